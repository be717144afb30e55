"""The scheduler: which sequences run this step, with which tokens and pages. Pure Python, no JAX.

Each step() returns a StepPlan; the engine packs it into fixed-shape arrays, runs the step, and
hands the sampled tokens back through update_from_output(plan, tokens) before the next step().
Every plan with sequences must be run: pages it names may be shared (by fork) or reused on the
strength of it. Not thread-safe: call everything (abort included) from the engine's loop.

Policy (per step, within max_num_seqs slots and a max_num_batched_tokens budget):
  1. running decodes, one token each, in priority order;
  2. running prefills that are partway through their prompt, a chunk each (chunked prefill);
  3. waiting requests in (priority, arrival) order: prefix-cache hits first shorten the prompt, then
     a chunk fills the remaining budget. Admission stops at the first request whose remaining
     pages would not fit above the watermark (strict ordering, no overtaking), and altogether in a
     step that had to preempt.
A running sequence that needs a page when none is available preempts the running sequence that
would be admitted last (highest (priority, arrival)), possibly itself: the victim's pages are
released and it waits again at its place in the queue, with its generated tokens appended to
what must be recomputed, so its output does not change (recompute preemption, vLLM's default).

A waiting request whose next prompt page is being computed right now by another running request
(same tokens, same salt) is deferred until that page is registered, so that a burst of prompts
sharing a prefix computes the prefix once instead of once per request admitted in the same step.
It keeps its place: the requests behind it are admitted only into what leaves it a slot and its
pages. A waiting fork (n > 1) holding the last reference to pages is preempted before running
requests when it would be admitted after the request that needs a page.

Lookahead (the engine planning step k+1 while the device still runs step k):
update_from_output(plan, None) accounts step k's K/V and gives each sampling sequence a
placeholder token -(row + 1), so step() can plan k+1 at once; a decode fed a placeholder reads the
token from step k's output on the device. resolve(tokens) then writes the real tokens and applies
the stops that depend on them (EOS, stop ids); a stop by length needs only the count and applies
at once. A request preempted while its last token is a placeholder waits for the resolve before it
is admitted again (its page hashes need the token). update_from_output(plan, tokens) is both at once.

Bursts (SchedulerConfig.decode_steps = K > 1): when nothing waits and every running request is a
plain decode (see _burst_length), the plan is a burst: each sequence samples K tokens in one device
program, the model step run K times with each token fed to the next (runtime/step.py), so the
host's per-step work (this plan, packing, the launch) is paid once per K tokens. Applying it
appends K placeholders per sequence (fewer where max_tokens comes first); resolve takes
[K][num_seqs] tokens and drops a sequence's tokens after its stop (the burst computed them anyway:
waste, never output).
Pages filled during a burst are offered to the prefix cache at resolve, when their tokens are known.

n > 1: the engine adds one request, and once step() has returned the plan that completes its
prompt (or any time later while it is live) calls fork(parent_id, child_ids): each child shares
the parent's full prompt pages by reference and recomputes only the partial last page, under its
own SamplingParams (seeds are the engine's business).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Iterable, Sequence

from runtime.page_allocator import PageAllocator
from runtime.plan import ScheduledSeq, SeqUpdate, StepPlan
from runtime.prefix_cache import PrefixCache
from runtime.request import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    Request,
    RequestStatus,
    SamplingParams,
    request_label,
    validate_cache_salt,
    validate_prompt,
)


def _int_list(tokens) -> list[int]:
    """Token ids as a list of Python ints: numpy's tolist (C speed) for an array, else int() each."""
    tolist = getattr(tokens, "tolist", None)
    return tolist() if tolist is not None else [int(t) for t in tokens]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class SchedulerConfig:
    num_pages: int  # P: pages in the device pool
    max_model_len: int  # prompt + generated tokens of one sequence
    page_size: int = 16  # G: tokens per page
    max_num_seqs: int = 64  # S: slots
    max_num_batched_tokens: int = 2048  # token budget of one step
    watermark: float = 0.01  # fraction of the pool kept free when admitting (room for decodes)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    decode_steps: int = 1  # K: tokens per sequence a decode-only step may sample (burst); 1 = off

    def __post_init__(self) -> None:
        for name in ("num_pages", "max_model_len", "page_size", "max_num_seqs", "max_num_batched_tokens",
                     "decode_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Otherwise running decodes could starve one another of the step's token budget.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) so that every prompt fits one step"
            )

    @cached_property
    def watermark_pages(self) -> int:
        return int(self.watermark * self.num_pages)

    @cached_property
    def max_pages_per_seq(self) -> int:
        """P_max: width of the page table the step packer needs."""
        return _cdiv(self.max_model_len, self.page_size)

    @cached_property
    def max_positions(self) -> int:
        """Positions a sequence's page table holds (>= max_model_len); a burst's positions stop at its end."""
        return self.max_pages_per_seq * self.page_size


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of pages referenced by live sequences
    num_free_pages: int
    num_cached_pages: int  # unreferenced pages kept for the prefix cache (evictable)
    prefill_tokens: int  # prompt (and recomputed) tokens scheduled for computation, cumulative
    decode_tokens: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int
    num_steps: int
    num_bursts: int  # steps that were bursts (decode_steps > 1)

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_query_tokens
        return self.prefix_cache_hit_tokens / q if q else 0.0


@dataclass
class _StepBuilder:
    budget: int
    entries: dict[str, tuple[Request, int, int, bool]] = field(default_factory=dict)  # id -> (req, start, n, prefill)
    preempted: list[str] = field(default_factory=list)

    def add(self, req: Request, n: int, prefill: bool) -> None:
        self.entries[req.request_id] = (req, req.num_computed_tokens, n, prefill)
        self.budget -= n

    def remove(self, req: Request) -> None:
        entry = self.entries.pop(req.request_id, None)
        if entry is not None:
            self.budget += entry[2]


class Scheduler:
    def __init__(self, config: SchedulerConfig, *, prefix_cache_key: bytes | None = None) -> None:
        self.config = config
        self._leases = itertools.count(1)  # Request.lease of each admission
        self._next_arrival = 0
        self._num_forks = 0
        self._num_steps = 0
        self._prefill_tokens = 0
        self._decode_tokens = 0
        self._num_preemptions = 0
        self._num_bursts = 0
        self._new_state(prefix_cache_key)

    def _new_state(self, prefix_cache_key: bytes | None) -> None:
        """No request, every page free, an empty prefix cache (the counters above are kept)."""
        config = self.config
        self.allocator = PageAllocator(config.num_pages)
        self.prefix_cache = (
            PrefixCache(self.allocator, config.page_size, key=prefix_cache_key) if config.enable_prefix_caching else None
        )
        self._requests: dict[str, Request] = {}  # live: waiting or running
        self._waiting: list[Request] = []  # sorted by order_key
        self._running: list[Request] = []
        self._free_slots = list(range(config.max_num_seqs))
        self._inflight: Counter[bytes] = Counter()  # page hash -> running prefills computing it
        self._outstanding: StepPlan | None = None
        self._outstanding_reqs: list[Request] = []  # aligned with _outstanding.seqs
        # a step applied without its tokens: its K, and per sampling sequence (row in its plan,
        # request, index of its first placeholder in token_ids, finished by length at once); see the
        # module docstring
        self._unresolved: tuple[int, list[tuple[int, Request, int, bool]]] | None = None
        self._finished_since_plan: list[str] = []

    def reset(self) -> list[str]:
        """Drop every live request and forget every page's contents, whatever step is planned or
        outstanding: after a step failed, the KV pool may hold partial writes or be gone. Returns
        the ids dropped. The statistics and the prefix cache's key and counts carry on."""
        dropped = list(self._requests)
        old = self.prefix_cache
        self._new_state(old.key if old is not None else None)
        if old is not None:
            self.prefix_cache.record(old.num_query_tokens, old.num_hit_tokens)
        return dropped

    # -- requests in ----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        eos_token_ids: Iterable[int] = (),
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> Request:
        """Queue a request, or raise ValueError at once if it can never run."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already live")
        params = sampling_params or SamplingParams()
        prompt = validate_prompt(prompt_token_ids)
        req = Request(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling_params=params,
            max_tokens=self._resolve_max_tokens(request_id, len(prompt), params),
            eos_token_ids=frozenset(int(t) for t in eos_token_ids),
            priority=int(priority),
            cache_salt=validate_cache_salt(cache_salt),
            arrival=self._next_arrival,
        )
        self._next_arrival += 1
        self._requests[request_id] = req
        self._insert_sorted(self._waiting, req)
        return req

    def check_request(self, request_id: str, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The max_tokens a request would get, or ValueError when it could never run. Reads only
        the config, so callers may validate from another thread before queueing."""
        return self._resolve_max_tokens(request_id, num_prompt_tokens, params)

    def _resolve_max_tokens(self, request_id: str, n_prompt: int, params: SamplingParams) -> int:
        L, G, P = self.config.max_model_len, self.config.page_size, self.config.num_pages
        who = request_label(request_id)
        if params.max_tokens is None:
            if n_prompt >= L:
                raise ValueError(
                    f"{who}prompt has {n_prompt} tokens; max_model_len is {L} "
                    f"(room is needed for at least one generated token)"
                )
            max_tokens = L - n_prompt
            if params.min_tokens > max_tokens:  # (with max_tokens set, SamplingParams checks it)
                raise ValueError(
                    f"{who}min_tokens {params.min_tokens} is more than the {max_tokens} tokens "
                    f"it can generate (max_model_len {L} - prompt {n_prompt})"
                )
        else:
            max_tokens = params.max_tokens
            if n_prompt + max_tokens > L:
                raise ValueError(
                    f"{who}prompt has {n_prompt} tokens + max_tokens {max_tokens} = "
                    f"{n_prompt + max_tokens} tokens; max_model_len is {L}"
                )
        # The last sampled token is never fed back, so its K/V is never stored.
        pages = _cdiv(n_prompt + max_tokens - 1, G)
        if pages > P:
            raise ValueError(
                f"{who}prompt has {n_prompt} tokens + max_tokens {max_tokens} needs {pages} "
                f"KV pages of {G} tokens; the pool has {P} pages"
            )
        return max_tokens

    def fork(
        self,
        parent_id: str,
        child_ids: Sequence[str],
        sampling_params: Sequence[SamplingParams] | None = None,
    ) -> list[Request]:
        """Add children that continue `parent_id`'s prompt (not its outputs) as separate requests.

        Each child references the parent's full prompt pages that are computed (or are being
        computed by the outstanding plan) and recomputes the rest of the prompt, at least its last
        token, whose logits it samples with its own params (default: the parent's, with n=1).
        """
        parent = self._requests.get(parent_id)
        if parent is None:
            raise KeyError(f"request {parent_id!r} is not live; fork it before it finishes")
        if sampling_params is not None and len(sampling_params) != len(child_ids):
            raise ValueError(f"{len(child_ids)} child ids but {len(sampling_params)} sampling params")
        computed = parent.num_computed_tokens
        if self._outstanding is not None:
            for seq in self._outstanding.seqs:
                if seq.request_id == parent_id:
                    computed = seq.num_computed_after
        G = self.config.page_size
        k = min((parent.num_prompt_tokens - 1) // G, computed // G, len(parent.pages))
        children = []
        for i, cid in enumerate(child_ids):
            if cid in self._requests or any(c.request_id == cid for c in children):
                raise ValueError(f"request id {cid!r} is already live")
            params = sampling_params[i] if sampling_params is not None else replace(parent.sampling_params, n=1)
            children.append(
                Request(
                    request_id=cid,
                    prompt_token_ids=list(parent.prompt_token_ids),
                    sampling_params=params,
                    max_tokens=self._resolve_max_tokens(cid, parent.num_prompt_tokens, params),
                    eos_token_ids=parent.eos_token_ids,
                    priority=parent.priority,
                    cache_salt=parent.cache_salt,
                    arrival=parent.arrival,
                    parent_id=parent_id,
                )
            )
        for child in children:
            self._num_forks += 1  # orders children after their parent, before later arrivals
            child.fork_index = self._num_forks
            child.pages = parent.pages[:k]
            self.allocator.incref(child.pages)
            child.num_computed_tokens = k * G
            child.page_hashes = parent.page_hashes[:k]
            # The parent offers the pages it has registered; the child offers the rest itself (the
            # parent may be aborted before its outstanding step registers them; a page offered
            # twice is cached once).
            child.num_registered_pages = min(k, parent.num_registered_pages)
            self._requests[child.request_id] = child
            self._insert_sorted(self._waiting, child)
        return children

    # -- requests out ---------------------------------------------------------------------------
    def abort(self, request_id: str) -> bool:
        """Cancel now: the request's pages are released before this returns. False if not live."""
        return self.finish(request_id, FINISH_ABORT)

    def finish(self, request_id: str, reason: str = FINISH_STOP, stop_reason: int | str | None = None) -> bool:
        """End a live request (the detokenizer calls this for stop strings). False if not live."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        if reason not in (FINISH_STOP, FINISH_LENGTH, FINISH_ABORT):
            raise ValueError(f"finish reason must be one of stop, length, abort; got {reason!r}")
        while req.token_ids[-1] < 0:  # the tokens of an unresolved step (K of a burst): never delivered, dropped
            req.token_ids.pop()
        self._finish(req, reason, stop_reason)
        return True

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_waiting_tokens(self) -> int:
        """Tokens the waiting requests have yet to compute, before prefix-cache hits."""
        return sum(r.num_tokens - r.num_computed_tokens for r in self._waiting)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def awaiting_tokens(self) -> bool:
        """A step was applied without its tokens and awaits resolve(tokens)."""
        return self._unresolved is not None

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> StepPlan:
        if self._outstanding is not None:
            raise RuntimeError(
                f"step {self._outstanding.step_id} is outstanding: call update_from_output(plan, tokens) first"
            )
        ctx = _StepBuilder(budget=self.config.max_num_batched_tokens)
        G = self.config.page_size
        K = self._burst_length()
        capacity = self.config.max_positions  # a burst's positions stop at the page table's end

        # The host plans every running sequence every step (256 and more): the loops below read
        # fields rather than properties and build tuples positionally (docs/design.md, "The host's
        # side of a step").
        entries, running = ctx.entries, RequestStatus.RUNNING
        prefilling = []  # running requests partway through their prompt, in running order
        for req in list(self._running):  # 1. decodes
            if req.status is not running:
                continue
            start = req.num_computed_tokens
            if start < req.prefill_target:
                prefilling.append(req)
                continue
            if ctx.budget < 1:
                break  # (so would loop 2 at its first request: nothing gives budget back in between)
            # (the first test is _ensure_pages' own, without its call: 15 of 16 decode steps need no page)
            end = min(start + K, capacity)
            if end <= len(req.pages) * G or self._ensure_pages(req, end, ctx):
                ctx.add(req, 1, False)

        for req in prefilling:  # 2. prefills partway through their prompt
            if req.status is not running or req.request_id in entries:
                continue  # (preempted by a decode's pages)
            if ctx.budget < 1:
                break
            n = self._fit_chunk(req, min(req.prefill_target - req.num_computed_tokens, ctx.budget), ctx)
            if n:
                ctx.add(req, n, True)

        self._admit(ctx)  # 3. waiting requests

        seqs = []
        n_prefill = n_decode = 0
        for req, start, n, prefill in entries.values():
            end = start + n + K - 1  # (K > 1: decodes only, n == 1)
            tokens = req.token_ids
            # ScheduledSeq(request_id, slot, token_ids, start_pos, num_computed_after, pages, sample,
            # is_prefill, lease)
            seqs.append(ScheduledSeq(req.request_id, req.slot, tuple(tokens[start:end]), start, end, tuple(req.pages),
                                     start + n == len(tokens), prefill, req.lease))
            if prefill:
                n_prefill += n
            else:
                n_decode += n + K - 1
        plan = StepPlan(
            step_id=self._num_steps,
            seqs=tuple(seqs),
            num_prefill_tokens=n_prefill,
            num_decode_tokens=n_decode,
            preempted_ids=tuple(ctx.preempted),
            finished_ids=tuple(self._finished_since_plan),
            num_steps=K,
        )
        self._finished_since_plan = []
        self._num_steps += 1
        self._prefill_tokens += n_prefill
        self._decode_tokens += n_decode
        if seqs:
            self._num_bursts += K > 1
            self._outstanding = plan
            self._outstanding_reqs = [e[0] for e in ctx.entries.values()]
        return plan

    def update_from_output(self, plan: StepPlan, sampled_token_ids: Sequence | None) -> list[SeqUpdate]:
        """Apply a finished step: sampled_token_ids[i] is what plan.seqs[i] sampled (ignored where
        seqs[i].sample is False); for a burst (plan.num_steps K > 1) it is [K][num_seqs], the
        tokens of each of the K model steps. Returns one SeqUpdate per sampled token of a live
        request, in order.

        With None, the step is applied without its tokens (lookahead, see the module docstring):
        placeholders stand in for them until resolve(tokens); returns []."""
        if plan is not self._outstanding:
            raise ValueError(f"plan {plan.step_id} is not the outstanding plan")
        K = plan.num_steps
        if sampled_token_ids is not None:
            got = (len(sampled_token_ids),) if K == 1 else (len(sampled_token_ids), len(sampled_token_ids[0]))
            want = (len(plan.seqs),) if K == 1 else (K, len(plan.seqs))
            if got != want:
                raise ValueError(f"sampled tokens of shape {got} for {want[-1]} scheduled sequences over {K} steps")
        if self._unresolved is not None:
            raise RuntimeError("the previous step's tokens are unresolved: call resolve(tokens) first")
        reqs, self._outstanding, self._outstanding_reqs = self._outstanding_reqs, None, []
        pending = []
        G, caching, running = self.config.page_size, self.prefix_cache is not None, RequestStatus.RUNNING
        register = caching and K == 1  # (a burst's pages hold K/V of tokens still unknown here: see resolve)
        for row, (seq, req) in enumerate(zip(plan.seqs, reqs)):
            if req.status is not running:
                continue  # finished or aborted after the plan was made (its id may be reused)
            after = req.num_computed_tokens = seq.num_computed_after
            if register and after // G > req.num_registered_pages:  # a page filled up
                self._register_pages(req)
            if not seq.sample:
                continue
            # (a burst may run past max_tokens: the tokens beyond it are never taken)
            tokens = req.token_ids
            room = req.max_tokens - (len(tokens) - len(req.prompt_token_ids))
            k = min(K, room)
            tokens.extend([-(row + 1)] * k)
            by_length = k == room
            if by_length:
                self._finish(req, FINISH_LENGTH, None)
            pending.append((row, req, len(tokens) - k, by_length))
        self._unresolved = (K, pending)
        return [] if sampled_token_ids is None else self.resolve(sampled_token_ids)

    def resolve(self, sampled_token_ids: Sequence) -> list[SeqUpdate]:
        """The tokens of the step applied by update_from_output(plan, None), indexed like its plan's
        seqs ([K][num_seqs] for a burst). Returns one SeqUpdate per sampled token of a request
        still live (or just finished by length) when the step was applied and not finished or
        aborted since; a burst's tokens after a stop are dropped."""
        if self._unresolved is None:
            raise RuntimeError("no step awaits its tokens")
        (K, pending), self._unresolved = self._unresolved, None
        # one list per model step (indexing a numpy array per row cost more)
        sampled = [_int_list(step) for step in (sampled_token_ids if K > 1 else (sampled_token_ids,))]
        updates = []
        G, register = self.config.page_size, K > 1 and self.prefix_cache is not None
        finished, running = RequestStatus.FINISHED, RequestStatus.RUNNING
        for row, req, index, by_length in pending:
            if req.status is finished and not by_length:
                continue  # aborted or stopped (stop string) since: its tokens are dropped
            tokens = req.token_ids
            n0 = index - len(req.prompt_token_ids)  # output tokens before this step
            for j in range(len(tokens) - index):  # its placeholders: K, or fewer up to max_tokens
                token = sampled[j][row]
                tokens[index + j] = token
                done = req.check_stop_token(token, n0 + j + 1)  # with by_length, stop or length (EOS first)
                if done is None:
                    updates.append(SeqUpdate(req.request_id, token, None, None))
                    continue
                del tokens[index + j + 1 :]  # a burst ran on past the stop: dropped
                if by_length:
                    req.finish_reason, req.stop_reason = done
                else:
                    self._finish(req, *done)
                updates.append(SeqUpdate(req.request_id, token, req.finish_reason, req.stop_reason))
                break
            # a burst's filled pages, now that their tokens are known (single steps: at update)
            if register and req.status is running and req.num_computed_tokens // G > req.num_registered_pages:
                self._register_pages(req)
        return updates

    def _burst_length(self) -> int:
        """K when the next step can be a burst (SchedulerConfig.decode_steps), else 1: nothing waits
        (a burst would delay its admission by K steps), every running request decodes, and the pages
        for K more positions are free without preempting anyone. A request with fewer than K tokens left under
        max_tokens runs the whole burst; its tokens past max_tokens are dropped. Their K/V goes to
        pages it holds until it finishes, at positions that stop at the end of its page table (the
        burst program clamps them there: runtime/step.py), past any position it ever computes."""
        K = self.config.decode_steps
        if K == 1 or self._waiting or not self._running:
            return 1
        G, need, capacity = self.config.page_size, 0, self.config.max_positions
        for req in self._running:
            if req.is_prefill:
                return 1
            need += _cdiv(min(req.num_computed_tokens + K, capacity), G) - len(req.pages)
        return K if need <= self.allocator.num_available else 1

    # -- internals ------------------------------------------------------------------------------
    def _ensure_pages(self, req: Request, num_tokens: int, ctx: _StepBuilder) -> bool:
        """Give a running request pages for num_tokens, preempting as needed. False if it was
        preempted itself."""
        need = _cdiv(num_tokens, self.config.page_size) - len(req.pages)
        while need > self.allocator.num_available:
            victim = self._pick_victim(req)
            if victim is req:
                self._preempt(victim, ctx)
                return False
            if victim.status is RequestStatus.WAITING:
                self._drop_pages(victim)
            else:
                self._preempt(victim, ctx)
        if need > 0:
            req.pages.extend(self.allocator.allocate(need))
        return True

    def _fit_chunk(self, req: Request, n: int, ctx: _StepBuilder) -> int:
        """Shrink a running prefill's chunk to the pages available (preempting only when not even
        one token fits), allocate them, and return the chunk length (0 if req was preempted)."""
        G = self.config.page_size
        room = len(req.pages) * G - req.num_computed_tokens + self.allocator.num_available * G
        if room <= 0:
            if not self._ensure_pages(req, req.num_computed_tokens + 1, ctx):
                return 0
            room = len(req.pages) * G - req.num_computed_tokens + self.allocator.num_available * G
        n = min(n, room)
        self._ensure_pages(req, req.num_computed_tokens + n, ctx)
        return n

    def _pick_victim(self, req: Request) -> Request:
        # Waiting forks have computed nothing of their own: cheapest first, but only those whose drop
        # frees a page (the last reference: pages shared with a running parent free nothing) and
        # that would be admitted after req (a better one keeps its pages; req preempts itself).
        refcount = self.allocator.refcount
        holders = [r for r in self._waiting if r.pages and r.order_key > req.order_key
                   and any(refcount(p) == 1 for p in r.pages)]
        return max(holders or self._running, key=lambda r: r.order_key)

    def _admit(self, ctx: _StepBuilder) -> None:
        if ctx.preempted or not self._waiting:
            return
        cfg, G = self.config, self.config.page_size
        outstanding = sum(_cdiv(r.prefill_target, G) - len(r.pages) for r in self._running if r.is_prefill)
        deferred = 0  # slots kept for deferred requests (their pages are counted in `outstanding`)
        for req in list(self._waiting):
            if (ctx.budget < 1 or len(self._running) + deferred >= cfg.max_num_seqs
                    or req.token_ids[-1] < 0):
                break  # (a placeholder: preempted before its last step was resolved; hashes need it)
            hits: list[int] = []
            fork = bool(req.pages)
            if fork:  # it shares its parent's pages
                start = req.num_computed_tokens
            elif self.prefix_cache is not None:
                self._ensure_hashes(req, req.num_tokens // G)
                hits = self.prefix_cache.match(req.page_hashes, req.num_tokens)
                k = len(hits)
                if k < (req.num_tokens - 1) // G and self._inflight[req.page_hashes[k]] > 0:
                    # its next page is being computed now: wait for it, then share it; its slot and
                    # pages stay its own, so that nobody behind it takes them meanwhile
                    deferred += 1
                    outstanding += _cdiv(req.num_tokens, G) - k
                    continue
                start = k * G
            else:
                start = 0
            remaining = req.num_tokens - start
            n = min(remaining, ctx.budget)
            if n < remaining and not cfg.enable_chunked_prefill:
                break
            held = len(req.pages) + len(hits)
            need_total = _cdiv(req.num_tokens, G) - held
            need_now = _cdiv(start + n, G) - held
            revived = sum(1 for p in hits if self.allocator.refcount(p) == 0)
            available = self.allocator.num_available - revived
            if self._running:
                if available - need_total - outstanding < cfg.watermark_pages:
                    break
            elif available < need_total:
                # Nothing runs, so only waiting forks can hold pages: release them so the head runs.
                for other in reversed(self._waiting):
                    if other is not req and other.pages:
                        self._drop_pages(other)
                available = self.allocator.num_available - revived
                if available < need_total:
                    break
            if self.prefix_cache is not None and not req.pages:
                hits = self.prefix_cache.lookup(req.page_hashes, req.num_tokens, count=False)  # (counted below)
                self.allocator.incref(hits)
                req.pages = list(hits)
                req.num_computed_tokens = start
            req.pages.extend(self.allocator.allocate(need_now))
            if not fork:  # (a fork offers the pages its parent has not: see fork)
                req.num_registered_pages = held
            req.prefill_target = req.num_tokens
            if not req.admitted_once:
                req.admitted_once = True
                req.num_cached_tokens = start
                # Each prompt counts once: not again after a preemption, nor for its forks (n > 1),
                # which share its pages; so the hits are the responses' cached_tokens.
                if self.prefix_cache is not None and req.parent_id is None:
                    self.prefix_cache.record(req.num_tokens, start)
            self._waiting.remove(req)
            req.status = RequestStatus.RUNNING
            req.slot = heapq.heappop(self._free_slots)
            req.lease = next(self._leases)
            self._insert_sorted(self._running, req)
            if self.prefix_cache is not None:
                self._ensure_hashes(req, req.num_tokens // G)
                req.inflight = (held, req.num_tokens // G)
                self._inflight.update(req.page_hashes[held : req.num_tokens // G])
            outstanding += need_total - need_now
            ctx.add(req, n, req.is_prefill)

    def _ensure_hashes(self, req: Request, num_pages: int) -> None:
        if len(req.page_hashes) < num_pages:
            self.prefix_cache.extend_hashes(req.page_hashes, req.token_ids, req.cache_salt, num_pages)

    def _register_pages(self, req: Request) -> None:
        if self.prefix_cache is None:
            return
        full = req.num_computed_tokens // self.config.page_size
        if full <= req.num_registered_pages:
            return
        self._ensure_hashes(req, full)
        lo = req.num_registered_pages
        self.prefix_cache.insert(req.page_hashes[lo:full], req.pages[lo:full])
        req.num_registered_pages = full
        start, end = req.inflight
        done = min(max(start, full), end)
        self._inflight_remove(req.page_hashes[start:done])
        req.inflight = (done, end)

    def _release_inflight(self, req: Request) -> None:
        start, end = req.inflight
        self._inflight_remove(req.page_hashes[start:end])
        req.inflight = (0, 0)

    def _inflight_remove(self, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            c = self._inflight[h] - 1
            if c:
                self._inflight[h] = c
            else:
                del self._inflight[h]

    def _drop_pages(self, req: Request) -> None:
        """Release a request's pages (last first, so the LRU evicts tails before shared heads)."""
        self.allocator.decref(reversed(req.pages))
        req.pages = []
        req.num_computed_tokens = 0
        req.num_registered_pages = 0
        self._release_inflight(req)

    def _preempt(self, req: Request, ctx: _StepBuilder) -> None:
        ctx.remove(req)
        self._drop_pages(req)
        self._running.remove(req)
        heapq.heappush(self._free_slots, req.slot)
        req.slot = None
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self._num_preemptions += 1
        ctx.preempted.append(req.request_id)
        self._insert_sorted(self._waiting, req)

    def _finish(self, req: Request, reason: str, stop_reason: int | str | None) -> None:
        self._drop_pages(req)
        if req.status is RequestStatus.RUNNING:
            self._running.remove(req)
            heapq.heappush(self._free_slots, req.slot)
            req.slot = None
        else:
            self._waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        del self._requests[req.request_id]
        self._finished_since_plan.append(req.request_id)

    @staticmethod
    def _insert_sorted(queue: list[Request], req: Request) -> None:
        """Keep a queue (waiting or running) in order_key order: both are planned in that order, and
        inserting keeps them sorted, so no step sorts them."""
        queue.insert(bisect.bisect_right(queue, req.order_key, key=lambda r: r.order_key), req)

    # -- stats and checks -----------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        pc = self.prefix_cache
        return SchedulerStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            kv_usage=self.allocator.usage,
            num_free_pages=self.allocator.num_free,
            num_cached_pages=self.allocator.num_cached,
            prefill_tokens=self._prefill_tokens,
            decode_tokens=self._decode_tokens,
            prefix_cache_query_tokens=pc.num_query_tokens if pc else 0,
            prefix_cache_hit_tokens=pc.num_hit_tokens if pc else 0,
            num_preemptions=self._num_preemptions,
            num_bursts=self._num_bursts,
            num_steps=self._num_steps,
        )

    def check_invariants(self) -> None:
        """Raise AssertionError when pages, slots or queues are inconsistent."""
        cfg, G = self.config, self.config.page_size
        self.allocator.check_invariants()
        if self.prefix_cache is not None:
            self.prefix_cache.check_invariants()
        live = self._waiting + self._running
        assert len(live) == len(self._requests) == len({id(r) for r in live}), "queues and live map disagree"
        assert all(self._requests[r.request_id] is r for r in live)
        assert all(r.status is RequestStatus.WAITING for r in self._waiting)
        assert all(r.status is RequestStatus.RUNNING for r in self._running)
        assert [r.order_key for r in self._waiting] == sorted(r.order_key for r in self._waiting), "waiting unsorted"
        assert [r.order_key for r in self._running] == sorted(r.order_key for r in self._running), "running unsorted"
        assert len(self._running) <= cfg.max_num_seqs
        slots = [r.slot for r in self._running]
        assert len(set(slots)) == len(slots) and set(slots).isdisjoint(self._free_slots)
        assert len(slots) + len(self._free_slots) == cfg.max_num_seqs, "slots leaked"
        held = Counter(p for r in live for p in r.pages)
        for p in range(cfg.num_pages):
            assert self.allocator.refcount(p) == held[p], (
                f"page {p}: refcount {self.allocator.refcount(p)} but held by {held[p]} live requests"
            )
        for r in live:
            assert all(p is not None for p in r.pages)
            assert len(r.pages) <= cfg.max_pages_per_seq, f"{r.request_id} has {len(r.pages)} pages"
            assert len(set(r.pages)) == len(r.pages), f"{r.request_id} holds a page twice"
            if self._outstanding is None:
                assert len(r.pages) == _cdiv(r.num_computed_tokens, G), (
                    f"{r.request_id}: {len(r.pages)} pages for {r.num_computed_tokens} computed tokens"
                )
            assert r.num_computed_tokens < r.num_tokens, f"{r.request_id} computed all its tokens"
            assert r.num_output_tokens < r.max_tokens, f"{r.request_id} is live with {r.num_output_tokens} tokens"
        inflight = Counter()
        for r in self._running:
            if self._outstanding is None and self._unresolved is None and not r.is_prefill:
                assert r.num_tokens - r.num_computed_tokens == 1, f"{r.request_id} decodes with {r!r}"
            inflight.update(r.page_hashes[r.inflight[0] : r.inflight[1]])
        assert self._inflight == inflight, "in-flight page hashes drifted"
