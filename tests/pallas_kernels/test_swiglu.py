"""The SwiGLU up projection: the jnp reference against float64, validation, the Hopper Mosaic GPU
kernel lowered for CUDA on CPU (Mosaic GPU's interpreter does not run this kernel) and run against
the reference under `gpu`, the Triton GEMV for a few rows (interpret mode on CPU, and under `gpu`),
and dispatch's choice between them and the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels.swiglu import ref_swiglu, validate
from pallas_kernels.swiglu import gpu as gemv
from pallas_kernels.swiglu.gpu_mosaic import BlockSizes, supports, swiglu_mosaic
from tests.tolerances import tol


def _is_hopper() -> bool:
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9.")


requires_hopper = pytest.mark.skipif(not _is_hopper(), reason="needs a Hopper (sm_90) GPU")


def inputs(T, D, F, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, D)), dtype)
    w = jnp.asarray(rng.standard_normal((D, 2, F)) * D ** -0.5, dtype)
    return x, w


def exact(x, w) -> np.ndarray:
    """float64 silu(x @ gate) * (x @ up) of the given (already rounded) inputs."""
    g, u = (np.asarray(x, np.float64) @ np.asarray(w[:, i], np.float64) for i in (0, 1))
    return g / (1 + np.exp(-g)) * u


def check_kernel_output(got, x, w):
    """A kernel's bf16 output: close to the reference, and at least as close to float64 (the kernels
    round once, from f32 accumulators; the reference also rounds the GEMM's output)."""
    ref = ref_swiglu(x, w)
    atol, rtol = tol(jnp.bfloat16)  # (f16's rounding is finer)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), atol=atol, rtol=rtol)
    want = exact(x, w)
    err = lambda y: np.abs(np.asarray(y, np.float64) - want).max()  # noqa: E731
    assert err(got) <= err(ref)


def test_reference_matches_float64():
    x, w = inputs(7, 48, 40, jnp.float32)
    got = ref_swiglu(x, w, precision=jax.lax.Precision.HIGHEST)
    assert got.shape == (7, 40) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), exact(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("x_shape, w_shape", [((4, 8), (8, 16)), ((4, 8), (8, 3, 16)), ((4, 8), (6, 2, 16)),
                                              ((8,), (8, 2, 16))])
def test_validate_rejects_bad_shapes(x_shape, w_shape):
    with pytest.raises(ValueError, match="must be"):
        validate(jnp.zeros(x_shape), jnp.zeros(w_shape))


@pytest.mark.parametrize("kwargs, match", [(dict(block_m=32), "multiple of 64"), (dict(block_n=96), "multiples of 64"),
                                           (dict(block_k=32), "multiples of 64"), (dict(num_stages=1), ">= 2"),
                                           (dict(block_m=0), "positive int")])
def test_block_sizes_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockSizes(**kwargs)


@pytest.mark.parametrize("T, D, F, bs", [(256, 2048, 8192, BlockSizes()), (512, 192, 384, BlockSizes(128, 64, 64, 3))])
def test_kernel_lowers_for_cuda(T, D, F, bs):
    x = jax.ShapeDtypeStruct((T, D), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((D, 2, F), jnp.bfloat16)
    lowered = swiglu_mosaic.trace(x, w, block_sizes=bs).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize("T, D, F, dtype, bs, match", [
    (100, 64, 128, jnp.bfloat16, BlockSizes(), "T a multiple of 128"),
    (128, 64, 128, jnp.float32, BlockSizes(), "bf16/f16"),
    (128, 64, 96, jnp.bfloat16, BlockSizes(), "F of 128"),
    (128, 64, 128, jnp.bfloat16, BlockSizes(num_stages=8), "shared memory"),
])
def test_kernel_rejects_what_it_cannot_run(T, D, F, dtype, bs, match):
    x, w = jax.ShapeDtypeStruct((T, D), dtype), jax.ShapeDtypeStruct((D, 2, F), dtype)
    with pytest.raises(ValueError, match=match):
        swiglu_mosaic.trace(x, w, block_sizes=bs)


def test_supports():
    x, w = jnp.zeros((256, 128), jnp.bfloat16), jnp.zeros((128, 2, 256), jnp.bfloat16)
    assert supports(x, w)
    assert not supports(x[:200], w)
    assert not supports(x, w.astype(jnp.float16))
    assert not supports(x.astype(jnp.float32), w.astype(jnp.float32))


def test_dispatch_reference_and_fallbacks():
    x, w = inputs(16, 64, 128, jnp.float32)
    want = ref_swiglu(x, w)
    np.testing.assert_array_equal(dispatch.swiglu(x, w), want)
    # below SWIGLU_MIN_TOKENS (and in f32) the Mosaic implementation runs the reference
    np.testing.assert_array_equal(dispatch.swiglu(x, w, implementation="mosaic_gpu"), want)
    with pytest.raises(ValueError, match="implementation='triton'"):
        dispatch.swiglu(x, w, implementation="triton")


@pytest.mark.parametrize("T, D, F, dtype, bs", [
    (1, 256, 128, jnp.bfloat16, gemv.BlockSizes(block_n=32, block_k=64)),
    (2, 192, 64, jnp.float16, gemv.BlockSizes(block_n=16, block_k=128)),  # D 192: k steps of 64
    (9, 128, 96, jnp.bfloat16, gemv.BlockSizes(block_n=32, block_k=32, num_stages=1)),
    (16, 64, 128, jnp.bfloat16, gemv.BlockSizes(block_n=64)),
])
def test_gemv_kernel_interpret(T, D, F, dtype, bs):
    x, w = inputs(T, D, F, dtype, seed=T)
    got = gemv.swiglu_gemv(x, w, block_sizes=bs, interpret=True)
    assert got.shape == (T, F) and got.dtype == dtype
    check_kernel_output(got, x, w)


@pytest.mark.parametrize("T, D, F, dtype, match", [
    (17, 128, 128, jnp.bfloat16, "T <= 16"), (0, 128, 128, jnp.bfloat16, "1 <= T"),
    (2, 128, 128, jnp.float32, "bf16/f16"), (2, 72, 128, jnp.bfloat16, "D a multiple of 16"),
    (2, 128, 96, jnp.bfloat16, "F of 64"),
])
def test_gemv_rejects_what_it_cannot_run(T, D, F, dtype, match):
    x, w = jax.ShapeDtypeStruct((T, D), dtype), jax.ShapeDtypeStruct((D, 2, F), dtype)
    assert not gemv.supports(x, w)
    with pytest.raises(ValueError, match=match):
        gemv.swiglu_gemv.trace(x, w)


@pytest.mark.parametrize("kwargs, match", [(dict(block_n=48), "power of two"), (dict(block_k=8), "at least 16"),
                                           (dict(num_warps=3), "power of two"), (dict(num_stages=0), "positive int")])
def test_gemv_block_sizes_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gemv.BlockSizes(**kwargs)


@pytest.mark.parametrize("T, D, kernel", [(2, 2048, "swiglu_gemv_gpu"), (16, 576, "swiglu_gemv_gpu"),
                                          (17, 2048, None), (2, 4096, None), (256, 2048, "mosaic_gpu")])
def test_dispatch_picks_the_kernel_by_rows_and_hidden_size(T, D, kernel):
    """Under "mosaic_gpu": the Triton GEMV up to SWIGLU_GEMV_MAX_TOKENS rows of models up to
    SWIGLU_GEMV_MAX_HIDDEN, the Mosaic GEMM from SWIGLU_MIN_TOKENS, XLA between and beyond (lowered
    for CUDA on this CPU host)."""
    x, w = jax.ShapeDtypeStruct((T, D), jnp.bfloat16), jax.ShapeDtypeStruct((D, 2, 1536), jnp.bfloat16)
    fn = jax.jit(lambda x, w: dispatch.swiglu(x, w, implementation="mosaic_gpu"))
    text = fn.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert ("swiglu_gemv_gpu" in text) == (kernel == "swiglu_gemv_gpu")
    assert ("mosaic_gpu" in text) == (kernel == "mosaic_gpu")


def test_select_gemm_impl_off_hopper():
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]), ("replica",))
    assert dispatch.select_gemm_impl(mesh) == "cpu"


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("T, D, F, bs", [(384, 192, 384, BlockSizes()), (256, 2048, 8192, BlockSizes()),
                                         (512, 576, 1536, BlockSizes(128, 64, 64, 3)),
                                         (128, 64, 128, BlockSizes(64, 64, 64, 6))])
def test_kernel_on_device(T, D, F, bs):
    for seed in (0, 1):  # fresh inputs: a race shows as a moving error
        x, w = inputs(T, D, F, jnp.bfloat16, seed=seed)
        got = swiglu_mosaic(x, w, block_sizes=bs)
        assert got.shape == (T, F) and got.dtype == jnp.bfloat16
        check_kernel_output(got, x, w)


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("T, D, F", [(2, 2048, 8192), (8, 576, 1536), (16, 960, 2560), (1, 256, 128)])
def test_gemv_kernel_on_device(T, D, F):
    for seed in (0, 1):
        x, w = inputs(T, D, F, jnp.bfloat16, seed=seed)
        check_kernel_output(gemv.swiglu_gemv(x, w), x, w)
