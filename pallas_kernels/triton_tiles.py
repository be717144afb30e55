"""Helpers shared by the Pallas Triton kernels: tile shapes (tiles must be powers of two) and loads
of the partial products dispatch.gemv_partials leaves."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, (int(x) - 1).bit_length())


def load_parts(ref, rows, cols, *, parts: int, part_rows: int, mask, dtype):
    """f32 ref[rows, cols] (masked lanes 0), or with parts > 1 the sum of the `parts` partial products
    stored one after the other in ref (part p's row r at r + p * part_rows), rounded to `dtype`: what
    the GEMV would have written."""
    x = plgpu.load(ref.at[rows, cols], mask=mask, other=0.0).astype(jnp.float32)
    if parts > 1:
        for p in range(1, parts):
            x += plgpu.load(ref.at[rows + p * part_rows, cols], mask=mask, other=0.0)
        x = x.astype(dtype).astype(jnp.float32)
    return x
