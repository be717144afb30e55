"""On 8 fake CPU devices: the KV write and attention run per tensor shard (shard_over_heads) with
each kernel (and the GPU's one-launch write + attention of decode-only steps), and give what one
device gives.

The Pallas kernels run in interpret mode here. On a real GPU or TPU they are custom calls that
XLA cannot partition; shard_over_heads is what keeps each device on its own heads and its own
slice of the KV pool (sharding/rules.py). Every compiled program is checked for collectives: the
per-shard write + attention must not communicate at all.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from models.attention import AttentionMetadata
from pallas_kernels.ragged_paged_attention import (
    BlockSizes, gpu, gpu_write, ref_ragged_paged_attention, ref_write_qkv, tpu)
from sharding.mesh import MeshConfig
from sharding.rules import head_parallel_mesh, kv_cache_sharding, shard_over_heads
from models.config import get_preset
from tests.tolerances import tol

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")

N, K, H, G, T, S, P_MAX = 8, 4, 64, 16, 24, 4, 3
Q_LENS, KV_LENS = (1, 7, 5, 1), (1, 7, 31, 33)  # a decode, a fresh prompt, a chunk crossing pages, a decode
DECODE_KV_LENS = (1, 16, 17, 33)  # decodes only: the token at a page's start, end and past it
SM_SCALE = H**-0.5


def _gpu_attend(q, kv, *meta):
    return gpu.ragged_paged_attention(q, kv, *meta, sm_scale=SM_SCALE, interpret=True,
                                      block_sizes=BlockSizes(q_tokens_per_block=4, kv_pages_per_block=2, kv_splits=2))


def _gpu_write(kv, qkv, cos, sin, *meta):
    return gpu_write.write_qkv(kv, qkv, cos, sin, *meta, interpret=True)


def _tpu_attend(q, kv, *meta):
    return tpu.ragged_paged_attention(q, kv, *meta, sm_scale=SM_SCALE, interpret=True,
                                      block_sizes=BlockSizes(q_tokens_per_block=8, kv_pages_per_block=2))


def _ref_attend(q, kv, *meta):
    return ref_ragged_paged_attention(q, kv, *meta, sm_scale=SM_SCALE)


KERNELS = {  # name -> (write, attend), as pallas_kernels.dispatch pairs them per implementation
    "gpu": (_gpu_write, _gpu_attend),
    "tpu": (ref_write_qkv, _tpu_attend),
    "reference": (ref_write_qkv, _ref_attend),
}


def _write_and_attend(write, attend):
    def run(kv_pages, qkv, cos, sin, *meta):
        q, kv_pages = write(kv_pages, qkv, cos, sin, *meta)
        return attend(q, kv_pages, *meta), kv_pages
    return run


@functools.lru_cache(maxsize=None)
def _inputs(dtype_name: str, q_lens=Q_LENS, kv_lens=KV_LENS):
    """(kv_pages, qkv, cos, sin, *metadata) as numpy arrays, and the number of real tokens. The pool
    is finite random data (a stray write shows); pages are distinct per sequence."""
    rng = np.random.default_rng(7)
    num_pages = S * P_MAX + 2
    free = rng.permutation(num_pages)
    tables, used = [], 0
    for kv_len in kv_lens:
        n = -(-kv_len // G)
        tables.append(free[used: used + n].tolist())
        used += n
    meta = AttentionMetadata.build(kv_lens, q_lens, tables, max_seqs=S, pages_per_seq=P_MAX)
    dt = jnp.dtype(dtype_name)
    arrays = [rng.standard_normal(shape).astype(np.float32).astype(dt)
              for shape in ((num_pages, G, 2 * K, H), (T, K, N // K + 2, H))]
    angles = rng.integers(0, 64, (T, 1)) * (10000.0 ** -(np.arange(H // 2) / (H // 2)))
    rope = [np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)]
    return (*arrays, *rope, *meta), sum(q_lens)


def _gpu_write_attend(kv, qkv, cos, sin, *meta):
    return gpu.write_qkv_attention(kv, qkv, cos, sin, *meta, sm_scale=SM_SCALE, interpret=True,
                                   block_sizes=BlockSizes(kv_pages_per_block=2, kv_splits=2))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kernel", [*KERNELS, "gpu_decode_only"])
@pytest.mark.parametrize("replica,tensor", [(1, 2), (2, 2), (1, 4)])
def test_per_shard_write_and_attention_equal_one_device(kernel, replica, tensor, dtype):
    if kernel == "gpu_decode_only":  # one launch (the engine's decode-only programs): decodes only
        args, n_real = _inputs(jnp.dtype(dtype).name, (1,) * len(DECODE_KV_LENS), DECODE_KV_LENS)
        run = _gpu_write_attend
    else:
        args, n_real = _inputs(jnp.dtype(dtype).name)
        run = _write_and_attend(*KERNELS[kernel])
    ref_o, ref_pool = jax.jit(_write_and_attend(ref_write_qkv, _ref_attend))(*args)

    mesh = MeshConfig(replica=replica, tensor=tensor).make_mesh()
    heads, pool = PartitionSpec(None, "tensor", None), PartitionSpec(None, None, "tensor", None)
    specs = (pool, PartitionSpec(None, "tensor", None, None)) + (PartitionSpec(),) * 6
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    step = jax.jit(shard_over_heads(run, mesh), donate_argnums=0)
    hlo = step.lower(*placed).compile().as_text()
    for collective in ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter"):
        assert collective not in hlo, f"per-shard write + attention communicates: {collective}"
    o, new_pool = step(*placed)
    assert new_pool.sharding.is_equivalent_to(NamedSharding(mesh, pool), 4)
    assert o.sharding.is_equivalent_to(NamedSharding(mesh, heads), 3)
    # RoPE'd k: one rounding apart where the kernel's multiply-adds contract (test_write_kv_pages)
    eps = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(np.asarray(new_pool, np.float32), np.asarray(ref_pool, np.float32), rtol=2 * eps,
                               atol=8 * eps)
    atol, rtol = tol(dtype)
    np.testing.assert_allclose(np.asarray(o, np.float32)[:n_real], np.asarray(ref_o, np.float32)[:n_real],
                               atol=atol, rtol=rtol)


@pytest.mark.parametrize("heads,kv_heads,tensor,expect", [
    (32, 8, 1, False),  # no tensor axis
    (32, 8, 2, True),
    (32, 8, 8, True),
    (8, 2, 4, True),  # each KV head stored twice (kv_repeat 2): still one per device
    (14, 2, 4, False),  # query heads do not split: attention runs whole
    (12, 3, 2, False),  # query heads split, KV heads neither split nor repeat evenly
])
def test_head_parallel_only_where_both_head_kinds_split(heads, kv_heads, tensor, expect):
    cfg = dataclasses.replace(get_preset("llama3_2_1b"), num_heads=heads, num_kv_heads=kv_heads)
    mesh = MeshConfig(tensor=tensor).make_mesh()
    assert (head_parallel_mesh(cfg, mesh) is not None) is expect
    if expect:  # the pool's sharding is the one shard_over_heads assumes
        assert kv_cache_sharding(cfg, mesh).spec == PartitionSpec(None, None, "tensor", None)
