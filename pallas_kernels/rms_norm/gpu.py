"""The residual add and the RMSNorm after it in one Pallas Triton launch.

XLA on an H200 runs a decoder layer's residual add and the norm that reads the sum as two kernels
(its normalization fusion does not take the add in, which also feeds the next residual add): a
launch each, ~1.3 and ~1.8 us at batch 1 on llama3_2_1b, twice per layer. Here one program
normalises `block_rows` rows: it reads x and r, writes their sum (rounded to their dtype, as the
jnp add) and the norm of that rounded sum, computed in f32 as reference.rms_norm does.

x may also come as f32[P, T, D] partial products of the GEMV before it (dispatch.gemv_partials):
the program sums them and rounds to r's dtype, the GEMM's output, before the add, so XLA's
split-K reduce kernel before each call goes (docs/benchmarks.md, twenty-eighth session).

`embed_rms_norm` is the same norm at the model's entry: the embedding rows of the step's tokens
gathered by the kernel itself, then the first layer's input norm of them. XLA ran the gather and the
norm as two kernels (~1.8 us each at batch 1 on an H200: the gather is not fused into a reduction
that reads its output twice), once per model step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.rms_norm.reference import ref_embed_rms_norm, validate, validate_embed
from pallas_kernels.triton_tiles import early_launch_enabled, launch_dependents, load_parts, next_pow2


def default_block_rows(T: int, D: int) -> int:
    """Rows per program: a tile of about 4k elements (Triton tiles are powers of two)."""
    return max(1, min(next_pow2(T), 4096 // next_pow2(D)))


def _kernel(x_ref, r_ref, scale_ref, sum_ref, y_ref, *, eps: float, block_rows: int, cols: int, parts: int,
            early_launch: bool):
    # x_ref: [parts * T, D], the partial products one after the other (parts == 1: x itself)
    T, D = r_ref.shape
    _, col, ok, idx = _rows_and_cols(block_rows, cols, T, D, early_launch)
    w = _load_scale(scale_ref, col, D)
    x = load_parts(x_ref, *idx, parts=parts, part_rows=T, mask=ok, dtype=r_ref.dtype)  # the projection's dtype
    r = plgpu.load(r_ref.at[idx], mask=ok, other=0.0).astype(jnp.float32)
    s = (x + r).astype(sum_ref.dtype)
    plgpu.store(sum_ref.at[idx], s, mask=ok)
    _store_norm(y_ref, idx, ok, s, w, D=D, eps=eps)


def _load_scale(scale_ref, col, D: int):
    """The norm's scale as f32, loaded first: with every load of a kernel issued before its first store,
    none waits behind that store (the compiler may not move a load past a store to another buffer,
    which could alias), so the kernel makes one round trip to memory before it stores, not two."""
    return plgpu.load(scale_ref.at[col], mask=col < D, other=0.0).astype(jnp.float32)


def _store_norm(y_ref, idx, ok, s, w, *, D: int, eps: float):
    """y_ref[idx] = RMSNorm(s) * w over each row's D columns (masked lanes of s must be 0; w the
    scale from _load_scale), in f32 as reference.rms_norm computes it."""
    sf = s.astype(jnp.float32)
    inv = lax.rsqrt(jnp.sum(sf * sf, axis=1) / D + eps)
    plgpu.store(y_ref.at[idx], (sf * inv[:, None] * w[None, :]).astype(y_ref.dtype), mask=ok)


def _rows_and_cols(block_rows: int, cols: int, T: int, D: int, early_launch: bool):
    """A program's rows (after the early-launch trigger), columns, the in-bounds mask and the index
    its masked lanes load and store at: distinct rows past the array, because interpret mode writes
    back every indexed element of a masked store and drops only out-of-range ones."""
    rows = launch_dependents(pl.program_id(0) * block_rows + jnp.arange(block_rows, dtype=jnp.int32), early_launch)
    col = jnp.arange(cols, dtype=jnp.int32)
    ok = (rows < T)[:, None] & (col < D)[None, :]
    return rows, col, ok, (jnp.where(ok, rows[:, None], T + rows[:, None]), col[None, :])


@functools.partial(jax.jit, static_argnames=("eps", "block_rows", "interpret"))
def _add_rms_norm(x, r, scale, *, eps, block_rows, interpret):
    parts = 1 if x.ndim == 2 else x.shape[0]
    T, D = r.shape
    itemsize = jnp.dtype(r.dtype).itemsize
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_kernel, eps=eps, block_rows=block_rows, cols=next_pow2(D), parts=parts,
                          early_launch=early_launch_enabled(interpret)),
        grid=(pl.cdiv(T, block_rows),),
        in_specs=[any_spec] * 3,
        out_specs=[any_spec] * 2,
        out_shape=[jax.ShapeDtypeStruct(r.shape, r.dtype)] * 2,
        # With partials a program reads parts x D f32 a row: 16 warps keep more of those loads in flight
        # (llama3_2_1b batch 1 on an H200: its step 0.967 ms at 8 warps, 0.938 at 16; one row a program).
        compiler_params=plgpu.CompilerParams(num_warps=4 if parts == 1 else 16, num_stages=1),
        cost_estimate=pl.CostEstimate(flops=(4 + parts) * T * D, transcendentals=T,
                                      bytes_accessed=3 * T * D * itemsize + x.size * jnp.dtype(x.dtype).itemsize
                                      + D * jnp.dtype(scale.dtype).itemsize),
        interpret=interpret,
        name="add_rms_norm_gpu",
    )(x.reshape(parts * T, D), r, scale)


def add_rms_norm(x: jax.Array, r: jax.Array, scale: jax.Array, *, eps: float, block_rows: int | None = None,
                 interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Pallas Triton kernel; same contract as reference.ref_add_rms_norm: (x + r, its RMSNorm); x
    [T, D] like r, or f32[P, T, D] partial products summed (and rounded to r's dtype) first.

    interpret: True runs the kernel body as jnp on the host (CPU tests)."""
    validate(x, r, scale)
    if block_rows is None:
        block_rows = 1 if x.ndim == 3 else default_block_rows(*r.shape)
    if block_rows < 1 or block_rows & (block_rows - 1):
        raise ValueError(f"block_rows={block_rows} must be a power of two")
    if r.shape[0] == 0:
        return r, r
    s, y = _add_rms_norm(x, r, scale, eps=float(eps), block_rows=block_rows, interpret=interpret)
    return s, y


def _embed_kernel(ids_ref, table_ref, scale_ref, x_ref, y_ref, *, eps: float, block_rows: int, cols: int,
                  early_launch: bool):
    T, D = x_ref.shape
    V, n = table_ref.shape[0], ids_ref.shape[0]
    rows, col, ok, idx = _rows_and_cols(block_rows, cols, T, D, early_launch)
    w = _load_scale(scale_ref, col, D)
    ids = plgpu.load(ids_ref.at[jnp.minimum(rows, n - 1)], mask=rows < n, other=0)  # rows past the ids: id 0
    ids = jnp.where(ids < 0, ids + V, ids)  # jnp.take's indexing: a negative id counts from the end
    found = (ids >= 0) & (ids < V)  # and an id out of range gives a NaN row
    e = plgpu.load(table_ref.at[jnp.clip(ids, 0, V - 1)[:, None], col[None, :]], mask=ok & found[:, None],
                   other=0.0)
    e = jnp.where(found[:, None], e.astype(x_ref.dtype), jnp.nan)
    plgpu.store(x_ref.at[idx], e, mask=ok)
    _store_norm(y_ref, idx, ok, e, w, D=D, eps=eps)


@functools.partial(jax.jit, static_argnames=("eps", "dtype", "rows", "block_rows", "interpret"))
def _embed_rms_norm(table, ids, scale, *, eps, dtype, rows, block_rows, interpret):
    T, D = rows, table.shape[1]
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_embed_kernel, eps=eps, block_rows=block_rows, cols=next_pow2(D),
                          early_launch=early_launch_enabled(interpret)),
        grid=(pl.cdiv(T, block_rows),),
        in_specs=[any_spec] * 3,
        out_specs=[any_spec] * 2,
        out_shape=[jax.ShapeDtypeStruct((T, D), dtype)] * 2,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        cost_estimate=pl.CostEstimate(flops=4 * T * D, transcendentals=T,
                                      bytes_accessed=T * D * (table.dtype.itemsize + 2 * jnp.dtype(dtype).itemsize)
                                      + 4 * ids.shape[0] + D * scale.dtype.itemsize),
        interpret=interpret,
        name="embed_rms_norm_gpu",
    )(ids.astype(jnp.int32), table, scale)


def embed_rms_norm(table: jax.Array, ids: jax.Array, scale: jax.Array, *, eps: float, dtype, rows: int | None = None,
                   block_rows: int | None = None, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Pallas Triton kernel; same contract as reference.ref_embed_rms_norm: (x, RMSNorm(x) * scale)
    for x = table[ids] cast to `dtype`, each [rows, D] of `dtype` (ids i32[T]; rows >= T, default T:
    rows past the ids embed id 0, as ids padded with zeros; negative ids count from the end of the
    table and ids out of range give NaN rows, as jnp.take's). One launch: a program gathers
    `block_rows` rows and normalises them.

    interpret: True runs the kernel body as jnp on the host (CPU tests)."""
    rows = validate_embed(table, ids, scale, rows)
    D = table.shape[1]
    if block_rows is None:
        block_rows = default_block_rows(rows, D)
    if block_rows < 1 or block_rows & (block_rows - 1):
        raise ValueError(f"block_rows={block_rows} must be a power of two")
    if ids.shape[0] == 0:
        return ref_embed_rms_norm(table, ids, scale, eps=eps, dtype=dtype, rows=rows)
    x, y = _embed_rms_norm(table, ids, scale, eps=float(eps), dtype=jnp.dtype(dtype), rows=rows,
                           block_rows=block_rows, interpret=interpret)
    return x, y
