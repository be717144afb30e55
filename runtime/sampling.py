"""Sampling inside the jitted step: one row per sequence, every shape fixed by the bucket.

Per row, in order (HF's logits-processor order):
  1. repetition penalty over the row's prompt + output tokens, presence and frequency penalties
     over its output tokens (OpenAI's definitions);
  2. EOS and stop token ids banned (-inf) while the row is below min_tokens (the host decides
     which rows and fills `banned`);
  3. greedy rows (temperature 0) take the argmax here;
  4. temperature, then top-k, top-p (over the top-k renormalized distribution), min-p (relative to
     the most likely token left), then one draw with the Gumbel-max trick.

Exactness across batch compositions (a request's tokens may not depend on its neighbours):
  * Noise comes from key(seed) folded with the position of the token being sampled, never from
    the batch slot or the step, so a request sampled alone, in a batch, or recomputed after a
    preemption draws the same noise. Noise is generated in vocabulary order.
  * The filters never reorder anything in vocabulary space: they reduce to one cutoff logit per
    row (they all keep a prefix of the sorted order), then `logit >= cutoff` masks the row. Ties
    at the cutoff are all kept, which is deterministic.
  * Work that only some rows need (penalty counts, the sort, noise, logprobs) sits behind a
    `lax.cond` on "does any row need it". A row that does not need it computes bit-identical
    values on either branch (the neutral settings are exact identities), so whether a neighbour
    triggered the branch cannot change the row.

Logprobs are of the model's raw distribution (log_softmax of the logits, before penalties and
temperature), as vLLM returns by default: the sampled token's, plus the top `max_logprobs`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class SamplingBatch(NamedTuple):
    """Per-row sampling inputs. Padding rows carry the neutral values of `neutral_rows`."""

    temperature: jax.Array  # f32[S]: 0 = greedy
    top_k: jax.Array  # i32[S]: 0 = off
    top_p: jax.Array  # f32[S]: 1 = off
    min_p: jax.Array  # f32[S]: 0 = off
    repetition_penalty: jax.Array  # f32[S]: 1 = off
    presence_penalty: jax.Array  # f32[S]: 0 = off
    frequency_penalty: jax.Array  # f32[S]: 0 = off
    seeds: jax.Array  # u32[S, 2]: the request's 64-bit seed as (low, high) words
    positions: jax.Array  # i32[S]: position of the token being sampled (its index in the sequence)
    history: jax.Array  # i32[S, W]: prompt + output ids of rows with penalties, -1 padded (host: None = all -1)
    num_prompt: jax.Array  # i32[S]: history[:num_prompt] is prompt, the rest output
    banned: jax.Array  # i32[S, NB]: ids to ban now (min_tokens), -1 padded
    want_logprobs: jax.Array  # bool[S]


class SampleOutput(NamedTuple):
    tokens: jax.Array  # i32[S]
    logprobs: Logprobs


class Logprobs(NamedTuple):
    sampled: jax.Array  # f32[S]: logprob of the sampled token (0 when no row asked)
    top_ids: jax.Array  # i32[S, M]
    top_logprobs: jax.Array  # f32[S, M]


def empty_sampling_batch(S: int, history_len: int, max_banned: int) -> SamplingBatch:
    """Host-side numpy arrays for S neutral (greedy, no penalties, no logprobs) rows."""
    return SamplingBatch(
        temperature=np.zeros(S, np.float32),
        top_k=np.zeros(S, np.int32),
        top_p=np.ones(S, np.float32),
        min_p=np.zeros(S, np.float32),
        repetition_penalty=np.ones(S, np.float32),
        presence_penalty=np.zeros(S, np.float32),
        frequency_penalty=np.zeros(S, np.float32),
        seeds=np.zeros((S, 2), np.uint32),
        positions=np.zeros(S, np.int32),
        history=np.full((S, history_len), -1, np.int32),
        num_prompt=np.zeros(S, np.int32),
        banned=np.full((S, max_banned), -1, np.int32),
        want_logprobs=np.zeros(S, np.bool_),
    )


def split_seed(seed: int) -> tuple[int, int]:
    """A Python int seed (any size; reduced mod 2**64) as (low, high) uint32 words."""
    s = int(seed) % (1 << 64)
    return s & 0xFFFFFFFF, s >> 32


def _row_keys(seeds: jax.Array, positions: jax.Array) -> jax.Array:  # u32[S, 2], i32[S] -> key[S]
    def one(seed, pos):
        key = jax.random.fold_in(jax.random.key(seed[0]), seed[1])
        return jax.random.fold_in(key, pos)

    return jax.vmap(one)(seeds, positions)


def _scatter_rows(shape, ids: jax.Array, values: jax.Array, dtype) -> jax.Array:
    """out[s, ids[s, j]] += values[s, j]; ids < 0 are dropped.  ids: i32[S, W] -> dtype[S, V]."""
    S, V = shape
    rows = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[:, None], ids.shape)
    cols = jnp.where(ids < 0, V, ids)  # out of range: dropped
    return jnp.zeros(shape, dtype).at[rows, cols].add(values.astype(dtype), mode="drop")


def apply_penalties(logits: jax.Array, b: SamplingBatch) -> jax.Array:  # f32[S, V] -> f32[S, V]
    S, V = logits.shape
    W = b.history.shape[1]
    valid = b.history >= 0
    is_out = jnp.arange(W, dtype=jnp.int32)[None, :] >= b.num_prompt[:, None]
    out_counts = _scatter_rows((S, V), b.history, valid & is_out, jnp.float32)  # f32[S, V]
    seen = _scatter_rows((S, V), b.history, valid, jnp.int32) > 0  # bool[S, V]
    rp = b.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    return (
        logits
        - b.frequency_penalty[:, None] * out_counts
        - b.presence_penalty[:, None] * (out_counts > 0).astype(jnp.float32)
    )


def _cutoffs(scaled: jax.Array, b: SamplingBatch) -> jax.Array:  # f32[S, V] -> f32[S, 1]
    """The smallest logit each row keeps after top-k, top-p and min-p."""
    S, V = scaled.shape
    srt = -jnp.sort(-scaled, axis=-1)  # descending; values only (the mask is applied by value)
    rank = jnp.arange(V, dtype=jnp.int32)[None, :]
    k = jnp.where(b.top_k > 0, jnp.minimum(b.top_k, V), V)[:, None]
    keep = rank < k
    probs = jax.nn.softmax(jnp.where(keep, srt, -jnp.inf), axis=-1)
    exclusive = jnp.cumsum(probs, axis=-1) - probs
    keep &= (exclusive < b.top_p[:, None]) | (b.top_p[:, None] >= 1.0)
    probs = jax.nn.softmax(jnp.where(keep, srt, -jnp.inf), axis=-1)
    keep &= (probs >= b.min_p[:, None] * probs[:, :1]) | (b.min_p[:, None] <= 0.0)
    n_keep = jnp.sum(keep, axis=-1, keepdims=True)  # >= 1: rank 0 always survives
    return jnp.take_along_axis(srt, n_keep - 1, axis=-1)


def sample(logits: jax.Array, b: SamplingBatch, *, max_logprobs: int) -> SampleOutput:
    """logits f32[S, V] -> tokens i32[S] and their logprobs (see the module docstring)."""
    S, V = logits.shape
    logits = logits.astype(jnp.float32)
    raw = logits

    penalized = (b.repetition_penalty != 1.0) | (b.presence_penalty != 0.0) | (b.frequency_penalty != 0.0)
    logits = jax.lax.cond(jnp.any(penalized), lambda x: apply_penalties(x, b), lambda x: x, logits)
    rows = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[:, None], b.banned.shape)
    logits = logits.at[rows, jnp.where(b.banned < 0, V, b.banned)].set(-jnp.inf, mode="drop")

    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    is_random = b.temperature > 0.0

    def draw(x):
        scaled = x / jnp.where(is_random, b.temperature, 1.0)[:, None]
        filtered = (b.top_k > 0) | (b.top_p < 1.0) | (b.min_p > 0.0)
        cutoff = jax.lax.cond(
            jnp.any(filtered & is_random),
            lambda s: _cutoffs(s, b),
            lambda s: jnp.full((S, 1), -jnp.inf, jnp.float32),
            scaled,
        )
        masked = jnp.where(scaled >= cutoff, scaled, -jnp.inf)
        noise = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(_row_keys(b.seeds, b.positions))
        return jnp.argmax(masked + noise, axis=-1).astype(jnp.int32)

    random_tokens = jax.lax.cond(jnp.any(is_random), draw, lambda x: greedy_tokens, logits)
    tokens = jnp.where(is_random, random_tokens, greedy_tokens)

    M = max_logprobs

    def logprobs(x):
        lp = jax.nn.log_softmax(x, axis=-1)
        sampled = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
        if M == 0:
            return Logprobs(sampled, jnp.zeros((S, 0), jnp.int32), jnp.zeros((S, 0), jnp.float32))
        top_lp, top_ids = jax.lax.top_k(lp, M)
        return Logprobs(sampled, top_ids.astype(jnp.int32), top_lp)

    def no_logprobs(x):
        return Logprobs(jnp.zeros((S,), jnp.float32), jnp.zeros((S, M), jnp.int32), jnp.zeros((S, M), jnp.float32))

    lps = jax.lax.cond(jnp.any(b.want_logprobs), logprobs, no_logprobs, raw)
    return SampleOutput(tokens, lps)
