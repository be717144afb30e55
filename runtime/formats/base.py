"""What every checkpoint format provides, and the one table from HF tensor names to model params.

Every source (safetensors, GGUF, llama2.c) presents its tensors under HF names in HF layout
(`[out, in]` matrices, rotate-half RoPE order for q/k). Formats that differ convert on read, so the
mapping onto the NNX model below exists exactly once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, NamedTuple, Protocol

import numpy as np

from models.config import ModelConfig


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt, truncated, or does not match the model config."""


class TensorSource(Protocol):
    path: Path
    config: ModelConfig
    dtype: np.dtype  # the checkpoint's own weight dtype (what `--dtype auto` loads)

    def keys(self) -> Iterable[str]: ...

    def get(self, name: str) -> np.ndarray: ...  # HF name -> array in HF layout

    def tokenizer_path(self) -> Path | None: ...


class TensorPlan(NamedTuple):
    hf_name: str
    hf_shape: tuple[int, ...]
    to_param: Callable[[np.ndarray], np.ndarray]  # HF layout -> our param layout


def hf_tensor_plan(cfg: ModelConfig) -> dict[tuple, TensorPlan]:
    """Model param path (as in nnx.to_flat_state) -> the HF tensor it is loaded from."""
    D, F, N, K, H, V = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                        cfg.head_dim, cfg.vocab_size)

    def heads_in(n):  # [n*H, D] -> [D, n, H]
        return lambda w: w.reshape(n, H, D).transpose(2, 0, 1)

    def bias(n):
        return lambda b: b.reshape(n, H)

    ident = lambda x: x  # noqa: E731
    T = lambda w: w.T  # noqa: E731

    plan = {("embed",): TensorPlan("model.embed_tokens.weight", (V, D), ident),
            ("final_norm", "scale"): TensorPlan("model.norm.weight", (D,), ident)}
    if not cfg.tie_word_embeddings:
        plan[("lm_head",)] = TensorPlan("lm_head.weight", (V, D), T)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = ("layers", i, "attn")
        plan[("layers", i, "input_norm", "scale")] = TensorPlan(p + "input_layernorm.weight", (D,), ident)
        plan[("layers", i, "post_attn_norm", "scale")] = TensorPlan(p + "post_attention_layernorm.weight", (D,), ident)
        plan[a + ("q_proj",)] = TensorPlan(p + "self_attn.q_proj.weight", (N * H, D), heads_in(N))
        plan[a + ("k_proj",)] = TensorPlan(p + "self_attn.k_proj.weight", (K * H, D), heads_in(K))
        plan[a + ("v_proj",)] = TensorPlan(p + "self_attn.v_proj.weight", (K * H, D), heads_in(K))
        plan[a + ("o_proj",)] = TensorPlan(p + "self_attn.o_proj.weight", (D, N * H),
                                           lambda w: w.reshape(D, N, H).transpose(1, 2, 0))
        if cfg.attention_bias:
            plan[a + ("q_bias",)] = TensorPlan(p + "self_attn.q_proj.bias", (N * H,), bias(N))
            plan[a + ("k_bias",)] = TensorPlan(p + "self_attn.k_proj.bias", (K * H,), bias(K))
            plan[a + ("v_bias",)] = TensorPlan(p + "self_attn.v_proj.bias", (K * H,), bias(K))
        if cfg.qk_norm:
            plan[a + ("q_norm", "scale")] = TensorPlan(p + "self_attn.q_norm.weight", (H,), ident)
            plan[a + ("k_norm", "scale")] = TensorPlan(p + "self_attn.k_norm.weight", (H,), ident)
        m = ("layers", i, "mlp")
        plan[m + ("gate_proj",)] = TensorPlan(p + "mlp.gate_proj.weight", (F, D), T)
        plan[m + ("up_proj",)] = TensorPlan(p + "mlp.up_proj.weight", (F, D), T)
        plan[m + ("down_proj",)] = TensorPlan(p + "mlp.down_proj.weight", (D, F), T)
    return plan


def interleaved_to_half_split(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder q/k projection rows [n*H, ...] from interleaved RoPE pairs (GPT-J / llama2.c / GGUF
    order: (x0, x1), (x2, x3), ...) to the half-split order HF and this model use."""
    H = w.shape[0] // n_heads
    rest = w.shape[1:]
    return w.reshape(n_heads, H // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)
