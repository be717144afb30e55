"""The engine: ties the scheduler, the compiled step and the output streams together.

One `step()` call (H = host, D = device), with step k in flight on the device:

    H  plan step k+1 (scheduler.step), fork n > 1 requests whose prompt completes in it, pack the
       plan into numpy arrays, dispatch its programs                -> D runs step k+1 after k
    H  while D runs: wait for step k's tokens, scheduler.resolve (stops by EOS and stop ids),
       append them to the penalty histories; apply step k+1 to the scheduler without its tokens
       (update_from_output(plan, None): placeholders, stops by length); emit the outputs of step
       k (incremental detokenization, stop-string matching, RequestOutput objects) and return
       them; the caller's own work (the async engine pushing outputs into asyncio queues and
       taking in new requests and cancellations, LLM.generate's progress bar) also runs then.

Lookahead: step k+1 is planned and dispatched before the host has step k's tokens, so the
device always has the next step queued and the host's work (including the launch of the step's
programs) hides behind the device. A decode whose input is step k's token carries a placeholder
that the model program replaces with row i of step k's token output, on the device
(runtime/step.py). The scheduler plans from token counts, which it knows; a request that turns
out to have stopped at step k (EOS, stop id) wastes its row of step k+1, which resolve discards.
Penalties count a row's previous tokens, the last of which is on the device only: the packer
puts a placeholder for it in the row's history, which the count program reads from step k's
tokens as the model program does for the input token (runtime/sampling.py, history_placeholder).

That holds only because the step programs never make the host wait for the device: no
`lax.cond` on device values (XLA's GPU runtime copies a cond's predicate to the host and waits for
it), no data-dependent loops. Which sampling work runs is chosen on the host, by the packer, as
a choice of programs (runtime/sampling.py): a greedy step is one dispatch, the model program.

Bursts (EngineConfig.decode_steps = K > 1): a plan of K decode steps (runtime/scheduler.py) is
one dispatch of a burst program that returns i32[K, slots] tokens and its last step's i32[slots]
as the next step's `prev`; the host resolves all K at once, so its work above is paid once per K
tokens. Penalties run inside a burst too (the counts of the rows' tokens stay on the device); the
step after a burst gets its i32[K, slots] tokens as well, for the K placeholders in each penalized
row's history (runtime/sampling.py, burst_history_placeholder). So do logprobs: the burst returns
them for all K steps ([K, S] and [K, S, max_logprobs]).

A stop string is matched late (after steps k+1 and k+2 were dispatched): the request then wastes
up to two tokens, which the scheduler discards (it skips requests that finished after the plan
was made). Requests finished by EOS or stop ids finish at resolve time, by length at once. Cancelling
(`abort`) releases the request's pages at once, even while a step that uses them is in flight:
the next step that could reuse them runs after it on the device (kv_pages is threaded through).

Garbage collection: CPython's full (generation 2) collection walks every tracked object, and a
warmed-up process holds 300-400k of them (JAX, the model, the compiled programs): 130-270 ms on
the CPU here, 200-260 ms on the H200 host, where one full collection landed in every fourth
offline run of bench_throughput (1.51-1.57 s against 1.27-1.34 s; docs/benchmarks.md). The loops
that drive the engine (LLM.generate, the async engine's thread) run inside `frozen_heap()`,
which moves the objects alive at entry out of the collector's reach (gc.freeze) and gives them
back at exit, so a collection inside the loop walks only the objects the loop made. A finished
request leaves no cyclic garbage (its group drops its sequences once its last output is out):
its objects go by reference counting and do not bring the next collection forward.

Failures: an exception that ends a step call is one of two kinds. An interrupt (KeyboardInterrupt,
or any BaseException that is not an Exception) that lands where a step spends its waits, while
packing and dispatching the next step or while waiting for the previous one's tokens, leaves the
step where it was, planned or dispatched or in flight, and the next call carries it on
(`_planned`, `_unapplied`, `_settle`). Anything else is re-raised after every live request is
dropped and the scheduler starts afresh with an empty prefix cache (the failed step may have
written part of the KV pool, or consumed it: a new pool is allocated then), and the engine takes
new requests at once: an Exception (a program that fails to compile or run, a device error, a
bug), where carrying on would re-run the same plan and fail the same way for good, and an
interrupt inside the host's bookkeeping (the scheduler, resolving tokens, building outputs), which
it may have left half done. CompileAfterWarmupError (strict_compile) comes after a step that ran:
its outputs come out of the next call.

Requests: one user request with n samples is n scheduler requests with internal ids (so user ids
cannot collide with them); the first is added at once, the other n-1 are forked from it when a
plan completes its prompt, sharing its prompt pages. Sample i uses sampling.sample_seed(seed, i).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import threading
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Callable, Sequence

import jax
import numpy as np

from pallas_kernels import dispatch
from runtime.checkpoint import LoadedModel
from runtime.compilation import BucketTable, CompileAfterWarmupError, CompileWatcher, StepExecutor
from runtime.config import EngineConfig
from runtime.kv_cache import init_kv_pages, kv_pages_shape
from runtime.llm import CompletionOutput, RequestOutput
from runtime.plan import StepPlan
from runtime.request import (FINISH_ABORT, FINISH_STOP, OUTPUT_DELTA, OUTPUT_FINAL_ONLY, Request, SamplingParams,
                             check_priority, new_request_id, request_label, validate_prompt)
from runtime.sampling import sample_seed
from runtime.scheduler import Scheduler, SchedulerConfig
from runtime.step import BatchPacker, SeqSampling, make_burst_fn, make_model_fn
from sharding.mesh import mesh_axis_size
from sharding.rules import kv_cache_sharding

logger = logging.getLogger(__name__)

_DTYPES = {"float32": np.float32, "bfloat16": jax.numpy.bfloat16}  # what the engine runs (EngineConfig.dtype, kv_dtype)


def _decode_programs(model: LoadedModel) -> bool:
    """Whether the executor compiles decode-only model programs: where the model's decode-only
    forward differs (dispatch.decode_attention_is_fused: on a GPU each layer's KV write runs inside
    its attention launch), single steps without a prefill token run it, as the bursts do."""
    return dispatch.decode_attention_is_fused(model.attn_impl)


def _greedy_head_seqs(model: LoadedModel, seq_buckets) -> frozenset[int]:
    """The seq buckets whose bursts' greedy head is a kernel (pallas_kernels/greedy_head, one row per
    sequence; the executor compiles GREEDY_HEAD bursts for them): on one Hopper GPU, up to
    dispatch.GREEDY_HEAD_GEMV_MAX_ROWS and from dispatch.GREEDY_HEAD_MIN_ROWS; none elsewhere."""
    cfg = model.config
    V, D = cfg.vocab_size, cfg.hidden_size
    tied = cfg.tie_word_embeddings
    head = jax.ShapeDtypeStruct((V, D) if tied else (D, V), model.dtype)
    return frozenset(S for S in seq_buckets if dispatch.greedy_head_is_fused(
        jax.ShapeDtypeStruct((S, D), model.dtype), head, transposed=tied, implementation=model.gemm_impl))


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_total_pages: int
    num_free_pages: int
    num_cached_pages: int  # unreferenced pages kept by the prefix cache
    kv_usage: float
    num_requests: int  # submitted (user requests)
    num_finished: int  # user requests finished, aborted ones included
    num_aborted: int
    prompt_tokens: int  # prompt tokens of submitted sequences (each of n samples counts)
    prefill_tokens: int  # prompt tokens actually computed (recomputation after preemption included)
    prefix_cache_hit_tokens: int
    prefix_cache_query_tokens: int
    decode_tokens: int
    generated_tokens: int
    num_preemptions: int
    num_steps: int  # steps dispatched to the device
    num_bursts: int  # of them, bursts of decode_steps model steps (EngineConfig.decode_steps)
    num_warmup_compiles: int
    num_compiles_after_warmup: int  # step programs missing from warmup plus any other compile while serving
    warmup_seconds: float

    @property
    def prefill_saved_fraction(self) -> float:
        """Share of submitted prompt tokens that were not computed (prefix cache, forks)."""
        return 1.0 - self.prefill_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(eq=False)
class _Seq:
    """One sampled sequence: a scheduler request of a user request."""

    sid: str  # scheduler request id
    group: _Group
    index: int
    sampling: SeqSampling
    detok: object | None  # IncrementalDetokenizer
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    emitted_chars: int = 0
    emitted_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class _Group:
    """One user request."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    seqs: list[_Seq] = field(default_factory=list)
    to_fork: int = 0  # samples still to fork from seqs[0]
    finished: bool = False
    first: Request | None = None  # the scheduler's state of seqs[0] (kept after it finishes)

    @cached_property
    def held_chars(self) -> int:
        """Characters of a running sequence's text held back (read for every output of every step:
        computed once): they may still begin a stop string, which the text must not show."""
        if self.params.include_stop_str_in_output:
            return 0  # (a match keeps the stop string, so nothing shown is ever taken back)
        return max(max((len(s) for s in self.params.stop), default=0) - 1, 0)

    @cached_property
    def output_prompt_ids(self) -> list[int]:
        """The prompt in every output of the request: one copy, made once (a copy per output cost
        the host O(prompt length) per request per step; vLLM shares it the same way)."""
        return list(self.prompt_ids)


class Engine:
    """Synchronous engine on one replica of the mesh (runtime/replicas.py runs several); drive it
    with add_request / abort / step from one thread."""

    num_replicas = 1

    def __init__(
        self,
        model: LoadedModel,
        config: EngineConfig | None = None,
        *,
        tokenizer=None,
        eos_token_ids: Sequence[int] | None = None,  # default: the tokenizer's (e.g. a generation config's list)
    ) -> None:
        config = config or EngineConfig()
        replicas = mesh_axis_size(model.mesh, "replica")
        if replicas > 1:
            raise ValueError(f"an Engine runs on one replica; this model's mesh has {replicas} "
                             "(runtime.replicas.make_engine builds one engine per replica)")
        if np.dtype(model.dtype) not in map(np.dtype, _DTYPES.values()):
            raise ValueError(f"the engine runs float32 and bfloat16 models; this one is {np.dtype(model.dtype).name} "
                             "(load it with dtype 'auto' or 'bfloat16')")
        cfg = model.config
        if config.max_logprobs > cfg.vocab_size:  # (the step's top-k of the logits would fail inside a step)
            raise ValueError(f"max_logprobs {config.max_logprobs} exceeds the model's vocabulary of {cfg.vocab_size} "
                             "ids")
        max_len = config.max_model_len or cfg.max_position_embeddings
        config = config.resolve(
            max_position_embeddings=cfg.max_position_embeddings,
            num_pages=None if config.num_pages else _estimate_num_pages(model, config, max_len),
        )
        self.config = config
        self.model = model
        # (a tokenizer with fewer tokens than the model's rows decodes the extra ids to nothing)
        self.tokenizer = tokenizer.for_model(cfg.vocab_size, model.source) if tokenizer is not None else None
        if eos_token_ids is None:
            eos_token_ids = tokenizer.eos_ids if tokenizer is not None else ()
        self.eos_ids: tuple[int, ...] = tuple(int(t) for t in eos_token_ids)
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_pages=config.num_pages,
                max_model_len=config.max_model_len,
                page_size=config.page_size,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                watermark=config.watermark,
                enable_prefix_caching=config.enable_prefix_caching,
                enable_chunked_prefill=config.enable_chunked_prefill,
                decode_steps=config.decode_steps,
            )
        )
        self.kv_pages = self._new_kv_pages()
        self.buckets = BucketTable(config.token_bucket_table, config.seq_bucket_table)
        self.packer = BatchPacker(
            pages_per_seq=config.max_pages_per_seq,
            history_len=config.max_model_len,
            max_banned=config.max_stop_token_ids,
            select_bucket=self.buckets.select,
            slots=self.buckets.seq_buckets[-1],
        )
        self.executor = StepExecutor(
            make_model_fn(model.forward), params=model.params, kv_pages=self.kv_pages, mesh=model.mesh,
            table=self.buckets, empty_batch=self.packer.empty, vocab_size=cfg.vocab_size,
            max_logprobs=config.max_logprobs, strict=config.strict_compile,
            burst_fn=make_burst_fn(model.forward) if config.decode_steps > 1 else None,
            decode_steps=config.decode_steps, gpu_cublas_min_tokens=config.gpu_cublas_min_tokens,
            greedy_head_seqs=_greedy_head_seqs(model, self.buckets.seq_buckets),
            decode_programs=_decode_programs(model), unroll_burst_max_seqs=config.unroll_burst_max_seqs,
        )
        self._watcher = CompileWatcher()
        self._watcher.open()
        self._compiles_seen = 0
        self._rng = np.random.default_rng(config.seed)
        self._groups: dict[str, _Group] = {}  # live user requests
        self._seqs: dict[str, _Seq] = {}  # live scheduler requests
        self._sid_counter = itertools.count()
        self._unforked = 0  # live groups with samples still to fork (_Group.to_fork > 0)
        # plan, tokens, last tokens (the next step's prev), logprobs or None: futures (executor)
        self._inflight: tuple[StepPlan, object, object, object] | None = None
        # A step between the scheduler and the device when an interrupt (Ctrl-C while waiting for
        # the device) ended the call: planned and not dispatched, or dispatched and not applied to
        # the scheduler. The next step() carries it on, so the engine stays usable (`_settle`).
        self._planned: tuple[StepPlan, dict] | None = None  # (the plan, its sequences' SeqSampling)
        self._unapplied: tuple[StepPlan, object, object, object] | None = None
        self._pending: list[tuple] = []  # (seq, token, logprob row, finish reason, stop reason)
        self._ready: list[_Group] = []  # groups with an output to emit that no token update carries
        self._resumable = False  # whether an interrupt now leaves a step the next call can carry on
        self._undelivered: list[RequestOutput] = []  # a step's outputs CompileAfterWarmupError held back
        self._dropped: list[str] = []  # the ids of the requests the last failed step dropped (take_dropped)
        self._counts = dict(requests=0, finished=0, aborted=0, prompt_tokens=0, generated=0, steps=0)
        if config.warmup:
            self.warmup()

    # -- lifecycle ------------------------------------------------------------------------------
    def warmup(self) -> None:
        """Compile the step programs of every bucket (progress bar), and run each once where
        EngineConfig.warmup_runs says so; compiles after this are counted."""
        runs = self.config.warmup_runs if self.config.warmup_runs is not None else self.executor.on_gpu
        kv_pages = self.executor.warmup(progress=self.config.progress, kv_pages=self.kv_pages if runs else None)
        if runs:
            self.kv_pages = kv_pages
        self._compiles_seen = self._watcher.count

    def close(self) -> None:
        self._watcher.close()

    def _new_kv_pages(self):
        model, config = self.model, self.config
        return init_kv_pages(model.config, config.num_pages, config.page_size, _kv_dtype(model, config),
                             kv_repeat=model.kv_repeat, sharding=kv_cache_sharding(model.config, model.mesh))

    # -- requests in ----------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        prompt_text: str | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises ValueError at once when it can never run.
        `prompt_text` is the text of a prompt given as ids (reported back in the outputs)."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else new_request_id("req-", self._sid_counter, self._groups)
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already live")
        check_priority(priority)
        text, prompt_ids = self.prepare_prompt(prompt)
        self.validate(prompt_ids, params, request_id=request_id)
        return self.enqueue_checked(prompt_ids, params, request_id=request_id, priority=priority,
                                    cache_salt=cache_salt, prompt_text=text if text is not None else prompt_text)

    def enqueue_checked(self, prompt_ids: list[int], params: SamplingParams, *, request_id: str | None = None,
                        priority: int = 0, cache_salt: str | None = None, prompt_text: str | None = None) -> str:
        """add_request for a prompt the caller already ran through prepare_prompt and validate
        (LLM.generate checks every prompt before queueing any): queues it without checking again."""
        request_id = request_id if request_id is not None else new_request_id("req-", self._sid_counter, self._groups)
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**63))
        group = _Group(request_id, prompt_text, prompt_ids, params, seed, to_fork=params.n - 1)
        seq = self._new_seq(group, 0)
        group.first = self.scheduler.add_request(seq.sid, prompt_ids, replace(params, n=1), eos_token_ids=self.eos_ids,
                                                 priority=priority, cache_salt=cache_salt)
        self._groups[request_id] = group
        self._seqs[seq.sid] = seq
        if group.to_fork:
            self._unforked += 1
        self._counts["requests"] += 1
        self._counts["prompt_tokens"] += len(prompt_ids) * params.n
        return request_id

    def prepare_prompt(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt given as text (needs a tokenizer) or as ids."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; this engine has none (pass token ids)")
            return prompt, self.tokenizer.encode(prompt)
        return None, validate_prompt(prompt)

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams, *, request_id: str = "") -> None:
        """Raise ValueError when a request can never run. Reads only configuration: safe to call
        from any thread."""
        cfg = self.config
        V = self.model.config.vocab_size
        who = request_label(request_id)
        if prompt_ids and max(prompt_ids) >= V:
            bad = next(t for t in prompt_ids if t >= V)
            raise ValueError(f"{who}prompt token id {bad} is out of range; the vocabulary has {V} ids")
        if params.logprobs is not None and params.logprobs > cfg.max_logprobs:
            raise ValueError(f"{who}logprobs {params.logprobs} exceeds max_logprobs {cfg.max_logprobs}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"{who}stop strings need a tokenizer; this engine has none")
        for what, ids in (("stop token id", params.stop_token_ids), ("logit_bias token id", params.logit_bias or ())):
            bad = next((t for t in ids if t >= V), None)
            if bad is not None:
                raise ValueError(f"{who}{what} {bad} is out of range; the vocabulary has {V} ids")
        if params.min_tokens > 0:
            banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_ids))
            if len(banned) > cfg.max_stop_token_ids:
                raise ValueError(
                    f"{who}min_tokens needs {len(banned)} EOS and stop token ids banned; max_stop_token_ids is "
                    f"{cfg.max_stop_token_ids}"
                )
        # The scheduler's own limits (max_model_len, pool size); raises with both numbers.
        self.scheduler.check_request(request_id, len(prompt_ids), params)

    def _new_seq(self, group: _Group, index: int) -> _Seq:
        sid = f"s{next(self._sid_counter)}"
        tok = self.tokenizer
        seq = _Seq(
            sid=sid,
            group=group,
            index=index,
            sampling=SeqSampling.create(replace(group.params, n=1), sample_seed(group.seed, index), group.prompt_ids,
                                        self.eos_ids, self.config.max_model_len),
            detok=(tok.incremental_detokenizer(group.prompt_ids, skip_special_tokens=group.params.skip_special_tokens)
                   if tok is not None else None),
        )
        if group.params.logprobs is not None:
            seq.logprobs, seq.cumulative_logprob = [], 0.0
        group.seqs.append(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        """Cancel a request now: its pages are released before this returns. False if not live."""
        group = self._groups.get(request_id)
        if group is None or group.finished:
            return False
        if group.to_fork:  # its samples end too, empty: a request of n gets n outputs however it ends
            group.to_fork = 0
            self._unforked -= 1
            for index in range(len(group.seqs), group.params.n):
                self._new_seq(group, index)
        for seq in group.seqs:
            if not seq.finished:
                self.scheduler.abort(seq.sid)  # (False for the samples never forked: the scheduler has none)
                self._finish_seq(seq, FINISH_ABORT, None)
        self._counts["aborted"] += 1
        self._ready.append(group)
        return True

    def waiting(self) -> tuple[int, int]:
        """(requests, prompt tokens) queued and not yet admitted."""
        return self.scheduler.num_waiting, self.scheduler.num_waiting_tokens

    def cached_prefix_tokens(self, prompt_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Prompt tokens the prefix cache holds now (0 with prefix caching off). Counts nothing."""
        pc = self.scheduler.prefix_cache
        return 0 if pc is None else pc.cached_prefix_pages(prompt_ids, cache_salt) * self.config.page_size

    def num_live_sequences(self) -> int:
        """The sequences (n a request) of the requests added and not yet finished: the slots they want."""
        return sum(group.params.n for group in self._groups.values())

    def is_live(self, request_id: str) -> bool:
        """Whether `request_id` names a request added and not yet finished (or aborted)."""
        return request_id in self._groups

    # -- the step -------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return (bool(self._groups) or self._inflight is not None or self._unapplied is not None
                or self._planned is not None or bool(self._pending) or bool(self._ready) or bool(self._undelivered))

    def step(self, *, partial: bool = True) -> list[RequestOutput]:
        """Run one engine iteration (see the module docstring); returns the outputs it produced:
        one per request that progressed, shaped by its SamplingParams.output_kind. partial=False
        returns only the requests that finished (offline use)."""
        with self._watcher.watch():
            self._resumable = False
            try:
                outputs = self._step(partial)
            except BaseException as e:
                if isinstance(e, Exception) or not self._resumable or self._pool_consumed():
                    self._drop_all()
                raise
            if self._undelivered:
                outputs, self._undelivered = self._undelivered + outputs, []
            try:
                self._check_compiles()
            except CompileAfterWarmupError:
                self._undelivered = outputs  # (the next call returns them)
                raise
        return outputs

    def _step(self, partial: bool) -> list[RequestOutput]:
        if self._unapplied is not None:  # (an interrupt ended the call that dispatched it)
            self._settle()
        if self._planned is not None:  # planned by a call an interrupt ended before it dispatched
            plan, sampling = self._planned
            self._dispatch(plan, sampling.__getitem__)  # (its requests may have been aborted since)
        else:
            plan = self.scheduler.step()
            if not plan.is_empty:
                try:
                    self._fork(plan)
                    self._dispatch(plan, lambda sid: self._seqs[sid].sampling)
                except BaseException:
                    if self._unapplied is None:  # (not dispatched: the next call does it)
                        seqs = self._seqs
                        self._planned = (plan, {s.request_id: seqs[s.request_id].sampling for s in plan.seqs
                                                if s.request_id in seqs})
                    raise
        self._settle()  # overlaps the step just dispatched
        return self._emit(partial)

    def _drop_all(self) -> None:
        """After a step failed (module docstring, Failures): drop every live request
        and whatever step was planned, dispatched or in flight; a KV pool or page table the failed
        call consumed (donated into a program that then failed) is made anew."""
        self.scheduler.reset()
        self._inflight = self._unapplied = self._planned = None
        self._pending, self._ready = [], []
        self._dropped = list(self._groups)
        self._counts["aborted"] += len(self._groups)
        self._counts["finished"] += len(self._groups)  # (as an abort counts)
        self._groups.clear()
        self._seqs.clear()
        self._unforked = 0
        self.executor.drop_pages()
        if self._pool_consumed():
            seen = self._watcher.count
            self.kv_pages = self._new_kv_pages()
            self._compiles_seen += self._watcher.count - seen  # (allocating is no step program)

    def take_dropped(self) -> list[str]:
        """The ids of the requests the last failed step dropped (module docstring, Failures), once:
        for a caller that streams outputs to tell their owners, which get no output of their end."""
        ids, self._dropped = self._dropped, []
        return ids

    def _pool_consumed(self) -> bool:  # (donated into a program call that did not return it)
        return any(a.is_deleted() for a in jax.tree.leaves(self.kv_pages))

    def _dispatch(self, plan: StepPlan, sampling: Callable) -> None:
        """Pack `plan` (sampling(request_id): a sequence's SeqSampling) and run it on the device."""
        self._resumable = True  # (an interrupt until it is dispatched: `_planned` carries it on, then `_unapplied`)
        batch = self.packer.pack(plan, sampling)
        prev, prev_burst = None, None
        if self._inflight is not None:
            prev_plan, prev_tokens, prev = self._inflight[:3]
            prev_burst = prev_tokens if prev_plan.num_steps > 1 else None
        tokens, last, logprobs, self.kv_pages = self.executor(self.model.params, self.kv_pages, batch, prev, prev_burst)
        # start the copy to the host now, ordered right after the step: reading the tokens later
        # then waits for the step, not for a copy queued behind the next step's launch (H200, 1B
        # batch 1: the read took 228 instead of 455 us, 1.39 vs 1.54 ms per step)
        tokens.copy_to_host_async()
        self._unapplied, self._planned = (plan, tokens, last, logprobs), None
        self._counts["steps"] += 1
        self._resumable = False

    def _settle(self) -> None:
        """Take in the previous step's tokens, then hand the step just dispatched to the scheduler
        (its tokens placeholders until the next call). An interrupt while waiting for the device
        leaves both where they were, for the next call to finish."""
        if self._inflight is not None:
            self._resumable = True  # (an interrupt while it waits for the device: the next call waits again)
            self._finish_inflight()
        if self._unapplied is not None:
            self.scheduler.update_from_output(self._unapplied[0], None)
            self._inflight, self._unapplied = self._unapplied, None

    def _fork(self, plan: StepPlan) -> None:
        if not self._unforked:  # (the common case: no n > 1 request waits for its prompt)
            return
        for s in plan.seqs:
            seq = self._seqs.get(s.request_id)
            if seq is None or not s.sample or seq.group.to_fork == 0:
                continue
            group = seq.group
            children = [self._new_seq(group, i) for i in range(1, group.to_fork + 1)]
            self.scheduler.fork(seq.sid, [c.sid for c in children], [c.sampling.params for c in children])
            for c in children:
                self._seqs[c.sid] = c
            group.to_fork = 0
            self._unforked -= 1

    def _finish_inflight(self) -> None:
        plan, tokens, _, logprobs = self._inflight
        n = plan.num_seqs
        sampled = np.asarray(tokens)[..., :n]  # blocks until the device has run the step; [K, n] for a burst
        lp = None
        if logprobs is not None:  # some row asked (the step ran the logprobs program, or a burst computed them)
            # each field [K, n, ...]: a burst's have the leading [K] axis, a single step's get one
            lp = [(np.asarray(a) if plan.num_steps > 1 else np.asarray(a)[None])[:, :n] for a in logprobs]
        self._inflight = None  # (only now: an interrupt in the waits above leaves it for the next call)
        self._resumable = False
        if lp is not None:
            rows = {s.request_id: i for i, s in enumerate(plan.seqs)}
            taken: dict[str, int] = {}  # a request's updates come in step order: the j-th is model step j's
        seqs, pending = self._seqs, self._pending
        for rid, token, finish_reason, stop_reason in self.scheduler.resolve(sampled):
            seq = seqs.get(rid)
            if seq is None:  # finished by length when applied, then aborted or stopped by a stop string
                continue
            seq.sampling.append(token)
            row = None
            if lp is not None and seq.logprobs is not None:
                i, k = rows[rid], seq.group.params.logprobs
                j = taken[rid] = taken.get(rid, -1) + 1
                row = {token: float(lp[0][j, i])}
                for t, v in zip(lp[1][j, i, :k].tolist(), lp[2][j, i, :k].tolist()):
                    row.setdefault(t, v)
            pending.append((seq, token, row, finish_reason, stop_reason))
            if finish_reason is not None:
                del seqs[rid]

    def _emit(self, partial: bool) -> list[RequestOutput]:
        # by group, not id: an aborted request's id may be reused before its final output is built
        touched: dict[int, _Group] = {id(g): g for g in self._ready}
        self._ready = []
        pending, self._pending = self._pending, []
        generated = 0  # the tokens outputs hold: not a burst's tokens after its stop string, nor an abort's
        for seq, token, lp_row, finish_reason, stop_reason in pending:
            if seq.finish_reason is not None:  # aborted (or stopped by a stop string) since the step was planned
                continue
            generated += 1
            seq.output_ids.append(token)
            if lp_row is not None:
                seq.logprobs.append(lp_row)
                seq.cumulative_logprob += lp_row[token]
            if seq.detok is not None and not (finish_reason == FINISH_STOP and not isinstance(stop_reason, str)
                                              and not seq.group.params.include_stop_str_in_output):
                # (the text of a stop token, EOS or a stop_token_ids entry, stays out: as in vLLM)
                before = len(seq.text)
                seq.text += seq.detok.step(token)
                stop = _cut_at_stop(seq, before) if seq.group.params.stop else None  # (a call per token saved)
                if stop is not None:
                    if finish_reason is None:
                        self.scheduler.finish(seq.sid, FINISH_STOP, stop)
                    finish_reason, stop_reason = FINISH_STOP, stop
            if finish_reason is not None:
                self._finish_seq(seq, finish_reason, stop_reason)
            group = seq.group
            touched[id(group)] = group
        self._counts["generated"] += generated
        return [self._output(g) for g in touched.values()
                if g.finished or (partial and g.params.output_kind != OUTPUT_FINAL_ONLY)]

    def _finish_seq(self, seq: _Seq, reason: str, stop_reason) -> None:
        self._seqs.pop(seq.sid, None)
        if seq.detok is not None and not (reason == FINISH_STOP and isinstance(stop_reason, str)):
            before = len(seq.text)
            seq.text += seq.detok.flush()  # a held incomplete character, as U+FFFD
            stop = _cut_at_stop(seq, before) if reason != FINISH_ABORT else None
            if stop is not None:
                reason, stop_reason = FINISH_STOP, stop
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        group = seq.group
        if group.to_fork == 0 and all(s.finished for s in group.seqs):
            group.finished = True
            self._groups.pop(group.request_id, None)
            self._counts["finished"] += 1

    def _output(self, group: _Group) -> RequestOutput:
        # A running request's cumulative output copies its whole sequence so far (O(length) host
        # work per request per step); a delta carries only what is new (SamplingParams.output_kind).
        whole = group.finished or group.params.output_kind != OUTPUT_DELTA
        outs = []
        for seq in group.seqs:
            hold = 0 if seq.finished else group.held_chars
            visible = max(seq.emitted_chars, len(seq.text) - hold)
            new_text = seq.text[seq.emitted_chars : visible]
            first = seq.emitted_tokens
            new_ids = seq.output_ids[first:]
            seq.emitted_chars, seq.emitted_tokens = visible, len(seq.output_ids)
            lps = seq.logprobs
            if lps is not None:
                lps = lps[:] if whole else lps[first:]
            outs.append(CompletionOutput(
                index=seq.index, text=seq.text[:visible] if whole else new_text,
                token_ids=seq.output_ids[:] if whole else new_ids[:], cumulative_logprob=seq.cumulative_logprob,
                logprobs=lps, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                new_text=new_text, new_token_ids=new_ids,
            ))
        if group.finished:  # its last output: drop the group -> seqs links, so that the request's
            group.seqs = []  # objects go by reference counting, not the cyclic collector
        return RequestOutput(group.request_id, group.prompt, group.output_prompt_ids, outs, group.finished,
                             group.first.num_cached_tokens)

    def _check_compiles(self) -> None:
        if not self.executor.warmed_up:
            return
        new = self._watcher.count - self._compiles_seen
        if new > 0:
            self._compiles_seen = self._watcher.count
            self.executor.num_compiles_after_warmup += new
            msg = f"{new} XLA compile(s) while serving, after warmup"
            if self.config.strict_compile:
                raise CompileAfterWarmupError(msg)
            logger.error("ALERT: %s", msg)

    # -- stats and checks -----------------------------------------------------------------------
    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        c = self._counts
        ex = self.executor
        return EngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting, num_total_pages=self.config.num_pages,
            num_free_pages=s.num_free_pages, num_cached_pages=s.num_cached_pages, kv_usage=s.kv_usage,
            num_requests=c["requests"], num_finished=c["finished"], num_aborted=c["aborted"],
            prompt_tokens=c["prompt_tokens"], prefill_tokens=s.prefill_tokens,
            prefix_cache_hit_tokens=s.prefix_cache_hit_tokens, prefix_cache_query_tokens=s.prefix_cache_query_tokens,
            decode_tokens=s.decode_tokens, generated_tokens=c["generated"], num_preemptions=s.num_preemptions,
            num_steps=c["steps"], num_bursts=s.num_bursts, num_warmup_compiles=ex.num_warmup_compiles,
            num_compiles_after_warmup=ex.num_compiles_after_warmup, warmup_seconds=ex.warmup_seconds,
        )

    def check_invariants(self) -> None:
        """AssertionError when bookkeeping is off; when idle, also that no page is held."""
        self.scheduler.check_invariants()
        assert self._unforked == sum(1 for g in self._groups.values() if g.to_fork), "fork count drifted"
        alloc = self.scheduler.allocator
        if not self.has_unfinished():
            assert not self._seqs and not self._groups, "live sequences remain"
            assert alloc.num_referenced == 0, f"{alloc.num_referenced} pages still referenced"
            assert alloc.num_free + alloc.num_cached == self.config.num_pages, (
                f"free {alloc.num_free} + cached {alloc.num_cached} != {self.config.num_pages} pages"
            )


_freeze_lock = threading.Lock()
_freeze_depth = 0  # frozen_heap bodies running now, in any thread


@contextlib.contextmanager
def frozen_heap(*, collect: bool = False):
    """Run the body with every object alive at entry frozen (gc.freeze): a cyclic collection inside
    then walks only the objects made since (module docstring). The outermost of nested or
    concurrent bodies freezes and unfreezes. CPython has no partial unfreeze, so the exit gives
    back every frozen object, including any that the process froze before (some libraries freeze
    a few hundred objects at import); an application that wants its heap frozen for good
    freezes it again after. Garbage in cycles at entry is frozen too, until the exit: a long
    body (a server's loop) passes collect=True to collect it first (~0.2 s on a warmed-up heap)."""
    global _freeze_depth
    with _freeze_lock:
        if _freeze_depth == 0:
            if collect:
                gc.collect()
            gc.freeze()
        _freeze_depth += 1
    try:
        yield
    finally:
        with _freeze_lock:
            _freeze_depth -= 1
            if _freeze_depth == 0:
                gc.unfreeze()


def _cut_at_stop(seq: _Seq, new_from: int) -> str | None:
    """The stop string that ends earliest in seq.text[new_from:] (of those ending at one place, the
    longest), after cutting the text where it starts (where it ends with
    include_stop_str_in_output); None when there is none, or before min_tokens tokens (as in vLLM).
    The earliest end is what text arriving a character at a time would meet first, so the choice
    does not depend on how many characters one token brings."""
    params = seq.group.params
    if not params.stop or len(seq.output_ids) <= params.min_tokens:
        return None
    best = None  # (end, start, stop)
    for s in params.stop:
        i = seq.text.find(s, max(0, new_from - len(s) + 1))
        if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
            best = (i + len(s), i, s)
    if best is None:
        return None
    end, start, stop = best
    seq.text = seq.text[: end if params.include_stop_str_in_output else start]
    return stop


def _kv_dtype(model: LoadedModel, config: EngineConfig):
    """The KV pool's dtype: config.kv_dtype, else the model's (LoadedModel.kv_dtype)."""
    return _DTYPES[config.kv_dtype] if config.kv_dtype else model.kv_dtype


def _estimate_num_pages(model: LoadedModel, config: EngineConfig, max_model_len: int) -> int:
    """Pages for the pool: on CPU, room for every slot at full length; on an accelerator, the
    configured share of the memory left on the first device after the weights."""
    G = config.page_size
    per_seq = -(-max_model_len // G)
    enough = config.max_num_seqs * per_seq
    dev = model.mesh.devices.flat[0]
    if dev.platform == "cpu":
        return enough
    stats = dev.memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        return enough
    cfg = model.config
    shape = kv_pages_shape(cfg, 1, G, model.kv_repeat)
    shards = mesh_axis_size(model.mesh, "tensor") if kv_cache_sharding(cfg, model.mesh).spec[2] else 1
    page_bytes = cfg.num_layers * int(np.prod(shape)) * np.dtype(_kv_dtype(model, config)).itemsize // shards
    free = limit * config.kv_memory_fraction - stats.get("bytes_in_use", 0)
    pages = int(free // page_bytes)
    if pages < per_seq:
        raise ValueError(
            f"only {pages} KV pages fit in {free / 2**30:.2f} GiB ({page_bytes} bytes each); one sequence of "
            f"max_model_len {max_model_len} needs {per_seq}"
        )
    return pages
