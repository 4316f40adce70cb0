"""Open-loop arrival schedules, computed up front and shared by every user and every target.

A schedule is a list of `Arrival`s (send time offset, prompt length, output length). It is fixed
before the run starts, so a slow server cannot slow the offered load down (closed-loop users would
quietly do that), and the same schedule can be replayed against several servers. Deterministic by
seed: `random.Random(seed)`, no global state.
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass, field, replace

# Gap between consecutive requests of one pattern group, in seconds.
PATTERN_GAPS = {"burst": 0.0, "stagger-25ms": 0.025, "stagger-100ms": 0.100,
                "rolling-250ms": 0.250}
# A rolling group keeps arriving for this many passes over the mix, so later requests land on a
# server that is already busy decoding the earlier ones (staggers are a single pass).
ROLLING_PASSES = 2
DEFAULT_MIX = (4096, 128, 512, 128)


@dataclass(frozen=True)
class Arrival:
    index: int
    t: float              # seconds after the run's start at which the request is due
    prompt_tokens: int    # target prompt length (the text is built to about this many tokens)
    max_tokens: int
    pattern: str          # which generator placed it ("poisson", "burst", "stagger-25ms", ...)
    seed: int             # seeds this request's prompt text, so prompts differ but replay equal


@dataclass
class Schedule:
    arrivals: list[Arrival]
    meta: dict = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return self.arrivals[-1].t if self.arrivals else 0.0

    def to_json(self) -> str:
        return json.dumps({"meta": self.meta, "arrivals": [asdict(a) for a in self.arrivals]})

    def reseeded(self, replay: int) -> "Schedule":
        """The same send times and prompt lengths with fresh prompt texts: replaying one
        schedule's texts again would hit the prefix caches of servers that keep them, which
        measures the cache, not serving (see docs/lab/benchmarks-loadtest.md)."""
        return Schedule([replace(a, seed=fresh_seed(a.seed, replay)) for a in self.arrivals],
                        {**self.meta, "replay": replay})

    @classmethod
    def from_json(cls, text: str) -> "Schedule":
        obj = json.loads(text)
        return cls([Arrival(**a) for a in obj["arrivals"]], obj.get("meta", {}))


def poisson_times(rate: float, duration: float, rng: random.Random) -> list[float]:
    """Exponential gaps with mean 1/rate, within [0, duration)."""
    return gamma_times(rate, duration, 1.0, rng)


def gamma_times(rate: float, duration: float, shape: float, rng: random.Random) -> list[float]:
    """Gamma gaps with mean 1/rate; shape < 1 is burstier than Poisson, shape 1 is Poisson
    (vLLM's `--burstiness`)."""
    if rate <= 0 or shape <= 0:
        raise ValueError("rate and shape must be positive")
    times, t = [], 0.0
    while True:
        t += rng.gammavariate(shape, 1.0 / (rate * shape))
        if t >= duration:
            return times
        times.append(t)


def poisson_count(rate: float, n: int, rng: random.Random) -> list[float]:
    """Exactly `n` arrivals with exponential gaps of mean 1/rate, the first at t = 0."""
    if rate <= 0 or n < 1:
        raise ValueError("rate must be positive and n at least 1")
    times = [0.0]
    while len(times) < n:
        times.append(times[-1] + rng.expovariate(rate))
    return times


def burst_times(size: int, period: float, count: int, start: float = 0.0) -> list[float]:
    """`count` synchronized bursts of `size` requests, `period` seconds apart."""
    return [start + b * period for b in range(count) for _ in range(size)]


def pattern_offsets(pattern: str, n: int) -> list[float]:
    """Offsets of one group of `n` requests under a named pattern."""
    if pattern not in PATTERN_GAPS:
        raise ValueError(f"unknown pattern {pattern!r}; known: {sorted(PATTERN_GAPS)}")
    return [i * PATTERN_GAPS[pattern] for i in range(n)]


def scale_mix(mix, context: int, max_tokens: int, headroom: float = 0.9) -> list[int]:
    """Shrink a prompt-length mix proportionally so its longest prompt plus the output fits in
    `headroom` of the model's context (never grows it); lengths stay >= 16 tokens."""
    room = int(context * headroom) - max_tokens
    if room < 16:
        raise ValueError(f"context {context} leaves no room for prompts with {max_tokens} output")
    factor = min(1.0, room / max(mix))
    return [max(16, int(n * factor)) for n in mix]


def assign(times: list[float], mix, max_tokens: int, pattern: str, seed: int,
           start_index: int = 0) -> list[Arrival]:
    """Attach prompt lengths (cycling through the mix, so proportions are exact) to send times."""
    return [Arrival(start_index + i, t, int(mix[i % len(mix)]), max_tokens, pattern,
                    seed * 1_000_003 + start_index + i)
            for i, t in enumerate(times)]


def mixed_patterns(mix, max_tokens: int, patterns=tuple(PATTERN_GAPS), rounds: int = 1,
                   round_gap: float = 2.0, seed: int = 0) -> list[Arrival]:
    """The mixed-arrival workload: each pattern in turn places one group over the mix, groups
    separated by `round_gap` seconds of quiet so each pattern's effect is visible on its own."""
    arrivals: list[Arrival] = []
    cursor = 0.0
    for _ in range(rounds):
        for pattern in patterns:
            n = len(mix) * (ROLLING_PASSES if pattern.startswith("rolling") else 1)
            offsets = pattern_offsets(pattern, n)
            group = assign([cursor + o for o in offsets], mix, max_tokens, pattern, seed,
                           start_index=len(arrivals))
            arrivals.extend(group)
            cursor += offsets[-1] + round_gap
    return arrivals


def uniform_lengths(n: int, lo: int, hi: int, rng: random.Random) -> list[int]:
    """`n` prompt lengths drawn uniformly from [lo, hi] tokens."""
    return [rng.randint(lo, hi) for _ in range(n)]


def with_lengths(arrivals: list[Arrival], lengths: list[int]) -> list[Arrival]:
    return [replace(a, prompt_tokens=n) for a, n in zip(arrivals, lengths, strict=True)]


def fresh_seed(seed: int, replay: int) -> int:
    """A request's text seed for replay number `replay`: a hash, so no two replays of a
    bench (targets, rates, repeats) share a prompt, yet each replays the same when re-run."""
    digest = hashlib.sha256(f"{replay}/{seed}".encode()).digest()
    return int.from_bytes(digest[:6], "big")


def sort_and_index(arrivals: list[Arrival]) -> list[Arrival]:
    """Order by send time (stable) and renumber, keeping each request's text seed."""
    ordered = sorted(arrivals, key=lambda a: a.t)
    return [Arrival(i, a.t, a.prompt_tokens, a.max_tokens, a.pattern, a.seed)
            for i, a in enumerate(ordered)]


def peak_rate(times: list[float], window: float = 1.0) -> float:
    """Most arrivals inside any `window`-second span, per second (what the 20 req/s goal bounds)."""
    ts = sorted(times)
    best, lo = 0, 0
    for hi, t in enumerate(ts):
        while t - ts[lo] >= window:
            lo += 1
        best = max(best, hi - lo + 1)
    return best / window
