"""Engine tests on the real stories260K (float32, CPU): exactness across batch compositions,
prefix caching, preemption and meshes; no compile after warmup; cancellation; no leaked pages.
(Which programs the executor runs -- bursts, the greedy head, decode-only programs -- is
tests/runtime/test_engine_programs.py; the shared helpers are tests/testing/engine.py.)

Near-ties: a request's logits differ by float reassociation between batch compositions (other
token counts change matmul blocking), so where the reference's top-2 logits are closer than
GAP the argmax may legitimately flip and the sequences diverge from there. The reference run
(each request alone) asks for the top-2 logprobs (their difference is the logit gap) and tokens
are compared strictly up to the first near-tie; a check that the comparisons cover most tokens
keeps this from going vacuous.
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from dataclasses import replace

import jax
import numpy as np
import pytest

from runtime.async_engine import AsyncEngine, EngineDeadError, GenerationRequest
from runtime.checkpoint import load_model
from runtime.compilation import BACKEND_COMPILE_EVENT
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime import replicas
from runtime.request import SamplingParams
from runtime.sampling import history_placeholder, sample_seed
from sharding.mesh import MeshConfig
from tests.testing.data import shared_data_dir
from tests.testing.engine import BASE, GAP, check_idle, first_near_tie, run_one, run_workload, scaled_dummy
from tests.testing.greedy import greedy_generate

VOCAB = 512


def test_random_model_batch_and_preemption_equal_alone():
    """Runs without the shared checkpoint: alone vs a random-arrival batch in a pool small enough
    to preempt, prefix caching on."""
    e = Engine(scaled_dummy(), EngineConfig(**{**BASE, "num_pages": 20, "watermark": 0.0, "seq_buckets": (8,)}))
    try:
        rng = np.random.default_rng()
        root = rng.integers(0, 256, 40).tolist()
        reqs = [(f"d{i}", root[: int(rng.integers(0, 40))] + rng.integers(0, 256, int(rng.integers(1, 30))).tolist(),
                 SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 40)))) for i in range(24)]
        alone = {rid: run_one(e, p, replace(sp, logprobs=2)) for rid, p, sp in reqs}
        results = run_workload(e, reqs)
        assert e.stats().num_preemptions > 0 and e.stats().prefix_cache_hit_tokens > 0
        assert_matches_alone(alone, results)
        with pytest.raises(ValueError, match="priority must be an int, got None"):  # (was a TypeError)
            e.add_request([1, 2], priority=None)
        assert not e.has_unfinished()
    finally:
        e.close()


@pytest.fixture(scope="module")
def model():
    return load_model(shared_data_dir() / "stories260k" / "stories260K.bin", dtype="float32", progress=False)


def make_engine(model, **overrides) -> Engine:
    return Engine(model, EngineConfig(**{**BASE, **overrides}))


@pytest.fixture(scope="module")
def engine(model):
    e = make_engine(model)
    yield e
    e.close()


@pytest.fixture(scope="module")
def workload():
    """32 greedy requests of mixed lengths; prompts share a few random roots (prefix-cache hits)."""
    rng = np.random.default_rng()
    roots = [rng.integers(3, VOCAB, int(n)).tolist() for n in rng.integers(16, 56, 3)]
    reqs = []
    for i in range(32):
        root = roots[i % 3][: int(rng.integers(0, 56))]
        prompt = root + rng.integers(3, VOCAB, int(rng.integers(1, 40))).tolist()
        reqs.append((f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 40)))))
    return reqs


@pytest.fixture(scope="module")
def alone(engine, workload):
    """Each request run alone, with top-2 logprobs for the near-tie check."""
    out = {}
    for rid, prompt, params in workload:
        out[rid] = run_one(engine, prompt, replace(params, logprobs=2))
    check_idle(engine)
    return out


def assert_matches_alone(alone, results):
    compared = total = 0
    for rid, ref in alone.items():
        r, g = ref.outputs[0], results[rid].outputs[0]
        j = first_near_tie(r)
        assert g.token_ids[:j] == r.token_ids[:j], f"{rid} diverges before any near-tie"
        if j == len(r.token_ids):
            assert g.token_ids == r.token_ids and g.finish_reason == r.finish_reason
        compared += j
        total += len(r.token_ids)
    assert compared >= 0.75 * total, f"only {compared} of {total} tokens were free of near-ties"


class CompileCounter:
    """Counts every backend compile in the process (any thread) while open."""

    def __init__(self):
        self.count = 0

    def __call__(self, event, duration, **kwargs):
        if event == BACKEND_COMPILE_EVENT:
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self)


def test_batch_equals_alone(engine, workload, alone):
    with CompileCounter() as compiles:
        results = run_workload(engine, workload)
    assert compiles.count == 0
    assert_matches_alone(alone, results)


def test_prefix_caching_off_equals_on(model, engine, workload, alone):
    before = engine.stats().prefix_cache_hit_tokens
    run_workload(engine, workload)
    assert engine.stats().prefix_cache_hit_tokens > before, "the workload never hit the prefix cache"
    off = make_engine(model, enable_prefix_caching=False)  # same shapes: reuses the compiled buckets
    try:
        results = run_workload(off, workload)
        assert off.stats().prefix_cache_hit_tokens == 0
    finally:
        off.close()
    assert_matches_alone(alone, results)


@pytest.fixture(scope="module")
def tiny(model):
    # 20 pages of 16 tokens: two long requests fill it, so decodes preempt one another.
    e = make_engine(model, num_pages=20, watermark=0.0)
    yield e
    e.close()


def test_preemption_equals_alone(tiny, workload, alone):
    results = run_workload(tiny, workload)
    assert tiny.stats().num_preemptions > 0, "the tiny pool never preempted"
    assert_matches_alone(alone, results)


@pytest.fixture(scope="module")
def bursts(model):
    e = make_engine(model, decode_steps=4)
    yield e
    e.close()


def test_bursts_equal_single_steps(bursts, workload, alone):
    """Decode bursts (4 model steps per program) give the tokens single steps give: in the mixed
    workload, and each request alone (where all of its decode runs in bursts but the tail)."""
    with CompileCounter() as compiles:
        results = run_workload(bursts, workload)
    assert compiles.count == 0
    assert_matches_alone(alone, results)
    ran = bursts.stats().num_bursts
    assert ran > 0, "the workload never ran a burst"
    solo = {rid: run_one(bursts, prompt, params) for rid, prompt, params in workload[:8]}
    assert bursts.stats().num_bursts > ran + 4
    assert_matches_alone({rid: alone[rid] for rid in solo}, solo)
    check_idle(bursts)


def test_bursts_stop_where_single_steps_stop(engine, bursts, workload):
    _, prompt, _ = workload[1]
    ref = run_one(engine, prompt, SamplingParams(temperature=0.0, max_tokens=30)).outputs[0].token_ids
    for k in range(1, 9):  # the prefill samples token 0; a burst then samples 1-4, the next 5-8
        stop = ref[k]
        first = ref.index(stop)
        out = run_one(bursts, prompt, SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop])).outputs[0]
        assert out.token_ids == ref[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop
    for n in (5, 6, 9):  # max_tokens inside a burst: the tokens past it are dropped
        out = run_one(bursts, prompt, SamplingParams(temperature=0.0, max_tokens=n)).outputs[0]
        assert out.token_ids == ref[:n] and out.finish_reason == "length"
    # up to max_model_len (256): the last burst's positions stop at the end of the page table
    long = (prompt * 16)[:245]
    want = run_one(engine, long, SamplingParams(temperature=0.0, max_tokens=11)).outputs[0].token_ids
    assert run_one(bursts, long, SamplingParams(temperature=0.0, max_tokens=11)).outputs[0].token_ids == want
    check_idle(bursts)


def test_bursts_sample_as_single_steps(engine, bursts, workload):
    """Seeded random sampling (the pick and pick_filtered bursts) draws the same tokens."""
    rng = np.random.default_rng()
    kinds = [dict(temperature=1.0), dict(temperature=0.8, top_k=20), dict(temperature=1.2, top_p=0.7),
             dict(temperature=0.9, min_p=0.1), dict(temperature=0.0)]
    reqs = [(rid, prompt, SamplingParams(seed=int(rng.integers(0, 2**62)), max_tokens=params.max_tokens + 8,
                                         **kinds[i % len(kinds)]))
            for i, (rid, prompt, params) in enumerate(workload[:10])]
    single = {rid: run_one(engine, prompt, params) for rid, prompt, params in reqs}
    before = bursts.stats().num_bursts
    for results in ({rid: run_one(bursts, prompt, params) for rid, prompt, params in reqs},
                    run_workload(bursts, reqs)):
        for rid, ref in single.items():
            assert results[rid].outputs[0].token_ids == ref.outputs[0].token_ids, rid
    assert bursts.stats().num_bursts > before


def sampled_workload(workload):
    rng = np.random.default_rng()
    kinds = [
        dict(temperature=1.0),
        dict(temperature=0.8, top_k=20),
        dict(temperature=1.2, top_p=0.7),
        dict(temperature=0.9, min_p=0.1),
        dict(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
        dict(temperature=0.0, frequency_penalty=1.0),
        dict(temperature=0.7, top_k=50, top_p=0.9, logprobs=3),
        dict(temperature=0.0, logprobs=5),
    ]
    out = []
    for i, (rid, prompt, params) in enumerate(workload[:16]):
        kw = kinds[i % len(kinds)]
        out.append((rid, prompt, SamplingParams(seed=int(rng.integers(0, 2**62)), max_tokens=params.max_tokens + 4, **kw)))
    return out


def test_seeded_sampling_alone_equals_batch_and_preempted(engine, tiny, workload):
    reqs = sampled_workload(workload)
    alone = {rid: run_one(engine, prompt, params) for rid, prompt, params in reqs}
    for eng in (engine, tiny):
        with CompileCounter() as compiles:  # every sampler program was compiled at warmup
            results = run_workload(eng, reqs)
        assert compiles.count == 0
        for rid, ref in alone.items():
            r, g = ref.outputs[0], results[rid].outputs[0]
            assert g.token_ids == r.token_ids, rid
            if r.logprobs is not None:
                assert [set(d) for d in g.logprobs] == [set(d) for d in r.logprobs]
    # Sampling is not greedy in disguise: two seeds of one prompt disagree somewhere.
    rid, prompt, params = reqs[0]
    other = run_one(engine, prompt, replace(params, seed=params.seed + 1, max_tokens=40))
    again = run_one(engine, prompt, replace(params, max_tokens=40))
    assert other.outputs[0].token_ids != again.outputs[0].token_ids


def test_n_samples_use_derived_seeds(engine, workload):
    _, prompt, _ = workload[0]
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, n=3)
    out = run_one(engine, prompt, params)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for i, c in enumerate(out.outputs):
        single = run_one(engine, prompt, replace(params, n=1, seed=sample_seed(1234, i)))
        assert c.token_ids == single.outputs[0].token_ids
    # the next seed's samples are not this request's shifted by one (seed + i made them so)
    nxt = run_one(engine, prompt, replace(params, seed=1235))
    assert nxt.outputs[0].token_ids != out.outputs[1].token_ids
    assert len({tuple(c.token_ids) for c in out.outputs + nxt.outputs}) == 6
    check_idle(engine)


def test_n_samples_aborted_before_their_fork_all_end(engine, workload):
    """A request of n aborted before its prompt step (its samples not forked yet) ends with n
    outputs, each aborted, as one aborted later does."""
    _, prompt, _ = workload[0]
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=12, n=3)
    rid = engine.add_request(prompt, params)
    assert engine.abort(rid)
    (out,) = [o for o in engine.step() if o.request_id == rid]
    assert out.finished and [(c.index, c.finish_reason, c.token_ids) for c in out.outputs] == [
        (0, "abort", []), (1, "abort", []), (2, "abort", [])]
    check_idle(engine)


def test_an_id_reused_after_an_abort_gets_both_final_outputs(engine, workload):
    """Engine frees an aborted request's id at once; a new request under it, aborted before the
    next step too, must not hide the first one's final output."""
    _, prompt, _ = workload[0]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine.add_request(prompt, params, request_id="x")
    engine.step()
    assert engine.abort("x")
    engine.add_request(prompt[:3], params, request_id="x")
    assert engine.abort("x")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [(o.request_id, len(o.prompt_token_ids), o.finished) for o in outs] == [
        ("x", len(prompt), True), ("x", 3, True)]
    check_idle(engine)


def test_sample_seeds():
    assert sample_seed(1234, 0) == 1234 and sample_seed(-3, 0) == -3
    seeds = {sample_seed(s, i) for s in range(64) for i in range(1, 9)}
    assert len(seeds) == 64 * 8 and not seeds & set(range(64))
    assert all(0 <= x < 2**64 for x in seeds)
    assert sample_seed(2**64 + 5, 3) == sample_seed(5, 3)  # seeds count mod 2**64, as split_seed reads them


def test_stop_token_ids_min_tokens_max_tokens(engine, workload):
    _, prompt, _ = workload[1]
    ref = run_one(engine, prompt, SamplingParams(temperature=0.0, max_tokens=30)).outputs[0].token_ids
    assert len(ref) == 30
    stop = ref[5]
    first = ref.index(stop)
    out = run_one(engine, prompt, SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop])).outputs[0]
    assert out.token_ids == ref[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop
    # min_tokens bans the stop ids for the first min_tokens tokens, so the stop comes later.
    banned = sorted(set(ref[:3]))
    out = run_one(engine, prompt, SamplingParams(temperature=0.0, max_tokens=30, min_tokens=3,
                                                 stop_token_ids=banned)).outputs[0]
    assert not set(out.token_ids[:3]) & set(banned)
    assert out.finish_reason == "length" or (out.token_ids[-1] in banned and len(out.token_ids) > 3)
    check_idle(engine)


def test_eos_min_tokens_and_ignore_eos(model, engine, workload):
    _, prompt, _ = workload[5]
    ref = run_one(engine, prompt, SamplingParams(temperature=0.0, max_tokens=30)).outputs[0].token_ids
    eos = ref[4]
    first = ref.index(eos)
    e = Engine(model, engine.config, eos_token_ids=[eos])  # same shapes and model: no new compile
    try:
        out = run_one(e, prompt, SamplingParams(temperature=0.0, max_tokens=30)).outputs[0]
        assert out.token_ids == ref[: first + 1] and out.finish_reason == "stop" and out.stop_reason is None
        out = run_one(e, prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)).outputs[0]
        assert out.token_ids == ref and out.finish_reason == "length"
        out = run_one(e, prompt, SamplingParams(temperature=0.0, max_tokens=30, min_tokens=first + 1)).outputs[0]
        assert eos not in out.token_ids[: first + 1] and len(out.token_ids) > first + 1
        check_idle(e)
    finally:
        e.close()


def test_lookahead_plans_before_tokens_are_known(engine, workload):
    """Decode steps are planned while the previous step's tokens are still on the device, with or
    without penalties, and with the min_tokens count (the plan's index of the token to sample, less
    the prompt) already including them."""
    _, prompt, _ = workload[1]
    sched, packer, seen = engine.scheduler, engine.packer, []

    def pack(plan, sampling):
        for s in plan.seqs:
            if s.sample:
                req = sched.get_request(s.request_id)
                seen.append((sched.awaiting_tokens, s.num_computed_after - len(prompt) == req.num_output_tokens))
        return type(packer).pack(packer, plan, sampling)

    packer.pack = pack
    try:
        for params in (SamplingParams(temperature=0.0, max_tokens=20, min_tokens=8, stop_token_ids=[1, 2]),
                       SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.3)):
            seen.clear()
            run_one(engine, prompt, params)
            assert all(counted for _, counted in seen) and len(seen) == 20
            assert sum(ahead for ahead, _ in seen) == 19  # every step but the prefill
    finally:
        del packer.pack
    check_idle(engine)


def test_penalties_match_a_plain_loop(model, engine, workload):
    """Greedy decoding with all three penalties through the engine, where each step's history ends
    in a placeholder for the token still on the device, equals a plain loop: the penalties applied
    in numpy (float64) to the plain model's logits (tests/testing/greedy.py) after the prompt and
    each earlier output. Compared up to the first step whose two best penalized logits are within
    GAP (a near-tie)."""
    _, words, _ = workload[2]
    # The model's own continuation in the prompt: its favourite next tokens are then often ones it
    # has seen (after random ids alone they rarely are, and the penalties would change nothing).
    prompt = words + greedy_generate(model, words, 24).tokens
    rep, pres, freq, n = 1.8, 1.5, 2.0, 16  # strong enough to change tokens of a model with logit std ~8
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, repetition_penalty=rep,
                            presence_penalty=pres, frequency_penalty=freq)
    packer, histories = engine.packer, []

    def pack(plan, sampling):
        out = type(packer).pack(packer, plan, sampling)
        histories.append(out.history[0].copy())
        return out

    packer.pack = pack
    try:
        got = run_one(engine, prompt, params).outputs[0].token_ids
    finally:
        del packer.pack
    # What each step's penalize program read: the prompt and every earlier output, the last of them
    # (after the prefill) still on the device, as a placeholder for row 0 of the previous step.
    assert len(histories) == n
    for j, h in enumerate(histories):
        want = prompt + got[:j]
        if j:
            assert h[len(want) - 1] == history_placeholder(-1), j
            h[len(want) - 1] = got[j - 1]
        assert h[: len(want)].tolist() == want and (h[len(want):] == -1).all(), j
    # One causal prefill of the prompt and the engine's outputs gives, at the prompt's last position
    # plus j, the logits after prompt + got[:j]: the loop's own history for as long as it agrees.
    plain = greedy_generate(model, prompt + got[:-1], 1).prompt_logits[len(prompt) - 1:].astype(np.float64)
    seq, changed = list(prompt), 0
    for j in range(n):
        x = plain[j].copy()
        raw_best = int(x.argmax())
        outputs = seq[len(prompt):]
        for t in set(seq):
            x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
        for t in set(outputs):
            x[t] -= freq * outputs.count(t) + pres
        top2 = np.sort(x)[-2:]
        if top2[1] - top2[0] < GAP:
            break
        tok = int(x.argmax())
        changed += tok != raw_best
        assert got[j] == tok, (j, got, seq[len(prompt):])
        seq.append(tok)
    assert changed, "the penalties never changed a token: the test does not test them"
    check_idle(engine)


def test_partial_false_returns_only_finished_outputs_with_all_their_tokens(engine, workload):
    (_, p1, _), (_, p2, _) = workload[1], workload[2]
    ref = [run_one(engine, p, SamplingParams(temperature=0.0, max_tokens=n)).outputs[0].token_ids
           for p, n in ((p1, 5), (p2, 12))]
    a = engine.add_request(p1, SamplingParams(temperature=0.0, max_tokens=5))
    b = engine.add_request(p2, SamplingParams(temperature=0.0, max_tokens=12))
    seen = []
    while engine.has_unfinished():
        seen += engine.step(partial=False)
    assert [o.request_id for o in seen] == [a, b] and all(o.finished for o in seen)
    for o, want in zip(seen, ref):  # the deltas cover everything, as no earlier output was built
        assert o.outputs[0].token_ids == o.outputs[0].new_token_ids == want
    check_idle(engine)


def test_max_logprobs_past_the_vocabulary_is_refused(model):
    """A cap over the vocabulary (512 ids) made the first logprobs step fail inside the device call
    (a top-k wider than the logits), with the KV pool donated: the engine was unusable after it."""
    with pytest.raises(ValueError, match="max_logprobs 513 exceeds the model's vocabulary of 512 ids"):
        make_engine(model, max_logprobs=513, warmup=False)


def test_a_step_that_compiled_after_warmup_keeps_its_outputs_for_the_next_call(engine, monkeypatch):
    """strict_compile raises CompileAfterWarmupError after the step ran: its outputs were lost (a
    request's final output among them, so its caller never saw it end). The next call returns them."""
    from runtime.compilation import CompileAfterWarmupError

    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    want = run_one(engine, [5, 6, 7], params).outputs[0].token_ids
    emit = engine._emit

    def compiling_emit(partial):
        outs = emit(partial)
        if any(o.finished for o in outs):
            engine._watcher.count += 1  # as if a program compiled during this call
        return outs

    monkeypatch.setattr(engine, "_emit", compiling_emit)
    rid = engine.add_request([5, 6, 7], params)
    finals, raised = [], 0
    while engine.has_unfinished():
        try:
            finals += [o for o in engine.step() if o.finished]
        except CompileAfterWarmupError:
            raised += 1
    monkeypatch.undo()
    assert raised == 1 and [(o.request_id, o.outputs[0].token_ids) for o in finals] == [(rid, want)]
    engine.executor.num_compiles_after_warmup -= 1  # (the simulated one)
    check_idle(engine)


def test_rejects_requests_that_can_never_run(engine):
    with pytest.raises(ValueError, match=r"250 tokens \+ max_tokens 10 = 260 tokens; max_model_len is 256"):
        engine.add_request([5] * 250, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="logprobs 21 exceeds max_logprobs 20"):
        engine.add_request([5], SamplingParams(logprobs=21))
    with pytest.raises(ValueError, match="token id 512 is out of range; the vocabulary has 512"):
        engine.add_request([5, 512], SamplingParams())
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.add_request([5], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="logit_bias token id 600 is out of range; the vocabulary has 512"):
        engine.add_request([5], SamplingParams(logit_bias={3: 1.0, 600: -1.0}))
    with pytest.raises(ValueError, match="needs a tokenizer"):
        engine.add_request("hello", SamplingParams())
    assert not engine.has_unfinished()


@pytest.mark.parametrize("which", ["engine", "bursts"])
def test_cancel_frees_pages_immediately(which, request, workload):
    engine = request.getfixturevalue(which)
    alloc = engine.scheduler.allocator
    params = SamplingParams(temperature=0.0, max_tokens=100)
    ids = [engine.add_request(workload[i][1], params) for i in range(3)]
    for _ in range(4):
        engine.step()
    victim = engine.scheduler.get_request(engine._groups[ids[1]].seqs[0].sid)
    pages = list(victim.pages)
    assert pages and victim.num_output_tokens > 0
    referenced = alloc.num_referenced
    assert engine.abort(ids[1])
    own = [p for p in pages if alloc.refcount(p) == 0]
    assert own and alloc.num_referenced == referenced - len(own)  # released before the next step
    outs = {o.request_id: o for o in engine.step()}
    assert outs[ids[1]].finished and outs[ids[1]].outputs[0].finish_reason == "abort"
    assert not engine.abort(ids[1])
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().num_aborted >= 1
    check_idle(engine)


class _Node:
    pass


def test_async_engine_streams_and_cancels(engine, workload):
    async def main():
        # Garbage in a cycle when the loop starts is collected before the heap is frozen for the
        # loop's lifetime, not kept until shutdown (automatic collections are off meanwhile).
        node = _Node()
        node.self = node
        dead = weakref.ref(node)
        del node
        ae = AsyncEngine(engine)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=30)
            full = ae.submit(GenerationRequest(prompt_token_ids=workload[2][1], sampling_params=params))
            cancelled = ae.submit(GenerationRequest(prompt_token_ids=workload[3][1], sampling_params=params,
                                                    request_id="to-cancel"))
            dropped = ae.submit(GenerationRequest(prompt_token_ids=workload[4][1], sampling_params=params))
            seen = []
            async for out in cancelled:
                seen.append(out)
                if len(seen) == 2:
                    ae.cancel("to-cancel")
            assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"
            assert len(seen[-1].outputs[0].token_ids) < 30
            async for out in dropped:  # a client that goes away: closing the stream cancels it
                break
            await dropped.aclose()
            streamed = []
            async for out in full:
                streamed.extend(out.outputs[0].new_token_ids)
            assert out.finished and streamed == out.outputs[0].token_ids and len(streamed) == 30
            # Commands run in order: once this later request is done, the drop was processed.
            await drain(ae.submit(GenerationRequest(prompt_token_ids=[7, 8, 9], sampling_params=params)))
            stats = ae.stats()
            assert stats.num_aborted >= 2 and stats.num_running == 0
            assert gc.get_freeze_count() > 0  # the loop runs with the heap it started on frozen
            assert dead() is None
            assert ae.health().healthy
            with pytest.raises(ValueError, match="max_model_len is 256"):
                ae.submit(GenerationRequest(prompt_token_ids=[5] * 300, sampling_params=params))
        finally:
            ae.shutdown()
        assert not ae.health().running
        assert gc.get_freeze_count() == 0  # and gives it back when it stops

    gc.disable()
    try:
        asyncio.run(main())
    finally:
        gc.enable()
    check_idle(engine)


def test_async_engine_lets_go_of_unread_streams_and_ends_requests_at_shutdown(engine, workload):
    """A stream closed or dropped before it is first read aborts its request; shutdown aborts the
    requests whose streams it ends, so the engine serves a new AsyncEngine (the same ids too)."""
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)

    async def main():
        ae = AsyncEngine(engine)
        try:
            aborted = ae.stats().num_aborted
            closed = ae.submit(GenerationRequest(prompt_token_ids=workload[2][1], sampling_params=params))
            await closed.aclose()
            dropped = ae.submit(GenerationRequest(prompt_token_ids=workload[3][1], sampling_params=params))
            del dropped
            # commands run in order: once this later request is done, both were let go of
            await drain(ae.submit(GenerationRequest(prompt_token_ids=[7, 8, 9],
                                                    sampling_params=replace(params, max_tokens=2))))
            assert ae.stats().num_aborted == aborted + 2
            left = ae.submit(GenerationRequest(prompt_token_ids=workload[4][1], sampling_params=params,
                                               request_id="r"))
            assert not (await left.__anext__()).finished
        finally:
            ae.shutdown()
        with pytest.raises(EngineDeadError):
            async for _ in left:
                pass
        assert not engine.has_unfinished()
        again = AsyncEngine(engine)
        try:
            out = await drain(again.submit(GenerationRequest(prompt_token_ids=workload[4][1], sampling_params=params,
                                                             request_id="r")))
            assert len(out.outputs[0].token_ids) == 60
        finally:
            again.shutdown()

    asyncio.run(asyncio.wait_for(main(), 120))
    check_idle(engine)


def test_async_engine_request_ids_and_bad_requests(engine, workload):
    """A stream that goes away aborts only its own request, not a later one that reuses its id; ids
    the engine picks skip ids callers chose; a bad field fails its submit, not the engine loop; a
    submit that meets a shutdown gets EngineDeadError rather than a stream that never ends."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompt = workload[2][1]

    async def main():
        ae = AsyncEngine(engine)
        try:
            old = ae.submit(GenerationRequest(prompt_token_ids=prompt, sampling_params=replace(params, max_tokens=3),
                                              request_id="r"))
            await old.__anext__()  # one output read; then the request finishes in the engine
            while ae.health().num_unfinished:
                await asyncio.sleep(0.005)
            new = ae.submit(GenerationRequest(prompt_token_ids=prompt, sampling_params=params, request_id="r"))
            await old.aclose()  # the old client goes away without reading its last output
            last = await drain(new)
            assert (last.outputs[0].finish_reason, len(last.outputs[0].token_ids)) == ("length", 30)
            chosen = ae.submit(GenerationRequest(prompt_token_ids=prompt, sampling_params=params, request_id="async-0"))
            picked = ae.submit(GenerationRequest(prompt_token_ids=prompt, sampling_params=params))
            assert picked.request_id not in ("async-0", "r")
            picked.cancel()
            assert (await drain(picked)).outputs[0].finish_reason == "abort"
            assert (await drain(chosen)).outputs[0].finish_reason == "length"
            for bad, needle in ((dict(priority=None), "priority must be an int"),
                                (dict(cache_salt=5), "cache_salt must be a string"),
                                (dict(request_id=7), "request_id must be a string")):
                with pytest.raises(ValueError, match=needle):
                    ae.submit(GenerationRequest(prompt_token_ids=prompt, sampling_params=params, **bad))
            with pytest.raises(ValueError, match=r"^prompt has \d+ tokens \+ max_tokens"):  # (it named request '')
                ae.submit(GenerationRequest(prompt_token_ids=prompt, sampling_params=replace(params, max_tokens=10**6)))
            with pytest.raises(TypeError, match="sampling_params is dict, not SamplingParams"):
                ae.submit(GenerationRequest(prompt_token_ids=prompt, sampling_params={"max_tokens": 3}))
            default = ae.submit(GenerationRequest(prompt_token_ids=prompt, sampling_params=None))  # the defaults
            assert len((await drain(default)).outputs[0].token_ids) <= SamplingParams().max_tokens
            assert ae.health().healthy
            # a request that fails to queue for a reason no check foresaw fails its own stream alone
            add = engine.add_request

            def broken_add(ids, p, **kw):
                if kw["request_id"] == "broken":
                    raise OverflowError("a value no check bounded")
                return add(ids, p, **kw)

            engine.add_request = broken_add
            try:
                broken = ae.submit(GenerationRequest(prompt_token_ids=prompt, sampling_params=params,
                                                     request_id="broken"))
                fine = ae.submit(GenerationRequest(prompt_token_ids=prompt, sampling_params=params))
                with pytest.raises(OverflowError, match="no check bounded"):
                    await drain(broken)
                assert (await drain(fine)).outputs[0].finish_reason == "length"
            finally:
                del engine.add_request
            assert ae.health().healthy
        finally:
            ae.shutdown()

        ae = AsyncEngine(engine)
        prepare = engine.prepare_prompt

        def shut_down_meanwhile(p):  # the engine shuts down while a submit tokenizes
            ae.shutdown()
            return prepare(p)

        engine.prepare_prompt = shut_down_meanwhile
        try:
            with pytest.raises(EngineDeadError, match="shut down"):
                ae.submit(GenerationRequest(prompt_token_ids=prompt, sampling_params=params))
        finally:
            del engine.prepare_prompt
        assert ae.health().num_unfinished == 0

    asyncio.run(asyncio.wait_for(main(), 120))
    check_idle(engine)


def test_new_request_id_skips_live_ids():
    import itertools

    from runtime.request import new_request_id

    counter = itertools.count()
    assert [new_request_id("req-", counter, {"req-1", "req-2"}) for _ in range(2)] == ["req-0", "req-3"]


async def drain(stream):
    last = None
    async for last in stream:
        pass
    return last


def test_prefix_cache_cuts_prefill_on_shared_prefix(engine):
    rng = np.random.default_rng()
    prefix = rng.integers(3, VOCAB, 144).tolist()  # 9 full pages: 90% of each 160-token prompt
    reqs = [(f"p{i}", prefix + rng.integers(3, VOCAB, 16).tolist(), SamplingParams(temperature=0.0, max_tokens=2))
            for i in range(32)]
    before = engine.stats()
    results = run_workload(engine, reqs)
    after = engine.stats()
    cached = [o.num_cached_tokens for o in results.values()]
    assert max(cached) == 144 and cached.count(144) >= 24
    prompt = after.prompt_tokens - before.prompt_tokens
    computed = after.prefill_tokens - before.prefill_tokens
    assert prompt == 32 * 160
    assert 1 - computed / prompt >= 0.85, f"computed {computed} of {prompt} prompt tokens"


def test_a_prompt_with_n_sequences_counts_once_in_the_prefix_cache_stats(engine):
    """n > 1: the forks share the prompt's pages; the stats count the prompt once, so the hits are
    the response's cached_tokens, cold (none) and warm (every full page)."""
    G = engine.config.page_size
    prompt = np.random.default_rng().integers(3, VOCAB, 6 * G + 4).tolist()
    for rid, cached in (("cold", 0), ("warm", 6 * G)):
        before = engine.stats()
        out = run_workload(engine, [(rid, prompt, SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=2))])[rid]
        after = engine.stats()
        assert len(out.outputs) == 3 and out.num_cached_tokens == cached
        assert after.prefix_cache_query_tokens - before.prefix_cache_query_tokens == len(prompt)
        assert after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens == cached


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")
@pytest.mark.parametrize("replica,tensor", [(1, 2), (2, 1)])
def test_mesh_equals_single_device(workload, alone, replica, tensor):
    mesh = MeshConfig(replica=replica, tensor=tensor).make_mesh()
    m = load_model(shared_data_dir() / "stories260k" / "stories260K.bin", mesh=mesh, dtype="float32", progress=False)
    if tensor > 1:
        assert m.params["layers"][0]["mlp"]["gate_up_proj"][...].sharding.spec[2] == "tensor"
    cfg = EngineConfig(**{**BASE, "token_buckets": (64,), "seq_buckets": (8,), "mesh": MeshConfig(replica, tensor)})
    e = replicas.make_engine(m, cfg)
    try:
        engines = getattr(e, "replicas", [e])
        assert len(engines) == replica  # one engine per replica, each on its own devices
        assert len({d for x in engines for d in x.kv_pages[0].devices()}) == replica * tensor
        if tensor > 1:
            assert e.kv_pages[0].sharding.spec[2] == "tensor"
        sub = workload[:12]
        results = run_workload(e, sub)
        assert all(x.stats().num_requests > 0 for x in engines)
    finally:
        e.close()
    assert_matches_alone({rid: alone[rid] for rid, _, _ in sub}, results)
