"""The one table that maps logical axis names to mesh axes, and the sharding helpers built on it.

Serving never shards weights FSDP-style (decode is bandwidth-bound, an all-gather per layer would
dominate): weights split only over `tensor`, and are replicated over `replica` and `context`.
"""

from __future__ import annotations

from typing import Callable

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from models.config import ModelConfig
from sharding.mesh import mesh_axis_size

LOGICAL_AXIS_RULES: dict[str, str | None] = {
    "vocab": "tensor",
    "embed": None,
    "mlp": "tensor",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "layers": None,
    "batch": "replica",
    "seq": "context",
    "pages": None,
}


def attention_layout(cfg: ModelConfig, mesh: jax.sharding.Mesh) -> tuple[bool, bool, int]:
    """(shard q heads, shard kv heads / cache, kv_repeat) for this model on this mesh.

    Query heads split over `tensor` when N divides evenly. KV heads split too when K divides
    evenly; when K is smaller than the tensor axis (and divides it) each KV head is stored
    kv_repeat = tensor / K times so every shard holds exactly the KV head its query heads read.
    Otherwise attention runs replicated (correct, just not tensor-parallel).
    """
    t = mesh_axis_size(mesh, "tensor")
    N, K = cfg.num_heads, cfg.num_kv_heads
    if N % t:
        return False, False, 1
    if K % t == 0:
        return True, True, 1
    if t % K == 0:
        return True, True, t // K
    return True, False, 1


def kv_repeat(cfg: ModelConfig, mesh: jax.sharding.Mesh) -> int:
    return attention_layout(cfg, mesh)[2]


def head_parallel_mesh(cfg: ModelConfig, mesh: jax.sharding.Mesh) -> jax.sharding.Mesh | None:
    """The mesh whose `tensor` axis the model's KV write and attention run split over, each device
    on its own heads (`shard_over_heads`), or None when they run as one program over the whole
    batch: a mesh without a tensor axis, or a layout that does not split both query and KV heads.

    Why explicitly: the Pallas kernels (attention; the KV write on GPU) are custom calls, which
    XLA's partitioner cannot split. Given head-sharded q and a head-sharded KV pool it would
    gather both onto every device around each call, every layer, every step (the whole pool);
    under shard_map every device runs the kernel on its heads and its slice of the pool, with no
    communication at all."""
    if mesh_axis_size(mesh, "tensor") == 1:
        return None
    q_ok, kv_ok, _ = attention_layout(cfg, mesh)
    return mesh if q_ok and kv_ok else None


def shard_over_heads(fn: Callable, mesh: jax.sharding.Mesh) -> Callable:
    """fn(kv_pages [P, G, 2K', H], qkv [T, K', R'+2, H], cos, sin, kv_lens, page_indices, cu_q_lens,
    num_seqs) -> (o [T, N, H], kv_pages), run per shard of the `tensor` axis: each device gets its
    K'/t groups of the merged projection (their query heads and their KV head's k and v), the
    matching slice of the pool's interleaved K/V axis (kv_cache_sharding), RoPE's tables and the
    metadata whole. The heads a query reads stay on its device (query head i reads KV head
    i // (N/K'), and both split evenly: head_parallel_mesh)."""
    heads, pool, whole = PartitionSpec(None, "tensor", None), _pool_spec(split=True), PartitionSpec()
    groups = PartitionSpec(None, "tensor", None, None)
    return jax.shard_map(fn, mesh=mesh, in_specs=(pool, groups) + (whole,) * 6,
                         out_specs=(heads, pool), check_vma=False)


def logical_to_spec(
    logical_axes: tuple[str | None, ...] | None,
    shape: tuple[int, ...],
    mesh: jax.sharding.Mesh,
    cfg: ModelConfig | None = None,
) -> PartitionSpec:
    """PartitionSpec for an array with these logical axes; a dim that the mesh axis doesn't divide
    evenly, or a mesh axis already used by an earlier dim, stays replicated."""
    if not logical_axes:
        return PartitionSpec()
    if len(logical_axes) != len(shape):
        raise ValueError(f"logical axes {logical_axes} do not match shape {shape}")
    q_ok, kv_ok, _ = attention_layout(cfg, mesh) if cfg is not None else (True, True, 1)
    used, spec = set(), []
    for name, dim in zip(logical_axes, shape):
        if name is not None and name not in LOGICAL_AXIS_RULES:
            raise ValueError(f"unknown logical axis {name!r}; known: {sorted(LOGICAL_AXIS_RULES)}")
        axis = LOGICAL_AXIS_RULES.get(name) if name else None
        if name == "q_heads" and not q_ok:
            axis = None
        if name == "kv_heads" and not kv_ok:  # (with kv_repeat > 1 the axis holds the repeated heads)
            axis = None
        if axis is not None and (axis in used or dim % mesh_axis_size(mesh, axis)):
            axis = None
        if axis is not None:
            used.add(axis)
        spec.append(axis)
    return PartitionSpec(*spec)


def state_shardings(state: nnx.State, mesh: jax.sharding.Mesh, cfg: ModelConfig) -> nnx.State:
    """The model state with every leaf replaced by its NamedSharding (a jit out_shardings tree)."""

    def one(var):
        axes = var.get_metadata().get("logical_axes") if isinstance(var, nnx.Param) else None
        return var.replace(NamedSharding(mesh, logical_to_spec(axes, var.value.shape, mesh, cfg)))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def kv_cache_sharding(cfg: ModelConfig, mesh: jax.sharding.Mesh) -> NamedSharding:
    """Sharding of one layer's pool [P, G, 2K', H]: the interleaved K/V axis splits over tensor."""
    _, kv_ok, _ = attention_layout(cfg, mesh)
    return NamedSharding(mesh, _pool_spec(split=kv_ok))


def _pool_spec(*, split: bool) -> PartitionSpec:
    """A pool [P, G, 2K', H]: the interleaved K/V axis over tensor (split) or whole. One layout for
    the pool's placement (kv_cache_sharding) and its per-shard view (shard_over_heads)."""
    return PartitionSpec(None, None, "tensor" if split else None, None)
