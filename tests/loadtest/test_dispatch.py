"""Open-loop delivery: requests go out on time, never early, and a busy request does not delay
the next one (no closed loop)."""
from __future__ import annotations

import gevent

from loadtest import dispatch
from loadtest.arrivals import Arrival


def test_delivery_is_punctual_and_never_early():
    perf = dispatch.perf
    arrivals = [Arrival(i, 0.05 + i * 0.02, 10, 4, "t", i) for i in range(60)]  # 50 req/s
    for a in arrivals[10:14]:  # a synchronized burst inside
        arrivals[a.index] = Arrival(a.index, arrivals[10].t, 10, 4, "t", a.index)
    errors = {}

    def fire(arrival, due):
        errors[arrival.index] = perf() - due
        gevent.sleep(0.5)  # a long "stream": open loop means the next send does not wait

    t0 = perf()
    group = dispatch.run_schedule(arrivals, fire, t0, lead_s=0.02, spin_s=0.002)
    group.join(timeout=10)
    assert len(errors) == 60
    assert min(errors.values()) >= 0.0
    ms = sorted(e * 1000 for e in errors.values())
    # Loose on purpose: on a shared 2-core host the OS decides the tail (docs/loadtest.md has
    # the measured numbers); a dispatcher that waited for streams would be ~0.5 s late here.
    assert ms[len(ms) // 2] < 5.0, ms
    assert ms[-1] < 200.0, ms


def test_wait_until_does_not_return_early():
    perf = dispatch.perf
    for delay in (0.0005, 0.003, 0.02):
        due = perf() + delay
        dispatch.wait_until(due, spin_s=0.001)
        assert perf() >= due
