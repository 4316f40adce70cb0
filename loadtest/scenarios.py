"""Named scenarios: each turns a few knobs into one fixed `Schedule`.

Names are what `python -m loadtest run --scenario NAME` and the CI test use; the knobs have
defaults so a bare name is a sensible run.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from loadtest import arrivals as A


@dataclass
class Params:
    duration: float | None = None     # seconds of arrivals (scenario default when None)
    rate: float | None = None         # mean req/s for poisson/gamma (scenario default when None)
    seed: int = 0
    mix: tuple = A.DEFAULT_MIX        # prompt lengths before scaling to the context
    context: int = 4096               # model context, tokens
    max_tokens: int = 64
    gamma_shape: float = 0.5
    burst_size: int = 8
    burst_period: float = 5.0
    rounds: int = 3                   # mixed: passes over the four patterns
    round_gap: float = 2.0            # mixed: quiet seconds between pattern groups
    capacity: int | None = None       # overload: advertised concurrent requests
    overload_factor: float = 3.0
    prompt_range: tuple | None = None  # (min, max) tokens drawn uniformly instead of the mix
    count: int | None = None          # poisson/smoke: exactly this many arrivals at `rate`


def _poisson_times(p: Params, rate: float, duration: float, rng) -> list[float]:
    # A fixed count (rate sweeps) keeps every rate's run equally long in requests, so the
    # server reaches the same depth of queue it would under a user's N-request test.
    return (A.poisson_count(p.rate or rate, p.count, rng) if p.count
            else A.poisson_times(p.rate or rate, p.duration or duration, rng))


def _poisson(p: Params, mix, rng):
    times = _poisson_times(p, 4.0, 30.0, rng)
    return A.assign(times, mix, p.max_tokens, "poisson", p.seed)


def _smoke(p: Params, mix, rng):
    times = _poisson_times(p, 2.0, 8.0, rng)
    return A.assign(times, mix, p.max_tokens, "poisson", p.seed)


def _gamma(p: Params, mix, rng):
    times = A.gamma_times(p.rate or 4.0, p.duration or 30.0, p.gamma_shape, rng)
    return A.assign(times, mix, p.max_tokens, f"gamma-{p.gamma_shape:g}", p.seed)


def _bursts(p: Params, mix, rng):
    count = max(1, int((p.duration or 20.0) // p.burst_period))
    times = A.burst_times(p.burst_size, p.burst_period, count)
    return A.assign(times, mix, p.max_tokens, "burst", p.seed)


def _mixed(p: Params, mix, rng):
    return A.mixed_patterns(mix, p.max_tokens, rounds=p.rounds, round_gap=p.round_gap,
                            seed=p.seed)


def _overload(p: Params, mix, rng):
    # Synchronized bursts of factor x the advertised concurrency: the service must refuse the
    # excess cleanly (429/503 + Retry-After) instead of queueing forever or failing.
    if not p.capacity:
        raise ValueError("overload needs the advertised capacity (--capacity or the server's "
                         "/v1/models/capacity feed)")
    size = max(1, round(p.capacity * p.overload_factor))
    count = max(1, int((p.duration or 15.0) // p.burst_period))
    times = A.burst_times(size, p.burst_period, count)
    return A.assign(times, mix, p.max_tokens, "overload", p.seed)


SCENARIOS = {"smoke": _smoke, "poisson": _poisson, "gamma": _gamma, "bursts": _bursts,
             "mixed": _mixed, "overload": _overload}


def build(name: str, params: Params) -> A.Schedule:
    """The schedule of scenario `name`; prompt lengths scaled to `params.context`."""
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; known: {sorted(SCENARIOS)}")
    mix = A.scale_mix(params.mix, params.context, params.max_tokens)
    rng = random.Random(params.seed)
    arrivals = A.sort_and_index(SCENARIOS[name](params, mix, rng))
    if not arrivals:
        raise ValueError(f"scenario {name!r} produced no requests; raise duration or rate")
    if params.prompt_range:
        lo, hi = params.prompt_range
        hi = min(hi, A.scale_mix([hi], params.context, params.max_tokens)[0])
        arrivals = A.with_lengths(arrivals, A.uniform_lengths(len(arrivals), min(lo, hi), hi,
                                                              random.Random(params.seed + 1)))
    meta = {"scenario": name, "params": {**asdict(params), "mix": list(params.mix)},
            "scaled_mix": mix if not params.prompt_range else
            [min(a.prompt_tokens for a in arrivals), max(a.prompt_tokens for a in arrivals)], "requests": len(arrivals),
            "peak_rate_1s": A.peak_rate([a.t for a in arrivals])}
    return A.Schedule(arrivals, meta)
