"""Prefix cache: a hash chain over full KV pages, so prompts that share a prefix share its pages.

Page i of a sequence is named by h_i = sha256(key || h_{i-1} || token ids of page i), with
h_{-1} = sha256(key || cache_salt). `key` is random per PrefixCache (so per process): page names
cannot be predicted or probed from outside it. Different salts give unrelated chains, so tenants
with different salts never share pages. Only full pages are named; a partial last page never is.

Pages are registered once their K/V has been computed. Unreferenced registered pages stay "cached"
in the PageAllocator and are evicted least recently used first when it runs out of free pages.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from typing import Sequence

from runtime.page_allocator import PageAllocator


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int, *, key: bytes | None = None) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self._key = os.urandom(32) if key is None else bytes(key)
        self._page_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        allocator.set_evict_callback(self._evicted)

    @property
    def key(self) -> bytes:
        """The hash chain's secret seed."""
        return self._key

    # -- hashing --------------------------------------------------------------------------------
    def root_hash(self, cache_salt: str | None) -> bytes:
        # surrogatepass: a lone surrogate (JSON allows "\ud800") is a salt like any other
        salt = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode("utf-8", "surrogatepass")
        return hashlib.sha256(self._key + b"root" + salt).digest()

    def extend_hashes(self, hashes: list[bytes], token_ids: Sequence[int], cache_salt: str | None, num_pages: int) -> None:
        """Append chain hashes to `hashes` (a sequence's, in order) until it names `num_pages` pages."""
        G = self.page_size
        if num_pages * G > len(token_ids):
            raise ValueError(f"{len(token_ids)} tokens fill {len(token_ids) // G} pages of {G}, not {num_pages}")
        parent = hashes[-1] if hashes else self.root_hash(cache_salt)
        for i in range(len(hashes), num_pages):
            parent = self._page_hash(parent, token_ids[i * G : (i + 1) * G])
            hashes.append(parent)

    def _page_hash(self, parent: bytes, page_tokens: Sequence[int]) -> bytes:
        """The chain hash of a page: its parent's hash and its own tokens, under the process key."""
        return hashlib.sha256(self._key + parent + array("q", page_tokens).tobytes()).digest()

    def page_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """Chain hashes of every full page of token_ids."""
        out: list[bytes] = []
        self.extend_hashes(out, token_ids, cache_salt, len(token_ids) // self.page_size)
        return out

    # -- lookup and insertion -------------------------------------------------------------------
    def match(self, hashes: Sequence[bytes], num_tokens: int) -> list[int]:
        """Pages of the longest cached prefix of `hashes`, for a sequence of num_tokens tokens.

        Never covers all num_tokens: at least one token must be computed to produce logits, so
        at most (num_tokens - 1) // page_size pages match. Pure: counts nothing, references nothing.
        """
        limit = min(len(hashes), max(num_tokens - 1, 0) // self.page_size)
        out = []
        for h in hashes[:limit]:
            page = self._page_of.get(h)
            if page is None:
                break
            out.append(page)
        return out

    def cached_prefix_pages(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """len(match(page_hashes(token_ids, cache_salt), len(token_ids))), hashing pages only up to
        the first one not cached (one hash for a prompt with nothing cached). Counts nothing."""
        G = self.page_size
        limit = max(len(token_ids) - 1, 0) // G
        parent, n = self.root_hash(cache_salt), 0
        while n < limit:
            parent = self._page_hash(parent, token_ids[n * G : (n + 1) * G])
            if parent not in self._page_of:
                break
            n += 1
        return n

    def lookup(self, hashes: Sequence[bytes], num_tokens: int, *, count: bool = True) -> list[int]:
        """match(), counted in the hit/query statistics unless `count` is false (the scheduler counts
        each prompt once, with record, at its first admission). The caller must incref the pages before
        allocating anything, or an eviction may hand one of them out."""
        pages = self.match(hashes, num_tokens)
        if count:
            self.record(num_tokens, len(pages) * self.page_size)
        return pages

    def record(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Counts a prompt of num_query_tokens tokens whose first num_hit_tokens were cached."""
        self.num_query_tokens += num_query_tokens
        self.num_hit_tokens += num_hit_tokens

    def insert(self, hashes: Sequence[bytes], pages: Sequence[int]) -> int:
        """Register computed full pages: pages[i] holds the page named hashes[i]. Returns how many
        were newly registered. A hash already cached keeps its page (the duplicate is simply not
        cached and is freed with its sequence); a page already registered keeps its name."""
        if len(hashes) != len(pages):
            raise ValueError(f"{len(hashes)} hashes for {len(pages)} pages")
        added = 0
        for h, page in zip(hashes, pages):
            if h in self._page_of or page in self._hash_of:
                continue
            self.allocator.mark_cacheable(page)
            self._page_of[h] = page
            self._hash_of[page] = h
            added += 1
        return added

    def contains(self, h: bytes) -> bool:
        return h in self._page_of

    @property
    def num_cached_pages(self) -> int:
        """Registered pages, referenced or not."""
        return len(self._page_of)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def clear(self) -> int:
        """Forget every page (e.g. after new weights are loaded). Unreferenced ones are freed at
        once; referenced ones are freed by their sequences. Returns how many pages were dropped."""
        n = len(self._hash_of)
        for page in list(self._hash_of):
            self._forget(page)
            self.allocator.uncache(page)
        return n

    def _forget(self, page: int) -> None:
        h = self._hash_of.pop(page)
        del self._page_of[h]

    def _evicted(self, page: int) -> None:
        self._forget(page)

    def check_invariants(self) -> None:
        assert len(self._page_of) == len(self._hash_of), "hash -> page and page -> hash maps differ in size"
        for h, page in self._page_of.items():
            assert self._hash_of.get(page) == h, f"page {page} is mapped inconsistently"
            assert self.allocator.refcount(page) > 0 or self.allocator.is_cached(page), (
                f"cached page {page} is neither referenced nor evictable"
            )
        assert self.allocator.num_cached <= len(self._page_of), "evictable pages the cache does not map"
