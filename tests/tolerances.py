"""The one tolerance table (CONVENTIONS.md): keyed by dtype; a looser entry needs a comment."""

import jax.numpy as jnp

# (atol, rtol) for kernel outputs vs their pure-jnp reference.
KERNEL = {
    jnp.float32: (2e-5, 2e-5),
    jnp.bfloat16: (2e-2, 2e-2),
}

# Model logits vs HF transformers (PyTorch CPU), float32, tiny random-weight configs. Both sides
# accumulate in f32 with different summation orders; 64-token prompts stay well under this.
MODEL_LOGITS_F32 = (2e-4, 2e-4)

# Our JAX model vs HF's GGUF loader on dequantized SmolLM2 (float32 both sides, 30 layers).
GGUF_LOGITS_F32 = (2e-3, 2e-3)


def tol(dtype):
    return KERNEL[jnp.dtype(dtype).type]
