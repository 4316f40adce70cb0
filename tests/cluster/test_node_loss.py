"""A node lost without closing its sockets (power cut, cable pulled), on the two-node cluster
in network namespaces (tests/cluster/netns.py): one orchard-tiny replica on each node, the
worker's port on the switch set down while a stream runs on its replica
(tests/cluster/node_loss.py). Every bound asserted here comes from the configured timeouts
(Ray's GCS health checks, the capacity ledger's `stale_after_s`: node_loss.bounds), never from
a guess at this machine's speed. Needs root (CI runs as root); a kernel that refuses network
namespaces fails this test, it is not skipped.
"""
from pathlib import Path

import pytest

from tests.cluster.netns import run_scenario

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.cluster
def test_cable_pulled_streams_end_the_head_serves_the_feed_drops_it_and_holds_settle(tmp_path):
    facts = run_scenario(REPO, tmp_path, "tests.cluster.node_loss", timeout=540)
    assert "error" not in facts, facts
    assert facts["submit_rc"] == 0, facts["job_tail"]
    head, worker = "10.203.0.1", "10.203.0.2"
    b = facts["bounds"]
    assert facts["placement"] == {"model-tiny": [head, worker], "ingress": [head]}, facts
    assert facts["feed_before"]["replicas"] == 2, facts["feed_before"]
    # Every stream on the worker's replica ended with an error event (then [DONE]) or a 5xx,
    # within the GCS's detection bound: none hung, none was cut without a word.
    for s in facts["worker_streams"]:
        assert s["outcome"] in ("error_event", "refused") or (s["status"] or 0) >= 500, s
        assert s["ended_after_cut_s"] <= b["stream_ends_s"], (s, b)
    assert facts["worker_streams_ended_after_cut_s"] <= b["stream_ends_s"], facts
    # (+ seen_within_s, here and below: the scenario sees a change by polling over HTTP)
    assert facts["node_dead_after_cut_s"] <= b["gcs_node_dead_s"] + b["seen_within_s"], facts
    # The feed stops counting the silent replica within stale_after_s (its last heartbeat was
    # at most one interval before the cut), and drops the node once Serve retires the replica.
    assert facts["feed_after_stale"]["replicas"] == 1, facts["feed_after_stale"]
    assert facts["feed_replicas_1_after_cut_s"] <= b["feed_replicas_s"] + b["seen_within_s"], facts
    worker_node = facts["nodes"][worker]
    assert worker_node not in facts["feed_after_loss"]["nodes"], facts["feed_after_loss"]
    assert facts["feed_node_dropped_after_cut_s"] <= b["stream_ends_s"], facts
    # New requests (one every 0.5 s throughout) are served by the head's replica: at once where
    # routed there, and every one of them once the feed stops counting the silent replica; a
    # request routed to the lost one before that ends like the streams (error event or 503 +
    # Retry-After). None hung, none was cut without a word.
    assert set(facts["probe_outcomes"]) <= {"ok", "refused", "error_event"}, facts
    assert facts["first_ok_after_cut_s"] is not None, facts
    assert (facts["every_new_request_served_from_s"]
            <= b["feed_replicas_s"] + b["seen_within_s"]), facts
    assert facts["replicas_serving_after_detection"] == [facts["replica_on"]["head"]], facts
    # A request open past the cut ended within the detection bound, plus what a request the
    # loss could not touch took here meanwhile (a loaded box is slow, it does not hang).
    assert (facts["longest_probe_past_cut_s"]
            <= b["stream_ends_s"] + facts["slowest_after_detection_s"]), facts
    # The ledger settles: idle, and every hold taken since before the fault settled once.
    assert facts["ledger_settled"], facts["ledger_after"]
    assert facts["ledger_after"]["holds"] == facts["ledger_after"]["releases"], facts
