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

# The same model on a mesh vs one device, float32: tensor-parallel reductions sum in another order.
# Tiny 40-token configs at logit std ~2 gave max |diff| 0.5-2e-5 over 12 prompts and 2.4e-5 once in
# CI, which made (2e-5, 2e-5) flaky; a wrong sharding is off by O(0.1).
MESH_LOGITS_F32 = (1e-4, 1e-4)

# Logprobs of one request from two engine programs, float32 tiny models: a decode burst vs single
# steps (other XLA fusions, and the K/V rows they wrote differ in the last bits, which compounds over
# ~40 tokens). Runs gave max |diff| 0.4-3.9e-5, and 3.9e-5 once in CI, which made (1e-5, 1e-5) flaky;
# logprobs of the wrong step or of penalized logits are off by O(0.1).
ENGINE_LOGPROBS_F32 = (2e-4, 2e-4)

# Our JAX model vs HF's GGUF loader on dequantized SmolLM2 (float32 both sides, 30 layers).
GGUF_LOGITS_F32 = (2e-3, 2e-3)


def tol(dtype):
    return KERNEL[jnp.dtype(dtype).type]
