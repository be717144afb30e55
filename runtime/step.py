"""StepPlan -> two flat arrays -> the model program of a bucket (then the sampler programs).

The packer lays a plan out as the ragged paged attention kernel reads it (models/attention.py):
a flat buffer of T tokens (T a token bucket), sequences in plan order (decodes first), then S
slots of metadata (S a seq bucket). Entries past the plan are padding: tokens 0 at position 0,
kv_len 0, page table row 0, cu_q_lens repeating the end offset, neutral sampling rows. The attention
reference and the KV writer ignore everything at or past cu_q_lens[num_seqs], so padding is never
computed into real outputs; the tokens sampled for padding rows are ignored by the engine.

Every host->device copy is a transfer of its own, so a step ships few arrays: all StepBatch
fields end to end in one i32 buffer (`StepLayout`), all sampling fields in one i32[S, K] rows
buffer (runtime/sampling.py; apart from the model buffer because the sampler programs are
compiled per seq bucket, not per (T, S)), and the [S, n * C] penalty history only when some row
has penalties (n chunks of C = HISTORY_CHUNK entries, as many as its longest penalized row needs).
The programs unpack them with static slices. The packer also records which sampler programs the
step needs (`SamplingNeeds`): it knows every row's settings.

The page tables stay on the device: one [slots, P_max] table, a row per scheduler slot, which the
executor updates with only the pages a step adds (StepExecutor.sync_pages); a step ships each
slot's row number and the programs gather the rows. Shipping [S, P_max] every step (8 MB at 256
sequences of max_model_len 131,072) cost a decode step at batch 256 a quarter of its speed on an
H100 (docs/benchmarks.md, twenty-second session).

Logits are computed only for the last token of each sequence (`logits_indices`), one row per
slot, so the LM head and the sampler run on [S, V] rather than [T, V].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.attention import AttentionMetadata
from runtime.request import SamplingParams
from runtime.sampling import (Logprobs, SamplingBatch, SamplingNeeds, advance_rows, apply_penalties, bias_columns,
                              HISTORY_CHUNK, burst_history_placeholder, count_sampled, empty_rows, greedy,
                              history_placeholder, pad_slots, pick, put_banned, put_bias_rows, put_positions,
                              put_request_rows, request_row, sampled_logprobs, sampling_rows, split_seed)
from runtime.plan import StepPlan


_NO_NEEDS = SamplingNeeds()  # what a step without sampling rows needs (frozen: shared)


class StepBatch(NamedTuple):
    """The model's inputs for one bucket (the sampling rows travel separately: runtime/sampling.py)."""

    tokens: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    attn: AttentionMetadata  # kv_lens i32[S], page_indices i32[S, P_max], cu_q_lens i32[S+1], num_seqs i32[1]
    logits_indices: jax.Array  # i32[S]: the token whose logits slot s samples from
    page_rows: jax.Array  # i32[S]: the page table row of each slot (its sequence's scheduler slot)


@dataclass(frozen=True)
class StepLayout:
    """Where each StepBatch field of bucket (T, S) sits in the flat i32 buffer shipped to the device:
    end to end in StepBatch order, except the page indices: each slot ships its row of the page table
    that stays on the device (`page_rows`; StepExecutor keeps the table). Hashable: the model program
    takes it as a static argument."""

    T: int
    S: int
    P: int  # P_max, pages per sequence: the page table's width

    @property
    def size(self) -> int:
        return 2 * self.T + 4 * self.S + 2

    def unflatten(self, flat, page_table=None) -> StepBatch:
        """The fields of flat i32[size]: numpy views of a host buffer, or static slices in a program.
        attn.page_indices are the rows `page_rows` of page_table [rows, P] (None without one)."""
        T, S = self.T, self.S
        out, off = [], 0
        for n in (T, T, S, S, S + 1, 1, S):
            out.append(flat[off : off + n])
            off += n
        tokens, positions, kv_lens, page_rows, cu_q_lens, num_seqs, logits_indices = out
        page_indices = None if page_table is None else page_table[page_rows]
        return StepBatch(tokens, positions, AttentionMetadata(kv_lens, page_indices, cu_q_lens, num_seqs),
                         logits_indices, page_rows)


@dataclass
class PackedBatch:
    """One step on the host, as the executor ships it: two (three with penalties) arrays."""

    layout: StepLayout
    flat: np.ndarray  # i32[layout.size]: the StepBatch
    rows: np.ndarray  # i32[S, K]: sampling rows (runtime/sampling.py)
    history: np.ndarray | None  # i32[S, n * C]: prompt + output ids of rows with penalties, -1 padded
    needs: SamplingNeeds  # which sampler programs the step runs
    steps: int = 1  # K > 1: a burst (StepPlan.num_steps); the arrays describe its first model step
    decode_only: bool = False  # no prefill token: every sequence has one token (bursts always do)
    # The page table rows the step reads, as the executor must hold them before it runs: per live
    # slot i, (its row step.page_rows[i], lease, pages). While a row's lease holds, its pages only
    # grow, so the executor ships the new ones alone (StepExecutor.sync_pages).
    pages: tuple[tuple[int, int, tuple[int, ...]], ...] = ()

    @property
    def step(self) -> StepBatch:  # numpy views into flat (attn.page_indices None: see `pages`)
        return self.layout.unflatten(self.flat)

    @property
    def sampling(self) -> SamplingBatch:  # numpy views into rows
        return sampling_rows(self.rows)


def _cached(forward: Callable, name: str, build: Callable) -> Callable:
    try:
        cache = forward.__dict__
    except AttributeError:  # a callable without attributes: no sharing
        return build(forward)
    if name not in cache:
        cache[name] = build(forward)
    return cache[name]


def make_model_fn(forward: Callable) -> Callable:
    """model(param_leaves, kv_pages, flat, rows, prev, page_table, layout, treedef, decode_only) ->
    (logits f32[S, V], greedy tokens i32[slots], kv_pages): the model program of a bucket, the
    parameters as the list of leaves of `treedef`, the page tables as rows of `page_table`
    i32[rows, P] (StepLayout.unflatten); the greedy tokens make a plain greedy step one dispatch.
    Jit it with kv_pages (argument 1) donated and layout, treedef, decode_only (arguments 6, 7, 8)
    static; see runtime/compilation.py. `prev` i32[slots] is the previous step's tokens: an input
    token -(i + 1) stands for its row i, sampled but not yet seen by the host (lookahead,
    runtime/engine.py). decode_only: the batch's sequences have one token each
    (PackedBatch.decode_only); the forward is told so (on a GPU the KV write then runs inside the
    attention launch, as in the bursts: equal up to rounding).

    One function object per forward, kept on the forward function itself: JAX caches traces,
    lowerings and executables per function object, so engines over the same loaded model (several
    configs in one process, tests) compile each bucket shape once between them. The programs live
    as long as the loaded model: drop it to free them.
    """
    return _cached(forward, "_xlaserve_model_fn", _build_model_fn)


def _input_tokens(b: StepBatch, prev):
    return jnp.where(b.tokens < 0, prev[jnp.maximum(-b.tokens - 1, 0)], b.tokens)


def _build_model_fn(forward: Callable) -> Callable:
    def model(param_leaves, kv_pages, flat, rows, prev, page_table, layout: StepLayout, treedef,
              decode_only: bool = False):
        params = treedef.unflatten(param_leaves)
        b = layout.unflatten(flat, page_table)
        logits, kv_pages = forward(params, _input_tokens(b, prev), b.positions, kv_pages, b.attn, b.logits_indices,
                                   decode_only=decode_only)
        logits = logits.astype(jnp.float32)
        return logits, pad_slots(greedy(logits, sampling_rows(rows).banned), prev.shape[0]), kv_pages

    return model


BURST_SAMPLERS = ("greedy", "pick", "pick_filtered")
# A burst sampler of its own: greedy rows with nothing banned, no penalties and no logprobs need only
# each row's argmax, which the model's greedy head gives without writing the logits (a Hopper kernel
# where dispatch.greedy_head_is_fused; the executor compiles it only for those seq buckets).
GREEDY_HEAD = "greedy_head"


def make_burst_fn(forward: Callable) -> Callable:
    """burst(param_leaves, kv_pages, flat, rows, prev, counts, page_table, layout, treedef, steps, sampler,
    penalties, max_logprobs, unroll=False) -> (tokens i32[steps, slots], last i32[slots], kv_pages, logprobs):
    a burst of `steps` decode steps in one program (StepPlan.num_steps), for a forward of logits
    f32[S, V]. The packed batch is its first model step, one token per sequence; model step j
    feeds each sequence the token it sampled at step j - 1, at position + j with kv_len + j (its
    pages cover the whole burst; both stop at the end of the page table), and samples with the
    rows of step j (`advance_rows`: positions + j, min_tokens bans lifted where met), so each
    token is what a single step at that position would give: the same model program body (called
    with decode_only=True: on a GPU the KV write then runs inside the attention launch, which sums
    the token's own key in another order, equal up to rounding) and, per
    `sampler` (one of BURST_SAMPLERS), the same tokens as `greedy` or the pick program; GREEDY_HEAD
    takes the forward's own argmax (forward(..., greedy=True)), for rows with nothing banned. With
    `penalties`, `counts` are the penalize program's input for the first step (the count programs'
    output, runtime/sampling.py); they are carried through the burst, each step's tokens added, and
    every step penalizes as that program does. Without, None. With `max_logprobs` (an int, not
    None), `logprobs` is the logprobs program's output for every step (runtime/sampling.Logprobs
    with a leading [steps] axis: of the raw logits, for the tokens the step sampled); else None.
    `last` is the final model step's tokens, the next step's `prev`. A fori_loop of static trip
    count: XLA runs it without reading anything back to the host (runtime/sampling.py); with
    `unroll` the model steps are straight-line code instead (EngineConfig.unroll_burst_max_seqs:
    no loop kernels between them, work that depends only on the step index hoisted out of them,
    a longer compile). Jit it with kv_pages donated and layout, treedef, steps, sampler,
    penalties, max_logprobs, unroll static; one function object per forward, as make_model_fn."""
    return _cached(forward, "_xlaserve_burst_fn", _build_burst_fn)


def _build_burst_fn(forward: Callable) -> Callable:
    def burst(param_leaves, kv_pages, flat, rows, prev, counts, page_table, layout: StepLayout, treedef, steps: int,
              sampler: str, penalties: bool, max_logprobs: int | None, unroll: bool = False):
        params = treedef.unflatten(param_leaves)
        b = layout.unflatten(flat, page_table)
        slots, m = prev.shape[0], min(layout.T, layout.S)  # decode i's token sits at i: i < num_seqs <= m
        live = b.attn.kv_lens > 0
        # A sequence whose burst runs past max_tokens (tokens the host drops) stops at the end of its
        # page table, rewriting its K/V there: past every position a live sequence computes
        # (max_model_len <= the table), so nothing else is ever read from it.
        last_pos = layout.P * kv_pages[0].shape[1] - 1

        def model_step(j, kv_pages, tokens, counts, lps):
            """Model step j: its tokens i32[slots], the pages, the penalty counts and logprobs so far."""
            attn = b.attn._replace(kv_lens=jnp.where(live, jnp.minimum(b.attn.kv_lens + j, last_pos + 1), 0))
            positions = jnp.minimum(b.positions + j, last_pos)
            if sampler == GREEDY_HEAD:
                t, kv_pages = forward(params, tokens, positions, kv_pages, attn, b.logits_indices, greedy=True,
                                      decode_only=True)
                return pad_slots(t, slots), kv_pages, counts, lps
            logits, kv_pages = forward(params, tokens, positions, kv_pages, attn, b.logits_indices,
                                       decode_only=True)
            raw = logits = logits.astype(jnp.float32)
            rows_j = advance_rows(rows, j)
            b_j = sampling_rows(rows_j)
            if penalties:
                logits = apply_penalties(logits, b_j, counts)
            if sampler == "greedy":
                t = pad_slots(greedy(logits, b_j.banned), slots)
            else:
                t = pick(logits, rows_j, filters=sampler == "pick_filtered", slots=slots)
            if penalties:
                counts = count_sampled(counts, t)
            if max_logprobs is not None:
                lps = jax.tree.map(lambda acc, x: acc.at[j].set(x), lps,
                                   sampled_logprobs(raw, t, max_logprobs=max_logprobs))
            return t, kv_pages, counts, lps

        def step(j, carry):
            kv_pages, tokens, out, _, counts, lps = carry
            t, kv_pages, counts, lps = model_step(j, kv_pages, tokens, counts, lps)
            return kv_pages, tokens.at[:m].set(t[:m]), out.at[j].set(t), t, counts, lps

        lps = None
        if max_logprobs is not None:
            S = layout.S
            lps = Logprobs(jnp.zeros((steps, S), jnp.float32), jnp.zeros((steps, S, max_logprobs), jnp.int32),
                           jnp.zeros((steps, S, max_logprobs), jnp.float32))
        init = (kv_pages, _input_tokens(b, prev), jnp.zeros((steps, slots), jnp.int32), prev, counts, lps)
        kv_pages, _, out, last, _, lps = jax.lax.fori_loop(0, steps, step, init, unroll=unroll)
        return out, last, kv_pages, lps

    return burst


@dataclass
class SeqSampling:
    """What the packer needs of one sampling sequence beyond the plan. The engine keeps one per
    scheduler request and appends generated tokens to the penalty history."""

    params: SamplingParams
    stop_ids: np.ndarray  # i32[k]: ids banned while below min_tokens (EOS unless ignore_eos, stop ids)
    # stop_ids are banned from a sampled token whose index in the sequence is below this: the
    # prompt length + min_tokens (0 when there is nothing to ban). The index of the token a step
    # samples is its num_computed_after, known from the plan even before the previous step's
    # tokens reach the host (lookahead), and the same after a recompute (preemption).
    ban_before: int
    row: bytes  # its sampling row's constant columns (runtime/sampling.py, request_row)
    history: np.ndarray | None = None  # i32[<= W]: prompt + output ids, kept only when penalties are on
    history_len: int = 0
    bias: np.ndarray | None = None  # its logit-bias columns (runtime/sampling.py, bias_columns); None: no bias

    @classmethod
    def create(cls, params: SamplingParams, seed: int, prompt: Sequence[int], eos_ids: Sequence[int], history_len: int):
        banned = list(dict.fromkeys([*([] if params.ignore_eos else eos_ids), *params.stop_token_ids]))
        penalties = (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
                     or params.frequency_penalty != 0.0 or bool(params.logit_bias))  # the penalize program's work
        ban_before = len(prompt) + params.min_tokens if banned else 0
        s = cls(params, np.asarray(banned, np.int32), ban_before,
                request_row(params, split_seed(seed), len(prompt) if penalties else 0, ban_before),
                bias=bias_columns(params.logit_bias))
        if penalties:  # room for every token the request can have (a queue of them costs no more)
            cap = history_len if params.max_tokens is None else min(history_len, len(prompt) + params.max_tokens)
            s.history = np.full(cap, -1, np.int32)
            s.history[: len(prompt)] = prompt
            s.history_len = len(prompt)
        return s

    def append(self, token: int) -> None:
        """A sampled token, once the host has it."""
        if self.history is not None and self.history_len < len(self.history):
            self.history[self.history_len] = token
            self.history_len += 1


class BatchPacker:
    """Packs plans into PackedBatches for the bucket table it is given."""

    def __init__(self, *, pages_per_seq: int, history_len: int, max_banned: int, select_bucket: Callable,
                 slots: int):
        self.pages_per_seq = pages_per_seq  # P_max
        self.history_len = history_len  # W: entries a request's history keeps (max_model_len)
        self.history_chunk = min(HISTORY_CHUNK, history_len)  # C: the count programs' width
        self.max_banned = max_banned  # NB
        self.select_bucket = select_bucket  # (num_tokens, num_seqs) -> (T, S)
        self.slots = slots  # rows of every program's tokens (the largest seq bucket)
        self._counts = np.arange(slots + 1, dtype=np.int32)  # cu_q_lens of a decode-only step: 0, 1, ..., n

    def empty(self, T: int, S: int, *, history: int = 1) -> PackedBatch:
        """An all-padding batch of bucket (T, S): the abstract shapes warmup compiles, with a
        penalty history of `history` chunks (0: None, see `pack`)."""
        layout = StepLayout(T, S, self.pages_per_seq)
        return PackedBatch(
            layout=layout,
            flat=np.zeros(layout.size, np.int32),
            rows=empty_rows(S, self.max_banned),
            history=np.full((S, history * self.history_chunk), -1, np.int32) if history else None,
            needs=_NO_NEEDS,
        )

    def pack(self, plan: StepPlan, sampling: Callable[[str], SeqSampling]) -> PackedBatch:
        """plan.seqs[i] fills slot i. `sampling(request_id)` gives a sequence's SeqSampling.

        The penalty history holds as many chunks of C entries as the longest penalized row needs,
        and is left None when no row has penalties: only the count programs read it, and they do
        not run then.
        """
        K = plan.num_steps  # a burst's arrays are its first model step: kv_len and sampled index K - 1 back
        n_tok = plan.num_prefill_tokens + plan.num_decode_tokens // K
        n = plan.num_seqs
        T, S = self.select_bucket(n_tok, n)
        seqs = plan.seqs
        samp = [sampling(seq.request_id) if seq.sample else None for seq in seqs]
        # a burst's first model step: kv_len and the sampled token's index K - 1 before its end
        after = [seq.num_computed_after - (K - 1) for seq in seqs]
        histories = [(i, s.history) for i, s in enumerate(samp) if s is not None and s.history is not None]
        # each history holds the tokens before the sampled one: entries up to `stop` (placeholders
        # past what the host has), and the shipped width covers the longest in whole chunks
        stops = [min(after[i], len(h)) for i, h in histories]
        need = max((max(samp[i].history_len, stop) for (i, _), stop in zip(histories, stops)), default=0)
        out = self.empty(T, S, history=max(1, -(-need // self.history_chunk)) if histories else 0)
        out.steps = K
        out.decode_only = plan.num_prefill_tokens == 0
        b = out.step
        m = b.attn
        # Decodes come first in a plan, one token each: their tokens and positions are two list writes.
        d = plan.num_decode_tokens // K
        # Per-sequence values are gathered into lists and written with one numpy assignment each
        # (a Python loop of numpy scalar writes cost ~10 us per sequence at 256 sequences).
        if n:
            # decodes only (a token each): the token counts' cumulative sums are 1, ..., n
            cu = self._counts[1 : n + 1] if d == n else np.cumsum([seq.q_len for seq in seqs], dtype=np.int32)
            m.cu_q_lens[1 : n + 1] = cu
            m.cu_q_lens[n + 1 :] = cu[-1]
            b.logits_indices[:n] = cu - 1
            m.kv_lens[:n] = after
        if d:
            b.tokens[:d] = [seq.token_ids[0] for seq in seqs[:d]]
            b.positions[:d] = [seq.start_pos for seq in seqs[:d]]
        off = d
        for seq in seqs[d:]:
            q = seq.q_len
            b.tokens[off : off + q] = seq.token_ids
            b.positions[off : off + q] = np.arange(seq.start_pos, seq.start_pos + q, dtype=np.int32)
            off += q
        if n:  # each slot reads its sequence's row of the device's page table (StepExecutor.sync_pages)
            b.page_rows[:n] = [seq.slot for seq in seqs]
            out.pages = tuple((seq.slot, seq.lease, seq.pages) for seq in seqs)
        m.num_seqs[0] = n
        rows = [i for i, s in enumerate(samp) if s is not None]
        if not rows:
            return out
        put_request_rows(out.rows, rows, [samp[i].row for i in rows])
        biased = [i for i in rows if samp[i].bias is not None]
        if biased:
            put_bias_rows(out.rows, biased, [samp[i].bias for i in biased])
        put_positions(out.rows, rows, [after[i] for i in rows])  # the index the sampled token will have
        for i in rows:
            s = samp[i]
            if after[i] < s.ban_before:  # below min_tokens (a burst lifts the ban where met: advance_rows)
                put_banned(out.rows, i, s.stop_ids)
        for (i, h), stop in zip(histories, stops):
            token, end = seqs[i].token_ids[-1], samp[i].history_len
            out.history[i, :end] = h[:end]
            if token < 0 and end < stop:  # the input token is still on the device: the history's last entry too
                missing = after[i] - end  # 1 after a single step; after a burst all K of its tokens
                if missing == 1:
                    out.history[i, end] = history_placeholder(token)
                else:
                    out.history[i, end:stop] = [burst_history_placeholder(token, j, self.slots)
                                                for j in range(stop - end)]
        out.needs = SamplingNeeds.of(out.rows, logprobs=any(samp[i].params.logprobs is not None for i in rows))
        return out
