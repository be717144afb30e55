"""Failures inside a step (runtime/engine.py, module docstring, Failures): a step that raises drops
the engine's requests and leaves it usable; an interrupt is carried on only where it lands in a
wait; the async engine ends the dropped requests' streams and serves on, and dies when the next
step fails too. On the real stories260K with its tokenizer."""

from __future__ import annotations

import asyncio

import jax
import pytest

from runtime.async_engine import AsyncEngine, EngineDeadError, EngineStepError, GenerationRequest
from runtime.llm import SamplingParams
from tests.testing.engine import STORY_PROMPTS as PROMPTS
from tests.testing.engine import FailingExecutor


@pytest.mark.parametrize("how", ["pool consumed", "page table consumed", "tokens unreadable"])
def test_a_step_that_fails_every_time_leaves_the_llm_usable(llm, monkeypatch, how):
    """A step that raises an Exception (not an interrupt) drops the live requests and the prefix
    cache, and remakes a KV pool or page table the failed call consumed. The next step re-ran the same plan, which
    failed again for good: the LLM's own clean-up raised, and every later call found the engine busy
    ("unfinished requests") or its pool deleted."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    before = engine.stats()
    failing = FailingExecutor(engine.executor, how)
    monkeypatch.setattr(engine, "executor", failing)
    with pytest.raises(RuntimeError, match="injected") as info:
        llm.generate([f"{p} again" for p in PROMPTS], params)
    assert info.value.__context__ is None  # (the clean-up raised nothing of its own)
    assert not engine.has_unfinished() and engine.scheduler.allocator.num_cached == 0
    engine.check_invariants()
    failing.failing = False
    assert not any(a.is_deleted() for a in jax.tree.leaves(engine.kv_pages))
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == want
    after = engine.stats()
    assert after.num_aborted == before.num_aborted + len(PROMPTS)
    assert after.prefix_cache_query_tokens > before.prefix_cache_query_tokens  # (the counts carry on)
    engine.check_invariants()


def _interrupt_the_third_call(monkeypatch, engine, where: str) -> None:
    """Ctrl-C as the third call of `where` ("scheduler.NAME" or "Engine.NAME") returns."""
    owner, name = where.split(".")
    target = engine.scheduler if owner == "scheduler" else engine
    real, calls = getattr(target, name), []

    def interrupted(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(target, name, interrupted)


@pytest.mark.parametrize("where", ["scheduler.step", "scheduler.resolve", "scheduler.update_from_output",
                                   "Engine._emit"])
def test_ctrl_c_inside_the_hosts_bookkeeping_drops_the_engines_requests(llm, monkeypatch, where):
    """Ctrl-C just after the scheduler planned, resolved or applied a step, or while outputs were
    built: that work is half done and cannot be carried on. The engine dropped a plan it had not
    seen (the next call raised "step N is outstanding", or "plan N is not the outstanding plan"),
    lost tokens taken off its list (outputs a token short; a request left live with no sequence,
    so LLM's clean-up stepped for ever) and LLM's clean-up raised an error of its own in place of
    the interrupt. Now it drops its requests, as after a failed step, and the interrupt comes out."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    _interrupt_the_third_call(monkeypatch, engine, where)
    with pytest.raises(KeyboardInterrupt) as info:
        llm.generate(PROMPTS, params)
    assert info.value.__context__ is None
    monkeypatch.undo()
    assert not engine.has_unfinished()
    engine.check_invariants()
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == want


@pytest.mark.parametrize("where", ["scheduler.resolve", "Engine._emit"])
def test_an_engine_stepped_on_after_ctrl_c_never_gives_a_short_output(llm, monkeypatch, where):
    """Stepping an Engine on after Ctrl-C landed just after it resolved a step's tokens (or while it
    built outputs) gave outputs a token short, with no error. Now those requests are dropped."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)}
    _interrupt_the_third_call(monkeypatch, engine, where)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    finals, interrupts = [], 0
    for _ in range(200):
        if not engine.has_unfinished():
            break
        try:
            finals += [o for o in engine.step() if o.finished]
        except KeyboardInterrupt:
            interrupts += 1
            assert not any(engine.is_live(r) for r in ids)
    monkeypatch.undo()
    assert interrupts == 1 and not engine.has_unfinished()
    assert all(o.outputs[0].token_ids == want[tuple(o.prompt_token_ids)] for o in finals)
    engine.check_invariants()


def _run_async(engine, jobs):
    """Submit (prompt, params) jobs on a new AsyncEngine over `engine`, one after another as each
    ends; per job its final output or the exception its stream raised; and the engine's health."""
    async def main():
        ae = AsyncEngine(engine)
        results = []
        try:
            for prompt, params in jobs:
                try:
                    async for out in ae.submit(GenerationRequest(prompt=prompt, sampling_params=params)):
                        pass
                    results.append(out)
                except (EngineStepError, EngineDeadError) as e:
                    results.append(e)
            return results, ae.health()
        finally:
            ae.shutdown()

    return asyncio.run(main())


def test_the_async_engine_ends_a_failed_steps_streams_and_serves_on(llm, monkeypatch):
    """A failed step took the whole loop down: every stream, and every later request, got
    EngineDeadError. Now the requests the step held end with EngineStepError and the next one runs."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params)]
    monkeypatch.setattr(engine, "executor", FailingExecutor(engine.executor, "pool consumed", times=1))
    (first, second), health = _run_async(engine, [(PROMPTS[0], params), (PROMPTS[1], params)])
    assert isinstance(first, EngineStepError) and "injected" in str(first)
    assert isinstance(first.__cause__, RuntimeError)
    assert second.outputs[0].token_ids == want[1] and health.healthy
    monkeypatch.undo()
    assert not engine.has_unfinished()
    engine.check_invariants()


def test_the_async_engine_dies_when_the_step_after_a_failed_one_fails_too(llm, monkeypatch):
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    monkeypatch.setattr(engine, "executor", FailingExecutor(engine.executor, "pool consumed"))
    (first, second), health = _run_async(engine, [(PROMPTS[0], params), (PROMPTS[1], params)])
    assert isinstance(first, EngineStepError) and isinstance(second, EngineDeadError)
    assert not health.healthy and "injected" in health.error
    monkeypatch.undo()
    assert not engine.has_unfinished()
    engine.check_invariants()
    assert llm.generate(PROMPTS[0], params)[0].outputs[0].token_ids  # (the engine itself is usable)
