"""Issue-3 bench: KV bytes and capacity per format, prefill TTFT and decode speed vs native.

    python -m engine.platform exec .venv/bin/python -m bench.kv --out bench.json

Every number of one run comes from one process, so ratios to native are fair on a shared machine;
absolute times mean something only on a dedicated one. The default model is a synthetic
llama-style geometry (random weights, built offline) so the bench runs anywhere; `--model`
uses a real model instead: `smollm2` (models/smollm2-135m, `make real-model`), `orchard-tiny`,
a model folder or a .gguf file.

Sections:
- capacity: exact bytes per token per format, and the raw tokens admitted at one equal KV
  budget (single request, and the split-safe projection over 16 requests, page tails included),
  for the bench model and two reference geometries, against the 1.78x / 2.29x / 3.2x goals;
- prefill: time to first token of a prompt of N tokens, prefilled in `--chunk`-token steps, for
  native, direct and fused;
- decode: tokens/s of B sequences that each already hold N tokens of KV (bench/kv_decode.py).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sysconfig
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np

from capacity.formats import FORMAT_BITS, KVFormat
from capacity.pricing import CostModel
from engine.attention.choices import DEFAULT_KERNELS, PREFILL_PATHS, KernelChoices
from engine.attention.cuda import packed_decode_v2 as cuda_packed_decode_v2
from engine.attention.cuda import packed_prefill as cuda_packed_prefill
from engine.attention.cuda import packed_write as cuda_packed_write
from engine.attention.cuda import page_key_decode as cuda_page_key_decode
from engine.attention.cuda import paged_decode as cuda_paged_decode
from engine.attention.layers import counters_of
from engine.model.loader import load_model
from engine.model.names import MODEL_HELP, model_arg
from engine.sched.seq import Chunk
from bench.kv_quality import heldout_docs, quality_section
from bench.kv_decode import decode_section
from bench.kv_runners import PAGE_TOKENS, make_runner, make_store, page_tokens_arg, progress

GOALS = {"int8": 16 / 9, "k8v4": 16 / 7, "int4": 3.2}
REFERENCE_GEOMETRIES = {
    # name: (full-attention layers, kv heads, head dim), BF16 payload
    "llama3-8b": (32, 8, 128),
    "qwen3.6-35b-a3b(full layers)": (10, 2, 256),
}
GEOMETRIES = {
    # CPU-sized: attention is a large share of the work, so KV-path ratios show.
    "small": dict(hidden_size=512, num_hidden_layers=4, intermediate_size=1024,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                  max_position_embeddings=40000),
    # GPU-sized (~0.5B params, Llama-like GQA 4:1) so kernels are not all launch overhead.
    "gpu": dict(hidden_size=2048, num_hidden_layers=8, intermediate_size=5632,
                num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                max_position_embeddings=40000),
}


def capacity_table(bytes_per_token: dict[str, int], budget: int, page_tokens: int) -> dict:
    """Admitted raw tokens per format at one budget, and the ratio to native."""
    out = {}
    for name, bpt in bytes_per_token.items():
        cm = CostModel(budget_bytes=budget, bytes_per_token=bpt, page_tokens=page_tokens,
                       fixed_bytes_per_request=0, concurrency_ceiling=16)
        out[name] = {"bytes_per_token": bpt, "max_raw_tokens_1req": cm.max_raw_tokens(),
                     "max_raw_tokens_16req": cm.project().max_new_raw_tokens}
    for name, row in out.items():
        for key in ("max_raw_tokens_1req", "max_raw_tokens_16req"):
            row[key.replace("max_raw_tokens", "ratio")] = round(
                row[key] / out["native"][key], 4)
        if name in GOALS:
            row["goal"] = round(GOALS[name], 4)
            row["within_3pct"] = abs(row["ratio_16req"] / GOALS[name] - 1) <= 0.03
    return out


def capacity_section(loaded, budget: int, page_tokens: int = PAGE_TOKENS) -> dict:
    result = {}
    for ref, (layers, heads, dim) in REFERENCE_GEOMETRIES.items():
        bpt = {n: layers * KVFormat(n, dim, "bfloat16").bytes_per_token(heads, page_tokens)
               for n in FORMAT_BITS}
        result[ref] = capacity_table(bpt, budget, page_tokens)
    # The bench model: bytes measured from real allocated stores, not from the formula.
    bpt = {n: make_store(loaded, n, 1, page_tokens=page_tokens).bytes_per_token
           for n in FORMAT_BITS}
    result[f"bench-model({loaded.dtype_name})"] = capacity_table(bpt, budget, page_tokens)
    return result


def prefill_once(runner, tokens, chunk) -> float:
    table = list(range(-(-len(tokens) // runner.kvstore.page_tokens)))
    mx.synchronize()
    t0 = time.perf_counter()
    for s in range(0, len(tokens), chunk):
        mx.eval(runner.forward([Chunk(0, tokens[s:s + chunk], s, table)]))
    return time.perf_counter() - t0


# Prefill format variants: "k6v4-kivi:kernel" prefills page-key history through the CUDA
# dequant kernel (KernelChoices.page_key_prefill: engine/attention/cuda/page_key_dequant.py;
# the CUDA default, so a plain "k6v4-kivi" takes it there too), "k6v4-kivi:mlx" through the
# MLX direct path (the kernel off), "k6v4-kivi:mx-softmax" on the CPU with mx.fast's SDPA and
# mx.softmax where packed attention takes NumPy's softmax (KernelChoices.cpu_softmax off),
# "k6v4-kivi:chunk-write" through the dequant kernel with the chunk's page-key write through the
# CUDA write kernel (KernelChoices.page_key_chunk_write), "k6v4-kivi:mlx-write" with it in MLX
# ops (no CUDA write kernel at all).
PREFILL_KERNELS = {"kernel": dict(page_key_prefill=True), "mlx": dict(page_key_prefill=False),
                   "mx-softmax": dict(cpu_softmax=False),
                   "chunk-write": dict(page_key_prefill=True, page_key_chunk_write=True),
                   "mlx-write": dict(page_key_prefill=True, page_key_write=False,
                                     page_key_chunk_write=False)}


def prefill_spec(spec: str, kernels: KernelChoices, mode: str) -> tuple:
    """(format, mode, kernel choices) of a prefill format spec FORMAT[:kernel]."""
    fmt, _, kernel = spec.partition(":")
    if kernel and kernel not in PREFILL_KERNELS:
        raise ValueError(f"prefill format {spec!r}: kernel must be one of "
                         f"{sorted(PREFILL_KERNELS)}")
    return fmt, mode, replace(kernels, **PREFILL_KERNELS[kernel]) if kernel else kernels


def prefill_section(loaded, contexts, formats, chunk, repeats, out: dict, save,
                    kernels: KernelChoices = DEFAULT_KERNELS, paths: tuple = (),
                    page_tokens: int = PAGE_TOKENS) -> dict:
    """Prefill time per variant: native, each format's direct and fused modes, and for each of
    `paths` (KernelChoices.prefill_path values) its direct mode through that CUDA path, named
    "{format}-{path}" ("direct" takes `kernels.prefill_path`)."""
    rng = np.random.default_rng(0)
    vocab = loaded.geometry.vocab_size
    for n in contexts:
        tokens = rng.integers(3, vocab, n).tolist()
        variants = [("native", "native", "direct", kernels)] + [
            (f"{f}-{m}", *prefill_spec(f, kernels, m)) for f in formats
            for m in ("direct", "fused")] + [
            (f"{f}-{path}", f, "direct", replace(kernels, prefill_path=path))
            for path in paths for f in formats]
        runners = {name: make_runner(loaded, f, -(-n // page_tokens), m, k,
                                     page_tokens=page_tokens)
                   for name, f, m, k in variants}
        times = {name: [] for name in runners}
        errors = {}
        for name, r in runners.items():   # warm-up: kernels compile/JIT outside the timing
            try:
                prefill_once(r, tokens[:2 * min(chunk, 64)], min(chunk, 64))
            except Exception as e:  # a backend missing a kernel: record it, bench the rest
                errors[name] = f"{type(e).__name__}: {e}"[:300]
        for rep in range(repeats):        # interleaved, so drift hits every variant alike
            for name, r in runners.items():
                if name not in errors:
                    times[name].append(prefill_once(r, tokens, chunk))
                    progress(f"prefill {n} {name} repeat {rep + 1}/{repeats}: "
                             f"{times[name][-1]:.2f} s")
        row = {name: {"error": err} for name, err in errors.items()}
        for name, r in runners.items():
            if name not in errors:
                row[name] = {"ttft_s": round(min(times[name]), 4),
                             "counters": counters_of(r.kvstore) or None}
        for name in row:
            if "ttft_s" in row[name] and "ttft_s" in row["native"]:
                row[name]["ratio_to_native"] = round(
                    row[name]["ttft_s"] / row["native"]["ttft_s"], 3)
        out[str(n)] = row
        save()
        del runners
    return out


def _ints(text):
    return [int(x) for x in text.split(",") if x]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=model_arg,
                    help=MODEL_HELP + " (default: synthetic llama geometry)")
    ap.add_argument("--geometry", default="small", choices=sorted(GEOMETRIES),
                    help="synthetic model size when --model is not given")
    ap.add_argument("--dtype", default=None, help="compute dtype (default: f32 CPU, bf16 GPU)")
    ap.add_argument("--out", default="bench_kv.json")
    ap.add_argument("--fuse", action="store_true",
                    help="q/k/v and gate/up as one matmul each, as the engine loads models")
    ap.add_argument("--budget-gib", type=float, default=8.0)
    ap.add_argument("--prefill", type=_ints, default=[512, 4096, 16384])
    ap.add_argument("--prefill-formats", default="int8,int4")
    ap.add_argument("--gpu-qmm", action="store_true",
                    help="let direct attention call quantized_matmul on a GPU (off by default: "
                         "it crashed on MLX 0.32.4 CUDA; see KernelChoices.gpu_qmm)")
    ap.add_argument("--no-decode-kernel", action="store_true",
                    help="decode without the CUDA decode kernels "
                         "(engine/attention/cuda/*_decode.py): "
                         "the gather / direct paths they replace, to compare")
    ap.add_argument("--no-prefill-kernel", action="store_true",
                    help="prefill packed layers through the MLX-op direct path, not the CUDA "
                         "tile kernel (engine/attention/cuda/packed_prefill.py), to compare")
    ap.add_argument("--prefill-paths", default="",
                    help="also prefill each format's direct mode through these CUDA paths, as "
                         "FORMAT-PATH variants (comma-separated, any of "
                         f"{','.join(PREFILL_PATHS)}; 'direct' takes the default, "
                         f"{DEFAULT_KERNELS.prefill_path!r})")
    ap.add_argument("--prefill-dequant", action="store_true",
                    help="the same as --prefill-paths dequant (session 11's command)")
    ap.add_argument("--prefill-split-target", type=int, default=None,
                    help="blocks per launch the CUDA prefill kernel aims for when it splits the "
                         "keys (KernelChoices.prefill_split_target)")
    ap.add_argument("--no-write-kernel", action="store_true",
                    help="quantize packed writes with MLX ops, not the CUDA write kernel "
                         "(engine/attention/cuda/packed_write.py), to compare")
    ap.add_argument("--no-compile", action="store_true",
                    help="decode steps uncompiled (compiled by default where the CUDA decode "
                         "kernels run: engine/runner/compiled_decode.py), to compare")
    ap.add_argument("--split-target", type=int, default=None,
                    help="blocks per layer the CUDA decode kernels aim for when they split a "
                         "row's history (KernelChoices.decode_split_target)")
    ap.add_argument("--split-min-keys", type=int, default=None,
                    help="the shortest history split of the CUDA decode kernels, native and "
                         "packed (KernelChoices.decode_split_min_keys; default "
                         "cuda/paged_decode.MIN_KEYS_PER_SPLIT)")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--decode", type=_ints, default=[1024, 4096, 16384])
    ap.add_argument("--batches", type=_ints, default=[1, 4])
    ap.add_argument("--decode-formats", default="int8,k8v4,int4",
                    help="packed formats to decode; FORMAT:tiles / FORMAT:split / FORMAT:v2 "
                         "pick the CUDA decode kernel (prefill tile kernel / split decode "
                         "kernel v1 / tiled decode kernel v2); native:walk: native pages "
                         "through the walk native kernel, native: the tiled one "
                         "(bench.kv_decode.DECODE_KERNELS)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--page-tokens", type=page_tokens_arg, default=PAGE_TOKENS,
                    help="tokens a KV page, every format of the run (default "
                         f"{PAGE_TOKENS}, the bench's rows until device run 15; the engine "
                         "serves 64 by default: pass 64 for the page a user's server has): "
                         "capacity, prefill and decode; quality keeps the default")
    ap.add_argument("--pipelined", action="store_true",
                    help="decode as the engine does: queue step n+1 before reading step n back "
                         "(default: synchronous steps)")
    ap.add_argument("--interleave", action="store_true",
                    help="decode: set every format up first, then time them in turns, round "
                         "by round, and report each round's paired ratio to native and their "
                         "median (robust to a machine's slow spells; default: one format's "
                         "rounds after another's, best of each)")
    ap.add_argument("--graph-dots", metavar="DIR", default=None,
                    help="with --interleave on CUDA: count each format's CUDA graph nodes per "
                         "decode step from the dot files MLX writes to DIR (start the bench "
                         "with MLX_SAVE_CUDA_GRAPHS_DOT_FILE=DIR/g)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sections", default="capacity,prefill,decode",
                    help="any of capacity,prefill,decode,quality")
    ap.add_argument("--quality-root", default=None,
                    help="stdlib root to draw orchard-tiny's held-out files from (default: this "
                         "Python's standard library; the recorded arguments keep it unnamed, "
                         "so results carry no machine path)")
    ap.add_argument("--quality-docs", type=int, default=8)
    ap.add_argument("--quality-tokens", type=int, default=1024)
    ap.add_argument("--quality-chunk", type=int, default=32)
    args = ap.parse_args(argv)
    paths = tuple(p for p in args.prefill_paths.split(",") if p) + (
        ("dequant",) if args.prefill_dequant else ())
    if unknown := set(paths) - set(PREFILL_PATHS):
        ap.error(f"--prefill-paths: unknown {sorted(unknown)}; choose from {PREFILL_PATHS}")
    if args.graph_dots and not (args.interleave and Path(os.environ.get(
            "MLX_SAVE_CUDA_GRAPHS_DOT_FILE", "")).parent == Path(args.graph_dots)):
        ap.error("--graph-dots DIR needs --interleave and MLX_SAVE_CUDA_GRAPHS_DOT_FILE=DIR/g "
                 "set when the bench starts (MLX reads it once)")
    kernels = KernelChoices(
        gpu_qmm=args.gpu_qmm, decode_kernel=not args.no_decode_kernel,
        write_kernel=not args.no_write_kernel, prefill_kernel=not args.no_prefill_kernel,
        prefill_split_target=args.prefill_split_target or None,
        decode_split_target=args.split_target or None,
        decode_split_min_keys=args.split_min_keys or None,
        compiled_decode=False if args.no_compile else None)

    if args.model:
        model_dir = args.model
    else:
        from bench.synthetic import build_tiny_model
        model_dir = str(build_tiny_model("llama", Path(tempfile.mkdtemp()) / "bench",
                                         **GEOMETRIES[args.geometry]))
    loaded = load_model(model_dir, dtype=args.dtype, fuse=args.fuse)
    sections = args.sections.split(",")
    result = {"env": {"mlx": mx.__version__, "device": str(mx.default_device()),
                      "machine": platform.machine(), "dtype": loaded.dtype_name,
                      "model": args.model or f"synthetic-llama {GEOMETRIES[args.geometry]}",
                      "geometry": loaded.geometry.describe()[:1], "page_tokens": args.page_tokens,
                      "quality_page_tokens": PAGE_TOKENS,
                      # null: compiled where the CUDA decode kernel runs (never on the CPU)
                      "compiled_decode": kernels.compiled_decode,
                      "decode_kernels": (not args.no_decode_kernel
                                         and cuda_paged_decode.available()),
                      "split_target": (kernels.decode_split_target
                                       or cuda_paged_decode.TARGET_BLOCKS),
                      "split_min_keys": (kernels.decode_split_min_keys
                                         or cuda_paged_decode.MIN_KEYS_PER_SPLIT),
                      "v2_split_target": (kernels.decode_split_target
                                          or cuda_packed_decode_v2.TARGET_BLOCKS),
                      "page_key_split_target": (kernels.decode_split_target
                                                or cuda_page_key_decode.TARGET_BLOCKS),
                      "write_kernel": (kernels.write_kernel
                                       and cuda_packed_write.usable(8, 8, 128)),
                      "prefill_kernel": (kernels.prefill_kernel
                                         and cuda_packed_prefill.usable(8, 8, 128)),
                      "decode_tiles_default": kernels.decode_tiles,
                      "packed_decode_default": kernels.packed_decode,
                      "prefill_path": kernels.prefill_path,
                      "prefill_split_target": (kernels.prefill_split_target
                                               or cuda_packed_prefill.TARGET_BLOCKS),
                      "args": vars(args), "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                    time.gmtime())}}

    def save():   # after every row, so a run cut short still leaves what it measured
        Path(args.out).write_text(json.dumps(result, indent=1))

    if "capacity" in sections:
        result["capacity"] = capacity_section(loaded, int(args.budget_gib * 2**30),
                                                args.page_tokens)
        save()
    if "prefill" in sections:
        prefill_section(loaded, args.prefill, args.prefill_formats.split(","), args.chunk,
                        args.repeats, result.setdefault("prefill", {}), save, kernels,
                        paths=tuple(dict.fromkeys(paths)), page_tokens=args.page_tokens)
    if "decode" in sections:
        decode_section(loaded, args.decode, args.batches, args.decode_formats.split(","),
                       args.steps, args.repeats, result.setdefault("decode", {}), save, kernels,
                       pipelined=args.pipelined, interleave=args.interleave,
                       dots=Path(args.graph_dots) if args.graph_dots else None,
                       page_tokens=args.page_tokens)
    if "quality" in sections:
        docs = heldout_docs(args.quality_root or sysconfig.get_paths()["stdlib"],
                            args.quality_docs, args.quality_tokens, loaded.tokenizer)
        result["quality"] = quality_section(loaded, docs, ["int8", "k8v4", "int4"],
                                            args.quality_chunk)
    save()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
