"""llama2.c `.bin` loading: stories260K reproduces llama2.c's golden greedy text, an exported random
HF model matches HF transformers, and malformed files fail with the numbers that are wrong."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from models.config import get_preset
from runtime.checkpoint import load_model
from runtime.formats.base import CheckpointError
from runtime.formats.llama2c import Llama2cSource
from tests.testing.data import shared_data_dir
from tests.testing.greedy import greedy_generate, hf_greedy, steps_before_near_tie
from tests.tolerances import MODEL_LOGITS_F32

# llama2.c's test_all.py expectation for `run stories260K.bin -z tok512.bin -t 0.0 -n 200`
GOLDEN = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, she saw "
    "a big, red ball. She wanted to play with it, but it was too high.\n"
    "Lily's mom said, \"Lily, let's go to the park.\" Lily was sad and didn't know what to do. She said, \"I want "
    "to play with your ball, but I can't find it.\"\n"
    "Lily was sad and didn't know what to do. She said, \"I'm sorry, Lily. I didn't know what to do.\"\n"
    "Lily didn't want to help her mom, so she"
)
BOS = 1


def runc_decode(tok_path, ids: list[int]) -> str:
    """run.c's `decode` + `safe_printf`: strip a piece's leading space right after BOS, map <0xXX>
    pieces to their byte. Reads tok512.bin directly (int32 max_len, then per token: f32 score,
    int32 length, bytes), independent of runtime.tokenizer."""
    data = tok_path.read_bytes()
    pieces, off = [], 4
    while off < len(data):
        _, n = struct.unpack_from("<fi", data, off)
        pieces.append(data[off + 8 : off + 8 + n])
        off += 8 + n
    out, prev = b"", BOS
    for t in ids:
        p = pieces[t]
        if prev == BOS and p.startswith(b" "):
            p = p[1:]
        if len(p) == 6 and p.startswith(b"<0x") and p.endswith(b">"):
            p = bytes([int(p[3:5], 16)])
        out += p
        prev = t
    return out.decode("utf-8")


@pytest.fixture(scope="module")
def stories():
    path = shared_data_dir() / "stories260k" / "stories260K.bin"
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return path


def test_stories260k_config(stories):
    src = Llama2cSource(stories)
    assert src.config == get_preset("stories260k").replace(name="stories260K")
    assert src.tokenizer_path() == stories.parent / "tok512.bin"


def test_stories260k_golden_text(stories):
    loaded = load_model(stories, dtype="float32", progress=False)
    # run.c feeds positions 0..199 and stops early only if it samples BOS
    out = greedy_generate(loaded, [BOS], 200, stop_token=BOS)
    assert len(out.tokens) == 200 and BOS not in out.tokens
    assert runc_decode(loaded.tokenizer_path, out.tokens) == GOLDEN
    from runtime.tokenizer import load_tokenizer

    assert load_tokenizer(loaded.tokenizer_path).decode(out.tokens) == GOLDEN


# -------------------------------------------------------------- an exported random HF model vs HF


def hf_to_llama2c(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama2.c export.py `permute_reverse`: HF half-split q/k rows -> llama2.c's
    interleaved RoPE pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama2c(path, model, *, shared: bool) -> int:
    """export.py `legacy_export` of a HF Llama model; returns the file size."""
    c = model.config
    sd = {k: v.numpy().astype(np.float32) for k, v in model.state_dict().items()}
    L, N, K = c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads
    H, S = c.hidden_size // N, c.max_position_embeddings
    layer = lambda suffix: [sd[f"model.layers.{i}.{suffix}"] for i in range(L)]  # noqa: E731
    parts = [sd["model.embed_tokens.weight"], *layer("input_layernorm.weight"),
             *[hf_to_llama2c(w, N) for w in layer("self_attn.q_proj.weight")],
             *[hf_to_llama2c(w, K) for w in layer("self_attn.k_proj.weight")],
             *layer("self_attn.v_proj.weight"), *layer("self_attn.o_proj.weight"),
             *layer("post_attention_layernorm.weight"), *layer("mlp.gate_proj.weight"),
             *layer("mlp.down_proj.weight"), *layer("mlp.up_proj.weight"), sd["model.norm.weight"],
             # freq_cis_real/imag: NaN so that a reader that used them would show it
             np.full((S, H // 2), np.nan, np.float32), np.full((S, H // 2), np.nan, np.float32)]
    if not shared:
        parts.append(sd["lm_head.weight"])
    header = struct.pack("<7i", c.hidden_size, c.intermediate_size, L, N, K,
                         c.vocab_size if shared else -c.vocab_size, S)
    data = header + b"".join(np.ascontiguousarray(p, "<f4").tobytes() for p in parts)
    path.write_bytes(data)
    return len(data)


@pytest.mark.parametrize("shared", [False, True], ids=["untied", "tied"])
def test_exported_model_vs_hf(shared, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                                   rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=shared,
                                   initializer_range=0.25, attn_implementation="eager")
    torch.manual_seed(int(np.random.default_rng().integers(1 << 30)))
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path / "tiny.bin"
    write_llama2c(path, model, shared=shared)
    loaded = load_model(path, progress=False)
    assert loaded.config.tie_word_embeddings == shared and loaded.config.head_dim == 8
    assert loaded.tokenizer_path is None  # no tok*.bin beside it

    prompt = np.random.default_rng().integers(0, cfg.vocab_size, 40).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0].numpy()
    ours = greedy_generate(loaded, prompt, 16)
    atol, rtol = MODEL_LOGITS_F32
    np.testing.assert_allclose(ours.prompt_logits, ref, atol=atol, rtol=rtol)
    # Greedy tokens must agree up to the reference's first near-tie
    ref_tokens, ref_logits = hf_greedy(model, prompt, 16)
    n = steps_before_near_tie(ref_logits, atol)
    assert ours.tokens[:n] == ref_tokens[:n]


# ------------------------------------------------------------------------------------ bad input


def test_truncated(stories, tmp_path):
    data = stories.read_bytes()
    cut = tmp_path / "cut.bin"
    cut.write_bytes(data[:-1000])
    with pytest.raises(CheckpointError, match=rf"cut.bin: truncated: .* needs {len(data)} bytes; the file has "
                                              rf"{len(data) - 1000}"):
        load_model(cut, progress=False)


def test_longer_than_header(stories, tmp_path):
    data = stories.read_bytes()
    long = tmp_path / "long.bin"
    long.write_bytes(data + b"\0" * 8)
    with pytest.raises(CheckpointError, match=rf"longer than its header implies.* needs {len(data)} bytes"):
        Llama2cSource(long)


def test_versioned_export_rejected(tmp_path):
    p = tmp_path / "v1.bin"
    p.write_bytes(struct.pack("<Ii7i", 0x616B3432, 1, 64, 172, 5, 8, 4, 512, 512) + b"\0" * 256)
    with pytest.raises(CheckpointError, match="version 1"):
        Llama2cSource(p)


@pytest.mark.parametrize("header, what", [((64, 172, 0, 8, 4, 512, 512), "n_layers is 0"),
                                           ((64, 172, 5, 6, 4, 512, 512), "dim must be a multiple"),
                                           ((12, 16, 1, 4, 4, 8, 4), r"header \(dim 12, n_heads 4\) gives an invalid "
                                                                     r"model config: head_dim must be even for RoPE"),
                                           ((1, 2, 3), "too short")])
def test_bad_header(header, what, tmp_path):
    p = tmp_path / "bad.bin"
    p.write_bytes(struct.pack(f"<{len(header)}i", *header))
    with pytest.raises(CheckpointError, match=rf"bad.bin: .*{what}"):
        Llama2cSource(p)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.bin"):
        load_model(tmp_path / "nope.bin", progress=False)
    with pytest.raises(CheckpointError, match="nope.bin"):
        Llama2cSource(tmp_path / "nope.bin")
