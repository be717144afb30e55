"""`xlaserve serve`: the HTTP and gRPC servers on one engine, in one event loop.

Start-up order: bind both ports first (health answers NOT_SERVING / 503 "warming up"), then load
the model and compile every bucket in a worker thread (progress bars on stderr), then attach the
engine and report SERVING. SIGTERM or SIGINT drains: health turns NOT_SERVING, new requests get
UNAVAILABLE / 503, in-flight requests finish for up to drain_timeout_s, the rest are aborted,
then the servers stop and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import ssl
import sys
import threading
import time
from pathlib import Path

import uvicorn

from serving.auth import APIKeyChecker
from serving.config import ServerConfig, ServeSettings, host_port
from serving.core import ServingCore
from serving.errors import BindError
from serving.grpc_server import GrpcServer
from serving.http_server import build_app

logger = logging.getLogger("xlaserve.serve")


class _Uvicorn(uvicorn.Server):
    # The serving app owns SIGTERM (it drains first); uvicorn must not install its own handlers.
    @contextlib.contextmanager
    def capture_signals(self):
        yield


def _bind(host: str, port: int, what: str = "HTTP") -> socket.socket:
    try:
        return _listen(host, port)
    except OSError as e:  # (socket.gaierror too: a host name that does not resolve)
        raise BindError(f"cannot bind the {what} port {host_port(host, port)}: {e.strerror or e}") from None


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on transports whose socket
    # says so, and accepted sockets take the listener's proto. With Nagle on, every response's second
    # small write (a stream's first SSE event, a reply's body after its headers) waited for the
    # client's delayed ACK: ~40 ms on each request of a kept-alive connection (docs/serving.md).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)  # connections queue in the kernel from now on, before uvicorn accepts them
    sock.setblocking(False)
    return sock


class ServingApp:
    """Both servers over one ServingCore. `await start()` binds; `attach(...)` serves an engine."""

    def __init__(self, config: ServerConfig, model_name: str) -> None:
        self.config = config
        self.core = ServingCore(config, model_name)
        keys = APIKeyChecker(config.api_keys)
        self.grpc = GrpcServer(self.core, config, keys) if config.grpc_port is not None else None
        self.app = build_app(self.core, keys, allowed_origins=config.allowed_origins)
        self._http: _Uvicorn | None = None
        self._http_task: asyncio.Task | None = None
        self.http_port: int | None = None
        self.grpc_port: int | None = None
        self.engine = None
        self._status_task: asyncio.Task | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.config.tls else "http"

    async def start(self) -> None:
        """Bind both ports; BindError (nothing left open) when either cannot be bound."""
        cfg = self.config
        # The HTTP socket first: a plain socket closes cleanly if gRPC then fails, while a started
        # gRPC server left behind by a failed HTTP bind outlived the event loop ("Event loop is closed").
        sock = _bind(cfg.host, cfg.port) if cfg.port is not None else None
        if self.grpc is not None:
            try:
                # a plain socket first: gRPC's own failure says only "could not bind" (after logging
                # a C++ error line), a socket's says why
                _bind(cfg.host, cfg.grpc_port, "gRPC").close()
                self.grpc_port = await self.grpc.start()  # (BindError if taken in between)
            except BaseException:
                if sock is not None:
                    sock.close()
                raise
            logger.info("gRPC listening on %s%s", host_port(cfg.host, self.grpc_port), " (TLS)" if cfg.tls else "")
        if sock is not None:
            self.http_port = sock.getsockname()[1]
            ucfg = uvicorn.Config(
                self.app, lifespan="off", log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                ssl_certfile=cfg.tls_certfile, ssl_keyfile=cfg.tls_keyfile, ssl_ca_certs=cfg.tls_ca_certfile,
                ssl_cert_reqs=ssl.CERT_REQUIRED if cfg.tls_ca_certfile else ssl.CERT_NONE)
            self._http = _Uvicorn(ucfg)
            self._http_task = asyncio.create_task(self._http.serve(sockets=[sock]), name="http-server")
            logger.info("HTTP listening on %s://%s:%d", self.scheme, cfg.host, self.http_port)

    def attach(self, engine, *, tokenizer=None, source: str = "") -> None:
        """Serve `engine` (a runtime.async_engine.AsyncEngine); health turns SERVING."""
        self.engine = engine
        self.core.attach(engine, tokenizer=tokenizer, source=source, chat_template=self.config.chat_template_text)
        if self.config.status_interval_s > 0:
            self._status_task = asyncio.create_task(self._status_loop(), name="status-log")
        logger.info("serving %r", self.core.model_name)

    async def shutdown(self, *, drain_timeout_s: float | None = None, stop_engine: bool = True) -> int:
        """Drain (see module docstring), stop both servers, stop the engine. Returns how many
        requests were aborted when the drain timed out."""
        aborted = 0
        if self.engine is not None:
            aborted = await self.core.drain(drain_timeout_s)
        self.core.stop()
        if self._status_task is not None:
            self._status_task.cancel()
        if self.grpc is not None:
            await self.grpc.stop(grace=1.0)
        if self._http is not None:
            self._http.should_exit = True
            await self._http_task
        if stop_engine and self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)
        return aborted

    async def _status_loop(self) -> None:
        last_tokens, last_t = None, time.monotonic()
        while True:
            await asyncio.sleep(self.config.status_interval_s)  # a period, not a synchronization
            s = self.engine.stats()
            now = time.monotonic()
            rate = 0.0 if last_tokens is None else (s.generated_tokens - last_tokens) / (now - last_t)
            last_tokens, last_t = s.generated_tokens, now
            logger.info("running %d | waiting %d | KV %.1f%% | prefix hit %.1f%% | %.1f tok/s | in flight %d",
                        s.num_running, s.num_waiting, 100 * s.kv_usage,
                        100 * (s.prefix_cache_hit_tokens / s.prefix_cache_query_tokens
                               if s.prefix_cache_query_tokens else 0.0), rate, self.core.in_flight)


def default_model_name(model: str) -> str:
    p = Path(model)
    if p.suffix in (".gguf", ".bin"):
        return p.stem
    return p.name or model


def build_engine(settings: ServeSettings, model: str):
    """Load the model and tokenizer and build a warmed-up AsyncEngine (blocking: run it in a
    worker thread). Returns (async_engine, tokenizer, source)."""
    from runtime.async_engine import AsyncEngine
    from runtime.checkpoint import load_model
    from runtime.replicas import make_engine
    from runtime.tokenizer import load_tokenizer

    config = settings.engine_config()
    # a --tokenizer first: a wrong path fails before the model loads
    tokenizer = load_tokenizer(settings.tokenizer) if settings.tokenizer is not None else None
    loaded = load_model(model, mesh=config.mesh.make_mesh(), dtype=config.dtype, seed=config.seed,
                        progress=config.progress)
    if tokenizer is None and loaded.tokenizer_path is not None:
        tokenizer = load_tokenizer(loaded.tokenizer_path)
    # refuses a tokenizer with more tokens than the model has rows, before compiling
    engine = make_engine(loaded, config, tokenizer=tokenizer)  # compiles every bucket (progress bar)
    return AsyncEngine(engine), engine.tokenizer, str(loaded.source)


_LOAD_THREAD = "xlaserve-load"


def run(settings: ServeSettings, model: str) -> int:
    """`xlaserve serve`: serve until SIGTERM/SIGINT; returns the exit code."""
    # bad engine settings, and a mesh of more devices than the machine has, fail now, before the ports are bound
    settings.engine_config().mesh.make_mesh()
    rc = asyncio.run(serve(settings, model))
    if any(t.name == _LOAD_THREAD and t.is_alive() for t in threading.enumerate()):
        # Stopped mid-load: XLA is still compiling in that thread, and interpreter shutdown would
        # tear it down with an abort. Nothing is left to clean up: leave at once.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


def _in_daemon_thread(fn, *args) -> asyncio.Future:
    """fn(*args) in a daemon thread: unlike asyncio.to_thread, a process stopped mid-load (SIGTERM
    during a long compile) does not wait for it at exit."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result, error) -> None:
        if not fut.done():
            fut.set_exception(error) if error is not None else fut.set_result(result)

    def work() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the event loop
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is gone: the server stopped while loading
            pass

    threading.Thread(target=work, name=_LOAD_THREAD, daemon=True).start()
    return fut


async def serve(settings: ServeSettings, model: str) -> int:
    """Run until SIGTERM/SIGINT, then drain and exit. Returns the process exit code."""
    cfg = settings.server
    app = ServingApp(cfg, cfg.served_model_name or default_model_name(model))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await app.start()
    load = _in_daemon_thread(build_engine, settings, model)
    await asyncio.wait({load, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
    if not load.done():  # stopped while loading (compiling can take minutes): nothing is in flight
        logger.info("stopping before the model finished loading")
        await app.shutdown()
        return 0
    try:
        engine, tokenizer, source = load.result()
    except BaseException:
        await app.shutdown()
        raise
    app.attach(engine, tokenizer=tokenizer, source=source)
    logger.info("ready: HTTP port %s, gRPC port %s", app.http_port, app.grpc_port)
    await stop.wait()
    logger.info("signal received: draining (up to %.1f s)", cfg.drain_timeout_s)
    aborted = await app.shutdown()
    logger.info("stopped (%d requests aborted at the drain timeout)", aborted)
    return 0
