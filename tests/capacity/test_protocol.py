"""Wire models: unknown fields, identity precedence, versions, capability negotiation; anomaly check."""
import pytest

from capacity.anomaly import AnomalyConfig, DecodeObservation, check, expected_decode_tps
from capacity.errors import ProtocolError
from capacity.protocol import ActorUnreachable
from capacity.identity import INVALID, NATIVE, ExecutionKey
from capacity.pricing import CostModel, Workspace
from capacity.protocol import (ActorInfo, CostModelWire, HeartbeatReport, RequestTelemetry,
                               SlotReport, check_version, negotiate_kv_format)

INT4 = "kvq-v1:affine-v1-k4v4-g64-f32-h128-s1:prefill=direct"


def test_unknown_fields_and_states_are_tolerated():
    r = HeartbeatReport.model_validate({
        "replica_id": "r", "seq": 1, "from_the_future": {"x": 1},
        "slots": [{"model_id": "m", "state": "hibernating", "new_field": 3}]})
    assert r.slots[0].state == "unknown"


def test_actual_identity_wins_when_resident():
    running_native = SlotReport(model_id="m", state="running", declared_execution=INT4)
    assert running_native.resolved_execution() == NATIVE        # omitted + resident = native
    loading = SlotReport(model_id="m", state="loading", declared_execution=INT4,
                         execution_identity="stale")
    assert loading.resolved_execution() == INT4                 # not resident: the declaration
    idle_bad = SlotReport(model_id="m", state="idle", execution_identity="kvq-v1:garbage")
    assert idle_bad.resolved_execution() == INVALID             # never native


def test_protocol_version_floor():
    with pytest.raises(ProtocolError):
        check_version(HeartbeatReport(replica_id="r", seq=0, protocol_version=0))
    check_version(HeartbeatReport(replica_id="r", seq=0, protocol_version=7))  # newer: additive


def test_negotiation_enables_packed_only_with_the_capability():
    ok = negotiate_kv_format("int4", ActorInfo())
    assert ok.kv_format == "int4"
    old = ActorInfo(capabilities=["cost_model"])
    # Never a silent native fallback: an old actor refuses, an unreachable one asks for a retry.
    with pytest.raises(ProtocolError, match="execution_identity"):
        negotiate_kv_format("int4", old)
    with pytest.raises(ActorUnreachable, match="unreachable"):
        negotiate_kv_format("k8v4", None)
    assert negotiate_kv_format("native", None).kv_format == "native"


def test_cost_model_wire_round_trip():
    cm = CostModel(budget_bytes=1 << 20, bytes_per_token=640, page_tokens=16,
                   fixed_bytes_per_request=96, workspace=Workspace(10, 2, 3), concurrency_ceiling=8,
                   token_limit=4096)
    assert CostModelWire.from_cost_model(cm).to_cost_model() == cm
    assert CostModelWire.model_validate_json(CostModelWire.from_cost_model(cm).model_dump_json()) \
        .to_cost_model() == cm


def _obs(execution, tps, running=1, chip="M4|Max"):
    # 546 GB/s, 3.6e9 active params at 0.5 B/param: expected = 546e9 * 0.8 / 1.8e9 = 242.67 tok/s
    return DecodeObservation(ExecutionKey.make("m", chip, execution), tps, running, 546.0, 3_600_000_000, 0.5)


def test_anomaly_expectation_by_hand():
    assert expected_decode_tps(546.0, 3_600_000_000, 0.5, 0.8) == pytest.approx(242.666, rel=1e-4)


def test_anomaly_flags_slow_native_buckets_only():
    slow = [_obs(None, 60.0) for _ in range(3)]                 # 60 / 242.7 = 0.247 < 0.35
    quantized = [_obs(INT4, 10.0) for _ in range(5)]            # packed: excluded, however slow
    busy = [_obs(None, 5.0, running=4) for _ in range(5)]       # not near-solo: excluded
    out = check(slow + quantized + busy)
    assert [(a.model, a.chip_class, a.samples) for a in out] == [("m", "M4|Max", 3)]
    assert out[0].ratio == pytest.approx(60 / 242.666, rel=1e-4)
    assert check(slow[:2]) == []                                # fewer than 3 samples
    assert check([_obs(None, 100.0) for _ in range(3)]) == []   # 0.41: healthy
    assert check(quantized, AnomalyConfig(min_samples=1)) == []


def test_batched_operations_have_one_codec_and_malformed_ones_fail_alone():
    import msgpack

    from capacity.fleet import Fleet
    from capacity.operations import (CancelOp, CommitOp, HeartbeatOp, HoldOp, ReleaseOp,
                                     RetireOp, decode_op, encode_op)
    from capacity.ops import BatchOps

    ops = [HoldOp("m", 10, "a", 4, ("r1",), 2.5), CommitOp("a", "r0", 10, "m"),
           ReleaseOp("a", {"prompt_tokens": 4}), CancelOp("a"), HeartbeatOp({"seq": 1}),
           RetireOp(["r0"])]
    for op in ops:
        wire = msgpack.unpackb(msgpack.packb(encode_op(op)))   # as the direct connection does
        assert wire[0] == op.name and decode_op(wire) == decode_op(op) == op.__class__(*wire[1:])
    # Older clients' shorter forms still decode (trailing optional fields default).
    assert decode_op(("hold", "m", 10, "b")) == HoldOp("m", 10, "b")
    out = BatchOps(Fleet()).apply([("nope", 1), ("cancel",), ("cancel", "x")])
    assert out[0]["error"] == "CapacityError" and out[1]["error"] == "MalformedOp"
    assert out[2] is False


def test_request_telemetry_round_trips_through_the_ops_codec_as_one_type():
    import pickle

    import msgpack

    from capacity.fleet import Fleet
    from capacity.operations import ReleaseOp, decode_op, encode_op
    from capacity.ops import BatchOps

    tel = RequestTelemetry(prompt_tokens=600, completion_tokens=10, batch_size=2,
                           max_batch_size=3, ttft_s=0.5, tpot_s=0.02, execution_identity=INT4,
                           finish_reason="stop")
    wire = encode_op(ReleaseOp("a", tel))
    for carried in (msgpack.unpackb(msgpack.packb(wire)), pickle.loads(pickle.dumps(wire))):
        got = decode_op(carried)                     # the direct connection's and Ray's forms
        assert isinstance(got.telemetry, RequestTelemetry) and got.telemetry == tel
    assert decode_op(encode_op(ReleaseOp("a"))).telemetry is None
    # A malformed report fails alone, before it refunds anything.
    fleet = Fleet()
    out = BatchOps(fleet).apply([["release", "a", {"batch_size": 0}], ["cancel", "b"]])
    assert out[0]["error"] == "ValidationError" and out[1] is False
