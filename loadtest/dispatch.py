"""Precise open-loop delivery on gevent.

One dispatcher greenlet walks the schedule and spawns each request's greenlet `lead_s` early;
that greenlet parks on its own gevent timer and spins on perf_counter for the last `spin_s`.
Why: libev timers fire on the loop's cached clock with ~1 ms granularity, and a greenlet woken at
the due time may still queue behind others; a short spin removes both without a busy loop for
the whole run. The cost is that the hub is held for at most `spin_s` per request, which can
delay other streams' timestamps by that much (bounded, and recorded as delivery error if late).
"""
from __future__ import annotations

import time

import gevent
import gevent.pool

perf = time.perf_counter


def wait_until(deadline: float, spin_s: float = 0.002) -> None:
    """Return as close after perf_counter() == deadline as this process can manage."""
    while True:
        remaining = deadline - perf()
        if remaining <= spin_s:
            break
        # A timer may fire early (stale loop clock) or late; re-check instead of trusting it.
        gevent.sleep(remaining - spin_s)
    while perf() < deadline:
        pass


def run_schedule(arrivals, fire, t0: float, lead_s: float = 0.05,
                 spin_s: float = 0.002) -> gevent.pool.Group:
    """Spawn `fire(arrival, due)` for each arrival (sorted by `.t`), due = t0 + arrival.t on the
    perf_counter clock. Returns the group so the caller can join in-flight requests."""
    group = gevent.pool.Group()
    for a in arrivals:
        due = t0 + a.t
        wake = due - lead_s - perf()
        if wake > 0:
            gevent.sleep(wake)
        group.spawn(_fire_at, fire, a, due, spin_s)
    return group


def _fire_at(fire, arrival, due: float, spin_s: float) -> None:
    wait_until(due, spin_s)
    fire(arrival, due)
