"""Request parsing, limits, admission, API keys, config files: no engine needed."""

from __future__ import annotations

import hmac

import pytest

from runtime.request import SamplingParams
from serving.admission import AdmissionQueue
from serving.auth import APIKeyChecker
from serving.config import ServerConfig, build_settings, load_yaml
from serving.errors import InvalidRequest, NotFound, Overloaded
from serving.openai_protocol import parse_chat, parse_completion
from serving.sse import DONE, event, parse_events

M = "m"


def completion(**kw):
    return parse_completion({"model": M, "prompt": "hi", **kw}, M)


def test_completion_defaults_and_extensions():
    r = completion()
    assert r.text == "hi" and r.params.max_tokens == 16 and r.params.temperature == 1.0 and not r.stream
    r = completion(prompt=[1, 2, 3], n=2, seed=7, stop="x", top_k=5, min_p=0.1, repetition_penalty=1.1,
                   stop_token_ids=[3], min_tokens=1, ignore_eos=True, priority=-1, cache_salt="s", logprobs=2,
                   stream=True, stream_options={"include_usage": True})
    assert r.token_ids == [1, 2, 3] and r.params.n == 2 and r.params.seed == 7 and r.params.stop == ["x"]
    assert (r.params.top_k, r.params.min_p, r.params.repetition_penalty) == (5, 0.1, 1.1)
    assert r.params.stop_token_ids == [3] and r.params.ignore_eos and r.priority == -1 and r.cache_salt == "s"
    assert r.params.logprobs == 2 and r.include_usage
    assert completion(prompt=["batch of one"]).text == "batch of one"
    assert completion(prompt=[[5, 6]]).token_ids == [5, 6] and completion(prompt=[[5, 6]]).prompts is None


def test_logit_bias_parsing():
    r = completion(logit_bias={"5": -100, "17": 2.5})
    assert r.params.logit_bias == {5: -100.0, 17: 2.5}
    assert completion(logit_bias={}).params.logit_bias is None and completion().params.logit_bias is None
    assert parse_chat({"model": M, "messages": [{"role": "user", "content": "x"}], "logit_bias": {"3": 1}},
                      M).params.logit_bias == {3: 1.0}


def test_completion_batch_of_prompts():
    r = completion(prompt=["a", [1, 2], "b"], n=2)
    assert r.prompts == ["a", [1, 2], "b"] and r.text is None and r.token_ids is None and r.params.n == 2
    for bad in (["a", []], ["a", [1, True]], [[1], ["x"]]):
        with pytest.raises(InvalidRequest, match=r"prompt\[1\]|prompt\[0\]") as e:
            completion(prompt=bad)
        assert e.value.param == "prompt"


@pytest.mark.parametrize("kw, param", [
    (dict(temperature=-1), "temperature"),
    (dict(temperature="hot"), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(n=0), "n"),
    (dict(n=True), "n"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(logprobs=-1), "logprobs"),
    (dict(presence_penalty=3), "presence_penalty"),
    (dict(stop=[""]), "stop"),
    (dict(stop=5), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(echo=True), "echo"),
    (dict(suffix="x"), "suffix"),
    (dict(logit_bias={"a": 2}), "logit_bias"),
    (dict(logit_bias={"-1": 2}), "logit_bias"),
    (dict(logit_bias={"1": 101}), "logit_bias"),
    (dict(logit_bias={"1": True}), "logit_bias"),
    (dict(logit_bias={"1" * 5000: 1}), "logit_bias"),  # int() refuses it: was a 500
    (dict(logit_bias=[1, 2]), "logit_bias"),
    (dict(logit_bias={str(i): 1 for i in range(33)}), "logit_bias"),
    (dict(best_of=3), "best_of"),
    (dict(prompt=["a", 5]), "prompt"),
    (dict(prompt=[1, "a"]), "prompt"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt=None), "prompt"),
    (dict(stream_options={"include_usage": True}), "stream_options"),
    (dict(seed=1.5), "seed"),
    (dict(echo=0), "echo"),  # not a boolean (0 == False passed as "not asked for")
    (dict(echo=[]), "echo"),
    (dict(temperature=10**400), "temperature"),  # past float's range: was an OverflowError, a 500
    (dict(response_format={"type": "json_object"}), "response_format"),  # was ignored on completions
    (dict(guided_json={"type": "object"}), "guided_json"),
    (dict(guided_json={}), "guided_json"),  # any JSON: still a constraint (empty tools/bad_words lists are none)
    (dict(guided_decoding_backend="xgrammar"), "guided_decoding_backend"),
    (dict(guided_choice=["a", "b"]), "guided_choice"),
    (dict(structured_outputs={"regex": "a+"}), "structured_outputs"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),  # ignored on completions before
    (dict(tool_choice="auto"), "tool_choice"),
])
def test_completion_bad_parameters_name_the_parameter(kw, param):
    with pytest.raises(InvalidRequest) as e:
        completion(**kw)
    assert e.value.param == param and e.value.status == 400
    assert e.value.envelope()["error"]["type"] == "invalid_request_error"


def test_cross_field_errors_come_from_sampling_params():
    with pytest.raises(InvalidRequest, match=r"min_tokens \(9\) must be <= max_tokens \(4\)") as e:
        completion(min_tokens=9, max_tokens=4)
    assert e.value.param == "min_tokens"
    completion(tools=[], bad_words=[])  # empty: nothing asked for


def test_model_checks():
    with pytest.raises(NotFound) as e:
        parse_completion({"model": "other", "prompt": "x"}, M)
    assert e.value.status == 404 and e.value.code == "model_not_found" and "'other'" in e.value.message
    for bad in ("", 5):
        with pytest.raises(InvalidRequest, match="model must be a non-empty string"):
            parse_completion({"model": bad, "prompt": "x"}, M)
    # left out or null: the served model, as vLLM reads it
    assert parse_completion({"prompt": "x"}, M).text == parse_completion({"model": None, "prompt": "x"}, M).text == "x"


def test_integral_floats_are_integers_as_pydantic_reads_them():
    r = completion(max_tokens=2.0, n=1.0, seed=7.0, logprobs=3.0)
    assert (r.params.max_tokens, r.params.n, r.params.seed, r.params.logprobs) == (2, 1, 7, 3)
    assert all(type(v) is int for v in (r.params.max_tokens, r.params.n, r.params.seed, r.params.logprobs))


def test_stream_options():
    """vLLM's defaults once stream_options is given: include_usage true, continuous_usage_stats false
    and only with include_usage (a lone continuous_usage_stats was refused, "as in vLLM")."""
    assert completion(stream=True).include_usage is False
    r = completion(stream=True, stream_options={})
    assert (r.include_usage, r.continuous_usage) == (True, False)
    for so, want in [({"include_usage": True, "continuous_usage_stats": True}, (True, True)),
                     ({"continuous_usage_stats": True}, (True, True)),
                     ({"include_usage": False, "continuous_usage_stats": True}, (False, False))]:
        r = completion(stream=True, stream_options=so)
        assert (r.include_usage, r.continuous_usage) == want, so
    with pytest.raises(InvalidRequest) as e:
        completion(stream=False, stream_options={})
    assert e.value.param == "stream_options"


def test_an_empty_cache_salt_is_refused():
    """As vLLM: "" is not "no salt", and as a salt of its own it would split the cache by mistake."""
    with pytest.raises(InvalidRequest, match="cache_salt must be a non-empty string") as e:
        completion(cache_salt="")
    assert e.value.param == "cache_salt"
    assert completion(cache_salt="t1").cache_salt == "t1" and completion().cache_salt is None


def test_chat_parsing():
    r = parse_chat({"model": M, "messages": [{"role": "user", "content": "hi"}]}, M)
    assert r.params.max_tokens is None and r.params.logprobs is None and r.kind == "chat"
    r = parse_chat({"model": M, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5,
                    "max_tokens": 9, "logprobs": True, "top_logprobs": 3}, M)
    assert r.params.max_tokens == 5 and r.params.logprobs == 3 and r.chat_logprobs
    assert r.max_tokens_param == "max_completion_tokens"
    r = parse_chat({"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9}, M)
    assert r.params.max_tokens == 9 and r.max_tokens_param == "max_tokens"
    assert parse_chat({"model": M, "messages": [{"role": "user", "content": "x"}], "logprobs": True}, M).params.logprobs == 0
    for bad, param in [({"top_logprobs": 2}, "top_logprobs"), ({"tools": [{"type": "function"}]}, "tools"),
                       ({"response_format": {"type": "json_object"}}, "response_format"), ({"messages": []}, "messages"),
                       ({"function_call": {"name": "f"}}, "function_call"), ({"guided_regex": "a+"}, "guided_regex"),
                       ({"echo": True}, "echo"), ({"suffix": "x"}, "suffix")]:  # (ignored on chat before)
        with pytest.raises(InvalidRequest) as e:
            parse_chat({"model": M, "messages": [{"role": "user", "content": "x"}], **bad}, M)
        assert e.value.param == param


def test_admission_counts_requests_and_tokens():
    q = AdmissionQueue(max_requests=2, max_tokens=100, retry_after_s=3)
    a = q.admit(60)
    with pytest.raises(Overloaded, match="60 prompt tokens waiting \\+ 50 exceeds max_waiting_tokens 100") as e:
        q.admit(50)
    assert e.value.status == 429 and e.value.headers() == {"Retry-After": "3"} and e.value.grpc_code.name == "RESOURCE_EXHAUSTED"
    b = q.admit(40)
    with pytest.raises(Overloaded, match="max_waiting_requests is 2"):
        q.admit(1)
    a.release()
    a.release()  # idempotent
    assert (q.waiting_requests, q.waiting_tokens) == (1, 40)
    b.release()
    big = q.admit(1000)  # alone, a request larger than the token bound is still admitted
    big.release()
    assert (q.waiting_requests, q.waiting_tokens, q.num_rejected) == (0, 0, 2)


def test_api_keys_use_compare_digest(monkeypatch):
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    k = APIKeyChecker(["k1", "k2"])
    assert k.check_authorization("Bearer k2") and k.check_authorization(None, "k1")
    assert not k.check_authorization("Bearer k3") and not k.check_authorization("k1") and not k.check_authorization(None)
    assert not k.check_authorization("Basic k1")
    assert calls and all(isinstance(a, bytes) for a, _ in calls)
    # Every key is compared, even after a match (no early exit).
    calls.clear()
    k.check_key("k1")
    assert len(calls) == 2
    assert APIKeyChecker([]).check_authorization(None)


def test_sse_roundtrip():
    raw = event({"a": "é"}) + event({"b": [1]}) + DONE
    assert raw.count(b"\n\n") == 3 and b"\\u00e9" in raw
    assert parse_events(raw) == [{"a": "é"}, {"b": [1]}, "[DONE]"]


def test_server_config_checks(tmp_path):
    with pytest.raises(ValueError, match="port must be None or an int in"):
        ServerConfig(port=70000)
    with pytest.raises(ValueError, match="needs both tls_certfile and tls_keyfile"):
        ServerConfig(tls_certfile=str(tmp_path / "c.pem"))
    with pytest.raises(ValueError, match="nothing would be served"):
        ServerConfig(port=None, grpc_port=None)
    with pytest.raises(ValueError, match="max_n must be an int >= 1"):
        ServerConfig(max_n=0)
    for name in ("retry_after_s", "drain_timeout_s", "health_stall_s", "status_interval_s"):
        for bad in (float("nan"), float("inf"), -1):  # (nan: a drain that never times out)
            with pytest.raises(ValueError, match=f"{name} must be a finite number >= 0"):
                ServerConfig(**{name: bad})
    assert ServerConfig().host == "127.0.0.1"  # loopback unless told otherwise
    t = tmp_path / "t.jinja"
    t.write_text("{{ messages }}")
    c = ServerConfig(chat_template=str(t))
    t.write_text("{{ changed }}")
    assert c.chat_template_text == "{{ messages }}"  # read once, at validation
    with pytest.raises(ValueError, match="is not a file"):
        ServerConfig(chat_template=str(tmp_path / "missing.jinja"))
    t.write_text("{% for m in messages %}{{ m.content }}")  # no endfor
    with pytest.raises(ValueError, match=r"chat template does not parse: .*endfor.* \(line 1\)"):
        ServerConfig(chat_template=str(t))
    with pytest.raises(ValueError, match="does not parse"):
        ServerConfig(chat_template="{{ messages[0].content }")


def test_yaml_settings_and_flag_precedence(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: m.gguf\nserver:\n  port: 9000\n  api_keys: secret\n  max_n: 4\n"
                   "engine:\n  max_num_seqs: 4\n  max_num_batched_tokens: 64\n  mesh: {tensor: 1}\n"
                   "  token_buckets: [16, 64]\n")
    data = load_yaml(cfg)
    s = build_settings(data, {"server": {"port": 9001}, "engine": {"max_model_len": 128}})
    assert s.model == "m.gguf" and s.server.port == 9001 and s.server.api_keys == ("secret",) and s.server.max_n == 4
    ec = s.engine_config()
    assert (ec.max_num_seqs, ec.max_model_len, ec.token_buckets, ec.mesh.tensor) == (4, 128, (16, 64), 1)
    bad = tmp_path / "bad.yaml"
    bad.write_text("server:\n  prot: 1\n")
    with pytest.raises(ValueError, match=r"unknown server settings \['prot'\]"):
        load_yaml(bad)
    bad.write_text("engine:\n  max_num_seq: 1\n")
    with pytest.raises(ValueError, match=r"unknown engine settings \['max_num_seq'\]"):
        load_yaml(bad)
    bad.write_text("models: x\n")
    with pytest.raises(ValueError, match="unknown top-level keys"):
        load_yaml(bad)
    bad.write_text("server:\n  port: [1\n")
    with pytest.raises(ValueError, match="not valid YAML") as e:
        load_yaml(bad)
    assert "\n" not in str(e.value)  # one line, as the CLI prints it
    with pytest.raises(FileNotFoundError, match="is a folder"):
        load_yaml(tmp_path)


def test_every_serve_flag_maps_to_a_config_key(tmp_path):
    import dataclasses

    from runtime.config import EngineConfig
    from serving import cli

    server_fields = {f.name for f in dataclasses.fields(ServerConfig)}
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    for flag, section, key, _ in cli._SERVE_FLAGS:
        root = key.split(".")[0]
        assert root in {"top": {"model", "tokenizer"}, "server": server_fields, "engine": engine_fields}[section], flag
    cfg = tmp_path / "c.yaml"
    cfg.write_text("server:\n  port: 9000\n  grpc_port: 9001\nengine:\n  mesh: {replica: 1}\n")
    args = cli.build_parser().parse_args(["serve", "--config", str(cfg), "--port", "7000", "--api-key", "a",
                                          "--api-key", "b", "--tensor", "1", "--replica", "2", "--no-prefix-caching",
                                          "--allowed-origin", "https://a.example"])
    s = cli._serve_settings(args)
    assert (s.server.port, s.server.grpc_port, s.server.api_keys) == (7000, 9001, ("a", "b"))
    assert s.server.allowed_origins == ("https://a.example",)
    assert s.engine["mesh"] == {"replica": 2, "tensor": 1} and s.engine["enable_prefix_caching"] is False
    assert s.engine_config().mesh.replica == 2


def test_serve_decodes_in_bursts_unless_told_otherwise(tmp_path):
    from serving import cli
    from serving.config import SERVE_DECODE_STEPS, ServeSettings

    assert SERVE_DECODE_STEPS == 4 and ServeSettings().engine_config().decode_steps == 4
    assert ServeSettings(engine={"decode_steps": 1}).engine_config().decode_steps == 1
    cfg = tmp_path / "c.yaml"
    cfg.write_text("engine:\n  decode_steps: 8\n")
    for argv, k in ((["serve"], 4), (["serve", "--config", str(cfg)], 8),
                    (["serve", "--config", str(cfg), "--decode-steps", "2"], 2)):
        assert cli._serve_settings(cli.build_parser().parse_args(argv)).engine_config().decode_steps == k, argv


def test_sampling_params_pass_through_unchanged():
    r = completion(temperature=0, max_tokens=3)
    assert r.params == SamplingParams(temperature=0.0, max_tokens=3)


@pytest.mark.parametrize("name", ["serve_cpu.yaml", "serve_example.yaml"])
def test_shipped_configs_load(name):
    from tests.testing.data import REPO_ROOT

    s = build_settings(load_yaml(REPO_ROOT / "configs" / name), {})
    assert s.server.host == "127.0.0.1"
    s.engine_config()  # every engine key is an EngineConfig field with a valid value


def test_allowed_origins_setting():
    assert ServerConfig(allowed_origins="*").allowed_origins == ("*",)  # (a YAML file's `allowed_origins: "*"`)
    assert ServerConfig(allowed_origins=["https://a.example"]).allowed_origins == ("https://a.example",)
    for bad in ([""], [5], 7):
        with pytest.raises(ValueError, match="allowed_origins must be a list of origins"):
            ServerConfig(allowed_origins=bad)
