"""Pure-jnp flash-attention semantics: the CPU path and the oracle every kernel is tested against.

Semantics are defined once in common.py (module docstring). This computes the full score matrix
in float32, so memory is O(B * N * T * S); kernels tile it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.flash_attention.common import normalize_segment_ids, validate_inputs, visible_pairs


def ref_flash_attention(
    q: jax.Array,  # [B, T, N, H]
    k: jax.Array,  # [B, S, K, H]
    v: jax.Array,  # [B, S, K, H]
    *,
    sm_scale: float,
    causal: bool = True,
    segment_ids=None,  # SegmentIds | (i32[B, T], i32[B, S]) | i32[B, T] when T == S
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # [B, T, N, H], q.dtype
    p = validate_inputs(q, k, v, sm_scale=sm_scale, causal=causal, sliding_window=sliding_window, soft_cap=soft_cap)
    seg = normalize_segment_ids(segment_ids, p.B, p.T, p.S)
    B, T, S, N, K, H, G = p.B, p.T, p.S, p.N, p.K, p.H, p.group
    qg = q.astype(jnp.float32).reshape(B, T, K, G, H)
    s = jnp.einsum("btkgh,bskh->bkgts", qg, k.astype(jnp.float32), precision="highest") * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    mask = jnp.ones((B, 1, 1, T, S), bool)
    q_pos = jnp.arange(T, dtype=jnp.int32)[:, None] + (S - T)
    kv_pos = jnp.arange(S, dtype=jnp.int32)[None, :]
    if causal:
        mask &= kv_pos <= q_pos
    if sliding_window is not None:
        mask &= kv_pos > q_pos - sliding_window
    if seg is not None:
        mask &= (seg.q[:, :, None] == seg.kv[:, None, :])[:, None, None]
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # all-masked rows: exp(-inf) = 0 below, no NaN
    e = jnp.exp(s - m)
    l = jnp.sum(e, axis=-1, keepdims=True)
    w = e / jnp.where(l == 0.0, 1.0, l)
    o = jnp.einsum("bkgts,bskh->btkgh", w, v.astype(jnp.float32), precision="highest")
    return o.reshape(B, T, N, H).astype(q.dtype)


def reference_cost(q_shape, k_shape, dtype, *, causal: bool, sliding_window: int | None,
                   has_segment_ids: bool = False) -> pl.CostEstimate:
    """Flops (two matmuls over visible pairs), exp count and the minimum HBM bytes of one call.

    Segment masks are data-dependent; they are not discounted (an upper bound on the flops)."""
    B, T, N, H = q_shape
    _, S, K, _ = k_shape
    pairs = visible_pairs(T, S, causal, sliding_window)
    itemsize = jnp.dtype(dtype).itemsize
    bytes_accessed = itemsize * (2 * B * T * N * H + 2 * B * S * K * H) + (4 * B * (T + S) if has_segment_ids else 0)
    return pl.CostEstimate(flops=int(4 * B * N * H * pairs), transcendentals=int(B * N * pairs),
                           bytes_accessed=int(bytes_accessed))
