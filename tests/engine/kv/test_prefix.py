"""Prefix cache bookkeeping: hits, misses, isolation by format/model/tenant, sharing, eviction."""
import pytest

from engine.kv.pages import PagePool, PageTable
from engine.kv.prefix import PrefixCache, chain_root, page_hashes

T = 4
INT4 = "0=affine-v1-k4v4-g64-f32-h64-s1;1=affine-v1-k4v4-g64-f32-h64-s1"
NATIVE = "0=native-v1-f32;1=native-v1-f32"


def _root(storage=INT4, model="fp-a", tenant="t1"):
    return chain_root(storage, model, tenant, T)


def _prefill(pool, cache, root, tokens):
    """What the engine does: reuse cached pages, allocate the rest, register when written."""
    table = PageTable(pool)
    table.pages = cache.lookup(root, tokens)
    table.ensure(len(tokens))
    cache.insert(root, tokens, table.pages)
    return table


def test_hash_chain_covers_full_pages_and_depends_on_everything_before():
    a = page_hashes(_root(), list(range(10)), T)
    assert len(a) == 2                                  # the 2-token tail is not hashed
    b = page_hashes(_root(), [99] + list(range(1, 10)), T)
    assert a[0] != b[0] and a[1] != b[1]                # a change in page 0 changes page 1's key
    assert page_hashes(_root(), list(range(8)), T) == a


def test_hit_shares_pages_and_charges_them_once():
    pool = PagePool(16, T)
    cache = PrefixCache(pool)
    first = _prefill(pool, cache, _root(), list(range(10)))
    used = pool.num_used
    second = _prefill(pool, cache, _root(), list(range(8)) + [50, 51, 52])
    assert second.pages[:2] == first.pages[:2]
    assert pool.num_used == used + 1                    # only the new tail page is allocated
    assert pool.refcount(first.pages[0]) == 3           # two requests + the cache
    assert (cache.hits, cache.hit_tokens) == (1, 8)


def test_miss_on_different_tokens_and_partial_pages():
    pool = PagePool(16, T)
    cache = PrefixCache(pool)
    _prefill(pool, cache, _root(), list(range(6)))
    assert cache.lookup(_root(), [7] + list(range(1, 6))) == []
    assert cache.lookup(_root(), list(range(3))) == []  # shorter than one full page


def test_a_hit_always_leaves_the_last_token_to_compute():
    pool = PagePool(16, T)
    cache = PrefixCache(pool)
    _prefill(pool, cache, _root(), list(range(8)))
    assert len(cache.lookup(_root(), list(range(8)))) == 1   # not 2: token 7 must run
    assert len(cache.lookup(_root(), list(range(9)))) == 2


@pytest.mark.parametrize("other", [
    dict(storage=NATIVE), dict(storage=INT4.replace("k4v4", "k8v4")), dict(model="fp-b"),
    dict(tenant="t2")])
def test_never_shared_across_formats_models_or_tenants(other):
    pool = PagePool(16, T)
    cache = PrefixCache(pool)
    tokens = list(range(12))
    _prefill(pool, cache, _root(), tokens)
    assert cache.lookup(_root(**other), tokens) == []
    assert len(cache.lookup(_root(), tokens)) == 2


def test_root_refuses_empty_bindings():
    with pytest.raises(ValueError):
        chain_root("", "fp", "t", T)
    with pytest.raises(ValueError):
        chain_root(INT4, "fp", "", T)


def test_eviction_frees_only_unheld_leaves_lru_first():
    pool = PagePool(8, T)
    cache = PrefixCache(pool)
    a = _prefill(pool, cache, _root(), list(range(8)))            # chain A: 2 pages
    a_pages = list(a.pages)
    b = _prefill(pool, cache, _root(), [9] * 4 + [1])              # chain B: 1 page + tail
    a.release()
    assert cache.evict(1) == 1                # A's leaf goes first (A's root still has a child)
    assert pool.refcount(a_pages[1]) == 0 and pool.refcount(a_pages[0]) == 1
    held = cache.lookup(_root(), list(range(8)) + [0])
    assert held == a_pages[:1]
    # A's root is now held by that lookup, B's page by request b: nothing is evictable.
    assert cache.evict(10) == 0 and len(cache) == 2
    b.release()
    assert cache.evict(10) == 1 and pool.refcount(held[0]) == 2


def test_evict_walks_chains_leaf_to_root_and_clear_returns_everything():
    pool = PagePool(8, T)
    cache = PrefixCache(pool)
    t = _prefill(pool, cache, _root(), list(range(12)))
    t.release()
    assert pool.num_used == 3 and cache.evict(2) == 2 and len(cache) == 1
    assert cache.lookup(_root(), list(range(13))) != []   # the root page is still reachable
    cache.clear()
    pool.check_consistent()
