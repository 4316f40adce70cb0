"""Where replicas run, as the fleet's views say it (fast; tests/cluster/test_netns.py checks the
same on a real two-node cluster): the capacity feed's `nodes`, /metrics' `orchard:replica_info`,
and `capacity.actor_resources`, which pins the capacity actor."""
import pytest

from capacity.fleet import Fleet
from serve_app.config import ConfigError, parse_config
from serve_app.metrics import Metrics
from tests.capacity.test_fleet import report


def test_the_feed_names_each_replicas_node_and_forgets_a_retired_one():
    f = Fleet()
    f.heartbeat(report("r1", 1, node="mac-a"), 0.0)
    f.heartbeat(report("r2", 1, node="mac-b"), 0.0)
    f.heartbeat(report("r3", 1, node="mac-b"), 0.0)
    assert f.snapshot(0.1)["models"][0]["nodes"] == {"mac-a": 1, "mac-b": 2}
    f.retire(["r1"])
    assert f.snapshot(0.2)["models"][0]["nodes"] == {"mac-b": 2}


def test_metrics_place_each_replica_on_its_node():
    m = Metrics()
    m.observe_replicas([{"replica_id": "abc", "node_id": "n1",
                         "routing_stats": {"model_id": "tiny", "format_identity": "native"},
                         "metadata": {"node_ip": "10.0.0.2"}}])
    text = m.render().decode()
    assert ('orchard:replica_info{model_name="tiny",node_id="n1",node_ip="10.0.0.2",'
            'replica="abc"} 1.0') in text
    m.observe_replicas([])      # a replica gone is gone from the gauge too
    assert 'replica="abc"' not in m.render().decode()


def test_capacity_actor_resources_are_validated():
    base = {"models": [{"id": "m", "path": "models/orchard-tiny"}]}
    cfg = parse_config({**base, "capacity": {"actor_resources": {"head": 0.01}}})
    assert cfg.capacity.actor_resources == {"head": 0.01}
    assert parse_config(base).capacity.actor_resources == {}
    with pytest.raises(ConfigError, match="actor_resources"):
        parse_config({**base, "capacity": {"actor_resources": {"head": -1}}})
