"""The prefix cache evicts the leaf expected back last (engine/kv/reuse.py), not the least
recently used one: in a chat the conversation idle longest is the one due back next. Each test
is built so that LRU would pick another page than the one asserted."""
import pytest

from engine.kv.pages import PagePool, PageTable
from engine.kv.prefix import PrefixCache, chain_root, page_hashes

T = 4   # tokens a page


def _root():
    return chain_root("native", "fp", "tenant", T)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _turn(cache, clock, at, tokens):
    """One request at time `at`: look its prompt up, write the rest, publish, finish."""
    clock.now = at
    table = PageTable(cache.pool)
    table.pages = cache.lookup(_root(), tokens)
    table.ensure(len(tokens))
    cache.insert(_root(), tokens, table.pages)
    table.release()


def _cached(cache, tokens):
    """How many of tokens' full pages are cached (without touching them)."""
    n = 0
    for h in page_hashes(_root(), tokens, T):
        if h not in cache:
            break
        n += 1
    return n


def _cache(pages):
    clock = Clock()
    return PrefixCache(PagePool(pages, T), clock=clock), clock


def test_the_conversation_due_next_keeps_its_pages():
    cache, clock = _cache(8)
    a, b, c = ([k] * 8 for k in (1, 2, 3))         # three conversations of 2 pages each
    for at, conv in enumerate((a, b, c)):
        _turn(cache, clock, at, conv)
    a2 = a + [9] * 4                                # a's next turn, 5 s after its first
    _turn(cache, clock, 5.0, a2)
    clock.now = 6.0   # b is due now (5 s after t=1), c at 7, a at 10: a's newest page goes
    assert cache.evict(1) == 1
    assert (_cached(cache, b), _cached(cache, c), _cached(cache, a2)) == (2, 2, 2)


def test_an_abandoned_chain_goes_before_a_slower_live_one():
    cache, clock = _cache(16)
    slow, fast = [1] * 8, [2] * 8
    _turn(cache, clock, 0.0, slow)
    _turn(cache, clock, 20.0, slow + [3] * 4)       # a 20 s pace, last used at 20
    _turn(cache, clock, 30.0, fast)
    _turn(cache, clock, 31.0, fast + [4] * 4)       # a 1 s pace, last used at 31
    clock.now = 45.0   # fast: silent for 14 of its 1 s intervals (gone); slow: 25 of 20 s
    assert cache.evict(3) == 3
    assert (_cached(cache, slow + [3] * 4), _cached(cache, fast + [4] * 4)) == (3, 0)


def test_a_branch_its_chain_went_on_without_goes_first():
    cache, clock = _cache(16)
    other, history = [1] * 8, [2] * 8
    _turn(cache, clock, 0.0, other)
    _turn(cache, clock, 1.0, history + [5] * 4)     # a reply page the next turn re-renders
    _turn(cache, clock, 5.0, other + [6] * 4)       # learns a 5 s interval
    _turn(cache, clock, 6.0, history + [7] * 4)     # the next turn: history, then new text
    clock.now = 7.0
    assert cache.evict(1) == 1
    assert _cached(cache, history + [5] * 4) == 2   # the page left behind went
    assert (_cached(cache, history + [7] * 4), _cached(cache, other + [6] * 4)) == (3, 3)


def test_retried_lookups_are_one_reuse():
    cache, clock = _cache(8)
    tokens = [1] * 8 + [2]
    _turn(cache, clock, 0.0, tokens)
    for k in range(5):   # a request waiting for room looks its prefix up at every attempt
        clock.now = 5.0 + 0.01 * k
        cache.pool.free(cache.lookup(_root(), tokens))
    assert cache.typical_reuse_s == pytest.approx(5.0)


def test_with_no_reuse_seen_the_order_is_lru():
    cache, clock = _cache(8)
    first, second = [1] * 4, [2] * 4
    _turn(cache, clock, 0.0, first)
    _turn(cache, clock, 1.0, second)
    assert cache.typical_reuse_s is None
    assert cache.evict(1) == 1 and (_cached(cache, first), _cached(cache, second)) == (0, 1)
