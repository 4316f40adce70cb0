"""Where the page-key decode kernel's time goes, phase by phase: the kernel timed with one phase
of its tile loop cut out of its source at a time (a probe: the cut kernels compute garbage, only
their time is read).

    python3 -m bench.device.page_key_phase_probe --rows gpu:32768:8 --out $OUT/phases.json
    python -m bench.device.page_key_phase_probe --rows tiny:128:1 --out R.json   # CPU: no kernel

Why: at 32K keys batch 8 (bench.kv's gpu geometry) the kernel takes ~205 us a call against the
tiled native kernel's ~260 on an H100 (device run 13, docs/lab/benchmarks-kv-page-keys.md) while
it reads 0.47x the bytes; neither its bytes nor (device run 12's tensor-core score pass) its
instruction count bound it, and neither more resident blocks (a launch bound) nor one wave of
blocks (16 splits) moved it. A tile is four phases between barriers: the key metadata folded
(`meta`), the score pass (`scores`), the online-softmax step (`softmax`), the PV pass (`pv`);
the time each cut saves says which one a restructured kernel must overlap or remove
(`loads-only` keeps the copies, the barriers and the loop alone).

Per row, like bench.device.page_key_layer_profile's kernel part (its Layer and paired timing:
CALLS dependent calls per round, medians over rounds): native's kernel, the unmodified
page-key kernel (`full`) and each cut, `saved_us` = full - cut.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from bench.device.page_key_layer_profile import Layer, paired
from bench.device.page_key_qmm import _geometry

# The tile loop's phases as text of the kernel source (page_key_decode_source._SOURCE); each
# cut must match exactly once, so a changed kernel fails the probe loudly, not silently.
META = """  for (int e = tid; e < cnt * NGK; e += NT) {
    const float S = km[e] * TWO_KB;
    km[e] = S;
    km[KT * NGK + e] -= S;
  }
  __syncthreads();
"""
SOFTMAX = """  softmax_step(cnt, MMA ? 1 : NW, true, stage + VM_OFF);
  __syncthreads();
"""
SCORES_FROM, SCORES_TO = "    const int sl = warp;\n", "= dot[i][h];\n    }\n"
PROBES = ("meta", "scores", "softmax", "pv")
# Not phases but the copies' addresses: `head-major` reads, for head hk, the bytes a page laid
# out [HK][PT][width] per section would hold (each head's rows of a section one run, where the
# pool's [PT][HK][width] interleaves the heads' rows); `meta-copies` drops the key and value
# metadata copies (their 8- and 16-byte pieces). Which of the copy path's costs is the access
# pattern and which the small pieces.
ROW_TOKEN_MAJOR = "const int irow = (ir % PT) * HK + hk;"
ROW_HEAD_MAJOR = "const int irow = hk * PT + ir % PT;"
META_COPIES_FROM = "    const int km_off = ih ? KO_OFF : KS_OFF"
META_COPIES_TO = "src + vm_off + irow * NG);\n"
ADDRESSING = ("head-major", "meta-copies")


def _cut_once(src: str, start: str, end: str | None = None) -> str:
    if src.count(start) != 1:
        raise ValueError(f"probe: {start[:40]!r} is not in the kernel source exactly once")
    i = src.index(start)
    j = i + len(start) if end is None else src.index(end, i) + len(end)
    return src[:i] + src[j:]


def _swap_row(text: str, old: str, new: str, after: str) -> str:
    """`old` (a row-index line, there once) out, `new` in after line `after`."""
    return _cut_once(text, old).replace(after, after + new + "\n")


def cut_source(phases: tuple[str, ...]) -> str:
    """The page-key kernel's source with `phases` (of PROBES) cut out of its tile loop."""
    from engine.attention.cuda import page_key_decode_source as src
    from engine.attention.cuda.tile_helpers import packed_pv
    text = src._SOURCE
    for phase in phases:
        if phase == "meta":
            text = _cut_once(text, META)
        elif phase == "softmax":
            text = _cut_once(text, SOFTMAX)
        elif phase == "scores":
            text = _cut_once(text, SCORES_FROM, SCORES_TO)
        elif phase == "pv":
            text = _cut_once(text, packed_pv("VW", "VB"))
        elif phase == "head-major":
            text = _swap_row(text, ROW_TOKEN_MAJOR, ROW_HEAD_MAJOR,
                             "const int ir = tid >> 1, ih = tid & 1;\n")
        elif phase == "meta-copies":
            text = _cut_once(text, META_COPIES_FROM, META_COPIES_TO)
        else:
            raise ValueError(f"probe: unknown phase {phase!r} (one of "
                             f"{PROBES + ADDRESSING})")
    return text


VARIANTS = {"full": (), **{f"no-{p}": (p,) for p in PROBES}, "loads-only": PROBES,
            "head-major": ("head-major",), "loads-only-head-major": PROBES + ("head-major",),
            "no-meta-copies": ("meta-copies",),
            "loads-only-no-meta-copies": PROBES + ("meta-copies",),
            "head-major-no-meta-copies": ("head-major", "meta-copies")}


# The warp-page kernel (page_key_warp_decode_source.py) under the same questions: its copies'
# addressing (`head-major`, `meta-copies`) and its compute (`compute`: scores, softmax and PV
# cut from its page loop, the copies, the key-metadata fold and the loop kept).
WARP_ROW_TOKEN_MAJOR = "const int crow = (qq * QT + ct) * HK + hk;"
WARP_ROW_HEAD_MAJOR = "const int crow = hk * PT + qq * QT + ct;"
WARP_META_FROM = "    orch_cp_async<4 * NG>(st + VM_OFF + (ch * QT + ct) * NG,\n"
WARP_META_TO = "c * MPW);\n      }\n    }\n"
WARP_COMPUTE_FROM = "  // 1. Scores of keys"
WARP_COMPUTE_TO = "orch_mma_f16(acc[j], a, bw[(16 * j) / 64]);\n    }\n  }\n"
# `head-pages`: each (page, head) one contiguous run of its sections ([HK][sections][PT]
# [width]: 3,840 bytes at 6-bit keys, head dim 128), the most contiguous a page could be.
WARP_HEAD_PAGES = {
    "src + KC_OFF + crow * LW": "src + hk * HEADW + KC_OFF / HK + (qq * QT + ct) * LW",
    "src + VC_OFF + crow * VW": "src + hk * HEADW + VC_OFF / HK + (qq * QT + ct) * VW",
    "src + (sec ? KO_OFF : KS_OFF) + (t * HK + hk) * NGK":
        "src + hk * HEADW + (sec ? KO_OFF : KS_OFF) / HK + t * NGK",
    "src + (ch ? VO_OFF : VS_OFF) + crow * NG":
        "src + hk * HEADW + (ch ? VO_OFF : VS_OFF) / HK + (qq * QT + ct) * NG"}
# `bulk`: its page copies as bulk copies of each section's run (page_key_bulk_copies.py).
WARP_ISSUE_FROM, WARP_ISSUE_TO = "auto issue = [&](int i) {", "  orch_cp_commit();\n};\n"
WARP_WAIT = "  orch_cp_wait<ST - 2>();"
WARP_VARIANTS = {"warp": (), "warp-head-major": ("head-major",),
                 "warp-no-meta-copies": ("meta-copies",), "warp-loads-only": ("compute",),
                 "warp-loads-only-head-major": ("compute", "head-major"),
                 "warp-head-pages": ("head-pages",),
                 "warp-loads-only-head-pages": ("compute", "head-pages"),
                 "warp-bulk": ("bulk",), "warp-loads-only-bulk": ("compute", "bulk")}


def warp_cut_source(cuts: tuple[str, ...]) -> str:
    """The warp-page kernel's source with `cuts` (head-major, meta-copies, compute) made."""
    from engine.attention.cuda import page_key_warp_decode_source as warp
    text = warp._SOURCE
    for cut in cuts:
        if cut == "head-major":   # in place: the row depends on the quarter being issued
            _cut_once(text, WARP_ROW_TOKEN_MAJOR)    # there, exactly once
            text = text.replace(WARP_ROW_TOKEN_MAJOR, WARP_ROW_HEAD_MAJOR)
        elif cut == "meta-copies":
            text = _cut_once(text, WARP_META_FROM, WARP_META_TO)
        elif cut == "compute":
            text = _cut_once(text, WARP_COMPUTE_FROM, WARP_COMPUTE_TO)
        elif cut == "head-pages":
            for old, new in WARP_HEAD_PAGES.items():
                _cut_once(text, old)                 # there, exactly once
                text = text.replace(old, new)
            text = text.replace("const int ct = lane >> 1, ch = lane & 1;\n",
                                "const int ct = lane >> 1, ch = lane & 1;\n"
                                "constexpr int HEADW = PGW / HK;\n")
        elif cut == "bulk":
            from bench.device import page_key_bulk_copies as bulk
            text = _cut_once(text, WARP_ISSUE_FROM, WARP_ISSUE_TO)
            at = text.index("#pragma unroll\nfor (int i = 0; i < ST - 1; ++i) issue(i);")
            text = text[:at] + bulk.ISSUE + text[at:]
            line = text.index(WARP_WAIT)
            text = text[:line] + bulk.WAIT + text[text.index("\n", line) + 1:]
        else:
            raise ValueError(f"probe: unknown warp-kernel cut {cut!r}")
    return text


def _build(text: str, name: str, warp: bool = False):
    """The kernel object of a cut source (built once a variant, not in the timed calls)."""
    import mlx.core as mx
    from engine.attention.cuda import page_key_decode_source as src
    from bench.device import page_key_bulk_copies as bulk
    kind = "warp_probe" if warp else "probe"
    return mx.fast.cuda_kernel(name=f"orchard_page_key_{kind}_{name}", input_names=src.INPUTS,
                               output_names=src.OUTPUTS, source=text,
                               header=src.header() + (bulk.HELPERS if warp else ""),
                               ensure_row_contiguous=True)


@contextmanager
def _launching(kernel, attr: str = "_kernel"):
    """page_key_decode_attention launching `kernel` inside the block (its host side, split
    plan and merge unchanged); `attr` "_warp_kernel": in place of the warp-page kernel."""
    from engine.attention.cuda import page_key_decode as pkd
    saved = getattr(pkd, attr)
    setattr(pkd, attr, lambda: kernel)
    try:
        yield
    finally:
        setattr(pkd, attr, saved)


def probe_row(geometry: str, n: int, b: int, calls: int, rounds: int,
              only: set | None = None) -> dict:
    import mlx.core as mx
    from engine.attention.cuda import paged_decode
    if not paged_decode.available():
        return {"unavailable": "no CUDA device: the page-key kernel is CUDA only",
                "source_chars": {**{k: len(cut_source(v)) for k, v in VARIANTS.items()},
                                 **{k: len(warp_cut_source(v))
                                    for k, v in WARP_VARIANTS.items()}}}
    g = _geometry(geometry)
    nat, pk = Layer(g, "native", n, b, mx.bfloat16), Layer(g, "k6v4-kivi", n, b, mx.bfloat16)
    variants = {"native": (nat.kernel(), nat.q, False)}
    base = pk.kernel()
    keep = lambda name: only is None or name in only   # noqa: E731
    for name, phases in VARIANTS.items():
        if not keep(name):
            continue
        kernel = _build(cut_source(phases), name.replace("-", "_"))

        def fn(q, kernel=kernel):
            with _launching(kernel):
                return base(q)
        variants[name] = (fn, pk.q, False)
    warp = pk.kernel(warp_pages=True)
    for name, cuts in WARP_VARIANTS.items():
        if not keep(name):
            continue
        kernel = _build(warp_cut_source(cuts), name.replace("-", "_"), warp=True)

        def fn(q, kernel=kernel):
            with _launching(kernel, "_warp_kernel"):
                return warp(q)
        variants[name] = (fn, pk.q, False)
    got, _ = paired(variants, calls, rounds)
    for family, base_name in ((VARIANTS, "full"), (WARP_VARIANTS, "warp")):
        if base_name in got:   # saved_us against the family's uncut kernel
            for name in family:
                if name in got:
                    got[name]["saved_us"] = round(got[base_name]["us"] - got[name]["us"], 2)
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="gpu:32768:8", help="GEOMETRY:CONTEXT:BATCH,...")
    ap.add_argument("--calls", type=int, default=50, help="dependent calls per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", default="",
                    help="comma-separated variant names to time (default: all; native always)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    only = set(args.variants.split(",")) if args.variants else None
    unknown = (only or set()) - set(VARIANTS) - set(WARP_VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; known: "
                 f"{sorted(VARIANTS) + sorted(WARP_VARIANTS)}")
    import mlx.core as mx
    rows = [r.split(":") for r in args.rows.split(",") if r]
    result = {"command": "python -m bench.device.page_key_phase_probe " + " ".join(argv or
                                                                                sys.argv[1:]),
              "device": str(mx.default_device()), "mlx": mx.__version__,
              "variants": {k: list(v) for k, v in {**VARIANTS, **WARP_VARIANTS}.items()},
              "rows": {}}
    for geometry, n, b in rows:
        t0 = time.perf_counter()
        got = probe_row(geometry, int(n), int(b), args.calls, args.rounds, only)
        result["rows"][f"{geometry}-ctx{n}-b{b}"] = got
        print(f"[page_key_phase_probe] {geometry} {n} {b}: {json.dumps(got)[:600]} "
              f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
