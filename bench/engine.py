"""Engine benchmark: prefill and decode throughput of the paged engine beside mlx-lm, same model,
same process, same run, plus the OpenBLAS on/off matmul difference.

    python -m bench.engine --synthetic --out bench.json        # default synthetic model
    python -m bench.engine --model smollm2                     # the real model (make real-model)
    python -m bench.engine --model /path/to/mlx-model          # or a model folder / .gguf file

Prefill: one request of L prompt tokens, max_tokens=1; tok/s = L / time to first token (both
sides chunk at 2048 tokens). Decode at batch B: B requests of the same prompt length start
together; tok/s counts tokens of all rows inside the window where every row decodes (from the
last row's first token to the first row's last token). mlx-lm runs `stream_generate` at batch 1
and `BatchGenerator` above. Both sides are greedy and ignore EOS. Rates are given on the wall
clock and on process CPU time (`_cpu`): on a shared host the wall clock mostly measures the other
tenants, CPU time measures the work. Each side keeps its best of `--repeats` alternating runs.
Peak memory is MLX's allocator
peak over each run minus what was resident before it (weights of both sides and the engine's
preallocated KV pages are resident; `resident_mb` reports them).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.output import run_bench
from engine.model.names import MODEL_HELP, model_arg

# Synthetic model: a llama big enough that compute, not Python, dominates a step on a CPU.
SYNTHETIC = dict(hidden_size=512, num_hidden_layers=8, intermediate_size=1408,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                 vocab_size=32000, max_position_embeddings=16384)

_MATMUL_CHILD = """
import time, mlx.core as mx
n = {n}
a = mx.random.normal((n, n)); b = mx.random.normal((n, n)); mx.eval(a, b)
mx.eval(a @ b)
t = time.perf_counter()
for _ in range({reps}):
    mx.eval(a @ b)
print((time.perf_counter() - t) / {reps})
"""


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=model_arg,
                   help=MODEL_HELP + " (default: --synthetic)")
    p.add_argument("--synthetic", action="store_true",
                   help=f"build a random-weight llama in a temp dir: {SYNTHETIC}")
    p.add_argument("--shaped-like", metavar="DIR",
                   help="random bf16 weights in the architecture of this folder (its config.json "
                        "and tokenizer files, .xz allowed): see build_shaped")
    p.add_argument("--prefill", default="512,2048,8192", help="prompt lengths for prefill")
    p.add_argument("--batches", default="1,4,8", help="decode batch sizes")
    p.add_argument("--decode-prompt", type=int, default=128, help="prompt length for decode")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens generated per row")
    p.add_argument("--page-tokens", type=int, default=None, help="engine page size")
    p.add_argument("--repeats", type=int, default=2,
                   help="alternating runs per point; each side's best is kept")
    p.add_argument("--warmup", type=int, default=0,
                   help="unrecorded runs of each side per point before the repeats (a GPU's "
                        "kernels compile on first use: without one, repeat 1 pays for it)")
    p.add_argument("--no-fuse", action="store_true",
                   help="engine side: separate q/k/v and gate/up matmuls (production fuses them)")
    p.add_argument("--no-compile", action="store_true",
                   help="engine side: decode steps uncompiled (production compiles them where "
                        "the CUDA decode kernel runs; engine/runner/compiled_decode.py)")
    p.add_argument("--compile", action="store_true",
                   help="engine side: compiled decode steps on any backend (the CPU too)")
    p.add_argument("--native-decode", choices=("walk", "tiled"), default=None,
                   help="engine side: the CUDA decode kernel over native pages (default: "
                        "production's KernelChoices.native_decode)")
    p.add_argument("--ref-fused", action="store_true",
                   help="mlx-lm side: fuse its projections the engine's way too (a factor "
                        "analysis; mlx-lm as users run it is unfused, the default)")
    p.add_argument("--no-openblas-check", action="store_true", help="skip the matmul A/B")
    p.add_argument("--out", help="write the JSON here as well as to stdout")
    return p.parse_args(argv)


def compile_choice(args):
    """The engine's KernelChoices for `--compile` / `--no-compile` and `--native-decode`
    (default: production's)."""
    from engine.attention.choices import KernelChoices
    if args.compile and args.no_compile:
        raise SystemExit("--compile and --no-compile exclude each other")
    choice = getattr(args, "native_decode", None)   # bench.decode_host has no such flag
    native = {"native_decode": choice} if choice else {}
    return KernelChoices(compiled_decode=True if args.compile else False if args.no_compile
                         else None, **native)


def build_synthetic(root: Path) -> str:
    from bench.synthetic import build_tiny_model

    return str(build_tiny_model("llama", root / "synthetic-llama", seed=0, **SYNTHETIC))


def openblas_check(n: int = 1024, reps: int = 5) -> dict:
    """float32 matmul seconds in child processes with and without OpenBLAS preloaded."""
    from engine.platform import openblas_path

    lib = openblas_path()
    code = _MATMUL_CHILD.format(n=n, reps=reps)
    out = {"matmul": f"{n}x{n} float32", "openblas_lib": lib}
    for label, preload in (("without", None), ("with", lib)):
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        if preload:
            env["LD_PRELOAD"] = preload
        if label == "with" and not preload:
            continue
        s = float(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                 capture_output=True, text=True).stdout.strip())
        out[f"gflops_{label}_openblas"] = round(2 * n ** 3 / s / 1e9, 1)
    if "gflops_with_openblas" in out:
        out["speedup"] = round(out["gflops_with_openblas"] / out["gflops_without_openblas"], 2)
    return out


class Window:
    """Per-row token timestamps -> throughput over the window where every row decodes, on the
    wall clock and on process CPU time (all threads; a shared host inflates wall time only)."""

    def __init__(self, rows: int):
        self.times: list[list[tuple[float, float]]] = [[] for _ in range(rows)]

    def add(self, row: int, n: int = 1) -> None:
        self.times[row].extend([(time.perf_counter(), time.process_time())] * n)

    def rate(self) -> tuple[float, float]:
        return self._rate(0), self._rate(1)

    def _rate(self, clock: int) -> float:
        start = max(t[0][clock] for t in self.times)
        end = min(t[-1][clock] for t in self.times)
        tokens = sum(sum(1 for x in t if start < x[clock] <= end) for t in self.times)
        return tokens / (end - start) if end > start and tokens else float("nan")


def clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def rates(tokens: int, since: tuple[float, float]) -> tuple[float, float]:
    now = clocks()
    return tokens / (now[0] - since[0]), tokens / max(now[1] - since[1], 1e-9)


# ---- mlx-lm side ---------------------------------------------------------------------------

def mlx_prefill(model, tokenizer, prompt: list[int]) -> tuple[float, float]:
    from mlx_lm.generate import stream_generate

    t = clocks()
    for _ in stream_generate(model, tokenizer, prompt, max_tokens=1, prefill_step_size=2048):
        break
    return rates(len(prompt), t)


def mlx_decode(model, tokenizer, prompts: list[list[int]], n: int) -> tuple[float, float]:
    from mlx_lm.generate import BatchGenerator, stream_generate

    w = Window(len(prompts))
    if len(prompts) == 1:
        for _ in stream_generate(model, tokenizer, prompts[0], max_tokens=n):
            w.add(0)
        return w.rate()
    gen = BatchGenerator(model, max_tokens=n, completion_batch_size=len(prompts),
                         prefill_batch_size=len(prompts), prefill_step_size=2048)
    try:
        uids = gen.insert(prompts, max_tokens=[n] * len(prompts))
        row = {u: i for i, u in enumerate(uids)}
        done = 0
        while done < len(prompts):
            _, responses = gen.next()
            for r in responses:
                w.add(row[r.uid])
                done += r.finish_reason is not None
    finally:
        gen.close()
    return w.rate()


# ---- engine side ---------------------------------------------------------------------------

def engine_prefill(eng, prompt: list[int], rid: str) -> tuple[float, float]:
    from engine.request import GenerationRequest
    from engine.sampling.params import SamplingParams

    async def go():
        t = clocks()
        async for _ in eng.generate(GenerationRequest(
                rid, prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))):
            pass
        return rates(len(prompt), t)
    return asyncio.run(go())


def engine_decode(eng, prompts: list[list[int]], n: int, rid: str) -> tuple[float, float]:
    from engine.request import GenerationRequest
    from engine.sampling.params import SamplingParams

    w = Window(len(prompts))

    async def row(i, p):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        async for d in eng.generate(GenerationRequest(f"{rid}-{i}", p, params)):
            w.add(i, len(d.token_ids))

    async def go():
        await asyncio.gather(*(row(i, p) for i, p in enumerate(prompts)))
    asyncio.run(go())
    return w.rate()


def measure_pair(ours, ref, repeats: int, warmup: int = 0) -> dict:
    """Alternate engine and mlx-lm runs `repeats` times (so load on a shared machine hits both
    alike; the side that goes first alternates too); keep each side's best wall and CPU-time
    rate, and its peak memory ABOVE what was resident before the run (MB). Resident memory
    (both copies of the weights, the engine's preallocated KV pages) is reported once,
    separately. Each repeat's engine/mlx-lm ratio is taken from its adjacent pair of runs;
    `ratio_wall_median` (the median of those) is the number to quote on a noisy host."""
    import statistics

    import mlx.core as mx

    out = {f"{side}_{k}": 0.0 for side in ("engine", "mlx_lm")
           for k in ("tok_s", "tok_s_cpu", "peak_over_resident_mb")}
    samples = {side: {"wall": [], "cpu": []} for side in ("engine", "mlx_lm")}
    for i in range(warmup):   # unrecorded (ids -1, -2, ...)
        ours(-1 - i)
        ref(-1 - i)
    for i in range(repeats):
        sides = (("engine", ours), ("mlx_lm", ref))
        for side, fn in (sides if i % 2 == 0 else sides[::-1]):
            mx.synchronize()
            mx.reset_peak_memory()
            resident = mx.get_active_memory()
            wall, cpu = fn(i)
            samples[side]["wall"].append(round(wall, 1))
            samples[side]["cpu"].append(round(cpu, 1))
            out[f"{side}_tok_s"] = max(out[f"{side}_tok_s"], round(wall, 1))
            out[f"{side}_tok_s_cpu"] = max(out[f"{side}_tok_s_cpu"], round(cpu, 1))
            mb = round((mx.get_peak_memory() - resident) / 2**20, 1)
            out[f"{side}_peak_over_resident_mb"] = max(out[f"{side}_peak_over_resident_mb"], mb)
    out["ratio_wall"] = round(out["engine_tok_s"] / out["mlx_lm_tok_s"], 3)
    out["ratio_cpu"] = round(out["engine_tok_s_cpu"] / out["mlx_lm_tok_s_cpu"], 3)
    for clock in ("wall", "cpu"):
        ratios = [e / m for e, m in zip(samples["engine"][clock], samples["mlx_lm"][clock])]
        out[f"ratios_{clock}"] = [round(r, 3) for r in ratios]
        out[f"ratio_{clock}_median"] = round(statistics.median(ratios), 3)
    out["samples"] = samples
    return out


def build_shaped(source: str, root: Path, dtype: str = "bfloat16") -> str:
    """A random-weight copy of a model folder's architecture: its config.json and tokenizer
    files, weights drawn by MLX under a fixed seed and stored in `dtype`. For speed benches
    where the real weights cannot travel (a GPU host reached through small transfers): with
    greedy decoding and EOS ignored every row runs its full length, and no kernel's work
    depends on the weights' values."""
    import shutil

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes as get_model_classes

    src, out = Path(source), root / (Path(source).name + "-random")
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization", None)
    config["torch_dtype"] = dtype
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name in (
                "generation_config.json",):
            if f.suffix == ".xz":
                import lzma
                (out / f.stem).write_bytes(lzma.decompress(f.read_bytes()))
            else:
                shutil.copy(f, out / f.name)
    model_cls, args_cls = get_model_classes(config)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(config))
    params = {k: v.astype(getattr(mx, dtype)) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), params)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return str(out)


def run(args) -> dict:
    import random

    import mlx.core as mx
    from mlx_lm.utils import load

    from engine.config import EngineConfig
    from engine import Engine

    tmp = tempfile.TemporaryDirectory()
    if args.shaped_like:
        model_dir = build_shaped(args.shaped_like, Path(tmp.name))
    else:
        model_dir = args.model or build_synthetic(Path(tmp.name))
    lengths = [int(x) for x in args.prefill.split(",") if x]
    batches = [int(x) for x in args.batches.split(",") if x]
    model, tokenizer = load(model_dir)
    if args.ref_fused:
        from engine.model.fuse import fuse_projections
        fuse_projections(model)
    tokenizer.eos_token_ids = []   # both sides ignore EOS so every row runs its full length
    vocab = min(len(tokenizer.vocab) if hasattr(tokenizer, "vocab") else 256, 256)
    rng = random.Random(0)

    def prompt(n):
        return [rng.randrange(3, vocab) for _ in range(n)]

    max_seqs = max(batches)
    longest = max([*lengths, args.decode_prompt + args.decode_tokens])
    cfg = dict(model=model_dir, max_num_seqs=max_seqs, max_step_tokens=2048,
               max_model_len=longest + 16, fuse_projections=not args.no_fuse)
    if args.page_tokens:
        cfg["page_tokens"] = args.page_tokens
    eng = Engine(EngineConfig(**cfg), kernels=compile_choice(args))
    # A model under the working directory is recorded by its relative path (no machine paths
    # in recorded results).
    relative = os.path.relpath(model_dir) if args.model else ""
    shown = model_dir if relative.startswith("..") else relative
    result = {"model": (shown if args.model else
                        {"random_weights_shaped_like": Path(args.shaped_like).name}
                        if args.shaped_like else {"synthetic_llama": SYNTHETIC}),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "device": str(mx.default_device()),
                          "loadavg_at_start": os.getloadavg(),
                          "ld_preload": os.environ.get("LD_PRELOAD", "")},
              "engine": {"page_tokens": eng.stats().page_tokens,
                         "kv_bytes_preallocated": eng.stats().kv_bytes_total,
                         "format_identity": eng.format_identity},
              "engine_fused_projections": not args.no_fuse,
              "engine_compiled_decode": {None: "where the CUDA decode kernel runs",
                                         True: "always", False: "never"}[
                                             compile_choice(args).compiled_decode],
              "engine_native_decode": compile_choice(args).native_decode,
              "mlx_lm_fused_projections": args.ref_fused,
              "warmup_runs": args.warmup,
              "resident_mb": round(mx.get_active_memory() / 2**20, 1),
              "prefill": [], "decode": []}
    try:
        for n in lengths:
            p = prompt(n)
            point = {"prompt_tokens": n, **measure_pair(
                lambda i: engine_prefill(eng, p, f"pf{n}-{i}"),
                lambda i: mlx_prefill(model, tokenizer, p), args.repeats, args.warmup)}
            result["prefill"].append(point)
            print(json.dumps(point), file=sys.stderr)
        for b in batches:
            ps = [prompt(args.decode_prompt) for _ in range(b)]
            point = {"batch": b, "mlx_lm_path": "stream_generate" if b == 1 else "BatchGenerator",
                     **measure_pair(
                         lambda i: engine_decode(eng, ps, args.decode_tokens, f"dc{b}-{i}"),
                         lambda i: mlx_decode(model, tokenizer, ps, args.decode_tokens),
                         args.repeats, args.warmup)}
            result["decode"].append(point)
            print(json.dumps(point), file=sys.stderr)
    finally:
        eng.shutdown()
        tmp.cleanup()
    if not args.no_openblas_check:
        result["openblas"] = openblas_check()
    result["machine"]["loadavg_at_end"] = os.getloadavg()
    return result


def main(argv=None) -> int:
    return run_bench(parse_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
