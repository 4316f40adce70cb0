"""Summarize session 7's device batches: per side (old/new), per point, the median of all
paired engine/mlx-lm wall ratios pooled over that side's processes, and each process's median."""
import json
import statistics
import sys

for path in sys.argv[1:]:
    rows = [json.loads(line) for line in open(path)]
    print(f"## {path}")
    for kind, key in (("prefill", "prompt_tokens"), ("decode", "batch")):
        points = sorted({p[key] for r in rows for p in r["result"].get(kind, [])
                         if "ratios_wall" in p})
        for pt in points:
            line = [f"{kind} {pt}"]
            for side in ("old", "new"):
                pooled, per_proc, tok = [], [], []
                for r in rows:
                    if r["side"] != side:
                        continue
                    for p in r["result"].get(kind, []):
                        if p[key] == pt and "ratios_wall" in p:
                            pooled += p["ratios_wall"]
                            per_proc.append(p["ratio_wall_median"])
                            tok += p["samples"]["engine"]["wall"]
                if pooled:
                    line.append(f"{side}: pooled median {statistics.median(pooled):.3f} "
                                f"(n={len(pooled)}), per process {per_proc}, engine tok/s "
                                f"median {statistics.median(tok):.1f}")
            print("  " + " | ".join(line))
