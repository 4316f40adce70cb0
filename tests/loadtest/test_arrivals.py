"""Arrival schedules: rates, burstiness, patterns, scaling, determinism."""
from __future__ import annotations

import math
import random

import pytest

from loadtest import arrivals as A
from loadtest import scenarios


def test_poisson_rate_and_exponential_gaps():
    times = A.poisson_times(20.0, 200.0, random.Random(1))
    n = len(times)
    assert abs(n - 4000) < 4 * math.sqrt(4000)  # 4 sigma of a Poisson count
    gaps = [b - a for a, b in zip(times, times[1:])]
    mean = sum(gaps) / len(gaps)
    cv = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
    assert abs(mean - 0.05) < 0.003 and abs(cv - 1.0) < 0.08
    assert times == sorted(times) and 0 <= times[0] and times[-1] < 200.0


def test_gamma_keeps_rate_but_is_burstier():
    times = A.gamma_times(10.0, 400.0, 0.25, random.Random(2))
    gaps = [b - a for a, b in zip(times, times[1:])]
    mean = sum(gaps) / len(gaps)
    cv = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
    assert abs(len(times) / 400.0 - 10.0) < 1.0
    assert abs(cv - 2.0) < 0.3  # CV of gamma gaps is 1/sqrt(shape)


def test_bursts_are_synchronized():
    times = A.burst_times(size=5, period=2.0, count=3, start=1.0)
    assert times == [1.0] * 5 + [3.0] * 5 + [5.0] * 5


@pytest.mark.parametrize("pattern,gap", [("burst", 0.0), ("stagger-25ms", 0.025),
                                         ("stagger-100ms", 0.1), ("rolling-250ms", 0.25)])
def test_pattern_offsets(pattern, gap):
    offs = A.pattern_offsets(pattern, 4)
    assert offs == pytest.approx([0.0, gap, 2 * gap, 3 * gap])
    with pytest.raises(ValueError):
        A.pattern_offsets("stagger-7ms", 4)


def test_scale_mix_fits_context_and_never_grows():
    assert A.scale_mix([4096, 128, 512, 128], 8192, 64) == [4096, 128, 512, 128]
    scaled = A.scale_mix([4096, 128, 512, 128], 2048, 64)
    assert max(scaled) + 64 <= 0.9 * 2048
    assert scaled[1] < 128 and scaled[0] / scaled[2] == pytest.approx(8, rel=0.02)
    with pytest.raises(ValueError):
        A.scale_mix([4096], 64, 64)


def test_mixed_patterns_layout():
    mix = [400, 10, 50, 10]
    arr = A.mixed_patterns(mix, 64, rounds=2, round_gap=1.0, seed=3)
    # per round: burst 4 + stagger 4 + stagger 4 + rolling 2 passes x 4
    assert len(arr) == 2 * (4 + 4 + 4 + 8)
    first = arr[:20]
    assert [a.pattern for a in first[:4]] == ["burst"] * 4
    assert len({a.t for a in first[:4]}) == 1
    stagger = [a.t for a in first[4:8]]
    assert [round(b - a, 6) for a, b in zip(stagger, stagger[1:])] == [0.025] * 3
    rolling = [a for a in first if a.pattern == "rolling-250ms"]
    assert [a.prompt_tokens for a in rolling] == mix * 2
    assert all(a.max_tokens == 64 for a in arr)
    assert [a.prompt_tokens for a in first[:4]] == mix
    assert len({a.seed for a in arr}) == len(arr)  # every prompt distinct


def test_scenarios_deterministic_by_seed():
    p = scenarios.Params(seed=5, duration=20.0, rate=8.0, context=2048)
    a, b = scenarios.build("poisson", p), scenarios.build("poisson", p)
    assert a.arrivals == b.arrivals
    c = scenarios.build("poisson", scenarios.Params(seed=6, duration=20.0, rate=8.0,
                                                    context=2048))
    assert [x.t for x in c.arrivals] != [x.t for x in a.arrivals]
    assert [x.index for x in a.arrivals] == list(range(len(a.arrivals)))
    assert A.Schedule.from_json(a.to_json()).arrivals == a.arrivals
    assert a.meta["scaled_mix"] == A.scale_mix(A.DEFAULT_MIX, 2048, 64)


def test_overload_is_factor_times_capacity():
    with pytest.raises(ValueError):
        scenarios.build("overload", scenarios.Params())
    s = scenarios.build("overload", scenarios.Params(capacity=4, duration=10.0,
                                                     burst_period=5.0))
    assert len(s.arrivals) == 2 * 12
    assert s.meta["peak_rate_1s"] == 12


def test_peak_rate():
    assert A.peak_rate([0.0, 0.1, 0.2, 1.5, 1.6]) == 3
    assert A.peak_rate([]) == 0


def test_unknown_scenario():
    with pytest.raises(ValueError):
        scenarios.build("nope", scenarios.Params())
