"""The step's KV write on NVIDIA GPUs through Pallas' Triton lowering (ragged paged attention's
companion: gpu.py reads the pages this writes; decode steps do both in one launch there,
`gpu.write_qkv_attention`).

`write_qkv` is the step's KV write, from the merged QKV projection: the same contract as
reference.ref_write_qkv, in place (the pool is aliased to the output). Grid over blocks of the
[T * K * (R + 2), H] rows; each program RoPEs its query and k rows, copies k and v to rows
slot * 2K + 2h and + 1 of the pool seen as [P * G * 2K, H] and query rows to q. `write_kv_pages`
(k and v given apart, reference.ref_write_kv_pages) is the same kernel with no query rows and no
RoPE. Why not the XLA scatter: on an H200 it took 69 us a layer for 8192 new rows of 8 KV heads x
128 (16 MB of bf16, ~9 us as a copy) and 12.4 us for 256 rows (docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.ragged_paged_attention.reference import kv_write_slots, split_qkv, write_kv_cost_estimate
from pallas_kernels.triton_tiles import next_pow2


def check_head_dim(H: int):
    """The attention and the write kernels tile the head dim whole."""
    if H & (H - 1) or H < 16:
        raise ValueError(f"head dim {H} must be a power of two >= 16 for the Triton kernel")


@dataclasses.dataclass(frozen=True)
class WriteBlockSizes:
    """Tiles of the KV write. rows_per_block: rows of the [tokens x groups x rows per group, H]
    input per program; a power of two >= 16, Triton's smallest 2-D tile."""

    rows_per_block: int = 64
    num_warps: int = 4

    def __post_init__(self):
        for name in ("rows_per_block", "num_warps"):
            x = getattr(self, name)
            if not isinstance(x, int) or isinstance(x, bool) or x < 1 or x & (x - 1):
                raise ValueError(f"{name}={x!r} must be a power of two")
        if self.rows_per_block < 16:
            raise ValueError(f"rows_per_block={self.rows_per_block} must be >= 16 (Triton's smallest tile)")


def default_write_block_sizes(num_rows: int, head_dim: int) -> WriteBlockSizes:
    # Not tuned: tiles of ~8k elements (16 KiB of bf16) keep 4 warps at 64 elements per thread;
    # small steps (decode) shrink to the rows they have.
    rows = min(next_pow2(num_rows), max(16, 8192 // head_dim), 256)
    return WriteBlockSizes(rows_per_block=max(16, rows))


def _write_kernel(
    slots_ref,  # i32[T] flat slot per token; P * G for padding
    new_ref,  # [T * K * (R + 2), H]: per token, per KV head: R query rows, then K, then V
    *refs,  # (cos f32[T, H/2], sin f32[T, H/2])?, pool (aliased), (q out [T * K * R, H])?, pool out
    q_rows_per_group: int,
    num_groups: int,
    num_slots: int,
    block_rows: int,
    rope: bool,
):
    R = q_rows_per_group
    if rope:
        cos_ref, sin_ref, *refs = refs
    _, *outs = refs  # the aliased pool input is the output's buffer
    q_ref, kv_ref = outs if R else (None, outs[0])
    r = jnp.arange(block_rows, dtype=jnp.int32)
    n = pl.program_id(0) * block_rows + r  # row n of new: (token, group) n // (R + 2), row n % (R + 2)
    row_ok = n < new_ref.shape[0]
    tg = lax.div(n, R + 2)
    j = n - tg * (R + 2)
    t = lax.div(tg, num_groups)
    slot = plgpu.load(slots_ref.at[t], mask=row_ok, other=num_slots)
    kv_ok = row_ok & (j >= R) & (slot >= 0) & (slot < num_slots)
    # A masked store is a no-op on the GPU, but interpret mode writes back every indexed row (its
    # old value where masked): masked rows get distinct rows past the output, which no real row
    # writes and interpret mode's scatter drops. Negative indices would wrap onto real rows there.
    kv_dst = jnp.where(kv_ok, (slot * num_groups + tg - t * num_groups) * 2 + j - R, kv_ref.shape[0] + r)
    H = new_ref.shape[1]
    if rope:  # half-split RoPE in f32 on q and k rows (reference.rope); v rows pass through
        half = jnp.arange(H // 2, dtype=jnp.int32)[None, :]
        x1, x2 = (plgpu.load(new_ref.at[n[:, None], c], mask=row_ok[:, None], other=0.0).astype(jnp.float32)
                  for c in (half, half + H // 2))
        c, s = (plgpu.load(ref.at[t[:, None], half], mask=row_ok[:, None], other=0.0) for ref in (cos_ref, sin_ref))
        turn = (j <= R)[:, None]
        parts = [(half, jnp.where(turn, x1 * c - x2 * s, x1)), (half + H // 2, jnp.where(turn, x2 * c + x1 * s, x2))]
    else:
        cols = jnp.arange(H, dtype=jnp.int32)[None, :]
        parts = [(cols, plgpu.load(new_ref.at[n[:, None], cols], mask=row_ok[:, None], other=0.0))]
    if R:
        q_ok = row_ok & (j < R)
        q_dst = jnp.where(q_ok, tg * R + j, q_ref.shape[0] + r)
    for cols, x in parts:
        x = x.astype(new_ref.dtype)  # the reference rounds RoPE's output to the activations' dtype
        plgpu.store(kv_ref.at[kv_dst[:, None], cols], x.astype(kv_ref.dtype), mask=kv_ok[:, None])
        if R:
            plgpu.store(q_ref.at[q_dst[:, None], cols], x, mask=q_ok[:, None])


def _write_groups(
    rows: jax.Array,  # [P * G * 2K, H] the pool, flattened; aliased to the output
    new: jax.Array,  # [T, K, R + 2, H]: per KV head, R query heads, then its k, then its v
    slots: jax.Array,  # i32[T]
    rope: tuple[jax.Array, jax.Array] | None,  # (cos, sin) f32[T, H/2]: RoPE q and k on the way
    *,
    num_slots: int,
    block_sizes: WriteBlockSizes | None,
    interpret: bool,
) -> tuple[jax.Array | None, jax.Array]:  # (q [T * K * R, H] or None when R = 0, pool)
    """The launch: token t's k and v of KV head g go to rows slots[t] * 2K + 2g (+ 1), only for
    slots in [0, num_slots) (tests pass num_slots below the pool's to see that nothing else is);
    its query rows, if any, to q. One pass over the merged QKV rows, so XLA materialises neither
    the RoPE'd q nor the interleaved k/v (two kernels a layer fewer than XLA's RoPE + this write on
    an H200, 1B at batch 1)."""
    T, K, R2, H = new.shape
    R = R2 - 2
    n = T * K * R2
    bs = block_sizes or default_write_block_sizes(n, H)
    kernel = functools.partial(_write_kernel, q_rows_per_group=R, num_groups=K, num_slots=num_slots,
                               block_rows=bs.rows_per_block, rope=rope is not None)
    inputs = [slots, new.reshape(n, H), *(rope or ()), rows]
    out_shape = ([jax.ShapeDtypeStruct((T * K * R, H), new.dtype)] if R else []) + [
        jax.ShapeDtypeStruct(rows.shape, rows.dtype)]
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    outs = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(n, bs.rows_per_block),),
        in_specs=[any_spec] * len(inputs),
        out_specs=[any_spec] * len(out_shape),
        out_shape=out_shape,
        input_output_aliases={len(inputs) - 1: len(out_shape) - 1},
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=1),
        cost_estimate=write_kv_cost_estimate(rows, new),
        interpret=interpret,
        name="write_kv_pages_gpu",
    )(*inputs)
    return (outs[0] if R else None), outs[-1]


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def _write_qkv(kv_pages, new, rope, kv_lens, page_indices, cu_q_lens, num_seqs, *, block_sizes, interpret):
    P, G, K2, H = kv_pages.shape
    slots = kv_write_slots(kv_lens, page_indices, cu_q_lens, num_seqs, new.shape[0], page_size=G, num_slots=P * G)
    q, rows = _write_groups(kv_pages.reshape(P * G * K2, H), new, slots, rope, num_slots=P * G,
                            block_sizes=block_sizes, interpret=interpret)
    return q, rows.reshape(P, G, K2, H)


def write_kv_pages(
    kv_pages: jax.Array,  # [P, G, 2K, H]
    k: jax.Array,  # [T, K, H]
    v: jax.Array,  # [T, K, H]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, P_max]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    block_sizes: WriteBlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:  # [P, G, 2K, H]
    """Pallas Triton kernel; same contract as reference.ref_write_kv_pages.

    k and v are interleaved into [T * 2K, H] rows in the pool's order; a program copies
    block_sizes.rows_per_block of those rows, row j of token t to row slot * 2K + j of the pool seen
    as [P * G * 2K, H]; padding tokens and slots outside the pool are masked. The pool is updated in place when the caller donates kv_pages (otherwise
    XLA copies it first, as for any aliased input). k, v of another dtype are cast to the pool's.

    interpret: True runs the kernel body as jnp on the host (CPU tests).
    """
    P, G, K2, H = kv_pages.shape
    if k.ndim != 3 or k.shape != v.shape or k.shape[1:] != (K2 // 2, H) or K2 % 2:
        raise ValueError(f"k {k.shape} and v {v.shape} must both be [T, K, H] = [T, {K2 // 2}, {H}] for "
                         f"kv_pages {kv_pages.shape}")
    check_head_dim(H)
    if k.shape[0] == 0:
        return kv_pages
    new = jnp.stack([k, v], axis=2)  # [T, K, 2, H]: groups of k and v, no query rows
    return _write_qkv(kv_pages, new, None, kv_lens, page_indices, cu_q_lens, num_seqs,
                      block_sizes=block_sizes, interpret=interpret)[1]


def check_qkv(kv_pages, qkv, cos, sin) -> tuple[int, int, int, int]:
    """(T, K, R + 2, H) of a merged projection qkv [T, K, R + 2, H] that fits kv_pages, with RoPE
    tables cos, sin [T, H/2]; ValueError naming what does not fit."""
    K2, H = kv_pages.shape[2:]
    if qkv.ndim != 4 or qkv.shape[1] * 2 != K2 or qkv.shape[3] != H or qkv.shape[2] < 3:
        raise ValueError(f"qkv {qkv.shape} must be [T, K, R + 2, H] = [T, {K2 // 2}, R + 2, {H}] with R >= 1 "
                         f"for kv_pages {kv_pages.shape}")
    check_head_dim(H)
    T = qkv.shape[0]
    if cos.shape != (T, H // 2) or sin.shape != cos.shape:
        raise ValueError(f"cos {cos.shape} and sin {sin.shape} must both be [T, H/2] = [{T}, {H // 2}]")
    return qkv.shape


def write_qkv(
    kv_pages: jax.Array,  # [P, G, 2K, H]
    qkv: jax.Array,  # [T, K, R + 2, H]: per KV head, its R query heads, then its k, then its v
    cos: jax.Array,  # f32[T, H/2]
    sin: jax.Array,  # f32[T, H/2]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, P_max]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    block_sizes: WriteBlockSizes | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # (q [T, K * R, H] qkv.dtype, kv_pages)
    """Pallas Triton kernel; same contract as reference.ref_write_qkv: RoPE on q and k, k and v
    written to their page slots (in place when kv_pages is donated), q returned, in one launch."""
    T, K, R2, H = check_qkv(kv_pages, qkv, cos, sin)
    if T == 0:
        return split_qkv(qkv)[0], kv_pages
    rope = (cos.astype(jnp.float32), sin.astype(jnp.float32))
    q, pool = _write_qkv(kv_pages, qkv, rope, kv_lens, page_indices, cu_q_lens, num_seqs,
                         block_sizes=block_sizes, interpret=interpret)
    return q.reshape(T, K * (R2 - 2), H), pool
