"""Check the CUDA attention and write kernels against references on the GPU; print (save) JSON.

    python -m bench.cuda_check --out cuda_check.json

Runs only where MLX has a CUDA device (the kernels' only backend; the CPU suite runs their
sources on bench/cuda_emulate.py). References: the native kernel (and its OWN variant, which
writes the step's own keys into the pages) against float32 numpy attention over the gathered
rows; packed decode, prefill (tiles, `--kernels dequant`: the history-dequant path) and write
kernels against the engine's own direct packed attention (engine.attention.packed, FP32) or
packed records, row by row, over packed pages built as the engine stores them (one uint32 pool
per layer, engine/kv/page_layout.py). Page tables are random permutations and row lengths
random (rows long enough to split, rows with no history, NaN chunk padding, pinned splits).
Exit status 1 if any case exceeds its tolerance.
"""
from __future__ import annotations

import argparse
import json
import sys

import mlx.core as mx
import numpy as np

from capacity.formats import KVFormat
from bench.output import emit
from engine.attention.cuda import packed_decode as cuda_packed_decode
from engine.attention.cuda import packed_decode_v2 as cuda_packed_decode_v2
from engine.attention.cuda import packed_dequant as cuda_packed_dequant
from engine.attention.cuda import packed_prefill as cuda_packed_prefill
from engine.attention.cuda import packed_write as cuda_packed_write
from engine.attention.cuda import paged_decode as cuda_paged_decode
from engine.attention.cuda.tile_helpers import kernel_layout
from engine.attention.packed import direct_attention
from engine.kv.page_layout import K_SECTIONS, SECTIONS, V_SECTIONS, PageLayout, packed_record
from engine.kv.quant import Packed, PackedKV, quantize
from engine.kv.rotation import rotate

# bf16 output rounding is 2^-8 relative; outputs are O(1) averages of unit-normal values.
TOLERANCE = 0.03


def _max_err(got, ref) -> float:
    """Largest absolute difference; inf if any is NaN or inf (a NaN the kernel left would
    otherwise vanish: max(err, nan) keeps err)."""
    diff = np.abs(np.asarray(got, np.float64) - np.asarray(ref, np.float64))
    return float(diff.max()) if np.isfinite(diff).all() else float("inf")


def _tables(rng, rows: int, lengths: np.ndarray, page_tokens: int):
    per = -(-int(lengths.max()) // page_tokens)
    perm = rng.permutation(rows * per).astype(np.int32)
    return perm.reshape(rows, per), rows * per


def packed_history(rng, layout: PageLayout, num_pages: int, tables: np.ndarray,
                   history: np.ndarray, d: int, k_bits: int, v_bits: int):
    """(pool, per_row): `history[b]` random rows of row b quantized (keys rotated) and written
    at its positions 0.. through page table `tables[b]` into a fresh pool of `layout`;
    per_row[b] = (K, V) Packed [n, heads, ...] or None for a row without history."""
    pool = layout.zeros(num_pages)
    per_row = []
    for b, n in enumerate(int(x) for x in history):
        if n == 0:
            per_row.append(None)
            continue
        k = mx.array(rng.standard_normal((n, layout.heads, d)).astype(np.float32))
        v = mx.array(rng.standard_normal((n, layout.heads, d)).astype(np.float32))
        kq, vq = quantize(rotate(k), k_bits), quantize(v, v_bits)
        per_row.append((kq, vq))
        pos = np.arange(n)
        layout.write_rows(pool, layout.row_index(tables[b][pos // layout.page_tokens],
                                                 pos % layout.page_tokens),
                          packed_record(kq, vq))
    return pool, per_row


def _history_kv(packed) -> PackedKV | None:
    """A row's packed history (K, V Packed [n, heads, ...]) as direct_attention takes it."""
    if packed is None:
        return None
    kq, vq = packed
    return PackedKV(*(Packed(*(mx.expand_dims(a.swapaxes(0, 1), 0) for a in side))
                      for side in (kq, vq)))


def native_case(rng, rows, hq, kvh, d, longest, page_tokens=64) -> dict:
    """The native kernel over pages holding every row's keys, and its OWN variant (it attends
    to each row's last key from its inputs and writes it to its slot, which starts poisoned):
    both against float32 numpy attention; OWN must also leave exactly the written pages."""
    lengths = rng.integers(1, longest + 1, rows)
    lengths[0] = longest   # the longest row sets the split plan
    tables, num_pages = _tables(rng, rows, lengths, page_tokens)
    kp = rng.standard_normal((kvh, num_pages, page_tokens, d)).astype(np.float32)
    vp = rng.standard_normal((kvh, num_pages, page_tokens, d)).astype(np.float32)
    q = rng.standard_normal((rows, hq, 1, d)).astype(np.float32)
    kb, vb, qb = (mx.array(a).astype(mx.bfloat16) for a in (kp, vp, q))
    scale = d ** -0.5
    ends = mx.array(lengths.astype(np.int32))
    out = cuda_paged_decode.paged_decode_attention(
        qb, kb, vb, mx.array(tables), ends, scale, int(lengths.max()))
    got = np.array(out.astype(mx.float32))
    kp, vp, q = (np.array(a.astype(mx.float32)) for a in (kb, vb, qb))
    slots = [(tables[b, (n - 1) // page_tokens], (n - 1) % page_tokens)
             for b, n in enumerate(lengths)]
    kn, vn = (np.stack([a[:, page, off] for page, off in slots])[:, :, None] for a in (kp, vp))
    k_poisoned, v_poisoned = kp.copy(), vp.copy()
    for page, off in slots:
        k_poisoned[:, page, off] = v_poisoned[:, page, off] = 1e4
    kw, vw = (mx.array(a).astype(mx.bfloat16) for a in (k_poisoned, v_poisoned))
    own = cuda_paged_decode.paged_decode_attention(
        qb, kw, vw, mx.array(tables), ends, scale, int(lengths.max()),
        own=tuple(mx.array(a).astype(mx.bfloat16) for a in (kn, vn)))
    got_own = np.array(own.astype(mx.float32))   # the pages are read after the kernel ran
    written = sum(_max_err(np.array(w.astype(mx.float32)), a) for w, a in ((kw, kp), (vw, vp)))
    err = 0.0
    for b in range(rows):
        n = int(lengths[b])
        keys = kp[:, tables[b]].reshape(kvh, -1, d)[:, :n]
        vals = vp[:, tables[b]].reshape(kvh, -1, d)[:, :n]
        for h in range(hq):
            s = keys[h // (hq // kvh)] @ q[b, h, 0] * scale
            p = np.exp(s - s.max())
            ref = (p / p.sum()) @ vals[h // (hq // kvh)]
            err = max(err, _max_err(got[b, h, 0], ref), _max_err(got_own[b, h, 0], ref))
    same = bool(np.array_equal(got, got_own))
    return {"kernel": "native", "rows": rows, "hq": hq, "kvh": kvh, "head_dim": d,
            "longest": longest, "splits": cuda_paged_decode.split_count(rows, kvh, longest),
            "max_abs_err": round(err, 5), "own_equals_plain": same, "own_pages_err": written,
            "ok": err < TOLERANCE and written == 0.0 and same}


def reference_packed_decode(q, k_new, v_new, pool, layout, bits, tables, ends, scale):
    """What the packed kernel computes, in float64 numpy, with the kernel's own arithmetic:
    token-major packed pages (the pool's sections, read through `layout`) by page table,
    scores of packed keys as
    scale_g * (q_rot . codes) + offset_g * sum(q_rot) per 64-channel group, values dequantized,
    the step's own key (model basis, full precision) last, one softmax. [B, Hq, 1, D]."""
    q = np.array(q.astype(mx.float32), np.float64)
    qr = np.array(rotate(q_arr := mx.array(q.astype(np.float32))), np.float64)
    del q_arr
    kf, vf = (np.array(a.astype(mx.float32), np.float64) for a in (k_new, v_new))
    kc, ks, ko = (np.array(layout.section(pool, name)) for name in K_SECTIONS)
    vc, vs, vo = (np.array(layout.section(pool, name)) for name in V_SECTIONS)
    rows, hq, _, d = q.shape
    kvh, page_tokens = kf.shape[1], layout.page_tokens
    shifts = np.arange(0, 32, bits, dtype=np.uint32)

    def unpack(words):   # [..., W] uint32 -> [..., D] codes
        return ((words[..., None] >> shifts) & ((1 << bits) - 1)).reshape(*words.shape[:-1], d)

    out = np.zeros((rows, hq, 1, d))
    for b in range(rows):
        n = int(ends[b]) - 1
        pos = np.arange(n)
        page, off = np.asarray(tables[b])[pos // page_tokens], pos % page_tokens
        for h in range(hq):
            hk = h // (hq // kvh)
            codes = unpack(kc[page, off, hk]).reshape(n, d // 64, 64)
            qg = (qr[b, h, 0] * scale).reshape(d // 64, 64)
            s = ((codes * qg).sum(-1) * ks[page, off, hk] + ko[page, off, hk] * qg.sum(-1)).sum(-1)
            vals = (unpack(vc[page, off, hk]).reshape(n, d // 64, 64) * vs[page, off, hk][..., None]
                    + vo[page, off, hk][..., None]).reshape(n, d)
            s = np.append(s, q[b, h, 0] @ kf[b, hk, 0] * scale)
            vals = np.concatenate([vals, vf[b, hk, 0][None]])
            p = np.exp(s - s.max())
            out[b, h, 0] = (p / p.sum()) @ vals
    return out


def packed_case(rng, fmt_name, rows, hq, kvh, d, longest, page_tokens=16,
                kernel=None, version="v1", target_blocks=None) -> dict:
    """`kernel` (default: the CUDA kernel `version`, split plan aiming at `target_blocks`) has
    packed_decode_attention's signature; the CPU test passes `reference_packed_decode` to check
    this harness and the layout it encodes."""
    fmt = KVFormat(fmt_name, d, "bfloat16")
    bits = fmt.k_bits
    hist = rng.integers(0, longest, rows)      # history rows before this step's own key
    hist[0] = longest - 1
    hist[-1] = 0 if rows > 1 else hist[-1]
    tables, num_pages = _tables(rng, rows, hist + 1, page_tokens)
    layout = kernel_layout(page_tokens, kvh, d, bits, bits)
    pool, per_row = packed_history(rng, layout, num_pages, tables, hist, d, bits, bits)
    q = mx.array(rng.standard_normal((rows, hq, 1, d)).astype(np.float32)).astype(mx.bfloat16)
    k_new = mx.array(rng.standard_normal((rows, kvh, 1, d)).astype(np.float32)).astype(mx.bfloat16)
    v_new = mx.array(rng.standard_normal((rows, kvh, 1, d)).astype(np.float32)).astype(mx.bfloat16)
    scale = d ** -0.5
    ends = (hist + 1).astype(np.int32)
    if kernel is None:
        got = cuda_packed_decode.packed_decode_attention(
            q, k_new, v_new, pool, layout, bits, mx.array(tables), mx.array(ends),
            int(ends.max()), scale, target_blocks, version=version)
        got = np.array(got.astype(mx.float32))
    else:
        got = kernel(q, k_new, v_new, pool, layout, bits, tables, ends, scale)
    err = 0.0
    for b, packed in enumerate(per_row):
        ref = direct_attention(q[b:b + 1], _history_kv(packed), k_new[b:b + 1], v_new[b:b + 1],
                               fmt=fmt, scale=scale, new_mask=None)
        err = max(err, _max_err(got[b], np.array(ref.astype(mx.float32))[0]))
    name = "packed" if version == "v1" else f"packed-{version}"
    return {"kernel": f"{name}-{fmt_name}", "rows": rows, "hq": hq, "kvh": kvh, "head_dim": d,
            "page_tokens": page_tokens, "longest": int(ends.max()),
            "splits": cuda_paged_decode.split_count(
                rows, kvh, int(ends.max()),
                target_blocks or (cuda_packed_decode_v2.TARGET_BLOCKS if version == "v2" else None)),
            "max_abs_err": round(err, 5), "ok": bool(err < TOLERANCE)}


def reference_packed_prefill(q, k_new, v_new, pool, layout, k_bits, v_bits, pages, bounds,
                             longest_history, scale, splits=None):
    """What the prefill kernel computes, in float64 numpy (packed_prefill_attention's
    signature): row b's first bounds[b, 0] history keys read from the pool's sections (through
    `layout`) by page table and dequantized, scored with the rotated query; then its own keys
    0..i (model basis) at position i < bounds[b, 1]; one softmax. Positions past a row's length
    are zero here."""
    del longest_history, splits
    qf = np.array(q.astype(mx.float32), np.float64)
    qr = np.array(rotate(q.astype(mx.float32)), np.float64)
    kf, vf = (np.array(a.astype(mx.float32), np.float64) for a in (k_new, v_new))
    pools = [[np.array(layout.section(pool, name)) for name in side]
             for side in (K_SECTIONS, V_SECTIONS)]
    pages, bounds = np.array(pages), np.array(bounds)
    rows, hq, length, d = qf.shape
    kvh, page_tokens = kf.shape[1], layout.page_tokens

    def dequant(pool, bits, page, off, hk):
        codes, scales, offsets = (a[page, off, hk] for a in pool)
        shifts = np.arange(0, 32, bits, dtype=np.uint32)
        c = ((codes[..., None] >> shifts) & ((1 << bits) - 1)).reshape(len(page), d // 64, 64)
        return (c * scales[..., None] + offsets[..., None]).reshape(len(page), d)

    out = np.zeros((rows, hq, length, d))
    for b in range(rows):
        n, own = int(bounds[b, 0]), int(bounds[b, 1])
        pos = np.arange(n)
        page, off = pages[b][pos // page_tokens], pos % page_tokens
        for h in range(hq):
            hk = h // (hq // kvh)
            kh, vh = dequant(pools[0], k_bits, page, off, hk), dequant(pools[1], v_bits, page,
                                                                        off, hk)
            for i in range(own):
                s = np.concatenate([kh @ qr[b, h, i], kf[b, hk, :i + 1] @ qf[b, h, i]]) * scale
                p = np.exp(s - s.max())
                out[b, h, i] = (p / p.sum()) @ np.concatenate([vh, vf[b, hk, :i + 1]])
    return out


def prefill_case(rng, fmt_name, hq, kvh, d, history, own, page_tokens=16, splits=None,
                 kernel=None) -> dict:
    """Rows with `history[b]` packed keys and `own[b]` new tokens (padded to max(own) with NaN,
    which must not reach any output). `kernel` (default: the CUDA kernel) has
    packed_prefill_attention's signature; the CPU test passes `reference_packed_prefill`."""
    fmt = KVFormat(fmt_name, d, "bfloat16")
    history, own = np.asarray(history), np.asarray(own)
    rows, length = len(history), int(own.max())
    tables, num_pages = _tables(rng, rows, history + own, page_tokens)
    layout = kernel_layout(page_tokens, kvh, d, fmt.k_bits, fmt.v_bits)
    pool, per_row = packed_history(rng, layout, num_pages, tables, history, d, fmt.k_bits,
                                   fmt.v_bits)
    pad = np.arange(length)[None, None, :, None] >= own[:, None, None, None]

    def draw(heads, poison):
        x = rng.standard_normal((rows, heads, length, d)).astype(np.float32)
        return mx.array(np.where(pad & poison, np.nan, x)).astype(mx.bfloat16)

    q, k_new, v_new = draw(hq, False), draw(kvh, True), draw(kvh, True)
    scale = d ** -0.5
    bounds = np.stack([history, own], axis=1).astype(np.int32)
    run = kernel or cuda_packed_prefill.packed_prefill_attention
    pinned = {} if splits is None else {"splits": splits}   # only the tile kernel splits keys
    got = run(q, k_new, v_new, pool, layout, fmt.k_bits, fmt.v_bits, mx.array(tables),
              mx.array(bounds), int(history.max()), scale, **pinned)
    got = np.array(got.astype(mx.float32)) if isinstance(got, mx.array) else got
    err = 0.0
    for b, packed in enumerate(per_row):
        n = int(own[b])
        ref = direct_attention(q[b:b + 1, :, :n], _history_kv(packed), k_new[b:b + 1, :, :n],
                               v_new[b:b + 1, :, :n], fmt=fmt, scale=scale,
                               new_mask="causal" if n > 1 else None)
        err = max(err, _max_err(got[b, :, :n], np.array(ref.astype(mx.float32))[0]))
    return {"kernel": f"prefill-{fmt_name}", "rows": rows, "hq": hq, "kvh": kvh, "head_dim": d,
            "history": history.tolist(), "own": own.tolist(), "splits": splits or "plan",
            "max_abs_err": round(err, 5), "ok": bool(err < TOLERANCE)}


def write_case(rng, fmt_name, rows, heads, d, kernel=None) -> dict:
    """The write kernel's records (`kernel`, default cuda/packed_write.quantize_record, with its
    signature: k, v, k_bits, v_bits, layout) against packed_record(quantize(rotate(k)),
    quantize(v)), section by section: codes may differ only by one step where a value sits on a
    rounding boundary; scales and offsets agree to FP32 rounding."""
    fmt = KVFormat(fmt_name, d, "bfloat16")
    layout = kernel_layout(16, heads, d, fmt.k_bits, fmt.v_bits)
    k = mx.array(rng.standard_normal((rows, heads, d)).astype(np.float32)).astype(mx.bfloat16)
    v = mx.array(rng.standard_normal((rows, heads, d)).astype(np.float32)).astype(mx.bfloat16)
    run = kernel or cuda_packed_write.quantize_record
    got = run(k, v, fmt.k_bits, fmt.v_bits, layout)
    ref = packed_record(quantize(rotate(k), fmt.k_bits), quantize(v, fmt.v_bits))
    out = {"kernel": f"write-{fmt_name}", "rows": rows, "heads": heads, "head_dim": d}
    if tuple(got.shape) != (rows, layout.record_words) or got.dtype != mx.uint32:
        return {**out, "error": f"records {got.dtype} {tuple(got.shape)}, want uint32 "
                                f"{(rows, layout.record_words)}", "ok": False}
    g, r = ({name: np.array(part) for name, part in zip(SECTIONS, layout.split_records(a))}
            for a in (got, ref))
    ok = True
    for name, bits in (("k", fmt.k_bits), ("v", fmt.v_bits)):
        shifts = np.arange(0, 32, bits, dtype=np.uint32)
        gc, rc = ((x[f"{name}_codes"][..., None] >> shifts) & ((1 << bits) - 1) for x in (g, r))
        diff = np.abs(gc.astype(np.int64) - rc.astype(np.int64))
        meta = max(_max_err(g[s], r[s]) / float(np.abs(r[s]).max())
                   for s in (f"{name}_scales", f"{name}_offsets"))
        out[f"{name}_code_mismatch"] = float((diff > 0).mean())
        out[f"{name}_code_max_diff"] = int(diff.max())
        out[f"{name}_meta_rel_err"] = float(f"{meta:.2e}")
        ok &= diff.max() <= 1 and (diff > 0).mean() < 1e-3 and meta < 1e-5
    out["ok"] = bool(ok)
    return out


def cases(kernels):
    """The checks of the kernel families in `kernels` (native, packed, packed-v2, write,
    prefill); each family draws from its own generator, so its data does not depend on which
    other families run."""
    rng = np.random.default_rng(0)
    for rows, longest in ((1, 300), (1, 5000), (8, 1200), (32, 300)):
        for hq, kvh, d in ((9, 3, 64), (16, 4, 128)):
            if "native" in kernels:
                yield native_case(rng, rows, hq, kvh, d, longest)
    for fmt in ("int8", "int4"):
        for rows, longest in ((1, 1), (1, 300), (1, 5000), (8, 2100)):
            for hq, kvh, d in ((9, 3, 64), (16, 4, 128)):
                if "packed" in kernels:
                    yield packed_case(rng, fmt, rows, hq, kvh, d, longest)
    rng = np.random.default_rng(1)
    if "packed-v2" in kernels:
        # The tiled kernel: the v1 cases, then GQA groups 1 and 8, 64-token pages, one split
        # over 79 tiles (double buffering across many tiles), many short splits, ragged rows
        # whose tile counts differ, a history of exactly one tile and one key past it.
        for fmt in ("int8", "int4"):
            for rows, longest in ((1, 1), (1, 300), (1, 5000), (8, 2100)):
                for hq, kvh, d in ((9, 3, 64), (16, 4, 128)):
                    yield packed_case(rng, fmt, rows, hq, kvh, d, longest, version="v2")
            for rows, hq, kvh, d, longest, pt, target in (
                    (3, 4, 4, 128, 700, 16, None), (3, 16, 2, 128, 700, 16, None),
                    (2, 8, 1, 64, 900, 64, None), (2, 16, 4, 128, 5000, 16, 1),
                    (1, 16, 4, 128, 5000, 64, 4096), (5, 14, 2, 64, 3000, 16, None),
                    (1, 16, 4, 128, 65, 16, None), (1, 16, 4, 128, 66, 16, None),
                    (1, 16, 4, 128, 33, 16, None), (32, 16, 4, 128, 600, 16, None)):
                yield packed_case(rng, fmt, rows, hq, kvh, d, longest, page_tokens=pt,
                                  version="v2", target_blocks=target)
    rng = np.random.default_rng(2)
    for fmt in ("int8", "int4", "k8v4"):
        for heads, d in ((3, 64), (4, 128)):
            if "write" in kernels:
                yield write_case(rng, fmt, 37, heads, d)
    rng = np.random.default_rng(3)
    for fmt in ("int8", "int4", "k8v4"):
        for hq, kvh, d in ((9, 3, 64), (16, 4, 128)):
            for history, own, splits in (([1000], [512], None), ([5000], [64], None),
                                         ([0, 700, 2100], [37, 512, 200], None),
                                         ([300, 2000], [100, 1], 3), ([4000] * 3, [1] * 3, None)):
                if "prefill" in kernels:
                    yield prefill_case(rng, fmt, hq, kvh, d, history, own, splits=splits)
    rng = np.random.default_rng(4)
    for fmt in ("int8", "int4", "k8v4"):
        for hq, kvh, d in ((9, 3, 64), (16, 4, 128)):
            for history, own in (([1000], [512]), ([5000], [64]), ([0, 700, 2100], [37, 512, 200]),
                                 ([300, 2000], [100, 1])):
                if "dequant" in kernels:
                    yield {**prefill_case(rng, fmt, hq, kvh, d, history, own,
                                          kernel=cuda_packed_dequant.dequant_prefill_attention),
                           "kernel": f"dequant-{fmt}"}


KERNEL_FAMILIES = ("native", "packed", "packed-v2", "write", "prefill", "dequant")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="cuda_check.json")
    ap.add_argument("--kernels", default=",".join(KERNEL_FAMILIES),
                    help="kernel families to check, any of " + ",".join(KERNEL_FAMILIES))
    args = ap.parse_args(argv)
    kernels = set(args.kernels.split(","))
    if kernels - set(KERNEL_FAMILIES):
        ap.error(f"unknown kernel families {sorted(kernels - set(KERNEL_FAMILIES))}")
    if not cuda_paged_decode.available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    cases_ = []
    for case in cases(kernels):
        cases_.append(case)
        print(json.dumps(case), file=sys.stderr, flush=True)   # progress, and what a crash cut
    result = {"mlx": mx.__version__, "tolerance": TOLERANCE, "kernels": sorted(kernels),
              "cases": cases_, "all_ok": all(c["ok"] for c in cases_)}
    emit(result, args.out)
    return 0 if result["all_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
