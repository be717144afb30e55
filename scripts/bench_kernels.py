"""Attention kernel benchmarks on one GPU, with the device's own ceilings measured in the same run.

  XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 python3 scripts/bench_kernels.py --out bench.json

Prints a short table per section and writes everything to --out as JSON:
  ceilings: copy bandwidth (bytes read + written per second, large jitted elementwise op) and the
            bf16 8192^3 matmul rate through XLA;
  prefill:  causal bf16 flash attention TFLOP/s at B=4, N=32, K=8, H=128 for each T, our kernels
            next to jax.nn.dot_product_attention(implementation="cudnn") and "xla"; causal flops
            counted as 4 * B * N * T * T * H / 2;
  decode:   filled by the ragged-paged-attention kernel (bench_decode);
  ragged_prefill: the ragged-paged-attention kernel on prefill-shaped token batches (the engine's
            prefill steps: S chunks of L new tokens after ctx tokens of context, pages of 16),
            TFLOP/s counted as 4 * N * H * S * (L * ctx + L * L / 2), next to our flash attention
            and cuDNN's over the same q/k/v held contiguous (where ctx = 0).
Timing: warm-up, block_until_ready, median over repetitions of back-to-back calls, XLA's default
preallocation kept (CONVENTIONS.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time

from benchlib import copy_bandwidth, git_commit, matmul_flops
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.flash_attention import BlockSizes, flash_attention, ref_flash_attention  # noqa: E402


def time_call(f, *args, min_rep_s: float = 0.05, reps: int = 7) -> float:
    """Median seconds per call of f(*args): warmed up, back-to-back calls per repetition."""
    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    one = max(time.perf_counter() - t0, 1e-6)
    iters = max(1, min(200, int(min_rep_s / one)))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for _ in range(iters):
            out = f(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def measure_ceilings() -> dict:
    """Device copy bandwidth (bytes read + written / s) and bf16 8192^3 matmul TFLOP/s."""
    c, m = copy_bandwidth(), matmul_flops()
    return {"copy_bytes_per_s": c["copy_bytes_per_s"], "copy_gbytes": c["copy_bytes"] / 1e9, "copy_s": c["copy_s"],
            "matmul_tflops": m["matmul_flops_per_s"] / 1e12, "matmul_s": m["matmul_s"]}


def _prefill_impls(sm_scale: float, variants: bool):
    impls = {
        "ours_mosaic": lambda q, k, v: flash_attention(q, k, v, sm_scale=sm_scale, implementation="mosaic_gpu"),
        "ours_triton": lambda q, k, v: flash_attention(q, k, v, sm_scale=sm_scale, implementation="triton"),
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=sm_scale, is_causal=True,
                                                              implementation="cudnn"),
        "xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=sm_scale, is_causal=True,
                                                            implementation="xla"),
    }
    if variants:
        for bkv, st in ((64, 2), (64, 3), (64, 4), (128, 3)):
            bs = BlockSizes(block_q=64, block_kv=bkv, num_stages=st)
            impls[f"mosaic_64x{bkv}_s{st}"] = (lambda bs: lambda q, k, v: flash_attention(
                q, k, v, sm_scale=sm_scale, block_sizes=bs, implementation="mosaic_gpu"))(bs)
        for bq, bk, w, st in ((128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 4, 3), (128, 32, 4, 4)):
            bs = BlockSizes(block_q=bq, block_kv=bk, num_warps=w, num_stages=st)
            impls[f"triton_{bq}x{bk}_w{w}_s{st}"] = (lambda bs: lambda q, k, v: flash_attention(
                q, k, v, sm_scale=sm_scale, block_sizes=bs, implementation="triton"))(bs)
    return impls


def _rel_err(x, ref) -> float:
    x, ref = jnp.asarray(x, jnp.float32), jnp.asarray(ref, jnp.float32)
    return float(jnp.linalg.norm(x - ref) / jnp.linalg.norm(ref))


def _check_and_time(row: dict, f, args, out, ref, flops: float, ceilings) -> None:
    """row += rel. error and finiteness of out against ref (when there is one), then f's median
    seconds, TFLOP/s and their fraction of the matmul ceiling."""
    if ref is not None:
        row["rel_err"] = _rel_err(out, ref)
        row["finite"] = bool(jnp.isfinite(out.astype(jnp.float32)).all())
    t = time_call(f, *args)
    row.update(seconds=t, tflops=flops / t / 1e12)
    if ceilings:
        row["frac_of_matmul"] = row["tflops"] / ceilings["matmul_tflops"]


def bench_prefill(seq_lens=(1024, 4096, 16384), *, B=4, N=32, K=8, H=128, variants_at=(), ceilings=None) -> list[dict]:
    """Causal bf16 prefill TFLOP/s per implementation and T; rel. error vs an f32 reference
    (T <= 1024) or vs cuDNN (larger T)."""
    sm_scale = 1.0 / math.sqrt(H)
    rows = []
    for T in seq_lens:
        key = jax.random.key(T)
        kq, kk, kv = jax.random.split(key, 3)
        q = jax.random.normal(kq, (B, T, N, H), jnp.bfloat16)
        k = jax.random.normal(kk, (B, T, K, H), jnp.bfloat16)
        v = jax.random.normal(kv, (B, T, K, H), jnp.bfloat16)
        flops = 4 * B * N * T * T * H / 2
        ref = None
        if T <= 1024:
            ref = jax.jit(lambda q, k, v: ref_flash_attention(q, k, v, sm_scale=sm_scale))(q, k, v)
        for name, fn in _prefill_impls(sm_scale, T in variants_at).items():
            row = {"T": T, "impl": name, "B": B, "N": N, "K": K, "H": H}
            if name == "xla" and B * N * T * T * 4 * 3 > 40e9:  # materialized f32 scores would not fit
                row["error"] = "skipped: XLA materializes [B, N, T, T] scores"
                rows.append(row)
                continue
            try:
                f = jax.jit(fn)
                out = jax.block_until_ready(f(q, k, v))
                if ref is None and name != "cudnn":
                    ref = jax.jit(_prefill_impls(sm_scale, False)["cudnn"])(q, k, v)
                    row["err_vs"] = "cudnn"
                _check_and_time(row, f, (q, k, v), out, ref, flops, ceilings)
            except Exception as e:  # a failing implementation is a result, not a crash
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            rows.append(row)
            print(_fmt_prefill_row(row), flush=True)
        del q, k, v, ref
    return rows


def _paged_batch(S: int, L: int, n: int, *, G: int, N: int, K: int, H: int, seed: int) -> tuple:
    """ragged_paged_attention's inputs, bf16: S sequences of L query tokens each (the last L of their
    n keys), pages of G tokens scattered at random over a pool of exactly their pages (as after many
    alloc/free cycles). Returns (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)."""
    pages_per_seq = -(-n // G)
    P = S * pages_per_seq
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    kv_pages = jax.random.normal(k1, (P, G, 2 * K, H), jnp.bfloat16)  # [P, G, 2K, H]
    page_indices = jax.random.permutation(k2, P).astype(jnp.int32).reshape(S, pages_per_seq)
    q = jax.random.normal(k3, (S * L, N, H), jnp.bfloat16)  # [T, N, H]
    return (q, kv_pages, jnp.full((S,), n, jnp.int32), page_indices, jnp.arange(S + 1, dtype=jnp.int32) * L,
            jnp.asarray([S], jnp.int32))


def bench_decode(ceilings=None, *, configs=((64, 4096, 16), (64, 4096, 64), (8, 32768, 16), (8, 32768, 64)),
                 N=32, K=8, H=128, sweep=True) -> list[dict]:
    """Decode attention over a paged bf16 KV cache: one query token per sequence, S sequences of ctx
    keys each, pages of G tokens scattered at random over the cache (as after many alloc/free
    cycles). Bytes that must move: every K and V row of every sequence once, q read, output
    written (page tables are counted too, ~0.1%). GB/s = bytes / median time; frac_of_copy divides
    by the copy bandwidth measured in the same run. Each variant is checked against the pure-jnp
    reference on the same inputs (rel. L2 error). sweep=False times only the default tiles and the
    XLA reference; sweep=True adds tile variants (keys per step, warps, pipeline stages, splits).
    """
    import dataclasses
    from functools import partial

    from pallas_kernels.ragged_paged_attention import gpu as rpa_gpu
    from pallas_kernels.ragged_paged_attention import ref_ragged_paged_attention

    sm_scale = 1.0 / math.sqrt(H)
    rows = []
    for S, ctx, G in configs:
        args = _paged_batch(S, 1, ctx, G=G, N=N, K=K, H=H, seed=S * ctx + G)
        q, kv_pages, _, page_indices, _, _ = args
        nbytes = S * ctx * 2 * K * H * 2 + 2 * S * N * H * 2 + page_indices.size * 4
        ref_fn = jax.jit(partial(ref_ragged_paged_attention, sm_scale=sm_scale))
        ref = ref_fn(*args)
        base = rpa_gpu.default_block_sizes(q, kv_pages, page_indices)
        impls = {f"pallas_default(b{base.kv_pages_per_block * G},w{base.num_warps},s{base.num_stages},"
                 f"x{base.kv_splits})": base}
        if sweep:
            for keys, w, st in ((32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 2),
                                (128, 4, 3), (256, 8, 2)):
                if keys % G == 0 and (keys, w, st) != (base.kv_pages_per_block * G, base.num_warps,
                                                        base.num_stages):
                    impls[f"pallas_b{keys}_w{w}_s{st}"] = dataclasses.replace(
                        base, kv_pages_per_block=keys // G, num_warps=w, num_stages=st)
            for x in (1, 2, 4, 8, 16, 32):
                if x != base.kv_splits:
                    impls[f"pallas_splits{x}"] = dataclasses.replace(base, kv_splits=x)
        fns = {name: jax.jit(partial(rpa_gpu.ragged_paged_attention, sm_scale=sm_scale, block_sizes=bs))
               for name, bs in impls.items()}
        fns["xla_reference"] = ref_fn
        for name, f in fns.items():
            row = {"S": S, "ctx": ctx, "G": G, "N": N, "K": K, "H": H, "impl": name, "bytes": nbytes}
            try:
                out = jax.block_until_ready(f(*args))
                row["rel_err"] = _rel_err(out, ref)
                row["finite"] = bool(jnp.isfinite(out.astype(jnp.float32)).all())
                t = time_call(f, *args)
                row.update(seconds=t, gbytes_per_s=nbytes / t / 1e9)
                if ceilings:
                    row["frac_of_copy"] = nbytes / t / ceilings["copy_bytes_per_s"]
            except Exception as e:  # a failing variant is a result, not a crash
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            rows.append(row)
            print(_fmt_decode_row(row), flush=True)
        del kv_pages, args, ref
    best = {}
    for r in rows:
        k = (r["S"], r["ctx"], r["G"])
        if "seconds" in r and r["impl"] != "xla_reference" and r.get("rel_err", 1) < 2e-2 and r["finite"]:
            if k not in best or r["seconds"] < best[k]["seconds"]:
                best[k] = r
    print("\n== decode (bf16 paged KV, N=%d K=%d H=%d): best valid Pallas variant per shape ==" % (N, K, H))
    for r in best.values():
        print(_fmt_decode_row(r))
    return rows


def bench_ragged_prefill(ceilings=None, *, configs=((16, 512, 0, 64), (1, 8192, 0, 64), (1, 8192, 0, 128),
                                                    (4, 2048, 6144, 128)),
                         N=32, K=8, G=16, kernels=None) -> list[dict]:
    """The ragged paged attention kernel on prefill chunks: S sequences of L new tokens each after
    ctx tokens of context, head dim H, KV pages of G tokens scattered over the pool. Causal TFLOP/s
    (masked work not counted) and rel. error against the jnp reference; where ctx = 0 also our flash
    attention and cuDNN's on the same q/k/v laid out [S, L, heads, H]. kernels: name -> ragged_paged_attention-like
    function (default: the Triton kernel with its default tiles)."""
    from functools import partial

    from pallas_kernels.ragged_paged_attention import gpu as rpa_gpu
    from pallas_kernels.ragged_paged_attention import ref_ragged_paged_attention

    kernels = kernels or {"ragged_pallas": rpa_gpu.ragged_paged_attention}
    rows = []
    for S, L, ctx, H in configs:
        sm_scale = 1.0 / math.sqrt(H)
        n = L + ctx
        args = _paged_batch(S, L, n, G=G, N=N, K=K, H=H, seed=S * n + H)
        q, kv_pages, _, page_indices, _, _ = args
        flops = 4 * N * H * S * (L * ctx + L * L / 2)
        ref = jax.jit(partial(ref_ragged_paged_attention, sm_scale=sm_scale))(*args) if S * L * n <= 2**26 else None
        fns = {name: (jax.jit(partial(k, sm_scale=sm_scale)), args) for name, k in kernels.items()}
        if ctx == 0:  # the same attention with K/V contiguous: gather each sequence's rows from the pages
            slots = (page_indices[:, :, None] * G + jnp.arange(G)[None, None, :]).reshape(S, -1)[:, :L]
            rows_kv = kv_pages.reshape(-1, 2 * K, H)[slots]  # [S, L, 2K, H]
            fa_args = (q.reshape(S, L, N, H), rows_kv[:, :, 0::2], rows_kv[:, :, 1::2])
            fns["flash_attention"] = (jax.jit(lambda q, k, v: flash_attention(
                q, k, v, sm_scale=sm_scale, implementation="gpu").reshape(S * L, N, H)), fa_args)
            fns["cudnn"] = (jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, scale=sm_scale, is_causal=True, implementation="cudnn").reshape(S * L, N, H)), fa_args)
        for name, (f, a) in fns.items():
            row = {"S": S, "L": L, "ctx": ctx, "H": H, "N": N, "K": K, "G": G, "impl": name}
            try:
                out = jax.block_until_ready(f(*a))
                if ref is None:  # the first implementation's output is the reference of the others
                    ref, row["err_vs"] = out, name
                _check_and_time(row, f, a, out, ref, flops, ceilings)
            except Exception as e:  # a failing implementation is a result, not a crash
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            rows.append(row)
            print(_fmt_ragged_prefill_row(row), flush=True)
        del kv_pages, args, ref, fns
    return rows


def _fmt_row(head: str, r: dict) -> str:
    """A result row: head, then its error, or its time, rate, fraction of the ceiling and rel. error."""
    if "error" in r:
        return f"{head} {r['error']}"
    if "tflops" in r:
        rate, frac, ceiling = f"{r['tflops']:7.1f} TFLOP/s", r.get("frac_of_matmul"), "matmul"
    else:
        rate, frac, ceiling = f"{r['gbytes_per_s']:7.0f} GB/s", r.get("frac_of_copy"), "copy"
    err = f"{r['rel_err']:.1e}" if "rel_err" in r else "-"
    return (f"{head} {r['seconds'] * 1e3:9.3f} ms {rate} ({'-' if frac is None else f'{frac:.0%}'} of {ceiling}) "
            f"rel_err {err}{'' if r.get('finite', True) else ' NON-FINITE'}")


def _fmt_ragged_prefill_row(r: dict) -> str:
    return _fmt_row(f"S={r['S']:>2} L={r['L']:>5} ctx={r['ctx']:>5} H={r['H']:>3} {r['impl']:<22}", r)


def _fmt_decode_row(r: dict) -> str:
    return _fmt_row(f"S={r['S']:>3} ctx={r['ctx']:>6} G={r['G']:>3} {r['impl']:<30}", r)


def _fmt_prefill_row(r: dict) -> str:
    return _fmt_row(f"T={r['T']:>6} {r['impl']:<24}", r)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_kernels.json")
    ap.add_argument("--seq-lens", default="1024,4096,16384")
    ap.add_argument("--sweep-at", default="", help="comma-separated T values at which block-size variants also run")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: prefill,decode,ragged_prefill")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    dev = jax.devices()[0]
    result = {"device": dev.device_kind, "jax": jax.__version__, "commit": git_commit(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python3", "scripts/bench_kernels.py", *(argv if argv is not None else sys.argv[1:])])}
    print(f"{result['device']}  jax {result['jax']}  commit {result['commit']}", flush=True)
    ceilings = measure_ceilings()
    result["ceilings"] = ceilings
    print(f"copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s   bf16 matmul {ceilings['matmul_tflops']:.0f} TFLOP/s",
          flush=True)
    if "prefill" not in skip:
        seq = tuple(int(s) for s in args.seq_lens.split(","))
        sweep = tuple(int(s) for s in args.sweep_at.split(",") if s)
        result["prefill"] = bench_prefill(seq, variants_at=sweep, ceilings=ceilings)
    if "decode" not in skip:
        result["decode"] = bench_decode(ceilings)
    if "ragged_prefill" not in skip:
        result["ragged_prefill"] = bench_ragged_prefill(ceilings)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("\n== prefill (causal bf16, B=4 N=32 K=8 H=128) ==")
    for r in result.get("prefill", []):
        print(_fmt_prefill_row(r))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
