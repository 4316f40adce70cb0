"""Markdown for the quality gate's result (docs/quality.md): what ran, verdicts, details."""
from __future__ import annotations

import json

from quality.stats import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED


def _ci(d: dict, fmt: str = "{:+.3f}", scale: float = 1.0) -> str:
    lo, hi = d["ci95"]
    return (f"{fmt.format(d['estimate'] * scale)} "
            f"[{fmt.format(lo * scale)}, {fmt.format(hi * scale)}]")


def _kl(d: dict) -> str:
    lo, hi = d["ci95"]
    return f"{d['estimate']:.2e} [{lo:.2e}, {hi:.2e}]"


def _acc(d: dict | None) -> str:
    if not d:
        return "-"
    dp = d["delta_points"]
    return f"{100 * d['accuracy']:.1f} ({dp['estimate']:+.1f} [{dp['ci95'][0]:+.1f}, {dp['ci95'][1]:+.1f}])"


def table(r: dict) -> str:
    lengths = [str(L) for L in r["sizes"]["lengths"]]
    head = ["format", "NLL delta % [95% CI]", "KL nats/token [95% CI]", "top-1 agreement",
            *[f"retrieval@{L} % (delta pts [CI])" for L in lengths], "probes % (delta pts [CI])",
            "verdict"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for fmt in r["formats"]:
        n = r["nll"].get(fmt)
        ret = r["retrieval"].get(fmt, {}).get("by_length", {})
        v = r["verdicts"].get(fmt)
        verdict = "control" if fmt == "native" else v["overall"]
        cells = [fmt,
                 _ci(n["nll_delta_pct"]) if n else "-",
                 _kl(n["kl"]) if n else "-",
                 _ci(n["top1_agreement"], "{:.4f}") if n else "-",
                 *[_acc(ret.get(L)) for L in lengths],
                 _acc(r["probes"].get("by_format", {}).get(fmt)), f"**{verdict}**"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def floor_table(r: dict) -> str:
    """The noise floor (quality.verdicts.summarize_floor) and each format's excess over it."""
    f = r.get("floor")
    if not f or "floor" not in f:
        return ""
    cd, rd, fl = f["compute_dtype"], f["reference_dtype"], f["floor"]
    rows = [f"Noise floor: native {cd} against native {rd} (same weights, same windows): KL "
            f"{_kl(fl['kl'])}, NLL delta {_ci(fl['nll_delta_pct'])} %, top-1 "
            f"{_ci(fl['top1_agreement'], '{:.4f}')}.", "",
            f"| format | KL to {rd} | KL / floor | KL over floor [95% CI] | "
            f"NLL delta to {rd} % | NLL over floor % [95% CI] | judged (margin: headroom) |",
            "|---|---|---|---|---|---|---|"]
    for fmt, d in f["formats"].items():
        ratio = d["kl_ratio_to_floor"]
        judged = "; ".join(f"{m} {v['margin']:g}: {v['headroom']:+.3g}"
                           for m, v in d["margins"].items()) or "-"
        rows.append(f"| {fmt} | {_kl(d['kl_to_reference'])} | "
                    f"{'-' if ratio is None else f'{ratio:.2f}'} | {_kl(d['excess']['kl'])} | "
                    f"{_ci(d['nll_delta_pct_to_reference'])} | {_ci(d['excess']['nll_delta_pct'])} "
                    f"| {judged} |")
    return "\n".join(rows)


def checks(r: dict) -> str:
    rows = ["| format | check | estimate | 95% CI | verdict |", "|---|---|---|---|---|"]
    for fmt, v in r["verdicts"].items():
        for c in v["checks"]:
            rows.append(f"| {fmt} | {c['check']} | {c['estimate']:.4g} | "
                        f"[{c['ci95'][0]:.4g}, {c['ci95'][1]:.4g}] | {c['verdict']} |")
    return "\n".join(rows)


def cells(r: dict) -> str:
    if not r["retrieval"]:
        return "(not run)"
    names = list(next(iter(r["retrieval"].values()))["cells"])
    rows = ["| format | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
    for fmt, d in r["retrieval"].items():
        rows.append(f"| {fmt} | " + " | ".join(f"{100 * d['cells'][k]['accuracy']:.1f}"
                                                for k in names) + " |")
    return "\n".join(rows)


def markdown(r: dict, table_only: bool = False) -> str:
    if table_only:
        return table(r) + ("\n\n" + floor_table(r) if r.get("floor") else "")
    s = r["sizes"]
    n = r["nll"].get("native") or next(iter(r["nll"].values()), None) or {
        "tokens": 0, "windows": 0, "native_nll": float("nan")}
    probes = r["probes"] or {"selection": {}, "kept": 0, "by_format": {"-": {"by_family": {}}}}
    fams = ", ".join(f"{k} {v['kept']}/{v['tried']}" for k, v in probes["selection"].items())
    by_fam = "\n".join(f"| {f} | " + " | ".join(f"{100 * x:.0f}" for x in d["by_family"].values())
                       + " |" for f, d in probes["by_format"].items())
    fam_head = " | ".join(next(iter(probes["by_format"].values()))["by_family"])
    sec = {k: r["seconds"].get(k, float("nan")) for k in ("total", "nll", "retrieval", "probes")}
    done = [L for L in map(str, s["lengths"])
            if any(L in d["by_length"] for d in r["retrieval"].values())]
    partial = "" if r.get("complete") else (
        f"\n> **Partial run** (a --parts subset, or stopped by a time limit). Completed: NLL "
        f"{'yes' if r['nll'] else 'no'}, probes {'yes' if r['probes'] else 'no'}, retrieval "
        f"lengths {', '.join(done) or 'none'}. Unfinished cells show '-'.\n")
    if r.get("runs"):
        command = "; ".join(f"`{x['command']}` ({x['used']})" for x in r["runs"])
    else:
        command = f"`{r['command']}`"
    control = ("Native is the control for NLL/KL/top-1: a second native run through its own paged "
               "store\n(expected exactly 0, 0 and 1.0)." if s.get("independent_control") else
               "In this run the native NLL/KL/top-1 row compared the reference run with itself\n"
               "(trivially 0; the gate now runs an independent second native store).")
    floor = ""
    if r.get("floor") and "floor" in r["floor"]:
        f = r["floor"]
        floor = (f"### Judged over the {f['compute_dtype']} noise floor\n\n"
                 f"Compute dtype {f['compute_dtype']}: the NLL/KL margins bound each format's "
                 f"excess over native {f['compute_dtype']}, both scored against native "
                 f"{f['reference_dtype']} on the same weights (MLX_ENABLE_TF32="
                 f"{f.get('mlx_enable_tf32') or 'unset'}); the table above is against native "
                 f"{f['compute_dtype']}, reported, not judged, for NLL/KL. Rule: {f['rule']}."
                 f"\n\n{floor_table(r)}\n\n")
    notes = f"\n## Reading the results\n\n{r['notes'].strip()}\n" if r.get("notes") else ""
    raw = "{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in r.items()
                              if k != "notes") + "\n}"
    return f"""# KV-format quality gate

Each packed KV format against native on the same weights ({r['model']}, fingerprint
`{r['fingerprint']}`), produced by `quality/gate.py`. Generated file: rerun the command to refresh.
{partial}
- **Command**: {command}
- **Machine**: {r['machine']}; compute dtype **{r['dtype']}**; {sec['total']:.0f} s
  (NLL {sec['nll']:.0f} s, retrieval {sec['retrieval']:.0f} s, probes {sec['probes']:.0f} s)
- **Sizes**: {n['tokens']} scored held-out tokens per format in {n['windows']} windows of
  {s['window']}; retrieval {s['retrieval_cases_per_cell']} cases per (task, length) cell at
  {', '.join(map(str, s['lengths']))} (tasks: pass key, key-value); {probes['kept']} graded probes;
  KV pages of {s['page_tokens']} tokens; {s['batch']} sequences per forward call; decode steps
  through {s.get('decode_path', 'the production path')}.
- **Held-out text**: {r['heldout']['tokens']} tokens (sha256 `{r['heldout']['sha256_16']}`) from
  {r['heldout']['source']}.

{notes}
## Declared margins and rule

Margins (fixed before any run): int8 NLL delta <= 0.1 % and KL <= 1e-3 nats/token; k8v4 NLL delta
<= 0.5 %; int4 (and int4 without rotation, the ablation) NLL delta <= 1 %; retrieval accuracy at
each length within {r['retrieval_points']:g} points of native (both tasks pooled per length);
probe accuracy within {r['probe_points']:g} points of native. KL, top-1 agreement and per-cell
accuracies of other formats are reported, not judged.

Rule: paired bootstrap 95% percentile interval ({BOOTSTRAP_RESAMPLES} resamples, seed
{BOOTSTRAP_SEED}) over held-out windows (NLL, KL, top-1) or cases (retrieval, probes). For an
"at most m" check: **pass** if the upper bound <= m, **fail** if the lower bound > m, else
**inconclusive**. For "within d points": pass if the lower bound of (format - native) >= -d, fail
if its upper bound < -d, else inconclusive. Accuracy intervals are the bootstrap interval widened
by exact Clopper-Pearson bounds on the rates of cases lost / gained against native, because near
ceiling the bootstrap collapses to a point: with 0 losses in n cases the lower bound is
-100 (1 - 0.025^(1/n)) points (-1.8 at n = 200, -3.6 at n = 100). A format passes when all its checks pass, fails when
any fails, otherwise it is inconclusive.

## Verdicts

{table(r)}

{floor}{control} For retrieval and probes the native row is the reference run
itself, shown with the interval that the same data would give a format with no loss. Cells show
accuracy (%) and the paired difference to native in points.

### Checks

{checks(r)}

## How tokens were scored

Teacher forcing through the serving code path (`PackedModelRunner` over a `KVStore` with the
format's layer stores): each window is prefilled in chunks of {s['chunk']} tokens; every chunk
after the first reads all earlier positions from stored pages (packed codes for packed formats),
while attending its own fresh K/V in full precision, exactly as chunked prefill does in serving.
Positions of the first chunk see no stored history (identical in every format) and are not
scored, so each window of {s['window']} scores {s['window'] - 1 - s['chunk']} next-token
predictions; a scored token attends on average ~{s['chunk'] // 2} fresh positions and the rest
from pages. Decode (one token per step) reads everything from pages and so is slightly harsher
than these numbers; the retrieval and probe tasks exercise it. Native mean NLL over the scored
tokens: {n['native_nll']:.4f} nats/token. Windows are spread evenly over the held-out stream.

Retrieval: `training.corpus.passkey_case` / `kv_case` (the model card's generators, seeded
per cell) over held-out filler; the prompt is prefilled in chunks of {s['retrieval_chunk']} tokens
and the answer decoded greedily one token per step; a case counts when every answer digit
matches. Per cell (accuracy %):

{cells(r)}

Probes: candidates from four exact-answer families (`quality/data.py`): chat pass key
(answer "The pass key is NNNNN." plus `<|im_end|>`), the 2nd-4th lookup of a 300-1500-token
key-value table, the pass key in held-out code at 300-3000 tokens, and restating "a op b =" from
a chat question with 3-digit operands; greedy decoding must reproduce the expected tokens exactly.
Only candidates native answers correctly are kept (kept/tried: {fams}), so native is 100% by
construction and a format can only lose; a probe native barely gets right may flip under any
perturbation. Accuracy (%) by family:

| format | {fam_head} |
|---|{'---|' * len(next(iter(probes['by_format'].values()))['by_family'])}
{by_fam}

int4 without rotation: the shipped store always rotates keys (and attention rotates queries), so
the ablation is an adapter in `quality/runs.py`: keys are quantized unrotated and the
shared direct attention path receives q R^T and k_new R^T, which R's orthogonality turns back
into q against unrotated stored keys.

<details><summary>The result JSON (quality.gate --out)</summary>

```json
{raw}
```
</details>
"""
