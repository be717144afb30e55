"""Sampling as a few small programs per seq bucket, chosen on the host: one row per sequence.

Per row, in order (HF's logits-processor order, with vLLM's place for the logit bias):
  0. the row's logit bias (OpenAI's logit_bias: a value added to each of up to MAX_LOGIT_BIAS ids);
  1. repetition penalty over the row's prompt + output tokens, presence and frequency penalties
     over its output tokens (OpenAI's definitions); the last output token (the last K after a
     burst) may still be on the device only (lookahead): the host history holds placeholders for
     them (`history_placeholder`, `burst_history_placeholder`). The counts they read come from
     the history in chunks of a fixed width (`count_penalties`), so a step ships and scans the
     history its rows hold, not max_model_len entries a row;
  2. EOS and stop token ids banned (-inf) while the row is below min_tokens (the host fills
     `banned` for the rows below it; a burst lifts a row's ban at its `ban_before`: `advance_rows`);
  3. greedy rows (temperature 0) take the argmax here;
  4. temperature, then top-k, top-p (over the top-k renormalized distribution), min-p (relative to
     the most likely token left), then one draw with the Gumbel-max trick.

Programs, not branches. Work that only some rows need (penalty counts, the sort, noise, logprobs)
is skipped when no row of the batch needs it. A `lax.cond` on a device predicate would decide
that on the device, but XLA's GPU runtime copies every cond predicate to the host and waits for
it, so the host call of the step would return only when the device has nearly finished it and the
engine's host work could not overlap the device. The packer already knows which rows need what
(`SamplingNeeds`), so the choice is made on the host, between separately compiled programs, and
every dispatch returns at once:

    model program (runtime/step.py)  forward -> raw logits f32[S, V] and `greedy` tokens
    count          -> penalty counts of the history's first chunk      when some row has penalties or a bias
    count_more     -> those counts with one more chunk added           per further chunk of the history
    penalize       -> penalized logits and their `greedy` tokens      when some row has penalties or a bias
    pick           -> tokens: random rows drawn, greedy rows argmax    when some row is random
    pick_filtered  -> the same with top-k/top-p/min-p cutoffs          when some random row filters
    logprobs       -> of the raw logits, for the final tokens          when some row asked

Loops whose trip count is known at compile time (threefry's rounds) do not wait on the host;
tests/runtime/test_step.py checks every compiled program for conditionals and other loops.

A plain greedy step is the model program alone. Six sampler programs per seq bucket (the two
pick variants because the sort is most of the sampler's work; folding penalties or logprobs into
variants instead would multiply the programs to compile).

Exactness across batch compositions (a request's tokens may not depend on its neighbours, nor on
which programs its neighbours made the step run):
  * Neutral settings are exact identities (x - 0 * n, x / 1, a cutoff at the row's minimum), so a
    row that does not need a program's work gets bit-identical values out of it; a greedy row
    takes the argmax of the same masked logits in every program that emits tokens.
  * Noise comes from key(seed) folded with the position of the token being sampled, never from
    the batch slot or the step, so a request sampled alone, in a batch, or recomputed after a
    preemption draws the same noise. Noise is generated in vocabulary order.
  * The filters never reorder anything in vocabulary space: they reduce to one cutoff logit per
    row (they all keep a prefix of the sorted order), then `logit >= cutoff` masks the row. Ties
    at the cutoff are all kept, which is deterministic.

Tokens leave every program as i32[slots] (slots = the largest seq bucket, rows past S padding):
one shape whatever the bucket, so the next step's model program can take a step's tokens as an
input and read a decode's input token from them on the device (lookahead, runtime/engine.py).

Per-row inputs travel as one i32[S, K] `rows` buffer (f32 and u32 fields as their bit patterns),
so a step ships one array for sampling rather than one per field; `sampling_rows` names its
columns, as numpy views on the host and as static slices inside a program.

Logprobs are of the model's raw distribution (log_softmax of the logits, before penalties and
temperature), as vLLM returns by default: the sampled token's, plus the top `max_logprobs`.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from runtime.request import MAX_LOGIT_BIAS


class SamplingBatch(NamedTuple):
    """Per-row sampling inputs: the named columns of a rows buffer. Padding rows are neutral."""

    temperature: jax.Array  # f32[S]: 0 = greedy
    top_k: jax.Array  # i32[S]: 0 = off
    top_p: jax.Array  # f32[S]: 1 = off
    min_p: jax.Array  # f32[S]: 0 = off
    repetition_penalty: jax.Array  # f32[S]: 1 = off
    presence_penalty: jax.Array  # f32[S]: 0 = off
    frequency_penalty: jax.Array  # f32[S]: 0 = off
    seeds: jax.Array  # u32[S, 2]: the request's 64-bit seed as (low, high) words
    positions: jax.Array  # i32[S]: position of the token being sampled (its index in the sequence)
    num_prompt: jax.Array  # i32[S]: history[:num_prompt] is prompt, the rest output
    ban_before: jax.Array  # i32[S]: `banned` holds while the sampled token's index is below this
    bias_ids: jax.Array  # i32[S, MAX_LOGIT_BIAS]: ids whose logits get bias_values added, -1 padded
    bias_values: jax.Array  # f32[S, MAX_LOGIT_BIAS]
    banned: jax.Array  # i32[S, NB]: ids to ban now (min_tokens), -1 padded


# (field, dtype, columns) of a rows buffer, in SamplingBatch order; `banned` takes the rest.
# SamplingNeeds.of reads the first seven by position; request_row copies them from SamplingParams.
_COLUMNS = (
    ("temperature", np.float32, 1), ("top_k", np.int32, 1), ("top_p", np.float32, 1), ("min_p", np.float32, 1),
    ("repetition_penalty", np.float32, 1), ("presence_penalty", np.float32, 1),
    ("frequency_penalty", np.float32, 1), ("seeds", np.uint32, 2), ("positions", np.int32, 1),
    ("num_prompt", np.int32, 1), ("ban_before", np.int32, 1), ("bias_ids", np.int32, MAX_LOGIT_BIAS),
    ("bias_values", np.float32, MAX_LOGIT_BIAS),
)
_FIXED_COLUMNS = sum(n for _, _, n in _COLUMNS)
_NEUTRAL = dict(top_p=1.0, repetition_penalty=1.0, bias_ids=-1, banned=-1)  # all other fields: 0


def _column(name: str) -> int:
    """The first column of field `name` in a rows buffer."""
    return sum(n for _, _, n in _COLUMNS[: [f for f, _, _ in _COLUMNS].index(name)])


_BIAS_COLUMN = _column("bias_ids")
_POSITIONS_COLUMN = _column("positions")


def _bitcast(x, dtype):
    if isinstance(x, np.ndarray):
        return x.view(dtype)  # a view: writes land in the rows buffer
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


def sampling_rows(rows) -> SamplingBatch:
    """The named columns of rows i32[S, K]: numpy views of a host buffer, or slices in a program."""
    out, c = [], 0
    for _, dtype, n in _COLUMNS:
        out.append(_bitcast(rows[:, c] if n == 1 else rows[:, c : c + n], dtype))
        c += n
    return SamplingBatch(*out, banned=rows[:, c:])


def empty_rows(S: int, max_banned: int) -> np.ndarray:
    """A host rows buffer i32[S, K] of S neutral (greedy, no penalties) rows."""
    return _neutral_rows(S, max_banned).copy()


def request_row(params, seed: tuple[int, int], num_prompt: int, ban_before: int) -> bytes:
    """The columns of a request's row that stay the same every step, up to its logit bias (F of
    them, those before `bias_ids`; `positions` left 0 for the packer to set per step), as the bytes
    of an i32[F]. `params` is its SamplingParams, `seed` split_seed(seed), `num_prompt` its prompt
    length (0 unless it has penalties), `ban_before` the index from which its min_tokens ban is
    lifted (0: none). Computed once per request; the packer copies it with `put_request_rows`."""
    row = _neutral_rows(1, 0).copy()
    v = sampling_rows(row)
    for name, _, _ in _COLUMNS[:7]:  # the settings, named as in SamplingParams
        getattr(v, name)[0] = getattr(params, name)
    v.seeds[0] = seed
    v.num_prompt[0] = num_prompt
    v.ban_before[0] = ban_before
    return row[0, :_BIAS_COLUMN].tobytes()


def bias_columns(logit_bias) -> np.ndarray | None:
    """A request's logit-bias columns, i32[2 * MAX_LOGIT_BIAS] (ids by id, -1 padded; then the
    biases' f32 bits), or None without a bias. Few requests have one: the packer writes these
    for those rows only (`put_bias_rows`), so every other row costs no more to pack."""
    if not logit_bias:
        return None
    row = _neutral_rows(1, 0).copy()
    v = sampling_rows(row)
    ids = sorted(logit_bias)
    v.bias_ids[0, : len(ids)] = ids
    v.bias_values[0, : len(ids)] = [logit_bias[t] for t in ids]
    return row[0, _BIAS_COLUMN:_FIXED_COLUMNS].copy()


def put_request_rows(rows: np.ndarray, index: list[int], request_rows: list[bytes]) -> None:
    """rows[index[j]] takes request_rows[j] (`request_row`) in its first F columns. Joined as bytes:
    at 256 rows one join is ~2 us where stacking 256 small arrays took ~100 (every step)."""
    F = _BIAS_COLUMN
    rows[index, :F] = np.frombuffer(b"".join(request_rows), np.int32).reshape(len(index), F)


def put_positions(rows: np.ndarray, index: list[int], positions: list[int]) -> None:
    """rows[index[j]] takes positions[j] as its `positions` (the index its sampled token will have).
    Written by column, as `put_banned`: the packer sets no other column per step, and building
    every column's view (`sampling_rows`) was ~40% of packing a one-sequence step."""
    rows[index, _POSITIONS_COLUMN] = positions


def put_banned(rows: np.ndarray, i: int, ids: np.ndarray) -> None:
    """Row i bans `ids` (its first len(ids) `banned` columns)."""
    rows[i, _FIXED_COLUMNS : _FIXED_COLUMNS + len(ids)] = ids


def put_bias_rows(rows: np.ndarray, index: list[int], bias: list[np.ndarray]) -> None:
    """rows[index[j]] takes bias[j] (`bias_columns`) in its logit-bias columns."""
    rows[index, _BIAS_COLUMN:_FIXED_COLUMNS] = np.stack(bias)


@functools.cache
def _neutral_rows(S: int, max_banned: int) -> np.ndarray:  # packing copies it every step
    rows = np.zeros((S, _FIXED_COLUMNS + max_banned), np.int32)
    view = sampling_rows(rows)
    for name, value in _NEUTRAL.items():
        getattr(view, name)[...] = value
    rows.flags.writeable = False
    return rows


@dataclass(frozen=True)
class SamplingNeeds:
    """What the rows of one step need beyond greedy decoding; the packer decides it on the host."""

    penalties: bool = False  # some row has a repetition/presence/frequency penalty or a logit bias
    random: bool = False  # some row has temperature > 0
    filters: bool = False  # some random row has top-k, top-p or min-p
    logprobs: bool = False  # some row asked for logprobs
    bans: bool = False  # some row has ids banned (below its min_tokens)

    @classmethod
    def of(cls, rows: np.ndarray, *, logprobs: bool) -> SamplingNeeds:
        """What host rows i32[S, K] need: a setting counts when it is not its neutral value
        (compared as bit patterns: SamplingParams admits no other spelling of "off")."""
        changed = rows[:, :7] != _neutral_rows(1, 0)[0, :7]  # bool[S, 7]: the columns below
        column = changed.any(axis=0)
        random = bool(column[0])  # temperature
        return cls(
            penalties=bool(column[4:7].any()) or bool((rows[:, _BIAS_COLUMN] >= 0).any()),  # or a first bias id
            random=random,
            filters=random and bool((changed[:, 0] & changed[:, 1:4].any(axis=1)).any()),  # top-k, top-p, min-p
            logprobs=logprobs,
            bans=bool((rows[:, _FIXED_COLUMNS:] >= 0).any()),
        )


class Logprobs(NamedTuple):
    sampled: jax.Array  # f32[S]: logprob of the sampled token
    top_ids: jax.Array  # i32[S, M]
    top_logprobs: jax.Array  # f32[S, M]


def split_seed(seed: int) -> tuple[int, int]:
    """A Python int seed (any size; reduced mod 2**64) as (low, high) uint32 words."""
    s = int(seed) % (1 << 64)
    return s & 0xFFFFFFFF, s >> 32


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded `seed` (SamplingParams.n > 1).

    Sample 0 uses the seed itself, so a request's first sample is the same for any n. The others
    take splitmix64's finalizer of seed + index * 2**64 / phi (mod 2**64): with seed + index (vLLM's
    rule), requests with adjacent seeds shared samples (seed 5's second was seed 6's first), and a
    sweep over seeds drew the same samples again and again."""
    if index == 0:
        return seed
    mask = (1 << 64) - 1
    z = (int(seed) + index * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def _row_keys(seeds: jax.Array, positions: jax.Array) -> jax.Array:  # u32[S, 2], i32[S] -> key[S]
    def one(seed, pos):
        key = jax.random.fold_in(jax.random.key(seed[0]), seed[1])
        return jax.random.fold_in(key, pos)

    return jax.vmap(one)(seeds, positions)


def _row_ids(ids: jax.Array, V: int) -> tuple[jax.Array, jax.Array]:
    """Scatter indices of per-row ids i32[S, W] into [S, V]: (row, id), with ids < 0 moved out of
    range, so that a scatter with mode="drop" skips them."""
    rows = jnp.broadcast_to(jnp.arange(ids.shape[0], dtype=jnp.int32)[:, None], ids.shape)
    return rows, jnp.where(ids < 0, V, ids)


def _scatter_rows(base: jax.Array, ids: jax.Array, values: jax.Array) -> jax.Array:
    """base[s, ids[s, j]] += values[s, j]; ids < 0 are dropped.  ids: i32[S, W], base: [S, V]."""
    return base.at[_row_ids(ids, base.shape[1])].add(values.astype(base.dtype), mode="drop")


def _ban(logits: jax.Array, banned: jax.Array) -> jax.Array:  # f32[S, V], i32[S, NB] -> f32[S, V]
    return logits.at[_row_ids(banned, logits.shape[1])].set(-jnp.inf, mode="drop")


def greedy(logits: jax.Array, banned: jax.Array) -> jax.Array:  # f32[S, V], i32[S, NB] -> i32[S]
    """The argmax of each row with its banned ids masked: every greedy row's token."""
    return jnp.argmax(_ban(logits, banned), axis=-1).astype(jnp.int32)


class PenaltyCounts(NamedTuple):
    out: jax.Array  # f32[S, V]: how often each id occurs among the row's output tokens
    seen: jax.Array  # bool[S, V]: whether it occurs in the prompt or the output


# Entries of the penalty history a count program reads per call. The packer ships the history in
# whole chunks (at least one, `BatchPacker`), as wide as its longest penalized row needs: a step
# costs what its rows hold. One [S, max_model_len] array was 134 MB a step at 256 rows x 131,072
# (llama3_2_1b's default max_model_len): 49 ms to pack on the CI machine, then its transfer and a
# scan on the device; the offline run with a repetition penalty took 3x as long (docs/benchmarks.md).
HISTORY_CHUNK = 2048


def penalty_counts(b: SamplingBatch, history: jax.Array, vocab_size: int, *, start=0,
                   counts: PenaltyCounts | None = None) -> PenaltyCounts:
    """The counts the penalties read, of history i32[S, C] (prompt + output ids, -1 padded), whose
    entry j is the row's token at index start + j; added to `counts` (those of the entries before
    start) when given. Whole counts in f32: the same values in any order of chunks."""
    S, C = history.shape
    if counts is None:
        counts = PenaltyCounts(jnp.zeros((S, vocab_size), jnp.float32), jnp.zeros((S, vocab_size), jnp.bool_))
    valid = history >= 0
    is_out = start + jnp.arange(C, dtype=jnp.int32)[None, :] >= b.num_prompt[:, None]
    seen = counts.seen.at[_row_ids(history, vocab_size)].set(True, mode="drop")
    return PenaltyCounts(_scatter_rows(counts.out, history, valid & is_out), seen)


def count_sampled(counts: PenaltyCounts, tokens: jax.Array) -> PenaltyCounts:
    """counts with one more output token per row, tokens i32[>= S] (a burst's step: each row's
    tokens so far stay on the device). Whole counts in f32: the same values as recounting."""
    S = counts.out.shape[0]
    rows, cols = jnp.arange(S, dtype=jnp.int32), tokens[:S]
    return PenaltyCounts(counts.out.at[rows, cols].add(1.0), counts.seen.at[rows, cols].set(True))


def apply_penalties(logits: jax.Array, b: SamplingBatch, counts: PenaltyCounts) -> jax.Array:
    """logits f32[S, V] with the rows' logit biases, then their repetition, presence and frequency
    penalties -> f32[S, V]. A row without bias ids (-1) keeps its logits bit for bit."""
    logits = logits.at[_row_ids(b.bias_ids, logits.shape[1])].add(b.bias_values, mode="drop")
    out_counts, seen = counts
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
    # at least the top token (a top_p that f32 holds as 0 kept none, and the index -1 then kept all)
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1, keepdims=True), 1)
    return jnp.take_along_axis(srt, n_keep - 1, axis=-1)


# -- the sampler programs: arrays in, arrays out; rows i32[S, K] as built by `empty_rows` --------


def pad_slots(tokens: jax.Array, slots: int) -> jax.Array:
    """i32[S] -> i32[slots]: every program's tokens have the one shape the next step reads them in."""
    return jnp.pad(tokens, (0, slots - tokens.shape[0]))


def advance_rows(rows: jax.Array, steps) -> jax.Array:
    """rows i32[S, K] of model step j = `steps` of a burst (runtime/step.py), whose sampled tokens
    sit j places after the first step's: every row's `positions` moved j on, and its `banned` ids
    cleared where that reaches its `ban_before` (min_tokens met)."""
    rows = rows.at[:, _POSITIONS_COLUMN].add(steps)
    b = sampling_rows(rows)
    return rows.at[:, _FIXED_COLUMNS:].set(jnp.where((b.positions < b.ban_before)[:, None], b.banned, -1))


def history_placeholder(token: int) -> int:
    """The history entry for a decode's input token that is still the placeholder -(i + 1) of row i
    of the previous step (lookahead, runtime/engine.py): -(i + 2), clear of the -1 padding.
    `penalize` reads row i of the previous step's tokens for it, on the device."""
    return token - 1


def burst_history_placeholder(token: int, step: int, slots: int) -> int:
    """The history entry for the token model step `step` of the previous step, a burst, sampled in
    row i (placeholder `token` = -(i + 1)): -(2 + slots * (step + 1) + i), past every
    `history_placeholder`. After a burst the host lacks all K of a row's tokens; the programs read
    them from the burst's i32[K, slots] tokens (`prev_burst`), on the device."""
    return -(2 + slots * (step + 1) - token - 1)


def resolve_history(history: jax.Array, prev: jax.Array, prev_burst: jax.Array) -> jax.Array:
    """history i32[S, W] with its placeholders replaced by the tokens they stand for: -(i + 2)
    (`history_placeholder`) by prev[i], the token the previous step sampled in row i, and
    `burst_history_placeholder`s by prev_burst i32[K, slots], the tokens of the previous step when
    it was a burst (else ignored). The host has not seen either yet."""
    pool = jnp.concatenate([prev, prev_burst.reshape(-1)])
    return jnp.where(history <= -2, pool[jnp.clip(-history - 2, 0, pool.shape[0] - 1)], history)


def count(rows: jax.Array, history: jax.Array, prev: jax.Array, prev_burst: jax.Array, *,
          vocab_size: int) -> PenaltyCounts:
    """i32[S, K], the history's first chunk i32[S, C], i32[slots], i32[K, slots] -> its penalty
    counts; placeholders stand for prev's or prev_burst's tokens (`resolve_history`)."""
    return penalty_counts(sampling_rows(rows), resolve_history(history, prev, prev_burst), vocab_size)


def count_more(counts: PenaltyCounts, history: jax.Array, start: jax.Array, rows: jax.Array, prev: jax.Array,
               prev_burst: jax.Array, *, vocab_size: int) -> PenaltyCounts:
    """`counts` with the history chunk i32[S, C] of entries start.. (an i32 scalar) added."""
    return penalty_counts(sampling_rows(rows), resolve_history(history, prev, prev_burst), vocab_size,
                          start=start, counts=counts)


def count_penalties(call: Callable, rows, history, prev, prev_burst, *, chunk: int):
    """The penalty counts of history i32[S, n * chunk] by the count programs, one call per chunk:
    `call(name, *args)` runs program `name`."""
    W = history.shape[1]
    if W % chunk or not W:
        raise ValueError(f"a penalty history of {W} entries is not whole chunks of {chunk}")
    counts = call("count", rows, history if W == chunk else history[:, :chunk], prev, prev_burst)  # no device slice
    for start in range(chunk, W, chunk):
        counts = call("count_more", counts, history[:, start : start + chunk], np.int32(start), rows, prev, prev_burst)
    return counts


def penalize(logits: jax.Array, rows: jax.Array, counts: PenaltyCounts, *, slots: int) -> tuple[jax.Array, jax.Array]:
    """f32[S, V], i32[S, K], the rows' penalty counts (`count`) -> penalized logits f32[S, V] and
    their greedy tokens i32[slots]."""
    b = sampling_rows(rows)
    logits = apply_penalties(logits, b, counts)
    return logits, pad_slots(greedy(logits, b.banned), slots)


def gumbel_from_bits(bits: jax.Array) -> jax.Array:  # u32[...] -> f32[...]
    """Standard Gumbel noise -log(E) from 32 random bits: E = -log1p(-x) ~ Exp(1) for x = (~bits + 1/2)
    / 2^32, uniform in (0, 1). The integer is converted before it is scaled, so x keeps float32's
    precision near 0, where E is small and the noise large: it reaches 22.9 (at most 1 - 2^-24
    at the other end: -2.8, below which a Gumbel falls with probability 6e-8). jax.random.gumbel's
    default maps 23 bits to u in [tiny, 1) and takes -log(-log(u)), whose steps near 1 thin the
    noise's tail from ~14 and end it at 15.9: a token more than ~20 nats below a row's top was never
    drawn, whatever its share (many such tokens can hold 1e-4 of a distribution). Now a token is
    out of reach only past ~25.7 nats below the top (e^-25.7 = 7e-12 a token), at the cost of the
    same 32 bits (jax's 64-bit mode "high" cost 1.6x this sampler on a CPU)."""
    x = jnp.minimum((jnp.invert(bits).astype(jnp.float32) + 0.5) * 2.0**-32, 1.0 - 2.0**-24)
    return -jnp.log(-jnp.log1p(-x))


def gumbel_noise(keys: jax.Array, V: int) -> jax.Array:  # key[S] -> f32[S, V]
    """Standard Gumbel noise, a row per key, for the Gumbel-max draw (`gumbel_from_bits`)."""
    return gumbel_from_bits(jax.vmap(lambda k: jax.random.bits(k, (V,), jnp.uint32))(keys))


def pick(logits: jax.Array, rows: jax.Array, *, filters: bool, slots: int) -> jax.Array:
    """f32[S, V], i32[S, K] -> tokens i32[slots]: random rows drawn, greedy rows their argmax. Without
    `filters` every row keeps its whole distribution (top-k, top-p and min-p must be off)."""
    S, V = logits.shape
    b = sampling_rows(rows)
    is_random = b.temperature > 0.0
    # banned after scaling: XLA may divide by multiplying with 1/t, 0 in f32 for t >= ~1e38, which
    # made a -inf banned before it NaN (argmax then took a banned id). Greedy rows are scaled by 1.
    scaled = _ban(logits / jnp.where(is_random, b.temperature, 1.0)[:, None], b.banned)
    greedy_ids = jnp.argmax(scaled, axis=-1).astype(jnp.int32)
    if filters:
        scaled = jnp.where(scaled >= _cutoffs(scaled, b), scaled, -jnp.inf)
    drawn = jnp.argmax(scaled + gumbel_noise(_row_keys(b.seeds, b.positions), V), axis=-1).astype(jnp.int32)
    return pad_slots(jnp.where(is_random, drawn, greedy_ids), slots)


# Exact top-k on the GPU (H200, jax 0.11.2, rows of 128,256 f32; docs/benchmarks.md): XLA's TopK
# kernel serves k <= 16 (~270 us at 256 rows for k <= 8, 555 us for 16); above 16 XLA sorts every row
# (2.2 ms at 256 rows, 1.0 ms at 64). A few rows are latency-bound either way (139 us for one row).
_TOP_K_STEP = 8  # "split": top-k as top-8 calls, each after masking what the previous took
_TOP_K_CHUNKS = 128  # "chunked": top-k of each of 128 chunks of a row (short rows sort fast), then of those
_TOP_K_CHUNKED_ROWS = 32  # up to this many rows "chunked" wins (1 row: 68 us, 8 rows: 122 us); above, "split"


def top_k_method(rows: int, width: int, k: int, backend: str) -> str:
    """How `top_k` computes the top k of f32[rows, width]: "plain" (lax.top_k) but on GPUs, where
    the measured fastest of "chunked" and "split" (see above); "plain" where k fits XLA's TopK
    kernel at many rows, or chunks would hold too few entries."""
    if backend != "gpu" or k == 0:
        return "plain"
    if rows <= _TOP_K_CHUNKED_ROWS and width >= 4 * _TOP_K_CHUNKS * k:
        return "chunked"
    return "split" if k > _TOP_K_STEP else "plain"


def top_k(x: jax.Array, k: int, *, method: str = "plain") -> tuple[jax.Array, jax.Array]:
    """lax.top_k(x, k) of finite f32[S, V] rows by `method` (top_k_method): the same values and
    ids in the same order (equal values: the lower id first), however computed. "split" masks
    what it took with -inf, so a row with -inf among its top k could repeat an id there; the
    model's raw logits are finite."""
    if method == "plain":
        return jax.lax.top_k(x, k)
    S, V = x.shape
    if method == "chunked":  # each chunk's top k in id order, then the top k of those: ties stay by id
        c = _TOP_K_CHUNKS
        w = -(-V // c)
        chunks = jnp.pad(x, ((0, 0), (0, c * w - V)), constant_values=-jnp.inf).reshape(S, c, w)
        vals, ids = jax.lax.top_k(chunks, k)
        ids = (ids + (jnp.arange(c, dtype=jnp.int32) * w)[None, :, None]).reshape(S, c * k)
        vals, best = jax.lax.top_k(vals.reshape(S, c * k), k)
        return vals, jnp.take_along_axis(ids, best, axis=1)
    if method != "split":
        raise ValueError(f"top_k method {method!r} must be 'plain', 'chunked' or 'split'")
    rows = jnp.arange(S, dtype=jnp.int32)[:, None]
    vals, ids = [], []
    for start in range(0, k, _TOP_K_STEP):  # each call's entries come after every earlier one's
        v, i = jax.lax.top_k(x, min(_TOP_K_STEP, k - start))
        vals.append(v)
        ids.append(i)
        if start + _TOP_K_STEP < k:
            x = x.at[rows, i].set(-jnp.inf)
    return jnp.concatenate(vals, axis=1), jnp.concatenate(ids, axis=1)


def sampled_logprobs(logits: jax.Array, tokens: jax.Array, *, max_logprobs: int) -> Logprobs:
    """Raw logits f32[S, V], tokens i32[slots] (rows past S are padding) -> the tokens' logprobs
    and the top max_logprobs: logits - logsumexp, the top ones found on the logits (the same
    order; no [S, V] log_softmax written)."""
    S, V = logits.shape
    lse = jax.nn.logsumexp(logits, axis=-1)
    sampled = jnp.take_along_axis(logits, tokens[:S, None], axis=-1)[:, 0] - lse
    if max_logprobs == 0:
        return Logprobs(sampled, jnp.zeros((S, 0), jnp.int32), jnp.zeros((S, 0), jnp.float32))
    top, top_ids = top_k(logits, max_logprobs, method=top_k_method(S, V, max_logprobs, jax.default_backend()))
    return Logprobs(sampled, top_ids.astype(jnp.int32), top - lse[:, None])


class SamplerProgram(NamedTuple):
    fn: Callable
    args: tuple[str, ...]  # of "logits" f32[S, V], "rows" i32[S, K], "history" i32[S, C] (a chunk), "start" i32
    #                        (the chunk's first index), "counts" PenaltyCounts, "tokens" i32[slots], "prev"
    #                        i32[slots] (the previous step's tokens), "prev_burst" i32[K, slots] (the previous
    #                        step's when it was a burst)


class _Programs(dict):
    """A dict that a weakref.WeakValueDictionary can hold (a plain dict takes no weak references)."""


# (max_logprobs, slots, vocab_size) -> the programs, while some executor holds them. JAX keeps the
# traces and executables of a function object as long as it lives: a functools.cache here kept every
# sampler executable ever compiled alive for the life of the process (~600 memory maps per config).
_SAMPLER_PROGRAMS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def sampler_programs(max_logprobs: int, slots: int, vocab_size: int) -> dict[str, SamplerProgram]:
    """The sampler programs by name; their tokens are i32[slots] (`pad_slots`). Shared while the
    returned dict is alive (StepExecutor keeps it): JAX caches traces and executables per function
    object, so engines alive together compile each shape once between them, and the programs go
    with the last of them."""
    key = (max_logprobs, slots, vocab_size)
    programs = _SAMPLER_PROGRAMS.get(key)
    if programs is None:
        programs = _SAMPLER_PROGRAMS[key] = _Programs(_build_sampler_programs(max_logprobs, slots, vocab_size))
    return programs


def _build_sampler_programs(max_logprobs: int, slots: int, vocab_size: int) -> dict[str, SamplerProgram]:
    return {
        "count": SamplerProgram(functools.partial(count, vocab_size=vocab_size),
                                ("rows", "history", "prev", "prev_burst")),
        "count_more": SamplerProgram(functools.partial(count_more, vocab_size=vocab_size),
                                     ("counts", "history", "start", "rows", "prev", "prev_burst")),
        "penalize": SamplerProgram(functools.partial(penalize, slots=slots), ("logits", "rows", "counts")),
        "pick": SamplerProgram(functools.partial(pick, filters=False, slots=slots), ("logits", "rows")),
        "pick_filtered": SamplerProgram(functools.partial(pick, filters=True, slots=slots), ("logits", "rows")),
        "logprobs": SamplerProgram(functools.partial(sampled_logprobs, max_logprobs=max_logprobs),
                                   ("logits", "tokens")),
    }


def run_sampler(call: Callable, logits, greedy_tokens, rows, history, prev, prev_burst, needs: SamplingNeeds, *,
                history_chunk: int):
    """The sampler programs one step needs, in order: `call(name, *args)` runs program `name`.
    logits: the model's raw f32[S, V]; greedy_tokens: i32[slots], `greedy` of them; history:
    i32[S, n * history_chunk] (None unless needs.penalties); prev i32[slots] and prev_burst
    i32[K, slots]: the previous step's tokens (what history placeholders stand for;
    `resolve_history`). -> (tokens i32[slots], Logprobs or None when no row asked)."""
    x, tokens = logits, greedy_tokens
    if needs.penalties:
        counts = count_penalties(call, rows, history, prev, prev_burst, chunk=history_chunk)
        x, tokens = call("penalize", logits, rows, counts)
    if needs.random:
        tokens = call("pick_filtered" if needs.filters else "pick", x, rows)
    return tokens, call("logprobs", logits, tokens) if needs.logprobs else None
