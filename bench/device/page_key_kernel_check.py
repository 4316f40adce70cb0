"""The page-key CUDA decode kernel's device check (bench.device.page_key_qmm's correctness child
with --kernel-only; engine/attention/cuda/page_key_decode.py).

Per row (geometry, context, batch) and format: history written through a real PageKeyStore
(ragged rows, partial last pages in the native tail: bench/cuda_emulate_page_keys.py's
`page_key_store`), then one decode attention call through PackedLayerCache.attend, as a decode
step makes it:
- `kernel`: the step marked for the kernels (KernelChoices.page_key_kernel on): the CUDA kernel;
- `tiled`: the same call on the MLX path GPUs took before (every key dequantized tile by tile);
against `reference` (the store's dequantized `gather` and a float64 softmax), plus one engine
decode step's logits, kernel against tiled (reported, not gated: bf16 model arithmetic).
"""
from __future__ import annotations

import numpy as np

TOLERANCE = 0.02   # bf16 outputs against float64 over the same dequantized keys


def available() -> bool:
    from engine.attention.cuda import paged_decode
    return paged_decode.available()


def _attend(store, q, k_new, v_new, tables, hist, kernel: bool):
    """One decode attention call of `store`'s layer through PackedLayerCache (the engine's
    path), the CUDA kernel or the MLX one."""
    import mlx.core as mx

    from engine.attention.choices import KernelChoices
    from engine.attention.packed_cache import PackedLayerCache
    from engine.attention.paged import StepBatch
    from engine.sched.seq import Chunk
    t = store.page_tokens
    rows = [Chunk(i, [7], int(h), [int(p) for p in tables[i, :int(h) // t + 1]])
            for i, h in enumerate(hist)]
    step = StepBatch(rows, t)
    step.kernel_decode = kernel
    step.kernels = KernelChoices(page_key_kernel=bool(kernel))   # off: the tiled path
    # The tails as this step began: what the step's own write (not made here) would record.
    store.tails.before = dict(store.tails.slot_of)
    cache = PackedLayerCache(store, step, None, direct=True)
    out = cache.attend(q, k_new, v_new, scale=q.shape[-1] ** -0.5)
    return np.array(out.astype(mx.float32), np.float64)


def attention_check(geometry: dict, context: int, batch: int, fmt: str,
                    page_tokens: int) -> dict:
    """Kernel and tiled decode attention against the reference over one layer's history."""
    import mlx.core as mx

    from bench.cuda_emulate_page_keys import page_key_store, reference
    hq, kvh, d = (geometry[k] for k in ("num_attention_heads", "num_key_value_heads",
                                         "head_dim"))
    rng = np.random.default_rng(5)
    # Ragged rows, most ending inside a page (the tail), the first exactly at `context`.
    hist = [max(0, context - 1 - (37 * i) % 101) for i in range(batch)]
    hist[0] = context - 1
    store, tables, _ = page_key_store(rng, fmt, hist, kvh, d, page_tokens)
    q, k_new, v_new = (mx.array(rng.standard_normal(s).astype(np.float32)).astype(mx.bfloat16)
                       for s in ((batch, hq, 1, d), (batch, kvh, 1, d), (batch, kvh, 1, d)))
    want = reference(q, k_new, v_new, store, tables, hist, d ** -0.5)
    got = _attend(store, q, k_new, v_new, tables, hist, kernel=True)
    tiled = _attend(store, q, k_new, v_new, tables, hist, kernel=False)
    diff = lambda a, b: float(np.abs(a - b).max()) if np.isfinite(a).all() else float("inf")
    out = {"kernel_vs_reference": diff(got, want), "kernel_vs_tiled": diff(got, tiled),
           "tiled_vs_reference": diff(tiled, want),
           "reference_max_abs": float(np.abs(want).max()), "history": hist[:4]}
    out["ok"] = out["kernel_vs_reference"] < TOLERANCE and out["kernel_vs_tiled"] < TOLERANCE
    return out


def logits_check(loaded, fmt: str, context: int, batch: int) -> dict:
    """One engine decode step over the same filled history: kernel vs tiled logits, and
    whether the kernel runner really routed its decode steps to the kernel."""
    from bench.kv_decode import DecodeTimer
    from bench.kv_runners import PAGE_TOKENS
    from engine.sched.seq import Chunk
    pages = batch * -(-(context + 4) // PAGE_TOKENS)
    timers = [DecodeTimer(loaded, f"{fmt}:{k}", pages, batch, context, 4)
              for k in ("kernel", "tiled-keys")]
    logits = [t.runner.forward([Chunk(i, [7], t.pos, table) for i, table in enumerate(t.tables)])
              for t in timers]
    import mlx.core as mx
    return {"kernel_routed": bool(timers[0].runner.kernel_decode),
            "kernel_vs_tiled_logits": float(mx.abs(logits[0] - logits[1]).max().item())}


def check(rows, models: dict, geometries: dict, formats, page_tokens: int, progress,
          save=None) -> dict:
    """Every (row, format): attention_check, and logits_check on each geometry's first row
    (two engines per check: the time goes there); {'unavailable': why} without CUDA (the
    kernel runs there only). `save(results so far)` after every check, so a child cut short
    by its time share still reports what it checked."""
    if not available():
        return {"unavailable": "no CUDA device: the page-key kernel runs on CUDA only"}
    out, engines = {}, set()
    for g, n, b in rows:
        for fmt in formats:
            row = attention_check(geometries[g], n, b, fmt, page_tokens)
            if (g, fmt) not in engines:
                engines.add((g, fmt))
                row.update(logits_check(models[g], fmt, min(n, 512), b))
                row["ok"] = row["ok"] and row["kernel_routed"]
            out[f"{g}-ctx{n}-b{b}-{fmt}"] = row
            progress(f"kernel check {g} ctx {n} batch {b} {fmt}: {row}")
            if save is not None:
                save(out)
    return out
