"""What every flash-attention implementation shares: tile sizes, input validation, masking rules.

Semantics (one definition, used by the reference and every kernel):
  q: [B, T, N, H], k and v: [B, S, K, H], N % K == 0 (query head n reads KV head n // (N // K)).
  Query i sits at key position S - T + i (the last query aligns with the last key), so a chunk
  of T new tokens over a KV of S tokens is chunked prefill; T == S is plain prefill.
  Key j is visible to query i iff
    causal:          j <= S - T + i
    sliding_window:  j >  S - T + i - sliding_window   (needs causal: a window of w keys ending
                                                         at the query itself)
    segment ids:     q_segment_ids[b, i] == kv_segment_ids[b, j]
  Scores are s = (q . k) * sm_scale, then soft_cap * tanh(s / soft_cap) when soft_cap is set.
  A query row with no visible key outputs 0.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class SegmentIds(NamedTuple):
    """Packed-sequence ids: a query attends only to keys with the same id."""

    q: jax.Array  # i32[B, T]
    kv: jax.Array  # i32[B, S]


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of one flash-attention launch.

    block_q: query rows per program (TPU: rows of the VMEM q tile; GPU Triton: rows per program;
      GPU Mosaic: rows per compute warpgroup, two warpgroups per CTA).
    block_kv: keys per inner step.
    num_warps: GPU Triton only; None picks 4 for head_dim <= 64, else 8.
    num_stages: GPU only: software-pipelining depth (Triton num_stages; Mosaic GPU K/V buffers).
    """

    block_q: int = 128
    block_kv: int = 128
    num_warps: int | None = None
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_kv"):
            v = getattr(self, name)
            if not isinstance(v, int) or not _is_pow2(v) or v < 8:
                raise ValueError(f"BlockSizes.{name}={v!r}: must be a power of two >= 8")
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"BlockSizes.num_warps={self.num_warps!r}: must be one of 1, 2, 4, 8, 16")
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"BlockSizes.num_stages={self.num_stages!r}: must be an int in [1, 8]")


@dataclasses.dataclass(frozen=True)
class Problem:
    """Static facts about one call, read off validated inputs."""

    B: int
    T: int
    S: int
    N: int
    K: int
    H: int
    dtype: jnp.dtype

    @property
    def group(self) -> int:
        return self.N // self.K

    @property
    def q_offset(self) -> int:
        """Key position of query 0."""
        return self.S - self.T


def normalize_segment_ids(segment_ids, B: int, T: int, S: int) -> SegmentIds | None:
    """Accept None, a SegmentIds / (q_ids, kv_ids) pair, or one i32[B, T] array when T == S."""
    if segment_ids is None:
        return None
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError(f"segment_ids: expected a (q_segment_ids, kv_segment_ids) pair, got {len(segment_ids)} items")
        q_ids, kv_ids = segment_ids
    else:
        if T != S:
            raise ValueError(f"segment_ids: a single array needs T == S (got T={T}, S={S}); pass a (q, kv) pair")
        q_ids = kv_ids = segment_ids
    q_ids, kv_ids = jnp.asarray(q_ids), jnp.asarray(kv_ids)
    if q_ids.shape != (B, T):
        raise ValueError(f"segment_ids: q_segment_ids has shape {q_ids.shape}; expected (B, T) = {(B, T)}")
    if kv_ids.shape != (B, S):
        raise ValueError(f"segment_ids: kv_segment_ids has shape {kv_ids.shape}; expected (B, S) = {(B, S)}")
    for name, a in (("q_segment_ids", q_ids), ("kv_segment_ids", kv_ids)):
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"segment_ids: {name} has dtype {a.dtype}; expected an integer dtype")
    return SegmentIds(q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32))


def _is_real(x) -> bool:
    """A static Python/NumPy real number (sm_scale and soft_cap are compile-time constants)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def validate_inputs(q, k, v, *, sm_scale, causal, sliding_window, soft_cap) -> Problem:
    """Check shapes, dtypes and options; raise ValueError naming the bad argument."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        if getattr(a, "ndim", None) != 4:
            raise ValueError(f"{name} must be 4-D ({'[B, T, N, H]' if name == 'q' else '[B, S, K, H]'}); got shape {getattr(a, 'shape', None)}")
    B, T, N, H = q.shape
    Bk, S, K, Hk = k.shape
    if k.shape != v.shape:
        raise ValueError(f"v has shape {v.shape}; must equal k's shape {k.shape}")
    if Bk != B:
        raise ValueError(f"k has batch {Bk}; q has batch {B}")
    if Hk != H:
        raise ValueError(f"k has head_dim {Hk}; q has head_dim {H}")
    if min(T, S, N, K, H, B) < 1:
        raise ValueError(f"empty input: q {q.shape}, k {k.shape}")
    if N % K:
        raise ValueError(f"q has {N} heads, not a multiple of k's {K} KV heads")
    dtype = jnp.dtype(q.dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q has dtype {dtype}; supported: {[str(d) for d in SUPPORTED_DTYPES]}")
    if jnp.dtype(k.dtype) != dtype or jnp.dtype(v.dtype) != dtype:
        raise ValueError(f"k ({k.dtype}) and v ({v.dtype}) must have q's dtype {dtype}")
    if not _is_real(sm_scale) or not np.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale={sm_scale!r}: must be a finite positive number (static, not a traced array)")
    if causal and T > S:
        raise ValueError(f"causal attention needs T <= S (query i sits at key position S - T + i); got T={T}, S={S}")
    if sliding_window is not None:
        if not isinstance(sliding_window, (int, np.integer)) or isinstance(sliding_window, bool) or sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window!r}: must be a positive int or None")
        if not causal:
            raise ValueError("sliding_window needs causal=True (the window ends at the query's own position)")
    if soft_cap is not None:
        if not _is_real(soft_cap) or not np.isfinite(soft_cap) or soft_cap <= 0:
            raise ValueError(f"soft_cap={soft_cap!r}: must be a finite positive number or None")
    return Problem(B=B, T=T, S=S, N=N, K=K, H=H, dtype=dtype)


def visible_pairs(T: int, S: int, causal: bool, sliding_window: int | None) -> int:
    """Number of (query, key) pairs the causal/window mask leaves visible, per batch and head."""
    if not causal:
        return T * S
    pos = np.arange(T, dtype=np.int64) + (S - T)
    hi = np.minimum(pos, S - 1)
    lo = np.zeros_like(pos) if sliding_window is None else np.maximum(pos - sliding_window + 1, 0)
    return int(np.maximum(hi - lo + 1, 0).sum())


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m
