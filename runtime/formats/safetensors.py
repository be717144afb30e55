"""HF safetensors directories (one `model.safetensors` or a sharded `*.index.json`), read by mmap.

The header is parsed here rather than through `safetensors.safe_open` so that a truncated or corrupt
file is reported with the file, the tensor and the byte counts, and so bf16 maps straight to numpy.
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from models.config import ModelConfig
from runtime.formats.base import CheckpointError

logger = logging.getLogger(__name__)

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}


def _check_entry(path: Path, name: str, info) -> None:
    """A header entry is {"dtype": str, "shape": [int >= 0, ...], "data_offsets": [begin, end]}."""
    if not isinstance(info, dict):
        raise CheckpointError(f"{path}: safetensors header entry for tensor {name!r} is {info!r}; it must be an "
                              f"object with dtype, shape and data_offsets")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in info]
    if missing:
        raise CheckpointError(f"{path}: safetensors header entry for tensor {name!r} has no {', '.join(missing)}")

    def is_int(x):
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    if not isinstance(info["dtype"], str):
        raise CheckpointError(f"{path}: tensor {name!r} has dtype {info['dtype']!r} in the header; it must be a string")
    if not isinstance(info["shape"], list) or not all(map(is_int, info["shape"])):
        raise CheckpointError(f"{path}: tensor {name!r} has shape {info['shape']!r} in the header; it must be a "
                              f"list of non-negative integers")
    offsets = info["data_offsets"]
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(is_int, offsets)) and offsets[0] <= offsets[1]):
        raise CheckpointError(f"{path}: tensor {name!r} has data_offsets {offsets!r} in the header; they must be "
                              f"[begin, end] with 0 <= begin <= end")


class _File:
    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        if size < 8:
            raise CheckpointError(f"{path}: {size} bytes is too short for a safetensors file (needs an 8-byte header length)")
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise CheckpointError(f"{path}: header length {n} exceeds the file size {size}; the file is truncated or not safetensors")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{path}: safetensors header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: safetensors header is a JSON {type(header).__name__}; it must be an object")
        header.pop("__metadata__", None)
        for name, info in header.items():
            _check_entry(path, name, info)
        self.header, self.data_start = header, 8 + n
        end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
        if self.data_start + end > size:
            worst = max(header, key=lambda k: header[k]["data_offsets"][1])
            raise CheckpointError(
                f"{path}: truncated: tensor {worst!r} ends at byte {self.data_start + end} but the file has {size} bytes"
            )
        self._mm = np.memmap(path, dtype=np.uint8, mode="r") if size > self.data_start else None

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        expect = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if end - start != expect:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} spans {end - start} bytes; shape {shape} of {info['dtype']} needs {expect}"
            )
        if expect == 0:
            return np.zeros(shape, dtype)
        raw = self._mm[self.data_start + start : self.data_start + end]
        return raw.view(dtype).reshape(shape)

    def dtype_of(self, name: str):
        return np.dtype(_DTYPES.get(self.header[name]["dtype"], np.float32))


class SafetensorsSource:
    """Tensors of a HF checkpoint directory, by HF name, in HF layout."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{self.path}: no config.json; a HF checkpoint directory needs one")
        try:
            hf_cfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
        try:
            self.config = ModelConfig.from_hf_config(hf_cfg, name=self.path.name)
        except ValueError as e:
            raise CheckpointError(f"{cfg_path}: {e}") from None
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names")
            files = {f: _File(self._need(self.path / f, index)) for f in sorted(set(weight_map.values()))}
            self._where = {name: files[f] for name, f in weight_map.items()}
            absent = next((n for n, f in self._where.items() if n not in f.header), None)
            if absent is not None:
                raise CheckpointError(f"{index} maps tensor {absent!r} to {self._where[absent].path.name}, "
                                      "which does not hold it")
        else:
            single = self.path / "model.safetensors"
            if not single.is_file():
                found = sorted(p.name for p in self.path.glob("*.safetensors"))
                if not found:
                    raise CheckpointError(f"{self.path}: no model.safetensors or model.safetensors.index.json")
                files = [_File(self.path / f) for f in found]
            else:
                files = [_File(single)]
            self._where = {}
            for f in files:
                for name in f.header:
                    if name in self._where:  # (no index says which copy is meant)
                        raise CheckpointError(f"{self.path}: tensor {name!r} is in both {self._where[name].path.name} "
                                              f"and {f.path.name}; without a model.safetensors.index.json it is "
                                              f"unclear which one to load")
                    self._where[name] = f
        self.dtype = next((f.dtype_of(n) for n, f in self._where.items() if n.endswith("_proj.weight")), np.dtype(np.float32))
        if self.config.tie_word_embeddings and not self._stored_head_is_the_embedding():
            self.config = self.config.replace(tie_word_embeddings=False)
        # A tied checkpoint may store the shared matrix as the head alone: transformers 5 then ties the
        # embedding to it (PreTrainedModel.tie_weights), so it is read as the embedding.
        self._stored_as = {}
        if (self.config.tie_word_embeddings and "model.embed_tokens.weight" not in self._where
                and "lm_head.weight" in self._where):
            self._stored_as["model.embed_tokens.weight"] = "lm_head.weight"

    def _stored_head_is_the_embedding(self) -> bool:
        """False where the checkpoint stores an lm_head.weight that differs from the embedding: as
        transformers does (PreTrainedModel.tie_weights), a tied config then loads the stored head
        untied, and logs it. Compared a block at a time, so host memory stays small."""
        head, embed = self._where.get("lm_head.weight"), self._where.get("model.embed_tokens.weight")
        if head is None or embed is None:
            return True
        h, e = head.get("lm_head.weight"), embed.get("model.embed_tokens.weight")
        same = h.shape == e.shape
        if same:
            h, e, step = h.reshape(-1), e.reshape(-1), 1 << 22
            same = all(np.array_equal(h[i : i + step], e[i : i + step]) for i in range(0, h.size, step))
        if not same:
            logger.warning("%s: config.json ties the word embeddings, but lm_head.weight differs from "
                           "model.embed_tokens.weight; loading it as a separate output head, as transformers does",
                           self.path)
        return same

    @staticmethod
    def _need(p: Path, index: Path) -> Path:
        if not p.is_file():
            raise CheckpointError(f"{index} names shard {p.name}, which is missing")
        return p

    def keys(self):
        return self._where.keys() | self._stored_as.keys()

    def get(self, name: str) -> np.ndarray:
        stored = self._stored_as.get(name, name)
        f = self._where.get(stored)
        if f is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
        return f.get(stored)

    def tokenizer_path(self) -> Path | None:
        return self.path if any((self.path / n).is_file() for n in ("tokenizer.json", "tokenizer.model")) else None
