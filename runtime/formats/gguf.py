"""GGUF files (llama.cpp), read through the `gguf` package and presented under HF names and layout.

Metadata becomes a ModelConfig; tensors are dequantized to float32 one at a time on `get`, so host
memory holds one tensor plus the file's mmap. Two layout facts from llama.cpp's converter
(convert_hf_to_gguf.py) matter here:
- ggml lists dimensions innermost first; the reader's numpy arrays are already `[out, in]` (HF order).
- `LlamaModel.modify_tensors` permutes q/k weights (and biases) of the `llama` architecture into
  interleaved RoPE pairs; `Qwen2Model` does not. We undo the permutation for `llama` only.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFReader
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from models.config import ModelConfig, RopeScaling, positive_number, rope_inv_freq
from runtime.formats.base import CheckpointError, interleaved_to_half_split

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SUPPORTED_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K})
_SUPPORTED_NAMES = ", ".join(sorted(q.name for q in SUPPORTED_TYPES))
# the types whose data a byte-swapped file's reader presents as typed numpy arrays; the others are raw
# bytes whose swapping depends on each type's block layout
_SWAPPABLE_TYPES = frozenset({Q.F32, Q.F16})

# GGUF tensor name suffix within a block -> HF name suffix within `model.layers.N.`
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# mixture-of-experts tensors as llama.cpp names them (gguf.constants.TENSOR_NAMES): routers, stacked
# experts, shared experts, and the separate per-expert tensors of GGUFs written before April 2024
_EXPERT_RE = re.compile(r"blk\.\d+\.(ffn_gate_inp\w*|ffn_\w+_(exps|chexps|shexp)|ffn_(gate|up|down)\.\d+|exp_probs_b)"
                        r"\.(weight|bias)")
# llama.cpp's split GGUF names (llama_split_path): PREFIX-00001-of-00003.gguf
_SPLIT_RE = re.compile(r"(.+)-(\d{5})-of-(\d{5})\.gguf")


def hf_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for tensors we don't use."""
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m:
        layer, part, kind = m.groups()
        return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}" if part in _BLOCK_NAMES else None
    base, _, kind = gguf_name.rpartition(".")
    return f"{_TOP_NAMES[base]}.{kind}" if base in _TOP_NAMES and kind in ("weight", "bias") else None


class _BadTensor(Exception):
    """A tensor the plain reader would fail on without naming it (_open adds the file's path)."""


class _Reader(GGUFReader):
    """GGUFReader that names the first tensor it cannot build: one of a ggml type the gguf package does
    not know, whose rows are not whole blocks of its type, or whose data lies past the end of the file
    (the plain reader fails on these with a bare ValueError or numpy reshape error)."""

    def _build_tensors(self, start_offs, fields):
        size = len(self.data)
        for field in fields:
            _, name, _, dims, raw_type, offset = field.parts
            name = bytes(name).decode(errors="replace")
            try:
                qtype = Q(int(raw_type[0]))
            except ValueError:
                raise _BadTensor(
                    f"tensor {name!r} has ggml type code {int(raw_type[0])}, which is not a ggml type this gguf "
                    f"package knows; supported: {_SUPPORTED_NAMES}"
                ) from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            if len(dims) and int(dims[0]) % block:  # ggml stores whole blocks along the innermost dim
                raise _BadTensor(
                    f"tensor {name!r} ({qtype.name}, ggml shape {dims.tolist()}) has rows of {int(dims[0])} "
                    f"elements, not a multiple of {qtype.name}'s block size {block}"
                )
            end = int(start_offs) + int(offset[0]) + int(np.prod(dims)) * type_size // block
            if end > size:
                raise _BadTensor(
                    f"truncated: tensor {name!r} ({qtype.name}, ggml shape "
                    f"{dims.tolist()}) ends at byte {end} but the file has {size} bytes"
                )
        super()._build_tensors(start_offs, fields)


def _open(path: Path) -> _Reader:
    try:
        return _Reader(path)
    except _BadTensor as e:
        raise CheckpointError(f"{path}: {e}") from None
    except (ValueError, KeyError, IndexError, OSError) as e:
        size = path.stat().st_size
        raise CheckpointError(
            f"{path}: not a readable GGUF file of {size} bytes; truncated or corrupt? "
            f"({type(e).__name__}: {e})"
        ) from None


def _split_number(reader: _Reader, path: Path, key: str) -> int | None:
    field = reader.fields.get(key)
    if field is None:
        return None
    v = field.contents()
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise CheckpointError(f"{path}: GGUF metadata key {key!r} is {v!r}; it must be a non-negative integer")
    return v


def _listed(items: list[str], n: int = 4) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def _read(t) -> np.ndarray:
    """A tensor dequantized to float32, in the reader's numpy shape. dequantize views F32 and F16 data
    as native-order floats, so a byte-swapped (big-endian) file's is converted to native order first
    (other types of such a file are refused when it is opened)."""
    data = t.data
    if t.tensor_type in _SWAPPABLE_TYPES:
        data = data.astype(data.dtype.newbyteorder("="), copy=False)
    return np.asarray(dequantize(data, t.tensor_type), dtype=np.float32)


def _f32(x) -> float:
    """A GGUF float32 as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(x)))


class GGUFSource:
    """Tensors of a GGUF file of the llama or qwen2 architecture, by HF name, in HF layout (float32)."""

    dtype = np.dtype(np.float32)  # dequantized weights are exact only in float32

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: GGUF file does not exist")
        shards = self._open_shards()
        self._reader = shards[0][1]  # metadata: a split GGUF's first file holds it all
        self.arch = self._meta("general.architecture", required=True)
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                f"{self.path}: GGUF architecture {self.arch!r} is not supported; supported: "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        self._tensors = {}  # HF name -> ReaderTensor
        self._unmapped = []  # GGUF names of tensors no HF name maps to: loading refuses them
        self._rope_freqs = None  # (read into the config's rope scaling)
        shard_of = {}  # GGUF name -> path of the file holding it
        swapped = []  # tensors we read, of types a byte-swapped file's reader leaves as raw bytes
        for shard, reader in shards:
            for t in reader.tensors:
                if t.name in shard_of:
                    raise CheckpointError(f"{shard}: tensor {t.name!r} is also in {shard_of[t.name]}")
                shard_of[t.name] = shard
                name = hf_name(t.name)
                if name is not None:
                    self._tensors[name] = t
                elif t.name == "rope_freqs.weight":
                    self._rope_freqs = t
                else:
                    self._unmapped.append(t.name)
                if reader.byte_order == "S" and (name or t.name == "rope_freqs.weight") and \
                        t.tensor_type not in _SWAPPABLE_TYPES:
                    swapped.append(f"{t.name!r} ({t.tensor_type.name})")
        if len(shards) > 1:
            # llama.cpp's check (llama_model_loader: "corrupted model: %d tensors expected but %d found")
            want = _split_number(self._reader, self.path, "split.tensors.count")
            if want is not None and want != len(shard_of):
                raise CheckpointError(f"{self.path}: split.tensors.count is {want} but the {len(shards)} split "
                                      f"files hold {len(shard_of)} tensors")
        self._refuse_experts()
        read = [*self._tensors.values(), *([self._rope_freqs] if self._rope_freqs is not None else [])]
        bad = [f"{t.name!r} ({t.tensor_type.name})" for t in read if t.tensor_type not in SUPPORTED_TYPES]
        if bad:  # before any tensor loads, not at the one it reaches last
            raise CheckpointError(f"{self.path}: quantization types not supported: {_listed(bad)}; "
                                  f"supported: {_SUPPORTED_NAMES}")
        if swapped:
            raise CheckpointError(f"{self.path}: only F32 and F16 tensors can be read from a byte-swapped "
                                  f"(big-endian) GGUF file, not {_listed(swapped)}")
        self.config = self._build_config()

    def _open_shards(self) -> list[tuple[Path, _Reader]]:
        """The file's reader, or with a split GGUF (llama.cpp's gguf-split, or convert_hf_to_gguf.py
        --split-max-tensors) those of all its files, as llama_model_loader opens them: the path names
        the first, the others are PREFIX-%05d-of-%05d.gguf beside it, and split.count/split.no agree."""
        first = _open(self.path)
        count = _split_number(first, self.path, "split.count")
        no = _split_number(first, self.path, "split.no") or 0
        if count is None or (count <= 1 and no == 0):
            return [(self.path, first)]
        m = _SPLIT_RE.fullmatch(self.path.name)
        if no != 0:
            hint = (f"; load it from the first, {self.path.with_name(f'{m[1]}-00001-of-{m[3]}.gguf')}"
                    if m else "; load it from the first")
            raise CheckpointError(f"{self.path}: this is file {no + 1} of a split GGUF of {count} files (split.no "
                                  f"is {no}){hint}")
        if m is None or (int(m[2]), int(m[3])) != (1, count):
            raise CheckpointError(f"{self.path}: the first file of a split GGUF of {count} files (split.count) must "
                                  f"be named PREFIX-00001-of-{count:05d}.gguf, so that the others can be found")
        shards = [(self.path, first)]
        for i in range(1, count):
            p = self.path.with_name(f"{m[1]}-{i + 1:05d}-of-{count:05d}.gguf")
            if not p.is_file():
                raise CheckpointError(f"{p}: file {i + 1} of the split GGUF {self.path} does not exist")
            r = _open(p)
            got = (_split_number(r, p, "split.count"), _split_number(r, p, "split.no"))
            if got != (count, i):
                raise CheckpointError(f"{p}: split.count is {got[0]} and split.no {got[1]}, but as file {i + 1} of "
                                      f"the split GGUF {self.path.name} it must be {count} and {i}")
            shards.append((p, r))
        return shards

    def _refuse_experts(self) -> None:
        """A mixture-of-experts model (Mixtral is arch llama) has no dense MLP: refuse it by name rather
        than fail later at a missing mlp.down_proj or run it without its experts."""
        key = f"{self.arch}.expert_count"
        n = self._meta(key, 0)
        experts = [repr(x) for x in self._unmapped if _EXPERT_RE.fullmatch(x)]
        why = ([f"{key} is {n}"] if isinstance(n, int) and n > 0 else []) + (
            [f"{len(experts)} expert tensors: {_listed(experts)}"] if experts else [])
        if why:
            raise CheckpointError(f"{self.path}: mixture-of-experts models are not supported ({'; '.join(why)})")

    # -------------------------------------------------------------------------------- metadata

    def _meta(self, key: str, default=None, *, required: bool = False):
        field = self._reader.fields.get(key)
        if field is None:
            if required:
                raise CheckpointError(f"{self.path}: GGUF metadata key {key!r} is missing")
            return default
        try:
            return field.contents()
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{self.path}: GGUF metadata key {key!r} is not valid UTF-8 ({e})") from None

    def _meta_number(self, key: str, kind: type = int, default=None, *, required: bool = False):
        """A metadata value as a positive int (kind=int) or a positive finite float, else a CheckpointError
        naming the key: int() of a string key or a head count of 0 would fail later without one."""
        v = self._meta(key, required=required)
        if v is None:
            return default
        try:
            return positive_number(v.item() if isinstance(v, np.generic) else v, key, kind, what="GGUF metadata key")
        except ValueError as e:
            raise CheckpointError(f"{self.path}: {e}") from None

    def _build_config(self) -> ModelConfig:
        a = self.arch
        embed = self._tensors.get("model.embed_tokens.weight")
        if embed is None:
            raise CheckpointError(f"{self.path}: GGUF has no token_embd.weight tensor")
        D = self._meta_number(f"{a}.embedding_length", required=True)
        N = self._meta_number(f"{a}.attention.head_count", required=True)
        # the embedding's row count is what the weights were trained with; the token list may be
        # shorter (padded embeddings) but never longer
        V = int(embed.shape[1])
        tokens = self._reader.fields.get("tokenizer.ggml.tokens")
        n_tokens = len(tokens.data) if tokens is not None else 0  # counted without decoding the strings
        if n_tokens > V:
            raise CheckpointError(
                f"{self.path}: tokenizer has {n_tokens} tokens but token_embd.weight has only {V} rows"
            )
        rope_dim = self._meta_number(f"{a}.rope.dimension_count")
        H = self._meta_number(f"{a}.attention.key_length") or rope_dim or D // N
        if rope_dim is not None and rope_dim != H:
            raise CheckpointError(
                f"{self.path}: {a}.rope.dimension_count is {rope_dim} but head_dim is {H}; partial "
                f"rotary embeddings are not supported"
            )
        ctx = self._meta_number(f"{a}.context_length", int, 4096)
        K = self._meta_number(f"{a}.attention.head_count_kv", int, N)
        if N % K:
            raise CheckpointError(
                f"{self.path}: GGUF metadata key '{a}.attention.head_count' is {N}; it must be a multiple of "
                f"{a}.attention.head_count_kv ({K})"
            )
        F = self._meta_number(f"{a}.feed_forward_length", required=True)
        L = self._meta_number(f"{a}.block_count", required=True)
        theta = _f32(self._meta_number(f"{a}.rope.freq_base", float, 10000.0))
        eps = _f32(self._meta_number(f"{a}.attention.layer_norm_rms_epsilon", float, 1e-5))
        try:
            cfg = ModelConfig(
                name=m[1] if (m := _SPLIT_RE.fullmatch(self.path.name)) else self.path.stem,
                vocab_size=V,
                hidden_size=D,
                intermediate_size=F,
                num_layers=L,
                num_heads=N,
                num_kv_heads=K,
                head_dim=int(H),
                rope_theta=theta,
                rms_norm_eps=eps,
                max_position_embeddings=ctx,
                tie_word_embeddings="lm_head.weight" not in self._tensors,
                attention_bias=a == "qwen2" or "model.layers.0.self_attn.q_proj.bias" in self._tensors,
                architecture=SUPPORTED_ARCHITECTURES[a],
            )
        except ValueError as e:  # a combination of values ModelConfig rejects (e.g. an odd head_dim)
            raise CheckpointError(f"{self.path}: GGUF metadata gives an invalid model config: {e}") from None
        return cfg.replace(rope_scaling=self._rope_scaling(cfg))

    def _rope_scaling(self, cfg: ModelConfig) -> RopeScaling | None:
        a = self.arch
        # as llama.cpp reads them (llama_model::load_hparams): the type defaults to linear, the factor
        # is rope.scaling.factor or else the older rope.scale_linear, and a factor of 0 means none
        kind = self._meta(f"{a}.rope.scaling.type", "linear")
        factor_key = f"{a}.rope.scaling.factor"
        if factor_key not in self._reader.fields:
            factor_key = f"{a}.rope.scale_linear"
        raw = self._meta(factor_key)
        factor = None if raw is None or raw == 0 else self._meta_number(factor_key, float)
        linear = None if kind == "none" or factor in (None, 1.0) else factor
        freqs = self._rope_freqs
        if freqs is not None:
            if linear is not None:  # (llama.cpp would apply both)
                raise CheckpointError(f"{self.path}: rope_freqs.weight together with rope scaling type {kind!r} "
                                      f"factor {linear} ({factor_key}) is not supported")
            # llama.cpp stores Llama 3.1's scaling as per-pair frequency divisors (rope_freqs) instead
            # of its parameters; accept them when they are exactly the llama3 rule with the
            # parameters every released Llama 3.x model uses.
            got = _read(freqs).astype(np.float64).reshape(-1)
            orig = self._meta_number(f"{a}.rope.scaling.original_context_length", int, 8192)
            rs = RopeScaling("llama3", float(got.max()), 1.0, 4.0, orig)
            base = rope_inv_freq(cfg.replace(rope_scaling=None)).astype(np.float64)
            want = base / rope_inv_freq(cfg.replace(rope_scaling=rs)).astype(np.float64)
            if got.shape != want.shape or not np.allclose(got, want, rtol=1e-4):
                raise CheckpointError(
                    f"{self.path}: rope_freqs.weight does not match llama3 rope scaling with factor "
                    f"{rs.factor}, low_freq_factor 1, high_freq_factor 4, original context {orig}; "
                    f"other rope frequency factors are not supported"
                )
            return rs
        if linear is None:
            return None
        if kind == "linear":
            return RopeScaling("linear", linear)
        raise CheckpointError(f"{self.path}: rope scaling type {kind!r} is not supported (supported: none, linear, llama3)")

    # --------------------------------------------------------------------------------- tensors

    def keys(self):
        """Every tensor the file holds: by HF name, or by its GGUF name where none maps to it (such
        as a mixture-of-experts block's `ffn_gate_inp`), which no model param is built from."""
        return [*self._tensors, *self._unmapped]

    def get(self, name: str) -> np.ndarray:
        t = self._tensors.get(name)
        if t is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing from the GGUF file")
        w = _read(t)  # (its type was checked when the file was opened)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # ggml order is innermost first
        if w.shape != shape:
            raise CheckpointError(f"{self.path}: tensor {t.name!r} dequantized to {w.shape}; expected {shape}")
        if self.arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = self.config.num_heads if ".q_proj." in name else self.config.num_kv_heads
            w = interleaved_to_half_split(w, heads)
        return w

    def tokenizer_path(self) -> Path | None:
        """The file itself where its metadata holds a tokenizer (runtime.tokenizer builds it from
        `tokenizer.ggml.*`); None where it has none, as for a HF folder without tokenizer files."""
        return self.path if "tokenizer.ggml.model" in self._reader.fields else None
