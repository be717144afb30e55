"""KV cache: the device page pool.

Layout (documented once, here and in the ragged paged attention reference): one array per layer,
  kv_pages[l]: [P, G, 2K', H]  with index 2k of the third axis = K of KV head k, 2k+1 = its V.
K' = K * kv_repeat: when the tensor axis is larger than the model's KV heads, each KV head is stored
kv_repeat times so that every tensor shard holds whole heads for its query heads
(sharding.rules.kv_repeat). The pool is a tuple of arrays, passed into the step and donated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.config import ModelConfig

KVPages = tuple[jax.Array, ...]


def kv_pages_shape(config: ModelConfig, num_pages: int, page_size: int, kv_repeat: int = 1) -> tuple[int, ...]:
    return (num_pages, page_size, 2 * config.num_kv_heads * kv_repeat, config.head_dim)


def init_kv_pages(
    config: ModelConfig,
    num_pages: int,
    page_size: int,
    dtype=jnp.bfloat16,
    *,
    kv_repeat: int = 1,
    sharding: jax.sharding.Sharding | None = None,
    fill: float = 0.0,
) -> KVPages:
    """Allocate the pool directly with its sharding (no host copy, no replica first)."""
    if num_pages <= 0 or page_size <= 0:
        raise ValueError(f"num_pages and page_size must be positive, got {num_pages} and {page_size}")
    shape = kv_pages_shape(config, num_pages, page_size, kv_repeat)
    make = jax.jit(lambda: jnp.full(shape, fill, dtype), out_shardings=sharding)
    return tuple(make() for _ in range(config.num_layers))
