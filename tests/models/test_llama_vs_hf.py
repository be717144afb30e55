"""Our decoder vs HF transformers (PyTorch CPU) on random-weight tiny configs of every family."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from runtime.checkpoint import load_model  # noqa: E402
from tests.testing.greedy import greedy_generate  # noqa: E402
from tests.testing.hf_models import random_hf_model  # noqa: E402
from tests.tolerances import MODEL_LOGITS_F32  # noqa: E402

PROMPT_LEN = 64
NEW_TOKENS = 32

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, initializer_range=0.25)

CASES = {
    # head_dim 32 with D/N = 16: head_dim independent of the model dim
    "llama3_rope_scaling": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32}, tie_word_embeddings=False)),
    "llama_linear_rope_tied": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=4, rope_scaling={"rope_type": "linear", "factor": 2.0},
        tie_word_embeddings=True)),
    "mistral_sliding_window": ("MistralConfig", "MistralForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16, tie_word_embeddings=False)),
    "qwen2_qkv_bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6, tie_word_embeddings=True)),
    # every layer from max_window_layers (0) on has the window: transformers' rule for Qwen
    "qwen2_sliding_window": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=16, max_window_layers=0)),
    # the window on the second layer only (layers from max_window_layers on)
    "qwen3_window_on_layer_1": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=16, max_window_layers=1)),
    "qwen3_qk_norm": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1e6, tie_word_embeddings=False)),
    "mqa": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=8, num_key_value_heads=1)),
    "mha": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16)),
}


def make_hf_checkpoint(case: str, path, seed: int = 0):
    """Save a random-weight tiny HF model of `case` with save_pretrained; returns the torch model."""
    cfg_cls, model_cls, extra = CASES[case]
    model = random_hf_model(cfg_cls, model_cls, seed, **BASE, **extra)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_hf_checkpoint(request.param, path)
    ours = load_model(path, dtype="float32", progress=False)
    return request.param, hf, ours


def test_config_read_from_hf(pair):
    case, hf, ours = pair
    c = ours.config
    assert c.num_kv_heads == hf.config.num_key_value_heads
    assert c.attention_bias == case.startswith("qwen2")
    assert c.qk_norm == case.startswith("qwen3")
    windowed = ("mistral_sliding_window", "qwen2_sliding_window", "qwen3_window_on_layer_1")
    assert c.sliding_window == (16 if case in windowed else None)
    assert c.sliding_window_layers == ((1,) if case == "qwen3_window_on_layer_1" else None)


def test_logits_match_hf(pair):
    _, hf, ours = pair
    rng = np.random.default_rng()
    prompt = rng.integers(0, BASE["vocab_size"], PROMPT_LEN).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float().numpy()
    got = greedy_generate(ours, prompt, 1).prompt_logits
    atol, rtol = MODEL_LOGITS_F32
    np.testing.assert_allclose(got, ref, atol=atol, rtol=rtol)


def test_greedy_tokens_match_hf(pair):
    # A fixed prompt: greedy identity is only meaningful where the reference has no near-ties. With
    # logits within atol of HF (test above), a top-2 gap over 2 * atol forces the same argmax.
    _, hf, ours = pair
    prompt = np.random.default_rng(1).integers(0, BASE["vocab_size"], PROMPT_LEN).tolist()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False, pad_token_id=0)[0].tolist()
        top2 = torch.topk(hf(torch.tensor([ref])).logits[0, PROMPT_LEN - 1 : -1], 2).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 2 * MODEL_LOGITS_F32[0], "reference has a near-tie"
    got = greedy_generate(ours, prompt, NEW_TOKENS).tokens
    assert got == ref[PROMPT_LEN:]
