"""The one place that picks an attention implementation. The model calls only these functions."""

from __future__ import annotations

import jax

from pallas_kernels import flash_attention as _flash_attention
from pallas_kernels.ragged_paged_attention import ref_ragged_paged_attention, ref_write_kv_pages


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                           sliding_window=None, soft_cap=None, implementation: str = "auto"):
    """Attention of a ragged token batch over paged KV. See ragged_paged_attention/reference.py."""
    del implementation  # only the reference exists until the kernels land
    return ref_ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                      sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)


def write_kv_pages(kv_pages, k, v, kv_lens, page_indices, cu_q_lens, num_seqs) -> jax.Array:
    """Scatter this step's new K/V into their page slots."""
    return ref_write_kv_pages(kv_pages, k, v, kv_lens, page_indices, cu_q_lens, num_seqs)


def flash_attention(q, k, v, *, sm_scale, causal=True, segment_ids=None, sliding_window=None, soft_cap=None,
                    block_sizes=None, implementation: str = "auto"):
    """Prefill attention q [B, T, N, H] over k, v [B, S, K, H]. See flash_attention/common.py.

    "auto": the Mosaic TPU kernel on TPU, the best GPU kernel on GPU (Mosaic GPU on Hopper, else
    Triton), the pure-jnp reference elsewhere (CPU)."""
    if implementation == "auto":
        implementation = {"tpu": "tpu", "gpu": "gpu"}.get(jax.default_backend(), "reference")
    return _flash_attention.flash_attention(
        q, k, v, sm_scale=sm_scale, causal=causal, segment_ids=segment_ids, sliding_window=sliding_window,
        soft_cap=soft_cap, block_sizes=block_sizes, implementation=implementation)
