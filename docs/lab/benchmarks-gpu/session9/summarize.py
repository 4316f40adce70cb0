"""Print the session 9 tables of docs/lab/benchmarks-gpu.md from the raw JSON beside this file.

    python docs/lab/benchmarks-gpu/session9/summarize.py
"""
import glob
import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent


def load(rel):
    return json.loads((HERE / rel).read_text())


def decode_ratios(rel):
    d = load(rel)["decode"]
    return {pt: (row["native"]["tok_s"], row["int4"].get("ratio_to_native"),
                 row["int8"].get("ratio_to_native")) for pt, row in d.items()}


def prefill_ratios(rel):
    d = load(rel).get("prefill", {})
    return {n: {f: r["ratio_to_native"] for f, r in row.items() if f.endswith("direct")}
            for n, row in d.items()}


def main():
    print("## decode, pool layout (native tok/s, int4, int8 ratio to native)")
    for rel in ["e1/kv_decode_pipelined.json", "e1/kv_decode_sync.json",
                "e2/kv_decode_pipelined2.json", "e2/kv_decode_pipelined_b1.json",
                "e4/decode_new_1.json", "e4/decode_new_2.json"]:
        print(rel, decode_ratios(rel))
    print("## decode, six-array layout (e209949) in the same machine as e4's new runs")
    for rel in ["e4/decode_old_1.json", "e4/decode_old_2.json"]:
        print(rel, decode_ratios(rel))
    print("## decode split minimum (e3; mk256 is the default)")
    for rel in sorted(glob.glob(str(HERE / "e3" / "*.json"))):
        d = json.loads(Path(rel).read_text())
        print(Path(rel).name, {pt: v[1] for pt, v in decode_ratios(Path(rel).relative_to(HERE)).items()})
    print("## prefill, direct path, time ratio to native")
    for rel in ["e1/kv_prefill.json", "e4/prefill_old_1.json", "e4/prefill_new_1.json",
                "e4/prefill_old_2.json", "e4/prefill_new_2.json", "e5/prefill_old_1.json",
                "e5/prefill_new_2.json", "e5/prefill_old_2.json"]:
        print(rel, prefill_ratios(rel))
    print("## SmolLM2-shaped engine vs mlx-lm (median of 5 paired wall ratios; all ratios)")
    for rel in ["e2/engine_a.json", "e2/engine_b.json", "e2/engine_c.json"]:
        d = load(rel)
        rows = {}
        for r in d.get("prefill", []) + d.get("decode", []):
            key = f"prefill {r['prompt_tokens']}" if "prompt_tokens" in r else f"B{r['batch']}"
            rows[key] = (r.get("ratio_wall_median"), r.get("ratios_wall"))
        print(rel, rows)
    print("## pooled SmolLM2 medians over e2's three runs")
    pooled = {}
    for rel in ["e2/engine_a.json", "e2/engine_b.json", "e2/engine_c.json"]:
        d = load(rel)
        for r in d.get("prefill", []) + d.get("decode", []):
            key = f"prefill {r['prompt_tokens']}" if "prompt_tokens" in r else f"B{r['batch']}"
            pooled.setdefault(key, []).extend(r.get("ratios_wall") or [])
    print({k: (round(statistics.median(v), 3), min(v), max(v), len(v)) for k, v in pooled.items()})


if __name__ == "__main__":
    main()
