"""The benchmark scripts issue 4's numbers come from, run end to end on CPU at toy sizes
(stories260k's shape, dummy weights): every table they print is built from measurements that must
be finite and positive, and the offline run must produce exactly the requested tokens with no
compile after warmup. HF's side of bench_throughput is skipped here: compiling its static-cache
decode with torch inductor takes minutes on a CPU."""

from __future__ import annotations

import gc
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))  # the scripts' helpers, imported by the tests below


def _run(script: str, *args: str, out: Path) -> dict:
    cmd = [sys.executable, str(ROOT / "scripts" / script), *args, "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(out.read_text())


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_bench_decode_smoke(tmp_path):
    res = _run("bench_decode.py", "--models", "stories260k", "--batches", "1", "2", "--ctx", "32", "--steps", "12",
               "--min-rep-s", "0.01", "--reps", "1", "--copy-elems", str(1 << 20), "--max-model-len", "256",
               "--profile", str(tmp_path / "trace"), "--profile-batches", "2", out=tmp_path / "decode.json")
    rows = {r["batch"]: r for r in res["main"]["rows"]}
    assert sorted(rows) == [1, 2]
    assert res["main"]["models"]["stories260k"]["max_model_len"] == 256
    # only the batch asked for is traced (a CPU trace has no device kernels: the summary says so)
    assert "profile" not in rows[1] and rows[2]["profile"]["step"]["error"] == "no device events"
    one = rows[1]
    for col in ("model", "step", "executor", "engine"):
        assert _positive(one[f"{col}_s"]) and _positive(one[f"{col}_tok_s"]) and 0 < one[f"{col}_mbu"] < 1, col
    assert one["engine_steps_timed"] > 0
    assert one["bytes_per_step"] < rows[2]["bytes_per_step"]  # a second sequence's K/V rows move too
    assert math.isclose(one["floor_s"] / one["step_s"], one["step_mbu"], rel_tol=1e-6)


def test_bench_throughput_smoke(tmp_path):
    res = _run("bench_throughput.py", "--model", "stories260k", "--num-prompts", "4", "--input-len", "16",
               "--output-len", "8", "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--token-buckets", "8",
               "64", "--seq-buckets", "4", "--repeats", "2", "--skip", "hf", "--copy-elems", str(1 << 20),
               "--matmul-size", "256", "--frequency-penalty", "0.5", "--logprobs", "2",
               "--gpu-cublas-min-tokens", "none", "--profile", str(tmp_path / "trace"), "--max-model-len", "64",
               out=tmp_path / "throughput.json")
    x = res["xla"]
    assert x["gpu_cublas_min_tokens"] is None and x["max_model_len"] == 64
    # one more run, traced: a CPU trace has no device kernels, so the summary says so
    prof = x["profile"]
    assert _positive(prof["traced_wall_s"]) and prof["engine_steps"] > 0
    assert prof["error"] == "no device events" and list((tmp_path / "trace").rglob("perfetto_trace.json.gz"))
    assert x["output_tokens"] == 4 * 8 and x["wrong_length"] == [] and x["compiles_after_warmup"] == 0
    # penalized rows asking for logprobs decode in bursts; every token carries its logprobs (wrong_length)
    assert res["workload"]["frequency_penalty"] == 0.5 and res["workload"]["logprobs"] == 2 and x["bursts"] > 0
    assert len(x["wall_s_runs"]) == 2 and all(_positive(w) for w in x["wall_s_runs"])
    assert len(x["full_gc_ms_runs"]) == 2
    lo, hi = x["output_tok_s_range"]
    assert lo <= x["output_tok_s"] <= hi
    assert _positive(x["floor_s"]) and x["floor_s"] < x["wall_s"]


def test_bench_throughput_mesh_smoke(tmp_path):
    """--replica / --tensor put xlaserve on a mesh of fake CPU devices; the floor is one replica's."""
    common = ["--model", "stories260k", "--num-prompts", "4", "--input-len", "16", "--output-len", "8",
              "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--token-buckets", "8", "64", "--seq-buckets",
              "4", "--repeats", "1", "--skip", "hf", "--copy-elems", str(1 << 20), "--matmul-size", "256",
              "--max-model-len", "64", "--decode-steps", "1"]  # bursts: the smoke test above; here the mesh
    x = _run("bench_throughput.py", *common, "--replica", "2", "--tensor", "2", out=tmp_path / "mesh.json")["xla"]
    assert x["mesh"] == {"replica": 2, "tensor": 2} and x["device"].startswith("4 x ")
    assert "tensor" in x["kv_pages_sharding"]  # KV heads split over the tensor axis
    assert x["output_tokens"] == 4 * 8 and x["wrong_length"] == [] and x["compiles_after_warmup"] == 0
    # the floor takes one replica's two tensor devices' ceilings together, for its half of the prompts
    assert x["copy_bytes_per_s"] == 2 * x["device_copy_bytes_per_s"] > 0
    assert x["matmul_flops_per_s"] == 2 * x["device_matmul_flops_per_s"] > 0
    assert x["floor_replicas"] == 2
    assert _positive(x["floor_s"]) and x["floor_s"] < x["wall_s"]


def test_replicas_floor_reads_the_weights_on_every_replica():
    """R replicas at once: the busiest replica's floor on its own ceilings, its decode steps reading the
    whole weights; less than one replica's time for all the prompts, more than that time over R."""
    import argparse

    from bench_throughput import physical_floor

    from models.config import get_preset

    mc = get_preset("llama3_2_1b")

    def floor(num_prompts: int, replicas: int = 1) -> dict:
        work = argparse.Namespace(num_prompts=num_prompts, input_len=512, output_len=256, max_num_seqs=256)
        return physical_floor(mc, work, 4.2e12, 7.0e14, replicas=replicas)

    one, two, half = floor(256), floor(256, replicas=2), floor(128)
    assert two["floor_s"] == half["floor_s"] and two["floor_output_tok_s"] == 2 * half["floor_output_tok_s"]
    assert one["floor_s"] / 2 < two["floor_s"] < one["floor_s"]
    # prefill is compute, split evenly; decode is not: 128 rows a step still read every weight
    assert math.isclose(two["floor_prefill_s"], one["floor_prefill_s"] / 2)
    assert two["floor_decode_s"] > one["floor_decode_s"] / 2 * 1.2
    # an odd count: the busiest replica takes the extra prompt
    odd, three = floor(5, replicas=2), floor(3)
    assert odd["floor_s"] == three["floor_s"] and odd["floor_output_tok_s"] == 5 * 256 / three["floor_s"]


def test_bench_host_smoke(tmp_path):
    res = _run("bench_host.py", "--model", "stories260k", "--num-seqs", "8", "--input-len", "16", "--output-len",
               "12", "--repeats", "2", "--decode-steps", "4", out=tmp_path / "host.json")
    for mode in ("offline", "cumulative", "delta"):  # (every request ran to --output-len: the script checks)
        r = res[mode]
        assert r["decode_steps"] > 0 and _positive(r["median_ms"]) and r["p90_ms"] >= r["median_ms"]
        assert len(r["medians_ms"]) == 2 and math.isclose(r["us_per_seq"], r["median_ms"] * 1e3 / 8)


def test_kernel_summary_of_a_device_trace(tmp_path):
    """benchlib.kernel_summary on a hand-made perfetto trace: kernels on the device's streams only
    (not the host's, not the derived XLA Ops line), busy = the union of their intervals, names
    grouped without numeric suffixes, figures per step."""
    import gzip

    from benchlib import kernel_summary

    def meta(kind, pid, name, tid=None):
        return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": {"name": name}}

    def x(pid, tid, name, ts, dur):
        return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}

    events = [meta("process_name", 1, "/host:CPU"), meta("process_name", 2, "/device:GPU:0"),
              meta("thread_name", 2, "Stream #7(compute)", 7), meta("thread_name", 2, "Stream #9(copy)", 9),
              meta("thread_name", 2, "XLA Ops", 3), meta("thread_name", 1, "python", 1),
              x(1, 1, "host_work", 0, 1000),
              x(2, 3, "gemm_fusion_dot.3", 10, 60),  # the derived line: not counted
              x(2, 7, "gemm_fusion_dot.3", 10, 20), x(2, 7, "fusion.12", 30, 10), x(2, 7, "gemm_fusion_dot.7", 100, 40),
              x(2, 9, "memcpy", 35, 15)]  # overlaps fusion.12: busy 10-50 and 100-140
    (tmp_path / "plugins").mkdir()
    with gzip.open(tmp_path / "plugins" / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = kernel_summary(str(tmp_path), steps=2, top=2)
    assert s["kernels_per_step"] == 2 and s["busy_us_per_step"] == 40 and s["span_us_per_step"] == 65
    assert s["top"] == [{"name": "gemm_fusion_dot", "us_per_step": 30, "count_per_step": 1},
                        {"name": "memcpy", "us_per_step": 7.5, "count_per_step": 0.5}]
    assert s["processes"] == ["/device:GPU:0"]
    assert kernel_summary(str(tmp_path / "plugins" / "none"), steps=1) == {"error": "no perfetto_trace.json.gz written"}


def test_full_gc_pauses_counts_full_collections_in_its_body_only():
    from bench_throughput import full_gc_pauses

    callbacks = list(gc.callbacks)
    with full_gc_pauses() as pauses:
        gc.collect(0)
        gc.collect(1)
        gc.collect()
        gc.collect(2)
    gc.collect()
    assert len(pauses) == 2 and all(_positive(p) for p in pauses)
    assert gc.callbacks == callbacks


def test_bench_kernels_ragged_prefill_smoke():
    """bench_kernels' ragged_prefill section, in process: the Triton kernel in interpret mode beside
    the reference on a first chunk and on a chunk after context (both through its unmasked loop).
    Rows carry finite positive rates and the kernel's error against the reference; the GPU-only
    peers become rows with an error, not a crash."""
    import bench_kernels
    from functools import partial

    from pallas_kernels.ragged_paged_attention import gpu, ref_ragged_paged_attention

    kernels = {"reference": ref_ragged_paged_attention,
               "triton_interpret": partial(gpu.ragged_paged_attention, interpret=True)}
    rows = bench_kernels.bench_ragged_prefill(configs=((2, 32, 0, 64), (1, 16, 48, 64)), N=4, K=2, kernels=kernels)
    by = {(r["ctx"], r["impl"]): r for r in rows}
    assert sorted(by) == [(0, "cudnn"), (0, "flash_attention"), (0, "reference"), (0, "triton_interpret"),
                          (48, "reference"), (48, "triton_interpret")]
    for ctx in (0, 48):
        assert by[(ctx, "reference")]["rel_err"] == 0
        r = by[(ctx, "triton_interpret")]
        assert r["finite"] and r["rel_err"] < 2e-2 and _positive(r["tflops"]) and _positive(r["seconds"])
    assert "error" in by[(0, "cudnn")] and "error" in by[(0, "flash_attention")]


@pytest.mark.parametrize("script, args, message", [
    ("bench_decode.py", ["--reps", "0"], "--reps must be >= 1, got 0"),
    ("bench_decode.py", ["--batches", "1", "--steps", "2"], "--steps 2 is too few to time bursts of 8"),
    ("bench_decode.py", ["--ctx", "64", "--steps", "8", "--max-model-len", "32"],
     "--max-model-len 32 is less than the run needs: 96"),
    ("bench_serving.py", ["--request-rate", "0"], "request rates must be > 0"),
    ("bench_serving.py", ["--burstiness", "0"], "--burstiness must be > 0"),
    ("bench_throughput.py", ["--model", "stories260k", "--input-len", "500", "--output-len", "100"],
     "--input-len + --output-len = 600 is more than stories260k's context of 512"),
    ("bench_throughput.py", ["--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
])
def test_bench_scripts_refuse_settings_they_cannot_run(script, args, message):
    """Each used to fail later with a traceback (StopIteration, ZeroDivisionError, a broadcast
    error deep in the engine) or, for bench_throughput's context, to run HF past the model's."""
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and message in p.stderr.splitlines()[-1], p.stderr
