"""Tile sizes and input validation shared by the TPU and GPU ragged paged attention kernels.

The argument contract (shapes, KV layout, ragged query layout) is documented in reference.py.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of one kernel launch. Every field is validated here; shape-dependent limits are
    checked by each kernel against its arguments (`check_block_sizes`).

    q_tokens_per_block: query tokens handled together; with the q heads of the block's KV heads
      they form the rows of every matmul (GPU: rows = q_tokens_per_block * kv_heads_per_block * N // K).
    kv_pages_per_block: pages read per inner step (keys per step = kv_pages_per_block * G).
    kv_heads_per_block: KV heads per grid step. TPU: None is the smallest count whose slice of the
      2K axis is a whole (8 x packing) sublane tile, else all K. GPU: a power of two dividing K;
      the program's heads read their keys side by side in one tile and each row sees only its
      own head's (rows = q_tokens_per_block * kv_heads_per_block * N // K); None: chosen from the
      shapes (more than 1 only for short-row decode batches, head dim <= 64).
    kv_splits: GPU only: each sequence's KV range is split across this many programs and the
      partial softmaxes are merged afterwards (flash-decoding). None: chosen from the shapes so the
      grid covers the GPU's multiprocessors.
    num_warps, num_stages: GPU only: Triton warps per program and software-pipelining depth.
    vmem_limit_bytes: TPU only: scoped VMEM limit; None: estimated from the tiles.
    """

    q_tokens_per_block: int = 16
    kv_pages_per_block: int = 8
    kv_heads_per_block: int | None = None
    kv_splits: int | None = None
    num_warps: int = 4
    num_stages: int = 2
    vmem_limit_bytes: int | None = None

    def __post_init__(self):
        for name in ("q_tokens_per_block", "kv_pages_per_block", "num_warps", "num_stages"):
            _check_positive_int(name, getattr(self, name))
        for name in ("kv_heads_per_block", "kv_splits", "vmem_limit_bytes"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        if self.num_warps & (self.num_warps - 1):
            raise ValueError(f"num_warps={self.num_warps} must be a power of two")


def _check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive int")


def _shape(name, x, ndim):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an array; got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims; got shape {tuple(x.shape)}")
    return tuple(x.shape)


def _int32(name, x):
    if jnp.dtype(x.dtype) != jnp.int32:
        raise ValueError(f"{name} must be int32; got {jnp.dtype(x.dtype)}")


def validate_static(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                    sliding_window=None, soft_cap=None):
    """Shape, dtype and option checks that need no array values (they run under jit too)."""
    T, N, H = _shape("q", q, 3)
    P, G, K2, Hk = _shape("kv_pages", kv_pages, 4)
    S, P_max = _shape("page_indices", page_indices, 2)
    (S_kv,) = _shape("kv_lens", kv_lens, 1)
    (S1,) = _shape("cu_q_lens", cu_q_lens, 1)
    (one,) = _shape("num_seqs", num_seqs, 1)
    for name, x in (("kv_lens", kv_lens), ("page_indices", page_indices), ("cu_q_lens", cu_q_lens),
                    ("num_seqs", num_seqs)):
        _int32(name, x)
    if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"q dtype {jnp.dtype(q.dtype)} is not one of float32, bfloat16")
    if jnp.dtype(kv_pages.dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"kv_pages dtype {jnp.dtype(kv_pages.dtype)} is not one of float32, bfloat16")
    if K2 % 2 or K2 == 0:
        raise ValueError(f"kv_pages.shape[2]={K2} must be 2K (K and V of each KV head interleaved), even and > 0")
    K = K2 // 2
    if Hk != H:
        raise ValueError(f"kv_pages head dim {Hk} must equal q head dim {H}")
    if N % K:
        raise ValueError(f"q has N={N} heads, not a multiple of K={K} KV heads")
    if min(T, P, G, S, P_max) == 0:
        raise ValueError(f"empty dimension: q {tuple(q.shape)}, kv_pages {tuple(kv_pages.shape)}, "
                         f"page_indices {tuple(page_indices.shape)}")
    if S_kv != S:
        raise ValueError(f"kv_lens has {S_kv} entries; page_indices has {S} rows")
    if S1 != S + 1:
        raise ValueError(f"cu_q_lens has {S1} entries; must be {S + 1} (page_indices rows + 1)")
    if one != 1:
        raise ValueError(f"num_seqs must have shape (1,); got {tuple(num_seqs.shape)}")
    if not isinstance(sm_scale, (int, float, np.floating)) or not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale={sm_scale!r} must be a finite Python float")
    if sliding_window is not None and (isinstance(sliding_window, bool) or
                                       not isinstance(sliding_window, (int, np.integer)) or
                                       sliding_window <= 0):
        raise ValueError(f"sliding_window={sliding_window!r} must be None or a positive int")
    if soft_cap is not None and (not isinstance(soft_cap, (int, float, np.floating)) or
                                 not math.isfinite(soft_cap) or soft_cap <= 0):
        raise ValueError(f"soft_cap={soft_cap!r} must be None or a positive finite float")


def _concrete(x):
    """x as a numpy array, or None while it is traced (values are then unknown)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def validate_values(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs):
    """Checks on the metadata values; skipped (returns False) when any of them is traced."""
    arrays = [_concrete(x) for x in (kv_lens, page_indices, cu_q_lens, num_seqs)]
    if any(a is None for a in arrays):
        return False
    kv_lens_, page_indices_, cu_, num_seqs_ = arrays
    T = q.shape[0]
    P, G = kv_pages.shape[:2]
    S, P_max = page_indices_.shape
    n = int(num_seqs_[0])
    if not 0 <= n <= S:
        raise ValueError(f"num_seqs={n} must be in [0, {S}] (page_indices rows)")
    cu = cu_[: n + 1]
    if cu[0] < 0:
        raise ValueError(f"cu_q_lens[0]={cu[0]} must be >= 0")
    if np.any(np.diff(cu) < 0):
        s = int(np.argmax(np.diff(cu) < 0))
        raise ValueError(f"cu_q_lens must be non-decreasing; cu_q_lens[{s + 1}]={cu[s + 1]} < cu_q_lens[{s}]={cu[s]}")
    if cu[n] > T:
        raise ValueError(f"cu_q_lens[num_seqs]={cu[n]} query tokens exceed the q budget T={T}")
    q_lens = np.diff(cu)
    for s in range(n):
        kv_len = int(kv_lens_[s])
        if not q_lens[s] <= kv_len <= P_max * G:
            raise ValueError(f"kv_lens[{s}]={kv_len} must be in [q_len={q_lens[s]}, P_max*G={P_max * G}]")
        used = page_indices_[s, : -(-kv_len // G)]
        bad = (used < 0) | (used >= P)
        if np.any(bad):
            j = int(np.argmax(bad))
            raise ValueError(f"page_indices[{s}, {j}]={used[j]} is out of range [0, {P}) "
                             f"(sequence {s} uses its first {len(used)} pages)")
    return True


def validate_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                    sliding_window=None, soft_cap=None):
    """All checks: static ones always, value ones when the metadata is concrete."""
    validate_static(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
                    sliding_window=sliding_window, soft_cap=soft_cap)
    validate_values(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
