"""Page-key chunk writes through a write kernel against the store's MLX write, byte for byte.

    python -m bench.page_key_chunk_compare            # on the GPU: the real CUDA kernel

Two PageKeyStores take the same calls (prefill chunks starting and ending mid-page, two
sequences' chunks in one call, calls needing more tail slots than are free, so a new page takes
a slot given back in the same call and the kernel writes the tails as new arrays, decode
rows): one writes with MLX ops, the other through `writer` (engine/attention/cuda/
page_key_write.py, or its CPU emulation in tests/engine/attention/test_cuda_page_key_chunk_
write.py). After each call's flush the pools and native tails must be equal byte for byte.
Prints JSON: per format and case, the first difference or null.
"""
from __future__ import annotations

import argparse
import sys

import mlx.core as mx
import numpy as np

from bench.output import emit
from capacity.formats import KVFormat
from engine.kv.page_key_store import PageKeyStore
from engine.kv.store import Slots
from engine.kv.tails import TailMap
from engine.model.loader import LayerGeometry

# (head dim, KV heads, page tokens, calls): each call a list of (sequence, first position,
# rows); see the module docstring.
CASES = [
    (64, 2, 16, [[(0, 0, 40)], [(0, 40, 37), (1, 0, 21)], [(1, 21, 30), (0, 77, 3)],
                 [(0, 80, 1), (1, 51, 1)]]),
    (128, 1, 32, [[(0, 0, 70), (1, 0, 31)], [(1, 31, 1), (0, 70, 26)]]),
    (64, 4, 64, [[(0, 0, 63)], [(0, 63, 70)]]),
]


def store(fmt, d, kvh, t, pages, seqs, dtype, chunk_writer=None) -> PageKeyStore:
    return PageKeyStore(LayerGeometry(0, "full", kvh, d, d),
                        KVFormat(fmt, d, str(dtype).removeprefix("mlx.core."), page_tokens=t),
                        pages, t, tails=TailMap(seqs, t), chunk_writer=chunk_writer)


def _bytes(a):
    return np.array(a.view(mx.uint8))


def compare(fmt, d, kvh, t, calls, dtype, writer) -> str | None:
    """The calls through an MLX-write store and a `writer` store; the first difference or None."""
    seqs = 1 + max(s for call in calls for s, _, _ in call)
    rng = np.random.default_rng(7)
    per_seq = max(p + n for call in calls for _, p, n in call) // t + 2
    tables = rng.permutation(seqs * per_seq).astype(np.int32).reshape(seqs, per_seq)
    wide = np.ones(d, np.float32)
    wide[rng.choice(d, 3, replace=False)] = 8.0   # a few wide key channels
    mlx_store = store(fmt, d, kvh, t, tables.size, seqs, dtype)
    kernel_store = store(fmt, d, kvh, t, tables.size, seqs, dtype, writer)
    if kernel_store.chunk_writer is None:
        return "the writer does not serve this store"
    for i, call in enumerate(calls):
        pos = np.concatenate([np.arange(p, p + n) for _, p, n in call])
        seq = np.concatenate([np.full(n, s) for s, _, n in call])
        k = mx.array(rng.standard_normal((len(pos), kvh, d)) * wide).astype(dtype)
        v = mx.array(rng.standard_normal((len(pos), kvh, d))).astype(dtype)
        for s in (mlx_store, kernel_store):
            s.write(Slots(tables[seq, pos // t], pos % t), k, v)
            s.flush_tail()
            mx.eval(s.pool, *s.tail)
        for name, a, b in zip(("K tail", "V tail"), mlx_store.tail, kernel_store.tail):
            if not np.array_equal(_bytes(a), _bytes(b)):
                return f"call {i}: {name}"
        if not np.array_equal(np.array(mlx_store.pool), np.array(kernel_store.pool)):
            return f"call {i}: pool words"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the JSON here as well as to stdout")
    args = ap.parse_args(argv)
    from engine.attention.cuda import page_key_write, paged_decode
    if not paged_decode.available():
        ap.error("needs MLX's CUDA backend (the kernel's source is compared on the CPU emulator "
                 "by tests/engine/attention/test_cuda_page_key_chunk_write.py)")
    out = {"mlx": mx.__version__, "device": str(mx.default_device()), "cases": {}}
    for fmt in ("k6v4-kivi", "int4-kivi"):
        for dtype in (mx.bfloat16, mx.float32):
            for d, kvh, t, calls in CASES:
                name = f"{fmt} d{d} h{kvh} pt{t} {str(dtype).removeprefix('mlx.core.')}"
                out["cases"][name] = compare(fmt, d, kvh, t, calls, dtype, page_key_write)
    out["all_equal"] = all(v is None for v in out["cases"].values())
    emit(out, args.out)
    return 0 if out["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
