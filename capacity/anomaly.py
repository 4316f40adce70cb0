"""Bandwidth anomaly check: is a near-solo native slot decoding far below what memory bandwidth allows?

expected tok/s = bandwidth * efficiency / (active params * bytes per param); a (model, chip class)
bucket is flagged when median(observed) / expected < threshold with enough samples. Only native
execution is checked: packed KV has a different cost model and no expectation of its own yet, so it
must neither train nor trigger native buckets (quarantined identities are excluded too).
Observability only: it never changes routing. Pure Python.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from capacity.identity import ExecutionKey
from capacity.sections import Section


class AnomalyConfig(Section):
    efficiency: float = 0.80     # fraction of peak bandwidth a healthy decode reaches on weights
    threshold: float = 0.35      # observed/expected below this is flagged (healthy MoE may sit ~0.44)
    min_samples: int = 3         # slots in a bucket before it can be judged
    max_running: int = 1         # only near-solo slots say anything about per-request speed


@dataclass(frozen=True)
class DecodeObservation:
    key: ExecutionKey
    observed_tps: float
    running: int
    bandwidth_gbps: float
    active_params: int
    bytes_per_param: float


@dataclass(frozen=True)
class Anomaly:
    model: str
    chip_class: str
    ratio: float          # median observed / expected
    expected_tps: float
    samples: int


def expected_decode_tps(bandwidth_gbps: float, active_params: int, bytes_per_param: float,
                        efficiency: float) -> float:
    return bandwidth_gbps * 1e9 * efficiency / (active_params * bytes_per_param)


def check(observations, cfg: AnomalyConfig | None = None) -> list[Anomaly]:
    cfg = cfg or AnomalyConfig()
    buckets: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for o in observations:
        if not o.key.is_native or o.running > cfg.max_running or o.observed_tps <= 0:
            continue
        exp = expected_decode_tps(o.bandwidth_gbps, o.active_params, o.bytes_per_param, cfg.efficiency)
        buckets.setdefault((o.key.model, o.key.chip_class), []).append((o.observed_tps, exp))
    out = []
    for (model, chip), pts in sorted(buckets.items()):
        if len(pts) < cfg.min_samples:
            continue
        expected = statistics.median(e for _, e in pts)
        ratio = statistics.median(o for o, _ in pts) / expected
        if ratio < cfg.threshold:
            out.append(Anomaly(model, chip, ratio, expected, len(pts)))
    return out
