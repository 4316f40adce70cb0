"""The quality gate's command line: options, the full and quick size presets, and how a run's
sizes resolve from them (quality.gate runs what they describe)."""
from __future__ import annotations

import argparse

from engine.model.names import MODEL_HELP, model_arg

TASKS = ("passkey", "kv")
FULL = {"nll_tokens": 20480, "retrieval_cases": 100, "probes": 200, "lengths": "512,1024,2048,4096"}
QUICK = {"nll_tokens": 2048, "retrieval_cases": 4, "probes": 8, "lengths": "512"}
# Text suite (a real chat model): retrieval cases per length (6 graded lookups per sequence);
# SmolLM2-135M itself cannot look up past ~1.5K tokens (native 0/8 at 2K), so longer cells would
# only measure the model. Cases are candidates, judged where native wins by MIN_MARGIN_NATS
# (214 of 240 at 512 on 2026-12-01): enough for a 0-loss pass (-1.7 points; -2 needs ~185).
FULL_TEXT = {"nll_tokens": 16384, "retrieval_cases": 240, "probes": 200, "lengths": "512"}
QUICK_TEXT = {"nll_tokens": 1024, "retrieval_cases": 6, "probes": 12, "lengths": "512"}
# Probe candidates per probe asked for: about half pass the margin rule (206 of 380 on
# 2026-12-01; chat_repeat is the weak family, 18 of 126).
PROBE_ASK = 2.0


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="orchard quality", description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="orchard-tiny", type=model_arg,
                    help=MODEL_HELP + " (default: orchard-tiny)")
    ap.add_argument("--data", default="training/data",
                    help="corpus build with heldout_tokens.npy (rebuilt from the stdlib if absent)")
    ap.add_argument("--suite", choices=("card", "text"), default=None,
                    help="card: orchard-tiny's own tasks (its model card's retrieval, greedy "
                    "decode); text: chat prose and held-out code, dict-lookup retrieval and chat "
                    "probes graded teacher-forced (quality.tasks). Default: card for "
                    "orchard-tiny, text for any other model")
    ap.add_argument("--formats", default="native,int8,k8v4,int4,int4-norot",
                    help="formats to judge; 'native' is the control (a second native run)")
    ap.add_argument("--quick", action="store_true",
                    help=f"CI preset: {QUICK} (explicit size flags still win)")
    ap.add_argument("--nll-tokens", type=int, default=None,
                    help=f"minimum scored held-out tokens per format (full: {FULL['nll_tokens']})")
    ap.add_argument("--window", type=int, default=1024, help="held-out window length (tokens)")
    ap.add_argument("--chunk", type=int, default=128,
                    help="teacher-forced prefill chunk; positions of the first chunk are unscored")
    ap.add_argument("--retrieval-cases", type=int, default=None,
                    help=f"cases per (task, length) cell (full: {FULL['retrieval_cases']})")
    ap.add_argument("--lengths", default=None, help=f"retrieval lengths (full: {FULL['lengths']})")
    ap.add_argument("--retrieval-chunk", type=int, default=512, help="prefill chunk for generation")
    ap.add_argument("--probes", type=int, default=None,
                    help=f"graded probes kept (native-correct; full: {FULL['probes']})")
    ap.add_argument("--batch", type=int, default=None,
                    help="sequences per forward call (default 4 on the CPU, 64 elsewhere)")
    ap.add_argument("--dtype", default=None, help="compute dtype (default: float32 on the CPU, "
                    "bfloat16 on Metal/CUDA)")
    ap.add_argument("--reference-dtype", default="auto",
                    help="noise floor for NLL/KL off float32 (quality.verdicts.REFERENCE_DTYPE): "
                    "the same weights also run natively in this dtype, every run is scored "
                    "against it, and the declared NLL/KL margins bound a format's excess over "
                    "native's (result key 'floor'). auto: float32 when the compute dtype is not "
                    "float32, else off; none: off (formats judged against native alone)")
    ap.add_argument("--out", default=None, help="write the JSON result here")
    ap.add_argument("--md", default=None, help="write the markdown report here (docs/quality.md)")
    ap.add_argument("--machine", default=None, help="machine description for the report")
    ap.add_argument("--parts", default="nll,probes,retrieval",
                    help="measurements to run, in this order (a subset reruns part of the gate)")
    ap.add_argument("--report", default=None, metavar="JSON",
                    help="no run: re-render the verdicts and --md from a saved --out result")
    ap.add_argument("--strict", action="store_true",
                    help="exit 1 when any judged format fails (int4-norot excluded: it is the "
                    "ablation that shows what rotation buys)")
    return ap


def resolve_sizes(a: argparse.Namespace) -> argparse.Namespace:
    if a.suite is None:
        a.suite = "card" if str(a.model).rstrip("/").endswith("orchard-tiny") else "text"
    if a.suite == "text":
        preset = QUICK_TEXT if a.quick else FULL_TEXT
    else:
        preset = QUICK if a.quick else FULL
    for k, v in preset.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.lengths = [int(x) for x in str(a.lengths).split(",") if x]
    a.formats = [f.strip() for f in a.formats.split(",") if f.strip()]
    return a
