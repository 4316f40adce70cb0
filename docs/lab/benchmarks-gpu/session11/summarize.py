"""Print session 11's tables from the raw data beside this file (python summarize.py).

Packed prefill (bench.kv): time / native per path, min of 3 interleaved repeats; in `a` the
default path was the tile kernel ("direct") and the dequant path ran as "-dequant", from `b` on
the default is the dequant path ("direct") and the tile kernel runs as "-tiles". SmolLM2 shape
(bench.engine, compiled decode): paired engine / mlx-lm wall ratios pooled over processes,
median [min-max] n, and each process's median. Packed decode: paired ratios to native.
"""
import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent


def prefill_table():
    print("## packed prefill, time / native: dequant path | tile kernel")
    paths = {"dequant": [], "tiles": []}
    for f in sorted(HERE.glob("*/prefill*.json")):
        d = json.loads(f.read_text())
        default = d["env"].get("prefill_path", "tiles")
        for n, row in d["prefill"].items():
            for fmt in ("int8", "int4"):
                got = {default: row[f"{fmt}-direct"]["ratio_to_native"]}
                for path in paths:
                    if f"{fmt}-{path}" in row:
                        got[path] = row[f"{fmt}-{path}"]["ratio_to_native"]
                for path, r in got.items():
                    paths[path].append((n, fmt, r))
                print(f"{f.parent.name}/{f.stem:10s} {n:>5s} {fmt}: dequant {got['dequant']:.3f}"
                      f" | tiles {got['tiles']:.3f}  (native {row['native']['ttft_s']} s)")
    for path, rows in paths.items():
        for n in ("4096", "16384"):
            for fmt in ("int8", "int4"):
                rs = [r for m, f, r in rows if m == n and f == fmt]
                print(f"{path:8s} {n:>5s} {fmt}: {min(rs):.3f}-{max(rs):.3f} over {len(rs)} runs")


def engine_table():
    procs = [(f"{f.parent.name}/{f.stem}", json.loads(f.read_text()))
             for f in sorted(HERE.glob("*/smol_*.json"))]
    print(f"\n## SmolLM2 shape, engine / mlx-lm: processes {[n for n, _ in procs]}")
    pts = {}
    for _, d in procs:
        for p in d["prefill"] + d["decode"]:
            k = f"prefill {p['prompt_tokens']}" if "prompt_tokens" in p else f"decode B{p['batch']}"
            pts.setdefault(k, []).append(p)
    for k, ps in pts.items():
        pooled = [r for p in ps for r in p["ratios_wall"]]
        print(f"{k:14s} {statistics.median(pooled):.3f} [{min(pooled):.2f}-{max(pooled):.2f}] "
              f"n={len(pooled)}; process medians {[p['ratio_wall_median'] for p in ps]}")


def kv_table():
    print("\n## packed decode, pipelined, --interleave (paired ratios to native; median)")
    for f in sorted(HERE.glob("*/kv*.json")):
        for point, row in json.loads(f.read_text())["decode"].items():
            for fmt, v in row.items():
                if "ratios_paired" in v:
                    print(f"{f.parent.name}/{f.stem} {point} {fmt}: {v['ratio_paired_median']:.3f}"
                          f" {v['ratios_paired']} (native {row['native']['tok_s']} tok/s)")


def checks():
    d = json.loads((HERE / "a/check.json").read_text())
    bad = [c for c in d["cases"] if not c["ok"]]
    print(f"## device check: {len(d['cases'])} cases, {len(bad)} failed, largest error "
          f"{max(c['max_abs_err'] for c in d['cases'])}")
    print("\n## compiled vs plain decode steps: first step ms (trace), sync step ms")
    for p in [*json.loads((HERE / "a/compiled.json").read_text())["batches"],
              *json.loads((HERE / "e/padded.json").read_text())["batches"]]:
        print(f"{p['kv_format']} B{p['batch']}: |diff| {p['max_abs_logit_diff']}, equal "
              f"{p['greedy_tokens_equal']}, first {p['first_step_ms']}, step {p['step_ms_median']}")


if __name__ == "__main__":
    checks()
    prefill_table()
    engine_table()
    kv_table()
