"""The engine for servers: a background thread runs the engine loop; callers on an asyncio event
loop `submit` requests and read their outputs from async iterators.

    engine = AsyncEngine(Engine(model, config, tokenizer=tok))
    stream = engine.submit(GenerationRequest(prompt="Hi", sampling_params=params))
    async for out in stream:
        ...                                  # RequestOutput snapshots; the last has finished=True
    stream.cancel(); engine.cancel(request_id); engine.stats(); engine.health(); engine.shutdown()

A client may choose its request ids and reuse one once its request has finished: a stream that
goes away (or `stream.cancel()`) aborts only its own request, never a later one of the same id;
`engine.cancel(request_id)` aborts whichever request has the id now.

Threading: the Engine is touched only by the loop thread. submit/cancel put commands on a
thread-safe queue and set an Event; the loop drains commands between steps (so a cancel takes
effect before the next step is planned: its pages are free within one step) and blocks on the
Event when there is no work (no polling). Outputs go back with `loop.call_soon_threadsafe` into
one asyncio.Queue per request. Validation and tokenization run in the caller's thread (submit
raises at once on a request that can never run); they read only immutable engine state.
A step that raises (runtime/engine.py, Failures: the engine drops the requests it held) ends their
streams with EngineStepError, and the loop serves on. If the next step raises too, the engine is
taken to be broken and the loop dies: every open stream raises EngineDeadError, submit() refuses
with it, and health() reports it. So does any other error of the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
from dataclasses import dataclass, field, replace
from typing import Sequence

from runtime.engine import Engine, EngineStats, frozen_heap
from runtime.llm import RequestOutput
from runtime.request import SamplingParams, check_priority, new_request_id, validate_cache_salt

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped with an error; no request can proceed."""


class EngineStepError(RuntimeError):
    """A step failed with this request in it: the engine dropped the request and serves on."""


@dataclass
class GenerationRequest:
    """One request as servers submit it: a text prompt or token ids (one of the two)."""

    prompt: str | None = None
    prompt_token_ids: Sequence[int] | None = None
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None
    priority: int = 0
    cache_salt: str | None = None


@dataclass(frozen=True)
class Health:
    healthy: bool
    running: bool  # the loop thread is alive
    error: str | None  # why the loop died
    num_unfinished: int


class AsyncEngine:
    def __init__(self, engine: Engine, *, start: bool = True) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._streams_lock = threading.Lock()
        self._ids = itertools.count()
        self._stop = False
        self._closed = False  # the loop thread has ended every stream: no new one may open (under _streams_lock)
        self._error: BaseException | None = None
        self._stats: EngineStats = engine.stats()
        self._thread = threading.Thread(target=self._run, name="xlaserve-engine", daemon=True)
        if start:
            self._thread.start()

    # -- API ------------------------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> OutputStream:
        """Queue a request; returns the async stream of its outputs. Must be called on a running
        event loop. Raises ValueError at once for a request that can never run."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        if (request.prompt is None) == (request.prompt_token_ids is None):
            raise ValueError("give exactly one of prompt and prompt_token_ids")
        if request.sampling_params is None:  # (the defaults, as Engine.add_request takes None)
            request = replace(request, sampling_params=SamplingParams())
        elif not isinstance(request.sampling_params, SamplingParams):
            raise TypeError(f"sampling_params is {type(request.sampling_params).__name__}, not SamplingParams")
        check_priority(request.priority)
        validate_cache_salt(request.cache_salt)
        if request.request_id is not None and not isinstance(request.request_id, str):
            raise ValueError(f"request_id must be a string or None, got {request.request_id!r}")
        text, ids = self.engine.prepare_prompt(
            request.prompt if request.prompt is not None else list(request.prompt_token_ids)
        )
        self.engine.validate(ids, request.sampling_params, request_id=request.request_id or "")
        q: asyncio.Queue = asyncio.Queue()
        with self._streams_lock:  # (the loop thread's last sweep takes it too: no stream opens after it)
            self._check_alive()
            rid = request.request_id
            if rid is None:
                rid = new_request_id("async-", self._ids, self._streams)
            elif rid in self._streams:
                raise ValueError(f"request id {rid!r} is already live")
            self._streams[rid] = (loop, q)
        self._send(("add", rid, text, ids, request))
        return OutputStream(self, rid, q)

    def cancel(self, request_id: str, *, stream: OutputStream | None = None) -> None:
        """Abort the request that has this id now, or with `stream` (what submit returned) only that
        stream's request, not a later one of the same id; its stream ends with finish_reason
        "abort". Unknown ids and finished requests are ignored."""
        self._send(("abort", request_id, None if stream is None else stream._q))

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine loop died: {self._error!r}")
        if self._stop or self._closed:
            raise EngineDeadError("the engine is shut down")

    def stats(self) -> EngineStats:
        """Engine statistics as of the last step (a snapshot the loop publishes)."""
        return self._stats

    def health(self) -> Health:
        running = self._thread.is_alive()
        return Health(
            healthy=running and self._error is None and not self._stop,
            running=running,
            error=None if self._error is None else repr(self._error),
            num_unfinished=len(self._streams),
        )

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the loop (open streams end with EngineDeadError) and wait for the thread."""
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- streams --------------------------------------------------------------------------------
    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _deliver(self, rid: str, item) -> None:
        with self._streams_lock:
            target = self._streams.get(rid)
            if target is not None and (isinstance(item, BaseException) or item.finished):
                del self._streams[rid]
        if target is not None:
            loop, q = target
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # that event loop is closed; nobody is listening
                pass

    # -- the loop thread ------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        failed = False  # the last step raised
        try:
            # The objects alive when serving starts stay out of the collector's way; the garbage
            # among them is collected first, or it would stay until shutdown.
            with frozen_heap(collect=True):
                while not self._stop:
                    self._drain()
                    if not engine.has_unfinished():
                        self._wake.wait()
                        self._wake.clear()
                        continue
                    try:
                        outputs = engine.step()
                    except Exception as e:
                        if failed:  # twice in a row: the engine cannot run (the loop dies)
                            raise
                        failed = True
                        logger.exception("an engine step failed; the requests in it end with its error")
                        for rid in engine.take_dropped():
                            err = EngineStepError(f"an engine step failed with this request in it: {e!r}")
                            err.__cause__ = e
                            self._deliver(rid, err)
                        self._stats = engine.stats()
                        continue
                    failed = False
                    self._stats = engine.stats()  # before delivery: a consumer sees stats at least this fresh
                    for out in outputs:
                        self._deliver(out.request_id, out)
        except BaseException as e:  # noqa: BLE001 - reported to every stream and to health()
            logger.exception("engine loop died")
            self._error = e
        finally:
            err = EngineDeadError(f"the engine loop stopped: {self._error!r}" if self._error else "the engine shut down")
            with self._streams_lock:
                self._closed = True
                rids = list(self._streams)
            for rid in rids:
                self._deliver(rid, err)
            # Nobody hears of those requests any more: they must not run on, nor hold their ids and
            # pages, in an engine a new AsyncEngine may drive. (An Engine whose step raised has
            # dropped them itself, runtime/engine.py, Failures; the other replicas of a
            # ReplicatedEngine have not, nor has an Engine interrupted while it waited.)
            try:
                for rid in rids:
                    engine.abort(rid)
                while engine.has_unfinished():  # the step in flight, and the aborts' last outputs
                    engine.step()
            except Exception:  # noqa: BLE001 - the streams have their error; this is the log's
                logger.exception("could not end the requests left when the loop stopped")

    def _drain(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, text, ids, req = cmd
                try:
                    self.engine.add_request(ids, req.sampling_params, request_id=rid, priority=req.priority,
                                            cache_salt=req.cache_salt, prompt_text=text)
                except Exception as e:  # only this request's stream hears of it; the loop serves the others
                    if not isinstance(e, (ValueError, TypeError)):  # (the request's own fault) a bug a check missed
                        logger.exception("request %r failed to queue", rid)
                        self.engine.abort(rid)  # whatever part of it was queued
                    self._deliver(rid, e)
            elif cmd[0] == "abort":
                _, rid, q = cmd
                if q is not None:  # a stream's own request, unless that one has finished (the id is free)
                    with self._streams_lock:
                        target = self._streams.get(rid)
                    if target is None or target[1] is not q:
                        continue
                self.engine.abort(rid)


class OutputStream:
    """The outputs of one submitted request (AsyncEngine.submit): `async for out in stream`.
    cancel() aborts this request; so does a stream closed, dropped or cancelled while waiting
    before its last output, also one never read."""

    def __init__(self, engine: AsyncEngine, request_id: str, q: asyncio.Queue) -> None:
        self.request_id = request_id
        self._engine, self._q = engine, q
        self._done = False  # the last output (or the error) was taken, or the request was let go

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._q.get()
        except BaseException:  # the consumer was cancelled while waiting (a client disconnect)
            self._let_go()
            raise
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    async def aclose(self) -> None:
        self._let_go()

    def cancel(self) -> None:
        self._engine.cancel(self.request_id, stream=self)

    def _let_go(self) -> None:
        if not self._done:
            self._done = True
            self._engine._send(("abort", self.request_id, self._q))

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # (at interpreter exit the engine may be gone)
            self._let_go()
