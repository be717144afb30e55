"""SwiGLU up projection for a few rows (decode steps) through Pallas Triton: one GEMV over the merged
gate/up weight whose epilogue applies silu(gate) * up, so the activation is not a kernel of its own.

Why: at batch 1 XLA runs the gate/up product as one of its Triton GEMMs and silu(gate) * up as a
separate kernel (~1.45 us a layer on an H200, 16 launches and ~23 us of llama3_2_1b's ~920 us step)
and fuses the activation into neither GEMM in any formulation measured (docs/benchmarks.md,
twenty-eighth session). The Mosaic GPU kernel (gpu_mosaic.py) covers 256 rows and more.

Structure: a program per `block_n` output columns. It walks the contraction in `block_k` steps
(shorter where D needs it, `contraction_block`), loading its x rows (padded to 16 in registers, the
smallest Triton dot) and the gate and up columns of the weight seen as [D, 2F], and keeps two f32
accumulators; the epilogue computes silu(gate) * up in f32 and rounds once to x's dtype, as the
Mosaic kernel does (the reference rounds the GEMM's output first). Measured: docs/kernels/swiglu.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.swiglu.reference import cost, validate
from pallas_kernels.triton_tiles import (MIN_DOT_ROWS, check_block_sizes, contraction_block, early_launch_enabled,
                                          launch_dependents)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_n: int = 64  # output columns a program (of gate and of up)
    block_k: int = 128  # contraction per loop step
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        check_block_sizes(self, dot_dims=("block_n", "block_k"))


# An H200 sweep at llama3_2_1b's shape, 2 rows (block_n 32/64/128 x block_k 64/128/256 x 4/8 warps x
# 3/4 stages; docs/kernels/swiglu.md): 64 x 128 with 4 warps was the best or within 0.2% of it; 32 or
# 128 columns a program 3% slower; 128 x 256 tiles do not fit in shared memory at 3 stages.
DEFAULT_BLOCK_SIZES = BlockSizes()


def supports(x: jax.Array, w: jax.Array, block_sizes: BlockSizes = DEFAULT_BLOCK_SIZES) -> bool:
    """Whether the kernel takes these shapes and dtypes (the caller runs the reference if not)."""
    T, D = x.shape
    F = w.shape[-1]
    bs = block_sizes
    return (jnp.dtype(x.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and w.dtype == x.dtype
            and 1 <= T <= MIN_DOT_ROWS and contraction_block(D, bs.block_k) > 0 and F % bs.block_n == 0)


def _kernel(x_ref, w_ref, o_ref, *, bs: BlockSizes, early_launch: bool):
    # x_ref [T, D]; w_ref [D, 2F] (gate columns, then up); o_ref [T, F]
    T, F = o_ref.shape
    D = w_ref.shape[0]
    bn, bk = bs.block_n, contraction_block(D, bs.block_k)
    c0 = pl.program_id(0) * bn
    rows = launch_dependents(jnp.arange(MIN_DOT_ROWS, dtype=jnp.int32), early_launch)
    mask = (rows < T)[:, None]
    # Padding rows index distinct rows past the array (masked): interpret mode writes back every
    # indexed element of a masked store and drops only out-of-range ones.
    safe_rows = jnp.where(mask, rows[:, None], T + rows[:, None])
    kcols = jnp.arange(bk, dtype=jnp.int32)[None, :]

    def step(i, accs):
        # x is loaded as the dot's operand, nothing computed on it in the loop: Triton then loads
        # ahead (num_stages). Summing partials and normalising x here (the add + RMSNorm before
        # the MLP in this launch) made the kernel 3.8x slower (docs/kernels/swiglu.md).
        g, u = accs
        k0 = pl.multiple_of(i * bk, bk)
        xb = plgpu.load(x_ref.at[safe_rows, k0 + kcols], mask=mask, other=0.0)
        wg = plgpu.load(w_ref.at[pl.ds(k0, bk), pl.ds(c0, bn)])
        wu = plgpu.load(w_ref.at[pl.ds(k0, bk), pl.ds(F + c0, bn)])
        g += jnp.dot(xb, wg, preferred_element_type=jnp.float32)
        u += jnp.dot(xb, wu, preferred_element_type=jnp.float32)
        return g, u

    zeros = jnp.zeros((MIN_DOT_ROWS, bn), jnp.float32)
    g, u = lax.fori_loop(0, D // bk, step, (zeros, zeros))
    h = (g * jax.nn.sigmoid(g) * u).astype(o_ref.dtype)
    cols = c0 + jnp.arange(bn, dtype=jnp.int32)[None, :]
    plgpu.store(o_ref.at[safe_rows, cols], h, mask=mask)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def swiglu_gemv(x: jax.Array, w: jax.Array, *, block_sizes: BlockSizes | None = None,
                interpret: bool = False) -> jax.Array:
    """silu(x @ w[:, 0]) * (x @ w[:, 1]): x [T, D] with T <= 16, w [D, 2, F] -> [T, F] x.dtype.

    D must be a multiple of 16 and F of block_n (`supports`). interpret: True runs the kernel body
    as jnp on the host (CPU tests)."""
    validate(x, w)
    bs = block_sizes or DEFAULT_BLOCK_SIZES
    if not supports(x, w, bs):
        raise ValueError(f"x {x.shape} {x.dtype}, w {w.shape} {w.dtype}: the kernel needs bf16/f16 of one dtype, "
                         f"1 <= T <= {MIN_DOT_ROWS}, D a multiple of 16, F of {bs.block_n}")
    T, D = x.shape
    F = w.shape[2]
    flops, nbytes = cost(x, w)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_kernel, bs=bs, early_launch=early_launch_enabled(interpret)),
        grid=(F // bs.block_n,),
        in_specs=[any_spec] * 2,
        out_specs=any_spec,
        out_shape=jax.ShapeDtypeStruct((T, F), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        cost_estimate=pl.CostEstimate(flops=int(flops), transcendentals=T * F, bytes_accessed=int(nbytes)),
        interpret=interpret,
        name="swiglu_gemv_gpu",
    )(x, w.reshape(D, 2 * F))
