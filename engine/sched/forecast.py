"""Measured step rates: prefill throughput and decode step time, for deadlines and routing."""
from __future__ import annotations

import statistics
from collections import deque

class RateForecast:
    """EWMA of measured prefill throughput, for first-token deadline forecasts.

    Before the first measured prefill there is no forecast and deadlines are only checked against
    the clock (optimistic: an idle engine's first request is never refused on a guess).
    """

    # Batch sizes kept in the decode step profile (the capacity actor fits its slowdown on it),
    # and steps remembered per size.
    PROFILE_SIZES = 64
    PROFILE_WINDOW = 9

    def __init__(self, alpha: float = 0.2):
        self.alpha = alpha
        self.prefill_tps: float | None = None
        self.decode_step_s: float | None = None
        # Seconds per pure decode step by batch size (the last few steps of each size): a clean
        # per-step measurement of how the batch slows each request, free of prefill
        # interference and serving-path overhead. A median drops the odd slow step (a compile).
        self._decode_steps: dict[int, deque] = {}

    def observe(self, prefill_tokens: int, decode_rows: int, seconds: float) -> None:
        if seconds <= 0:
            return
        if prefill_tokens:
            self.prefill_tps = self._mix(self.prefill_tps, prefill_tokens / seconds)
        elif decode_rows:
            self.decode_step_s = self._mix(self.decode_step_s, seconds)
            ring = self._decode_steps.get(decode_rows)
            if ring is None and len(self._decode_steps) < self.PROFILE_SIZES:
                ring = self._decode_steps[decode_rows] = deque(maxlen=self.PROFILE_WINDOW)
            if ring is not None:
                ring.append(seconds)

    @property
    def decode_profile(self) -> dict[int, float]:
        """Median seconds per pure decode step, by batch size."""
        return {b: statistics.median(r) for b, r in sorted(self._decode_steps.items())}

    def ttft_s(self, prefill_tokens_ahead: int) -> float | None:
        if self.prefill_tps is None:
            return None
        return prefill_tokens_ahead / self.prefill_tps + (self.decode_step_s or 0.0)

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)
