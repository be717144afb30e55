"""Offline throughput: xlaserve `LLM.generate` against HF transformers `generate` (static cache) on
the same model shape, the same random prompts and the same GPU, in one run.

  python3 scripts/bench_throughput.py --out throughput.json            # llama3_2_1b, 256 x (512 in / 256 out)
  python3 scripts/bench_throughput.py --model smollm2_135m --num-prompts 8 --input-len 32 --output-len 16 --max-num-seqs 8 \
      --max-num-batched-tokens 256 --token-buckets 16 256 --seq-buckets 8 --hf-batch 8 \
      --copy-elems 1048576 --matmul-size 256      # CPU smoke test (tests/scripts runs one without HF)

Workload: `--num-prompts` prompts of `--input-len` random token ids (seeded), `--output-len` tokens
each, greedy, EOS ignored (every request generates exactly output-len tokens; checked). Optional
penalties: `--repetition-penalty` on both sides (HF's `repetition_penalty` is the same
definition), `--presence-penalty` / `--frequency-penalty` on xlaserve only (HF generate has no
such option: run them with `--skip hf`). `--logprobs N` (xlaserve only, with `--skip hf`) asks every
request for its tokens' logprobs and the top N; each output is checked to carry them.

`--repeats N` (default 3) times the workload N times on each side, with fresh random prompts each
time (seeds `--seed`, +2, +4, ...; the same prompts on both sides), and reports the median run and
the range: on the H200 here, single runs of the same generate varied by up to a third. Fresh prompts
keep xlaserve's prefix cache from serving a repeat's prefill.

xlaserve: `LLM("dummy:MODEL", dtype="bfloat16", ...)` with random weights made on the device, a
small bucket table (warmup compile time is reported apart; by default token buckets 256 / 4096 /
8192 and seq buckets 64 / 128 / 256, so that the default workload's last prefill step, ~2,100
tokens, and last decode burst, ~100 sequences, are not padded to full ones: docs/benchmarks.md,
twenty-sixth session), LLM's decode bursts (`--decode-steps` sets EngineConfig.decode_steps; 1
turns them off), one short warm-up generate, then the
timed `LLM.generate` of the whole workload (scheduler, chunked prefill, continuous batching, the
step's compiled programs -- greedy: the model program alone --, detokenization skipped as there is
no tokenizer). Full garbage collections inside each timed run are reported with their pauses.
`--profile DIR` then traces one more run (fresh prompts, not in the timings) with jax.profiler and
lists the device kernels that took the most time in it, with their counts, and the device's busy
time against the run's span (`result["xla"]["profile"]`; a CPU trace has no device kernels).

`--replica R --tensor T` run xlaserve on a mesh of R x T devices (EngineConfig.mesh: the weights and the
KV pages split over KV heads on the tensor axis; R engines, one per replica, each with --max-num-seqs
sequences and its own KV pool: runtime/replicas.py); its floor is then one replica's, each ceiling (measured
on the first device) times T, for the busiest replica's share of the prompts (each replica reads the whole
weights every decode step). HF runs on one GPU whatever the mesh.

HF: the preset's model class of transformers (`LlamaForCausalLM(LlamaConfig(...same shape...))` for
the Llama presets; Qwen2's, Qwen3's and Mistral's for theirs) in bf16 with random weights on the GPU,
`generate(..., cache_implementation="static", do_sample=False)` in batches of `--hf-batch`
prompts (SDPA attention; whatever generate itself does for a static cache, which in transformers 5
includes compiling the decode step), warmed up by one full call on the first batch (same shapes as
the timed calls; its time is reported as first_call_s) and one on a last, smaller batch where
--num-prompts is not a multiple of --hf-batch, then timed with cuda.synchronize.

The two sides run one after the other, each in its own child process, so that neither holds GPU
memory while the other runs (XLA preallocates 75% of the card by default, kept as it is). Both
report output tokens per second (generated tokens / wall time of the generate call) and the ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchlib import (  # noqa: E402
    add_cublas_arg, copy_bandwidth, cublas_kwargs, git_commit, kernel_summary, matmul_flops, print_kernel_summary)


def repeat_seed(args, r: int) -> int:
    """Prompt seed of timed run r: even offsets from --seed (the warm-up uses --seed + 1)."""
    return args.seed + 2 * r


def timing_summary(walls: list[float], n_out: int, n_in: int) -> dict:
    """The median run's wall time and rates, with every run's wall time beside them."""
    wall = statistics.median(walls)
    return {"wall_s": wall, "wall_s_runs": walls, "output_tok_s": n_out / wall,
            "output_tok_s_range": [n_out / max(walls), n_out / min(walls)], "total_tok_s": (n_out + n_in) / wall}


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(1, vocab, size=(n, length)).tolist()


def run_xla(args) -> dict:
    import jax

    from models.config import get_preset
    from runtime.llm import LLM
    from runtime.request import SamplingParams
    from sharding.mesh import MeshConfig

    mc = get_preset(args.model)
    G = args.page_size
    max_model_len = (None if args.max_model_len == "model" else args.max_model_len
                     or -(-(args.input_len + args.output_len) // G) * G)
    cfg = dict(dtype="bfloat16", max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               page_size=G, max_model_len=max_model_len, progress=False,
               token_buckets=tuple(args.token_buckets) if args.token_buckets else None,
               seq_buckets=tuple(args.seq_buckets) if args.seq_buckets else None,
               mesh=MeshConfig(replica=args.replica, tensor=args.tensor))
    if args.num_pages:
        cfg["num_pages"] = args.num_pages
    if args.decode_steps is not None:
        cfg["decode_steps"] = args.decode_steps
    cfg.update(cublas_kwargs(args.gpu_cublas_min_tokens))
    t0 = time.perf_counter()
    llm = LLM(f"dummy:{args.model}", **cfg)
    init_s = time.perf_counter() - t0
    eng = llm.engine
    st0 = eng.stats()
    # warm-up: a few short requests through the same programs
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(make_prompts(min(4, args.num_prompts), args.input_len, mc.vocab_size, args.seed + 1), warm,
                 use_tqdm=False)
    st1 = eng.stats()
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                            repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty, logprobs=args.logprobs)
    walls, bad, full_gcs = [], [], []
    for r in range(args.repeats):
        prompts = make_prompts(args.num_prompts, args.input_len, mc.vocab_size, repeat_seed(args, r))
        with full_gc_pauses() as pauses:
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            walls.append(time.perf_counter() - t0)
        full_gcs.append([round(p * 1e3, 1) for p in pauses])
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        bad += [(r, i) for i, o in enumerate(outs) if len(o.outputs[0].token_ids) != args.output_len
                or (args.logprobs is not None and (len(o.outputs[0].logprobs) != args.output_len
                                                   or min(map(len, o.outputs[0].logprobs)) < args.logprobs))]
        eng.check_invariants()
    st2 = eng.stats()
    profile = profile_run(llm, args, mc.vocab_size, params) if args.profile else None
    mesh = dict(eng.model.mesh.shape)  # the devices the engine ran on
    num_devices = eng.model.mesh.devices.size
    dev = eng.model.mesh.devices.flat[0]
    kind = getattr(dev, "device_kind", str(dev))
    res = {
        "device": kind if num_devices == 1 else f"{num_devices} x {kind}", "jax": jax.__version__,
        "mesh": {"replica": mesh["replica"], "tensor": mesh["tensor"]},
        "kv_pages_sharding": str(getattr(eng, "replicas", [eng])[0].kv_pages[0].sharding.spec),  # each replica's
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "init_s": init_s,
        "warmup_compile_s": st0.warmup_seconds,  # EngineConfig.warmup: compiles, and on GPUs each program's first run
        "num_warmup_compiles": st0.num_warmup_compiles, "num_pages": st0.num_total_pages,
        "token_buckets": eng.config.token_bucket_table, "seq_buckets": eng.config.seq_bucket_table,
        **timing_summary(walls, n_out, args.num_prompts * args.input_len), "output_tokens": n_out,
        "wrong_length": bad[:5], "repeats": args.repeats,
        "decode_steps": eng.config.decode_steps,
        "gpu_cublas_min_tokens": eng.config.gpu_cublas_min_tokens, "max_model_len": eng.config.max_model_len,
        "steps": (st2.num_steps - st1.num_steps) / args.repeats,  # per run (every replica's, summed)
        "bursts": (st2.num_bursts - st1.num_bursts) / args.repeats,  # per run, of the steps
        "preemptions": st2.num_preemptions - st1.num_preemptions,  # all runs
        "prefill_tokens": (st2.prefill_tokens - st1.prefill_tokens) / args.repeats,  # per run
        "compiles_after_warmup": st2.num_compiles_after_warmup,
        "full_gc_ms_runs": full_gcs,  # each timed run's full (generation 2) garbage collections
    }
    if profile is not None:
        res["profile"] = profile
    del llm, eng  # the KV pool: room for the ceiling measurements
    gc.collect()
    copy_s = copy_bandwidth(args.copy_elems)["copy_bytes_per_s"]
    matmul_s = matmul_flops(args.matmul_size)["matmul_flops_per_s"]
    replica_devices = num_devices // mesh["replica"]
    res.update(physical_floor(mc, args, copy_s * replica_devices, matmul_s * replica_devices, replicas=mesh["replica"]),
               device_copy_bytes_per_s=copy_s, device_matmul_flops_per_s=matmul_s)
    return res


def profile_run(llm, args, vocab_size: int, params) -> dict:
    """One more run of the workload (fresh prompts, untimed) traced with jax.profiler into
    --profile: where the device's time went in the whole run (benchlib.kernel_summary), printed."""
    import jax

    prompts = make_prompts(args.num_prompts, args.input_len, vocab_size, repeat_seed(args, args.repeats))
    steps0 = llm.engine.stats().num_steps
    t0 = time.perf_counter()
    # Python tracer off: the device's kernels are what is listed, and tracing every Python call made
    # the traced run take 17.8 s instead of 5.0 s on an H100 (collection included).
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with jax.profiler.trace(args.profile, create_perfetto_trace=True, profiler_options=options):
        llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    llm.engine.check_invariants()
    prof = {"traced_wall_s": wall, "engine_steps": llm.engine.stats().num_steps - steps0,
            **kernel_summary(args.profile, 1, top=args.profile_top)}
    print(f"traced run: {wall:.2f} s wall (tracing included), {prof['engine_steps']} engine steps", flush=True)
    print_kernel_summary("traced run", prof, unit="run")
    return prof


@contextlib.contextmanager
def full_gc_pauses():
    """Yields a list that collects the duration (s) of every full (generation 2) garbage collection
    in the body: ~0.25 s each in a warmed-up process when the heap is not frozen (runtime/engine.py,
    frozen_heap)."""
    pauses, start = [], []

    def watch(phase, info):
        if info["generation"] == 2:
            if phase == "start":
                start.append(time.perf_counter())
            elif start:
                pauses.append(time.perf_counter() - start.pop())

    gc.callbacks.append(watch)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(watch)


def physical_floor(mc, args, copy_bytes_per_s: float, matmul_flops_per_s: float, replicas: int = 1) -> dict:
    """The least time any engine needs for the workload, from two ceilings measured in the same
    process: prefill is compute (2 FLOPs per weight per prompt token, the LM head only for each
    prompt's last token, plus causal attention's QK and PV), at the bf16 matmul rate; each decode
    step moves the weights it reads and every K/V row of the batch's contexts at copy bandwidth, or
    computes 2 FLOPs per weight per sequence, whichever takes longer. Sequences decode max_num_seqs
    at a time (waves), K/V in bf16; the embedding table is not read at decode (B rows gathered)
    unless tied (the LM head).

    The ceilings are one replica's (its devices' summed). With `replicas` R > 1 the
    prompts split as evenly as they can over R replicas that run at once, and each replica's decode
    steps read the whole weights for its own rows: the floor is the busiest replica's, not the
    single-replica floor divided by R (which would count the weights once for all R)."""
    D, V, L = mc.hidden_size, mc.vocab_size, mc.num_layers
    head = V * D
    body = mc.num_params - head * (1 if mc.tie_word_embeddings else 2)  # the layers' weights
    n, T_in, T_out = -(-args.num_prompts // replicas), args.input_len, args.output_len  # the busiest replica's
    attn_prefill = 4 * L * mc.num_heads * mc.head_dim * (T_in * (T_in + 1) / 2)  # QK and PV, causal
    prefill_flops = n * (2 * body * T_in + 2 * head + attn_prefill)
    prefill_s = prefill_flops / matmul_flops_per_s
    weights_read = 2 * (body + head)  # bf16, every decode step
    kv_tok = mc.kv_bytes_per_token(2)
    decode_s = 0.0
    for start in range(0, n, args.max_num_seqs):
        B = min(args.max_num_seqs, n - start)
        for i in range(1, T_out):  # the first output token comes from the prefill
            ctx = T_in + i
            t_mem = (weights_read + B * (ctx + 1) * kv_tok) / copy_bytes_per_s
            t_cmp = 2 * (body + head) * B / matmul_flops_per_s
            decode_s += max(t_mem, t_cmp)
    floor_s = prefill_s + decode_s
    return {"floor_s": floor_s, "floor_prefill_s": prefill_s, "floor_decode_s": decode_s,
            "floor_output_tok_s": args.num_prompts * T_out / floor_s, "copy_bytes_per_s": copy_bytes_per_s,
            "matmul_flops_per_s": matmul_flops_per_s, "floor_replicas": replicas}


def run_hf(args) -> dict:
    import torch
    import transformers

    from models.config import get_preset

    mc = get_preset(args.model)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    # the preset's own family: Qwen2's q/k/v biases, Qwen3's q/k norms, Mistral's window
    family = mc.architecture.removesuffix("ForCausalLM")
    extra = {"sliding_window": mc.sliding_window} if family == "Mistral" else {}
    if family == "Llama" and mc.attention_bias:
        extra["attention_bias"] = True
    hf_cfg = getattr(transformers, f"{family}Config")(
        vocab_size=mc.vocab_size, hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
        num_hidden_layers=mc.num_layers, num_attention_heads=mc.num_heads, num_key_value_heads=mc.num_kv_heads,
        head_dim=mc.head_dim, rms_norm_eps=mc.rms_norm_eps, rope_theta=mc.rope_theta,
        max_position_embeddings=mc.max_position_embeddings, tie_word_embeddings=mc.tie_word_embeddings,
        bos_token_id=None, eos_token_id=None, pad_token_id=0, **extra,
    )
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(dev):
        model = getattr(transformers, mc.architecture)(hf_cfg)
    model = model.to(dev, torch.bfloat16).eval()
    for p in model.parameters():  # HF's init leaves some tensors constant: make every weight random
        if p.dim() > 1:
            p.data.normal_(0.0, 0.02)
    init_s = time.perf_counter() - t0
    gen = dict(max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False,
               cache_implementation="static", pad_token_id=0, eos_token_id=None,
               repetition_penalty=args.repetition_penalty)
    model.generation_config.eos_token_id = None
    runs = [torch.tensor(make_prompts(args.num_prompts, args.input_len, mc.vocab_size, repeat_seed(args, r)),
                         dtype=torch.long, device=dev) for r in range(args.repeats)]
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    B = min(args.hf_batch, args.num_prompts)
    with torch.inference_mode():
        # warm-up with the timed shapes: generate may compile the decode step for a static cache,
        # and the cache and any compiled graph depend on batch size and max_new_tokens (a last,
        # smaller batch is a shape of its own)
        for b in sorted({B, args.num_prompts % B} - {0}, reverse=True):
            x = runs[0][:b]
            sync()
            t0 = time.perf_counter()
            model.generate(input_ids=x, attention_mask=torch.ones_like(x), **gen)
            sync()
            if b == B:
                first_s = time.perf_counter() - t0
        walls, bad = [], 0
        for ids in runs:
            t0 = time.perf_counter()
            n_out = 0
            for i in range(0, len(ids), B):
                x = ids[i : i + B]
                out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), **gen)
                new = out.shape[1] - x.shape[1]
                n_out += new * x.shape[0]
                bad += int(new != args.output_len)
            sync()
            walls.append(time.perf_counter() - t0)
    return {
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
        "transformers": transformers.__version__, "hf_batch": B, "init_s": init_s,
        **timing_summary(walls, n_out, args.num_prompts * args.input_len), "repeats": args.repeats,
        "first_call_s": first_s, "compiled": bool(getattr(model, "_compiled_call", None)),
        "output_tokens": n_out, "wrong_length_batches": bad,
        "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else None,
    }




def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3_2_1b")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per side (median reported, range beside it)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--token-buckets", nargs="*", type=int, default=[256, 4096, 8192])
    ap.add_argument("--seq-buckets", nargs="*", type=int, default=[64, 128, 256])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--replica", type=int, default=1, help="xlaserve's mesh: replicas (EngineConfig.mesh)")
    ap.add_argument("--tensor", type=int, default=1, help="xlaserve's mesh: tensor-parallel devices")
    ap.add_argument("--max-model-len", type=lambda v: v if v == "model" else int(v), default=None, metavar="N|model",
                    help="EngineConfig.max_model_len (default: input + output, rounded up to a page; 'model': the "
                         "model's maximum, the engine's own default)")
    ap.add_argument("--num-pages", type=int, default=None, help="default: the engine's estimate from free memory")
    ap.add_argument("--decode-steps", type=int, default=None,
                    help="EngineConfig.decode_steps (decode bursts); default: LLM's (runtime/llm.py)")
    ap.add_argument("--repetition-penalty", type=float, default=1.0, help="both sides")
    ap.add_argument("--presence-penalty", type=float, default=0.0, help="xlaserve only (needs --skip hf)")
    ap.add_argument("--frequency-penalty", type=float, default=0.0, help="xlaserve only (needs --skip hf)")
    ap.add_argument("--logprobs", type=int, default=None,
                    help="top-n logprobs per token; xlaserve only (needs --skip hf)")
    ap.add_argument("--hf-batch", type=int, default=256, help="prompts per HF generate call")
    add_cublas_arg(ap)
    ap.add_argument("--skip", nargs="*", default=[], choices=["hf", "xla"])
    ap.add_argument("--copy-elems", type=int, default=1 << 28, help="f32 elements of the copy ceiling (1 GiB)")
    ap.add_argument("--matmul-size", type=int, default=8192, help="m of the bf16 m x m x m matmul ceiling")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="after the timed runs, trace one more xlaserve run into DIR and list its kernels")
    ap.add_argument("--profile-top", type=int, default=20, help="kernel names listed with --profile")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", choices=["hf", "xla"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.replica < 1 or args.tensor < 1:
        ap.error(f"--replica and --tensor must be >= 1, got {args.replica} and {args.tensor}")
    if args.profile_top < 1:
        ap.error(f"--profile-top must be >= 1, got {args.profile_top}")
    if (args.presence_penalty or args.frequency_penalty) and "hf" not in args.skip:
        ap.error("HF generate has no presence or frequency penalty: add --skip hf")
    if args.logprobs is not None and "hf" not in args.skip:
        ap.error("--logprobs is measured on xlaserve only: add --skip hf")
    for name in ("num_prompts", "input_len", "output_len", "hf_batch"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    from models.config import get_preset

    try:
        context = get_preset(args.model).max_position_embeddings
    except ValueError as e:
        ap.error(str(e))
    if args.input_len + args.output_len > context:
        ap.error(f"--input-len + --output-len = {args.input_len + args.output_len} is more than {args.model}'s "
                 f"context of {context}")
    if args.child:
        res = run_xla(args) if args.child == "xla" else run_hf(args)
        Path(args.child_out).write_text(json.dumps(res, indent=1))
        return

    command = "python3 scripts/bench_throughput.py " + " ".join(sys.argv[1:])
    result = {"command": command, "commit": git_commit(), "date": datetime.date.today().isoformat(),
              "workload": {"model": args.model, "num_prompts": args.num_prompts, "input_len": args.input_len,
                           "output_len": args.output_len, "greedy": True, "ignore_eos": True,
                           "repetition_penalty": args.repetition_penalty, "presence_penalty": args.presence_penalty,
                           "frequency_penalty": args.frequency_penalty, "logprobs": args.logprobs}}
    with tempfile.TemporaryDirectory() as tmp:
        for side in ("xla", "hf"):
            if side in args.skip:
                continue
            out = f"{tmp}/{side}.json"
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--child", side,
                                "--child-out", out])
            if p.returncode != 0 or not Path(out).exists():
                result[side] = {"error": f"child exited with {p.returncode}"}
            else:
                result[side] = json.loads(Path(out).read_text())
            result[side]["process_s"] = time.perf_counter() - t0
            print(f"{side}: {json.dumps(result[side])}", flush=True)
    x, h = result.get("xla", {}), result.get("hf", {})
    if "output_tok_s" in x and "output_tok_s" in h:
        result["ratio_output_tok_s"] = x["output_tok_s"] / h["output_tok_s"]
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    w = result["workload"]
    print(f"\ncommit {result['commit']}  {result['date']}  {command}")
    penalties = "".join(f", {k} {w[k]}" for k, off in (("repetition_penalty", 1.0), ("presence_penalty", 0.0),
                                                         ("frequency_penalty", 0.0), ("logprobs", None)) if w[k] != off)
    print(f"workload: {w['model']} bf16 random weights, {w['num_prompts']} prompts x {w['input_len']} in / "
          f"{w['output_len']} out, greedy, ignore_eos{penalties}")
    print(f"median of {args.repeats} timed run(s) per side; output tok/s range over the runs in brackets")
    print("| engine | device | output tok/s | total tok/s | wall s | note |")
    print("| --- | --- | --- | --- | --- | --- |")

    def rate(d):
        lo, hi = d["output_tok_s_range"]
        return f"{d['output_tok_s']:,.0f} [{lo:,.0f}-{hi:,.0f}]"

    m = x.get("mesh", {})
    on_mesh = m.get("replica", 1) * m.get("tensor", 1) > 1
    if "output_tok_s" in x:
        mesh = "replica {replica} x tensor {tensor}, ".format(**x["mesh"]) if on_mesh else ""
        print(f"| xlaserve LLM.generate | {x['device']} | {rate(x)} | {x['total_tok_s']:,.0f} | "
              f"{x['wall_s']:.2f} | {mesh}{x['steps']:.0f} steps a run "
              f"({x['bursts']:.0f} bursts of {x['decode_steps']}), "
              f"{x['preemptions']} preemptions, warmup "
              f"{x['num_warmup_compiles']} programs {x['warmup_compile_s']:.0f}s, "
              f"full GCs in the timed runs (ms): {x['full_gc_ms_runs']} |")
    elif "xla" in result:
        print(f"| xlaserve | failed: {x.get('error')} |")
    if "output_tok_s" in h:
        print(f"| HF generate static cache, batch {h['hf_batch']} | {h['device']} | {rate(h)} | "
              f"{h['total_tok_s']:,.0f} | {h['wall_s']:.2f} | torch {h['torch']}, transformers "
              f"{h['transformers']} |")
    elif "hf" in result:
        print(f"| HF | failed: {h.get('error')} |")
    if "floor_output_tok_s" in x:
        mesh = ("each replica's, its devices' summed, for its share of the prompts:" if on_mesh
                else "this device's")
        print(f"| physical floor ({mesh} copy {x['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
              f"{x['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s) | {x['device']} | {x['floor_output_tok_s']:,.0f} | - | "
              f"{x['floor_s']:.2f} | prefill {x['floor_prefill_s']:.2f} s + decode {x['floor_decode_s']:.2f} s |")
    if x.get("wrong_length") or h.get("wrong_length_batches"):
        print(f"WARNING: outputs of the wrong length (xlaserve: {x.get('wrong_length')}, HF batches: "
              f"{h.get('wrong_length_batches')}): the two sides did not generate the same tokens")
    if "ratio_output_tok_s" in result:
        print(f"ratio xlaserve / HF (output tok/s): {result['ratio_output_tok_s']:.2f}x")
    if "floor_output_tok_s" in x:
        print(f"xlaserve at {x['output_tok_s'] / x['floor_output_tok_s']:.0%} of the floor"
              + (f"; the floor is {x['floor_output_tok_s'] / h['output_tok_s']:.2f}x HF" if "output_tok_s" in h else ""))


if __name__ == "__main__":
    main()
