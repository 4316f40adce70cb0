"""Routers alive in this process, and the replicas they see (for /metrics).

Its own module because Serve pickles the router's module *by value*: module-level state kept in
serve_app.routing would be a private copy inside each router, invisible to the ingress.
"""
from __future__ import annotations

import weakref
from typing import Any

_ROUTERS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def register(router: Any) -> None:
    _ROUTERS.add(router)


def router_events() -> dict[str, int]:
    """Hold, refusal, fault and fallback counts summed over this process's routers."""
    total: dict[str, int] = {}
    for router in list(_ROUTERS):
        for k, v in getattr(router, "stats", {}).items():
            total[k] = total.get(k, 0) + v
    return total


def replica_views() -> list[dict[str, Any]]:
    """Replicas known to this process's routers, with their latest routing stats."""
    views = {}
    for router in list(_ROUTERS):
        for replica in list(router.curr_replicas.values()):
            views[replica.replica_id.unique_id] = {
                "replica_id": replica.replica_id.unique_id,
                "deployment": replica.replica_id.deployment_id.name,
                "node_id": replica.node_id,
                "routing_stats": dict(replica.routing_stats or {}),
                "metadata": dict(replica.replica_metadata or {}),
            }
    return list(views.values())
