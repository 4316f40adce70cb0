"""Concurrency caps per execution identity.

cap = min(ceiling, max(1, ceil(qc * overcommit))), where qc is the largest batch B whose per-request
rate solo / (1 + k*B) stays at or above the decode floor. The floor is the TPOT objective
(`floor_tps` tok/s per stream), but never more than solo / max_slowdown: on a box where even a lone
request decodes below the objective, holding every stream to it is impossible and would only
refuse work; each stream is then promised at most `max_slowdown` x its solo time per token.

k comes from the engine's own per-step measurements (seconds per pure decode step by batch size,
warm-up included; rates.RateRegistry.step_fit), else a fit of request samples, else the default.
The solo rate is the static solo median, never an under-load rate: an under-load rate collapses in
overload and would drive the cap to 1 in a feedback loop. A native identity without enough solo
samples starts from the step profile's intercept (its warm-up measurement).

A quantized identity with fewer than `min_solo_samples` solo samples for the same identity AND chip
class is uncalibrated: cap 1, and it never borrows native rates, other chip classes or seeds. Native
identities may bootstrap from configured seeds. Quarantined identities stay at 1; neither stretches.

The cap is what routing promises without a queue. When requests queue for it, the head of the queue
is admitted above the cap (up to the ceiling, memory permitting) once it has waited half the TTFT
objective: past that point holding the stream speed would cost the TTFT objective instead
(capacity/waiting.py). Pure Python.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import Field

from capacity.identity import ExecutionKey
from capacity.rates import RateRegistry
from capacity.sections import Section


class CapConfig(Section):
    floor_tps: float = 15.0          # TPOT objective: per-request decode rate at the cap
    max_slowdown: float = 2.0        # ... but never more than solo / this (see module doc)
    ttft_objective_s: float | None = 2.0   # queued past half of it: admitted above the cap
    overcommit: float = 1.2          # admitted batch vs qc; >1 because requests rarely all decode at once
    default_k: float = 0.39          # batch slowdown until fitted (reference: Gemma-4-26B, B=1..8)
    min_solo_samples: int = 5        # same-identity, same-chip solo samples before a cap can grow
    fallback_concurrency: int = 4    # native with neither samples nor seed
    # Native solo tok/s seeds: "model" or "model@chip_class" -> tok/s. Never used for quantized.
    native_seeds: dict[str, float] = Field(default_factory=dict)


@dataclass(frozen=True)
class CapDecision:
    cap: int
    source: str               # solo | seed | undersampled | fallback | uncalibrated | invalid
    solo_tps: float | None
    k: float

    @property
    def stretchable(self) -> bool:
        """May a queued request be admitted above this cap? Not while uncalibrated or invalid."""
        return self.source not in ("uncalibrated", "invalid")


def quality_concurrency(solo_tps: float, k: float, floor_tps: float, ceiling: int,
                        max_slowdown: float | None = None) -> int:
    """Largest B with solo / (1 + k*B) >= floor, clamped to [1, ceiling]; 1 if solo <= floor.
    With `max_slowdown`, the floor is at most solo / max_slowdown."""
    if max_slowdown:
        floor_tps = min(floor_tps, solo_tps / max_slowdown)
    if solo_tps <= floor_tps:
        return 1
    if k <= 0:
        return ceiling
    qc = math.floor((solo_tps / floor_tps - 1.0) / k + 1e-9)  # tolerance: exact edges count as fitting
    return min(max(qc, 1), ceiling)


def concurrency_cap(solo_tps: float, k: float, ceiling: int, floor_tps: float = 15.0,
                    overcommit: float = 1.2, max_slowdown: float | None = None) -> int:
    qc = quality_concurrency(solo_tps, k, floor_tps, ceiling, max_slowdown)
    # round() first so 10 * 1.2 == 12.000000000000002 does not become 13.
    return min(ceiling, max(1, math.ceil(round(qc * overcommit, 9))))


def resolve_cap(rates: RateRegistry, key: ExecutionKey, ceiling: int,
                cfg: CapConfig | None = None) -> CapDecision:
    cfg = cfg or CapConfig()
    ceiling = max(1, int(ceiling))
    fit = rates.fit(key)
    k = fit.k if fit else cfg.default_k

    def cap(solo: float) -> int:
        return concurrency_cap(solo, k, ceiling, cfg.floor_tps, cfg.overcommit, cfg.max_slowdown)

    if key.is_invalid:
        return CapDecision(1, "invalid", None, k)
    solo, n = rates.solo_median(key)
    if solo is not None and n >= max(1, cfg.min_solo_samples):
        return CapDecision(cap(solo), "solo", solo, k)
    if key.is_quantized:
        return CapDecision(1, "uncalibrated", None, k)
    seed = cfg.native_seeds.get(f"{key.model}@{key.chip_class}", cfg.native_seeds.get(key.model))
    if seed:
        return CapDecision(cap(seed), "seed", float(seed), k)
    steps = rates.step_fit(key)
    if steps is not None:
        # The engine's warm-up (and later steps) measured solo and slowdown directly.
        return CapDecision(cap(steps.solo_tps), "step_profile", steps.solo_tps, k)
    if solo is not None:
        return CapDecision(cap(solo), "undersampled", solo, k)
    return CapDecision(min(ceiling, cfg.fallback_concurrency), "fallback", None, k)
