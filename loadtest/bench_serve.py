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

from engine.model_names import MODEL_HELP, model_arg, served_id
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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest bench-serve",
                                description=__doc__.split("\n")[0])
    p.add_argument("--target", action="append", type=parse_target, default=[],
                   help="label=NAME,url=URL,model=ID,kv=FORMAT (repeat per target); model= "
                   "takes what `orchard loadtest --model` takes (e.g. smollm2)")
    p.add_argument("--peer-model", type=model_arg,
                   help="start mlx_lm.server on this model as a target: " + MODEL_HELP)
    p.add_argument("--peer-url", help="an already running mlx_lm.server to include")
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
    from loadtest import peer, plots, report

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    targets = list(args.target)
    os.makedirs(args.out, exist_ok=True)
    started = None
    if args.peer_model:
        dtype = peer.default_dtype() if args.peer_dtype == "auto" else args.peer_dtype
        model = peer.prepare_model(args.peer_model, dtype)
        print(f"[loadtest] starting {PEER_LABEL} on {model} ({dtype})", flush=True)
        started = peer.start(model, log_path=os.path.join(args.out, "mlx_lm_server.log"))
        targets.append(runner.Target(started.url, started.model, "native", PEER_LABEL))
    elif args.peer_url:
        targets.append(runner.Target(args.peer_url.rstrip("/"), None, "native", PEER_LABEL))
    if not targets:
        print("no targets: give --target and/or --peer-model/--peer-url", file=sys.stderr)
        return 2
    # Per-target PNGs would repeat the combined ones drawn at the end.
    combined_plots, args.no_plots = not args.no_plots, True
    try:
        infos = {t.name: runner.discover(t, args) for t in targets}
        # One schedule for all: sized to the smallest context and capacity among the targets.
        contexts = [i["context"] for i in infos.values()]
        caps = [i["advertised_concurrency"] for i in infos.values() if i["advertised_concurrency"]]
        schedule = runner.build_schedule(args, {"context": min(contexts),
                                                "advertised_concurrency": min(caps, default=None)})
        per: dict[str, list] = {t.name: [] for t in targets}
        for rep in range(args.repeats):
            for t in targets[rep % len(targets):] + targets[:rep % len(targets)]:
                out = os.path.join(args.out, re.sub(r"[^A-Za-z0-9_.-]+", "_", t.name))
                out = os.path.join(out, f"r{rep}") if args.repeats > 1 else out
                s = runner.run_locust(t, schedule, args, out)
                per[t.name].append((s, report.load_records(s["files"]["records"])[0]))
    finally:
        if started is not None:
            started.stop()
    summaries = {k: v[0][0] if len(v) == 1 else
                 report.pool(v, schedule.meta, args.slo_ttft_ms, args.slo_tpot_ms)
                 for k, v in per.items()}
    runs = {k: [r for _, recs in v for r in recs] for k, v in per.items()}
    plot_paths = plots.all_plots(runs, args.out, timeline={k: v[0][1] for k, v in per.items()}) \
        if combined_plots else []
    command = "python -m loadtest bench-serve " + " ".join(shlex.quote(a) for a in argv)
    md = comparison_markdown(summaries, args.baseline, command, schedule.meta)
    with open(os.path.join(args.out, "comparison.md"), "w") as f:
        f.write(md + "\n")
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump({"command": command, "schedule": schedule.meta, "summaries": summaries,
                   "plots": plot_paths}, f, indent=1)
    if args.docs:
        write_docs_section(args.docs, md)
    print(md)
    return 0 if all(runner.clean(s, args.scenario) for s in summaries.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
