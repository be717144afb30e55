"""Flash attention on TPU (Mosaic TPU): BlockSpec pipelining, online softmax in VMEM scratch.

Grid (B, N, q_blocks, kv_blocks), kv innermost and sequential ("arbitrary"). Per step the
pipeline holds one q tile [bq, H], one K and one V tile [bk, H] (double-buffered) and the f32
score tile [bq, bk]: at the default 256 x 512 tiles and H = 256 that is ~2.6 MiB, inside the
16 MiB default scoped VMEM of v5e and the 32 MiB of v6e.

KV blocks that the causal / sliding-window mask hides entirely from a q block are skipped twice
over: the body does not run (pl.when), and their index_map clamps to the nearest visible block,
so the pipeline sees an unchanged block index and issues no DMA for them.

TPU tiles want the last two block dims to be multiples of (8, 128) or the full dims, so q, k, v
are transposed to head-major [B, N, T, H] / [B, K, S, H] around the call, T and S are padded to
whole tiles, and segment ids travel as [B, T, 1] and [B, 1, S] (full-dim minor axes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.flash_attention.common import (
    BlockSizes, normalize_segment_ids, round_up, validate_inputs)
from pallas_kernels.flash_attention.reference import reference_cost

# Untuned (no TPU in CI or the lab yet): splash-attention-like tiles; a tuning script keyed by chip
# should replace this once a TPU is available.
DEFAULT_BLOCK_SIZES = BlockSizes(block_q=256, block_kv=512)
_LANES = 128


def _kv_block_range(i, *, bq, bk, nk, q_offset, causal, sliding_window):
    """Inclusive [lo, hi] kv-block range visible from q block i (traced scalars)."""
    q_min = q_offset + i * bq
    q_max = q_min + bq - 1
    hi = jnp.minimum(q_max // bk, nk - 1) if causal else nk - 1
    lo = jnp.maximum(q_min - sliding_window + 1, 0) // bk if sliding_window is not None else 0
    return lo, hi


def _kernel(*refs, sm_scale, soft_cap, causal, sliding_window, q_offset, kv_len, bq, bk, nk,
            has_segments, mask_kv_tail):
    if has_segments:
        q_ref, k_ref, v_ref, qs_ref, ks_ref, o_ref, m_ref, l_ref, acc_ref = refs
    else:
        q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref = refs
        qs_ref = ks_ref = None
    i, j = pl.program_id(2), pl.program_id(3)
    lo, hi = _kv_block_range(i, bq=bq, bk=bk, nk=nk, q_offset=q_offset, causal=causal,
                             sliding_window=sliding_window)

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when((j >= lo) & (j <= hi))
    def _step():
        q = q_ref[...]  # [bq, H]
        k = k_ref[...]  # [bk, H]
        # f32 inputs: IEEE dots (the TPU's default precision takes bf16 passes), as the ragged kernel's
        precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                                precision=precision)
        s = s * sm_scale  # f32[bq, bk]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask = None
        if causal or sliding_window is not None or mask_kv_tail:
            q_pos = q_offset + i * bq + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
            kv_pos = j * bk + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
            if causal:
                mask = kv_pos <= q_pos
            if sliding_window is not None:
                mask = mask & (kv_pos > q_pos - sliding_window)
            if mask_kv_tail:
                tail = kv_pos < kv_len
                mask = tail if mask is None else mask & tail
        if has_segments:
            same = qs_ref[...] == ks_ref[...]  # [bq, 1] == [1, bk]
            mask = same if mask is None else mask & same
        if mask is not None:
            s = jnp.where(mask, s, -jnp.inf)
        m_prev = m_ref[...][:, :1]  # [bq, 1]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        # A row with nothing visible yet keeps m = -inf; shifting by 0 instead keeps exp(-inf) = 0.
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        p = jnp.exp(s - m_safe)
        alpha = jnp.exp(m_prev - m_safe)
        l_ref[...] = jnp.broadcast_to(alpha * l_ref[...][:, :1] + jnp.sum(p, axis=1, keepdims=True), l_ref.shape)
        m_ref[...] = jnp.broadcast_to(m_next, m_ref.shape)
        pv = jnp.dot(p.astype(v_ref.dtype), v_ref[...], preferred_element_type=jnp.float32, precision=precision)
        acc_ref[...] = alpha * acc_ref[...] + pv

    @pl.when(j == nk - 1)
    def _finish():
        l = l_ref[...][:, :1]
        inv = 1.0 / jnp.where(l == 0.0, 1.0, l)  # empty rows: acc is 0, output 0
        o_ref[...] = (acc_ref[...] * inv).astype(o_ref.dtype)


def _check_tpu_blocks(bs: BlockSizes):
    if bs.block_q % 8:
        raise ValueError(f"block_sizes.block_q={bs.block_q}: the TPU kernel needs a multiple of 8")
    if bs.block_kv % _LANES:
        raise ValueError(f"block_sizes.block_kv={bs.block_kv}: the TPU kernel needs a multiple of {_LANES}")


@functools.partial(jax.jit, static_argnames=("sm_scale", "causal", "sliding_window", "soft_cap",
                                             "block_sizes", "interpret"))
def flash_attention_tpu(
    q: jax.Array,  # [B, T, N, H]
    k: jax.Array,  # [B, S, K, H]
    v: jax.Array,  # [B, S, K, H]
    segment_ids=None,
    *,
    sm_scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret=False,
) -> jax.Array:  # [B, T, N, H]
    p = validate_inputs(q, k, v, sm_scale=sm_scale, causal=causal, sliding_window=sliding_window, soft_cap=soft_cap)
    seg = normalize_segment_ids(segment_ids, p.B, p.T, p.S)
    bs = block_sizes or DEFAULT_BLOCK_SIZES
    _check_tpu_blocks(bs)
    B, T, S, N, H, G = p.B, p.T, p.S, p.N, p.H, p.group
    bq = min(bs.block_q, round_up(T, 8))
    bk = min(bs.block_kv, round_up(S, _LANES))
    Tp, Sp = round_up(T, bq), round_up(S, bk)
    nq, nk = Tp // bq, Sp // bk

    qt = jnp.pad(q.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, Tp - T), (0, 0)))  # [B, N, Tp, H]
    kt = jnp.pad(k.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, Sp - S), (0, 0)))  # [B, K, Sp, H]
    vt = jnp.pad(v.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, Sp - S), (0, 0)))

    rng = functools.partial(_kv_block_range, bq=bq, bk=bk, nk=nk, q_offset=p.q_offset, causal=causal,
                            sliding_window=sliding_window)

    def kv_block(i, j):
        lo, hi = rng(i)
        return jnp.clip(j, lo, hi)

    in_specs = [
        pl.BlockSpec((None, None, bq, H), lambda b, n, i, j: (b, n, i, 0)),
        pl.BlockSpec((None, None, bk, H), lambda b, n, i, j: (b, n // G, kv_block(i, j), 0)),
        pl.BlockSpec((None, None, bk, H), lambda b, n, i, j: (b, n // G, kv_block(i, j), 0)),
    ]
    args = [qt, kt, vt]
    if seg is not None:
        # Padding gets ids that match nothing real: -1 for queries, -2 for keys.
        qs = jnp.pad(seg.q, ((0, 0), (0, Tp - T)), constant_values=-1)[:, :, None]  # i32[B, Tp, 1]
        ks = jnp.pad(seg.kv, ((0, 0), (0, Sp - S)), constant_values=-2)[:, None, :]  # i32[B, 1, Sp]
        in_specs += [pl.BlockSpec((None, bq, 1), lambda b, n, i, j: (b, i, 0)),
                     pl.BlockSpec((None, 1, bk), lambda b, n, i, j: (b, 0, kv_block(i, j)))]
        args += [qs, ks]

    kernel = functools.partial(
        _kernel, sm_scale=float(sm_scale), soft_cap=None if soft_cap is None else float(soft_cap),
        causal=causal, sliding_window=sliding_window, q_offset=p.q_offset, kv_len=S, bq=bq, bk=bk, nk=nk,
        has_segments=seg is not None, mask_kv_tail=Sp != S)
    out = pl.pallas_call(
        kernel,
        grid=(B, N, nq, nk),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, bq, H), lambda b, n, i, j: (b, n, i, 0)),
        out_shape=jax.ShapeDtypeStruct((B, N, Tp, H), q.dtype),
        scratch_shapes=[pltpu.VMEM((bq, _LANES), jnp.float32),  # running max, lane-replicated
                        pltpu.VMEM((bq, _LANES), jnp.float32),  # running denominator
                        pltpu.VMEM((bq, H), jnp.float32)],  # running numerator
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=reference_cost(q.shape, k.shape, q.dtype, causal=causal, sliding_window=sliding_window,
                                     has_segment_ids=seg is not None),
        interpret=interpret,
        name="flash_attention_tpu",
    )(*args)
    return out[:, :, :T].transpose(0, 2, 1, 3)
