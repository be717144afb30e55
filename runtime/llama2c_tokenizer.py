"""llama2.c's tokenizer files (`tokenizer.bin`, `tok512.bin`): reading them, and encoding as
llama2.c's run.c does. Tokenizer.from_llama2c builds a Tokenizer on them."""

from __future__ import annotations

import heapq
import struct
from collections.abc import Sequence
from pathlib import Path


def read_llama2c(path: Path, vocab_size: int | None) -> tuple[list[str], list[float]]:
    """int32 max_token_length, then per token: float32 score, int32 byte length, the bytes."""
    if not path.is_file():
        raise FileNotFoundError(f"llama2.c tokenizer {path} does not exist")
    data = path.read_bytes()
    if len(data) < 4:
        raise ValueError(f"{path} is not a llama2.c tokenizer: {len(data)} bytes")
    (max_len,) = struct.unpack_from("<i", data, 0)
    if not 0 < max_len <= 4096:
        raise ValueError(f"{path} is not a llama2.c tokenizer: max_token_length {max_len}")
    pieces, scores, pos = [], [], 4
    while pos < len(data) and (vocab_size is None or len(pieces) < vocab_size):
        if pos + 8 > len(data):
            raise ValueError(f"{path}: token {len(pieces)} is truncated at byte {pos}")
        score, n = struct.unpack_from("<fi", data, pos)
        pos += 8
        if not 0 <= n <= max_len or pos + n > len(data):
            raise ValueError(
                f"{path}: token {len(pieces)} has length {n} "
                f"(max_token_length {max_len}, {len(data) - pos} bytes left)"
            )
        try:
            pieces.append(data[pos : pos + n].decode("utf-8"))
        except UnicodeDecodeError:
            raise ValueError(f"{path}: token {len(pieces)} is not UTF-8") from None
        scores.append(score)
        pos += n
    if vocab_size is not None and len(pieces) != vocab_size:
        raise ValueError(f"{path} has {len(pieces)} tokens; expected vocab_size {vocab_size}")
    if len(pieces) < 259 or any(pieces[3 + b] != f"<0x{b:02X}>" for b in range(256)):
        raise ValueError(f"{path} is not a llama2.c tokenizer: ids 3..258 are not the byte pieces <0x00>..<0xFF>")
    # The exporter wraps BOS/EOS in newlines for run.c's printing; the pieces are <s> and </s>.
    pieces[1], pieces[2] = pieces[1].strip("\n"), pieces[2].strip("\n")
    return pieces, scores


class Llama2cEncoder:
    """llama2.c's `encode` (run.c): a dummy-prefix " " token, one token per UTF-8 character (or its
    bytes as <0xNN> tokens at ids 3..258), then repeatedly merge the adjacent pair whose
    concatenation is the highest-scoring vocabulary entry, leftmost first on ties. run.c rescans
    the whole sequence per merge; a heap with lazy invalidation gives the same merges in
    O(n log n)."""

    _NO_MERGE = -1e10  # run.c's initial best score: entries at or below it never merge

    def __init__(self, pieces: Sequence[str], scores: Sequence[float]):
        self._scores = list(scores)
        self._ids: dict[str, int] = {}
        for i, p in enumerate(pieces):
            self._ids.setdefault(p, i)
        if " " not in self._ids:
            raise ValueError("llama2.c vocabulary has no ' ' piece for the dummy prefix")

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        ids = self._ids
        syms: list[str] = [" "]
        tokens: list[int] = [ids[" "]]
        for ch in text:
            tid = ids.get(ch)
            if tid is not None:
                syms.append(ch)
                tokens.append(tid)
            else:
                for b in ch.encode("utf-8"):
                    syms.append(f"<0x{b:02X}>")
                    tokens.append(b + 3)
        n = len(syms)
        nxt = list(range(1, n + 1))
        prv = list(range(-1, n - 1))
        heap: list[tuple[float, int, int, str]] = []

        def push(left: int) -> None:
            right = nxt[left]
            if right < n:
                merged = syms[left] + syms[right]
                tid = ids.get(merged)
                if tid is not None and self._scores[tid] > self._NO_MERGE:
                    heapq.heappush(heap, (-self._scores[tid], left, right, merged))

        for i in range(n - 1):
            push(i)
        while heap:
            _, left, right, merged = heapq.heappop(heap)
            if syms[left] is None or syms[right] is None or nxt[left] != right or syms[left] + syms[right] != merged:
                continue  # stale: one side has merged since this pair was queued
            syms[left], tokens[left] = merged, ids[merged]
            syms[right] = None
            nxt[left] = nxt[right]
            if nxt[right] < n:
                prv[nxt[right]] = left
            push(left)
            if prv[left] >= 0:
                push(prv[left])
        return [t for s, t in zip(syms, tokens) if s is not None]
