"""One mixed step (new prompts beside decoding rows) through the runner, merged or not.

    python -m bench.mixed_step --model smollm2 --prompts 200 --prompts 300,150,60 --out mix.json

A served step on the CPU mixes a prompt's chunk with the decode rows of running requests. The
runner groups rows of similar length into calls; with `KernelChoices.merged_steps` (the default
where it fits: engine/runner/merged.py) all groups go through the projections in one pass over
the weights, without it each group is a whole model call. For each `--prompts` set this times,
in one process with the variants interleaved round by round:
- `merged` / `per_group`: the step (the prompts plus --rows decode rows at --context tokens);
- `decode_alone`, `prompts_alone`: its two halves as steps of their own (per-group calls).
Prints the median and every round, in seconds, and merged / per_group as a ratio.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace

from bench.output import run_bench
from engine.model.names import MODEL_HELP, model_arg


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.mixed_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=model_arg, required=True, help=MODEL_HELP)
    p.add_argument("--prompts", action="append", type=_lengths,
                   help="prompt lengths of one step's new prompts, comma-separated (repeat for "
                        "more steps; default: 200)")
    p.add_argument("--rows", type=int, default=12, help="decode rows beside the prompts")
    p.add_argument("--context", type=int, default=200, help="tokens each decode row holds")
    p.add_argument("--page-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    args = p.parse_args(argv)
    args.prompts = args.prompts or [[200]]
    if args.rows < 1 or args.context < 1 or args.repeats < 1:
        p.error("--rows, --context and --repeats must be >= 1")
    return args


def _lengths(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}")
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"token counts must be >= 1, got {text!r}")
    return lengths


def run(args) -> dict:
    import mlx.core as mx
    import numpy as np

    from engine.attention.choices import DEFAULT_KERNELS
    from engine.kv.store import KVStore
    from engine.model.loader import load_model
    from engine.runner.paged import ModelRunner
    from engine.sched.seq import Chunk

    loaded = load_model(args.model)
    longest = max(args.context + 1, *(n for p in args.prompts for n in p))
    per_seq = -(-longest // args.page_tokens)
    seqs = args.rows + max(len(p) for p in args.prompts)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(seqs)]
    rng = np.random.default_rng(args.seed)
    vocab = loaded.geometry.vocab_size
    runners = {}
    for name, merged in (("merged", True), ("per_group", False)):
        r = ModelRunner(loaded, KVStore(loaded.geometry, seqs * per_seq, args.page_tokens,
                                        loaded.dtype),
                        kernels=replace(DEFAULT_KERNELS, merged_steps=merged))
        for i in range(args.rows):   # the decode rows' contexts
            mx.eval(r.forward([Chunk(i, rng.integers(3, vocab, args.context).tolist(), 0,
                                     tables[i])]))
        runners[name] = r
    if runners["merged"].merged is None:
        raise SystemExit(f"{args.model}: merged steps do not fit this model or device")

    def timed(runner, chunks) -> float:
        t0 = time.perf_counter()
        mx.eval(runner.forward(chunks))
        return time.perf_counter() - t0

    steps = []
    for lengths in args.prompts:
        prompts = [rng.integers(3, vocab, n).tolist() for n in lengths]
        new = [Chunk(args.rows + j, p, 0, tables[args.rows + j]) for j, p in enumerate(prompts)]
        decode = [Chunk(i, [5], args.context, tables[i]) for i in range(args.rows)]
        rounds = {"merged": [], "per_group": [], "decode_alone": [], "prompts_alone": []}
        for _ in range(args.repeats):
            # Same positions every round: each round rewrites the same page slots.
            for name in ("merged", "per_group"):
                rounds[name].append(timed(runners[name], new + decode))
            rounds["decode_alone"].append(timed(runners["per_group"], decode))
            rounds["prompts_alone"].append(timed(runners["per_group"], new))
        median = {k: round(float(np.median(v)), 4) for k, v in rounds.items()}
        steps.append({"prompts": lengths, "median_s": median,
                      "merged_to_per_group": round(median["merged"] / median["per_group"], 3),
                      "rounds_s": {k: [round(x, 4) for x in v] for k, v in rounds.items()}})
    return {"model": str(args.model), "device": str(mx.default_device()), "rows": args.rows,
            "context": args.context, "page_tokens": args.page_tokens, "repeats": args.repeats,
            "steps": steps}


def main(argv=None) -> int:
    return run_bench(parse_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
