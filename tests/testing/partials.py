"""Partial products for tests of the kernels that sum them (dispatch.gemv_partials' consumers)."""

import jax.numpy as jnp
import numpy as np


def exact_partials(x, parts: int, seed: int = 0):
    """f32[parts, ...] whose sum is x in any order: x split by dyadic weights (1/2, 1/4, ..., the last
    two equal, shuffled by `seed`), each part exact and every partial sum exact while x has at most
    16 significant bits (bf16 values)."""
    w = [0.5 ** (i + 1) for i in range(parts - 1)] + [0.5 ** (parts - 1)]
    perm = np.random.default_rng(seed).permutation(parts)
    return jnp.stack([x.astype(jnp.float32) * w[i] for i in perm])
