"""`xlaserve serve` as a subprocess: SIGTERM during load finishes in-flight requests, refuses new
ones (health 503), and exits 0 within the drain timeout."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import yaml

from tests.serving.conftest import CHAT_TEMPLATE, ENGINE_SETTINGS, MODEL_NAME
from tests.testing.data import REPO_ROOT

DRAIN_TIMEOUT = 30.0
STATUS_LINE = re.compile(r"running \d+ \| waiting \d+ \| KV [\d.]+% \| prefix hit [\d.]+% \| [\d.]+ tok/s")

# `xlaserve serve` with the engine's steps held while the file argv[1] exists, once NUM_STREAMS requests
# have had an output: their streams stay in flight until the test removes the file, however fast the machine.
NUM_STREAMS = 4
HELD_SERVE = f"""
import os, sys, time
from runtime.engine import Engine
from xlaserve.cli import main

gate, step, seen = sys.argv.pop(1), Engine.step, set()

def held_step(self, *args, **kwargs):
    while len(seen) >= {NUM_STREAMS} and os.path.exists(gate):
        time.sleep(0.005)
    outputs = step(self, *args, **kwargs)
    seen.update(o.request_id for o in outputs)
    return outputs

Engine.step = held_step
sys.exit(main())
"""


def _read_ports(proc: subprocess.Popen, log: list[str], draining: threading.Event, timeout: float = 180.0,
                status: threading.Event | None = None) -> int:
    """Read the server's stderr until it reports ready; returns the HTTP port. A reader thread
    keeps collecting lines afterwards (so the pipe never fills), sets `draining` when the server
    says it started draining and `status` at its first status line."""
    ready = threading.Event()
    port: list[int] = []

    def reader() -> None:
        for line in proc.stderr:
            log.append(line)
            m = re.search(r"ready: HTTP port (\d+), gRPC port (\d+)", line)
            if m:
                port.append(int(m.group(1)))
                ready.set()
            if "signal received: draining" in line:
                draining.set()
            if status is not None and STATUS_LINE.search(line):
                status.set()
        ready.set()
        draining.set()
        if status is not None:
            status.set()

    threading.Thread(target=reader, daemon=True).start()
    assert ready.wait(timeout) and port, "server did not become ready:\n" + "".join(log[-30:])
    return port[0]


def test_sigterm_drains_in_flight_requests(stories_path, tmp_path):
    engine = {k: list(v) if isinstance(v, tuple) else v for k, v in ENGINE_SETTINGS.items()}
    engine.update(progress=True, strict_compile=False)
    cfg = {"model": str(stories_path),
           "server": {"host": "127.0.0.1", "port": 0, "grpc_port": 0, "served_model_name": MODEL_NAME,
                      "chat_template": CHAT_TEMPLATE, "drain_timeout_s": DRAIN_TIMEOUT, "status_interval_s": 0.5},
           "engine": engine}
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)  # one device is enough
    gate = tmp_path / "hold-steps"
    gate.touch()
    proc = subprocess.Popen([sys.executable, "-c", HELD_SERVE, str(gate), "serve", "--config", str(tmp_path / "serve.yaml")],
                            cwd=REPO_ROOT, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    log: list[str] = []
    try:
        draining, status = threading.Event(), threading.Event()
        port = _read_ports(proc, log, draining, status=status)
        # the periodic status line (every 0.5 s, idle too): the streams below may end sooner than that
        assert status.wait(30), "no status line:\n" + "".join(log[-30:])
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(base + "/health").status_code == 200
        results: dict[int, list] = {}
        first_chunk = threading.Barrier(NUM_STREAMS + 1)

        def stream(i: int) -> None:
            body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 200 + i, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            events, passed = [], False
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if not passed:
                            passed = True
                            first_chunk.wait(60)
            results[i] = events

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(NUM_STREAMS)]
        for t in threads:
            t.start()
        first_chunk.wait(60)  # every stream has its first token: the requests are in flight
        t_term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        # While draining: not healthy, and new work is refused (the streams are held with ~200 tokens to go).
        assert draining.wait(30)
        h = httpx.get(base + "/health", timeout=5)
        assert h.status_code == 503 and h.json() == {"status": "draining"}
        r = httpx.post(base + "/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
        assert proc.poll() is None and not results, "the server stopped before its streams ended"
        gate.unlink()  # the engine steps again: the drain waits for every stream to end
        for t in threads:
            t.join(60)
        rc = proc.wait(DRAIN_TIMEOUT + 15)
        elapsed = time.monotonic() - t_term
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0, "".join(log[-30:])
    assert elapsed < DRAIN_TIMEOUT + 10
    for i, events in results.items():
        assert events[-1] == "[DONE]"
        *chunks, usage = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length", f"stream {i} did not complete"
        # the whole completion arrived (a chunk carries up to decode_steps tokens: serve's bursts)
        assert usage["usage"]["completion_tokens"] == 200 + i and not usage["choices"]
    text = "".join(log)
    assert "draining" in text and "stopped (0 requests aborted" in text
    assert STATUS_LINE.search(text)


def test_health_during_warmup_and_sigterm_while_loading(stories_path):
    """Ports are bound before the model is loaded: health says "warming up" (HTTP 503, gRPC
    NOT_SERVING), requests and /v1/models get 503; SIGTERM then exits 0 at once, without waiting for the compile."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)
    # Default buckets: 20+ programs to compile, so the server is still warming up below.
    proc = subprocess.Popen([sys.executable, "-m", "xlaserve", "serve", "--model", str(stories_path), "--port", "0",
                             "--grpc-port", "0", "--served-model-name", MODEL_NAME],
                            cwd=REPO_ROOT, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    log: list[str] = []
    try:
        ports = {}
        for line in proc.stderr:
            log.append(line)
            for kind in ("HTTP", "gRPC"):
                m = re.search(kind + r" listening on \S*?127\.0\.0\.1:(\d+)", line)
                if m:
                    ports[kind] = int(m.group(1))
            if len(ports) == 2:
                break
        assert len(ports) == 2, "".join(log)
        base = f"http://127.0.0.1:{ports['HTTP']}"
        h = httpx.get(base + "/health", timeout=5)
        assert h.status_code == 503 and h.json() == {"status": "warming up"}
        r = httpx.post(base + "/v1/completions", json={"model": MODEL_NAME, "prompt": "x"}, timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "warming_up"
        for route in ("/v1/models", "/v1/models/" + MODEL_NAME):  # (clients poll these for readiness)
            r = httpx.get(base + route, timeout=5)
            assert r.status_code == 503 and r.json()["error"]["code"] == "warming_up", route
        with grpc.insecure_channel(f"127.0.0.1:{ports['gRPC']}") as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
        assert rc == 0 and time.monotonic() - t0 < 15
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
