"""Attention-level timing of the packed prefill paths against native SDPA (prints JSON).

One prefill chunk of L queries over S tokens of packed history plus its own L fresh tokens, the
shape every chunk after the first has. Variants, all from engine.attention.packed:
  native        mx.fast SDPA over compute-dtype K/V of length S+L (what a native layer runs)
  direct_tiled  history unpacked tile by tile under one online softmax (FP32)
  direct_qmm    history scored and summed with quantized_matmul (FP32 accumulation in-kernel);
                on the CPU the scores are a GEMM on the codes (engine.attention.cpu_gemm)
  direct_qmm_mlx  (CPU A/B) direct_qmm with MLX's quantized_matmul for the scores as well
  fused         history dequantized to an FP32 scratch, one SDPA call
  scratch_compute_dtype  (reference, not an engine path) the same in the compute dtype
  direct_cuda   (GPU only, experiment) bench.experiments.cuda_packed_attention: unpack inside the tile
Times are medians over --repeats after a warm-up, interleaved variant by variant so load drift
hits all of them; ratios are to native in the same run. `max_err` is the largest absolute
difference from an FP32 reference computed on the dequantized history (so it measures the path's
arithmetic, not the quantization error, which all packed paths share).

  python -m bench.attention --dtype bfloat16 --history 3584,15872 --formats int8,int4
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import mlx.core as mx

from capacity.formats import KVFormat
from bench.output import emit
from engine.attention.choices import KernelChoices
from engine.attention.packed import direct_attention, fused_attention
from engine.kv.quant import PackedKV
from engine.kv.quant import dequantize, quantize
from engine.kv.rotation import rotate

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def _inputs(B, Hq, Hkv, L, S, D, dtype, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((B, Hq, L, D)).astype(dtype)
    k_hist = mx.random.normal((B, Hkv, S, D))
    v_hist = mx.random.normal((B, Hkv, S, D))
    k_new = mx.random.normal((B, Hkv, L, D)).astype(dtype)
    v_new = mx.random.normal((B, Hkv, L, D)).astype(dtype)
    return q, k_hist, v_hist, k_new, v_new


def _time(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def run_case(fmt_name: str, B, Hq, Hkv, L, S, D, dtype, repeats: int,
             only: set[str] | None = None) -> dict:
    fmt = KVFormat(fmt_name, D)
    scale = D ** -0.5
    q, k_hist, v_hist, k_new, v_new = _inputs(B, Hq, Hkv, L, S, D, dtype)
    hist = PackedKV(quantize(rotate(k_hist), fmt.k_bits), quantize(v_hist, fmt.v_bits))
    # Native sees the same (dequantized) history, in the compute dtype, unrotated basis.
    k_deq = dequantize(hist.k, fmt.k_bits)
    v_deq = dequantize(hist.v, fmt.v_bits)
    k_nat = mx.concatenate([k_deq.astype(dtype), rotate(k_new).astype(dtype)], axis=2)
    v_nat = mx.concatenate([v_deq.astype(dtype), v_new], axis=2)
    q_rot = rotate(q).astype(dtype)
    mx.eval(q, hist, k_nat, v_nat, q_rot, k_new, v_new)
    variants = {
        "native": lambda: mx.fast.scaled_dot_product_attention(q_rot, k_nat, v_nat, scale=scale,
                                                               mask="causal"),
        "direct_tiled": lambda: direct_attention(q, hist, k_new, v_new, fmt=fmt, scale=scale,
                                                 qmm_max_queries=0),
        "direct_qmm": lambda: direct_attention(q, hist, k_new, v_new, fmt=fmt, scale=scale,
                                               qmm_max_queries=1 << 30),
        "fused": lambda: fused_attention(q, hist, k_new, v_new, fmt=fmt, scale=scale),
        # CPU: the same qmm path with MLX's quantized_matmul for the scores too (the engine
        # scores decode rows with a GEMM on the codes there, engine.attention.cpu_gemm).
        "direct_qmm_mlx": lambda: direct_attention(
            q, hist, k_new, v_new, fmt=fmt, scale=scale, qmm_max_queries=1 << 30,
            kernels=KernelChoices(cpu_code_gemm=False)),
        # Reference only (not an engine path): the history dequantized to the compute dtype.
        "scratch_compute_dtype": lambda: mx.fast.scaled_dot_product_attention(
            q_rot, mx.concatenate([dequantize(hist.k, fmt.k_bits, dtype),
                                   rotate(k_new).astype(dtype)], axis=2),
            mx.concatenate([dequantize(hist.v, fmt.v_bits, dtype), v_new], axis=2),
            scale=scale, mask="causal"),
    }
    if mx.default_device() != mx.cpu:   # the experimental in-tile kernel (CUDA only)
        from bench.experiments.cuda_packed_attention import packed_prefill_attention
        variants["direct_cuda"] = lambda: packed_prefill_attention(q, hist, k_new, v_new,
                                                                   fmt=fmt, scale=scale)
    if only:
        variants = {k: v for k, v in variants.items() if k == "native" or k in only}
    ref = mx.fast.scaled_dot_product_attention(
        q_rot.astype(mx.float32), k_nat.astype(mx.float32), v_nat.astype(mx.float32),
        scale=scale, mask="causal")
    result: dict = {"format": fmt_name, "S": S, "L": L}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for name, fn in variants.items():
        try:
            out = fn()
            mx.eval(out)
            result[f"{name}_max_err"] = float(mx.abs(out.astype(mx.float32) - ref).max())
            _time(fn, 2)   # warm-up (CUDA kernels JIT-compile on first use)
        except Exception as e:  # noqa: BLE001 - a missing backend kernel is a result to report
            result[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
            times.pop(name)
    for _ in range(repeats):
        for name in list(times):
            times[name] += _time(variants[name], 1)
    base = statistics.median(times["native"]) if "native" in times else None
    for name, ts in times.items():
        med = statistics.median(ts)
        result[f"{name}_ms"] = round(med, 4)
        if base:
            result[f"{name}_ratio"] = round(med / base, 3)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--formats", default="int8,k8v4,int4")
    ap.add_argument("--history", default="512,3584", help="packed history lengths S")
    ap.add_argument("--chunk", type=int, default=512, help="queries per chunk L")
    ap.add_argument("--heads", default="16,4", help="query heads, KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--variants", default="",
                    help="comma-separated subset to time (native always runs); default all")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    hq, hkv = (int(x) for x in args.heads.split(","))
    cases = []
    for fmt in args.formats.split(","):
        for S in (int(x) for x in args.history.split(",")):
            case = run_case(fmt, args.batch, hq, hkv, args.chunk, S, args.head_dim,
                            DTYPES[args.dtype], args.repeats,
                            {v for v in args.variants.split(",") if v})
            print(json.dumps(case), file=sys.stderr, flush=True)
            cases.append(case)
    doc = {"device": str(mx.default_device()), "mlx": mx.__version__, "dtype": args.dtype,
           "heads": [hq, hkv], "head_dim": args.head_dim, "batch": args.batch, "cases": cases}
    emit(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
