"""What every benchmark script records: the commit a result belongs to, the device's copy and matmul
ceilings, and (with --profile) where the device's time went."""

from __future__ import annotations

import glob
import gzip
import json
import math
import os
import re
import statistics
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def add_cublas_arg(ap) -> None:
    """--gpu-cublas-min-tokens: EngineConfig.gpu_cublas_min_tokens, a token count, 'none' (XLA's own
    GEMM choice in every program) or 'default' (the engine's). cublas_kwargs() turns it into config."""

    def min_tokens(v: str):
        if v in ("default", "none"):
            return v
        if not v.isdigit() or int(v) <= 0:
            raise ValueError(v)
        return int(v)

    ap.add_argument("--gpu-cublas-min-tokens", type=min_tokens, default="default", metavar="N|none|default",
                    help="step programs of token buckets >= N run their matmuls with cuBLAS (NVIDIA GPUs)")


def cublas_kwargs(value) -> dict:
    """EngineConfig keyword arguments for a --gpu-cublas-min-tokens value."""
    return {} if value == "default" else {"gpu_cublas_min_tokens": None if value == "none" else value}


def git_commit() -> str:
    """Short HEAD (+dirty), or $BENCH_COMMIT: the device machine's copy of the tree has no .git."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except OSError:
        return "unknown"


def _median_call_s(f, *args, min_run_s: float = 0.05) -> float:
    """Seconds per call of jitted f: the median of 7 runs of back-to-back calls, each run at least
    `min_run_s` long (and of at least 10 calls), after one warm-up call and one timed call that sizes
    the runs. Each run also pays one launch and one wait that no call overlaps; on an H200 runs of 10
    1 GiB copies (~5 ms) read 4.01 TB/s where runs of 50 read 4.20, so short runs under-measure the
    ceilings MBU and the floors divide by (docs/benchmarks.md, fortieth session)."""
    import jax

    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    calls = max(10, math.ceil(min_run_s / max(time.perf_counter() - t0, 1e-6)))
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(calls):
            y = f(*args)
        jax.block_until_ready(y)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def copy_bandwidth(n: int = 1 << 28) -> dict:
    """Bytes read + written per second by a large jitted elementwise op (x * 2 over n f32): the
    memory ceiling MBU is quoted against (_median_call_s: median of 7 runs of >= 50 ms)."""
    import jax
    import jax.numpy as jnp

    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    t = _median_call_s(jax.jit(lambda a: a * 2.0), x)
    del x
    return {"copy_bytes_per_s": 2 * n * 4 / t, "copy_bytes": 2 * n * 4, "copy_s": t}


def matmul_flops(m: int = 8192) -> dict:
    """bf16 m^3 matmul rate through XLA (FLOP/s): the compute ceiling (_median_call_s)."""
    import jax
    import jax.numpy as jnp

    key = jax.random.key(0)
    a = jax.random.normal(key, (m, m), jnp.bfloat16)
    b = jax.random.normal(jax.random.fold_in(key, 1), (m, m), jnp.bfloat16)
    t = _median_call_s(jax.jit(lambda a, b: a @ b), a, b)
    return {"matmul_flops_per_s": 2 * m**3 / t, "matmul_s": t}


def kernel_summary(trace_dir: str, steps: int, top: int = 14) -> dict:
    """Where the device's time went in a jax.profiler trace written under trace_dir (the newest
    perfetto_trace.json.gz): the kernels and copies on the device's streams, per step (`steps`
    divides every figure): how many, busy time (the union of their intervals), span (first start to
    last end), and the `top` names by time, numeric suffixes dropped (`fusion.12` -> `fusion`).
    {"error": ...} when the trace holds no device events (a CPU run has none)."""
    files = glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)
    if not files:
        return {"error": "no perfetto_trace.json.gz written"}
    with gzip.open(sorted(files, key=os.path.getmtime)[-1]) as f:
        ev = json.load(f)
    ev = ev["traceEvents"] if isinstance(ev, dict) else ev
    pname = {e["pid"]: e.get("args", {}).get("name", "") for e in ev
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, nm in pname.items() if "/device:" in nm or "GPU" in nm}
    tname = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in ev
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    ks = [e for e in ev if e.get("ph") == "X" and e.get("pid") in device and "dur" in e]
    threads = sorted({tname.get((e["pid"], e.get("tid")), "") for e in ks})
    # kernels and copies on CUDA streams, not the derived "XLA Ops"/"XLA Modules" lines over them
    ks = [e for e in ks if tname.get((e["pid"], e.get("tid")), "").startswith("Stream")] or ks
    if not ks:
        return {"error": "no device events", "processes": sorted(set(pname.values()))[:20]}
    ks.sort(key=lambda e: e["ts"])
    busy, cur_s, cur_e = 0.0, None, None
    for e in ks:
        s0, e0 = e["ts"], e["ts"] + e["dur"]
        if cur_e is None or s0 > cur_e:
            busy += 0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s0, e0
        else:
            cur_e = max(cur_e, e0)
    busy += cur_e - cur_s
    span = max(e["ts"] + e["dur"] for e in ks) - ks[0]["ts"]
    by = {}
    for e in ks:
        k = re.sub(r"[._]\d+$", "", e["name"])[:60]
        t, c = by.get(k, (0.0, 0))
        by[k] = (t + e["dur"], c + 1)
    ranked = sorted(by.items(), key=lambda kv: -kv[1][0])[:top]
    return {"steps": steps, "kernels_per_step": len(ks) / steps, "busy_us_per_step": busy / steps,
            "span_us_per_step": span / steps, "processes": sorted({pname[p] for p in device}), "threads": threads[:12],
            "top": [{"name": k, "us_per_step": t / steps, "count_per_step": c / steps} for k, (t, c) in ranked]}


def print_kernel_summary(label: str, p: dict, unit: str = "step") -> None:
    """kernel_summary's result as a few lines: counts, busy and span, then the top kernels."""
    if "top" not in p:
        print(f"{label} profile: {p}", flush=True)
        return
    print(f"{label}: {p['kernels_per_step']:.0f} kernels/{unit}, device busy {p['busy_us_per_step']:.0f} us of "
          f"{p['span_us_per_step']:.0f} us span per {unit}", flush=True)
    for t in p["top"]:
        print(f"    {t['us_per_step']:10.1f} us  x{t['count_per_step']:7.1f}  {t['name']}", flush=True)
