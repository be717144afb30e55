"""RMSNorm and the residual add before it, in jnp: the CPU and TPU path and the oracle the GPU
kernel is tested against. One formula for every norm of the model (models/llama.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, scale: jax.Array, *, eps: float) -> jax.Array:
    """x * rsqrt(mean(x^2) + eps) * scale over the last axis, in f32, rounded to x's dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def ref_add_rms_norm(x: jax.Array, r: jax.Array, scale: jax.Array, *, eps: float) -> tuple[jax.Array, jax.Array]:
    """A decoder layer's residual add and the norm after it: (x + r, rms_norm(x + r)). x, r: [T, D]
    of one dtype, the sum rounded to it; scale: [D]. x may instead be f32[P, T, D] partial products
    (dispatch.gemv_partials): their sum, rounded to r's dtype, is the x added."""
    validate(x, r, scale)
    if x.ndim == 3:
        x = x.sum(axis=0).astype(r.dtype)
    s = x + r
    return s, rms_norm(s, scale, eps=eps)


def validate(x: jax.Array, r: jax.Array, scale: jax.Array):
    partials = x.ndim == 3 and x.shape[1:] == r.shape and x.dtype == jnp.float32
    if r.ndim != 2 or not (partials or (r.shape == x.shape and x.dtype == r.dtype)):
        raise ValueError(f"x {x.shape} {x.dtype} and r {r.shape} {r.dtype} must both be [T, D] of one dtype, "
                         "or x f32[P, T, D] partial products")
    if scale.shape != r.shape[1:]:
        raise ValueError(f"scale {scale.shape} must be [D] = [{r.shape[1]}]")
