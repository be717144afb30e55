"""What every checkpoint format provides, and the one table from HF tensor names to model params.

Every source (safetensors, GGUF, llama2.c) presents its tensors under HF names in HF layout
(`[out, in]` matrices, rotate-half RoPE order for q/k). Formats that differ convert on read, so the
mapping onto the NNX model below exists exactly once.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Iterable, NamedTuple, Protocol

import numpy as np

from models.config import ModelConfig
from models.llama import qkv_layout, repeat_qkv


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt, truncated, or does not match the model config."""


class TensorSource(Protocol):
    path: Path
    config: ModelConfig
    dtype: np.dtype  # the checkpoint's own weight dtype (what `--dtype auto` loads)

    def keys(self) -> Iterable[str]: ...  # every tensor it holds, by HF name where it has one

    def get(self, name: str) -> np.ndarray: ...  # HF name -> array in HF layout

    def tokenizer_path(self) -> Path | None: ...


class TensorPlan(NamedTuple):
    hf_names: tuple[str, ...]  # the HF tensors one param is built from (q, k, v for the merged qkv)
    hf_shapes: tuple[tuple[int, ...], ...]
    to_param: Callable[..., np.ndarray]  # HF layout arrays, in hf_names order -> our param layout


def hf_tensor_plan(cfg: ModelConfig, kv_repeat: int = 1) -> dict[tuple, TensorPlan]:
    """Model param path (as in nnx.to_flat_state) -> the HF tensors it is loaded from. kv_repeat:
    the model's (sharding.rules.kv_repeat), which the merged qkv params' layout depends on."""
    D, F, N, K, H, V = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                        cfg.head_dim, cfg.vocab_size)

    def one(name, shape, fn=lambda x: x):
        return TensorPlan((name,), (shape,), fn)

    def heads_in(w):  # [n*H, D] -> [D, n, H]
        return w.reshape(-1, H, D).transpose(2, 0, 1)

    def qkv(q, k, v):  # HF [N*H, D], [K*H, D], [K*H, D] (or the biases) -> [D, K', R'+2, H] ([K', R'+2, H])
        parts = [heads_in(w) if w.ndim == 2 else w.reshape(-1, H) for w in (q, k, v)]
        return repeat_qkv(qkv_layout(*parts), kv_repeat)

    T = lambda w: w.T  # noqa: E731

    plan = {("embed",): one("model.embed_tokens.weight", (V, D)),
            ("final_norm", "scale"): one("model.norm.weight", (D,))}
    if not cfg.tie_word_embeddings:
        plan[("lm_head",)] = one("lm_head.weight", (V, D), T)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = ("layers", i, "attn")
        plan[("layers", i, "input_norm", "scale")] = one(p + "input_layernorm.weight", (D,))
        plan[("layers", i, "post_attn_norm", "scale")] = one(p + "post_attention_layernorm.weight", (D,))
        plan[a + ("qkv_proj",)] = TensorPlan(
            tuple(p + f"self_attn.{x}_proj.weight" for x in "qkv"), ((N * H, D), (K * H, D), (K * H, D)), qkv)
        plan[a + ("o_proj",)] = one(p + "self_attn.o_proj.weight", (D, N * H),
                                    lambda w: w.reshape(D, N, H).transpose(1, 2, 0))
        if cfg.attention_bias:
            plan[a + ("qkv_bias",)] = TensorPlan(
                tuple(p + f"self_attn.{x}_proj.bias" for x in "qkv"), ((N * H,), (K * H,), (K * H,)), qkv)
        if cfg.qk_norm:
            plan[a + ("q_norm", "scale")] = one(p + "self_attn.q_norm.weight", (H,))
            plan[a + ("k_norm", "scale")] = one(p + "self_attn.k_norm.weight", (H,))
        m = ("layers", i, "mlp")
        plan[m + ("gate_up_proj",)] = TensorPlan(
            (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), ((F, D), (F, D)),
            lambda g, u: np.stack([g.T, u.T], axis=1))
        plan[m + ("down_proj",)] = one(p + "mlp.down_proj.weight", (D, F), T)
    return plan


# Tensors that real checkpoints carry and the model rightly leaves unread: the RoPE inverse-frequency
# buffers that transformers < 4.31 saved in Llama checkpoints (RoPE is computed from the config).
_IGNORABLE = re.compile(r"(model\.)?(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")


def unused_tensors(cfg: ModelConfig, plan: dict[tuple, TensorPlan], names: Iterable[str]) -> list[str]:
    """The tensors among `names` (HF names) that no param of `plan` is built from, in layer order:
    weights the model would silently drop, e.g. layers beyond the config's num_layers, or biases
    the config says the model does not have. Not counted: ignorable buffers, and lm_head.weight
    beside tied embeddings, which is then a copy of the embedding (a reader whose checkpoint stores
    a different head unties the config, as SafetensorsSource does after transformers)."""
    used = {n for tp in plan.values() for n in tp.hf_names}
    extra = [n for n in names if n not in used and not _IGNORABLE.fullmatch(n)
             and not (n == "lm_head.weight" and cfg.tie_word_embeddings)]
    return sorted(extra, key=lambda n: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", n)])


def interleaved_to_half_split(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder q/k projection rows [n*H, ...] from interleaved RoPE pairs (GPT-J / llama2.c / GGUF
    order: (x0, x1), (x2, x3), ...) to the half-split order HF and this model use."""
    H = w.shape[0] // n_heads
    rest = w.shape[1:]
    return w.reshape(n_heads, H // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)
