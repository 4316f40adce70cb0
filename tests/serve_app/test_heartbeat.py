"""A replica's reports are built from values: its identity (fixed at start), the engine's stats
and cost model, its active requests; a request's telemetry from what its deltas showed."""
from types import SimpleNamespace

import pytest

from capacity.pricing import CostModel
from capacity.protocol import HeartbeatReport, RequestTelemetry
from serve_app.heartbeat import ReplicaIdentity, RequestMeter, build_report

INT4 = "affine-v1-k4v4-g64-f32-h64-s1"


def stats(running=1, waiting=0):
    return SimpleNamespace(num_requests_running=running, num_requests_waiting=waiting,
                           decode_step_s=0.05, prefill_tokens_per_s=600.0,
                           decode_step_profile={2: 0.06, 1: 0.05}, kv_bytes_reserved=4096)


def test_identity_is_the_wire_execution_and_native_omits_it():
    packed = ReplicaIdentity.of("r0", "box", "m", INT4, "fused")
    assert packed.execution == f"kvq-v1:{INT4}:prefill=fused"
    native = ReplicaIdentity.of("r0", "box", "m", "native-v1-bf16", "direct")
    assert native.execution is None and native.chip_class


def test_heartbeat_is_built_from_values():
    ident = ReplicaIdentity("r0", "box", "m", "M3|Max", f"kvq-v1:{INT4}:prefill=direct")
    cost = CostModel(budget_bytes=1 << 20, bytes_per_token=64, page_tokens=16,
                     fixed_bytes_per_request=0, concurrency_ceiling=8)
    report = build_report(ident, stats(), cost, {"a": 300, "b": 100}, incarnation=7, seq=3)
    assert isinstance(report, HeartbeatReport)
    assert (report.replica_id, report.node_id, report.chip_class, report.seq) == (
        "r0", "box", "M3|Max", 3)
    slot = report.slots[0]
    assert slot.execution_identity == slot.declared_execution == ident.execution
    assert (slot.state, slot.raw_budget_used, slot.max_concurrency) == ("running", 400, 8)
    assert slot.observed_decode_tps == pytest.approx(20.0)
    assert slot.decode_step_profile == [(1, 0.05), (2, 0.06)]
    assert [a.request_id for a in slot.active] == ["a", "b"] and slot.active_complete
    idle = build_report(ident, stats(running=0), cost, {}, incarnation=7, seq=4).slots[0]
    assert idle.state == "idle" and idle.observed_decode_tps is None


def test_request_meter_makes_the_telemetry_the_actor_reads():
    meter = RequestMeter(prompt_tokens=12, running_at_admission=0, started=100.0)
    usage = SimpleNamespace(prompt_tokens=10, completion_tokens=5, cached_tokens=0)
    assert meter.saw(SimpleNamespace(ttft_s=0.5, usage=usage, finish_reason=None))
    assert not meter.saw(SimpleNamespace(ttft_s=None, usage=usage, finish_reason="stop"))
    meter.last_t = 102.5
    tel = meter.telemetry(running_at_end=2, execution=None)
    assert tel == RequestTelemetry(prompt_tokens=10, completion_tokens=5, batch_size=1,
                                   max_batch_size=3, ttft_s=0.5, tpot_s=0.5,
                                   finish_reason="stop")
    # Refused before any delta: the prompt's length, no rates, the refusal as the finish.
    refused = RequestMeter(prompt_tokens=12, running_at_admission=4)
    refused.finish = "refused:too_large"
    tel = refused.telemetry(running_at_end=0, execution="x")
    assert (tel.prompt_tokens, tel.completion_tokens, tel.batch_size, tel.max_batch_size) == (
        12, 0, 5, 5)
    assert tel.ttft_s is None and tel.tpot_s is None and tel.finish_reason == "refused:too_large"
    assert RequestMeter(1, 0).telemetry(0, None).finish_reason == "cancelled"


def test_a_model_server_reports_its_weights_and_measured_bandwidth(tiny_llama):
    """The anomaly check's inputs come from the replica itself: the loaded model's parameters and
    bytes per parameter, and this box's memory bandwidth, measured at start."""
    from mlx.utils import tree_flatten

    from serve_app.app import build_local_app
    from serve_app.config import parse_config

    _, servers = build_local_app(parse_config({"models": [{"id": "m", "path": tiny_llama}]}))
    [server] = servers.values()
    try:
        report = server.heartbeat_report(incarnation=1, seq=1)
        weights = tree_flatten(server.engine.loaded.model.parameters())
        slot = report.slots[0]
        assert slot.active_params == sum(a.size for _, a in weights) > 0
        assert slot.bytes_per_param == pytest.approx(
            sum(a.nbytes for _, a in weights) / slot.active_params)
        assert report.memory_bandwidth_gbps is not None and report.memory_bandwidth_gbps > 0
        assert server.startup["identity_s"] >= 0
    finally:
        server.shutdown()
