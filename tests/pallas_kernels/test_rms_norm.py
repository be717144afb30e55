"""The residual add + RMSNorm: the Triton kernel (interpret mode on CPU, for real under `gpu`)
against the jnp reference, dispatch, and the reference against a float64 numpy RMSNorm."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels.rms_norm import add_rms_norm, ref_add_rms_norm, rms_norm
from tests.testing.partials import exact_partials

ON_GPU = jax.default_backend() == "gpu"
requires_gpu = pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")
EPS = 1e-5


def inputs(T, D, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x, r = (jnp.asarray(rng.standard_normal((T, D)) * 3, dtype) for _ in range(2))
    scale = jnp.asarray(rng.uniform(0.5, 1.5, D), dtype)
    return x, r, scale


def assert_norm_close(got, want, dtype):
    """The sum is rounded once on both sides: equal. The norm's mean is a sum of D squares whose
    order differs between the kernel and XLA: f32 rounding of that, then one rounding to dtype."""
    eps = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2 * eps,
                               atol=2 * eps)


def test_reference_is_rms_norm():
    x, r, scale = inputs(5, 48, jnp.float32)
    s, y = ref_add_rms_norm(x, r, scale, eps=EPS)
    s64 = np.asarray(x, np.float64) + np.asarray(r, np.float64)
    want = s64 / np.sqrt((s64**2).mean(-1, keepdims=True) + EPS) * np.asarray(scale, np.float64)
    np.testing.assert_allclose(np.asarray(s), s64, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(rms_norm(s, scale, eps=EPS)), np.asarray(y))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("T,D,block_rows", [(1, 64, None), (2, 2048, None), (7, 96, 2), (37, 48, 4), (16, 128, 1)])
def test_kernel_matches_reference(T, D, block_rows, dtype):
    """D not a power of two (96, 48: masked columns) and T not a multiple of the rows per program
    (masked rows) included: a stray lane would corrupt a neighbour or the norm's sum."""
    x, r, scale = inputs(T, D, dtype, seed=T * D)
    f = jax.jit(functools.partial(add_rms_norm, eps=EPS, block_rows=block_rows, interpret=True))
    s, y = f(x, r, scale)
    ws, wy = ref_add_rms_norm(x, r, scale, eps=EPS)
    assert s.dtype == y.dtype == dtype and s.shape == y.shape == (T, D)
    np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(ws, np.float32))
    assert_norm_close(y, wy, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("T,D,parts", [(1, 64, 2), (2, 2048, 8), (7, 96, 4)])
def test_kernel_sums_partial_products(T, D, parts, dtype):
    """x as f32[P, T, D] partial products (dispatch.gemv_partials): the kernel and the reference sum
    them and round to r's dtype before the add; the same as x itself."""
    x, r, scale = inputs(T, D, dtype, seed=T + D)
    if dtype == jnp.float32:  # 16 significant bits: the dyadic parts' partial sums stay exact
        x = x.astype(jnp.bfloat16).astype(jnp.float32)
    xp = exact_partials(x, parts, seed=T)
    want = ref_add_rms_norm(x, r, scale, eps=EPS)
    ref = ref_add_rms_norm(xp, r, scale, eps=EPS)
    got = jax.jit(functools.partial(add_rms_norm, eps=EPS, interpret=True))(xp, r, scale)
    for g, rf, w in zip(got, ref, want):
        assert g.dtype == rf.dtype == dtype and g.shape == rf.shape == (T, D)
        np.testing.assert_array_equal(np.asarray(rf, np.float32), np.asarray(w, np.float32))
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    assert_norm_close(got[1], want[1], dtype)
    with pytest.raises(ValueError, match="f32\\[P, T, D\\] partial products"):
        add_rms_norm(xp.astype(jnp.bfloat16), r, scale, eps=EPS, interpret=True)
    with pytest.raises(ValueError, match="f32\\[P, T, D\\] partial products"):
        ref_add_rms_norm(xp[:, :, :-1], r, scale, eps=EPS)


def test_kernel_rows_are_independent():
    """A row's norm uses only its own elements: changing one row changes no other row's output."""
    x, r, scale = inputs(9, 96, jnp.float32)
    f = jax.jit(functools.partial(add_rms_norm, eps=EPS, block_rows=4, interpret=True))
    _, y0 = f(x, r, scale)
    _, y1 = f(x.at[5].mul(100.0), r, scale)
    keep = np.arange(9) != 5
    np.testing.assert_array_equal(np.asarray(y0)[keep], np.asarray(y1)[keep])
    assert not np.allclose(np.asarray(y0)[5], np.asarray(y1)[5])


def test_bad_inputs_raise():
    x, r, scale = inputs(3, 32, jnp.float32)
    with pytest.raises(ValueError, match=r"must both be \[T, D\] of one dtype"):
        add_rms_norm(x, r[:, :16], scale, eps=EPS, interpret=True)
    with pytest.raises(ValueError, match=r"must both be \[T, D\] of one dtype"):
        add_rms_norm(x, r.astype(jnp.bfloat16), scale, eps=EPS, interpret=True)
    with pytest.raises(ValueError, match=r"scale \(16,\) must be \[D\] = \[32\]"):
        add_rms_norm(x, r, scale[:16], eps=EPS, interpret=True)
    with pytest.raises(ValueError, match="block_rows=3 must be a power of two"):
        add_rms_norm(x, r, scale, eps=EPS, block_rows=3, interpret=True)


def test_dispatch_routes_by_implementation():
    x, r, scale = inputs(4, 64, jnp.bfloat16)
    want = ref_add_rms_norm(x, r, scale, eps=EPS)
    for impl in ("tpu", "reference", "auto"):
        got = dispatch.add_rms_norm(x, r, scale, eps=EPS, implementation=impl)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    for impl, kernel in (("gpu", True), ("reference", False)):
        f = jax.jit(functools.partial(dispatch.add_rms_norm, eps=EPS, implementation=impl))
        assert ("add_rms_norm_gpu" in f.trace(x, r, scale).lower(lowering_platforms=("cuda",)).as_text()) == kernel
    with pytest.raises(ValueError, match="implementation='cuda'"):
        dispatch.add_rms_norm(x, r, scale, eps=EPS, implementation="cuda")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("T,D", [(1, 2048), (2, 4096), (256, 2048), (8192, 2048), (300, 3584), (5, 96)])
def test_kernel_on_device(T, D, dtype):
    x, r, scale = inputs(T, D, dtype, seed=T + D)
    s, y = jax.jit(functools.partial(add_rms_norm, eps=EPS))(x, r, scale)
    ws, wy = jax.jit(functools.partial(ref_add_rms_norm, eps=EPS))(x, r, scale)
    np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(ws, np.float32))
    assert_norm_close(y, wy, dtype)
    if T <= 16:  # the sizes decode steps hand it partial products at (dispatch.GEMV_PARTIALS_MAX_ROWS)
        x = x.astype(jnp.bfloat16).astype(dtype)
        s, y = jax.jit(functools.partial(add_rms_norm, eps=EPS))(exact_partials(x, 8), r, scale)
        ws, wy = jax.jit(functools.partial(ref_add_rms_norm, eps=EPS))(x, r, scale)
        np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(ws, np.float32))
        assert_norm_close(y, wy, dtype)
