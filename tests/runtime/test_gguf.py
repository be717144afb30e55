"""GGUF loading: every supported quant type dequantizes exactly, llama/qwen2 layouts match HF
transformers, SmolLM2-135M (a real Q4_1 GGUF) matches HF's GGUF loader, bad files fail clearly."""

from __future__ import annotations

import math
import re
import shutil
import struct

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from models.config import RopeScaling  # noqa: E402
from runtime.checkpoint import load_model  # noqa: E402
from runtime.formats.base import CheckpointError  # noqa: E402
from runtime.formats.gguf import GGUFSource  # noqa: E402
from tests.testing import hf_models  # noqa: E402
from tests.testing.data import smollm2_gguf_path  # noqa: E402
from tests.testing.greedy import greedy_generate, hf_greedy, steps_before_near_tie  # noqa: E402
from tests.tolerances import GGUF_LOGITS_F32, MODEL_LOGITS_F32  # noqa: E402

# HF name suffix -> GGUF name suffix, as llama.cpp's tensor map names them (written out here rather
# than taken from the code under test)
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}
TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf: str) -> str:
    base, kind = hf.rsplit(".", 1)
    if base in TOP_NAMES:
        return f"{TOP_NAMES[base]}.{kind}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[rest]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: HF half-split q/k rows -> interleaved RoPE pairs.
    Rows only, so it applies equally to float rows and to rows of quantized bytes."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, arch: str, hp: dict, tensors: dict, *, meta=None, **writer) -> None:
    """tensors: GGUF name -> (array, raw ggml type or None for plain float arrays); writer: GGUFWriter
    options (endianess, split_max_tensors)."""
    w = gguf.GGUFWriter(str(path), arch, **writer)
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_rope_freq_base(hp["rope_theta"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_rope_dimension_count(hp["head_dim"])
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
    w.add_vocab_size(hp["vocab_size"])
    for key, (fn, value) in (meta or {}).items():
        getattr(w, fn)(key, value)
    for name, (arr, raw) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def encode(w: np.ndarray, qtype: Q, rng) -> tuple[np.ndarray, Q | None]:
    """Store a float32 [out, in] matrix as `qtype`."""
    if qtype == Q.F32:
        return w.astype(np.float32), None
    if qtype == Q.F16:
        return w.astype(np.float16), None
    if qtype in (Q.Q4_K, Q.Q6_K):  # the gguf package has no quantizer for these: random valid blocks
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(w.shape[0], w.shape[1] // block, size), dtype=np.uint8)
        scale = lambda lo, hi: rng.uniform(lo, hi, raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)  # noqa: E731
        if qtype == Q.Q4_K:  # d, dmin (f16) lead the block; weights are d*sc*q - dmin*m
            raw[..., 0:2], raw[..., 2:4] = scale(1e-4, 4e-4), scale(1e-4, 4e-4)
        else:  # d (f16) ends the block; weights are d*sc*(q-32), sc an int8
            raw[..., size - 2 :] = scale(1e-5, 4e-5)
        return raw.reshape(w.shape[0], -1), qtype
    return quantize(w, qtype), qtype


def hp_dict(cfg) -> dict:
    d = cfg.to_dict()
    d["head_dim"] = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    d["rope_theta"] = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    return d


def hf_tensors_to_gguf(state: dict, arch: str, hp: dict, qtype: Q, rng) -> tuple[dict, dict]:
    """HF-named f32 tensors -> (GGUF tensors as llama.cpp would write them, the HF tensors they
    dequantize to). Norms and biases stay F32 as in llama.cpp; matrices are stored as `qtype`."""
    out, expect = {}, {}
    for name, w in state.items():
        raw, raw_type = (w.astype(np.float32), None) if w.ndim == 1 else encode(w, qtype, rng)
        expect[name] = np.asarray(dequantize(raw, raw_type or (Q.F16 if raw.dtype == np.float16 else Q.F32)), np.float32)
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = hp["num_attention_heads"] if ".q_proj." in name else hp["num_key_value_heads"]
            raw = llama_cpp_permute(raw, heads)
        out[gguf_name(name)] = (raw, raw_type)
    return out, expect


def prompt_logits(loaded, prompt) -> np.ndarray:
    return greedy_generate(loaded, prompt, 1).prompt_logits


# ------------------------------------------------------------------------- every quant type, exactly

QUANT_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K]
# K-quants need rows that are multiples of 256 elements: every matrix's input dim is 256 or 512
QUANT_HP = dict(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, rope_theta=10000.0, rms_norm_eps=1e-6,
                max_position_embeddings=128, tie_word_embeddings=False)


def random_llama_state(hp: dict, rng) -> dict:
    D, F, N, K, H, V = (hp[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                         "num_key_value_heads", "head_dim", "vocab_size"))
    mat = lambda *s: (rng.standard_normal(s) * 0.1).astype(np.float32)  # noqa: E731
    vec = lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    st = {"model.embed_tokens.weight": mat(V, D), "model.norm.weight": vec(D), "lm_head.weight": mat(V, D)}
    for i in range(hp["num_hidden_layers"]):
        p = f"model.layers.{i}."
        st |= {p + "self_attn.q_proj.weight": mat(N * H, D), p + "self_attn.k_proj.weight": mat(K * H, D),
               p + "self_attn.v_proj.weight": mat(K * H, D), p + "self_attn.o_proj.weight": mat(D, N * H),
               p + "mlp.gate_proj.weight": mat(F, D), p + "mlp.up_proj.weight": mat(F, D),
               p + "mlp.down_proj.weight": mat(D, F), p + "input_layernorm.weight": vec(D),
               p + "post_attention_layernorm.weight": vec(D)}
    return st


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_quant_type_matches_dequantize_and_safetensors(qtype, tmp_path):
    rng = np.random.default_rng()
    state = random_llama_state(QUANT_HP, rng)
    tensors, expect = hf_tensors_to_gguf(state, "llama", QUANT_HP, qtype, rng)
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_gguf(path, "llama", QUANT_HP, tensors)

    src = GGUFSource(path)
    assert set(src.keys()) == set(expect)
    for name, want in expect.items():
        got = src.get(name)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want, err_msg=f"{qtype.name} {name}")

    # the same dequantized weights saved as a HF safetensors checkpoint load to the same model
    st_dir = tmp_path / "st"
    transformers.LlamaConfig(**QUANT_HP).save_pretrained(st_dir)
    save_file(expect, str(st_dir / "model.safetensors"))
    ours, ref = load_model(path, progress=False), load_model(st_dir, progress=False)
    assert ours.dtype == np.float32
    assert ours.config.replace(name="x") == ref.config.replace(name="x")
    prompt = rng.integers(0, QUANT_HP["vocab_size"], 12).tolist()
    np.testing.assert_array_equal(prompt_logits(ours, prompt), prompt_logits(ref, prompt))


# ------------------------------------------------------------------- layouts vs HF transformers

HF_BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256,
               rms_norm_eps=1e-6, initializer_range=0.25)


def random_hf_model(cfg_cls: str, model_cls: str, **kw):
    return hf_models.random_hf_model(cfg_cls, model_cls, **HF_BASE, **kw)


def model_to_gguf(model, path, arch: str, *, meta=None, extra=None) -> None:
    hp = hp_dict(model.config)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tensors, _ = hf_tensors_to_gguf(state, arch, hp, Q.F32, None)
    write_gguf(path, arch, hp, tensors | (extra or {}), meta=meta)


def assert_matches_hf(model, loaded, *, new_tokens: int = 32):
    prompt = np.random.default_rng().integers(0, model.config.vocab_size, 48).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0].numpy()
    ours = greedy_generate(loaded, prompt, new_tokens)
    atol, rtol = MODEL_LOGITS_F32
    np.testing.assert_allclose(ours.prompt_logits, ref, atol=atol, rtol=rtol)
    # Greedy tokens must agree up to the reference's first near-tie (these random models put a top-2
    # gap under 3e-5, the size of the logit differences, in ~0.5% of runs)
    hf_tokens, hf_logits = hf_greedy(model, prompt, new_tokens)
    n = steps_before_near_tie(hf_logits, atol)
    assert ours.tokens[:n] == hf_tokens[:n]


def test_llama_gguf_vs_hf(tmp_path):
    """Untied head, GQA, head_dim 32 != D/N: the q/k un-permutation must be exactly llama.cpp's."""
    model = random_hf_model("LlamaConfig", "LlamaForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                            head_dim=32, rope_theta=10000.0, tie_word_embeddings=False)
    model_to_gguf(model, tmp_path / "llama.gguf", "llama")
    loaded = load_model(tmp_path / "llama.gguf", progress=False)
    assert loaded.config.architecture == "LlamaForCausalLM" and loaded.config.head_dim == 32
    assert not loaded.config.tie_word_embeddings and not loaded.config.attention_bias
    assert_matches_hf(model, loaded)


def test_llama_gguf_written_here_reads_back_in_hf(tmp_path):
    """HF's own GGUF reader gets the original model back from our test writer, so the writer follows
    llama.cpp's conventions independently of the loader under test."""
    model = random_hf_model("LlamaConfig", "LlamaForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                            rope_theta=10000.0, tie_word_embeddings=False)
    model_to_gguf(model, tmp_path / "llama.gguf", "llama")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="llama.gguf",
                                                             dtype=torch.float32).eval()
    for name, w in model.state_dict().items():
        np.testing.assert_array_equal(back.state_dict()[name].numpy(), w.numpy(), err_msg=name)


def test_qwen2_gguf_vs_hf(tmp_path):
    """qwen2: QKV bias, tied embeddings, and q/k NOT permuted (llama.cpp's Qwen2Model keeps HF order)."""
    model = random_hf_model("Qwen2Config", "Qwen2ForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                            rope_theta=1e6, tie_word_embeddings=True)
    model_to_gguf(model, tmp_path / "qwen2.gguf", "qwen2")
    loaded = load_model(tmp_path / "qwen2.gguf", progress=False)
    cfg = loaded.config
    assert cfg.architecture == "Qwen2ForCausalLM" and cfg.attention_bias and cfg.tie_word_embeddings
    assert_matches_hf(model, loaded)


def llama_cpp_rope_freqs(theta: float, dim: int, factor: float, low=1.0, high=4.0, old_ctx=8192) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.generate_extra_tensors for rope_type llama3."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def test_llama3_rope_freqs_vs_hf(tmp_path):
    # theta 1e6 at head_dim 32 puts pairs in all three bands of the llama3 rule: 0-6 unscaled,
    # 7-8 interpolated, 9-15 divided by the factor
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 1e6}
    model = random_hf_model("LlamaConfig", "LlamaForCausalLM", num_attention_heads=2, num_key_value_heads=1,
                            rope_parameters=scaling, tie_word_embeddings=True)
    freqs = llama_cpp_rope_freqs(1e6, 32, 8.0)
    assert freqs[6] == 1.0 and 1.0 < freqs[7] < freqs[8] < 8.0 and freqs[9] == 8.0
    model_to_gguf(model, tmp_path / "l3.gguf", "llama", extra={"rope_freqs.weight": (freqs, None)})
    loaded = load_model(tmp_path / "l3.gguf", progress=False)
    assert loaded.config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert_matches_hf(model, loaded, new_tokens=8)

    bad = freqs.copy()
    bad[8] *= 1.5
    model_to_gguf(model, tmp_path / "bad.gguf", "llama", extra={"rope_freqs.weight": (bad, None)})
    with pytest.raises(CheckpointError, match="rope_freqs"):
        GGUFSource(tmp_path / "bad.gguf")


LINEAR_ROPE_META = {
    "type_and_factor": {"llama.rope.scaling.type": ("add_string", "linear"),
                        "llama.rope.scaling.factor": ("add_float32", 4.0)},
    "factor_alone": {"llama.rope.scaling.factor": ("add_float32", 4.0)},  # llama.cpp's default type is linear
    "old_scale_linear_key": {"llama.rope.scale_linear": ("add_float32", 4.0)},
}


@pytest.mark.parametrize("case", sorted(LINEAR_ROPE_META))
def test_linear_rope_scaling_read_as_llama_cpp_reads_it(tmp_path, case):
    scaling = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    model = random_hf_model("LlamaConfig", "LlamaForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                            rope_parameters=scaling, tie_word_embeddings=False)
    model_to_gguf(model, tmp_path / "linear.gguf", "llama", meta=LINEAR_ROPE_META[case])
    loaded = load_model(tmp_path / "linear.gguf", progress=False)
    assert loaded.config.rope_scaling == RopeScaling("linear", 4.0)
    assert_matches_hf(model, loaded, new_tokens=8)


@pytest.mark.parametrize("meta", [
    {"llama.rope.scaling.type": ("add_string", "none"), "llama.rope.scaling.factor": ("add_float32", 4.0)},
    {"llama.rope.scaling.factor": ("add_float32", 0.0)},  # llama.cpp: 0 is no scaling
    {"llama.rope.scaling.factor": ("add_float32", 1.0), "llama.rope.scale_linear": ("add_float32", 4.0)},
], ids=["type_none", "factor_0", "new_key_first"])
def test_rope_metadata_that_means_no_scaling(tmp_path, meta):
    hp, tensors = tiny_tensors()
    write_gguf(tmp_path / "none.gguf", "llama", hp, tensors, meta=meta)
    assert GGUFSource(tmp_path / "none.gguf").config.rope_scaling is None


def test_rope_freqs_beside_a_linear_factor_is_refused(tmp_path):
    hp, tensors = tiny_tensors()
    freqs = llama_cpp_rope_freqs(hp["rope_theta"], hp["head_dim"], 8.0)
    write_gguf(tmp_path / "both.gguf", "llama", hp, tensors | {"rope_freqs.weight": (freqs, None)},
               meta={"llama.rope.scaling.factor": ("add_float32", 2.0)})
    with pytest.raises(CheckpointError, match=r"both.gguf: rope_freqs.weight together with rope scaling type "
                                              r"'linear' factor 2.0 \(llama.rope.scaling.factor\) is not supported"):
        GGUFSource(tmp_path / "both.gguf")


# ------------------------------------------------------------------------------------ bad input


def tiny_tensors(arch="llama", qtype=Q.F32):
    hp = dict(QUANT_HP)
    return hp, hf_tensors_to_gguf(random_llama_state(hp, np.random.default_rng()), arch, hp, qtype,
                                  np.random.default_rng())[0]


@pytest.mark.parametrize("arch", ["gpt2", "falcon"])
def test_unsupported_architecture(arch, tmp_path):
    hp, tensors = tiny_tensors()
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, arch, hp, tensors)
    with pytest.raises(CheckpointError, match=rf"{path.name}.*{arch!r} is not supported.*llama, qwen2"):
        load_model(path, progress=False)


def test_unsupported_quant_types_are_refused_on_opening_naming_each_tensor(tmp_path):
    """Refused before any tensor is read, not after loading dequantized all the tensors before them."""
    hp, tensors = tiny_tensors()
    rng = np.random.default_rng()
    w = rng.standard_normal((hp["vocab_size"], hp["hidden_size"])).astype(np.float32)
    tensors["output.weight"] = (quantize(w, Q.Q5_1), Q.Q5_1)
    block, size = gguf.GGML_QUANT_SIZES[Q.Q5_K]  # (no quantizer in the gguf package: never dequantized)
    rows = rng.integers(0, 256, (hp["hidden_size"], hp["intermediate_size"] // block * size), dtype=np.uint8)
    tensors["blk.1.ffn_down.weight"] = (rows, Q.Q5_K)
    freqs = llama_cpp_rope_freqs(hp["rope_theta"], hp["head_dim"], 8.0)  # 32 values: one Q5_1 block
    tensors["rope_freqs.weight"] = (quantize(freqs, Q.Q5_1), Q.Q5_1)
    write_gguf(tmp_path / "q5.gguf", "llama", hp, tensors)
    with pytest.raises(CheckpointError, match=re.escape(
            "q5.gguf: quantization types not supported: 'output.weight' (Q5_1), 'blk.1.ffn_down.weight' (Q5_K), "
            "'rope_freqs.weight' (Q5_1); supported: BF16, F16, F32, Q4_0, Q4_1, Q4_K, Q5_0, Q6_K, Q8_0")):
        GGUFSource(tmp_path / "q5.gguf")


def test_tensors_the_model_does_not_use_are_refused(tmp_path):
    """A tensor no model param is built from (here a q norm, which Llama has not) would be dropped and
    the model run without it; loading names it instead. rope_freqs is read (above)."""
    hp, tensors = tiny_tensors()
    tensors["blk.1.attn_q_norm.weight"] = (np.ones(hp["head_dim"], np.float32), None)
    write_gguf(tmp_path / "qnorm.gguf", "llama", hp, tensors)
    with pytest.raises(CheckpointError, match=r"qnorm.gguf: 1 checkpoint tensors would be left unused "
                                              r"\('blk.1.attn_q_norm.weight'\); the model config has no parameter"):
        load_model(tmp_path / "qnorm.gguf", progress=False)


def test_mixture_of_experts_gguf_is_refused_naming_its_expert_tensors(tmp_path):
    """As llama.cpp writes Mixtral (arch llama): each block's MLP is a router and stacked experts."""
    hp, tensors = tiny_tensors()
    rng = np.random.default_rng()
    E, D, F = 2, hp["hidden_size"], hp["intermediate_size"]
    for i in range(hp["num_hidden_layers"]):
        for part in ("gate", "up", "down"):
            del tensors[f"blk.{i}.ffn_{part}.weight"]
        tensors |= {f"blk.{i}.ffn_gate_inp.weight": (rng.standard_normal((E, D)).astype(np.float32), None),
                    f"blk.{i}.ffn_gate_exps.weight": (rng.standard_normal((E, F, D)).astype(np.float16), None),
                    f"blk.{i}.ffn_up_exps.weight": (rng.standard_normal((E, F, D)).astype(np.float16), None),
                    f"blk.{i}.ffn_down_exps.weight": (rng.standard_normal((E, D, F)).astype(np.float16), None)}
    write_gguf(tmp_path / "moe.gguf", "llama", hp, tensors, meta={"llama.expert_count": ("add_uint32", E)})
    with pytest.raises(CheckpointError, match=re.escape(
            "moe.gguf: mixture-of-experts models are not supported (llama.expert_count is 2; 8 expert tensors: "
            "'blk.0.ffn_gate_inp.weight', 'blk.0.ffn_gate_exps.weight', 'blk.0.ffn_up_exps.weight', "
            "'blk.0.ffn_down_exps.weight' and 4 more)")):
        load_model(tmp_path / "moe.gguf", progress=False)

    hp, tensors = tiny_tensors()  # a dense model's tensors beside one router: still refused as MoE
    tensors["blk.1.ffn_gate_inp.weight"] = (rng.standard_normal((E, D)).astype(np.float32), None)
    write_gguf(tmp_path / "router.gguf", "llama", hp, tensors)
    with pytest.raises(CheckpointError, match=re.escape(
            "router.gguf: mixture-of-experts models are not supported (1 expert tensors: "
            "'blk.1.ffn_gate_inp.weight')")):
        load_model(tmp_path / "router.gguf", progress=False)


def test_truncated_gguf(tmp_path):
    hp, tensors = tiny_tensors()
    path = tmp_path / "full.gguf"
    write_gguf(path, "llama", hp, tensors)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(CheckpointError, match=rf"cut.gguf: truncated: tensor '[\w.]+' .* ends at byte \d+ but "
                                              rf"the file has {len(data) * 2 // 3} bytes"):
        load_model(cut, progress=False)
    cut.write_bytes(data[:100])  # inside the metadata
    with pytest.raises(CheckpointError, match="cut.gguf: not a readable GGUF file of 100 bytes"):
        load_model(cut, progress=False)


def patch_tensor_info(path, name: str, *, ne0: int | None = None, type_code: int | None = None) -> None:
    """Overwrite a tensor's row length or ggml type code in the file's tensor info (name, n_dims u32,
    dims u64 innermost first, type u32, offset u64)."""
    data = bytearray(path.read_bytes())
    at = data.index(name.encode()) + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    if ne0 is not None:
        struct.pack_into("<Q", data, at + 4, ne0)
    if type_code is not None:
        struct.pack_into("<I", data, at + 4 + 8 * n_dims, type_code)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("change, message", [
    # 31: Q4_0_4_4 of 2024 llama.cpp files (now repacked on load); 4: Q4_2, removed in 2023
    ({"type_code": 31}, "tensor 'blk.0.ffn_up.weight' has ggml type code 31, which is not a ggml type this gguf "
                        "package knows; supported: BF16, F16, F32, Q4_0, Q4_1, Q4_K, Q5_0, Q6_K, Q8_0"),
    ({"type_code": 4}, "tensor 'blk.0.ffn_up.weight' has ggml type code 4, which is not a ggml type"),
    ({"ne0": 240}, "tensor 'blk.0.ffn_up.weight' (Q8_0, ggml shape [240, 512]) has rows of 240 elements, not a "
                   "multiple of Q8_0's block size 32"),
], ids=["type_31", "type_4", "partial_block"])
def test_tensor_info_the_reader_cannot_build_names_the_tensor(tmp_path, change, message):
    hp, tensors = tiny_tensors(qtype=Q.Q8_0)
    path = tmp_path / "info.gguf"
    write_gguf(path, "llama", hp, tensors)
    patch_tensor_info(path, "blk.0.ffn_up.weight", **change)
    with pytest.raises(CheckpointError, match=re.escape(f"info.gguf: {message}")):
        GGUFSource(path)


def test_missing_metadata_key(tmp_path):
    hp, tensors = tiny_tensors()
    w = gguf.GGUFWriter(str(tmp_path / "nometa.gguf"), "llama")
    w.add_embedding_length(hp["hidden_size"])
    for name, (arr, raw) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="llama.attention.head_count"):
        GGUFSource(tmp_path / "nometa.gguf")


def test_token_list_longer_than_embedding(tmp_path):
    hp, tensors = tiny_tensors()
    pieces = [f"t{i}" for i in range(hp["vocab_size"] + 1)]
    write_gguf(tmp_path / "vocab.gguf", "llama", hp, tensors, meta={"tokenizer.ggml.tokens": ("add_array", pieces)})
    with pytest.raises(CheckpointError, match=rf"tokenizer has {len(pieces)} tokens but token_embd.weight has only "
                                              rf"{hp['vocab_size']} rows"):
        GGUFSource(tmp_path / "vocab.gguf")


def test_tensors_for_more_blocks_than_block_count_are_an_error(tmp_path):
    hp, tensors = tiny_tensors()  # blocks 0 and 1
    path = tmp_path / "blocks.gguf"
    write_gguf(path, "llama", hp | {"num_hidden_layers": 1}, tensors)
    with pytest.raises(CheckpointError, match=r"blocks.gguf: 9 checkpoint tensors would be left unused "
                                              r"\('model\.layers\.1\.input_layernorm\.weight', .*up to layer 1 but "
                                              r"the config has 1 layers"):
        load_model(path, progress=False)


@pytest.mark.parametrize("key, value, message", [
    ("llama.attention.head_count", ("add_uint32", 0), "is 0; it must be a positive integer"),
    ("llama.attention.head_count_kv", ("add_uint32", 0), "is 0; it must be a positive integer"),
    ("llama.embedding_length", ("add_string", "abc"), "is 'abc'; it must be a positive integer"),
    ("llama.context_length", ("add_int32", -5), "is -5; it must be a positive integer"),
    ("llama.rope.freq_base", ("add_float32", -1.0), "is -1.0; it must be a positive finite number"),
])
def test_bad_metadata_value_names_file_and_key(tmp_path, key, value, message):
    hp, tensors = tiny_tensors()
    path = tmp_path / "badmeta.gguf"
    write_gguf(path, "llama", hp, tensors, meta={key: value})  # overwrites the value write_gguf set
    with pytest.raises(CheckpointError, match=re.escape(f"badmeta.gguf: GGUF metadata key {key!r} {message}")):
        GGUFSource(path)


def test_tokenizer_path_only_where_the_metadata_has_a_tokenizer(tmp_path):
    hp, tensors = tiny_tensors()
    write_gguf(tmp_path / "notok.gguf", "llama", hp, tensors)
    assert load_model(tmp_path / "notok.gguf", progress=False).tokenizer_path is None  # so --prompt-ids works
    write_gguf(tmp_path / "tok.gguf", "llama", hp, tensors, meta={"tokenizer.ggml.model": ("add_string", "llama")})
    assert GGUFSource(tmp_path / "tok.gguf").tokenizer_path() == tmp_path / "tok.gguf"


def test_invalid_utf8_metadata_string_names_file_and_key(tmp_path):
    hp, tensors = tiny_tensors()
    path = tmp_path / "utf8.gguf"
    write_gguf(path, "llama", hp, tensors)
    data = bytearray(path.read_bytes())
    value = data.index(b"llama", data.index(b"general.architecture") + len("general.architecture"))
    data[value] = 0xA8  # not a UTF-8 start byte
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"utf8.gguf: GGUF metadata key 'general.architecture' is not valid "
                                              r"UTF-8 \('utf-8' codec can't decode byte 0xa8"):
        load_model(path, progress=False)


# a byte-level BPE tokenizer in which "ab" is token 2
TINY_VOCAB = {"tokenizer.ggml.model": ("add_string", "gpt2"), "tokenizer.ggml.tokens": ("add_array", ["a", "b", "ab"]),
              "tokenizer.ggml.merges": ("add_array", ["a b"]), "tokenizer.ggml.token_type": ("add_array", [1, 1, 1])}


def test_gguf_file_without_the_suffix_is_known_by_its_magic(tmp_path):
    """ollama keeps its models as blobs named sha256-<digest>: the model and its tokenizer load."""
    from runtime.tokenizer import load_tokenizer

    hp, tensors = tiny_tensors()
    write_gguf(tmp_path / "model.gguf", "llama", hp, tensors, meta=TINY_VOCAB)
    blob = tmp_path / "sha256-0c1f"
    blob.write_bytes((tmp_path / "model.gguf").read_bytes())
    loaded, ref = load_model(blob, progress=False), load_model(tmp_path / "model.gguf", progress=False)
    assert loaded.tokenizer_path == blob and load_tokenizer(loaded.tokenizer_path).encode("ab") == [2]
    prompt = np.random.default_rng().integers(0, hp["vocab_size"], 8).tolist()
    np.testing.assert_array_equal(prompt_logits(loaded, prompt), prompt_logits(ref, prompt))
    (tmp_path / "other").write_bytes(b"GGUX" + bytes(60))
    with pytest.raises(CheckpointError, match="other: unknown checkpoint format"):
        load_model(tmp_path / "other", progress=False)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_model(tmp_path / "nope.gguf", progress=False)
    with pytest.raises(CheckpointError, match="nope.gguf"):
        GGUFSource(tmp_path / "nope.gguf")


# ------------------------------------------------------------------------ byte order, split files


def test_big_endian_f32_and_f16_tensors_read_as_the_little_endian_file_does(tmp_path):
    """The reader gives a big-endian file's F32/F16 data as '>f4'/'>f2' arrays, which gguf's
    dequantize views as native floats; rope_freqs (the config's llama3 scaling) is read the same way."""
    hp, tensors = tiny_tensors(qtype=Q.F16)  # norms stay F32
    tensors["rope_freqs.weight"] = (llama_cpp_rope_freqs(hp["rope_theta"], hp["head_dim"], 8.0), None)
    write_gguf(tmp_path / "le.gguf", "llama", hp, tensors)
    write_gguf(tmp_path / "be.gguf", "llama", hp, tensors, endianess=gguf.GGUFEndian.BIG)
    assert gguf.GGUFReader(tmp_path / "be.gguf").byte_order == "S"
    le, be = GGUFSource(tmp_path / "le.gguf"), GGUFSource(tmp_path / "be.gguf")
    assert le.config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert be.config.replace(name="le") == le.config
    assert be.keys() == le.keys()
    for name in le.keys():
        np.testing.assert_array_equal(be.get(name), le.get(name), err_msg=name)


@pytest.mark.parametrize("qtype", [Q.BF16, Q.Q8_0], ids=lambda q: q.name)
def test_big_endian_bf16_and_quantized_tensors_are_refused_by_name(tmp_path, qtype):
    """Their data is raw bytes, whose swapping would depend on each type's block layout."""
    hp, tensors = tiny_tensors(qtype=qtype)
    write_gguf(tmp_path / "be.gguf", "llama", hp, tensors, endianess=gguf.GGUFEndian.BIG)
    with pytest.raises(CheckpointError, match=re.escape(
            f"be.gguf: only F32 and F16 tensors can be read from a byte-swapped (big-endian) GGUF file, not "
            f"'token_embd.weight' ({qtype.name}), 'output.weight' ({qtype.name}), 'blk.0.attn_q.weight' "
            f"({qtype.name}), 'blk.0.attn_k.weight' ({qtype.name}) and 12 more")):
        GGUFSource(tmp_path / "be.gguf")


def test_split_gguf_loads_as_its_single_file_does(tmp_path):
    from runtime.tokenizer import load_tokenizer

    hp, tensors = tiny_tensors()  # 21 tensors
    write_gguf(tmp_path / "tiny.gguf", "llama", hp, tensors, meta=TINY_VOCAB)
    (tmp_path / "split").mkdir()
    write_gguf(tmp_path / "split" / "tiny.gguf", "llama", hp, tensors, meta=TINY_VOCAB, split_max_tensors=5)
    shards = sorted((tmp_path / "split").iterdir())
    assert [p.name for p in shards] == [f"tiny-{i:05d}-of-00005.gguf" for i in range(1, 6)]
    one, split = GGUFSource(tmp_path / "tiny.gguf"), GGUFSource(shards[0])
    assert split.config == one.config and split.keys() == one.keys()
    for name in one.keys():
        np.testing.assert_array_equal(split.get(name), one.get(name), err_msg=name)
    loaded = load_model(shards[0], progress=False)
    assert loaded.tokenizer_path == shards[0] and load_tokenizer(loaded.tokenizer_path).encode("ab") == [2]


def write_shards(folder, hp: dict, shards: list[dict], *, tensors_count: int | None = None) -> list:
    """Split GGUF files as llama.cpp's gguf-split names and marks them, each written on its own so that
    a test can make them disagree."""
    folder.mkdir()
    n, paths = len(shards), []
    for i, tensors in enumerate(shards):
        paths.append(folder / f"tiny-{i + 1:05d}-of-{n:05d}.gguf")
        count = tensors_count if tensors_count is not None else sum(map(len, shards))
        meta = {"split.no": ("add_uint16", i), "split.count": ("add_uint16", n),
                "split.tensors.count": ("add_int32", count)}
        write_gguf(paths[-1], "llama", hp, tensors, meta=meta)
    return paths


@pytest.mark.parametrize("case", ["missing_file", "not_the_first_file", "renamed_first_file", "count_disagrees",
                                  "tensor_in_two_files", "tensors_count_disagrees"])
def test_split_gguf_errors_name_the_file(tmp_path, case):
    hp, tensors = tiny_tensors()  # 21 tensors
    items = list(tensors.items())
    write_gguf(tmp_path / "tiny.gguf", "llama", hp, tensors, split_max_tensors=5)
    shard = [None, *(tmp_path / f"tiny-{i:05d}-of-00005.gguf" for i in range(1, 6))]  # 1-based
    path = shard[1]
    if case == "missing_file":
        shard[3].unlink()
        message = f"{shard[3]}: file 3 of the split GGUF {shard[1]} does not exist"
    elif case == "not_the_first_file":
        path = shard[2]
        message = (f"{shard[2]}: this is file 2 of a split GGUF of 5 files (split.no is 1); load it from the "
                   f"first, {shard[1]}")
    elif case == "renamed_first_file":
        path = shard[1].rename(tmp_path / "tiny.gguf")
        message = (f"{path}: the first file of a split GGUF of 5 files (split.count) must be named "
                   f"PREFIX-00001-of-00005.gguf, so that the others can be found")
    elif case == "count_disagrees":  # file 2 of a split into 3 files, put in the place of file 2 of 5
        (tmp_path / "other").mkdir()
        write_gguf(tmp_path / "other" / "tiny.gguf", "llama", hp, tensors, split_max_tensors=7)
        shutil.copy(tmp_path / "other" / "tiny-00002-of-00003.gguf", shard[2])
        message = (f"{shard[2]}: split.count is 3 and split.no 1, but as file 2 of the split GGUF "
                   f"tiny-00001-of-00005.gguf it must be 5 and 1")
    elif case == "tensor_in_two_files":
        path, second = write_shards(tmp_path / "other", hp, [dict(items[:11]), dict(items[10:])])
        message = f"{second}: tensor {items[10][0]!r} is also in {path}"
    else:
        path, _ = write_shards(tmp_path / "other", hp, [dict(items[:11]), dict(items[11:])], tensors_count=22)
        message = f"{path}: split.tensors.count is 22 but the 2 split files hold 21 tensors"
    with pytest.raises(CheckpointError, match=re.escape(message)):
        GGUFSource(path)


# ------------------------------------------------------------------------- SmolLM2-135M, real Q4_1

PROMPT = "The Eiffel Tower is located in the city of"


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_gguf_path()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    return path, tok, hf, load_model(path, dtype="float32", progress=False)


# ~30 s together on 2 quiet CPU cores (most of it HF's GGUF loading), so not marked slow
def test_smollm2_config(smollm2):
    path, _, _, loaded = smollm2
    c = loaded.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size) == (
        30, 576, 9, 3, 64, 1536)
    assert (c.vocab_size, c.rope_theta, c.max_position_embeddings, c.rms_norm_eps) == (49152, 1e5, 8192, 1e-5)
    assert c.tie_word_embeddings and not c.attention_bias and c.rope_scaling is None
    assert loaded.tokenizer_path == path


def test_smollm2_greedy_and_logits_vs_hf(smollm2):
    _, tok, hf, loaded = smollm2
    prompt = tok(PROMPT)["input_ids"]
    ours = greedy_generate(loaded, prompt, 32)
    hf_tokens, hf_logits = hf_greedy(hf, prompt, 32)
    assert tok.decode(ours.tokens).startswith(" Paris, France.")
    assert ours.tokens == hf_tokens
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].numpy()
    atol, rtol = GGUF_LOGITS_F32
    np.testing.assert_allclose(ours.prompt_logits, ref, atol=atol, rtol=rtol)
    np.testing.assert_allclose(ours.step_logits, hf_logits, atol=atol, rtol=rtol)
