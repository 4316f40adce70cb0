"""The quality gate's margins, declared before any run, and the verdicts against them.

Per format: the NLL / KL margins (MARGINS), retrieval and probe points; a check's verdict comes
from its paired bootstrap interval (rule in quality.stats).
"""
from __future__ import annotations

from quality.stats import (INCONCLUSIVE, PASS, Interval, accuracy_delta_interval, combine,
                           ratio_interval, relative_delta_interval, verdict_at_most,
                           verdict_within_points)

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
        for metric, margin in MARGINS.get(fmt, {}).items():
            if nll is None:
                continue
            iv = _iv(nll[metric])
            checks.append({"check": f"{metric} <= {margin:g}", "estimate": iv.estimate,
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
