"""The greedy LM head for a few rows (batch-1 and small decode bursts) through Pallas Triton: the
head GEMV with each row's argmax over its block of vocabulary in the epilogue, so the f32 logits are
never written and no separate argmax runs over them.

Why: below 64 rows (where the Mosaic GPU kernel, gpu_mosaic.py, takes over) a greedy decode step ran
a gather of the rows it takes logits for, XLA's Triton GEMV for the head writing [R, V] f32 logits,
then XLA's argmax over them in two reduction kernels (and, in a burst's plain greedy sampler, a
scatter of the banned ids): llama3_2_1b at batch 1 on an H200, ~7 us a token of small kernels beside
the head's ~125 (docs/kernels/greedy_head.md).

Structure: a program per `block_v` vocabulary ids. It walks the contraction in `block_k` steps
(`triton_tiles.contraction_block`), loading its x rows (padded to 16 in registers, the smallest
Triton dot; with `rows`, the rows of x those indices name, so the forward's gather is not a kernel
of its own) and the head's [block_k, block_v] tile, or the tied embedding's [block_v, block_k] tile
read transposed, into one f32 accumulator. The epilogue takes each row's maximum over the block and
the first id holding it, and writes both to partials [V / block_v, R]; `argmax_of_block_partials`
(shared with the Mosaic kernel) then picks the first block holding the row's maximum. Ids past V
(the last block of a vocabulary that block_v does not divide) are masked to -inf. The result is the
first index among equal maxima, as jnp.argmax gives, for rows without NaN (a NaN row's token is
unspecified). The logits are f32 accumulators summed in another order than XLA's, so the two agree
except where a row's two best logits are within a few f32 roundings of each other.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.greedy_head.reference import argmax_of_block_partials, validate
from pallas_kernels.triton_tiles import (MIN_DOT_ROWS, check_block_sizes, contraction_block, early_launch_enabled,
                                          launch_dependents)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_v: int = 256  # vocabulary ids a program
    block_k: int = 128  # contraction per loop step
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        check_block_sizes(self, dot_dims=("block_v", "block_k"))


# An H200 sweep (block_v 64/128/256 x block_k 64/128/256 x 4/8 warps x 3/4 stages; docs/kernels/greedy_head.md):
# at llama3_2_1b's tied head 256 x 128 with 4 warps and 3 stages was the best at 2, 8 and 16 rows and
# within 0.5 us of the best at 1; at llama3_8b's head [4,096, 128,256] within 1 us of the best.
DEFAULT_BLOCK_SIZES = BlockSizes()


def _vocab(head: jax.Array, transposed: bool) -> int:
    return head.shape[0] if transposed else head.shape[1]


def supports(x: jax.Array, head: jax.Array, *, transposed: bool, block_sizes: BlockSizes = DEFAULT_BLOCK_SIZES) -> bool:
    """Whether the kernel takes these shapes and dtypes (x [R, D]: the rows the logits are for; the
    caller runs the reference if not): bf16 or f16 of one dtype, 1 to 16 rows, D with a contraction
    step of at least 16; any V."""
    T, D = x.shape
    return (jnp.dtype(x.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and head.dtype == x.dtype
            and 1 <= T <= MIN_DOT_ROWS and contraction_block(D, block_sizes.block_k) > 0)


def _kernel(*refs, bs: BlockSizes, transposed: bool, gather: bool, early_launch: bool):
    # x_ref [T, D]; rows_ref i32[R] (gather) or none (R = T); w_ref [V, D] (transposed) or [D, V];
    # pmax_ref, pidx_ref [blocks, R]
    x_ref, rows_ref, w_ref, pmax_ref, pidx_ref = refs if gather else (refs[0], None, *refs[1:])
    T, D = x_ref.shape
    R = pmax_ref.shape[1]
    V = w_ref.shape[0] if transposed else w_ref.shape[1]
    bv, bk = bs.block_v, contraction_block(D, bs.block_k)
    b = pl.program_id(0)
    r = launch_dependents(jnp.arange(MIN_DOT_ROWS, dtype=jnp.int32), early_launch)
    row_ok = r < R
    # Padding rows index distinct rows past the arrays (masked): interpret mode writes back every
    # indexed element of a masked store and drops only out-of-range ones.
    safe_r = jnp.where(row_ok, r, R + r)
    x_rows = safe_r
    if gather:  # x's rows the logits are for, clamped into x
        x_rows = jnp.clip(plgpu.load(rows_ref.at[safe_r], mask=row_ok, other=0), 0, T - 1)
        x_rows = jnp.where(row_ok, x_rows, T + r)
    ids = b * bv + jnp.arange(bv, dtype=jnp.int32)
    id_ok = ids < V
    kcols = jnp.arange(bk, dtype=jnp.int32)

    def step(i, acc):
        k0 = pl.multiple_of(i * bk, bk)
        xb = plgpu.load(x_ref.at[x_rows[:, None], k0 + kcols[None, :]], mask=row_ok[:, None], other=0.0)
        if transposed:  # the embedding's [block_v, block_k] tile, handed to the dot transposed
            w = plgpu.load(w_ref.at[ids[:, None], k0 + kcols[None, :]], mask=id_ok[:, None], other=0.0)
            return acc + lax.dot_general(xb, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        w = plgpu.load(w_ref.at[k0 + kcols[:, None], ids[None, :]], mask=id_ok[None, :], other=0.0)
        return acc + jnp.dot(xb, w, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, D // bk, step, jnp.zeros((MIN_DOT_ROWS, bv), jnp.float32))
    acc = jnp.where(id_ok[None, :], acc, -jnp.inf)
    plgpu.store(pmax_ref.at[b, safe_r], jnp.max(acc, axis=1), mask=row_ok)
    plgpu.store(pidx_ref.at[b, safe_r], b * bv + jnp.argmax(acc, axis=1).astype(jnp.int32), mask=row_ok)


@functools.partial(jax.jit, static_argnames=("transposed", "block_sizes", "interpret"))
def greedy_head_gemv(x: jax.Array, head: jax.Array, *, transposed: bool, rows: jax.Array | None = None,
                     block_sizes: BlockSizes | None = None, interpret: bool = False) -> jax.Array:
    """i32[R]: argmax over x @ head (head [D, V]) or x @ head.T (`transposed`, head [V, D]) of each
    row of x [T, D] (R = T), or of x's rows `rows` i32[R] (jnp.take(x, rows) without the gather's
    own kernel; indices outside x are clamped into it), R <= 16; see `supports`. interpret: True runs
    the kernel body as jnp on the host (CPU tests)."""
    validate(x, head, transposed=transposed)
    bs = block_sizes or DEFAULT_BLOCK_SIZES
    R = x.shape[0] if rows is None else rows.shape[0]
    if rows is not None and (rows.ndim != 1 or not jnp.issubdtype(rows.dtype, jnp.integer)):
        raise ValueError(f"rows {rows.shape} {rows.dtype} must be a vector of integer indices into x's rows")
    if not supports(jax.ShapeDtypeStruct((R, x.shape[1]), x.dtype), head, transposed=transposed, block_sizes=bs):
        raise ValueError(f"x {x.shape} {x.dtype} ({R} rows), head {head.shape} {head.dtype}: the kernel needs bf16/f16 "
                         f"of one dtype, 1 to {MIN_DOT_ROWS} rows and D a multiple of 16")
    D = x.shape[1]
    V = _vocab(head, transposed)
    blocks = pl.cdiv(V, bs.block_v)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    operands = (x, head) if rows is None else (x, rows.astype(jnp.int32), head)
    pmax, pidx = pl.pallas_call(
        functools.partial(_kernel, bs=bs, transposed=transposed, gather=rows is not None,
                          early_launch=early_launch_enabled(interpret)),
        grid=(blocks,),
        in_specs=[any_spec] * len(operands),
        out_specs=[any_spec] * 2,
        out_shape=[jax.ShapeDtypeStruct((blocks, R), jnp.float32), jax.ShapeDtypeStruct((blocks, R), jnp.int32)],
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        cost_estimate=pl.CostEstimate(flops=2 * R * D * V, transcendentals=0,
                                      bytes_accessed=V * D * head.dtype.itemsize + R * D * x.dtype.itemsize),
        interpret=interpret,
        name="greedy_head_gemv_gpu",
    )(*operands)
    return argmax_of_block_partials(pmax, pidx)
