"""Print session 12's tables from the raw data beside this file (python summarize.py).

`a`: the tree before the change (stores scatter the step's keys). `b`-`e`: the native decode
kernel writes the step's own keys itself (b, c), then packed decode writes its records in place
too (d, e). Kernels per step and the build / issue / wait split: bench.step_graph. SmolLM2 shape
(bench.engine): paired engine / mlx-lm wall ratios, each process's median and its rounds.
Packed decode (bench.kv): paired ratios to native, median and rounds.
"""
import json
from pathlib import Path

HERE = Path(__file__).parent


def load(name):
    return json.loads((HERE / name).read_text())


def graphs():
    print("## kernels per decode step (CUDA graph nodes) and the synchronous step split, ms")
    for run in ("a", "b"):
        for f in sorted((HERE / run).glob("graph_b*.json")):
            d = load(f"{run}/{f.name}")
            k = d.get("kernels", {})
            nodes = {s: k[s]["nodes_per_step"] for s in ("engine", "mlx_lm") if s in k}
            print(f"{run}/{f.stem} batch {d['batch']}: nodes {nodes}")
            for side, t in d["time_ms"].items():
                if isinstance(t, dict):
                    print(f"    {side:22s} build {t['build']:.2f} issue {t['issue']:.2f} "
                          f"wait {t['wait']:.2f} step {t['step']:.2f}")
            for side in ("engine", "mlx_lm"):
                copies = {n: v for n, v in k.get(side, {}).get("by_kernel", {}).items()
                          if "copy_v" in n or "scatter" in n or "arange" in n}
                if copies:
                    print(f"    {side} copies / scatters / aranges: {copies}")
    for name in ("a/time_ops1000.json", "a/time_nographs.json"):
        t = load(name)["time_ms"]
        print(f"{name}: " + ", ".join(f"{s} step {v['step']:.2f}" for s, v in t.items()
                                      if isinstance(v, dict)))


def engine():
    print("## SmolLM2 shape, engine / mlx-lm (paired wall ratios)")
    for f in sorted(HERE.glob("*/smol_*.json")):
        d = load(f"{f.parent.name}/{f.name}")
        for p in d["decode"]:
            print(f"{f.parent.name}/{f.stem:14s} decode B{p['batch']:<3d} median "
                  f"{p['ratio_wall_median']:.3f} rounds {p['ratios_wall']}")
        for p in d["prefill"]:
            print(f"{f.parent.name}/{f.stem:14s} prefill {p['prompt_tokens']:<5d} median "
                  f"{p['ratio_wall_median']:.3f}")


def checks():
    print("## correctness")
    for name in ("b/check.json", "d/check.json"):
        for p in load(name)["batches"]:
            print(f"{name} {p['kv_format']} B{p['batch']}: logit diff {p['max_abs_logit_diff']}"
                  f", pages diff {p['pages_max_abs_diff']}, greedy equal "
                  f"{p['greedy_tokens_equal']}, step ms {p['step_ms_median']}")
    for c in load("c/check_native.json")["cases"]:
        print(f"c/check_native rows {c['rows']} d{c['head_dim']} keys {c['longest']} splits "
              f"{c['splits']}: err {c['max_abs_err']}, own == plain {c['own_equals_plain']}, "
              f"own pages err {c['own_pages_err']}, ok {c['ok']}")


def packed():
    print("## packed decode / native (bench.kv --pipelined --interleave)")
    for run in ("c", "d", "e"):
        for f in sorted((HERE / run).glob("kv*.json")):
            for point, row in load(f"{run}/{f.name}")["decode"].items():
                for fmt in ("int4", "int8"):
                    r = row[fmt]
                    print(f"{run}/{f.stem:8s} {point} {fmt}: median {r['ratio_paired_median']}"
                          f" rounds {r['ratios_paired']} (native {row['native']['tok_s']} "
                          f"tok/s)")


def mix():
    print("## served mix (bench.decode_mix), per round")
    for i, r in enumerate(load("c/mix.json")["rounds"]):
        for variant, v in r.items():
            print(f"round {i + 1} {variant:8s} wall {v['wall_s']:6.2f} s, {v['tok_s']} tok/s, "
                  f"traces {v['traces']}, TTFT median {v['ttft']['median_ms']} ms, token gap "
                  f"median {v['token_gap']['median_ms']} p99 {v['token_gap']['p99_ms']} ms")


if __name__ == "__main__":
    for table in (graphs, engine, checks, packed, mix):
        table()
        print()
