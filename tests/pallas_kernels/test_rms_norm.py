"""The residual add + RMSNorm and the model's entry (the embedding rows + RMSNorm): the Triton
kernels (interpret mode on CPU, for real under `gpu`) against the jnp references, dispatch, and the
references against a float64 numpy RMSNorm."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels.rms_norm import add_rms_norm, embed_rms_norm, ref_add_rms_norm, ref_embed_rms_norm, rms_norm
from tests.testing.partials import exact_partials

ON_GPU = jax.default_backend() == "gpu"
requires_gpu = pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")
EPS = 1e-5


def inputs(T, D, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x, r = (jnp.asarray(rng.standard_normal((T, D)) * 3, dtype) for _ in range(2))
    scale = jnp.asarray(rng.uniform(0.5, 1.5, D), dtype)
    return x, r, scale


def assert_norm_close(got, want, dtype, ulps: int = 2):
    """The sum is rounded once on both sides: equal. The norm's mean is a sum of D squares whose
    order differs between the kernel and XLA: f32 rounding of that, then one rounding to dtype."""
    eps = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=ulps * eps,
                               atol=ulps * eps)


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


def embed_inputs(V, D, table_dtype, seed=0):
    rng = np.random.default_rng(seed)
    table = jnp.asarray(rng.standard_normal((V, D)) * 3, table_dtype)
    return table, jnp.asarray(rng.uniform(0.5, 1.5, D), table_dtype)


# in range, negative (counted from the end), and out of range on both sides (NaN rows)
EMBED_IDS = [3, -1, 36, 37, -40, 0, 5]


def test_embed_reference_is_take_and_rms_norm():
    table, scale = embed_inputs(37, 48, jnp.float32)
    ids = jnp.asarray(EMBED_IDS, jnp.int32)
    x, y = ref_embed_rms_norm(table, ids, scale, eps=EPS, dtype=jnp.float32, rows=9)
    t64 = np.asarray(table, np.float64)
    e = np.stack([t64[i % 37] if -37 <= i < 37 else np.full(48, np.nan) for i in EMBED_IDS + [0, 0]])
    want = e / np.sqrt((e**2).mean(-1, keepdims=True) + EPS) * np.asarray(scale, np.float64)
    np.testing.assert_array_equal(np.asarray(x), e)  # NaN where NaN
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("table_dtype,dtype", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.bfloat16),
                                               (jnp.float32, jnp.bfloat16)], ids=["f32", "bf16", "f32-to-bf16"])
@pytest.mark.parametrize("D,rows,block_rows", [(96, None, None), (48, 9, 4), (64, 8, 1), (2048, 7, 2)])
def test_embed_kernel_matches_reference(D, rows, block_rows, table_dtype, dtype):
    """Masked columns (D 96, 48), rows past the ids (id 0's), a partial last program, negative and
    out-of-range ids, a table stored in another dtype than the output's: the rows exact, the norm to
    its rounding."""
    table, scale = embed_inputs(37, D, table_dtype, seed=D)
    ids = jnp.asarray(EMBED_IDS, jnp.int32)
    f = jax.jit(functools.partial(embed_rms_norm, eps=EPS, dtype=dtype, rows=rows, block_rows=block_rows,
                                  interpret=True))
    x, y = f(table, ids, scale)
    wx, wy = ref_embed_rms_norm(table, ids, scale, eps=EPS, dtype=dtype, rows=rows)
    assert x.dtype == y.dtype == dtype and x.shape == y.shape == (rows or len(EMBED_IDS), D)
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(wx, np.float32))
    assert_norm_close(y, wy, dtype)
    assert np.isnan(np.asarray(y, np.float32)).any(axis=1).tolist() == [i in (3, 4) for i in range(x.shape[0])]


def test_embed_bad_inputs_raise():
    table, scale = embed_inputs(11, 32, jnp.float32)
    ids = jnp.asarray([1, 2, 3], jnp.int32)
    for f in (functools.partial(embed_rms_norm, interpret=True), ref_embed_rms_norm):
        with pytest.raises(ValueError, match="rows=2 must be at least the 3 ids"):
            f(table, ids, scale, eps=EPS, dtype=jnp.float32, rows=2)
        with pytest.raises(ValueError, match=r"must be \[V, D\] and ids \(1, 3\) int32 integers \[T\]"):
            f(table, ids[None], scale, eps=EPS, dtype=jnp.float32)
        with pytest.raises(ValueError, match=r"integers \[T\]"):
            f(table, ids.astype(jnp.float32), scale, eps=EPS, dtype=jnp.float32)
        with pytest.raises(ValueError, match=r"scale \(16,\) must be \[D\] = \[32\]"):
            f(table, ids, scale[:16], eps=EPS, dtype=jnp.float32)
    with pytest.raises(ValueError, match="block_rows=3 must be a power of two"):
        embed_rms_norm(table, ids, scale, eps=EPS, dtype=jnp.float32, block_rows=3, interpret=True)
    x, y = embed_rms_norm(table, ids[:0], scale, eps=EPS, dtype=jnp.bfloat16, rows=2, interpret=True)
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(table[jnp.zeros(2, int)].astype(jnp.bfloat16),
                                                                          np.float32))


def test_embed_dispatch_routes_by_implementation():
    table, scale = embed_inputs(50, 64, jnp.bfloat16)
    ids = jnp.asarray([4, 9], jnp.int32)
    want = ref_embed_rms_norm(table, ids, scale, eps=EPS, dtype=jnp.bfloat16, rows=3)
    got = dispatch.embed_rms_norm(table, ids, scale, eps=EPS, dtype=jnp.bfloat16, rows=3)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    for impl, kernel in (("mosaic_gpu", True), ("reference", False)):
        f = jax.jit(functools.partial(dispatch.embed_rms_norm, eps=EPS, dtype=jnp.bfloat16, rows=3,
                                      implementation=impl))
        assert ("embed_rms_norm_gpu" in f.trace(table, ids, scale).lower(lowering_platforms=("cuda",)).as_text()) \
            == kernel
    with pytest.raises(ValueError, match="implementation='gpu'"):
        dispatch.embed_rms_norm(table, ids, scale, eps=EPS, dtype=jnp.bfloat16, implementation="gpu")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("table_dtype,dtype", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.bfloat16)],
                         ids=["f32", "bf16"])
@pytest.mark.parametrize("T,rows,D", [(1, 2, 2048), (8, 8, 4096), (8192, 8192, 2048), (5, 7, 96)])
def test_embed_kernel_on_device(T, rows, D, table_dtype, dtype):
    table, scale = embed_inputs(128256 if D > 96 else 37, D, table_dtype, seed=D)
    ids = jnp.asarray(np.random.default_rng(T).integers(-table.shape[0], table.shape[0], T), jnp.int32)
    x, y = jax.jit(functools.partial(embed_rms_norm, eps=EPS, dtype=dtype, rows=rows))(table, ids, scale)
    wx, wy = jax.jit(functools.partial(ref_embed_rms_norm, eps=EPS, dtype=dtype, rows=rows))(table, ids, scale)
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(wx, np.float32))
    # XLA sums this norm's squares in yet another order: at 8,192 f32 rows on an H200, 3 of 16.8M
    # elements 3.4e-7 apart (2 ulps are 2.4e-7)
    assert_norm_close(y, wy, dtype, ulps=4)


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
