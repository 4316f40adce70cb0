"""Run a CUDA kernel's source on the CPU, one fiber per GPU thread (a developer's check).

    python -m bench.cuda_emulate            # the tiled packed decode kernel's check cases
    python -m bench.cuda_emulate --version v1   # the same cases through the v1 kernel

Device time is scarce, and `bench.cuda_nvcc_check` only proves a kernel compiles. This compiles
the same kernel body with g++ instead: every GPU thread of a block becomes a fiber (ucontext)
of one OS thread; `__syncthreads`, `__syncwarp` and warp shuffles are barriers among the fibers
(a shuffle: every lane posts its value, then reads its partner's), `__shared__` arrays are one
static copy (blocks run one after another), and `cp.async` copies are queued per thread and
done at its `cp.async.wait_group` (so reading a tile before waiting for it reads stale data,
as it could on the GPU; a copy whose addresses are not aligned to its size stops the run, as it
would fault there). It does not model timing, memory ordering beyond barriers, bank
conflicts or the GPU's approximate `__expf`; it does check indexing, tiling, the split plan,
barrier placement and the arithmetic, on the real source text. Exit 1 if a case fails.
"""
from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.cuda_emulate_runtime import ASYNC_CPU, MAIN, MMA_CPU, PRELUDE
from bench.cuda_nvcc_check import template_constants

CPP_TYPES = {"float32": "float", "bfloat16": "__nv_bfloat16", "uint32": "uint32_t",
             "int32": "int32_t"}
NP_TYPES = {"float32": np.float32, "bfloat16": np.uint16, "uint32": np.uint32,
            "int32": np.int32}


def build(name: str, inputs: list[tuple[str, str]], outputs: list[tuple[str, str]], source: str,
          helpers: str, template: list[tuple[str, object]], writes: tuple[int, ...] = ()) -> str:
    """A C++ program that runs kernel `source` over a grid (argv: dir, blocks x, blocks y,
    threads) on inputs in_<i>.bin and outputs out_<i>.bin of that dir (outputs updated, and
    the inputs numbered in `writes`: a kernel that writes an input in place)."""
    consts = template_constants(template, CPP_TYPES)
    params = [f"const {CPP_TYPES[t]}* {n}" for n, t in inputs]
    params += [f"{CPP_TYPES[t]}* {n}" for n, t in outputs]
    load = [f"static std::vector<char> b_in{i} = read_file(dir, \"in_{i}.bin\");"
            for i in range(len(inputs))]
    load += [f"static std::vector<char> b_out{i} = read_file(dir, \"out_{i}.bin\");"
             for i in range(len(outputs))]
    load += [f"static const {CPP_TYPES[t]}* p_{n} = (const {CPP_TYPES[t]}*)b_in{i}.data();"
             for i, (n, t) in enumerate(inputs)]
    load += [f"static {CPP_TYPES[t]}* p_{n} = ({CPP_TYPES[t]}*)b_out{i}.data();"
             for i, (n, t) in enumerate(outputs)]
    call = f"{name}(" + ", ".join(f"p_{n}" for n, _ in inputs + outputs) + ");"
    save = [f'{{ char p[4096]; std::snprintf(p, sizeof p, "%s/{f}_{i}.bin", dir); '
            f'FILE* f = std::fopen(p, "wb"); std::fwrite(b_{f}{i}.data(), 1, '
            f'b_{f}{i}.size() - 16, f); std::fclose(f); }}'
            for f, i in [("out", i) for i in range(len(outputs))] + [("in", i) for i in writes]]
    kernel = (f"void {name}(" + ", ".join(params) + ") {\n" + "\n".join(consts) + "\n"
              + source + "\n}\n")
    return (PRELUDE + ASYNC_CPU + MMA_CPU + helpers + kernel
            + MAIN.replace("LOAD", "\n  ".join(load)).replace("CALL", call)
            .replace("SAVE", "\n  ".join(save)))


_BUILT: dict[str, Path] = {}


def run(name, inputs, outputs, source, helpers, template, arrays, out_shapes, grid, threads,
        workdir: Path, writes: tuple[int, ...] = ()) -> list[np.ndarray]:
    """Compile (cached by source) and run; `arrays` numpy inputs in `inputs` order (bfloat16
    as uint16 bit patterns); returns the outputs, NaN-initialised before the run, then the
    inputs numbered in `writes` as the kernel left them."""
    program = build(name, inputs, outputs, source, helpers, template, writes)
    key = hashlib.sha256(program.encode()).hexdigest()[:16]
    exe = _BUILT.get(key)
    if exe is None or not exe.exists():
        src = workdir / f"k{key}.cpp"
        src.write_text(program)
        exe = workdir / f"k{key}"
        subprocess.run(["g++", "-std=c++20", "-O2", "-w", "-o", str(exe), str(src)], check=True)
        _BUILT[key] = exe
    case = Path(tempfile.mkdtemp(dir=workdir))
    for i, ((_, t), a) in enumerate(zip(inputs, arrays)):
        np.ascontiguousarray(a, NP_TYPES[t]).tofile(case / f"in_{i}.bin")
    for i, ((_, t), shape) in enumerate(zip(outputs, out_shapes)):
        fill = np.full(shape, np.nan, np.float32)
        if t == "bfloat16":
            fill = (fill.view(np.uint32) >> 16).astype(np.uint16)
        elif t != "float32":   # integers: the NaN's bits (a word the kernel never wrote shows)
            fill = fill.view(np.uint32).astype(NP_TYPES[t])
        fill.tofile(case / f"out_{i}.bin")
    subprocess.run([str(exe), str(case), str(grid[0]), str(grid[1]), str(threads)], check=True)
    got = []
    for i, ((_, t), shape) in enumerate(zip(outputs, out_shapes)):
        raw = np.fromfile(case / f"out_{i}.bin", NP_TYPES[t]).reshape(shape)
        got.append((raw.astype(np.uint32) << 16).view(np.float32) if t == "bfloat16" else raw)
    for i in writes:
        (_, t), shape = inputs[i], np.shape(arrays[i])
        raw = np.fromfile(case / f"in_{i}.bin", NP_TYPES[t]).reshape(shape)
        got.append((raw.astype(np.uint32) << 16).view(np.float32) if t == "bfloat16" else raw)
    shutil.rmtree(case)
    return got


def _bits16(x) -> np.ndarray:
    import mlx.core as mx
    return np.array(x.astype(mx.bfloat16).view(mx.uint16))


def packed_decode(q, k_new, v_new, pool, layout, bits, tables, ends, scale,
                  target_blocks=None, workdir: Path | None = None,
                  version: str = "v2", own: bool = False):
    """A packed decode kernel (`version` "v2": cuda/packed_decode_v2_source.py, "v1":
    cuda/packed_decode.py) and, with several splits, the merge kernel (cuda/paged_decode.py),
    run here with the split plan its host side picks; packed_case's kernel signature (history:
    the layer's uint32 pool and its PageLayout, checked as the host side checks it). Returns
    [B, Hq, 1, D] float32 (from the bf16 output); `own` (v2's variant that stores the own rows
    into the pool): (that, the pool as the kernel left it)."""
    from engine.attention.cuda import packed_decode as v1
    from engine.attention.cuda import packed_decode_v2_source as v2
    from engine.attention.cuda import packed_write as pw
    from engine.attention.cuda import tile_helpers
    from engine.attention.cuda import paged_decode as pd
    from engine.attention.cuda.packed_decode_v2 import TARGET_BLOCKS, _signs
    from engine.kv.rotation import rotate
    workdir = workdir or Path(tempfile.mkdtemp(prefix="orchard_emulate_"))
    rows, hq, _, d = q.shape
    kvh = k_new.shape[1]
    tile_helpers.check_pool(pool, layout, d, bits, bits, kvh, vectors=version == "v2")
    tables, ends = np.asarray(tables, np.int32), np.asarray(ends, np.int32)
    fresh = [("kf", "bfloat16"), ("vf", "bfloat16"), ("pool", "uint32"), ("pages", "int32"),
             ("ends", "int32"), ("dims", "int32"), ("scale", "float32")]
    arrays = [_bits16(k_new), _bits16(v_new), np.array(pool), tables, ends,
              np.array([hq, kvh, tables.shape[1]], np.int32), np.array([scale], np.float32)]
    if version == "v2":
        name, source, helpers = "orchard_packed_decode_v2", v2._SOURCE, tile_helpers.HELPERS
        inputs = [("q", "bfloat16"), *fresh, ("signs", "float32")]
        arrays = [_bits16(q), *arrays, np.array(_signs(d))]
        target_blocks = target_blocks or TARGET_BLOCKS
    else:   # v1 takes the rotated query as an input
        name, source, helpers = "orchard_packed_decode", v1._SOURCE, ""
        inputs = [("q", "bfloat16"), ("qr", "float32"), *fresh]
        arrays = [_bits16(q), np.array(rotate(q)), *arrays]
    splits = pd.split_count(rows, kvh, int(ends.max()), target_blocks)
    parts = rows * hq * (splits if splits > 1 else 1)
    template = [("D", d), ("G", hq // kvh), ("PT", layout.page_tokens), ("HK", layout.heads),
                ("KB", bits), ("TQ", "bfloat16"), ("TK", "bfloat16"), ("SPLIT", splits > 1),
                ("TO", "bfloat16")]
    if version == "v2":
        template, helpers = template + [("OWN", own)], helpers + pw.QUANTIZE
    elif own:
        raise ValueError("only the v2 kernel stores own rows")
    outputs = [("out", "bfloat16"), ("part", "float32"), ("ml", "float32")]
    out, part, ml, *written = run(
        name, inputs, outputs, source, helpers, template, arrays,
        [(rows, hq, 1, d), (parts, d), (parts, 2)], (rows * kvh, splits), pd.THREADS, workdir,
        writes=(3,) if own else ())   # the pool: after q, kf, vf
    if splits == 1:
        return (out, *written) if own else out
    merged = merge(part, ml, splits, (rows, hq, 1, d), "bfloat16", workdir)
    return (merged, *written) if own else merged


def merge(part, ml, splits, shape, out_type, workdir: Path) -> np.ndarray:
    """The split decode kernels' merge kernel (cuda/paged_decode.py) run here: their partials
    `part` and `ml` over `splits` splits to the output `shape` [B, Hq, 1, D] (of `out_type`)."""
    from engine.attention.cuda import paged_decode as pd
    rows, hq, _, d = shape
    (merged,) = run("orchard_decode_merge", [("part", "float32"), ("ml", "float32"),
                                             ("dims", "int32")], [("out", out_type)],
                    pd._MERGE, "", [("D", d), ("TO", out_type)],
                    [part, ml, np.array([splits], np.int32)], [shape], (rows * hq, 1), d, workdir)
    return merged


def packed_write(k, v, k_bits, v_bits, layout, workdir: Path | None = None):
    """The write kernel (cuda/packed_write.py) run here: rows [N, H, D] (bf16) to their pool
    records [N, layout.record_words] uint32, quantize_record's signature and launch."""
    import mlx.core as mx

    from engine.attention.cuda import packed_write as pw
    workdir = workdir or Path(tempfile.mkdtemp(prefix="orchard_emulate_"))
    n, h, d = k.shape
    blocks = -(-2 * n * h // pw.WARPS)
    (rec,) = run("orchard_packed_write", [("k", "bfloat16"), ("v", "bfloat16"),
                                          ("signs", "float32"), ("dims", "int32")],
                 [("rec", "uint32")], pw.source(False), pw.QUANTIZE,   # the prelude: HEADER
                 [("D", d), ("KB", k_bits), ("VB", v_bits), ("TI", "bfloat16")],
                 [_bits16(k), _bits16(v), np.array(pw._signs(d)), np.array([n, h], np.int32)],
                 [(n, layout.record_words)], (blocks, 1), pw.WARPS * 32, workdir)
    return mx.array(rec)


def packed_dequant(k_fresh, v_fresh, pool, layout, k_bits, v_bits, pages, bounds, span,
                   workdir: Path | None = None):
    """The history-dequant kernel (cuda/packed_dequant.py) run here with
    `dequantized_history`'s signature and launch; returns keys and values [B, Hkv, span + W, D]
    as bfloat16 mx arrays (as the kernel's outputs are)."""
    import mlx.core as mx
    from engine.attention.cuda import packed_dequant as pq
    workdir = workdir or Path(tempfile.mkdtemp(prefix="orchard_emulate_"))
    b, hkv, w, d = k_fresh.shape
    pages, bounds = np.asarray(pages, np.int32), np.asarray(bounds, np.int32)
    units = b * hkv * (span + w) * (d // 8)
    types = {"TO": "bfloat16"}
    return tuple(mx.array(a).astype(mx.bfloat16) for a in run(
        "orchard_packed_dequant", [(n, types.get(t, t)) for n, t in pq.INPUTS],
        [(n, types.get(t, t)) for n, t in pq.OUTPUTS], pq._SOURCE, "",
        [*pq.template(layout, k_bits, v_bits), ("TO", "bfloat16")],
        [_bits16(k_fresh), _bits16(v_fresh), np.array(pool), pages, bounds,
         np.array([b, hkv, span, w, pages.shape[1]], np.int32)],
        [(b, hkv, span + w, d)] * 2, (-(-units // pq.THREADS), 1), pq.THREADS, workdir))


def packed_decode_v2(*args, **kwargs) -> np.ndarray:
    """`packed_decode` of the tiled kernel."""
    return packed_decode(*args, **kwargs, version="v2")


# (fmt, rows, hq, kvh, head dim, longest, page tokens, split target): the device check's v2
# shapes, shorter (the emulator runs ~1e5 keys a second).
CASES = [(f, *c) for f in ("int8", "int4") for c in (
    (1, 16, 4, 128, 1, 16, None), (1, 9, 3, 64, 300, 16, None), (3, 16, 4, 128, 700, 16, None),
    (2, 16, 4, 128, 1500, 16, 1), (3, 4, 4, 128, 200, 16, None), (2, 16, 2, 128, 300, 16, None),
    (2, 8, 1, 64, 400, 64, None), (3, 14, 2, 64, 500, 16, None), (1, 16, 4, 128, 65, 16, None),
    (1, 16, 4, 128, 66, 16, None), (1, 16, 4, 128, 33, 16, None),
    (1, 16, 4, 128, 1200, 64, 4096))]


def run_cases(cases, check) -> int:
    """Each case's `check(rng, work, *case)` (a dict with "ok"), printed as it lands; one rng and
    work folder for all. Exit status: 1 if a case failed, 2 without g++."""
    if shutil.which("g++") is None:
        print("no g++ on PATH", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    work = Path(tempfile.mkdtemp(prefix="orchard_emulate_"))
    failed = 0
    for args in cases:
        case = check(rng, work, *args)
        print(("ok  " if case["ok"] else "FAIL"), case, flush=True)
        failed += not case["ok"]
    shutil.rmtree(work)
    return 1 if failed else 0


def main(argv=None) -> int:
    from bench import cuda_check
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=len(CASES), help="run the first N cases")
    ap.add_argument("--version", choices=("v1", "v2"), default="v2",
                    help="packed decode kernel to run (default: the tiled v2)")
    args = ap.parse_args(argv)

    def check(rng, work, fmt, rows, hq, kvh, d, longest, pt, target):
        def kernel(*a):
            return packed_decode(*a, target_blocks=target, workdir=work, version=args.version)
        return cuda_check.packed_case(rng, fmt, rows, hq, kvh, d, longest, page_tokens=pt,
                                      kernel=kernel, version=args.version, target_blocks=target)
    return run_cases(CASES[:args.limit], check)


if __name__ == "__main__":
    raise SystemExit(main())
