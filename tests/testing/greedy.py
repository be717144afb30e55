"""Plain greedy generation over the paged model, for tests: prefill the prompt in one step, then
decode one token per step, reusing the same pages. One sequence; pages taken in reverse order so a
page-table bug cannot hide behind an identity mapping; unused cache filled with NaN."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.attention import AttentionMetadata
from runtime.kv_cache import init_kv_pages
from sharding.rules import kv_cache_sharding


@dataclasses.dataclass
class GreedyResult:
    tokens: list[int]  # generated ids, the prompt excluded
    prompt_logits: np.ndarray  # f32[T, V]: logits at every prompt position
    step_logits: np.ndarray  # f32[n, V]: the logits each generated token was the argmax of


def greedy_generate(
    loaded,  # runtime.checkpoint.LoadedModel
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    page_size: int = 16,
    stop_token: int | None = None,
    decode_only: bool = False,
) -> GreedyResult:
    """decode_only: the one-token steps tell the model so (forward's decode_only, as the engine's
    decode bursts do)."""
    cfg = loaded.config
    T = len(prompt)
    if T == 0 or max_new_tokens < 1:
        raise ValueError(f"need a non-empty prompt and max_new_tokens >= 1; got {T} tokens, {max_new_tokens}")
    total = T + max_new_tokens - 1  # the last generated token is never fed back
    num_pages = -(-total // page_size)
    pages = list(reversed(range(num_pages)))
    kv = init_kv_pages(cfg, num_pages, page_size, loaded.dtype, kv_repeat=loaded.kv_repeat,
                       sharding=kv_cache_sharding(cfg, loaded.mesh), fill=float("nan"))
    step = jax.jit(loaded.forward, donate_argnums=(3,))
    decode = jax.jit(partial(loaded.forward, decode_only=decode_only), donate_argnums=(3,))
    meta = partial(AttentionMetadata.build, page_tables=[pages], pages_per_seq=num_pages)

    logits, kv = step(loaded.params, jnp.asarray(prompt, jnp.int32), jnp.arange(T, dtype=jnp.int32), kv,
                      meta([T], [T]))
    prompt_logits = np.asarray(logits, np.float32)
    last = prompt_logits[-1]
    tokens, step_logits = [], []
    for pos in range(T, T + max_new_tokens):
        tok = int(np.argmax(last))
        tokens.append(tok)
        step_logits.append(last)
        if tok == stop_token or pos == T + max_new_tokens - 1:
            break
        logits, kv = decode(loaded.params, jnp.asarray([tok], jnp.int32), jnp.asarray([pos], jnp.int32), kv,
                            meta([pos + 1], [1]))
        last = np.asarray(logits[0], np.float32)
    return GreedyResult(tokens, prompt_logits, np.stack(step_logits))


def hf_greedy(model, prompt: Sequence[int], max_new_tokens: int) -> tuple[list[int], np.ndarray]:
    """The same greedy loop on a HF transformers causal LM (its own KV cache): generated ids and the
    f32[n, V] logits each was chosen from. No EOS stop, unlike `generate`, so runs compare in full."""
    import inspect

    import torch
    from transformers import DynamicCache

    # The KV cache argument is `cache` in recent transformers 5 releases, where `past_key_values` is
    # deprecated (to go in 5.40); older ones take only the latter. The cache fills in place either way.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    kv = {name: DynamicCache(config=model.config)}
    seq, logits = list(prompt), []
    x = torch.tensor([list(prompt)])
    with torch.no_grad():
        for _ in range(max_new_tokens):
            last = model(x, use_cache=True, **kv).logits[0, -1].float()
            logits.append(last.numpy())
            seq.append(int(last.argmax()))
            x = torch.tensor([[seq[-1]]])
    return seq[len(prompt):], np.stack(logits)


def steps_before_near_tie(ref_logits: np.ndarray, atol: float) -> int:
    """How many leading greedy steps two runs must agree on, given the reference's f32[n, V] step
    logits and the runs' logits within atol of each other: up to the first step whose top-2 gap is at
    most 2 * atol (there float reassociation may flip the argmax), else all n."""
    top2 = -np.sort(-ref_logits, axis=-1)[:, :2]
    ties = np.flatnonzero(top2[:, 0] - top2[:, 1] <= 2 * atol)
    return int(ties[0]) if len(ties) else len(ref_logits)
