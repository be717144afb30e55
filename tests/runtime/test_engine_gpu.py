"""The engine on an NVIDIA GPU: EngineConfig.gpu_cublas_min_tokens, the decode-only model programs,
the greedy head bursts, the unrolled batch-1 bursts, meshes of two GPUs. Run on a GPU host with
JAX_PLATFORMS=cuda,cpu (the device tool)."""

import jax
import numpy as np
import pytest

import runtime.engine
from runtime.checkpoint import load_model
from runtime.compilation import DECODE_MODEL
from runtime.llm import LLM
from runtime.request import SamplingParams
from sharding.mesh import MeshConfig
from tests.pallas_kernels.test_swiglu import requires_hopper
from tests.runtime.test_step import _compile_options_seen


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpus(), reason="needs an NVIDIA GPU")]

CFG = dict(max_num_seqs=8, max_num_batched_tokens=64, token_buckets=(8, 64), seq_buckets=(8,), max_model_len=128,
           num_pages=128, strict_compile=True, progress=False, decode_steps=4)
NO_TRITON = {"xla_gpu_enable_triton_gemm": False}


def test_cublas_from_the_token_bucket_up_with_the_same_tokens(monkeypatch):
    """Programs of token buckets >= gpu_cublas_min_tokens compile without XLA's Triton GEMMs, the
    others keep them; greedy outputs and their logprobs agree with XLA's own choice everywhere."""
    m = load_model("dummy:smollm2_135m", mesh=MeshConfig().make_mesh(_gpus()), dtype="bfloat16", seed=0)
    prompts = np.random.default_rng(0).integers(1, m.config.vocab_size, (6, 40)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    outs = {}
    for min_tokens in (None, 64):
        seen = _compile_options_seen(monkeypatch)
        llm = LLM(m, **CFG, gpu_cublas_min_tokens=min_tokens)
        e = llm.engine
        try:
            keys = e.executor.program_keys()
            assert len(seen) == len(keys)
            big = lambda k: k[0] in ("model", DECODE_MODEL, "burst") and k[1] >= min_tokens  # noqa: E731
            want = {k: NO_TRITON if min_tokens and big(k) else {} for k in keys}
            assert {k: e.executor.compiler_options(k) for k in keys} == want
            assert sorted(map(str, (o or {} for _, o in seen))) == sorted(map(str, want.values()))
            # XLA names its Triton GEMMs gemm_fusion*; cuBLAS runs as __cublas$lt custom calls
            small, large = (e.executor._executables[("model", T, 8)].as_text() for T in (8, 64))
            assert "gemm_fusion" in small
            assert ("gemm_fusion" in large, "__cublas$lt" in large) == ((True, False) if min_tokens is None
                                                                         else (False, True))
            outs[min_tokens] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            e.close()
        monkeypatch.undo()
    for a, b in zip(outs[None], outs[64]):
        la = [lp[t] for lp, t in zip(a.logprobs, a.token_ids)]
        lb = [lp[t] for lp, t in zip(b.logprobs, b.token_ids)]
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        np.testing.assert_allclose(la[:n], lb[:n], atol=0.05)
        if n < len(a.token_ids):
            # bf16 sums in another order part them only where the top two logits are a near-tie (the
            # dummy's 0.02 weights make many): b's token is a's runner-up, as likely within 0.05
            row, ta, tb = a.logprobs[n], a.token_ids[n], b.token_ids[n]
            assert tb in row and row[ta] - row[tb] < 0.05, (n, row, ta, tb)


def test_single_decode_steps_run_the_fused_decode_program(monkeypatch):
    """On a GPU the executor compiles a decode-only model program per decode pair (each layer's KV
    write inside its attention launch) and single steps without a prefill token run it. In float32,
    with weights that leave no near-ties, their greedy tokens equal those of the two-launch model
    program (the executor's switch off) and of decode bursts, which run the same forward."""
    from tests.testing.engine import scaled_dummy, spy_programs

    model = scaled_dummy()  # head dim 16: the GPU kernels
    assert model.attn_impl == "gpu" and runtime.engine._decode_programs(model)
    prompts = np.random.default_rng(0).integers(0, model.config.vocab_size, (6, 20)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for name, steps, fused in (("single", 1, True), ("two_launch", 1, False), ("bursts", 4, True)):
        if not fused:
            monkeypatch.setattr(runtime.engine, "_decode_programs", lambda m: False)
        llm = LLM(model, **{**CFG, "decode_steps": steps})
        ex = llm.engine.executor
        try:
            assert any(k[0] == DECODE_MODEL for k in ex.program_keys()) == fused
            used = spy_programs(monkeypatch, ex)
            outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            kinds = {k[0] for k in used}
            assert {"single": DECODE_MODEL in kinds, "two_launch": DECODE_MODEL not in kinds,
                    "bursts": "burst" in kinds}[name], (name, kinds)
            assert ex.num_compiles_after_warmup == 0
        finally:
            llm.engine.close()
            monkeypatch.undo()
    assert outs["single"] == outs["two_launch"] == outs["bursts"]


def test_batch_one_bursts_run_unrolled_with_the_same_tokens(monkeypatch):
    """On a GPU the burst programs of the batch-1 seq bucket are unrolled by default
    (EngineConfig.unroll_burst_max_seqs None -> 1): the burst's while loop is gone from the
    compiled program, while the 8-sequence bucket's bursts keep theirs. In float32, with weights
    that leave no near-ties, their greedy tokens equal those of looped bursts
    (unroll_burst_max_seqs 0), alone and in a batch."""
    from tests.testing.engine import scaled_dummy, spy_programs

    model = scaled_dummy()
    prompts = np.random.default_rng(2).integers(0, model.config.vocab_size, (6, 20)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    cfg = {**CFG, "seq_buckets": (1, 8)}
    outs, loops = {}, {}
    for unroll in (None, 0):
        llm = LLM(model, **cfg, unroll_burst_max_seqs=unroll)
        ex = llm.engine.executor
        try:
            assert ex.unroll_burst_max_seqs == (1 if unroll is None else 0)
            for S in (1, 8):
                T = min(T for T in cfg["token_buckets"] if T >= S)
                loops[unroll, S] = ex._executables[("burst", T, S, "greedy", False, False)].as_text().count(" while(")
            used = spy_programs(monkeypatch, ex)
            alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts[:2]]
            assert {k[2] for k in used if k[0] == "burst"} == {1}
            batch = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            assert 8 in {k[2] for k in used if k[0] == "burst"}
            outs[unroll] = (alone, batch)
            assert ex.num_compiles_after_warmup == 0
        finally:
            llm.engine.close()
            monkeypatch.undo()
    assert loops[None, 1] == loops[0, 1] - 1 and loops[None, 8] == loops[0, 8] >= 1, loops
    assert outs[None] == outs[0]


@requires_hopper  # the greedy head kernels
@pytest.mark.parametrize("seq_buckets", [(64,), (1, 8)])
def test_greedy_head_bursts_give_the_logits_path_tokens(seq_buckets):
    """On one Hopper GPU plain greedy bursts run an LM head kernel with the argmax in its epilogue
    (GREEDY_HEAD): the Mosaic GEMM from 64 sequences, the Triton GEMV up to 16 (batch 1 included);
    their tokens equal those of the bursts that write the logits. Weights scaled up from the
    dummy's 0.02 std so every step's top two logits are far apart (at 0.02 every step is a
    near-tie, which f32 sums in another order may flip)."""
    import dataclasses

    from flax import nnx

    from runtime.step import GREEDY_HEAD

    m = load_model("dummy:smollm2_135m", mesh=MeshConfig().make_mesh(_gpus()), dtype="bfloat16", seed=0)
    flat = nnx.to_flat_state(m.params)
    m = dataclasses.replace(m, params=nnx.from_flat_state(
        {tuple(p): v.replace(v[...] if p[-1] == "scale" else v[...] * 25) for p, v in flat}))
    assert m.gemm_impl == "mosaic_gpu"
    logits_path = dataclasses.replace(m)
    logits_path.__dict__["gemm_impl"] = "reference"  # the executor's switch only: no GREEDY_HEAD bursts
    logits_path.__dict__["forward"] = m.forward
    prompts = np.random.default_rng(1).integers(1, m.config.vocab_size, (6, 40)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    cfg = {**CFG, "max_num_seqs": seq_buckets[-1], "seq_buckets": seq_buckets, "token_buckets": (64, 128),
           "max_num_batched_tokens": 128}
    outs = []
    for model, heads in ((m, True), (logits_path, False)):
        llm = LLM(model, **cfg)
        try:
            keys = {k[2] for k in llm.engine.executor.program_keys() if k[3:4] == (GREEDY_HEAD,)}
            assert keys == (set(seq_buckets) if heads else set()), keys
            # all six prompts at once, then one alone (the batch-1 bucket where there is one; bf16 tokens
            # alone may differ from the batch's, whose prefill chunks differ, but not between the two heads)
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
                        + [llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0].token_ids])
            assert llm.engine.stats().num_bursts > 0
        finally:
            llm.engine.close()
    assert outs[0] == outs[1]
    assert len({tuple(t) for t in outs[0]}) > 1  # the prompts lead to different tokens


@requires_hopper  # gemm_impl "mosaic_gpu": where small decode steps leave partial products
def test_small_decode_steps_sum_partial_products_with_the_same_tokens(monkeypatch):
    """Decode-only programs of up to dispatch.GEMV_PARTIALS_MAX_ROWS rows compute q/k/v, o and down
    as partial products that the attention and norm kernels sum (dispatch.gemv_parts); in float32,
    with weights that leave no near-ties, their greedy tokens equal those of the plain GEMVs."""
    import dataclasses

    from pallas_kernels import dispatch
    from tests.testing.engine import scaled_dummy

    model = scaled_dummy()
    assert model.gemm_impl == "mosaic_gpu" and model.attn_impl == "gpu"
    prompts = np.random.default_rng(3).integers(0, model.config.vocab_size, (6, 20)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    gemv_parts = dispatch.gemv_parts
    for max_rows in (dispatch.GEMV_PARTIALS_MAX_ROWS, 0):
        monkeypatch.setattr(dispatch, "GEMV_PARTIALS_MAX_ROWS", max_rows)
        parts = []  # what each traced projection got
        monkeypatch.setattr(dispatch, "gemv_parts", lambda *a, **kw: parts.append(gemv_parts(*a, **kw)) or parts[-1])
        llm = LLM(dataclasses.replace(model), **CFG)  # a fresh forward: traced anew; decode programs of 8 rows
        try:
            assert parts and (max(parts) > 1) == (max_rows > 0), parts
            outs[max_rows] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            assert llm.engine.executor.num_compiles_after_warmup == 0
        finally:
            llm.engine.close()
            monkeypatch.undo()
    assert outs[dispatch.GEMV_PARTIALS_MAX_ROWS] == outs[0]


@pytest.mark.skipif(len(_gpus()) < 2, reason="needs two NVIDIA GPUs")
@pytest.mark.parametrize("replica,tensor", [(1, 2), (2, 1)])
def test_two_gpu_meshes_give_one_gpus_tokens(replica, tensor):
    """The engine on a mesh of two GPUs, with tensor=2 (KV pages split over KV heads, the Triton KV
    write and attention run per shard) or replica=2 (an engine per GPU, both given requests), gives one
    GPU's greedy tokens in float32, bursts included, with no compile after warmup. The same check on
    fake CPU devices: test_engine.py."""
    from tests.testing.engine import scaled_dummy

    prompts = [np.random.default_rng(5).integers(0, 256, n).tolist() for n in (3, 17, 40, 9, 64, 25, 1, 33, 50, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = {}
    for mesh_cfg, devices in ((MeshConfig(), _gpus()[:1]), (MeshConfig(replica=replica, tensor=tensor), _gpus()[:2])):
        model = scaled_dummy(mesh=mesh_cfg.make_mesh(devices), seed=11)  # head dim 16: the GPU kernels
        assert model.attn_impl == "gpu"
        llm = LLM(model, **CFG)
        engines = getattr(llm.engine, "replicas", [llm.engine])  # replica=2: an engine per GPU
        try:
            assert len(engines) == mesh_cfg.replica
            assert {d.id for e in engines for d in e.kv_pages[0].devices()} == {d.id for d in devices}
            if tensor > 1 and len(devices) == 2:
                assert llm.engine.kv_pages[0].sharding.spec[2] == "tensor"
            outs[len(devices)] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            assert all(e.executor.num_compiles_after_warmup == 0 and e.stats().num_requests for e in engines)
        finally:
            llm.engine.close()
    assert all(len(t) == 16 for t in outs[1])
    assert outs[2] == outs[1]
