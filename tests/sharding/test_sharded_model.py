"""On 8 fake CPU devices: every mesh layout computes the same logits as one device."""

import jax
import numpy as np
import pytest
from flax import nnx

from runtime.checkpoint import load_model, restore_orbax, save_orbax
from models.llama import repeat_qkv, unrepeat_qkv
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


def test_dummy_weights_equal_on_every_mesh():
    """stories260K has 4 KV heads: on tensor=8 each is stored twice (kv_repeat 2), in the pool and in
    the merged qkv weight. The dummy draw is canonical and repeated, so the copies are equal and the
    model is the one-device model, sharded."""
    one = load_model("dummy:stories260k", dtype="float32")
    eight = load_model("dummy:stories260k", mesh=MeshConfig(tensor=8).make_mesh(), dtype="float32")
    assert eight.kv_repeat == 2 and one.kv_repeat == 1
    w1 = np.asarray(one.params["layers"][0]["attn"]["qkv_proj"][...])
    w8 = np.asarray(eight.params["layers"][0]["attn"]["qkv_proj"][...])
    K, R = w1.shape[1], w1.shape[2] - 2
    assert w8.shape == (w1.shape[0], 2 * K, R // 2 + 2, w1.shape[3])
    np.testing.assert_array_equal(w8[:, 0::2, R // 2:], w8[:, 1::2, R // 2:])  # the two copies of k and v
    np.testing.assert_array_equal(unrepeat_qkv(w8, 2), w1)
    np.testing.assert_array_equal(repeat_qkv(w1, 2), w8)
    np.testing.assert_array_equal(np.asarray(repeat_qkv(jax.numpy.asarray(w1), 2)), w8)  # jnp as numpy
    prompt = [1, 5, 9, 200, 17]
    atol, rtol = MESH_LOGITS_F32
    np.testing.assert_allclose(greedy_generate(eight, prompt, 1).prompt_logits,
                               greedy_generate(one, prompt, 1).prompt_logits, atol=atol, rtol=rtol)


def test_meshes_the_models_cannot_use_are_refused_before_loading():
    """A hand-built mesh with other axis names failed deep in JAX; one with Explicit axes loaded
    and failed at the first forward. MeshConfig refuses booleans as its other fields do."""
    devices = np.asarray(jax.devices()[:2])
    with pytest.raises(ValueError, match=r"\['data'\] are not among \('replica', 'context', 'tensor'\)"):
        load_model("dummy:stories260k", mesh=jax.sharding.Mesh(devices, ("data",)), dtype="float32")
    for axes in (("replica",), ("context",)):  # (failed deep in JAX: P('tensor', None) had no axis)
        with pytest.raises(ValueError, match=r"lack 'tensor', the axis the sharding rules place weights on"):
            load_model("dummy:stories260k", mesh=jax.sharding.Mesh(devices, axes), dtype="float32")
    explicit = jax.sharding.Mesh(devices.reshape(1, 1, 2), ("replica", "context", "tensor"),
                                 axis_types=(jax.sharding.AxisType.Explicit,) * 3)
    with pytest.raises(ValueError, match=r"mesh axes \['replica', 'context', 'tensor'\] are not of Auto type"):
        load_model("dummy:stories260k", mesh=explicit, dtype="float32")
    with pytest.raises(ValueError, match="MeshConfig.tensor must be a positive int, got True"):
        MeshConfig(tensor=True)


def test_the_engine_config_mesh_is_the_models():
    """A loaded model's mesh is the engine's: an unset EngineConfig.mesh takes it (it said one device
    while the engine ran on the model's); one that differs is refused."""
    from runtime.config import EngineConfig
    from runtime.replicas import make_engine

    model = load_model("dummy:stories260k", mesh=MeshConfig(replica=2, tensor=2).make_mesh(), dtype="float32")
    settings = dict(max_num_seqs=2, max_num_batched_tokens=16, token_buckets=(16,), seq_buckets=(2,),
                    max_model_len=64, progress=False, warmup=False)
    engine = make_engine(model, EngineConfig(**settings))
    assert engine.config.mesh == MeshConfig(replica=2, tensor=2) and engine.num_replicas == 2
    engine.close()
    with pytest.raises(ValueError, match=r"EngineConfig.mesh is MeshConfig\(replica=1, tensor=4, context=1\), but "
                                         r"the model was loaded on a mesh of MeshConfig\(replica=2, tensor=2"):
        make_engine(model, EngineConfig(mesh=MeshConfig(tensor=4), **settings))
