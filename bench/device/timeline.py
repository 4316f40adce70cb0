"""What a served run's streams were doing over time, from a bench-serve records.json: per time
slice, how many streams were decoding (first chunk seen, last not yet), how many were waiting for
their first token, and how many chunks arrived per second. Shows where a saturated run stalls
(prefill holding decode back, a queue waiting on releases) without any server-side trace.

    python -m bench.device.timeline RECORDS.json [--slice 0.5] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys


def streams(records: list[dict]) -> list[tuple[float, float, list[float]]]:
    """(sent, first chunk, chunk arrival times) per answered request, in seconds from send."""
    out = []
    for r in records:
        chunks = r.get("chunk_times") or []
        if chunks:
            out.append((r["sent"], r["sent"] + chunks[0], [r["sent"] + c for c in chunks]))
    return out


def timeline(records: list[dict], slice_s: float = 0.5) -> list[dict]:
    ss = streams(records)
    if not ss:
        return []
    end = max(c[-1] for _, _, c in ss)
    rows, t = [], 0.0
    while t <= end:
        rows.append({
            "t": round(t, 3),
            "decoding": sum(1 for _, first, c in ss if first <= t < c[-1]),
            "waiting_first": sum(1 for sent, first, _ in ss if sent <= t < first),
            "chunks_per_s": round(sum(1 for _, _, c in ss for x in c if t <= x < t + slice_s)
                                  / slice_s, 1)})
        t += slice_s
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.device.timeline",
                                description=__doc__.split("\n")[0])
    p.add_argument("records", help="records.json written by `python -m loadtest bench-serve`")
    p.add_argument("--slice", type=float, default=0.5, help="seconds per row (default 0.5)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    if args.slice <= 0:
        p.error("--slice must be positive")
    with open(args.records) as f:
        data = json.load(f)
    rows = timeline(data["records"] if isinstance(data, dict) else data, args.slice)
    if args.json:
        print(json.dumps(rows))
    else:
        print("t_s\tdecoding\twaiting_first\tchunks_per_s")
        for r in rows:
            print(f"{r['t']}\t{r['decoding']}\t{r['waiting_first']}\t{r['chunks_per_s']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
