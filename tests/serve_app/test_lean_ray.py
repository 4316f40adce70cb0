"""A local Ray runs without the bookkeeping orchard never reads (serve_app/launch.py,
LOCAL_RAY_SYSTEM_CONFIG): Ray's metrics, task events and event-loop stats, CPU a saturated
replica's GEMMs wait on on a 2-core box.

The session's Ray is started the way `orchard serve` starts its local one (tests/fixtures/
ray_session.py), so this checks what the cluster itself applied (the GCS's system config), not
the dict."""
from __future__ import annotations

from serve_app import launch


def test_the_running_ray_applied_the_lean_system_config(ray_session):
    from ray._private.state import state

    applied = state.get_system_config()
    for key in ("enable_metrics_collection", "task_events_report_interval_ms", "event_stats"):
        assert key in launch.LOCAL_RAY_SYSTEM_CONFIG, key
        assert applied.get(key) == launch.LOCAL_RAY_SYSTEM_CONFIG[key], (key, applied.get(key))
    assert applied["enable_metrics_collection"] is False
    assert applied["task_events_report_interval_ms"] == 0

