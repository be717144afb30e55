import random

import pytest

from runtime.page_allocator import PageAllocator


def test_allocate_all_then_nothing_fits():
    a = PageAllocator(8)
    got = a.allocate(5)
    assert len(set(got)) == 5 and all(0 <= p < 8 for p in got)
    assert a.allocate(4) is None  # all-or-nothing: 3 left
    assert a.num_free == 3 and a.num_referenced == 5
    rest = a.allocate(3)
    assert set(got) | set(rest) == set(range(8))
    assert a.allocate(1) is None
    assert a.usage == 1.0
    a.check_invariants()


def test_refcounts_and_free():
    a = PageAllocator(4)
    (p,) = a.allocate(1)
    a.incref([p])
    assert a.refcount(p) == 2
    a.decref([p])
    assert a.refcount(p) == 1 and a.num_free == 3
    a.decref([p])
    assert a.refcount(p) == 0 and a.num_free == 4 and a.num_referenced == 0
    with pytest.raises(ValueError, match="refcount 0"):
        a.decref([p])
    with pytest.raises(ValueError, match="free"):
        a.incref([p])
    a.check_invariants()


def test_cached_pages_are_kept_then_evicted_lru_first():
    a = PageAllocator(4)
    evicted = []
    a.set_evict_callback(evicted.append)
    pages = a.allocate(3)
    for p in pages:
        a.mark_cacheable(p)
    a.decref([pages[1]])
    a.decref([pages[0]])
    a.decref([pages[2]])  # LRU order now: pages[1], pages[0], pages[2]
    assert a.num_cached == 3 and a.num_free == 1 and a.num_available == 4
    a.check_invariants()
    # A cached page that is referenced again is no longer evictable.
    a.incref([pages[0]])
    assert not a.is_cached(pages[0]) and a.refcount(pages[0]) == 1
    got = a.allocate(2)  # the free page first, then the least recently used cached one
    assert pages[1] in got and evicted == [pages[1]]
    got2 = a.allocate(1)
    assert got2 == [pages[2]] and evicted == [pages[1], pages[2]]
    assert a.allocate(1) is None
    a.check_invariants()


def test_mark_cacheable_requires_reference_and_uncache_frees():
    a = PageAllocator(2)
    with pytest.raises(ValueError, match="refcount 0"):
        a.mark_cacheable(0)
    (p,) = a.allocate(1)
    a.mark_cacheable(p)
    a.decref([p])
    assert a.is_cached(p)
    a.uncache(p)
    assert not a.is_cached(p) and a.num_free == 2
    with pytest.raises(ValueError, match="not cached"):
        a.uncache(p)
    a.check_invariants()


def test_bad_sizes():
    with pytest.raises(ValueError, match="positive"):
        PageAllocator(0)
    with pytest.raises(ValueError):
        PageAllocator(3).allocate(-1)


def test_random_operations_keep_invariants():
    rng = random.Random()
    a = PageAllocator(32)
    a.set_evict_callback(lambda p: None)
    held: list[int] = []  # one entry per reference
    for _ in range(2000):
        op = rng.random()
        if op < 0.35:
            n = rng.randint(0, 6)
            avail = a.num_available
            got = a.allocate(n)
            assert (got is None) == (n > avail)
            if got:
                held += got
                for p in got:
                    if rng.random() < 0.5:
                        a.mark_cacheable(p)
        elif op < 0.5 and held:
            p = rng.choice(held)
            a.incref([p])
            held.append(p)
        elif held:
            p = held.pop(rng.randrange(len(held)))
            a.decref([p])
        a.check_invariants()
        assert a.num_referenced == len(set(held))
        assert a.num_free + a.num_cached + a.num_referenced == 32
