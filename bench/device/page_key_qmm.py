"""Page-key decode through MLX's quantized matmuls (engine/attention/page_qmm.py) or the CUDA
page-key kernel (engine/attention/cuda/page_key_decode.py) against native and the path they
replace on GPUs (tiled: every key dequantized each step), in one process.

    python -m bench.device.page_key_qmm --out RESULT.json          # the H200 run, <= 150 s
    python -m bench.device.page_key_qmm --tiny --out RESULT.json   # CPU smoke run, seconds
    # the CUDA kernel only (no qmm variant, no qmm check), ~4-5 minutes on the H200:
    python -m bench.device.page_key_qmm --kernel-only --budget-s 280 --out OUT/page-key-kernel.json

--kernel-only: variants k6v4-kivi:kernel and int4-kivi:kernel (KernelChoices.page_key_kernel
on); the correctness child runs bench/device/page_key_kernel_check.py instead of the qmm checks
(kernel and tiled decode attention through PackedLayerCache vs the store's dequantized
reference, max abs diffs, and one engine step's logits, kernel vs tiled); no attention-only
timing. Without CUDA (--tiny on the CPU) the kernel variants are left out and the JSON says
so (`kernel_left_out`: no CUDA device).

Steps, each progress line on stderr, the JSON rewritten after every row (a run cut short keeps
what it measured):
1. correctness, in a child process (a CUDA fault poisons its process's context, and MLX's CUDA
   quantized matmul has faulted on this machine before: docs/lab/benchmarks-kv.md): per row's
   geometry and batch, decode attention through page_qmm against the dequantized reference and
   the tiled path (max abs diff), the in-place gather_qmm shape (page_qmm.expert_attention)
   against its reference, and the logits of one engine decode step, qmm against tiled. If the
   child fails, the timing leaves the qmm variants out and says so.
2. decode timing per (geometry, context, batch): bench.kv's interleaved rounds
   (bench/kv_decode.py: native, then each variant, per round; paired ratios to native),
   pipelined as the engine decodes. Variants: k6v4-kivi:tiled-keys (the GPU path before),
   k6v4-kivi:qmm (float32 activations, the default), k6v4-kivi:qmm-bf16, int4-kivi:qmm.
3. attention only, one layer call of k6v4-kivi at the row's shape: page_qmm.expert_attention
   reading a pool of (page, head) blocks in place, against the same call on a gathered copy: what
   a store layout with contiguous (page, head) sections would save over today's per-step copy.

Geometries: bench.kv's "gpu" (~0.5B: 16 query / 4 KV heads, head dim 128, 8 layers) and the
Llama-3.1-8B attention shape (32 / 8 heads, head dim 128, hidden 4096, MLP 14336) with 2 layers
(random weights; the per-layer ratio is the model's, without the 30 other layers' build time).
Pages are bench.kv's 16 tokens.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

GEOMETRIES = {
    "llama8b-2l": dict(hidden_size=4096, num_hidden_layers=2, intermediate_size=14336,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40000),
    "tiny": dict(hidden_size=192, num_hidden_layers=2, intermediate_size=256,
                 num_attention_heads=6, num_key_value_heads=2, head_dim=64,
                 max_position_embeddings=4096),
}
# (geometry, context, batch): the three targets first, so a run cut short keeps them
ROWS = [("gpu", 4096, 1), ("gpu", 32768, 8), ("llama8b-2l", 4096, 8), ("gpu", 4096, 8)]
TINY_ROWS = [("tiny", 128, 1), ("tiny", 96, 2)]
VARIANTS = ["k6v4-kivi:tiled-keys", "k6v4-kivi:qmm", "k6v4-kivi:qmm-bf16", "int4-kivi:qmm"]
KERNEL_VARIANTS = ["k6v4-kivi:kernel", "int4-kivi:kernel"]
FORMAT_BITS = {"k6v4-kivi": (6, 4), "int4-kivi": (4, 4)}
TOLERANCE = 2e-3        # float32 throughout: a broken path is off by O(0.1-1)
BF16_TOLERANCE = 0.1    # bf16 activations (KernelChoices.page_key_qmm_bf16): 0.03-0.05 on the
                        # CPU at test shapes; compare 'native_bf16_like_vs_reference'


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.device.page_key_qmm",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke run)")
    ap.add_argument("--rows", default=None,
                    help="GEOMETRY:CONTEXT:BATCH,... instead of the default rows")
    ap.add_argument("--variants", default=None,
                    help="decode format specs beside native (bench/kv_decode.py's FORMAT:KERNEL;"
                         " default: the qmm variants, or the kernel ones with --kernel-only)")
    ap.add_argument("--kernel-only", action="store_true",
                    help="the CUDA page-key kernel's variants and check only (no qmm)")
    ap.add_argument("--steps", type=int, default=None, help="decode steps per round")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds per variant")
    ap.add_argument("--budget-s", type=float, default=135.0,
                    help="start no row that would end after this many seconds, judged by the "
                         "row before (rows left out are listed as skipped)")
    ap.add_argument("--check-only", type=Path, default=None, metavar="MODEL_ROOT",
                    help="the correctness step only, in this process, on the models built "
                         "under MODEL_ROOT (what the child runs)")
    args = ap.parse_args(argv)
    if args.rows:
        args.rows = [_row(r) for r in args.rows.split(",") if r]
    else:
        args.rows = TINY_ROWS if args.tiny else ROWS
    default = KERNEL_VARIANTS if args.kernel_only else VARIANTS
    args.variants = [v for v in (args.variants or ",".join(default)).split(",") if v]
    args.steps = args.steps or (2 if args.tiny else 8)
    args.repeats = args.repeats or (2 if args.tiny else 3)
    return args


def _row(text: str) -> tuple[str, int, int]:
    geometry, context, batch = text.split(":")
    return geometry, int(context), int(batch)


def _geometry(name: str) -> dict:
    from bench.kv import GEOMETRIES as KV_GEOMETRIES
    known = {**KV_GEOMETRIES, **GEOMETRIES}
    if name not in known:
        raise SystemExit(f"unknown geometry {name!r}; known: {', '.join(sorted(known))}")
    return known[name]


def _models(names, root: Path, build: bool = True) -> dict:
    """Each geometry's random-weight model, built under root (or, `build` off, loaded from
    there: the child process reads what its parent built)."""
    from bench.synthetic import build_tiny_model
    from engine.model.loader import load_model
    return {n: load_model(str(build_tiny_model("llama", root / n, **_geometry(n)) if build
                              else root / n))
            for n in sorted(set(names))}


def _maxdiff(a, b) -> float:
    import mlx.core as mx
    return float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item())


# ---- 1. correctness --------------------------------------------------------------------------

def attention_check(geometry: dict, context: int, batch: int, fmt: str) -> dict:
    """Decode attention of one layer over `context` tokens of random page-key history: page_qmm
    vs the dequantized reference and vs the tiled path; expert_attention vs its reference."""
    import mlx.core as mx
    from capacity.formats import KVFormat
    from engine.attention import page_qmm
    from engine.attention.choices import DEFAULT_KERNELS
    from engine.attention.packed import direct_attention
    from engine.kv.page_quant import PagePacked, dequantize_pages, quantize_pages
    from engine.kv.quant import PackedKV, dequantize, quantize
    from bench.kv_runners import PAGE_TOKENS as T

    kb, vb = FORMAT_BITS[fmt]
    hq, hkv, d = (geometry[k] for k in ("num_attention_heads", "num_key_value_heads",
                                         "head_dim"))
    P = context // T
    r = mx.random.split(mx.random.key(1), 5)
    k = mx.random.normal((batch, hkv, P, T, d), key=r[0]) + 4.0 * (mx.arange(d) == 1)
    v = mx.random.normal((batch, hkv, P * T, d), key=r[1])
    codes, scales, offsets = quantize_pages(k, kb)
    hist = PackedKV(PagePacked(codes.reshape(batch, hkv, P * T, -1), scales, offsets),
                    quantize(v, vb))
    q = mx.random.normal((batch, hq, 1, d), key=r[2])
    k_new = mx.random.normal((batch, hkv, 1, d), key=r[3])
    v_new = mx.random.normal((batch, hkv, 1, d), key=r[4])
    kw = dict(fmt=KVFormat(fmt, d), scale=d ** -0.5, new_mask=None)
    got = direct_attention(q, hist, k_new, v_new, **kw,
                           kernels=replace(DEFAULT_KERNELS, page_key_qmm=True))
    got16 = direct_attention(q, hist, k_new, v_new, **kw,
                             kernels=replace(DEFAULT_KERNELS, page_key_qmm=True,
                                             page_key_qmm_bf16=True))
    tiled = direct_attention(q, hist, k_new, v_new, **kw,
                             kernels=replace(DEFAULT_KERNELS, page_key_qmm=False,
                                             page_key_scores=False))
    kd = mx.concatenate([dequantize_pages(hist.k, kb), k_new], axis=2)
    vd = mx.concatenate([dequantize(hist.v, vb), v_new], axis=2)
    want = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), kd, vd, scale=d ** -0.5)
    # The in-place shape: this history as a pool of pages (sections apart), pages in order.
    page_major = lambda a: a.reshape(batch, hkv, P, T, -1).transpose(0, 2, 3, 1, 4).reshape(
        batch * P, T, hkv, -1)
    pool = page_qmm.page_experts(
        page_major(codes),
        *(a.transpose(0, 2, 1, 3).reshape(batch * P, hkv, d) for a in (scales, offsets)),
        *(page_major(a) for a in hist.v))
    tables = mx.arange(batch * P, dtype=mx.int32).reshape(batch, P)
    expert = page_qmm.expert_attention(q[:, :, 0], pool, tables, kb, vb, d ** -0.5)
    want_hist = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), kd[:, :, :-1],
                                                     vd[:, :, :-1], scale=d ** -0.5)
    out = {"qmm_vs_reference": _maxdiff(got, want), "qmm_vs_tiled": _maxdiff(got, tiled),
           "tiled_vs_reference": _maxdiff(tiled, want),
           "expert_in_place_vs_reference": _maxdiff(expert, want_hist[:, :, 0])}
    out["ok"] = all(x < TOLERANCE for x in out.values())
    out["qmm_bf16_vs_reference"] = _maxdiff(got16, want)
    # What attention over bf16-rounded q, K and V (native bf16 KV of these values) is off by.
    r16 = lambda a: a.astype(mx.bfloat16).astype(mx.float32)
    native_like = mx.fast.scaled_dot_product_attention(r16(q), r16(kd), r16(vd), scale=d ** -0.5)
    out["native_bf16_like_vs_reference"] = _maxdiff(native_like, want)
    out["ok_bf16"] = out["qmm_bf16_vs_reference"] < BF16_TOLERANCE
    out["reference_max_abs"] = float(mx.abs(want).max().item())   # the scale the diffs face
    return out


def logits_check(loaded, fmt: str, context: int, batch: int) -> dict:
    """One engine decode step over the same filled history: qmm vs tiled logits (reported, not
    gated: the model computes in bf16 on a GPU, so the two paths' roundings differ there)."""
    from bench.kv_decode import DecodeTimer
    from bench.kv_runners import PAGE_TOKENS
    pages = batch * -(-(context + 4) // PAGE_TOKENS)
    timers = [DecodeTimer(loaded, f"{fmt}:{k}", pages, batch, context, 4)
              for k in ("qmm", "tiled-keys")]
    from engine.sched.seq import Chunk
    logits = [t.runner.forward([Chunk(i, [7], t.pos, table) for i, table in enumerate(t.tables)])
              for t in timers]
    return {"qmm_vs_tiled_logits": _maxdiff(*logits)}


def check(args) -> dict:
    """The qmm checks where a qmm variant is asked for; the kernel's (under "kernel") where a
    kernel variant is."""
    from bench.kv_runners import PAGE_TOKENS, progress
    out = {}
    models = _models([g for g, _, _ in args.rows], args.check_only, build=False)
    if any(v.endswith(":kernel") for v in args.variants):
        from bench.device import page_key_kernel_check
        out["kernel"] = page_key_kernel_check.check(
            args.rows, models, {g: _geometry(g) for g, _, _ in args.rows}, FORMAT_BITS,
            PAGE_TOKENS, lambda m: progress(m, "page_key_qmm"),
            save=lambda rows: args.out.write_text(json.dumps({"kernel": rows}, indent=1)))
    for g, n, b in args.rows if any(":qmm" in v for v in args.variants) else ():
        for fmt in FORMAT_BITS:
            row = attention_check(_geometry(g), n, b, fmt)
            row.update(logits_check(models[g], fmt, min(n, 512), b))
            out[f"{g}-ctx{n}-b{b}-{fmt}"] = row
            progress(f"check {g} ctx {n} batch {b} {fmt}: {row}", "page_key_qmm")
    return out


def run_check_child(args, model_root: Path, budget_s: float) -> dict:
    """The correctness step in a child process; its JSON, or why there is none."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "check.json"
        cmd = [sys.executable, "-m", "bench.device.page_key_qmm", "--check-only",
               str(model_root), "--out", str(path),
               "--rows", ",".join(f"{g}:{n}:{b}" for g, n, b in args.rows),
               "--variants", ",".join(args.variants)]
        try:
            proc = subprocess.run(cmd, timeout=budget_s, stdout=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            # The kernel check saves as it goes: the rows it finished still count.
            done = json.loads(path.read_text()) if path.exists() else {}
            if done.get("kernel"):
                return {"kernel": done["kernel"],
                        "timed_out": f"correctness child ran past {budget_s:.0f} s"}
            return {"error": f"correctness child ran past {budget_s:.0f} s"}
        if proc.returncode != 0 or not path.exists():
            return {"error": f"correctness child exited {proc.returncode} (stderr above)"}
        return json.loads(path.read_text())


# ---- 3. attention only: in place vs a gathered copy ------------------------------------------

def in_place_timing(geometry: dict, context: int, batch: int, iters: int) -> dict:
    """ms per k6v4-kivi layer call of expert_attention, pages read in place vs copied first."""
    import mlx.core as mx
    from engine.attention import page_qmm
    from bench.kv_runners import PAGE_TOKENS as T
    hq, hkv, d = (geometry[k] for k in ("num_attention_heads", "num_key_value_heads",
                                         "head_dim"))
    P = context // T
    N = batch * P
    r = mx.random.split(mx.random.key(2), 6)
    words = lambda bits: mx.random.randint(0, 2 ** 31, (N, T, hkv, d * bits // 32),
                                           key=mx.random.key(bits)).astype(mx.uint32)
    pool = page_qmm.page_experts(words(6), mx.random.uniform(shape=(N, hkv, d), key=r[1]) * 0.1,
                                 mx.random.normal((N, hkv, d), key=r[2]), words(4),
                                 mx.random.uniform(shape=(N, T, hkv, d // 64), key=r[3]) * 0.1,
                                 mx.random.normal((N, T, hkv, d // 64), key=r[5]))
    mx.eval(*pool)
    perm = mx.random.permutation(N, key=r[0]).astype(mx.int32).reshape(batch, P)
    q = mx.random.normal((batch, hq, d), key=r[4])

    def in_place():
        return page_qmm.expert_attention(q, pool, perm, 6, 4, d ** -0.5)

    def copied():   # as the store does today: the step's pages gathered (copied) first
        part = page_qmm.page_experts(*(a[perm.reshape(-1)] for a in pool[:6]))
        tables = mx.arange(N, dtype=mx.int32).reshape(batch, P)
        return page_qmm.expert_attention(q, part, tables, 6, 4, d ** -0.5)

    out = {}
    for name, fn in (("in_place", in_place), ("copied", copied)) * 2:   # second pass timed
        mx.eval(fn())
        t0 = time.perf_counter()
        for _ in range(iters):
            mx.eval(fn())
        out[f"{name}_ms"] = round(1e3 * (time.perf_counter() - t0) / iters, 3)
    out["copy_over_in_place"] = round(out["copied_ms"] / out["in_place_ms"], 3)
    return out


# ---- 2. decode timing and the run ------------------------------------------------------------

def _left_out(checks: dict, flag: str, kernel: bool) -> str | None:
    """Why a variant's correctness step does not let it be timed (None: it does)."""
    if "error" in checks:
        return "correctness step failed: see 'correctness'"
    rows = checks.get("kernel", {}) if kernel else {k: v for k, v in checks.items()
                                                    if k != "kernel"}
    if "unavailable" in rows:
        return rows["unavailable"]
    rows = {k: v for k, v in rows.items() if isinstance(v, dict)}   # not notes
    if not rows or not all(r.get(flag) for r in rows.values()):
        return "correctness step failed or disagreed: see 'correctness'"
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    if args.check_only:
        args.out.write_text(json.dumps(check(args), indent=1))
        return 0
    import mlx.core as mx
    from bench.kv_decode import _interleaved_row
    from bench.kv_runners import PAGE_TOKENS, progress
    from engine.attention.choices import DEFAULT_KERNELS

    doc = {"command": "python -m bench.device.page_key_qmm " + " ".join(sys.argv[1:]),
           "device": str(mx.default_device()), "mlx": mx.__version__,
           "page_tokens": PAGE_TOKENS, "steps": args.steps, "repeats": args.repeats,
           "variants": args.variants, "rows": {}, "skipped": []}
    save = lambda: args.out.write_text(json.dumps(doc, indent=1))
    with tempfile.TemporaryDirectory() as tmp:
        progress("building the models", "page_key_qmm")
        models = _models([g for g, _, _ in args.rows], Path(tmp))
        left = args.budget_s - (time.perf_counter() - started)
        progress("correctness (child process)", "page_key_qmm")
        doc["correctness"] = run_check_child(args, Path(tmp), budget_s=max(20.0, 0.6 * left))
        save()
        variants, checks = args.variants, doc["correctness"]
        for flag, suffix in (("ok", ":qmm"), ("ok_bf16", ":qmm-bf16"), ("ok", ":kernel")):
            if not any(v.endswith(suffix) for v in variants):
                continue
            why = _left_out(checks, flag, suffix == ":kernel")
            if why:
                variants = [v for v in variants if not v.endswith(suffix)]
                doc[f"{suffix[1:]}_left_out"] = why
                progress(f"{suffix[1:]} left out: {why}", "page_key_qmm")
        last_row_s = 0.0   # a row that would not end within the budget is not started
        for g, n, b in args.rows:
            row_started = time.perf_counter()
            if row_started - started + last_row_s > args.budget_s:
                doc["skipped"].append(f"{g}:{n}:{b}")
                progress(f"skipped {g}:{n}:{b} (budget)", "page_key_qmm")
                continue
            room = args.steps * (args.repeats + 1)
            pages = b * -(-(n + room) // PAGE_TOKENS)
            try:
                row = _interleaved_row(models[g], variants, pages, b, n, room, args.steps,
                                       args.repeats, DEFAULT_KERNELS, pipelined=True)
            except Exception as e:   # a timed round failed: record it, run the other rows
                doc["rows"][f"{g}-ctx{n}-b{b}"] = {"error": f"{type(e).__name__}: {e}"[:300]}
                save()
                continue
            for spec, cell in row.items():
                cell["step_ms"] = round(1e3 * b / cell["tok_s"], 3) if "tok_s" in cell else None
                progress(f"{g} ctx {n} batch {b} {spec}: {cell.get('tok_s')} tok/s, paired "
                         f"{cell.get('ratio_paired_median')}", "page_key_qmm")
            if any(":qmm" in v for v in variants):
                try:
                    row["attention_only_k6v4"] = in_place_timing(_geometry(g), n, b,
                                                                 iters=3 if args.tiny else 10)
                except Exception as e:   # a missing kernel: record it, keep the decode rows
                    row["attention_only_k6v4"] = {"error": f"{type(e).__name__}: {e}"[:300]}
                progress(f"{g} ctx {n} batch {b} attention only: "
                         f"{row['attention_only_k6v4']}", "page_key_qmm")
            last_row_s = time.perf_counter() - row_started
            row["seconds"] = round(last_row_s, 1)
            doc["rows"][f"{g}-ctx{n}-b{b}"] = row
            save()
    doc["seconds"] = round(time.perf_counter() - started, 1)
    save()
    progress(f"done in {doc['seconds']} s: {args.out}", "page_key_qmm")
    return 0


if __name__ == "__main__":
    sys.exit(main())
