"""Serving test fixtures: the real engine on stories260K (llama2.c, with its tok512 tokenizer),
compiled once per session, served by in-process HTTP + gRPC servers on ephemeral loopback ports.

Each LiveServer runs a ServingApp on its own event loop in a thread, around its own AsyncEngine
(engine loop thread) over the shared, warmed-up Engine. Stopping it drains, joins the engine
loop, and then checks on the quiet engine that every KV page is free.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path

import pytest

from tests.testing.data import shared_data_dir

# A plain chat format for a model that has none: BOS, "role: content" lines, then the assistant cue.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
MODEL_NAME = "stories260K"
ENGINE_SETTINGS = dict(max_num_seqs=16, max_num_batched_tokens=128, max_model_len=256, token_buckets=(16, 128),
                       seq_buckets=(16,), progress=False, strict_compile=True, seed=0)


@pytest.fixture(scope="session")
def stories_path() -> Path:
    p = shared_data_dir() / "stories260k" / "stories260K.bin"
    if not p.is_file():
        pytest.skip(f"{p} is missing")
    return p


@pytest.fixture(scope="session")
def engine(stories_path):
    """The synchronous Engine (compiled once); servers wrap it in their own AsyncEngine."""
    from runtime.checkpoint import load_model
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.tokenizer import load_tokenizer

    loaded = load_model(stories_path, progress=False)
    tok = load_tokenizer(loaded.tokenizer_path)
    eng = Engine(loaded, EngineConfig(**ENGINE_SETTINGS), tokenizer=tok)
    yield eng
    eng.close()


def assert_all_pages_free(engine) -> None:
    engine.check_invariants()
    alloc = engine.scheduler.allocator
    assert not engine.has_unfinished(), "the engine still has unfinished work"
    assert alloc.num_referenced == 0, f"{alloc.num_referenced} KV pages are still referenced"
    assert alloc.num_free + alloc.num_cached == engine.config.num_pages


@contextlib.contextmanager
def steps_held_until_cancel(server, timeout_s: float = 30.0):
    """Within the block the engine makes no step; on leaving it, the test waits until the server has
    cancelled an engine request (a client went away), then lets steps go on. A request sent inside
    the block therefore cannot finish before its client gives up, however fast the machine is."""
    gate, cancelled = threading.Event(), threading.Event()
    engine, async_engine = server.engine, server.core.engine
    step, cancel = engine.step, async_engine.cancel

    def held_step(*args, **kwargs):
        gate.wait(60)
        return step(*args, **kwargs)

    def noted_cancel(request_id, **kwargs):
        cancel(request_id, **kwargs)
        cancelled.set()

    engine.step, async_engine.cancel = held_step, noted_cancel  # instance attributes over the methods
    try:
        yield
        assert cancelled.wait(timeout_s), "the server never cancelled the request of a client that went away"
    finally:
        gate.set()
        del engine.step, async_engine.cancel


class LiveServer:
    def __init__(self, engine, **server_settings) -> None:
        from serving.config import ServerConfig

        settings = dict(host="127.0.0.1", port=0, grpc_port=0, chat_template=CHAT_TEMPLATE, status_interval_s=0)
        settings.update(server_settings)
        self.engine = engine
        self.config = ServerConfig(**settings)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.app = None
        self.aborted_at_stop = 0
        self._thread = threading.Thread(target=self._main, name="test-server", daemon=True)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> LiveServer:
        self._thread.start()
        self._ready.wait(120)
        if self._error is not None:
            raise self._error
        assert self._ready.is_set(), "the test server did not start"
        return self

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as e:  # noqa: BLE001 - surfaced to the test
            self._error = e
            self._ready.set()

    async def _serve(self) -> None:
        from runtime.async_engine import AsyncEngine
        from serving.server import ServingApp

        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.app = ServingApp(self.config, MODEL_NAME)
        await self.app.start()
        self.app.attach(AsyncEngine(self.engine), tokenizer=self.engine.tokenizer, source="stories260K.bin")
        self._ready.set()
        await self._stop.wait()
        self.aborted_at_stop = await self.app.shutdown(drain_timeout_s=self._drain_timeout)

    def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Drain, stop both servers and the engine loop; then every page must be free."""
        if self.loop is None:
            return
        self._drain_timeout = drain_timeout_s
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)
        assert not self._thread.is_alive(), "the test server did not stop"
        if self._error is not None:
            raise self._error
        assert_all_pages_free(self.engine)

    def call(self, coro, timeout: float = 60.0):
        """Run a coroutine on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    # -- addresses ------------------------------------------------------------------------------
    @property
    def core(self):
        return self.app.core

    @property
    def http_url(self) -> str:
        return f"{self.app.scheme}://127.0.0.1:{self.app.http_port}"

    @property
    def base_url(self) -> str:
        return self.http_url + "/v1"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.app.grpc_port}"


@pytest.fixture(scope="module")
def server(engine):
    s = LiveServer(engine).start()
    yield s
    s.stop()
