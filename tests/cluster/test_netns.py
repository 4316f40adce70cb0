"""Orchard on a real two-node Ray cluster: each node in its own network namespace.

The harness (tests/cluster/netns.py) runs cluster.yaml's own head and worker start commands
(token auth, the `mac` resource) on separate addresses; tests/cluster/scenario.py then works
from a third namespace as an operator would: `ray job submit` of `orchard deploy`, chat
through the head's ingress, and the worker's raylet killed under mixed load. Needs root (CI
runs as root); a kernel that refuses network namespaces fails this test, it is not skipped.
"""
from pathlib import Path

import pytest

from tests.cluster.netns import run_scenario

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.cluster
def test_two_nodes_in_namespaces_deploy_serve_lose_and_regain_the_worker(tmp_path):
    facts = run_scenario(REPO, tmp_path, "tests.cluster.scenario", timeout=420)
    head, worker = "10.203.0.1", "10.203.0.2"
    worker_node = facts["nodes"][worker]
    # `ray job submit` of `orchard deploy` from the client namespace deployed the app.
    assert facts["submit_rc"] == 0, facts["job_tail"]
    assert "deployed orchard" in facts["job_tail"], facts["job_tail"]
    assert facts["chat_status"] == 200, facts
    # Placement: the model replica on the worker (by the mac resource), the ingress and the
    # capacity actor on the head; the feed and /metrics name the worker's node.
    assert facts["placement"] == {"model-tiny": [worker], "ingress": [head]}, facts
    assert facts["capacity_actor_ip"] == head, facts
    assert facts["feed_before"]["nodes"] == {worker_node: 1}, facts["feed_before"]
    [info] = facts["metrics_replica_info"]
    assert f'node_id="{worker_node}"' in info and f'node_ip="{worker}"' in info, info
    assert f'replica="{facts["chat_replica"]}"' in info, info
    # The capacity actor's direct transport listens on the head's LAN address, and the
    # worker's replica is connected to it across namespaces.
    [listen] = facts["direct_transport"]["listen"]
    assert listen.startswith(head + ":"), facts["direct_transport"]
    assert worker in facts["direct_transport"]["peers"], facts["direct_transport"]
    # The worker's raylet killed under mixed load: the GCS and the capacity feed drop it, and
    # no client ever hangs: each request is served, refused with Retry-After, or its stream
    # ends with an error event.
    assert facts["node_dead_after_kill_s"] < 60, facts
    # (with no replica left the model leaves the feed; requests meanwhile: 503 unknown_model)
    assert facts["feed_after_loss"].get("replicas", 0) == 0, facts["feed_after_loss"]
    assert worker_node not in facts["feed_after_loss"].get("nodes", {}), facts["feed_after_loss"]
    assert set(facts["outcomes"]) <= {"ok", "refused", "error_event"}, facts["not_ok"]
    assert facts["outcomes"].get("refused", 0) + facts["outcomes"].get("error_event", 0), facts
    # The worker rejoins (cluster.yaml's worker commands again): a new replica there is routed.
    new_node = facts["new_worker_node"]
    assert new_node != worker_node
    assert facts["placement_after"] == {"model-tiny": [worker], "ingress": [head]}, facts
    assert facts["model_replica_ids_after"] != facts["model_replica_ids"], facts
    assert facts["replicas_served_after"] == facts["model_replica_ids_after"], facts
    assert facts["feed_after_rejoin"]["nodes"] == {new_node: 1}, facts["feed_after_rejoin"]
