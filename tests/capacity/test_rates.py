"""Rate histories, batch-slowdown fit, TTFT calibration and forecasts, with hand-computed values."""
import pytest

from capacity.forecast import ForecastConfig, forecast_ttft
from capacity.identity import ExecutionKey
from capacity.rates import RateConfig, RateRegistry, RequestSample
from capacity.ring import Ring

INT4 = "kvq-v1:affine-v1-k4v4-g64-f32-h128-s1:prefill=direct"
NATIVE_KEY = ExecutionKey.make("m", "M4|Max", None)
INT4_KEY = ExecutionKey.make("m", "M4|Max", INT4)
BAD_KEY = ExecutionKey.make("m", "M4|Max", "kvq-v1:nope")


def test_ring_keeps_the_last_window_and_its_median():
    r = Ring(3, [1, 2, 3, 4, 5])
    assert r.values() == [3, 4, 5] and r.median() == 4
    r.append(100)
    assert r.values() == [4, 5, 100] and r.median() == 5
    assert Ring(4, [1, 2, 3, 10]).median() == 2.5
    assert Ring(2).median() is None


def test_load_and_solo_windows():
    reg = RateRegistry()
    for i in range(60):
        reg.record_decode(NATIVE_KEY, float(i + 1), solo=(i % 2 == 0))
    assert reg.load_median(NATIVE_KEY) == (11 + 60) / 2           # last 50 of 1..60
    median, n = reg.solo_median(NATIVE_KEY)
    assert n == 30 and median == 30.0                             # odd values 1..59


def test_quarantined_and_absurd_samples_are_refused():
    reg = RateRegistry()
    assert not reg.record_decode(BAD_KEY, 50.0, solo=True)
    assert not reg.record_request(BAD_KEY, RequestSample(10, 1, 0.1, 0.01))
    assert not reg.record_ttft_ratio(BAD_KEY, 1.0, 1.0)
    assert len(reg) == 0
    assert not reg.record_decode(NATIVE_KEY, 501.0, solo=True)    # inflation guard
    assert not reg.record_decode(NATIVE_KEY, float("nan"), solo=True)
    assert not reg.record_decode(NATIVE_KEY, 0.0, solo=True)


def test_fit_recovers_per_format_slowdown():
    # rate(B) = solo / (1 + k B): native solo 100, k 0.25; int4 solo 80, k 0.5.
    reg = RateRegistry()
    for b in [1, 2, 3, 4] * 5:
        reg.record_request(NATIVE_KEY, RequestSample(100, b, 0.2, (1 + 0.25 * b) / 100))
        reg.record_request(INT4_KEY, RequestSample(100, b, 0.4, (1 + 0.5 * b) / 80))
    native, int4 = reg.fit(NATIVE_KEY), reg.fit(INT4_KEY)
    assert native.samples == 20
    assert native.solo_tps == pytest.approx(100) and native.k == pytest.approx(0.25)
    assert int4.solo_tps == pytest.approx(80) and int4.k == pytest.approx(0.5)


def test_fit_waits_for_enough_spread_out_samples():
    reg = RateRegistry()
    for _ in range(19):
        reg.record_request(NATIVE_KEY, RequestSample(10, 1 + _ % 2, 0.1, 0.01))
    assert reg.fit(NATIVE_KEY) is None                            # 19 < 20
    reg.record_request(NATIVE_KEY, RequestSample(10, 1, 0.1, 0.01))
    assert reg.fit(NATIVE_KEY) is not None
    one_batch = RateRegistry()
    for _ in range(30):
        one_batch.record_request(NATIVE_KEY, RequestSample(10, 2, 0.1, 0.01))
    assert one_batch.fit(NATIVE_KEY) is None                      # a single batch size fits no slope


def test_ttft_calibration_applies_after_50_and_is_clamped():
    reg = RateRegistry()
    for _ in range(49):
        reg.record_ttft_ratio(NATIVE_KEY, predicted_s=2.0, actual_s=1.0)
    assert reg.ttft_ratio(NATIVE_KEY) == 1.0
    reg.record_ttft_ratio(NATIVE_KEY, 2.0, 1.0)
    assert reg.ttft_ratio(NATIVE_KEY) == 0.5
    slow = RateRegistry()
    for _ in range(50):
        slow.record_ttft_ratio(INT4_KEY, 1.0, 3.0)
    assert slow.ttft_ratio(INT4_KEY) == 1.5
    fast = RateRegistry()
    for _ in range(50):
        fast.record_ttft_ratio(INT4_KEY, 1.0, 0.1)
    assert fast.ttft_ratio(INT4_KEY) == 0.2


def test_ttft_model_fallback_never_crosses_formats():
    reg = RateRegistry()
    for _ in range(50):
        reg.record_ttft_ratio(NATIVE_KEY, 2.0, 1.0)
    other_chip = ExecutionKey.make("m", "M3|Pro", None)
    assert reg.ttft_ratio(other_chip) == 0.5                      # same model and execution
    assert reg.ttft_ratio(ExecutionKey.make("m", "M3|Pro", INT4)) == 1.0


def test_registry_round_trips_through_json_form():
    import json

    reg = RateRegistry(RateConfig(load_window=5))
    reg.record_decode(INT4_KEY, 70.0, solo=True)
    reg.record_request(NATIVE_KEY, RequestSample(100, 2, 0.5, 0.02))
    reg.record_ttft_ratio(NATIVE_KEY, 1.0, 0.8)
    back = RateRegistry.from_dict(json.loads(json.dumps(reg.to_dict())), reg.cfg)
    assert back.solo_median(INT4_KEY) == (70.0, 1)
    assert back.prefill_tps(NATIVE_KEY) == 200.0
    assert back.to_dict() == reg.to_dict()


def test_forecast_native_measured():
    reg = RateRegistry()
    reg.record_request(NATIVE_KEY, RequestSample(1000, 1, 0.5, 0.02))   # prefill 2000 tok/s
    reg.record_decode(NATIVE_KEY, 50.0, solo=False)
    f = forecast_ttft(reg, NATIVE_KEY, prompt_tokens=2000)
    assert f.seconds == pytest.approx(2000 / 2000 + 1 / 50) and f.trainable


def test_forecast_native_bootstraps_prefill_from_decode():
    reg = RateRegistry()
    reg.record_decode(NATIVE_KEY, 50.0, solo=False)
    f = forecast_ttft(reg, NATIVE_KEY, prompt_tokens=600)   # prefill fallback 50 * 12 = 600 tok/s
    assert f.seconds == pytest.approx(1 + 1 / 50) and f.trainable


def test_forecast_unmeasured_packed_prefill_is_a_cold_bound_that_never_trains():
    reg = RateRegistry()
    reg.record_decode(INT4_KEY, 70.0, solo=True)            # decode known, prefill not
    cfg = ForecastConfig(cold_load_penalty_s=30.0)
    short = forecast_ttft(reg, INT4_KEY, prompt_tokens=10, cfg=cfg)
    assert short.seconds == 30.0 and not short.trainable
    long = forecast_ttft(reg, INT4_KEY, prompt_tokens=100, cfg=cfg)   # floor 1 tok/s -> 100 s
    assert long.seconds == 100.0 and not long.trainable
    reg.record_request(INT4_KEY, RequestSample(400, 1, 1.0, 0.02))  # prefill measured: 400 tok/s
    warm = forecast_ttft(reg, INT4_KEY, prompt_tokens=400, cfg=cfg)
    assert warm.trainable and warm.seconds == pytest.approx(1.0 + 1 / reg.load_median(INT4_KEY))


def test_forecast_never_scales_the_state_penalty():
    reg = RateRegistry()
    reg.record_request(NATIVE_KEY, RequestSample(1000, 1, 1.0, 0.02))  # 1000 tok/s
    reg.record_decode(NATIVE_KEY, 100.0, solo=False)
    for _ in range(50):
        reg.record_ttft_ratio(NATIVE_KEY, 2.0, 1.0)                     # ratio 0.5
    f = forecast_ttft(reg, NATIVE_KEY, 1000, state="idle_shutdown",
                      cfg=ForecastConfig(idle_shutdown_penalty_s=20.0))
    assert f.raw_s == pytest.approx(20 + 1 + 0.01)
    assert f.seconds == pytest.approx(20 + (1 + 0.01) * 0.5) and not f.trainable
