"""`python -m loadtest bench-serve`: one schedule, several targets, one comparison.

Targets are Orchard endpoints (one per KV format, given as URL + model id) and `mlx_lm.server` on
the same model (started here with --peer-model, or given by URL). The schedule is built once and
replayed against each target in turn: on one machine, running them at the same time would make
them compete for the same cores and measure the contention instead of the servers.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys

from engine.model.names import MODEL_HELP, model_arg, served_id
from loadtest import runner

PEER_LABEL = "mlx_lm.server"
DOC_BEGIN = "<!-- loadtest:bench-serve:begin -->"
DOC_END = "<!-- loadtest:bench-serve:end -->"


def parse_target(spec: str) -> runner.Target:
    """`label=NAME,url=URL,model=ID,kv=FORMAT` (url required), or a bare URL."""
    if "=" not in spec:
        return runner.Target(spec.rstrip("/"))
    fields = dict(part.split("=", 1) for part in spec.split(","))
    unknown = set(fields) - {"label", "url", "model", "kv"}
    if unknown or "url" not in fields:
        raise argparse.ArgumentTypeError(f"bad target {spec!r}: need url=, may have label=, "
                                         f"model=, kv=")
    model = served_id(fields["model"]) if fields.get("model") else None
    return runner.Target(fields["url"].rstrip("/"), model, fields.get("kv", "-"),
                         fields.get("label", ""))


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rates wants numbers like 0.5,1,2,4, got {text!r}")
    if not rates or min(rates) <= 0:
        raise argparse.ArgumentTypeError(f"--rates wants positive rates, got {text!r}")
    return rates


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest bench-serve",
                                description=__doc__.split("\n")[0])
    p.add_argument("--target", action="append", type=parse_target, default=[],
                   help="label=NAME,url=URL,model=ID,kv=FORMAT (repeat per target); model= "
                   "takes what `orchard loadtest --model` takes (e.g. smollm2)")
    p.add_argument("--peer-model", type=model_arg,
                   help="start mlx_lm.server on this model as a target: " + MODEL_HELP)
    p.add_argument("--peer-url", help="an already running mlx_lm.server to include")
    p.add_argument("--orchard-model",
                   help="start `orchard serve --model THIS` (defaults, a fresh Ray and fresh "
                   "learned rates) as the target 'orchard'; same names as --peer-model")
    p.add_argument("--rates", type=_rates,
                   help="comma-separated mean rates (req/s) to sweep, e.g. 0.5,1,2,4; each rate "
                   "gets --requests-per-rate requests (duration = requests / rate) on one "
                   "schedule shared by every target; overrides --rate/--duration")
    p.add_argument("--requests-per-rate", type=int, default=30)
    p.add_argument("--peer-dtype", default="auto",
                   choices=["auto", "as-is", "float32", "bfloat16", "float16"],
                   help="weights dtype given to the peer (auto: float32 on Linux, where MLX "
                   "runs on the CPU and Orchard computes in float32; as shipped elsewhere)")
    p.add_argument("--baseline", default=PEER_LABEL, help="label the ratios are taken against")
    p.add_argument("--docs", help="markdown file whose bench-serve section to (re)write")
    p.add_argument("--repeats", type=int, default=1,
                   help="replay the schedule this many times per target, rotating the target "
                   "order each time so host-load drift does not always favour the same one")
    runner.add_load_args(p)
    return p


def comparison_markdown(summaries: dict[str, dict], baseline: str, command: str,
                        scenario_meta: dict) -> str:
    from loadtest import report

    loads = ", ".join(f"{k} {_load(s)}" for k, s in summaries.items())
    parts = [f"Scenario `{scenario_meta.get('scenario')}`: {scenario_meta.get('requests')} "
             f"requests, prompt mix {scenario_meta.get('scaled_mix')} tokens, peak "
             f"{scenario_meta.get('peak_rate_1s', 0):.0f} req/s in 1 s. Targets ran one after "
             f"another in the order below; host 1-min load average before/after each: {loads}.",
             "", report.markdown_row_table(summaries), ""]
    if baseline in summaries and len(summaries) > 1:
        parts += [report.ratio_table(summaries, baseline), ""]
    parts += [report.pattern_table(summaries), ""]
    parts += ["Command:", "", "```", command, "```"]
    return "\n".join(parts)


def _load(summary: dict) -> str:
    h = summary.get("host", {})
    fmt = (lambda v: "?" if v is None else f"{v:.1f}")
    return f"{fmt(h.get('loadavg_1m_before'))}/{fmt(h.get('loadavg_1m_after'))}"


def write_docs_section(path: str, body: str) -> None:
    """Replace (or append) the marked bench-serve section, leaving the rest of the file alone."""
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    section = f"{DOC_BEGIN}\n{body}\n{DOC_END}"
    if DOC_BEGIN in text and DOC_END in text:
        text = re.sub(re.escape(DOC_BEGIN) + r".*?" + re.escape(DOC_END), lambda _: section,
                      text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    with open(path, "w") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> int:
    from loadtest import orchard_proc, peer

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    targets = list(args.target)
    os.makedirs(args.out, exist_ok=True)
    started = []
    try:
        if args.orchard_model:
            print(f"[loadtest] starting orchard serve --model {args.orchard_model}", flush=True)
            server = orchard_proc.start(args.orchard_model,
                                        os.path.join(args.out, "orchard_serve.log"))
            started.append(server)
            targets.insert(0, runner.Target(server.url, served_id(args.orchard_model), "native",
                                            "orchard"))
        if args.peer_model:
            dtype = peer.default_dtype() if args.peer_dtype == "auto" else args.peer_dtype
            model = peer.prepare_model(args.peer_model, dtype)
            print(f"[loadtest] starting {PEER_LABEL} on {model} ({dtype})", flush=True)
            p = peer.start(model, log_path=os.path.join(args.out, "mlx_lm_server.log"))
            started.append(p)
            targets.append(runner.Target(p.url, p.model, "native", PEER_LABEL))
        elif args.peer_url:
            targets.append(runner.Target(args.peer_url.rstrip("/"), None, "native", PEER_LABEL))
        if not targets:
            print("no targets: give --target, --orchard-model and/or --peer-model/--peer-url",
                  file=sys.stderr)
            return 2
        command = "python -m loadtest bench-serve " + " ".join(shlex.quote(a) for a in argv)
        if not args.rates:
            return _compare(args, targets, args.out, command)
        results, clean = {}, True
        for rate in args.rates:
            args.rate, args.duration = rate, args.requests_per_rate / rate
            out = os.path.join(args.out, f"rate_{rate:g}")
            print(f"[loadtest] rate {rate:g} req/s -> {out}", flush=True)
            clean &= _compare(args, targets, out, command) == 0
            with open(os.path.join(out, "bench.json")) as f:
                results[f"{rate:g}"] = json.load(f)
    finally:
        for proc in started:
            proc.stop()
    md = sweep_markdown(results, args.baseline, command)
    with open(os.path.join(args.out, "sweep.md"), "w") as f:
        f.write(md + "\n")
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump({"command": command, "rates": results}, f, indent=1)
    if args.docs:
        write_docs_section(args.docs, md)
    print(md)
    return 0 if clean else 1


def _compare(args, targets: list, out_dir: str, command: str) -> int:
    """One schedule replayed against every target (--repeats times, rotating the order)."""
    from loadtest import plots, report

    os.makedirs(out_dir, exist_ok=True)
    # Per-target PNGs would repeat the combined ones drawn at the end.
    combined_plots, args.no_plots = not args.no_plots, True
    infos = {t.name: runner.discover(t, args) for t in targets}
    # One schedule for all: sized to the smallest context and capacity among the targets.
    contexts = [i["context"] for i in infos.values()]
    caps = [i["advertised_concurrency"] for i in infos.values() if i["advertised_concurrency"]]
    schedule = runner.build_schedule(args, {"context": min(contexts),
                                            "advertised_concurrency": min(caps, default=None)})
    per: dict[str, list] = {t.name: [] for t in targets}
    for rep in range(args.repeats):
        for t in targets[rep % len(targets):] + targets[:rep % len(targets)]:
            out = os.path.join(out_dir, re.sub(r"[^A-Za-z0-9_.-]+", "_", t.name))
            out = os.path.join(out, f"r{rep}") if args.repeats > 1 else out
            s = runner.run_locust(t, schedule, args, out)
            per[t.name].append((s, report.load_records(s["files"]["records"])[0]))
    args.no_plots = not combined_plots
    summaries = {k: v[0][0] if len(v) == 1 else
                 report.pool(v, schedule.meta, args.slo_ttft_ms, args.slo_tpot_ms)
                 for k, v in per.items()}
    runs = {k: [r for _, recs in v for r in recs] for k, v in per.items()}
    plot_paths = plots.all_plots(runs, out_dir, timeline={k: v[0][1] for k, v in per.items()}) \
        if combined_plots else []
    md = comparison_markdown(summaries, args.baseline, command, schedule.meta)
    with open(os.path.join(out_dir, "comparison.md"), "w") as f:
        f.write(md + "\n")
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump({"command": command, "schedule": schedule.meta, "summaries": summaries,
                   "plots": plot_paths}, f, indent=1)
    if args.docs and not args.rates:
        write_docs_section(args.docs, md)
    if not args.rates:
        print(md)
    return 0 if all(runner.clean(s, args.scenario) for s in summaries.values()) else 1


def sweep_markdown(results: dict[str, dict], baseline: str, command: str) -> str:
    """One row per (rate, target) with its ratios to the baseline at that rate (>1 is better
    for tok/s, <1 for TTFT)."""
    def get(summary: dict, *path):
        for key in path:
            summary = summary.get(key, {}) if isinstance(summary, dict) else {}
        return summary if isinstance(summary, (int, float)) else None

    cols = {"out tok/s": ("throughput", "output_tokens_per_s"),
            "TTFT p50 ms": ("metrics", "ttft_ms", "p50"),
            "TTFT p99 ms": ("metrics", "ttft_ms", "p99")}
    rows = ["| rate req/s | target | ok/sent | refused | errors | "
            + " | ".join(cols) + " | " + " | ".join(f"{c.split(' ms')[0]} vs {baseline}"
                                                      for c in cols) + " |"]
    rows.append("|" + "---|" * (rows[0].count("|") - 1))
    for rate, res in results.items():
        sums = res["summaries"]
        base = sums.get(baseline)
        for name, sm in sums.items():
            c = sm["counts"]
            vals = [get(sm, *path) for path in cols.values()]
            ratios = []
            for path, v in zip(cols.values(), vals):
                b = get(base, *path) if base is not None and name != baseline else None
                ratios.append(f"{v / b:.2f}x" if v is not None and b else "-")
            rows.append(f"| {rate} | {name} | {c['ok']}/{c['sent']} | {c['refused']} | "
                        f"{c['error'] + c['hung']} | "
                        + " | ".join("-" if v is None else f"{v:.1f}" for v in vals) + " | "
                        + " | ".join(ratios) + " |")
    return "\n".join(rows + ["", "Command:", "", "```", command, "```"])


if __name__ == "__main__":
    sys.exit(main())
