import random

import pytest

from runtime.page_allocator import PageAllocator
from runtime.prefix_cache import PrefixCache

G = 4


def make(num_pages=16, key=None):
    a = PageAllocator(num_pages)
    return a, PrefixCache(a, G, key=key)


def compute(alloc, cache, tokens, salt=None):
    """Allocate pages for `tokens` as a sequence would, and register its full pages."""
    hashes = cache.page_hashes(tokens, salt)
    pages = alloc.allocate(-(-len(tokens) // G))
    cache.insert(hashes, pages[: len(hashes)])
    return hashes, pages


def test_hashes_chain_over_full_pages_only():
    _, c = make()
    toks = list(range(11))
    h = c.page_hashes(toks)
    assert len(h) == 2 and len(set(h)) == 2
    assert c.page_hashes(toks[:8]) == h
    # A page's name depends on everything before it, not just its own tokens.
    other = c.page_hashes([99] + toks[1:8])
    assert other[0] != h[0] and other[1] != h[1]
    # Incremental extension agrees with hashing from scratch.
    inc = h[:1]
    c.extend_hashes(inc, toks, None, 2)
    assert inc == h
    with pytest.raises(ValueError, match="fill"):
        c.extend_hashes([], toks, None, 3)


def test_salts_and_process_keys_separate_chains():
    _, c = make()
    toks = list(range(8))
    assert c.page_hashes(toks, None) != c.page_hashes(toks, "tenant-a")
    assert c.page_hashes(toks, "tenant-a") != c.page_hashes(toks, "tenant-b")
    assert c.page_hashes(toks, "") != c.page_hashes(toks, None)
    _, c2 = make()  # a fresh random key: names cannot be predicted from another instance
    assert c.page_hashes(toks) != c2.page_hashes(toks)
    _, c3 = make(key=b"k")
    _, c4 = make(key=b"k")
    assert c3.page_hashes(toks) == c4.page_hashes(toks)


def test_lookup_finds_longest_prefix_but_never_the_whole_prompt():
    a, c = make()
    prompt = [random.randrange(1000) for _ in range(12)]  # exactly 3 pages
    hashes, pages = compute(a, c, prompt)
    assert c.match(hashes, 12) == pages[:2]  # the last token must be computed for its logits
    assert c.match(hashes, 13) == pages[:3]
    longer = c.page_hashes(prompt + [1, 2, 3, 4, 5])
    assert c.lookup(longer, 17) == pages[:3]
    assert (c.num_query_tokens, c.num_hit_tokens) == (17, 12)
    diverged = c.page_hashes(prompt[:5] + [prompt[5] + 1] + prompt[6:])
    assert c.lookup(diverged, 12) == pages[:1]
    assert (c.num_query_tokens, c.num_hit_tokens) == (29, 16)
    assert c.hit_rate == pytest.approx(16 / 29)
    other_salt = c.page_hashes(prompt, "s")
    assert c.match(other_salt, 13) == []
    a.check_invariants()
    c.check_invariants()


def test_cached_prefix_pages_counts_what_match_would_find():
    a, c = make()
    prompt = [random.randrange(1000) for _ in range(12)]
    compute(a, c, prompt)
    diverged = prompt[:5] + [prompt[5] + 1] + prompt[6:]
    for toks, salt in ((prompt, None), (prompt + [7] * 9, None), (prompt[:9], None), (diverged, None), ([], None),
                       (prompt, "s")):
        assert c.cached_prefix_pages(toks, salt) == len(c.match(c.page_hashes(toks, salt), len(toks)))
    assert [c.cached_prefix_pages(t) for t in (prompt, prompt + [7], diverged)] == [2, 3, 1]
    assert (c.num_query_tokens, c.num_hit_tokens) == (0, 0)  # counts nothing


def test_unreferenced_pages_stay_cached_until_evicted():
    a, c = make(num_pages=4)
    p1 = list(range(100, 108))
    h1, pg1 = compute(a, c, p1)
    a.decref(reversed(pg1))  # the sequence finished: its pages become cached, tail first in LRU
    assert a.num_cached == 2 and a.num_free == 2
    assert c.match(h1, 9) == pg1
    fresh = a.allocate(3)  # 2 free + the LRU cached page (the tail page) is evicted
    assert pg1[1] in fresh and pg1[0] not in fresh
    assert c.match(h1, 9) == pg1[:1] and c.num_cached_pages == 1
    a.decref(fresh)
    a.check_invariants()
    c.check_invariants()


def test_duplicate_insert_keeps_first_page():
    a, c = make()
    toks = list(range(8))
    h, pg = compute(a, c, toks)
    h2 = c.page_hashes(toks)
    pg2 = a.allocate(2)
    assert c.insert(h2, pg2) == 0
    a.decref(pg2)  # never registered: freed, not cached
    assert a.num_cached == 0 and c.match(h, 9) == pg
    with pytest.raises(ValueError, match="hashes"):
        c.insert(h, pg[:1])
    a.check_invariants()
    c.check_invariants()


def test_clear_frees_unreferenced_pages():
    a, c = make()
    h, pg = compute(a, c, list(range(8)))
    a.decref(pg[:1])
    assert c.clear() == 2
    assert a.num_cached == 0 and c.match(h, 9) == []
    a.decref(pg[1:])
    assert a.num_free == 16
    a.check_invariants()
    c.check_invariants()
