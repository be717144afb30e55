"""The OpenAI-compatible HTTP server, driven by the official `openai` client, on stories260K."""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest

from serving.openai_protocol import TokenText
from tests.serving.conftest import MODEL_NAME, LiveServer, steps_held_until_cancel

openai = pytest.importorskip("openai")

# llama2.c's own greedy golden output for stories260K (see ../shared/data/README.md).
GOLDEN = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, "
          "she saw a big, red ball.")
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_completion_greedy_follows_the_golden_text(client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0)
    c = r.choices[0]
    assert GOLDEN.startswith(PROMPT + c.text) and len(c.text) > 20
    assert c.finish_reason == "length" and c.index == 0
    assert r.object == "text_completion" and r.model == MODEL_NAME and r.id.startswith("cmpl-")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 16, 21)
    # Token ids as the prompt give the same text.
    ids = httpx.post(f"{client.base_url.scheme}://{client.base_url.host}:{client.base_url.port}/tokenize",
                     json={"prompt": PROMPT}).json()["tokens"]
    assert len(ids) == 5 and ids[0] == 1
    r2 = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=16, temperature=0)
    assert r2.choices[0].text == c.text


@pytest.mark.parametrize("include_usage", [False, True])
def test_completion_stream(client, include_usage):
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    kw = dict(stream_options={"include_usage": True}) if include_usage else {}
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True, **kw))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    if include_usage:
        assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 12
        assert chunks[-1].usage.prompt_tokens == 5
        assert all(c.usage is None for c in chunks[:-1])
    else:
        assert all(c.choices and getattr(c, "usage", None) is None for c in chunks)
    # vLLM's stop_reason on every choice: null where no stop string or stop token id ended it
    assert all(c.choices[0].model_extra["stop_reason"] is None for c in text_chunks)
    assert whole.choices[0].model_extra["stop_reason"] is None


def test_continuous_usage_stats(client):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far."""
    for chat in (False, True):
        create, kw = ((client.chat.completions.create, dict(messages=[{"role": "user", "content": "A story"}]))
                      if chat else (client.completions.create, dict(prompt=PROMPT)))
        chunks = list(create(model=MODEL_NAME, max_tokens=6, temperature=0, stream=True, **kw,
                             stream_options={"include_usage": True, "continuous_usage_stats": True}))
        assert all(c.usage is not None for c in chunks) and not chunks[-1].choices
        text = [c for c in chunks if c.choices and (c.choices[0].delta.content if chat else c.choices[0].text)]
        assert [c.usage.completion_tokens for c in text] == list(range(1, 7))
        assert len({c.usage.prompt_tokens for c in chunks}) == 1 and chunks[-1].usage.completion_tokens == 6
        alone = list(create(model=MODEL_NAME, max_tokens=2, temperature=0, stream=True, **kw,
                            stream_options={"continuous_usage_stats": True}))  # (include_usage true by default)
        assert all(c.usage is not None for c in alone) and alone[-1].usage.completion_tokens == 2


def test_stream_ends_with_done(server):
    with httpx.stream("POST", server.base_url + "/completions", timeout=60,
                      json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_bytes())
    assert raw.endswith(b"data: [DONE]\n\n") and raw.count(b"data: ") == 4


def test_chat(client, server):
    msgs = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "A story about a cat"}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=10, temperature=0)
    m = r.choices[0].message
    assert m.role == "assistant" and isinstance(m.content, str) and m.content
    assert r.object == "chat.completion" and r.choices[0].finish_reason == "length"
    rendered = "<s>system: You tell stories.\nuser: A story about a cat\nassistant:"
    n_prompt = len(server.engine.tokenizer.encode(rendered, add_special_tokens=False))
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == m.content
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.prompt_tokens == n_prompt


def test_n2_and_seeds(client):
    def run(seed, n=2):
        r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=1.5, n=n, seed=seed)
        assert sorted(c.index for c in r.choices) == list(range(n))
        assert r.usage.completion_tokens == sum(16 if c.finish_reason == "length" else 0 for c in r.choices) or \
            any(c.finish_reason == "stop" for c in r.choices)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    a = run(123)
    assert run(123) == a  # same seed, same samples
    assert any(run(s) != a for s in (1, 2, 3, 4))
    # Streaming n=2 carries both indices and each finishes once.
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=1.5, n=2,
                                            seed=5, stream=True))
    finished = [c.choices[0].index for c in chunks if c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1]
    texts = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in (0, 1)]
    assert texts == run(5)  # same seed, same samples, streamed or not


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert v <= 0 and len(top) == 3
        assert max(top.values()) == pytest.approx(v, abs=1e-5)  # greedy: the chosen token is the most likely
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    # sampled, the top entries hold the sampled token too (OpenAI: up to logprobs + 1), also at logprobs=0
    for k in (0, 1):
        hot = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=1.8, seed=5,
                                        logprobs=k).choices[0].logprobs
        for tok, v, top in zip(hot.tokens, hot.token_logprobs, hot.top_logprobs):
            assert top[tok] == v and k <= len(top) <= k + 1
        assert any(len(top) == k + 1 for top in hot.top_logprobs)  # a token outside the top k was sampled
    stream = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                            stream=True))
    assert [t for c in stream for t in c.choices[0].logprobs.tokens] == lp.tokens


def test_chat_logprobs(client):
    msgs = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert all(bytes(t.bytes).decode() == t.token for t in content if t.bytes is not None)
    r = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=3, logprobs=True)
    assert all(t.top_logprobs == [] for t in r.choices[0].logprobs.content)


def test_stop_string(client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=30, temperature=0, stop=[" little"])
    assert r.choices[0].text == ", there was a" and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == " little"
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=30, temperature=0,
                                            stop=" little", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ", there was a"
    for stream in (False, True):  # vLLM's include_stop_str_in_output keeps it
        r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=30, temperature=0, stop=" little",
                                      stream=stream, extra_body={"include_stop_str_in_output": True})
        text = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
        assert text == ", there was a little"


def test_logit_bias(client, server):
    """+100 on one token id makes it every greedy token; -100 on the greedy next token moves the
    continuation off it. Streamed and whole agree."""
    text_of = TokenText(server.engine.tokenizer)
    args = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0,
                logit_bias={"400": 100}, extra_body={"ignore_eos": True})
    r = client.completions.create(**args)
    assert r.choices[0].logprobs.tokens == [text_of(400)] * 6 and r.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    first = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, temperature=0,
                                      logprobs=0).choices[0].logprobs.tokens[0]
    first_ids = [i for i in range(512) if text_of(i) == first]
    banned = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0,
                                       logit_bias={str(i): -100 for i in first_ids})
    assert first_ids and banned.choices[0].logprobs.tokens[0] != first


def test_prompt_with_a_lone_surrogate(server):
    # JSON may escape one half of a surrogate pair alone ("\\ud800"); no UTF-8 text has it
    body = '{"model": "%s", "prompt": "bad \\ud800", "max_tokens": 2}' % MODEL_NAME
    r = httpx.post(server.http_url + "/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "prompt: text is not valid Unicode" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "prompt"


def test_skip_special_tokens(client, server):
    """vLLM's skip_special_tokens: false keeps special tokens (EOS here, forced) in the text."""
    args = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0, logit_bias={"2": 100})
    for skip in (True, False):
        r = client.completions.create(**args, extra_body={"ignore_eos": True, "skip_special_tokens": skip})
        assert r.choices[0].text == server.engine.tokenizer.decode([2, 2, 2], skip_special_tokens=skip)
        assert bool(r.choices[0].text) is not skip
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**args, extra_body={"skip_special_tokens": "no"})
    assert "skip_special_tokens" in str(e.value)


def test_completion_batch_of_prompts(client, server):
    """A list of prompts is one request: choice i * n + j is sample j of prompt i, each the text the
    prompt gets alone; usage adds the prompts up; the stream carries the same texts."""
    other = "The cat sat"
    ids = httpx.post(server.http_url + "/tokenize", json={"prompt": other}).json()["tokens"]
    alone = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=8, temperature=0).choices[0].text
             for p in (PROMPT, other)]
    assert alone[0] != alone[1]
    args = dict(model=MODEL_NAME, prompt=[PROMPT, ids], max_tokens=8, temperature=0, n=2)
    r = client.completions.create(**args)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [alone[0], alone[0], alone[1], alone[1]]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (5 + len(ids), 4 * 8)
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert texts == {c.index: c.text for c in r.choices}
    assert sorted(ch.index for c in chunks for ch in c.choices if ch.finish_reason) == [0, 1, 2, 3]
    assert not chunks[-1].choices and (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == \
        (5 + len(ids), 4 * 8)


def test_completion_batch_refused_whole(client, server):
    """Too many sequences in all, or one bad prompt: a 400 naming it, and nothing left running (the
    prompts submitted before the bad one are cancelled)."""
    with pytest.raises(openai.BadRequestError, match=r"the 9 prompts ask for 18 sequences in all .* max_n is 16"):
        client.completions.create(model=MODEL_NAME, prompt=[PROMPT] * 9, n=2, max_tokens=4)
    core = server.core

    def prompt_tokens():
        return core.metrics.registry.get_sample_value("xlaserve:prompt_tokens_total", {"model_name": MODEL_NAME})

    aborted, invalid, before = finished_count(core, "abort"), failed_count(core, "invalid"), prompt_tokens()
    with pytest.raises(openai.BadRequestError, match="token id 600 is out of range"):
        client.completions.create(model=MODEL_NAME, prompt=[PROMPT, [600]], max_tokens=200,
                                  extra_body={"ignore_eos": True})
    server.call(core.wait_idle(), timeout=30)
    # every prompt is checked before any runs: one failed request, nothing started or counted as finished
    assert core.in_flight == 0 and finished_count(core, "abort") == aborted
    assert failed_count(core, "invalid") == invalid + 1 and prompt_tokens() == before


@pytest.mark.parametrize("kw, exc, needle", [
    (dict(model="gpt-4"), "NotFoundError", "'gpt-4' does not exist"),
    (dict(temperature=-1), "BadRequestError", "temperature"),
    (dict(max_tokens=1000), "BadRequestError", "max_model_len is 256"),
    (dict(prompt=[5] * 300), "BadRequestError", "prompt has 300 tokens; max_model_len is 256"),
    (dict(n=17), "BadRequestError", "n is 17; max_n is 16"),
    (dict(logprobs=21), "BadRequestError", "logprobs is 21; max_logprobs is 20"),
    (dict(stop=[str(i) for i in range(17)]), "BadRequestError", "max_stop is 16"),
    (dict(prompt=[600]), "BadRequestError", "token id 600 is out of range"),
    (dict(logit_bias={"600": 1}), "BadRequestError", "logit_bias token id 600 is out of range"),
    (dict(echo=True), "BadRequestError", "echo"),
])
def test_errors(client, kw, exc, needle):
    args = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=4)
    args.update(kw)
    with pytest.raises(getattr(openai, exc)) as e:
        client.completions.create(**args)
    assert needle in e.value.message
    assert set(e.value.body) == {"message", "type", "param", "code"}
    assert e.value.type == ("not_found_error" if exc == "NotFoundError" else "invalid_request_error")


@pytest.mark.parametrize("kw, param, needle", [
    (dict(temperature=1e300), "temperature", "within float32's range"),
    (dict(extra_body={"min_tokens": 5}), "min_tokens", "min_tokens (5) must be <= max_tokens (4)"),
    (dict(max_tokens=None, extra_body={"min_tokens": 300}), "min_tokens", "min_tokens 300 is more than the"),
    # the field the client sent (it was named max_tokens, which this request does not hold)
    (dict(max_tokens=None, max_completion_tokens=1000), "max_completion_tokens", "+ max_completion_tokens 1000 ="),
    (dict(max_tokens=1000), "max_tokens", "+ max_tokens 1000 ="),
])
def test_errors_name_their_parameter(client, kw, param, needle):
    """SamplingParams' own checks and the room left for min_tokens name the parameter, not the
    request's internal id."""
    args = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], max_tokens=4)
    args.update(kw)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**args)
    assert needle in e.value.message and e.value.body["param"] == param and "chatcmpl-" not in e.value.message


def test_http_level_errors(server):
    url = server.base_url + "/completions"
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(url, content=b"[1]")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    big = json.dumps({"model": MODEL_NAME, "prompt": "x" * (server.config.max_body_bytes + 1)})
    r = httpx.post(url, content=big)
    assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]["message"]
    r = httpx.get(server.base_url + "/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(url)
    assert r.status_code == 405 and "error" in r.json() and r.headers["allow"] == "POST"
    for body, param in (({"messages": None}, "prompt"), ({"messages": "hi"}, "messages"), ({"prompt": 5}, "prompt"),
                        ({"prompt": None, "messages": []}, "messages")):
        r = httpx.post(server.http_url + "/tokenize", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_an_unexpected_error_is_a_500_answered_like_any_response(server, monkeypatch, caplog):
    """Not re-raised to the server after the answer (Starlette's Exception handler does), which
    would close the connection and drop a request the client had already sent on it."""
    async def broken(**kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(server.core, "tokenize", broken)
    sent, messages = [], [{"type": "http.request", "body": b'{"prompt": "x"}', "more_body": False}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/tokenize", "raw_path": b"/tokenize", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 9), "server": ("127.0.0.1", 80)}
    with caplog.at_level(logging.ERROR, logger="xlaserve.http"):
        server.call(server.app.app(scope, receive, send))  # returns: nothing is raised to uvicorn
    assert sent[0]["status"] == 500
    assert json.loads(sent[1]["body"])["error"] == {"message": "internal error: RuntimeError('boom')",
                                                    "type": "server_error", "param": None, "code": None}
    assert "unhandled error on /tokenize" in caplog.text


def test_malformed_bodies_are_400s_and_counted(server):
    """JSON that parses in no Python object (too deep, an integer of over 4,300 digits) and numbers
    past float's range were 500s; every 400 before the engine is counted as an invalid request."""
    url, label = server.base_url + "/completions", f'model_name="{MODEL_NAME}"'
    key = f'xlaserve:request_failure_total{{{label},reason="invalid"}}'

    def invalid() -> float:
        text = httpx.get(server.http_url + "/metrics").text
        return next((float(x.split(" ")[1]) for x in text.splitlines() if x.startswith(key + " ")), 0.0)

    before = invalid()
    bodies = [b"[" * 100_000 + b"]" * 100_000, b'{"model": "m", "max_tokens": ' + b"9" * 5000 + b"}",
              json.dumps({"model": MODEL_NAME, "prompt": PROMPT, "temperature": 10**400}).encode(),
              json.dumps({"model": "other", "prompt": PROMPT}).encode(), b"{not json"]
    for body in bodies:
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
        assert r.status_code in (400, 404) and r.json()["error"]["type"] != "server_error", (body[:40], r.text)
    assert invalid() == before + len(bodies)


def test_a_client_gone_while_sending_its_body_is_not_an_error(server, caplog):
    sent, messages = [], [{"type": "http.request", "body": b'{"model": ', "more_body": True},
                          {"type": "http.disconnect"}]

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 9), "server": ("127.0.0.1", 80)}
    server.call(server.app.app(scope, receive, send))
    assert sent[0]["status"] == 499
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_chat_errors(client):
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "robot", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="tool calling"):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    with pytest.raises(openai.BadRequestError, match="top_logprobs is 21; max_logprobs is 20") as e:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                       logprobs=True, top_logprobs=21)
    assert e.value.body["param"] == "top_logprobs"


def test_chat_rendering_options(client, server):
    """vLLM's continue_final_message, add_generation_prompt and chat_template_kwargs shape the
    prompt (usage and /tokenize count the same tokens); a request's own template is refused."""
    tok = server.engine.tokenizer
    msgs = [{"role": "user", "content": "A story"}, {"role": "assistant", "content": "Once upon a"}]
    for body, rendered in (({"continue_final_message": True}, "<s>user: A story\nassistant: Once upon a"),
                           ({"continue_final_message": True, "add_generation_prompt": False},
                            "<s>user: A story\nassistant: Once upon a"),
                           ({"add_generation_prompt": False}, "<s>user: A story\nassistant: Once upon a\n"),
                           ({"chat_template_kwargs": {"enable_thinking": False}},
                            "<s>user: A story\nassistant: Once upon a\nassistant:")):
        want = tok.encode(rendered, add_special_tokens=False)
        got = httpx.post(server.http_url + "/tokenize", json={"messages": msgs, **body}).json()["tokens"]
        assert got == want, body
        r = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=3, temperature=0, extra_body=body)
        assert r.usage.prompt_tokens == len(want)
    for body, needle in (({"continue_final_message": True, "add_generation_prompt": True}, "cannot both be true"),
                         ({"chat_template": "{{ messages }}"}, "start the server with --chat-template"),
                         ({"chat_template_kwargs": {"messages": []}}, "may not set messages"),
                         ({"chat_template_kwargs": [1]}, "must be an object")):
        with pytest.raises(openai.BadRequestError, match=needle):
            client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=3, extra_body=body)
    # an empty final message is continued, as transformers continues it
    empty = msgs[:1] + [{"role": "assistant", "content": ""}]
    got = httpx.post(server.http_url + "/tokenize", json={"messages": empty, "continue_final_message": True}).json()
    assert got["tokens"] == tok.encode("<s>user: A story\nassistant: ", add_special_tokens=False)


def test_chat_content_parts(server):
    """Text parts are joined one a line, as vLLM joins them; an assistant's refusal part (OpenAI's
    replayed refusals) reads as its text; other parts are refused."""
    tok = server.engine.tokenizer

    def tokens(msgs):
        r = httpx.post(server.http_url + "/tokenize", json={"messages": msgs})
        return r.status_code, r.json()

    parts = [{"type": "text", "text": "A story"}, {"type": "text", "text": "about a cat"}]
    assert tokens([{"role": "user", "content": parts}])[1]["tokens"] == tokens(
        [{"role": "user", "content": "A story\nabout a cat"}])[1]["tokens"]
    refused = [{"role": "user", "content": "x"},
               {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]}]
    assert tokens(refused)[1]["tokens"] == tok.encode("<s>user: x\nassistant: I can't.\nassistant:",
                                                        add_special_tokens=False)
    for msgs in ([{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}],
                 [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                 [{"role": "assistant", "content": [{"type": "refusal", "text": "no"}]}]):
        status, body = tokens(msgs)
        assert status == 400 and "only text parts" in body["error"]["message"], msgs


@pytest.mark.parametrize("field, value", [("prompt_logprobs", 1), ("allowed_token_ids", [5]), ("bad_words", ["a"]),
                                          ("truncate_prompt_tokens", 8), ("use_beam_search", True),
                                          ("detokenize", False), ("return_tokens_as_token_ids", True),
                                          ("spaces_between_special_tokens", False)])
def test_vllm_fields_that_would_be_ignored_are_refused(client, field, value):
    for create, kw in ((client.completions.create, {"prompt": PROMPT}),
                       (client.chat.completions.create, {"messages": [{"role": "user", "content": "x"}]})):
        with pytest.raises(openai.BadRequestError, match=f"{field} is not supported") as e:
            create(model=MODEL_NAME, max_tokens=2, extra_body={field: value}, **kw)
        assert e.value.body["param"] == field
        create(model=MODEL_NAME, max_tokens=2, extra_body={field: None}, **kw)  # (null: the default)


def test_chat_template_kwargs_reach_the_template(engine):
    from runtime.async_engine import AsyncEngine
    from serving.config import ServerConfig
    from serving.core import ChatOptions, ServingCore

    core = ServingCore(ServerConfig(), MODEL_NAME)
    core.attach(AsyncEngine(engine, start=False), tokenizer=engine.tokenizer,
                chat_template="{{ messages[0].content }}{% if shout %}!{% endif %}")
    msgs = [{"role": "user", "content": "x"}]
    assert core.render_chat(msgs) == "x"
    assert core.render_chat(msgs, ChatOptions(template_kwargs={"shout": True})) == "x!"


def test_a_template_that_loops_over_content_parts_gets_parts(engine):
    """vLLM's content formats: a template that iterates over a message's content gets text parts (a
    string content becoming one); joined into a string, its loop read characters and the text was lost."""
    from runtime.async_engine import AsyncEngine
    from serving.config import ServerConfig
    from serving.core import ServingCore

    core = ServingCore(ServerConfig(), MODEL_NAME)
    core.attach(AsyncEngine(engine, start=False), tokenizer=engine.tokenizer,
                chat_template="{% for m in messages %}{{ m['role'] }}:{% for p in m['content'] %}[{{ p['text'] }}]"
                              "{% endfor %} {% endfor %}")
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "refusal", "refusal": "b"}]}]
    assert core.render_chat(msgs) == "user:[hi] assistant:[a][b] "
    # the keys stay in the client's order, as transformers passes them (content was moved last)
    core.attach(AsyncEngine(engine, start=False), tokenizer=engine.tokenizer, chat_template="{{ messages[0] | tojson }}")
    assert core.render_chat([{"content": "x", "role": "user", "name": "n"}]) == '{"content": "x", "role": "user", "name": "n"}'


def test_a_model_chat_template_that_does_not_parse_refuses_chat_alone(engine):
    """A model's own template with a syntax error is found at attach: chat is refused with the
    parse error and the way out, completions still work; a --chat-template replaces it."""
    import copy

    from runtime.async_engine import AsyncEngine
    from serving.config import ServerConfig
    from serving.core import ServingCore
    from serving.errors import InvalidRequest

    tok = copy.copy(engine.tokenizer)
    tok._chat_templates = {"default": "{% for m in messages %}{{ m.content }}"}  # no endfor
    core = ServingCore(ServerConfig(), MODEL_NAME)
    core.attach(AsyncEngine(engine, start=False), tokenizer=tok)
    assert not core.model_info.has_chat_template
    with pytest.raises(InvalidRequest, match=r"does not parse: .*endfor.*\(line 1\); .*--chat-template"):
        core.render_chat([{"role": "user", "content": "x"}])
    core.attach(AsyncEngine(engine, start=False), tokenizer=tok, chat_template="{{ bos_token }}{{ messages[0].content }}!")
    assert core.model_info.has_chat_template
    assert core.render_chat([{"role": "user", "content": "x"}]) == tok.id_to_piece(tok.bos_id) + "x!"


def test_health_and_metrics(server, client):
    assert httpx.get(server.http_url + "/health").json() == {"status": "ok"}
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0)
    with pytest.raises(openai.BadRequestError):  # over max_model_len: counted as an invalid request
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=100_000, temperature=0)
    text = httpx.get(server.http_url + "/metrics").text
    label = f'model_name="{MODEL_NAME}"'
    for name in ("time_to_first_token_seconds_count", "request_time_per_output_token_seconds_count",
                 "e2e_request_latency_seconds_count", "inter_token_latency_seconds_count", "prompt_tokens_total",
                 "generation_tokens_total", "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total"):
        assert f"xlaserve:{name}{{{label}}}" in text, name
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line.startswith("xlaserve:")}
    assert values[f"xlaserve:time_to_first_token_seconds_count{{{label}}}"] >= 1
    assert values[f'xlaserve:request_success_total{{finished_reason="length",{label}}}'] >= 1
    assert values[f'xlaserve:request_failure_total{{{label},reason="invalid"}}'] >= 1
    assert values[f"xlaserve:compiles_after_warmup_total{{{label}}}"] == 0


def test_inter_token_latency_counts_each_sequences_gaps(server, client):
    """n sequences of k tokens: n * (k - 1) gaps, none between tokens of different sequences."""
    def count():
        return server.core.metrics.registry.get_sample_value("xlaserve:inter_token_latency_seconds_count",
                                                            {"model_name": MODEL_NAME}) or 0.0

    before = count()
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, n=3, temperature=1.0, seed=1,
                                  extra_body={"ignore_eos": True})
    assert all(c.finish_reason == "length" for c in r.choices) and r.usage.completion_tokens == 15
    assert count() - before == 3 * 4


def test_connections_send_without_waiting_for_acks(server):
    """Nagle is off on the HTTP connections: a kept-alive connection's requests do not wait ~40 ms
    for the client's delayed ACK before a response's second write (the body after the headers,
    a stream's first event), which they all did while the listening socket's proto was 0."""
    import socket
    import statistics
    import time

    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    with httpx.Client(timeout=60) as c:
        walls = []
        for _ in range(6):
            t0 = time.perf_counter()
            assert c.post(server.base_url + "/completions", json=body).status_code == 200
            walls.append(time.perf_counter() - t0)

        async def nodelay():
            return [p.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                    for p in server.app._http.server_state.connections]

        flags = server.call(nodelay())
    assert flags and all(flags), flags
    assert statistics.median(walls[1:]) < 0.030, walls  # with Nagle on: >= 40 ms each


def finished_count(core, reason: str) -> float:
    v = core.metrics.registry.get_sample_value("xlaserve:request_success_total",
                                               {"model_name": MODEL_NAME, "finished_reason": reason})
    return v or 0.0


def failed_count(core, reason: str) -> float:
    v = core.metrics.registry.get_sample_value("xlaserve:request_failure_total",
                                               {"model_name": MODEL_NAME, "reason": reason})
    return v or 0.0


def test_disconnect_cancels_the_request(server):
    aborted = finished_count(server.core, "abort")
    with httpx.stream("POST", server.base_url + "/completions", timeout=60,
                      json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 240, "stream": True,
                            "ignore_eos": True}) as r:
        it = r.iter_lines()
        assert next(it).startswith("data: ")
        with steps_held_until_cancel(server):  # the rest cannot be generated before the server notices
            r.close()
    # The stream was dropped after one chunk: the engine aborts the request (not 240 tokens later).
    server.call(server.core.wait_idle(), timeout=30)
    assert server.core.in_flight == 0
    assert finished_count(server.core, "abort") == aborted + 1


def test_non_streaming_disconnect_cancels_the_request(server, caplog):
    """A client that gives up on a non-streaming answer: the server cancels its request (held steps:
    it cannot finish first, as it once did in under the client's 0.3 s), quietly (it logged an
    "unhandled error" for each, reading the result of a task it had only asked to cancel)."""
    aborted = finished_count(server.core, "abort")
    with steps_held_until_cancel(server), pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/completions", timeout=0.3,
                   json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 250 - 5, "ignore_eos": True})
    server.call(server.core.wait_idle(), timeout=30)
    assert finished_count(server.core, "abort") == aborted + 1
    time.sleep(0.2)  # (the handler's last lines run after the abort)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_api_keys(engine):
    s = LiveServer(engine, api_keys=("sekrit",)).start()
    try:
        bad = openai.OpenAI(base_url=s.base_url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
        assert e.value.status_code == 401 and e.value.type == "authentication_error"
        good = openai.OpenAI(base_url=s.base_url, api_key="sekrit", max_retries=0)
        assert good.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2).choices[0].text
        assert httpx.get(s.http_url + "/health").status_code == 200  # health needs no key
        r = httpx.get(s.http_url + "/metrics")
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer ")  # (RFC 9110)
        assert httpx.get(s.http_url + "/metrics", headers={"Authorization": "Bearer sekrit"}).status_code == 200
        assert httpx.get(s.base_url + "/models", headers={"X-API-Key": "sekrit"}).status_code == 200
    finally:
        s.stop()


def test_cors_only_for_allowed_origins(engine, server):
    """--allowed-origin: browser preflights are answered and every response (a 401 too) carries the
    CORS headers for that origin; without it no origin is answered (the default)."""
    pre = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(server.base_url + "/chat/completions", headers=pre)
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    s = LiveServer(engine, api_keys=("sekrit",), allowed_origins=("https://app.example",)).start()
    try:
        r = httpx.options(s.base_url + "/chat/completions", headers=pre)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in r.headers["access-control-allow-methods"]
        r = httpx.get(s.base_url + "/models", headers={"Origin": "https://app.example"})  # no key: 401
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = httpx.get(s.base_url + "/models", headers={"Origin": "https://app.example", "X-API-Key": "sekrit"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = httpx.options(s.base_url + "/chat/completions", headers={**pre, "Origin": "https://evil.example"})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    finally:
        s.stop()


def test_client_request_ids(server):
    """vLLM's: the X-Request-Id header (else the body's request_id) names the response (`cmpl-<id>`)
    and comes back in the header; a reused id does not clash with a live one; a bad one is a 400."""
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2}
    r = httpx.post(server.base_url + "/completions", json=body, headers={"X-Request-Id": "trace-7"}, timeout=60)
    assert r.json()["id"] == "cmpl-trace-7" and r.headers["x-request-id"] == "trace-7"
    r = httpx.post(server.base_url + "/chat/completions", timeout=60,
                   json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                         "request_id": "from-body"})
    assert r.json()["id"] == "chatcmpl-from-body" and r.headers["x-request-id"] == "from-body"
    r = httpx.post(server.base_url + "/completions", json=body, timeout=60)  # none: a random one, sent back
    assert r.headers["x-request-id"] == r.json()["id"] and r.json()["id"].startswith("cmpl-")
    with httpx.stream("POST", server.base_url + "/completions", json={**body, "stream": True, "max_tokens": 30},
                      headers={"X-Request-Id": "same"}, timeout=60) as first:
        assert first.headers["x-request-id"] == "same"
        again = httpx.post(server.base_url + "/completions", json=body, headers={"X-Request-Id": "same"}, timeout=60)
        assert again.status_code == 200 and again.json()["id"] == "cmpl-same"
        first.read()
    r = httpx.post(server.base_url + "/completions", json=body, headers={"X-Request-Id": "has space"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id" and "x-request-id" not in r.headers
    r = httpx.post(server.base_url + "/completions", json={**body, "max_tokens": 10**6},
                   headers={"X-Request-Id": "failed-9"}, timeout=60)  # an error echoes the client's id too
    assert r.status_code == 400 and r.headers["x-request-id"] == "failed-9"
