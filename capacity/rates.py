"""Rate histories keyed by execution identity: decode tok/s, per-request samples, TTFT calibration.

Why per identity: packed KV formats decode and prefill at different speeds than native, so one
format's rates must never price another. Invalid (quarantined) identities record nothing.

Beyond heartbeat EWMAs, every released request leaves a sample (prompt tokens, batch size at
admission, TTFT, time per output token). Once enough exist, rate(B) = solo / (1 + k*B) is fitted by
least squares on tpot(B) = 1/rate(B) = a + b*B (a = 1/solo, b = k/solo), so the batch slowdown k is
measured per format instead of one global constant. Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass

from capacity.identity import ExecutionKey
from capacity.ring import Ring, finite_positive
from capacity.sections import Section


class RateConfig(Section):
    load_window: int = 50            # load-inclusive decode tok/s samples kept per identity
    solo_window: int = 50            # solo decode tok/s samples kept per identity
    sample_window: int = 256         # per-request samples kept per identity (least-squares fit)
    fit_min_samples: int = 20        # requests needed before k is fitted ...
    fit_min_batch_sizes: int = 2     # ... spread over at least this many distinct batch sizes
    max_k: float = 4.0               # a fitted slowdown above this is noise, not physics
    ttft_window: int = 200           # actual/predicted TTFT ratios kept per key
    ttft_min_samples: int = 50       # ratios needed before calibration applies
    ttft_clamp: tuple[float, float] = (0.2, 1.5)  # applied ratio bounds (one bad day can't zero TTFT)
    max_decode_tps: float = 500.0    # reports above this are refused (inflation guard)
    max_prefill_tps: float = 20000.0


@dataclass(frozen=True)
class RequestSample:
    prompt_tokens: int
    batch_size: int          # requests decoding together at admission, this one included
    ttft_s: float
    tpot_s: float | None     # seconds per output token after the first; None for 1-token outputs


@dataclass(frozen=True)
class BatchFit:
    solo_tps: float   # 1/a: the B -> 0 intercept, in the same parameterization as the cap formula
    k: float
    samples: int


class History:
    """All samples of one execution identity."""

    RINGS = ("load", "solo", "prompt", "batch", "ttft", "tpot")
    __slots__ = RINGS + ("prefill_cache",)

    def __init__(self, cfg: RateConfig):
        self.prefill_cache: float | None = None   # median prefill tok/s; None = recompute
        self.load = Ring(cfg.load_window)
        self.solo = Ring(cfg.solo_window)
        self.prompt = Ring(cfg.sample_window)
        self.batch = Ring(cfg.sample_window)
        self.ttft = Ring(cfg.sample_window)
        self.tpot = Ring(cfg.sample_window)   # 0.0 marks "no decode phase"

    def to_dict(self) -> dict:
        return {name: getattr(self, name).values() for name in self.RINGS}

    @classmethod
    def from_dict(cls, cfg: RateConfig, data: dict) -> "History":
        h = cls(cfg)
        for name in cls.RINGS:
            for v in data.get(name, ()):
                getattr(h, name).append(float(v))
        return h


class RateRegistry:
    def __init__(self, cfg: RateConfig | None = None):
        self.cfg = cfg or RateConfig()
        self._hist: dict[ExecutionKey, History] = {}
        self._ttft: dict[ExecutionKey, Ring] = {}
        self._steps: dict[ExecutionKey, dict[int, float]] = {}   # batch size -> s per decode step

    def __len__(self) -> int:
        return len(self._hist)

    def _history(self, key: ExecutionKey) -> History:
        h = self._hist.get(key)
        if h is None:
            h = self._hist[key] = History(self.cfg)
        return h

    # ---- recording (all return whether the value was kept) -------------------------------------

    def record_decode(self, key: ExecutionKey, tps: float, solo: bool) -> bool:
        """A heartbeat decode rate. `solo` only when the whole box ran at most one request."""
        if key.is_invalid or not finite_positive(tps) or tps > self.cfg.max_decode_tps:
            return False
        h = self._history(key)
        h.load.append(float(tps))
        if solo:
            h.solo.append(float(tps))
        return True

    def record_step_profile(self, key: ExecutionKey, profile) -> bool:
        """The engine's seconds per pure decode step by batch size (latest value per size)."""
        if key.is_invalid:
            return False
        points = {int(b): float(t) for b, t in profile
                  if int(b) >= 1 and finite_positive(t) and 1.0 / t <= self.cfg.max_decode_tps}
        if not points:
            return False
        self._steps.setdefault(key, {}).update(points)
        return True

    def step_fit(self, key: ExecutionKey) -> BatchFit | None:
        """step(B) = a + b*B by least squares over the measured batch sizes (each size once):
        solo = 1/a, k = b/a. None until two sizes are measured; a negative slope (noise) is
        clamped to k = 0 rather than promising faster decoding in bigger batches."""
        pts = sorted(self._steps.get(key, {}).items())
        if len(pts) < 2:
            return None
        return _line_fit(pts, self.cfg)

    def record_request(self, key: ExecutionKey, s: RequestSample, solo: bool = False) -> bool:
        """Telemetry of one released request. A solo request also adds a solo decode sample."""
        if key.is_invalid or not finite_positive(s.ttft_s) or s.batch_size < 1 or s.prompt_tokens < 0:
            return False
        if s.tpot_s is not None and not finite_positive(s.tpot_s):
            return False
        h = self._history(key)
        h.prompt.append(float(s.prompt_tokens))
        h.batch.append(float(s.batch_size))
        h.ttft.append(float(s.ttft_s))
        h.tpot.append(float(s.tpot_s or 0.0))
        h.prefill_cache = None
        if solo and s.tpot_s and 1.0 / s.tpot_s <= self.cfg.max_decode_tps:
            h.solo.append(1.0 / s.tpot_s)
        return True

    def record_ttft_ratio(self, key: ExecutionKey, predicted_s: float, actual_s: float) -> bool:
        """Learn actual/predicted under the chip key and the model-level key (same execution)."""
        if key.is_invalid or not finite_positive(predicted_s) or not finite_positive(actual_s):
            return False
        ratio = actual_s / predicted_s
        for k in (key, key.model_level()):
            ring = self._ttft.get(k)
            if ring is None:
                ring = self._ttft[k] = Ring(self.cfg.ttft_window)
            ring.append(ratio)
        return True

    # ---- reading -------------------------------------------------------------------------------

    def solo_median(self, key: ExecutionKey) -> tuple[float | None, int]:
        h = self._hist.get(key)
        return (h.solo.median(), len(h.solo)) if h else (None, 0)

    def load_median(self, key: ExecutionKey) -> float | None:
        h = self._hist.get(key)
        return h.load.median() if h else None

    def prefill_tps(self, key: ExecutionKey) -> float | None:
        """Median prompt tokens per TTFT second over this identity's requests; None = unmeasured."""
        h = self._hist.get(key)
        if not h:
            return None
        if h.prefill_cache is None:   # forecasts read this on every hold; samples change rarely
            rates = sorted(p / t for p, t in zip(h.prompt.values(), h.ttft.values()) if p > 0)
            h.prefill_cache = min(rates[len(rates) // 2], self.cfg.max_prefill_tps) if rates else 0.0
        return h.prefill_cache or None

    def fit(self, key: ExecutionKey) -> BatchFit | None:
        """The batch slowdown: from the engine's per-step profile when it has two batch sizes
        (clean: no prefill or serving-path time in it), else the least-squares fit of
        tpot = a + b*B over request samples; None until enough spread-out samples exist."""
        by_steps = self.step_fit(key)
        if by_steps is not None:
            return by_steps
        h = self._hist.get(key)
        if not h:
            return None
        pts = [(b, t) for b, t in zip(h.batch.values(), h.tpot.values()) if t > 0]
        if len(pts) < self.cfg.fit_min_samples or \
                len({b for b, _ in pts}) < self.cfg.fit_min_batch_sizes:
            return None
        return _line_fit(pts, self.cfg)

    def ttft_ratio(self, key: ExecutionKey) -> float:
        """Applied calibration: chip key, then model key, then 1.0; only after enough samples."""
        lo, hi = self.cfg.ttft_clamp
        for k in (key, key.model_level()):
            ring = self._ttft.get(k)
            if ring is not None and len(ring) >= self.cfg.ttft_min_samples:
                return min(max(ring.median(), lo), hi)
        return 1.0

    # ---- persistence (the actor snapshots these; JSON-able) ------------------------------------

    def to_dict(self) -> dict:
        def enc(k: ExecutionKey):
            return [k.model, k.chip_class, k.execution]
        return {"histories": [[enc(k), h.to_dict()] for k, h in self._hist.items()],
                "ttft": [[enc(k), r.values()] for k, r in self._ttft.items()],
                "steps": [[enc(k), sorted(p.items())] for k, p in self._steps.items()]}

    @classmethod
    def from_dict(cls, data: dict, cfg: RateConfig | None = None) -> "RateRegistry":
        reg = cls(cfg)
        for (m, c, e), h in data.get("histories", ()):
            reg._hist[ExecutionKey(m, c, e)] = History.from_dict(reg.cfg, h)
        for (m, c, e), vals in data.get("ttft", ()):
            reg._ttft[ExecutionKey(m, c, e)] = Ring(reg.cfg.ttft_window, vals)
        for (m, c, e), points in data.get("steps", ()):
            reg._steps[ExecutionKey(m, c, e)] = {int(b): float(t) for b, t in points}
        return reg


def _line_fit(pts: list[tuple[float, float]], cfg: RateConfig) -> BatchFit | None:
    """Seconds per token t = a + b*B by least squares; solo = 1/a, k = b/a (clamped)."""
    n = len(pts)
    mb = sum(b for b, _ in pts) / n
    mt = sum(t for _, t in pts) / n
    sbb = sum((b - mb) ** 2 for b, _ in pts)
    if sbb == 0:
        return None
    slope = sum((b - mb) * (t - mt) for b, t in pts) / sbb
    intercept = mt - slope * mb
    if intercept <= 0:
        return None  # rate would be infinite or negative at B -> 0: the data cannot support a fit
    k = min(max(0.0, slope / intercept), cfg.max_k)
    return BatchFit(solo_tps=min(1.0 / intercept, cfg.max_decode_tps), k=k, samples=n)
