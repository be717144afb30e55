"""SwiGLU up projection for Hopper (sm_90) through Pallas' Mosaic GPU backend: one GEMM kernel whose
epilogue applies silu(gate) * up, so the [T, 2F] gate/up product is never written to memory.

Why: with cuBLAS for the merged gate/up GEMM, XLA runs silu(gate) * up as a kernel of its own that
reads the [T, 2F] product back and writes [T, F]: at a prefill step of 8,192 tokens of llama3_2_1b
(F = 8,192) that is 402 MB a layer, about 2 ms of a ~28 ms step on an H100 (docs/benchmarks.md).

Structure: the persistent warp-specialized GEMM of pallas_kernels/mosaic_gemm.py with two weight
operands, the gate columns and the matching up columns of the merged weight, so each compute
warpgroup holds two f32 accumulators. The epilogue computes silu(gate) * up from them, rounds once
to x's dtype and stores through shared memory with TMA. The reference rounds the GEMM's output to
x's dtype before the activation, so the two differ by about one rounding of the operands
(tests/pallas_kernels/test_swiglu.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mosaic_gemm import COMPUTE_WGS, BlockSizes, check_smem, hopper_kernel, smem_transforms, tile_loop
from pallas_kernels.swiglu.reference import validate

_EPI = 64  # epilogue tiles of 64 x 64 through shared memory

# H100 and H200 sweeps at llama3_2_1b's shape (docs/kernels/swiglu.md): groups of 8 column blocks were
# the best or within run-to-run noise (3-5%) of it at 256-8,192 rows on H100s; 4 stages beat 3; 64 x
# 64 tiles, 128-deep k steps, 2-CTA clusters sharing the weight tiles and one wgmma group kept in
# flight gained nothing.
DEFAULT_BLOCK_SIZES = BlockSizes()


def supports(x: jax.Array, w: jax.Array, block_sizes: BlockSizes = DEFAULT_BLOCK_SIZES) -> bool:
    """Whether the kernel takes these shapes and dtypes (the caller runs the reference if not)."""
    T, D = x.shape
    F = w.shape[-1]
    bs = block_sizes
    return (jnp.dtype(x.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and w.dtype == x.dtype
            and T % bs.cta_m == 0 and D % bs.block_k == 0 and F % bs.block_n == 0)  # block_n: a multiple of _EPI


def _smem_bytes(bs: BlockSizes, itemsize: int) -> int:
    return bs.ring_bytes(itemsize, 2) + itemsize * COMPUTE_WGS * 2 * _EPI * _EPI


def _kernel(x_gmem, w_gmem, out_gmem, *, bs: BlockSizes):
    T, D = x_gmem.shape
    F = out_gmem.shape[1]
    bm, bn = bs.block_m, bs.block_n
    dtype = x_gmem.dtype
    m_iters, n_iters = T // bs.cta_m, F // bn

    def tile(idx):
        # Tiles in groups of group_n weight column blocks (the columns varying fastest within a
        # group, then the rows; snaking between groups): the tiles in flight at once (one per
        # SM) share a few column blocks of the weight and a few row blocks of x, so both come
        # from L2. With the columns varying fastest over the whole width, every row block
        # re-read the whole weight (67 MB at llama3_2_1b, more than L2) from memory.
        return plgpu.planar_snake(idx, (m_iters, n_iters), 1, min(bs.group_n, n_iters))

    def epilogue(accs, *, mi, ni, wg, out_smem):
        g, u = accs
        h = (g * jax.nn.sigmoid(g) * u).astype(dtype)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        out_tile = out_gmem.at[pl.ds(mi * bs.cta_m + wg * bm, bm), pl.ds(ni * bn, bn)]
        for em in range(bm // _EPI):
            for en in range(bn // _EPI):
                slot = (em * (bn // _EPI) + en) % 2
                sl = (slice(em * _EPI, (em + 1) * _EPI), slice(en * _EPI, (en + 1) * _EPI))
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                out_smem[wg, slot] = h[sl]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], out_tile.at[sl])

    # the weight's gate columns, then the matching up columns
    tile_loop(x_gmem, (w_gmem, w_gmem), bs=bs, num_tiles=m_iters * n_iters, transpose_w=False, tile=tile,
              w_block=lambda ni, j: pl.ds(j * F + ni * bn, bn), epilogue=epilogue,
              scratch=dict(out_smem=plgpu.SMEM((COMPUTE_WGS, 2, _EPI, _EPI), dtype,
                                               transforms=smem_transforms(dtype, _EPI))))


@functools.partial(jax.jit, static_argnames=("block_sizes",))
def swiglu_mosaic(x: jax.Array, w: jax.Array, *, block_sizes: BlockSizes | None = None) -> jax.Array:
    """silu(x @ w[:, 0]) * (x @ w[:, 1]): x [T, D], w [D, 2, F] -> [T, F] x.dtype, on a Hopper GPU.

    T must be a multiple of 2 * block_m, D of block_k and F of block_n (`supports`)."""
    validate(x, w)
    bs = block_sizes or DEFAULT_BLOCK_SIZES
    if not supports(x, w, bs):
        raise ValueError(f"x {x.shape} {x.dtype}, w {w.shape} {w.dtype}: the kernel needs bf16/f16 of one dtype, "
                         f"T a multiple of {bs.cta_m}, D of {bs.block_k}, F of {bs.block_n}")
    check_smem(bs, _smem_bytes(bs, x.dtype.itemsize))
    T, D = x.shape
    F = w.shape[2]
    kernel = hopper_kernel(functools.partial(_kernel, bs=bs), jax.ShapeDtypeStruct((T, F), x.dtype))
    return kernel(x, w.reshape(D, 2 * F))
