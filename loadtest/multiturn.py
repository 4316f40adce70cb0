"""`python -m loadtest chat`: the multi-turn chat scenario against one or more targets.

    python -m loadtest chat --target label=prefix,url=http://127.0.0.1:8001,model=smollm2 \\
        --target label=capacity,url=http://127.0.0.1:8002,model=smollm2 --out OUT
    python -m loadtest chat --serve prefix=CONFIG_A.yaml --serve capacity=CONFIG_B.yaml \\
        --model smollm2 --out OUT        # starts `orchard serve CONFIG` per label, stops them

By default the targets run one after another (loadtest/chat_legs.py): each plays the identical
plan (loadtest/chat_plan.py: same conversations, texts, think times, seed) alone on the box, a
`--serve` target on a server started for its leg and stopped before the next one starts.
`--simultaneous` plays every conversation against every target at the same time, in one Locust
run, so targets share the box's load. Either way they are compared as ratios. While a leg runs,
each of its targets' /metrics is sampled for requests running per replica against the learned
concurrency cap. API keys (one tenant each) come from $ORCHARD_LOADTEST_API_KEYS
(comma-separated). Writes OUT/plan.json, OUT/chat_records.json (every leg's records) and
OUT/summary.json (loadtest/chat_summary.py); talks HTTP only.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

from loadtest import chat_legs, chat_plan, chat_summary
from loadtest.chat_summary import p50, summarize, switched  # noqa: F401 - this module's API
from loadtest.chat_watch import CapWatch, metrics_sample

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
    p.add_argument("--simultaneous", action="store_const", dest="mode",
                   const=chat_legs.SIMULTANEOUS, default=chat_legs.SEQUENTIAL,
                   help="play the plan against every target at once (default: one target "
                        "after another, each --serve server fresh and alone)")
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


def entries(args: argparse.Namespace) -> list[chat_legs.Entry]:
    """--target entries first, then --serve entries, each in the order given."""
    out = [chat_legs.Entry(t["label"], t["model"], url=t["url"])
           for t in map(parse_target, args.target)]
    if args.serve and not args.model:
        raise SystemExit("--serve needs --model (the model id in the configs)")
    for spec in args.serve:
        label, config = spec.split("=", 1)
        out.append(chat_legs.Entry(label, args.model, config=config))
    if not out:
        raise SystemExit("give at least one --target or --serve")
    return out


def params_of(args: argparse.Namespace) -> chat_plan.ChatParams:
    return chat_plan.ChatParams(
        conversations=args.conversations, min_turns=args.min_turns, max_turns=args.max_turns,
        tenants=args.tenants, system_words=tuple(args.system_words),
        user_words=tuple(args.user_words), max_tokens=args.max_tokens, think_s=args.think_s,
        stagger_s=args.stagger_s, seed=args.seed)


def serve(out: str):
    """chat_legs' `start`: `orchard serve CONFIG` on a fresh home and Ray, logged under OUT."""
    from loadtest import orchard_proc

    def start(entry: chat_legs.Entry):
        print(f"[chat] starting orchard serve {entry.config} as {entry.label}", flush=True)
        srv = orchard_proc.start(None, os.path.join(out, f"orchard-{entry.label}.log"),
                                 config=entry.config)
        return {"label": entry.label, "url": srv.url, "model": entry.model}, srv.stop

    return start


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    # SIGTERM (a timeout, a kill) must still stop the servers this run started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.makedirs(args.out, exist_ok=True)
    todo = entries(args)
    params = params_of(args)
    plan = chat_plan.build(params)
    plan_text = chat_plan.to_json(params, plan)
    plan_path = os.path.join(args.out, "plan.json")
    with open(plan_path, "w") as f:
        f.write(plan_text)
    longest = max(c.start_s + len(c.users) * (params.think_s + 120) for c in plan)
    n_legs = len(chat_legs.legs(todo, args.mode))
    count = iter(range(n_legs))

    def leg(targets: list[dict]) -> dict:
        i = next(count)
        print(f"[chat] leg {i + 1}/{n_legs} ({args.mode}): "
              f"{', '.join(t['label'] for t in targets)}", flush=True)
        rec_path = os.path.join(args.out, f"chat_records-leg{i + 1}.json")
        return run_leg(targets, plan_path, rec_path, longest, args.sample_s)

    results = chat_legs.run_legs(todo, args.mode, serve(args.out), leg)
    with open(os.path.join(args.out, "chat_records.json"), "w") as f:
        json.dump({"mode": args.mode, "wall_s": sum(r["wall_s"] for r in results),
                   "legs": [{"labels": r["labels"], "wall_s": r["wall_s"]} for r in results],
                   "records": [row for r in results for row in r["records"]]}, f)
    summary = chat_summary.build(chat_plan.asdict(params), args.mode, results, os.cpu_count(),
                                 hashlib.sha256(plan_text.encode()).hexdigest())
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary, indent=1))
    failed = sum(s["failed"] for s in summary["targets"].values())
    return 0 if summary["locust_exit_code"] == 0 and failed == 0 else 1


def run_leg(targets: list[dict], plan_path: str, rec_path: str, longest_s: float,
            sample_s: float) -> dict:
    """One Locust run of the plan against `targets` (all at once); its records and facts."""
    before = {t["label"]: metrics_sample(t["url"])["router_events"] for t in targets}
    cmd = [sys.executable, "-m", "locust", "-f", LOCUSTFILE, "--headless", "-u", "1", "-r", "1",
           "-H", targets[0]["url"], "-t", f"{int(longest_s + 60)}s", "--stop-timeout", "5",
           "--loglevel", "WARNING", "--only-summary", "--plan-file", plan_path,
           "--targets-json", json.dumps(targets), "--records-out", rec_path]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        x for x in (REPO_ROOT, os.environ.get("PYTHONPATH")) if x)}
    watch = CapWatch(targets, sample_s)
    watch.start()
    load_before = os.getloadavg()[0]
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    rc = subprocess.call(cmd, env=env)
    watch.stop_event.set()
    watch.join()
    if not os.path.exists(rec_path):
        raise RuntimeError(f"locust exited {rc} without writing {rec_path}")
    with open(rec_path) as f:
        recorded = json.load(f)
    events = {}
    for t in targets:
        after = metrics_sample(t["url"])["router_events"]
        events[t["label"]] = {k: v - before[t["label"]].get(k, 0.0) for k, v in after.items()}
    return {"labels": [t["label"] for t in targets], "locust_exit_code": rc,
            "wall_s": recorded["wall_s"], "started_utc": started,
            "loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0],
            "records": recorded["records"], "router_events": events,
            "replica_load": {t["label"]: watch.seen[t["label"]] for t in targets}}
