"""Engine tests on a random model (float32, CPU; no checkpoint) of which programs the executor
compiles and runs: decode bursts with penalties, bans and logprobs, the GREEDY_HEAD bursts, the
decode-only model programs. Each must give the tokens (and logprobs) of the programs it stands in
for."""

from __future__ import annotations

from dataclasses import replace

import jax
import numpy as np
import pytest

import runtime.engine
import runtime.step
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.request import SamplingParams
from tests.testing.engine import BASE, check_idle, greedy_requests, run_one, run_workload, scaled_dummy, spy_programs
from tests.tolerances import ENGINE_LOGPROBS_F32


def assert_same_logprobs(got, want, rid):
    """Per-token logprob rows: the same ids, values equal up to float reassociation."""
    assert (got is None) == (want is None), rid
    if want is None:
        return
    assert len(got) == len(want), rid
    for j, (g, w) in enumerate(zip(got, want)):
        assert list(g) == list(w), (rid, j)
        atol, rtol = ENGINE_LOGPROBS_F32
        np.testing.assert_allclose(list(g.values()), list(w.values()), atol=atol, rtol=rtol, err_msg=f"{rid} {j}")


def test_bursts_with_penalties_min_tokens_and_logprobs_equal_single_steps(monkeypatch):
    """Penalties, logit biases, min_tokens bans and logprobs inside decode bursts (4 model steps per
    program) give the tokens and logprobs single steps give, alone and in a random-arrival batch:
    consecutive bursts of penalized rows (the host resolves each before it packs the next), greedy
    and seeded random, logprobs with and without penalties in the burst, and min_tokens bans held
    and lifted inside a burst. The burst engine counts penalty histories in chunks of 16 entries
    (up to 5 a step here), the single-step one in one chunk of max_model_len. Runs without the
    shared checkpoint."""
    model = scaled_dummy()
    cfg = {**BASE, "seq_buckets": (8,)}
    single = Engine(model, EngineConfig(**cfg))
    monkeypatch.setattr(runtime.step, "HISTORY_CHUNK", 16)
    bursts = Engine(model, EngineConfig(**cfg, decode_steps=4))
    assert (single.packer.history_chunk, bursts.packer.history_chunk) == (256, 16)
    try:
        rng = np.random.default_rng()
        kinds = [dict(temperature=0.0, repetition_penalty=1.8), dict(temperature=0.0, frequency_penalty=2.0),
                 dict(temperature=1.0, presence_penalty=2.0, top_k=20),
                 dict(temperature=0.8, frequency_penalty=1.5, presence_penalty=0.5), dict(temperature=0.0),
                 dict(temperature=0.0, logprobs=3), dict(temperature=0.9, top_p=0.8, logprobs=0),
                 dict(temperature=0.0, repetition_penalty=1.5, logprobs=2),
                 dict(temperature=0.0, logit_bias={5: 3.0, 17: -2.0, 99: 1.5}),
                 dict(temperature=0.7, top_k=20, logit_bias={3: 2.0}, presence_penalty=1.0)]
        reqs = [(f"p{i}", rng.integers(0, 256, int(rng.integers(4, 30))).tolist(),
                 SamplingParams(seed=int(rng.integers(0, 2**62)), max_tokens=int(rng.integers(12, 40)),
                                **kinds[i % len(kinds)])) for i in range(16)]
        want = {rid: run_one(single, prompt, params).outputs[0] for rid, prompt, params in reqs}
        before = bursts.stats().num_bursts
        alone = {rid: run_one(bursts, prompt, params) for rid, prompt, params in reqs}
        for rid, out in want.items():  # alone, same shapes: the logits agreed bit for bit when measured
            assert alone[rid].outputs[0].token_ids == out.token_ids, rid
            assert_same_logprobs(alone[rid].outputs[0].logprobs, out.logprobs, rid)
        # In a batch, logits move by float reassociation (logprobs by up to ~4e-5 here, top-2 gaps
        # down to ~1e-3), which can flip a near-tied pick. A penalized or sampled pick's margin is
        # not visible in the raw logprobs, so instead of a near-tie cut one request of the 16 may
        # part from its reference, after a common prefix with the same logprobs; a burst bug moves
        # every request of its kind (two or more).
        batch, parted = run_workload(bursts, reqs), []
        for rid, out in want.items():
            got = batch[rid].outputs[0]
            j = next((i for i, (a, b) in enumerate(zip(got.token_ids, out.token_ids)) if a != b), None)
            if j is None:
                assert got.token_ids == out.token_ids, rid
            else:
                parted.append(rid)
            k = len(out.token_ids) if j is None else j
            assert_same_logprobs(got.logprobs[:k] if got.logprobs is not None else None,
                                 out.logprobs[:k] if out.logprobs is not None else None, rid)
        assert len(parted) <= 1, f"{parted} part from their single-step references in a batch"
        assert bursts.stats().num_bursts > before + 16
        before = bursts.stats().num_bursts
        run_one(bursts, reqs[5][1], reqs[5][2])  # logprobs, no penalties: bursts too
        assert bursts.stats().num_bursts > before
        # the penalties decide tokens here: without them some greedy ones differ
        plain = [(rid, prompt, replace(params, repetition_penalty=1.0, frequency_penalty=0.0, logit_bias=None))
                 for rid, prompt, params in reqs if params.temperature == 0.0]
        assert any(run_one(single, prompt, params).outputs[0].token_ids != want[rid].token_ids
                   for rid, prompt, params in plain)
        forced = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logit_bias={42: 100.0})
        for eng in (single, bursts):  # +100 outweighs any logit of this model: every token is 42
            assert run_one(eng, reqs[0][1], forced).outputs[0].token_ids == [42] * 9, eng.config.decode_steps

        # min_tokens: a prompt whose greedy tokens t have t[2] not in t[:2] and t[6] not in t[:6].
        # The prefill samples index 0, bursts 1-4 and 5-8.
        for _ in range(100):
            prompt = rng.integers(0, 256, 12).tolist()
            t = run_one(single, prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)).outputs[0].token_ids
            if t[2] not in t[:2] and t[6] not in t[:6]:
                break
        else:
            pytest.fail("no prompt of 100 had the token pattern needed")
        lifted = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=6, ignore_eos=True, stop_token_ids=[t[6]])
        held = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=8, ignore_eos=True, stop_token_ids=[t[2]])
        for eng in (single, bursts):
            out = run_one(eng, prompt, lifted).outputs[0]  # the ban is lifted at index 6, mid-burst
            assert out.token_ids == t[:7] and out.finish_reason == "stop", eng.config.decode_steps
        ref = run_one(single, prompt, held).outputs[0].token_ids
        assert ref[:2] == t[:2] and ref[2] != t[2]  # banned at index 2
        assert run_one(bursts, prompt, held).outputs[0].token_ids == ref
        check_idle(single)
        check_idle(bursts)
    finally:
        single.close()
        bursts.close()


def test_greedy_head_bursts_equal_greedy_bursts(monkeypatch):
    """Where the model's greedy head is a kernel (one Hopper GPU) the executor compiles a GREEDY_HEAD
    burst per decode pair and runs it for bursts of greedy rows with nothing banned, no penalties
    and no logprobs; every other burst keeps the logits. On the CPU the graph's head is the
    reference (the logits' argmax), so the tokens must equal those of bursts without it bit for
    bit, alone and in a random-arrival batch."""
    model = scaled_dummy()
    cfg = EngineConfig(**{**BASE, "seq_buckets": (8,)}, decode_steps=4)
    plain = Engine(model, cfg)
    assert plain.executor.greedy_head_seqs == frozenset()  # float32 on the CPU: no kernel
    # the executor's switch only: the graph keeps the reference head (the logits' argmax)
    monkeypatch.setattr(runtime.engine, "_greedy_head_seqs", lambda model, seq_buckets: frozenset(seq_buckets))
    headed = Engine(model, cfg)  # the same forward: the programs both have compile once
    try:
        heads = [k for k in headed.executor.program_keys() if k[3:4] == (runtime.step.GREEDY_HEAD,)]
        assert heads and not [k for k in plain.executor.program_keys() if k in heads]
        assert {k[1:3] for k in heads} == set(headed.buckets.decode_pairs())
        headed.executor.greedy_head_seqs = frozenset({16})  # none of these buckets
        assert not [k for k in headed.executor.program_keys() if k[3:4] == (runtime.step.GREEDY_HEAD,)]
        headed.executor.greedy_head_seqs = frozenset({8})
        used = spy_programs(monkeypatch, headed.executor)
        reqs = greedy_requests("g")
        for rid, prompt, params in reqs[:3]:
            assert run_one(headed, prompt, params).outputs[0].token_ids == \
                run_one(plain, prompt, params).outputs[0].token_ids, rid
        want = run_workload(plain, reqs, seed=1)
        got = run_workload(headed, reqs, seed=1)
        assert {r: o.outputs[0].token_ids for r, o in got.items()} == {r: o.outputs[0].token_ids for r, o in want.items()}
        assert sum(k[3:4] == (runtime.step.GREEDY_HEAD,) for k in used) >= 6
        # a ban (min_tokens with a stop id) or logprobs keep the logits: banned bursts run the greedy sampler
        base = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        free = run_one(plain, reqs[0][1], base).outputs[0].token_ids
        stop = next(t for t in range(256) if t not in free)  # banned, never chosen: the same tokens
        for params in (replace(base, min_tokens=9, stop_token_ids=[stop]), replace(base, logprobs=1)):
            used.clear()
            assert run_one(headed, reqs[0][1], params).outputs[0].token_ids == \
                run_one(plain, reqs[0][1], params).outputs[0].token_ids
            bursts = [k[3] for k in used if k[0] == "burst"]
            if params.logprobs is None:  # banned below index 9: bursts 1-4 and 5-8, then 9-12 and 13-15
                assert bursts == ["greedy", "greedy", runtime.step.GREEDY_HEAD, runtime.step.GREEDY_HEAD], bursts
            else:
                assert bursts and runtime.step.GREEDY_HEAD not in bursts, bursts
        check_idle(plain)
        check_idle(headed)
    finally:
        plain.close()
        headed.close()


def test_unrolled_bursts_equal_looped_bursts(monkeypatch):
    """EngineConfig.unroll_burst_max_seqs: the burst programs of seq buckets up to it compile their
    model steps as straight-line code (the burst's while loop gone; the forward's own loops stay),
    the others keep the loop, and unrolled bursts give the tokens looped ones give, greedy and
    sampled, with penalties and logprobs, alone and in a random-arrival batch. On the CPU the
    default unrolls none."""
    model = scaled_dummy()
    lazy = {**BASE, "warmup": False, "strict_compile": False}  # only the programs the workload runs compile
    looped = Engine(model, EngineConfig(**lazy, decode_steps=4))
    unrolled = Engine(model, EngineConfig(**lazy, decode_steps=4, unroll_burst_max_seqs=2))
    try:
        assert (looped.executor.unroll_burst_max_seqs, unrolled.executor.unroll_burst_max_seqs) == (0, 2)
        for T, S in unrolled.buckets.decode_pairs():
            key = ("burst", T, S, "greedy", False, False)
            loops = [e.executor._lower(key).as_text().count("stablehlo.while") for e in (looped, unrolled)]
            assert loops[1] == loops[0] - (S <= 2), (key, loops)
        used = spy_programs(monkeypatch, unrolled.executor)
        rng = np.random.default_rng()
        kinds = [dict(temperature=0.0), dict(temperature=0.0, repetition_penalty=1.5, logprobs=2),
                 dict(temperature=0.9, top_k=20), dict(temperature=0.8, top_p=0.9, presence_penalty=1.0)]
        # The last request, submitted last, outlives every other by 25+ tokens: the workload ends with it
        # alone, in the unrolled bucket, whatever the random lengths.
        reqs = [(f"u{i}", rng.integers(0, 256, int(rng.integers(2, 30))).tolist(),
                 SamplingParams(seed=int(rng.integers(0, 2**62)),
                                max_tokens=64 if i == 11 else int(rng.integers(9, 40)), ignore_eos=True,
                                **kinds[i % len(kinds)])) for i in range(12)]
        for rid, prompt, params in reqs[:4]:
            got, want = run_one(unrolled, prompt, params).outputs[0], run_one(looped, prompt, params).outputs[0]
            assert got.token_ids == want.token_ids, rid
            assert_same_logprobs(got.logprobs, want.logprobs, rid)
        assert {k[2] for k in used if k[0] == "burst"} == {2}  # one sequence at a time: the unrolled bucket
        used.clear()
        want = run_workload(looped, reqs, seed=1)
        got = run_workload(unrolled, reqs, seed=1)
        for rid, _, _ in reqs:
            g, w = got[rid].outputs[0], want[rid].outputs[0]
            assert g.token_ids == w.token_ids, rid
            assert_same_logprobs(g.logprobs, w.logprobs, rid)
        assert {k[2] for k in used if k[0] == "burst"} == {2, 8}  # unrolled and looped bursts both ran
        check_idle(looped)
        check_idle(unrolled)
    finally:
        looped.close()
        unrolled.close()


def test_decode_only_single_steps_run_the_decode_program(monkeypatch):
    """Where the decode-only forward differs (a GPU: the KV write inside the attention launch) the
    executor compiles a decode-only model program per decode pair, and single steps without a
    prefill token run it; steps with one run the model program of their bucket. On the CPU both
    programs compute the same, so the tokens must equal those of an engine without them bit for
    bit, alone and in a random-arrival batch, with nothing compiled after warmup (strict)."""
    from runtime.compilation import DECODE_MODEL

    model = scaled_dummy()
    cfg = EngineConfig(**BASE)  # single steps (decode_steps 1)
    plain = Engine(model, cfg)
    assert not plain.executor.decode_programs  # the CPU's attention: the same program either way
    monkeypatch.setattr(runtime.engine, "_decode_programs", lambda model: True)
    decoding = Engine(model, cfg)
    try:
        keys = decoding.executor.program_keys()
        assert sorted(k[1:] for k in keys if k[0] == DECODE_MODEL) == sorted(decoding.buckets.decode_pairs())
        assert not [k for k in plain.executor.program_keys() if k[0] == DECODE_MODEL]
        used = spy_programs(monkeypatch, decoding.executor)
        reqs = greedy_requests("d")
        for rid, prompt, params in reqs[:3]:
            used.clear()
            assert run_one(decoding, prompt, params).outputs[0].token_ids == \
                run_one(plain, prompt, params).outputs[0].token_ids, rid
            models = [k[0] for k in used if k[0] in ("model", DECODE_MODEL)]
            # the prompt's step, then one decode-only step per token after the first
            assert models == ["model"] + [DECODE_MODEL] * (params.max_tokens - 1), (rid, models)
        want = run_workload(plain, reqs, seed=1)
        used.clear()
        got = run_workload(decoding, reqs, seed=1)
        tokens = lambda outs: {r: o.outputs[0].token_ids for r, o in outs.items()}  # noqa: E731
        assert tokens(got) == tokens(want)
        assert {"model", DECODE_MODEL} <= {k[0] for k in used}
        assert decoding.executor.num_compiles_after_warmup == 0
        check_idle(plain)
        check_idle(decoding)
    finally:
        plain.close()
        decoding.close()


def test_model_step_fn_runs_the_executors_model_program():
    """StepExecutor.model_step_fn (the device's share of a step: scripts/bench_decode.py's step
    column) runs the program the executor's call runs for the same batch, with the same arguments:
    the greedy tokens and the KV pool it writes equal the call's. A burst has no such program."""
    eng = Engine(scaled_dummy(), EngineConfig(**BASE, num_pages=32))  # a small pool: it is compared on the host
    try:
        ex, ctx = eng.executor, 5
        T, S = min(eng.buckets.decode_pairs(), key=lambda p: p[1])  # the decode bucket of 2 sequences
        assert S == 2
        b = eng.packer.empty(T, S, history=0)
        b.decode_only = True
        st = b.step  # views into b.flat
        st.tokens[:S] = [3, 7]  # the bucket's other tokens are padding
        st.positions[:S] = ctx
        st.attn.kv_lens[:] = ctx + 1
        st.attn.cu_q_lens[:] = np.arange(S + 1)
        st.attn.num_seqs[0] = S
        st.logits_indices[:] = np.arange(S)
        st.page_rows[:] = np.arange(S)
        b.pages = ((0, 1, (4,)), (1, 1, (9,)))  # (row, lease, pages): one page each holds positions 0-5
        kv, eng.kv_pages = eng.kv_pages, None
        tokens, _, _, kv = ex(eng.model.params, kv, b)
        want_kv = [np.asarray(x) for x in jax.tree.leaves(kv)]
        _, greedy, kv = ex.model_step_fn(b)(kv)  # writes the same K/V rows again
        np.testing.assert_array_equal(np.asarray(greedy)[:S], np.asarray(tokens)[:S])
        for got, want in zip(jax.tree.leaves(kv), want_kv, strict=True):
            np.testing.assert_array_equal(np.asarray(got), want)
        assert ex.num_compiles_after_warmup == 0
        eng.kv_pages = kv
        with pytest.raises(ValueError, match="burst"):
            ex.model_step_fn(replace(b, steps=2))
    finally:
        eng.close()


def test_warmup_runs_each_program_once_and_writes_no_kv(monkeypatch):
    """EngineConfig.warmup_runs: warmup runs every compiled program once on an all-padding batch (the
    page-table updates on updates that all drop), which writes nothing into the KV pool or the page
    table, and the engine's tokens are those of an engine that skipped the runs (which ran nothing at
    warmup), with no compile after warmup."""
    from runtime.compilation import StepExecutor

    calls = {}  # (executor, key) -> runs
    compile_ = StepExecutor._compile

    def counting_compile(self, key, lowered):
        exe = compile_(self, key, lowered)

        def run(*args):
            calls[self, key] = calls.get((self, key), 0) + 1
            return exe(*args)
        return run

    monkeypatch.setattr(StepExecutor, "_compile", counting_compile)
    model = scaled_dummy()
    cfg = {**BASE, "seq_buckets": (1, 8), "decode_steps": 4}
    eng = Engine(model, EngineConfig(**cfg, warmup_runs=True))
    plain = None
    try:
        plain = Engine(model, EngineConfig(**cfg, warmup_runs=False))
        keys = eng.executor.program_keys()
        assert {k[0] for k in keys} >= {"model", "burst", "count", "penalize", "pick", "logprobs", "pages"}
        assert calls == {(eng.executor, k): 1 for k in keys}  # and none of plain's programs ran
        for e in (eng, plain):
            assert all(not np.asarray(x).any() for x in jax.tree.leaves(e.kv_pages))  # the pool is still all zeros
            assert not np.asarray(e.executor.page_table).any()  # and the page table
        workload = greedy_requests("w", 10)
        got = run_workload(eng, workload, seed=3)
        want = run_workload(plain, workload, seed=3)
        ids = [{r: o.outputs[0].token_ids for r, o in res.items()} for res in (got, want)]
        assert ids[0] == ids[1]
        check_idle(eng)
        check_idle(plain)
    finally:
        eng.close()
        if plain is not None:
            plain.close()


def test_a_dropped_engines_programs_are_freed():
    """JAX keeps a function object's compiled programs while it lives. The sampler programs were
    cached for good, and the page-table update jitted a module function: every shape an engine ever
    ran stayed compiled (~600 memory maps a slot count; a sweep over shapes ran into the kernel's map
    limit). Now they go with the last engine that holds them."""
    import gc
    import weakref

    from runtime.sampling import sampler_programs

    model = scaled_dummy(seed=0)
    engine = Engine(model, EngineConfig(**{**BASE, "warmup": False}))
    V, slots = model.config.vocab_size, engine.executor.slots
    pick = weakref.ref(sampler_programs(engine.config.max_logprobs, slots, V)["pick"].fn)
    pages = weakref.ref(engine.executor._set_pages.__wrapped__)
    assert pick() is not None and pages() is not None
    other = Engine(model, EngineConfig(**{**BASE, "warmup": False}))  # engines alive together share them
    assert sampler_programs(other.config.max_logprobs, slots, V)["pick"].fn is pick()
    engine.close(), other.close()
    del engine, other
    gc.collect()
    assert pick() is None and pages() is None
