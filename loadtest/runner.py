"""`python -m loadtest run`: one named scenario against one target, headless, with a report.

The runner itself never imports locust or gevent: Locust runs in a child process (its gevent
monkey-patching must precede any requests/urllib3/ray import, and callers such as the `orchard`
CLI may already have imported ray). The runner probes the target over plain HTTP, fixes the
schedule, runs Locust, then writes summary.json and the plots. Usable as a `ray job submit`
entrypoint: everything goes under --out, and the exit status says whether the run was clean.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import sys
from dataclasses import dataclass

from loadtest import probe, scenarios
from loadtest.models import served_id
from loadtest.arrivals import DEFAULT_MIX, Schedule

LOCUSTFILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "locustfile.py")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_KEY_ENV = "ORCHARD_LOADTEST_API_KEY"  # how the key reaches the Locust child


@dataclass
class Target:
    url: str
    model: str | None = None
    kv: str = "-"
    label: str = ""

    @property
    def name(self) -> str:
        return self.label or self.model or self.url


def add_load_args(p: argparse.ArgumentParser) -> None:
    """Options shared by `run` and `bench-serve` (schedule, SLOs, client behaviour)."""
    p.add_argument("--scenario", default="smoke", choices=sorted(scenarios.SCENARIOS))
    p.add_argument("--duration", type=float, help="seconds of arrivals")
    p.add_argument("--rate", type=float, help="mean requests/s (poisson, gamma, smoke)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mix", default=",".join(map(str, DEFAULT_MIX)),
                   help="prompt lengths in tokens before scaling to the context")
    p.add_argument("--prompt-tokens", type=token_range, default=None, metavar="MIN-MAX",
                   help="draw each prompt's length uniformly from MIN-MAX tokens (seeded) "
                   "instead of cycling through --mix")
    p.add_argument("--tokenizer", type=_tokenizer_arg,
                   help="tokenizer.json or model folder: count output tokens from the streamed "
                   "text with it (what a user counts) instead of the server's usage figure")
    p.add_argument("--context", type=int, help="model context (default: from /v1/models, "
                   "else 4096)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--gamma-shape", type=float, default=0.5)
    p.add_argument("--burst-size", type=int, default=8)
    p.add_argument("--burst-period", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--round-gap", type=float, default=2.0)
    p.add_argument("--capacity", type=int, help="advertised concurrency for overload (default: "
                   "/v1/models/capacity)")
    p.add_argument("--overload-factor", type=float, default=3.0)
    p.add_argument("--schedule-file", help="replay this schedule JSON instead of building one")
    p.add_argument("--api", default="chat", choices=["chat", "completions"])
    p.add_argument("--api-key", default=os.environ.get("ORCHARD_API_KEY"),
                   help="bearer key (default: $ORCHARD_API_KEY); servers without auth ignore it")
    p.add_argument("--extra-body", default="", help="JSON merged into every request body")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    p.add_argument("--stream-timeout", type=float, default=120.0,
                   help="a stream open longer than this counts as hung")
    p.add_argument("--drain-timeout", type=float, default=None,
                   help="seconds to wait for open streams after the last send (default: "
                   "--stream-timeout + 5, so no stream is cut before it counts as hung)")
    p.add_argument("--spin-ms", type=float, default=2.0,
                   help="busy-wait this long before each due time for precise delivery")
    p.add_argument("--sched", default="normal", choices=["normal", "nice", "fifo"],
                   help="raise the load generator's OS priority for precise delivery on a busy "
                   "host (needs privileges; what took effect is in summary.json)")
    p.add_argument("--retry-refused", type=int, default=0,
                   help="retry a refused request up to N times after its Retry-After (latencies "
                   "then count from the first attempt); 0 reports refusals as they come")
    p.add_argument("--require-delivery", action="store_true",
                   help="fail the run (exit 1) when the delivery goal applies (mean rate <= "
                   "20 req/s) and its p99 delivery error exceeds 5 ms; default: reported only")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs (faster)")
    p.add_argument("--locust-stats", action="store_true",
                   help="also print Locust's periodic stats table")
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "orchard-loadtest"),
                   help="directory for CSV, HTML, records, summary.json and plots")


def _tokenizer_arg(spec: str) -> str:
    from loadtest.tokens import tokenizer_path

    try:
        return tokenizer_path(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def token_range(text: str) -> tuple[int, int]:
    """argparse `type=` for MIN-MAX token ranges, e.g. 25-400."""
    try:
        lo, hi = (int(x) for x in text.split("-"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"want MIN-MAX tokens like 25-400, got {text!r}")
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"want 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest run", description=__doc__.split("\n")[0])
    p.add_argument("--host", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", type=served_id,
                   help="model id to request (default: the only one in /v1/models): a short "
                   "name becomes the id Orchard serves it as (smollm2 -> smollm2-135m, what "
                   "`make serve` serves; orchard-tiny); anything else, e.g. the model path an "
                   "mlx_lm.server was started on, is sent as given")
    p.add_argument("--kv", default="-", help="KV format label for slice names")
    p.add_argument("--label", default="", help="display name of this target")
    add_load_args(p)
    return p


def params_from(args, context: int, capacity: int | None) -> scenarios.Params:
    return scenarios.Params(
        duration=args.duration, rate=args.rate, seed=args.seed,
        mix=tuple(int(x) for x in args.mix.split(",")), context=context,
        max_tokens=args.max_tokens, gamma_shape=args.gamma_shape, burst_size=args.burst_size,
        burst_period=args.burst_period, rounds=args.rounds, round_gap=args.round_gap,
        capacity=args.capacity or capacity, overload_factor=args.overload_factor,
        prompt_range=args.prompt_tokens, count=getattr(args, "count", None))


def discover(target: Target, args) -> dict:
    """Model, context, advertised capacity of a target (plain HTTP, before any load)."""
    probe.wait_ready(target.url, timeout=60.0, key=args.api_key)
    models = probe.list_models(target.url, key=args.api_key)
    if target.model is None and len(models) == 1:
        target.model = models[0].get("id")
    context = args.context or probe.context_length(models, target.model) or 4096
    mix = [int(x) for x in args.mix.split(",")]
    feed = probe.capacity_feed(target.url, key=args.api_key)
    raw = int(sum(mix) / len(mix)) + args.max_tokens
    return {"model": target.model, "context": context, "capacity_feed": feed is not None,
            "advertised_concurrency": probe.advertised_concurrency(feed, target.model, raw)}


def build_schedule(args, info: dict) -> Schedule:
    if args.schedule_file:
        with open(args.schedule_file) as f:
            return Schedule.from_json(f.read())
    return scenarios.build(args.scenario, params_from(args, info["context"],
                                                       info["advertised_concurrency"]))


def run_locust(target: Target, schedule: Schedule, args, out: str) -> dict:
    """Replay `schedule` against `target` in a Locust child process; return its summary."""
    from loadtest import plots, report  # matplotlib is slow to import; only needed here

    os.makedirs(out, exist_ok=True)
    cal, probe_s = probe.calibrate(target.url, args.api, target.model, key=args.api_key)
    feed_before = probe.capacity_feed(target.url, key=args.api_key)
    sched_path, rec_path = os.path.join(out, "schedule.json"), os.path.join(out, "records.json")
    with open(sched_path, "w") as f:
        f.write(schedule.to_json())
    drain = args.drain_timeout if args.drain_timeout is not None else args.stream_timeout + 5
    run_time = int(schedule.duration_s + drain + 60)
    cmd = [sys.executable, "-m", "locust", "-f", LOCUSTFILE, "--headless", "-H", target.url,
           "-u", "1", "-r", "1", "-t", f"{run_time}s", "--stop-timeout", "5",
           "--csv", os.path.join(out, "locust"), "--html", os.path.join(out, "locust.html"),
           "--loglevel", "WARNING", "--schedule-file", sched_path, "--records-out", rec_path,
           "--target-model", target.model or "", "--kv-format", target.kv,
           "--label", target.name, "--api", args.api,
           "--calibration", f"{cal.tokens_per_word},{cal.overhead}",
           "--stream-timeout", str(args.stream_timeout),
           "--drain-timeout", str(drain), "--spin-ms", str(args.spin_ms),
           "--sched", args.sched, "--retry-refused", str(args.retry_refused)]
    if args.extra_body:
        cmd += ["--extra-body", args.extra_body]
    if not args.locust_stats:
        cmd.append("--only-summary")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        x for x in (REPO_ROOT, os.environ.get("PYTHONPATH")) if x)}
    if args.api_key:
        env[API_KEY_ENV] = args.api_key  # not on the command line, where `ps` would show it
    print(f"[loadtest] {target.name}: {len(schedule.arrivals)} requests, scenario "
          f"{schedule.meta.get('scenario')}, calibration {cal.tokens_per_word:.2f} tok/word "
          f"+{cal.overhead}", flush=True)
    load_before = _loadavg()
    rc = subprocess.call(cmd, env=env)
    if not os.path.exists(rec_path):
        raise RuntimeError(f"locust exited {rc} without writing {rec_path}")
    records, meta = report.load_records(rec_path)
    counted = {"from": "usage"}
    if args.tokenizer:
        from loadtest.tokens import TextCounter

        counted = TextCounter(args.tokenizer).recount(records)
        with open(rec_path, "w") as f:  # pooled summaries re-read the records from here
            json.dump({"meta": meta, "records": [r.to_dict() for r in records]}, f)
    summary = report.summarize(records, meta, args.slo_ttft_ms, args.slo_tpot_ms)
    summary["output_token_count"] = counted
    summary["target"].update(model=target.model, kv=target.kv, label=target.name)
    summary["calibration"] = {"tokens_per_word": cal.tokens_per_word, "overhead": cal.overhead,
                              "probe_s": probe_s}
    summary["capacity_after"] = probe.wait_idle(target.url, feed_before, key=args.api_key)
    summary["locust_exit_code"] = rc
    # Numbers from a shared host mean little without how busy it was.
    summary["host"] = {"cpus": os.cpu_count(), "loadavg_1m_before": load_before,
                       "loadavg_1m_after": _loadavg()}
    summary["files"] = {"records": rec_path, "schedule": sched_path,
                        "html": os.path.join(out, "locust.html"),
                        "csv_stats": os.path.join(out, "locust_stats.csv"),
                        "plots": [] if args.no_plots else
                        plots.all_plots({target.name: records}, out)}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def clean(summary: dict, scenario: str, require_delivery: bool = False) -> bool:
    """Exit status rule: no errors, hung or unsent requests; overload must also pass its rules;
    with `require_delivery`, the delivery goal must be met where it applies (the reason is
    printed to stderr)."""
    from loadtest import report

    c = summary["counts"]
    ok = c["error"] == 0 and c["hung"] == 0 and c["unsent"] == 0
    if scenario == "overload":
        ok = ok and summary["overload_rules"]["passed"]
    if require_delivery:
        missed = report.delivery_failure(summary)
        if missed:
            name = summary.get("target", {}).get("label") or ""
            print(f"[loadtest] {name + ': ' if name else ''}{missed} (--require-delivery)",
                  file=sys.stderr, flush=True)
            ok = False
    return ok and summary["capacity_after"].get("idle") is not False


def main(argv: list[str] | None = None) -> int:
    from loadtest import report

    args = parser().parse_args(argv)
    target = Target(args.host.rstrip("/"), args.model, args.kv, args.label)
    info = discover(target, args)
    schedule = build_schedule(args, info)
    schedule.meta["target_info"] = info
    summary = run_locust(target, schedule, args, args.out)
    print(report.markdown_row_table({target.name: summary}))
    d = {k: (v if v is not None else float("nan"))
         for k, v in summary["delivery_error_ms"].items()}
    print(f"[loadtest] delivery error p50 {d['p50']:.2f} ms p99 {d['p99']:.2f} ms "
          f"(goal p99 <= {d['goal_p99_ms']} ms at <= 20 req/s; peak "
          f"{summary['schedule']['peak_rate_1s']:.0f} req/s) -> {args.out}/summary.json")
    return 0 if clean(summary, args.scenario, args.require_delivery) else 1


if __name__ == "__main__":
    sys.exit(main())
