"""Model configuration: one frozen dataclass for every Llama-family decoder, plus named presets.

The fields mirror the HF `config.json` keys they come from (see `ModelConfig.from_hf_config`), so a
config read from a checkpoint and a preset written here are the same kind of object.
"""

from __future__ import annotations

import dataclasses
import math
from functools import cached_property
from typing import Any, Literal


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `llama3` is Llama 3.1's piecewise rule; `linear` divides positions."""

    kind: Literal["llama3", "linear"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.kind not in ("llama3", "linear"):
            raise ValueError(f"rope scaling kind {self.kind!r} is not supported; use 'llama3' or 'linear'")
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"llama3 rope scaling needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}"
            )

    @classmethod
    def from_hf(cls, d: dict[str, Any] | None) -> RopeScaling | None:
        if not d:
            return None
        kind = d.get("rope_type", d.get("type"))
        if kind in (None, "default"):
            return None
        if kind == "linear":
            return cls("linear", float(d["factor"]))
        if kind == "llama3":
            return cls(
                "llama3",
                float(d["factor"]),
                float(d.get("low_freq_factor", 1.0)),
                float(d.get("high_freq_factor", 4.0)),
                int(d.get("original_max_position_embeddings", 8192)),
            )
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5, Qwen3).

    Letters as in ARCHITECTURE.md: V vocab, D model dim, F MLP dim, L layers, N query heads,
    K KV heads, H head dim (independent of D / N).
    """

    name: str
    vocab_size: int  # V
    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int  # L
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # each token sees this many KV positions, itself included (Mistral)
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self):
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelConfig.{f} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {self.sliding_window}")

    @cached_property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @cached_property
    def num_params(self) -> int:
        D, F, N, K, H, V = (self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads,
                            self.head_dim, self.vocab_size)
        attn = D * (N + 2 * K) * H + N * H * D + (N + 2 * K) * H * self.attention_bias + 2 * H * self.qk_norm
        layer = attn + 3 * D * F + 2 * D
        return V * D * (1 if self.tie_word_embeddings else 2) + self.num_layers * layer + D

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_config(cls, d: dict[str, Any], name: str | None = None) -> ModelConfig:
        """Build from a HF `config.json` dict of a Llama/Mistral/Qwen2/Qwen3 model."""
        archs = d.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {arch!r} is not supported; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        try:
            D = int(d["hidden_size"])
            N = int(d["num_attention_heads"])
            head_dim = d.get("head_dim") or D // N
            sliding = d.get("sliding_window")
            if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not d.get("use_sliding_window", False):
                sliding = None  # Qwen configs carry a window size that is off unless use_sliding_window
            return cls(
                name=name or d.get("_name_or_path") or d.get("model_type", "model"),
                vocab_size=int(d["vocab_size"]),
                hidden_size=D,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=N,
                num_kv_heads=int(d.get("num_key_value_heads") or N),
                head_dim=int(head_dim),
                rope_theta=float(d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
                rope_scaling=RopeScaling.from_hf(d.get("rope_scaling") or d.get("rope_parameters")),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", arch == "Qwen2ForCausalLM")),
                qk_norm=arch == "Qwen3ForCausalLM",
                sliding_window=int(sliding) if sliding else None,
                architecture=arch,
            )
        except KeyError as e:
            raise ValueError(f"HF config is missing required key {e.args[0]!r}") from None


SUPPORTED_ARCHITECTURES = frozenset(
    {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
)

_LLAMA31_SCALING = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)

PRESETS: dict[str, ModelConfig] = {
    c.name: c
    for c in [
        ModelConfig("llama2_7b", 32000, 4096, 11008, 32, 32, 32, 128, rope_theta=1e4, max_position_embeddings=4096),
        ModelConfig("llama3_2_1b", 128256, 2048, 8192, 16, 32, 8, 64, rope_theta=5e5,
                    rope_scaling=RopeScaling("llama3", 32.0, 1.0, 4.0, 8192), max_position_embeddings=131072,
                    tie_word_embeddings=True),
        ModelConfig("llama3_8b", 128256, 4096, 14336, 32, 32, 8, 128, rope_theta=5e5, max_position_embeddings=8192),
        ModelConfig("llama3_1_70b", 128256, 8192, 28672, 80, 64, 8, 128, rope_theta=5e5,
                    rope_scaling=_LLAMA31_SCALING, max_position_embeddings=131072),
        ModelConfig("mistral_7b", 32000, 4096, 14336, 32, 32, 8, 128, rope_theta=1e4, sliding_window=4096,
                    max_position_embeddings=32768, architecture="MistralForCausalLM"),
        ModelConfig("qwen2_5_0_5b", 151936, 896, 4864, 24, 14, 2, 64, rope_theta=1e6, rms_norm_eps=1e-6,
                    max_position_embeddings=32768, tie_word_embeddings=True, attention_bias=True,
                    architecture="Qwen2ForCausalLM"),
        ModelConfig("qwen2_5_7b", 152064, 3584, 18944, 28, 28, 4, 128, rope_theta=1e6, rms_norm_eps=1e-6,
                    max_position_embeddings=32768, attention_bias=True, architecture="Qwen2ForCausalLM"),
        ModelConfig("qwen3_8b", 151936, 4096, 12288, 36, 32, 8, 128, rope_theta=1e6, rms_norm_eps=1e-6,
                    max_position_embeddings=40960, qk_norm=True, architecture="Qwen3ForCausalLM"),
        ModelConfig("smollm2_135m", 49152, 576, 1536, 30, 9, 3, 64, rope_theta=1e5,
                    max_position_embeddings=8192, tie_word_embeddings=True),
        ModelConfig("stories260k", 512, 64, 172, 5, 8, 4, 8, rope_theta=1e4, max_position_embeddings=512,
                    tie_word_embeddings=True),
    ]
}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(sorted(PRESETS))}") from None


def rope_inv_freq(config: ModelConfig):
    """Per-pair inverse frequencies f32[H/2], with the config's scaling applied (numpy, host-side)."""
    import numpy as np

    H = config.head_dim
    inv = 1.0 / (config.rope_theta ** (np.arange(0, H, 2, dtype=np.float64) / H))
    rs = config.rope_scaling
    if rs is None:
        pass
    elif rs.kind == "linear":
        inv = inv / rs.factor
    else:  # llama3: keep high frequencies, divide low ones by factor, interpolate between
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor
        )
        scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = np.where(mid, (1 - smooth) * inv / rs.factor + smooth * inv, scaled)
    return inv.astype(np.float32)
