"""Decode speed of the engine's step on one device: batch-1 tok/s and MBU, throughput at larger batches.

  python3 scripts/bench_decode.py --out decode.json                       # llama3_2_1b + llama3_8b, bf16
  python3 scripts/bench_decode.py --models smollm2_135m --batches 1 4 --ctx 64 --steps 8   # CPU smoke test

Random ("dummy") bf16 weights made on the device by runtime.checkpoint.load_model. Every sequence
sits at `--ctx` tokens of context (KV pages scattered at random over the pool) and decodes one token
per step. For each model and batch size B it times, back to back with the KV pool donated and
threaded through (median over repetitions, warmed up, block_until_ready at the end of each one):

  model     the pure model step: jit(forward + argmax), batch arrays already on the device;
  step      the engine's programs for a greedy batch, batch already on the device: the model program
            alone (runtime/step.py: the flat batch unpacked, forward with paged KV written and read
            through pallas_kernels.dispatch -- the Pallas kernel on GPU -- f32 logits, banned ids
            masked, argmax); a greedy step runs no sampler program (runtime/sampling.py); on a GPU
            the decode-only program (each layer's KV write inside its attention launch), as the
            engine runs it for steps without a prefill token;
  executor  the same step called as the engine calls it (StepExecutor with a numpy PackedBatch, so
            the host->device copy of the batch, two flat arrays, is in every step);
  engine    (B = 1 only) `Engine.step()` in steady decode: scheduling, packing, dispatch, output
            handling; median wall time between consecutive steps.
  engine, bursts  (B = 1 only, `--decode-steps` K > 1) the same loop on an engine with
            EngineConfig.decode_steps = K: K decode steps per program (runtime/scheduler.py);
            wall time per token over the whole bursts of 4 x `--steps` tokens after the second, the
            median of `--reps` requests.
The engine rows' MBU counts the K/V rows at the timed tokens' mean context (past `--ctx`).

Bytes that must move per step = the weights read at decode (every parameter array except an untied
embedding table, of which only B rows are gathered) + every K/V row of the context + the new K/V
rows written. MBU = bytes / time / copy bandwidth, the copy (bytes read + written by a large jitted
elementwise op) measured in the same process.

With `--flag-variants NAME=XLA_FLAGS ...` the script also reruns the batch-1 measurement of the
first model in a child process per variant (XLA reads its flags once per process), e.g.
  --flag-variants "cmdbuf_cond=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"
The main measurement itself also runs in a child so that no process holds the device's memory
(XLA preallocates it) while another one runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchlib import (  # noqa: E402
    add_cublas_arg, copy_bandwidth, cublas_kwargs, git_commit, kernel_summary, print_kernel_summary)




# ------------------------------------------------------------------------------------------ child side




def timed_loop(call, state, *, min_rep_s: float, reps: int):
    """Median seconds per call of `state = call(state)`: warmed up, back-to-back calls per repetition,
    blocked at the end of each repetition. Returns (seconds, state, dispatch seconds): the last is the
    median host time one call takes to return when started on an idle device; close to the step
    time, it means the call blocks until the device has (nearly) finished."""
    import jax

    for _ in range(3):
        state = call(state)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    state = call(state)
    jax.block_until_ready(state)
    one = max(time.perf_counter() - t0, 1e-6)
    iters = max(3, min(500, int(min_rep_s / one)))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            state = call(state)
        jax.block_until_ready(state)
        times.append((time.perf_counter() - t0) / iters)
    dispatch = []  # host time until the call returns, device idle before it (is the call asynchronous?)
    for _ in range(10):
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        state = call(state)
        dispatch.append(time.perf_counter() - t0)
    jax.block_until_ready(state)
    return statistics.median(times), state, statistics.median(dispatch)


def decode_stamps(engine, prompt: list[int], max_tokens: int) -> list[tuple[float, int, int]]:
    """Run one greedy request through `engine.step()` to its end: per step, (the time it returned,
    tokens out before it, tokens out after it)."""
    from runtime.request import SamplingParams

    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    stamps, n = [], 0
    while engine.has_unfinished():
        outs = engine.step()
        t, before = time.perf_counter(), n
        for o in outs:
            n = len(o.outputs[0].token_ids)
        stamps.append((t, before, n))
    engine.check_invariants()
    return stamps


def profile_kernels(call, state, n: int, trace_dir: str) -> tuple[dict, object]:
    """Trace n back-to-back calls with jax.profiler and summarize the device kernels per call
    (benchlib.kernel_summary)."""
    import jax

    jax.block_until_ready(state)
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(n):
            state = call(state)
        jax.block_until_ready(state)
    return kernel_summary(trace_dir, n), state


def run_child(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from runtime.checkpoint import load_model
    from runtime.config import EngineConfig
    from runtime.engine import Engine

    dev = jax.devices()[0]
    res = {"device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform, "jax": jax.__version__,
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "ctx": args.ctx, "rows": [], "models": {}}
    res.update(copy_bandwidth(args.copy_elems))
    bw = res["copy_bytes_per_s"]
    print(f"[{res['device']}] copy bandwidth {bw / 1e12:.3f} TB/s (read + write)", flush=True)

    G = args.page_size
    for name in args.models:
        t0 = time.perf_counter()
        loaded = load_model(f"dummy:{name}", dtype="bfloat16", progress=False)
        jax.block_until_ready(loaded.params)
        mc = loaded.config
        leaves = jax.tree.leaves(loaded.params)
        param_bytes = sum(x.size * x.dtype.itemsize for x in leaves)
        embed = loaded.params["embed"][...]
        embed_bytes = embed.size * embed.dtype.itemsize
        weights_read = param_bytes - (0 if mc.tie_word_embeddings else embed_bytes)
        kv_tok = mc.kv_bytes_per_token(2)  # all layers, K and V, bf16
        batches = sorted(args.batches)
        Bmax = batches[-1]
        pps = -(-(args.ctx + 1) // G)  # pages per sequence at ctx + the token being written
        eng_steps = args.steps
        max_model_len = args.max_model_len or -(-(args.ctx + eng_steps + 8) // G) * G
        prefill_T = 1 << (args.ctx - 1).bit_length()
        num_pages = Bmax * pps + 2 * -(-max_model_len // G)
        token_buckets = tuple(sorted(set(batches) | {prefill_T}))
        cfg = EngineConfig(max_num_seqs=Bmax, max_num_batched_tokens=token_buckets[-1], page_size=G,
                           num_pages=num_pages, max_model_len=max_model_len, token_buckets=token_buckets,
                           seq_buckets=tuple(batches), dtype="bfloat16", warmup=False, progress=False,
                           enable_prefix_caching=False, **cublas_kwargs(args.gpu_cublas_min_tokens))
        engine = Engine(loaded, cfg)
        ex = engine.executor
        info = {"param_bytes": param_bytes, "weights_read_bytes": weights_read, "embed_bytes": embed_bytes,
                "kv_bytes_per_token": kv_tok, "num_pages": num_pages, "max_model_len": max_model_len,
                "load_s": time.perf_counter() - t0}
        res["models"][name] = info

        fwd = loaded.forward

        def model_step(params, kv, tokens, positions, meta, li):
            logits, kv = fwd(params, tokens, positions, kv, meta, li)
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), kv

        model_jit = jax.jit(model_step, donate_argnums=(1,))
        rng = np.random.default_rng(0)
        perm = rng.permutation(num_pages).astype(np.int32)

        def make_batch(B):  # greedy rows, no penalties: what the packer gives for this decode
            packed = engine.packer.empty(B, B, history=False)
            packed.decode_only = True
            b = packed.step  # views into packed.flat
            b.tokens[:] = rng.integers(0, mc.vocab_size, B)
            b.positions[:] = args.ctx
            m = b.attn
            m.kv_lens[:] = args.ctx + 1
            m.cu_q_lens[:] = np.arange(B + 1)
            m.num_seqs[0] = B
            b.logits_indices[:] = np.arange(B)
            b.page_rows[:] = np.arange(B)  # rows of the executor's page table (StepExecutor.sync_pages)
            packed.pages = tuple((i, B, tuple(p)) for i, p in enumerate(perm[: B * pps].reshape(B, pps).tolist()))
            return packed

        def model_batch(packed):  # the StepBatch with the page tables themselves, for jit(forward)
            table = np.zeros((len(packed.pages), packed.layout.P), np.int32)
            for row, _, pages in packed.pages:
                table[row, : len(pages)] = pages
            return packed.layout.unflatten(packed.flat, table)

        # Compile what this model needs, in parallel (tracing is sequential, XLA compiles release the GIL).
        t0 = time.perf_counter()
        jobs = []
        program_keys = {}  # job key -> the executor's key of the program it compiles

        def step_job(job, T, S, decode: bool):  # the program the engine runs, with the engine's XLA options
            key = program_keys[job] = ex.model_key(T, S, decode)
            return job, functools.partial(ex._compile, key, ex._lower(key))

        for B in batches:
            jobs.append(step_job(("step", B), B, B, True))
            if B in args.model_batches:
                b = model_batch(make_batch(B))
                jobs.append((("model", B), model_jit.lower(loaded.params, engine.kv_pages, b.tokens, b.positions,
                                                           b.attn, b.logits_indices).compile))
        if 1 in batches and not args.no_engine:
            jobs.append(step_job(("step", (prefill_T, 1)), prefill_T, 1, False))
        compiled = {}
        with ThreadPoolExecutor(4) as pool:
            futs = [(k, pool.submit(job)) for k, job in jobs]
            for k, f in futs:
                compiled[k] = f.result()
        for k, key in program_keys.items():
            ex._executables[key] = compiled[k]
        info["compile_s"] = time.perf_counter() - t0
        print(f"{name}: {param_bytes / 1e9:.2f} GB params ({weights_read / 1e9:.2f} GB read per step), "
              f"{num_pages} KV pages; load {info['load_s']:.1f}s, {len(jobs)} programs compiled in "
              f"{info['compile_s']:.1f}s", flush=True)

        kv = engine.kv_pages
        engine.kv_pages = None

        def engine_bytes(ctx: float) -> float:  # batch 1, at a mean context of `ctx` tokens
            return weights_read + (ctx + 1) * kv_tok + kv_tok

        for B in batches:
            bytes_step = weights_read + B * (args.ctx + 1) * kv_tok + B * kv_tok
            row = {"model": name, "batch": B, "ctx": args.ctx, "bytes_per_step": bytes_step,
                   "floor_s": bytes_step / bw}
            hb = make_batch(B)
            db = jax.device_put(model_batch(hb))  # the model column's arguments (one device)
            step_fn = ex.model_step_fn(hb)  # the step column's program, its arguments on the device
            measured, disp = {}, {}
            if ("model", B) in compiled:
                exe = compiled[("model", B)]

                def call(kv, exe=exe, db=db):
                    return exe(loaded.params, kv, db.tokens, db.positions, db.attn, db.logits_indices)[1]

                measured["model"], kv, disp["model"] = timed_loop(call, kv, min_rep_s=args.min_rep_s, reps=args.reps)

            def call(kv, step_fn=step_fn):
                return step_fn(kv)[2]

            measured["step"], kv, disp["step"] = timed_loop(call, kv, min_rep_s=args.min_rep_s, reps=args.reps)

            def call(kv, hb=hb):
                return ex(loaded.params, kv, hb)[3]

            measured["executor"], kv, disp["executor"] = timed_loop(call, kv, min_rep_s=args.min_rep_s, reps=args.reps)
            for k, t in measured.items():
                row[f"{k}_s"] = t
                row[f"{k}_tok_s"] = B / t
                row[f"{k}_mbu"] = bytes_step / t / bw
                row[f"{k}_dispatch_s"] = disp[k]
            if args.profile and B in args.profile_batches:
                prof = {}
                for k in ("model", "step"):
                    if k == "model":
                        exe = compiled.get(("model", B))
                        if exe is None:
                            continue

                        def call(kv, exe=exe, db=db):
                            return exe(loaded.params, kv, db.tokens, db.positions, db.attn, db.logits_indices)[1]
                    else:
                        def call(kv, step_fn=step_fn):
                            return step_fn(kv)[2]
                    try:
                        prof[k], kv = profile_kernels(call, kv, 20, f"{args.profile}/{name}_B{B}_{k}")
                    except Exception as e:  # a failed trace is a result, not a crash
                        prof[k] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    print_kernel_summary(f"{name} B={B} {k}", prof[k])
                row["profile"] = prof
            res["rows"].append(row)
            print(_fmt_row(row), flush=True)

        engine.kv_pages = kv
        if 1 in batches and not args.no_engine:
            row = next(r for r in res["rows"] if r["model"] == name and r["batch"] == 1)
            stamps = decode_stamps(engine, rng.integers(0, mc.vocab_size, args.ctx).tolist(), eng_steps)
            # steady decode: intervals between steps once the first tokens are out (skip the prefill and
            # the first two decode steps), up to the last dispatch
            ts = [t for t, n, _ in stamps if n >= 2]
            gaps = [b - a for a, b in zip(ts, ts[1:])][:-1] or [float("nan")]
            t = statistics.median(gaps)
            ctx = args.ctx + eng_steps / 2  # the timed tokens' mean context
            row.update(engine_s=t, engine_tok_s=1 / t, engine_mbu=engine_bytes(ctx) / t / bw,
                       engine_steps_timed=len(gaps), engine_ctx=ctx)
            print(f"{name}: engine.step() batch-1 decode {1 / t:.1f} tok/s, MBU {row['engine_mbu']:.1%} "
                  f"(median of {len(gaps)} step intervals)", flush=True)
        if 1 in batches and not args.no_engine and args.decode_steps > 1:
            # the same loop with decode bursts: its own small engine (the pool of one sequence)
            engine = kv = None  # the single-step engine's pool freed before the burst engine's (rebound, not
            # deleted: the closures above read these names)
            K = args.decode_steps
            # the prefill's token, then whole bursts: the last one's tokens are all taken (a burst runs
            # in full, so with a remainder its last program would compute tokens nobody times)
            n_out = 1 + K * -(-4 * eng_steps // K)
            burst_len = args.max_model_len or -(-(args.ctx + n_out + 8) // G) * G
            bcfg = dataclasses.replace(
                cfg, decode_steps=K, max_num_seqs=1, seq_buckets=(1,), token_buckets=(1, prefill_T),
                max_num_batched_tokens=prefill_T, max_model_len=burst_len, num_pages=2 * (burst_len // G) + 2,
                warmup=True)
            engine = Engine(loaded, bcfg)
            runs = []
            for _ in range(args.reps):  # a new prompt each time (no prefix cache hit)
                stamps = decode_stamps(engine, rng.integers(0, mc.vocab_size, args.ctx).tolist(), n_out)
                # steady decode: from the step whose outputs end the second burst to the last step
                (t0, n0), (t1, n1) = next((t, n) for t, _, n in stamps if n > K + 1), stamps[-1][::2]
                runs.append(((t1 - t0) / (n1 - n0), n1 - n0, n0, n1))
            t, tokens, n0, n1 = sorted(runs)[len(runs) // 2]  # the median run
            ctx = args.ctx + (n0 + n1) / 2  # the timed tokens' mean context
            row.update(engine_burst_s=t, engine_burst_tok_s=1 / t, engine_burst_mbu=engine_bytes(ctx) / t / bw,
                       engine_burst_tokens_timed=tokens, engine_burst_runs=[1 / r[0] for r in runs],
                       engine_burst_ctx=ctx, decode_steps=K)
            print(f"{name}: engine.step() batch-1 decode with bursts of {K}: {1 / t:.1f} tok/s, MBU "
                  f"{row['engine_burst_mbu']:.1%} (median of {len(runs)} runs of {tokens} tokens at mean context "
                  f"{ctx:.0f}; tok/s {min(runs)[0] ** -1:.1f}..{max(runs)[0] ** -1:.1f})", flush=True)
        engine = kv = loaded = compiled = jobs = ex = None  # this model's device memory freed before the next's
        import gc

        gc.collect()
    return res


# ----------------------------------------------------------------------------------------- parent side


def _fmt_row(r: dict) -> str:
    parts = [f"{r['model']:>12} B={r['batch']:<4}"]
    for k in ("model", "step", "executor", "engine", "engine_burst"):
        if f"{k}_s" in r:
            d = f" (returns after {r[f'{k}_dispatch_s'] * 1e3:.3f} ms)" if f"{k}_dispatch_s" in r else ""
            parts.append(f"{k} {r[f'{k}_s'] * 1e3:7.3f} ms {r[f'{k}_tok_s']:9.1f} tok/s {r[f'{k}_mbu']:6.1%}{d}")
    return " | ".join(parts)


def table(res: dict) -> str:
    bw = res["copy_bytes_per_s"]
    lines = [f"device {res['device']}, jax {res['jax']}, copy {bw / 1e12:.2f} TB/s, ctx {res['ctx']}, "
             f"XLA_FLAGS={res['xla_flags'] or '(none)'}",
             "| model | B | floor tok/s | model: tok/s (MBU) | step: tok/s (MBU) | executor: tok/s (MBU) | "
             "engine.step: tok/s (MBU) | engine.step, bursts: tok/s (MBU) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["rows"]:
        cells = [r["model"], str(r["batch"]), f"{r['batch'] / r['floor_s']:,.0f}"]
        for k in ("model", "step", "executor", "engine", "engine_burst"):
            cells.append(f"{r[f'{k}_tok_s']:,.1f} ({r[f'{k}_mbu']:.1%})" if f"{k}_s" in r else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _child_cmd(args, out: str, models, batches, model_batches, no_engine: bool) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--out", out, "--models", *models,
           "--batches", *map(str, batches), "--model-batches", *map(str, model_batches), "--ctx", str(args.ctx),
           "--steps", str(args.steps), "--page-size", str(args.page_size),
           *(["--max-model-len", str(args.max_model_len)] if args.max_model_len else []),
           "--copy-elems", str(args.copy_elems),
           "--min-rep-s", str(args.min_rep_s), "--reps", str(args.reps), "--decode-steps", str(args.decode_steps),
           "--gpu-cublas-min-tokens", str(args.gpu_cublas_min_tokens)]
    if args.profile and out.endswith("main.json"):
        cmd += ["--profile", args.profile, "--profile-batches", *map(str, args.profile_batches)]
    return cmd + (["--no-engine"] if no_engine else [])


def _run(cmd, env) -> dict | None:
    out = cmd[cmd.index("--out") + 1]
    p = subprocess.run(cmd, env=env)
    if p.returncode != 0 or not Path(out).exists():
        return {"error": f"child exited with {p.returncode}"}
    return json.loads(Path(out).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["llama3_2_1b", "llama3_8b"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64, 256])
    ap.add_argument("--model-batches", nargs="+", type=int, default=None,
                    help="batches that also get the pure model step (default: all)")
    ap.add_argument("--ctx", type=int, default=512, help="context tokens of every sequence")
    ap.add_argument("--steps", type=int, default=64, help="decode steps of the engine.step() loop (batch 1)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="EngineConfig.max_model_len of the engines (default: just over what the run needs); the "
                         "page tables are this wide")
    ap.add_argument("--copy-elems", type=int, default=1 << 28, help="f32 elements of the copy ceiling (1 GiB)")
    ap.add_argument("--min-rep-s", type=float, default=0.2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-engine", action="store_true", help="skip the engine.step() loops")
    ap.add_argument("--decode-steps", type=int, default=8,
                    help="K of the batch-1 engine loop with decode bursts (EngineConfig.decode_steps); 1: skip it")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="also trace 20 steps (model and step) of each --profile-batches batch with jax.profiler "
                         "into DIR and list the kernels")
    ap.add_argument("--profile-batches", nargs="+", type=int, default=[1], metavar="B",
                    help="the batches --profile traces (default: 1)")
    ap.add_argument("--flag-variants", nargs="*", default=[], metavar="NAME=XLA_FLAGS")
    ap.add_argument("--variant-models", nargs="+", default=None, help="models of the flag variants (default: the first)")
    add_cublas_arg(ap)
    ap.add_argument("--out", default=None, help="JSON results")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model_batches is None:
        args.model_batches = list(args.batches)
    for flag, v, lo in (("--ctx", args.ctx, 1), ("--steps", args.steps, 1), ("--reps", args.reps, 1),
                        ("--decode-steps", args.decode_steps, 1), ("--page-size", args.page_size, 1)):
        if v < lo:
            ap.error(f"{flag} must be >= {lo}, got {v}")
    if min(args.batches) < 1:
        ap.error(f"--batches must be >= 1, got {args.batches}")
    # the burst loop decodes 4 x --steps tokens (its own engine); the step loop --steps
    bursts = 1 in args.batches and args.decode_steps > 1 and not args.no_engine
    need = args.ctx + (4 if bursts else 1) * args.steps
    if args.max_model_len is not None and args.max_model_len < need:
        ap.error(f"--max-model-len {args.max_model_len} is less than the run needs: {need} (--ctx + --steps, x 4 for "
                 "the burst loop); leave it out for just enough")
    if bursts and 4 * args.steps < 3 * args.decode_steps + 2:
        ap.error(f"--steps {args.steps} is too few to time bursts of {args.decode_steps}: the burst loop decodes 4 x "
                 f"--steps tokens and times them from its second burst on (at least {-(-(3 * args.decode_steps + 2) // 4)})")
    if args.child:
        res = run_child(args)
        Path(args.out).write_text(json.dumps(res, indent=1))
        return

    command = "python3 scripts/bench_decode.py " + " ".join(sys.argv[1:])
    result = {"command": command, "commit": git_commit(), "date": datetime.date.today().isoformat()}
    with tempfile.TemporaryDirectory() as tmp:
        main_res = _run(_child_cmd(args, f"{tmp}/main.json", args.models, args.batches, args.model_batches,
                                   args.no_engine), os.environ.copy())
        result["main"] = main_res
        variants = {}
        for i, spec in enumerate(args.flag_variants):
            name, _, flags = spec.partition("=")
            env = os.environ.copy()
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
            print(f"\n== variant {name}: XLA_FLAGS={env['XLA_FLAGS']}", flush=True)
            variants[name] = _run(_child_cmd(args, f"{tmp}/v{i}.json", args.variant_models or args.models[:1], [1], [1],
                                             args.no_engine), env)
        result["variants"] = variants
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"\ncommit {result['commit']}  {result['date']}  {command}")
    if "rows" in main_res:
        print(table(main_res))
    else:
        print("main run failed:", main_res)
    for name, v in variants.items():
        print(f"\nvariant {name}:")
        print(table(v) if "rows" in v else v)


if __name__ == "__main__":
    main()
