"""The LM head and its greedy argmax in jnp: the path wherever the fused kernel does not run, and
the oracle it is tested against."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def validate(x: jax.Array, head: jax.Array, *, transposed: bool):
    D = head.shape[1] if transposed else head.shape[0]
    if x.ndim != 2 or head.ndim != 2 or D != x.shape[1]:
        want = "[V, D] (transposed: a tied embedding)" if transposed else "[D, V]"
        raise ValueError(f"x {x.shape} must be [T, D] and head {head.shape} {want} with D = {x.shape[-1]}")


def head_logits(x: jax.Array, head: jax.Array, *, transposed: bool, precision=None,
                fold_transpose: bool = False) -> jax.Array:
    """f32[T, V] logits of x [T, D] (the final norm's output) under head [D, V], or [V, D] when
    `transposed` (a tied input embedding), accumulated and returned in float32.

    fold_transpose: contract a transposed head's own D axis in the dot (lax.dot_general) instead of
    x @ head.T, for CPUs (dispatch.f32_dot_outputs): there XLA upcast the whole bf16 table to f32 every
    call for x @ head.T (34.3 against 2.3 ms for 8 rows of SmolLM2-135M's [49152, 576] table;
    docs/design.md, "16-bit models on CPUs"). On an H200 the two forms gave equal logits, and the
    dot_general one measured 134 / 128 / 226 us against 132 / 127 / 209 at 1 / 8 / 256 rows of
    llama3_2_1b's table, so GPUs keep x @ head.T."""
    validate(x, head, transposed=transposed)
    if transposed and fold_transpose:
        dims = (((1,), (1,)), ((), ()))
        return lax.dot_general(x, head.astype(x.dtype), dims, precision=precision, preferred_element_type=jnp.float32)
    w = head.T if transposed else head
    return jnp.matmul(x, w.astype(x.dtype), precision=precision, preferred_element_type=jnp.float32)


def ref_greedy_head(x: jax.Array, head: jax.Array, *, transposed: bool, precision=None,
                    fold_transpose: bool = False) -> jax.Array:
    """i32[T]: each row's argmax over its f32 logits (the first index among equal maxima)."""
    logits = head_logits(x, head, transposed=transposed, precision=precision, fold_transpose=fold_transpose)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def argmax_of_block_partials(pmax: jax.Array, pidx: jax.Array) -> jax.Array:
    """i32[T] from the kernels' partials: pmax f32[B, T], each block of ids' maximum per row, and
    pidx [B, T] (any numeric dtype), the first id holding it. The row's maximum over the blocks and,
    among equal maxima, the lowest id: the first index among equal maxima over the whole row, as
    jnp.argmax gives. One variadic reduction (one XLA kernel; jnp.argmax over pmax and then a
    gather of pidx were two)."""

    def pick(a, b):
        (va, ia), (vb, ib) = a, b
        take_a = (va > vb) | ((va == vb) & (ia < ib))
        return jnp.where(take_a, va, vb), jnp.where(take_a, ia, ib)

    top = jnp.iinfo(pidx.dtype).max if jnp.issubdtype(pidx.dtype, jnp.integer) else jnp.inf
    _, idx = jax.lax.reduce((pmax, pidx), (jnp.array(-jnp.inf, pmax.dtype), jnp.array(top, pidx.dtype)), pick, (0,))
    return idx.astype(jnp.int32)
