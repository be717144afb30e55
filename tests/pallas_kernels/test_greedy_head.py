"""The greedy LM head: the jnp reference against float64, validation, the Hopper Mosaic GPU kernel
lowered for CUDA on CPU (Mosaic GPU's interpreter does not run it) and run against the reference
under `gpu`, and dispatch's fallbacks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels.greedy_head import head_logits, ref_greedy_head, validate
from pallas_kernels.greedy_head.gpu_mosaic import BlockSizes, greedy_head_mosaic, supports
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
    n = dispatch.GREEDY_HEAD_MIN_ROWS
    x, head = jax.ShapeDtypeStruct((n, 128), jnp.bfloat16), jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
    assert dispatch.greedy_head_is_fused(x, head, transposed=True, implementation="mosaic_gpu")
    assert not dispatch.greedy_head_is_fused(x, head, transposed=True, implementation="reference")
    few = jax.ShapeDtypeStruct((n - 1, 128), jnp.bfloat16)  # XLA's Triton GEMMs win below
    assert not dispatch.greedy_head_is_fused(few, head, transposed=True, implementation="mosaic_gpu")
    f32 = jax.ShapeDtypeStruct((256, 128), jnp.float32)
    assert not dispatch.greedy_head_is_fused(jax.ShapeDtypeStruct((n, 128), jnp.float32), f32, transposed=True,
                                             implementation="mosaic_gpu")
    assert not dispatch.greedy_head_is_fused(x, jax.ShapeDtypeStruct((200, 128), jnp.bfloat16), transposed=True,
                                             implementation="mosaic_gpu")


@pytest.mark.parametrize("transposed", [True, False])
def test_dispatch_reference_and_fallbacks(transposed):
    x, head = inputs(16, 64, 96, jnp.float32, transposed=transposed)
    want = ref_greedy_head(x, head, transposed=transposed)
    np.testing.assert_array_equal(dispatch.greedy_head(x, head, transposed=transposed), want)
    # in f32 and with V not a multiple of 128 the Mosaic implementation runs the reference
    np.testing.assert_array_equal(dispatch.greedy_head(x, head, transposed=transposed, implementation="mosaic_gpu"),
                                  want)
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
