"""Host cost of the engine's step: `Engine.step` at many running sequences, with the device's work
taken out, so that every millisecond measured is the host's.

  python3 scripts/bench_host.py --out host.json      # 256 x (512 in / 256 out), smollm2_135m's shape, CPU
  python3 scripts/bench_host.py --num-seqs 8 --input-len 16 --output-len 8 --repeats 1   # smoke test

Why: with lookahead (runtime/engine.py) the host plans and packs step k+1 and emits step k's
outputs while the device runs step k; when that host work takes longer than the device's step,
the device waits. At 256 sequences of llama3_2_1b an H100 decode step takes ~3.4 ms of device time
(docs/benchmarks.md), so single-step serving keeps the device busy only if the host's side stays
below that.

How: a real engine (scheduler, prefix cache, packer, the executor's page-table sync with its small
scatter programs, resolve, output building) around `HostOnlyExecutor`, which stands in for the model
and sampler programs: every row "samples" the same token at once (EOS is ignored, so every request
runs to --output-len). The model is `dummy:MODEL` (no tokenizer: no detokenization). The timed
steps are the decode-only steps (no prefill token in the step), each wall-timed around
`Engine.step()`; the median over them is reported per output mode, as the best of --repeats runs
(fresh prompts each run, so the prefix cache serves none): this machine's timings vary by tens of
percent from run to run.

Output modes (--modes): `offline` (step(partial=False), as LLM.generate), `cumulative` (every
running request's output each step, SamplingParams.output_kind "cumulative": the async engine's
default), `delta` (output_kind "delta": what the servers use).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchlib import git_commit  # noqa: E402

MODES = ("offline", "cumulative", "delta")


class HostOnlyExecutor:
    """The engine's StepExecutor without its model and sampler programs: a step syncs the device's
    page table (StepExecutor.sync_pages: host work plus its scatter programs) and returns `token` for
    every row at once ([K, slots] for a burst of K steps). Everything else is the real executor's."""

    def __init__(self, real, token: int):
        import jax

        self.real = real
        self.tokens = {k: jax.device_put(np.full((k, real.slots) if k > 1 else (real.slots,), token, np.int32))
                       for k in {1, real.decode_steps}}

    def __call__(self, params, kv_pages, batch, prev_tokens=None, prev_burst=None):
        self.real.sync_pages(batch)
        tokens = self.tokens[batch.steps]
        return tokens, tokens[-1] if batch.steps > 1 else tokens, None, kv_pages

    def __getattr__(self, name):
        return getattr(self.real, name)


def run_mode(llm, mode: str, args, seed: int) -> dict:
    from runtime.engine import frozen_heap
    from runtime.request import OUTPUT_DELTA, OUTPUT_CUMULATIVE, SamplingParams

    eng = llm.engine
    kind = OUTPUT_DELTA if mode == "delta" else OUTPUT_CUMULATIVE
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, output_kind=kind)
    rng = np.random.default_rng(seed)
    vocab = llm.engine.model.config.vocab_size
    for _ in range(args.num_seqs):
        eng.add_request(rng.integers(1, vocab, args.input_len).tolist(), params)
    decode, produced = [], {}
    with frozen_heap():  # as LLM.generate and the async engine run it
        while eng.has_unfinished():
            before, steps = eng.scheduler.stats().prefill_tokens, eng.stats().num_steps
            t0 = time.perf_counter()
            outs = eng.step(partial=mode != "offline")
            dt = time.perf_counter() - t0
            # a decode step: no prefill token, and a program dispatched (the last call only settles)
            if eng.scheduler.stats().prefill_tokens == before and eng.stats().num_steps > steps:
                decode.append(dt)
            for o in outs:
                if o.finished:
                    produced[o.request_id] = len(o.outputs[0].token_ids)
    eng.check_invariants()
    if sorted(produced.values()) != [args.output_len] * args.num_seqs:
        raise RuntimeError(f"{mode}: requests produced {sorted(set(produced.values()))} tokens, not {args.output_len}")
    ms = sorted(t * 1e3 for t in decode)
    return {"decode_steps": len(ms), "median_ms": statistics.median(ms), "p90_ms": ms[int(0.9 * (len(ms) - 1))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2_135m", help="a preset (dummy weights)")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=1, help="EngineConfig.decode_steps (bursts: > 1)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="runs per mode; the best median is reported")
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import jax

    from runtime.llm import LLM

    G = args.page_size
    llm = LLM(f"dummy:{args.model}", dtype="float32", max_num_seqs=args.num_seqs,
              max_num_batched_tokens=max(2048, args.num_seqs), page_size=G,
              max_model_len=-(-(args.input_len + args.output_len) // G) * G, token_buckets=(max(2048, args.num_seqs),),
              seq_buckets=(args.num_seqs,), decode_steps=args.decode_steps, warmup=False, progress=False)
    llm.engine.executor = HostOnlyExecutor(llm.engine.executor, token=1)
    # one short run first: the page-table programs compile at their first use (warmup=False)
    run_mode(llm, "offline", argparse.Namespace(**{**vars(args), "output_len": 2}), args.seed + 10**6)
    res = {"commit": git_commit(), "device": str(jax.devices()[0]), "cpu": os.cpu_count(), "args": vars(args)}
    print(f"host ms per decode step, {args.num_seqs} sequences, {args.input_len} in / {args.output_len} out, "
          f"decode_steps {args.decode_steps} (median of the decode steps; best of {args.repeats} runs)")
    for m, mode in enumerate(args.modes):
        runs = [run_mode(llm, mode, args, args.seed + 100 * m + r) for r in range(args.repeats)]
        best = min(runs, key=lambda r: r["median_ms"])
        res[mode] = {**best, "medians_ms": [round(r["median_ms"], 3) for r in runs],
                     "us_per_seq": best["median_ms"] * 1e3 / args.num_seqs}
        print(f"  {mode:<10} {best['median_ms']:7.3f} ms (p90 {best['p90_ms']:.3f}; runs "
              + ", ".join(f"{r['median_ms']:.3f}" for r in runs) + f") = {res[mode]['us_per_seq']:.1f} us per sequence")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
