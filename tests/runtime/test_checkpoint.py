"""Checkpoint loading: dummy weights, Orbax round trip, convert, and clear errors for bad input."""

import json
import struct

import jax.numpy as jnp
import numpy as np
import pytest

from models.config import PRESETS
from runtime.checkpoint import convert, load_model, restore_orbax
from runtime.formats.base import CheckpointError
from tests.testing.greedy import greedy_generate
from sharding.mesh import MeshConfig
from tests.models.test_llama_vs_hf import BASE, make_hf_checkpoint


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_hf_checkpoint("llama3_rope_scaling", path)
    return path


def test_dummy_weights_for_a_preset_are_sharded_and_run():
    model = load_model("dummy:stories260k", mesh=MeshConfig(tensor=2).make_mesh(), dtype="float32")
    assert model.config == PRESETS["stories260k"]
    assert model.params["layers"][0]["mlp"]["gate_up_proj"][...].sharding.spec[2] == "tensor"
    out = greedy_generate(model, [1, 5, 9], 4)
    assert len(out.tokens) == 4 and np.isfinite(out.prompt_logits).all()


def test_preset_name_alone_loads_dummy_bf16_by_default():
    model = load_model("stories260k")
    assert model.dtype == jnp.bfloat16 and model.source == "dummy:stories260k"


def test_convert_then_load_gives_same_logits(hf_dir, tmp_path):
    prompt = np.random.default_rng().integers(0, BASE["vocab_size"], 20).tolist()
    ref = greedy_generate(load_model(hf_dir, dtype="float32", progress=False), prompt, 1).prompt_logits
    dst = convert(hf_dir, tmp_path / "orbax", progress=False)
    got = greedy_generate(load_model(dst), prompt, 1).prompt_logits
    np.testing.assert_array_equal(got, ref)
    with pytest.raises(FileExistsError, match="not empty"):
        convert(hf_dir, dst, progress=False)


def test_auto_dtype_is_the_checkpoints_own(hf_dir, tmp_path):
    assert load_model(hf_dir, progress=False).dtype == jnp.float32  # save_pretrained wrote f32


def test_missing_path_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        load_model(tmp_path / "nope")


def test_directory_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(tmp_path)


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_truncated_safetensors_names_file_and_tensor(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path / "trunc")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated: tensor '.+' ends at byte \d+ but the file has \d+ bytes"):
        load_model(d, progress=False)


def test_garbage_safetensors_header(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path / "garbage")
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 12) + b"not json!!!!")
    with pytest.raises(CheckpointError, match="header is not valid JSON"):
        load_model(d, progress=False)


def test_config_weight_shape_mismatch_names_tensor_and_shapes(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path / "mismatch")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 128  # the weights were written with 96
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' has shape \((96, 64|64, 96)\); model config .* expects \((128, 64|64, 128)\)"):
        load_model(d, progress=False)


def test_missing_tensor_names_it(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path / "missing")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.2\..*' is missing"):
        load_model(d, progress=False)


def test_unsupported_architecture(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path / "arch")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*not supported"):
        load_model(d, progress=False)


def test_sharded_index_with_missing_shard(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path / "index")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": "model-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="model-00002.safetensors, which is missing"):
        load_model(d, progress=False)


def test_sharded_index_loads(hf_dir, tmp_path):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0].numpy()
    got = greedy_generate(load_model(tmp_path / "sharded", progress=False), prompt, 1).prompt_logits
    np.testing.assert_allclose(got, ref, atol=2e-4, rtol=2e-4)


def test_restore_rejects_a_bad_config(tmp_path):
    (tmp_path / "xlaserve_config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="not an xlaserve checkpoint config"):
        restore_orbax(tmp_path, mesh=MeshConfig().make_mesh())
