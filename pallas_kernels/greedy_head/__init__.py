"""The greedy LM head: each row's argmax over x @ head, the logits never written to memory.

`ref_greedy_head` is the jnp path (the f32 logits, then their argmax: every platform without the
kernel) and the oracle; gpu_mosaic.greedy_head_mosaic the Hopper kernel with the argmax in its
epilogue (imported on use: Mosaic GPU imports are heavier). Model code calls
pallas_kernels.dispatch.greedy_head.
"""

from __future__ import annotations

from pallas_kernels.greedy_head.reference import head_logits, ref_greedy_head, validate

__all__ = ["head_logits", "ref_greedy_head", "validate"]
