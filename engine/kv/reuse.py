"""Which cached prefix page to evict first: the one expected back last. No MLX, no pages.

The prefix cache (engine/kv/prefix.py) can only evict leaves. Least recently used is the usual
order, and it is the worst one for chat: a conversation's pages sit idle between its turns, so
when the conversations a replica holds add up to more than its pool, the one idle longest is the
one due back next, and LRU evicts exactly it (the cyclic working set larger than the cache; every
turn can miss). What a serving cache wants is Belady's choice, the page whose next use is
furthest away. It cannot know the future, but a chain's reuse is regular enough to estimate it:

- Each page keeps its chain's reuse interval: the time between two uses of the page, smoothed
  (a conversation's think time plus its wait for admission; a shared system prompt's gap between
  requests). A new page inherits its parent's (a reply continues its conversation's pace); a page
  with no interval seen takes the cache's typical one (the median of the recent ones).
- Its next use is expected one interval after its last. A page idle for more than ABANDON_AFTER
  of its intervals is taken for gone (the conversation ended, the user left); so is a leaf whose
  parent was used after it (its chain came back and went on without it: the previous reply's
  last page where the re-rendered history parts from it, a one-off request's suffix under a
  shared prompt). Those go first, longest idle first, as LRU would order them.
- Then the live ones, the one expected back last first. For conversations at one pace that is
  the one that finished most recently: it loses its tail pages and recomputes them on its next
  turn, while the ones due sooner keep theirs (LRU would evict the next due, whose return then
  evicts the next due after it).
- With no reuse seen yet there is nothing to estimate from: plain LRU.

A page held by a running request is never a candidate (the cache only frees pages it alone
holds), so none of this can take KV from under a request.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

# Idle for more than this many of its reuse intervals: taken for abandoned. Human think times
# vary by a few times around their typical value; a chain silent for four of them has most likely
# ended, and keeping it longer keeps live conversations' pages out.
ABANDON_AFTER = 4.0
# Weight of the newest interval in a page's smoothed one: one odd gap (a turn that queued long)
# moves it halfway, not all the way.
SMOOTHING = 0.5
WINDOW = 64   # recent intervals the typical one is the median of


def smoothed(old: float | None, observed: float) -> float:
    return observed if old is None else old + SMOOTHING * (observed - old)


class ReuseIntervals:
    """Recent reuse intervals seen by one cache (seconds): its typical one is their median."""

    def __init__(self, window: int = WINDOW):
        self._recent: deque[float] = deque(maxlen=window)

    def observe(self, seconds: float) -> None:
        self._recent.append(max(0.0, seconds))

    def typical(self) -> float | None:
        return statistics.median(self._recent) if self._recent else None


@dataclass(frozen=True)
class Candidate:
    """An evictable leaf as the policy sees it."""

    order: int              # the cache's use counter at its last use (larger = more recent)
    used_s: float           # clock time of its last use
    gap_s: float | None     # its chain's smoothed reuse interval, None if never seen
    superseded: bool        # its parent was used after it


def eviction_key(c: Candidate, now_s: float, typical_s: float | None) -> tuple:
    """Sort key over evictable leaves: the smallest is evicted first."""
    if c.superseded:
        return (0, c.order)
    gap = c.gap_s if c.gap_s is not None else typical_s
    if gap is None or now_s - c.used_s > ABANDON_AFTER * gap:
        return (0, c.order)                 # gone, or nothing learned yet: oldest first (LRU)
    return (1, -(c.used_s + gap), -c.order)   # live: the one expected back last first
