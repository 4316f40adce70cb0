"""How long an affine waiter (capacity/waiting.py) may wait for the replicas caching its prefix:
about the prefill time a hit there saves, not a fixed bound.

A later chat turn that waits for its holder and is granted there skips recomputing the cached
prefix; sent elsewhere by headroom, it recomputes it. So waiting pays as long as the wait is
shorter than that prefill: the bound is `saved_tokens / prefill_tps`, the rate the actor learned
for the holders' execution identity (capacity/rates.py: prompt tokens computed per TTFT second,
over requests that found little of their prompt cached, so it includes the queueing and the
interleaving with other requests' decode steps that a recompute pays too). With several holders
the fastest rate prices it (the smallest saving). While no holder's identity has a learned rate,
the fixed UNLEARNED_WAIT_S stands in. The op's own `wait_s` always caps the result: the router
sends there the least of queue_timeout_s, the time left before the request's first-token
deadline and an explicit capacity.prefix_wait_s. An op without saved_tokens (an older router)
waits its wait_s, as before. Pure Python.
"""
from __future__ import annotations

from capacity.fleet import Fleet
from capacity.operations import HoldOp

# The bound before any rate is learned: on SmolLM2/CPU a later turn's full re-prefill cost
# 4-5x a hit's TTFT (~1.3 s), so 2 s was the fixed bound this replaces (runs 7-10).
UNLEARNED_WAIT_S = 2.0


def holder_prefill_tps(fleet: Fleet, model: str, exclude) -> float | None:
    """The fastest learned prefill rate among the model's replicas not excluded; None = none."""
    excluded = set(exclude)
    rates = [fleet.rates.prefill_tps(r.key) for r in fleet.ledger.replicas(model)
             if r.replica_id not in excluded]
    return max((r for r in rates if r), default=None)


def affine_wait_s(fleet: Fleet, op: HoldOp) -> float:
    """Seconds the affine hold `op` may wait: min(op.wait_s, saved prefill time)."""
    cap = max(0.0, float(op.wait_s or 0))
    if op.saved_tokens <= 0:
        return cap
    rate = holder_prefill_tps(fleet, op.model_id, op.exclude)
    return min(cap, UNLEARNED_WAIT_S if rate is None else op.saved_tokens / rate)
