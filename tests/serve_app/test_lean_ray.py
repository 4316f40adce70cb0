"""A local Ray runs without the bookkeeping orchard never reads (serve_app/launch.py,
LOCAL_RAY_SYSTEM_CONFIG and SERVE_START_ENV): on a 2-core box Ray's processes took 2.2 CPU-s per
20 s idle with it and 1.1 without, CPU a saturated replica's GEMMs wait on.

The session's Ray is started the way `orchard serve` starts its local one (tests/fixtures/
ray_session.py), so this checks what the cluster itself applied, not the dicts: the GCS's system
config, and Serve's control-loop interval as a process of that cluster reads it."""
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


def test_serve_processes_read_the_slower_control_loop(ray_session):
    ray = ray_session

    @ray.remote(num_cpus=0)
    def control_loop_interval() -> float:
        from ray.serve._private import constants

        return constants.CONTROL_LOOP_INTERVAL_S

    # A worker of this cluster (as Serve's controller is) inherits the start's environment.
    assert ray.get(control_loop_interval.remote()) == float(
        launch.SERVE_START_ENV["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"]) == 0.5
