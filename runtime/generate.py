"""One-shot generation for a single prompt over the paged KV cache.

This is the simple path used by `xlaserve generate` until the batching engine lands, by the
perplexity script and by tests: one sequence, its pages laid out contiguously, a jitted prefill
(prompt padded to a power of two so few shapes compile) and a jitted one-token decode step.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from models.attention import AttentionMetadata
from runtime.checkpoint import LoadedModel
from runtime.kv_cache import init_kv_pages
from sharding.rules import kv_cache_sharding


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    token_ids: list[int]
    finish_reason: str  # "stop" (an EOS id) or "length"


def _bucket(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << math.ceil(math.log2(max(n, 1))))


def _sample(logits, key, temperature: float, top_k: int, top_p: float):  # logits f32[V] -> i32[]
    if temperature == 0.0:
        return jnp.argmax(logits).astype(jnp.int32)
    logits = logits / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][-1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        order = jnp.argsort(-logits)
        probs = jax.nn.softmax(logits[order])
        keep_sorted = jnp.cumsum(probs) - probs < top_p  # always keeps the most likely token
        keep = jnp.zeros_like(keep_sorted).at[order].set(keep_sorted)
        logits = jnp.where(keep, logits, -jnp.inf)
    return jax.random.categorical(key, logits).astype(jnp.int32)


class Generator:
    """Compiled prefill + decode for one model; reusable across prompts."""

    def __init__(self, model: LoadedModel, *, max_len: int, page_size: int = 16, kv_dtype=None):
        cfg = model.config
        if max_len > cfg.max_position_embeddings:
            raise ValueError(f"max_len {max_len} exceeds the model's max_position_embeddings {cfg.max_position_embeddings}")
        self.model, self.page_size = model, page_size
        self.max_len = max_len
        self.num_pages = -(-max_len // page_size)
        self.kv_dtype = kv_dtype or model.dtype
        self._kv_sharding = kv_cache_sharding(cfg, model.mesh)
        fwd = model.forward

        @partial(jax.jit, donate_argnums=(1,), static_argnames=("temperature", "top_k", "top_p"))
        def step(params, kv, tokens, positions, meta, last, key, *, temperature, top_k, top_p):
            logits, kv = fwd(params, tokens, positions, kv, meta, last)
            return _sample(logits[0], key, temperature, top_k, top_p), logits[0], kv

        self._step = step
        self._forward = jax.jit(fwd)

    def _meta(self, kv_len: int, q_len: int) -> AttentionMetadata:
        return AttentionMetadata.build([kv_len], [q_len], [list(range(self.num_pages))])

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        *,
        eos_ids: tuple[int, ...] = (),
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> GenerateResult:
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("prompt is empty; at least one token (e.g. BOS) is needed")
        if n + max_new_tokens > self.max_len:
            raise ValueError(f"prompt ({n} tokens) + max_new_tokens ({max_new_tokens}) exceeds max_len {self.max_len}")
        if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
            raise ValueError(f"bad sampling parameters: temperature={temperature} top_p={top_p} top_k={top_k}")
        kv = init_kv_pages(self.model.config, self.num_pages, self.page_size, self.kv_dtype,
                           kv_repeat=self.model.kv_repeat, sharding=self._kv_sharding)
        T = _bucket(n)
        tokens = np.zeros(T, np.int32)
        tokens[:n] = prompt_ids
        positions = np.arange(T, dtype=np.int32)
        key = jax.random.key(seed)
        sampling = dict(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))
        key, sub = jax.random.split(key)
        tok, _, kv = self._step(self.model.params, kv, tokens, positions, self._meta(n, n),
                                np.array([n - 1], np.int32), sub, **sampling)
        out: list[int] = []
        pos = n
        while True:
            t = int(tok)
            out.append(t)
            if t in eos_ids:
                return GenerateResult(out, "stop")
            if len(out) >= max_new_tokens:
                return GenerateResult(out, "length")
            key, sub = jax.random.split(key)
            tok, _, kv = self._step(self.model.params, kv, np.array([t], np.int32), np.array([pos], np.int32),
                                    self._meta(pos + 1, 1), np.array([0], np.int32), sub, **sampling)
            pos += 1

    def prompt_logits(self, prompt_ids: list[int]) -> np.ndarray:
        """f32[n, V] logits of every prompt position (for reference comparisons and perplexity)."""
        n = len(prompt_ids)
        if not 0 < n <= self.max_len:
            raise ValueError(f"prompt has {n} tokens; must be 1..{self.max_len}")
        kv = init_kv_pages(self.model.config, self.num_pages, self.page_size, self.kv_dtype,
                           kv_repeat=self.model.kv_repeat, sharding=self._kv_sharding)
        T = _bucket(n)
        tokens = np.zeros(T, np.int32)
        tokens[:n] = prompt_ids
        logits, _ = self._forward(self.model.params, tokens, np.arange(T, dtype=np.int32), kv,
                                                self._meta(n, n))
        return np.asarray(logits[:n])
