"""Small decode steps' projections as partial products (dispatch.gemv_parts / gemv_partials): when
they apply, that their sums are the projections, and the model wired through them on CPU (the
reference attention and norm sum the parts as the GPU kernels do)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from runtime.checkpoint import load_model
from sharding.mesh import MeshConfig
from tests.models.test_llama_vs_hf import BASE, PROMPT_LEN, make_hf_checkpoint
from tests.testing.greedy import greedy_generate


def test_gemv_partials_sum_to_the_product():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 2, 5, 8)), jnp.float32)
    want = jnp.einsum("td,dgrh->tgrh", x, w, precision="highest")
    for parts in (2, 4, 8):
        got = dispatch.gemv_partials(x, w, parts, precision=jax.lax.Precision.HIGHEST)
        assert got.shape == (parts, 3, 2, 5, 8) and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got.sum(0)), np.asarray(want), rtol=1e-5, atol=1e-5)
    # bf16 inputs: f32 partials (the sum rounds once, in the kernel that reads them)
    assert dispatch.gemv_partials(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), 4).dtype == jnp.float32
    for parts in (1, 3):
        with pytest.raises(ValueError, match=f"parts={parts} must be at least 2 and divide the contraction 64"):
            dispatch.gemv_partials(x, w, parts)


def test_gemv_parts_only_for_small_decode_steps_on_one_hopper_gpu():
    small = dict(decode_only=True, attn_impl="gpu", gemm_impl="mosaic_gpu")
    n, hidden = dispatch.GEMV_PARTIALS_MAX_ROWS, dispatch.GEMV_PARTIALS_MAX_HIDDEN
    for name, parts in dispatch.GEMV_PARTS.items():
        assert dispatch.gemv_parts(name, n, 2048, hidden, **small) == parts
        assert dispatch.gemv_parts(name, 1, 8192, 576, **small) == parts
        assert dispatch.gemv_parts(name, n + 1, 2048, hidden, **small) == 1  # XLA's GEMMs from there
        assert dispatch.gemv_parts(name, 1, 4096, 2 * hidden, **small) == 1  # larger models: XLA's GEMMs
        assert dispatch.gemv_parts(name, 1, 2048 + parts // 2, hidden, **small) == 1  # parts must divide it
        assert dispatch.gemv_parts(name, 1, 2048, hidden, **{**small, "decode_only": False}) == 1
        assert dispatch.gemv_parts(name, 1, 2048, hidden, **{**small, "attn_impl": "reference"}) == 1  # no summing
        assert dispatch.gemv_parts(name, 1, 2048, hidden, **{**small, "gemm_impl": "reference"}) == 1  # CPU, TPU, meshes


def test_gemv_parts_for_the_down_projection_of_decode_steps_of_cublas_buckets():
    """From 64 to 256 rows only the MLP's down projection leaves parts: 4 in small models, 2 in larger
    ones from 128 rows; none outside those rows, in steps with prefill tokens, or off one Hopper GPU."""
    small = dict(decode_only=True, attn_impl="gpu", gemm_impl="mosaic_gpu")
    lo, hi = dispatch.DOWN_PARTS_ROWS
    for rows in (lo, 128, hi):
        assert dispatch.gemv_parts("down", rows, 8192, 2048, **small) == 4  # llama3_2_1b
        assert dispatch.gemv_parts("down", rows, 14336, 4096, **small) == (2 if rows >= 128 else 1)  # llama3_8b
        assert dispatch.gemv_parts("down", rows, 8190, 2048, **small) == 1  # 4 does not divide it
        for name in ("qkv", "o"):
            assert dispatch.gemv_parts(name, rows, 2048, 2048, **small) == 1
        assert dispatch.gemv_parts("down", rows, 8192, 2048, **{**small, "decode_only": False}) == 1
        assert dispatch.gemv_parts("down", rows, 8192, 2048, **{**small, "gemm_impl": "reference"}) == 1
    for rows in (dispatch.GEMV_PARTIALS_MAX_ROWS + 1, lo - 1, hi + 1):
        assert dispatch.gemv_parts("down", rows, 8192, 2048, **small) == 1


@pytest.mark.parametrize("case", ["llama3_rope_scaling", "qwen3_qk_norm", "qwen2_qkv_bias"])
def test_model_with_partial_products_decodes_the_same(case, tmp_path, monkeypatch):
    """Every projection that may leave partials does (on CPU, through the reference attention and
    norm, which sum them): greedy tokens equal the plain model's and logits agree to f32 rounding.
    Checks the weights' split over the parts (q/k/v's merged layout, o's heads, down's F)."""
    make_hf_checkpoint(case, tmp_path)
    model = load_model(tmp_path, mesh=MeshConfig().make_mesh(jax.devices("cpu")), dtype="float32", progress=False)
    prompt = np.random.default_rng(2).integers(0, BASE["vocab_size"], PROMPT_LEN).tolist()
    want = greedy_generate(model, prompt, 12, decode_only=True)
    used = []

    def forced(name, rows, contraction, hidden, *, decode_only, attn_impl, gemm_impl):
        parts = dispatch.GEMV_PARTS[name] if decode_only and contraction % dispatch.GEMV_PARTS[name] == 0 else 1
        used.append((name, parts))
        return parts

    monkeypatch.setattr(dispatch, "gemv_parts", forced)
    got = greedy_generate(model, prompt, 12, decode_only=True)
    qkv = case == "llama3_rope_scaling"  # bias and q/k norms need the summed projection: no q/k/v partials
    assert {n for n, p in used if p > 1} == ({"qkv", "o", "down"} if qkv else {"o", "down"})
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.step_logits, want.step_logits, rtol=1e-4, atol=1e-4)
