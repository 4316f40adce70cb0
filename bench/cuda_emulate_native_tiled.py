"""The tiled native decode kernel (engine/attention/cuda/native_tiled_decode.py) and its merge
on the CPU emulator (bench/cuda_emulate.py: one fiber per GPU thread), with the pages read back
(the OWN variant writes the step's own keys into them).

    python -m bench.cuda_emulate_native_tiled    # the check cases against NumPy attention
    python -m bench.cuda_emulate_native_tiled --device   # the same cases on a CUDA GPU
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench import cuda_emulate as ce
from bench.cuda_emulate_inplace import own_key_pages, reference

TOLERANCE = 0.02   # bf16 output of float32 math against float64 on the same bf16 inputs


def native_tiled_decode(q, k_pages, v_pages, tables, ends, scale, own=None, target_blocks=None,
                        min_keys=None, workdir: Path | None = None):
    """The kernel with the split plan its host side picks (`tiled_decode_attention`'s
    arguments as numpy arrays, rounded to bfloat16). `own`: (keys, values) [B, kvh, 1, D].
    Returns (out [B, Hq, 1, D], k_pages, v_pages after the kernel), float32."""
    import mlx.core as mx

    from engine.attention.cuda import native_tiled_decode_source as src
    from engine.attention.cuda import paged_decode as pd
    from engine.attention.cuda import tile_helpers
    workdir = workdir or Path(tempfile.mkdtemp(prefix="orchard_emulate_"))
    rows, hq, _, d = q.shape
    kvh, num_pages, pt, _ = k_pages.shape
    tables, ends = np.asarray(tables, np.int32), np.asarray(ends, np.int32)
    inputs = [("q", "bfloat16"), ("kp", "bfloat16"), ("vp", "bfloat16"), ("pages", "int32"),
              ("ends", "int32"), ("dims", "int32"), ("scale", "float32")]
    arrays = [ce._bits16(mx.array(a)) for a in (q, k_pages, v_pages)]
    arrays += [tables, ends, np.array([hq, kvh, tables.shape[1], num_pages], np.int32),
               np.array([scale], np.float32)]
    if own is not None:
        inputs += [("kn", "bfloat16"), ("vn", "bfloat16")]
        arrays += [ce._bits16(mx.array(a)) for a in own]
    splits = pd.split_count(rows, kvh, int(ends.max()), target_blocks, min_keys)
    parts = rows * hq * (splits if splits > 1 else 1)
    template = [("D", d), ("G", hq // kvh), ("PT", pt), ("TQ", "bfloat16"), ("TK", "bfloat16"),
                ("OWN", own is not None), ("SPLIT", splits > 1), ("TO", "bfloat16")]
    out, part, ml, kp, vp = ce.run(
        src.name(own is not None), inputs,
        [("out", "bfloat16"), ("part", "float32"), ("ml", "float32")],
        src.source(own is not None), tile_helpers.HELPERS, template, arrays,
        [(rows, hq, 1, d), (parts, d), (parts, 2)], (rows * kvh, splits), 128, workdir,
        writes=(1, 2))
    if splits > 1:
        out = ce.merge(part, ml, splits, (rows, hq, 1, d), "bfloat16", workdir)
    return out, kp, vp


def on_device(q, k_pages, v_pages, tables, ends, scale, own=None, target_blocks=None,
              min_keys=None, workdir=None):
    """native_tiled_decode's signature run on the CUDA device itself (`--device`): the same
    cases as a device session's correctness check before it times the kernel."""
    import mlx.core as mx

    from engine.attention.cuda import native_tiled_decode as nt
    qb, kb, vb = (mx.array(a).astype(mx.bfloat16) for a in (q, k_pages, v_pages))
    fresh = None if own is None else tuple(mx.array(a).astype(mx.bfloat16) for a in own)
    out = nt.tiled_decode_attention(qb, kb, vb, mx.array(tables), mx.array(ends), scale,
                                    int(np.max(ends)), target_blocks, min_keys, own=fresh)
    mx.eval(out)   # the pages are read back after the kernel wrote them in place
    return tuple(np.array(a.astype(mx.float32)) for a in (out, kb, vb))


def case(rng, ends, hq: int, kvh: int, d: int, pt: int, own: bool, target_blocks=None,
         min_keys=None, workdir: Path | None = None, kernel=native_tiled_decode) -> dict:
    """One check: rows of lengths `ends`, pages interleaved over rows, own key slots poisoned
    (an OWN kernel that read them would be far off). Returns the errors and the write check.
    `kernel`: the emulator's run, or `on_device`."""
    c = own_key_pages(rng, ends, hq, kvh, d, pt, own)
    scale = d ** -0.5
    fresh = (c["kn"], c["vn"]) if own else None
    out, k_after, v_after = kernel(c["q"], c["k_pages"], c["v_pages"], c["tables"], c["ends"],
                                   scale, fresh, target_blocks, min_keys, workdir)
    ref = reference(c["q"], c["k_pages"], c["v_pages"], c["tables"], c["ends"], scale, fresh)
    err = float(np.abs(out - ref).max())
    pages_ok = bool(np.array_equal(k_after, c["written_k"])
                    and np.array_equal(v_after, c["written_v"]))
    return dict(max_abs_err=err, pages_ok=pages_ok, ok=err < TOLERANCE and pages_ok)


# (ends, hq, kvh, d, page tokens, own, target_blocks, min_keys): ragged rows, a 1-key row,
# splits that leave short rows empty, every page size, GQA groups 1..8.
CASES = [
    ((600, 1, 33), 9, 3, 64, 16, True, None, None),
    ((300, 70, 5), 32, 8, 128, 16, True, None, 64),
    ((129, 40), 8, 8, 128, 32, False, None, 32),
    ((200, 64, 2), 16, 2, 64, 64, True, None, 64),
    ((97,), 4, 1, 128, 64, False, None, None),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", action="store_true",
                    help="run the cases on the CUDA device (MLX's cuda_kernel), not emulated")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for c in CASES:
            got = case(rng, *c, workdir=Path(tmp),
                       kernel=on_device if args.device else native_tiled_decode)
            failed += not got["ok"]
            print(f"{'ok  ' if got['ok'] else 'FAIL'} {c}: {got}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
