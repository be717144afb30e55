"""Scheduler tests against a simulated device (tests/testing/scheduler_sim.py): admission, chunked
prefill, finishing, preemption and priority, bursts, and random workloads checked for exactness.
Prefix caching and n > 1 forks: test_scheduler_sharing.py."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from runtime.request import SamplingParams
from runtime.scheduler import Scheduler, SchedulerConfig
from tests.testing.scheduler_sim import EOS, FakeDevice, Harness, rand_prompt, reference_generate


# -- admission ----------------------------------------------------------------------------------
@pytest.mark.parametrize("ids,ok", [
    ([3, 0, 7], True),
    ((3, 0, 7), True),  # any sequence
    ([np.int32(3), np.int64(0), 7], True),  # numpy ints, as tokenizers return them
    ([3, -1, 7], False),
    ([2**31], False),  # (raised from the prefix cache's hash at every step when >= 2**63)
    ([np.uint64(2**63)], False),
    ([-1], False),
    ([3, True, 7], False),  # bools are not token ids, mixed in or not
    ([True], False),
    ([3, 1.0], False),
    (["3"], False),
    ([], False),
])
def test_prompt_ids_are_validated(ids, ok):
    s = Scheduler(SchedulerConfig(num_pages=10, page_size=16, max_model_len=64))
    if not ok:
        with pytest.raises(ValueError, match="prompt token ids must be ints (>= 0|below 2..31)|0 tokens"):
            s.add_request("a", ids, SamplingParams(max_tokens=4))
        return
    req = s.add_request("a", ids, SamplingParams(max_tokens=4))
    assert req.prompt_token_ids == [3, 0, 7] and all(type(t) is int for t in req.prompt_token_ids)
    if isinstance(ids, list):
        ids.append(9)  # the request holds its own copy
        assert req.prompt_token_ids == [3, 0, 7]


def test_reject_at_once_names_both_numbers():
    s = Scheduler(SchedulerConfig(num_pages=10, page_size=16, max_model_len=512))
    with pytest.raises(ValueError, match=r"\b530\b.*\b512\b"):
        s.add_request("a", [1] * 500, SamplingParams(max_tokens=30))
    # 300 + 100 - 1 = 399 tokens with K/V -> 25 pages of 16; only 10 exist.
    with pytest.raises(ValueError, match=r"\b25\b.*\b10 pages"):
        s.add_request("b", [1] * 300, SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="512"):
        s.add_request("c", [1] * 512, SamplingParams(max_tokens=None))
    with pytest.raises(ValueError, match="0 tokens"):
        s.add_request("d", [], SamplingParams())
    s.add_request("e", [1] * 100, SamplingParams(max_tokens=61))  # exactly 10 pages: accepted
    with pytest.raises(ValueError, match="already live"):
        s.add_request("e", [1], SamplingParams())
    assert s.num_waiting == 1
    s.check_invariants()


def test_config_validation():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(num_pages=8, max_model_len=64, max_num_seqs=32, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="chunked"):
        SchedulerConfig(num_pages=8, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="watermark"):
        SchedulerConfig(num_pages=8, max_model_len=64, watermark=1.0)
    cfg = SchedulerConfig(num_pages=8, max_model_len=65, page_size=16, watermark=0.25)
    assert cfg.max_pages_per_seq == 5 and cfg.watermark_pages == 2


def test_sampling_params_validation():
    p = SamplingParams(top_k=-1, stop="###", stop_token_ids=[7], seed=3, logprobs=5)
    assert p.top_k == 0 and p.stop == ["###"] and p.stop_token_ids == [7]
    stops = ["a"]
    q = SamplingParams(stop=stops)
    stops.append("b")
    assert q.stop == ["a"]
    for bad in (
        dict(temperature=-0.1),
        dict(top_k=-2),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(min_p=-0.1),
        dict(repetition_penalty=0.0),
        dict(presence_penalty=2.5),
        dict(frequency_penalty=-3),
        dict(seed=1.5),
        dict(logprobs=-1),
        dict(stop=[""]),
        dict(stop_token_ids=[-1]),
        dict(min_tokens=5, max_tokens=4),
        dict(max_tokens=0),
        dict(n=0),
        dict(skip_special_tokens=None),
        dict(ignore_eos="no"),  # (a truthy string ignored EOS)
        dict(min_tokens=True),
        dict(n=np.float64(2)),
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        with pytest.raises(ValueError, match=f"{name} must be a number, got '1'"):
            SamplingParams(**{name: "1"})
    ints = dict(top_k=5, seed=2, logprobs=3, min_tokens=1, max_tokens=7, n=2)  # numpy integers read as ints
    q = SamplingParams(**{k: np.int64(v) for k, v in ints.items()})
    assert all(type(getattr(q, k)) is int and getattr(q, k) == v for k, v in ints.items())
    none = SamplingParams(stop=None, stop_token_ids=None)  # vLLM's spelling of "none"
    assert none.stop == [] and none.stop_token_ids == []
    with pytest.raises(AttributeError):
        p.temperature = 0.5
    # The sampling rows read settings by their bits: -0.0 penalties (valid JSON) asked for penalty
    # histories the engine had not kept, and a top_k past int32 overflowed its row; both ended the
    # engine loop. -0.0 is 0.0, and a top_k above any vocabulary keeps every token, as disabled.
    z = SamplingParams(temperature=-0.0, presence_penalty=-0.0, frequency_penalty=-0.0, min_p=-0.0, top_p=1)
    for name in ("temperature", "presence_penalty", "frequency_penalty", "min_p"):
        assert math.copysign(1.0, getattr(z, name)) == 1.0, name
    assert type(z.top_p) is float and SamplingParams(top_k=2**31).top_k == 0 and SamplingParams(top_k=2**31 - 2).top_k == 2**31 - 2
    for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty"):
        with pytest.raises(ValueError, match=f"{name} must be a finite number, got an int past the range of floats"):
            SamplingParams(**{name: 10**400})
        with pytest.raises(ValueError, match=f"{name} must be a finite number, got nan"):
            SamplingParams(**{name: float("nan")})
    # the sampler computes in float32: values it cannot hold are refused; a temperature whose logits
    # would overflow is greedy (vLLM's rule below 1e-5)
    for name, v in (("temperature", 1e300), ("top_p", -1e39), ("presence_penalty", 1e39)):
        with pytest.raises(ValueError, match=f"{name} must be within float32's range"):
            SamplingParams(**{name: v})
    # past these, the float32 logits the sampler computes overflow or every token ties (a top-k
    # or top-p filter then kept every token, an all-inf row sampled id 0)
    for v in (1e-50, 1.2e-38, 3e38):
        with pytest.raises(ValueError, match=r"repetition_penalty must be a number in \[1e-30, 1e\+30\]"):
            SamplingParams(repetition_penalty=v)
    with pytest.raises(ValueError, match=r"temperature must be a number in \[0, 1e\+30\]"):
        SamplingParams(temperature=1e38)
    assert SamplingParams(temperature=1e30, repetition_penalty=1e30).temperature == 1e30
    assert SamplingParams(temperature=1e-6).temperature == 0.0 and SamplingParams(temperature=1e-5).temperature == 1e-5
    h = Harness(num_pages=64, page_size=4, max_model_len=32)
    with pytest.raises(ValueError, match=r"min_tokens 30 is more than the 27 tokens it can generate \(max_model_len 32 - prompt 5\)"):
        h.add("a", [1, 2, 3, 4, 5], SamplingParams(min_tokens=30, max_tokens=None))


def test_watermark_holds_back_admission_while_others_run():
    h = Harness(num_pages=10, page_size=4, max_num_seqs=4, max_num_batched_tokens=64, watermark=0.2)
    h.add("a", rand_prompt(random.Random(), 16), SamplingParams(max_tokens=4, ignore_eos=True))
    plan = h.step()
    assert [s.request_id for s in plan.seqs] == ["a"]
    # a's decode takes its 5th page first. b needs 3 prompt pages: 10 - 5 - 3 = 2 left, at the
    # watermark of 2 -> admitted; c's 2 pages would fit but leave 0, below the watermark: it waits.
    h.add("b", rand_prompt(random.Random(), 12), SamplingParams(max_tokens=2, ignore_eos=True))
    h.add("c", rand_prompt(random.Random(), 8), SamplingParams(max_tokens=2, ignore_eos=True))
    plan = h.step()
    assert [s.request_id for s in plan.seqs] == ["a", "b"]
    assert h.sched.allocator.num_available == 2
    plan = h.step()
    assert [s.request_id for s in plan.seqs] == ["a", "b"]
    h.run()
    h.check_all_exact()
    h.check_drained()


# -- chunked prefill and step contents ---------------------------------------------------------
def test_chunked_prefill_decodes_first_and_samples_only_at_prompt_end():
    h = Harness(num_pages=64, page_size=4, max_num_seqs=4, max_num_batched_tokens=10, enable_prefix_caching=False)
    h.add("short", rand_prompt(random.Random(), 3), SamplingParams(max_tokens=10, ignore_eos=True))
    h.step()
    h.add("long", rand_prompt(random.Random(), 25), SamplingParams(max_tokens=3))
    chunks = []
    while h.reqs["long"].num_output_tokens == 0:
        plan = h.step()
        assert plan.seqs[0].request_id == "short" and not plan.seqs[0].is_prefill
        long = [s for s in plan.seqs if s.request_id == "long"][0]
        chunks.append((long.start_pos, long.q_len, long.sample))
        assert plan.num_decode_tokens == 1 and plan.num_prefill_tokens == long.q_len
    assert chunks == [(0, 9, False), (9, 9, False), (18, 7, True)]
    h.run()
    h.check_all_exact()
    h.check_drained()
    assert h.sched.stats().prefill_tokens == 28


def test_prefill_without_chunking_waits_for_a_whole_budget():
    h = Harness(
        num_pages=64, page_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32,
        enable_chunked_prefill=False,
    )
    h.add("a", rand_prompt(random.Random(), 20), SamplingParams(max_tokens=5, ignore_eos=True))
    h.add("b", rand_prompt(random.Random(), 20), SamplingParams(max_tokens=5, ignore_eos=True))
    plan = h.step()
    assert [(s.request_id, s.q_len) for s in plan.seqs] == [("a", 20)]
    plan = h.step()
    assert [(s.request_id, s.q_len) for s in plan.seqs] == [("a", 1), ("b", 20)]
    h.run()
    h.check_all_exact()
    h.check_drained()


def test_step_contract_is_enforced():
    h = Harness(num_pages=8, page_size=4)
    h.add("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    plan = h.sched.step()
    h.dev.planned(plan)
    with pytest.raises(RuntimeError, match="outstanding"):
        h.sched.step()
    with pytest.raises(ValueError, match="sampled tokens"):
        h.sched.update_from_output(plan, [])
    h.sched.update_from_output(plan, h.dev.run(plan))
    with pytest.raises(ValueError, match="outstanding"):
        h.sched.update_from_output(plan, [5])
    assert h.sched.step().is_empty is False


# -- finishing ----------------------------------------------------------------------------------
def test_stop_rules_eos_min_tokens_ignore_eos_stop_ids():
    rng = random.Random(0)
    prompts = [rand_prompt(rng, rng.randint(1, 9)) for _ in range(40)]
    h = Harness(num_pages=512, page_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    for i, p in enumerate(prompts):
        params = SamplingParams(
            max_tokens=40, min_tokens=i % 5, ignore_eos=i % 3 == 0, stop_token_ids=[1 + i % 7, 9]
        )
        h.add(f"r{i}", p, params)
    h.run()
    h.check_all_exact()
    h.check_drained()
    reasons = {r.finish_reason for r in h.reqs.values()}
    assert reasons == {"stop", "length"}
    for r in h.reqs.values():
        if r.finish_reason == "stop" and r.output_token_ids[-1] != EOS:
            assert r.stop_reason == r.output_token_ids[-1]


def test_finish_for_stop_strings_and_abort_free_pages_within_one_step():
    h = Harness(num_pages=64, page_size=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    a = h.add("a", rand_prompt(random.Random(), 10), SamplingParams(max_tokens=50, ignore_eos=True))
    b = h.add("b", rand_prompt(random.Random(), 10), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        h.step()
    used = h.sched.allocator.num_referenced
    assert used == 2 * 3  # 12 computed tokens each
    st_ = h.sched.stats()
    assert (st_.kv_usage, st_.num_running, st_.num_waiting) == (6 / 64, 2, 0)
    assert h.sched.abort("a") and not h.sched.abort("a")
    assert h.sched.allocator.num_referenced == 3 and a.finish_reason == "abort"
    plan = h.step()
    assert plan.finished_ids == ("a",) and [s.request_id for s in plan.seqs] == ["b"]
    assert h.sched.finish("b", "stop", "</s>")
    assert (b.finish_reason, b.stop_reason) == ("stop", "</s>")
    assert h.sched.step().finished_ids == ("b",)
    h.check_drained()
    ref, _ = reference_generate(b.prompt_token_ids, b.sampling_params)
    assert b.output_token_ids == ref[: b.num_output_tokens]


def test_abort_between_step_and_update_and_while_waiting():
    h = Harness(num_pages=64, page_size=4, max_num_seqs=1)
    h.add("a", rand_prompt(random.Random(), 6))
    h.add("b", rand_prompt(random.Random(), 6))
    plan = h.sched.step()
    h.dev.planned(plan)
    tokens = h.dev.run(plan)
    assert h.sched.abort("a") and h.sched.abort("b")
    assert h.sched.update_from_output(plan, tokens) == []
    h.sched.check_invariants()
    h.check_drained()


def test_reset_drops_everything_whatever_step_is_outstanding():
    """After a failed step (Engine, module docstring: Failures): no request, no page held or cached,
    the statistics kept; the same ids run again as new requests, exactly."""
    h = Harness(num_pages=64, page_size=4, max_num_seqs=4, enable_prefix_caching=True)
    shared = rand_prompt(random.Random(1), 8)
    for i in range(3):
        h.add(f"r{i}", shared + rand_prompt(random.Random(i), 5))
    h.run()  # pages cached
    for i in range(3):
        h.add(f"r{i}", shared + rand_prompt(random.Random(10 + i), 5))
    h.step()
    plan = h.sched.step()  # planned and applied without its tokens (lookahead), never resolved
    h.sched.update_from_output(plan, None)
    before = h.sched.stats()
    assert h.sched.allocator.num_referenced > 0 and before.prefix_cache_hit_tokens > 0
    assert sorted(h.sched.reset()) == ["r0", "r1", "r2"]
    h.sched.check_invariants()
    a, after = h.sched.allocator, h.sched.stats()
    assert a.num_free == a.num_pages and not h.sched.has_unfinished()
    assert (after.prefill_tokens, after.num_steps, after.prefix_cache_hit_tokens) == (
        before.prefill_tokens, before.num_steps, before.prefix_cache_hit_tokens)
    h.dev = FakeDevice(h.sched)
    for i in range(3):
        h.add(f"r{i}", shared + rand_prompt(random.Random(20 + i), 5))
    h.run()
    h.check_all_exact()
    assert h.sched.stats().prefix_cache_hit_tokens > before.prefix_cache_hit_tokens  # computed once more, then shared
    h.check_drained()


# -- preemption and priority ------------------------------------------------------------------
def test_recompute_preemption_on_a_tiny_pool_keeps_outputs():
    h = Harness(num_pages=8, page_size=4, max_num_seqs=4, max_num_batched_tokens=32, watermark=0.0)
    rng = random.Random(7)
    for i in range(4):
        h.add(f"r{i}", rand_prompt(rng, 6), SamplingParams(max_tokens=20, ignore_eos=True))
    h.run()
    stats = h.sched.stats()
    assert stats.num_preemptions > 0
    preempted = [rid for p in h.plans for rid in p.preempted_ids]
    assert preempted and preempted[0] == "r3"  # the latest arrival goes first
    assert sum(r.num_preemptions for r in h.reqs.values()) == stats.num_preemptions
    h.check_all_exact()
    h.check_drained()
    assert stats.prefill_tokens > 4 * 6  # the preempted work was computed again


def test_priority_orders_admission_and_picks_the_victim():
    h = Harness(num_pages=64, page_size=4, max_num_seqs=1)
    h.add("low", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True), priority=5)
    h.add("high", [5, 6, 8], SamplingParams(max_tokens=2, ignore_eos=True), priority=0)
    h.add("high2", [5, 6, 9], SamplingParams(max_tokens=2, ignore_eos=True), priority=0)
    order = []
    while h.sched.has_unfinished():
        plan = h.step()
        order += [s.request_id for s in plan.seqs if s.request_id not in order]
    assert order == ["high", "high2", "low"]

    # A low-priority request that arrived first is preempted for a high-priority one.
    h = Harness(num_pages=6, page_size=4, max_num_seqs=2, max_num_batched_tokens=32, watermark=0.0)
    rng = random.Random(3)
    h.add("old-low", rand_prompt(rng, 8), SamplingParams(max_tokens=12, ignore_eos=True), priority=1)
    h.step()
    h.add("new-high", rand_prompt(rng, 8), SamplingParams(max_tokens=12, ignore_eos=True), priority=0)
    h.run()
    preempted = [rid for p in h.plans for rid in p.preempted_ids]
    assert preempted and set(preempted) == {"old-low"}
    assert h.reqs["new-high"].num_preemptions == 0
    h.check_all_exact()
    h.check_drained()


# -- bursts ---------------------------------------------------------------------------------------
def test_bursts_run_only_plain_decodes_with_room_and_pages():
    rng = random.Random(5)
    h = Harness(num_pages=64, page_size=4, max_num_seqs=4, decode_steps=4)
    h.add("a", rand_prompt(rng, 6), SamplingParams(max_tokens=11, ignore_eos=True))
    assert h.step().num_steps == 1  # the prefill
    plan = h.step()
    assert plan.num_steps == 4 and plan.num_decode_tokens == 4
    (s,) = plan.seqs
    assert (s.start_pos, s.num_computed_after, len(s.pages)) == (6, 10, 3)
    assert h.reqs["a"].num_output_tokens == 5
    assert h.reqs["a"].num_registered_pages == 2  # pages filled by the burst go to the prefix cache
    h.add("b", rand_prompt(rng, 5), SamplingParams(max_tokens=3, ignore_eos=True))
    assert h.step().num_steps == 1  # b waits: no burst delays its admission
    plan = h.step()  # b has 2 tokens left: the burst computes 4, b takes 2 and finishes
    assert plan.num_steps == 4 and h.reqs["b"].finish_reason == "length"
    assert (h.reqs["a"].num_output_tokens, h.reqs["b"].num_output_tokens) == (10, 3)
    plan = h.step()  # a's last token (of 11): a burst still, as nothing waits
    assert plan.num_steps == 4 and h.reqs["a"].is_finished and h.reqs["a"].num_output_tokens == 11
    h.check_all_exact()
    h.check_drained()
    # Penalties, min_tokens bans and logprobs run in bursts (the device counts tokens, lifts bans,
    # returns every step's logprobs): the prefill, then bursts of 4 from the first decode (4 + 4 +
    # 3 of 4 tokens).
    for params in (SamplingParams(max_tokens=12, logprobs=1),
                   SamplingParams(max_tokens=12, repetition_penalty=1.2),
                   SamplingParams(max_tokens=12, frequency_penalty=0.5, presence_penalty=0.5),
                   SamplingParams(max_tokens=12, min_tokens=6, ignore_eos=True)):
        h = Harness(num_pages=64, page_size=4, decode_steps=4)
        h.add("m", rand_prompt(rng, 5), params)
        h.run()
        assert [p.num_steps for p in h.plans] == [1, 4, 4, 4], params
    # Without the pages for a whole burst, single steps (a burst never preempts).
    h = Harness(num_pages=4, page_size=4, max_num_seqs=2, watermark=0.0, decode_steps=4)
    h.add("x", rand_prompt(rng, 7), SamplingParams(max_tokens=8, ignore_eos=True))
    h.add("y", rand_prompt(rng, 7), SamplingParams(max_tokens=8, ignore_eos=True))
    h.run()
    assert all(p.num_steps == 1 for p in h.plans if len(p.seqs) == 2)
    h.check_all_exact()
    h.check_drained()


def test_a_burst_at_the_end_of_the_page_table():
    """A request ending at max_model_len still bursts; positions past its table are never computed
    for real (it finishes by length first)."""
    h = Harness(num_pages=16, page_size=4, max_model_len=16, decode_steps=4)
    r = h.add("e", rand_prompt(random.Random(2), 10), SamplingParams(max_tokens=6, ignore_eos=True))
    h.run()
    assert [p.num_steps for p in h.plans] == [1, 4, 4] and r.num_output_tokens == 6
    assert len(h.plans[-1].seqs[0].pages) == 4  # positions 14-17 asked, the table's 16 given
    h.check_all_exact()
    h.check_drained()


def test_a_burst_drops_the_tokens_after_a_stop():
    rng = random.Random(11)
    for _ in range(50):  # prompts until one stops (EOS: 1 in 64 per token) inside a burst
        prompt = rand_prompt(rng, 3)
        want, reason = reference_generate(prompt, SamplingParams(max_tokens=40))
        if reason == "stop" and len(want) % 4 != 1 and len(want) > 2:
            break
    else:
        pytest.fail("no prompt stopped inside a burst")
    h = Harness(num_pages=64, page_size=4, decode_steps=4)
    r = h.add("s", prompt, SamplingParams(max_tokens=40))
    h.run()
    assert (r.output_token_ids, r.finish_reason) == (want, "stop")
    assert sum(p.num_decode_tokens for p in h.plans) > len(want) - 1  # the burst ran on past the stop
    h.check_drained()


# -- random workloads -----------------------------------------------------------------------------
request_st = st.fixed_dictionaries(
    {
        "arrive": st.integers(0, 20),
        "base": st.integers(0, 2),  # 0: no shared prefix
        "prefix_len": st.integers(0, 32),
        "suffix_len": st.integers(1, 12),
        "max_tokens": st.integers(1, 24),
        "min_tokens": st.integers(0, 3),
        "ignore_eos": st.booleans(),
        "priority": st.integers(0, 2),
        "salt": st.sampled_from([None, None, "x"]),
        "abort_at": st.one_of(st.none(), st.integers(0, 60)),
        "stop_string_at": st.one_of(st.none(), st.integers(1, 10)),
        "forks": st.integers(0, 2),
    }
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    page_size=st.sampled_from([1, 2, 4, 8]),
    num_pages=st.integers(6, 32),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(6, 40),
    watermark=st.sampled_from([0.0, 0.05, 0.2]),
    caching=st.booleans(),
    chunked=st.booleans(),
    requests=st.lists(request_st, min_size=1, max_size=20),
    seed=st.integers(0, 2**16),
    lookahead=st.booleans(),
    decode_steps=st.sampled_from([1, 2, 4]),
)
def test_random_workload_invariants_and_exactness(
    page_size, num_pages, max_num_seqs, budget, watermark, caching, chunked, requests, seed, lookahead, decode_steps
):
    """lookahead: step k+1 is planned (and run) before step k's tokens are resolved, as the engine
    does when no request needs its previous token on the host. decode_steps > 1: bursts."""
    max_model_len = 48
    if not chunked:
        budget = max(budget, max_model_len)
    h = Harness(
        num_pages=num_pages, page_size=page_size, max_num_seqs=min(max_num_seqs, budget),
        max_num_batched_tokens=budget, max_model_len=max_model_len, watermark=watermark,
        enable_prefix_caching=caching, enable_chunked_prefill=chunked, decode_steps=decode_steps,
    )
    rng = random.Random(seed)
    bases = [None] + [rand_prompt(rng, 32) for _ in range(2)]
    pending = sorted(enumerate(requests), key=lambda x: x[1]["arrive"])
    cut = {}  # request id -> why its output may stop short of the reference
    step = 0
    prev = None  # lookahead: the output of the step applied without its tokens
    while pending or h.sched.has_unfinished() or prev is not None:
        assert step < 3000, "workload did not drain"
        while pending and pending[0][1]["arrive"] <= step:
            i, spec = pending.pop(0)
            prompt = (bases[spec["base"]][: spec["prefix_len"]] if spec["base"] else []) + rand_prompt(
                rng, spec["suffix_len"]
            )
            params = SamplingParams(
                max_tokens=spec["max_tokens"], min_tokens=min(spec["min_tokens"], spec["max_tokens"]),
                ignore_eos=spec["ignore_eos"], n=1 + spec["forks"],
            )
            kv_pages = -(-(len(prompt) + params.max_tokens - 1) // page_size)
            if len(prompt) + params.max_tokens > max_model_len or kv_pages > num_pages:
                with pytest.raises(ValueError):
                    h.sched.add_request(f"r{i}", prompt, params)
                continue
            h.add(f"r{i}", prompt, params, priority=spec["priority"], cache_salt=spec["salt"])
        for rid, r in list(h.reqs.items()):
            spec = requests[int(rid[1:].split("#")[0])]
            if spec["abort_at"] == step and not r.is_finished:
                assert h.sched.abort(rid)
                cut[rid] = "abort"
                assert h.sched.get_request(rid) is None
            elif spec["stop_string_at"] is not None and r.num_output_tokens >= spec["stop_string_at"] and not r.is_finished:
                assert h.sched.finish(rid, "stop", "STOP")
                cut[rid] = "stop"
        plan = h.sched.step()
        h.dev.planned(plan)
        h.plans.append(plan)
        for s in plan.seqs:
            r = h.reqs[s.request_id]
            if s.sample and r.num_output_tokens == 0 and r.parent_id is None and r.sampling_params.n > 1:
                kids = h.sched.fork(s.request_id, [f"{s.request_id}#{j}" for j in range(1, r.sampling_params.n)])
                h.reqs.update({k.request_id: k for k in kids})
        if lookahead:
            out = h.dev.run(plan, prev) if not plan.is_empty else None
            if prev is not None:
                h.sched.resolve(prev)
            prev = out
            if out is not None:
                h.sched.update_from_output(plan, None)
        elif not plan.is_empty:
            h.sched.update_from_output(plan, h.dev.run(plan))
        h.sched.check_invariants()
        step += 1
    h.check_drained()
    stats = h.sched.stats()
    event(f"preempted: {stats.num_preemptions > 0}")
    event(f"prefix hits: {stats.prefix_cache_hit_tokens > 0}")
    event(f"forked: {any(r.parent_id for r in h.reqs.values())}")
    event(f"cut short: {bool(cut)}")
    event(f"bursts: {any(p.num_steps > 1 for p in h.plans)}")
    if caching:  # each admitted prompt counts once (not again after a preemption, nor for its forks)
        admitted = [r for r in h.reqs.values() if r.admitted_once and r.parent_id is None]
        assert stats.prefix_cache_query_tokens == sum(r.num_prompt_tokens for r in admitted)
        assert stats.prefix_cache_hit_tokens == sum(r.num_cached_tokens for r in admitted)
    for rid, r in h.reqs.items():
        assert r.is_finished
        want, reason = reference_generate(r.prompt_token_ids, r.sampling_params)
        if rid in cut:
            assert r.finish_reason == cut[rid]
            assert r.output_token_ids == want[: r.num_output_tokens], rid
        else:
            assert (r.output_token_ids, r.finish_reason) == (want, reason), rid


def test_an_aborted_id_reused_before_the_update_is_a_new_request():
    h = Harness(num_pages=16, page_size=4)
    h.add("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    plan = h.sched.step()
    h.dev.planned(plan)
    tokens = h.dev.run(plan)
    h.sched.abort("a")
    fresh = h.add("a", [4, 5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    assert h.sched.update_from_output(plan, tokens) == []
    assert fresh.num_computed_tokens == 0 and fresh.output_token_ids == []
    h.run()
    h.check_all_exact()
    h.check_drained()
