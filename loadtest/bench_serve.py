"""`python -m loadtest bench-serve`: one schedule, several targets, one comparison.

Targets are Orchard endpoints (one per KV format, given as URL + model id), `mlx_lm.server` on
the same model and llama.cpp's `llama-server` on GGUFs of it (started here with --orchard-model,
--peer-model, --llama-model, or given by URL). The schedule (send times, prompt lengths) is built
once per rate and replayed against each target in turn: on one machine, running them at the same
time would make them compete for the same cores and measure the contention instead of the
servers. Each replay gets fresh prompt texts, so no server is ever sent a prompt twice (a
repeated prompt would measure its prefix cache, not its serving).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys

import itertools
import subprocess
from importlib import metadata

from loadtest import runner
from loadtest.models import MODEL_HELP, kv_formats_arg, model_arg, model_dir, served_id

PEER_LABEL = "mlx_lm.server"
# What a user's side-by-side measured (issue 30): prompts of 25-400 tokens, 40 Poisson arrivals
# per rate, every request generating its full max_tokens.
DEFAULT_PROMPT_TOKENS = (25, 400)
DEFAULT_EXTRA_BODY = '{"ignore_eos": true}'
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
    p = argparse.ArgumentParser(prog="python -m loadtest bench-serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Defaults measure what a user sees: --prompt-tokens "
                                "25-400, 40 Poisson arrivals per rate, ignore_eos, output tokens "
                                "counted from the text (--tokenizer), servers fresh per rate. "
                                "docs/loadtest.md has the details.")
    p.add_argument("--target", action="append", type=parse_target, default=[],
                   help="label=NAME,url=URL,model=ID,kv=FORMAT (repeat per target); model= "
                   "takes what `orchard loadtest --model` takes (e.g. smollm2)")
    p.add_argument("--peer-model", type=model_arg,
                   help="start mlx_lm.server on this model as a target: " + MODEL_HELP)
    p.add_argument("--peer-url", help="an already running mlx_lm.server to include")
    p.add_argument("--orchard-model",
                   help="start `orchard serve --model THIS` (defaults, a fresh Ray and fresh "
                   "learned rates) as the target 'orchard'; same names as --peer-model")
    p.add_argument("--orchard-kv", type=kv_formats_arg, default=["native"], metavar="F[,F...]",
                   help="with --orchard-model: one Orchard server per KV format, each started "
                   "fresh (`--kv-format F`: the server refuses an unknown name) and named "
                   "orchard-F (native: orchard); default native")
    p.add_argument("--llama-model", action="append", default=[], type=_gguf,
                   help="start llama.cpp's llama-server on this GGUF as a target (repeat for "
                   "several): f32 or q4_1 (SmolLM2 GGUFs written by `make llama-server`) or a "
                   ".gguf path; 16 slots, continuous batching, all cores")
    p.add_argument("--llama-binary", default=None,
                   help="llama-server binary (default: the one `make llama-server` builds)")
    p.add_argument("--llama-slots", type=int, default=16,
                   help="llama-server parallel slots (-np); its context is slots x (longest "
                   "prompt + max tokens)")
    p.add_argument("--llama-args", default="",
                   help="more llama-server options for every --llama-model, one string, e.g. "
                   "'--no-repack' (its CPU weight repacking of Q4_1 crashed on the project's "
                   "x86 box)")
    p.add_argument("--reuse-servers", action="store_true",
                   help="keep the servers this bench starts across rates (faster); by default "
                   "each rate starts them fresh, as a user restarting between runs has them: "
                   "no learned rates or warm caches from an earlier rate")
    p.add_argument("--rates", type=_rates,
                   help="comma-separated mean rates (req/s) to sweep, e.g. 0.5,1,2,4; each rate "
                   "gets --requests-per-rate requests (duration = requests / rate) on one "
                   "schedule shared by every target; overrides --rate/--duration")
    p.add_argument("--requests-per-rate", type=_positive, default=40,
                   help="arrivals per rate (exactly this many for poisson; default 40, enough "
                   "to saturate the servers on a small box)")
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
    # A user's comparison: fresh prompts of 25-400 tokens, every answer max_tokens long (servers
    # that ignore ignore_eos, like mlx_lm.server, show it in the tokens counted from the text).
    p.set_defaults(prompt_tokens=DEFAULT_PROMPT_TOKENS, extra_body=DEFAULT_EXTRA_BODY)
    return p


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"want a positive whole number, got {text!r}")
    return n


def _gguf(spec: str) -> str:
    from loadtest import llama_peer

    try:
        return llama_peer.gguf_path(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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


def start_servers(args, out_dir: str) -> tuple[list, list, dict]:
    """Start what the bench starts itself; (targets, handles to stop, settings by target)."""
    from loadtest import llama_peer, orchard_proc, peer

    targets, started, settings = [], [], {}
    try:
        for fmt in args.orchard_kv if args.orchard_model else []:
            server, target, setting = orchard_proc.start_for_bench(args.orchard_model, fmt,
                                                                   out_dir, _git_version())
            started.append(server)
            targets.append(target)
            settings[target.name] = setting
        if args.peer_model:
            dtype = peer.default_dtype() if args.peer_dtype == "auto" else args.peer_dtype
            model = peer.prepare_model(args.peer_model, dtype)
            print(f"[loadtest] starting {PEER_LABEL} on {model} ({dtype})", flush=True)
            p = peer.start(model, log_path=os.path.join(out_dir, "mlx_lm_server.log"))
            started.append(p)
            targets.append(runner.Target(p.url, p.model, "native", PEER_LABEL))
            settings[PEER_LABEL] = {"server": PEER_LABEL, "version": _dist_versions(),
                                    "weights": dtype, "settings": "defaults"}
        lo, hi = args.prompt_tokens or (0, max(int(x) for x in args.mix.split(",")))
        for gguf in args.llama_model:
            name = llama_peer.label(gguf)
            print(f"[loadtest] starting llama-server on {gguf}", flush=True)
            s = llama_peer.start(gguf, os.path.join(out_dir, f"{name}.log"),
                                 binary=args.llama_binary or llama_peer.DEFAULT_BINARY,
                                 slots=args.llama_slots,
                                 ctx_per_slot=llama_peer.slot_context(hi, args.max_tokens),
                                 extra_args=tuple(shlex.split(args.llama_args)))
            started.append(s)
            targets.append(runner.Target(s.url, s.model, "native", name))
            settings[name] = s.settings
    except BaseException:
        for proc in started:
            proc.stop()
        raise
    return targets, started, settings


def _git_version() -> str:
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                             text=True, cwd=runner.REPO_ROOT, timeout=10)
        return f"git {out.stdout.strip()}" if out.returncode == 0 else "unknown"
    except OSError:
        return "unknown"


def _dist_versions() -> str:
    found = []
    for dist in ("mlx-lm", "mlx"):
        try:
            found.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(found) or "unknown"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.orchard_kv != ["native"] and not args.orchard_model:
        parser().error("--orchard-kv needs --orchard-model (the model its servers load)")
    if not (args.target or args.orchard_model or args.peer_model or args.peer_url
            or args.llama_model):
        print("no targets: give --target, --orchard-model, --peer-model/--peer-url and/or "
              "--llama-model", file=sys.stderr)
        return 2
    if args.tokenizer is None:
        # Count output tokens from the text with the served model's tokenizer when we know it.
        for spec in (args.peer_model, args.orchard_model):
            try:
                args.tokenizer = runner._tokenizer_arg(model_dir(spec)) if spec else None
            except (ValueError, argparse.ArgumentTypeError):
                continue
            if args.tokenizer:
                break
    os.makedirs(args.out, exist_ok=True)
    command = "python -m loadtest bench-serve " + " ".join(shlex.quote(a) for a in argv)
    replays = itertools.count()   # one number per replay in the whole bench: fresh prompts
    fixed = list(args.target) + ([runner.Target(args.peer_url.rstrip("/"), None, "native",
                                                PEER_LABEL)] if args.peer_url else [])
    started: list = []
    settings: dict = {}

    def servers(out_dir: str) -> list:
        nonlocal started
        targets, started, new = start_servers(args, out_dir)
        settings.update(new)
        return targets + fixed

    try:
        if not args.rates:
            return _compare(args, servers(args.out), args.out, command, replays, settings)
        results, clean, targets = {}, True, None
        for rate in args.rates:
            args.rate, args.duration = rate, args.requests_per_rate / rate
            args.count = args.requests_per_rate
            out = os.path.join(args.out, f"rate_{rate:g}")
            os.makedirs(out, exist_ok=True)
            if targets is None or not args.reuse_servers:
                for proc in started:
                    proc.stop()
                started = []
                targets = servers(out)
            print(f"[loadtest] rate {rate:g} req/s -> {out}", flush=True)
            clean &= _compare(args, targets, out, command, replays, settings) == 0
            with open(os.path.join(out, "bench.json")) as f:
                results[f"{rate:g}"] = json.load(f)
    finally:
        for proc in started:
            proc.stop()
    md = sweep_markdown(results, args.baseline, command, settings)
    with open(os.path.join(args.out, "sweep.md"), "w") as f:
        f.write(md + "\n")
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump({"command": command, "servers": settings, "rates": results}, f, indent=1)
    if args.docs:
        write_docs_section(args.docs, md)
    print(md)
    return 0 if clean else 1


def _compare(args, targets: list, out_dir: str, command: str, replays, settings: dict) -> int:
    """One schedule replayed against every target (--repeats times, rotating the order), each
    replay with prompt texts no other replay of this bench has sent."""
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
    for rep, t in replay_order(targets, args.repeats):
        out = os.path.join(out_dir, re.sub(r"[^A-Za-z0-9_.-]+", "_", t.name))
        out = os.path.join(out, f"r{rep}") if args.repeats > 1 else out
        s = runner.run_locust(t, schedule.reseeded(next(replays)), args, out)
        per[t.name].append((s, report.load_records(s["files"]["records"])[0]))
    args.no_plots = not combined_plots
    summaries = {k: v[0][0] if len(v) == 1 else
                 report.pool(v, schedule.meta, args.slo_ttft_ms, args.slo_tpot_ms)
                 for k, v in per.items()}
    for k, sm in summaries.items():
        sm["server"] = settings.get(k, {"server": "given by URL"})
        sm.setdefault("output_token_count", per[k][0][0].get("output_token_count"))
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
    verdicts = [runner.clean(s, args.scenario, args.require_delivery)
                for s in summaries.values()]     # every target's reason printed, not the first
    return 0 if all(verdicts) else 1


def replay_order(targets: list, repeats: int) -> list[tuple[int, object]]:
    """(repeat, target) in the order they run: the target order rotates each repeat so host-load
    drift does not always favour the same one."""
    return [(rep, t) for rep in range(repeats)
            for t in targets[rep % len(targets):] + targets[:rep % len(targets)]]


def sweep_markdown(results: dict[str, dict], baseline: str, command: str,
                   servers: dict | None = None) -> str:
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
    notes = [f"- {name}: " + ", ".join(f"{k} `{v}`" for k, v in info.items())
             for name, info in (servers or {}).items()]
    return "\n".join(rows + ([""] + notes if notes else [])
                     + ["", "Command:", "", "```", command, "```"])


if __name__ == "__main__":
    sys.exit(main())
