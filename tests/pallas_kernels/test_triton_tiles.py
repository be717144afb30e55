"""The helpers the Pallas Triton kernels share: the early launch of the next kernel
(`griddepcontrol.launch_dependents`) is in every decode-step kernel lowered for a Hopper GPU, and in
none run in interpret mode or on a GPU without the instruction."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import triton_tiles
from pallas_kernels.greedy_head import gpu as head_gpu
from pallas_kernels.ragged_paged_attention import gpu as rpa_gpu
from pallas_kernels.rms_norm import gpu as norm_gpu
from pallas_kernels.swiglu import gpu as swiglu_gpu

TRIGGER = "griddepcontrol.launch_dependents"


def test_disabled_is_the_identity_and_emits_nothing():
    idx = jnp.arange(8, dtype=jnp.int32)
    assert triton_tiles.launch_dependents(idx, False) is idx
    assert not triton_tiles.early_launch_enabled(interpret=True)
    if jax.default_backend() != "gpu":
        assert not triton_tiles.early_launch_supported()  # CPU: never emitted


def _cuda_text(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.fixture
def hopper(monkeypatch):
    """Lower as the kernels would for an sm_90 GPU, whatever this host has."""
    monkeypatch.setattr(triton_tiles, "early_launch_supported", lambda: True)


def _kernels(interpret: bool):
    """(name, lowering text) of each decode-step kernel, llama3_2_1b's batch-1 shapes."""
    D, H, K, R, F = 2048, 64, 8, 4, 512
    x = jnp.zeros((1, D), jnp.bfloat16)
    scale = jnp.zeros((D,), jnp.bfloat16)
    yield "add_rms_norm", _cuda_text(functools.partial(norm_gpu._add_rms_norm, eps=1e-5, block_rows=1,
                                                       interpret=interpret), x, x, scale)
    w = jnp.zeros((D, 2, F), jnp.bfloat16)
    yield "swiglu_gemv", _cuda_text(functools.partial(swiglu_gpu.swiglu_gemv, interpret=interpret), x, w)
    head = jnp.zeros((1024, D), jnp.bfloat16)
    yield "greedy_head_gemv", _cuda_text(functools.partial(head_gpu.greedy_head_gemv, transposed=True,
                                                           interpret=interpret), x, head)
    P, G = 16, 16
    kv_pages = jnp.zeros((P, G, 2 * K, H), jnp.bfloat16)
    qkv = jnp.zeros((1, K, R + 2, H), jnp.bfloat16)
    cos = sin = jnp.zeros((1, H // 2), jnp.float32)
    lens, pages = jnp.array([40], jnp.int32), jnp.arange(4, dtype=jnp.int32)[None]
    cu, n = jnp.array([0, 1], jnp.int32), jnp.array([1], jnp.int32)
    fn = functools.partial(rpa_gpu.write_qkv_attention, sm_scale=0.125, interpret=interpret,
                           block_sizes=rpa_gpu.BlockSizes(kv_pages_per_block=1, kv_splits=4))
    yield "attention + merge", _cuda_text(fn, kv_pages, qkv, cos, sin, lens, pages, cu, n)


def test_every_decode_kernel_launches_its_successor_early(hopper):
    texts = dict(_kernels(interpret=False))
    for name, text in texts.items():
        assert TRIGGER in text, name
    # the attention with splits is two launches, both with the trigger
    assert texts["attention + merge"].count(TRIGGER) == 2


def test_interpret_mode_never_emits_the_instruction(hopper):
    for name, text in _kernels(interpret=True):
        assert TRIGGER not in text, name


def test_contraction_block():
    assert [triton_tiles.contraction_block(D, 128) for D in (2048, 576, 960, 72, 8)] == [128, 64, 64, 0, 0]
    assert triton_tiles.contraction_block(2048, 64) == 64
