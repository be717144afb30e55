"""Replica parallelism (runtime/replicas.py): one engine per replica of the mesh, driven as one engine.

That replicated engines give a single device's greedy tokens (tensor=2 inside a replica too) is
test_engine.py::test_mesh_equals_single_device; on two GPUs, test_engine_gpu.py."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import jax
import numpy as np
import pytest

from runtime.async_engine import AsyncEngine, GenerationRequest
from runtime.checkpoint import load_model
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.llm import LLM
from runtime.replicas import ReplicatedEngine, make_engine
from runtime.request import SamplingParams
from sharding.mesh import MeshConfig
from tests.testing.data import shared_data_dir
from tests.testing.engine import BASE, FailingExecutor, check_idle, run_one

pytestmark = pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 (fake) devices")

VOCAB = 512  # stories260K


@pytest.fixture(scope="module")
def model2():
    mesh = MeshConfig(replica=2).make_mesh()
    return load_model(shared_data_dir() / "stories260k" / "stories260K.bin", mesh=mesh, dtype="float32",
                      progress=False)


@pytest.fixture(scope="module")
def engine2(model2):
    e = make_engine(model2, EngineConfig(**BASE, mesh=MeshConfig(replica=2), seed=7))
    assert isinstance(e, ReplicatedEngine) and e.num_replicas == 2
    assert e.config.seed == 7 and len({r.config.seed for r in e.replicas} | {7}) == 3  # (the replicas' derived)
    yield e
    e.close()


def _prompts(n, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, int(rng.integers(2, 50))).tolist() for _ in range(n)]


def test_views_share_the_weights(model2):
    """Each replica's model lives on its own device and holds the loaded arrays' own buffers."""
    views = model2.replica_views()
    assert [list(v.mesh.devices.flat) for v in views] == [[d] for d in model2.mesh.devices.flat]
    for view in views:
        (device,) = view.mesh.devices.flat
        for x, y in zip(jax.tree.leaves(model2.params), jax.tree.leaves(view.params)):
            assert y.devices() == {device} and y.shape == x.shape
            (orig,) = [s.data for s in x.addressable_shards if s.device == device]
            assert y.addressable_shards[0].data.unsafe_buffer_pointer() == orig.unsafe_buffer_pointer()
    with pytest.raises(ValueError, match="make_engine"):
        Engine(model2, EngineConfig(**BASE, warmup=False))


def test_requests_spread_over_replicas_and_abort_where_they_run(engine2):
    before = [e.stats().num_requests for e in engine2.replicas]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ids = [engine2.add_request(p, params) for p in _prompts(6, 1)]
    assert len(set(ids)) == 6
    assert [e.stats().num_requests - b for e, b in zip(engine2.replicas, before)] == [3, 3]  # least loaded first
    with pytest.raises(ValueError, match="already live"):
        engine2.add_request([5, 6, 7], params, request_id=ids[0])
    # checked as Engine.add_request checks them (priority was cast by int(), a salt of 5 an AttributeError)
    for kw, needle in ((dict(priority=1.5), "priority must be an int"), (dict(priority=True), "priority must be an int"),
                       (dict(cache_salt=5), "cache_salt must be a string or None")):
        with pytest.raises(ValueError, match=needle):
            engine2.add_request([5, 6, 7], params, **kw)
    assert engine2.abort(ids[1]) and engine2.abort(ids[4])  # one on each replica
    assert not engine2.abort("no-such-request")
    finals = {}
    while engine2.has_unfinished():
        for o in engine2.step():
            if o.finished:
                finals[o.request_id] = o
    assert sorted(finals) == sorted(ids)
    for rid in ids:
        reason = finals[rid].outputs[0].finish_reason
        assert reason == ("abort" if rid in (ids[1], ids[4]) else "length")
    check_idle(engine2)
    assert engine2.stats().num_aborted >= 2


def test_routing_weighs_requests_by_their_sequences(engine2):
    """Requests of n = 4, 1, 4, 1 went 0, 1, 0, 1 (counted as requests): 8 sequences on one replica,
    2 on the other. Counted by sequences they balance, 5 and 5."""
    ids = [engine2.add_request(p, SamplingParams(max_tokens=2, n=n, seed=1))
           for p, n in zip(_prompts(4, 7), (4, 1, 4, 1))]
    assert [engine2.replicas.index(engine2._where[r]) for r in ids] == [0, 1, 1, 0]
    assert [e.num_live_sequences() for e in engine2.replicas] == [5, 5]
    while engine2.has_unfinished():
        engine2.step()
    check_idle(engine2)


def test_an_id_reused_after_an_abort_gets_both_final_outputs(engine2):
    """As on one Engine: an aborted id is free at once, wherever the new request runs (the mapping
    stayed until the next step: 'already live'), and the old request's final output does not
    unmap the new one."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine2.add_request([5, 6, 7], params, request_id="x")
    engine2.step()
    assert engine2.abort("x")
    engine2.add_request([8, 9], params, request_id="x")
    finals = [(o.request_id, len(o.prompt_token_ids)) for o in engine2.step() if o.finished]
    assert finals == [("x", 3)] and engine2.abort("x")  # the second was still live, under the same id
    while engine2.has_unfinished():
        finals += [(o.request_id, len(o.prompt_token_ids)) for o in engine2.step() if o.finished]
        engine2.check_invariants()
    assert finals == [("x", 3), ("x", 2)]
    check_idle(engine2)


def test_outputs_survive_an_exception_in_a_later_replicas_step(engine2):
    """Ctrl-C while replica 1 waits for the device: what replica 0 gave in that call comes out of
    the next one (they were dropped: a token lost from a stream, or a final output and the id mapped
    for good)."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, output_kind="delta")
    a = engine2.add_request([5, 6, 7], params)
    b = engine2.add_request([8, 9, 10, 11], params)
    assert [engine2._where[r] for r in (a, b)] == engine2.replicas
    r1, calls = engine2.replicas[1], []

    def interrupted():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return type(r1)._finish_inflight(r1)

    r1._finish_inflight = interrupted
    seen = {a: [], b: []}
    try:
        while engine2.has_unfinished():
            try:
                outs = engine2.step()
            except KeyboardInterrupt:
                continue
            for o in outs:
                seen[o.request_id] += o.outputs[0].new_token_ids
            engine2.check_invariants()
    finally:
        del r1._finish_inflight
    want = {r: run_one(engine2, p, replace(params, output_kind="cumulative")).outputs[0].token_ids
            for r, p in ((a, [5, 6, 7]), (b, [8, 9, 10, 11]))}
    assert len(calls) > 3 and seen == want
    check_idle(engine2)


def test_a_replica_whose_step_fails_drops_only_its_own_requests(engine2, monkeypatch):
    """An Exception from replica 1's step (its program failed after taking its KV pool): replica 1
    drops its requests (Engine, Failures) and the ReplicatedEngine their ids; replica 0's request
    runs on to its tokens, and the engine takes new requests."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [run_one(engine2, p, params).outputs[0].token_ids for p in ([5, 6, 7], [8, 9, 10, 11])]
    a = engine2.add_request([5, 6, 7], params)
    b = engine2.add_request([8, 9, 10, 11], params)
    r1 = engine2.replicas[1]
    assert engine2._where[b] is r1
    monkeypatch.setattr(r1, "executor", FailingExecutor(r1.executor, "pool consumed"))
    with pytest.raises(RuntimeError, match="injected"):
        engine2.step()
    monkeypatch.undo()
    assert not r1.is_live(b) and b not in engine2._where and engine2._where[a] is engine2.replicas[0]
    engine2.check_invariants()
    finals = {}
    while engine2.has_unfinished():
        finals.update((o.request_id, o.outputs[0].token_ids) for o in engine2.step() if o.finished)
    assert finals == {a: want[0]}
    assert run_one(engine2, [8, 9, 10, 11], params).outputs[0].token_ids == want[1]
    check_idle(engine2)


def test_the_async_engine_over_replicas_after_a_failed_step_and_after_its_loop_died(engine2, monkeypatch):
    """A step that fails on replica 1 ends replica 1's streams only (EngineStepError); replica 0's
    request runs on. A loop that dies (here: an interrupt that is no Exception) aborts the requests
    every replica holds: its clean-up skipped the aborts after an error, as if the engine had
    dropped every request, so replica 0's stayed live and mapped, and a new AsyncEngine's request of
    the same id was refused ("already live")."""
    from runtime.async_engine import EngineDeadError, EngineStepError

    real = engine2.replicas[1].executor
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def run(ids):
        ae = AsyncEngine(engine2, start=False)
        try:  # (both queued before the loop starts: one on each replica)
            streams = [ae.submit(GenerationRequest(prompt_token_ids=[5 + i, 6], sampling_params=params, request_id=r))
                       for i, r in enumerate(ids)]
            ae._thread.start()
            results = []
            for st in streams:
                try:
                    async for last in st:
                        pass
                    results.append(last.outputs[0].finish_reason)
                except (EngineDeadError, EngineStepError) as e:
                    results.append(type(e).__name__)
            return results
        finally:
            ae.shutdown()

    want = ["length", "length"]
    for error, results in ((RuntimeError("injected"), ["length", "EngineStepError"]),
                           (KeyboardInterrupt(), ["EngineDeadError", "EngineDeadError"])):
        monkeypatch.setattr(engine2.replicas[1], "executor", FailingExecutor(real, "raise", times=1, error=error))
        assert asyncio.run(run(["x0", "x1"])) == results
        monkeypatch.undo()
        assert not engine2.has_unfinished() and not engine2._where
        engine2.check_invariants()
        assert asyncio.run(run(["x0", "x1"])) == want
    check_idle(engine2)


def test_unseeded_requests_draw_different_seeds_on_each_replica(engine2):
    """Each replica's generator is seeded apart: the first unseeded request of each one does not
    sample the same tokens (they would, with both generators seeded from EngineConfig.seed alone)."""
    params = SamplingParams(temperature=1.5, max_tokens=24, ignore_eos=True)
    prompt = _prompts(1, 2)[0]
    fresh = make_engine(engine2.model, EngineConfig(**BASE, mesh=MeshConfig(replica=2)))
    try:
        a, b = fresh.add_request(prompt, params), fresh.add_request(prompt, params)
        finals = {}
        while fresh.has_unfinished():
            finals.update({o.request_id: o for o in fresh.step() if o.finished})
        assert [e.stats().num_requests for e in fresh.replicas] == [1, 1]
        assert finals[a].outputs[0].token_ids != finals[b].outputs[0].token_ids
        check_idle(fresh)
    finally:
        fresh.close()


def test_llm_generate_on_replicas_gives_each_request_its_own_tokens(engine2):
    prompts = _prompts(10, 3)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    before = [e.stats().num_requests for e in engine2.replicas]
    outs = LLM.from_engine(engine2).generate(prompts, params, use_tqdm=False)
    assert [e.stats().num_requests - b for e, b in zip(engine2.replicas, before)] == [5, 5]
    alone = [run_one(engine2.replicas[0], p, params) for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]
    assert [o.prompt_token_ids for o in outs] == prompts
    check_idle(engine2)


def test_async_engine_streams_and_cancels_on_replicas(engine2):
    async def main():
        ae = AsyncEngine(engine2)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
            streams = [ae.submit(GenerationRequest(prompt_token_ids=p, sampling_params=params, request_id=f"a{i}"))
                       for i, p in enumerate(_prompts(4, 4))]

            async def drain(stream, cancel=None):
                last = None
                async for last in stream:
                    if cancel:
                        ae.cancel(cancel)
                        cancel = None
                return last

            finals = await asyncio.gather(*(drain(s, "a3" if i == 3 else None) for i, s in enumerate(streams)))
        finally:
            ae.shutdown()
        return finals

    finals = asyncio.run(main())
    reasons = [f.outputs[0].finish_reason for f in finals]
    assert reasons[:3] == ["length"] * 3 and reasons[3] == "abort"
    assert all(len(f.outputs[0].token_ids) == 40 for f in finals[:3])
    check_idle(engine2)


def test_serving_core_reports_every_replicas_capacity(engine2):
    from serving.config import ServerConfig
    from serving.core import ServingCore

    core = ServingCore(ServerConfig(), "stories")
    core.attach(AsyncEngine(engine2, start=False))
    info, cfg = core.model_info, engine2.config
    assert (info.max_num_seqs, info.num_pages) == (2 * cfg.max_num_seqs, 2 * cfg.num_pages)
    assert info.eos_token_ids == engine2.replicas[0].eos_ids and info.vocab_size == VOCAB


def test_a_prompt_returns_to_the_replica_that_cached_its_prefix(engine2):
    """A follow-up prompt (a chat's next turn) goes to the replica whose prefix cache holds its
    history, even when the least loaded replica is another."""
    G = engine2.config.page_size
    rng = np.random.default_rng(6)
    history = rng.integers(3, VOCAB, 3 * G + 5).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def run(*ids):
        finals = {}
        while engine2.has_unfinished():
            finals.update({o.request_id: o for o in engine2.step() if o.finished})
        return [finals[i] for i in ids]

    before = [e.stats().num_requests for e in engine2.replicas]
    busy = engine2.add_request(rng.integers(3, VOCAB, 20).tolist(), params)  # both idle: replica 0
    first = engine2.add_request(history, params)  # the less loaded: replica 1
    run(busy, first)
    assert [e.stats().num_requests - b for e, b in zip(engine2.replicas, before)] == [1, 1]
    assert [e.cached_prefix_tokens(history) for e in engine2.replicas] == [0, 3 * G]
    # both idle again, so by load alone replica 0 would take the next turn
    (follow,) = run(engine2.add_request(history + rng.integers(3, VOCAB, 7).tolist(), params))
    assert follow.num_cached_tokens == 3 * G
    assert [e.stats().num_requests - b for e, b in zip(engine2.replicas, before)] == [1, 2]
    run(engine2.add_request(history, params, cache_salt="tenant"))  # salted: no hit, so the load decides
    assert [e.stats().num_requests - b for e, b in zip(engine2.replicas, before)] == [2, 2]
    # the replica with the history max_num_seqs requests busier than the other: the load decides
    busy = [engine2.replicas[1].add_request(rng.integers(3, VOCAB, 9).tolist(), params)
            for _ in range(engine2.config.max_num_seqs)]
    (again,) = run(engine2.add_request(history, params), *busy)[:1]
    assert again.num_cached_tokens == 0
    assert [e.stats().num_requests - b for e, b in zip(engine2.replicas, before)] == [3, 2 + len(busy)]
    check_idle(engine2)
