"""The warm-up's lone decode steps are solo samples of the replica's own identity (issue 32,
item 3): a quantized replica's first heartbeat lifts it off the uncalibrated cap of 1, and a
replica that keeps re-sending them does not count them twice."""
from capacity.fleet import Fleet
from capacity.identity import ExecutionKey
from tests.capacity.test_fleet import INT4, report


def _warm(replica, seq, samples, incarnation=1):
    r = report(replica, seq, execution=INT4, incarnation=incarnation)
    r["slots"][0]["warmup_solo_tps"] = samples
    return r


def test_warmup_samples_give_a_quantized_identity_a_learned_cap_before_traffic():
    f = Fleet()
    key = ExecutionKey.make("m", "M4|Max", INT4)
    assert f.heartbeat(report("q", 1, execution=INT4), 0.0)["caps"]["m"] == 1   # uncalibrated
    cap = f.heartbeat(_warm("q", 2, [76.0] * 8), 0.0)["caps"]["m"]
    assert cap > 1 and f.rates.solo_median(key) == (76.0, 8)
    for seq in (3, 4):   # every heartbeat re-sends them; they count once per incarnation
        assert f.heartbeat(_warm("q", seq, [76.0] * 8), 0.0)["caps"]["m"] == cap
    assert f.rates.solo_median(key) == (76.0, 8)
    f.heartbeat(_warm("q", 1, [80.0] * 8, incarnation=2), 0.0)   # a restarted replica warmed again
    assert f.rates.solo_median(key)[1] == 16


def test_fewer_warmup_samples_than_the_rule_asks_leave_the_cap_at_one():
    f = Fleet()
    assert f.heartbeat(_warm("q", 1, [76.0] * 4), 0.0)["caps"]["m"] == 1
