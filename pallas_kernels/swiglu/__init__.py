"""The SwiGLU up projection of a gated MLP: silu(x @ W_gate) * (x @ W_up), W = [D, 2, F].

`ref_swiglu` is the jnp path (CPU, TPU, small token buckets, GPUs other than Hopper) and the oracle;
gpu_mosaic.swiglu_mosaic the Hopper kernel with the activation in its epilogue (imported on use:
Mosaic GPU imports are heavier). Model code calls pallas_kernels.dispatch.swiglu.
"""

from __future__ import annotations

from pallas_kernels.swiglu.reference import cost, ref_swiglu, validate

__all__ = ["cost", "ref_swiglu", "validate"]
