"""Page ids, refcounts, free list, growth without copying, double-free detection."""
import pytest
from hypothesis import given, settings, strategies as st

from engine.errors import PageError
from engine.kv.pages import PagePool, PageTable, pages_for


def test_pages_for_rounds_tails_up():
    assert [pages_for(n, 16) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def test_page_size_must_be_power_of_two():
    with pytest.raises(PageError, match="power of two"):
        PagePool(4, 24)


def test_allocate_is_all_or_nothing():
    pool = PagePool(4, 16)
    pool.allocate(3)
    with pytest.raises(PageError, match="out of pages"):
        pool.allocate(2)
    assert pool.num_free == 1


def test_table_grows_by_appending_without_moving_existing_pages():
    pool = PagePool(8, 4)
    t = PageTable(pool)
    t.ensure(5)
    first = list(t.pages)
    assert len(first) == 2 and t.ensure(8) == []
    new = t.ensure(13)
    assert t.pages[:2] == first and len(new) == 2
    assert t.slot(0) == first[0] * 4 and t.slot(6) == first[1] * 4 + 2
    assert t.slot(12) == new[1] * 4


def test_double_free_raises_and_leaves_pool_untouched():
    pool = PagePool(4, 16)
    pages = pool.allocate(2)
    pool.free(pages)
    with pytest.raises(PageError, match="double free"):
        pool.free([pages[0]])
    with pytest.raises(PageError, match="double free"):
        other = pool.allocate(1)
        pool.free(other + other)
    assert pool.refcount(other[0]) == 1
    pool.check_consistent()


def test_shared_page_returns_to_free_list_only_after_last_holder():
    pool = PagePool(2, 16)
    [p] = pool.allocate(1)
    pool.share([p])
    pool.free([p])
    assert pool.refcount(p) == 1 and pool.num_free == 1
    pool.free([p])
    assert pool.num_free == 2
    with pytest.raises(PageError):
        pool.share([p])


def test_unknown_page_id_raises():
    pool = PagePool(2, 16)
    with pytest.raises(PageError, match="unknown page"):
        pool.free([7])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["grow", "release", "share"]), st.integers(0, 7),
                          st.integers(1, 70)), max_size=80))
def test_random_tables_never_leak_or_double_free(ops):
    pool = PagePool(40, 8)
    tables = [PageTable(pool) for _ in range(8)]
    shared: list[int] = []
    for op, i, n in ops:
        t = tables[i]
        if op == "grow":
            try:
                t.ensure(t.capacity_tokens + n)
            except PageError:
                assert pages_for(t.capacity_tokens + n, 8) - len(t.pages) > pool.num_free
        elif op == "release":
            t.release()
        elif t.pages:
            pool.share(t.pages[:1])
            shared.append(t.pages[0])
        pool.check_consistent()
        held = sum(len(t.pages) for t in tables) + len(shared)
        assert sum(pool.refcount(p) for p in range(pool.num_pages)) == held
    for t in tables:
        t.release()
    pool.free(shared)
    assert pool.num_free == pool.num_pages
    pool.check_consistent()
