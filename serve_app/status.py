"""`orchard status`: Serve's view (deployments, replica states) plus the capacity feed
(formats, budgets, caps) of the running service."""
from __future__ import annotations

import asyncio
import json

from serve_app.launch import label


def print_status(app_name: str, namespace: str) -> int:
    from ray import serve

    status = serve.status()
    app = status.applications.get(app_name)
    if app is None:
        print(f"no Serve application named {app_name!r} on this cluster "
              f"(running: {', '.join(status.applications) or 'none'})")
        return 1
    print(f"application {app_name}: {label(app.status)}")
    for name, dep in app.deployments.items():
        states = ", ".join(f"{n} {label(s)}" for s, n in dep.replica_states.items())
        print(f"  {name}: {label(dep.status)} ({states or 'no replicas'})")
    snapshot = _snapshot(namespace)
    if snapshot is None:
        print("capacity: actor unreachable")
        return 0
    for line in capacity_lines(snapshot):
        print(line)
    return 0


def _snapshot(namespace: str) -> dict | None:
    try:
        from serve_app.capacity_client import CapacityClient

        return asyncio.run(CapacityClient(namespace=namespace, create=False).snapshot())
    except Exception:  # noqa: BLE001 - status must still print Serve's view
        return None


def capacity_lines(snapshot: dict) -> list[str]:
    """One line per model (readiness, headroom in raw tokens and requests), then one per
    execution identity (chip class, cap and its source, learned rates)."""
    lines = ["capacity:"]
    models = snapshot.get("models") if isinstance(snapshot, dict) else None
    if not isinstance(models, list):
        return lines + ["  " + json.dumps(snapshot, default=str, sort_keys=True)]
    for m in models:
        lines.append("  " + " ".join(f"{k}={v}" for k, v in m.items()
                                     if not isinstance(v, (list, dict))))
        for row in m.get("identities") or []:
            lines.append("    " + " ".join(f"{k}={v}" for k, v in row.items()
                                           if not isinstance(v, (list, dict))))
    return lines
