"""Checkpoint loading: dummy weights, Orbax round trip, convert, and clear errors for bad input."""

import json
import re
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
from tests.tolerances import MODEL_LOGITS_F32


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


@pytest.mark.parametrize("template_file", ["chat_template.jinja", "chat_template.json"])
def test_convert_keeps_the_chat_template(hf_dir, tmp_path, template_file):
    """Tokenizer.from_pretrained_dir reads the chat template from these files (and the named ones in
    additional_chat_templates/): convert copies them."""
    from tokenizers import Tokenizer as HFTokenizer, models

    from runtime.tokenizer import load_tokenizer

    src = _copy(hf_dir, tmp_path / "src")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hi": 3}  # (generation_config.json names ids 1 and 2)
    HFTokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(src / "tokenizer.json"))
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    (src / template_file).write_text(template if template_file.endswith(".jinja")
                                     else json.dumps({"chat_template": template}))
    assert load_tokenizer(src).chat_template == template
    if template_file.endswith(".jinja"):  # with transformers 5's named templates beside it
        (src / "additional_chat_templates").mkdir()
        (src / "additional_chat_templates" / "tool_use.jinja").write_text("TOOLS{{ messages[0]['content'] }}")
    loaded = load_model(convert(src, tmp_path / "orbax", progress=False))
    assert (loaded.tokenizer_path / template_file).is_file()
    tok = load_tokenizer(loaded.tokenizer_path)
    assert tok.chat_template == template
    if template_file.endswith(".jinja"):
        assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=[]) == "TOOLShi"


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


def test_weights_for_more_layers_than_the_config_are_an_error(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path / "fewer")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = BASE["num_hidden_layers"] - 1  # the weights have one layer more
    (d / "config.json").write_text(json.dumps(cfg))
    last = BASE["num_hidden_layers"] - 1
    with pytest.raises(CheckpointError, match=rf"fewer: 9 checkpoint tensors would be left unused \('model\.layers\.{last}"
                                              rf"\.input_layernorm\.weight', .*up to layer {last} but the config has "
                                              rf"{last} layers"):
        load_model(d, progress=False)


def test_tensor_the_model_has_no_parameter_for_is_an_error(hf_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    d = _copy(hf_dir, tmp_path / "bias")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.ones(BASE["hidden_size"], np.float32)  # attention_bias is off
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"bias: 1 checkpoint tensors would be left unused "
                                              r"\('model\.layers\.0\.self_attn\.o_proj\.bias'\); the model config has no"):
        load_model(d, progress=False)


def test_extra_tensors_real_checkpoints_carry_still_load(hf_dir, tmp_path):
    """transformers < 4.31 saved RoPE inv_freq buffers in Llama checkpoints, and tied models may store
    a copy of the embedding as lm_head.weight: both load as if absent."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(hf_dir / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    cfg = json.loads((hf_dir / "config.json").read_text()) | {"tie_word_embeddings": True}

    def write(name, tensors):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        save_file(tensors, str(d / "model.safetensors"))
        return d

    inv_freq = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": np.ones(16, np.float32)
                for i in range(BASE["num_hidden_layers"])}
    extras = write("extras", tensors | inv_freq)
    plain = write("plain", {k: v for k, v in tensors.items() if k != "lm_head.weight"})
    prompt = np.random.default_rng().integers(0, BASE["vocab_size"], 12).tolist()
    loaded = load_model(extras, dtype="float32", progress=False)
    assert loaded.config.tie_word_embeddings
    got = greedy_generate(loaded, prompt, 1).prompt_logits
    want = greedy_generate(load_model(plain, dtype="float32", progress=False), prompt, 1).prompt_logits
    np.testing.assert_array_equal(got, want)


def test_tied_checkpoint_storing_only_the_head_reads_it_as_the_embedding(hf_dir, tmp_path):
    """A tied checkpoint may hold the shared matrix as lm_head.weight alone; transformers 5 ties the
    embedding to it (this failed as a missing model.embed_tokens.weight)."""
    import torch
    import transformers
    from safetensors.numpy import load_file, save_file

    d = _copy(hf_dir, tmp_path / "head_only")
    cfg = json.loads((d / "config.json").read_text()) | {"tie_word_embeddings": True}
    (d / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(d / "model.safetensors")
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, str(d / "model.safetensors"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    assert np.array_equal(hf.model.embed_tokens.weight.detach().numpy(), tensors["lm_head.weight"])
    loaded = load_model(d, dtype="float32", progress=False)
    assert loaded.config.tie_word_embeddings
    prompt = np.random.default_rng().integers(0, BASE["vocab_size"], 20).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].numpy()
    atol, rtol = MODEL_LOGITS_F32
    np.testing.assert_allclose(greedy_generate(loaded, prompt, 1).prompt_logits, ref, atol=atol, rtol=rtol)


def test_tied_config_with_a_different_stored_head_loads_it_untied_as_transformers_does(hf_dir, tmp_path, caplog):
    """transformers 5 (PreTrainedModel.tie_weights) warns and does not tie when the checkpoint stores
    an lm_head.weight that differs from the embedding; dropping it gave other logits."""
    import torch
    import transformers
    from safetensors.numpy import load_file, save_file

    d = _copy(hf_dir, tmp_path / "tied")
    cfg = json.loads((d / "config.json").read_text()) | {"tie_word_embeddings": True}
    (d / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(d / "model.safetensors")  # (hf_dir's model is untied: its lm_head differs)
    assert not np.array_equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    save_file(tensors, str(d / "model.safetensors"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    assert not torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)
    with caplog.at_level("WARNING", logger="runtime.formats.safetensors"):
        loaded = load_model(d, dtype="float32", progress=False)
    assert not loaded.config.tie_word_embeddings
    assert "lm_head.weight differs from model.embed_tokens.weight" in caplog.text
    prompt = np.random.default_rng().integers(0, BASE["vocab_size"], 20).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].numpy()
    atol, rtol = MODEL_LOGITS_F32
    np.testing.assert_allclose(greedy_generate(loaded, prompt, 1).prompt_logits, ref, atol=atol, rtol=rtol)


def test_a_tensor_in_two_unindexed_files_is_an_error(hf_dir, tmp_path):
    """Without an index every *.safetensors file is read: a tensor in two of them was taken from the
    later file (here a stale one), silently."""
    from safetensors.numpy import load_file, save_file

    d = tmp_path / "dupe"
    d.mkdir()
    (d / "config.json").write_bytes((hf_dir / "config.json").read_bytes())
    tensors = load_file(hf_dir / "model.safetensors")
    save_file(tensors, str(d / "a.safetensors"))
    save_file({"model.norm.weight": np.full_like(tensors["model.norm.weight"], 7.0)}, str(d / "b-stale.safetensors"))
    with pytest.raises(CheckpointError, match=r"dupe: tensor 'model\.norm\.weight' is in both a\.safetensors and "
                                              r"b-stale\.safetensors"):
        load_model(d, progress=False)
    (d / "b-stale.safetensors").unlink()
    save_file({"lm_head.weight": tensors.pop("lm_head.weight")}, str(d / "b.safetensors"))
    save_file(tensors, str(d / "a.safetensors"))
    load_model(d, progress=False)  # split over two files without an index, each tensor once


@pytest.mark.parametrize("key, value, message", [
    ("num_attention_heads", 0, "config key 'num_attention_heads' is 0; it must be a positive integer"),
    ("hidden_size", None, "config key 'hidden_size' is null; it is required"),
    ("hidden_size", "sixtyfour", "config key 'hidden_size' is 'sixtyfour'; it must be a positive integer"),
    ("max_position_embeddings", -5, "config key 'max_position_embeddings' is -5; it must be a positive integer"),
    ("rope_theta", 10**400, f"config key 'rope_theta' is {10**400}; it must be a positive finite number"),
    ("hidden_act", "gelu", "config key 'hidden_act' is 'gelu'; only 'silu' (SwiGLU) is supported"),
    ("rope_scaling", "linear", "config key 'rope_scaling' is 'linear'; it must be an object (or null)"),
    ("rope_scaling", {"rope_type": "linear"}, "config key 'rope_scaling.factor' is missing; it is required"),
    ("tie_word_embeddings", "false", "config key 'tie_word_embeddings' is 'false'; it must be true or false"),
    (None, [1, 2], "the config is a JSON list; it must be an object of config keys"),
])
def test_bad_config_value_names_file_and_key(hf_dir, tmp_path, key, value, message):
    d = tmp_path / "cfg"
    d.mkdir()
    cfg = json.loads((hf_dir / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(value if key is None else cfg | {key: value}))
    with pytest.raises(CheckpointError, match=re.escape(f"{d / 'config.json'}: {message}")):
        load_model(d, progress=False)


def test_sliding_windows_and_defaults_read_as_transformers_reads_them():
    """Qwen's window is on only with use_sliding_window, and then on the layers from
    max_window_layers (default 28) on; layer_types, where listed, decide (it ran the window on every
    layer). Missing keys take transformers' defaults."""
    from models.config import ModelConfig

    base = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_hidden_layers=3, vocab_size=256)
    qwen, mistral = dict(base, architectures=["Qwen2ForCausalLM"]), dict(base, architectures=["MistralForCausalLM"])
    on = dict(use_sliding_window=True, sliding_window=8)
    for cfg, window, layers in (
            (qwen, None, None), (dict(qwen, sliding_window=8), None, None), (dict(qwen, **on), None, None),
            (dict(qwen, **on, max_window_layers=0), 8, None), (dict(qwen, **on, max_window_layers=3), None, None),
            (dict(qwen, **on, max_window_layers=1), 8, (1, 2)),
            (dict(qwen, **on, layer_types=["sliding_attention"] * 3), 8, None),
            (mistral, 4096, None), (dict(mistral, sliding_window=None), None, None), (dict(mistral, sliding_window=8), 8, None),
            (dict(mistral, sliding_window=8, layer_types=["full_attention"] * 3), None, None),
            (dict(mistral, sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
             8, (0, 2)),
            (dict(base, sliding_window=8), None, None)):
        c = ModelConfig.from_hf_config(cfg)
        assert (c.sliding_window, c.sliding_window_layers) == (window, layers), cfg
        assert [c.window_of(i) for i in range(3)] == [window if layers is None or i in layers else None for i in range(3)]
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf_config(dict(mistral, layer_types=["sliding_attention"]))
    with pytest.raises(ValueError, match="sliding_window_layers must be increasing layer indices"):
        ModelConfig.from_hf_config(base).replace(sliding_window=8, sliding_window_layers=(2, 1))
    c = ModelConfig.from_hf_config(base)
    assert (c.rms_norm_eps, c.max_position_embeddings) == (1e-6, 2048)
    assert ModelConfig.from_hf_config(qwen).max_position_embeddings == 32768


@pytest.mark.parametrize("entry, message", [
    (5, "header entry for tensor 'model.embed_tokens.weight' is 5; it must be an object"),
    ({"dtype": "F32", "shape": [2]}, "header entry for tensor 'model.embed_tokens.weight' has no data_offsets"),
    ({"shape": [2], "data_offsets": [0, 8]}, "header entry for tensor 'model.embed_tokens.weight' has no dtype"),
    ({"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}, "tensor 'model.embed_tokens.weight' has shape ['2']"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}, "tensor 'model.embed_tokens.weight' has data_offsets [8, 0]"),
])
def test_corrupt_safetensors_header_entry_names_file_and_tensor(hf_dir, tmp_path, entry, message):
    d = tmp_path / "entry"
    d.mkdir()
    (d / "config.json").write_bytes((hf_dir / "config.json").read_bytes())
    header = json.dumps({"model.embed_tokens.weight": entry}).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(CheckpointError, match=re.escape(f"{d / 'model.safetensors'}: ") + ".*" + re.escape(message)):
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


def test_sharded_index_with_a_bad_weight_map(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path / "index")
    for weight_map, needle in ((["model.safetensors"], "weight_map must map tensor names to shard file names"),
                               ({"model.norm.weight": 3}, "weight_map must map tensor names to shard file names"),
                               ({"model.nope.weight": "model.safetensors"}, "maps tensor 'model.nope.weight' to "
                                                                            "model.safetensors, which does not hold it")):
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(CheckpointError, match=needle):
            load_model(d, progress=False)
    (d / "model.safetensors.index.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="not a safetensors index"):
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


def test_float16_checkpoints_load_as_bfloat16_and_the_engine_refuses_float16(tmp_path):
    """The engine's paged attention takes float32 and bfloat16: auto loads a float16 checkpoint as
    bfloat16 (it failed to compile before); float16 by name is the model's alone."""
    from runtime.config import EngineConfig
    from runtime.engine import Engine

    make_hf_checkpoint("llama3_rope_scaling", tmp_path / "f32").half().save_pretrained(tmp_path / "f16")
    auto = load_model(tmp_path / "f16", progress=False)
    exact = load_model(tmp_path / "f16", dtype="float32", progress=False)  # the float16 values, widened
    assert auto.dtype == jnp.bfloat16
    w, ref = auto.params["layers"][0]["mlp"]["down_proj"][...], exact.params["layers"][0]["mlp"]["down_proj"][...]
    np.testing.assert_array_equal(np.asarray(w), np.asarray(ref.astype(jnp.bfloat16)))
    small = EngineConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, progress=False, warmup=False)
    Engine(auto, small).close()
    with pytest.raises(ValueError, match="the engine runs float32 and bfloat16 models; this one is float16"):
        Engine(load_model(tmp_path / "f16", dtype="float16", progress=False), small)
    with pytest.raises(ValueError, match="dtype 'float16' is not supported"):
        EngineConfig(dtype="float16")


def test_convert_checks_the_destination_before_loading(tmp_path):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep").write_text("data")
    # the source does not exist either: the destination's error comes first, before any load
    for dst, err, needle in ((tmp_path / "afile", FileExistsError, "is not a directory"),
                             (tmp_path / "afile" / "sub", NotADirectoryError, "is a file"),
                             (tmp_path / "full", FileExistsError, "not empty")):
        with pytest.raises(err, match=needle):
            convert(tmp_path / "no-such-source", dst, progress=False)
    assert (tmp_path / "full" / "keep").read_text() == "data" and (tmp_path / "afile").read_text() == "x"


def test_a_failed_save_leaves_no_partial_checkpoint(hf_dir, tmp_path, monkeypatch):
    import runtime.checkpoint as ckpt

    write = ckpt._write_orbax

    def fail_midway(loaded, dst):
        write(loaded, dst)
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "_write_orbax", fail_midway)
    (tmp_path / "empty").mkdir()
    for dst in (tmp_path / "new", tmp_path / "empty"):
        with pytest.raises(OSError, match="disk full"):
            convert(hf_dir, dst, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"] and not any((tmp_path / "empty").iterdir())
    monkeypatch.setattr(ckpt, "_write_orbax", write)
    assert convert(hf_dir, tmp_path / "empty", progress=False) == tmp_path / "empty"  # an empty directory is used
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]
    load_model(tmp_path / "empty")


def test_convert_destination_modes_and_symlinks(hf_dir, tmp_path):
    """The checkpoint folder gets the umask's mode (it kept tempfile.mkdtemp's 0700, unreadable to a
    serving account), an existing empty DST keeps its own; a link to an empty folder is written
    through, and a dangling one is refused before SRC loads (it failed after)."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        new = convert(hf_dir, tmp_path / "new", progress=False)
        assert stat.S_IMODE(new.stat().st_mode) == 0o755
        (tmp_path / "shared").mkdir(mode=0o775)
        os.chmod(tmp_path / "shared", 0o775)
        assert stat.S_IMODE(convert(hf_dir, tmp_path / "shared", progress=False).stat().st_mode) == 0o775
    finally:
        os.umask(old)
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    assert convert(hf_dir, tmp_path / "link", progress=False) == tmp_path / "target"
    assert (tmp_path / "link").is_symlink() and (tmp_path / "link" / "xlaserve_config.json").is_file()
    load_model(tmp_path / "link")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="is a symbolic link to .*nowhere, which does not exist"):
        convert(tmp_path / "no-such-source", tmp_path / "dangling", progress=False)


def test_an_interrupted_save_waits_for_its_writes_before_removing_them(hf_dir, tmp_path, monkeypatch):
    """Ctrl-C while Orbax's threads write: the save waits for them (through a second Ctrl-C) and
    then removes the partial folder, which the threads recreated after an immediate removal."""
    import orbax.checkpoint as ocp

    wait = ocp.StandardCheckpointer.wait_until_finished
    interrupts = []

    def interrupted(self):
        if len(interrupts) < 2:  # the save's wait, then the first wait of the cleanup
            interrupts.append(1)
            raise KeyboardInterrupt
        return wait(self)

    monkeypatch.setattr(ocp.StandardCheckpointer, "wait_until_finished", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(hf_dir, tmp_path / "dst", progress=False)
    monkeypatch.setattr(ocp.StandardCheckpointer, "wait_until_finished", wait)
    import time

    time.sleep(0.5)  # (long enough for a write still running to show itself)
    assert len(interrupts) == 2 and list(tmp_path.iterdir()) == []


def test_restore_names_a_damaged_checkpoint(hf_dir, tmp_path):
    import shutil

    dst = convert(hf_dir, tmp_path / "orbax", progress=False)
    meta = json.loads((dst / "xlaserve_config.json").read_text())
    mesh = MeshConfig().make_mesh()
    (dst / "xlaserve_config.json").write_text(json.dumps({**meta, "dtype": "float99"}))
    with pytest.raises(CheckpointError, match="not an xlaserve checkpoint config"):
        restore_orbax(dst, mesh=mesh)
    (dst / "xlaserve_config.json").write_text(json.dumps(meta))
    data = [p for p in (dst / "state").rglob("*") if p.is_file() and p.stat().st_size > 1000]
    for p in data:
        p.write_bytes(p.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="could not restore the parameters"):
        restore_orbax(dst, mesh=mesh)
    shutil.rmtree(dst / "state")
    with pytest.raises(CheckpointError, match="no state/ directory"):
        restore_orbax(dst, mesh=mesh)
