"""Ragged paged attention over a paged KV cache (mixed prefill chunks and decodes in one batch).

`ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
sliding_window=None, soft_cap=None, block_sizes=None, implementation, interpret=False)`
runs the TPU (Mosaic) or GPU (Triton) kernel, or "xla": plain jnp doing only the batch's work
(xla.py), the path where no kernel runs (CPU); `ref_ragged_paged_attention` is the pure-jnp oracle.
The step's KV write: `ref_write_kv_pages` (an XLA scatter) and `gpu_write.write_kv_pages`
(Triton), both placing tokens at `kv_write_slots`; `ref_write_qkv` and `gpu_write.write_qkv` do the same from the
merged QKV projection, with RoPE on q and k on the way (one launch on GPU). Contract and KV layout: reference.py. Model
code calls pallas_kernels.dispatch.
"""

from __future__ import annotations

from pallas_kernels.ragged_paged_attention import gpu, tpu, xla
from pallas_kernels.ragged_paged_attention.common import (
    BlockSizes,
    validate_inputs,
    validate_static,
    validate_values,
)
from pallas_kernels.ragged_paged_attention.reference import (
    kv_write_slots,
    ref_cost_estimate,
    ref_ragged_paged_attention,
    ref_write_kv_pages,
    ref_write_qkv,
    rope,
    split_qkv,
)

IMPLEMENTATIONS = ("tpu", "gpu", "xla")


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                           sliding_window=None, soft_cap=None, block_sizes: BlockSizes | None = None,
                           implementation: str, interpret=False):
    """The implementation named by `implementation`: the Pallas kernel ("tpu", "gpu") or the jnp
    one ("xla"; `interpret` does not apply); see reference.py for the contract."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r} must be one of {IMPLEMENTATIONS}")
    if implementation == "xla":
        return xla.xla_ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                              sm_scale=sm_scale, sliding_window=sliding_window,
                                              soft_cap=soft_cap, block_sizes=block_sizes)
    kernel = tpu.ragged_paged_attention if implementation == "tpu" else gpu.ragged_paged_attention
    return kernel(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
                  sliding_window=sliding_window, soft_cap=soft_cap, block_sizes=block_sizes,
                  interpret=interpret)


__all__ = [
    "BlockSizes",
    "IMPLEMENTATIONS",
    "kv_write_slots",
    "ragged_paged_attention",
    "ref_cost_estimate",
    "ref_ragged_paged_attention",
    "ref_write_kv_pages",
    "ref_write_qkv",
    "rope",
    "split_qkv",
    "validate_inputs",
    "validate_static",
    "validate_values",
]
