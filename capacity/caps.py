"""Concurrency caps per execution identity.

cap = min(ceiling, max(1, ceil(qc * overcommit))), where qc is the largest batch B whose per-request
rate solo / (1 + k*B) stays at or above the decode floor. The solo rate is the static solo median,
never an under-load rate: an under-load rate collapses in overload and would drive the cap to 1 in a
feedback loop. k is fitted per identity when the samples allow (rates.RateRegistry.fit), else the
configured default.

A quantized identity with fewer than `min_solo_samples` solo samples for the same identity AND chip
class is uncalibrated: cap 1, and it never borrows native rates, other chip classes or seeds. Native
identities may bootstrap from configured seeds. Quarantined identities stay at 1. Pure Python.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from capacity.identity import ExecutionKey
from capacity.rates import RateRegistry


@dataclass(frozen=True)
class CapConfig:
    floor_tps: float = 15.0          # per-request decode rate a user must still see at the cap
    overcommit: float = 1.2          # admitted batch vs qc; >1 because requests rarely all decode at once
    default_k: float = 0.39          # batch slowdown until fitted (reference: Gemma-4-26B, B=1..8)
    min_solo_samples: int = 5        # same-identity, same-chip solo samples before a cap can grow
    fallback_concurrency: int = 4    # native with neither samples nor seed
    # Native solo tok/s seeds: "model" or "model@chip_class" -> tok/s. Never used for quantized.
    native_seeds: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict | None) -> "CapConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (data or {}).items() if k in names})


@dataclass(frozen=True)
class CapDecision:
    cap: int
    source: str               # solo | seed | undersampled | fallback | uncalibrated | invalid
    solo_tps: float | None
    k: float


def quality_concurrency(solo_tps: float, k: float, floor_tps: float, ceiling: int) -> int:
    """Largest B with solo / (1 + k*B) >= floor, clamped to [1, ceiling]; 1 if solo <= floor."""
    if solo_tps <= floor_tps:
        return 1
    if k <= 0:
        return ceiling
    qc = math.floor((solo_tps / floor_tps - 1.0) / k + 1e-9)  # tolerance: exact edges count as fitting
    return min(max(qc, 1), ceiling)


def concurrency_cap(solo_tps: float, k: float, ceiling: int, floor_tps: float = 15.0,
                    overcommit: float = 1.2) -> int:
    qc = quality_concurrency(solo_tps, k, floor_tps, ceiling)
    # round() first so 10 * 1.2 == 12.000000000000002 does not become 13.
    return min(ceiling, max(1, math.ceil(round(qc * overcommit, 9))))


def resolve_cap(rates: RateRegistry, key: ExecutionKey, ceiling: int,
                cfg: CapConfig | None = None) -> CapDecision:
    cfg = cfg or CapConfig()
    ceiling = max(1, int(ceiling))
    fit = rates.fit(key)
    k = fit.k if fit else cfg.default_k
    if key.is_invalid:
        return CapDecision(1, "invalid", None, k)
    solo, n = rates.solo_median(key)
    if solo is not None and n >= max(1, cfg.min_solo_samples):
        return CapDecision(concurrency_cap(solo, k, ceiling, cfg.floor_tps, cfg.overcommit),
                           "solo", solo, k)
    if key.is_quantized:
        return CapDecision(1, "uncalibrated", None, k)
    seed = cfg.native_seeds.get(f"{key.model}@{key.chip_class}", cfg.native_seeds.get(key.model))
    if seed:
        return CapDecision(concurrency_cap(seed, k, ceiling, cfg.floor_tps, cfg.overcommit),
                           "seed", float(seed), k)
    if solo is not None:
        return CapDecision(concurrency_cap(solo, k, ceiling, cfg.floor_tps, cfg.overcommit),
                           "undersampled", solo, k)
    return CapDecision(min(ceiling, cfg.fallback_concurrency), "fallback", None, k)
