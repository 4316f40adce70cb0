"""What float32 scores cost and buy in the ops prefill path (engine/attention/ops_prefill.py).

    python -m bench.prefill_scores --out scores.json            # the model shapes below
    python -m bench.prefill_scores --quick                      # one small shape (CPU smoke)

Per shape (query heads, KV heads, head dim, queries L, keys S; bf16 inputs, a causal mask
aligned to the last key), three ways of attending: `ops_f32` (the default: scores and softmax
in float32), `ops_bf16` (scores in the inputs' dtype, the path before) and `fast`
(mx.fast.scaled_dot_product_attention: cuDNN's flash attention on CUDA, what mlx-lm's prefill
takes). Each: milliseconds per call (median of --repeats, evaluated one call at a time) and its
error against a float64 NumPy reference over the same bf16 inputs (max and mean absolute).
Why: the engine's bf16 greedy tokens diverged from mlx-lm's on the GPU where the CPU's matched
512 of 512 (docs/lab/greedy-agreement.md); prefill scores rounded to bf16 were the one place
the engine's arithmetic was coarser than the fast path's.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

from bench.output import emit
from engine.attention import ops_prefill

# (name, query heads, KV heads, head dim, L, S): prompt chunks the ops path takes (under
# OPS_SCORE_ELEMENTS scores) at SmolLM2-135M, Llama-3.2-1B and Llama-3.1-8B geometry.
SHAPES = [("smollm2-512", 9, 3, 64, 512, 512), ("smollm2-1024+1024", 9, 3, 64, 1024, 2048),
          ("1b-512", 32, 8, 64, 512, 512), ("1b-1024", 32, 8, 64, 1024, 1024),
          ("8b-512+512", 32, 8, 128, 512, 1024)]
QUICK = [("tiny-64", 4, 2, 64, 64, 96)]


def reference(q, k, v, scale: float) -> np.ndarray:
    """float64 causal attention (bottom-right aligned) over the bf16 inputs."""
    qf, kf, vf = (np.array(x.astype(mx.float32)).astype(np.float64) for x in (q, k, v))
    hq, hkv, n, s = qf.shape[1], kf.shape[1], qf.shape[2], kf.shape[2]
    kf, vf = np.repeat(kf, hq // hkv, axis=1), np.repeat(vf, hq // hkv, axis=1)
    scores = np.einsum("bhld,bhsd->bhls", qf, kf) * scale
    keep = np.arange(s)[None, :] <= np.arange(s - n, s)[:, None]
    scores = np.where(keep, scores, -np.inf)
    scores -= scores.max(-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhls,bhsd->bhld", p, vf)


def timed(fn, repeats: int) -> float:
    mx.eval(fn())                                    # compile / plan outside the timing
    times = []
    for _ in range(repeats):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def measure(shape, repeats: int) -> dict:
    name, hq, hkv, d, n, s = shape
    mx.random.seed(0)
    q = mx.random.normal((1, hq, n, d)).astype(mx.bfloat16)
    k = mx.random.normal((1, hkv, s, d)).astype(mx.bfloat16)
    v = mx.random.normal((1, hkv, s, d)).astype(mx.bfloat16)
    scale = d ** -0.5
    ways = {"ops_f32": lambda: ops_prefill.ops_attention(q, k, v, scale, "causal"),
            "ops_bf16": lambda: ops_prefill.ops_attention(q, k, v, scale, "causal",
                                                          score_dtype=mx.bfloat16),
            "fast": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale,
                                                                 mask="causal")}
    ref = reference(q, k, v, scale)
    row = {"heads": [hq, hkv], "head_dim": d, "queries": n, "keys": s}
    for way, fn in ways.items():
        err = np.abs(np.array(fn().astype(mx.float32)).astype(np.float64) - ref)
        row[way] = {"ms": round(timed(fn, repeats), 4), "max_abs_err": float(err.max()),
                    "mean_abs_err": float(err.mean())}
    row["f32_over_bf16_time"] = round(row["ops_f32"]["ms"] / row["ops_bf16"]["ms"], 3)
    return {name: row}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one small shape (a CPU smoke run)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", help="write the JSON here as well as to stdout")
    args = ap.parse_args(argv)
    out = {"mlx": mx.__version__, "device": str(mx.default_device()), "shapes": {}}
    for shape in QUICK if args.quick else SHAPES:
        out["shapes"].update(measure(shape, args.repeats))
        print(f"[prefill_scores] {shape[0]} done", file=sys.stderr, flush=True)
    emit(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
