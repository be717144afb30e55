"""Ragged paged attention kernels vs the pure-jnp reference, the KV write, validators, dispatch.

CPU: the TPU kernel (interpret=True, and a few cases under pltpu.InterpretParams, which raises on
out-of-bounds reads and fills uninitialized memory with NaN) and the Triton GPU kernel
(interpret=True), over dtype x case. Inputs poison everything a kernel must not use: unused pages,
unwritten slots of a sequence's last page and padding query tokens are NaN, page_indices entries
past a sequence's pages and metadata past num_seqs are out-of-range junk. Valid outputs must match
the reference within tests/tolerances.py; padding outputs must be finite.

Cases that share a shape differ only in metadata values, so they reuse one compiled kernel: that
keeps this file inside its CPU time budget. `gpu`-marked tests run the Triton kernel for real.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import dispatch
from pallas_kernels.ragged_paged_attention import (
    BlockSizes, gpu, ragged_paged_attention, ref_cost_estimate, ref_ragged_paged_attention,
    ref_write_kv_pages, ref_write_qkv, tpu, validate_inputs, xla)
from tests.testing.partials import exact_partials
from tests.tolerances import tol

ON_GPU = jax.default_backend() == "gpu"
requires_gpu = pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")
DTYPES = [jnp.float32, jnp.bfloat16]
JUNK = 1 << 20  # page index / length far out of range


@dataclasses.dataclass(frozen=True)
class Shape:
    N: int = 8
    K: int = 2
    H: int = 128
    G: int = 16
    T: int = 46  # not a multiple of the test token blocks
    S: int = 6  # page_indices rows; rows past num_seqs hold junk
    P_max: int = 8
    sliding_window: int | None = None
    soft_cap: float | None = None
    pages: int | None = None  # cache size; default: enough for every row, plus spare NaN pages

    @property
    def P(self) -> int:
        return self.pages or self.S * self.P_max + 5


@dataclasses.dataclass(frozen=True)
class Batch:
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]


BASE = Shape()
# Metadata-only cases on one shape (GQA 4, H=128, pages of 16).
BATCHES = {
    "decode_only": Batch((1, 1, 1, 1, 1, 1), (1, 16, 17, 33, 128, 70)),
    "prefill_only": Batch((17, 16, 1, 12), (17, 16, 1, 12)),
    "mixed": Batch((1, 20, 1, 9, 1), (100, 20, 64, 73, 5)),
    "page_boundary": Batch((16, 1, 15, 1, 2), (32, 16, 47, 49, 64)),
    "single_token": Batch((1,), (1,)),
    "empty_q_seq": Batch((3, 0, 5, 0, 2), (10, 7, 40, 3, 2)),
    "no_seqs": Batch((), ()),
    "full_budget": Batch((30, 16), (128, 16)),
}


def _shape_batch(s: Shape) -> Batch:
    """Decode, a fresh prefill, a chunk crossing pages and a page-boundary decode on any shape."""
    G = s.G
    return Batch((1, 7, 5, 1), (1, 7, 2 * G - 1, min(s.P_max * G, 2 * G + 1)))


# Shape cases: each compiles once per kernel and dtype.
SHAPES = {
    "gqa1_h64": Shape(N=4, K=4, H=64, T=24, P_max=3),
    "gqa2_page32": Shape(N=8, K=4, G=32, T=24, P_max=3),
    "gqa3": Shape(N=12, K=4, H=64, T=24, P_max=3),
    "gqa8_h256_page64": Shape(N=8, K=1, H=256, G=64, T=24, P_max=3),
    "gqa16_page128": Shape(N=16, K=1, H=64, G=128, T=24, P_max=3),
    "kv_head_blocks": Shape(N=32, K=16, H=64, T=24, P_max=3),  # TPU grid splits KV heads
    "sliding_window": Shape(sliding_window=20),
    "soft_cap": Shape(soft_cap=5.0),
    "window_cap_page64": Shape(G=64, T=24, P_max=3, sliding_window=50, soft_cap=3.0),
}

CASES = {**{k: (BASE, b) for k, b in BATCHES.items()}, **{k: (s, _shape_batch(s)) for k, s in SHAPES.items()}}


def make_inputs(shape: Shape, batch: Batch, dtype, seed: int):
    """Arguments of the op (numpy -> jnp) with every unused value poisoned, and the real token count."""
    rng = np.random.default_rng(seed)
    N, K, H, G, T, S, P_max, P = shape.N, shape.K, shape.H, shape.G, shape.T, shape.S, shape.P_max, shape.P
    n = len(batch.q_lens)
    assert n <= S and sum(batch.q_lens) <= T and max(batch.kv_lens, default=0) <= P_max * G
    kv = np.full((P, G, 2 * K, H), np.nan, np.float32)
    page_indices = rng.integers(P + 1, JUNK, (S, P_max)).astype(np.int32)
    free = rng.permutation(P)
    used = 0
    for s, (q_len, kv_len) in enumerate(zip(batch.q_lens, batch.kv_lens)):
        assert q_len <= kv_len
        pages = free[used: used + -(-kv_len // G)]
        used += len(pages)
        page_indices[s, : len(pages)] = pages
        kv[pages] = rng.standard_normal((len(pages), G, 2 * K, H))
        kv[pages[-1], kv_len - (len(pages) - 1) * G:] = np.nan  # slots not written yet
    cu = np.concatenate([[0], np.cumsum(batch.q_lens, dtype=np.int64)]).astype(np.int32)
    cu_q_lens = np.concatenate([cu, rng.integers(0, JUNK, S - n)]).astype(np.int32)
    kv_lens = np.concatenate([np.asarray(batch.kv_lens, np.int32), rng.integers(0, JUNK, S - n)]).astype(np.int32)
    q = rng.standard_normal((T, N, H)).astype(np.float32)
    q[cu[-1]:] = np.nan
    args = (jnp.asarray(q, dtype), jnp.asarray(kv, dtype), jnp.asarray(kv_lens), jnp.asarray(page_indices),
            jnp.asarray(cu_q_lens), jnp.asarray([n], jnp.int32))
    return args, int(cu[-1])


def _opts(shape: Shape) -> dict:
    return dict(sm_scale=shape.H ** -0.5, sliding_window=shape.sliding_window, soft_cap=shape.soft_cap)


@functools.lru_cache(maxsize=None)
def case_inputs(case: str, dtype_name: str):
    """Inputs and the reference output of a case, shared by every kernel's test."""
    shape, batch = CASES[case]
    seed = zlib.crc32(f"{case}/{dtype_name}".encode())
    args, n_real = make_inputs(shape, batch, jnp.dtype(dtype_name), seed)
    ref = jax.jit(functools.partial(ref_ragged_paged_attention, **_opts(shape)))(*args)
    ref = np.asarray(ref.astype(jnp.float32))
    assert np.isfinite(ref[:n_real]).all()
    return args, ref, n_real


def check_kernel(run, case: str, dtype):
    args, ref, n_real = case_inputs(case, jnp.dtype(dtype).name)
    out = run(*args, **_opts(CASES[case][0]))
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all(), "non-finite output (padding tokens must be finite too)"
    np.testing.assert_array_equal(out[n_real:], 0.0, err_msg="padding tokens' outputs must be zero")
    atol, rtol = tol(dtype)
    np.testing.assert_allclose(out[:n_real], ref[:n_real], atol=atol, rtol=rtol)


def gpu_test_blocks(shape: Shape, splits: int) -> BlockSizes:
    return BlockSizes(q_tokens_per_block=4, kv_pages_per_block=max(1, 32 // shape.G), kv_splits=splits)


TPU_TEST_BLOCKS = BlockSizes(q_tokens_per_block=8, kv_pages_per_block=2)


# ---- TPU kernel (Mosaic), interpret mode ----------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_tpu_kernel(case, dtype):
    check_kernel(functools.partial(tpu.ragged_paged_attention, block_sizes=TPU_TEST_BLOCKS, interpret=True),
                 case, dtype)


@pytest.mark.parametrize("case,dtype", [("mixed", jnp.float32), ("mixed", jnp.bfloat16),
                                        ("window_cap_page64", jnp.float32)], ids=str)
def test_tpu_kernel_simulated(case, dtype):
    """TPU memory simulation: DMAs, semaphores, out-of-bounds reads raise, scratch starts as NaN."""
    check_kernel(functools.partial(tpu.ragged_paged_attention, block_sizes=TPU_TEST_BLOCKS,
                                   interpret=pltpu.InterpretParams()), case, dtype)


def test_tpu_simulator_catches_bad_page_index():
    """A page index past the cache, if validation is bypassed, is an out-of-bounds DMA read."""
    args, _, _ = case_inputs("mixed", "float32")
    page_indices = args[3].at[1, 0].set(BASE.P + 3)
    with pytest.raises(Exception, match="(?i)out[- ]of[- ]bounds"):
        jax.block_until_ready(tpu._ragged_paged_attention(
            *args[:3], page_indices, *args[4:], **_opts(BASE), block_sizes=TPU_TEST_BLOCKS,
            interpret=pltpu.InterpretParams()))


def test_tpu_default_block_sizes():
    check_kernel(functools.partial(tpu.ragged_paged_attention, interpret=True), "mixed", jnp.bfloat16)


# ---- GPU kernel (Triton), interpret mode ----------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_gpu_kernel(case, dtype):
    splits = 1 if case in SHAPES and list(SHAPES).index(case) % 2 else 2  # both epilogues over shapes
    bs = gpu_test_blocks(CASES[case][0], splits)
    check_kernel(functools.partial(gpu.ragged_paged_attention, block_sizes=bs, interpret=True), case, dtype)


@pytest.mark.parametrize("case", [c for c, (shape, _) in CASES.items() if shape.K % 2 == 0])
def test_gpu_kernel_kv_heads_per_block(case):
    """Two KV heads a program (their keys side by side in one tile, each row masked to its own
    head's), with and without splits."""
    shape = CASES[case][0]
    splits = 1 + zlib.crc32(case.encode()) % 2
    bs = dataclasses.replace(gpu_test_blocks(shape, splits), q_tokens_per_block=2, kv_heads_per_block=2)
    check_kernel(functools.partial(gpu.ragged_paged_attention, block_sizes=bs, interpret=True), case, jnp.float32)


@pytest.mark.parametrize("splits", [1, 2])
def test_gpu_kernel_leading_padding(splits):
    """Tokens before cu_q_lens[0] are padding too: zero, like those past cu_q_lens[num_seqs] (with one
    split the kernel's unused work items write both; with several, the merge)."""
    shape, batch = BASE, BATCHES["mixed"]
    (q, *rest), n_real = make_inputs(shape, batch, jnp.float32, seed=5)
    lead = 5
    q = jnp.concatenate([jnp.full((lead,) + q.shape[1:], jnp.nan, q.dtype), q[:-lead]])
    cu = rest[3].at[: len(batch.q_lens) + 1].add(lead)
    args = (q, rest[0], rest[1], rest[2], cu, rest[4])
    want = np.asarray(ref_ragged_paged_attention(*args, **_opts(shape)))
    got = np.asarray(gpu.ragged_paged_attention(*args, **_opts(shape), interpret=True,
                                                block_sizes=gpu_test_blocks(shape, splits)))
    real = np.zeros(shape.T, bool)
    real[lead: lead + n_real] = True
    np.testing.assert_array_equal(got[~real], 0.0)
    np.testing.assert_allclose(got[real], want[real], atol=tol(jnp.float32)[0], rtol=tol(jnp.float32)[1])


@pytest.mark.parametrize("case", ["decode_only", "prefill_only"])
def test_gpu_default_block_sizes(case):
    check_kernel(functools.partial(gpu.ragged_paged_attention, interpret=True), case, jnp.bfloat16)


def test_gpu_default_block_sizes_stack_prefill_rows():
    """A bucket of prefill chunks (T >= 8 S) stacks 64 rows a program (16 tokens of GQA 4), a
    decode-sized one 16 (4 tokens); the 64-row default matches the reference."""
    shape = Shape(T=64, S=4)
    args, n_real = make_inputs(shape, Batch((30, 17, 1, 16), (30, 40, 70, 16)), jnp.bfloat16, seed=5)
    assert gpu.default_block_sizes(args[0], args[1], args[3]).q_tokens_per_block == 16
    assert gpu.default_block_sizes(args[0][:8], args[1], args[3]).q_tokens_per_block == 4
    ref = jax.jit(functools.partial(ref_ragged_paged_attention, **_opts(shape)))(*args)
    out = gpu.ragged_paged_attention(*args, **_opts(shape), interpret=True)
    atol, rtol = tol(jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(out, np.float32)[:n_real], np.asarray(ref, np.float32)[:n_real],
                               atol=atol, rtol=rtol)


def test_gpu_default_block_sizes_decode_batches():
    """A decode batch that fills the GPU without splitting keys reads K tiles of 8k elements: 128
    keys a block at head dim 64, 64 at 128; at head dim 64 up to 4 KV heads a program share them
    while >= 3 programs per SM remain (132 SMs when the device reports none); a batch-1 decode keeps
    64 keys and splits. The 128-key default matches the reference."""
    def keys_heads_splits(S, H, N=32, K=8, G=16, P_max=48):
        bs = gpu.default_block_sizes(jnp.zeros((S, N, H), jnp.bfloat16), jnp.zeros((4, G, 2 * K, H), jnp.bfloat16),
                                     jnp.zeros((S, P_max), jnp.int32))
        gpu.check_block_sizes(bs, jnp.zeros((S, N, H)), jnp.zeros((4, G, 2 * K, H)), jnp.zeros((S, P_max), jnp.int32))
        assert bs.q_tokens_per_block * bs.kv_heads_per_block * N // K == min(16, S * N // K)  # rows a program
        return bs.kv_pages_per_block * G, bs.kv_heads_per_block, bs.kv_splits

    assert keys_heads_splits(256, 64) == (32, 4, 1)  # 512 programs of 4 KV heads
    assert keys_heads_splits(128, 64) == (64, 2, 1)
    assert keys_heads_splits(64, 64) == (128, 1, 1)
    assert keys_heads_splits(256, 64, G=64) == (64, 2, 1)  # no fewer keys than a page
    assert keys_heads_splits(256, 128) == (64, 1, 1)
    assert keys_heads_splits(1, 64)[:2] == (64, 1) and keys_heads_splits(1, 64)[2] > 1
    assert keys_heads_splits(256, 64, P_max=1) == (16, 4, 1)  # no wider than the page table
    shape = Shape(N=4, K=4, H=64, T=72, S=72, P_max=12)  # 72 sequences x 4 KV heads: no splits
    rng = np.random.default_rng(7)
    q_lens = (1,) * 72
    args, n_real = make_inputs(shape, Batch(q_lens, tuple(int(x) for x in rng.integers(1, 193, 72))), jnp.bfloat16,
                               seed=7)
    bs = gpu.default_block_sizes(args[0], args[1], args[3])
    assert (bs.kv_pages_per_block * shape.G, bs.kv_splits) == (128, 1)
    ref = jax.jit(functools.partial(ref_ragged_paged_attention, **_opts(shape)))(*args)
    out = gpu.ragged_paged_attention(*args, **_opts(shape), interpret=True)
    atol, rtol = tol(jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(out, np.float32)[:n_real], np.asarray(ref, np.float32)[:n_real],
                               atol=atol, rtol=rtol)


def test_gpu_merge_of_mostly_empty_splits():
    """Batch-1-like decode with a wide page table: 8 splits of 16-key blocks over contexts of 1 to
    128 keys (the short ones leave most splits empty, the longest fills all 8), a 3-token chunk
    whose rows see different splits, and padding tokens (their partials are never written: the
    merge must keep them out of every output and write the padding rows)."""
    shape = Shape(N=6, K=2, H=64, T=12, S=4, P_max=8)  # 6 q heads: the merge pads rows to 8
    args, n_real = make_inputs(shape, Batch((1, 3, 1, 1), (128, 20, 1, 47)), jnp.bfloat16, seed=11)
    bs = BlockSizes(q_tokens_per_block=1, kv_pages_per_block=1, kv_splits=8)
    ref = jax.jit(functools.partial(ref_ragged_paged_attention, **_opts(shape)))(*args)
    out = np.asarray(gpu.ragged_paged_attention(*args, **_opts(shape), block_sizes=bs, interpret=True), np.float32)
    atol, rtol = tol(jnp.bfloat16)
    np.testing.assert_allclose(out[:n_real], np.asarray(ref, np.float32)[:n_real], atol=atol, rtol=rtol)
    assert (out[n_real:] == 0).all()
    # the default for one decode token over a 128-key table: a split per 64-key block (was 1)
    assert gpu.default_block_sizes(args[0][:1], args[1], args[3]).kv_splits == 2


def test_gpu_merge_keeps_unwritten_partials_out():
    """The merge loads every split's partial at once, before it knows which hold keys: NaN in the
    partials of splits that saw no key (lse -inf), and whatever padding tokens' rows hold (never
    written: before cu_q_lens[0] and from cu_q_lens[num_seqs] on; NaN or finite garbage), reach no
    output. A real row is the lse-weighted mean of the splits that hold keys, a padding row zeros."""
    splits, T, N, H = 3, 5, 2, 16
    rng = np.random.default_rng(4)
    o = rng.standard_normal((splits, T * N, H)).astype(np.float32)
    lse = rng.standard_normal((splits, T * N)).astype(np.float32)
    cu_q_lens, num_seqs = np.array([1, 2, 4, 4], np.int32), np.array([2], np.int32)  # real tokens 1-3
    lse[1:, N:2 * N], o[1:, N:2 * N] = -np.inf, np.nan  # token 1: only split 0 saw keys
    o[:, :N], lse[:, :N] = np.nan, np.nan  # padding token 0: NaN; padding token 4 keeps finite garbage
    items = gpu._item_table(jnp.asarray(cu_q_lens), jnp.asarray(num_seqs), jnp.zeros(3, jnp.int32), 1, T)
    out = np.asarray(gpu._merge_splits(jnp.asarray(o), jnp.asarray(lse), items, num_heads=N, dtype=jnp.float32,
                                       interpret=True))
    want = np.zeros((T * N, H), np.float32)
    for row in range(N, 4 * N):
        used = np.isfinite(lse[:, row])
        w = np.exp2(lse[used, row] - lse[used, row].max())
        want[row] = (w[:, None] * o[used, row]).sum(0) / w.sum()
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("pages_per_seq", [1, 2, 3, 5, 7, 9])
def test_gpu_default_block_sizes_fit_any_page_table(pages_per_seq, page_size):
    """The defaults must be valid for any page table width, not only powers of two (a greedy run
    over a 40-token prompt with pages of 16 has 3 pages per sequence)."""
    q = jnp.zeros((5, 8, 64), jnp.bfloat16)
    kv = jnp.zeros((4, page_size, 4, 64), jnp.bfloat16)
    pages = jnp.zeros((2, pages_per_seq), jnp.int32)
    bs = gpu.default_block_sizes(q, kv, pages)
    gpu.check_block_sizes(bs, q, kv, pages)  # raises on a block the kernel cannot run


@pytest.mark.parametrize("page_size,pages_per_seq", [(24, 4), (8, 1), (4, 3)])
def test_dispatch_runs_the_reference_for_pages_the_gpu_kernel_cannot_block(page_size, pages_per_seq):
    """Key blocks must be a power of two >= 16 keys: pages of 24, or of 8 in one-page tables, make
    none, and the kernel refused them with no way around (the page size is the engine's setting).
    The dispatcher runs the reference there (it would fail on this CPU host trying the kernel)."""
    assert not gpu.pages_fit(page_size, pages_per_seq) and gpu.pages_fit(16, 1) and gpu.pages_fit(8, 2)
    shape = Shape(N=4, K=2, H=64, G=page_size, T=8, S=3, P_max=pages_per_seq)
    G = page_size
    args, n = make_inputs(shape, Batch((1, 2, 3), (G * pages_per_seq, 2, min(G * pages_per_seq, G + 3))),
                          jnp.float32, 3)
    out = dispatch.ragged_paged_attention(*args, **_opts(shape), implementation="gpu")
    want = ref_ragged_paged_attention(*args, **_opts(shape))
    np.testing.assert_array_equal(np.asarray(out)[:n], np.asarray(want)[:n])


def test_gpu_kernel_lowers_for_cuda():
    """Pallas' Triton lowering (to Triton IR) runs on CPU: catches unsupported ops before a GPU run."""
    args, _, _ = case_inputs("mixed", "bfloat16")
    for splits in (1, 3):
        f = functools.partial(gpu.ragged_paged_attention, sm_scale=0.1, sliding_window=9, soft_cap=4.0,
                              block_sizes=gpu_test_blocks(BASE, splits))
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "triton" in text


def test_op_by_implementation_name():
    args, ref, n = case_inputs("mixed", "float32")
    for impl in ("tpu", "gpu", "xla"):
        out = ragged_paged_attention(*args, **_opts(BASE), implementation=impl, interpret=True)
        np.testing.assert_allclose(np.asarray(out)[:n], ref[:n], *tol(jnp.float32)[::-1])
    with pytest.raises(ValueError, match="implementation='cuda'"):
        ragged_paged_attention(*args, **_opts(BASE), implementation="cuda")


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_f32_queries_over_bf16_cache(impl):
    """f32 activations with a bf16 cache: q is cast to bf16 for the matmuls, the output stays f32."""
    args, _, n = case_inputs("mixed", "bfloat16")
    q = jnp.asarray(np.random.default_rng(11).standard_normal(args[0].shape), jnp.float32)
    args = (q, *args[1:])
    ref = np.asarray(ref_ragged_paged_attention(*args, **_opts(BASE)))
    out = ragged_paged_attention(*args, **_opts(BASE), implementation=impl, interpret=True)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out)[:n], ref[:n], *tol(jnp.bfloat16)[::-1])


# ---- "xla": jnp that does only the batch's work (the CPU path) -------------------------------------

@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_xla_impl(case, dtype):
    check_kernel(xla.xla_ragged_paged_attention, case, dtype)


@pytest.mark.parametrize("q_tokens,kv_pages", [(1, 1), (4, 2), (16, 8), (64, 3)])
@pytest.mark.parametrize("case", ["mixed", "page_boundary", "empty_q_seq", "sliding_window", "window_cap_page64"])
def test_xla_impl_tiles(case, q_tokens, kv_pages):
    """Any tile and key block give the reference's output: tiles of one token, tiles wider than any
    sequence's chunk (64 > T = 46 clamps to T), key blocks of one page, of several, of a count that
    does not divide the page table."""
    run = functools.partial(xla.xla_ragged_paged_attention,
                            block_sizes=BlockSizes(q_tokens_per_block=q_tokens, kv_pages_per_block=kv_pages))
    check_kernel(run, case, jnp.float32)


def test_xla_impl_is_batch_invariant():
    """A sequence's outputs are bit-identical alone and beside other sequences, wherever its tokens
    fall in the tiles (for given tile and block sizes: their widths change the dots' blocking, as a
    bucket's T changes the model's matmuls; tests/testing/engine.py, GAP)."""
    args, _, n = case_inputs("mixed", "float32")
    q, kv, kv_lens, pi, cu, _ = args
    shape, batch = CASES["mixed"]
    opts = _opts(shape)
    together = np.asarray(xla.xla_ragged_paged_attention(
        *args, **opts, block_sizes=BlockSizes(q_tokens_per_block=3, kv_pages_per_block=1)))
    for s, q_len in enumerate(batch.q_lens):
        start = int(cu[s])
        alone = xla.xla_ragged_paged_attention(
            q[start:start + q_len], kv, kv_lens[s:s + 1], pi[s:s + 1], jnp.asarray([0, q_len], jnp.int32),
            jnp.asarray([1], jnp.int32), **opts,
            block_sizes=BlockSizes(q_tokens_per_block=3, kv_pages_per_block=1))
        np.testing.assert_array_equal(np.asarray(alone), together[start:start + q_len])


def test_xla_impl_skips_keys_no_token_sees():
    """The work follows the batch: keys past every sequence's length are never read (poisoned pages
    beyond kv_len cannot leak even through a 0 * NaN), and a sliding window starts at its block."""
    args, ref, n = case_inputs("sliding_window", "float32")
    out = xla.xla_ragged_paged_attention(*args, **_opts(SHAPES["sliding_window"]),
                                         block_sizes=BlockSizes(q_tokens_per_block=2, kv_pages_per_block=1))
    np.testing.assert_allclose(np.asarray(out)[:n], ref[:n], *tol(jnp.float32)[::-1])
    text = jax.jit(functools.partial(xla.xla_ragged_paged_attention, **_opts(BASE))).lower(
        *case_inputs("mixed", "float32")[0]).as_text()
    assert text.count("stablehlo.while") >= 2  # items and key blocks: loops to traced bounds


def test_xla_default_block_sizes():
    q = jnp.zeros((128, 8, 64))
    kv = jnp.zeros((64, 16, 4, 64))
    assert xla.default_block_sizes(q, kv, jnp.zeros((8, 32), jnp.int32)) == BlockSizes(16, 4)  # 64 keys
    assert xla.default_block_sizes(q[:16], kv, jnp.zeros((8, 32), jnp.int32)).q_tokens_per_block == 1
    assert xla.default_block_sizes(q, kv, jnp.zeros((8, 32), jnp.int32), decode_only=True).q_tokens_per_block == 1
    assert xla.default_block_sizes(q, kv, jnp.zeros((1, 2), jnp.int32)).kv_pages_per_block == 2  # the table's width


# ---- reference and dispatch -----------------------------------------------------------------------

def test_reference_is_causal_attention():
    """The oracle against a direct numpy softmax over each sequence's gathered keys."""
    args, ref, n_real = case_inputs("mixed", "float32")
    q, kv, kv_lens, pi, cu, _ = (np.asarray(a) for a in args)
    shape, batch = CASES["mixed"]
    G, K, qpk = shape.G, shape.K, shape.N // shape.K
    for s, (q_len, kv_len) in enumerate(zip(batch.q_lens, batch.kv_lens)):
        keys = kv[pi[s, : -(-kv_len // G)]].reshape(-1, 2 * K, shape.H)[:kv_len]
        for i in range(q_len):
            t, pos = cu[s] + i, kv_len - q_len + i
            for n in range(shape.N):
                k, v = keys[: pos + 1, 2 * (n // qpk)], keys[: pos + 1, 2 * (n // qpk) + 1]
                w = np.exp(q[t, n] @ k.T * shape.H ** -0.5 - np.max(q[t, n] @ k.T * shape.H ** -0.5))
                np.testing.assert_allclose(ref[t, n], w @ v / w.sum(), atol=1e-5, rtol=1e-5)


def test_dispatch_on_cpu_runs_xla():
    args, ref, n = case_inputs("mixed", "bfloat16")
    # "auto" picks by the platform of concrete arrays (under tracing, by the default backend's, the
    # GPU's on a GPU host), so the call is eager and the arrays are the CPU's
    args = jax.device_put(args, jax.devices("cpu")[0])
    out = dispatch.ragged_paged_attention(*args, **_opts(BASE))
    want = xla.xla_ragged_paged_attention(*args, **_opts(BASE))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32))[:n], ref[:n], *tol(jnp.bfloat16)[::-1])
    oracle = dispatch.ragged_paged_attention(*args, **_opts(BASE), implementation="reference")
    # the reference on the CPU's arrays (ref ran on the default device: a GPU's rounds differently)
    np.testing.assert_array_equal(np.asarray(oracle), np.asarray(ref_ragged_paged_attention(*args, **_opts(BASE))))
    assert dispatch._platform(args[0]) == "cpu"
    assert dispatch.select_attention_impl("cpu", 64) == "xla"
    assert dispatch.select_attention_impl("gpu", 8) == "reference"  # no loops of traced bounds on a GPU
    with pytest.raises(ValueError, match="implementation"):
        dispatch.ragged_paged_attention(*args, **_opts(BASE), implementation="cuda")


def test_cost_estimate_counts_reference_work():
    args, _, _ = case_inputs("mixed", "bfloat16")
    q, kv = args[0], args[1]
    c = ref_cost_estimate(q, kv, args[3])
    keys = BASE.P_max * BASE.G
    assert c.flops == 4 * BASE.T * BASE.N * BASE.H * keys
    assert c.transcendentals == BASE.T * BASE.N * keys
    assert c.bytes_accessed >= min(BASE.P, BASE.S * BASE.P_max) * BASE.G * 2 * BASE.K * BASE.H * 2


# ---- KV write then attention (the write itself: test_write_kv_pages.py) ----------------------------

def test_write_then_attend_matches_dense_attention():
    """Write a whole prompt through ref_write_kv_pages, then attend: equals dense causal attention."""
    rng = np.random.default_rng(3)
    T, N, K, H, G = 9, 4, 2, 16, 4
    P = 6  # pages in the pool; the prompt takes 3 of them
    q, k, v = (rng.standard_normal((T, n, H)).astype(np.float32) for n in (N, K, K))
    meta = (jnp.asarray([T], jnp.int32), jnp.asarray([[4, 1, 5]], jnp.int32), jnp.asarray([0, T], jnp.int32),
            jnp.asarray([1], jnp.int32))
    kv = ref_write_kv_pages(jnp.full((P, G, 2 * K, H), jnp.nan), jnp.asarray(k), jnp.asarray(v), *meta)
    out = ref_ragged_paged_attention(jnp.asarray(q), kv, *meta, sm_scale=0.25)
    kk, vv = np.repeat(k, N // K, 1), np.repeat(v, N // K, 1)
    logits = np.einsum("tnh,snh->nts", q, kk) * 0.25 + np.triu(np.full((T, T), -np.inf), 1)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    want = np.einsum("nts,snh->tnh", w / w.sum(-1, keepdims=True), vv)
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-5, rtol=1e-5)


# ---- write_qkv_attention: the decode step's KV write inside the attention ---------------------------

def _decode_batch(shape: Shape) -> Batch:
    G = shape.G
    return Batch((1, 1, 1, 1), (1, G, G + 1, min(shape.P_max * G, 2 * G + 1)))


FUSED_CASES = {  # (shape, KV heads a program, splits)
    "base": (BASE, 1, 1), "base_splits": (BASE, 2, 2), "base_8_splits": (BASE, 1, 8),  # 8: empty splits past the table
    "gqa1_h64": (SHAPES["gqa1_h64"], 2, 1),
    "gqa3": (SHAPES["gqa3"], 4, 2), "gqa16_page128": (SHAPES["gqa16_page128"], 1, 1),
    "sliding_window": (SHAPES["sliding_window"], 1, 2), "window_cap_page64": (SHAPES["window_cap_page64"], 1, 1),
}


def _fused_inputs(shape: Shape, dtype, seed: int, batch: Batch | None = None):
    """(kv, qkv, cos, sin, meta, n_real) of a decode batch, each token's own slot NaN before the
    call (the kernel takes that key from the projection, never from the pages); and what
    ref_write_qkv then the reference attention give: (want_o f32, want_pool)."""
    batch = batch or _decode_batch(shape)
    (_, kv, *meta), n = make_inputs(shape, batch, dtype, seed=seed)
    kv = np.array(kv.astype(jnp.float32))
    pages = np.asarray(meta[1])
    for s, kv_len in enumerate(batch.kv_lens):
        kv[pages[s, (kv_len - 1) // shape.G], (kv_len - 1) % shape.G] = np.nan
    kv = jnp.asarray(kv, dtype)
    rng = np.random.default_rng(seed)
    K, R = shape.K, shape.N // shape.K
    qkv = rng.standard_normal((shape.T, K, R + 2, shape.H)).astype(np.float32)
    qkv[n:] = np.nan  # padding tokens
    qkv = jnp.asarray(qkv, dtype)
    ang = rng.uniform(0, 100, (shape.T, shape.H // 2)).astype(np.float32)
    cos, sin = jnp.asarray(np.cos(ang)), jnp.asarray(np.sin(ang))
    q, want_pool = ref_write_qkv(kv, qkv, cos, sin, *meta)
    want = np.asarray(ref_ragged_paged_attention(q, want_pool, *meta, **_opts(shape)).astype(jnp.float32))
    return (kv, qkv, cos, sin, meta, n), (want, want_pool)


def _check_fused(shape: Shape, dtype, got, inputs, wants):
    (kv, qkv, _, _, _, n), (want, want_pool) = inputs, wants
    o, pool = got
    assert o.shape == want.shape and o.dtype == qkv.dtype and pool.shape == kv.shape and pool.dtype == kv.dtype
    o = np.asarray(o.astype(jnp.float32))
    np.testing.assert_array_equal(o[n:], 0.0, err_msg="padding tokens' outputs must be zero")
    atol, rtol = tol(dtype)
    np.testing.assert_allclose(o[:n], want[:n], atol=atol, rtol=rtol)
    np.testing.assert_allclose(np.asarray(pool.astype(jnp.float32)), np.asarray(want_pool.astype(jnp.float32)),
                               atol=atol, rtol=rtol)  # NaN where the reference has NaN: untouched slots


@pytest.mark.parametrize("case", list(FUSED_CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_gpu_write_qkv_attention_is_write_then_attend(case, dtype):
    """The fused decode kernel against ref_write_qkv then the reference attention: the outputs, and
    the pool (the tokens' k and v written, nothing else touched)."""
    shape, kh, splits = FUSED_CASES[case]
    inputs, wants = _fused_inputs(shape, dtype, zlib.crc32(case.encode()))
    kv, qkv, cos, sin, meta, _ = inputs
    bs = dataclasses.replace(gpu_test_blocks(shape, splits), q_tokens_per_block=1, kv_heads_per_block=kh)
    got = gpu.write_qkv_attention(kv, qkv, cos, sin, *meta, **_opts(shape), block_sizes=bs, interpret=True)
    _check_fused(shape, dtype, got, inputs, wants)


@pytest.mark.parametrize("case", ["base_splits", "gqa3", "sliding_window"])
def test_gpu_write_qkv_attention_sums_partial_products(case):
    """qkv as f32 partial products (dispatch.gemv_partials): the kernel sums each row's parts and
    rounds them to the cache's dtype as it loads them; the same output and pool as from the summed
    projection, and as the reference path through dispatch."""
    shape, kh, splits = FUSED_CASES[case]
    inputs, wants = _fused_inputs(shape, jnp.bfloat16, zlib.crc32(case.encode()) + 1)
    kv, qkv, cos, sin, meta, _ = inputs
    bs = dataclasses.replace(gpu_test_blocks(shape, splits), q_tokens_per_block=1, kv_heads_per_block=kh)
    f = functools.partial(gpu.write_qkv_attention, **_opts(shape), block_sizes=bs, interpret=True)
    want = f(kv, qkv, cos, sin, *meta)
    for parts in (2, 8):
        got = f(kv, exact_partials(qkv, parts), cos, sin, *meta)
        _check_fused(shape, jnp.bfloat16, got, inputs, wants)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))
    ref = functools.partial(dispatch.write_qkv_attention, **_opts(shape), decode_only=True, implementation="reference")
    for g, w in zip(ref(kv, exact_partials(qkv, 4), cos, sin, *meta), ref(kv, qkv, cos, sin, *meta)):
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))
    with pytest.raises(ValueError, match="partial products .* must be float32"):
        f(kv, exact_partials(qkv, 2).astype(jnp.bfloat16), cos, sin, *meta)


def test_gpu_write_qkv_attention_lowers_for_cuda_in_place():
    """The fused kernel through Pallas' Triton lowering on CPU (with splits, window and soft cap), the
    pool aliased to its output."""
    shape = SHAPES["window_cap_page64"]
    (kv, qkv, cos, sin, meta, _), _ = _fused_inputs(shape, jnp.bfloat16, 3)
    for splits in (1, 2):
        f = functools.partial(gpu.write_qkv_attention, **_opts(shape), block_sizes=gpu_test_blocks(shape, splits))
        text = jax.jit(f, donate_argnums=0).trace(kv, qkv, cos, sin, *meta).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "triton" in text and "tf.aliasing_output" in text


def test_gpu_write_qkv_attention_default_blocks_and_bad_shapes():
    shape = SHAPES["kv_head_blocks"]  # 16 KV heads of 64: the defaults take several a program
    inputs, wants = _fused_inputs(shape, jnp.bfloat16, 11)
    kv, qkv, cos, sin, meta, _ = inputs
    got = gpu.write_qkv_attention(kv, qkv, cos, sin, *meta, **_opts(shape), interpret=True)
    _check_fused(shape, jnp.bfloat16, got, inputs, wants)
    with pytest.raises(ValueError, match="must be \\[T, K, R \\+ 2, H\\]"):
        gpu.write_qkv_attention(kv, qkv[:, :, :2], cos, sin, *meta, **_opts(shape), interpret=True)
    with pytest.raises(ValueError, match="cos"):
        gpu.write_qkv_attention(kv, qkv, cos[:-1], sin, *meta, **_opts(shape), interpret=True)


# ---- validation -----------------------------------------------------------------------------------

def _valid_args():
    return list(case_inputs("mixed", "float32")[0])


def _replace(i, value):
    args = _valid_args()
    args[i] = value
    return args


BAD_INPUTS = {
    "q_rank": (lambda: _replace(0, jnp.zeros((46, 8 * 128))), "q must have 3 dims"),
    "head_dim": (lambda: _replace(0, jnp.zeros((46, 8, 64))), "head dim"),
    "n_not_multiple_of_k": (lambda: _replace(0, jnp.zeros((46, 7, 128))), r"N=7 heads, not a multiple of K=2"),
    "odd_kv_axis": (lambda: _replace(1, jnp.zeros((53, 16, 3, 128))), r"kv_pages.shape\[2\]=3"),
    "kv_dtype": (lambda: _replace(1, _valid_args()[1].astype(jnp.float16)), "kv_pages dtype float16"),
    "q_dtype": (lambda: _replace(0, _valid_args()[0].astype(jnp.float16)), "q dtype float16"),
    "kv_lens_len": (lambda: _replace(2, jnp.zeros((5,), jnp.int32)), "kv_lens has 5 entries"),
    "kv_lens_dtype": (lambda: _replace(2, _valid_args()[2].astype(jnp.float32)), "kv_lens must be int32"),
    "cu_q_lens_len": (lambda: _replace(4, jnp.zeros((6,), jnp.int32)), "cu_q_lens has 6 entries"),
    "num_seqs_shape": (lambda: _replace(5, jnp.asarray([1, 1], jnp.int32)), "num_seqs must have shape"),
    "page_out_of_range": (lambda: _replace(3, _valid_args()[3].at[2, 3].set(53)), r"page_indices\[2, 3\]=53"),
    "negative_page": (lambda: _replace(3, _valid_args()[3].at[0, 0].set(-1)), r"page_indices\[0, 0\]=-1"),
    "kv_len_below_q_len": (lambda: _replace(2, _valid_args()[2].at[1].set(19)), r"kv_lens\[1\]=19"),
    "kv_len_past_pages": (lambda: _replace(2, _valid_args()[2].at[0].set(129)), r"kv_lens\[0\]=129"),
    "cu_decreasing": (lambda: _replace(4, _valid_args()[4].at[2].set(0)), "non-decreasing"),
    "too_many_tokens": (lambda: _replace(4, _valid_args()[4].at[5].set(47)), "exceed the q budget T=46"),
    "num_seqs_too_big": (lambda: _replace(5, jnp.asarray([7], jnp.int32)), r"num_seqs=7 must be in \[0, 6\]"),
}


@pytest.mark.parametrize("bad", list(BAD_INPUTS))
@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_bad_inputs_raise(bad, impl):
    make, message = BAD_INPUTS[bad]
    with pytest.raises(ValueError, match=message):
        ragged_paged_attention(*make(), sm_scale=0.1, implementation=impl, interpret=True)


@pytest.mark.parametrize("kwargs,message", [
    (dict(sliding_window=0), "sliding_window=0"),
    (dict(sliding_window=2.5), "sliding_window=2.5"),
    (dict(soft_cap=0.0), "soft_cap=0.0"),
    (dict(soft_cap=-1.0), "soft_cap=-1.0"),
    (dict(sm_scale=float("nan")), "sm_scale=nan"),
], ids=str)
def test_bad_options_raise(kwargs, message):
    kwargs = {"sm_scale": 0.1, **kwargs}
    with pytest.raises(ValueError, match=message):
        validate_inputs(*_valid_args(), **kwargs)


def test_value_checks_skip_under_jit():
    """Under jit the metadata is traced: only static checks run, and the kernel still works."""
    args, ref, n = case_inputs("decode_only", "float32")
    f = jax.jit(functools.partial(tpu.ragged_paged_attention, **_opts(BASE), block_sizes=TPU_TEST_BLOCKS,
                                  interpret=True))
    np.testing.assert_allclose(np.asarray(f(*args))[:n], ref[:n], *tol(jnp.float32)[::-1])


@pytest.mark.parametrize("kwargs,message", [
    (dict(q_tokens_per_block=0), "q_tokens_per_block=0"),
    (dict(kv_pages_per_block=-2), "kv_pages_per_block=-2"),
    (dict(kv_splits=True), "kv_splits=True"),
    (dict(num_warps=3), "num_warps=3 must be a power of two"),
    (dict(kv_heads_per_block=1.5), "kv_heads_per_block=1.5"),
], ids=str)
def test_block_sizes_validate(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BlockSizes(**kwargs)


@pytest.mark.parametrize("impl,bs,message", [
    ("tpu", BlockSizes(kv_heads_per_block=3), "kv_heads_per_block=3 must divide K=2"),
    ("tpu", BlockSizes(kv_pages_per_block=9), "kv_pages_per_block=9 exceeds"),
    ("gpu", BlockSizes(kv_pages_per_block=3), "3 \\* 16 = 48 keys"),
    ("gpu", BlockSizes(kv_pages_per_block=9), "kv_pages_per_block=9 exceeds"),
    ("gpu", BlockSizes(kv_pages_per_block=2, kv_heads_per_block=4), "kv_heads_per_block=4 must be a power of two "
                                                                     "that divides K=2"),
], ids=str)
def test_block_sizes_checked_against_shapes(impl, bs, message):
    with pytest.raises(ValueError, match=message):
        ragged_paged_attention(*_valid_args(), sm_scale=0.1, block_sizes=bs, implementation=impl, interpret=True)


def test_tpu_rejects_untiled_kv_head_block():
    """bf16 KV heads per block must give whole 16-row sublane tiles of the 2K axis, or be all of K."""
    args, _ = make_inputs(Shape(N=8, K=8, H=64, T=8, P_max=2), Batch((1,), (5,)), jnp.bfloat16, 0)
    with pytest.raises(ValueError, match="whole sublane tiles"):
        tpu.ragged_paged_attention(*args, sm_scale=0.1, block_sizes=BlockSizes(kv_heads_per_block=4, kv_pages_per_block=1),
                                   interpret=True)


# ---- Real GPU -------------------------------------------------------------------------------------

GPU_CASES = {
    "decode_32x_page16": (Shape(N=32, K=8, H=128, G=16, T=32, S=32, P_max=128, pages=2200),
                          Batch((1,) * 32, tuple(int(x) for x in np.linspace(1, 2048, 32)))),
    # the offline benchmark's decode shape: the default puts 4 KV heads in a program
    "decode_256x_h64": (Shape(N=32, K=8, H=64, G=16, T=256, S=256, P_max=48, pages=12400),
                        Batch((1,) * 256, tuple(int(x) for x in np.linspace(1, 768, 256)))),
    "mixed_page64_h64": (Shape(N=16, K=4, H=64, G=64, T=600, S=12, P_max=40, pages=120),
                         Batch((1, 300, 1, 200, 1, 1, 90), (2500, 300, 64, 1000, 65, 1, 2559))),
    "window_cap_h256": (Shape(N=8, K=2, H=256, G=32, T=300, S=4, P_max=40, sliding_window=256, soft_cap=30.0,
                              pages=90),
                        Batch((1, 250, 1), (1200, 1000, 257))),
    "gqa8_page128": (Shape(N=8, K=1, H=128, G=128, T=64, S=8, P_max=16, pages=40),
                     Batch((1, 1, 50, 1), (2048, 129, 50, 1777))),
}


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_gpu_kernel_on_device(case, dtype, splits):
    shape, batch = GPU_CASES[case]
    for seed in (0, 1):  # fresh inputs: a race shows as a moving error
        args, n_real = make_inputs(shape, batch, dtype, seed + 100 * (splits or 0))
        ref = np.asarray(jax.jit(functools.partial(ref_ragged_paged_attention, **_opts(shape)))(*args)
                         .astype(jnp.float32))
        bs = None if splits is None else dataclasses.replace(gpu.default_block_sizes(*args[:2], args[3]),
                                                              kv_splits=splits)
        out = gpu.ragged_paged_attention(*args, **_opts(shape), block_sizes=bs)
        out = np.asarray(out.astype(jnp.float32))
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out[:n_real], ref[:n_real], *tol(dtype)[::-1])


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("case", ["decode_32x_page16", "decode_256x_h64"])
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_gpu_write_qkv_attention_on_device(case, splits):
    shape, batch = GPU_CASES[case]
    for seed in (0, 1):  # fresh inputs: a race shows as a moving error
        inputs, wants = _fused_inputs(shape, jnp.bfloat16, seed, batch)
        kv, qkv, cos, sin, meta, _ = inputs
        q_shape = jax.ShapeDtypeStruct((shape.T, shape.N, shape.H), qkv.dtype)
        bs = None if splits is None else dataclasses.replace(gpu.default_block_sizes(q_shape, kv, meta[1]),
                                                              kv_splits=splits)
        got = gpu.write_qkv_attention(kv, qkv, cos, sin, *meta, **_opts(shape), block_sizes=bs)
        _check_fused(shape, jnp.bfloat16, got, inputs, wants)
        if splits is None:  # qkv as the partial products small decode steps hand it (dispatch.gemv_parts)
            got = gpu.write_qkv_attention(kv, exact_partials(qkv, 8), cos, sin, *meta, **_opts(shape))
            _check_fused(shape, jnp.bfloat16, got, inputs, wants)


@pytest.mark.gpu
@requires_gpu
def test_dispatch_on_gpu_runs_triton_kernel():
    shape, batch = GPU_CASES["mixed_page64_h64"]
    args, n_real = make_inputs(shape, batch, jnp.bfloat16, 5)
    f = jax.jit(functools.partial(dispatch.ragged_paged_attention, **_opts(shape)))
    assert "triton" in f.lower(*args).as_text()
    out = np.asarray(f(*args).astype(jnp.float32))
    want = np.asarray(gpu.ragged_paged_attention(*args, **_opts(shape)).astype(jnp.float32))
    np.testing.assert_array_equal(out, want)
