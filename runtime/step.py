"""StepPlan -> fixed-shape arrays -> one jitted `step(params, kv_pages, batch)`.

The packer lays a plan out as the ragged paged attention kernel reads it (models/attention.py):
a flat buffer of T tokens (T a token bucket), sequences in plan order (decodes first), then S
slots of metadata (S a seq bucket). Entries past the plan are padding: tokens 0 at position 0,
kv_len 0, page 0, cu_q_lens repeating the end offset, neutral sampling rows. The attention
reference and the KV writer ignore everything at or past cu_q_lens[num_seqs], so padding is never
computed into real outputs; the tokens sampled for padding rows are ignored by the engine.

Logits are computed only for the last token of each sequence (`logits_indices`), one row per
slot, so the LM head and the sampler run on [S, V] rather than [T, V].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import jax
import numpy as np

from models.attention import AttentionMetadata
from runtime.request import SamplingParams
from runtime.sampling import Logprobs, SamplingBatch, empty_sampling_batch, sample, split_seed
from runtime.scheduler import StepPlan


class StepBatch(NamedTuple):
    tokens: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    attn: AttentionMetadata  # kv_lens i32[S], page_indices i32[S, P_max], cu_q_lens i32[S+1], num_seqs i32[1]
    logits_indices: jax.Array  # i32[S]: the token whose logits slot s samples from
    sampling: SamplingBatch  # S rows


def make_step_fn(forward: Callable, *, max_logprobs: int) -> Callable:
    """step(params, kv_pages, batch) -> (tokens i32[S], Logprobs, kv_pages). Jit it with kv_pages
    (argument 1) donated; see runtime/compilation.py.

    One function object per (forward, max_logprobs), kept on the forward function itself: JAX
    caches traces, lowerings and executables per function object, so engines over the same loaded
    model (several configs in one process, tests) compile each bucket shape once between them.
    """
    try:
        cache = forward.__dict__.setdefault("_xlaserve_step_fns", {})
    except AttributeError:  # a callable without attributes: no sharing
        return _build_step_fn(forward, max_logprobs)
    if max_logprobs not in cache:
        cache[max_logprobs] = _build_step_fn(forward, max_logprobs)
    return cache[max_logprobs]


def _build_step_fn(forward: Callable, max_logprobs: int) -> Callable:
    def step(params, kv_pages, batch: StepBatch):
        logits, kv_pages = forward(params, batch.tokens, batch.positions, kv_pages, batch.attn, batch.logits_indices)
        out = sample(logits, batch.sampling, max_logprobs=max_logprobs)
        return out.tokens, out.logprobs, kv_pages

    return step


@dataclass
class SeqSampling:
    """What the packer needs of one sampling sequence beyond the plan. The engine keeps one per
    scheduler request and appends generated tokens to the penalty history."""

    params: SamplingParams
    seed: tuple[int, int]  # split_seed(seed)
    num_prompt: int
    stop_ids: np.ndarray  # i32[k]: ids banned while below min_tokens (EOS unless ignore_eos, stop ids)
    history: np.ndarray | None = None  # i32[W]: prompt + output ids, kept only when penalties are on
    history_len: int = 0
    num_output: int = 0

    @classmethod
    def create(cls, params: SamplingParams, seed: int, prompt: Sequence[int], eos_ids: Sequence[int], history_len: int):
        banned = list(dict.fromkeys([*([] if params.ignore_eos else eos_ids), *params.stop_token_ids]))
        s = cls(params, split_seed(seed), len(prompt), np.asarray(banned, np.int32))
        if params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
            s.history = np.full(history_len, -1, np.int32)
            s.history[: len(prompt)] = prompt
            s.history_len = len(prompt)
        return s

    def append(self, token: int) -> None:
        self.num_output += 1
        if self.history is not None and self.history_len < len(self.history):
            self.history[self.history_len] = token
            self.history_len += 1

    @property
    def wants_logprobs(self) -> bool:
        return self.params.logprobs is not None


class BatchPacker:
    """Packs plans into numpy StepBatches for the bucket table it is given."""

    def __init__(self, *, pages_per_seq: int, history_len: int, max_banned: int, select_bucket: Callable):
        self.pages_per_seq = pages_per_seq  # P_max
        self.history_len = history_len  # W
        self.max_banned = max_banned  # NB
        self.select_bucket = select_bucket  # (num_tokens, num_seqs) -> (T, S)

    def empty(self, T: int, S: int, *, history: bool = True) -> StepBatch:
        """An all-padding batch of bucket (T, S): the abstract shape warmup compiles. With
        history=False the penalty history is None (see `pack`)."""
        sampling = empty_sampling_batch(S, self.history_len if history else 0, self.max_banned)
        return StepBatch(
            tokens=np.zeros(T, np.int32),
            positions=np.zeros(T, np.int32),
            attn=AttentionMetadata(
                kv_lens=np.zeros(S, np.int32),
                page_indices=np.zeros((S, self.pages_per_seq), np.int32),
                cu_q_lens=np.zeros(S + 1, np.int32),
                num_seqs=np.zeros(1, np.int32),
            ),
            logits_indices=np.zeros(S, np.int32),
            sampling=sampling if history else sampling._replace(history=None),
        )

    def pack(self, plan: StepPlan, sampling: Callable[[str], SeqSampling]) -> StepBatch:
        """plan.seqs[i] fills slot i. `sampling(request_id)` gives a sequence's SeqSampling.

        When no row has penalties the [S, W] history (W = max_model_len, the largest input) is
        left None rather than filled and shipped every step; the executor substitutes a
        device-resident all -1 array of the same shape, so the compiled program is the same.
        """
        n_tok = plan.num_prefill_tokens + plan.num_decode_tokens
        n = plan.num_seqs
        T, S = self.select_bucket(n_tok, n)
        seqs = plan.seqs
        samp = [sampling(seq.request_id) if seq.sample else None for seq in seqs]
        histories = [(i, s.history) for i, s in enumerate(samp) if s is not None and s.history is not None]
        b = self.empty(T, S, history=bool(histories))
        m, sb = b.attn, b.sampling
        # Per-sequence values are gathered into lists and written with one numpy assignment each
        # (a Python loop of numpy scalar writes cost ~10 us per sequence at 256 sequences).
        if n:
            cu = np.cumsum([seq.q_len for seq in seqs], dtype=np.int32)
            m.cu_q_lens[1 : n + 1] = cu
            m.cu_q_lens[n + 1 :] = cu[-1]
            b.logits_indices[:n] = cu - 1
            m.kv_lens[:n] = [seq.num_computed_after for seq in seqs]
        off = 0
        for i, seq in enumerate(seqs):
            q = seq.q_len
            if q == 1:
                b.tokens[off] = seq.token_ids[0]
                b.positions[off] = seq.start_pos
            else:
                b.tokens[off : off + q] = seq.token_ids
                b.positions[off : off + q] = np.arange(seq.start_pos, seq.start_pos + q, dtype=np.int32)
            m.page_indices[i, : len(seq.pages)] = seq.pages
            off += q
        rows = [i for i, s in enumerate(samp) if s is not None]
        if rows:
            ps = [samp[i].params for i in rows]
            sb.temperature[rows] = [p.temperature for p in ps]
            sb.top_k[rows] = [p.top_k for p in ps]
            sb.top_p[rows] = [p.top_p for p in ps]
            sb.min_p[rows] = [p.min_p for p in ps]
            sb.repetition_penalty[rows] = [p.repetition_penalty for p in ps]
            sb.presence_penalty[rows] = [p.presence_penalty for p in ps]
            sb.frequency_penalty[rows] = [p.frequency_penalty for p in ps]
            sb.seeds[rows] = [samp[i].seed for i in rows]
            sb.positions[rows] = [seqs[i].num_computed_after for i in rows]  # the index the sampled token will have
            sb.want_logprobs[rows] = [samp[i].wants_logprobs for i in rows]
            for i in rows:
                s = samp[i]
                if s.history is not None:
                    sb.num_prompt[i] = s.num_prompt
                if s.num_output < s.params.min_tokens and len(s.stop_ids):
                    sb.banned[i, : len(s.stop_ids)] = s.stop_ids
        for i, h in histories:
            sb.history[i] = h
        m.num_seqs[0] = n
        return b


def logprob_rows(lp: Logprobs, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The first n rows of a step's logprobs, on the host."""
    return np.asarray(lp.sampled)[:n], np.asarray(lp.top_ids)[:n], np.asarray(lp.top_logprobs)[:n]
