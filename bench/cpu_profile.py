"""Where a CPU engine step spends its time, split by op, on a real model.

    python -m bench.cpu_profile --model smollm2 --out profile.json

Two shapes, both through the engine's own ModelRunner over the paged KV store (what a served
step runs): a long prefill (one prompt of --prompt tokens, batch 1, in chunks of --chunk as
the scheduler cuts it at max_step_tokens) and a saturated decode step (--rows rows whose contexts
are spread over --contexts; more counts, e.g. `--rows 16,32`, add shapes `decode_rows32`...).

Each --variant (a name and KernelChoices fields, e.g. `--variant before:cpu_softmax=0`; none
given: production's choices as `default`) gets its own runner over the same model and pages, and
every variant and shape is timed twice in the same process, interleaved over --repeats rounds:
- `plain`: the step as served (lazy graph, one evaluation), best round; `build_s` is the host
  time to build the graph before anything is evaluated.
- `by_op`: the same step with an evaluation barrier after every op class (projections, norms,
  rope, KV writes, attention and apart its NumPy softmax, activation, LM head, sampling), so
  each op's time is its own;
  `glue` is whatever runs between them (reshapes, transposes, residual adds). Barriers cost
  threading hand-offs, so `by_op` sums a little above `plain`: read its shares, not its sum.

`--engine` adds the served view of the same shapes, through `Engine` (one per variant, default
config but for the variant's KernelChoices): a lone --prompt-token request's time to first token
and the steady decode rate of --rows requests (prompts of --contexts lengths) decoding together;
`step_s` (rows / rate) beside the runner's decode step shows the engine's own host work
(scheduling, sampling bookkeeping, streams).

Times are wall clock (the host is shared: compare shares and ratios within one run, never
absolute times across runs).
"""
from __future__ import annotations

import argparse
import os
import platform
import time
from collections import defaultdict
from contextlib import contextmanager
from functools import partial

from bench.output import run_bench
from engine.model.names import MODEL_HELP, model_arg


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.cpu_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=model_arg, required=True, help=MODEL_HELP)
    p.add_argument("--prompt", type=int, default=1200, help="prefill prompt tokens")
    p.add_argument("--chunk", type=int, default=512,
                   help="prefill chunk (the engine's max_step_tokens)")
    p.add_argument("--rows", default="16", help="decode rows (comma-separated counts)")
    p.add_argument("--contexts", default="100,500", help="decode contexts: lo,hi (spread)")
    p.add_argument("--page-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--shapes", default="prefill,decode")
    p.add_argument("--variant", action="append", default=[], type=variant_arg,
                   help="NAME[:FIELD=VALUE,...] KernelChoices for one runner (repeatable)")
    p.add_argument("--no-by-op", action="store_true", help="time the plain steps only")
    p.add_argument("--engine", action="store_true", help="also time the shapes through Engine")
    p.add_argument("--decode-tokens", type=int, default=24,
                   help="tokens each --engine decode request generates")
    p.add_argument("--out")
    return p.parse_args(argv)


def variant_arg(spec: str) -> tuple[str, dict]:
    """`NAME[:FIELD=VALUE,...]` -> (name, KernelChoices fields); booleans as 0/1."""
    from dataclasses import fields

    from engine.attention.choices import KernelChoices

    name, _, rest = spec.partition(":")
    types = {f.name: f.type for f in fields(KernelChoices)}
    out = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in types:
            raise argparse.ArgumentTypeError(f"{key!r} is not a KernelChoices field")
        out[key] = (value not in ("0", "false", "False") if "bool" in str(types[key])
                    else int(value) if "int" in str(types[key]) else value)
    return name, out


class OpTimer:
    """Evaluation barriers around op classes, patched onto the classes the model calls. A timed
    call inside another (the softmax inside attention) counts for itself only; what its inputs
    cost to evaluate (the score GEMM before that softmax) stays with the enclosing op."""

    def __init__(self):
        self.times: dict[str, float] = defaultdict(float)
        self.on = False
        self._nested: list[float] = []   # time of timed calls inside each open timed call

    def wrap(self, name: str, fn):
        import mlx.core as mx
        timer = self

        def timed(*args, **kwargs):
            if not timer.on:
                return fn(*args, **kwargs)
            t = time.perf_counter()
            mx.eval([a for a in (*args, *kwargs.values()) if isinstance(a, mx.array)])
            t1 = time.perf_counter()
            timer._nested.append(0.0)
            try:
                out = fn(*args, **kwargs)
                mx.eval(out)
            finally:
                inner = timer._nested.pop()
            t2 = time.perf_counter()
            timer.times[name] += t2 - t1 - inner
            if timer._nested:
                timer._nested[-1] += t2 - t1
            else:
                timer.times["glue"] += t1 - t
            return out
        return timed

    @contextmanager
    def patched(self, loaded):
        """Patch the model's op classes (and the runner's LM head) for the duration."""
        import mlx.nn as nn
        from mlx_lm.models import llama

        from engine.attention import cpu_softmax
        from engine.attention.paged import PagedLayerCache

        rope_cls = type(loaded.model.model.layers[0].self_attn.rope)
        saved = [(nn.Linear, "__call__"), (nn.RMSNorm, "__call__"), (rope_cls, "__call__"),
                 (PagedLayerCache, "update_and_fetch"), (PagedLayerCache, "attend"),
                 (nn.Embedding, "__call__"), (llama, "swiglu"),
                 (cpu_softmax, "softmax_in_place"), (cpu_softmax, "_exp_in_place"),
                 (cpu_softmax, "_mask_upper")]
        names = ["projections", "norms", "rope", "kv_write", "attention", "embed", "activation",
                 "attention_softmax", "attention_softmax", "attention_softmax"]
        originals = [getattr(obj, attr) for obj, attr in saved]
        head = loaded.head
        try:
            for (obj, attr), orig, name in zip(saved, originals, names):
                setattr(obj, attr, self.wrap(name, orig))
            loaded.head = self.wrap("lm_head", head)
            yield
        finally:
            for (obj, attr), orig in zip(saved, originals):
                setattr(obj, attr, orig)
            loaded.head = head


def run(args) -> dict:
    import mlx.core as mx
    import numpy as np

    from engine.attention.choices import KernelChoices
    from engine.kv.store import KVStore
    from engine.model.loader import load_model
    from engine.runner.paged import ModelRunner
    from engine.sched.seq import Chunk
    from engine.sampling.params import SamplingParams
    from engine.sampling.sampler import RowSpec, sample

    loaded = load_model(args.model, fuse=True)
    rng = np.random.default_rng(0)
    lo, hi = (int(x) for x in args.contexts.split(","))
    counts = [int(x) for x in args.rows.split(",")]
    contexts = np.linspace(lo, hi, counts[0]).astype(int).tolist()
    t = args.page_tokens
    # Every decode row gets pages for the longest context (shapes of other row counts reuse them).
    pages_per = [-(-args.prompt // t)] + [-(-(hi + 1) // t)] * max(counts)
    kv = KVStore(loaded.geometry, sum(pages_per), t, loaded.dtype)
    variants = dict(args.variant or [("default", {})])
    runners = {name: ModelRunner(loaded, kv, kernels=KernelChoices(**fields))
               for name, fields in variants.items()}
    vocab = loaded.geometry.vocab_size
    timer = OpTimer()
    spec = RowSpec(SamplingParams(), 0, 0)    # the served default (temperature 1)
    sample_rows = timer.wrap("sampling", sample)

    tables, first = [], 0
    for n in pages_per:
        tables.append(list(range(first, first + n)))
        first += n
    prompt = rng.integers(100, vocab - 100, args.prompt).tolist()
    # Decode rows' histories: their KV is whatever the pages hold (the cost does not depend on
    # it); only the lengths matter.
    decode_shapes = {
        n: [Chunk(i + 1, [int(rng.integers(100, vocab - 100))], c, tables[i + 1])
            for i, c in enumerate(np.linspace(lo, hi, n).astype(int).tolist())]
        for n in counts}

    def prefill(runner):
        t0, c0 = time.perf_counter(), time.process_time()
        build = 0.0
        for pos in range(0, args.prompt, args.chunk):
            ids = prompt[pos:pos + args.chunk]
            b0 = time.perf_counter()
            logits = runner.forward([Chunk(0, ids, pos, tables[0])])
            tok = sample_rows(logits, [spec])
            build += time.perf_counter() - b0
            mx.eval(tok, kv.arrays())
        return time.perf_counter() - t0, time.process_time() - c0, build

    def decode(runner, rows=counts[0]):
        chunks = decode_shapes[rows]
        t0, c0 = time.perf_counter(), time.process_time()
        logits = runner.forward(chunks)
        tok = sample_rows(logits, [spec] * len(chunks))
        build = time.perf_counter() - t0
        mx.eval(tok, kv.arrays())
        return time.perf_counter() - t0, time.process_time() - c0, build

    def by_op(step, runner):
        timer.times.clear()
        timer.on = True
        try:
            total = step(runner)[0]
        finally:
            timer.on = False
        out = {k: round(v, 4) for k, v in sorted(timer.times.items(), key=lambda kv: -kv[1])}
        out["total_s"] = round(total, 4)
        return out

    shapes = {"prefill": prefill, "decode": decode,
              **{f"decode_rows{n}": partial(decode, rows=n) for n in counts[1:]}}
    chosen = [s for s in args.shapes.split(",") if s]
    if "decode" in chosen:
        chosen += [f"decode_rows{n}" for n in counts[1:]]
    relative = os.path.relpath(args.model)
    result = {"model": args.model if relative.startswith("..") else relative,
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "device": str(mx.default_device()),
                          "loadavg_at_start": os.getloadavg()},
              "prefill_shape": {"prompt": args.prompt, "chunk": args.chunk},
              "decode_shape": {"rows": counts, "contexts": contexts},
              "page_tokens": t, "variants": variants, "repeats": args.repeats}
    rounds = {(v, s): {"plain": [], "by_op": []} for v in runners for s in chosen}
    with timer.patched(loaded):
        for (v, s) in rounds:   # warm-up: first calls allocate
            shapes[s](runners[v])
        for _ in range(args.repeats):
            for (v, s), got in rounds.items():
                total, cpu, build = shapes[s](runners[v])
                got["plain"].append({"total_s": round(total, 4), "cpu_s": round(cpu, 4),
                                     "build_s": round(build, 4)})
                if not args.no_by_op:
                    got["by_op"].append(by_op(shapes[s], runners[v]))
    for (v, s), got in rounds.items():
        point = result.setdefault(s, {}).setdefault(v, {})
        point["plain_best"] = min(got["plain"], key=lambda r: r["total_s"])
        if got["by_op"]:
            ops = min(got["by_op"], key=lambda r: r["total_s"])
            whole = sum(x for k, x in ops.items() if k != "total_s")
            point["by_op_best"] = ops
            point["by_op_share"] = {k: round(x / whole, 3) for k, x in ops.items()
                                    if k != "total_s"}
        point["rounds"] = got
    for s in chosen:   # each variant's time over the first variant's, round by round
        base = next(iter(result[s].values()))["rounds"]["plain"]
        for point in result[s].values():
            for clock in ("total_s", "cpu_s"):
                point[f"{clock}_vs_first_median"] = _median_ratio(
                    [r[clock] for r in point["rounds"]["plain"]], [r[clock] for r in base])
    del runners, kv, loaded
    if args.engine:
        result["engine"] = served(args, variants, prompt, contexts, vocab)
    result["machine"]["loadavg_at_end"] = os.getloadavg()
    return result


def _median_ratio(xs: list[float], bases: list[float]) -> float:
    import statistics
    return round(statistics.median(x / b for x, b in zip(xs, bases)), 3)


def served(args, variants: dict, prompt: list[int], contexts: list[int], vocab: int) -> dict:
    """TTFT of a lone prompt and steady decode of --rows requests through Engine, per variant,
    interleaved over --repeats rounds (best of each)."""
    import asyncio

    import numpy as np

    from bench.engine import Window
    from engine import Engine
    from engine.attention.choices import KernelChoices
    from engine.config import EngineConfig
    from engine.request import GenerationRequest
    from engine.sampling.params import SamplingParams

    rng = np.random.default_rng(1)
    cfg = EngineConfig(model=args.model, max_num_seqs=len(contexts), page_tokens=args.page_tokens,
                       kv_budget_bytes=256 << 20, max_step_tokens=args.chunk)
    engines = {name: Engine(cfg, kernels=KernelChoices(**fields))
               for name, fields in variants.items()}
    rounds = {name: {"ttft_s": [], "ttft_cpu_s": [], "decode_tok_s": [], "decode_tok_s_cpu": []}
              for name in engines}

    def fresh(n):   # never repeats a prompt (no prefix cache here, but keep runs independent)
        return rng.integers(100, vocab - 100, n).tolist()

    async def lone(eng, rid):
        t, c = time.perf_counter(), time.process_time()
        async for _ in eng.generate(GenerationRequest(rid, fresh(len(prompt)), SamplingParams(
                temperature=0, max_tokens=1, ignore_eos=True))):
            return time.perf_counter() - t, time.process_time() - c

    async def decode(eng, rid):
        w = Window(len(contexts))

        async def row(i, n):
            params = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True, seed=i)
            async for d in eng.generate(GenerationRequest(f"{rid}-{i}", fresh(n), params)):
                w.add(i, len(d.token_ids))
        await asyncio.gather(*(row(i, n) for i, n in enumerate(contexts)))
        return w.rate()

    try:
        for r in range(-1, args.repeats):   # round -1 warms each engine up, unrecorded
            for name, eng in engines.items():
                ttft = asyncio.run(lone(eng, f"p{r}"))
                rate = asyncio.run(decode(eng, f"d{r}"))
                if r >= 0:
                    for key, x in zip(rounds[name], (*ttft, *rate)):
                        rounds[name][key].append(round(x, 3))
    finally:
        for eng in engines.values():
            eng.shutdown()
    out = {}
    first = next(iter(rounds.values()))
    for name, got in rounds.items():
        best_rate = max(got["decode_tok_s"])
        out[name] = {"ttft_s_best": min(got["ttft_s"]), "decode_tok_s_best": best_rate,
                     "decode_step_s": round(len(contexts) / best_rate, 4),
                     **{f"{k}_vs_first_median": _median_ratio(got[k], first[k]) for k in got},
                     "rounds": got}
    return out


def main(argv=None) -> int:
    return run_bench(parse_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
