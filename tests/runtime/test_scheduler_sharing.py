"""Pages shared between requests (simulated device: tests/testing/scheduler_sim.py): the prefix
cache (hits, salts, eviction, its counters) and n > 1 forks of a prompt."""

from __future__ import annotations

import random

import pytest

from runtime.request import SamplingParams
from tests.testing.scheduler_sim import Harness, rand_prompt


# -- prefix cache -------------------------------------------------------------------------------
def shared_prefix_workload(caching: bool, n=32):
    rng = random.Random(1234)
    prefix = rand_prompt(rng, 900)
    h = Harness(
        num_pages=1024, page_size=16, max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=1100,
        enable_prefix_caching=caching,
    )
    for i in range(n):  # all arrive at once, as from LLM.generate(prompts)
        h.add(f"r{i}", prefix + rand_prompt(rng, 100), SamplingParams(max_tokens=4, ignore_eos=True))
    h.run()
    h.check_drained()
    return h


def test_prefix_cache_cuts_prefill_by_85_percent_with_identical_outputs():
    on, off = shared_prefix_workload(True), shared_prefix_workload(False)
    s_on, s_off = on.sched.stats(), off.sched.stats()
    assert s_off.prefill_tokens == 32 * 1000
    assert s_on.prefill_tokens <= 0.15 * s_off.prefill_tokens, (s_on, s_off)
    assert s_on.prefix_cache_hit_tokens == s_off.prefill_tokens - s_on.prefill_tokens
    assert s_on.prefix_cache_query_tokens == 32 * 1000 and s_on.prefix_cache_hit_rate > 0.85
    for rid in on.reqs:
        assert on.reqs[rid].output_token_ids == off.reqs[rid].output_token_ids
    on.check_all_exact()
    assert sum(r.num_cached_tokens for r in on.reqs.values()) == s_on.prefix_cache_hit_tokens


def test_same_step_arrivals_wait_for_the_shared_page_instead_of_recomputing_it():
    h = Harness(num_pages=64, page_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    p = rand_prompt(random.Random(), 14)
    h.add("a", p)
    h.add("b", p)
    h.add("c", rand_prompt(random.Random(), 5))
    plan = h.step()
    assert [s.request_id for s in plan.seqs] == ["a", "c"]  # b waits one step for a's pages
    plan = h.step()
    b = [s for s in plan.seqs if s.request_id == "b"][0]
    assert (b.start_pos, b.q_len) == (12, 2) and h.reqs["b"].num_cached_tokens == 12
    h.run()
    h.check_all_exact()
    h.check_drained()


def test_cache_salt_prevents_sharing():
    h = Harness(num_pages=64, page_size=4)
    p = rand_prompt(random.Random(), 13)
    h.add("a", p, cache_salt="t1")
    h.run()
    h.add("b", p, cache_salt="t2")
    h.add("c", p, cache_salt="t1")
    h.run()
    assert h.reqs["b"].num_cached_tokens == 0 and h.reqs["c"].num_cached_tokens == 12
    # any string is a salt, a lone surrogate (JSON's "\ud800") too; it was hashed inside the step
    # with strict UTF-8, and the error ended the engine loop for every request
    h.add("d", p, cache_salt="\ud800")
    h.run()
    h.add("e", p, cache_salt="\ud800")
    h.run()
    assert h.reqs["d"].num_cached_tokens == 0 and h.reqs["e"].num_cached_tokens == 12
    with pytest.raises(ValueError, match="cache_salt must be a string or None, got 5"):
        h.add("f", p, cache_salt=5)
    h.check_all_exact()
    h.check_drained()


def test_generated_tokens_are_cached_for_follow_up_turns():
    h = Harness(num_pages=64, page_size=4)
    a = h.add("a", rand_prompt(random.Random(), 5), SamplingParams(max_tokens=12, ignore_eos=True))
    h.run()
    turn2 = a.token_ids + [3, 4, 5]  # the next turn of a chat repeats the whole conversation
    b = h.add("b", turn2, SamplingParams(max_tokens=2))
    h.run()
    assert b.num_cached_tokens == 16  # 16 of a's 16 computed tokens (its last sample is not computed)
    h.check_all_exact()


def test_finished_sequences_are_evicted_tail_first():
    h = Harness(num_pages=4, page_size=4, watermark=0.0)
    p = rand_prompt(random.Random(), 13)
    h.add("a", p, SamplingParams(max_tokens=1))  # 13 computed tokens: 3 full pages cached
    h.run()
    assert h.sched.allocator.num_cached == 3
    h.add("b", rand_prompt(random.Random(), 8), SamplingParams(max_tokens=1))  # evicts one page
    h.run()
    c = h.add("c", p, SamplingParams(max_tokens=1))
    h.run()
    assert c.num_cached_tokens == 8  # a's head survived; its tail page went first
    h.check_all_exact()
    h.check_drained()


# -- n > 1 ------------------------------------------------------------------------------------
def test_fork_shares_prompt_pages_and_recomputes_only_the_tail():
    for caching in (False, True):
        h = Harness(num_pages=64, page_size=4, max_num_seqs=4, enable_prefix_caching=caching)
        parent = h.add("p", rand_prompt(random.Random(), 14), SamplingParams(max_tokens=6, ignore_eos=True, n=3))
        plan = h.sched.step()
        h.dev.planned(plan)
        assert plan.seqs[0].sample  # the prompt's last chunk: fork now
        kids = h.sched.fork("p", ["p#1", "p#2"], [SamplingParams(max_tokens=4), SamplingParams(max_tokens=6)])
        shared = parent.pages[:3]
        assert all(k.pages == shared for k in kids)
        assert all(h.sched.allocator.refcount(pg) == 3 for pg in shared)
        h.sched.update_from_output(plan, h.dev.run(plan))
        h.sched.check_invariants()
        plan = h.step()
        tails = {s.request_id: (s.start_pos, s.q_len) for s in plan.seqs if s.request_id != "p"}
        assert tails == {"p#1": (12, 2), "p#2": (12, 2)}
        h.reqs.update({k.request_id: k for k in kids})
        h.run()
        h.check_all_exact()
        h.check_drained()
        with pytest.raises(KeyError, match="not live"):
            h.sched.fork("p", ["late"])


def test_forks_offer_the_shared_pages_when_their_parent_is_aborted_first():
    """A parent aborted between its fork and its step's update never registers the prompt pages
    that step computed; its children do, so a later prompt still finds them in the cache."""
    h = Harness(num_pages=64, page_size=4, max_num_seqs=4, enable_prefix_caching=True)
    prompt = rand_prompt(random.Random(7), 14)
    h.add("p", prompt, SamplingParams(max_tokens=6, ignore_eos=True, n=2))
    plan = h.sched.step()
    h.dev.planned(plan)
    (kid,) = h.sched.fork("p", ["p#1"])
    out = h.dev.run(plan)  # the step is on the device when the parent is aborted
    assert h.sched.abort("p")
    h.sched.update_from_output(plan, out)
    h.reqs["p#1"] = kid
    h.run()
    assert kid.finish_reason == "length"
    h.add("again", list(prompt), SamplingParams(max_tokens=2, ignore_eos=True))
    plan = h.step()
    (seq,) = plan.seqs
    assert seq.start_pos == 12  # the 3 full prompt pages came from the cache
    h.run()
    h.check_drained()


# -- waiting requests that share pages keep their place -------------------------------------------
def test_a_deferred_request_keeps_its_slot():
    """H waits for a prompt page A is computing (deferred, to share it); L, behind it (priority 5,
    later), took the last slot meanwhile and H ran only after L's whole generation."""
    rng = random.Random(0)
    shared = rand_prompt(rng, 20)
    h = Harness(num_pages=64, page_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64)
    h.add("A", shared, SamplingParams(max_tokens=30, ignore_eos=True))
    h.step()  # A: prompt tokens 0-15
    h.add("H", shared + [7, 8], SamplingParams(max_tokens=4, ignore_eos=True))
    h.add("L", rand_prompt(rng, 3), SamplingParams(max_tokens=25, ignore_eos=True), priority=5)
    first = {}
    while h.sched.has_unfinished():
        for s in h.step().seqs:
            first.setdefault(s.request_id, len(h.plans))
    assert first["H"] < first["L"] and h.reqs["H"].num_cached_tokens == 20  # (it shared A's prompt pages)
    h.check_all_exact()
    h.check_drained()


def test_a_waiting_fork_keeps_pages_that_dropping_would_not_free_or_that_a_worse_request_wants():
    """A running request short of a page dropped every waiting fork's pages first: pages its running
    parent still held (nothing freed; the forks recomputed them), and a priority-0 fork's pages for
    a priority-5 request, which is the one to preempt (the docstring's rule: the running request
    that would be admitted last, possibly itself)."""
    rng = random.Random(0)
    h = Harness(num_pages=5, page_size=4, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=32,
                watermark=0.0, enable_prefix_caching=False)
    h.add("P", rand_prompt(rng, 12), SamplingParams(max_tokens=8, ignore_eos=True, n=3))
    h.step()  # P: prompt 0-7
    h.add("Q", rand_prompt(rng, 3), SamplingParams(max_tokens=12, ignore_eos=True))
    plan = h.sched.step(); h.dev.planned(plan); h.plans.append(plan)  # noqa: E702 - P's last chunk, Q
    kids = h.sched.fork("P", ["P#1", "P#2"])
    h.reqs.update({k.request_id: k for k in kids})
    h.sched.update_from_output(plan, h.dev.run(plan))
    while not plan.preempted_ids:
        before = [list(k.pages) for k in kids]
        plan = h.step()
    assert plan.preempted_ids == ("Q",) and [k.pages for k in kids] == before == [[0, 1], [0, 1]]
    h.run(); h.check_all_exact(); h.check_drained()  # noqa: E702

    h = Harness(num_pages=5, page_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32, watermark=0.0)
    low = h.add("L", rand_prompt(rng, 2), SamplingParams(max_tokens=19, ignore_eos=True), priority=5)
    h.step(); h.step()  # noqa: E702
    h.add("H", rand_prompt(rng, 13), SamplingParams(max_tokens=1, ignore_eos=True, n=2))
    plan = h.sched.step(); h.dev.planned(plan); h.plans.append(plan)  # noqa: E702 - L, H's whole prompt
    (kid,) = h.sched.fork("H", ["H#1"], [SamplingParams(max_tokens=3, ignore_eos=True)])
    h.reqs["H#1"] = kid
    h.sched.update_from_output(plan, h.dev.run(plan))
    assert len(kid.pages) == 3  # H finished: the waiting fork alone holds its prompt's full pages
    h.run(); h.check_all_exact(); h.check_drained()  # noqa: E702
    assert kid.num_cached_tokens == 12 and low.num_preemptions == 1
