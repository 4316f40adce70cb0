"""Builders: the Serve application (usable as a `serve run`/`serve deploy` import path) and an
in-process FastAPI app with the same HTTP layer (tests, the TTFT-overhead bench).

    import_path: serve_app.app:app_builder
    args: {config: config.yaml}          # or the config mapping itself under `args`
"""
from __future__ import annotations

import logging
import os
from typing import Any, AsyncIterator

from ray import serve
from ray.serve.config import RequestRouterConfig

from serve_app.capacity_link import make_client, negotiate_format
from serve_app.config import CapacitySettings, ModelConfig, OrchardConfig, load_config, parse_config
from serve_app.ingress import IngressCore, build_fastapi_app
from serve_app.memory_plan import plan_memory, with_kv_budgets
from serve_app.calls import GenerateCall
from serve_app.server import ModelServer
from serve_app.wire import encode

INGRESS_NAME = "ingress"
ROUTER_CLASS = "serve_app.routing.CapacityRouter"
INGRESS_SHUTDOWN_POLL_S = 0.5
# After a model replica ends a stream (or is killed mid-stream), the old ingress still writes
# the stream's last events (finish or error, then [DONE]) before it may be stopped.
INGRESS_RELAY_MARGIN_S = 5.0


log = logging.getLogger("orchard.app")


def deployment_name(model_id: str) -> str:
    return f"model-{model_id}"


class ModelDeployment(ModelServer):
    """ModelServer as a Serve replica: reporting starts on the replica's event loop."""

    async def __init__(self, model: ModelConfig, kv_format: str,  # type: ignore[misc]
                       capacity: CapacitySettings | None, drain_timeout_s: float):
        self.kv_format_requested = kv_format
        kv_format, self.kv_format_reason = await negotiate_format(kv_format, capacity)
        ModelServer.__init__(self, model, kv_format, capacity, drain_timeout_s)
        # Warm-up before the first heartbeat: the actor learns this box's batch slowdown from it.
        await self.prepare(model.warmup)

    async def generate_wire(self, call: GenerateCall) -> AsyncIterator[bytes]:
        """`generate`'s items as bytes: what RayBackend streams (serve_app/wire.py says why)."""
        items = self.generate(call)
        try:
            async for item in items:
                yield encode(item)
        finally:
            # Closed at once when the ingress cancels (not at garbage collection): `generate`'s
            # own finally cancels the engine request and releases its hold.
            await items.aclose()


@serve.ingress()
class OrchardIngress:
    def __init__(self, config: OrchardConfig, handles: dict[str, Any]):
        from serve_app.backends import RayBackend
        from serve_app.router_registry import replica_views, router_events

        self.core = IngressCore(config, {mid: RayBackend(h) for mid, h in handles.items()},
                                capacity=make_client(config.capacity),
                                replica_views=replica_views, router_events=router_events)

    def pid(self) -> int:
        """This ingress replica's process (fault tests and operators kill it by pid)."""
        return os.getpid()

    def __serve_build_asgi_app__(self):
        return build_fastapi_app(self.core)


def actor_options(cfg: OrchardConfig, resources) -> dict[str, Any]:
    """Ray actor options of one replica: its resources plus the app's replica_env."""
    opts = resources.ray_actor_options()
    # Serve merges env_vars over the job's runtime_env (PYTHONPATH, LD_PRELOAD stay).
    opts["runtime_env"] = {"env_vars": cfg.replica_env_vars()}
    return opts


def model_shutdown_budget_s(cfg: OrchardConfig) -> float:
    """How long Serve lets a model replica drain before killing it: its requests' drain, then
    the engine's shutdown and the handoff export."""
    return cfg.drain_timeout_s + 5.0


def ingress_deployment_options(cfg: OrchardConfig) -> dict[str, Any]:
    return dict(
        name=INGRESS_NAME, num_replicas=1,
        ray_actor_options=actor_options(cfg, cfg.ingress_resources),
        max_ongoing_requests=10_000,
        # A redeploy replaces the ingress while streams run through it. Serve's default budget
        # (20 s) cut streams their model replica was still serving; the old ingress now outlives
        # the model replicas' drain by the time to relay a stream's last events, and checks
        # every 0.5 s (Serve's default: 2 s) so it leaves right after its last stream.
        graceful_shutdown_wait_loop_s=INGRESS_SHUTDOWN_POLL_S,
        graceful_shutdown_timeout_s=model_shutdown_budget_s(cfg) + INGRESS_RELAY_MARGIN_S,
    )


def model_deployment_options(cfg: OrchardConfig, model) -> dict[str, Any]:
    extra = {"max_replicas_per_node": model.max_replicas_per_node} \
        if model.max_replicas_per_node else {}
    return dict(
        name=deployment_name(model.id),
        num_replicas=model.replicas,
        **extra,
        ray_actor_options=actor_options(cfg, model.resources),
        # The capacity actor and the engine's byte ledger own the real cap; this is a ceiling.
        max_ongoing_requests=model.max_ongoing_requests or 2 * model.max_num_seqs,
        # A dead replica is noticed at its next health check: on the path of recovery.
        health_check_period_s=1.0,
        health_check_timeout_s=30.0,
        graceful_shutdown_wait_loop_s=1.0,
        graceful_shutdown_timeout_s=model_shutdown_budget_s(cfg),
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTER_CLASS,
            request_router_kwargs={
                "capacity": cfg.capacity.model_dump(),
            },
            request_routing_stats_period_s=cfg.capacity.routing_stats_period_s,
        ),
    )


def build_app(config: OrchardConfig | dict[str, Any]):
    """The Serve application: one deployment per model behind one ingress."""
    cfg = config if isinstance(config, OrchardConfig) else parse_config(config)
    plan = plan_memory(cfg)     # refuses, with the numbers, models that cannot fit together
    handles = {}
    for m, model in zip(cfg.models, with_kv_budgets(cfg, plan)):
        dep = serve.deployment(ModelDeployment, **model_deployment_options(cfg, m))
        handles[m.id] = dep.bind(model=model, kv_format=cfg.kv_format_for(m),
                                 capacity=cfg.capacity, drain_timeout_s=cfg.drain_timeout_s)
    ingress = serve.deployment(OrchardIngress, **ingress_deployment_options(cfg))
    return ingress.bind(cfg, handles)


def app_builder(args: dict[str, Any]):
    """`serve run`/`serve deploy` builder: args = {config: path} or a config mapping."""
    if set(args) == {"config"}:
        return build_app(load_config(args["config"]))
    return build_app(parse_config(args, source="serve args"))


def build_local_app(config: OrchardConfig, capacity: Any = None):
    """Everything in this process, no Ray: returns (FastAPI app, {model id: ModelServer})."""
    from serve_app.backends import LocalBackend

    models = with_kv_budgets(config, plan_memory(config))
    servers = {m.id: ModelServer(model, config.kv_format_for(m), None, config.drain_timeout_s)
               for m, model in zip(config.models, models)}
    core = IngressCore(config, {mid: LocalBackend(s) for mid, s in servers.items()},
                       capacity=capacity)
    return build_fastapi_app(core), servers
