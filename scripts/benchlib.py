"""What every benchmark script records: the commit a result belongs to and the device's copy ceiling."""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def add_cublas_arg(ap) -> None:
    """--gpu-cublas-min-tokens: EngineConfig.gpu_cublas_min_tokens, a token count, 'none' (XLA's own
    GEMM choice in every program) or 'default' (the engine's). engine_kwargs() turns it into config."""

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


def _median_call_s(f, *args) -> float:
    """Seconds per call of jitted f: the median of 7 runs of 10 back-to-back calls, after one warm-up."""
    import jax

    jax.block_until_ready(f(*args))
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(10):
            y = f(*args)
        jax.block_until_ready(y)
        times.append((time.perf_counter() - t0) / 10)
    return statistics.median(times)


def copy_bandwidth(n: int = 1 << 28) -> dict:
    """Bytes read + written per second by a large jitted elementwise op (x * 2 over n f32): the
    memory ceiling MBU is quoted against. Median of 7 runs of 10 back-to-back calls."""
    import jax
    import jax.numpy as jnp

    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    t = _median_call_s(jax.jit(lambda a: a * 2.0), x)
    del x
    return {"copy_bytes_per_s": 2 * n * 4 / t, "copy_bytes": 2 * n * 4, "copy_s": t}


def matmul_flops(m: int = 8192) -> dict:
    """bf16 m^3 matmul rate through XLA (FLOP/s): the compute ceiling. Median of 7 runs of 10 calls."""
    import jax
    import jax.numpy as jnp

    key = jax.random.key(0)
    a = jax.random.normal(key, (m, m), jnp.bfloat16)
    b = jax.random.normal(jax.random.fold_in(key, 1), (m, m), jnp.bfloat16)
    t = _median_call_s(jax.jit(lambda a, b: a @ b), a, b)
    return {"matmul_flops_per_s": 2 * m**3 / t, "matmul_s": t}
