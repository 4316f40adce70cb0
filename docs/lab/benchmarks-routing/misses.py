"""Where a chat run's later turns lost their cached history, read from its records
(`python -m loadtest chat`, OUT/chat_records.json): per target, the later turns with under half
their history cached that moved to another replica than their previous turn's, and those that
stayed (their holder had evicted it); and, for the prefix-aware target, the cached share of
history had every moved turn hit like a typical one (HIT_SHARE of its history).

    python docs/lab/benchmarks-routing/misses.py OUT [OUT ...]
"""
from __future__ import annotations

import json
import sys

# Conservative: in runs 5-10 a later turn that stayed on its holder and hit there found 94-96 %
# of its history cached.
HIT_SHARE = 0.85


def misses(records: list[dict], target: str) -> dict:
    ok = [r for r in records if r["target"] == target and r["status"] == 200]
    where = {(r["conversation"], r["turn"]): r.get("replica") for r in ok}
    out = {"missed_moved": 0, "missed_stayed": 0, "history": 0, "cached": 0, "if_moved_hit": 0}
    for r in ok:
        if r["turn"] < 2:
            continue
        history, cached = r["history_tokens"] or 0, r["cached_tokens"] or 0
        prev = where.get((r["conversation"], r["turn"] - 1))
        moved = prev is not None and prev != r.get("replica")
        if cached < 0.5 * history:
            out["missed_moved" if moved else "missed_stayed"] += 1
        out["history"] += history
        out["cached"] += cached
        out["if_moved_hit"] += max(cached, HIT_SHARE * history) if moved else cached
    return out


def main(paths: list[str]) -> None:
    for path in paths:
        with open(f"{path}/chat_records.json") as f:
            records = json.load(f)["records"]
        for target in ("prefix", "capacity"):
            m = misses(records, target)
            print(f"{path} {target}: missed moved {m['missed_moved']}, stayed "
                  f"{m['missed_stayed']}; cached share {m['cached'] / m['history']:.3f}, had the "
                  f"moved turns hit {m['if_moved_hit'] / m['history']:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
