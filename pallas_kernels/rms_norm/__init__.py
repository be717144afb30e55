"""The residual add and the RMSNorm that follows it (a decoder layer's two joints).

`add_rms_norm(x, r, scale, *, eps)` is the GPU (Triton) kernel: one launch where XLA runs two;
`ref_add_rms_norm` the jnp oracle and the CPU and TPU path (there XLA fuses what it can);
`rms_norm` the formula every norm of the model uses. `embed_rms_norm` (GPU) and
`ref_embed_rms_norm`: the model's entry, the tokens' embedding rows and the first layer's input norm
of them. Model code calls pallas_kernels.dispatch.
"""

from __future__ import annotations

from pallas_kernels.rms_norm import gpu
from pallas_kernels.rms_norm.gpu import add_rms_norm, embed_rms_norm
from pallas_kernels.rms_norm.reference import ref_add_rms_norm, ref_embed_rms_norm, rms_norm, validate

__all__ = ["add_rms_norm", "embed_rms_norm", "gpu", "ref_add_rms_norm", "ref_embed_rms_norm", "rms_norm", "validate"]
