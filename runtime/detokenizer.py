"""Token ids back to text, whole or streamed.

Every tokenizer we load is reduced to a `PieceTable`: the bytes each id stands for, plus two
rules that are not a property of one token alone:

* the dummy-prefix space. SentencePiece (and llama2.c, and HF `Metaspace`/`Strip` decoders) writes
  the space it prepended while encoding as the first byte of the first piece; decoding drops it.
  `StripMode.FIRST_PIECE` is SentencePiece's rule (the first piece that is not skipped loses one
  leading space, unless it is a byte-fallback or unknown piece, which stand for literal text);
  `StripMode.FIRST_PIECE_ALL` is HF's `Metaspace` decoder's (the first token loses every "▁");
  `StripMode.OUTPUT` is HF's `Fuse` + `Strip(" ", 1, 0)` rule (the decoded text loses one leading
  space).
* invalid UTF-8. Byte-level BPE (GPT-2, Llama 3, Qwen2) decodes like Rust's `from_utf8_lossy`:
  one U+FFFD per maximal invalid subsequence (Python's `errors="replace"` follows the same Unicode
  recommendation). SentencePiece's byte fallback gives one U+FFFD per invalid byte.

The streaming decoder feeds the same bytes to Python's incremental UTF-8 decoder. It holds back an
incomplete multi-byte character until the token that completes it (or `flush`) arrives, which is
what vLLM's prefix_offset/read_offset technique approximates by re-decoding a window and holding
back text that ends in U+FFFD. Working on bytes makes the streamed text equal the full decode by
construction, including for U+FFFD that the model really produced.
"""

from __future__ import annotations

import codecs
import enum
import operator
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cache
from typing import Any


class StripMode(enum.Enum):
    NONE = "none"
    FIRST_PIECE = "first_piece"  # SentencePiece, llama2.c
    FIRST_PIECE_ALL = "first_piece_all"  # HF Metaspace: the first piece loses every "▁"
    OUTPUT = "output"  # HF Fuse + Strip(content=" ", start=1)


class InvalidBytes(enum.Enum):
    REPLACE = "replace"  # one U+FFFD per maximal invalid subsequence (byte-level BPE)
    PER_BYTE = "per_byte"  # one U+FFFD per invalid byte (SentencePiece byte fallback)


# `surrogateescape` turns each undecodable byte into one lone surrogate U+DC80..U+DCFF; valid UTF-8
# never decodes to a surrogate, so mapping that range to U+FFFD gives exactly one per invalid byte.
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_fallback_value(piece: str) -> int | None:
    """The byte a `<0xNN>` byte-fallback piece stands for, else None."""
    m = _BYTE_PIECE.fullmatch(piece)
    return int(m.group(1), 16) if m else None


@cache
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted: printable stand-in character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


@cache
def _byte_level_translation() -> dict[int, int]:
    # Alphabet characters become the byte they stand for (as a code point < 256); characters
    # below 256 outside the alphabet become U+0100 so that the Latin-1 encode below fails.
    table = {ord(c): b for c, b in byte_level_alphabet().items()}
    table.update({x: 0x100 for x in range(256) if x not in table})
    return table


def byte_level_bytes(piece: str) -> bytes:
    """A byte-level BPE token's bytes. Like HF's ByteLevel decoder, a token that uses any character
    outside the alphabet (an added token such as `<｜end▁of▁sentence｜>`) stands for its own UTF-8."""
    try:
        return piece.translate(_byte_level_translation()).encode("latin-1")
    except UnicodeEncodeError:
        return piece.encode("utf-8")


@dataclass(frozen=True, eq=False)
class PieceTable:
    """What each token id decodes to. `pieces[i]` is the bytes of id i (for SentencePiece the
    "▁" is already a space, byte-fallback pieces are their byte)."""

    pieces: tuple[bytes, ...]
    special_ids: frozenset[int]  # dropped when skip_special_tokens
    literal_ids: frozenset[int]  # byte-fallback/unknown pieces: a leading space is real text
    strip: StripMode
    invalid: InvalidBytes
    # A skipped special token between two byte-fallback pieces ends the byte run: SentencePiece
    # decodes piece by piece (<0xC2> <s> <0x80> is two invalid bytes there). HF tokenizers and
    # llama.cpp drop the special token first, so the run goes on (U+0080).
    special_breaks_bytes: bool = False

    @property
    def size(self) -> int:
        return len(self.pieces)

    def padded(self, size: int) -> PieceTable:
        """This table grown to `size` ids, the new ones decoding to nothing (as HF tokenizers
        skips ids it does not know)."""
        return replace(self, pieces=self.pieces + (b"",) * (size - len(self.pieces)))

    def check_id(self, token_id: int) -> int:
        try:
            i = operator.index(token_id)
        except TypeError:
            raise TypeError(f"token ids must be integers; got {token_id!r}") from None
        if not 0 <= i < len(self.pieces):
            raise ValueError(f"token id {i} is out of range; the vocabulary has {len(self.pieces)} ids")
        return i

    def first_piece_bytes(self, token_id: int, piece: bytes) -> bytes:
        """The bytes of the first decoded piece, without the dummy-prefix space when it has one."""
        if token_id in self.literal_ids:
            return piece
        if self.strip is StripMode.FIRST_PIECE and piece[:1] == b" ":
            return piece[1:]
        if self.strip is StripMode.FIRST_PIECE_ALL:
            return piece.replace(b" ", b"")
        return piece

    def bytes_to_text(self, data: bytes) -> str:
        if self.invalid is InvalidBytes.REPLACE:
            return data.decode("utf-8", "replace")
        return unescape_invalid(data.decode("utf-8", "surrogateescape"))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        done: list[str] = []
        first = True
        for token_id in ids:
            i = self.check_id(token_id)
            if skip_special_tokens and i in self.special_ids:
                if self.special_breaks_bytes and out:
                    done.append(self.bytes_to_text(bytes(out)))
                    out.clear()
                continue
            piece = self.pieces[i]
            if not piece:  # (ids past the tokenizer's vocabulary in a model's padded one: PieceTable.padded)
                continue
            if first:
                first = False
                piece = self.first_piece_bytes(i, piece)
            out += piece
        text = "".join(done) + self.bytes_to_text(bytes(out))
        if self.strip is StripMode.OUTPUT and text.startswith(" "):
            text = text[1:]
        return text


@dataclass(frozen=True)
class DecodeRules:
    """How a tokenizer.json's `decoder` turns tokens into text, reduced to per-token bytes plus
    the strip rule. Decoders that need more context (WordPiece's "##", CTC, regex Replace) are
    refused, since a streamed decode could not reproduce them token by token."""

    byte_level: bool = False  # GPT-2 byte-to-unicode alphabet
    byte_fallback: bool = False  # "<0xNN>" pieces are raw bytes
    replace: tuple[tuple[str, str], ...] = ()  # e.g. ("▁", " ")
    strip: StripMode = StripMode.NONE
    spaced: bool = False  # no decoder: HF tokenizers joins the tokens with spaces

    SUPPORTED = ("ByteLevel, Metaspace, Replace (string), ByteFallback, Fuse, Strip(' ', 1, 0), Sequence; "
                 "ByteFallback and Metaspace before any Fuse, Strip after one")

    @classmethod
    def from_hf_decoder(cls, decoder: Mapping[str, Any] | None, source: str) -> DecodeRules:
        fields: dict[str, Any] = {"replace": ()}
        fused = False  # HF decoders work token by token until a Fuse joins them into one string

        def refuse(d: Mapping[str, Any], why: str = "") -> None:
            raise ValueError(f"{source}: tokenizer.json decoder {dict(d)}{why} is not supported; "
                             f"supported: {cls.SUPPORTED}")

        def read(d: Mapping[str, Any]) -> None:
            nonlocal fused
            kind = d.get("type")
            if kind in ("ByteFallback", "Metaspace") and fused:  # (on the joined text they act otherwise)
                refuse(d, " after Fuse")
            if kind == "Strip" and not fused:  # (token by token it strips every token)
                refuse(d, " before a Fuse")
            if kind == "Sequence":
                for sub in d.get("decoders", ()):
                    read(sub)
            elif kind == "ByteLevel":
                fields["byte_level"] = True
            elif kind == "ByteFallback":
                fields["byte_fallback"] = True
            elif kind == "Fuse":
                fused = True
            elif kind == "Metaspace":
                scheme = d.get("prepend_scheme") or ("always" if d.get("add_prefix_space", True) else "never")
                fields["replace"] += ((d.get("replacement", "\u2581"), " "),)
                if scheme != "never":
                    fields["strip"] = StripMode.FIRST_PIECE_ALL
            elif kind == "Replace" and "String" in d.get("pattern", {}):
                fields["replace"] += ((d["pattern"]["String"], d["content"]),)
            elif kind == "Strip" and d.get("content") == " " and d.get("start") == 1 and d.get("stop") == 0:
                fields["strip"] = StripMode.OUTPUT
            else:
                refuse(d)

        if decoder is None:  # a space before every piece, and none before the text's first
            return cls(spaced=True, strip=StripMode.FIRST_PIECE)
        read(decoder)
        return cls(**fields)

    def table(self, pieces: Sequence[str], special_ids: Iterable[int]) -> PieceTable:
        out, literal = [], set()
        for i, piece in enumerate(pieces):
            b = byte_fallback_value(piece) if self.byte_fallback else None
            if b is not None:
                out.append(bytes([b]))
                literal.add(i)
            elif self.byte_level:
                out.append(byte_level_bytes(piece))
            else:
                for old, new in self.replace:
                    piece = piece.replace(old, new)
                out.append((" " + piece if self.spaced else piece).encode("utf-8"))
        return PieceTable(
            pieces=tuple(out),
            special_ids=frozenset(special_ids),
            literal_ids=frozenset(literal),
            strip=self.strip,
            invalid=InvalidBytes.PER_BYTE if self.byte_fallback else InvalidBytes.REPLACE,
        )


def _utf8_length(lead: int) -> int:
    """The length of the UTF-8 sequence a valid lead byte starts."""
    return 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4


def unescape_invalid(text: str) -> str:
    return _ESCAPED_BYTE.sub("\ufffd", text) if _ESCAPED_BYTE.search(text) else text


class IncrementalDetokenizer:
    """Streams text for a growing token sequence: the concatenation of every `step` result and
    `flush()` equals the full decode of all ids stepped.

    `prompt_ids` are consumed without producing text; the outputs are then the tail of
    `decode(prompt_ids + generated)` after `decode(prompt_ids)`. A prompt that ends inside a UTF-8
    character (ids cut from a longer text) holds its bytes back: the first ids that complete the
    character emit it whole; ids that cannot complete it leave it to the prompt, whose decode shows
    it as U+FFFD, and start the output afresh. The prompt matters: after it, the first generated
    "▁Paris" is " Paris", not the "Paris" that starts a text.
    """

    def __init__(self, table: PieceTable, *, skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()):
        self._table = table
        self._skip = skip_special_tokens
        errors = "replace" if table.invalid is InvalidBytes.REPLACE else "surrogateescape"
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors=errors)
        self._first_piece = True  # no piece decoded yet (StripMode.FIRST_PIECE)
        self._first_text = True  # no text produced yet (StripMode.OUTPUT)
        self._flushed = False
        self._carry = b""  # the prompt's unfinished UTF-8 character (`_with_carry`)
        if prompt_ids:
            self._feed(prompt_ids, final=False)
            self._carry = self._utf8.getstate()[0]
            self._utf8.reset()

    def step(self, new_ids: int | Iterable[int]) -> str:
        """Adds generated ids; returns the text they complete (possibly empty)."""
        try:  # one id: an int, a numpy integer, a 0-d array
            new_ids = (operator.index(new_ids),)
        except TypeError:
            pass
        return self._feed(new_ids, final=False)

    def flush(self) -> str:
        """Ends the stream; returns text held back for an incomplete UTF-8 sequence (as U+FFFD)."""
        text = self._feed((), final=True)
        self._flushed = True
        return text

    def _feed(self, ids: Iterable[int], final: bool) -> str:
        if self._flushed:
            raise ValueError("this detokenizer was flushed; start a new one for a new stream")
        table = self._table
        out = bytearray()
        done: list[str] = []
        for token_id in ids:
            i = table.check_id(token_id)
            if self._skip and i in table.special_ids:
                if table.special_breaks_bytes:  # end any pending byte run, as decode() does
                    done.append(self._utf8.decode(self._with_carry(bytes(out), True), True))
                    out.clear()
                continue
            piece = table.pieces[i]
            if not piece:
                continue
            if self._first_piece:
                self._first_piece = False
                piece = table.first_piece_bytes(i, piece)
            out += piece
        text = "".join(done) + self._utf8.decode(self._with_carry(bytes(out), final), final)
        if table.invalid is InvalidBytes.PER_BYTE:
            text = unescape_invalid(text)
        if text and self._first_text:
            self._first_text = False
            if table.strip is StripMode.OUTPUT and text.startswith(" "):
                text = text[1:]
        return text

    def _with_carry(self, data: bytes, final: bool) -> bytes:
        """The bytes to decode for generated `data`, given the prompt's unfinished character: with
        it when `data` completes the character, without it (it stays the prompt's U+FFFD) when
        `data` cannot; nothing while `data` may still complete it and the stream goes on."""
        carry = self._carry
        if not carry:
            return data
        head = data[:_utf8_length(carry[0]) - len(carry)]
        try:
            complete = codecs.getincrementaldecoder("utf-8")().decode(carry + head, False)
        except UnicodeDecodeError:  # the output does not continue the character
            self._carry = b""
            return data
        if complete:
            self._carry = b""
            return carry + data
        # (head is all of data here) still a valid start of the character
        if not final:
            self._carry = carry + data
            return b""
        self._carry = b""  # never completed: decode(prompt + data) shows the bytes as the prompt's did
        return data if self._table.invalid is InvalidBytes.PER_BYTE else b""
