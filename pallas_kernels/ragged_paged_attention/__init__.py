"""Ragged paged attention over a paged KV cache (mixed prefill chunks and decodes in one batch)."""

from pallas_kernels.ragged_paged_attention.reference import ref_ragged_paged_attention, ref_write_kv_pages

__all__ = ["ref_ragged_paged_attention", "ref_write_kv_pages"]
