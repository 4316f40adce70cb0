"""The quality gate's margins, declared before any run, and the verdicts against them.

Per format: the NLL / KL margins (MARGINS), retrieval and probe points; a check's verdict comes
from its paired bootstrap interval (rule in quality.stats).
"""
from __future__ import annotations

from quality.stats import (INCONCLUSIVE, PASS, Interval, accuracy_delta_interval, combine,
                           excess_interval, ratio_interval, relative_delta_interval,
                           verdict_at_most, verdict_within_points)

# Declared before any run. NLL delta in percent of native mean NLL; KL in nats/token;
# accuracy margins in points (format minus native).
MARGINS = {
    "int8": {"nll_delta_pct": 0.1, "kl": 1e-3},
    "k8v4": {"nll_delta_pct": 0.5},
    "int4": {"nll_delta_pct": 1.0},
    "int4-norot": {"nll_delta_pct": 1.0},
    # issue 17's bar for the best int4 identity
    "int4-sink": {"nll_delta_pct": 0.3},
    "int4-k32": {"nll_delta_pct": 0.3},
    "int4-tail": {"nll_delta_pct": 0.3},
    "int4-k32-tail": {"nll_delta_pct": 0.3},
    "int4-kivi": {"nll_delta_pct": 0.3},
    "k6v4-kivi": {"nll_delta_pct": 0.3},   # held to the int4 bar: it is within its bytes
}
RETRIEVAL_POINTS = 2.0
PROBE_POINTS = 2.0
# int4 identities are held to 3 probe points (issue 17), every other format to PROBE_POINTS.
PROBE_POINTS_BY_FORMAT = {"int4": 3.0, "int4-norot": 3.0, "int4-sink": 3.0, "int4-k32": 3.0,
                          "int4-tail": 3.0, "int4-k32-tail": 3.0, "int4-kivi": 3.0,
                          "k6v4-kivi": 3.0}
# Text suite case selection, declared before the run that judges with it (2026-12-01): a graded
# case (probe or retrieval lookup) is judged only where native's answer wins by at least this
# margin at every one of its positions: log p(forced token) - max log p(any other token), in
# nats (quality.runs.forced_margin). 0.5 nats = the answer at least 1.65x as likely as the
# runner-up. Why this value: int8's KL on SmolLM2 FP32 (2.9e-5 nats/token) means a typical
# logit perturbation of sqrt(2 KL) ~ 0.008 nats, so 0.5 is ~60x what int8 rounding moves a gap
# and a flip there is damage, not a tie broken the other way; int4-k32's KL (6.7e-3) gives
# ~0.12 nats, so 0.5 is ~4x: int4 flips at this margin still count against it. Cases under the
# margin (near-ties that any rounding, int8 included, can flip either way) are reported, not judged.
MIN_MARGIN_NATS = 0.5
# The retrieval task must be one native is good at (issue 17): native's accuracy over every
# case (no selection) at a judged length, reported next to the verdict.
RETRIEVAL_NATIVE_MIN = 0.90

# Off float32 (bfloat16 on Metal/CUDA) the NLL/KL margins are judged against a noise floor
# measured in the same run (issue 32). Native bf16 KV is itself rounded to 8 significant bits and
# every bf16 kernel rounds differently, so KL(native bf16 || format bf16) holds two paths' bf16
# noise (int8 on SmolLM2: 2e-3 in bf16 against 2.9e-5 in float32) and is no measure of the
# format. Instead the same weights also run natively in REFERENCE_DTYPE, and each run is scored
# against that reference: native bf16's KL / NLL delta to it is the floor, what bf16 compute
# itself costs; a format's excess over the floor (paired over windows) is judged against the
# format's declared margin, unchanged. KL of independent small perturbations adds, so the excess
# estimates the format's own loss: in float32 it is exactly the float32 gate's number (the floor
# is 0), and a format that loses quality in float32 loses it over the floor too.
REFERENCE_DTYPE = "float32"
FLOOR_RULE = ("each run scored against native in the reference dtype (same weights); floor = "
              "native's KL / NLL delta to the reference in the compute dtype; a format's "
              "declared NLL/KL margin bounds its excess over the floor (format minus native, "
              "both to the reference; NLL in percent of the reference's NLL), paired over windows")

# ------------------------------------------------------------------ summaries and verdicts

def summarize_nll(scores) -> dict:
    s = scores
    return {
        "nll_delta_pct": relative_delta_interval(s.nll_format, s.nll_native).as_dict(),
        "kl": ratio_interval(s.kl, s.tokens).as_dict(),
        "top1_agreement": ratio_interval(s.agree, s.tokens).as_dict(),
        "native_nll": float(s.nll_native.sum() / s.tokens.sum()),
        "format_nll": float(s.nll_format.sum() / s.tokens.sum()),
        "tokens": int(s.tokens.sum()), "windows": int(len(s.tokens)),
    }


def summarize_floor(vs_exact: dict, compute_dtype: str, reference_dtype: str) -> dict:
    """The noise floor and each format's excess over it (quality.runs.teacher_forced_exact's
    second result: per-window scores of native and each format against the reference run)."""
    nat = vs_exact["native"]
    floor = summarize_nll(nat)
    out = {"reference_dtype": reference_dtype, "compute_dtype": compute_dtype, "rule": FLOOR_RULE,
           "floor": {"kl": floor["kl"], "nll_delta_pct": floor["nll_delta_pct"],
                     "top1_agreement": floor["top1_agreement"],
                     "reference_nll": floor["native_nll"], "native_nll": floor["format_nll"],
                     "tokens": floor["tokens"], "windows": floor["windows"]},
           "formats": {}}
    for fmt, sc in vs_exact.items():
        if fmt == "native":
            continue
        to_ref = summarize_nll(sc)
        excess = {"kl": excess_interval(sc.kl, nat.kl, sc.tokens),
                  "nll_delta_pct": excess_interval(sc.nll_format, nat.nll_format, sc.nll_native,
                                                   scale=100.0)}
        kl_n = floor["kl"]["estimate"]
        out["formats"][fmt] = {
            "kl_to_reference": to_ref["kl"], "nll_delta_pct_to_reference": to_ref["nll_delta_pct"],
            "top1_agreement_to_reference": to_ref["top1_agreement"],
            "kl_ratio_to_floor": to_ref["kl"]["estimate"] / kl_n if kl_n > 0 else None,
            "excess": {k: iv.as_dict() for k, iv in excess.items()},
            # the declared margin each judged excess is held to, and what is left of it at the
            # interval's upper bound (negative: over the margin)
            "margins": {m: {"margin": v, "excess": excess[m].estimate,
                            "ci95": [excess[m].low, excess[m].high],
                            "headroom": v - excess[m].high}
                        for m, v in MARGINS.get(fmt, {}).items()},
        }
    return out


def summarize_accuracy(ok, ref) -> dict:
    d = accuracy_delta_interval(ok, ref)
    return {"accuracy": float(ok.mean()), "native_accuracy": float(ref.mean()), "cases": int(len(ok)),
            "delta_points": d.as_dict()}


def _iv(d: dict) -> Interval:
    return Interval(d["estimate"], *d["ci95"])


def verdicts(result: dict) -> dict:
    """Per format: each declared check with its interval and verdict, and the overall verdict."""
    out = {}
    for fmt in result["formats"]:
        if fmt == "native":
            continue
        checks = []
        nll = result["nll"].get(fmt)
        floor = result.get("floor") or {}
        over = floor.get("formats", {}).get(fmt)
        for metric, margin in MARGINS.get(fmt, {}).items():
            if over is not None:   # judged over the noise floor (REFERENCE_DTYPE reference)
                iv = _iv(over["excess"][metric])
                name = (f"{metric} over native {floor['compute_dtype']} (both vs "
                        f"{floor['reference_dtype']}) <= {margin:g}")
            elif nll is not None:
                iv, name = _iv(nll[metric]), f"{metric} <= {margin:g}"
            else:
                continue
            checks.append({"check": name, "estimate": iv.estimate,
                           "ci95": [iv.low, iv.high], "verdict": verdict_at_most(iv, margin)})
        for length, cell in result["retrieval"].get(fmt, {}).get("by_length", {}).items():
            iv = _iv(cell["delta_points"])
            verdict = verdict_within_points(iv, RETRIEVAL_POINTS)
            # A task native is bad at cannot clear a format (issue 17): no pass below the bar.
            if (verdict == PASS and "native_accuracy_all" in cell
                    and cell["native_accuracy_all"] < RETRIEVAL_NATIVE_MIN):
                verdict = INCONCLUSIVE
            checks.append({"check": f"retrieval@{length} within {RETRIEVAL_POINTS:g} points",
                           "estimate": iv.estimate, "ci95": [iv.low, iv.high],
                           "verdict": verdict})
        probes = result["probes"].get("by_format", {}).get(fmt)
        if probes:
            iv = _iv(probes["delta_points"])
            points = result.get("probe_points_by_format", {}).get(fmt, PROBE_POINTS)
            checks.append({"check": f"probes within {points:g} points", "estimate": iv.estimate,
                           "ci95": [iv.low, iv.high],
                           "verdict": verdict_within_points(iv, points)})
        out[fmt] = {"checks": checks, "overall": combine([c["verdict"] for c in checks])}
    return out
