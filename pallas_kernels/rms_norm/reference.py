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


def ref_embed_rms_norm(table: jax.Array, ids: jax.Array, scale: jax.Array, *, eps: float, dtype,
                       rows: int | None = None) -> tuple[jax.Array, jax.Array]:
    """The model's entry: (x, rms_norm(x)) for the embedding rows x = table[ids] (jnp.take: negative
    ids count from the end, ids out of range give NaN rows) cast to `dtype`. table [V, D], ids i32[T],
    scale [D]; rows >= T (default T): the output's rows, those past the ids embedding id 0 (ids
    padded with zeros)."""
    rows = validate_embed(table, ids, scale, rows)
    x = jnp.take(table, jnp.pad(ids, (0, rows - ids.shape[0])), axis=0).astype(dtype)
    return x, rms_norm(x, scale, eps=eps)


def validate_embed(table: jax.Array, ids: jax.Array, scale: jax.Array, rows: int | None) -> int:
    """The output's rows (rows, or len(ids) for None), once the arguments check out."""
    if table.ndim != 2 or ids.ndim != 1 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"table {table.shape} must be [V, D] and ids {ids.shape} {ids.dtype} integers [T]")
    if scale.shape != table.shape[1:]:
        raise ValueError(f"scale {scale.shape} must be [D] = [{table.shape[1]}]")
    if rows is None:
        return ids.shape[0]
    if rows < ids.shape[0]:
        raise ValueError(f"rows={rows} must be at least the {ids.shape[0]} ids")
    return rows


def validate(x: jax.Array, r: jax.Array, scale: jax.Array):
    partials = x.ndim == 3 and x.shape[1:] == r.shape and x.dtype == jnp.float32
    if r.ndim != 2 or not (partials or (r.shape == x.shape and x.dtype == r.dtype)):
        raise ValueError(f"x {x.shape} {x.dtype} and r {r.shape} {r.dtype} must both be [T, D] of one dtype, "
                         "or x f32[P, T, D] partial products")
    if scale.shape != r.shape[1:]:
        raise ValueError(f"scale {scale.shape} must be [D] = [{r.shape[1]}]")
