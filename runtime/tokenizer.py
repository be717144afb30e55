"""Tokenizers: SentencePiece `.model`, HF `tokenizer.json`, GGUF-embedded, and llama2.c `tok*.bin`.

Encoding runs in the library each format belongs to (sentencepiece, HF `tokenizers`); llama2.c's
format has no library, so its score-driven BPE is implemented here. Decoding goes through one
`PieceTable` per tokenizer (see runtime/detokenizer.py), which is what lets the streaming
detokenizer reproduce the full decode exactly.

Decoding is the inverse of encoding: unlike transformers we never apply
`clean_up_tokenization_spaces` (it rewrites " ." as "." and so cannot be streamed or round-tripped).
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from gguf.constants import TokenType

from runtime.chat_template import render_chat_template, select_chat_template
from runtime.detokenizer import (
    DecodeRules,
    IncrementalDetokenizer,
    InvalidBytes,
    PieceTable,
    StripMode,
    byte_fallback_value,
)
from runtime.gguf_tokenizer import is_gguf_file, load_gguf_tokenizer
from runtime.llama2c_tokenizer import Llama2cEncoder, read_llama2c
from runtime.tool_schema import tool_schemas

# End-of-turn tokens that stop generation when the vocabulary has them as special tokens, beside
# the configured EOS (Llama 3 ends a turn with <|eot_id|> but declares <|end_of_text|> as EOS).
CHAT_END_TOKENS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>", "<end_of_turn>", "<|end|>",
)


class _Encoder(Protocol):
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with no BOS/EOS added."""
        ...


class Tokenizer:
    """One tokenizer, whatever file it came from. Build it with `load_tokenizer` or a `from_*`
    constructor."""

    def __init__(
        self,
        *,
        encoder: _Encoder,
        table: PieceTable,
        pieces: Sequence[str],
        bos_id: int | None,
        eos_ids: Sequence[int],
        pad_id: int | None,
        unk_id: int | None = None,
        add_bos: bool,
        add_eos: bool = False,
        chat_templates: Mapping[str, str] | None = None,
        source: str = "",
    ):
        if len(pieces) != table.size:
            raise ValueError(f"{len(pieces)} pieces for a decoding table of {table.size} ids")
        for name, tid in (("bos", bos_id), ("pad", pad_id), ("unk", unk_id), *(("eos", e) for e in eos_ids)):
            if tid is not None and not 0 <= tid < table.size:
                raise ValueError(f"{name} id {tid} is outside the vocabulary of {table.size}")
        if add_bos and bos_id is None:
            raise ValueError(f"{source}: configured to add BOS but has no BOS token")
        self._encoder = encoder
        self._table = table
        self._pieces = tuple(pieces)
        self._piece_ids: dict[str, int] | None = None
        self._bos_id, self._pad_id, self._unk_id = bos_id, pad_id, unk_id
        specials = table.special_ids
        chat_ends = (i for i in map(self.piece_to_id, CHAT_END_TOKENS) if i is not None and i in specials)
        self._eos_ids = tuple(dict.fromkeys([*eos_ids, *chat_ends]))
        self._add_bos = add_bos
        self._add_eos = add_eos and bool(self._eos_ids)
        self._chat_templates = dict(chat_templates or {})
        self._source = source

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self._source!r}, vocab_size={self.vocab_size}, bos_id={self._bos_id}, "
            f"eos_ids={self._eos_ids}, add_bos={self._add_bos})"
        )

    # --- vocabulary ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._table.size

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends generation; the configured EOS first."""
        return self._eos_ids

    @property
    def eos_id(self) -> int | None:
        return self._eos_ids[0] if self._eos_ids else None

    @property
    def pad_id(self) -> int | None:
        return self._pad_id

    @property
    def unk_id(self) -> int | None:
        return self._unk_id

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids dropped by `decode(..., skip_special_tokens=True)`."""
        return self._table.special_ids

    @property
    def piece_table(self) -> PieceTable:
        """What each id decodes to (bytes, special ids, the dummy-prefix rule)."""
        return self._table

    @property
    def add_bos_token(self) -> bool:
        return self._add_bos

    @property
    def chat_template(self) -> str | None:
        return self._chat_templates.get("default")

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry of an id as the format spells it ("▁Hello", "Ġworld", "<0x0A>")."""
        return self._pieces[self._table.check_id(token_id)]

    def piece_to_id(self, piece: str) -> int | None:
        if self._piece_ids is None:
            ids: dict[str, int] = {}
            for i, p in enumerate(self._pieces):
                ids.setdefault(p, i)
            self._piece_ids = ids
        return self._piece_ids.get(piece)

    # --- encode / decode ----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (`<|im_start|>`) become their
        ids. With `add_special_tokens`, BOS (and EOS) are added when the tokenizer's config says so;
        encode a rendered chat template with `add_special_tokens=False`, as it writes BOS itself."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str; got {type(text).__name__}")
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate ("\ud800", e.g. from a JSON escape)
                raise ValueError(f"text is not valid Unicode: {e.reason} at index {e.start}") from None
        ids = self._encoder.encode(text)
        if add_special_tokens:
            if self._add_bos:
                ids.insert(0, self._bos_id)
            if self._add_eos:
                ids.append(self._eos_ids[0])
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._table.decode(ids, skip_special_tokens)

    def for_model(self, vocab_size: int, model: object = "") -> Tokenizer:
        """This tokenizer for a model with `vocab_size` embedding rows. Itself when they match;
        when the model has more (embeddings padded to a multiple of 64 or 128: Qwen2.5's 151,936
        rows for 151,665 tokens), a copy whose extra ids, which the model may still sample, decode
        to nothing, as HF tokenizers skips ids it does not know; ValueError when it has fewer."""
        n = self.vocab_size
        if vocab_size == n:
            return self
        if vocab_size < n:
            raise ValueError(f"tokenizer {self._source} has {n} tokens; the model {model} has a vocabulary of "
                             f"{vocab_size}: they do not match (pass the model's own tokenizer)")
        out = copy.copy(self)
        out._table = self._table.padded(vocab_size)
        out._pieces = self._pieces + ("",) * (vocab_size - n)
        return out

    def incremental_detokenizer(
        self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        """A streaming decoder whose outputs concatenate to the text of the ids stepped into it
        (after `prompt_ids`, whose text it does not repeat)."""
        return IncrementalDetokenizer(self._table, skip_special_tokens=skip_special_tokens, prompt_ids=prompt_ids)

    # --- chat ---------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Renders `messages` with the model's jinja2 chat template the way transformers does:
        sandboxed, trim_blocks/lstrip_blocks, `raise_exception`, `strftime_now`, HF's `tojson`, and
        bos_token/eos_token/unk_token/pad_token in scope; keys whose value is None dropped and
        `reasoning`/`thinking` also passed as `reasoning_content` (runtime/chat_template.py). Extra
        keyword arguments (`tools`, `documents`, `enable_thinking`, ...) are passed to the template;
        tools given as Python functions as their JSON schemas (runtime/tool_schema.py).
        `chat_template` is the name of one of the model's templates (when it has several) or a
        template text replacing them; without it, `tool_use` is used when `tools` is given and the
        model has one, else `default`. A template that does not parse is a ValueError
        (compile_chat_template); one that raises while rendering, a jinja2 TemplateError.

        continue_final_message (transformers' rule): the text ends where the last message's content
        does, so that generation continues that message (a prefilled assistant reply) instead of
        starting a new one; a ValueError if the template does not write that content, or with
        add_generation_prompt."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set: "
                             "the first continues the last message, the second starts a new one")
        template = self.resolve_chat_template(chat_template, kwargs.get("tools"))
        context = {
            f"{n}_token": self._pieces[i]
            for n, i in (("bos", self._bos_id), ("eos", self.eos_id), ("unk", self._unk_id), ("pad", self._pad_id))
            if i is not None
        }
        context.update(add_generation_prompt=add_generation_prompt, tools=None, documents=None)
        context.update(kwargs, tools=tool_schemas(kwargs.get("tools")))
        return render_chat_template(template, messages, context, continue_final_message=continue_final_message)

    def resolve_chat_template(self, chat_template: str | None = None, tools: Any = None) -> str:
        """The template text apply_chat_template renders with these arguments (select_chat_template)."""
        return select_chat_template(self._chat_templates, chat_template, tools, self._source)

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **options: Any) -> tuple[str, list[int]]:
        """apply_chat_template's text (same arguments) and its ids, encoded without special tokens:
        the template writes BOS and the like itself."""
        text = self.apply_chat_template(messages, add_generation_prompt, **options)
        return text, self.encode(text, add_special_tokens=False)

    # --- constructors -------------------------------------------------------------------------

    @classmethod
    def from_pretrained_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """An HF model folder: tokenizer.json (or tokenizer.model) with tokenizer_config.json,
        special_tokens_map.json, generation_config.json and chat_template.jinja when present."""
        d = Path(path)
        if not d.is_dir():
            raise FileNotFoundError(f"tokenizer folder {d} does not exist")
        cfg = _read_json(d / "tokenizer_config.json")
        special_map = _read_json(d / "special_tokens_map.json")
        gen = _read_json(d / "generation_config.json")
        if (d / "tokenizer.json").is_file():
            parts = _hf_json_parts(d / "tokenizer.json", {**special_map, **cfg})
        elif (d / "tokenizer.model").is_file():
            if cfg.get("split_special_tokens"):
                raise ValueError(f"{d}: split_special_tokens is supported with a tokenizer.json, not a tokenizer.model")
            # decoded as transformers' (fast) tokenizer built from it does
            parts = _transformers_decode(_sentencepiece_parts(
                d / "tokenizer.model", _config_added_tokens(cfg), special_breaks_bytes=False,
                prepend=_spm_prepend_scheme(cfg)), cfg)
        else:
            raise FileNotFoundError(f"{d} has neither tokenizer.json nor tokenizer.model")

        def configured_id(name: str) -> int | None:
            content = _token_content(cfg.get(f"{name}_token", special_map.get(f"{name}_token")))
            if content is None:
                return None
            tid = parts.piece_to_id(content)
            if tid is None:
                raise ValueError(f"{d}: {name}_token {content!r} is not in the vocabulary")
            return tid

        bos = configured_id("bos")
        if bos is None:
            bos = parts.bos_id
        eos = [configured_id("eos"), *_id_list(gen.get("eos_token_id"))]
        if eos[0] is None:
            eos[0] = parts.eos_id
        pad = configured_id("pad")
        if pad is None:
            pad = gen.get("pad_token_id")
        unk = configured_id("unk")
        if (d / "tokenizer.json").is_file():  # its post-processor decides, as in transformers 5
            add_bos, add_eos = parts.add_bos, parts.add_eos
        else:
            add_bos = cfg.get("add_bos_token", parts.add_bos)
            add_eos = cfg.get("add_eos_token", parts.add_eos)
        return cls(
            encoder=parts.encoder,
            table=parts.table,
            pieces=parts.pieces,
            bos_id=bos,
            eos_ids=[e for e in eos if e is not None],
            pad_id=pad,
            unk_id=unk if unk is not None else parts.unk_id,
            add_bos=bool(add_bos) and bos is not None,
            add_eos=bool(add_eos),
            chat_templates=_config_chat_templates(d, cfg),
            source=str(d),
        )

    @classmethod
    def from_sentencepiece(cls, path: str | os.PathLike, *, add_bos: bool = True) -> Tokenizer:
        """A bare SentencePiece `.model`; BOS/EOS/unknown come from the model's trainer spec."""
        parts = _sentencepiece_parts(Path(path), {}, special_breaks_bytes=True)
        return cls(
            encoder=parts.encoder,
            table=parts.table,
            pieces=parts.pieces,
            bos_id=parts.bos_id,
            eos_ids=[parts.eos_id] if parts.eos_id is not None else [],
            pad_id=parts.pad_id,
            unk_id=parts.unk_id,
            add_bos=add_bos and parts.bos_id is not None,
            source=str(path),
        )

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
        """The tokenizer in a GGUF file's metadata (runtime/gguf_tokenizer.py)."""
        g = load_gguf_tokenizer(path)
        if g.sentencepiece_proto is not None:
            parts = _sentencepiece_parts_from_proto(g.sentencepiece_proto, str(path), {}, special_breaks_bytes=False,
                                                    split_user_defined=True)
        else:
            control = {i for i, t in enumerate(g.token_types) if t == TokenType.CONTROL}
            parts = _hf_parts(g.hf_tokenizer, str(path), decoder={"type": "ByteLevel"}, special=control)
        return cls(
            encoder=parts.encoder,
            table=parts.table,
            pieces=g.tokens,
            bos_id=g.bos_id,
            eos_ids=[g.eos_id] if g.eos_id is not None else [],
            pad_id=g.pad_id,
            unk_id=g.unk_id,
            add_bos=g.add_bos and g.bos_id is not None,
            add_eos=g.add_eos,
            chat_templates=g.chat_templates,
            source=str(path),
        )

    @classmethod
    def from_llama2c(cls, path: str | os.PathLike, vocab_size: int | None = None) -> Tokenizer:
        """llama2.c's `tokenizer.bin`/`tok512.bin` (see `runtime.llama2c_tokenizer.Llama2cEncoder`)."""
        pieces, scores = read_llama2c(Path(path), vocab_size)
        table_pieces = []
        literal = set()
        for i, p in enumerate(pieces):
            b = byte_fallback_value(p)
            if b is not None and 3 <= i < 259:
                table_pieces.append(bytes([b]))
                literal.add(i)
            else:
                table_pieces.append(p.encode("utf-8"))
        table = PieceTable(
            pieces=tuple(table_pieces),
            special_ids=frozenset({1, 2}),
            literal_ids=frozenset(literal | {0}),
            strip=StripMode.FIRST_PIECE,
            invalid=InvalidBytes.PER_BYTE,
            special_breaks_bytes=True,  # a SentencePiece model's vocabulary, decoded by its rules
        )
        return cls(
            encoder=Llama2cEncoder(pieces, scores),
            table=table,
            pieces=pieces,
            bos_id=1,
            # llama2.c's models end a story with BOS, never with EOS (2), and run.c stops generating
            # at BOS ("the BOS (=1) token delimits sequences"); without it a story runs on into the next.
            eos_ids=[2, 1],
            pad_id=None,
            unk_id=0,
            add_bos=True,
            source=str(path),
        )


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A tokenizer from a model folder, a `.model`, a `.gguf`, a llama2.c `.bin` or a tokenizer.json."""
    p = Path(path)
    if p.is_dir():
        return Tokenizer.from_pretrained_dir(p)
    if not p.is_file():
        raise FileNotFoundError(f"tokenizer path {p} does not exist")
    if p.name == "tokenizer.json":
        return Tokenizer.from_pretrained_dir(p.parent)
    if is_gguf_file(p):
        return Tokenizer.from_gguf(p)
    if p.suffix == ".model":
        return Tokenizer.from_sentencepiece(p)
    if p.suffix == ".bin":
        return Tokenizer.from_llama2c(p)
    raise ValueError(
        f"cannot tell what tokenizer format {p} is (expected a folder, .model, .gguf, .bin or tokenizer.json)"
    )


# --- format-specific parts ----------------------------------------------------------------------


@dataclass(eq=False)
class _Parts:
    """What a format contributes before the config files are consulted."""

    encoder: _Encoder
    table: PieceTable
    pieces: list[str]
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    unk_id: int | None = None
    add_bos: bool = False
    add_eos: bool = False

    @functools.cached_property
    def _ids(self) -> dict[str, int]:
        ids: dict[str, int] = {}
        for i, p in enumerate(self.pieces):
            ids.setdefault(p, i)
        return ids

    def piece_to_id(self, piece: str) -> int | None:
        return self._ids.get(piece)


class _Added(NamedTuple):
    """A tokenizer_config.json added token, for a SentencePiece model: matched in text literally."""

    content: str
    special: bool
    lstrip: bool = False  # takes the whitespace before it
    rstrip: bool = False  # and after it


class _SentencePieceEncoder:
    """SentencePiece, with special tokens written in the text matched first (sentencepiece itself
    leaves `<s>` as literal characters). With prepend "sentencepiece" (llama.cpp's rule too), each
    stretch of text between special tokens gets its own dummy-prefix space; transformers' Metaspace
    prepend schemes: "always", the same but for a stretch that starts with a space; "first", only
    the stretch the text starts with; "never", none (`bare`: the model without its dummy prefix)."""

    def __init__(self, processor, literal: Mapping[str, int], strips: Mapping[str, tuple[bool, bool]] = {},
                 *, bare=None, prepend: str = "sentencepiece"):
        """strips: (lstrip, rstrip) of the added tokens that take the whitespace beside them (HF's
        AddedToken flags, from a tokenizer_config.json)."""
        self._sp, self._bare, self._prepend = processor, bare, prepend
        self._literal = dict(literal)
        self._strips = dict(strips)
        alternatives = "|".join(re.escape(s) for s in sorted(self._literal, key=len, reverse=True))
        self._split = re.compile(f"({alternatives})") if alternatives else None

    def _encode(self, part: str, first: bool) -> list[int]:
        p = self._prepend
        dummy = (p == "sentencepiece" or (p == "always" and not part.startswith(" "))
                 or (p == "first" and first and not part.startswith(" ")))
        return (self._sp if dummy else self._bare).encode(part)

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return self._encode(text, True)
        ids: list[int] = []
        parts = self._split.split(text)
        for k in range(1, len(parts), 2):  # (the text around a literal is parts[k - 1] and parts[k + 1])
            lstrip, rstrip = self._strips.get(parts[k], (False, False))
            if lstrip:
                parts[k - 1] = parts[k - 1].rstrip()
            if rstrip:
                parts[k + 1] = parts[k + 1].lstrip()
        for k, part in enumerate(parts):
            if k % 2:
                ids.append(self._literal[part])
            elif part:
                ids.extend(self._encode(part, k == 0))
        return ids


# transformers 5's LlamaTokenizer, which it builds from a folder's tokenizer.model
_LLAMA_TOKENIZER_CLASSES = ("LlamaTokenizer", "LlamaTokenizerFast")


def _spm_prepend_scheme(cfg: Mapping[str, Any]) -> str:
    """Where a tokenizer.model folder's text gets SentencePiece's dummy-prefix space, as transformers 5
    encodes it (_get_prepend_scheme): for its LlamaTokenizer, only at the start of the text unless
    the config says `legacy: true` (then before every stretch after a special token too), never
    before a space, and nowhere with `add_prefix_space: false`; other classes keep sentencepiece's
    own rule (every stretch, a space or not)."""
    if cfg.get("tokenizer_class") not in _LLAMA_TOKENIZER_CLASSES:
        return "sentencepiece"
    if cfg.get("add_prefix_space") is False:
        return "never"
    return "always" if cfg.get("legacy", False) else "first"


def _transformers_decode(parts: _Parts, cfg: Mapping[str, Any]) -> _Parts:
    """A tokenizer.model folder's ids decode as transformers 5's tokenizer built from it: <unk> a
    special token shown as written (sentencepiece writes " ⁇ ", never skipped) and, for its
    LlamaTokenizer (unless `add_prefix_space: false`) and a config naming no class (its generic
    conversion), one leading space stripped from the text whatever wrote it (their Strip decoder;
    sentencepiece strips only a first "▁" piece's)."""
    table = parts.table
    pieces, special, strip = list(table.pieces), set(table.special_ids), table.strip
    if parts.unk_id is not None:
        pieces[parts.unk_id] = parts.pieces[parts.unk_id].encode("utf-8")
        special.add(parts.unk_id)
    if cfg.get("tokenizer_class") in (None, *_LLAMA_TOKENIZER_CLASSES):
        strip = StripMode.NONE if _spm_prepend_scheme(cfg) == "never" else StripMode.OUTPUT
    return replace(parts, table=replace(table, pieces=tuple(pieces), special_ids=frozenset(special), strip=strip))


def _sentencepiece_parts(path: Path, added: Mapping[int, _Added], *, special_breaks_bytes: bool,
                         prepend: str = "sentencepiece") -> _Parts:
    if not path.is_file():
        raise FileNotFoundError(f"SentencePiece model {path} does not exist")
    return _sentencepiece_parts_from_proto(path.read_bytes(), str(path), added,
                                           special_breaks_bytes=special_breaks_bytes, prepend=prepend)


def _sentencepiece_parts_from_proto(proto: bytes, source: str, added: Mapping[int, _Added], *,
                                    special_breaks_bytes: bool, split_user_defined: bool = False,
                                    prepend: str = "sentencepiece") -> _Parts:
    """special_breaks_bytes (PieceTable's): decode as sentencepiece does (a bare .model), or as HF
    tokenizers and llama.cpp do (a model folder's tokenizer.model, a GGUF's vocabulary).
    prepend: where the text gets the model's dummy-prefix space (_SentencePieceEncoder).
    split_user_defined: user-defined pieces (a GGUF's added tokens such as <|im_start|>) are split out
    of the text before SentencePiece runs, the text after one starting afresh (with its own dummy
    prefix), and decode as written: llama.cpp's rules for them."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2

    model = sp_pb2.ModelProto()
    try:
        model.ParseFromString(proto)
        if not model.pieces:
            raise ValueError("it has no pieces")
        sp = spm.SentencePieceProcessor(model_proto=proto)
    except Exception as e:  # protobuf's DecodeError, sentencepiece's RuntimeError
        raise ValueError(f"{source} is not a valid SentencePiece model: {e}") from None
    if model.trainer_spec.treat_whitespace_as_suffix:
        raise ValueError(f"{source}: SentencePiece models with treat_whitespace_as_suffix are not supported")
    n = sp.get_piece_size()
    pieces, table, special, literal_ids, literal_text = [], [], set(), set(), {}
    unk_surface = (model.trainer_spec.unk_surface or " \u2047 ").encode("utf-8")
    for i in range(n):
        piece = sp.id_to_piece(i)
        pieces.append(piece)
        if sp.is_byte(i):
            table.append(bytes([byte_fallback_value(piece)]))
            literal_ids.add(i)
        elif sp.is_unknown(i):
            table.append(unk_surface)
            literal_ids.add(i)
            literal_text[piece] = i
        elif sp.is_control(i):
            table.append(piece.encode("utf-8"))
            special.add(i)
            literal_text[piece] = i
        elif split_user_defined and model.pieces[i].type == sp_pb2.ModelProto.SentencePiece.USER_DEFINED:
            table.append(piece.encode("utf-8"))
            literal_ids.add(i)
            literal_text[piece] = i
        else:
            table.append(piece.replace("\u2581", " ").encode("utf-8"))
    # Tokens a tokenizer_config.json adds (a <pad> appended by a fine-tune) are matched literally.
    strips = {}
    for tid, (content, is_special, lstrip, rstrip) in sorted(added.items()):
        if tid < n:
            if pieces[tid] != content:
                raise ValueError(f"{source}: added token {tid} is {content!r} but the model has {pieces[tid]!r}")
        elif tid == len(pieces):
            pieces.append(content)
            table.append(content.encode("utf-8"))
        else:
            raise ValueError(f"{source}: added token id {tid} leaves a gap after the vocabulary of {len(pieces)}")
        literal_text[content] = tid
        literal_ids.add(tid)
        if is_special:
            special.add(tid)
        if lstrip or rstrip:
            strips[content] = (lstrip, rstrip)
    norm = model.normalizer_spec
    if not norm.add_dummy_prefix:
        prepend = "sentencepiece"  # (no dummy prefix to leave out)
    strip_first = norm.add_dummy_prefix or norm.remove_extra_whitespaces  # (a folder's: _transformers_decode)
    bare = None
    if prepend != "sentencepiece":  # the same model without its dummy prefix
        norm.add_dummy_prefix = False
        bare = spm.SentencePieceProcessor(model_proto=model.SerializeToString())
    opt = lambda i: i if i >= 0 else None  # noqa: E731
    return _Parts(
        _SentencePieceEncoder(sp, literal_text, strips, bare=bare, prepend=prepend),
        PieceTable(
            pieces=tuple(table),
            special_ids=frozenset(special),
            literal_ids=frozenset(literal_ids),
            strip=StripMode.FIRST_PIECE if strip_first else StripMode.NONE,
            invalid=InvalidBytes.PER_BYTE,
            special_breaks_bytes=special_breaks_bytes,
        ),
        pieces,
        bos_id=opt(sp.bos_id()),
        eos_id=opt(sp.eos_id()),
        pad_id=opt(sp.pad_id()),
        unk_id=opt(sp.unk_id()),
        add_bos=sp.bos_id() >= 0,
    )


class _HFEncoder:
    def __init__(self, tokenizer):
        self._tok = tokenizer

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids


def _hf_json_parts(path: Path, cfg: Mapping[str, Any]) -> _Parts:
    from tokenizers import Tokenizer as HFTokenizer

    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
        tok = HFTokenizer.from_file(str(path))
    except Exception as e:  # JSONDecodeError, tokenizers' Exception
        raise ValueError(f"{path} is not a valid tokenizer.json: {e}") from None
    # A file saved with truncation or padding on would cut and pad every prompt; transformers
    # ignores both settings of the file too.
    tok.no_truncation()
    tok.no_padding()
    # transformers' split_special_tokens: special tokens written in the text are encoded as text
    tok.encode_special_tokens = bool(cfg.get("split_special_tokens", False))
    _add_config_tokens(tok, spec, cfg, path)
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    parts = _hf_parts(tok, str(path), decoder=spec.get("decoder"), special=special)
    probe = tok.encode("", add_special_tokens=True).ids
    bos = _token_content(cfg.get("bos_token"))
    eos = _token_content(cfg.get("eos_token"))
    parts.bos_id = tok.token_to_id(bos) if bos is not None else None
    parts.eos_id = tok.token_to_id(eos) if eos is not None else None
    # BOS and EOS are what the post-processor adds (transformers 5 encodes through it, whatever the
    # config's add_bos_token says); the tokens it adds are BOS and EOS where the config names none
    # (a bare tokenizer.json of Llama 3 writes <|begin_of_text|> there).
    if parts.bos_id is None and probe and probe[0] in special:
        parts.bos_id = probe[0]
    if parts.eos_id is None and len(probe) > 1 and probe[-1] in special:
        parts.eos_id = probe[-1]
    parts.add_bos = parts.bos_id is not None and probe[:1] == [parts.bos_id]
    parts.add_eos = parts.eos_id is not None and probe[-1:] == [parts.eos_id] and (len(probe) > 1 or not parts.add_bos)
    if parts.add_bos and parts.eos_id == parts.bos_id and len(probe) == 1:
        parts.add_eos = False
    return parts


_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "cls_token", "sep_token", "mask_token")
_ADDED_FLAGS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")


def _add_config_tokens(tok, spec: Mapping[str, Any], cfg: Mapping[str, Any], path: Path) -> None:
    """Add what tokenizer_config.json declares and tokenizer.json lacks, as transformers 5 does: its
    added_tokens_decoder entries (one tokenizer.json holds with other flags takes the config's), then
    the named and additional special tokens."""
    from tokenizers import AddedToken

    have = {t["id"]: t for t in spec.get("added_tokens", ())}
    entries = cfg.get("added_tokens_decoder") or {}
    for key, v in sorted(entries.items(), key=lambda kv: int(kv[0])):
        tid = int(key)
        if not isinstance(v, Mapping) or not isinstance(v.get("content"), str):
            raise ValueError(f"{path.parent}: tokenizer_config.json added_tokens_decoder[{key}] has no content string")
        if tid in have and all(have[tid].get(f) == v.get(f) for f in _ADDED_FLAGS):
            continue
        is_special = bool(v.get("special", False))
        token = AddedToken(v["content"], special=is_special, single_word=bool(v.get("single_word", False)),
                           lstrip=bool(v.get("lstrip", False)), rstrip=bool(v.get("rstrip", False)),
                           normalized=bool(v.get("normalized", not is_special)))
        (tok.add_special_tokens if is_special else tok.add_tokens)([token])
        got = tok.token_to_id(v["content"])
        if got != tid:
            raise ValueError(f"{path.parent}: tokenizer_config.json declares {v['content']!r} as token {tid}, "
                             f"but the vocabulary gives it id {got}")
    extra = cfg.get("additional_special_tokens") or cfg.get("extra_special_tokens") or ()
    named = [cfg.get(n) for n in _NAMED_SPECIAL] + list(extra.values() if isinstance(extra, Mapping) else extra)
    present = {t.content for t in tok.get_added_tokens_decoder().values()}
    for content in map(_token_content, named):
        if isinstance(content, str) and content and content not in present:
            tok.add_special_tokens([AddedToken(content, special=True, normalized=False)])
            present.add(content)


def _hf_parts(tok, source: str, decoder: Mapping[str, Any] | None, special: set[int]) -> _Parts:
    rules = DecodeRules.from_hf_decoder(decoder, source)
    vocab = tok.get_vocab(with_added_tokens=True)
    pieces = [""] * (max(vocab.values()) + 1)
    for piece, i in vocab.items():
        pieces[i] = piece
    return _Parts(_HFEncoder(tok), rules.table(pieces, special), pieces)


# --- config files and chat templates ------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def _token_content(v: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(v, Mapping):
        return v.get("content")
    return v


def _id_list(v: Any) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, list) else [int(v)]


def _config_added_tokens(cfg: Mapping[str, Any]) -> dict[int, _Added]:
    added = cfg.get("added_tokens_decoder", {})
    return {int(k): _Added(v["content"], bool(v.get("special", False)), bool(v.get("lstrip", False)),
                           bool(v.get("rstrip", False))) for k, v in added.items()}


# What Tokenizer.from_pretrained_dir reads from a model folder besides tokenizer* and special_tokens*
# (`xlaserve convert` copies them): files, and the folder of transformers 5's named chat templates.
FOLDER_FILES = ("generation_config.json", "chat_template.jinja", "chat_template.json")
NAMED_CHAT_TEMPLATES = "additional_chat_templates"


def _config_chat_templates(d: Path, cfg: Mapping[str, Any]) -> dict[str, str]:
    """chat_template.jinja with additional_chat_templates/<name>.jinja (transformers 5's files for a
    default and named templates), else chat_template.json, else tokenizer_config.json's
    chat_template (a string or a list of {"name", "template"}): in the order transformers prefers
    them, the template files replacing the config's templates whole."""
    files = {"default": d / "chat_template.jinja"} if (d / "chat_template.jinja").is_file() else {}
    if (d / NAMED_CHAT_TEMPLATES).is_dir():
        files.update((f.name.removesuffix(".jinja"), f)
                     for f in sorted((d / NAMED_CHAT_TEMPLATES).glob("*.jinja")) if f.is_file())
    if files:
        return {name: f.read_text(encoding="utf-8") for name, f in files.items()}
    template = _read_json(d / "chat_template.json").get("chat_template", cfg.get("chat_template"))
    if template is None:
        return {}
    if isinstance(template, str):
        return {"default": template}
    return {t["name"]: t["template"] for t in template}
