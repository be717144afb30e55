"""Packing plans into fixed-shape batches, the bucket table, EngineConfig, and the compiled step
(paged KV, chunked prefill, logits rows) against the plain forward on a tiny random model."""

from __future__ import annotations

import gc
import logging
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runtime.checkpoint import load_model
from runtime.compilation import (PAGE_UPDATE_BUCKETS, BucketTable, CompileAfterWarmupError, CompileWatcher,
                                 StepExecutor)
from runtime.config import EngineConfig, default_seq_buckets, default_token_buckets
from runtime.kv_cache import init_kv_pages
from runtime.request import SamplingParams
from runtime.sampling import (HISTORY_CHUNK, SamplingNeeds, burst_history_placeholder, count, empty_rows,
                              history_placeholder, put_request_rows, sampling_rows)
from runtime.plan import ScheduledSeq, StepPlan
from runtime.step import BatchPacker, SeqSampling, StepLayout, make_burst_fn, make_model_fn
from sharding.rules import kv_cache_sharding
from tests.testing.greedy import greedy_generate
from tests.tolerances import MODEL_LOGITS_F32

P_MAX, W, NB = 8, 64, 4


def seq(rid, tokens, start, pages, sample=True, prefill=True, slot=0, lease=1):
    return ScheduledSeq(rid, slot, tuple(tokens), start, start + len(tokens), tuple(pages), sample, prefill, lease)


def plan_of(*seqs):
    n_pre = sum(s.q_len for s in seqs if s.is_prefill)
    n_dec = sum(s.q_len for s in seqs if not s.is_prefill)
    return StepPlan(0, tuple(seqs), n_pre, n_dec, (), ())


def test_bucket_table_selects_smallest_and_skips_unreachable_pairs():
    t = BucketTable((16, 64), (1, 4, 32))
    assert t.select(1, 1) == (16, 1)
    assert t.select(17, 2) == (64, 4)
    assert t.select(64, 32) == (64, 32)
    # A pair is compiled only if some step lands in it: S bucket 32 starts at 5 sequences, which
    # need at least 5 tokens, so (4, 32) is dropped.
    assert BucketTable((4, 64), (1, 4, 32)).pairs() == [(4, 1), (4, 4), (64, 1), (64, 4), (64, 32)]
    with pytest.raises(ValueError, match="65 tokens and 1 sequences exceeds the bucket table"):
        t.select(65, 1)


def test_engine_config_defaults_and_validation():
    assert default_token_buckets(512) == (1, 16, 32, 64, 128, 256, 512)
    assert default_token_buckets(100) == (1, 16, 32, 64, 100)
    assert default_seq_buckets(32) == (1, 4, 16, 32)
    c = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64)
    assert c.token_bucket_table == (1, 16, 32, 64) and c.seq_bucket_table == (1, 4, 8)
    r = c.resolve(max_position_embeddings=512, num_pages=100)
    assert (r.max_model_len, r.num_pages, r.max_pages_per_seq) == (512, 100, 32)
    with pytest.raises(ValueError, match="max_model_len 1024 exceeds the model's max_position_embeddings 512"):
        EngineConfig(max_model_len=1024).resolve(max_position_embeddings=512, num_pages=100)
    with pytest.raises(ValueError, match=r"token_buckets ends at 32; it must reach max_num_batched_tokens \(64\)"):
        EngineConfig(max_num_batched_tokens=64, max_num_seqs=8, token_buckets=(16, 32))
    with pytest.raises(ValueError, match="seq_buckets must be strictly increasing"):
        EngineConfig(max_num_seqs=8, seq_buckets=(8, 4, 8))
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(4\) must be >= max_num_seqs \(8\)"):
        EngineConfig(max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="num_pages 3 cannot hold one sequence of max_model_len 64"):
        EngineConfig(num_pages=3, max_model_len=64, page_size=16)
    with pytest.raises(ValueError, match="dtype 'int8' is not supported"):
        EngineConfig(dtype="int8")
    assert EngineConfig().unroll_burst_max_seqs is None and EngineConfig(unroll_burst_max_seqs=0).unroll_burst_max_seqs == 0
    for bad in (-1, True, 1.0):
        with pytest.raises(ValueError, match=f"unroll_burst_max_seqs must be None or an int >= 0, got {bad!r}"):
            EngineConfig(unroll_burst_max_seqs=bad)
    assert EngineConfig().warmup_runs is None and EngineConfig(warmup_runs=True).warmup_runs is True
    for bad in (1, "yes"):
        with pytest.raises(ValueError, match=f"warmup_runs must be None, True or False, got {bad!r}"):
            EngineConfig(warmup_runs=bad)
    assert EngineConfig(seed=2**63 - 1).seed == 2**63 - 1
    for bad in (-1, None, "7", True):  # (numpy's generator refused -1 only after the model had loaded)
        with pytest.raises(ValueError, match=f"seed must be an int >= 0, got {bad!r}"):
            EngineConfig(seed=bad)
    with pytest.raises(ValueError, match="seed must be < 2\\*\\*63"):
        EngineConfig(seed=2**63)


def test_packer_marks_the_in_flight_token_in_penalty_histories():
    """A decode whose input token is still the previous step's placeholder -(i + 1) (lookahead) gets
    history_placeholder of it as its history's last entry; the penalize program reads it from the
    previous step's tokens on the device."""
    packer = BatchPacker(pages_per_seq=P_MAX, history_len=W, max_banned=NB,
                         select_bucket=BucketTable((4, 16), (2, 4)).select, slots=4)
    s = SeqSampling.create(SamplingParams(repetition_penalty=1.2), 0, [4, 5, 6], eos_ids=[2], history_len=W)
    s.append(11)  # an output the host has seen
    ahead = packer.pack(plan_of(seq("a", [-(3 + 1)], 4, [7], prefill=False)), {"a": s}.__getitem__)
    np.testing.assert_array_equal(ahead.history[0, :6], [4, 5, 6, 11, history_placeholder(-4), -1])
    assert history_placeholder(-4) == -5  # clear of the -1 padding
    known = packer.pack(plan_of(seq("a", [12], 4, [7], prefill=False)), {"a": s}.__getitem__)
    np.testing.assert_array_equal(known.history[0, :5], [4, 5, 6, 11, -1])  # nothing in flight: as kept
    # After a burst of 3 in which it was row 2, all 3 of its tokens are on the device only: the next
    # step samples index 7 and the history holds a placeholder for each (burst_history_placeholder)
    after = packer.pack(plan_of(seq("a", [-(2 + 1)], 6, [7], prefill=False)), {"a": s}.__getitem__)
    want = [burst_history_placeholder(-3, j, 4) for j in range(3)]
    np.testing.assert_array_equal(after.history[0, :8], [4, 5, 6, 11, *want, -1])
    assert want == [-(2 + 4 * (j + 1) + 2) for j in range(3)] and min(want) > -(2 + 4 * 4)


def test_packer_ships_the_history_its_rows_use_in_whole_chunks():
    """With a long max_model_len the history is as wide as whole HISTORY_CHUNKs of the longest
    penalized row (prompt, outputs and the placeholders of tokens in flight), not max_model_len."""
    C, L = HISTORY_CHUNK, 5 * HISTORY_CHUNK + 7
    packer = BatchPacker(pages_per_seq=P_MAX, history_len=L, max_banned=NB,
                         select_bucket=BucketTable((4, 16), (2, 4)).select, slots=4)
    short = SeqSampling.create(SamplingParams(repetition_penalty=1.2), 0, [4, 5, 6], eos_ids=[2], history_len=L)
    assert short.history.shape == (3 + 16,)  # the prompt and max_tokens (16), not max_model_len
    one = packer.pack(plan_of(seq("s", [7], 3, [7], prefill=False)), {"s": short}.__getitem__)
    assert one.history.shape == (2, C)
    np.testing.assert_array_equal(one.history[0, :4], [4, 5, 6, -1])
    prompt = list(range(3, C + 3))  # C + 1 entries known, its last output still in flight: C + 2 used
    long = SeqSampling.create(SamplingParams(frequency_penalty=1.0, max_tokens=None), 0, prompt, eos_ids=[2],
                              history_len=L)
    assert long.history.shape == (L,)
    long.append(9)
    both = packer.pack(plan_of(seq("s", [7], 3, [7], prefill=False), seq("l", [-2], C + 1, [1], prefill=False, slot=1)),
                       {"s": short, "l": long}.__getitem__)
    assert both.history.shape == (2, 2 * C)
    np.testing.assert_array_equal(both.history[1, : C + 3], prompt + [9, history_placeholder(-2), -1])
    assert (both.history[0, 3:] == -1).all()
    # a row at max_model_len: every entry it can hold, in whole chunks (the last one partly padding)
    long.history_len = L
    full = packer.pack(plan_of(seq("l", [5], L - 1, [1], prefill=False)), {"l": long}.__getitem__)
    assert full.history.shape == (2, 6 * C)


def test_packer_lays_out_plan_and_padding():
    packer = BatchPacker(pages_per_seq=P_MAX, history_len=W, max_banned=NB,
                         select_bucket=BucketTable((4, 16), (2, 4)).select, slots=4)
    greedy = SeqSampling.create(SamplingParams(temperature=0.0), 0, [1, 2], eos_ids=[2], history_len=W)
    fancy = SeqSampling.create(
        SamplingParams(temperature=0.5, top_k=3, top_p=0.9, min_p=0.1, repetition_penalty=1.2, seed=7, logprobs=2,
                       min_tokens=3, stop_token_ids=[9]),
        2**40 + 3, [4, 5, 6], eos_ids=[2], history_len=W,
    )
    fancy.append(11)
    table = {"d": greedy, "p": fancy}
    plan = plan_of(
        seq("d", [3], 5, [7, 2], prefill=False, slot=2),
        seq("p", [6, 11, 12], 2, [4], sample=True, slot=0, lease=4),
        seq("c", [20, 21, 22, 23], 0, [5], sample=False, slot=3),
    )
    packed = packer.pack(plan, table.__getitem__)
    assert packed.layout == StepLayout(16, 4, P_MAX) and packed.flat.shape == (packed.layout.size,)
    b = packed.step  # views into the one flat buffer
    assert b.tokens.shape == (16,) and b.logits_indices.shape == (4,)
    np.testing.assert_array_equal(b.tokens[:8], [3, 6, 11, 12, 20, 21, 22, 23])
    np.testing.assert_array_equal(b.positions[:8], [5, 2, 3, 4, 0, 1, 2, 3])
    assert not b.tokens[8:].any() and not b.positions[8:].any()
    m = b.attn
    np.testing.assert_array_equal(m.kv_lens, [6, 5, 4, 0])
    np.testing.assert_array_equal(m.cu_q_lens, [0, 1, 4, 8, 8])
    np.testing.assert_array_equal(m.num_seqs, [3])
    # each slot names its row of the executor's page table (StepExecutor.sync_pages), padding row 0
    assert m.page_indices is None
    np.testing.assert_array_equal(b.page_rows, [2, 0, 3, 0])
    assert packed.pages == ((2, 1, (7, 2)), (0, 4, (4,)), (3, 1, (5,)))
    np.testing.assert_array_equal(b.logits_indices, [0, 3, 7, 0])
    sb = packed.sampling  # views into the rows buffer
    np.testing.assert_allclose(sb.temperature, [0, 0.5, 0, 0])
    np.testing.assert_array_equal(sb.top_k, [0, 3, 0, 0])
    np.testing.assert_allclose(sb.top_p, [1, 0.9, 1, 1], rtol=1e-6)
    np.testing.assert_allclose(sb.repetition_penalty, [1, 1.2, 1, 1], rtol=1e-6)
    np.testing.assert_array_equal(sb.seeds[1], [3, 2**8])
    np.testing.assert_array_equal(sb.positions[:2], [6, 5])
    np.testing.assert_array_equal(packed.history[1, :5], [4, 5, 6, 11, -1])
    assert (packed.history[[0, 2, 3]] == -1).all()  # only rows with penalties carry their history
    assert sb.num_prompt[1] == 3
    # "p" samples the token at index 5 (its num_computed_after) of a 3-token prompt: 2 outputs before
    # it, below min_tokens 3, so EOS and the stop id are banned
    np.testing.assert_array_equal(sb.banned[1], [2, 9, -1, -1])
    assert (sb.banned[[0, 2, 3]] == -1).all()
    assert packed.needs == SamplingNeeds(penalties=True, random=True, filters=True, logprobs=True, bans=True)
    fancy.append(12)
    later = plan_of(plan.seqs[0], seq("p", [13], 5, [4], prefill=False, slot=1))  # samples index 6: 3 outputs before it
    lifted = packer.pack(later, table.__getitem__)
    assert (lifted.sampling.banned == -1).all() and not lifted.needs.bans
    # Without a penalized row the [S, W] history is not built (the penalize program does not run).
    greedy_only = packer.pack(plan_of(plan.seqs[0], plan.seqs[2]), table.__getitem__)
    assert greedy_only.history is None and greedy_only.needs == SamplingNeeds()
    random = SeqSampling.create(SamplingParams(temperature=0.5, logprobs=0), 1, [1], [2], W)
    assert packer.pack(plan_of(seq("r", [3], 5, [7], prefill=False)), {"r": random}.__getitem__).needs == \
        SamplingNeeds(random=True, logprobs=True)


def test_packed_batch_size_does_not_grow_with_the_page_table_width():
    """The page tables stay on the device: a step ships a row number per slot, so the flat buffer is
    the same for a narrow table and a wide one (max_model_len 131,072 at pages of 16: 8,192)."""
    g = SeqSampling.create(SamplingParams(temperature=0.0), 0, [1], eos_ids=[2], history_len=W)
    plan = plan_of(seq("a", [3], 40, [7, 2, 9], prefill=False, slot=1), seq("b", [5], 9, [4], prefill=False, slot=3),
                   seq("c", [6], 70, [1, 8, 3, 6, 5], prefill=False, slot=0))
    sizes = set()
    for pages_per_seq in (8, 8192):
        packer = BatchPacker(pages_per_seq=pages_per_seq, history_len=W, max_banned=NB,
                             select_bucket=BucketTable((4, 16), (2, 4)).select, slots=4)
        packed = packer.pack(plan, lambda _: g)
        sizes.add(packed.flat.size)
        np.testing.assert_array_equal(packed.step.page_rows, [1, 3, 0, 0])
        assert [p for _, _, p in packed.pages] == [(7, 2, 9), (4,), (1, 8, 3, 6, 5)]
    assert sizes == {StepLayout(4, 4, 8).size}


def test_sync_pages_ships_new_pages_and_rewrites_a_row_whose_lease_changed(tiny_model, monkeypatch):
    """The executor's page table [slots, P]: a row gets only the pages past those it holds while its
    lease holds (an entry changed on the device behind its back stays), all of them when the lease
    changes; updates past the largest bucket run in several calls; rows or page lists that do not
    fit are refused."""
    import runtime.compilation as compilation

    monkeypatch.setattr(compilation, "PAGE_UPDATE_BUCKETS", (2, 4))
    m = tiny_model
    kv = init_kv_pages(m.config, 16, 8, m.dtype, sharding=kv_cache_sharding(m.config, m.mesh))
    table = BucketTable((16,), (4,))
    packer = BatchPacker(pages_per_seq=P_MAX, history_len=W, max_banned=NB, select_bucket=table.select, slots=4)
    ex = StepExecutor(make_model_fn(m.forward), params=m.params, kv_pages=kv, mesh=m.mesh, table=table,
                      empty_batch=packer.empty, vocab_size=m.config.vocab_size, max_logprobs=5, strict=True)

    def sync(*rows):
        b = packer.empty(16, 4)
        b.pages = rows
        ex.sync_pages(b)
        return np.asarray(ex.page_table)

    t = sync((0, 1, (5, 6)), (2, 1, (7,)))
    np.testing.assert_array_equal(t[[0, 2], :3], [[5, 6, 0], [7, 0, 0]])
    ex.page_table = ex.page_table.at[0, 0].set(99)  # not what the host sent: a same-lease sync leaves it
    t = sync((0, 1, (5, 6, 9)), (2, 2, (3, 4)))
    np.testing.assert_array_equal(t[0, :3], [99, 6, 9])
    np.testing.assert_array_equal(t[2, :3], [3, 4, 0])  # a new lease: the row from its start
    t = sync((1, 1, tuple(range(10, 17))), (3, 1, (1,)))  # 8 entries: calls of 4 and 4
    np.testing.assert_array_equal(t[1, :7], range(10, 17))
    assert t[3, 0] == 1 and t[0, 0] == 99
    with pytest.raises(ValueError, match="the table is"):
        sync((4, 1, (1,)))
    with pytest.raises(ValueError, match="the table is"):
        sync((0, 3, tuple(range(P_MAX + 1))))


def test_ignore_eos_keeps_eos_unbanned():
    s = SeqSampling.create(SamplingParams(ignore_eos=True, min_tokens=3, stop_token_ids=[5]), 0, [1], [2], W)
    assert s.stop_ids.tolist() == [5]


def decode_batch(P, *, tokens, positions, kv_lens, num_seqs):
    """A packed batch of one decode token per slot (T = S = len(tokens)), the first num_seqs live:
    its layout and flat buffer, no pages."""
    layout = StepLayout(T=len(tokens), S=len(tokens), P=P)
    flat = np.zeros(layout.size, np.int32)
    b = layout.unflatten(flat)  # views into flat
    b.tokens[:], b.positions[:], b.attn.kv_lens[:] = tokens, positions, kv_lens
    b.attn.cu_q_lens[:] = np.minimum(np.arange(len(tokens) + 1), num_seqs)
    b.attn.num_seqs[0] = num_seqs
    b.logits_indices[:] = np.arange(len(tokens))
    return layout, flat


def test_burst_feeds_each_step_its_tokens_and_stops_at_the_page_table_end():
    """A stand-in model whose greedy token encodes what it was given (position, kv_len, input
    token): step j sees position + j and kv_len + j, both held at the page table's last position,
    and the token step j - 1 sampled; padding slots keep kv_len 0."""
    G, P, K = 4, 3, 5  # a 12-position table; the sequence starts at position 9

    def forward(params, tokens, positions, kv_pages, attn, logits_indices, decode_only=False):
        assert decode_only, "a burst's steps are decode only: the model may write K/V inside its attention"
        code = positions * 10_000 + attn.kv_lens[: tokens.shape[0]] * 100 + tokens % 100
        return jax.nn.one_hot(code[logits_indices], 200_000), kv_pages

    # the input token is row 0 of the previous step's tokens
    layout, flat = decode_batch(P, tokens=[-1, 0], positions=[9, 0], kv_lens=[10, 0], num_seqs=1)
    leaves, treedef = jax.tree.flatten({})
    kv = (np.zeros((P, G, 2, 8), np.float32),)
    out, last, _, lps = jax.jit(make_burst_fn(forward), static_argnums=(7, 8, 9, 10, 11, 12))(
        leaves, kv, flat, empty_rows(2, 0), np.array([42, 0, 0], np.int32), None, np.zeros((2, P), np.int32),
        layout, treedef, K, "greedy", False, None)
    assert lps is None
    out = np.asarray(out)
    fed = 42
    for j in range(K):
        pos = min(9 + j, P * G - 1)
        want = pos * 10_000 + (pos + 1) * 100 + fed % 100
        assert out[j, 0] == want, (j, out[j, 0], want)
        assert out[j, 1] // 100 % 100 == 0  # padding keeps kv_len 0
        fed = want
    np.testing.assert_array_equal(np.asarray(last), out[-1])


def test_burst_counts_its_own_tokens_for_penalties_and_lifts_bans_where_met():
    """A stand-in model whose logits rank ids 0 < 1 < 2 ... every step. Row 0 has a frequency
    penalty larger than the spread, so each step must take the best id it has not output yet: its
    history holds the prompt [5] and outputs [0, then the previous step's tokens of its row 1, a
    burst of 2: placeholders for 1 and 3]; the burst's own tokens count from the step after they are
    sampled. Row 1 (no penalties) has id 0 banned below index 7 and samples indices 4-8 (kv_len 4):
    the ban holds for 3 steps and is lifted for 2. Each step's logprobs are of the raw logits, for
    the token it sampled."""
    S, V, K = 2, 16, 5
    ranked = jnp.asarray(0.1 * (V - np.arange(V)), jnp.float32)  # a spread of 1.6 < the penalty

    def forward(params, tokens, positions, kv_pages, attn, logits_indices, decode_only=False):
        return jnp.broadcast_to(ranked, (logits_indices.shape[0], V)), kv_pages

    layout, flat = decode_batch(2, tokens=[-2, 3], positions=[4, 3], kv_lens=[5, 4], num_seqs=S)
    penalized = SeqSampling.create(SamplingParams(temperature=0.0, frequency_penalty=2.0), 0, [5], [], W)
    banning = SeqSampling.create(SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[0]), 0, [7, 7, 7], [], W)
    rows = empty_rows(S, NB)
    put_request_rows(rows, [0, 1], [penalized.row, banning.row])
    sb = sampling_rows(rows)
    sb.positions[:] = [4, 4]
    sb.banned[1, 0] = 0  # index 4 < ban_before 3 + 4: the packer bans it
    history = np.full((S, W), -1, np.int32)
    history[0, :4] = [5, 0, burst_history_placeholder(-2, 0, 3), burst_history_placeholder(-2, 1, 3)]
    prev = np.array([9, 3, 0], np.int32)  # slots 3; row 1's last token is prev_burst[1, 1]
    prev_burst = np.array([[9, 1, 0], [9, 3, 0]], np.int32)
    leaves, treedef = jax.tree.flatten({})
    kv = (np.zeros((2, 4, 2, 8), np.float32),)
    burst = jax.jit(make_burst_fn(forward), static_argnums=(7, 8, 9, 10, 11, 12))
    raw = np.asarray(jax.nn.log_softmax(ranked))
    counts = count(rows, history, prev, prev_burst, vocab_size=V)  # what the count program gives the burst
    for sampler in ("greedy", "pick"):
        out, _, _, lps = burst(leaves, kv, flat, rows, prev, counts, np.zeros((S, 2), np.int32), layout, treedef, K,
                               sampler, True, 3)
        out = np.asarray(out)[:, :S]
        np.testing.assert_array_equal(out[:, 0], [2, 4, 5, 6, 7], err_msg=sampler)
        np.testing.assert_array_equal(out[:, 1], [1, 1, 1, 0, 0], err_msg=sampler)
        np.testing.assert_allclose(np.asarray(lps.sampled), raw[out], rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(lps.top_ids), np.broadcast_to([0, 1, 2], (K, S, 3)))
        np.testing.assert_allclose(np.asarray(lps.top_logprobs), np.broadcast_to(raw[:3], (K, S, 3)), rtol=1e-6)


@pytest.fixture(scope="module")
def tiny_model():
    return load_model("dummy:stories260k", dtype="float32", seed=3)


@pytest.fixture(scope="module")
def executor(tiny_model):
    m = tiny_model
    kv = init_kv_pages(m.config, 16, 8, m.dtype, sharding=kv_cache_sharding(m.config, m.mesh), fill=float("nan"))
    table = BucketTable((16, 32), (2,))
    packer = BatchPacker(pages_per_seq=P_MAX, history_len=W, max_banned=NB, select_bucket=table.select, slots=2)
    ex = StepExecutor(make_model_fn(m.forward), params=m.params, kv_pages=kv, mesh=m.mesh, table=table,
                      empty_batch=packer.empty, vocab_size=m.config.vocab_size, max_logprobs=5, strict=True)
    ex.warmup(progress=False)
    return ex, packer, kv


def test_step_matches_plain_forward(tiny_model, executor):
    """Chunked prefill of one prompt beside the full prefill of another, then a decode, through
    reversed page tables over a NaN-filled pool: logprobs equal the unpaged forward's."""
    ex, packer, kv = executor
    m = tiny_model
    rng = np.random.default_rng()
    a = rng.integers(0, 512, 12).tolist()
    b = rng.integers(0, 512, 19).tolist()
    pages_a, pages_b = [9, 3], [15, 0, 6]
    params = SamplingParams(temperature=0.0, logprobs=5)
    table = {r: SeqSampling.create(params, 0, p, [], W) for r, p in (("a", a), ("b", b))}

    def run(plan):
        nonlocal kv
        tokens, _, lp, kv = ex(m.params, kv, packer.pack(plan, table.__getitem__))
        return np.asarray(tokens), np.asarray(lp.top_ids), np.asarray(lp.top_logprobs)

    def ref(prompt):
        logits = greedy_generate(m, prompt, 1, page_size=8).prompt_logits[-1].astype(np.float64)
        return logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())  # f64[V]

    atol = MODEL_LOGITS_F32[0]

    def check(row, ids, lps, prompt):
        # The top 5 ids in order, up to near-ties: the paged and plain logprobs differ by up to ~1e-6
        # and this dummy model's logits (std ~0.17) put two of the top 6 within 1e-5 of each other in
        # ~1 row of 600, so an id may stand in for one whose reference logprob is within atol of its.
        want = ref(prompt)
        want_lps = np.sort(want)[::-1][:5]
        np.testing.assert_allclose(lps[row], want_lps, atol=atol)
        np.testing.assert_allclose(want[ids[row]], want_lps, atol=atol, err_msg=f"ids {ids[row]}")

    tok, ids, lps = run(plan_of(seq("a", a, 0, pages_a), seq("b", b[:10], 0, pages_b, sample=False, slot=1)))
    check(0, ids, lps, a)
    t_a = int(tok[0])
    tok, ids, lps = run(plan_of(seq("a", [t_a], 12, pages_a, prefill=False), seq("b", b[10:], 10, pages_b, slot=1)))
    for row, prompt in ((0, a + [t_a]), (1, b)):
        check(row, ids, lps, prompt)
    assert ex.compiled_buckets == [(16, 2), (32, 2)]
    # a model program per bucket, 6 sampler programs for S = 2, the page table update programs
    assert ex.num_warmup_compiles == 2 + 6 + len(PAGE_UPDATE_BUCKETS)


def test_step_runs_only_the_programs_its_rows_need(tiny_model, executor, monkeypatch):
    ex, packer, _ = executor
    m = tiny_model
    kv = init_kv_pages(m.config, 16, 8, m.dtype, sharding=kv_cache_sharding(m.config, m.mesh))
    calls = []
    compiled = ex._executable
    monkeypatch.setattr(ex, "_executable", lambda key: calls.append(key) or compiled(key))
    table = {"g": SeqSampling.create(SamplingParams(temperature=0.0), 0, [1, 2, 3], [], W),
             "r": SeqSampling.create(SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.1, logprobs=2),
                                     0, [1, 2, 3], [], W)}
    tokens, _, lp, kv = ex(m.params, kv, packer.pack(plan_of(seq("g", [1, 2, 3], 0, [1])), table.__getitem__))
    assert lp is None and calls == [("model", 16, 2)]  # a greedy step is one dispatch
    calls.clear()
    both = plan_of(seq("g", [1, 2, 3], 0, [1]), seq("r", [1, 2, 3], 0, [2], slot=1))
    tokens, _, lp, kv = ex(m.params, kv, packer.pack(both, table.__getitem__))
    assert calls == [("model", 16, 2), ("count", 2), ("penalize", 2), ("pick_filtered", 2), ("logprobs", 2)]
    assert np.asarray(lp.top_ids).shape == (2, 5)


def test_step_programs_never_wait_for_the_device(tiny_model, executor):
    """No conditional (XLA's GPU runtime copies its predicate to the host and waits), and every
    loop has a trip count known at compile time (threefry's rounds, the burst's steps) but the CPU
    attention's (ragged_paged_attention/xla.py, which GPUs never run: dispatch.select_attention_impl)."""
    ex, _, _ = executor
    on_cpu = tiny_model.attn_impl == "xla"  # on a GPU host the model (head dim 8) runs the reference
    assert tiny_model.attn_impl in ("xla", "reference")
    cpu_attention = 0
    for key, exe in ex._executables.items():
        hlo = exe.as_text()
        assert "conditional(" not in hlo, key
        loops = [line for line in hlo.splitlines() if " while(" in line and "known_trip_count" not in line]
        assert all(on_cpu and "jit(_xla_attention)" in line for line in loops), key
        cpu_attention += len(loops)
    assert bool(cpu_attention) == on_cpu  # the CPU's model programs hold its attention's loops (not vacuous)


def _compile_options_seen(monkeypatch) -> list:
    """Patches jax's Lowered.compile to record (program name, options) for every compile."""
    seen, compile_ = [], jax.stages.Lowered.compile

    def spy(self, compiler_options=None, **kw):
        seen.append((self.as_text().split("@", 2)[1].split(" ")[0], compiler_options))
        return compile_(self, compiler_options, **kw)

    monkeypatch.setattr(jax.stages.Lowered, "compile", spy)
    return seen


def test_gpu_cublas_option_stays_off_other_backends(tiny_model, monkeypatch):
    """EngineConfig.gpu_cublas_min_tokens is an XLA GPU option: on the CPU no program gets it."""
    m = tiny_model
    if m.mesh.devices.flat[0].platform == "gpu":
        pytest.skip("the CPU's side of the option; tests/runtime/test_engine_gpu.py has the GPU's")
    seen = _compile_options_seen(monkeypatch)
    kv = init_kv_pages(m.config, 16, 8, m.dtype, sharding=kv_cache_sharding(m.config, m.mesh))
    table = BucketTable((16, 32), (2,))
    packer = BatchPacker(pages_per_seq=P_MAX, history_len=W, max_banned=NB, select_bucket=table.select, slots=2)
    ex = StepExecutor(make_model_fn(m.forward), params=m.params, kv_pages=kv, mesh=m.mesh, table=table,
                      empty_batch=packer.empty, vocab_size=m.config.vocab_size, max_logprobs=5, strict=True,
                      burst_fn=make_burst_fn(m.forward), decode_steps=2,
                      gpu_cublas_min_tokens=1)
    keys = ex.program_keys()
    assert all(ex.compiler_options(k) == {} for k in keys)
    # a model and a burst program (the kinds the option is for; warmup compiles through _compile too)
    chosen = [next(k for k in keys if k[0] == "model"), next(k for k in keys if k[0] == "burst")]
    for key in chosen:
        ex._compile(key, ex._lower(key))
    assert len(seen) == 2 and {o for _, o in seen} == {None}
    with pytest.raises(ValueError, match="gpu_cublas_min_tokens must be None or a positive int, got 0"):
        EngineConfig(gpu_cublas_min_tokens=0)


def test_strict_executor_refuses_to_compile_after_warmup(executor):
    ex, packer, kv = executor
    with pytest.raises(CompileAfterWarmupError, match=r"model program \(T=64, S=2\) was not compiled at warmup"):
        ex._executable(("model", 64, 2))
    with pytest.raises(CompileAfterWarmupError, match=r"pick program \(S=4\) was not compiled at warmup"):
        ex._executable(("pick", 4))


def test_lenient_executor_compiles_and_alerts(tiny_model, executor, caplog):
    _, packer, kv = executor
    m = tiny_model
    lenient = StepExecutor(make_model_fn(m.forward), params=m.params, kv_pages=kv, mesh=m.mesh,
                           table=BucketTable((16,), (2,)), empty_batch=packer.empty, vocab_size=m.config.vocab_size,
                           max_logprobs=5, strict=False)
    lenient.warmup(progress=False)  # the same program functions and shapes: JAX's caches make this cheap
    with caplog.at_level(logging.ERROR, logger="runtime.compilation"):
        lenient._executable(("model", 32, 2))
    assert lenient.num_compiles_after_warmup == 1
    assert "ALERT" in caplog.text and "(T=32, S=2)" in caplog.text


def test_compile_watcher_counts_only_its_thread():
    w = CompileWatcher()
    w.open()
    try:
        with w.watch():
            jax.jit(lambda x: x * 3 + 1)(np.arange(7))
        assert w.count == 1
        t = threading.Thread(target=lambda: jax.jit(lambda x: x * 5 - 2)(np.arange(7)))
        t.start()
        t.join()
        assert w.count == 1
    finally:
        w.close()
    with w.watch():
        jax.jit(lambda x: x * 7)(np.arange(7))
    assert w.count == 1  # closed: no longer listening
    w.open()
    ref = weakref.ref(w)
    del w
    gc.collect()
    assert ref() is None  # the registered listener does not keep a forgotten watcher (or engine) alive
