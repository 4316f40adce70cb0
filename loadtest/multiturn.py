"""`python -m loadtest chat`: the multi-turn chat scenario against one or more targets at once.

    python -m loadtest chat --target label=prefix,url=http://127.0.0.1:8001,model=smollm2 \\
        --target label=capacity,url=http://127.0.0.1:8002,model=smollm2 --out OUT
    python -m loadtest chat --serve prefix=CONFIG_A.yaml --serve capacity=CONFIG_B.yaml \\
        --model smollm2 --out OUT        # starts `orchard serve CONFIG` per label, stops them

Every conversation of the plan (loadtest/chat_plan.py) runs against every target at the same
time, in one Locust run, so targets share the box's load and are compared as ratios. While it
runs, each target's /metrics is sampled for requests running per replica against the learned
concurrency cap. API keys (one tenant each) come from $ORCHARD_LOADTEST_API_KEYS (comma-separated).
Writes OUT/plan.json, OUT/chat_records.json and OUT/summary.json; talks HTTP only.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

from loadtest import chat_plan

LOCUSTFILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_locustfile.py")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS_ENV = "ORCHARD_LOADTEST_API_KEYS"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest chat", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", action="append", default=[],
                   help="label=NAME,url=URL,model=MODEL (repeatable)")
    p.add_argument("--serve", action="append", default=[],
                   help="LABEL=CONFIG.yaml: start `orchard serve CONFIG` as target LABEL")
    p.add_argument("--model", default="", help="model id for --serve targets")
    p.add_argument("--out", required=True)
    d = chat_plan.ChatParams()
    p.add_argument("--conversations", type=int, default=d.conversations)
    p.add_argument("--min-turns", type=int, default=d.min_turns)
    p.add_argument("--max-turns", type=int, default=d.max_turns)
    p.add_argument("--tenants", type=int, default=d.tenants)
    p.add_argument("--system-words", type=int, nargs=2, default=d.system_words,
                   metavar=("LOW", "HIGH"), help="words of each conversation's system document")
    p.add_argument("--user-words", type=int, nargs=2, default=d.user_words,
                   metavar=("LOW", "HIGH"), help="words of each user message")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--think-s", type=float, default=d.think_s)
    p.add_argument("--stagger-s", type=float, default=d.stagger_s)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--sample-s", type=float, default=0.5, help="/metrics sampling period")
    return p.parse_args(argv)


def parse_target(spec: str) -> dict:
    fields = dict(part.split("=", 1) for part in spec.split(",") if "=" in part)
    missing = {"label", "url", "model"} - fields.keys()
    if missing:
        raise SystemExit(f"--target {spec!r} lacks {', '.join(sorted(missing))}")
    return {"label": fields["label"], "url": fields["url"].rstrip("/"), "model": fields["model"]}


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


def p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def switched(ok: list[dict]) -> dict:
    """Later turns served by another replica than their conversation's previous turn: a
    capacity-only router must move some conversations for routing, not cache size, to be what
    the two targets differ in; `missed_half` counts turns with under half their history cached."""
    where = {(r["conversation"], r["turn"]): r.get("replica") for r in ok}
    pairs = [(where.get((r["conversation"], r["turn"] - 1)), r.get("replica"))
             for r in ok if r["turn"] >= 2]
    known = [(a, b) for a, b in pairs if a and b]
    return {"turns_with_replicas": len(known), "switched": sum(a != b for a, b in known),
            "switched_share": sum(a != b for a, b in known) / len(known) if known else None,
            "missed_half": sum((r["cached_tokens"] or 0) < 0.5 * (r["history_tokens"] or 0)
                               for r in ok if r["turn"] >= 2)}


def summarize(rows: list[dict], label: str) -> dict:
    mine = [r for r in rows if r["target"] == label]
    ok = [r for r in mine if r["status"] == 200 and r["error"] is None and r["chunk_times"]]
    later = [r for r in ok if r["turn"] >= 2]
    history = sum(r["history_tokens"] or 0 for r in later)
    cached = sum(r["cached_tokens"] or 0 for r in later)
    out_tokens = sum(r["output_tokens"] or 0 for r in ok)
    # Each target's own span (first send to last end): targets run at once but finish apart.
    span = (max(r["sent"] + r["done"] for r in ok) - min(r["sent"] for r in ok)) if ok else 0.0
    return {
        "turns": len(mine), "ok": len(ok), "failed": len(mine) - len(ok),
        "conversations": len({r["conversation"] for r in mine}),
        "ttft_p50_turn1_ms": p50([r["chunk_times"][0] * 1000 for r in ok if r["turn"] == 1]),
        "ttft_p50_turns2plus_ms": p50([r["chunk_times"][0] * 1000 for r in later]),
        "prompt_tokens_turns2plus": sum(r["prompt_tokens"] or 0 for r in later),
        "history_tokens_turns2plus": history,
        "cached_tokens_turns2plus": cached,
        "cached_share_of_history": cached / history if history else None,
        "output_tokens": out_tokens,
        "span_s": span,
        "output_tokens_per_s": out_tokens / span if span else None,
        "e2e_p50_ms": p50([r["done"] * 1000 for r in ok]),
        "ttft_mean_turns2plus_ms": (statistics.fmean(r["chunk_times"][0] * 1000 for r in later)
                                    if later else None),
        "later_turns": switched(ok),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    # SIGTERM (a timeout, a kill) must still stop the servers this run started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.makedirs(args.out, exist_ok=True)
    targets = [parse_target(t) for t in args.target]
    servers = []
    try:
        if args.serve:
            from loadtest import orchard_proc

            if not args.model:
                raise SystemExit("--serve needs --model (the model id in the configs)")
            for spec in args.serve:
                label, config = spec.split("=", 1)
                print(f"[chat] starting orchard serve {config} as {label}", flush=True)
                srv = orchard_proc.start(None, os.path.join(args.out, f"orchard-{label}.log"),
                                         config=config)
                servers.append(srv)
                targets.append({"label": label, "url": srv.url, "model": args.model})
        if not targets:
            raise SystemExit("give at least one --target or --serve")
        return run(args, targets)
    finally:
        for srv in servers:
            srv.stop()


def run(args, targets: list[dict]) -> int:
    params = chat_plan.ChatParams(
        conversations=args.conversations, min_turns=args.min_turns, max_turns=args.max_turns,
        tenants=args.tenants, system_words=tuple(args.system_words),
        user_words=tuple(args.user_words), max_tokens=args.max_tokens, think_s=args.think_s,
        stagger_s=args.stagger_s, seed=args.seed)
    plan = chat_plan.build(params)
    plan_path = os.path.join(args.out, "plan.json")
    rec_path = os.path.join(args.out, "chat_records.json")
    with open(plan_path, "w") as f:
        f.write(chat_plan.to_json(params, plan))
    before = {t["label"]: metrics_sample(t["url"])["router_events"] for t in targets}
    longest = max(c.start_s + len(c.users) * (params.think_s + 120) for c in plan)
    cmd = [sys.executable, "-m", "locust", "-f", LOCUSTFILE, "--headless", "-u", "1", "-r", "1",
           "-H", targets[0]["url"], "-t", f"{int(longest + 60)}s", "--stop-timeout", "5",
           "--loglevel", "WARNING", "--only-summary", "--plan-file", plan_path,
           "--targets-json", json.dumps(targets), "--records-out", rec_path]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        x for x in (REPO_ROOT, os.environ.get("PYTHONPATH")) if x)}
    watch = CapWatch(targets, args.sample_s)
    watch.start()
    load_before = os.getloadavg()[0]
    rc = subprocess.call(cmd, env=env)
    watch.stop_event.set()
    watch.join()
    if not os.path.exists(rec_path):
        raise RuntimeError(f"locust exited {rc} without writing {rec_path}")
    with open(rec_path) as f:
        recorded = json.load(f)
    summary = {"params": chat_plan.asdict(params), "locust_exit_code": rc,
               "wall_s": recorded["wall_s"],
               "host": {"cpus": os.cpu_count(), "loadavg_1m_before": load_before,
                        "loadavg_1m_after": os.getloadavg()[0]},
               "targets": {}}
    for t in targets:
        s = summarize(recorded["records"], t["label"])
        after = metrics_sample(t["url"])["router_events"]
        s["router_events"] = {k: v - before[t["label"]].get(k, 0.0) for k, v in after.items()}
        s["replica_load"] = watch.seen[t["label"]]
        summary["targets"][t["label"]] = s
    if len(targets) == 2:
        a, b = (summary["targets"][t["label"]] for t in targets)
        summary["ratios_first_over_second"] = {
            k: (a[k] / b[k] if a[k] is not None and b[k] else None)
            for k in ("ttft_p50_turns2plus_ms", "ttft_mean_turns2plus_ms", "ttft_p50_turn1_ms",
                      "output_tokens_per_s",
                      "cached_share_of_history", "e2e_p50_ms")}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary, indent=1))
    failed = sum(s["failed"] for s in summary["targets"].values())
    return 0 if rc == 0 and failed == 0 else 1
