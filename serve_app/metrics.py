"""Prometheus metrics at the ingress, named like vLLM's so existing dashboards carry over.

Latency histograms, token counters, admissions and refusals are observed here on the request
path. Replica gauges (running, waiting, KV bytes and pages) come from the replicas' routing
stats, and learned rates and caps from the capacity feed, refreshed at scrape time.
"""
from __future__ import annotations

from typing import Any, Iterable

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)

# `*_created` series double the output and no dashboard reads them.
disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        m, mf = ["model_name"], ["model_name", "format_identity"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token (ingress)",
                              mf, buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Gap between streamed tokens",
                             mf, buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency end to end",
                             mf, buckets=_E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", m,
                                         registry=r)
        self.cached_tokens = Counter("orchard:prefix_cache_hit_tokens", "Prompt tokens served "
                                     "from the prefix cache", m, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests", m + ["finished_reason"],
                               registry=r)
        self.admissions = Counter("orchard:admissions", "Requests admitted to an engine", m,
                                  registry=r)
        self.refusals = Counter("orchard:refusals", "Requests refused, by reason",
                                m + ["reason", "status"], registry=r)
        rep = ["model_name", "replica", "format_identity"]
        self.running = Gauge("vllm:num_requests_running", "Requests running on a replica", rep,
                             registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting on a replica", rep,
                             registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage, 0-1 by bytes", rep,
                              registry=r)
        self.kv_bytes = Gauge("orchard:kv_cache_bytes", "KV bytes", rep + ["kind"], registry=r)
        self.kv_pages = Gauge("orchard:kv_cache_pages", "KV pages", rep + ["kind"], registry=r)
        self.headroom = Gauge("orchard:headroom_raw_tokens", "Largest raw-token request a replica "
                              "could admit now", rep, registry=r)
        ident = ["model_name", "execution_identity"]
        self.cap = Gauge("orchard:concurrency_cap", "Concurrency cap learned per identity", ident,
                         registry=r)
        self.rate = Gauge("orchard:learned_rate_tokens_per_second", "Learned rate per identity",
                          ident + ["phase"], registry=r)
        self.router = Gauge("orchard:router_events", "Capacity router events in this ingress "
                            "(holds, refusals, actor faults, fallback routes), since start",
                            ["event"], registry=r)
        # Where each replica runs (1 per replica): join on `replica` to place the gauges above.
        self.replica_info = Gauge("orchard:replica_info", "Replica placement: its Ray node",
                                  ["model_name", "replica", "node_id", "node_ip"], registry=r)
        self._replica_gauges = (self.running, self.waiting, self.kv_usage, self.kv_bytes,
                                self.kv_pages, self.headroom, self.replica_info)

    def observe_replicas(self, views: Iterable[dict[str, Any]]) -> None:
        """Replace the replica gauges with the current routing-stats view."""
        for g in self._replica_gauges:
            g.clear()
        for v in views:
            s = v.get("routing_stats") or {}
            if not s:
                continue
            labels = (s.get("model_id", "?"), v["replica_id"], s.get("format_identity", "?"))
            meta = v.get("metadata") or {}
            self.replica_info.labels(labels[0], v["replica_id"], v.get("node_id") or "?",
                                     meta.get("node_ip") or "?").set(1)
            self.running.labels(*labels).set(s.get("num_requests_running", 0))
            self.waiting.labels(*labels).set(s.get("num_requests_waiting", 0))
            total = s.get("kv_bytes_total") or 0
            self.kv_usage.labels(*labels).set(s.get("kv_bytes_used", 0) / total if total else 0.0)
            self.kv_bytes.labels(*labels, "used").set(s.get("kv_bytes_used", 0))
            self.kv_bytes.labels(*labels, "total").set(total)
            self.kv_pages.labels(*labels, "used").set(s.get("kv_pages_used", 0))
            self.kv_pages.labels(*labels, "total").set(s.get("kv_pages_total", 0))
            self.headroom.labels(*labels).set(s.get("headroom_raw_tokens", 0))

    def observe_router(self, events: dict[str, int]) -> None:
        for event, count in events.items():
            self.router.labels(event).set(count)

    def observe_identities(self, rows: Iterable[dict[str, Any]]) -> None:
        """Caps and learned rates per (model, execution identity) from the capacity feed."""
        self.cap.clear()
        self.rate.clear()
        for row in rows:
            labels = (row.get("model_id", "?"), row.get("identity", "?"))
            if row.get("cap") is not None:
                self.cap.labels(*labels).set(row["cap"])
            for phase in ("prefill", "decode"):
                value = row.get(f"{phase}_tokens_per_s")
                if value is not None:
                    self.rate.labels(*labels, phase).set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
