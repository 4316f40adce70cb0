"""Count a CUDA kernel's machine instructions per pass of its main loop (static; no GPU).

    python -m bench.cuda_sass_loops --only "page-key d128 k6 pt16 g4 split=True" \
        --only "native-tiled d128 pt16 g4 split=True own=True" [--out F]

Why: the decode kernels are bound by the instructions they issue per key as much as by the
bytes they read (docs/lab/benchmarks-kv-page-keys.md: the page-key kernel read 0.375x native's
bytes and took 1.24x its time), and device time is scarce. This compiles each named variant of
`bench.cuda_nvcc_check` with the local nvcc, disassembles it (cuobjdump, which needs nvdisasm:
the PyPI wheels `nvidia-cuda-cuobjdump` and `nvidia-cuda-nvdisasm` carry both), finds the
tile loop (`main_loop`) and prints, as JSON, its instruction
count, the instructions of each stretch between block barriers (`BAR.SYNC`: the tile's copy
issue, score pass, softmax and P.V) and the opcodes they are made of. Static counts: a loop
body's instructions per pass, not cycles; the device says what they cost. Exit 2 without
nvcc or cuobjdump.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from bench.cuda_nvcc_check import variants, wheel_files

LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")
BARRIERS = ("BAR.SYNC", "BAR.ARV", "BAR.RED")


def find_cuobjdump() -> str | None:
    """cuobjdump on PATH, or from the nvidia-cuda-cuobjdump wheel (its nvdisasm beside it, or
    nvidia-cuda-nvdisasm's, put on PATH for it)."""
    found = shutil.which("cuobjdump") or next(map(str, wheel_files("*/bin/cuobjdump")), None)
    for nvdisasm in wheel_files("*/bin/nvdisasm"):
        os.environ["PATH"] = f"{nvdisasm.parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return found if found and shutil.which("nvdisasm") else None


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text) of every instruction in cuobjdump's SASS listing."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(LINE.match, sass.splitlines()) if m]


def opcode(text: str) -> str:
    """The instruction's opcode without its predicate and modifiers (`@!P0 LDG.E.64` -> LDG)."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def main_loop(ins: list[tuple[int, str]]) -> tuple[int, int] | None:
    """Index range [first, last] of the tile loop: the shortest loop (a backward branch and its
    target) that prefetches (`LDGSTS`: cp.async) and holds two block barriers; without one, the
    longest loop. (A code region the compiler laid out around the tile loop, with a backward
    branch of its own, would otherwise be taken for it.)"""
    index = {a: i for i, (a, _) in enumerate(ins)}
    loops = [(index[int(m.group(1), 16)], i) for i, (a, t) in enumerate(ins)
             if (m := BRANCH.search(t)) and int(m.group(1), 16) < a
             and int(m.group(1), 16) in index]

    def tiles(span):
        body = [t for _, t in ins[span[0]:span[1] + 1]]
        return (any(opcode(t) == "LDGSTS" for t in body)
                and sum(any(b in t for b in BARRIERS) for t in body) >= 2)
    tiled = [r for r in loops if tiles(r)]
    if tiled:
        return min(tiled, key=lambda r: r[1] - r[0])
    return max(loops, key=lambda r: r[1] - r[0], default=None)


def summary(body: list[tuple[int, str]], top: int = 8) -> dict:
    ops = Counter(opcode(t) for _, t in body)
    return {"instructions": len(body), "from": hex(body[0][0]) if body else None,
            "opcodes": dict(ops.most_common(top))}


def loop_report(ins: list[tuple[int, str]]) -> dict:
    """The kernel's instruction count, and its longest loop's, split at block barriers."""
    span = main_loop(ins)
    out = {"instructions": len(ins)}
    if span is None:
        return out
    body = ins[span[0]:span[1] + 1]
    segments, seg = [], []
    for a, t in body:
        seg.append((a, t))
        if any(b in t for b in BARRIERS):
            segments.append(summary(seg))
            seg = []
    if seg:
        segments.append(summary(seg))
    out["loop"] = {**summary(body, 14), "between_barriers": segments}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", required=True,
                    help="an exact variant label of bench.cuda_nvcc_check (repeatable)")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    nvcc, cuobjdump = shutil.which("nvcc"), find_cuobjdump()
    if nvcc is None or cuobjdump is None:
        print("needs nvcc and cuobjdump with nvdisasm (pip install nvidia-cuda-cuobjdump "
              "nvidia-cuda-nvdisasm)", file=sys.stderr)
        return 2
    wanted, report = set(args.only), {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, src) in enumerate(variants()):
            if label not in wanted:
                continue
            cu = Path(tmp) / f"k{i}.cu"
            cu.write_text(src)
            subprocess.run([nvcc, f"-arch={args.arch}", "-std=c++17", "-cubin", "-o",
                            str(cu.with_suffix(".cubin")), str(cu)], check=True)
            sass = subprocess.run([cuobjdump, "-sass", str(cu.with_suffix(".cubin"))],
                                  check=True, capture_output=True, text=True).stdout
            report[label] = loop_report(instructions(sass))
            print(f"[sass] {label}: loop {report[label].get('loop', {}).get('instructions')}",
                  file=sys.stderr)
    missing = wanted - set(report)
    if missing:
        print(f"no such variant: {sorted(missing)}", file=sys.stderr)
        return 1
    text = json.dumps({"arch": args.arch, "variants": report}, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
