"""Where a decode step's device time goes, kernel by kernel: CUPTI's records through PyTorch's
profiler (the accelerator image has PyTorch; MLX has no kernel profiler of its own, and CUPTI
sees every kernel of the process, MLX's included, graph nodes too).

    python3 -m bench.device.kernel_trace --model W/models/llama-3.1-8b --context 4096 \\
        --variants native@8,k6v4-kivi@8,native@1,mlx-lm@1 --out $OUT/kernel-trace.json
    python3 -m bench.device.kernel_trace --geometry gpu --context 32768 --out $OUT/t.json
    python -m bench.device.kernel_trace --tiny --out RESULT.json    # CPU smoke run, no trace

Each variant is FORMAT[:KERNEL]@BATCH (bench.kv_decode's format specs, its pipelined decode at
--context keys per row), `mlx-lm@1` (mlx-lm's generate_step after a --context-token prompt,
the batch-1 yardstick of issue 33), or `prefill:FORMAT[:KERNEL]@TOKENS` (one prompt of TOKENS
prefilled in --chunk-token steps through bench.kv's runner, as `bench.kv --sections prefill`
times it; "steps" are then chunks, so per-step figures are per chunk). One warm-up round,
--untraced rounds of --steps steps timed without the profiler (`tok_s_untraced`: the rates to
quote), then one round under it.
Per variant: wall ms per step, kernels per step, the kernels' summed and merged (busy) device
time per step, the device's idle time inside the traced span (host-bound steps show it), and
the kernels ranked by device time per step. Why: issue 32's 8B page-key step is 0.8x native
although its attention kernel and write are each faster or close (device run 7: ~120 us per
layer unattributed), and issue 33's batch-1 step sits below the bandwidth limit for reasons a
wall clock cannot split. Without PyTorch or CUDA the steps are timed and `trace` says why not.
"""
from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
import numpy as np

from bench.kv import GEOMETRIES
from bench.kv_decode import DecodeTimer
from bench.kv_runners import PAGE_TOKENS, page_tokens_arg, progress
from engine.attention.choices import DEFAULT_KERNELS
from engine.model.loader import load_model

TINY = dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64, vocab_size=256, max_position_embeddings=1024)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model folder (bench.device.shaped_models builds them)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model (CPU smoke run)")
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES),
                    help="a random model in one of bench.kv's geometries (its rows' model)")
    ap.add_argument("--variants", default="native@8,k6v4-kivi@8",
                    help="FORMAT[:KERNEL]@BATCH or mlx-lm@1, comma-separated")
    ap.add_argument("--context", type=int, default=4096, help="keys per row before decoding")
    ap.add_argument("--steps", type=int, default=20, help="traced decode steps per variant")
    ap.add_argument("--page-tokens", type=page_tokens_arg, default=PAGE_TOKENS,
                    help="decode variants: tokens a KV page (the engine serves 64 by default)")
    ap.add_argument("--chunk", type=int, default=2048,
                    help="prefill variants: tokens per prefill step (bench.kv's --chunk)")
    ap.add_argument("--untraced", type=int, default=3,
                    help="rounds timed without the profiler first (the rates to quote: CUPTI "
                         "slows the host, so the traced round's rate is not one)")
    ap.add_argument("--top", type=int, default=25, help="kernels listed per variant")
    ap.add_argument("--no-fuse", action="store_true",
                    help="separate q/k/v and gate/up matmuls (the engine fuses them by default)")
    ap.add_argument("--out", type=Path, required=True, help="the JSON (rewritten per variant)")
    args = ap.parse_args(argv)
    if sum(map(bool, (args.model, args.tiny, args.geometry))) != 1:
        ap.error("give one of --model DIR, --geometry NAME, --tiny")
    return args


def short_name(kernel: str) -> str:
    """A kernel's name without its template arguments and parameter list."""
    name = re.sub(r"^void ", "", kernel)
    depth, out = 0, []
    for ch in name:
        depth += ch == "<"
        if depth == 0 and ch == "(":
            break
        if depth == 0:
            out.append(ch)
        depth -= ch == ">" and depth > 0
    return "".join(out)[:120] or kernel[:120]


def summarize(kernels: list[tuple[str, float, float]], steps: int, top: int) -> dict:
    """(name, start us, end us) records -> per-step totals, busy time and the ranked kernels."""
    if not kernels:
        return {"kernels_per_step": 0}
    spans = sorted((s, e) for _, s, e in kernels)
    busy, cur_s, cur_e = 0.0, *spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            busy, cur_s, cur_e = busy + cur_e - cur_s, s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = spans[-1][1] - spans[0][0]
    by = defaultdict(lambda: [0, 0.0])
    for name, s, e in kernels:
        entry = by[short_name(name)]
        entry[0] += 1
        entry[1] += e - s
    ranked = sorted(by.items(), key=lambda kv: -kv[1][1])[:top]
    return {"kernels_per_step": round(len(kernels) / steps, 1),
            "kernel_us_per_step": round(sum(e - s for _, s, e in kernels) / steps, 1),
            "busy_us_per_step": round(busy / steps, 1),
            "idle_us_per_step": round((span - busy) / steps, 1),
            "top": [{"kernel": k, "calls_per_step": round(n / steps, 2),
                     "us_per_step": round(t / steps, 1), "us_per_call": round(t / n, 2)}
                    for k, (n, t) in ranked]}


def traced(fn) -> tuple[object, dict | str]:
    """fn() under PyTorch's profiler: (its result, the CUDA kernel records) or a reason."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
        if not torch.cuda.is_available():
            return fn(), "no CUDA device seen by PyTorch"
    except ImportError as e:
        return fn(), f"PyTorch unavailable ({e})"
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        result = fn()
    cuda = torch.autograd.DeviceType.CUDA
    return result, [(e.name, e.time_range.start, e.time_range.end)
                    for e in prof.events() if e.device_type == cuda]


def engine_variant(loaded, spec: str, batch: int, context: int, steps: int, rounds: int,
                   page_tokens: int = PAGE_TOKENS):
    """A round of `steps` pipelined decode steps of bench.kv_decode's timer on pages of
    `page_tokens`, warmed once; room for `rounds` more."""
    room = (rounds + 1) * steps + 2
    pages = batch * -(-(context + room) // page_tokens)
    timer = DecodeTimer(loaded, spec, pages, batch, context, room, pipelined=True,
                        page_tokens=page_tokens)
    timer.round(steps)
    return lambda: timer.round(steps)


def prefill_variant(loaded, spec: str, tokens: int, chunk: int):
    """(a round: one prompt of `tokens` prefilled in `chunk`-token steps through bench.kv's
    runner for FORMAT[:KERNEL] (bench.kv.prefill_spec), warmed once at full length so the
    traced round pays no kernel build or cuDNN plan; chunks per round)."""
    from bench.kv import prefill_once, prefill_spec
    from bench.kv_runners import make_runner
    fmt, mode, kernels = prefill_spec(spec, DEFAULT_KERNELS, "direct")
    runner = make_runner(loaded, fmt, -(-tokens // PAGE_TOKENS), mode, kernels)
    prompt = np.random.default_rng(0).integers(3, loaded.geometry.vocab_size, tokens).tolist()
    prefill_once(runner, prompt, chunk)
    return (lambda: prefill_once(runner, prompt, chunk)), -(-tokens // chunk)


def mlx_lm_variant(model_dir: str, context: int, steps: int, rounds: int):
    """mlx-lm's own batch-1 decode (generate_step, which pipelines), after a prompt."""
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    model, _ = load(model_dir)
    prompt = mx.array([7] * context)
    gen = generate_step(prompt, model, max_tokens=(rounds + 1) * steps + 10)
    for _ in range(steps):
        next(gen)

    def run():
        t0 = time.perf_counter()
        for _ in range(steps):
            next(gen)
        return time.perf_counter() - t0
    return run


def main(argv=None) -> int:
    args = parse_args(argv)
    model_dir = args.model
    if args.tiny or args.geometry:
        from bench.synthetic import build_tiny_model
        shape = GEOMETRIES[args.geometry] if args.geometry else TINY
        model_dir = str(build_tiny_model("llama", Path(tempfile.mkdtemp()) / "trace", **shape))
    loaded = load_model(model_dir, fuse=not args.no_fuse)
    result = {"env": {"mlx": mx.__version__, "device": str(mx.default_device()),
                      "model": args.model or args.geometry or "tiny", "context": args.context,
                      "steps": args.steps, "page_tokens": args.page_tokens,
                      "fused": not args.no_fuse,
                      "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
              "variants": {}}
    for item in args.variants.split(","):
        spec, _, batch = item.partition("@")
        batch = int(batch or 1)
        prefill = spec.startswith("prefill:")
        progress(f"{spec} {'tokens' if prefill else 'batch'} {batch}"
                 f"{'' if prefill else f' at {args.context} keys'}", "kernel_trace")
        try:
            rounds, steps, tokens = args.untraced + 1, args.steps, batch * args.steps
            if prefill:   # one prompt of `batch` tokens a round, `steps` chunks
                run, steps = prefill_variant(loaded, spec[len("prefill:"):], batch, args.chunk)
                tokens = batch
            elif spec == "mlx-lm":
                run = mlx_lm_variant(model_dir, args.context, args.steps, rounds)
            else:
                run = engine_variant(loaded, spec, batch, args.context, args.steps, rounds,
                                     args.page_tokens)
            untraced = [tokens / run() for _ in range(args.untraced)]
            seconds, records = traced(run)
            row = {"batch": 1 if prefill else batch, "steps": steps,
                   "tok_s_untraced": [round(r, 1) for r in untraced],
                   "tok_s_untraced_median": (round(statistics.median(untraced), 1)
                                             if untraced else None),
                   "wall_ms_per_step": round(1e3 * seconds / steps, 3),
                   "tok_s": round(tokens / seconds, 1)}
            row["trace"] = (summarize(records, steps, args.top)
                            if isinstance(records, list) else records)
        except Exception as e:  # noqa: BLE001 - a variant that fails is a result
            row = {"error": f"{type(e).__name__}: {e}"[:400]}
        result["variants"][item] = row
        run = None
        gc.collect()
        mx.clear_cache()
        args.out.write_text(json.dumps(result, indent=1))
        progress(f"{item}: {json.dumps(row)[:300]}", "kernel_trace")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
