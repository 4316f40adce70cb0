"""Time the CUDA decode attention kernels alone (native, packed v1, packed v2); print (save) JSON.

    python -m bench.decode_kernels --contexts 4096,32768 --batches 1,8 --out decode_kernels.json
    python -m bench.decode_kernels --kernels native,int4:v2 --min-keys 256,128,64   # split plans

`bench.kv` measures whole decode steps, where host work (issuing the graph) and the rest of the
model share the time; this isolates the attention call of one layer, so a kernel change shows
as itself. Per case: B rows of N keys each (page tables random permutations), GQA 16:4 x 128
(the `bench.kv --geometry gpu` layer) unless told otherwise, bf16; packed layers are one
uint32 pool each (engine/kv/page_layout.py) holding random codes, scales and offsets (the
kernels' speed does not depend on the values). Each round
issues `--layers` calls and evaluates them together (as a step's layers would be); the time
per call is the round's wall time / layers, median and best over `--rounds`. Only where MLX
has a CUDA device; exit 2 elsewhere.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

from bench.output import emit
from engine.attention.cuda import packed_decode as cuda_packed_decode
from engine.attention.cuda import paged_decode as cuda_paged_decode
from engine.attention.cuda.tile_helpers import kernel_layout


def _case_inputs(rng, rows: int, n: int, hq: int, kvh: int, d: int, page_tokens: int):
    per = -(-n // page_tokens)
    num_pages = rows * per
    tables = mx.array(rng.permutation(num_pages).astype(np.int32).reshape(rows, per))
    ends = mx.array(np.full(rows, n, np.int32))
    q = mx.random.normal((rows, hq, 1, d)).astype(mx.bfloat16)
    k_new = mx.random.normal((rows, kvh, 1, d)).astype(mx.bfloat16)
    v_new = mx.random.normal((rows, kvh, 1, d)).astype(mx.bfloat16)
    native = tuple(mx.random.normal((kvh, num_pages, page_tokens, d)).astype(mx.bfloat16)
                   for _ in range(2))

    def pool(bits):
        """(pool, layout) of `bits` for both K and V."""
        layout = kernel_layout(page_tokens, kvh, d, bits, bits)
        words = layout.zeros(num_pages)
        every = mx.arange(num_pages, dtype=mx.int32)
        for name, bounds in (("k_codes", None), ("v_codes", None),
                             ("k_scales", (0.01, 0.1)), ("k_offsets", (-0.5, -0.1)),
                             ("v_scales", (0.01, 0.1)), ("v_offsets", (-0.5, -0.1))):
            shape = (num_pages, page_tokens, kvh, layout.width(name))
            values = (mx.random.randint(0, 2**31 - 1, shape).astype(mx.uint32) if bounds is None
                      else mx.random.uniform(*bounds, shape))
            layout.write_pages(words, every, name, values)
        return words, layout

    return q, k_new, v_new, native, pool, tables, ends


def _time(call, layers: int, rounds: int) -> dict:
    for _ in range(2):   # compile and warm up
        mx.eval([call() for _ in range(layers)])
    times = []
    for _ in range(rounds):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval([call() for _ in range(layers)])
        mx.synchronize()
        times.append((time.perf_counter() - t0) / layers * 1e6)
    return {"us_median": round(statistics.median(times), 1), "us_best": round(min(times), 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--heads", default="16:4", help="query:KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-tokens", type=int, default=16)
    ap.add_argument("--kernels", default="native,int4:v1,int4:v2,int8:v1,int8:v2",
                    help="native, or FORMAT:v1 / FORMAT:v2 / FORMAT:v2own (v2's variant that "
                         "also stores the step's own rows into the pool)")
    ap.add_argument("--split-target", type=int, default=None,
                    help="blocks per layer the kernels aim for (default: each kernel's own)")
    ap.add_argument("--min-keys", default="",
                    help="comma list of smallest keys per split to time each kernel at "
                         "(e.g. 256,128,64: one row per value, named KERNEL@mkN; default: "
                         "each kernel's own plan only)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", default="decode_kernels.json")
    args = ap.parse_args(argv)
    try:
        plans = [int(x) for x in args.min_keys.split(",") if x] or [None]
    except ValueError:
        ap.error(f"--min-keys: comma list of integers, got {args.min_keys!r}")
    if any(m is not None and m < 1 for m in plans):
        ap.error("--min-keys: values must be >= 1")
    if not cuda_paged_decode.available():
        print("no CUDA device: nothing to time", file=sys.stderr)
        return 2
    hq, kvh = (int(x) for x in args.heads.split(":"))
    d, scale = args.head_dim, args.head_dim ** -0.5
    rng = np.random.default_rng(0)
    result = {"mlx": mx.__version__, "args": vars(args), "cases": {}}
    for n in (int(x) for x in args.contexts.split(",")):
        for rows in (int(x) for x in args.batches.split(",")):
            q, k_new, v_new, native, pool, tables, ends = _case_inputs(
                rng, rows, n, hq, kvh, d, args.page_tokens)
            pools = {}
            row = {}
            for spec, mk in ((s, m) for s in args.kernels.split(",") for m in plans):
                name = spec if mk is None else f"{spec}@mk{mk}"
                if spec == "native":
                    def call(mk=mk):
                        return cuda_paged_decode.paged_decode_attention(
                            q, *native, tables, ends, scale, n, args.split_target, mk)
                    kv_bytes = 2 * rows * kvh * n * d * 2
                else:
                    fmt, version = spec.split(":")
                    bits = {"int4": 4, "int8": 8}[fmt]
                    # "v2own": the v2 kernel's variant that also stores the own rows
                    version, own = version.removesuffix("own"), version.endswith("own")
                    if bits not in pools:
                        pools[bits] = pool(bits)
                        mx.eval(pools[bits][0])
                    words, layout = pools[bits]

                    def call(words=words, layout=layout, bits=bits, version=version, mk=mk,
                             own=own):
                        return cuda_packed_decode.packed_decode_attention(
                            q, k_new, v_new, words, layout, bits, tables, ends, n, scale,
                            args.split_target, version=version, min_keys=mk, own=own)
                    kv_bytes = 2 * rows * kvh * n * (d * bits // 8 + 2 * 4 * (d // 64))
                try:
                    row[name] = _time(call, args.layers, args.rounds)
                    row[name]["GB_s"] = round(kv_bytes / row[name]["us_best"] / 1e3, 1)
                except Exception as e:   # record it, time the rest
                    row[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
                print(f"ctx {n} batch {rows} {name}: {row[name]}", file=sys.stderr, flush=True)
            base = row.get("native", row.get(f"native@mk{plans[0]}", {}))
            if "us_median" in base:   # against native at its own (or the first) plan
                for r in row.values():
                    if "us_median" in r:
                        r["speed_vs_native"] = round(base["us_median"] / r["us_median"], 3)
            result["cases"][f"ctx{n}-b{rows}"] = row
            del native, pools
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
