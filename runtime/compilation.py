"""The bucket table, AOT warmup of the step programs, and compile accounting.

The programs of one step (runtime/step.py, runtime/sampling.py): the model program, compiled per
(token bucket T, seq bucket S) pair of the table, and the sampler programs (count, count_more,
penalize, pick, pick_filtered, logprobs), compiled per seq bucket. A pair is reachable when some step with
n_seqs <= n_tokens lands in it, i.e. when the smallest seq count of the S bucket (the previous
bucket + 1) is <= T; unreachable pairs are skipped. With EngineConfig.decode_steps K > 1, the burst
programs too (K decode steps in one program, runtime/step.py:make_burst_fn), per decode pair (the
bucket of a step of n sequences with one token each) and sampler (greedy, pick, pick_filtered), in
three variants: plain, with penalties, and with penalties and logprobs. A burst with logprobs but no
penalized row runs the third with an empty penalty history: neutral penalties are exact
identities (runtime/sampling.py), and a fourth variant per sampler would lengthen warmup for
nothing. Where the model's greedy head is a kernel (one Hopper GPU: the argmax in the LM head's
epilogue, the logits never written; up to dispatch.GREEDY_HEAD_GEMV_MAX_ROWS rows and from
dispatch.GREEDY_HEAD_MIN_ROWS), one more burst per decode pair of such a seq bucket, GREEDY_HEAD,
runs the bursts whose rows are all greedy with nothing banned, no penalties and no logprobs. And
the page table update programs, one per PAGE_UPDATE_BUCKETS size: the executor keeps the page
tables on the device (`sync_pages`). Where the model's decode-only forward differs from its other
one (dispatch.decode_attention_is_fused: on a GPU, each layer's KV write inside the attention
launch), also a decode-only model program per decode pair, which single steps without a prefill
token run (the bursts' model steps already are).
Bursts of seq buckets up to EngineConfig.unroll_burst_max_seqs sequences (on a GPU by default the
batch-1 bucket) compile their K model steps unrolled: faster there, longer to compile.

Warmup lowers every program (tracing is Python, sequential) and compiles them ahead of time (XLA
compiles release the GIL, so a small thread pool overlaps them), keeping the `Compiled`
executables. Serving calls those executables directly, so a batch outside the table cannot
silently compile: `StepExecutor.__call__` raises `CompileAfterWarmupError` under strict mode, and
otherwise compiles it, counts it and logs an alert. A `CompileWatcher` also counts every XLA
compile (jax.monitoring's backend-compile event) that happens in the serving thread while it
watches, which catches compiles from anything else (an eager jnp op on the serving path).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Iterator

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from runtime.sampling import PenaltyCounts, count_penalties, run_sampler, sampler_programs
from runtime.step import BURST_SAMPLERS, GREEDY_HEAD, PackedBatch

logger = logging.getLogger(__name__)

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch


# The (penalties, logprobs) variants of the burst programs: a burst with logprobs always takes the
# penalty counts (of an all -1 history when no row has penalties) rather than doubling the variants.
_BURST_VARIANTS = ((False, False), (True, False), (True, True))


# Entries of the page table update programs (StepExecutor.sync_pages): a decode step adds a page per
# sequence every page_size tokens, an admission its whole prompt's (a long cached prefix: thousands);
# updates past the largest bucket run in several calls.
PAGE_UPDATE_BUCKETS = (256, 4096, 65536)

# The key of a decode-only model program (StepExecutor.decode_programs): ("model_decode", T, S).
DECODE_MODEL = "model_decode"


def _set_pages(table, upd):
    """table i32[rows, P] with table[upd[0], upd[1]] = upd[2]; entries with upd[0] == rows drop."""
    return table.at[upd[0], upd[1]].set(upd[2], mode="drop")


_POOL_PROGRAMS = ("model", DECODE_MODEL, "burst")  # programs that take (and donate) the KV pool


class CompileAfterWarmupError(RuntimeError):
    """The engine would compile while serving (strict mode)."""


class BucketTable:
    def __init__(self, token_buckets: tuple[int, ...], seq_buckets: tuple[int, ...]):
        self.token_buckets = tuple(token_buckets)
        self.seq_buckets = tuple(seq_buckets)

    def select(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        """The smallest (T, S) bucket holding num_tokens tokens of num_seqs sequences."""
        T = next((b for b in self.token_buckets if b >= num_tokens), None)
        S = next((b for b in self.seq_buckets if b >= num_seqs), None)
        if T is None or S is None:
            raise ValueError(
                f"a step of {num_tokens} tokens and {num_seqs} sequences exceeds the bucket table "
                f"(largest token bucket {self.token_buckets[-1]}, seq bucket {self.seq_buckets[-1]})"
            )
        return T, S

    def decode_pairs(self) -> list[tuple[int, int]]:
        """The buckets of decode-only steps (one token per sequence): where bursts run."""
        return sorted({self.select(n, n) for n in range(1, min(self.token_buckets[-1], self.seq_buckets[-1]) + 1)})

    def pairs(self) -> list[tuple[int, int]]:
        out = []
        for T in self.token_buckets:
            lo = 1
            for S in self.seq_buckets:
                if lo <= T:
                    out.append((T, S))
                lo = S + 1
        return out


class CompileWatcher:
    """Counts XLA compiles in one thread while `watch()` is active there.

    jax.monitoring listeners are process-wide; this one is registered by `open()` and removed by
    `close()` (or when the watcher is garbage collected: the registered callback holds only a weak
    reference, so a forgotten engine is not kept alive by it), and it ignores compiles of other
    threads (another engine, a test building a reference).
    """

    def __init__(self) -> None:
        self.count = 0
        self._thread: int | None = None
        self._finalizer: weakref.finalize | None = None

    def _on_event(self, event: str) -> None:
        if event == BACKEND_COMPILE_EVENT and self._thread == threading.get_ident():
            self.count += 1

    def open(self) -> None:
        if self._finalizer is not None and self._finalizer.alive:
            return
        ref = weakref.ref(self)

        def listener(event: str, duration: float, **kwargs) -> None:
            watcher = ref()
            if watcher is not None:
                watcher._on_event(event)

        jax.monitoring.register_event_duration_secs_listener(listener)
        self._finalizer = weakref.finalize(self, jax.monitoring.unregister_event_duration_listener, listener)

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # unregisters once; later calls do nothing

    @contextmanager
    def watch(self) -> Iterator[None]:
        prev, self._thread = self._thread, threading.get_ident()
        try:
            yield
        finally:
            self._thread = prev


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


class StepExecutor:
    """The compiled programs of a bucket table, called with host (numpy) PackedBatches: the model
    program per (T, S) pair, the sampler programs (runtime/sampling.py) per seq bucket S."""

    def __init__(
        self,
        model_fn: Callable,  # model(params, kv_pages, flat, rows, prev, layout) -> (logits, greedy tokens, kv_pages)
        *,
        params,
        kv_pages,
        mesh,
        table: BucketTable,
        empty_batch: Callable[[int, int], PackedBatch],  # (T, S) -> all-padding batch of that bucket
        vocab_size: int,
        max_logprobs: int,
        strict: bool,
        burst_fn: Callable | None = None,  # runtime/step.make_burst_fn; needed when decode_steps > 1
        decode_steps: int = 1,  # K of the bursts to compile (StepPlan.num_steps); 1: none
        gpu_cublas_min_tokens: int | None = None,  # EngineConfig.gpu_cublas_min_tokens
        greedy_head_seqs: frozenset[int] = frozenset(),  # seq buckets with GREEDY_HEAD bursts (_greedy_head_seqs)
        decode_programs: bool = False,  # decode-only model programs per decode pair (engine._decode_programs)
        unroll_burst_max_seqs: int | None = None,  # EngineConfig.unroll_burst_max_seqs
    ):
        if decode_steps > 1 and burst_fn is None:
            raise ValueError(f"decode_steps={decode_steps} needs a burst_fn")
        self.table = table
        self.decode_steps = decode_steps
        self.greedy_head_seqs = frozenset(greedy_head_seqs)
        self.decode_programs = decode_programs
        self.on_gpu = on_gpu = next(iter(mesh.devices.flat)).platform == "gpu"
        self._cublas_min_tokens = gpu_cublas_min_tokens if on_gpu else None
        # bursts of seq buckets up to this many sequences run unrolled (None: 1 on a GPU, 0 elsewhere)
        self.unroll_burst_max_seqs = (1 if on_gpu else 0) if unroll_burst_max_seqs is None else unroll_burst_max_seqs
        self.strict = strict
        self._empty_batch = empty_batch
        self._vocab_size = vocab_size
        self._batch_sharding = replicated(mesh)
        kv_sharding = tuple(x.sharding for x in kv_pages)
        # The model program takes the parameters as a flat list of arrays: flattening the model's
        # nnx.State at every call cost ~1 us per array on the host (147 arrays for a 1B model).
        self._params = params
        self._param_leaves, self._param_treedef = jax.tree.flatten(params)
        param_shardings = [x.sharding for x in self._param_leaves]
        rep = self._batch_sharding
        self._model = jax.jit(
            model_fn,
            donate_argnums=(1,),
            static_argnums=(6, 7, 8),  # layout, params treedef, decode_only
            in_shardings=(param_shardings, kv_sharding, rep, rep, rep, rep),
            out_shardings=(rep, rep, kv_sharding),
        )
        self._burst = None if burst_fn is None else jax.jit(
            burst_fn,
            donate_argnums=(1,),
            # layout, params treedef, steps, sampler, penalties, max_logprobs, unroll
            static_argnums=(7, 8, 9, 10, 11, 12, 13),
            in_shardings=(param_shardings, kv_sharding, rep, rep, rep, rep, rep),
            out_shardings=(rep, rep, kv_sharding, rep),
        )
        self.max_logprobs = max_logprobs
        self._empty_histories: dict[int, jax.Array] = {}  # S -> i32[S, C] of -1: logprob bursts without penalties
        probe = empty_batch(1, 1)
        self._history_chunk = probe.history.shape[1]  # C: entries a count program reads
        # Every program's tokens are i32[slots]: the next step's model program reads them as `prev`.
        self.slots = table.seq_buckets[-1]
        # The page tables, a row per scheduler slot (< max_num_seqs <= slots), kept on the device;
        # per row the lease and page count it holds (what the host knows of it: sync_pages).
        self._page_table_shape = (self.slots, probe.layout.P)
        self.page_table = None
        self.drop_pages()
        # this executor's own function object: a jit of the module's function kept its programs (one
        # set per page table shape) for the life of the process
        self._set_pages = jax.jit(functools.partial(_set_pages), donate_argnums=(0,), out_shardings=rep)
        self._no_prev = jax.device_put(np.zeros(self.slots, np.int32), rep)
        # the previous step's tokens when it was a burst (history placeholders read them); zeros else
        self._no_prev_burst = jax.device_put(np.zeros((decode_steps, self.slots), np.int32), rep)
        # held: the programs are shared with the other live executors and go with the last of them
        self._sampler_programs = sampler_programs(max_logprobs, self.slots, vocab_size)
        self._samplers = {name: (jax.jit(p.fn, out_shardings=rep), p.args)
                          for name, p in self._sampler_programs.items()}
        self._abstract_params = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                                 for x in self._param_leaves]
        self._abstract_kv = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in kv_pages)
        # ("model", T, S) or (sampler program name, S) -> Compiled
        self._executables: dict[tuple, object] = {}
        self.warmed_up = False
        self.num_warmup_compiles = 0
        self.num_compiles_after_warmup = 0
        self.warmup_seconds = 0.0

    def program_keys(self) -> list[tuple]:
        """Every program of the table: the model program per (T, S) pair (and with decode_programs
        the decode-only one per decode pair), the sampler programs per seq bucket, then with
        decode_steps > 1 the burst programs per decode pair, sampler and (penalties, logprobs)
        variant (see the module docstring), and the GREEDY_HEAD burst per decode pair whose seq bucket
        is in greedy_head_seqs."""
        keys = [("model", T, S) for T, S in self.table.pairs()]
        if self.decode_programs:
            keys += [(DECODE_MODEL, T, S) for T, S in self.table.decode_pairs()]
        seq_buckets = sorted({S for _, S in self.table.pairs()})
        keys += [(name, S) for S in seq_buckets for name in self._samplers]
        if self.decode_steps > 1:
            keys += [("burst", T, S, sampler, penalties, logprobs) for T, S in self.table.decode_pairs()
                     for sampler in BURST_SAMPLERS for penalties, logprobs in _BURST_VARIANTS]
            keys += [("burst", T, S, GREEDY_HEAD, False, False) for T, S in self.table.decode_pairs()
                     if self._greedy_head(S)]
        keys += [("pages", U) for U in PAGE_UPDATE_BUCKETS]
        return keys

    def model_key(self, T: int, S: int, decode_only: bool) -> tuple:
        """The model program a single step of bucket (T, S) runs: the decode-only one for a step
        without a prefill token where those are compiled (decode_programs), else the bucket's."""
        return (DECODE_MODEL if decode_only and self.decode_programs else "model", T, S)

    def _greedy_head(self, S: int) -> bool:
        return S in self.greedy_head_seqs

    def compiler_options(self, key: tuple) -> dict:
        """XLA options of one program: on a GPU, the model and burst programs of token buckets of at
        least gpu_cublas_min_tokens run their matmuls with cuBLAS. XLA's Triton GEMMs win at a
        few rows (batch-1 decode: 990 tok/s against 587 with cuBLAS on an H200), cuBLAS from a few
        dozen (docs/benchmarks.md)."""
        if (self._cublas_min_tokens is not None and key[0] in ("model", DECODE_MODEL, "burst")
                and key[1] >= self._cublas_min_tokens):
            return {"xla_gpu_enable_triton_gemm": False}
        return {}

    def _compile(self, key: tuple, lowered):
        return lowered.compile(self.compiler_options(key) or None)

    def _abstract(self, a) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self._batch_sharding)

    def _lower(self, key: tuple):
        program, args, static = self._padding_call(key)
        head = ()
        if key[0] in _POOL_PROGRAMS:  # the parameters and the pool keep their own shardings
            head, args = (self._abstract_params, self._abstract_kv), args[2:]
        return program.lower(*head, *(jax.tree.map(self._abstract, a) for a in args), *static)

    def _padding_call(self, key: tuple) -> tuple[Callable, tuple, tuple]:
        """The jitted function of program `key` and its (dynamic, static) arguments for an all-padding
        batch of its bucket. Dynamic: host arrays and the executor's device arrays; for a model or burst
        program the parameters' leaves first, then None where the pool goes. A page-table update's rows
        are all `slots`, out of range: it writes nothing."""
        if key[0] == "pages":
            return self._set_pages, (self.page_table, np.full((3, key[1]), self.slots, np.int32)), ()
        if key[0] not in _POOL_PROGRAMS:
            name, S = key
            b = self._empty_batch(S, S)  # any T: the sampling arrays do not depend on it
            values = dict(logits=np.broadcast_to(np.float32(0), (S, self._vocab_size)), rows=b.rows,
                          history=b.history, start=np.int32(0), counts=self._zero_counts(S), tokens=self._no_prev,
                          prev=self._no_prev, prev_burst=self._no_prev_burst)
            fn, names = self._samplers[name]
            return fn, tuple(values[a] for a in names), ()
        T, S = key[1:3]
        b = self._empty_batch(T, S)
        args = (self._param_leaves, None, b.flat, b.rows, self._no_prev)
        static = (b.layout, self._param_treedef)
        if key[0] == "burst":
            sampler, penalties, logprobs = key[3:]
            return self._burst, (*args, self._zero_counts(S) if penalties else None, self.page_table), (
                *static, self.decode_steps, sampler, penalties, self.max_logprobs if logprobs else None,
                S <= self.unroll_burst_max_seqs)
        return self._model, (*args, self.page_table), (*static, key[0] == DECODE_MODEL)

    def _zero_counts(self, S: int) -> PenaltyCounts:
        shape = (S, self._vocab_size)
        return PenaltyCounts(np.broadcast_to(np.float32(0), shape), np.broadcast_to(np.False_, shape))

    def _first_runs(self, kv_pages, progress: bool):
        """Run every program once on its all-padding arguments (_padding_call; see warmup); returns the
        pool, donated through the model and burst programs."""
        put = functools.partial(jax.device_put, device=self._batch_sharding)
        for key in tqdm(self.program_keys(), desc="first runs of the step programs", unit="program",
                        disable=not progress):
            _, args, _ = self._padding_call(key)
            head = ()
            if key[0] in _POOL_PROGRAMS:
                head, args = (args[0], kv_pages), args[2:]
            outs = self._executables[key](*head, *(jax.tree.map(put, a) for a in args))
            if key[0] == "pages":
                self.page_table = outs
            elif key[0] in _POOL_PROGRAMS:
                kv_pages = outs[2]
            jax.block_until_ready(outs)
        return kv_pages

    def warmup(self, *, progress: bool = True, kv_pages=None):
        """Compile every program of the table (program_keys) that is not compiled yet. With `kv_pages` (the
        pool, donated) then run each program once on an all-padding batch, which computes nothing into the
        pool (runtime/step.py) or the page table, and return the pool: a program's first run pays
        one-time costs (on a GPU, loading its kernels and building its command buffer) that would otherwise
        land on the first request that needs the program. Without, returns None."""
        keys = [k for k in self.program_keys() if k not in self._executables]
        t0 = time.perf_counter()
        bar = tqdm(total=len(keys), desc="compiling step programs", unit="program", disable=not progress)
        # XLA's CPU compiler already uses several threads: on a 2-core machine two compiles at once
        # ran slower than one after the other, so only hosts with cores to spare compile in parallel.
        workers = max(1, min(4, (os.cpu_count() or 1) // 4, len(keys)))
        with ThreadPoolExecutor(workers) as pool:
            futures = []
            for key in keys:
                lowered = self._lower(key)  # tracing holds the GIL: one at a time
                futures.append((key, pool.submit(self._compile, key, lowered)))
            for key, fut in futures:
                self._executables[key] = fut.result()
                bar.update(1)
        bar.close()
        self.num_warmup_compiles += len(keys)
        if kv_pages is not None:
            kv_pages = self._first_runs(kv_pages, progress)
        self.warmup_seconds += time.perf_counter() - t0
        self.warmed_up = True
        return kv_pages

    def _executable(self, key: tuple):
        exe = self._executables.get(key)
        if exe is not None:
            return exe
        if self.warmed_up:
            if key[0] in ("model", DECODE_MODEL):
                what = f"{'decode-only ' if key[0] == DECODE_MODEL else ''}model program (T={key[1]}, S={key[2]})"
            elif key[0] == "pages":
                what = f"page table update program (U={key[1]})"
            elif key[0] == "burst":
                what = (f"burst program (T={key[1]}, S={key[2]}, {key[3]}{', penalties' if key[4] else ''}"
                        f"{', logprobs' if key[5] else ''})")
            else:
                what = f"{key[0]} program (S={key[1]})"
            msg = f"{what} was not compiled at warmup; compiling it now while serving"
            if self.strict:
                raise CompileAfterWarmupError(msg)
            logger.error("ALERT: %s", msg)
            self.num_compiles_after_warmup += 1
        exe = self._executables[key] = self._compile(key, self._lower(key))
        return exe

    def __call__(self, params, kv_pages, batch: PackedBatch, prev_tokens: jax.Array | None = None,
                 prev_burst: jax.Array | None = None):
        """Dispatch one step: the model program, then the sampler programs `batch.needs` asks for
        (runtime/sampling.py); or a burst's program (batch.steps > 1). Asynchronous: returns
        (tokens, last, Logprobs or None when no row asked, kv_pages) as futures at once; tokens is
        i32[slots], or i32[K, slots] for a burst (its Logprobs' fields then have a leading [K] axis
        too), and `last` i32[slots] the final model step's (the
        next call's `prev_tokens`, which its input tokens -(i + 1) stand for: lookahead,
        runtime/engine.py). After a burst, `prev_burst` is its tokens (what the penalty histories'
        burst placeholders stand for)."""
        T, S = batch.layout.T, batch.layout.S
        self.sync_pages(batch)
        leaves = self._param_leaves if params is self._params else self._param_treedef.flatten_up_to(params)
        prev = self._no_prev if prev_tokens is None else prev_tokens
        prev_burst = self._no_prev_burst if prev_burst is None else prev_burst
        if batch.steps > 1:
            needs = batch.needs
            if batch.steps != self.decode_steps:
                raise ValueError(f"a burst of {batch.steps} steps cannot run here (decode_steps {self.decode_steps})")
            sampler = "pick_filtered" if needs.filters else "pick" if needs.random else "greedy"
            if sampler == "greedy" and self._greedy_head(S) and not (needs.penalties or needs.logprobs or needs.bans):
                sampler = GREEDY_HEAD
            penalties = needs.penalties or needs.logprobs  # see _BURST_VARIANTS
            burst = self._executable(("burst", T, S, sampler, penalties, needs.logprobs))
            counts = None
            if penalties:
                history = self._empty_history(S) if batch.history is None else batch.history
                counts = count_penalties(self._sampler_call(S), batch.rows, history, prev, prev_burst,
                                         chunk=self._history_chunk)
            tokens, last, kv_pages, logprobs = burst(leaves, kv_pages, batch.flat, batch.rows, prev, counts,
                                                     self.page_table)
            return tokens, last, logprobs, kv_pages
        model = self._executable(self.model_key(T, S, batch.decode_only))
        # numpy arrays go straight into the call: the executable's own transfer of a host array
        # cost ~10 us where a jax.device_put first cost ~60 us more (host time on the serving path)
        logits, greedy, kv_pages = model(leaves, kv_pages, batch.flat, batch.rows, prev, self.page_table)
        tokens, logprobs = run_sampler(self._sampler_call(S), logits, greedy, batch.rows, batch.history, prev,
                                       prev_burst, batch.needs, history_chunk=self._history_chunk)
        return tokens, tokens, logprobs, kv_pages

    def model_step_fn(self, batch: PackedBatch) -> Callable:
        """The model program of `batch`'s bucket with its arguments already on the device, as a
        function of the KV pool returning (logits, greedy tokens, kv_pages) (kv_pages is donated):
        the device's share of a single step, without the batch's host transfer or a sampler, for
        benchmarks (scripts/bench_decode.py). The page table is synced to the batch first. A
        program warmup did not compile is compiled as `__call__` would."""
        if batch.steps > 1:
            raise ValueError(f"a burst of {batch.steps} steps has no single model program")
        self.sync_pages(batch)
        model = self._executable(self.model_key(batch.layout.T, batch.layout.S, batch.decode_only))
        flat, rows = jax.device_put((batch.flat, batch.rows), self._batch_sharding)
        leaves, prev, table = self._param_leaves, self._no_prev, self.page_table
        return lambda kv_pages: model(leaves, kv_pages, flat, rows, prev, table)

    def drop_pages(self) -> None:
        """Forget what every page table row holds (leases start at 1: the next sync ships a row's
        whole list), and make the table anew if a failed update consumed it (it is donated)."""
        if self.page_table is None or self.page_table.is_deleted():
            self.page_table = jax.device_put(np.zeros(self._page_table_shape, np.int32), self._batch_sharding)
        self._row_lease = [0] * self.slots
        self._row_pages = [0] * self.slots

    def sync_pages(self, batch: PackedBatch) -> None:
        """Bring the device's page table up to `batch.pages`: per row, the pages past those it holds
        under the same lease, or the whole list when the lease changed (the slot's sequence is new,
        or was preempted and admitted again). Stale entries past a row's pages stay: nothing reads
        a page table past its sequence's length. Asynchronous, like the steps."""
        P = self.page_table.shape[1]
        changed = []  # (row, lease, pages)
        rows, cols, vals = [], [], []  # the update, entry by entry
        for row, lease, pages in batch.pages:
            if not 0 <= row < self.slots or len(pages) > P:
                raise ValueError(f"page table row {row} of {len(pages)} pages: the table is [{self.slots}, {P}]")
            same = self._row_lease[row] == lease
            start = self._row_pages[row] if same else 0
            n = len(pages)
            if n > start or not same:
                changed.append((row, lease, n))
                rows += [row] * (n - start)
                cols += range(start, n)
                vals += pages[start:]
        upd = np.array([rows, cols, vals], np.int32).reshape(3, -1)
        largest = PAGE_UPDATE_BUCKETS[-1]
        for i in range(0, upd.shape[1], largest):
            part = upd[:, i : i + largest]
            U = next(b for b in PAGE_UPDATE_BUCKETS if b >= part.shape[1])
            padded = np.full((3, U), self.slots, np.int32)  # row `slots` is out of range: dropped
            padded[:, : part.shape[1]] = part
            self.page_table = self._executable(("pages", U))(self.page_table, padded)
        for row, lease, n in changed:
            self._row_lease[row], self._row_pages[row] = lease, n

    def _sampler_call(self, S: int) -> Callable:
        return lambda name, *args: self._executable((name, S))(*args)

    def _empty_history(self, S: int) -> jax.Array:
        """The penalty history of S rows without penalties (one chunk of -1), kept on the device."""
        h = self._empty_histories.get(S)
        if h is None:
            h = self._empty_histories[S] = jax.device_put(self._empty_batch(S, S).history, self._batch_sharding)
        return h

    @property
    def compiled_buckets(self) -> list[tuple[int, int]]:
        """The (T, S) buckets whose model program is compiled."""
        return sorted((k[1], k[2]) for k in self._executables if k[0] == "model")
