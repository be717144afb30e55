"""On 8 fake CPU devices: every mesh layout computes the same logits as one device."""

import jax
import numpy as np
import pytest
from flax import nnx

from runtime.checkpoint import load_model, restore_orbax, save_orbax
from tests.testing.greedy import greedy_generate
from sharding.mesh import MeshConfig
from sharding.rules import attention_layout
from tests.models.test_llama_vs_hf import BASE, make_hf_checkpoint
from tests.tolerances import MESH_LOGITS_F32

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")

MESHES = [(1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 2), (8, 1)]  # (replica, tensor)


@pytest.fixture(scope="module", params=["mqa", "qwen2_qkv_bias"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_hf_checkpoint(request.param, path)
    prompt = np.random.default_rng().integers(0, BASE["vocab_size"], 40).tolist()
    single = load_model(path, dtype="float32", progress=False)
    return path, prompt, greedy_generate(single, prompt, 1).prompt_logits


@pytest.mark.parametrize("replica,tensor", MESHES)
def test_mesh_matches_single_device(checkpoint, replica, tensor):
    path, prompt, ref = checkpoint
    mesh = MeshConfig(replica=replica, tensor=tensor).make_mesh()
    model = load_model(path, mesh=mesh, dtype="float32", progress=False)
    q_sharded, kv_sharded, rep = attention_layout(model.config, mesh)
    mlp = model.params["layers"][0]["mlp"]["gate_up_proj"][...]
    qkv = model.params["layers"][0]["attn"]["qkv_proj"][...]
    if tensor > 1:  # weights really are split, not replicated
        assert mlp.sharding.spec[2] == "tensor"
        assert mlp.addressable_shards[0].data.shape[2] == model.config.intermediate_size // tensor
    if model.config.num_kv_heads < tensor and q_sharded:
        assert rep == tensor // model.config.num_kv_heads and kv_sharded
    if kv_sharded:  # one group of query heads + its (repeated) KV head per shard, never the whole qkv
        assert qkv.sharding.spec[1] == "tensor"
        assert qkv.shape[1] == model.config.num_kv_heads * rep
        assert qkv.addressable_shards[0].data.shape[1] == qkv.shape[1] // tensor
    # KV write + attention run per tensor shard (shard_over_heads) exactly when both head kinds split
    attn = nnx.merge(model.graphdef, model.params).layers[0].attn
    assert (attn.head_mesh is not None) is (tensor > 1 and q_sharded and kv_sharded)
    got = greedy_generate(model, prompt, 1).prompt_logits
    atol, rtol = MESH_LOGITS_F32
    np.testing.assert_allclose(got, ref, atol=atol, rtol=rtol)


def test_orbax_restores_onto_another_mesh(checkpoint, tmp_path):
    path, prompt, ref = checkpoint
    src = load_model(path, mesh=MeshConfig(tensor=2).make_mesh(), dtype="float32", progress=False)
    save_orbax(src, tmp_path / "ckpt")
    for replica, tensor in [(1, 1), (2, 4)]:
        mesh = MeshConfig(replica=replica, tensor=tensor).make_mesh()
        restored = restore_orbax(tmp_path / "ckpt", mesh=mesh)
        assert restored.config == src.config
        leaf = restored.params["layers"][0]["mlp"]["gate_up_proj"][...]
        assert leaf.sharding.mesh.shape == mesh.shape
        atol, rtol = MESH_LOGITS_F32
        np.testing.assert_allclose(greedy_generate(restored, prompt, 1).prompt_logits, ref, atol=atol, rtol=rtol)
    # the bf16 restore path casts on device
    half = restore_orbax(tmp_path / "ckpt", mesh=MeshConfig().make_mesh(), dtype="bfloat16")
    assert half.params["embed"][...].dtype == np.dtype("bfloat16")
