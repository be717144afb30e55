"""Flash attention kernels vs the pure-jnp reference.

CPU: the TPU kernel (interpret=True, and a few cases under pltpu.InterpretParams, which raises on
out-of-bounds reads and fills uninitialized memory with NaN) and the Triton GPU kernel
(interpret=True), over dtype x case. The Hopper Mosaic GPU kernel cannot run in interpret mode on
jax 0.10 (its interpreter lacks run_state and layout_cast), so on CPU it is lowered for CUDA, which
runs all of Pallas' Mosaic GPU lowering; the `gpu`-marked tests run both GPU kernels for real.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.flash_attention import (
    BlockSizes, SegmentIds, flash_attention, ref_flash_attention, reference_cost, visible_pairs)
from tests.tolerances import tol

ON_GPU = jax.default_backend() == "gpu"
requires_gpu = pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")


@dataclasses.dataclass(frozen=True)
class Case:
    B: int = 1
    T: int = 96
    S: int = 96
    N: int = 4
    K: int = 4
    H: int = 64
    causal: bool = True
    sliding_window: int | None = None
    soft_cap: float | None = None
    segments: str | None = None  # None | "packed" (shared boundaries) | "disjoint" (some rows see nothing)


# Lengths are deliberately not multiples of the test tiles (16 x 32 on GPU, 16 x 128 on TPU).
CASES = {
    "causal": Case(),
    "non_causal": Case(T=80, S=112, K=1, causal=False),  # GQA 4
    "segment_ids": Case(B=2, T=90, S=90, N=8, K=1, segments="packed"),  # GQA 8
    "segment_ids_empty_rows": Case(T=40, S=72, N=2, K=2, causal=False, segments="disjoint"),
    "sliding_window": Case(T=128, S=128, N=2, K=2, sliding_window=37),
    "soft_cap": Case(T=64, S=64, K=2, soft_cap=2.0),
    "chunked_prefill": Case(T=40, S=170, K=1),
    "chunk_window_cap": Case(T=33, S=150, N=8, K=2, sliding_window=50, soft_cap=5.0),
    "single_token": Case(T=1, S=77, N=8, K=1),
    "head_dim_128": Case(T=48, S=48, N=2, K=1, H=128),
    "head_dim_256": Case(T=40, S=40, N=2, K=2, H=256),
}


def make_inputs(c: Case, dtype, seed):
    key = jax.random.key(seed)
    kq, kk, kv, ks = jax.random.split(key, 4)
    q = jax.random.normal(kq, (c.B, c.T, c.N, c.H), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (c.B, c.S, c.K, c.H), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (c.B, c.S, c.K, c.H), jnp.float32).astype(dtype)
    seg = None
    if c.segments == "packed":
        # Random segment boundaries shared by q and kv (T == S): sorted ids, so causal packing.
        ids = jnp.sort(jax.random.randint(ks, (c.B, c.T), 0, 3), axis=1).astype(jnp.int32)
        seg = ids
    elif c.segments == "disjoint":
        q_ids = jax.random.randint(ks, (c.B, c.T), 0, 4).astype(jnp.int32)  # id 3 never appears in kv
        kv_ids = jax.random.randint(jax.random.fold_in(ks, 1), (c.B, c.S), 0, 3).astype(jnp.int32)
        seg = SegmentIds(q_ids, kv_ids)
    return q, k, v, seg


def opts(c: Case):
    return dict(sm_scale=1.0 / math.sqrt(c.H), causal=c.causal, sliding_window=c.sliding_window,
                soft_cap=c.soft_cap)


def check_against_reference(c: Case, dtype, implementation, block_sizes, interpret, seed):
    q, k, v, seg = make_inputs(c, dtype, seed)
    out = flash_attention(q, k, v, segment_ids=seg, block_sizes=block_sizes, implementation=implementation,
                          interpret=interpret, **opts(c))
    ref = ref_flash_attention(q, k, v, segment_ids=seg, **opts(c))
    assert out.shape == q.shape and out.dtype == q.dtype
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all(), "kernel produced NaN/inf"
    atol, rtol = tol(dtype)
    np.testing.assert_allclose(out, ref, atol=atol, rtol=rtol)
    return out


DTYPES = [jnp.float32, jnp.bfloat16]
TPU_TEST_BLOCKS = BlockSizes(block_q=16, block_kv=128)
TRITON_TEST_BLOCKS = BlockSizes(block_q=16, block_kv=32)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_tpu_kernel_interpret(case, dtype):
    check_against_reference(CASES[case], dtype, "tpu", TPU_TEST_BLOCKS, True, seed=zlib.crc32(case.encode()) % 1000)


@pytest.mark.parametrize("case", ["chunk_window_cap", "segment_ids", "non_causal"])
def test_tpu_kernel_interpret_params_oob_checked(case):
    # 40-200x slower than interpret=True: a few small cases. Out-of-bounds reads raise here, and
    # uninitialized scratch reads as NaN, so a missed init or a bad index_map cannot pass.
    params = pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")
    c = dataclasses.replace(CASES[case], B=1, N=min(CASES[case].N, 2), K=min(CASES[case].K, 2))
    check_against_reference(c, jnp.float32, "tpu", TPU_TEST_BLOCKS, params, seed=7)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_triton_kernel_interpret(case, dtype):
    check_against_reference(CASES[case], dtype, "triton", TRITON_TEST_BLOCKS, True,
                            seed=zlib.crc32(case.encode()) % 1000 + 1)


def test_kernels_skip_hidden_blocks_and_still_match():
    # A long chunk with a short window: most KV blocks are skipped (TPU: clamped index_map and
    # pl.when; Triton: loop bounds); a wrong bound shows up as a mismatch against the reference.
    c = Case(T=64, S=640, N=2, K=1, sliding_window=20)
    check_against_reference(c, jnp.float32, "tpu", TPU_TEST_BLOCKS, True, seed=3)
    check_against_reference(c, jnp.float32, "triton", TRITON_TEST_BLOCKS, True, seed=3)


def test_rows_without_visible_keys_are_zero():
    c = CASES["segment_ids_empty_rows"]
    q, k, v, seg = make_inputs(c, jnp.float32, seed=11)
    empty = np.asarray(seg.q == 3)  # [B, T]
    assert empty.any() and not empty.all()
    for impl, bs in (("reference", None), ("tpu", TPU_TEST_BLOCKS), ("triton", TRITON_TEST_BLOCKS)):
        out = np.asarray(flash_attention(q, k, v, segment_ids=seg, block_sizes=bs, implementation=impl,
                                         interpret=True, **opts(c)))
        assert np.isfinite(out).all(), impl
        assert (out[empty] == 0).all(), impl
        assert (np.abs(out[~empty]).sum(-1) > 0).all(), impl


def test_reference_matches_naive_softmax():
    # The oracle itself against a per-row numpy loop (float64), causal chunk + window + cap + GQA.
    c = Case(T=5, S=9, N=4, K=2, H=8, sliding_window=4, soft_cap=3.0)
    q, k, v, _ = make_inputs(c, jnp.float32, seed=5)
    out = np.asarray(ref_flash_attention(q, k, v, **opts(c)))
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    expect = np.zeros_like(out, dtype=np.float64)
    for n in range(c.N):
        for i in range(c.T):
            p = c.S - c.T + i
            js = [j for j in range(c.S) if j <= p and j > p - c.sliding_window]
            s = np.array([qn[0, i, n] @ kn[0, j, n // 2] for j in js]) / math.sqrt(c.H)
            s = c.soft_cap * np.tanh(s / c.soft_cap)
            w = np.exp(s - s.max())
            w /= w.sum()
            expect[0, i, n] = w @ vn[0, js, n // 2]
    np.testing.assert_allclose(out, expect, atol=1e-5, rtol=1e-5)
    # a numpy integer window (a config read through numpy) is a window, as the ragged kernel takes it
    np.testing.assert_array_equal(np.asarray(ref_flash_attention(q, k, v, **{**opts(c), "sliding_window": np.int64(4)})),
                                  out)


def test_cost_estimate_counts_visible_pairs():
    assert visible_pairs(4, 4, True, None) == 10
    assert visible_pairs(2, 5, True, None) == 4 + 5
    assert visible_pairs(4, 4, True, 2) == 1 + 2 + 2 + 2
    assert visible_pairs(3, 7, False, None) == 21
    ce = reference_cost((2, 4, 8, 16), (2, 4, 2, 16), jnp.bfloat16, causal=True, sliding_window=None)
    assert ce.flops == 4 * 2 * 8 * 16 * 10
    assert ce.transcendentals == 2 * 8 * 10
    assert ce.bytes_accessed == 2 * (2 * 2 * 4 * 8 * 16 + 2 * 2 * 4 * 2 * 16)


# ---- Mosaic GPU (Hopper) kernel: CUDA lowering on CPU -------------------------------------------

MOSAIC_LOWER_CASES = {
    "causal_gqa4_h128": Case(B=1, T=256, S=256, N=8, K=2, H=128),
    "chunk_window_cap_h64_padded": Case(B=1, T=100, S=300, N=2, K=1, H=64, sliding_window=70, soft_cap=20.0),
    "non_causal_h256_padded": Case(B=2, T=130, S=200, N=2, K=2, H=256, causal=False),
}


@pytest.mark.parametrize("case", list(MOSAIC_LOWER_CASES))
def test_mosaic_gpu_kernel_lowers_for_cuda(case):
    from pallas_kernels.flash_attention.gpu_mosaic import flash_attention_mosaic

    c = MOSAIC_LOWER_CASES[case]
    q = jax.ShapeDtypeStruct((c.B, c.T, c.N, c.H), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((c.B, c.S, c.K, c.H), jnp.bfloat16)
    lowered = flash_attention_mosaic.trace(q, kv, kv, **opts(c)).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


# ---- Negative tests -----------------------------------------------------------------------------

def _qkv(B=1, T=8, S=8, N=4, K=2, H=16, dtype=jnp.float32):
    return (jnp.ones((B, T, N, H), dtype), jnp.ones((B, S, K, H), dtype), jnp.ones((B, S, K, H), dtype))


@pytest.mark.parametrize("implementation", ["reference", "tpu", "triton"])
@pytest.mark.parametrize("mutate, kwargs, match", [
    (lambda q, k, v: (q[0], k, v), {}, "q must be 4-D"),
    (lambda q, k, v: (q, k, v[:, :4]), {}, "v has shape"),
    (lambda q, k, v: (q, k[:1, :, :, :8], v[:1, :, :, :8]), {}, "head_dim"),
    (lambda q, k, v: (q[:, :, :3], k, v), {}, "not a multiple"),
    (lambda q, k, v: (q, k.astype(jnp.bfloat16), v), {}, "must have q's dtype"),
    (lambda q, k, v: (q.astype(jnp.int32), k.astype(jnp.int32), v.astype(jnp.int32)), {}, "dtype"),
    (lambda q, k, v: (q, k[:, :4], v[:, :4]), {}, "causal attention needs T <= S"),
    (lambda q, k, v: (q, k, v), {"sliding_window": 0}, "sliding_window=0"),
    (lambda q, k, v: (q, k, v), {"sliding_window": 4, "causal": False}, "sliding_window needs causal"),
    (lambda q, k, v: (q, k, v), {"soft_cap": -1.0}, "soft_cap=-1.0"),
    (lambda q, k, v: (q, k, v), {"sm_scale": 0.0}, "sm_scale=0.0"),
    (lambda q, k, v: (q, k, v), {"segment_ids": jnp.zeros((1, 7), jnp.int32)}, "q_segment_ids has shape"),
    (lambda q, k, v: (q, k, v), {"segment_ids": (jnp.zeros((1, 8), jnp.int32), jnp.zeros((1, 9), jnp.int32))},
     "kv_segment_ids has shape"),
    (lambda q, k, v: (q, k, v), {"segment_ids": (jnp.zeros((1, 8)), jnp.zeros((1, 8)))}, "integer dtype"),
    (lambda q, k, v: (q[:, :4], k, v), {"segment_ids": jnp.zeros((1, 4), jnp.int32)}, "needs T == S"),
])
def test_bad_inputs_raise(implementation, mutate, kwargs, match):
    q, k, v = mutate(*_qkv())
    kw = dict(sm_scale=0.25, causal=True)
    kw.update(kwargs)
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, v, implementation=implementation, interpret=True, **kw)


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_q=12), "block_q=12"),
    (dict(block_kv=4), "block_kv=4"),
    (dict(num_warps=3), "num_warps=3"),
    (dict(num_stages=0), "num_stages=0"),
])
def test_block_sizes_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockSizes(**kwargs)


def test_backend_specific_block_limits():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="block_kv=64: the TPU kernel"):
        flash_attention(q, k, v, sm_scale=0.25, block_sizes=BlockSizes(16, 64), implementation="tpu", interpret=True)
    with pytest.raises(ValueError, match="the Triton kernel needs"):
        flash_attention(q, k, v, sm_scale=0.25, block_sizes=BlockSizes(8, 32), implementation="triton", interpret=True)
    from pallas_kernels.flash_attention.gpu_mosaic import flash_attention_mosaic
    qb, kb, vb = _qkv(H=64, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="block_q=128: the Mosaic GPU kernel needs 64"):
        flash_attention_mosaic.trace(qb, kb, vb, sm_scale=0.1, block_sizes=BlockSizes(128, 128))
    with pytest.raises(ValueError, match="shared memory"):
        flash_attention_mosaic.trace(*_qkv(H=256, dtype=jnp.bfloat16), sm_scale=0.1,
                                     block_sizes=BlockSizes(64, 256, num_stages=2))
    with pytest.raises(ValueError, match="head_dim in"):
        flash_attention_mosaic.trace(*_qkv(H=80, dtype=jnp.bfloat16), sm_scale=0.1)
    with pytest.raises(ValueError, match="implementation='cuda'"):
        flash_attention(q, k, v, sm_scale=0.25, implementation="cuda")


# ---- Real GPU -----------------------------------------------------------------------------------

GPU_CASES = {
    "causal_gqa4": Case(B=2, T=1000, S=1000, N=8, K=2, H=128),
    "prefill_4k_gqa4": Case(B=1, T=4096, S=4096, N=8, K=2, H=128),
    "chunked_prefill": Case(B=2, T=300, S=2100, N=8, K=1, H=128),
    "non_causal_h64": Case(B=2, T=513, S=700, N=4, K=4, H=64, causal=False),
    "window_cap_h256": Case(B=1, T=900, S=900, N=4, K=2, H=256, sliding_window=300, soft_cap=30.0),
    "window_h128": Case(B=1, T=2048, S=2048, N=4, K=1, H=128, sliding_window=512),
    # Window not a multiple of the KV tile: rows whose first KV block is fully masked (NaN before
    # the running-max floor in gpu_mosaic.py).
    "window_unaligned_h64": Case(B=1, T=900, S=900, N=4, K=2, H=64, sliding_window=300),
    "single_token": Case(B=3, T=1, S=333, N=8, K=2, H=128),
}


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
@pytest.mark.parametrize("implementation", ["mosaic_gpu", "triton"])
def test_gpu_kernels_on_device(case, implementation):
    c = GPU_CASES[case]
    for seed in (0, 1):  # fresh inputs: a race shows as a moving error
        check_against_reference(c, jnp.bfloat16, implementation, None, False, seed=seed)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("case", ["segment_ids", "segment_ids_empty_rows", "chunk_window_cap"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_triton_kernel_on_device_small(case, dtype):
    c = dataclasses.replace(CASES[case], H=128)
    check_against_reference(c, dtype, "gpu", None, False, seed=2)


def _dot_precisions(jaxpr) -> list:
    """The precision of every dot_general in `jaxpr`, inner jaxprs (a pallas_call's kernel, pl.when's
    branches) included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out.append(eqn.params["precision"])
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    out += _dot_precisions(sub)
    return out


@pytest.mark.parametrize("dtype, want", [(jnp.float32, (jax.lax.Precision.HIGHEST,) * 2), (jnp.bfloat16, None)])
def test_tpu_kernel_takes_f32_dots_at_full_precision(dtype, want):
    """A TPU takes bf16 passes for an f32 dot at the default precision: the kernel's two dots ask for
    HIGHEST with f32 inputs (as the ragged kernel's do), the default with bf16 (interpret mode on a
    CPU computes both exactly, so the kernel's program is what is checked)."""
    from pallas_kernels.flash_attention.tpu import flash_attention_tpu

    q = jax.ShapeDtypeStruct((1, 2, 256, 128), dtype)
    jaxpr = jax.make_jaxpr(lambda q, k, v: flash_attention_tpu(q, k, v, sm_scale=0.1, interpret=True))(q, q, q)
    assert _dot_precisions(jaxpr.jaxpr) == [want, want]
