"""What `python -m loadtest chat` reads from a target's /metrics while it runs: requests running
per replica against the learned concurrency cap, and the router's event counters."""
from __future__ import annotations

import re
import threading
import urllib.request

_RUNNING = re.compile(r'^vllm:num_requests_running\{[^}]*replica="([^"]+)"[^}]*\} (\S+)$', re.M)
_CAP = re.compile(r'^orchard:concurrency_cap\{[^}]*\} (\S+)$', re.M)
_EVENT = re.compile(r'^orchard:router_events\{event="(\w+)"\} (\S+)$', re.M)


def metrics_sample(url: str) -> dict:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    caps = [float(v) for v in _CAP.findall(text)]
    return {"running": {rid: float(v) for rid, v in _RUNNING.findall(text)},
            "cap": min(caps) if caps else None,
            "router_events": {k: float(v) for k, v in _EVENT.findall(text)}}


class CapWatch(threading.Thread):
    """Samples each target's replicas: the most requests seen running on one, and the cap."""

    def __init__(self, targets: list[dict], period_s: float):
        super().__init__(daemon=True)
        self.targets, self.period_s = targets, period_s
        self.stop_event = threading.Event()
        self.seen = {t["label"]: {"samples": 0, "max_running": 0.0, "over_cap_samples": 0,
                                  "caps": []} for t in targets}

    def run(self) -> None:
        while not self.stop_event.wait(self.period_s):
            for t in self.targets:
                try:
                    s = metrics_sample(t["url"])
                except OSError:
                    continue
                seen = self.seen[t["label"]]
                seen["samples"] += 1
                top = max(s["running"].values(), default=0.0)
                seen["max_running"] = max(seen["max_running"], top)
                if s["cap"] is not None:
                    if s["cap"] not in seen["caps"]:
                        seen["caps"].append(s["cap"])
                    seen["over_cap_samples"] += top > s["cap"]
