"""Where a page-key decode step's time goes: one attention layer's parts against native's.

    python -m bench.device.page_key_layer_profile --budget-s 230 --out $OUT/pk-layer-profile.json
    python -m bench.device.page_key_layer_profile --tiny --out RESULT.json   # CPU smoke run

Per shape (the issue's: bench.kv's 0.5B "gpu" geometry at 4K batch 1 and 32K batch 8, the
Llama-3.1-8B attention shape at 4K batch 8, then gpu 4K batch 8; 16-token pages) one layer's
store, filled to context + 8 rows (the last page half full: its keys come from the native
tail). Every variant runs once per round as CALLS dependent calls in one `mx.eval` (a call's
output is the next one's query, or its pool the next write's); medians over rounds. `ratio`:
native's time over the variant's, paired per round (> 1: faster), as bench.kv's tok/s ratios.

a. `kernel`: the attention call alone at a compiled step's split plan (longest = the page
   bucket's capacity): native's paged kernel writing its own row (as compiled native steps),
   without `own`, packed v2 int4 (own row), page-key k6v4-kivi / int4-kivi through the
   block-tiled kernel at SPLIT_PLANS and the warp-page one at WARP_SHAPES (each output's max
   abs diff to the block-tiled default plan's). Without CUDA: the MLX reference instead.
b. `write`: one layer's decode write as a compiled step issues it (mx.compile of `write_decode`
   on DeviceSlots, tails planned by TailMap.decode_slots, then `flush_tail`): page-key's
   `_write_planned` (value record, current page re-keyed, tail row) vs native's and int4's
   scatters. `:held` keeps every input pool referenced, so each scatter copies the whole pool
   first, as in pipelined decode while the previous step's kernels hold it
   (docs/lab/engine-kernel-notes.md: 52 such copies in a SmolLM2 step). `FORMAT:fused`: the
   same write as one CUDA kernel (KernelChoices.page_key_write, cuda/page_key_write.py), and
   `fused_check_bytes_differing`: one filling write both ways, bytes that differ.
c. `step`: the whole compiled decode step, native vs k6v4-kivi vs int4-kivi (bench.kv_decode's
   interleaved row, pipelined; page-key steps take the default MLX write) and `k6v4-kivi:fused-
   write` (the fused kernel), whether each compiled; `attribution_us`: a, b, c per layer.

Split plans and hypothesis: docs/lab/benchmarks-kv-page-keys.md, "Where a page-key ... goes".
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from bench.device.page_key_profile_math import PAGE_KEY, attribution, plan
from bench.device.page_key_qmm import _geometry, _maxdiff

# (geometry, context, batch): the three targets first, so a run cut short keeps them
ROWS = [("gpu", 4096, 1), ("gpu", 32768, 8), ("llama8b-2l", 4096, 8), ("gpu", 4096, 8)]
TINY_ROWS = [("tiny", 128, 1), ("tiny", 96, 2)]
# The block-tiled kernel's (label, target blocks, min keys per split, explicit splits, key
# codes in 16-byte copies: KernelChoices.page_key_wide_copies); then the warp-page kernel's
# (KernelChoices.page_key_warp_pages, the engine's at pages of 16 and 64) shapes: warps x stages.
SPLIT_PLANS = [("default", None, None, None, True), ("narrow", None, None, None, False),
               ("s16", None, None, 16, True), ("mk256", None, 256, None, True)]
WARP_SHAPES = [(4, 2), (2, 3), (2, 4), (1, 4)]
PARTIAL = 8          # rows past the context: the last page half full (native tail read)
# The step part's page-key runners: the defaults (fused write on CUDA), then the MLX write
STEP_SPECS = [*PAGE_KEY, "k6v4-kivi:fused-write"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.device.page_key_layer_profile",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSON file (rewritten per row)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke run)")
    ap.add_argument("--rows", default=None, help="GEOMETRY:CONTEXT:BATCH,... (default: ROWS)")
    ap.add_argument("--parts", default="kernel,write,step",
                    help="which parts to run (kernel, write, step); step rows after all others")
    for flag, what in (("calls", "chained calls per timed round"), ("rounds", "timed rounds"),
                       ("steps", "decode steps per step round"), ("repeats", "step rounds")):
        ap.add_argument(f"--{flag}", type=int, default=None, help=what)
    ap.add_argument("--budget-s", type=float, default=230.0,
                    help="start no row that would end after this many seconds, judged by the "
                         "same part's row before (rows left out are listed as skipped)")
    args = ap.parse_args(argv)
    rows = [r.split(":") for r in args.rows.split(",") if r] if args.rows else None
    args.rows = ([(g, int(n), int(b)) for g, n, b in rows] if rows
                 else TINY_ROWS if args.tiny else ROWS)
    args.parts = [p for p in args.parts.split(",") if p]
    for flag, tiny, full in (("calls", 4, 50), ("rounds", 2, 5), ("steps", 2, 8),
                             ("repeats", 2, 3)):
        setattr(args, flag, getattr(args, flag) or (tiny if args.tiny else full))
    return args


class Layer:
    """One attention layer's store in format `fmt`, rows filled to context + PARTIAL, and the
    inputs of the next decode step as a compiled step has them."""

    def __init__(self, geometry: dict, fmt: str, n: int, b: int, dtype):
        import mlx.core as mx
        from bench.kv_decode import _fill
        from bench.kv_runners import PAGE_TOKENS as T, make_store
        from engine.model.loader import LayerGeometry, ModelGeometry
        from engine.runner.compiled_decode import bucket_pages
        hq, kvh, d = (geometry[k] for k in ("num_attention_heads", "num_key_value_heads",
                                             "head_dim"))
        one = ModelGeometry((LayerGeometry(0, "full", kvh, d, d),), 256)
        ctx, room = n + PARTIAL, 2 * T
        self.store = make_store(SimpleNamespace(geometry=one, dtype=dtype), fmt,
                                b * -(-(ctx + room) // T), b)
        tables = _fill(self.store, b, ctx, room)
        self.layer, self.fmt, self.b, self.kvh = self.store.layer(0), fmt, b, kvh
        self.geometry, self.dtype = geometry, dtype
        width = bucket_pages(ctx // T + 1)
        pages = np.array([t[:width] + [t[0]] * (width - len(t[:width])) for t in tables],
                         dtype=np.int32)
        self.page_np = pages[:, ctx // T].copy()
        self.offset_np = np.full(b, ctx % T, dtype=np.int32)
        self.pages, self.longest = mx.array(pages), width * T
        self.ends = mx.array(np.full(b, ctx + 1, dtype=np.int32))
        self.n = ctx + 1
        tails = getattr(self.layer, "tails", None)
        if tails is not None and fmt in PAGE_KEY:
            # As a compiled step plans it: (slot as the step began, slot of the new row).
            self.tail_plan = tails.decode_slots(self.page_np, self.offset_np)
            self.tail_before = mx.array(self.tail_plan[0])
        r = mx.random.split(mx.random.key(3), 3)
        self.q, self.k_new, self.v_new = (mx.random.normal((b, h, 1, d), key=k).astype(dtype)
                                          for h, k in zip((hq, kvh, kvh), r))
        self.scale = d ** -0.5
        mx.eval(self.q, self.k_new, self.v_new, *self.store.arrays())

    def kernel(self, **plan_kw):
        """The layer's CUDA decode attention as a function of the query."""
        from engine.attention.cuda import packed_decode_v2, page_key_decode, paged_decode
        L = self.layer
        if self.fmt == "native":
            own = plan_kw.pop("own", True)
            return lambda q: paged_decode.paged_decode_attention(
                q, L.k, L.v, self.pages, self.ends, self.scale, self.longest,
                own=(self.k_new, self.v_new) if own else None)
        if self.fmt == "int4":
            return lambda q: packed_decode_v2.packed_decode_attention(
                q, self.k_new, self.v_new, L.pool, L.layout, 4, self.pages, self.ends,
                self.longest, self.scale, own=True)
        return lambda q: page_key_decode.page_key_decode_attention(
            q, self.k_new, self.v_new, L.pool, L.layout, PAGE_KEY[self.fmt], L.tail,
            self.pages, self.ends, self.tail_before, self.longest, self.scale, **plan_kw)

    def reference(self):
        """MLX ops: the store's (dequantized) gather and SDPA, as a function of the query."""
        import mlx.core as mx
        k, v = (a.astype(self.q.dtype) for a in self.layer.gather(self.pages))
        mask = (mx.arange(k.shape[2]) < self.n - 1)[None, None, None, :]
        return lambda q: mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale,
                                                              mask=mask)

    def write(self, fused: bool = False):
        """(compiled write of one decode row as a compiled step issues it: state -> state,
        the initial state); `fused`: through the page-key write kernel."""
        import mlx.core as mx
        from engine.attention.cuda import page_key_write
        from engine.runner.compiled_decode import DeviceSlots
        tail = self.fmt in PAGE_KEY
        rows = [self.page_np, self.offset_np, *(self.tail_plan if tail else ())]
        table = mx.array(np.stack(rows).astype(np.int32))
        L = self.layer

        def step(k, v, table, *arrays):
            stand = L.traced(list(arrays))
            slots = DeviceSlots(table[0], table[1])
            if tail:
                slots.tail_before, slots.tail_write = table[2], table[3]
                slots.page_key_writer = page_key_write if fused else None
            stand.write_decode(slots, k, v)
            if tail:
                stand.flush_tail()   # attention's flush: the tail row after the read
            return stand.arrays()

        fn = mx.compile(step)
        return (lambda state: fn(self.k_new, self.v_new, table, *state)), list(L.arrays())


def _chain(fn, state, calls: int, held: list | None = None) -> tuple[float, object]:
    """Seconds per call of `calls` dependent calls (state -> state), built lazily and then run
    in one eval; `held`: keep every intermediate state referenced (no scatter in place)."""
    import mlx.core as mx
    mx.eval(state)
    mx.synchronize()
    x = state   # the caller's reference is gone: the graph holds the first input only
    for _ in range(calls):
        if held is not None:
            held.append(x)
        x = fn(x)
    del state
    t0 = time.perf_counter()
    mx.eval(x)
    mx.synchronize()
    return (time.perf_counter() - t0) / calls, x


def paired(variants: dict, calls: int, rounds: int, native: str = "native") -> dict:
    """variants: name -> (fn, initial state, hold). Round 0 warms up; then every variant once
    per round; per variant median us per call and median paired ratio to `native`."""
    times = {k: [] for k in variants}
    state = {k: v[1] for k, v in variants.items()}
    for r in range(rounds + 1):
        for name, (fn, _, hold) in variants.items():
            held = [] if hold else None
            # popped: the chain's first input must be referenced by its graph only
            t, state[name] = _chain(fn, state.pop(name), calls, held)
            del held
            if r:
                times[name].append(t)
    out = {}
    for name, ts in times.items():
        out[name] = {"us": round(1e6 * statistics.median(ts), 2),
                     "us_rounds": [round(1e6 * t, 2) for t in ts]}
        if native in times and name != native:
            out[name]["ratio"] = round(statistics.median(
                [a / b for a, b in zip(times[native], ts)]), 3)
    return out, state


def kernel_part(layers: dict, args, cuda: bool) -> dict:
    """(a) the attention call alone, per variant and split plan."""
    nat = layers["native"]
    q = nat.q
    if not cuda:
        got, _ = paired({f: (L.reference(), q, False) for f, L in layers.items()},
                        args.calls, args.rounds)
        return {"unavailable": "no CUDA device: the page-key kernel is CUDA only",
                "mlx_reference_gather_sdpa": got}
    variants = {"native": (nat.kernel(), q, False),
                "native-no-own": (nat.kernel(own=False), q, False),
                "int4-v2": (layers["int4"].kernel(), q, False)}
    plans, diffs = {}, {}
    for fmt in PAGE_KEY:
        L = layers[fmt]
        base = L.kernel()(q)
        for label, target, min_keys, splits, wide in SPLIT_PLANS:
            fn = L.kernel(target_blocks=target, min_keys=min_keys, splits=splits,
                          wide_copies=wide)
            variants[f"{fmt}:{label}"] = (fn, q, False)
            plans[label] = plan(nat.b, nat.kvh, nat.longest, nat.n, target, min_keys, splits)
            diffs[f"{fmt}:{label}"] = _maxdiff(fn(q), base)
        for w, st in WARP_SHAPES:   # the warp-page kernel, the default plan, at each shape
            name, fn = f"{fmt}:warp-pages-{w}x{st}", L.kernel(warp_pages=True, warp_shape=(w, st))
            variants[name], diffs[name] = (fn, q, False), _maxdiff(fn(q), base)
    got, _ = paired(variants, args.calls, args.rounds)
    for name, d in diffs.items():
        got[name]["max_abs_vs_default_plan"] = round(d, 5)
    best = {fmt: min((k for k in got if k.startswith(fmt + ":")), key=lambda k: got[k]["us"])
            for fmt in PAGE_KEY}
    return {"variants": got, "page_key_plans": plans, "best_plan": best,
            "plan_uncompiled_longest": plan(nat.b, nat.kvh, nat.n, nat.n)}


def write_part(layers: dict, args, cuda: bool) -> dict:
    """(b) one layer's decode write as a compiled step issues it, in place and held; the
    page-key formats also through the fused write kernel (CUDA only)."""
    variants = {}
    for fmt, L in layers.items():
        for tag, fused, hold in (("", False, False), (":held", False, True),
                                 (":fused", True, False)):
            if not fused or (cuda and fmt in PAGE_KEY):
                fn, state = L.write(fused)
                variants[fmt + tag] = (fn, state, hold)
    got, _ = paired(variants, args.calls, args.rounds)
    if cuda:   # the kernel's first device runs: its bytes against the MLX write's
        L = layers["native"]
        got["fused_check_bytes_differing"] = {
            f: fused_check(L.geometry, f, L.n - 1 - PARTIAL, L.b, L.dtype) for f in PAGE_KEY}
    got["pool_mb"] = {f: round(sum(a.nbytes for a in L.layer.arrays()) / 2 ** 20, 2)
                      for f, L in layers.items()}
    return got


def fused_check(geometry: dict, fmt: str, n: int, b: int, dtype) -> dict:
    """One decode write from the same state through the MLX ops and the fused kernel, every row
    at its page's last offset (so every row keys its page): bytes that differ per array."""
    import mlx.core as mx
    from bench.kv_runners import PAGE_TOKENS as T
    L = Layer(geometry, fmt, n + T - 1 - PARTIAL, b, dtype)   # offset T - 1: a fill
    got = []
    for fused in (False, True):
        fn, state = L.write(fused)
        state = [(a.view(mx.uint8) + 0).view(a.dtype) for a in state]   # own copies: written
        got.append(fn(state))                                           # in place by the kernel
        mx.eval(got[-1])
    return {name: int((x.view(mx.uint8) != y.view(mx.uint8)).sum().item())
            for name, x, y in zip(("pool", "k_tail", "v_tail"), *got)}


def step_part(loaded, n: int, b: int, args) -> dict:
    """(c) the whole compiled decode step (bench.kv_decode's interleaved row, pipelined)."""
    from bench import kv_decode
    from bench.kv_runners import PAGE_TOKENS
    from engine.attention.choices import DEFAULT_KERNELS
    room = args.steps * (args.repeats + 1)
    made, real = [], kv_decode.make_runner   # the row's runners, kept: did each compile?
    kv_decode.make_runner = lambda *a, **k: made.append(real(*a, **k)) or made[-1]
    kv_decode.DECODE_KERNELS["fused-write"] = dict(page_key_write=None)   # this bench's spec
    try:
        row = kv_decode._interleaved_row(loaded, STEP_SPECS, b * -(-(n + room) // PAGE_TOKENS),
                                         b, n, room, args.steps, args.repeats, DEFAULT_KERNELS,
                                         pipelined=True)
    finally:
        kv_decode.make_runner = real
        kv_decode.DECODE_KERNELS.pop("fused-write")
    for spec, runner in zip(["native", *STEP_SPECS], made):
        cell = row.get(spec, {})
        compiled = getattr(runner, "compiled", None)
        cell["compiled"] = compiled is not None and compiled.traces > 0
        if "tok_s" in cell:
            cell["step_ms"] = round(1e3 * b / cell["tok_s"], 3)
    for fmt in STEP_SPECS if "step_ms" in row.get("native", {}) else ():
        if "step_ms" in row.get(fmt, {}):
            row[fmt]["extra_ms_per_layer"] = round((row[fmt]["step_ms"] - row["native"][
                "step_ms"]) / loaded.geometry.num_layers, 4)
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    import tempfile
    import mlx.core as mx
    from bench.kv_runners import PAGE_TOKENS, progress
    from engine.attention.cuda.paged_decode import available
    from engine.model.loader import default_compute_dtype
    cuda = available()
    say = lambda m: progress(m, "page_key_layer_profile")
    doc = {"command": "python -m bench.device.page_key_layer_profile " + " ".join(sys.argv[1:]),
           "device": str(mx.default_device()), "mlx": mx.__version__, "cuda": cuda,
           "page_tokens": PAGE_TOKENS, "partial_rows": PARTIAL, "calls": args.calls,
           "rounds": args.rounds, "split_plans": SPLIT_PLANS, "parts": args.parts,
           "rows": {}, "skipped": []}
    save = lambda: args.out.write_text(json.dumps(doc, indent=1))
    save()

    def fits(last_s: float, what: str) -> bool:
        if time.perf_counter() - started + last_s <= args.budget_s:
            return True
        doc["skipped"].append(what)
        say(f"skipped {what} (budget)")
        save()
        return False

    last = 0.0   # the same part's previous row, seconds (a row that would not end is skipped)
    for g, n, b in args.rows if {"kernel", "write"} & set(args.parts) else ():
        name = f"{g}-ctx{n}-b{b}"
        if not fits(last, f"{name}:layer"):
            continue
        t0 = time.perf_counter()
        row = doc["rows"].setdefault(name, {})
        try:
            layers = {f: Layer(_geometry(g), f, n, b, default_compute_dtype())
                      for f in ("native", "int4", *PAGE_KEY)}
        except Exception as e:   # a store this backend cannot build: record it, go on
            row["error"] = f"{type(e).__name__}: {e}"[:300]
            say(f"{name}: {row['error']}")
            save()
            continue
        for part, run in (("kernel", lambda: kernel_part(layers, args, cuda)),
                          ("write", lambda: write_part(layers, args, cuda))):
            if part not in args.parts:
                continue
            try:
                row[part] = run()
            except Exception as e:   # a failed part: record it, keep the others
                row[part] = {"error": f"{type(e).__name__}: {e}"[:300]}
            say(f"{name} {part}: {json.dumps(row[part])[:600]}")
            row["attribution_us"] = attribution(row)
            save()
        del layers
        mx.clear_cache()
        last = time.perf_counter() - t0
        row["layer_seconds"] = round(last, 1)

    if "step" in args.parts and fits(0.0, "step (models)"):
        from bench.device.page_key_qmm import _models
        last = 0.0
        with tempfile.TemporaryDirectory() as tmp:
            say("building the models")
            models = _models([g for g, _, _ in args.rows], Path(tmp))
            for g, n, b in args.rows:
                name = f"{g}-ctx{n}-b{b}"
                if not fits(last, f"{name}:step"):
                    continue
                t0 = time.perf_counter()
                row = doc["rows"].setdefault(name, {})
                try:
                    row["step"] = step_part(models[g], n, b, args)
                except Exception as e:   # a timed round failed: record it, run the others
                    row["step"] = {"error": f"{type(e).__name__}: {e}"[:300]}
                row["attribution_us"] = attribution(row)
                last = time.perf_counter() - t0
                row["step_seconds"] = round(last, 1)
                say(f"{name} step: {json.dumps(row['step'])[:600]}")
                save()
    doc["seconds"] = round(time.perf_counter() - started, 1)
    save()
    say(f"done in {doc['seconds']} s: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
