"""The SwiGLU up projection in jnp: silu(x @ W_gate) * (x @ W_up), with gate and up as one merged
[D, 2, F] weight. The model's MLP path wherever the fused kernel does not run (CPU, TPU, small
token buckets, other GPUs), and the oracle the kernel is tested against."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ref_swiglu(x: jax.Array, w: jax.Array, *, precision=None, f32_out: bool = False) -> jax.Array:  # [T, F] x.dtype
    """x: [T, D]; w: [D, 2, F] (w[:, 0] the gate, w[:, 1] the up projection). One GEMM for both
    halves (docs/design.md "Merged projections"), its output in x's dtype, then silu(gate) * up.
    f32_out: the GEMM's output in f32 and silu(gate) * up computed in it, rounded once to x's dtype,
    as the Mosaic GPU kernel does (dispatch.f32_dot_outputs: what CPUs run fast)."""
    gu = jnp.einsum("td,dgf->tgf", x, w.astype(x.dtype), precision=precision,
                    preferred_element_type=jnp.float32 if f32_out else None)
    return (jax.nn.silu(gu[:, 0]) * gu[:, 1]).astype(x.dtype)


def validate(x: jax.Array, w: jax.Array):
    if x.ndim != 2 or w.ndim != 3 or w.shape[:2] != (x.shape[1], 2):
        raise ValueError(f"x {x.shape} must be [T, D] and w {w.shape} [D, 2, F] with D = {x.shape[-1]}")


def cost(x: jax.Array, w: jax.Array) -> tuple[float, float]:
    """(FLOPs, bytes that must move): the GEMM's 2 T D 2F, reading x and w, writing [T, F]."""
    T, D = x.shape
    F = w.shape[2]
    isz = jnp.dtype(x.dtype).itemsize
    return 4.0 * T * D * F, float(isz * (T * D + T * F) + jnp.dtype(w.dtype).itemsize * D * 2 * F)
