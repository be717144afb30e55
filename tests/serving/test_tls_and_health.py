"""TLS for HTTP and gRPC (and mTLS), and health when the engine loop is gone or makes no step."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.protos import xlaserve_pb2 as pb
from serving.protos import xlaserve_pb2_grpc as pb_grpc
from tests.serving.conftest import MODEL_NAME, LiveServer


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=xlaserve test CA", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", "san.ext", cwd=d)
    return d


def test_tls_and_mtls(engine, pki):
    s = LiveServer(engine, tls_certfile=str(pki / "server.pem"), tls_keyfile=str(pki / "server.key"),
                   tls_ca_certfile=str(pki / "ca.pem")).start()
    try:
        assert s.http_url.startswith("https://")
        ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        ctx.load_cert_chain(str(pki / "client.pem"), str(pki / "client.key"))
        body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 3}
        r = httpx.post(s.base_url + "/completions", json=body, verify=ctx, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        with pytest.raises(httpx.TransportError):  # no client certificate: refused by mTLS
            httpx.post(s.base_url + "/completions", json=body,
                       verify=ssl.create_default_context(cafile=str(pki / "ca.pem")), timeout=30)
        with pytest.raises(httpx.TransportError):  # plain HTTP on the TLS port
            httpx.get(f"http://127.0.0.1:{s.app.http_port}/health", timeout=5)

        creds = grpc.ssl_channel_credentials(root_certificates=(pki / "ca.pem").read_bytes(),
                                             private_key=(pki / "client.key").read_bytes(),
                                             certificate_chain=(pki / "client.pem").read_bytes())
        with grpc.secure_channel(s.grpc_target, creds) as ch:
            out = list(pb_grpc.GenerationStub(ch).Generate(
                pb.GenerateRequest(text="Once upon a time", sampling=pb.SamplingParams(max_tokens=3)), timeout=30))
            assert out[-1].usage.completion_tokens == 3
        no_cert = grpc.ssl_channel_credentials(root_certificates=(pki / "ca.pem").read_bytes())
        with grpc.secure_channel(s.grpc_target, no_cert) as ch:
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.GenerationStub(ch).ModelInfo(pb.ModelInfoRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        s.stop()


def test_health_fails_when_the_engine_loop_is_gone(engine):
    s = LiveServer(engine).start()
    try:
        assert httpx.get(s.http_url + "/health").status_code == 200
        s.app.engine.shutdown()  # the engine loop thread stops
        h = httpx.get(s.http_url + "/health")
        assert h.status_code == 503 and "engine loop is not running" in h.json()["status"]
        r = httpx.post(s.base_url + "/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        with grpc.insecure_channel(s.grpc_target) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest()).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert not pb_grpc.OrchestratorStub(ch).HealthCheck(pb.HealthCheckRequest()).is_live
            with pytest.raises(grpc.RpcError) as e:
                list(pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(text="x"), timeout=10))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        s.stop()


def _poll_health(s, status_code: int, timeout_s: float = 30.0) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while True:
        h = httpx.get(s.http_url + "/health", timeout=10)
        if h.status_code == status_code or time.monotonic() > deadline:
            return h
        time.sleep(0.05)


def test_health_fails_while_the_engine_makes_no_step(engine, monkeypatch):
    """A request in flight and no engine step for health_stall_s: /health answers 503 naming the
    stall, gRPC health NOT_SERVING. Once steps resume, health is back to 200 and the request
    completes. An idle engine is never stalled, however long it waits."""
    gate = threading.Event()
    step = engine.step

    def stalled_step():
        gate.wait(60)
        return step()

    s = LiveServer(engine, health_stall_s=0.3).start()
    try:
        for _ in range(2):  # the first check notes the step count; the second comes after health_stall_s idle
            assert httpx.get(s.http_url + "/health").status_code == 200
            time.sleep(0.5)
        monkeypatch.setattr(engine, "step", stalled_step)
        with ThreadPoolExecutor(1) as pool:
            body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 4}
            pending = pool.submit(httpx.post, s.base_url + "/completions", json=body, timeout=60)
            h = _poll_health(s, 503)
            assert h.status_code == 503 and "engine made no step" in h.json()["status"], h.text
            with grpc.insecure_channel(s.grpc_target) as ch:
                status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest()).status
                assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            gate.set()
            r = pending.result(60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert _poll_health(s, 200).status_code == 200
    finally:
        gate.set()
        s.stop()


def test_a_failed_step_is_a_500_and_the_server_serves_on(engine, monkeypatch):
    """A step that raised took the engine loop down, and the server with it (every later request
    a 503). Now the requests in that step get a 500 (code step_failed), counted as failures of
    reason "error", and the next request runs."""
    from tests.testing.engine import FailingExecutor

    s = LiveServer(engine).start()
    try:
        monkeypatch.setattr(engine, "executor",
                            FailingExecutor(engine.executor, "raise", times=1, error=RuntimeError("injected")))
        body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 4}
        r = httpx.post(s.base_url + "/completions", json=body, timeout=60)
        assert r.status_code == 500 and r.json()["error"]["code"] == "step_failed"
        assert "injected" in r.json()["error"]["message"]
        r = httpx.post(s.base_url + "/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert httpx.get(s.http_url + "/health").status_code == 200
        metrics = httpx.get(s.http_url + "/metrics").text
        assert f'xlaserve:request_failure_total{{model_name="{MODEL_NAME}",reason="error"}} 1.0' in metrics
    finally:
        s.stop()
        monkeypatch.undo()
    assert not engine.has_unfinished()
    engine.check_invariants()
