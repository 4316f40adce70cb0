"""Batch-1 decode timed on the device: the engine per decode-kernel split plan against mlx-lm.

The device part of bench/decode_graph.py (`--device-time`, its arguments). The graphs there
show the engine's step issuing fewer kernels than mlx-lm's; this measures whether the paged
decode kernel's serial walk over the keys at short contexts (one split: rows * KV heads blocks
of 4 warps, each warp visiting every 4th key in turn) is the engine's extra time per step, by
timing the same step with shorter history splits (KernelChoices.decode_split_min_keys).
"""
from __future__ import annotations


def device_time(args, model_dir: str) -> dict:
    """Batch-1 decode after `--context` prompt tokens, on the device: the engine's compiled step
    (production's choices but the decode kernel's split plan, `decode_split_min_keys`) and
    mlx-lm's generate_step, same weights, alternating rounds. Per side and round: ms per token
    pipelined (step n+1 queued before step n is read back, as both serve) and the medians of
    synchronous steps split into build / issue / wait (bench.step_graph.split_steps). What it
    tests: whether the paged decode kernel's serial walk over the keys (one split at short
    contexts: rows * KV heads blocks of 4 warps) is the engine's extra time per step."""
    import statistics
    import time

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    from bench.compiled_check import make_runner
    from bench.step_graph import split_steps
    from engine.attention.choices import KernelChoices
    from engine.attention.cuda import paged_decode as pd
    from engine.model.loader import load_model
    from engine.runner.compiled_decode import bucket_pages
    from engine.sampling.params import SamplingParams
    from engine.sampling.sampler import RowSpec, sample
    from engine.sched.seq import Chunk

    gpu = pd.available()   # elsewhere the step gathers pages (a smoke test of this code only)
    t, ctx, n = args.page_tokens, args.context, args.steps
    pages = -(-(ctx + n + 3) // t)   # every round rewinds to `ctx` (rewind below)
    table = list(range(pages))
    prompt = [3 + j % 200 for j in range(ctx)]
    specs = [RowSpec(SamplingParams(temperature=0.0), 0, 0)]
    lm = load_model(model_dir, dtype="bfloat16", fuse=True)
    kvh = lm.geometry.layers[0].kv_heads
    plans = [(lm, mk, f"engine_min_keys_{mk}") for mk in args.min_keys.split(",") if mk]
    if args.unfused:   # the same step with mlx-lm's separate q/k/v and gate/up matmuls
        plans.append((load_model(model_dir, dtype="bfloat16", fuse=False), "default",
                      "engine_unfused_min_keys_default"))
    sides: dict = {}
    for lm, mk, name in plans:
        keys = None if mk == "default" else int(mk)
        runner = make_runner(lm, "native", pages, t, KernelChoices(
            decode_split_min_keys=keys, compiled_decode=None if gpu else True))
        first = mx.argmax(runner.forward([Chunk(0, prompt, 0, table)]), axis=-1).astype(mx.int32)
        mx.eval(first, runner.kvstore.arrays())
        state = {"toks": first, "n": ctx}

        def launch(runner=runner, state=state):
            logits = runner.forward([Chunk(0, [0], state["n"], table)],
                                    decode_tokens=state["toks"])
            state["toks"], state["n"] = sample(logits, specs), state["n"] + 1
            return [state["toks"]]

        capacity = bucket_pages(ctx // t + 1) * t   # the compiled step's split plan reads it
        sides[name] = {
            "launch": launch, "arrays": runner.kvstore.arrays, "state": state,
            "splits_at_start": pd.split_count(1, kvh, capacity, None, keys),
            "compiled": runner.compiled is not None, "reset": ctx}
    model, _ = load(model_dir)
    cache = make_prompt_cache(model)
    ref = {"y": mx.argmax(model(mx.array([prompt]), cache=cache)[:, -1, :], axis=-1)}
    mx.eval(ref["y"], [c.state for c in cache])

    def mlx_launch():   # generate_step's _step, greedy
        logits = model(ref["y"][None], cache=cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        ref["y"] = mx.argmax(logprobs, axis=-1)
        return [ref["y"], logprobs]

    sides["mlx_lm"] = {"launch": mlx_launch, "arrays": lambda: [c.state for c in cache]}

    def pipelined(side, n=n) -> float:
        prev = None
        mx.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            out = side["launch"]()
            mx.async_eval(*out, side["arrays"]())
            if prev is not None:
                prev.item()
            prev = out[0]
        prev.item()
        return 1000 * (time.perf_counter() - t0) / n

    def rewind(side):   # every round decodes from the same context length
        if "state" in side:
            side["state"]["n"] = side["reset"]
        else:
            for c in cache:
                c.offset = ctx

    results = {k: {"ms_per_token": [], "sync": []} for k in sides}
    for side in sides.values():   # traces, kernel builds and every page bucket, unrecorded
        rewind(side)
        pipelined(side, n + 2)
    for _ in range(args.rounds):
        for name, side in sides.items():
            rewind(side)
            results[name]["ms_per_token"].append(round(pipelined(side), 3))
            rewind(side)
            results[name]["sync"].append(split_steps(side["launch"], side["arrays"], n))
    out = {"context": ctx, "steps": n, "rounds": args.rounds, "decode_kernel": gpu}
    for name, r in results.items():
        med = statistics.median(r["ms_per_token"])
        out[name] = {"ms_per_token": r["ms_per_token"], "tok_s_median": round(1000 / med, 1),
                     "sync_median": {k: statistics.median(s[k] for s in r["sync"])
                                     for k in r["sync"][0]}}
        for k in ("splits_at_start", "compiled"):
            if k in sides[name]:
                out[name][k] = sides[name][k]
    base = statistics.median(results["mlx_lm"]["ms_per_token"])
    for name in results:
        out[name]["vs_mlx_lm"] = round(base / statistics.median(results[name]["ms_per_token"]), 3)
    if gpu:
        out["attention_alone"] = attention_alone(args, lm)
    return out


def attention_alone(args, lm, calls: int = 32, rounds: int = 20) -> dict:
    """us per call of one layer's batch-1 decode attention at `--context` keys, `calls` calls
    (a step's layers) in one compiled function evaluated together, so the host issues them from
    C++ and a call longer than its issue shows as itself: the paged decode kernel per
    `--min-keys` plan (capacity as the compiled step plans it) against mx.fast's SDPA over a
    contiguous cache (mlx-lm's). Median of `rounds`."""
    import statistics
    import time

    import mlx.core as mx

    from engine.attention.cuda import paged_decode as pd
    from engine.runner.compiled_decode import bucket_pages

    g = lm.geometry.layers[0]
    hq = int(lm.config["num_attention_heads"])
    t, n = args.page_tokens, args.context + 1
    per_row = bucket_pages(args.context // t + 1)
    # One query per call: identical calls would be merged by mx.compile.
    qs = [mx.random.normal((1, hq, 1, g.head_dim)).astype(mx.bfloat16) for _ in range(calls)]
    kp, vp = (mx.random.normal((g.kv_heads, per_row, t, g.head_dim)).astype(mx.bfloat16)
              for _ in range(2))
    pages = mx.arange(per_row, dtype=mx.int32)[None]
    ends = mx.array([n], dtype=mx.int32)
    k, v = (mx.random.normal((1, g.kv_heads, 256 * -(-n // 256), g.head_dim)).astype(mx.bfloat16)
            for _ in range(2))
    mx.eval(qs, kp, vp, pages, ends, k, v)
    scale = g.head_dim ** -0.5

    def timed(fn) -> float:
        f = mx.compile(fn)
        for _ in range(3):
            mx.eval(f())
        ts = []
        for _ in range(rounds):
            mx.synchronize()
            t0 = time.perf_counter()
            mx.eval(f())
            mx.synchronize()
            ts.append((time.perf_counter() - t0) / calls * 1e6)
        return round(statistics.median(ts), 2)

    out = {"keys": n, "q_heads": hq, "kv_heads": g.kv_heads, "head_dim": g.head_dim,
           "calls": calls}
    for mk in [x for x in args.min_keys.split(",") if x]:
        keys = None if mk == "default" else int(mk)
        splits = pd.split_count(1, g.kv_heads, per_row * t, None, keys)
        out[f"paged_decode_min_keys_{mk}"] = {"splits": splits, "us_per_call": timed(
            lambda keys=keys: [pd.paged_decode_attention(q, kp, vp, pages, ends, scale,
                                                         per_row * t, None, keys)
                               for q in qs])}
    out["sdpa_vector"] = {"us_per_call": timed(lambda: [
        mx.fast.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], scale=scale)
        for q in qs])}
    return out
