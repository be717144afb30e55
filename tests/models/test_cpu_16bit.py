"""16-bit models on CPUs (docs/design.md, "16-bit models on CPUs"): the dots return f32 and round
once (dispatch.f32_dot_outputs), the tied LM head reads the table in its own dtype, and the KV pool
is float32 (dispatch.kv_pool_dtype), which gives a 16-bit pool's outputs bit for bit."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels.greedy_head import head_logits
from pallas_kernels.swiglu.reference import ref_swiglu
from runtime.checkpoint import load_model
from runtime.llm import LLM
from runtime.request import SamplingParams
from sharding.mesh import MeshConfig
from tests.testing.engine import BASE

CFG = {**BASE, "dtype": "bfloat16"}


@pytest.fixture(autouse=True)
def _on_cpu():
    """These are the CPU's programs also on a GPU host: arrays made and jitted here go to the CPU."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture(scope="module")
def bf16_model():
    return load_model("dummy:stories260k", mesh=MeshConfig().make_mesh(jax.devices("cpu")[:1]), dtype="bfloat16",
                      seed=3)


def _elements(shape: str) -> int:
    return int(np.prod([int(d) for d in shape.split(",") if d])) if shape else 1


def _materialized_converts(hlo: str) -> list[str]:
    """Output shapes of the converts a compiled CPU program writes to memory: those a fusion returns
    (its ROOT, or in its ROOT tuple) and those of the entry computation. A convert inside a fusion
    feeding a gather computes only the elements the gather reads (the embedding's)."""
    shapes, converts, entry = [], {}, False
    for line in hlo.splitlines():
        entry = entry or line.startswith("ENTRY")
        if m := re.search(r"(ROOT )?%(\S+) = \w+\[([\d,]*)\]\S* convert\(", line):
            converts[m[2]] = m[3]
            if m[1] or entry:
                shapes.append(m[3])
        elif "ROOT" in line and " tuple(" in line:
            shapes += [converts[n] for n in re.findall(r"%([\w.\-]+)", line.split(" tuple(", 1)[1]) if n in converts]
    return shapes


def test_the_rules():
    assert dispatch.select_gemm_impl(jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]), ("replica",))) == "cpu"
    assert dispatch.f32_dot_outputs("cpu") and not dispatch.f32_dot_outputs("reference")
    assert not dispatch.f32_dot_outputs("mosaic_gpu")
    with pytest.raises(ValueError, match="implementation='cuda'"):
        dispatch.f32_dot_outputs("cuda")
    f32, bf16, f16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)
    assert [dispatch.kv_pool_dtype("xla", d) for d in (bf16, f16, f32)] == [f32, f32, f32]
    assert [dispatch.kv_pool_dtype(i, bf16) for i in ("gpu", "tpu", "reference")] == [bf16] * 3


def test_cpu_programs_keep_weights_and_pool_in_their_dtypes(bf16_model):
    """No dot of the compiled model programs returns bf16 (XLA's CPU runs those 3-6x slower), and
    nothing converts an array the size of a weight or of the KV pool: the whole table, the pool
    around the KV write, or a weight upcast around a dot."""
    # token buckets other than D (64): an activation [T, F] never has a weight's [D, F] shape; one seq
    # bucket: its nine burst programs are most of the compile time, and the others' dots are the same
    llm = LLM(bf16_model, **{**CFG, "max_num_batched_tokens": 32, "token_buckets": (16, 32), "seq_buckets": (8,),
                             "decode_steps": 8})
    try:
        ex = llm.engine.executor
        pool = llm.engine.kv_pages[0]
        assert pool.dtype == jnp.float32
        weights = {",".join(map(str, x.shape)) for x in jax.tree.leaves(bf16_model.params) if x.ndim >= 2}
        assert f"{bf16_model.config.vocab_size},{bf16_model.config.hidden_size}" in weights  # the table
        models = [k for k in ex._executables if k[0] in ("model", "burst")]
        assert models
        for key in models:
            hlo = ex._executables[key].as_text()
            dots = re.findall(r"= (\w+)\[[\d,]*\]\{[\d,]*\} dot\(", hlo)
            assert dots and set(dots) == {"f32"}, (key, set(dots))
            shapes = _materialized_converts(hlo)
            assert shapes, key  # the check finds converts (the dots' outputs rounded to bf16)
            # bursts included: XLA's CPU gathers the embedding from an f32 convert of the table, which
            # it hoisted out of a burst's loop until dispatch.embed_rms_norm tied the table to the ids
            converted = weights & set(shapes)
            assert not converted, (key, converted)
            assert max(map(_elements, shapes)) < pool.size, key
    finally:
        llm.engine.close()


def test_f32_pool_gives_the_16bit_pools_outputs_bit_for_bit(bf16_model):
    prompts = np.random.default_rng(0).integers(0, bf16_model.config.vocab_size, (5, 24)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    outs = {}
    for kv in (None, "bfloat16"):  # no warmup: only the programs this batch runs are compiled
        llm = LLM(bf16_model, **{**CFG, "warmup": False, "strict_compile": False}, kv_dtype=kv)
        try:
            assert llm.engine.kv_pages[0].dtype == (jnp.float32 if kv is None else jnp.bfloat16)
            outs[kv] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.engine.close()
    for a, b in zip(outs[None], outs["bfloat16"]):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs


@pytest.mark.parametrize("transposed", [True, False])
def test_lm_head_reads_the_table_in_its_dtype(transposed):
    """On CPUs the tied head contracts the table's own D axis: as x @ table.T, XLA's CPU upcast the
    whole table to f32 every call (15x slower at SmolLM2-135M's). The logits equal an f32 product."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((8, 64)), jnp.bfloat16)
    head = jnp.asarray(rng.standard_normal((512, 64) if transposed else (64, 512)) * 0.1, jnp.bfloat16)
    f = jax.jit(lambda x, h: head_logits(x, h, transposed=transposed, fold_transpose=True))
    assert " convert(" not in f.lower(x, head).compile().as_text()
    # what GPUs run (x @ head.T, measured faster there) gives the same logits
    np.testing.assert_array_equal(np.asarray(f(x, head)), np.asarray(head_logits(x, head, transposed=transposed)))
    w = np.asarray(head, np.float32)
    want = np.asarray(x, np.float32) @ (w.T if transposed else w)
    np.testing.assert_allclose(np.asarray(f(x, head)), want, rtol=1e-5, atol=1e-5)


def test_swiglu_f32_out_rounds_once():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((16, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((64, 2, 96)) * 0.2, jnp.bfloat16)
    got = ref_swiglu(x, w, f32_out=True)
    gu = np.einsum("td,dgf->tgf", np.asarray(x, np.float32), np.asarray(w, np.float32))
    want = jax.nn.silu(gu[:, 0]) * gu[:, 1]
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=8e-3, atol=1e-3)
    # the rounded-twice reference (the GEMM's output in bf16 first) differs from it somewhere
    assert not np.array_equal(np.asarray(got), np.asarray(ref_swiglu(x, w)))
