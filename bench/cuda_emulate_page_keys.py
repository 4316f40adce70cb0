"""The page-key decode kernel (engine/attention/cuda/page_key_decode_source.py) on the CPU
emulator (bench/cuda_emulate.py: one fiber per GPU thread), and the check case it and the
device bench share: history written through a real PageKeyStore (quantize-on-fill, native
tail), the reference its own dequantized `gather` (page_quant.dequantize_pages for full pages,
the native tail for the partial one) and a plain float64 softmax.

    python -m bench.cuda_emulate_page_keys     # the check cases, exit 1 if one fails
    python -m bench.cuda_emulate_page_keys --mma            # the tensor-core score pass
    python -m bench.cuda_emulate_page_keys --mma --device   # the same cases on a CUDA GPU
    python -m bench.cuda_emulate_page_keys --narrow-copies  # 8-byte key-code copies
    python -m bench.cuda_emulate_page_keys --warp-pages     # the warp-page kernel's cases
    python -m bench.cuda_emulate_page_keys --block-tiled    # the block-tiled one everywhere
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from bench import cuda_emulate as ce
from engine.attention.choices import DEFAULT_KERNELS

# The kernel's key-code copies as the engine launches it by default (16-byte pieces).
WIDE = DEFAULT_KERNELS.page_key_wide_copies
# ... and the warp-page kernel (KernelChoices.page_key_warp_pages) at the page sizes it takes.
WARP = DEFAULT_KERNELS.page_key_warp_pages
TOLERANCE = 0.02   # bf16 output of float32 math against float64 on the same (dequantized) keys


def engine_kernel_is_warp(page_tokens: int, warp_pages: bool | None) -> bool:
    """Whether a launch at `page_tokens` asks for the warp-page kernel: `warp_pages` where
    given, else as the engine does (KernelChoices.page_key_warp_at)."""
    return DEFAULT_KERNELS.page_key_warp_at(page_tokens) if warp_pages is None else warp_pages


def page_key_decode(q, k_new, v_new, pool, layout, k_bits, tail, tables, ends, tail_slots,
                    scale, target_blocks=None, workdir: Path | None = None,
                    mma: bool = False, wide_copies: bool = WIDE,
                    warp_pages: bool | None = None, warp_shape=None) -> np.ndarray:
    """page_key_decode_attention's contract run here (numpy tables, ends, tail_slots; mx
    arrays otherwise, bf16 q, fresh rows and tail), with the host side's split plan and, with
    several splits, the merge kernel. Returns [B, Hq, 1, D] float32 (from the bf16 output
    unless q is float32). `mma`: the kernel's tensor-core score pass; `wide_copies`: its key
    codes in 16-byte pieces; `warp_pages`: the warp-page kernel instead
    (page_key_warp_decode_source.py; None: where the engine takes it) of `warp_shape` (warps a
    block, copy stages a warp; None: page_key_decode.WARP_SHAPE)."""
    return _decode(q, k_new, v_new, pool, layout, k_bits, tail, tables, ends, tail_slots, scale,
                   target_blocks, None, workdir, mma, wide_copies, warp_pages, warp_shape)[0]


def page_key_decode_own(q, k_new, v_new, pool, layout, k_bits, tail, tables, ends, tail_slots,
                        scale, tail_write, target_blocks=None, workdir: Path | None = None,
                        warp_pages: bool | None = None):
    """The OWN variant (`tail_write`: each row's slot for its own row): (the output as
    `page_key_decode` returns it, the pool and (K, V) tails as the launch left them, mx)."""
    import mlx.core as mx
    out, (written, kt, vt) = _decode(q, k_new, v_new, pool, layout, k_bits, tail, tables, ends,
                                     tail_slots, scale, target_blocks, tail_write, workdir,
                                     warp_pages=warp_pages)
    return out, mx.array(written), tuple(mx.array(a).astype(tail[0].dtype) for a in (kt, vt))


def _decode(q, k_new, v_new, pool, layout, k_bits, tail, tables, ends, tail_slots, scale,
            target_blocks, tail_write, workdir, mma: bool = False, wide_copies: bool = WIDE,
            warp_pages: bool | None = None, warp_shape=None):
    import mlx.core as mx

    from engine.attention.cuda import page_key_decode as pk
    from engine.attention.cuda import page_key_decode_source as src
    from engine.attention.cuda import page_key_warp_decode_source as warp_src
    from engine.attention.cuda import page_key_write as pw
    from engine.attention.cuda import paged_decode as pd
    from engine.attention.cuda import tile_helpers
    workdir = workdir or Path(tempfile.mkdtemp(prefix="orchard_emulate_"))
    rows, hq, _, d = q.shape
    kvh = k_new.shape[1]
    if not pk.supports(k_bits, 4, d, hq // kvh, layout.page_tokens):
        raise ValueError("page-key kernel: unsupported shape")
    pk.check_layout(pool, layout, d, k_bits, kvh)
    tables, ends = np.asarray(tables, np.int32), np.asarray(ends, np.int32)
    # Activations and the tail as the engine holds them: float32 stores (the CPU) run the
    # kernel in float32 types, anything else is rounded to bfloat16.
    types = {"pool": "uint32", "pages": "int32", "ends": "int32", "tslot": "int32",
             "dims": "int32", "scale": "float32", "tw": "int32"}
    data = {}
    for name, a in zip(("q", "kf", "vf", "kt", "vt"), (q, k_new, v_new, *tail)):
        wide = a.dtype == mx.float32
        types[name] = "float32" if wide else "bfloat16"
        data[name] = np.array(a) if wide else ce._bits16(a)
    own = tail_write is not None
    slots = np.asarray(tail_slots, np.int32)
    arrays = [data["q"], data["kf"], data["vf"], np.array(pool), data["kt"], data["vt"],
              tables, ends, slots, np.array([hq, kvh, tables.shape[1]], np.int32),
              np.array([scale], np.float32), np.asarray(tail_write, np.int32) if own else slots]
    shape = warp_shape or pk.WARP_SHAPE
    warp, splits = pk.split_plan(layout, rows, kvh, int(ends.max()),
                                 engine_kernel_is_warp(layout.page_tokens, warp_pages), shape,
                                 target_blocks, None)
    parts = rows * hq * (splits if splits > 1 else 1)
    if warp:
        template = [*pk.warp_template(d, hq // kvh, layout, k_bits, types["q"], types["kf"],
                                      types["kt"], own, shape), ("SPLIT", splits > 1),
                    ("TO", types["q"])]
    else:
        template = [("D", d), ("G", hq // kvh), ("PT", layout.page_tokens), ("HK", kvh),
                    ("KB", k_bits), ("TQ", types["q"]), ("TK", types["kf"]),
                    ("TT", types["kt"]), ("OWN", own), ("MMA", mma), ("WKC", wide_copies),
                    ("SPLIT", splits > 1), ("TO", types["q"])]
    outputs = [("out", types["q"]), ("part", "float32"), ("ml", "float32")]
    out, part, ml, *written = ce.run(
        "orchard_page_key_decode", [(n, types[n]) for n in src.INPUTS], outputs,
        warp_src._SOURCE if warp else src._SOURCE,
        tile_helpers.HELPERS + src.PAGE_KEY_HELPERS + pw.helpers(), template, arrays,
        [(rows, hq, 1, d), (parts, d), (parts, 2)], (rows * kvh, splits),
        32 * shape[0] if warp else pd.THREADS, workdir,
        writes=(3, 4, 5) if own else ())
    if splits > 1:
        out = ce.merge(part, ml, splits, (rows, hq, 1, d), types["q"], workdir)
    return out, written


def page_key_dequant(k_fresh, v_fresh, pool, layout, k_bits, tail, pages, bounds, tail_slots,
                     span, workdir: Path | None = None):
    """The prefill history-dequant kernel (cuda/page_key_dequant.py) run here with
    `dequantized_history`'s signature and launch; keys and values [B, Hkv, span + W, D] as mx
    arrays in k_fresh's dtype (float32 or bfloat16, as the kernel's outputs are)."""
    import mlx.core as mx

    from engine.attention.cuda import page_key_dequant as pq
    workdir = workdir or Path(tempfile.mkdtemp(prefix="orchard_emulate_"))
    b, hkv, w, d = k_fresh.shape
    pages, bounds = np.asarray(pages, np.int32), np.asarray(bounds, np.int32)
    units = b * hkv * (span + w) * (d // 8)
    wide = k_fresh.dtype == mx.float32
    to = "float32" if wide else "bfloat16"
    tt = "float32" if tail[0].dtype == mx.float32 else "bfloat16"
    cast = lambda a, kind: np.array(a) if kind == "float32" else ce._bits16(a)
    types = {"kf": to, "vf": to, "pool": "uint32", "kt": tt, "vt": tt, "pages": "int32",
             "bounds": "int32", "tslot": "int32", "dims": "int32"}
    out = ce.run(
        "orchard_page_key_dequant", [(n, types[n]) for n in pq.INPUTS],
        [(n, to) for n in pq.OUTPUTS], pq._SOURCE, "",
        [*pq.template(d, layout.page_tokens, hkv, k_bits), ("TO", to), ("TT", tt)],
        [cast(k_fresh, to), cast(v_fresh.astype(k_fresh.dtype), to), np.array(pool),
         cast(tail[0], tt), cast(tail[1], tt), pages, bounds, np.asarray(tail_slots, np.int32),
         np.array([b, hkv, span, w, pages.shape[1]], np.int32)],
        [(b, hkv, span + w, d)] * 2, (-(-units // pq.THREADS), 1), pq.THREADS, workdir)
    return tuple(mx.array(a).astype(k_fresh.dtype) for a in out)


def page_key_write(k, v, pool, layout, k_bits, tail, page, offset, tail_before, tail_write,
                   in_place: bool = True, workdir: Path | None = None):
    """The page-key write kernel (cuda/page_key_write.py) run here with `write_decode`'s
    signature and launch (float32 or bfloat16 rows and tails, as the engine holds them).
    Returns (the pool as the kernel left it, (K, V) tails: as the kernel left them in place, or
    the new ones) as mx arrays."""
    import mlx.core as mx

    from engine.attention.cuda import page_key_write as pw
    workdir = workdir or Path(tempfile.mkdtemp(prefix="orchard_emulate_"))
    n, h, d = k.shape
    kt, vt = tail
    pw.check_layout(pool, layout, d, k_bits, h)
    t, slots = layout.page_tokens, kt.shape[0]
    kind = lambda a: "float32" if a.dtype == mx.float32 else "bfloat16"
    cast = lambda a: np.array(a) if a.dtype == mx.float32 else ce._bits16(a)
    ti, tt = kind(k), kind(kt)
    types = {"k": ti, "v": ti, "pool": "uint32", "kt": tt, "vt": tt, "page": "int32",
             "off": "int32", "tb": "int32", "tw": "int32", "dims": "int32"}
    ints = [np.asarray(a, np.int32) for a in (page, offset, tail_before, tail_write)]
    warps = pw.grid_warps(n, h, slots, t, in_place)
    shapes, _ = pw.tail_outputs(tail, in_place)
    kt1, vt1, written, kt_in, vt_in = ce.run(
        "orchard_page_key_write", [(m, types[m]) for m in pw.INPUTS],
        [(m, tt) for m in pw.OUTPUTS], pw._SOURCE, pw.helpers(),
        pw.template(d, t, h, k_bits, ti, tt, in_place),
        [cast(k), cast(v.astype(k.dtype)), np.array(pool), cast(kt), cast(vt), *ints,
         np.array([n, slots], np.int32)],
        shapes, (-(-warps // pw.WARPS), 1), pw.WARPS * 32, workdir, writes=(2, 3, 4))
    tails = tuple(mx.array(a).astype(kt.dtype)
                  for a in ((kt_in, vt_in) if in_place else (kt1, vt1)))
    return mx.array(written), tails


def page_key_store(rng, fmt_name: str, hist, kvh: int, d: int, page_tokens: int):
    """A PageKeyStore holding history of hist[b] tokens per row, each row written by one write
    (so its full pages are key-quantized on fill, its partial page kept in the native tail), on
    shuffled page ids. Keys get a few wide channels (what per-channel page scales are for).
    Returns (store, tables [B, P] int32, tail slots [B] int32: -1 where no partial page)."""
    import mlx.core as mx

    from capacity.formats import KVFormat
    from engine.kv.page_key_store import PageKeyStore
    from engine.kv.store import Slots
    from engine.kv.tails import TailMap
    from engine.model.loader import LayerGeometry
    t = page_tokens
    hist = np.asarray(hist)
    need = [int(h) // t + 1 for h in hist]          # pages covering history + the own key
    ids = rng.permutation(sum(need) + 3).astype(np.int32)
    fmt = KVFormat(fmt_name, d, "bfloat16", page_tokens=t)
    store = PageKeyStore(LayerGeometry(0, "full", kvh, d, d), fmt, len(ids), t,
                         tails=TailMap(len(hist), t))
    tables = np.empty((len(hist), max(need)), np.int32)
    at = 0
    wide = np.ones(d, np.float32)
    wide[rng.choice(d, 3, replace=False)] = 8.0
    for b, h in enumerate(hist):
        row = ids[at:at + need[b]]
        at += need[b]
        tables[b, :len(row)] = row
        tables[b, len(row):] = row[0]
        if h:
            pos = np.arange(h)
            k = rng.standard_normal((h, kvh, d)).astype(np.float32) * wide
            v = rng.standard_normal((h, kvh, d)).astype(np.float32)
            store.write(Slots(row[pos // t], pos % t), mx.array(k).astype(mx.bfloat16),
                        mx.array(v).astype(mx.bfloat16))
            store.flush_tail()
    slots = np.array([store.tails.slot_of.get(int(tables[b, h // t]), -1) if h % t else -1
                      for b, h in enumerate(hist)], np.int32)
    return store, tables, slots


def reference(q, k_new, v_new, store, tables, hist, scale) -> np.ndarray:
    """[B, Hq, 1, D] float64: each row's history as the store's `gather` dequantizes it (full
    pages from their codes, the partial page from its native tail), then its own key; one
    softmax per query head."""
    import mlx.core as mx
    k_hist, v_hist = (np.array(a.astype(mx.float32), np.float64)
                      for a in store.gather(mx.array(tables)))
    qf, kf, vf = (np.array(a.astype(mx.float32), np.float64) for a in (q, k_new, v_new))
    rows, hq, _, d = qf.shape
    group = hq // kf.shape[1]
    out = np.zeros((rows, hq, 1, d))
    for b, h in enumerate(hist):
        for head in range(hq):
            kv = head // group
            keys = np.concatenate([k_hist[b, kv, :h], kf[b, kv]], axis=0)
            vals = np.concatenate([v_hist[b, kv, :h], vf[b, kv]], axis=0)
            s = keys @ qf[b, head, 0] * scale
            p = np.exp(s - s.max())
            out[b, head, 0] = p @ vals / p.sum()
    return out


def page_key_case(rng, fmt_name: str, hist, hq: int, kvh: int, d: int, page_tokens: int = 16,
                  kernel=None, target_blocks=None, mma: bool = False,
                  wide_copies: bool = WIDE, warp_pages: bool | None = None,
                  warp_shape=None) -> dict:
    """One check: rows of hist[b] history tokens (ragged; partial tails where hist % pages),
    `kernel` with page_key_decode_attention's signature (None: the CUDA kernel itself, with
    its tensor-core score pass if `mma`) against `reference`. Returns a JSON-able dict with
    max_abs_err and ok."""
    import mlx.core as mx

    from engine.attention.cuda import page_key_decode as pk
    hist = np.asarray(hist, np.int64)
    warp_pages = engine_kernel_is_warp(page_tokens, warp_pages)
    bits = 6 if fmt_name.startswith("k6") else 4
    store, tables, slots = page_key_store(rng, fmt_name, hist, kvh, d, page_tokens)
    rows = len(hist)

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.bfloat16)

    q, k_new, v_new = normal(rows, hq, 1, d), normal(rows, kvh, 1, d), normal(rows, kvh, 1, d)
    scale = d ** -0.5
    ends = (hist + 1).astype(np.int32)
    args = (q, k_new, v_new, store.pool, store.layout, bits, store.tail)
    if kernel is None:
        got = pk.page_key_decode_attention(*args, mx.array(tables), mx.array(ends),
                                           mx.array(slots), int(ends.max()), scale,
                                           target_blocks, mma=mma, wide_copies=wide_copies,
                                           warp_pages=warp_pages,
                                           warp_shape=warp_shape or pk.WARP_SHAPE)
        got = np.array(got.astype(mx.float32))
    else:
        got = kernel(*args, tables, ends, slots, scale, target_blocks)
    ref = reference(q, k_new, v_new, store, tables, hist, scale)
    err = float(np.nanmax(np.abs(got - ref))) if np.isfinite(got).all() else float("inf")
    shape = warp_shape or pk.WARP_SHAPE
    warp, splits = pk.split_plan(store.layout, rows, kvh, int(ends.max()), warp_pages, shape,
                                 target_blocks, None)
    name = (f"page-key-{fmt_name}{'-mma' * mma}{'-narrow' * (not wide_copies)}"
            f"{'-warp-pages' * warp}")
    return {"kernel": name, "rows": rows, "hq": hq, "kvh": kvh,
            "head_dim": d, "page_tokens": page_tokens, "history": hist.tolist(),
            "splits": splits,
            "warp_shape": list(shape) if warp else None,
            "max_abs_err": round(err, 5), "ok": bool(err < TOLERANCE)}


# (format, history per row, hq, kvh, head dim, page tokens, split target)
CASES = [
    ("k6v4-kivi", (37,), 8, 2, 64, 16, None),
    ("int4-kivi", (200, 0, 77), 12, 4, 128, 16, None),
    ("k6v4-kivi", (300, 64, 129), 16, 2, 128, 32, 8),
    ("int4-kivi", (130, 15), 6, 2, 64, 64, None),
    ("k6v4-kivi", (700, 47, 192), 9, 3, 64, 16, 16),
]

# The warp-page kernel's cases: GQA 1, 4, 7 and 8, head dims 64 and 128, pages of 16, 32 and
# 64 (a page's quarters sharing its key metadata), ragged rows, empty history, splits (a warp
# with no pages, a split holding only the tail).
WARP_CASES = [
    ("k6v4-kivi", (37,), 8, 2, 64, 16, None),
    ("int4-kivi", (200, 0, 77), 16, 4, 128, 16, None),
    ("k6v4-kivi", (300, 64, 129), 16, 2, 128, 16, 8),
    ("k6v4-kivi", (700, 47, 192), 14, 2, 128, 16, 16),
    ("int4-kivi", (130, 15), 8, 8, 64, 16, None),
    ("k6v4-kivi", (700, 64, 129), 16, 2, 128, 64, 16),
    ("int4-kivi", (300, 0, 77), 8, 4, 64, 64, None),
    ("k6v4-kivi", (600, 45), 12, 3, 128, 32, 16),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=len(CASES), help="run the first N cases")
    ap.add_argument("--mma", action="store_true",
                    help="the kernel's tensor-core score pass (KernelChoices.page_key_mma)")
    ap.add_argument("--narrow-copies", action="store_true",
                    help="key codes in 8-byte pieces (KernelChoices.page_key_wide_copies off)")
    ap.add_argument("--warp-pages", action="store_true",
                    help="the warp-page kernel's own cases (pages of 16-64; the engine takes it "
                         "at KernelChoices.page_key_warp_page_tokens)")
    ap.add_argument("--block-tiled", action="store_true",
                    help="the block-tiled kernel at every page size (warp pages off)")
    ap.add_argument("--warp-shape", default="4x2",
                    help="the warp-page kernel's WARPSxSTAGES (KernelChoices.page_key_warp_shape)")
    ap.add_argument("--device", action="store_true",
                    help="run the cases on the CUDA device (MLX's cuda_kernel), not emulated")
    args = ap.parse_args(argv)
    shape = tuple(int(x) for x in args.warp_shape.split("x"))
    # --mma and --narrow-copies are the block-tiled kernel's choices: they take it everywhere;
    # else --warp-pages takes the warp-page kernel everywhere, and None follows the engine
    warp = None if not args.warp_pages else True
    if args.block_tiled or args.mma or args.narrow_copies:
        warp = False

    def check(rng, work, fmt, hist, hq, kvh, d, pt, target):
        def kernel(*a):
            return page_key_decode(*a, workdir=work, mma=args.mma,
                                   wide_copies=not args.narrow_copies,
                                   warp_pages=warp, warp_shape=shape)
        return page_key_case(rng, fmt, hist, hq, kvh, d, pt, None if args.device else kernel,
                             target, args.mma, not args.narrow_copies, warp, shape)
    cases = WARP_CASES if args.warp_pages else CASES
    return ce.run_cases(cases[:args.limit], check)


if __name__ == "__main__":
    raise SystemExit(main())
