"""Statistics of the KV-format quality gate: paired bootstrap intervals and verdicts. numpy only.

Every comparison is paired: the format and native are scored on the same units (held-out
windows, retrieval cases, probes), and a bootstrap resample draws units, not tokens, so the
interval reflects how much the answer depends on which text was scored. Tokens inside one window
are correlated; resampling them individually would give falsely narrow intervals.

Verdict rule (declared up front, same for every metric):
- a "not worse than" margin m on a lower-is-better quantity (NLL delta %, KL):
  pass if the CI's upper bound <= m, fail if its lower bound > m, else inconclusive;
- accuracy (points, format minus native) within d points:
  pass if the CI's lower bound >= -d, fail if its upper bound < -d, else inconclusive.
  (Accuracy intervals are widened by exact binomial bounds where the bootstrap is blind; see
  accuracy_delta_interval.)
A format passes when every declared check passes, fails when any fails, else is inconclusive.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

BOOTSTRAP_SEED = 20261129
BOOTSTRAP_RESAMPLES = 2000
CONFIDENCE = 0.95

PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float

    def as_dict(self) -> dict:
        return {"estimate": self.estimate, "ci95": [self.low, self.high]}


def _resample_index(n_units: int, resamples: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n_units, size=(resamples, n_units))


def _interval(estimate: float, draws: np.ndarray) -> Interval:
    a = (1 - CONFIDENCE) / 2
    lo, hi = np.quantile(draws, [a, 1 - a])
    # The percentile interval of a degenerate sample is the point itself; keep it exact.
    return Interval(float(estimate), float(min(lo, estimate)), float(max(hi, estimate)))


def ratio_interval(num: np.ndarray, den: np.ndarray, scale: float = 1.0,
                   resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> Interval:
    """scale * sum(num) / sum(den) with a bootstrap over units (e.g. KL sum / tokens)."""
    num, den = np.asarray(num, np.float64), np.asarray(den, np.float64)
    idx = _resample_index(len(num), resamples, seed)
    draws = scale * num[idx].sum(1) / den[idx].sum(1)
    return _interval(scale * num.sum() / den.sum(), draws)


def relative_delta_interval(fmt: np.ndarray, ref: np.ndarray,
                            resamples: int = BOOTSTRAP_RESAMPLES,
                            seed: int = BOOTSTRAP_SEED) -> Interval:
    """100 * (sum(fmt) - sum(ref)) / sum(ref), paired over units (per-window NLL sums)."""
    fmt, ref = np.asarray(fmt, np.float64), np.asarray(ref, np.float64)
    idx = _resample_index(len(fmt), resamples, seed)
    sf, sr = fmt[idx].sum(1), ref[idx].sum(1)
    est = 100.0 * (fmt.sum() - ref.sum()) / ref.sum()
    return _interval(est, 100.0 * (sf - sr) / sr)


def excess_interval(a: np.ndarray, b: np.ndarray, den: np.ndarray, scale: float = 1.0,
                    resamples: int = BOOTSTRAP_RESAMPLES,
                    seed: int = BOOTSTRAP_SEED) -> Interval:
    """scale * (sum(a) - sum(b)) / sum(den), paired over units: how much more a costs than b,
    both measured against one reference (e.g. per-window KL of a format and of native to a
    float32 run, over tokens; or NLL sums over the reference's NLL sum, in percent)."""
    a, b, den = (np.asarray(x, np.float64) for x in (a, b, den))
    idx = _resample_index(len(a), resamples, seed)
    draws = scale * (a[idx].sum(1) - b[idx].sum(1)) / den[idx].sum(1)
    return _interval(scale * (a.sum() - b.sum()) / den.sum(), draws)


def binomial_upper(k: int, n: int, alpha: float = (1 - CONFIDENCE) / 2) -> float:
    """Clopper-Pearson one-sided upper bound on a rate with k events in n trials."""
    if k >= n:
        return 1.0
    lo, hi = k / n, 1.0
    for _ in range(60):   # P(X <= k; n, p) falls with p: bisect for it to equal alpha
        mid = (lo + hi) / 2
        cdf = sum(math.comb(n, i) * mid ** i * (1 - mid) ** (n - i) for i in range(k + 1))
        lo, hi = (mid, hi) if cdf > alpha else (lo, mid)
    return hi


def accuracy_delta_interval(fmt_ok: np.ndarray, ref_ok: np.ndarray,
                            resamples: int = BOOTSTRAP_RESAMPLES,
                            seed: int = BOOTSTRAP_SEED) -> Interval:
    """Accuracy difference in points (format - native), paired over cases.

    The paired bootstrap interval, widened where it is blind: with few or no discordant cases
    (both near ceiling) every resample agrees and the percentile interval collapses to a point.
    So the lower bound is at most (observed gain rate - Clopper-Pearson upper bound of the loss
    rate), and the upper bound at least the mirror image: 0 losses in 100 cases still allow a
    3.6-point loss at 95%.
    """
    f, r = np.asarray(fmt_ok, np.int64), np.asarray(ref_ok, np.int64)
    d = 100.0 * (f - r)
    idx = _resample_index(len(d), resamples, seed)
    boot = _interval(d.mean(), d[idx].mean(1))
    lost, gained = int(((r == 1) & (f == 0)).sum()), int(((r == 0) & (f == 1)).sum())
    n = len(d)
    return Interval(boot.estimate, min(boot.low, 100.0 * (gained / n - binomial_upper(lost, n))),
                    max(boot.high, 100.0 * (binomial_upper(gained, n) - lost / n)))


def verdict_at_most(ci: Interval, margin: float) -> str:
    """Lower-is-better quantity that must stay <= margin."""
    if ci.high <= margin:
        return PASS
    if ci.low > margin:
        return FAIL
    return INCONCLUSIVE


def verdict_within_points(ci: Interval, points: float) -> str:
    """Accuracy difference (format - native, in points) that must stay >= -points."""
    if ci.low >= -points:
        return PASS
    if ci.high < -points:
        return FAIL
    return INCONCLUSIVE


def combine(verdicts: list[str]) -> str:
    if not verdicts:
        return INCONCLUSIVE
    if FAIL in verdicts:
        return FAIL
    if INCONCLUSIVE in verdicts:
        return INCONCLUSIVE
    return PASS
