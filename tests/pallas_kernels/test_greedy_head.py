"""The greedy LM head: the jnp reference against float64, validation, the combine of the kernels'
block partials, the Triton GEMV (few rows) in interpret mode and on the GPU, the Hopper Mosaic GPU
kernel lowered for CUDA on CPU (Mosaic GPU's interpreter does not run it) and run against the
reference under `gpu`, and dispatch's choice between them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels.greedy_head import gpu as gemv
from pallas_kernels.greedy_head import head_logits, ref_greedy_head, validate
from pallas_kernels.greedy_head.gpu_mosaic import BlockSizes, greedy_head_mosaic, supports
from pallas_kernels.greedy_head.reference import argmax_of_block_partials
from tests.pallas_kernels.test_swiglu import requires_hopper


def inputs(T, D, V, dtype, *, transposed, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, D)), dtype)
    head = jnp.asarray(rng.standard_normal((V, D) if transposed else (D, V)) * D ** -0.5, dtype)
    return x, head


def exact_logits(x, head, transposed) -> np.ndarray:
    w = np.asarray(head, np.float64)
    return np.asarray(x, np.float64) @ (w.T if transposed else w)


@pytest.mark.parametrize("transposed", [True, False])
def test_reference_matches_float64(transposed):
    x, head = inputs(9, 32, 50, jnp.float32, transposed=transposed)
    logits = head_logits(x, head, transposed=transposed, precision=jax.lax.Precision.HIGHEST)
    assert logits.shape == (9, 50) and logits.dtype == jnp.float32
    want = exact_logits(x, head, transposed)
    np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-5, atol=1e-5)
    got = ref_greedy_head(x, head, transposed=transposed, precision=jax.lax.Precision.HIGHEST)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), want.argmax(-1))


def test_reference_takes_the_first_of_equal_maxima():
    x = jnp.ones((2, 4), jnp.float32)
    head = jnp.zeros((4, 6), jnp.float32).at[:, 2].set(1.0).at[:, 4].set(1.0)  # columns 2 and 4 tie
    np.testing.assert_array_equal(ref_greedy_head(x, head, transposed=False), [2, 2])
    np.testing.assert_array_equal(ref_greedy_head(x, head.T, transposed=True), [2, 2])


@pytest.mark.parametrize("x_shape, h_shape, transposed", [((4, 8), (9, 16), False), ((4, 8), (16, 9), True),
                                                          ((8,), (8, 16), False), ((4, 8), (8, 16, 1), False)])
def test_validate_rejects_bad_shapes(x_shape, h_shape, transposed):
    with pytest.raises(ValueError, match="must be"):
        validate(jnp.zeros(x_shape), jnp.zeros(h_shape), transposed=transposed)


@pytest.mark.parametrize("idx_dtype", [jnp.int32, jnp.float32])  # the Triton kernel's ids, the Mosaic kernel's
def test_block_partials_pick_the_first_of_equal_maxima(idx_dtype):
    # per row (the partials are [blocks, rows]): a unique maximum in block 1; equal maxima in blocks
    # 0 and 2, block 0's id lower; equal maxima in blocks 0 and 1, the later block's id lower (the
    # lowest id wins either way)
    pmax = jnp.array([[1.0, 7.0, 5.0], [5.0, 2.0, 5.0], [5.0, 5.0, 1.0]], jnp.float32).T
    pidx = jnp.array([[3, 17, 60], [9, 5, 30], [40, 12, 2]], idx_dtype).T
    got = argmax_of_block_partials(pmax, pidx)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, [17, 9, 12])


def check_tokens(got, x, head, transposed):
    """got equals the float64 argmax up to near-ties: an f32 sum in another order may part from it
    only where the row's two best logits are within a few f32 roundings of each other."""
    logits = exact_logits(x, head, transposed)
    want = logits.argmax(-1)
    rows = np.arange(len(want))
    gap = logits[rows, want] - logits[rows, np.asarray(got)]
    assert (gap >= 0).all() and (gap <= 1e-5 * np.abs(logits).max(-1)).all(), gap.max()
    return (np.asarray(got) == want).mean()


@pytest.mark.parametrize("T, D, V, transposed, bs", [
    (1, 256, 1000, True, gemv.BlockSizes(64, 64)),  # V not a multiple of block_v: a masked last block
    (2, 128, 512, False, gemv.BlockSizes(128, 64, 4, 3)),
    (16, 576, 777, True, gemv.BlockSizes(128, 128)),  # D 576: contraction steps of 64
    (5, 96, 300, False, gemv.BlockSizes(64, 128, 8, 2)),
])
def test_gemv_kernel_interpret(T, D, V, transposed, bs):
    x, head = inputs(T, D, V, jnp.bfloat16, transposed=transposed, seed=T)
    got = gemv.greedy_head_gemv(x, head, transposed=transposed, block_sizes=bs, interpret=True)
    assert got.shape == (T,) and got.dtype == jnp.int32
    assert check_tokens(got, x, head, transposed) == 1.0
    # every logit negative: ids past V (a masked last block) must not win with a zero
    x, head = jnp.abs(x), -jnp.abs(head)
    got = gemv.greedy_head_gemv(x, head, transposed=transposed, block_sizes=bs, interpret=True)
    assert check_tokens(got, x, head, transposed) == 1.0


@pytest.mark.parametrize("transposed", [True, False])
def test_gemv_kernel_gathers_rows_and_takes_the_first_of_equal_maxima(transposed):
    T, D, V, bs = 6, 64, 320, gemv.BlockSizes(64, 64)
    x, head = inputs(T, D, V, jnp.bfloat16, transposed=transposed, seed=3)
    # rows of x in any order, repeated, and indices outside x clamped into it (jnp.take's "clip")
    rows = jnp.array([4, 0, 4, 9, -2], jnp.int32)
    got = gemv.greedy_head_gemv(x, head, transposed=transposed, rows=rows, block_sizes=bs, interpret=True)
    assert got.shape == (5,)
    assert check_tokens(got, jnp.take(x, rows, axis=0, mode="clip"), head, transposed) == 1.0
    # ties: x row 4's maximum in ids 3 and 7 (one block) and 3 + 64 (the next), bitwise equal
    col = (x[4].astype(jnp.float32) * 4.0 / D ** 0.5).astype(x.dtype)
    tied = jnp.array([3 + bs.block_v, 7, 3])
    dup = head.at[tied].set(col) if transposed else head.at[:, tied].set(col[:, None])
    got = gemv.greedy_head_gemv(x, dup, transposed=transposed, rows=rows, block_sizes=bs, interpret=True)
    assert int(got[0]) == int(got[2]) == 3
    assert int(ref_greedy_head(x[4:5], dup, transposed=transposed)[0]) == 3


@pytest.mark.parametrize("T, D, dtype, rows, match", [
    (17, 128, jnp.bfloat16, None, "1 to 16 rows"), (2, 128, jnp.float32, None, "bf16/f16"),
    (2, 8, jnp.bfloat16, None, "D a multiple of 16"), (2, 128, jnp.bfloat16, jnp.zeros((17,), jnp.int32), "17 rows"),
    (2, 128, jnp.bfloat16, jnp.zeros((2, 1), jnp.int32), "vector of integer"),
])
def test_gemv_rejects_what_it_cannot_run(T, D, dtype, rows, match):
    x, head = jnp.zeros((T, D), dtype), jnp.zeros((256, D), dtype)
    with pytest.raises(ValueError, match=match):
        gemv.greedy_head_gemv(x, head, transposed=True, rows=rows, interpret=True)


@pytest.mark.parametrize("kwargs, match", [(dict(block_v=48), "power of two"), (dict(block_k=8), "at least 16"),
                                           (dict(num_warps=3), "power of two"), (dict(num_stages=0), "positive int")])
def test_gemv_block_sizes_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gemv.BlockSizes(**kwargs)


@pytest.mark.parametrize("T, D, V, transposed, bs", [(256, 2048, 128256, True, BlockSizes(64, 128, 64, 4)),
                                                     (200, 192, 1280, False, BlockSizes(64, 256, 64, 3)),
                                                     (8, 576, 49152, True, BlockSizes(128, 128, 64, 4))])
def test_kernel_lowers_for_cuda(T, D, V, transposed, bs):
    x = jax.ShapeDtypeStruct((T, D), jnp.bfloat16)
    head = jax.ShapeDtypeStruct((V, D) if transposed else (D, V), jnp.bfloat16)
    lowered = greedy_head_mosaic.trace(x, head, transposed=transposed, block_sizes=bs).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize("D, V, dtype, bs, match", [
    (64, 1000, jnp.bfloat16, BlockSizes(), "V of 128"),
    (96, 1024, jnp.bfloat16, BlockSizes(), "D a multiple of 64"),
    (64, 1024, jnp.float32, BlockSizes(), "bf16/f16"),
    (64, 1024, jnp.bfloat16, BlockSizes(num_stages=12), "shared memory"),
])
def test_kernel_rejects_what_it_cannot_run(D, V, dtype, bs, match):
    x, head = jax.ShapeDtypeStruct((16, D), dtype), jax.ShapeDtypeStruct((V, D), dtype)
    with pytest.raises(ValueError, match=match):
        greedy_head_mosaic.trace(x, head, transposed=True, block_sizes=bs)


def test_supports():
    x, head = jnp.zeros((5, 128), jnp.bfloat16), jnp.zeros((128, 256), jnp.bfloat16)
    assert supports(x, head, transposed=False) and supports(x, head.T, transposed=True)
    assert not supports(x, head[:, :200], transposed=False)
    assert not supports(x, head.astype(jnp.float16), transposed=False)
    assert not supports(x.astype(jnp.float32), head.astype(jnp.float32), transposed=False)


def test_greedy_head_is_fused():
    head = jax.ShapeDtypeStruct((1000, 128), jnp.bfloat16)  # V not a multiple of 128: the GEMV only
    aligned = jax.ShapeDtypeStruct((1024, 128), jnp.bfloat16)

    def kernel(rows, h=aligned, dtype=jnp.bfloat16, implementation="mosaic_gpu"):
        return dispatch._greedy_head_kernel(jax.ShapeDtypeStruct((rows, 128), dtype), h, transposed=True,
                                            implementation=implementation)

    n, m = dispatch.GREEDY_HEAD_GEMV_MAX_ROWS, dispatch.GREEDY_HEAD_MIN_ROWS
    assert [kernel(1), kernel(n), kernel(n + 1), kernel(m - 1), kernel(m), kernel(256)] == \
        ["triton", "triton", None, None, "mosaic", "mosaic"]  # XLA's Triton GEMMs in between
    assert kernel(1, head) == "triton" and kernel(m, head) is None
    assert kernel(1, implementation="reference") is None and kernel(m, implementation="reference") is None
    assert kernel(1, jax.ShapeDtypeStruct((1024, 128), jnp.float32), jnp.float32) is None
    assert dispatch.greedy_head_is_fused(jax.ShapeDtypeStruct((m, 128), jnp.bfloat16), aligned, transposed=True,
                                         implementation="mosaic_gpu")
    assert not dispatch.greedy_head_is_fused(jax.ShapeDtypeStruct((n + 1, 128), jnp.bfloat16), aligned,
                                             transposed=True, implementation="mosaic_gpu")
    with pytest.raises(ValueError, match="implementation='triton'"):
        dispatch.greedy_head_is_fused(jax.ShapeDtypeStruct((1, 128), jnp.bfloat16), aligned, transposed=True,
                                      implementation="triton")


@pytest.mark.parametrize("transposed", [True, False])
def test_dispatch_reference_and_fallbacks(transposed):
    x, head = inputs(16, 64, 96, jnp.float32, transposed=transposed)
    want = ref_greedy_head(x, head, transposed=transposed)
    np.testing.assert_array_equal(dispatch.greedy_head(x, head, transposed=transposed), want)
    # in f32 the "mosaic_gpu" implementation runs the reference
    np.testing.assert_array_equal(dispatch.greedy_head(x, head, transposed=transposed, implementation="mosaic_gpu"),
                                  want)
    rows = jnp.array([5, 0, 5], jnp.int32)  # the rows to take logits for, as the forward's logits_indices
    np.testing.assert_array_equal(dispatch.greedy_head(x, head, transposed=transposed, rows=rows), want[rows])
    with pytest.raises(ValueError, match="implementation='triton'"):
        dispatch.greedy_head(x, head, transposed=transposed, implementation="triton")


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("T, D, V, transposed, bs", [(256, 2048, 128256, True, BlockSizes()),
                                                     (64, 576, 49152, True, BlockSizes()),
                                                     (130, 192, 1280, False, BlockSizes(64, 256, 64, 3)),
                                                     (8, 128, 512, True, BlockSizes(128, 128, 64, 4))])
def test_kernel_on_device(T, D, V, transposed, bs):
    for seed in (0, 1):  # fresh inputs: a race shows as a moving error
        x, head = inputs(T, D, V, jnp.bfloat16, transposed=transposed, seed=seed)
        got = np.asarray(greedy_head_mosaic(x, head, transposed=transposed, block_sizes=bs))
        assert got.shape == (T,) and got.dtype == np.int32
        logits = exact_logits(x, head, transposed)
        want = logits.argmax(-1)
        rows = np.arange(T)
        # f32 sums in another order may part only near-ties: each token's logit is within a few f32
        # roundings of the row's maximum, and nearly every row agrees exactly
        gap = logits[rows, want] - logits[rows, got]
        assert (gap >= 0).all() and (gap <= 1e-5 * np.abs(logits).max(-1)).all(), gap.max()
        assert (got == want).mean() >= 0.99
        # ties: row 0's maximum in three columns, two in one column block and one in the next,
        # bitwise equal (the same products summed in the same order): the first one wins
        col = (x[0].astype(jnp.float32) * 4.0 / D ** 0.5).astype(x.dtype)
        tied = [3, 7, 3 + bs.block_n]
        dup = head.at[jnp.array(tied)].set(col) if transposed else head.at[:, jnp.array(tied)].set(col[:, None])
        assert int(greedy_head_mosaic(x, dup, transposed=transposed, block_sizes=bs)[0]) == 3
        assert int(ref_greedy_head(x, dup, transposed=transposed)[0]) == 3


@pytest.mark.gpu
@requires_hopper  # dispatch runs the GEMV under gemm_impl "mosaic_gpu" (one Hopper GPU)
@pytest.mark.parametrize("T, D, V, transposed, rows", [(1, 2048, 128256, True, [0]), (2, 4096, 128256, False, None),
                                                       (16, 576, 49152, True, None), (8, 192, 1000, False, [3, 1, 7])])
def test_gemv_kernel_on_device(T, D, V, transposed, rows):
    rows = None if rows is None else jnp.array(rows, jnp.int32)
    for seed in (0, 1):  # fresh inputs: a race shows as a moving error
        x, head = inputs(T, D, V, jnp.bfloat16, transposed=transposed, seed=seed)
        got = dispatch.greedy_head(x, head, transposed=transposed, rows=rows, implementation="mosaic_gpu")
        assert got.dtype == jnp.int32
        assert check_tokens(got, x if rows is None else x[rows], head, transposed) >= 0.99
