"""Print session 10's tables from the raw data beside this file (python summarize.py).

SmolLM2 shape (bench.engine): every paired engine / mlx-lm wall ratio of a point, pooled over
the processes of one side (compiled decode, the default on CUDA, or --no-compile), as
median [min-max] n, and each process's own median. Packed decode (bench.kv --interleave):
each run's paired ratios to native and their median. Packed prefill (bench.kv): time / native.
"""
import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent


def points(path: Path):
    """bench.engine points of one process: from its JSON, else from its log's lines."""
    if path.with_suffix(".json").exists():
        d = json.loads(path.with_suffix(".json").read_text())
        return d["prefill"] + d["decode"]
    lines = path.with_suffix(".log").read_text().splitlines()
    return [json.loads(x) for x in lines if x.startswith("{")]


def key(p):
    return f"prefill {p['prompt_tokens']}" if "prompt_tokens" in p else f"decode B{p['batch']}"


def engine_table():
    lost = json.loads((HERE / "a/lost_files_from_log.json").read_text())
    sides = {"compiled": [], "plain": []}
    for run in ("a", "b", "c"):
        for log in sorted((HERE / run).glob("smol*.log")):
            side = "plain" if "plain" in log.stem else "compiled"
            sides[side].append((f"{run}/{log.stem}", points(log)))
    for name, proc in lost.items():
        if isinstance(proc, dict):
            sides["plain" if "plain" in name else "compiled"].append((f"a/{name}", proc["decode"]))
    for side, procs in sides.items():
        print(f"\n## {side}: processes {[n for n, _ in procs]}")
        keys = sorted({key(p) for _, ps in procs for p in ps},
                      key=lambda k: (k.startswith("decode"), int(k.split()[-1].lstrip("B"))))
        for k in keys:
            pooled, meds = [], []
            for _, ps in procs:
                for p in ps:
                    if key(p) == k:
                        pooled += p["ratios_wall"]
                        meds.append(p["ratio_wall_median"])
            print(f"{k:14s} {statistics.median(pooled):.3f} [{min(pooled):.2f}-{max(pooled):.2f}] "
                  f"n={len(pooled)}; process medians {meds}")


def kv_tables():
    print("\n## packed decode, pipelined, --interleave (paired ratios to native; median)")
    for f in sorted(HERE.glob("[bc]/kv*.json")):
        d = json.loads(f.read_text())["decode"]
        for point, row in d.items():
            for fmt, v in row.items():
                if "ratios_paired" in v:
                    print(f"{f.parent.name}/{f.stem:18s} {point} {fmt}: "
                          f"{v['ratio_paired_median']:.3f} {v['ratios_paired']} "
                          f"(native {v and row['native']['tok_s']} tok/s)")
    print("\n## packed prefill, time / native (min of 3 interleaved repeats)")
    for f in sorted(HERE.glob("[bc]/prefill*.json")):
        d = json.loads(f.read_text())["prefill"]
        print(f"{f.parent.name}/{f.stem}: " + "; ".join(
            f"{n} {k.split('-')[0]} {v['ratio_to_native']}" for n, r in d.items()
            for k, v in r.items() if k.endswith("-direct")) +
            f" (native {', '.join(str(r['native']['ttft_s']) for r in d.values())} s)")


def checks():
    print("\n## compiled vs plain decode steps (bench.compiled_check)")
    for f in (HERE / "a/check_smol.json", HERE / "b/check.json"):
        for p in json.loads(f.read_text())["batches"]:
            print(f"{f.parent.name}: {p.get('kv_format', 'native')} B{p['batch']}: max |diff| "
                  f"{p['max_abs_logit_diff']}, greedy equal {p['greedy_tokens_equal']}, traces "
                  f"{p['traces']}, sync step ms {p['step_ms_median']}")


if __name__ == "__main__":
    checks()
    engine_table()
    kv_tables()
