"""llama2.c `.bin` checkpoints (the legacy "version 0" export of karpathy/llama2.c), by mmap.

Layout (export.py `legacy_export`, read by run.c `memory_map_weights`): a header of 7 int32
  dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size (negative: separate classifier), seq_len
then float32 arrays, each stacked over layers where it has a layer axis:
  token_embedding [V, D], rms_att [L, D], wq [L, N*H, D], wk [L, K*H, D], wv [L, K*H, D],
  wo [L, D, N*H], rms_ffn [L, D], w1 [L, F, D], w2 [L, D, F], w3 [L, F, D], rms_final [D],
  freq_cis_real [S, H/2], freq_cis_imag [S, H/2] (unused: we compute RoPE), wcls [V, D] if unshared.
Matrices are already `[out, in]` as in HF. llama2.c's model applies RoPE to interleaved pairs, so
q/k rows are permuted to the half-split order here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from models.config import ModelConfig
from runtime.formats.base import CheckpointError, interleaved_to_half_split

_HEADER = 7  # int32 fields
_MAGIC_V1 = 0x616B3432  # "ak42": the newer versioned exports (export.py version 1/2)


class Llama2cSource:
    """Tensors of a llama2.c legacy `.bin`, by HF name, in HF layout (float32)."""

    dtype = np.dtype(np.float32)

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: llama2.c checkpoint does not exist")
        size = self.path.stat().st_size
        if size < 4 * _HEADER:
            raise CheckpointError(f"{self.path}: {size} bytes is too short for a llama2.c header ({4 * _HEADER} bytes)")
        header = np.fromfile(self.path, dtype="<i4", count=_HEADER)
        if int(header[0]) & 0xFFFFFFFF == _MAGIC_V1:
            raise CheckpointError(
                f"{self.path}: llama2.c versioned export (magic 'ak42', version {int(header[1])}) is not "
                f"supported; re-export with export.py --version 0"
            )
        D, F, L, N, K, V, S = (int(x) for x in header)
        shared = V > 0
        V = abs(V)
        for name, v in (("dim", D), ("hidden_dim", F), ("n_layers", L), ("n_heads", N), ("n_kv_heads", K),
                        ("vocab_size", V), ("seq_len", S)):
            if v <= 0:
                raise CheckpointError(f"{self.path}: llama2.c header field {name} is {v}; must be positive")
        if D % N or N % K:
            raise CheckpointError(
                f"{self.path}: llama2.c header has dim {D}, n_heads {N}, n_kv_heads {K}; dim must be a "
                f"multiple of n_heads and n_heads of n_kv_heads"
            )
        H = D // N
        try:
            self.config = ModelConfig(
                name=self.path.stem, vocab_size=V, hidden_size=D, intermediate_size=F, num_layers=L,
                num_heads=N, num_kv_heads=K, head_dim=H, rope_theta=10000.0, rms_norm_eps=1e-5,
                max_position_embeddings=S, tie_word_embeddings=shared,
            )
        except ValueError as e:  # a combination ModelConfig rejects (an odd head_dim, dim / n_heads)
            raise CheckpointError(f"{self.path}: llama2.c header (dim {D}, n_heads {N}) gives an invalid model "
                                  f"config: {e}") from None
        # (name, shape) in file order; the name is our own for the stacked arrays
        layout = [
            ("embed", (V, D)), ("rms_att", (L, D)), ("wq", (L, N * H, D)), ("wk", (L, K * H, D)),
            ("wv", (L, K * H, D)), ("wo", (L, D, N * H)), ("rms_ffn", (L, D)), ("w1", (L, F, D)),
            ("w2", (L, D, F)), ("w3", (L, F, D)), ("rms_final", (D,)), ("freq_cis_real", (S, H // 2)),
            ("freq_cis_imag", (S, H // 2)),
        ]
        if not shared:
            layout.append(("wcls", (V, D)))
        self._offsets, offset = {}, 4 * _HEADER
        for name, shape in layout:
            self._offsets[name] = (offset, shape)
            offset += 4 * int(np.prod(shape))
        if size != offset:
            what = "truncated" if size < offset else "longer than its header implies"
            raise CheckpointError(
                f"{self.path}: {what}: the header (dim {D}, hidden {F}, layers {L}, heads {N}/{K}, vocab "
                f"{V}, seq_len {S}, {'shared' if shared else 'separate'} classifier) needs {offset} bytes; "
                f"the file has {size}"
            )
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._names = {"model.embed_tokens.weight": ("embed", None), "model.norm.weight": ("rms_final", None)}
        if not shared:
            self._names["lm_head.weight"] = ("wcls", None)
        per_layer = {"input_layernorm.weight": "rms_att", "self_attn.q_proj.weight": "wq",
                     "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
                     "self_attn.o_proj.weight": "wo", "post_attention_layernorm.weight": "rms_ffn",
                     "mlp.gate_proj.weight": "w1", "mlp.down_proj.weight": "w2", "mlp.up_proj.weight": "w3"}
        for i in range(L):
            for hf, ours in per_layer.items():
                self._names[f"model.layers.{i}.{hf}"] = (ours, i)

    def _array(self, name: str) -> np.ndarray:
        offset, shape = self._offsets[name]
        n = int(np.prod(shape))
        return self._mm[offset : offset + 4 * n].view("<f4").reshape(shape)

    def keys(self):
        return self._names.keys()

    def get(self, name: str) -> np.ndarray:
        if name not in self._names:
            raise CheckpointError(f"{self.path}: tensor {name!r} is not in a llama2.c checkpoint")
        ours, layer = self._names[name]
        w = self._array(ours)
        if layer is not None:
            w = w[layer]
        if ours == "wq":
            w = interleaved_to_half_split(w, self.config.num_heads)
        elif ours == "wk":
            w = interleaved_to_half_split(w, self.config.num_kv_heads)
        return np.asarray(w, dtype=np.float32)

    def tokenizer_path(self) -> Path | None:
        """A llama2.c tokenizer (`tok*.bin`) beside the checkpoint: `tok{vocab}.bin` first."""
        exact = self.path.with_name(f"tok{self.config.vocab_size}.bin")
        if exact.is_file() and exact != self.path:
            return exact
        found = sorted(p for p in self.path.parent.glob("tok*.bin") if p != self.path)
        return found[0] if found else None
