"""Kernels that write their inputs in place, on the CPU emulator (bench/cuda_emulate.py: one
fiber per GPU thread), with what they wrote read back: the native decode kernel's OWN variant
(engine/attention/cuda/paged_decode.py writes the step's own keys into the pages) and the packed
write kernel's in-place variant (engine/attention/cuda/packed_write.py writes records into the
pool).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from bench import cuda_emulate as ce



def bf16(x) -> np.ndarray:
    """float32 values exactly representable in bfloat16 (MLX's rounding, as the kernels see)."""
    import mlx.core as mx
    return np.array(mx.array(np.asarray(x, np.float32)).astype(mx.bfloat16).astype(mx.float32))


def own_key_pages(rng, ends, hq: int, kvh: int, d: int, pt: int, own: bool = True) -> dict:
    """A native decode kernel's check case: rows of lengths `ends` over pages interleaved
    across rows, bf16 q / pages / the step's own keys and values (kn, vn [B, kvh, 1, D]), and
    the pages as an OWN kernel must leave them (`written_k`, `written_v`: the own key in its
    slot). With `own`, the slots in `k_pages` / `v_pages` are poisoned, so a kernel that read
    them instead of kn / vn is far off."""
    ends = np.asarray(ends, np.int32)
    rows = len(ends)
    per_row = -(-int(ends.max()) // pt)
    tables = np.array([[r + rows * j for j in range(per_row)] for r in range(rows)], np.int32)
    kp, vp = (bf16(rng.standard_normal((kvh, rows * per_row, pt, d))) for _ in range(2))
    q = bf16(rng.standard_normal((rows, hq, 1, d)))
    kn, vn = (bf16(rng.standard_normal((rows, kvh, 1, d))) for _ in range(2))
    written_k, written_v = kp.copy(), vp.copy()
    if own:
        for b, n in enumerate(ends):
            page, off = tables[b, (n - 1) // pt], (n - 1) % pt
            written_k[:, page, off], written_v[:, page, off] = kn[b, :, 0], vn[b, :, 0]
            kp[:, page, off] = vp[:, page, off] = 1e4
    return dict(q=q, k_pages=kp, v_pages=vp, tables=tables, ends=ends, kn=kn, vn=vn,
                written_k=written_k, written_v=written_v)


def reference(q, k_pages, v_pages, tables, ends, scale, own=None) -> np.ndarray:
    """Attention in float64 over each row's keys (the own key from `own`, not its slot)."""
    rows, hq, _, d = q.shape
    kvh = k_pages.shape[0]
    g = hq // kvh
    out = np.zeros((rows, hq, 1, d))
    for b, n in enumerate(ends):
        keys = k_pages[:, tables[b]].reshape(kvh, -1, d)[:, :n].astype(np.float64)
        vals = v_pages[:, tables[b]].reshape(kvh, -1, d)[:, :n].astype(np.float64)
        if own is not None:
            keys[:, n - 1], vals[:, n - 1] = own[0][b, :, 0], own[1][b, :, 0]
        for h in range(hq):
            s = keys[h // g] @ q[b, h, 0] * scale
            w = np.exp(s - s.max())
            out[b, h, 0] = (w / w.sum()) @ vals[h // g]
    return out


def native_decode(q, k_pages, v_pages, tables, ends, scale, own=None, target_blocks=None,
                  workdir: Path | None = None, warps: int | None = None):
    """The native decode kernel (cuda/paged_decode.py) and, with several splits, its merge,
    run here with the split plan its host side picks (`paged_decode_attention`'s arguments, as
    numpy float32 arrays that are rounded to bfloat16). `own`: (keys, values) [B, kvh, 1, D] of
    the OWN variant, which attends to them and writes them into the pages. Returns
    (out [B, Hq, 1, D], k_pages, v_pages after the kernel), float32. `warps`: warps per block
    (None: pd.WARPS; KernelChoices.decode_warps' kernel variants)."""
    import mlx.core as mx

    from engine.attention.cuda import paged_decode as pd
    workdir = workdir or Path(tempfile.mkdtemp(prefix="orchard_emulate_"))
    rows, hq, _, d = q.shape
    kvh, num_pages, pt, _ = k_pages.shape
    tables, ends = np.asarray(tables, np.int32), np.asarray(ends, np.int32)
    bf = [(n, "bfloat16") for n in ("q", "kp", "vp")]
    inputs = [*bf, ("pages", "int32"), ("ends", "int32"), ("dims", "int32"), ("scale", "float32")]
    q, k_pages, v_pages = (mx.array(a) for a in (q, k_pages, v_pages))
    arrays = [ce._bits16(q), ce._bits16(k_pages), ce._bits16(v_pages), tables, ends,
              np.array([hq, kvh, num_pages, tables.shape[1]], np.int32),
              np.array([scale], np.float32)]
    if own is not None:
        inputs += [("kn", "bfloat16"), ("vn", "bfloat16")]
        arrays += [ce._bits16(mx.array(own[0])), ce._bits16(mx.array(own[1]))]
    splits = pd.split_count(rows, kvh, int(ends.max()), target_blocks)
    parts = rows * hq * (splits if splits > 1 else 1)
    template = [("D", d), ("G", hq // kvh), ("PT", pt), ("TQ", "bfloat16"), ("TK", "bfloat16"),
                ("OWN", own is not None), ("SPLIT", splits > 1), ("TO", "bfloat16")]
    warps = warps or pd.WARPS
    name = ("orchard_paged_decode" + ("_own" if own is not None else "")
            + (f"_w{warps}" if warps != pd.WARPS else ""))
    out, part, ml, kp, vp = ce.run(
        name, inputs, [("out", "bfloat16"), ("part", "float32"), ("ml", "float32")],
        pd._native_source(own is not None, warps), "", template, arrays,
        [(rows, hq, 1, d), (parts, d), (parts, 2)], (rows * kvh, splits), 32 * warps, workdir,
        writes=(1, 2))
    if splits > 1:
        (out,) = ce.run("orchard_decode_merge", [("part", "float32"), ("ml", "float32"),
                                              ("dims", "int32")], [("out", "bfloat16")],
                     pd._MERGE, "", [("D", d), ("TO", "bfloat16")],
                     [part, ml, np.array([splits], np.int32)], [(rows, hq, 1, d)],
                     (rows * hq, 1), d, workdir)
    return out, kp, vp


def packed_write_in_place(k, v, k_bits, v_bits, layout, pool, slot,
                          workdir: Path | None = None) -> np.ndarray:
    """The write kernel's in-place variant (cuda/packed_write.write_in_place's signature and
    launch, `slot` [N, 2] int32 page and offset): returns the pool [pages, words] uint32 as the
    kernel left it."""
    from engine.attention.cuda import packed_write as pw
    workdir = workdir or Path(tempfile.mkdtemp(prefix="orchard_emulate_"))
    n, h, d = k.shape
    blocks = -(-2 * n * h // pw.WARPS)
    pool = np.array(pool)
    _, got = ce.run(
        "orchard_packed_write_in_place",
        [("k", "bfloat16"), ("v", "bfloat16"), ("signs", "float32"), ("dims", "int32"),
         ("pool", "uint32"), ("slot", "int32"), ("tmpl", "int32")], [("done", "uint32")],
        pw.source(True), pw.QUANTIZE,
        [("D", d), ("KB", k_bits), ("VB", v_bits), ("TI", "bfloat16")],
        [ce._bits16(k), ce._bits16(v), np.array(pw._signs(d)),
         np.array([n, h, pool.shape[1]], np.int32), pool, np.asarray(slot, np.int32),
         np.array(pw._template(layout))], [(1,)], (blocks, 1), pw.WARPS * 32, workdir,
        writes=(4,))
    return got
