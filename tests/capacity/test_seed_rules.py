"""Seed rules of the capacity package that were partial: the cold-start TTFT bound of an
unmeasured identity gates deadlines (not only ranks), and the native-only bandwidth anomaly
check is fed by heartbeats and run."""
import pytest

from capacity.fleet import Fleet
from capacity.protocol import RequestTelemetry
from tests.capacity.test_fleet import INT4, report


def test_the_cold_bound_of_an_unmeasured_packed_identity_gates_a_short_deadline():
    f = Fleet()
    f.heartbeat(report("q", 1, execution=INT4), 0.0)
    hold = f.hold("m", 100, "a", 0.0, prompt_tokens=10)
    # Unmeasured int4 prefill: max(10 tokens at the 1 tok/s floor, 30 s cold-load penalty).
    assert hold.predicted_ttft_s == 30.0 and hold.ttft_bound
    assert hold.misses_deadline(5.0)              # "unknown" is not "zero latency"
    assert not hold.misses_deadline(31.0) and not hold.misses_deadline(None)
    # Once the identity's prefill is measured the forecast is calibrated, no longer a bound.
    f.commit("a", "q", 0.1)
    f.release("a", RequestTelemetry(prompt_tokens=10, completion_tokens=4, batch_size=1,
                                    max_batch_size=1, ttft_s=0.05, tpot_s=0.02))
    warm = f.hold("m", 100, "b", 1.0, prompt_tokens=10)
    assert not warm.ttft_bound and warm.predicted_ttft_s < 1.0
    assert not warm.misses_deadline(0.5)          # a warm forecast gates at the replica


def test_a_warm_native_identity_is_never_gated_by_the_bound():
    f = Fleet()
    f.heartbeat(report("n", 1, running=1, tps=50.0), 0.0)
    hold = f.hold("m", 100, "a", 0.0, prompt_tokens=10)
    assert not hold.ttft_bound and not hold.misses_deadline(0.01)
