"""The tokenizer a GGUF file carries in its metadata, rebuilt as a standard one.

llama.cpp writes the vocabulary under `tokenizer.ggml.*`: `model` is "llama" (a SentencePiece BPE
vocabulary: tokens, scores, token types with byte-fallback pieces) or "gpt2" (byte-level BPE:
tokens and merges, with the pre-tokenizer named by `tokenizer.ggml.pre`). We rebuild the first as
a real SentencePiece `ModelProto` and the second as an HF `tokenizers` BPE, so encoding runs in
those libraries rather than in a re-implementation.

The metadata is parsed here rather than with `gguf.GGUFReader`: the reader builds numpy views for
every element of every array, which takes ~8 s for a Llama 3 vocabulary (128k tokens, 280k merges)
on our CI machines; reading only the key/value section directly takes a fraction of a second.
The type codes come from the `gguf` package, and a test checks both readers agree.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf.constants import GGUF_MAGIC, GGUFValueType, TokenType

logger = logging.getLogger(__name__)


def is_gguf_file(path: str | os.PathLike) -> bool:
    """A `.gguf` path, or a file that starts with GGUF's magic."""
    p = Path(path)
    with open(p, "rb") as f:
        return p.suffix == ".gguf" or f.read(4) == b"GGUF"

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}


class _Cursor:
    def __init__(self, buf: mmap.mmap, path: Path, endian: str):
        self.buf, self.path, self.endian, self.pos = buf, path, endian, 0

    def scalar(self, fmt: str) -> Any:
        s = struct.Struct(self.endian + fmt)
        if self.pos + s.size > len(self.buf):
            raise ValueError(f"{self.path}: GGUF metadata is truncated at byte {self.pos} (file has {len(self.buf)})")
        (v,) = s.unpack_from(self.buf, self.pos)
        self.pos += s.size
        return v

    def string(self) -> str:
        n = self.scalar("Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"{self.path}: GGUF string of {n} bytes at byte {self.pos} runs past the end of the file")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{self.path}: GGUF string at byte {self.pos - n} is not UTF-8 ({e})") from None

    def strings(self, n: int) -> list[str]:
        # The hot loop for vocabularies (hundreds of thousands of tokens and merges).
        buf, pos, end = self.buf, self.pos, len(self.buf)
        length = struct.Struct(self.endian + "Q").unpack_from
        out = []
        try:
            for _ in range(n):
                (k,) = length(buf, pos)
                pos += 8
                if pos + k > end:
                    raise ValueError(f"{self.path}: GGUF string of {k} bytes at byte {pos} runs past the end")
                out.append(buf[pos : pos + k].decode("utf-8"))
                pos += k
        except struct.error:
            raise ValueError(f"{self.path}: GGUF metadata is truncated at byte {pos}") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{self.path}: GGUF string at byte {pos} is not UTF-8 ({e})") from None
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            etype, n = self.scalar("I"), self.scalar("Q")
            if etype in _SCALAR_FORMATS:
                s = struct.Struct(f"{self.endian}{n}{_SCALAR_FORMATS[etype]}")
                if self.pos + s.size > len(self.buf):
                    raise ValueError(f"{self.path}: GGUF array of {n} values at byte {self.pos} is truncated")
                values = list(s.unpack_from(self.buf, self.pos))
                self.pos += s.size
                return values
            if etype == GGUFValueType.STRING:
                return self.strings(n)
            return [self.value(etype) for _ in range(n)]
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is None:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype} before byte {self.pos}")
        return self.scalar(fmt)


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The key/value metadata of a GGUF file (versions 2 and 3, either byte order), without the
    tensor table or data. Arrays come back as lists."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < 24:
            raise ValueError(f"{path} is not a GGUF file: only {os.fstat(f.fileno()).st_size} bytes")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        (magic,) = struct.unpack_from("<I", buf, 0)
        if magic != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file: magic {bytes(buf[:4])!r}, expected b'GGUF'")
        (version,) = struct.unpack_from("<I", buf, 4)
        endian = "<"
        if version & 0xFFFF == 0:  # a big-endian file reads as version << 16 here
            endian, version = ">", struct.unpack_from(">I", buf, 4)[0]
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
        cur = _Cursor(buf, path, endian)
        cur.pos = 8
        cur.scalar("Q")  # tensor count
        n_kv = cur.scalar("Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.scalar("I"))
        return metadata
    finally:
        buf.close()


# Pre-tokenizer split patterns, by `tokenizer.ggml.pre` (llama.cpp's names; the patterns are the
# ones in each model's own tokenizer.json).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreTokenizer:
    split: str | None  # a regex isolated before byte-level mapping; None: GPT-2's own regex
    individual_digits: bool = False  # StarCoder/SmolLM: every digit is its own pre-token
    nfc: bool = False  # Qwen2's tokenizer.json normalizes to NFC
    ignore_merges: bool = False  # Llama 3: a pre-token that is itself in the vocabulary is one token
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


_LLAMA3 = _PreTokenizer(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True)
_QWEN2 = _PreTokenizer(_QWEN2_SPLIT, nfc=True)
_GPT2 = _PreTokenizer(None)
PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "smollm": _PreTokenizer(None, individual_digits=True),
    # llama.cpp's own "default" is a legacy fallback it warns about; like transformers we read it
    # as GPT-2's byte-level split, which is what files converted from GPT-2-style vocabularies need.
    "default": _GPT2,
    "gpt-2": _GPT2,
}


@dataclass(frozen=True, eq=False)
class GGUFTokenizer:
    """A GGUF's tokenizer as standard parts: exactly one of `sentencepiece_proto` (serialized
    ModelProto) and `hf_tokenizer` (a `tokenizers.Tokenizer`, byte-level BPE) is set."""

    model: str  # tokenizer.ggml.model
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_templates: dict[str, str] = field(default_factory=dict)
    sentencepiece_proto: bytes | None = None
    hf_tokenizer: Any = None


def load_gguf_tokenizer(path: str | os.PathLike) -> GGUFTokenizer:
    path = Path(path)
    meta = read_gguf_metadata(path)
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        raise ValueError(f"{path} has no tokenizer (no tokenizer.ggml.model key)")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"{path} has no tokenizer.ggml.tokens")
    n = len(tokens)
    token_types = meta.get("tokenizer.ggml.token_type") or [int(TokenType.NORMAL)] * n
    if len(token_types) != n:
        raise ValueError(f"{path}: {len(token_types)} token types for {n} tokens")

    def token_id(key: str) -> int | None:
        v = meta.get(f"tokenizer.ggml.{key}")
        if v is None:
            return None
        if not 0 <= v < n:  # (often padding_token_id = n) llama.cpp warns and goes on without it, as here
            logger.warning("%s: tokenizer.ggml.%s is %s, outside the vocabulary of %d; ignored", path, key, v, n)
            return None
        return int(v)

    templates = {
        ("default" if k == "tokenizer.chat_template" else k.removeprefix("tokenizer.chat_template.")): v
        for k, v in meta.items()
        if k == "tokenizer.chat_template" or k.startswith("tokenizer.chat_template.")
    }
    common = dict(
        model=model,
        tokens=tuple(tokens),
        token_types=tuple(int(t) for t in token_types),
        bos_id=token_id("bos_token_id"),
        eos_id=token_id("eos_token_id"),
        pad_id=token_id("padding_token_id"),
        unk_id=token_id("unknown_token_id"),
        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        chat_templates=templates,
    )
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    if model == "llama":
        add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        return GGUFTokenizer(
            **common,
            add_bos=True if add_bos is None else bool(add_bos),
            add_space_prefix=add_prefix,
            sentencepiece_proto=_sentencepiece_proto(path, meta, common, add_prefix),
        )
    if model == "gpt2":
        pre_name = meta.get("tokenizer.ggml.pre", "default")
        if pre_name not in PRE_TOKENIZERS:
            raise ValueError(
                f"{path}: GGUF pre-tokenizer {pre_name!r} (tokenizer.ggml.pre) is not supported; "
                f"supported: {sorted(PRE_TOKENIZERS)}"
            )
        pre = PRE_TOKENIZERS[pre_name]
        return GGUFTokenizer(
            **common,
            add_bos=pre.add_bos if add_bos is None else bool(add_bos),
            add_space_prefix=False,
            hf_tokenizer=_byte_level_bpe(path, meta, pre),
        )
    raise ValueError(f"{path}: GGUF tokenizer model {model!r} is not supported (supported: 'llama', 'gpt2')")


def _sentencepiece_proto(path: Path, meta: dict, common: dict, add_prefix: bool) -> bytes:
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2

    tokens, types = common["tokens"], common["token_types"]
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ValueError(f"{path}: a SentencePiece ('llama') vocabulary needs one tokenizer.ggml.scores per token")
    valid_types = {int(t) for t in TokenType}
    proto = sp_pb2.ModelProto()
    for i, (piece, score, ttype) in enumerate(zip(tokens, scores, types)):
        if ttype not in valid_types:
            raise ValueError(f"{path}: token {i} ({piece!r}) has unknown token type {ttype}")
        p = proto.pieces.add()
        # llama.cpp's token types are SentencePiece's piece types, same numbers.
        p.piece, p.score, p.type = piece, score, ttype
    spec = proto.trainer_spec
    spec.model_type = sp_pb2.TrainerSpec.BPE
    spec.vocab_size = len(tokens)
    spec.byte_fallback = int(TokenType.BYTE) in types
    unk = common["unk_id"]
    if unk is None:
        unk = next((i for i, t in enumerate(types) if t == TokenType.UNKNOWN), None)
    if unk is None:
        raise ValueError(f"{path}: a SentencePiece vocabulary needs an unknown token; none is marked")
    spec.unk_id, spec.unk_piece = unk, tokens[unk]
    for name in ("bos", "eos", "pad"):
        tid = common[f"{name}_id"]
        if tid is not None and tid != unk and types[tid] == TokenType.CONTROL:
            setattr(spec, f"{name}_id", tid)
            setattr(spec, f"{name}_piece", tokens[tid])
        else:
            setattr(spec, f"{name}_id", -1)
    norm = proto.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = add_prefix
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = True
    return proto.SerializeToString()


def _byte_level_bpe(path: Path, meta: dict, pre: _PreTokenizer):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type")
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise ValueError(f"{path}: a byte-level BPE ('gpt2') vocabulary needs tokenizer.ggml.merges")
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise ValueError(f"{path}: merge {m!r} is not two tokens separated by a space")
        pairs.append((a, b))
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"{path}: tokenizer.ggml.tokens has {len(tokens) - len(vocab)} duplicate tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre.ignore_merges, fuse_unk=False))
    if pre.nfc:
        tok.normalizer = normalizers.NFC()
    steps = []
    if pre.individual_digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if pre.split is not None:
        steps.append(pre_tokenizers.Split(Regex(pre.split), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre.split is None))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    if types is not None:
        # llama.cpp matches control and user-defined tokens whole in the text; without this they
        # would be cut into byte-level pieces. They are already in the vocabulary, so no id moves.
        marked = list(zip(tokens, types))
        special = [AddedToken(t, special=True, normalized=False) for t, k in marked if k == TokenType.CONTROL]
        user = [AddedToken(t, special=False, normalized=False) for t, k in marked if k == TokenType.USER_DEFINED]
        tok.add_special_tokens(special)
        tok.add_tokens(user)
        if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
            raise ValueError(f"{path}: marking special tokens grew the vocabulary past {len(tokens)}")
    return tok
