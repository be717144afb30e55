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
    def from_hf(cls, d: dict[str, Any] | None, key: str = "rope_scaling", *, max_position_embeddings: int,
                original_max_position_embeddings: int | None = None) -> RopeScaling | None:
        """From a HF config's `rope_scaling` (or `rope_parameters`) dict; `key` names it in errors.
        llama3's pretraining context is read as transformers 5 reads it (`standardize_rope_params`):
        the config's top-level `original_max_position_embeddings` (passed here) first, then the
        dict's, then the config's `max_position_embeddings`."""
        if not d:
            return None
        if not isinstance(d, dict):
            raise ValueError(f"config key {key!r} is {d!r}; it must be an object (or null)")
        kind = d.get("rope_type", d.get("type"))
        if kind in (None, "default"):
            return None
        if kind == "linear":
            return cls("linear", _hf_number(d, "factor", float, prefix=key))
        if kind == "llama3":
            orig = original_max_position_embeddings or _hf_number(
                d, "original_max_position_embeddings", int, max_position_embeddings, prefix=key)
            return cls(
                "llama3",
                _hf_number(d, "factor", float, prefix=key),
                _hf_number(d, "low_freq_factor", float, 1.0, prefix=key),
                _hf_number(d, "high_freq_factor", float, 4.0, prefix=key),
                orig,
            )
        type_key = "rope_type" if "rope_type" in d else "type"
        raise ValueError(f"config key '{key}.{type_key}' is {kind!r}; supported: default, linear, llama3")


_REQUIRED = object()


def _hf_number(d: dict[str, Any], key: str, kind: type = int, default: Any = _REQUIRED, *, prefix: str = ""):
    """d[key] as a positive int (kind=int; 64.0 is accepted as 64) or a positive finite float;
    `default` where the key is absent or null. prefix: the enclosing key, for the error message."""
    name = f"{prefix}.{key}" if prefix else key
    v = d.get(key)
    if v is None:
        if default is _REQUIRED:
            raise ValueError(f"config key {name!r} is {'null' if key in d else 'missing'}; it is required")
        return default
    return positive_number(v, name, kind)


def positive_number(v: Any, name: str, kind: type = int, what: str = "config key"):
    """v as a positive int (kind=int; 64.0 is accepted as 64) or a positive finite float, else a
    ValueError naming it (`what` `name`): the checkpoint readers' check of a config value."""
    if isinstance(v, int) and not isinstance(v, bool):
        number = kind is int or v < 2**1023  # (float() of an int past float's range raises)
    else:
        number = isinstance(v, float) and math.isfinite(v) and (kind is float or v.is_integer())
    if not (number and v > 0):
        raise ValueError(f"{what} {name!r} is {v!r}; it must be a positive {'integer' if kind is int else 'finite number'}")
    return kind(v)


def _hf_bool(d: dict[str, Any], key: str, default: bool) -> bool:
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ValueError(f"config key {key!r} is {v!r}; it must be true or false")
    return v


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
    # the layers (indices) that have sliding_window; None: every layer (Qwen's max_window_layers, HF's layer_types)
    sliding_window_layers: tuple[int, ...] | None = None
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self):
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"ModelConfig.{f} must be a positive int, got {v!r}")
        mpe = self.max_position_embeddings
        if not isinstance(mpe, int) or isinstance(mpe, bool) or mpe <= 0:
            raise ValueError(f"ModelConfig.max_position_embeddings must be a positive int, got {mpe!r}")
        for f in ("rope_theta", "rms_norm_eps"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"ModelConfig.{f} must be a positive number, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {self.sliding_window}")
        layers = self.sliding_window_layers
        if layers is not None:
            layers = tuple(layers)  # (a list from a JSON config)
            object.__setattr__(self, "sliding_window_layers", layers)
            if self.sliding_window is None or not layers or list(layers) != sorted(set(layers)) or not all(
                    isinstance(i, int) and 0 <= i < self.num_layers for i in layers):
                raise ValueError(f"sliding_window_layers must be increasing layer indices in [0, {self.num_layers}), "
                                 f"with sliding_window set; got {layers!r}")

    def window_of(self, layer: int) -> int | None:
        """The attention window of layer `layer` (None: full attention)."""
        if self.sliding_window_layers is None or layer in self.sliding_window_layers:
            return self.sliding_window
        return None

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
        """Build from a HF `config.json` dict of a Llama/Mistral/Qwen2/Qwen3 model. Every key is
        checked for type and range here, so a bad one is named (ValueError) rather than failing later."""
        if not isinstance(d, dict):
            raise ValueError(f"the config is a JSON {type(d).__name__}; it must be an object of config keys")
        arch = _architecture(d)
        D = _hf_number(d, "hidden_size")
        N = _hf_number(d, "num_attention_heads")
        K = _hf_number(d, "num_key_value_heads", int, N)
        if N % K:
            raise ValueError(f"config key 'num_attention_heads' is {N}; it must be a multiple of num_key_value_heads ({K})")
        head_dim = _hf_number(d, "head_dim", int, None) or D // N  # transformers' default, floored as there
        L = _hf_number(d, "num_hidden_layers")
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):  # (transformers' names of the one activation the model has)
            raise ValueError(f"config key 'hidden_act' is {act!r}; only 'silu' (SwiGLU) is supported")
        _check_biases(d, arch)
        sliding, sliding_layers = _sliding_window(d, arch, L)
        max_positions = _hf_number(d, "max_position_embeddings", int, _MAX_POSITIONS[arch])
        # transformers 5 (convert_rope_params_to_dict): a non-empty legacy `rope_scaling` replaces
        # `rope_parameters` altogether; the dict's rope_theta wins over a top-level one (setdefault)
        scaling_key = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
        rope = d.get(scaling_key)
        if rope is not None and not isinstance(rope, dict):
            raise ValueError(f"config key {scaling_key!r} is {rope!r}; it must be an object (or null)")
        top_theta = _hf_number(d, "rope_theta", float, 10000.0)  # (checked even where the dict's wins)
        rope_theta = _hf_number(rope or {}, "rope_theta", float, top_theta, prefix=scaling_key)
        return cls(
            name=name or d.get("_name_or_path") or d.get("model_type", "model"),
            vocab_size=_hf_number(d, "vocab_size"),
            hidden_size=D,
            intermediate_size=_hf_number(d, "intermediate_size"),
            num_layers=L,
            num_heads=N,
            num_kv_heads=K,
            head_dim=head_dim,
            rope_theta=rope_theta,
            rope_scaling=RopeScaling.from_hf(
                rope, scaling_key, max_position_embeddings=max_positions,
                original_max_position_embeddings=_hf_number(d, "original_max_position_embeddings", int, None)),
            rms_norm_eps=_hf_number(d, "rms_norm_eps", float, 1e-6),  # (transformers' default for all four)
            max_position_embeddings=max_positions,
            tie_word_embeddings=_hf_bool(d, "tie_word_embeddings", False),
            # transformers' Qwen2 always has q/k/v biases (whatever attention_bias says), Mistral never;
            # Llama's and Qwen3's attention_bias, which also adds an o_proj bias, is refused above
            attention_bias=arch == "Qwen2ForCausalLM",
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=sliding,
            sliding_window_layers=sliding_layers,
            architecture=arch,
        )


# transformers' model_type -> the class AutoModelForCausalLM builds, for a config without architectures
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM"}


def _architecture(d: dict[str, Any]) -> str:
    """The model class: `architectures[0]`, else the one transformers picks from `model_type`. A config
    with neither is read as Llama's."""
    archs = d.get("architectures")
    if not archs:
        model_type = d.get("model_type")
        if model_type is None:
            return "LlamaForCausalLM"
        if not isinstance(model_type, str) or model_type not in _MODEL_TYPES:
            raise ValueError(f"config has no 'architectures' and its model_type {model_type!r} is not supported; "
                             f"supported model types: {', '.join(_MODEL_TYPES)}")
        return _MODEL_TYPES[model_type]
    if not isinstance(archs, list) or not isinstance(archs[0], str):
        raise ValueError(f"config key 'architectures' is {archs!r}; it must be a list of class names")
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"architecture {archs[0]!r} is not supported; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    return archs[0]


def _check_biases(d: dict[str, Any], arch: str) -> None:
    """Refuse the bias options transformers honours and the model lacks: Llama's and Qwen3's
    attention_bias (q/k/v *and* o_proj biases; Qwen2's q/k/v biases are supported) and Llama's
    mlp_bias. (Mistral's and Qwen2's modeling code ignores both keys.)"""
    if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") and _hf_bool(d, "attention_bias", False):
        raise ValueError(f"config key 'attention_bias' is true: {arch} then has an o_proj bias, which is not "
                         f"supported (only Qwen2's q/k/v biases are)")
    if arch == "LlamaForCausalLM" and _hf_bool(d, "mlp_bias", False):
        raise ValueError("config key 'mlp_bias' is true: MLP biases (gate_proj, up_proj, down_proj) are not supported")


# transformers' defaults where config.json has no max_position_embeddings
_MAX_POSITIONS = {"LlamaForCausalLM": 2048, "MistralForCausalLM": 4096 * 32, "Qwen2ForCausalLM": 32768,
                  "Qwen3ForCausalLM": 32768}


def _sliding_window(d: dict[str, Any], arch: str, num_layers: int) -> tuple[int | None, tuple[int, ...] | None]:
    """(window, the layers that have it; None: all), as transformers reads the config: Mistral's
    `sliding_window` (default 4096; null: none); Qwen's only with `use_sliding_window`, and then on
    the layers from `max_window_layers` (default 28) on; `layer_types` where the config lists them."""
    if arch == "LlamaForCausalLM":
        return None, None
    qwen = arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
    if qwen and not _hf_bool(d, "use_sliding_window", False):
        return None, None
    window = _hf_number(d, "sliding_window", int, 4096 if "sliding_window" not in d else None)
    if window is None:
        return None, None
    types = d.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers or \
                not set(types) <= {"full_attention", "sliding_attention"}:
            raise ValueError(f"config key 'layer_types' is {types!r}; it must list 'full_attention' or "
                             f"'sliding_attention' for each of the {num_layers} layers")
        windowed = [t == "sliding_attention" for t in types]
    elif qwen:
        first = d.get("max_window_layers", 28)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ValueError(f"config key 'max_window_layers' is {first!r}; it must be an integer >= 0")
        windowed = [i >= first for i in range(num_layers)]
    else:
        windowed = [True] * num_layers
    if all(windowed):
        return window, None
    if not any(windowed):
        return None, None
    return window, tuple(i for i, w in enumerate(windowed) if w)


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
