"""The bucket table, AOT warmup of the step for every bucket, and compile accounting.

Only (token bucket T, seq bucket S) pairs from the table are ever compiled. A pair is reachable
when some step with n_seqs <= n_tokens lands in it, i.e. when the smallest seq count of the S
bucket (the previous bucket + 1) is <= T; unreachable pairs are skipped.

Warmup lowers every reachable pair (tracing is Python, sequential) and compiles them ahead of time
(XLA compiles release the GIL, so a small thread pool overlaps them), keeping the `Compiled`
executables. Serving calls those executables directly, so a batch outside the table cannot
silently compile: `StepExecutor.__call__` raises `CompileAfterWarmupError` under strict mode, and
otherwise compiles it, counts it and logs an alert. A `CompileWatcher` also counts every XLA
compile (jax.monitoring's backend-compile event) that happens in the serving thread while it
watches, which catches compiles from anything else (an eager jnp op on the serving path).
"""

from __future__ import annotations

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

logger = logging.getLogger(__name__)

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch


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
    """The compiled step for every bucket of a table, called with host (numpy) batches."""

    def __init__(
        self,
        step_fn: Callable,  # step(params, kv_pages, batch) -> (tokens, logprobs, kv_pages)
        *,
        params,
        kv_pages,
        mesh,
        table: BucketTable,
        empty_batch: Callable[[int, int], object],  # (T, S) -> numpy StepBatch of that bucket
        strict: bool,
    ):
        self.table = table
        self.strict = strict
        self._empty_batch = empty_batch
        self._batch_sharding = replicated(mesh)
        kv_sharding = tuple(x.sharding for x in kv_pages)
        param_shardings = jax.tree.map(lambda x: x.sharding, params)
        self._jitted = jax.jit(
            step_fn,
            donate_argnums=(1,),
            in_shardings=(param_shardings, kv_sharding, self._batch_sharding),
            out_shardings=(self._batch_sharding, self._batch_sharding, kv_sharding),
        )
        self._abstract_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
        self._abstract_kv = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in kv_pages)
        self._executables: dict[tuple[int, int], object] = {}
        self._no_history: dict[int, jax.Array] = {}  # S -> device-resident all -1 i32[S, W]
        self.warmed_up = False
        self.num_warmup_compiles = 0
        self.num_compiles_after_warmup = 0
        self.warmup_seconds = 0.0

    def _lower(self, T: int, S: int):
        batch = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self._batch_sharding), self._empty_batch(T, S)
        )
        return self._jitted.lower(self._abstract_params, self._abstract_kv, batch)

    def warmup(self, *, progress: bool = True) -> None:
        pairs = [p for p in self.table.pairs() if p not in self._executables]
        t0 = time.perf_counter()
        bar = tqdm(total=len(pairs), desc="compiling step buckets", unit="bucket", disable=not progress)
        # XLA's CPU compiler already uses several threads: on a 2-core machine two compiles at once
        # ran slower than one after the other, so only hosts with cores to spare compile in parallel.
        workers = max(1, min(4, (os.cpu_count() or 1) // 4, len(pairs)))
        with ThreadPoolExecutor(workers) as pool:
            futures = []
            for T, S in pairs:
                lowered = self._lower(T, S)  # tracing holds the GIL: one at a time
                futures.append(((T, S), pool.submit(lowered.compile)))
            for key, fut in futures:
                self._executables[key] = fut.result()
                bar.update(1)
        bar.close()
        self.num_warmup_compiles += len(pairs)
        self.warmup_seconds += time.perf_counter() - t0
        self.warmed_up = True

    def _executable(self, T: int, S: int):
        exe = self._executables.get((T, S))
        if exe is not None:
            return exe
        if self.warmed_up:
            msg = f"step bucket (T={T}, S={S}) was not compiled at warmup; compiling it now while serving"
            if self.strict:
                raise CompileAfterWarmupError(msg)
            logger.error("ALERT: %s", msg)
            self.num_compiles_after_warmup += 1
        exe = self._executables[(T, S)] = self._lower(T, S).compile()
        return exe

    def __call__(self, params, kv_pages, batch):
        """Dispatch one step (asynchronously: the results are futures until read)."""
        T = batch.tokens.shape[0]
        S = batch.logits_indices.shape[0]
        exe = self._executable(T, S)
        if batch.sampling.history is None:  # no row has penalties: reuse a device constant
            hist = self._no_history.get(S)
            if hist is None:
                full = self._empty_batch(T, S).sampling.history
                hist = self._no_history[S] = jax.device_put(full, self._batch_sharding)
            batch = batch._replace(sampling=batch.sampling._replace(history=hist))
        dev_batch = jax.device_put(batch, self._batch_sharding)
        return exe(params, kv_pages, dev_batch)

    @property
    def compiled_buckets(self) -> list[tuple[int, int]]:
        return sorted(self._executables)


def host_tokens(tokens, n: int) -> np.ndarray:
    """The first n sampled tokens on the host (blocks until the step has run)."""
    return np.asarray(tokens)[:n]
