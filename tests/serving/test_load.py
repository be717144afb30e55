"""Load and faults on CPU: 200 concurrent streams over HTTP and gRPC with mixed lengths, 20% of them
dropped mid-stream, a burst that overflows the waiting queue, invalid requests; then the server is
healthy and, once drained, every KV page is free. Also: a drain that times out aborts what is left."""

from __future__ import annotations

import asyncio
import json
import random
import threading

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.protos import xlaserve_pb2 as pb
from serving.protos import xlaserve_pb2_grpc as pb_grpc
from tests.serving.conftest import MODEL_NAME, LiveServer

N_STREAMS, N_HTTP = 200, 150
BURST_PER_PROTOCOL, BURST_PROMPT = 80, 220
MAX_WAITING_TOKENS = 14000  # holds the 200 streams' prompts (<= 60 tokens each), not the burst too


def sse_payloads(lines: list[str]) -> list:
    return ["[DONE]" if ln == "data: [DONE]" else json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]


class Workload:
    def __init__(self, server: LiveServer, seed: int) -> None:
        self.s = server
        self.rng = random.Random(seed)
        self.accepted = 0
        self.all_accepted = asyncio.Event()
        self.results: dict[str, list] = {"complete": [], "cancelled": [], "overloaded": [], "invalid": []}

    def _prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(3, 512) for _ in range(n)]

    def _accepted(self) -> None:
        self.accepted += 1
        if self.accepted == N_STREAMS:
            self.all_accepted.set()

    async def http_stream(self, client: httpx.AsyncClient, prompt, max_tokens: int, cancel_after: int | None,
                          count: bool = True) -> None:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code == 429:
                assert int(r.headers["retry-after"]) >= 1
                err = json.loads(await r.aread())["error"]
                assert err["type"] == "rate_limit_error" and "max_waiting_tokens" in err["message"]
                self.results["overloaded"].append("http")
                return
            assert r.status_code == 200, await r.aread()
            if count:
                self._accepted()
            lines, chunks = [], 0
            async for line in r.aiter_lines():
                lines.append(line)
                if line.startswith("data: {"):
                    chunks += 1
                    if cancel_after is not None and chunks >= cancel_after:
                        self.results["cancelled"].append("http")
                        return  # leaving the block closes the connection mid-stream
        events = sse_payloads(lines)
        assert events[-1] == "[DONE]", events[-3:]
        usage = events[-2]["usage"]
        finals = [e["choices"][0]["finish_reason"] for e in events[:-2]]
        assert finals[-1] == "length" and all(f is None for f in finals[:-1])
        assert usage["completion_tokens"] == max_tokens and usage["prompt_tokens"] == len(prompt)
        self.results["complete"].append("http")

    async def grpc_stream(self, stub, prompt, max_tokens: int, cancel_after: int | None, count: bool = True) -> None:
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
            temperature=0.8, max_tokens=max_tokens, ignore_eos=True))
        call = stub.Generate(req, timeout=120)
        try:
            await call.initial_metadata()
            if count:
                self._accepted()
            ids, last = [], None
            async for r in call:
                last = r
                ids += [t for d in r.outputs for t in d.token_ids]
                if cancel_after is not None and len(ids) >= cancel_after:
                    call.cancel()
                    self.results["cancelled"].append("grpc")
                    return
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                assert "max_waiting_tokens" in e.details()
                self.results["overloaded"].append("grpc")
                return
            raise
        assert last.finished and len(ids) == max_tokens == last.usage.completion_tokens
        assert last.outputs[-1].finish_reason == pb.FINISH_REASON_LENGTH
        self.results["complete"].append("grpc")


async def run_load(server: LiveServer) -> Workload:
    w = Workload(server, seed=1234)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=50)
    async with httpx.AsyncClient(base_url=server.http_url, limits=limits, timeout=120) as client, \
            grpc.aio.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        tasks = []
        for i in range(N_STREAMS):
            prompt = w._prompt(w.rng.randint(4, 60))
            max_tokens = w.rng.randint(4, 40)
            cancel_after = 1 + i % 3 if i % 5 == 0 else None  # 20% dropped after 1-3 chunks
            if i < N_HTTP:
                tasks.append(w.http_stream(client, prompt, max_tokens, cancel_after))
            else:
                tasks.append(w.grpc_stream(stub, prompt, max_tokens, cancel_after))
        streams = asyncio.gather(*tasks)

        async def burst():
            await w.all_accepted.wait()  # the 200 are queued: the burst must not take their room
            jobs = []
            for _ in range(BURST_PER_PROTOCOL):
                jobs.append(w.http_stream(client, w._prompt(BURST_PROMPT), 4, None, count=False))
                jobs.append(w.grpc_stream(stub, w._prompt(BURST_PROMPT), 4, None, count=False))
            await asyncio.gather(*jobs)

        async def invalid():
            r = await client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "temperature": -1})
            assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
            w.results["invalid"].append("http")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.ModelInfo(pb.ModelInfoRequest())  # a valid call first, then an invalid one
                async for _ in stub.Generate(pb.GenerateRequest(text="x", sampling=pb.SamplingParams(top_p=2.0))):
                    pass
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in e.value.details()
            w.results["invalid"].append("grpc")

        await asyncio.wait_for(asyncio.gather(streams, burst(), invalid()), 240)
    return w


def test_load_with_cancellations_overflow_and_invalid_requests(engine):
    server = LiveServer(engine, max_waiting_requests=1000, max_waiting_tokens=MAX_WAITING_TOKENS).start()
    try:
        w = asyncio.run(run_load(server))
        res = {k: len(v) for k, v in w.results.items()}
        assert res["cancelled"] == 40 and res["invalid"] == 2
        assert res["complete"] + res["overloaded"] == N_STREAMS - 40 + 2 * BURST_PER_PROTOCOL
        # Each protocol saw the queue overflow (far more burst tokens than the bound allows).
        assert w.results["overloaded"].count("http") >= 1 and w.results["overloaded"].count("grpc") >= 1
        # Still healthy, and serving.
        assert httpx.get(server.http_url + "/health").json() == {"status": "ok"}
        with grpc.insecure_channel(server.grpc_target) as ch:
            assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest()).status == \
                health_pb2.HealthCheckResponse.SERVING
        r = httpx.post(server.base_url + "/completions", timeout=60,
                       json={"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        server.call(server.core.wait_idle(), timeout=60)
        adm = server.core.admission
        assert (adm.waiting_requests, adm.waiting_tokens) == (0, 0)
        assert server.engine.stats().num_compiles_after_warmup == 0
    finally:
        server.stop()  # drains, joins the engine loop, asserts every KV page is free


def test_drain_timeout_aborts_in_flight_requests(engine):
    server = LiveServer(engine).start()
    stopper = None
    try:
        async def streams():
            nonlocal stopper
            async with httpx.AsyncClient(base_url=server.http_url, timeout=60) as client:
                started = asyncio.Semaphore(0)

                async def one():
                    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 240,
                            "ignore_eos": True, "stream": True}
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        lines = []
                        async for line in r.aiter_lines():
                            if not lines:
                                started.release()
                            lines.append(line)
                    return sse_payloads(lines)

                tasks = [asyncio.create_task(one()) for _ in range(4)]
                for _ in tasks:
                    await started.acquire()
                stopper = threading.Thread(target=server.stop, kwargs=dict(drain_timeout_s=0.2))
                stopper.start()
                return await asyncio.gather(*tasks)

        results = asyncio.run(streams())
        stopper.join(60)
        for events in results:
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "abort"
        assert server.aborted_at_stop == 4
    finally:
        if stopper is None:
            server.stop()
