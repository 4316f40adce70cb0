"""Concurrency caps: the formula by hand, uncalibrated quantized identities, seeds, quarantine."""
import pytest

from capacity.caps import CapConfig, concurrency_cap, quality_concurrency, resolve_cap
from capacity.identity import ExecutionKey
from capacity.rates import RateRegistry, RequestSample

INT4 = "kvq-v1:affine-v1-k4v4-g64-f32-h128-s1:prefill=direct"
NATIVE_KEY = ExecutionKey.make("m", "M4|Max", None)
INT4_KEY = ExecutionKey.make("m", "M4|Max", INT4)


@pytest.mark.parametrize("solo,k,ceiling,expected", [
    (95.7, 0.39, 24, 16),   # qc = floor((95.7/15 - 1)/0.39) = floor(13.79) = 13; ceil(15.6) = 16
    (76.0, 0.39, 24, 12),   # qc = floor(10.43) = 10; ceil(12.0) = 12 (not 13: float guard)
    (76.0, 0.39, 8, 8),     # the configured ceiling stays a ceiling
    (15.0, 0.39, 24, 2),    # solo <= floor: qc = 1, ceil(1.2) = 2
    (40.0, 0.0, 6, 6),      # no slowdown: everything up to the ceiling keeps the floor
    (30.0, 0.39, 1, 1),
])
def test_cap_formula_by_hand(solo, k, ceiling, expected):
    assert concurrency_cap(solo, k, ceiling) == expected


def test_quality_concurrency_edge_is_inclusive():
    # solo / (1 + 0.5 * 2) = 15 exactly: B = 2 keeps the floor.
    assert quality_concurrency(30.0, 0.5, 15.0, 24) == 2


def _solo(reg, key, n, tps):
    for _ in range(n):
        reg.record_decode(key, tps, solo=True)


def test_uncalibrated_quantized_is_capped_at_one_then_expands_on_the_fifth_sample():
    reg = RateRegistry()
    cfg = CapConfig(native_seeds={"m": 95.7})
    _solo(reg, NATIVE_KEY, 50, 95.7)                       # plenty of native evidence ...
    _solo(reg, ExecutionKey.make("m", "M3|Pro", INT4), 50, 76.0)   # ... and other-chip int4 evidence
    _solo(reg, INT4_KEY, 4, 76.0)
    d = resolve_cap(reg, INT4_KEY, 24, cfg)
    assert (d.cap, d.source) == (1, "uncalibrated")       # borrows none of it
    reg.record_decode(INT4_KEY, 76.0, solo=False)          # load samples are not solo samples
    assert resolve_cap(reg, INT4_KEY, 24, cfg).cap == 1
    _solo(reg, INT4_KEY, 1, 76.0)                          # the 5th same-identity solo sample
    d = resolve_cap(reg, INT4_KEY, 24, cfg)
    assert (d.cap, d.source, d.solo_tps) == (12, "solo", 76.0)


def test_native_bootstraps_from_seeds_then_measures():
    reg = RateRegistry()
    cfg = CapConfig(native_seeds={"m": 30.0, "m@M4|Max": 95.7})
    assert resolve_cap(reg, NATIVE_KEY, 24, cfg).cap == 16                      # chip seed wins
    d = resolve_cap(reg, ExecutionKey.make("m", "M1", None), 24, cfg)
    assert (d.cap, d.source) == (3, "seed")  # qc = floor((2 - 1)/0.39) = 2; ceil(2.4) = 3
    assert resolve_cap(reg, NATIVE_KEY, 24, CapConfig()).cap == 4              # fallback
    _solo(reg, NATIVE_KEY, 2, 76.0)
    assert resolve_cap(reg, NATIVE_KEY, 24, CapConfig()).source == "undersampled"
    _solo(reg, NATIVE_KEY, 3, 76.0)
    assert resolve_cap(reg, NATIVE_KEY, 24, cfg).source == "solo"


def test_quarantined_identity_stays_at_one():
    reg = RateRegistry()
    bad = ExecutionKey.make("m", "M4|Max", "kvq-v1:affine-v9")
    _solo(reg, bad, 10, 95.7)                              # refused: nothing recorded
    d = resolve_cap(reg, bad, 24, CapConfig(native_seeds={"m": 95.7}))
    assert (d.cap, d.source) == (1, "invalid")


def test_fitted_k_replaces_the_default():
    reg = RateRegistry()
    _solo(reg, NATIVE_KEY, 5, 60.0)
    assert resolve_cap(reg, NATIVE_KEY, 24).cap == 9        # k .39: qc = floor(7.69) = 7; ceil(8.4)
    for b in [1, 2, 3, 4] * 5:                              # measured k = 1.0
        reg.record_request(NATIVE_KEY, RequestSample(10, b, 0.1, (1 + 1.0 * b) / 60))
    d = resolve_cap(reg, NATIVE_KEY, 24)
    assert d.k == pytest.approx(1.0)
    assert d.cap == 4                                       # qc = floor((4 - 1)/1) = 3; ceil(3.6) = 4


def test_the_floor_never_asks_more_than_half_of_the_solo_rate():
    # SmolLM2-135M on a 2-core CPU: 12.6 tok/s alone, k 0.085 (engine bench). A 15 tok/s floor
    # is out of reach even alone; the cap then protects 2x the solo time per token instead.
    assert concurrency_cap(12.6, 0.085, 16, floor_tps=15.0) == 2          # the old rule
    assert concurrency_cap(12.6, 0.085, 16, floor_tps=15.0, max_slowdown=2.0) == 14
    # A fast model keeps the absolute objective: 60 tok/s solo, 15 tok/s floor.
    assert concurrency_cap(60.0, 0.39, 16, 15.0, max_slowdown=2.0) == \
        concurrency_cap(60.0, 0.39, 16, 15.0)


def test_native_starts_from_the_engines_step_profile_and_quantized_does_not():
    reg = RateRegistry()
    native, q = NATIVE_KEY, INT4_KEY
    for key in (native, q):
        # Warm-up: 80 ms per decode step alone, 140 ms at batch 8 -> k = (60/7 ms)/(71.4 ms).
        assert reg.record_step_profile(key, [(1, 0.080), (8, 0.140)])
    d = resolve_cap(reg, native, 16, CapConfig())
    fit = reg.step_fit(native)
    assert d.source == "step_profile" and d.k == pytest.approx(fit.k) and 0.1 < fit.k < 0.13
    assert d.solo_tps == pytest.approx(1 / (0.080 - 0.060 / 7))
    assert d.cap == concurrency_cap(fit.solo_tps, fit.k, 16, 15.0, 1.2, 2.0) and d.stretchable
    dq = resolve_cap(reg, q, 16, CapConfig())
    assert (dq.cap, dq.source, dq.stretchable) == (1, "uncalibrated", False)
    assert dq.k == pytest.approx(fit.k)      # its own profile prices k once it may grow
