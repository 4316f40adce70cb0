"""Kernel-level timings for bench/decode_sweep.py: one layer's batch-1 decode attention and the
step's batch-1 matmuls, each alone.

Why alone: a decode step's time mixes host issue and device work; these isolate the two parts
issue 33 suspects (the paged decode kernel's walk over a short row, and whether MLX's GEMV
streams weights at HBM speed). Every timing is `calls` calls in one compiled function evaluated
together (a step's layers, issued from C++), reported per call as `issue_us` (until
mx.async_eval returns: host encoding) and `us` (until the device is done), median of `rounds`.
"""
from __future__ import annotations

import statistics
import time

# The H200's L2 is 50 MB: matmul weights are cycled through enough copies that each call
# streams its weight from HBM, as a step's distinct layers do.
STREAM_BYTES = 768 << 20


def timed(fn, calls: int, rounds: int) -> dict:
    """Per-call microseconds of `fn` (returns the arrays of `calls` calls) compiled once."""
    import mlx.core as mx

    f = mx.compile(fn)
    for _ in range(2):
        mx.eval(f())
    issue, total = [], []
    for _ in range(rounds):
        mx.synchronize()
        t0 = time.perf_counter()
        out = f()
        mx.async_eval(out)
        t1 = time.perf_counter()
        mx.eval(out)
        mx.synchronize()
        t2 = time.perf_counter()
        issue.append((t1 - t0) / calls * 1e6)
        total.append((t2 - t0) / calls * 1e6)
    return {"issue_us": round(statistics.median(issue), 2),
            "us": round(statistics.median(total), 2)}


def guarded(fn) -> dict:
    """`fn()`, or the error it raised (a kernel that does not compile on the device is a
    result, not the end of the sweep)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - recorded in the JSON and the sweep goes on
        return {"error": f"{type(e).__name__}: {e}"[:500]}


def attention_alone(geometry: dict, context: int, page_tokens: int, calls: int = 32,
                    rounds: int = 10) -> dict:
    """One layer's batch-1 decode attention at `context` + 1 keys: the paged decode kernel per
    plan (KernelChoices' split and warp choices, planned at the compiled step's bucket
    capacity) against mx.fast's SDPA on a contiguous cache (mlx-lm's) and on the row's pages
    gathered contiguous first (what an SDPA decode path over pages would cost: a page gather
    per K and V, then the vector kernel, no mask because the slice is exact)."""
    import mlx.core as mx

    from engine.attention.cuda import paged_decode as pd
    from engine.runner.compiled_decode import bucket_pages

    hq, kvh, d = geometry["q_heads"], geometry["kv_heads"], geometry["head_dim"]
    n = context + 1
    per_row = bucket_pages(context // page_tokens + 1)
    bf = mx.bfloat16
    qs = [mx.random.normal((1, hq, 1, d)).astype(bf) for _ in range(calls)]
    kp, vp = (mx.random.normal((kvh, per_row, page_tokens, d)).astype(bf) for _ in range(2))
    pages = mx.arange(per_row, dtype=mx.int32)[None]
    ends = mx.array([n], dtype=mx.int32)
    k, v = (mx.random.normal((1, kvh, 256 * -(-n // 256), d)).astype(bf) for _ in range(2))
    mx.eval(qs, kp, vp, pages, ends, k, v)
    scale = d ** -0.5
    out = {"keys": n, "q_heads": hq, "kv_heads": kvh, "head_dim": d, "calls": calls}
    if pd.available():
        plans = {"paged_default": (None, None), "paged_min_keys_32": (32, None),
                 "paged_warps_16": (None, 16), "paged_warps_16_min_keys_64": (64, 16)}
        for name, (keys, warps) in plans.items():
            splits = pd.split_count(1, kvh, per_row * page_tokens, None, keys)
            nw = pd.block_warps(warps, hq // kvh, d)
            out[name] = {"splits": splits, "warps": nw, **guarded(lambda keys=keys, warps=warps:
                timed(lambda: [pd.paged_decode_attention(q, kp, vp, pages, ends, scale,
                                                         per_row * page_tokens, None, keys,
                                                         warps=warps) for q in qs],
                      calls, rounds))}
    out["sdpa_vector_contiguous"] = guarded(lambda: timed(lambda: [
        mx.fast.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], scale=scale)
        for q in qs], calls, rounds))

    def gathered(q):
        kg = kp[:, pages[0]].reshape(1, kvh, -1, d)[:, :, :n]
        vg = vp[:, pages[0]].reshape(1, kvh, -1, d)[:, :, :n]
        return mx.fast.scaled_dot_product_attention(q, kg, vg, scale=scale)

    out["sdpa_vector_gathered_pages"] = guarded(
        lambda: timed(lambda: [gathered(q) for q in qs], calls, rounds))
    return out


def matmul_alone(geometry: dict, rounds: int = 10) -> dict:
    """The step's batch-1 matmuls (fused q/k/v, o, fused gate/up, down, LM head) in two weight
    layouts: `x @ W.T` of a row-major [out, in] W (mlx-lm's and the engine's default: MLX's own
    GEMV kernel, `can_use_gemv`) and `x @ W` of a row-major [in, out] W (cuBLAS); on CUDA also
    engine/attention/cuda/gemv.py's kernel on [out, in]. GB/s = the weight's bytes per call /
    us."""
    import mlx.core as mx

    from engine.attention.cuda import gemv
    from engine.attention.cuda.paged_decode import available

    gemv_available = available()
    hidden, inter = geometry["hidden"], geometry["intermediate"]
    hq, kvh, d = geometry["q_heads"], geometry["kv_heads"], geometry["head_dim"]
    shapes = {"qkv": ((hq + 2 * kvh) * d, hidden), "o": (hidden, hq * d),
              "gate_up": (2 * inter, hidden), "down": (hidden, inter),
              "head": (geometry["vocab"], hidden)}
    out = {}
    for name, (n_out, n_in) in shapes.items():
        nbytes = 2 * n_out * n_in
        copies = max(2, min(32, -(-STREAM_BYTES // nbytes)))
        xs = [mx.random.normal((1, 1, n_in)).astype(mx.bfloat16) for _ in range(copies)]
        ws = [(mx.random.normal((n_out, n_in)) * 0.02).astype(mx.bfloat16)
              for _ in range(copies)]
        mx.eval(xs, ws)
        row = {"out": n_out, "in": n_in, "weight_bytes": nbytes, "copies": copies}
        views = [w.T for w in ws]
        row["x_WT_gemv"] = guarded(lambda: timed(
            lambda: [x @ wt for x, wt in zip(xs, views)], copies, rounds))
        kn = [mx.contiguous(wt) for wt in views]
        mx.eval(kn)
        row["x_W_in_major_cublas"] = guarded(lambda: timed(
            lambda: [x @ w for x, w in zip(xs, kn)], copies, rounds))
        del kn
        if gemv_available:
            row["orchard_gemv_kernel"] = guarded(lambda: timed(
                lambda: [gemv.gemv(x, w) for x, w in zip(xs, ws)], copies, rounds))
            row["orchard_gemv_kernel"]["max_abs_diff_vs_mlx"] = guarded(lambda: {"v": float(
                mx.abs(gemv.gemv(xs[0], ws[0]).astype(mx.float32)
                       - (xs[0] @ views[0]).astype(mx.float32)).max().item())})
        for k in ("x_WT_gemv", "x_W_in_major_cublas", "orchard_gemv_kernel"):
            if "us" in row.get(k, {}):
                row[k]["gb_s"] = round(nbytes / row[k]["us"] / 1e3, 1)
        out[name] = row
        del xs, ws, views
    return out


def geometry_of(config: dict) -> dict:
    """The sizes attention_alone and matmul_alone need, from a model's config.json."""
    hq = config["num_attention_heads"]
    return {"q_heads": hq, "kv_heads": config.get("num_key_value_heads", hq),
            "head_dim": config.get("head_dim") or config["hidden_size"] // hq,
            "hidden": config["hidden_size"], "intermediate": config["intermediate_size"],
            "vocab": config["vocab_size"]}
