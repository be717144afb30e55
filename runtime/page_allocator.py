"""Host-side allocator of KV page ids: free list, refcounts, and the LRU of cached pages.

Every page id in [0, num_pages) is in exactly one state:
  free        refcount 0, holds nothing anyone wants; on the free list.
  cached      refcount 0, but the prefix cache maps a hash to it; evictable, kept in LRU order.
  referenced  refcount > 0 (held by one or more sequences; may also be mapped by the prefix cache).
free + cached + referenced == num_pages, always (check_invariants).

The allocator never touches device memory: it hands out ids of pages in runtime/kv_cache.py's pool.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable, Iterable


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
        self.num_pages = num_pages
        self._refcount = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._is_free = [True] * num_pages
        self._cacheable = [False] * num_pages  # the prefix cache maps a hash to this page
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached pages, least recent first
        self._num_referenced = 0
        self._on_evict: Callable[[int], None] | None = None

    # -- counts ---------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._evictable)

    @property
    def num_referenced(self) -> int:
        return self._num_referenced

    @property
    def num_available(self) -> int:
        """Pages an allocate() can hand out now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of the pool held by live sequences (cached pages count as reusable)."""
        return self._num_referenced / self.num_pages

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def is_cached(self, page: int) -> bool:
        """True while the page is unreferenced but kept for the prefix cache (evictable)."""
        return page in self._evictable

    # -- the prefix cache's hooks ---------------------------------------------------------------
    def set_evict_callback(self, fn: Callable[[int], None]) -> None:
        """fn(page) runs when a cached page is evicted, before the page is handed out again."""
        self._on_evict = fn

    def mark_cacheable(self, page: int) -> None:
        """The prefix cache now maps a hash to `page`: at refcount 0 it stays cached, not free."""
        if self._refcount[page] <= 0:
            raise ValueError(f"page {page} has refcount {self._refcount[page]}; only held pages can be cached")
        self._cacheable[page] = True

    def uncache(self, page: int) -> None:
        """The prefix cache dropped `page`: an unreferenced one goes back to the free list."""
        if not self._cacheable[page]:
            raise ValueError(f"page {page} is not cached")
        self._cacheable[page] = False
        if page in self._evictable:
            del self._evictable[page]
            self._push_free(page)

    # -- allocation -----------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """n fresh pages with refcount 1, or None (allocating nothing) when fewer are available.

        Free pages go first; then cached pages are evicted, least recently used first.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self.num_available:
            return None
        out = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
                self._is_free[page] = False
            else:
                page, _ = self._evictable.popitem(last=False)
                self._cacheable[page] = False
                if self._on_evict is not None:
                    self._on_evict(page)
            self._refcount[page] = 1
            out.append(page)
        self._num_referenced += n
        return out

    def incref(self, pages: Iterable[int]) -> None:
        """Take another reference; a cached page is revived (no longer evictable)."""
        for page in pages:
            if self._is_free[page]:
                raise ValueError(f"page {page} is free; allocate it instead of incref")
            if self._refcount[page] == 0:
                del self._evictable[page]
                self._num_referenced += 1
            self._refcount[page] += 1

    def decref(self, pages: Iterable[int]) -> None:
        """Drop a reference. At 0 a cached page joins the LRU's most recent end, others are freed.

        Release a sequence's pages last page first, so that its tail is evicted before its head
        (the head is the part other prompts are most likely to share).
        """
        for page in pages:
            rc = self._refcount[page]
            if rc <= 0:
                raise ValueError(f"page {page} has refcount {rc}; decref would make it negative")
            self._refcount[page] = rc - 1
            if rc == 1:
                self._num_referenced -= 1
                if self._cacheable[page]:
                    self._evictable[page] = None
                else:
                    self._push_free(page)

    def _push_free(self, page: int) -> None:
        self._is_free[page] = True
        self._free.append(page)

    # -- checks ---------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError when the pool's bookkeeping is inconsistent."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        cached = set(self._evictable)
        referenced = {p for p in range(self.num_pages) if self._refcount[p] > 0}
        assert all(rc >= 0 for rc in self._refcount), "negative refcount"
        assert not (free & referenced), f"pages both free and referenced: {sorted(free & referenced)}"
        assert not (free & cached), f"pages both free and cached: {sorted(free & cached)}"
        assert not (cached & referenced), f"pages both cached and referenced: {sorted(cached & referenced)}"
        assert len(free) + len(cached) + len(referenced) == self.num_pages, (
            f"free {len(free)} + cached {len(cached)} + referenced {len(referenced)} != {self.num_pages}"
        )
        assert len(referenced) == self._num_referenced, "referenced counter drifted"
        for p in range(self.num_pages):
            assert self._is_free[p] == (p in free), f"page {p}: free flag disagrees with the free list"
            if p in free:
                assert not self._cacheable[p], f"free page {p} is marked cacheable"
            if p in cached:
                assert self._cacheable[p], f"evictable page {p} is not marked cacheable"
