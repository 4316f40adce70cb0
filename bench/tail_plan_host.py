"""Host time of a compiled page-key decode step's tail planning (engine/kv/tails.py), per step.

    python -m bench.tail_plan_host [--rows 1,8,32] [--steps 3000] [--out F]

Why: at 4K tokens, batch 1, the page-key decode step is host-bound on the GPU (device run 11:
build + issue 0.94 ms against native's 0.78), and every compiled page-key step plans its rows'
tail slots on the host first (`TailMap.state` and `decode_slots`, CompiledDecode.forward). This
times that planning through both of `TailMap.plan`'s paths in one process, interleaved: numpy
arrays (`SMALL_WRITE` 0, every write as before 2026-12-06) and Python ids (the default for writes
of up to SMALL_WRITE rows), rows decoding through 16-token pages (fills, new pages). Prints JSON:
microseconds per step, median of 5 rounds, and the ratio.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from engine.kv import tails as tails_module

PAGE_TOKENS = 16


def time_steps(rows: int, steps: int, small_write: int) -> float:
    """Microseconds per decode step of `rows` sequences (state + decode_slots)."""
    tails_module.SMALL_WRITE, saved = small_write, tails_module.SMALL_WRITE
    try:
        tm = tails_module.TailMap(rows + 4, PAGE_TOKENS)
        base = np.arange(rows, dtype=np.int64) * 1_000_000
        t0 = time.perf_counter()
        for pos in range(steps):
            page, offset = base + pos // PAGE_TOKENS, np.full(rows, pos % PAGE_TOKENS)
            tm.state()
            tm.decode_slots(page, offset)
        return (time.perf_counter() - t0) / steps * 1e6
    finally:
        tails_module.SMALL_WRITE = saved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32", help="batch sizes, comma-separated")
    ap.add_argument("--steps", type=int, default=3000, help="decode steps a round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    result = {"page_tokens": PAGE_TOKENS, "steps": args.steps, "rounds": args.rounds,
              "rows": {}}
    for rows in [int(r) for r in args.rows.split(",")]:
        numpy_us, python_us = [], []
        time_steps(rows, args.steps, 0)   # warm-up: numpy's first calls are slow
        for _ in range(args.rounds):   # interleaved: both paths see the same machine state
            numpy_us.append(time_steps(rows, args.steps, 0))
            python_us.append(time_steps(rows, args.steps, tails_module.SMALL_WRITE))
        a, b = statistics.median(numpy_us), statistics.median(python_us)
        result["rows"][rows] = {"numpy_us": round(a, 2), "python_ids_us": round(b, 2),
                                "saved_us": round(a - b, 2), "ratio": round(a / b, 2)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
