"""The greedy LM head for Hopper (sm_90) through Pallas' Mosaic GPU backend: the head GEMM with each
row's argmax in its epilogue, so the f32 [T, V] logits are never written nor read back.

Why: a greedy decode step needs only the argmax of each row's logits. With cuBLAS the LM head writes
them in f32 and XLA's argmax reads them back: at llama3_2_1b's shape (V = 128,256) and 256 rows
that is 131 MB each way, the head 238 us and the argmax 59 us per step on an H100 against ~180 us
for the weight alone (docs/benchmarks.md).

Structure: the persistent warp-specialized GEMM of pallas_kernels/mosaic_gemm.py with one weight
operand, the head [D, V], or the tied embedding [V, D] read transposed. The tiles walk the row
blocks fastest, so the CTAs in flight share a few column blocks of the weight and read each from
memory once. Each compute warpgroup reduces its [block_m, block_n] f32 accumulator to every row's
maximum and the first column holding it, and writes both as f32 partials [V / block_n, T]; a small
XLA reduction over the column blocks (reference.argmax_of_block_partials) then picks the first block
holding the row's maximum. The result is the first index among equal maxima, as jnp.argmax gives
(for rows without NaN; a NaN row's token is unspecified here, where jnp.argmax returns the NaN's
index). Column indices travel as f32, exact below 2^24.

The logits are the GEMM's f32 accumulators, as the reference's (cuBLAS accumulates in f32 too), but
summed in another order: the two agree except where a row's two best logits are within a few f32
roundings of each other (tests/pallas_kernels/test_greedy_head.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.greedy_head.reference import argmax_of_block_partials, validate
from pallas_kernels.mosaic_gemm import COMPUTE_WGS, BlockSizes, check_smem, hopper_kernel, tile_loop

_MAX_COLUMNS = 2 ** 24  # column indices are f32 in the epilogue

DEFAULT_BLOCK_SIZES = BlockSizes(block_m=64, block_n=128, block_k=64, num_stages=4)
# From 256 rows: 128 rows per warpgroup, so each CTA's weight tile serves 256 rows (H100, llama3_2_1b's
# head at 256 rows: 231 us against 258 with 64).
LARGE_BLOCK_SIZES = BlockSizes(block_m=128, block_n=128, block_k=64, num_stages=4)


def default_block_sizes(rows: int) -> BlockSizes:
    return LARGE_BLOCK_SIZES if rows >= LARGE_BLOCK_SIZES.cta_m else DEFAULT_BLOCK_SIZES


def _vocab(head: jax.Array, transposed: bool) -> int:
    return head.shape[0] if transposed else head.shape[1]


def supports(x: jax.Array, head: jax.Array, *, transposed: bool, block_sizes: BlockSizes = DEFAULT_BLOCK_SIZES) -> bool:
    """Whether the kernel takes these shapes and dtypes (the caller runs the reference if not).
    Any number of rows: the kernel pads them to a multiple of 2 * block_m."""
    V = _vocab(head, transposed)
    bs = block_sizes
    return (jnp.dtype(x.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and head.dtype == x.dtype
            and x.shape[1] % bs.block_k == 0 and V % bs.block_n == 0 and V <= _MAX_COLUMNS)


def _smem_bytes(bs: BlockSizes, itemsize: int) -> int:
    return bs.ring_bytes(itemsize, 1) + 4 * COMPUTE_WGS * 2 * bs.block_m


def _kernel(x_gmem, w_gmem, pmax_gmem, pidx_gmem, *, bs: BlockSizes, transposed: bool):
    T = x_gmem.shape[0]
    n_iters = pmax_gmem.shape[0]
    m_iters = T // bs.cta_m
    bm, bn = bs.block_m, bs.block_n

    def tile(idx):  # (row block, column block), the row blocks varying fastest
        return lax.rem(idx, m_iters), lax.div(idx, m_iters)

    def epilogue(accs, *, mi, ni, wg, part_smem):
        (acc,) = accs
        m = acc.max(axis=1)
        cols = plgpu.broadcasted_iota(jnp.int32, (bm, bn), 1, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
        # -(the first column holding the row's maximum)
        neg_first = jnp.where(acc == lax.broadcast_in_dim(m, acc.shape, [0]), -cols, -jnp.inf).max(axis=1)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's partials have left
        part_smem[wg, 0] = m
        part_smem[wg, 1] = (ni * bn).astype(jnp.float32) - neg_first
        plgpu.commit_smem()
        rows = pl.ds(mi * bs.cta_m + wg * bm, bm)
        plgpu.copy_smem_to_gmem(part_smem.at[wg, 0], pmax_gmem.at[ni, rows])
        plgpu.copy_smem_to_gmem(part_smem.at[wg, 1], pidx_gmem.at[ni, rows])

    tile_loop(x_gmem, (w_gmem,), bs=bs, num_tiles=m_iters * n_iters, transpose_w=transposed, tile=tile,
              w_block=lambda ni, _: pl.ds(ni * bn, bn), epilogue=epilogue,
              scratch=dict(part_smem=plgpu.SMEM((COMPUTE_WGS, 2, bm), jnp.float32)))


@functools.partial(jax.jit, static_argnames=("transposed", "block_sizes"))
def greedy_head_mosaic(x: jax.Array, head: jax.Array, *, transposed: bool,
                       block_sizes: BlockSizes | None = None) -> jax.Array:
    """i32[T]: argmax over x @ head (head [D, V]) or x @ head.T (`transposed`, head [V, D]) of each
    row of x [T, D], on a Hopper GPU; see `supports` for the shapes it takes."""
    validate(x, head, transposed=transposed)
    bs = block_sizes or default_block_sizes(x.shape[0])
    if not supports(x, head, transposed=transposed, block_sizes=bs):
        raise ValueError(f"x {x.shape} {x.dtype}, head {head.shape} {head.dtype}: the kernel needs bf16/f16 of one "
                         f"dtype, D a multiple of {bs.block_k}, V of {bs.block_n} and at most {_MAX_COLUMNS}")
    check_smem(bs, _smem_bytes(bs, x.dtype.itemsize))
    T = x.shape[0]
    Tp = -(-T // bs.cta_m) * bs.cta_m
    n_blocks = _vocab(head, transposed) // bs.block_n
    part = jax.ShapeDtypeStruct((n_blocks, Tp), jnp.float32)
    kernel = hopper_kernel(functools.partial(_kernel, bs=bs, transposed=transposed), (part, part))
    pmax, pidx = kernel(jnp.pad(x, ((0, Tp - T), (0, 0))), head)
    return argmax_of_block_partials(pmax[:, :T], pidx[:, :T])
