"""The offline LLM API on the real stories260K with its tokenizer: prompt forms, text, EOS, stop
strings (matched through the incremental detokenizer, held back while streaming), logprobs, n.
This model ends stories with BOS, never with its EOS: like llama2.c's run.c, generation stops there
(test_story_ends_at_bos). EOS handling in general is tested in test_engine.py."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from runtime.engine import frozen_heap
from runtime.llm import LLM, RequestOutput, SamplingParams
from tests.testing.engine import STORY_PROMPTS as PROMPTS


def test_prompt_forms_and_text(llm):
    tok = llm.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=24)
    outs = llm.generate(PROMPTS, params)
    assert [o.prompt for o in outs] == PROMPTS
    assert [o.prompt_token_ids for o in outs] == [tok.encode(p) for p in PROMPTS]
    for o in outs:
        c = o.outputs[0]
        assert o.finished and c.finish_reason in ("stop", "length")
        # The text continues the prompt's ("▁was" after "time" is " was"), as a streamed decode.
        full = tok.decode(o.prompt_token_ids + c.token_ids)
        assert c.text and c.text == full[len(tok.decode(o.prompt_token_ids)):]
        assert c.finish_reason == "length" and len(c.token_ids) == 24 or c.token_ids[-1] in tok.eos_ids
    single = llm.generate(PROMPTS[2], params)
    ids = llm.generate(tok.encode(PROMPTS[2]), params)
    many_ids = llm.generate([tok.encode(p) for p in PROMPTS[:2]], params)
    assert single[0].outputs[0].token_ids == ids[0].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert ids[0].prompt is None
    assert [o.outputs[0].token_ids for o in many_ids] == [o.outputs[0].token_ids for o in outs[:2]]
    llm.engine.check_invariants()


def test_story_ends_at_bos(llm):
    # Greedy, this prompt's story ends after 175 tokens with BOS (found with ignore_eos); run.c would
    # stop there, and so do we, with the stop token last, as for any EOS.
    prompt = "They all lived happily ever after."
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))[0].outputs[0]
    end = free.token_ids.index(1)
    assert 0 < end < 199 and 2 not in free.token_ids[:end]
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=200))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: end + 1]
    tok, prompt_ids = llm.tokenizer, llm.tokenizer.encode(prompt)
    assert out.text == tok.decode(prompt_ids + free.token_ids[:end])[len(tok.decode(prompt_ids)):]
    assert out.text and len(out.text) < len(free.text)


def test_stop_string_truncates_text_and_streams_held_back(llm):
    base = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=40))[0].outputs[0]
    words = base.text.split()
    stop = " ".join(words[3:5])  # two words from the middle, spanning tokens
    cut = base.text.index(stop)
    engine = llm.engine
    rid = engine.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=40, stop=[stop, "zzzz"]))
    streamed, final = "", None
    while engine.has_unfinished():
        for o in engine.step():
            streamed += o.outputs[0].new_text
            assert stop not in o.outputs[0].text
            final = o
    c = final.outputs[0]
    assert final.request_id == rid and c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == streamed == base.text[:cut]
    assert c.token_ids == base.token_ids[: len(c.token_ids)] and len(c.token_ids) < len(base.token_ids)
    assert stop in llm.tokenizer.decode(c.token_ids)  # the ids keep the token that completed it
    engine.check_invariants()


def test_stop_strings_wait_for_min_tokens(llm):
    """As stop token ids are banned until min_tokens, a stop string ends a sequence only from the
    token after min_tokens on (vLLM's rule): an earlier match is passed over."""
    tok = llm.tokenizer
    base = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))[0].outputs[0]
    prompt_ids = tok.encode(PROMPTS[0])

    def text_of(k):  # the output text of the first k tokens, as the engine streams it
        return tok.decode(prompt_ids + base.token_ids[:k])[len(tok.decode(prompt_ids)):]

    first = base.text.index(",")
    k = next(k for k in range(1, 60) if len(text_of(k)) > first)  # the token that writes the first ","
    later = base.text.index(",", len(text_of(k)))
    for min_tokens, cut in ((0, first), (k - 1, first), (k, later)):
        c = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, stop=[","],
                                                    min_tokens=min_tokens))[0].outputs[0]
        assert (c.text, c.finish_reason, c.stop_reason) == (base.text[:cut], "stop", ","), min_tokens
        assert len(c.token_ids) > min_tokens
    llm.engine.check_invariants()


def test_the_text_ends_before_what_stopped_it(llm):
    """As in vLLM: the text leaves out the stop token's text (its id stays in token_ids) and the
    stop string; include_stop_str_in_output keeps both, and then nothing is held back while
    streaming."""
    tok = llm.tokenizer
    prompt_ids = tok.encode(PROMPTS[0])
    base = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0].outputs[0]

    def text_of(k):  # the output text of the first k tokens
        return tok.decode(prompt_ids + base.token_ids[:k])[len(tok.decode(prompt_ids)):]

    j = next(j for j in range(3, 40) if base.token_ids[j] not in base.token_ids[:j] and text_of(j + 1) != text_of(j))
    t = base.token_ids[j]
    for include in (False, True):
        c = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[t],
                                                    include_stop_str_in_output=include))[0].outputs[0]
        assert (c.token_ids, c.finish_reason, c.stop_reason) == (base.token_ids[: j + 1], "stop", t)
        assert c.text == text_of(j + 1 if include else j)
    stop = " ".join(base.text.split()[3:5])
    end = base.text.index(stop) + len(stop)
    engine = llm.engine
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=40, stop=[stop],
                                                  include_stop_str_in_output=True))
    streamed, final = "", None
    while engine.has_unfinished():
        for o in engine.step():
            c = o.outputs[0]
            streamed += c.new_text
            if not o.finished:  # nothing held back: the text of every token so far
                assert c.text == text_of(len(c.token_ids))
            final = o
    c = final.outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (base.text[:end], "stop", stop) and streamed == c.text
    engine.check_invariants()


def test_the_stop_string_that_ends_first_wins_however_the_text_was_tokenized(llm):
    """Two stop strings completed by one token: the one a character-at-a-time stream would meet
    first (the earliest end) cuts the text, whichever is listed first and wherever each starts."""
    tok = llm.tokenizer
    prompt_ids = tok.encode(PROMPTS[0])
    base = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0].outputs[0]

    def text_of(k):  # the output text of the first k tokens
        return tok.decode(prompt_ids + base.token_ids[:k])[len(tok.decode(prompt_ids)):]

    word = " little"
    cut = base.text.index(word)
    k = next(k for k in range(1, 41) if len(text_of(k)) > cut)
    assert text_of(k - 1) == base.text[:cut] and text_of(k).startswith(base.text[:cut] + word)  # one token
    for stop in (["lit", word], [word, "lit"]):
        before = llm.engine.stats().generated_tokens
        c = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                    stop=stop))[0].outputs[0]
        assert (c.text, c.finish_reason, c.stop_reason) == (base.text[: cut + 1], "stop", "lit"), stop
        # the burst's tokens past the stop string are in no output, nor in the count
        assert llm.engine.stats().generated_tokens - before == len(c.token_ids) == k
    llm.engine.check_invariants()


def test_the_final_flush_is_checked_against_stop_strings(llm):
    """An incomplete character at the end becomes U+FFFD only when the sequence ends; a stop string
    in that last text cuts it as anywhere else."""
    lead = llm.tokenizer.piece_to_id("<0xE2>")  # the first of a three-byte character's bytes
    params = SamplingParams(temperature=0.0, max_tokens=1, logit_bias={lead: 100.0})
    c = llm.generate(PROMPTS[0], params)[0].outputs[0]
    assert (c.token_ids, c.text, c.finish_reason) == ([lead], "\ufffd", "length")
    for stop in ("\ufffd", "zz"):
        c = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=1, logit_bias={lead: 100.0},
                                                    stop=["zz", stop]))[0].outputs[0]
        want = ("", "stop", "\ufffd") if stop == "\ufffd" else ("\ufffd", "length", None)
        assert (c.text, c.finish_reason, c.stop_reason) == want
    llm.engine.check_invariants()


def test_an_interrupted_generate_leaves_the_llm_usable(llm, monkeypatch):
    """Ctrl-C (or an engine error) inside generate withdraws the call's requests: the next call
    does not find the engine busy."""
    engine, step, calls = llm.engine, llm.engine.step, []

    def interrupted_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step(*args, **kwargs)

    monkeypatch.setattr(engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16))
    monkeypatch.undo()
    assert not engine.has_unfinished()
    engine.check_invariants()
    assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=4))[0].finished


class _StepCounts(dict):
    """Engine._counts that raises KeyboardInterrupt as the `n`-th step's dispatch is counted: the
    step is then on the device but not yet handed to the scheduler."""

    def __init__(self, counts, n):
        super().__init__(counts)
        self.n = n

    def __setitem__(self, key, value):
        if key == "steps":
            self.n -= 1
            if self.n == 0:
                raise KeyboardInterrupt
        super().__setitem__(key, value)


@pytest.mark.parametrize("where", ["waiting for the device", "before dispatching", "after dispatching"])
def test_ctrl_c_inside_a_step_leaves_the_llm_usable(llm, monkeypatch, where):
    """Ctrl-C lands where a step spends its time: waiting for the previous step's tokens, after the
    next step was dispatched (or, rarely, while packing a step or just after dispatching it). The
    step the scheduler had planned was left outstanding, so every later step raised and the LLM
    stayed busy for good. Now the interrupt reaches the caller, and the next call finishes that
    step first."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    if where == "after dispatching":
        monkeypatch.setattr(engine, "_counts", _StepCounts(engine._counts, 2))
    else:
        target = (engine, "_finish_inflight") if where == "waiting for the device" else (engine.packer, "pack")
        real, calls = getattr(*target), []

        def interrupted(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:  # (the second step: the first one's tokens awaited, the second's dispatched)
                raise KeyboardInterrupt
            return real(*args, **kwargs)

        monkeypatch.setattr(*target, interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, params)
    counts = engine._counts
    monkeypatch.undo()
    engine._counts.update(counts)  # (what the patched counter counted meanwhile)
    assert not engine.has_unfinished()
    engine.check_invariants()
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == want


def test_generate_from_two_threads_at_once_refuses_the_second(llm, monkeypatch):
    """The busy check and the stepping were not atomic: two threads could both pass it and step the
    engine together (internal errors, an engine left busy)."""
    import threading

    engine, step = llm.engine, llm.engine.step
    inside, release = threading.Event(), threading.Event()

    def slow_step(*args, **kwargs):
        inside.set()
        release.wait(30)
        return step(*args, **kwargs)

    monkeypatch.setattr(engine, "step", slow_step)
    result = []
    t = threading.Thread(target=lambda: result.append(llm.generate(PROMPTS[0], SamplingParams(max_tokens=4))))
    t.start()
    try:
        assert inside.wait(30)
        with pytest.raises(RuntimeError, match="another thread"):
            llm.generate(PROMPTS[1], SamplingParams(max_tokens=4))
    finally:
        release.set()
        t.join(60)
    assert result and result[0][0].finished
    monkeypatch.undo()
    engine.check_invariants()


def test_ids_past_the_tokenizers_vocabulary_decode_to_nothing(tmp_path):
    """A model may have more embedding rows than its tokenizer has tokens (Qwen2.5: 151,936 rows,
    151,665 tokens) and may sample the extra ids: they decode to nothing, as in HF tokenizers.
    Decoding one raised inside the engine's step and left the LLM unusable."""
    pytest.importorskip("gguf")
    from runtime.tokenizer import Tokenizer
    from tests.testing.data import write_bpe_gguf
    from tests.testing.engine import scaled_dummy

    write_bpe_gguf(tmp_path / "t.gguf")
    tok = Tokenizer.from_gguf(tmp_path / "t.gguf")
    model = scaled_dummy(seed=0)
    V = model.config.vocab_size
    llm = LLM(model, tokenizer=tok, dtype="float32", max_num_seqs=2, max_num_batched_tokens=16, token_buckets=(16,),
              seq_buckets=(2,), max_model_len=64, progress=False)
    assert (tok.vocab_size, llm.tokenizer.vocab_size) == (6, V) and V > 40
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logit_bias={40: 100.0})
    out = llm.generate([[2, 40, 4]], params)[0].outputs[0]
    assert (out.token_ids, out.text, out.finish_reason) == ([40, 40, 40], "", "length")
    assert llm.generate("ab", params)[0].outputs[0].text == ""
    assert llm.tokenizer.decode([40, 2, 40, 4, V - 1]) == tok.decode([2, 4]) == "ab ab"
    assert llm.tokenizer.id_to_piece(40) == ""
    with pytest.raises(ValueError, match=r"tokenizer .*t.gguf has 6 tokens; the model m has a vocabulary of 4"):
        tok.for_model(4, "m")
    llm.engine.check_invariants()
    llm.engine.close()


def test_output_kinds_carry_the_same_sequence(llm):
    """cumulative, delta and final_only outputs of one request (n=2, logprobs, a stop string held
    back while streaming) add up to the same final output; the prompt list is shared, not copied."""
    engine = llm.engine

    def stream(kind):
        params = SamplingParams(temperature=0.9, seed=5, max_tokens=20, logprobs=2, n=2, stop=["zzzz"],
                                output_kind=kind)
        engine.add_request(PROMPTS[2], params)
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        engine.check_invariants()
        return outs

    cumulative, delta, final_only = stream("cumulative"), stream("delta"), stream("final_only")
    final = cumulative[-1]
    assert final.finished and [o.finished for o in cumulative].count(True) == 1 and len(cumulative) > 3
    assert len(final_only) == 1 and final_only[0].finished
    for outs in (cumulative, delta, final_only):
        last = outs[-1]
        assert all(o.prompt_token_ids is last.prompt_token_ids for o in outs)
        assert last.prompt_token_ids == llm.tokenizer.encode(PROMPTS[2])
        for c, want in zip(last.outputs, final.outputs):  # the final output is whole in every kind
            assert (c.token_ids, c.text, c.logprobs, c.finish_reason) == (
                want.token_ids, want.text, want.logprobs, want.finish_reason)
            assert c.cumulative_logprob == pytest.approx(want.cumulative_logprob)
        for i, want in enumerate(final.outputs):  # the new_* pieces of every output add up to it
            pieces = [o.outputs[i] for o in outs]
            assert sum((c.new_token_ids for c in pieces), []) == want.token_ids
            assert "".join(c.new_text for c in pieces) == want.text
    for o in cumulative[:-1]:
        for c in o.outputs:
            assert len(c.logprobs) == len(c.token_ids) and c.token_ids[len(c.token_ids) - len(c.new_token_ids):] \
                == c.new_token_ids
    for o in delta[:-1]:  # a running request's delta: only what is new
        for c in o.outputs:
            assert c.token_ids == c.new_token_ids and c.text == c.new_text and len(c.logprobs) == len(c.token_ids)
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="deltas")


def test_logprobs_and_n(llm):
    outs = llm.generate(PROMPTS[1], SamplingParams(temperature=0.9, seed=11, max_tokens=10, logprobs=3, n=2))
    o = outs[0]
    assert isinstance(o, RequestOutput) and [c.index for c in o.outputs] == [0, 1]
    assert o.outputs[0].token_ids != o.outputs[1].token_ids
    for c in o.outputs:
        assert len(c.logprobs) == len(c.token_ids) == 10
        for t, d in zip(c.token_ids, c.logprobs):
            assert t in d and 3 <= len(d) <= 4 and all(v <= 0 for v in d.values())
        assert c.cumulative_logprob == pytest.approx(sum(d[t] for t, d in zip(c.token_ids, c.logprobs)))
    plain = llm.generate(PROMPTS[1], SamplingParams(temperature=0.9, seed=11, max_tokens=10))[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None
    assert plain.token_ids == o.outputs[0].token_ids


def test_per_prompt_params_and_errors(llm):
    outs = llm.generate(PROMPTS[:2], [SamplingParams(temperature=0.0, max_tokens=3),
                                      SamplingParams(temperature=0.0, max_tokens=5)], use_tqdm=True)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        llm.generate(PROMPTS[:2], [SamplingParams()])
    with pytest.raises(TypeError, match=r"sampling_params\[1\] is NoneType, not SamplingParams"):
        llm.generate(PROMPTS[:2], [SamplingParams(), None])
    with pytest.raises(ValueError, match="max_model_len is 256"):
        llm.generate([PROMPTS[0], "word " * 400], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished()  # every prompt is checked before any is queued
    llm.engine.check_invariants()


def test_prompt_ids_of_any_integer_type_and_nothing_else(llm):
    """Token ids may come as lists, tuples or numpy arrays of any integer type; a float or a bool
    among them is an error (it was truncated to an int before), and so is a negative id."""
    sp = SamplingParams(temperature=0.0, max_tokens=3)
    ids = llm.tokenizer.encode(PROMPTS[0])
    want = llm.generate([ids], sp)[0].outputs[0].token_ids
    for form in (tuple(ids), np.asarray(ids, np.int64), np.asarray(ids, np.int32), [np.int64(t) for t in ids]):
        out = llm.generate([form, ids], sp)
        assert [o.outputs[0].token_ids for o in out] == [want, want]
        assert out[0].prompt_token_ids == ids and type(out[0].prompt_token_ids[0]) is int
    assert llm.generate(ids, sp)[0].outputs[0].token_ids == want  # one prompt as a flat list of ids
    for bad in (ids[:3] + [1.5], ids[:3] + [True], ids[:3] + [-1]):
        with pytest.raises(ValueError, match="prompt token ids must be ints >= 0"):
            llm.generate([ids, bad], sp)
    assert not llm.engine.has_unfinished()
    llm.engine.check_invariants()


def test_vllm_prompt_dicts(llm):
    """vLLM's TextPrompt / TokensPrompt dicts: the same tokens as the plain forms; a TokensPrompt's
    "prompt" is reported as its text; a cache_salt keeps the prompt's pages from other salts'
    prompts (no prefix-cache hit); anything else a dict may hold is refused, naming the prompt."""
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    ids = llm.tokenizer.encode(PROMPTS[2])
    want = llm.generate(PROMPTS[2], sp)[0]
    outs = llm.generate([{"prompt": PROMPTS[2]}, {"prompt_token_ids": ids}, {"prompt_token_ids": np.asarray(ids),
                                                                          "prompt": "shown"}], sp)
    assert [o.outputs[0].token_ids for o in outs] == [want.outputs[0].token_ids] * 3
    assert [o.prompt for o in outs] == [PROMPTS[2], None, "shown"] and outs[1].prompt_token_ids == ids
    assert llm.generate({"prompt": PROMPTS[2]}, sp)[0].outputs[0].token_ids == want.outputs[0].token_ids
    long = llm.tokenizer.encode("Once upon a time there was a little girl named Lily. She liked to play " * 2)
    llm.generate([long], sp)  # its full pages are now cached
    hits = llm.engine.stats().prefix_cache_hit_tokens
    llm.generate([{"prompt_token_ids": long, "cache_salt": "tenant-a"}], sp)
    assert llm.engine.stats().prefix_cache_hit_tokens == hits  # a salt shares nothing with unsalted pages
    llm.generate([{"prompt_token_ids": long, "cache_salt": "tenant-a"}], sp)
    assert llm.engine.stats().prefix_cache_hit_tokens > hits  # ... but with its own salt's
    for bad, needle in (({"prompt": PROMPTS[0], "multi_modal_data": {}}, r"prompt keys \['multi_modal_data'\] are not"),
                        ({"cache_salt": "x"}, "needs 'prompt'"), ({"prompt": 5}, "'prompt' must be a string"),
                        ({"prompt_token_ids": "abc"}, "must be a list of token ids"),
                        ({"prompt": "a", "cache_salt": 5}, "cache_salt must be a string")):
        with pytest.raises(ValueError, match="request 'prompt 1': .*" + needle):
            llm.generate(["a", bad], sp)
    assert not llm.engine.has_unfinished()
    llm.engine.check_invariants()


def test_bad_prompt_raises_before_anything_runs(llm):
    before = llm.engine.stats()
    with pytest.raises(ValueError, match=r"request 'prompt 5': .*max_model_len is 256"):
        llm.generate(PROMPTS + ["One day"] + ["word " * 400], SamplingParams(max_tokens=4))
    after = llm.engine.stats()
    assert (after.num_requests, after.num_steps) == (before.num_requests, before.num_steps)
    # every error names its prompt, whichever check refuses it
    sp = SamplingParams(max_tokens=4)
    for prompts, params, needle in (
        (["a", []], sp, "request 'prompt 1': prompt has 0 tokens"),
        (["a", "b", [5, 600]], sp, "request 'prompt 2': prompt token id 600 is out of range"),
        (["bad \ud800"], sp, "request 'prompt 0': text is not valid Unicode"),
        (["a", "b"], [sp, SamplingParams(logprobs=30)], "request 'prompt 1': logprobs 30 exceeds max_logprobs 20"),
        (["a", "b"], [sp, SamplingParams(stop_token_ids=[600])], "request 'prompt 1': stop token id 600 is out"),
    ):
        with pytest.raises(ValueError) as e:
            llm.generate(prompts, params)
        assert needle in str(e.value)
    assert not llm.engine.has_unfinished()


def test_prompts_past_the_first_step_are_checked_while_it_runs(llm):
    """The prompts the first step can take (8 slots here) are checked before it runs, the rest while
    the device runs it: a bad one among them raises before the second step, with the call's
    requests withdrawn and the engine left empty."""
    engine = llm.engine
    before = engine.stats()
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(10)] + ["word " * 400]
    with pytest.raises(ValueError, match=r"request 'prompt 10': .*max_model_len is 256"):
        llm.generate(prompts, SamplingParams(max_tokens=4))
    after = engine.stats()
    assert after.num_steps - before.num_steps >= 1  # the first step ran (and the withdrawal drained it)
    assert after.num_aborted - before.num_aborted == 8  # the 8 queued for the first step
    assert not engine.has_unfinished() and gc.get_freeze_count() == 0
    engine.check_invariants()
    outs = llm.generate(prompts[:10], SamplingParams(temperature=0.0, max_tokens=4))  # the engine serves on
    assert [o.prompt for o in outs] == prompts[:10]


def test_prompts_are_queued_as_the_engine_takes_them(llm, monkeypatch):
    # 24 prompts of 20-40 tokens against 8 slots and a 64-token budget: the queue is topped up to
    # two budgets (128 tokens) or 8 waiting requests, whichever comes first, between steps, and the
    # outputs are each prompt's own.
    tok, engine = llm.tokenizer, llm.engine
    prompts = [f"{PROMPTS[i % 4]} and the number {i}" + " and then" * (i % 7) for i in range(24)]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    alone = [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts[:6]]
    seen = []  # (steps run, requests waiting, their tokens) at each queueing
    add = engine.enqueue_checked  # LLM.generate queues prompts it has already checked

    def watched(*a, **k):
        seen.append((engine.stats().num_steps, engine.scheduler.num_waiting, engine.scheduler.num_waiting_tokens))
        return add(*a, **k)

    monkeypatch.setattr(engine, "enqueue_checked", watched)
    steps0 = engine.stats().num_steps
    outs = llm.generate(prompts, params)
    assert [o.prompt for o in outs] == prompts
    assert [o.outputs[0].token_ids for o in outs[:6]] == alone
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    assert len(seen) == 24
    assert all(w < 8 and t < 128 for _, w, t in seen)  # each add found room under both limits
    first = sum(s == steps0 for s, _, _ in seen)
    assert 0 < first < 24  # some prompts were queued only after the first step ran
    lens, k = [len(tok.encode(p)) for p in prompts], 0
    while k < 8 and sum(lens[:k]) < 128:
        k += 1
    assert first == k < 8  # here the token limit binds first
    engine.check_invariants()


def test_queueing_failure_withdraws_every_request(llm, monkeypatch):
    engine = llm.engine
    add, calls = engine.enqueue_checked, []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 12:
            raise RuntimeError("injected")
        return add(*a, **k)

    monkeypatch.setattr(engine, "enqueue_checked", failing)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([f"{p} again" for p in PROMPTS] * 5, SamplingParams(temperature=0.0, max_tokens=30))
    assert len(calls) == 12 and engine.stats().num_aborted > 0
    assert not engine.has_unfinished()
    assert gc.get_freeze_count() == 0  # the frozen heap is given back on the error path too
    engine.check_invariants()


def test_generate_runs_with_the_heap_frozen(llm, monkeypatch):
    # The generate loop runs inside frozen_heap (runtime/engine.py): the objects alive at entry
    # (the warmed-up process: JAX, the model, the programs) are out of the cyclic collector's
    # reach while it steps, and given back at exit, also when something froze a few objects before
    # (as a library may at import); nested in another frozen_heap, the outer one keeps them frozen.
    engine, step, seen = llm.engine, llm.engine.step, []

    def watched(*a, **k):
        seen.append(gc.get_freeze_count())
        return step(*a, **k)

    monkeypatch.setattr(engine, "step", watched)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    assert gc.get_freeze_count() == 0, "something else left the heap frozen"
    first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert seen and min(seen) > 10_000  # the whole warmed-up heap, not a handful of objects
    assert gc.get_freeze_count() == 0
    gc.freeze()  # frozen before: here the whole heap, then 20k objects made since
    before, made = gc.get_freeze_count(), [[i] for i in range(20_000)]
    seen.clear()
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == first
    assert seen and min(seen) > before + len(made) - 1000 and gc.get_freeze_count() == 0
    with frozen_heap():
        outer = gc.get_freeze_count()
        seen.clear()
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == first
        # Objects freed by reference counting leave the frozen set; the inner exit unfreezes nothing.
        assert seen and all(outer - 1000 < c <= outer for c in seen + [gc.get_freeze_count()])
    assert gc.get_freeze_count() == 0


def test_finished_requests_leave_no_cyclic_garbage(llm):
    # A finished request's objects (its sequences, sampling state, detokenizers, scheduler request)
    # are freed by reference counting: none waits for the cyclic collector, whose full passes
    # cost 0.2 s in a warmed-up process (runtime/engine.py). n = 2, logprobs and stop strings too.
    params = SamplingParams(temperature=0.8, max_tokens=12, n=2, logprobs=2, stop=["."])
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        outs = llm.generate(PROMPTS, params)
        gc.collect()
        ours = sorted({type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith("runtime.")})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert len(outs) == 4 and all(len(o.outputs) == 2 for o in outs)
    assert ours == [], f"cyclic garbage left by finished requests: {ours}"


def test_chat_renders_each_conversation(llm):
    """vLLM's LLM.chat: one conversation or several, rendered with a chat template (stories260K has
    none of its own, so the call gives one), generated as the rendered text's ids would be."""
    tok = llm.tokenizer
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %} Then{% endif %}"
    sp = SamplingParams(temperature=0.0, max_tokens=6)
    convs = [[{"role": "user", "content": PROMPTS[0]}], [{"role": "user", "content": PROMPTS[1]}]]
    outs = llm.chat(convs, sp, chat_template=template)
    for conv, out in zip(convs, outs):
        text = "<s>" + conv[0]["content"] + " Then"
        assert out.prompt == text and out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
        assert out.outputs[0].token_ids == llm.generate([out.prompt_token_ids], sp)[0].outputs[0].token_ids
    one = llm.chat(convs[0], sp, chat_template=template, add_generation_prompt=False)
    assert len(one) == 1 and one[0].prompt == "<s>" + PROMPTS[0]
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat(convs[0], sp)
    llm.engine.check_invariants()
