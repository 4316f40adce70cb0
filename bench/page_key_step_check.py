"""Compiled page-key decode steps through the CUDA write paths against the MLX write, bit for bit.

    python -m bench.page_key_step_check --model DIR      # on the GPU: the real kernels
    python -m bench.page_key_step_check --model DIR --variants write-kernel,own-write --steps 48

Runners over the same model in k6v4-kivi, compiled decode steps with the page-key decode kernel
(where CUDA runs) in every one; they differ only in who writes a step's rows:
- `mlx-write` (the reference): the store's MLX ops (KernelChoices.page_key_write off);
- `write-kernel`: the write kernel, tails in place (engine/attention/cuda/page_key_write.py);
- `own-write`: the decode kernel itself (KernelChoices.page_key_own_write, the default).
The attention arithmetic is the same in all, so every step's logits and, at the end, every
layer's pool and native tails must be equal bit for bit (the key codes of pages still partial
aside: the MLX write keys those every step, the kernels only when a page fills, and nothing
reads them). Ragged prompts (one ending on a page
boundary, the others mid-page), then `--steps` decode steps feeding every runner the same
tokens, across page fills and new pages. Prints JSON; exit 1 on a difference. Without CUDA every
runner takes the MLX paths (a smoke run).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import mlx.core as mx
import numpy as np

from bench.kv_runners import PAGE_TOKENS, make_runner
from bench.output import emit
from engine.attention.choices import DEFAULT_KERNELS
from engine.kv.page_layout import K_SECTIONS
from engine.sched.seq import Chunk

VARIANTS = {"mlx-write": dict(page_key_write=False),
            "write-kernel": dict(page_key_own_write=False),
            "own-write": dict(page_key_own_write=True)}
PROMPTS = (3 * PAGE_TOKENS, 2 * PAGE_TOKENS + 5, PAGE_TOKENS - 3, 70)


def _run(loaded, kernels, steps: int, seed: int):
    """(per-step float32 logits, each layer's arrays as bytes) of one runner."""
    rows = len(PROMPTS)
    per_row = -(-(max(PROMPTS) + steps + 1) // PAGE_TOKENS)
    runner = make_runner(loaded, "k6v4-kivi", rows * per_row, kernels=kernels, seqs=rows)
    rng = np.random.default_rng(seed)
    ids = rng.permutation(rows * per_row).reshape(rows, per_row).tolist()
    vocab = loaded.geometry.vocab_size
    prompts = [rng.integers(3, vocab, n).tolist() for n in PROMPTS]
    runner.forward([Chunk(i, p, 0, ids[i]) for i, p in enumerate(prompts)])
    feed = rng.integers(3, vocab, (steps, rows))
    logits = []
    for s in range(steps):
        out = runner.forward([Chunk(i, [int(feed[s, i])], PROMPTS[i] + s, ids[i])
                              for i in range(rows)])
        mx.eval(out)
        logits.append(np.array(out))
    arrays = [_final_bytes(store) for store in runner.kvstore.layers.values()]
    return logits, arrays, runner.compiled is not None


def _final_bytes(store) -> list[np.ndarray]:
    """The layer's arrays as bytes, with the key sections of pages still partial blanked: the
    MLX write keys a partial page every step (codes nothing reads: attention takes its rows from
    the tail) where the kernels key a page once, when it fills."""
    pool, *tails = (np.array(a if a.dtype != mx.bfloat16 else a.view(mx.uint16))
                    for a in store.arrays())   # NumPy has no bfloat16: its bits
    lay, heads = store.layout, store.geometry.kv_heads
    partial = sorted(store.tails.slot_of)
    for name in K_SECTIONS:
        at = lay.offsets[name]
        pool[partial, at:at + lay.page_tokens * heads * lay.width(name)] = 0
    return [a.view(np.uint8) for a in (pool, *tails)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="an mlx-lm model directory (Llama-style)")
    ap.add_argument("--variants", default="write-kernel,own-write",
                    help=f"compared with mlx-write, from {sorted(VARIANTS)}")
    ap.add_argument("--steps", type=int, default=2 * PAGE_TOKENS + 4)
    ap.add_argument("--out", help="write the JSON here as well as to stdout")
    args = ap.parse_args(argv)
    names = args.variants.split(",")
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        ap.error(f"unknown variants {bad}; choose from {sorted(VARIANTS)}")
    from engine.attention.cuda import paged_decode
    from engine.model.loader import load_model
    loaded = load_model(args.model, fuse=True)
    kernels = replace(DEFAULT_KERNELS, page_key_kernel=True)
    want, want_arrays, _ = _run(loaded, replace(kernels, **VARIANTS["mlx-write"]), args.steps, 0)
    out = {"mlx": mx.__version__, "device": str(mx.default_device()),
           "cuda": paged_decode.available(), "steps": args.steps, "prompts": PROMPTS,
           "variants": {}}
    for name in names:
        got, arrays, compiled = _run(loaded, replace(kernels, **VARIANTS[name]), args.steps, 0)
        steps_differing = [s for s, (a, b) in enumerate(zip(want, got))
                           if not np.array_equal(a, b)]
        layers_differing = [i for i, (a, b) in enumerate(zip(want_arrays, arrays))
                            if not all(np.array_equal(x, y) for x, y in zip(a, b))]
        out["variants"][name] = {
            "compiled": compiled, "steps_differing": steps_differing,
            "max_abs_logit_diff": float(max(np.abs(a - b).max() for a, b in zip(want, got))),
            "layers_differing": layers_differing,
            "equal": not steps_differing and not layers_differing}
    out["all_equal"] = all(v["equal"] for v in out["variants"].values())
    emit(out, args.out)
    return 0 if out["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
