"""Serving benchmark: send a workload to a running `xlaserve serve` over HTTP (OpenAI completions API)
or gRPC, at a request rate (Poisson arrivals) and/or a concurrency cap, and report TTFT, TPOT, ITL and
end-to-end latency (mean, p50, p90, p99), throughput, and goodput under SLOs.

    python scripts/bench_serving.py --backend openai --port 8000 --num-prompts 200 --request-rate 8 \
        --input-len 128 --output-len 64 --slo-ttft-ms 500 --slo-tpot-ms 50
    python scripts/bench_serving.py --backend grpc --grpc-port 50051 --sweep-rates 1,2,4,8,inf \
        --plot latency.png --json-out results.json

Prompts are random token ids (exact input lengths, no tokenizer needed on the client), lengths
drawn uniformly in [len * (1 - range_ratio), len * (1 + range_ratio)]; outputs are forced to their
length with ignore_eos. Definitions: TTFT = send -> first token (with --max-concurrency a request is
sent when a slot frees, so its wait in the client's queue is not counted, as in vLLM's benchmark); TPOT = (e2e - TTFT) / (tokens - 1)
per request; ITL = every gap between consecutive token chunks; goodput = completed requests per
second that met every SLO given. Prints a table and writes JSON (--json-out); --plot draws p50/p99
TTFT and TPOT against output throughput over the swept rates.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Result:
    ok: bool
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


def make_workload(n: int, input_len: int, output_len: int, range_ratio: float, vocab: tuple[int, int],
                  rng: random.Random) -> list[tuple[list[int], int]]:
    def draw(x: int) -> int:
        lo, hi = max(1, int(x * (1 - range_ratio))), max(1, int(x * (1 + range_ratio)))
        return rng.randint(lo, hi)

    return [([rng.randrange(*vocab) for _ in range(draw(input_len))], draw(output_len)) for _ in range(n)]


# -- clients -------------------------------------------------------------------------------------
class HttpClient:
    def __init__(self, args) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.client = httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=args.timeout,
                                        limits=httpx.Limits(max_connections=None), verify=not args.insecure)
        self.model = args.model

    async def model_name(self) -> str:
        if self.model is None:
            r = await self.client.get("/v1/models")
            r.raise_for_status()
            self.model = r.json()["data"][0]["id"]
        return self.model

    async def request(self, prompt: list[int], max_tokens: int) -> Result:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
        res = Result(ok=False, prompt_len=len(prompt))
        t0 = time.perf_counter()
        last = None
        try:
            async with self.client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    return res
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        res.error = chunk["error"]["message"]
                        return res
                    if chunk.get("usage"):
                        res.output_len = chunk["usage"]["completion_tokens"]
                    if chunk["choices"]:
                        now = time.perf_counter()
                        if last is None:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last = now
        except Exception as e:  # noqa: BLE001 - a failed request is a data point, not a crash
            res.error = repr(e)
            return res
        res.e2e = time.perf_counter() - t0
        res.ok = last is not None
        return res

    async def close(self) -> None:
        await self.client.aclose()


class GrpcClient:
    def __init__(self, args) -> None:
        import grpc

        from serving.protos import xlaserve_pb2 as pb
        from serving.protos import xlaserve_pb2_grpc as pb_grpc

        self.pb, self.grpc = pb, grpc
        if args.tls_ca:
            with open(args.tls_ca, "rb") as f:
                creds = grpc.ssl_channel_credentials(root_certificates=f.read())
            self.channel = grpc.aio.secure_channel(args.grpc_target, creds)
        else:
            self.channel = grpc.aio.insecure_channel(args.grpc_target)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.metadata = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else ()
        self.timeout = args.timeout

    async def model_name(self) -> str:
        return (await self.stub.ModelInfo(self.pb.ModelInfoRequest(), metadata=self.metadata)).model

    async def request(self, prompt: list[int], max_tokens: int) -> Result:
        pb = self.pb
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        res = Result(ok=False, prompt_len=len(prompt))
        t0 = time.perf_counter()
        last = None
        try:
            async for r in self.stub.Generate(req, timeout=self.timeout, metadata=self.metadata):
                if any(d.token_ids for d in r.outputs):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                if r.finished:
                    res.output_len = r.usage.completion_tokens
        except self.grpc.aio.AioRpcError as e:
            res.error = f"{e.code().name}: {e.details()}"
            return res
        res.e2e = time.perf_counter() - t0
        res.ok = last is not None
        return res

    async def close(self) -> None:
        await self.channel.close()


# -- running -------------------------------------------------------------------------------------
async def run_rate(client, workload, rate: float, max_concurrency: int | None, burstiness: float,
                   rng: random.Random) -> tuple[list[Result], float]:
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(prompt, out_len):
        if sem is None:
            return await client.request(prompt, out_len)
        async with sem:
            return await client.request(prompt, out_len)

    tasks = []
    t0 = time.perf_counter()
    for prompt, out_len in workload:
        tasks.append(asyncio.create_task(one(prompt, out_len)))
        if math.isfinite(rate):
            # Gamma-distributed gaps with mean 1/rate; burstiness 1 is a Poisson process.
            await asyncio.sleep(rng.gammavariate(burstiness, 1.0 / (rate * burstiness)))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - t0


def summarize(results: list[Result], duration: float, percentiles: list[float], slo: dict[str, float]) -> dict:
    ok = [r for r in results if r.ok]
    out = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
           "request_throughput": len(ok) / duration,
           "output_throughput": sum(r.output_len for r in ok) / duration,
           "total_token_throughput": sum(r.output_len + r.prompt_len for r in ok) / duration}
    series = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [x for r in ok for x in r.itl], "e2e": [r.e2e for r in ok]}
    for name, xs in series.items():
        a = np.asarray(xs, dtype=np.float64) * 1000.0
        out[f"mean_{name}_ms"] = float(a.mean()) if a.size else float("nan")
        for p in percentiles:
            out[f"p{p:g}_{name}_ms"] = float(np.percentile(a, p)) if a.size else float("nan")
    if slo:
        def good(r: Result) -> bool:
            vals = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2e": r.e2e}
            return all(vals[k] * 1000.0 <= v for k, v in slo.items())

        out["goodput"] = sum(good(r) for r in ok) / duration
        out["slo_ms"] = slo
    errors = [r.error for r in results if not r.ok]
    if errors:
        out["first_errors"] = errors[:3]
    return out


def print_table(rate: float, s: dict, percentiles: list[float]) -> None:
    print(f"\n== request rate {rate:g}/s: {s['completed']} completed, {s['failed']} failed, {s['duration_s']:.2f} s")
    print(f"   throughput: {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s, "
          f"{s['total_token_throughput']:.1f} total tok/s" + (f", goodput {s['goodput']:.2f} req/s" if "goodput" in s else ""))
    cols = ["mean"] + [f"p{p:g}" for p in percentiles]
    print("   " + f"{'ms':<6}" + "".join(f"{c:>10}" for c in cols))
    for name in ("ttft", "tpot", "itl", "e2e"):
        vals = [s[f"mean_{name}_ms"]] + [s[f"p{p:g}_{name}_ms"] for p in percentiles]
        print("   " + f"{name.upper():<6}" + "".join(f"{v:>10.2f}" for v in vals))
    for e in s.get("first_errors", []):
        print(f"   error: {e}")


def plot(summaries: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [s["output_throughput"] for s in summaries]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, name, title in ((axes[0], "ttft", "time to first token"), (axes[1], "tpot", "time per output token")):
        for p, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(xs, [s[f"{p}_{name}_ms"] for s in summaries], style, label=p)
        for x, s in zip(xs, summaries):
            ax.annotate(f"{s['request_rate']:g}/s", (x, s[f"p50_{name}_ms"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(f"{name.upper()} (ms)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("xlaserve: latency against throughput (labels: request rate)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["openai", "grpc"], default="openai")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="HTTP port (openai backend)")
    ap.add_argument("--grpc-port", type=int, default=50051)
    ap.add_argument("--https", action="store_true", help="HTTP over TLS")
    ap.add_argument("--insecure", action="store_true", help="do not verify the HTTPS certificate")
    ap.add_argument("--tls-ca", help="CA certificate for gRPC over TLS")
    ap.add_argument("--api-key")
    ap.add_argument("--model", help="model name to send (default: the served one)")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.0, help="lengths vary uniformly by +- this fraction")
    ap.add_argument("--vocab-range", default="3,500", help="prompt token ids are drawn from [lo, hi)")
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    ap.add_argument("--sweep-rates", help="comma-separated request rates to run in turn, e.g. 1,2,4,inf")
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1: Poisson)")
    ap.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    ap.add_argument("--slo-ttft-ms", type=float)
    ap.add_argument("--slo-tpot-ms", type=float)
    ap.add_argument("--slo-e2e-ms", type=float)
    ap.add_argument("--percentiles", default="50,90,99")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", help="write the summaries (and the settings) here")
    ap.add_argument("--plot", help="save a PNG of latency against throughput over the rates")
    args = ap.parse_args(argv)
    rates = args.sweep_rates.split(",") if args.sweep_rates else [args.request_rate]
    try:
        bad = [r for r in rates if not float(r) > 0]
    except ValueError:
        ap.error(f"--sweep-rates must be comma-separated numbers (or inf), got {args.sweep_rates!r}")
    if bad:
        ap.error(f"request rates must be > 0 (inf: all at once), got {', '.join(map(str, bad))}")
    if not args.burstiness > 0:
        ap.error(f"--burstiness must be > 0 (1: Poisson arrivals), got {args.burstiness}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        ap.error(f"--max-concurrency must be >= 1 (leave it out for no limit), got {args.max_concurrency}")
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    args.base_url = f"{'https' if args.https else 'http'}://{args.host}:{args.port}"
    args.grpc_target = f"{args.host}:{args.grpc_port}"
    return args


async def main_async(args) -> list[dict]:
    rng = random.Random(args.seed)
    lo, hi = (int(x) for x in args.vocab_range.split(","))
    percentiles = [float(p) for p in args.percentiles.split(",")]
    slo = {k: v for k, v in (("ttft", args.slo_ttft_ms), ("tpot", args.slo_tpot_ms), ("e2e", args.slo_e2e_ms))
           if v is not None}
    rates = [float(r) for r in args.sweep_rates.split(",")] if args.sweep_rates else [args.request_rate]
    client = HttpClient(args) if args.backend == "openai" else GrpcClient(args)
    summaries = []
    try:
        model = await client.model_name()
        if args.backend == "openai":
            client.model = model
        print(f"benchmarking {model!r} over {args.backend} ({args.base_url if args.backend == 'openai' else args.grpc_target})")
        warm = await client.request(make_workload(1, 8, 4, 0, (lo, hi), rng)[0][0], 4)
        if not warm.ok:
            raise SystemExit(f"the warm-up request failed: {warm.error}")
        for rate in rates:
            workload = make_workload(args.num_prompts, args.input_len, args.output_len, args.range_ratio, (lo, hi), rng)
            results, duration = await run_rate(client, workload, rate, args.max_concurrency, args.burstiness, rng)
            s = summarize(results, duration, percentiles, slo)
            s["request_rate"] = rate
            print_table(rate, s, percentiles)
            summaries.append(s)
    finally:
        await client.close()
    return summaries


def main(argv=None) -> int:
    args = parse_args(argv)
    summaries = asyncio.run(main_async(args))
    if args.json_out:
        settings = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, type(None)))}
        with open(args.json_out, "w") as f:
            json.dump({"settings": settings, "results": summaries}, f, indent=2, default=str)
        print(f"\nwrote {args.json_out}")
    if args.plot:
        plot(summaries, args.plot)
        print(f"wrote {args.plot}")
    return 0 if all(s["completed"] for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
