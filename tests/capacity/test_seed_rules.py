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


def _identity(tiny_llama, replica):
    from engine.model.loader import load_model
    from serve_app.heartbeat import ReplicaIdentity

    lm = load_model(tiny_llama)
    return ReplicaIdentity.of(replica, "box", "m", "native-v1-f32", "direct", model=lm.model), lm


def test_replicas_report_their_weights_and_measured_bandwidth(tiny_llama):
    from mlx.utils import tree_flatten

    ident, lm = _identity(tiny_llama, "r0")
    arrays = [a for _, a in tree_flatten(lm.model.parameters())]
    assert ident.active_params == sum(a.size for a in arrays)       # float32 weights, unpacked
    assert ident.bytes_per_param == 4.0
    assert ident.memory_bandwidth_gbps > 0.1                        # measured on this box


def test_heartbeats_feed_the_native_anomaly_check_and_the_feed_reports_it(tiny_llama):
    from types import SimpleNamespace

    from capacity.pricing import CostModel
    from serve_app.heartbeat import build_report

    ident, _ = _identity(tiny_llama, "r0")
    expected = ident.memory_bandwidth_gbps * 1e9 * 0.8 / (ident.active_params * 4.0)
    cost = CostModel(budget_bytes=1 << 20, bytes_per_token=64, page_tokens=16,
                     fixed_bytes_per_request=0, concurrency_ceiling=8)
    f = Fleet()
    for i, rid in enumerate(["r0", "r1", "r2"]):
        rep = type(ident)(**{**ident.__dict__, "replica_id": rid})
        # Solo decode at a tenth of what the measured bandwidth allows: a sick box.
        step = SimpleNamespace(num_requests_running=1, num_requests_waiting=0,
                               decode_step_s=1 / (expected * 0.1), prefill_tokens_per_s=0.0,
                               decode_step_profile={}, kv_bytes_reserved=0)
        f.heartbeat(build_report(rep, step, cost, {"a": 10}, incarnation=1, seq=1).model_dump(),
                    0.0)
    [flag] = f.snapshot(0.0)["anomalies"]
    assert flag["model"] == "m" and flag["samples"] == 3
    assert flag["ratio"] == pytest.approx(0.1, rel=1e-6)
    # Packed slots never trigger the native expectation, however slow.
    g = Fleet()
    for rid in ["q0", "q1", "q2"]:
        rep = type(ident)(**{**ident.__dict__, "replica_id": rid, "execution": INT4})
        g.heartbeat(build_report(rep, step, cost, {"a": 10}, incarnation=1, seq=1).model_dump(),
                    0.0)
    assert g.snapshot(0.0)["anomalies"] == []
