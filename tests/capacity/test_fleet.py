"""The actor's state machine without Ray: heartbeats feed rates, caps and the ledger; releases feed
per-request samples and TTFT calibration; the public feed and persistence."""
import json

import pytest

from capacity.errors import CapacityRefused, ConfigInvalid
from capacity.fleet import Fleet, FleetConfig
from capacity.identity import ExecutionKey
from capacity.protocol import RequestTelemetry

INT4 = "kvq-v1:affine-v1-k4v4-g64-f32-h128-s1:prefill=direct"


def report(replica, seq, *, node="box", running=0, waiting=0, tps=None, execution=None, used=0,
           max_=10_000, conc=24, active=(), incarnation=1, chip="M4|Max"):
    return {"replica_id": replica, "node_id": node, "chip_class": chip, "incarnation": incarnation,
            "seq": seq, "slots": [{
                "model_id": "m", "state": "running", "execution_identity": execution,
                "num_running": running, "num_waiting": waiting, "raw_budget_used": used,
                "raw_budget_max": max_, "max_concurrency": conc, "observed_decode_tps": tps,
                "active": [{"request_id": r, "raw_tokens": t} for r, t in active]}]}


def test_stale_heartbeat_is_discarded_and_teaches_nothing():
    f = Fleet()
    assert f.heartbeat(report("r0", 2, running=1, tps=50.0), 0.0)["accepted"]
    out = f.heartbeat(report("r0", 1, running=1, tps=400.0, max_=0), 0.0)
    assert out == {"accepted": False, "reason": "stale_or_out_of_order", "caps": {}}
    key = ExecutionKey.make("m", "M4|Max", None)
    assert f.rates.load_median(key) == 50.0
    assert f.snapshot(0.0)["models"][0]["headroom_raw_tokens"] == 10_000


def test_quantized_cap_expands_after_the_fifth_solo_heartbeat():
    f = Fleet()
    caps = [f.heartbeat(report("r0", s, running=1, tps=76.0, execution=INT4), 0.0)["caps"]["m"]
            for s in range(1, 6)]
    assert caps == [1, 1, 1, 1, 12]


def test_solo_samples_need_the_whole_box_quiet():
    f = Fleet()
    f.heartbeat(report("other", 1, running=1), 0.0)         # same box, another replica busy
    for s in range(1, 8):
        f.heartbeat(report("r0", s, running=1, tps=76.0, execution=INT4), 0.0)
    key = ExecutionKey.make("m", "M4|Max", INT4)
    assert f.rates.solo_median(key) == (None, 0)
    assert f.rates.load_median(key) == 76.0
    rows = {r["identity"]: r for r in f.snapshot(0.0)["models"][0]["identities"]}
    assert rows[INT4]["cap"] == 1 and rows["native"]["cap_source"] == "fallback"


def test_malformed_identity_is_quarantined_in_the_feed():
    f = Fleet()
    for s in range(1, 7):
        f.heartbeat(report("r0", s, running=1, tps=90.0, execution="kvq-v1:affine-v1-k4v4"), 0.0)
    ident = f.snapshot(0.0)["models"][0]["identities"][0]
    assert (ident["identity"], ident["cap"], ident["cap_source"], ident["decode_tps"]) == \
        ("kvq-v1:invalid", 1, "invalid", None)
    assert f.counters["quarantined"] == 6


def test_hold_commit_release_learns_once():
    f = Fleet()
    f.heartbeat(report("r0", 1, running=1, tps=50.0), 0.0)   # native: prefill bootstraps from decode
    hold = f.hold("m", 1000, "a", 0.0, prompt_tokens=600)
    assert hold.replica_id == "r0" and hold.ranking == ["r0"]
    assert hold.predicted_ttft_s == pytest.approx(600 / 600 + 1 / 50)
    assert f.commit("a", "r0", 0.1)
    tel = RequestTelemetry(prompt_tokens=600, completion_tokens=10, batch_size=1, max_batch_size=1,
                           ttft_s=0.51, tpot_s=0.02)
    assert f.release("a", tel) and not f.release("a", tel)
    key = ExecutionKey.make("m", "M4|Max", None)
    assert f.rates.prefill_tps(key) == pytest.approx(600 / 0.51)
    assert f.rates.solo_median(key) == (50.0, 2)            # the heartbeat's, and 1/tpot
    assert f.rates._ttft[key].values() == [pytest.approx(0.51 / 1.02)]


def test_refusal_debits_nothing_and_public_feed_matches_routing():
    f = Fleet()
    f.heartbeat(report("r0", 1, max_=500, conc=2), 0.0)
    f.hold("m", 400, "a", 0.0)
    snap = f.snapshot(0.0)["models"][0]
    assert (snap["headroom_raw_tokens"], snap["max_request_raw_tokens"]) == (100, 100)
    with pytest.raises(CapacityRefused) as e:
        f.hold("m", 101, "b", 0.0)
    assert e.value.reason == "no_capacity"
    assert f.snapshot(0.0)["outstanding_raw_tokens"] == 400
    f.hold("m", 100, "c", 0.0)
    assert f.snapshot(0.0)["models"][0]["ready"] is False


def test_persisted_rates_survive_a_restart_but_reservations_come_from_reports():
    f = Fleet()
    for s in range(1, 6):
        f.heartbeat(report("r0", s, running=1, tps=76.0, execution=INT4), 0.0)
    f.hold("m", 300, "a", 0.0)
    state = json.loads(json.dumps(f.persist_state()))
    g = Fleet.restore(state, FleetConfig())
    key = ExecutionKey.make("m", "M4|Max", INT4)
    assert g.rates.solo_median(key) == (76.0, 5)
    assert g.ledger.outstanding_raw() == 0
    out = g.heartbeat(report("r0", 6, running=1, execution=INT4, used=300, active=[("a", 300)]), 1.0)
    assert out["caps"]["m"] == 12 and g.ledger.outstanding_raw() == 300
    assert g.release("a") and g.ledger.outstanding_raw() == 0


def test_config_sections_are_configurable_from_dicts():
    cfg = FleetConfig.from_dict({"caps": {"overcommit": 2.0},
                                 "ledger": {"hold_ttl_s": 3.0}, "rates": {"ttft_clamp": [0.5, 1.0]}})
    assert cfg.caps.overcommit == 2.0 and cfg.ledger.hold_ttl_s == 3.0
    assert cfg.rates.ttft_clamp == (0.5, 1.0) and cfg.forecast.cold_load_penalty_s == 30.0
    assert FleetConfig.from_dict(None) == FleetConfig()


def test_config_refuses_an_unknown_key_by_name():
    with pytest.raises(ConfigInvalid) as e:
        FleetConfig.from_dict({"caps": {"floor_tp": 9.0}, "ledgr": {}})
    assert str(e.value).splitlines() == ["capacity config: caps.floor_tp: unknown key",
                                         "capacity config: ledgr: unknown key"]
    with pytest.raises(ConfigInvalid, match="rates.load_window"):
        FleetConfig.from_dict({"rates": {"load_window": "many"}})


def test_telemetry_is_solo_only_if_the_request_never_shared_the_box():
    f = Fleet()
    f.heartbeat(report("r0", 1, running=1), 0.0)
    key = ExecutionKey.make("m", "M4|Max", None)
    base = {"prompt_tokens": 10, "batch_size": 1, "ttft_s": 0.1, "tpot_s": 0.02}
    for i, extra in enumerate([{}, {"max_batch_size": 3}]):   # unknown, or shared later
        f.hold("m", 100, f"q{i}", 0.0)
        assert f.release(f"q{i}", RequestTelemetry(**base, **extra))
    assert f.rates.solo_median(key) == (None, 0)
    f.heartbeat(report("peer", 1, running=1), 0.0)            # the box is busy elsewhere
    f.hold("m", 100, "q9", 0.0)
    assert f.release("q9", RequestTelemetry(**base, max_batch_size=1))
    assert f.rates.solo_median(key) == (None, 0)
    assert f.rates.fit(key) is None and len(f.rates._hist[key].ttft) == 3   # still samples


def test_a_retired_replica_is_gone_from_the_feed_its_holds_settled_and_its_late_report_ignored():
    f = Fleet()
    f.heartbeat(report("dead", 1), 0.0)
    f.heartbeat(report("live", 1), 0.0)
    for rid in ("a", "b", "c"):
        f.hold("m", 100, rid, 0.0)
    on_dead = [r for r in ("a", "b", "c") if f.ledger.reservation(r).replica_id == "dead"]
    assert on_dead and f.commit(on_dead[0], "dead", 0.1)
    assert f.snapshot(0.2)["models"][0]["replicas"] == 2
    f.retire(["dead", "never-seen"])
    snap = f.snapshot(0.3)
    assert snap["models"][0]["replicas"] == 1 and f.counters["retired_replicas"] == 1
    # The dead replica's holds are settled now; the live one's settle by release and cancel.
    for rid in {"a", "b", "c"} - set(on_dead):
        assert f.release(rid) or f.cancel(rid)
    snap = f.snapshot(0.4)
    assert snap["outstanding_raw_tokens"] == 0
    assert snap["counters"]["holds"] == snap["counters"]["releases"] == 3
    assert snap["counters"]["settled"].get("dropped") == len(on_dead)
    # A heartbeat the dead replica sent before it died, delivered late, does not resurrect it.
    assert not f.heartbeat(report("dead", 2), 0.5)["accepted"]
    assert f.snapshot(0.6)["models"][0]["replicas"] == 1


def test_a_silent_replica_is_not_counted_live_in_the_feed():
    f = Fleet()
    f.heartbeat(report("r0", 1), 0.0)
    f.heartbeat(report("r1", 1), 10.0)
    [m] = f.snapshot(16.0)["models"]        # r0 silent for 16 s > stale_after_s (15 s)
    assert m["replicas"] == 1


def test_a_hold_dropped_with_its_replica_then_served_by_the_replacement_settles_once():
    """Issue 34: after a replica SIGKILL the feed read holds 7, releases 8. A request held on the
    dying replica while Serve re-routed it: its hold is dropped when the router retires the dead
    replica, then the replacement admits it (its commit carries raw tokens and model, so the
    reservation comes back) and releases it. One hold must settle once, not twice."""
    f = Fleet()
    f.heartbeat(report("dead", 1), 0.0)
    f.hold("m", 100, "x", 0.0)
    f.hold("m", 100, "y", 0.0)
    f.retire(["dead"])
    f.heartbeat(report("new", 1), 1.0)
    assert f.commit("x", "new", 1.1, raw_tokens=100, model_id="m")
    assert f.ledger.outstanding_raw() == 100        # the replacement runs it: counted again
    assert f.release("x")
    # A report rebuilds a dropped one the same way: "y" is listed by the replacement.
    f.heartbeat(report("new", 2, running=1, used=100, active=[("y", 100)]), 1.2)
    assert f.release("y")
    snap = f.snapshot(1.3)
    c = snap["counters"]
    assert snap["outstanding_raw_tokens"] == 0
    assert c["holds"] == c["releases"] == 2, c
    assert c["settled"] == {"dropped": 0, "released": 2} and c["rebuilt"] == 0


def test_reservations_rebuilt_without_a_hold_are_counted_apart():
    """An actor that restarted learns running requests from commits and reports it never held:
    they settle too, and are counted as rebuilt, so settlements == holds + rebuilt, all read
    from the public feed's counters."""
    f = Fleet()
    f.heartbeat(report("r0", 1, running=1, used=100, active=[("a", 100)]), 0.0)
    assert f.commit("b", "r0", 0.1, raw_tokens=50, model_id="m")
    f.hold("m", 10, "c", 0.2)
    for rid in ("a", "b", "c"):
        assert f.release(rid)
    c = f.snapshot(0.3)["counters"]
    assert (c["holds"], c["rebuilt"], c["releases"]) == (1, 2, 3)


def test_holding_an_active_request_again_counts_one_hold():
    """Serve re-routing a request before its first hold settled holds the same id again: the
    ledger returns the active reservation, and the counters must still balance (seen with
    shortened health checks on a pulled cable: holds 39, releases 37)."""
    f = Fleet()
    f.heartbeat(report("r0", 1), 0.0)
    first = f.hold("m", 100, "q1", 0.0)
    again = f.hold("m", 100, "q1", 0.1)
    assert again.replica_id == first.replica_id
    assert f.cancel("q1")
    c = f.snapshot(0.2)["counters"]
    assert c["holds"] == 1 and f.ledger.outstanding_raw() == 0
    assert c["holds"] == sum(c["settled"].values()), c
