"""KV-format quality gate: each packed KV format against native on the same weights.

    python -m quality.gate --quick                  # CI-sized, minutes on a CPU
    python -m quality.gate --out out/quality.json --md docs/quality.md   # full sizes

Measures, per format (int8, k8v4, int4, int4 without the K rotation; native as a control):
- teacher-forced next-token NLL delta (%), mean KL(native || format) and top-1 agreement over
  held-out windows, prefilled in chunks through the paged runner (each chunk reads earlier
  chunks from stored pages; only positions after the first chunk are scored);
- retrieval accuracy (pass key, key-value) at each length, by greedy decoding after chunked
  prefill;
- exact-answer generation probes that native answers correctly;
with paired bootstrap 95% intervals over windows / cases and verdicts against margins declared
up front (MARGINS; rule in quality.stats). Off float32 (bfloat16 on Metal/CUDA) the same weights
also run natively in float32 and the NLL/KL margins bound a format's excess over native's
distance to that reference, the noise floor measured in the same run (quality.verdicts.
REFERENCE_DTYPE, --reference-dtype; docs/quality.md, "bfloat16").
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import time
from pathlib import Path

from quality.options import PROBE_ASK, TASKS, build_parser, resolve_sizes
from quality.stats import FAIL
from quality.verdicts import (MARGINS, MIN_MARGIN_NATS, PROBE_POINTS, PROBE_POINTS_BY_FORMAT,
                              REFERENCE_DTYPE, RETRIEVAL_NATIVE_MIN, RETRIEVAL_POINTS,
                              summarize_accuracy, summarize_floor, summarize_nll, verdicts)

def _log(msg: str) -> None:
    print(f"[quality {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ the three measurements

def reference_dtype(a: argparse.Namespace, compute: str) -> str | None:
    """The noise floor's reference dtype for this run, or None (no floor: float32 compute, or
    --reference-dtype none or equal to the compute dtype)."""
    want = str(a.reference_dtype).strip().lower()
    if want == "none":
        return None
    if want == "auto":
        want = REFERENCE_DTYPE
    from engine.model.loader import resolve_dtype
    name = str(resolve_dtype(want)).removeprefix("mlx.core.")
    return None if name == compute else name


def run_nll(loaded, held, a, floor: dict | None = None) -> dict:
    """NLL/KL of each format against native; with a reference dtype (reference_dtype) also
    against native in that dtype, the noise floor and excesses written into `floor`."""
    from quality.data import text_windows, windows
    from quality.runs import teacher_forced, teacher_forced_exact
    per_window = a.window - 1 - a.chunk
    n = max(2, math.ceil(a.nll_tokens / per_window))
    if a.suite == "text":   # half chat prose, half held-out code
        n += n % 2
        wins = text_windows(loaded.tokenizer, n // 2, a.window)
    else:
        wins = windows(held.stream, n, a.window)
    _log(f"nll: {n} windows x {a.window} tokens, chunk {a.chunk}, {per_window} scored per window")
    ref = reference_dtype(a, loaded.dtype_name)
    if ref is None:
        scores = teacher_forced(loaded, wins, a.formats, a.chunk, a.batch, log=_log)
        return {f: summarize_nll(s) for f, s in scores.items()}
    from engine.model.loader import load_model
    exact = load_model(a.model, dtype=ref)
    _log(f"nll: noise floor against native {ref} (the same weights; "
         f"MLX_ENABLE_TF32={os.environ.get('MLX_ENABLE_TF32', 'unset')})")
    scores, vs_exact = teacher_forced_exact(loaded, exact, wins, a.formats, a.chunk, a.batch,
                                            log=_log)
    del exact
    got = summarize_floor(vs_exact, loaded.dtype_name, ref)
    got["mlx_enable_tf32"] = os.environ.get("MLX_ENABLE_TF32")
    if floor is not None:
        floor.update(got)
    fl = got["floor"]
    _log(f"nll: floor (native {loaded.dtype_name} vs {ref}) KL {fl['kl']['estimate']:.2e}, NLL "
         f"{fl['nll_delta_pct']['estimate']:+.3f} %; excess KL "
         + ", ".join(f"{f} {d['excess']['kl']['estimate']:.2e}"
                     for f, d in got["formats"].items()))
    return {f: summarize_nll(s) for f, s in scores.items()}


def run_retrieval(loaded, held, a, checkpoint=lambda part: None) -> dict:
    """Length by length (shortest first), every format on the same cases; `checkpoint` gets
    the summary of the lengths done so far, so a run cut short keeps them."""
    import numpy as np

    from quality.data import retrieval_cases
    from quality.runs import generate
    ok: dict[str, dict[tuple, np.ndarray]] = {f: {} for f in {"native", *a.formats}}
    out: dict = {}
    for L in a.lengths:
        cases = {t: retrieval_cases(held, t, L, a.retrieval_cases) for t in TASKS}
        flat = [c for t in TASKS for c in cases[t]]
        for fmt in ["native"] + [f for f in a.formats if f != "native"]:
            _log(f"retrieval@{L}: {fmt}, {len(flat)} cases")
            got = generate(loaded, fmt, flat, a.retrieval_chunk, a.batch, log=_log)
            for i, t in enumerate(TASKS):
                ok[fmt][(t, L)] = got[i * a.retrieval_cases:(i + 1) * a.retrieval_cases]
        for fmt in a.formats:
            d = out.setdefault(fmt, {"cells": {}, "by_length": {}})
            for t in TASKS:
                d["cells"][f"{t}@{L}"] = {"accuracy": float(ok[fmt][(t, L)].mean()),
                                          "native_accuracy": float(ok["native"][(t, L)].mean()),
                                          "cases": a.retrieval_cases}
            d["by_length"][str(L)] = summarize_accuracy(
                np.concatenate([ok[fmt][(t, L)] for t in TASKS]),
                np.concatenate([ok["native"][(t, L)] for t in TASKS]))
        checkpoint(out)
    return out


def run_retrieval_text(loaded, held, a, checkpoint=lambda part: None, make=None) -> dict:
    """Text suite: dict lookups over held-out code at each length (quality.tasks.RETRIEVAL_TASK),
    graded teacher-forced with a chunk cut before each answer; judged on the cases native wins by
    MIN_MARGIN_NATS, with native's accuracy over every case and the all-case delta reported.
    `make` builds the runners (quality.runs.graded_spans; quality.variants passes its own)."""
    from quality.data import code_stream
    from quality.runs import REF, graded_spans
    from quality.tasks import RETRIEVAL_TASK, retrieval_sequences
    code = code_stream(loaded.tokenizer)
    out: dict = {}
    for L in a.lengths:
        seqs = retrieval_sequences(loaded.tokenizer, code, L, a.retrieval_cases, **RETRIEVAL_TASK)
        _log(f"retrieval@{L}: {len(seqs)} sequences, {sum(len(s.spans) for s in seqs)} cases")
        got = graded_spans(loaded, seqs, a.formats, a.retrieval_chunk, a.batch, log=_log,
                           make=make)
        keep = select_by_margin(got)
        native_all = float(got[REF].mean())
        _log(f"retrieval@{L}: native {native_all:.3f} of {len(keep)}; judged {int(keep.sum())} "
             f"(margin >= {MIN_MARGIN_NATS:g})")
        for fmt in a.formats:
            d = out.setdefault(fmt, {"cells": {}, "by_length": {}})
            s = summarize_accuracy(got[fmt][keep], got[REF][keep])
            s["native_accuracy_all"] = native_all
            s["native_at_least"] = RETRIEVAL_NATIVE_MIN
            s["all_cases"] = summarize_accuracy(got[fmt], got[REF])
            d["cells"][f"lookup@{L}"] = {k: s[k] for k in ("accuracy", "native_accuracy", "cases")}
            d["cells"][f"lookup@{L}"]["native_accuracy_all"] = native_all
            d["by_length"][str(L)] = s
        checkpoint(out)
    return out


def select_by_margin(got: dict, margin: float = MIN_MARGIN_NATS):
    """The judged cases of a graded_spans result: native right with its answer ahead of the
    runner-up by >= `margin` nats at every position (quality.verdicts.MIN_MARGIN_NATS)."""
    from quality.runs import REF, REF_MARGIN
    return (got[REF] == 1) & (got[REF_MARGIN] >= margin)


def run_probes_text(loaded, held, a, make=None) -> dict:
    """Text suite: chat probes in multi-turn conversations; the first `probes` of those the
    reference run answers by MIN_MARGIN_NATS are judged (native is 100 % there by construction);
    the earlier rule (every native-correct probe) is reported beside it. `make` as for
    run_retrieval_text."""
    import numpy as np

    from quality.runs import REF, REF_MARGIN, graded_spans
    from quality.tasks import probe_conversations
    convs = probe_conversations(loaded.tokenizer, int(PROBE_ASK * a.probes))
    got = graded_spans(loaded, convs, a.formats, a.retrieval_chunk, a.batch, log=_log,
                       make=make)
    fams = np.array([str(f) for c in convs for f in c.families])
    correct = np.flatnonzero(got[REF] == 1)
    kept = np.flatnonzero(select_by_margin(got))[:a.probes]
    # The earlier rule (every native-correct probe, near-ties included), reported, not judged.
    old = correct[:a.probes]
    selection = {str(f): {"tried": int((fams == f).sum()),
                          "native_correct": int((fams[correct] == f).sum()),
                          "margin_ok": int(((fams == f) & select_by_margin(got)).sum()),
                          "kept": int((fams[kept] == f).sum())}
                 for f in dict.fromkeys(fams.tolist())}
    _log(f"probes: kept {len(kept)} of {len(fams)} (native right by >= {MIN_MARGIN_NATS:g} nats; "
         f"{len(correct)} native-correct): {selection}")
    out = {"rule": f"native right with margin >= {MIN_MARGIN_NATS:g} nats at every position",
           "min_margin_nats": MIN_MARGIN_NATS, "candidates": int(len(fams)),
           "native_correct": int(len(correct)), "selection": selection, "kept": int(len(kept)),
           "by_format": {}, "native_correct_rule": {}}
    for fmt in a.formats:
        ok = got[fmt][kept]
        s = summarize_accuracy(ok, got[REF][kept])
        s["by_family"] = {f: float(ok[fams[kept] == f].mean()) for f in selection
                          if (fams[kept] == f).any()}
        out["by_format"][fmt] = s
        out["native_correct_rule"][fmt] = summarize_accuracy(got[fmt][old], got[REF][old])
    lost = {fmt: [float(got[REF_MARGIN][i]) for i in correct if not got[fmt][i]]
            for fmt in a.formats}
    out["lost_margins"] = lost   # native's margin on each native-correct probe a format lost
    return out


def run_probes(loaded, held, a) -> dict:
    import numpy as np

    from quality.data import probe_candidates
    from quality.runs import generate
    families = probe_candidates(held, loaded.tokenizer, per_family=max(4, a.probes))
    want = -(-a.probes // len(families))
    kept, selection = [], {}
    for fam, cands in families.items():
        # Native is run on candidates in slices until the family's quota of correct ones is met.
        got, tried = [], 0
        while len(got) < want and tried < len(cands):
            part = cands[tried:tried + want - len(got)]
            ok = generate(loaded, "native", part, a.retrieval_chunk, a.batch)
            got += [c for c, k in zip(part, ok) if k][:want - len(got)]
            tried += len(part)
        selection[fam] = {"tried": tried, "kept": len(got)}
        kept += got
    _log(f"probes: kept {len(kept)} native-correct of {sum(s['tried'] for s in selection.values())} "
         f"tried: {selection}")
    ref = np.ones(len(kept), np.int8)
    out = {"selection": selection, "kept": len(kept), "by_format": {}}
    fams = [c.family for c in kept]
    for fmt in a.formats:
        if fmt == "native":
            ok = ref
        else:
            _log(f"probes: {fmt}")
            ok = generate(loaded, fmt, kept, a.retrieval_chunk, a.batch)
        s = summarize_accuracy(ok, ref)
        s["by_family"] = {f: float(np.mean([k for k, g in zip(ok, fams) if g == f]))
                          for f in families if f in fams}
        out["by_format"][fmt] = s
    return out


# ------------------------------------------------------------------ entry point

def _shown(model: str) -> str:
    """A model under the working directory by its relative path (short names resolve to an
    absolute folder), so recorded results carry no machine paths."""
    relative = os.path.relpath(model)
    return model if relative.startswith("..") else relative


def _machine(a) -> str:
    import mlx.core as mx
    if a.machine:
        return a.machine
    dev = mx.default_device()
    desc = f"{platform.machine()} {platform.system()}, MLX {mx.__version__} {dev}"
    if dev != mx.cpu:
        try:
            desc += f" ({mx.device_info().get('device_name', '')})"
        except Exception:  # device_info is best-effort decoration only
            pass
    else:
        import os
        desc += f", {os.cpu_count()} CPU cores"
    return desc


def run(a: argparse.Namespace, argv: list[str]) -> dict:
    import mlx.core as mx

    from engine.model.loader import load_model
    from quality.data import load_heldout
    from quality.runs import decode_path
    t0 = time.time()
    loaded = load_model(a.model, dtype=a.dtype)
    a.batch = a.batch or (4 if mx.default_device() == mx.cpu else 64)
    held = load_heldout(loaded.tokenizer, a.data)
    _log(f"model {a.model} ({loaded.dtype_name}, fingerprint {loaded.fingerprint}); held-out "
         f"{len(held.stream)} tokens, sha {held.sha256} from {held.source}")
    result = {
        "command": "python -m quality.gate " + " ".join(shlex.quote(x) for x in argv),
        "suite": a.suite,
        "machine": _machine(a), "dtype": loaded.dtype_name, "model": _shown(a.model),
        "fingerprint": loaded.fingerprint, "formats": a.formats,
        "sizes": {"nll_tokens_min": a.nll_tokens, "window": a.window, "chunk": a.chunk,
                  "retrieval_cases_per_cell": a.retrieval_cases, "lengths": a.lengths,
                  "retrieval_chunk": a.retrieval_chunk, "probes": a.probes, "batch": a.batch,
                  "page_tokens": 64, "decode_path": decode_path(), "independent_control": True},
        "heldout": {"tokens": int(len(held.stream)), "sha256_16": held.sha256, "source": held.source},
        "margins": MARGINS, "retrieval_points": RETRIEVAL_POINTS, "probe_points": PROBE_POINTS,
        "probe_points_by_format": PROBE_POINTS_BY_FORMAT,
        # the noise floor's reference dtype (None: judged against native alone, as in float32)
        "reference_dtype": reference_dtype(a, loaded.dtype_name),
    }
    if a.suite == "text":
        from quality.tasks import RETRIEVAL_TASK
        result.update(min_margin_nats=MIN_MARGIN_NATS, retrieval_native_min=RETRIEVAL_NATIVE_MIN,
                      retrieval_task=RETRIEVAL_TASK, probe_ask=PROBE_ASK)
    stamps = {}
    result.update(nll={}, retrieval={}, probes={}, seconds=stamps)

    def checkpoint(name, part):
        # Partial results reach --out after every phase (and retrieval length), so a run cut
        # short by a time limit still leaves what it measured.
        result[name] = part
        result["verdicts"] = verdicts(result)
        stamps["total"] = round(time.time() - t0, 1)
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(result, indent=1))

    # Cheapest first: NLL carries the finest signal; retrieval's long cells cost the most.
    fns = {"nll": run_nll, "probes": run_probes, "retrieval": run_retrieval}
    if a.suite == "text":
        fns.update(probes=run_probes_text, retrieval=run_retrieval_text)
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    for name in parts:
        fn = fns[name]
        t = time.time()
        kw = {"checkpoint": lambda part, n=name: checkpoint(n, part)} if name == "retrieval" else {}
        if name == "nll" and result["reference_dtype"]:
            kw = {"floor": result.setdefault("floor", {})}
        part = fn(loaded, held, a, **kw)
        stamps[name] = round(time.time() - t, 1)
        checkpoint(name, part)
        _log(f"{name} done in {stamps[name]}s")
    result["complete"] = set(parts) == set(fns)
    checkpoint("retrieval", result["retrieval"])
    return result


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = resolve_sizes(build_parser(__doc__).parse_args(argv))
    unknown = set(p.strip() for p in a.parts.split(",") if p.strip()) - {"nll", "probes", "retrieval"}
    if unknown:
        build_parser(__doc__).error(f"--parts: unknown {sorted(unknown)}")
    from quality.report import markdown
    if a.report:
        result = json.loads(Path(a.report).read_text())
        result["verdicts"] = verdicts(result)
    else:
        result = run(a, argv)
    if a.md:
        Path(a.md).parent.mkdir(parents=True, exist_ok=True)
        Path(a.md).write_text(markdown(result))
    print(markdown(result, table_only=True))
    overall = {f: v["overall"] for f, v in result["verdicts"].items()}
    _log(f"verdicts: {overall}")
    return 1 if a.strict and any(v == FAIL for f, v in overall.items() if f != "int4-norot") else 0


if __name__ == "__main__":
    from engine.platform import ensure_openblas_preloaded
    ensure_openblas_preloaded()
    raise SystemExit(main())
