"""Pool bench.engine's paired engine/mlx-lm ratios per variant and point across processes.

    python docs/lab/benchmarks-gpu/session8/summarize.py

Variant = the file name without its trailing run letter/number (fused_a, fused2 -> fused; ops64 and ops200 stay apart).
"""
import json
import re
import statistics
from pathlib import Path

here = Path(__file__).parent
pooled: dict = {}


def add(batch, variant, point, ratios):
    pooled.setdefault((batch, variant, point), []).extend(ratios)


for batch in ("batchA", "batchB1"):
    for f in sorted((here / batch).glob("*.json")):
        if f.name == "lost_files_from_log.json":
            for tag, rec in json.loads(f.read_text()).items():
                if tag == "note":
                    continue
                for b in ("1", "8"):
                    add(batch, re.sub(r"(?<=fused)2$", "", tag), f"decode B{b}", rec[b]["ratios_wall"])
            continue
        d = json.loads(f.read_text())
        variant = re.sub(r"(_[ab]|(?<=fused)2)$", "", f.stem)
        for p in d["prefill"]:
            add(batch, variant, f"prefill {p['prompt_tokens']}", p["ratios_wall"])
        for p in d["decode"]:
            add(batch, variant, f"decode B{p['batch']}", p["ratios_wall"])

for (batch, variant, point), rs in sorted(pooled.items()):
    print(f"{batch:8s} {variant:10s} {point:13s} n={len(rs):2d} median {statistics.median(rs):.3f} "
          f"[{min(rs):.2f}-{max(rs):.2f}]")
