"""Batch-1 decode, engine variants against mlx-lm, at several shapes in one process (issue 33).

    python -m bench.decode_sweep --out sweep.json          # the H200 sweep: 1B and 8B shapes
    python -m bench.decode_sweep --tiny --out sweep.json   # a tiny llama shape, CPU smoke run

Random bf16 weights in each shape's geometry (bench/device/shapes, built once under `--cache`,
as bench/decode_graph.py does). Per shape, after `--context` prompt tokens, alternating rounds
of every side (one process, one device):
- engine variants (VARIANTS: KernelChoices knobs and weight layouts; each compiled as on CUDA,
  except `uncompiled`): ms per token pipelined (step n+1 queued before step n is read back, as
  the engine serves) and the medians of synchronous steps split into build / issue / wait
  (bench.step_graph.split_steps: `wait` is the device time left after the host issued);
- `mlx_lm_step`: mlx-lm's generate_step body (model over KVCache, log-softmax, argmax), timed
  the same way; `mlx_lm_stream_generate`: mlx-lm's own stream_generate on the same model, its
  generation_tps (EOS ignored, detokenizer off);
then `attention_alone` and `matmul_alone` (bench/decode_sweep_kernels.py). Each side's first
greedy tokens are compared with the default's (`tokens_match_default`): a variant that changes
results beyond rounding shows there.

Time bounds: a side that has used `--side-seconds` stops taking rounds; past `--budget` seconds
the sweep loads no more weights, starts no more shapes (`budget_exhausted`), skips the kernel
timings and takes no round after each built side's first. A side whose setup or
kernel fails (e.g. a kernel that does not compile on the device) records its error and the rest
go on. The JSON is rewritten after every shape (a killed run keeps what was done). Progress on
stderr.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.decode_sweep_kernels import attention_alone, geometry_of, guarded, matmul_alone
from bench.output import emit
from bench.step_graph import WARM_STEPS

# name: (weights, KernelChoices overrides, greedy tokens from the step). Weights: "fused" (the
# loader's default), "unfused" (mlx-lm's separate q/k/v and gate/up), "in_major" (each weight a
# contiguous [in, out] copy: cuBLAS instead of MLX's GEMV, linear.store_input_major), "gemv"
# (fused, one-token calls through engine/attention/cuda/gemv.py; the default elsewhere).
VARIANTS = {
    "default": ("fused", {}, False),
    "model_forward": ("fused", {"flat_decode": False}, False),   # mlx-lm's [B, 1, hidden] layers
    "min_keys_32": ("fused", {"decode_split_min_keys": 32}, False),
    "warps_16": ("fused", {"decode_warps": 16}, False),
    "warps_16_min_keys_64": ("fused", {"decode_warps": 16, "decode_split_min_keys": 64}, False),
    "greedy_in_step": ("fused", {"compiled_greedy": True}, True),
    "greedy_warps_16": ("fused", {"compiled_greedy": True, "decode_warps": 16}, True),
    "uncompiled": ("fused", {"compiled_decode": False}, False),
    "unfused": ("unfused", {}, False),
    "in_major_weights": ("in_major", {}, False),
    "gemv_kernel": ("gemv", {}, False),
    # The three step-level candidates together (shares the gemv side's weights).
    "gemv_greedy_warps_16": ("gemv", {"compiled_greedy": True, "decode_warps": 16}, True),
}
TINY = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2,
        "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "rms_norm_eps": 1e-5, "vocab_size": 512, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "max_position_embeddings": 2048}
COMPARE_TOKENS = 16
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.decode_sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="llama-3.2-1b,llama-3.1-8b")
    p.add_argument("--tiny", action="store_true", help="a 2-layer tiny llama instead of --shapes")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "orchard-decode-graph"),
                   help="where each shape's random model folder is written once and reused "
                        "(bench.decode_graph's default: the two share the folders)")
    p.add_argument("--context", type=int, default=160)
    p.add_argument("--page-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=64, help="pipelined steps per round")
    p.add_argument("--sync-steps", type=int, default=24, help="synchronous steps per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--side-seconds", type=float, default=12.0,
                   help="timed seconds after which a side takes no more rounds")
    p.add_argument("--budget", type=float, default=230.0, help="whole-run seconds")
    p.add_argument("--hbm-gbs", type=float, default=4800.0,
                   help="the device's memory bandwidth for the limit (H200: 4.8 TB/s)")
    p.add_argument("--no-kernels", action="store_true", help="skip the kernel-level timings")
    p.add_argument("--out")
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    bad = sorted(set(args.variants) - set(VARIANTS))
    if bad or "default" not in args.variants:
        p.error(f"variants must include default and be among {', '.join(VARIANTS)}")
    if args.sync_steps <= WARM_STEPS or args.steps < 2:
        p.error(f"--sync-steps must exceed {WARM_STEPS} (left out of the medians), --steps >= 2")
    args.shapes = ["tiny"] if args.tiny else [s for s in args.shapes.split(",") if s]
    return args


def model_folder(args, shape: str) -> str:
    if shape != "tiny":
        from bench.decode_graph import model_folder as shaped
        return shaped(argparse.Namespace(model=None, shape=shape, layers=None, cache=args.cache,
                                         tokenizer_from=None))
    import shutil

    from bench.decode_graph import MODELS
    from bench.engine import build_shaped

    root = Path(args.cache)
    out = root / "tiny-random"
    if not (out / "model.safetensors").exists():
        src = root / "src" / "tiny"
        src.mkdir(parents=True, exist_ok=True)
        (src / "config.json").write_text(json.dumps(TINY))
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (MODELS / "orchard-tiny" / f).exists():
                shutil.copy(MODELS / "orchard-tiny" / f, src / f)
        build_shaped(str(src), root, "bfloat16")
    return str(out)


class Side:
    """One timed decoder: `launch()` queues a step and returns [tokens, ...]; `arrays()` what
    the step writes; `rewind()` back to the prompt's end."""
    def __init__(self, launch, arrays, rewind, info: dict):
        self.launch, self.arrays, self.rewind, self.info = launch, arrays, rewind, info
        self.ms, self.sync, self.spent, self.tokens = [], [], 0.0, []
        self.logits = self.first_logprobs = None   # the last step's (lazy); the first's


def engine_side(models: dict, variant: str, prompt: list[int], args, gpu: bool) -> Side:
    import mlx.core as mx

    from bench.compiled_check import make_runner
    from engine.attention.choices import KernelChoices
    from engine.attention.cuda import paged_decode as pd
    from engine.runner.compiled_decode import bucket_pages
    from engine.sampling.params import SamplingParams
    from engine.sampling.sampler import RowSpec, sample
    from engine.sched.seq import Chunk

    weights, overrides, greedy = VARIANTS[variant]
    lm = models[weights]
    t, ctx = args.page_tokens, len(prompt)
    pages = -(-(ctx + max(args.steps, args.sync_steps) + COMPARE_TOKENS + 8) // t)
    table = list(range(pages))
    kw = {"compiled_decode": None if gpu else True, **overrides}
    runner = make_runner(lm, "native", pages, t, KernelChoices(**kw))
    first = mx.argmax(runner.forward([Chunk(0, prompt, 0, table)]), axis=-1).astype(mx.int32)
    mx.eval(first, runner.kvstore.arrays())
    specs = [RowSpec(SamplingParams(temperature=0.0), 0, 0)]
    state = {"toks": first, "n": ctx}

    def launch():
        logits = runner.forward([Chunk(0, [0], state["n"], table)], decode_tokens=state["toks"])
        side.logits = logits
        fast = runner.compiled.greedy if (greedy and runner.compiled is not None) else None
        state["toks"], state["n"] = (fast if fast is not None else sample(logits, specs),
                                     state["n"] + 1)
        return [state["toks"]]

    def rewind():
        state["n"], state["toks"] = ctx, first

    g = lm.geometry.layers[0]
    hq = int(lm.config["num_attention_heads"])
    capacity = bucket_pages(ctx // t + 1) * t   # the compiled step plans its split by it
    side = Side(launch, runner.kvstore.arrays, rewind,
                {"weights": weights, "choices": overrides,
                 "compiled": runner.compiled is not None, "kernel_decode": runner.kernel_decode,
                 "gemv_kernel_layers": getattr(lm, "gemv_layers", 0),
                 "splits_at_start": pd.split_count(1, g.kv_heads, capacity, None,
                                                   overrides.get("decode_split_min_keys")),
                 "warps": pd.block_warps(overrides.get("decode_warps"), hq // g.kv_heads,
                                         g.head_dim)})
    return side


def mlx_lm_side(model, prompt: list[int]) -> Side:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    first = mx.argmax(model(mx.array([prompt]), cache=cache)[:, -1, :], axis=-1)
    mx.eval(first, [c.state for c in cache])
    ref = {"y": first}

    def launch():   # mlx_lm.generate.generate_step's _step, greedy
        logits = model(ref["y"][None], cache=cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        ref["y"] = mx.argmax(logprobs, axis=-1)
        side.logits = logprobs
        return [ref["y"], logprobs]

    def rewind():
        ref["y"] = first
        for c in cache:
            c.offset = len(prompt)

    side = Side(launch, lambda: [c.state for c in cache], rewind, {"weights": "mlx_lm"})
    return side


def pipelined(side: Side, steps: int) -> float:
    import mlx.core as mx

    prev = None
    mx.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        out = side.launch()
        mx.async_eval(*out, side.arrays())
        if prev is not None:
            prev.item()
        prev = out[0]
    prev.item()
    return 1000 * (time.perf_counter() - t0) / steps


def first_tokens(side: Side, n: int) -> list[int]:
    """The side's first `n` greedy tokens after the prompt (also its warm-up: traces, kernel
    builds, the page buckets the rounds reach)."""
    import mlx.core as mx
    import numpy as np
    side.rewind()
    toks = [int(side.launch()[0].reshape(-1)[0].item())]
    first = side.logits.reshape(-1).astype(mx.float32)
    side.first_logprobs = np.array(first - mx.logsumexp(first))   # the first step's, [vocab]
    return toks + [int(side.launch()[0].reshape(-1)[0].item()) for _ in range(n - 1)]


def stream_generate_tps(model, tokenizer, prompt: list[int], steps: int) -> float:
    """mlx-lm's stream_generate, greedy, `steps` tokens: its generation_tps (the first token,
    prefill's, is outside it). EOS is ignored and the detokenizer does nothing (random weights
    pick any id of the shape's vocabulary)."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate

    class Quiet:   # the detokenizer protocol stream_generate calls, doing nothing
        last_segment = ""
        reset = finalize = lambda self: None
        add_token = lambda self, token: None   # noqa: E731

    tokenizer._detokenizer = Quiet()
    tokenizer._eos_token_ids = set()
    last = None
    for last in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=steps + 1):
        pass
    return float(last.generation_tps)


def run_shape(args, shape: str) -> dict:
    import gc

    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load

    from bench.step_graph import split_steps
    from engine.attention.cuda import paged_decode as pd
    from engine.model.linear import store_input_major, use_gemv_kernel
    from engine.model.loader import load_model

    gpu = pd.available()
    folder = model_folder(args, shape)
    config = json.loads((Path(folder) / "config.json").read_text())
    log(f"{shape}: weights in {folder}")
    prompt = [3 + j % 200 for j in range(args.context)]
    res: dict = {"context": args.context, "steps": args.steps, "rounds": args.rounds,
                 "decode_kernel": gpu, "sides": {}}
    model, tokenizer = load(folder)
    nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    embed = model.model.embed_tokens.weight.nbytes
    streamed = nbytes - (0 if config.get("tie_word_embeddings") else embed)
    res["weight_bytes_per_token"] = streamed
    res["limit_tok_s"] = round(args.hbm_gbs * 1e9 / streamed, 1)
    models, sides = {}, {}
    for v in args.variants:
        weights = VARIANTS[v][0]
        if weights not in models and v != "default" and time.perf_counter() - T0 > args.budget:
            res["sides"][v] = {"skipped": "budget"}
            continue
        try:
            if weights not in models:
                lm = load_model(folder, dtype="bfloat16", fuse=weights != "unfused")
                if weights == "in_major":
                    store_input_major(lm.model)
                if weights == "gemv":
                    object.__setattr__(lm, "gemv_layers", use_gemv_kernel(lm.model))
                    bound = getattr(lm.head, "__self__", None)
                    if bound is not None:   # a tied head's as_linear, bound before the swap
                        object.__setattr__(lm, "head", bound.as_linear)
                models[weights] = lm
            sides[v] = engine_side(models, v, prompt, args, gpu)
        except Exception as e:  # noqa: BLE001 - recorded; the other sides go on
            res["sides"][v] = {"error": f"{type(e).__name__}: {e}"[:500]}
            log(f"{shape}: {v} setup failed: {e}")
    sides["mlx_lm_step"] = mlx_lm_side(model, prompt)
    log(f"{shape}: {len(sides)} sides built; warming up")
    for name, side in list(sides.items()):
        try:
            side.tokens = first_tokens(side, COMPARE_TOKENS)
            pipelined(side, 4)
        except Exception as e:  # noqa: BLE001 - e.g. a kernel that does not compile
            res["sides"][name] = {**side.info, "error": f"{type(e).__name__}: {e}"[:500]}
            log(f"{shape}: {name} failed in warm-up: {e}")
            del sides[name]
    stream = []
    for r in range(args.rounds):
        for name, side in sides.items():
            # The first round always runs (each built side's one measurement), later ones in time.
            late = r > 0 and time.perf_counter() - T0 > args.budget
            if side.spent > args.side_seconds or late:
                continue
            t0 = time.perf_counter()
            try:
                side.rewind()
                side.ms.append(round(pipelined(side, args.steps), 3))
                side.rewind()
                side.sync.append(split_steps(side.launch, side.arrays, args.sync_steps))
            except Exception as e:  # noqa: BLE001
                side.info["error"] = f"round {r}: {type(e).__name__}: {e}"[:500]
                side.spent = float("inf")
            side.spent += time.perf_counter() - t0
        if r == 0 or time.perf_counter() - T0 < args.budget:
            stream.append(round(guarded(lambda: {"tps": stream_generate_tps(
                model, tokenizer, prompt, args.steps)}).get("tps", float("nan")), 1))
        log(f"{shape}: round {r + 1} done")
    ref = sides["default"].tokens if "default" in sides else None
    base = statistics.median(sides["mlx_lm_step"].ms) if sides["mlx_lm_step"].ms else None
    for name, side in sides.items():
        row = dict(side.info, first_tokens=side.tokens, ms_per_token=side.ms)
        if side.ms:
            med = statistics.median(side.ms)
            row["tok_s_median"] = round(1000 / med, 1)
            row["of_limit"] = round(1000 / med / res["limit_tok_s"], 3)
            if base:
                row["vs_mlx_lm_step"] = round(base / med, 3)
        if side.sync:
            row["sync_median_ms"] = {k: statistics.median(s[k] for s in side.sync)
                                     for k in side.sync[0]}
        if ref is not None:
            row["tokens_match_default"] = sum(a == b for a, b in zip(side.tokens, ref))
            # The first step's log-probabilities against the default's: rounding-level for a
            # variant that computes the same thing (bf16 logits: ~1e-2), large for a broken one.
            row["first_logprob_max_abs_diff"] = round(float(np.abs(
                side.first_logprobs - sides["default"].first_logprobs).max()), 5)
        res["sides"][name] = row
    res["sides"]["mlx_lm_stream_generate"] = {"generation_tps": stream, "tok_s_median": (
        statistics.median(stream) if stream else None)}
    if not args.no_kernels and time.perf_counter() - T0 < args.budget:
        del sides, models
        gc.collect()
        mx.clear_cache()
        geo = geometry_of(config)
        log(f"{shape}: attention alone")
        res["attention_alone"] = guarded(
            lambda: attention_alone(geo, args.context, args.page_tokens))
        if time.perf_counter() - T0 < args.budget:
            log(f"{shape}: matmuls alone")
            res["matmul_alone"] = guarded(lambda: matmul_alone(geo))
    return res


def run(args) -> dict:
    import gc

    import mlx.core as mx

    out = {"device": str(mx.default_device()), "argv": sys.argv[1:], "batch": 1,
           "variants": {v: {"weights": w, "choices": c, "greedy_in_step": g}
                        for v, (w, c, g) in VARIANTS.items() if v in args.variants},
           "shapes": {}}
    for shape in args.shapes:
        if time.perf_counter() - T0 > args.budget:
            out["budget_exhausted"] = True
            break
        out["shapes"][shape] = guarded(lambda: run_shape(args, shape))
        gc.collect()
        mx.clear_cache()
        out["elapsed_s"] = round(time.perf_counter() - T0, 1)
        emit(out, args.out, quiet=True)
        log(f"{shape} done")
    out["elapsed_s"] = round(time.perf_counter() - T0, 1)
    return out


def main(argv=None) -> int:
    from bench.output import run_bench
    return run_bench(parse_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
