"""config.json read as transformers reads it: the class from model_type where architectures is absent,
RoPE's defaults and priorities, and the bias options the model lacks refused up front."""

import json
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from models.config import ModelConfig, rope_inv_freq  # noqa: E402
from runtime.checkpoint import load_model  # noqa: E402
from runtime.formats.base import CheckpointError  # noqa: E402
from tests.testing.greedy import greedy_generate  # noqa: E402
from tests.testing.hf_models import random_hf_model  # noqa: E402
from tests.tolerances import MODEL_LOGITS_F32  # noqa: E402

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
             initializer_range=0.25)


def save_random_model(path, cfg_cls: str, model_cls: str, **extra):
    random_hf_model(cfg_cls, model_cls, **SMALL, **extra).save_pretrained(path)


def edit_config(path, fn) -> dict:
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))
    return cfg


def assert_logits_match_hf(path, prompt_len: int = 40):
    """Our logits for a random prompt vs those of transformers' model loaded from the same folder."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    ours = load_model(path, dtype="float32", progress=False)
    prompt = np.random.default_rng().integers(0, SMALL["vocab_size"], prompt_len).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].numpy()
    atol, rtol = MODEL_LOGITS_F32
    np.testing.assert_allclose(greedy_generate(ours, prompt, 1).prompt_logits, ref, atol=atol, rtol=rtol)
    return hf, ours


# ------------------------------------------------------------------ the class, from model_type


@pytest.mark.parametrize("cfg_cls, model_cls, extra", [
    # a window of 8 under a 40-token prompt: read as Llama, the window was dropped
    ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    ("Qwen2Config", "Qwen2ForCausalLM", {}),  # q/k/v biases
    ("Qwen3Config", "Qwen3ForCausalLM", {}),  # q/k norms
], ids=["mistral", "qwen2", "qwen3"])
def test_config_without_architectures_takes_the_class_from_model_type(tmp_path, cfg_cls, model_cls, extra):
    save_random_model(tmp_path, cfg_cls, model_cls, **extra)
    edit_config(tmp_path, lambda c: c.pop("architectures"))
    hf, ours = assert_logits_match_hf(tmp_path)
    assert type(hf).__name__ == model_cls == ours.config.architecture


def test_unknown_model_type_without_architectures_is_refused():
    base = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_hidden_layers=2, vocab_size=128)
    with pytest.raises(ValueError, match="config has no 'architectures' and its model_type 'gpt2' is not "
                                         "supported; supported model types: llama, mistral, qwen2, qwen3"):
        ModelConfig.from_hf_config(dict(base, model_type="gpt2"))
    with pytest.raises(ValueError, match=r"its model_type \['llama'\] is not supported"):
        ModelConfig.from_hf_config(dict(base, model_type=["llama"]))
    assert ModelConfig.from_hf_config(dict(base, model_type="qwen3", architectures=[])).qk_norm


# ------------------------------------------------------------------------------------- RoPE

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
ROPE_CASES = {
    # no original_max_position_embeddings: transformers 5 takes max_position_embeddings (not 8192)
    "llama3_without_original": dict(rope_parameters=dict(LLAMA3, rope_theta=10000.0)),
    "legacy_rope_scaling_without_original": dict(rope_theta=10000.0, rope_scaling=dict(LLAMA3)),
    # a top-level original_max_position_embeddings wins over the dict's
    "top_level_original": dict(original_max_position_embeddings=64,
                               rope_parameters=dict(LLAMA3, rope_theta=10000.0, original_max_position_embeddings=32)),
    # rope_parameters' rope_theta wins over a top-level one
    "two_thetas": dict(rope_theta=100.0, rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    # a legacy rope_scaling replaces rope_parameters, rope_theta included
    "rope_scaling_beside_rope_parameters": dict(rope_scaling={"rope_type": "linear", "factor": 2.0},
                                                rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_frequencies_match_transformers(tmp_path, case):
    d = dict(SMALL, architectures=["LlamaForCausalLM"], model_type="llama", **ROPE_CASES[case])
    (tmp_path / "config.json").write_text(json.dumps(d))
    # built through from_pretrained's config path: the model's init standardizes the RoPE dict again
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    assert hf.model.rotary_emb.attention_scaling == 1.0
    np.testing.assert_allclose(rope_inv_freq(ModelConfig.from_hf_config(d)), hf.model.rotary_emb.inv_freq.numpy(),
                               rtol=1e-6)


def test_llama3_rope_without_original_matches_hf_logits(tmp_path):
    save_random_model(tmp_path, "LlamaConfig", "LlamaForCausalLM",
                      rope_parameters=dict(LLAMA3, rope_theta=10000.0, original_max_position_embeddings=32))
    edit_config(tmp_path, lambda c: c["rope_parameters"].pop("original_max_position_embeddings"))
    _, ours = assert_logits_match_hf(tmp_path)
    assert ours.config.rope_scaling.original_max_position_embeddings == SMALL["max_position_embeddings"]


# ----------------------------------------------------------------------------------- biases


@pytest.mark.parametrize("cfg_cls, extra, message", [
    ("LlamaConfig", dict(attention_bias=True), "config key 'attention_bias' is true: LlamaForCausalLM then has an "
                                               "o_proj bias, which is not supported"),
    ("Qwen3Config", dict(attention_bias=True), "config key 'attention_bias' is true: Qwen3ForCausalLM then has an "
                                               "o_proj bias, which is not supported"),
    ("LlamaConfig", dict(mlp_bias=True), "config key 'mlp_bias' is true: MLP biases (gate_proj, up_proj, down_proj) "
                                         "are not supported"),
], ids=["llama_attention_bias", "qwen3_attention_bias", "llama_mlp_bias"])
def test_bias_options_the_model_lacks_are_refused_by_name(tmp_path, cfg_cls, extra, message):
    save_random_model(tmp_path, cfg_cls, cfg_cls.replace("Config", "ForCausalLM"), **extra)
    with pytest.raises(CheckpointError, match=re.escape(f"{tmp_path / 'config.json'}: {message}")):
        load_model(tmp_path, progress=False)


@pytest.mark.parametrize("cfg_cls, attention_bias", [("MistralConfig", True), ("Qwen2Config", False)])
def test_attention_bias_where_transformers_ignores_it(cfg_cls, attention_bias):
    """Mistral's modeling code has no biases and Qwen2's always has q/k/v biases, whatever
    attention_bias says: the model has them exactly where transformers' does."""
    cfg = getattr(transformers, cfg_cls)(**SMALL, attention_bias=attention_bias)
    model_cls = cfg_cls.replace("Config", "ForCausalLM")
    hf = getattr(transformers, model_cls)(cfg)
    hf_biases = sorted(n.split(".", 3)[-1] for n in hf.state_dict() if n.endswith(".bias") and ".layers.0." in n)
    ours = ModelConfig.from_hf_config(cfg.to_dict() | {"architectures": [model_cls]})
    assert hf_biases == (["self_attn.k_proj.bias", "self_attn.q_proj.bias", "self_attn.v_proj.bias"]
                         if ours.attention_bias else [])
    assert ours.attention_bias == (cfg_cls == "Qwen2Config")
