"""Time-to-first-token forecast for one candidate replica, calibrated per execution identity.

raw = penalty + (queued prefill tokens + prompt) / prefill_tps + 1 / decode_tps
calibrated = penalty + (raw - penalty) * ratio   (the state penalty is never scaled)

A packed identity whose prefill has never been measured forecasts max(estimate, cold-load penalty):
"unknown" is not "zero latency". That bound is marked untrainable so it never teaches the calibrator.
Only warm forecasts (penalty 0) train it, because the penalty is a configured guess, not a rate.
"""
from __future__ import annotations

from dataclasses import dataclass

from capacity.identity import ExecutionKey
from capacity.rates import RateRegistry
from capacity.sections import Section


class ForecastConfig(Section):
    cold_load_penalty_s: float = 30.0      # unmeasured packed prefill / unknown slot state
    idle_shutdown_penalty_s: float = 20.0  # a slot that must reload its model first
    prefill_to_decode_ratio: float = 12.0  # native prefill fallback when only decode is known
    min_rate_tps: float = 1.0              # rates are floored so a forecast is always finite


@dataclass(frozen=True)
class Forecast:
    seconds: float
    raw_s: float          # before calibration; what the calibrator learns against
    trainable: bool
    bound: bool = False   # seconds is the cold lower bound (unmeasured prefill or a cold state)


def state_penalty(state: str, cfg: ForecastConfig) -> float:
    if state in ("running", "idle"):
        return 0.0
    if state == "idle_shutdown":
        return cfg.idle_shutdown_penalty_s
    return cfg.cold_load_penalty_s


def forecast_ttft(rates: RateRegistry, key: ExecutionKey, prompt_tokens: int,
                  queued_prefill_tokens: int = 0, state: str = "running",
                  decode_tps: float | None = None, cfg: ForecastConfig | None = None) -> Forecast:
    cfg = cfg or ForecastConfig()
    penalty = state_penalty(state, cfg)
    decode = decode_tps or rates.load_median(key) or rates.solo_median(key)[0]
    prefill = rates.prefill_tps(key)
    if prefill is None and key.is_native and decode:
        prefill = decode * cfg.prefill_to_decode_ratio
    tokens = max(0, queued_prefill_tokens) + max(0, prompt_tokens)
    if prefill is None:
        # Unmeasured packed (or quarantined) prefill: the configured floor rate is a pessimistic
        # estimate, and the cold-load penalty bounds it from below. Never trains.
        est = penalty + tokens / cfg.min_rate_tps
        bound = max(est, cfg.cold_load_penalty_s)
        return Forecast(bound, 0.0, False, bound=True)
    decode = max(decode or cfg.min_rate_tps, cfg.min_rate_tps)
    raw = penalty + tokens / max(prefill, cfg.min_rate_tps) + 1.0 / decode
    ratio = rates.ttft_ratio(key)
    return Forecast(penalty + (raw - penalty) * ratio, raw, penalty == 0.0, bound=penalty > 0.0)
