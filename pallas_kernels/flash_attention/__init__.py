"""Prefill flash attention: q [B, T, N, H] over k, v [B, S, K, H] (causal, chunked, GQA, windows).

Semantics live in common.py; `ref_flash_attention` is the pure-jnp oracle and CPU path; tpu.py,
gpu.py (Triton) and gpu_mosaic.py (Hopper) are the kernels. The model calls
pallas_kernels.dispatch.flash_attention, which picks the implementation by backend.
"""

from __future__ import annotations

import jax

from pallas_kernels.flash_attention.common import (
    BlockSizes, SegmentIds, normalize_segment_ids, validate_inputs, visible_pairs)
from pallas_kernels.flash_attention.reference import ref_flash_attention, reference_cost

IMPLEMENTATIONS = ("reference", "tpu", "gpu", "triton", "mosaic_gpu")


def flash_attention(
    q: jax.Array,  # [B, T, N, H]
    k: jax.Array,  # [B, S, K, H]
    v: jax.Array,  # [B, S, K, H]
    *,
    sm_scale: float,
    causal: bool = True,
    segment_ids=None,  # SegmentIds | (i32[B, T], i32[B, S]) | i32[B, T] when T == S
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    block_sizes: BlockSizes | None = None,
    implementation: str = "reference",
    interpret=False,
) -> jax.Array:  # [B, T, N, H], q.dtype
    """Run one implementation by name. 'gpu' picks the faster GPU kernel for the inputs."""
    opts = dict(sm_scale=sm_scale, causal=causal, sliding_window=sliding_window, soft_cap=soft_cap)
    if implementation == "reference":
        return ref_flash_attention(q, k, v, segment_ids=segment_ids, **opts)
    if implementation == "tpu":
        from pallas_kernels.flash_attention.tpu import flash_attention_tpu
        return flash_attention_tpu(q, k, v, segment_ids, block_sizes=block_sizes, interpret=interpret, **opts)
    if implementation in ("gpu", "triton", "mosaic_gpu"):
        from pallas_kernels.flash_attention.gpu import flash_attention_gpu
        kernel = {"gpu": "auto", "triton": "triton", "mosaic_gpu": "mosaic"}[implementation]
        return flash_attention_gpu(q, k, v, segment_ids, block_sizes=block_sizes, kernel=kernel,
                                   interpret=interpret, **opts)
    raise ValueError(f"implementation={implementation!r}: expected one of {IMPLEMENTATIONS}")


__all__ = ["BlockSizes", "IMPLEMENTATIONS", "SegmentIds", "flash_attention", "normalize_segment_ids",
           "ref_flash_attention", "reference_cost", "validate_inputs", "visible_pairs"]
