"""What the scheduler hands the rest of the engine each step: the StepPlan of its sequences
(ScheduledSeq, laid out as the step packer reads them) and, once the step's tokens are known, one
SeqUpdate per sampled token. Plain records, no JAX: runtime/scheduler.py makes them,
runtime/step.py packs plans and runtime/engine.py reads both."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class ScheduledSeq(NamedTuple):
    """One sequence of a step, in the order the step packer lays them out (decodes first). A
    NamedTuple rather than a frozen dataclass: the scheduler makes one per sequence per step, and a
    frozen dataclass took twice as long to build (2.4 vs 1.1 us; 256 of them every step)."""

    request_id: str
    slot: int  # stable while the request runs; per-slot device state (penalties, RNG) can key on it
    token_ids: tuple[int, ...]  # tokens fed this step: 1 for a decode, a chunk for a prefill
    start_pos: int  # position of token_ids[0] == tokens computed before this step
    num_computed_after: int  # kv_len: tokens with K/V in pages once this step has run
    pages: tuple[int, ...]  # every page of the sequence, in order; covers num_computed_after
    sample: bool  # sample from the last token's logits (False for a chunk short of the prompt end)
    is_prefill: bool
    lease: int  # Request.lease: while it holds, `pages` only grows (appended to)

    @property
    def q_len(self) -> int:
        return len(self.token_ids)

    @property
    def kv_len(self) -> int:
        return self.num_computed_after


@dataclass(frozen=True)
class StepPlan:
    step_id: int
    seqs: tuple[ScheduledSeq, ...]
    num_prefill_tokens: int
    num_decode_tokens: int
    preempted_ids: tuple[str, ...]  # lost their pages (and slot) this step; they will recompute
    finished_ids: tuple[str, ...]  # finished or aborted since the previous plan; their slots are free
    # K > 1: a burst. Every sequence is a decode that samples K tokens, each fed to the next of K
    # model steps run in one device program; seqs describe the first of them (token_ids, start_pos)
    # and the whole burst (num_computed_after = start_pos + K; pages cover it up to the end of the
    # page table, where the burst program holds the positions of tokens past max_tokens).
    num_steps: int = 1

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class SeqUpdate(NamedTuple):
    """What update_from_output did to one sampling sequence (a NamedTuple, as ScheduledSeq)."""

    request_id: str
    token_id: int
    finish_reason: str | None  # None while the request goes on
    stop_reason: int | str | None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
