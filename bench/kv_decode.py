"""bench.kv's decode section: B sequences that each already hold N tokens of KV, decoded for
`--steps` steps per round, synchronously or pipelined as the engine decodes, one format after
another (best round of each) or interleaved (`--interleave`: paired ratios per round).

The history is written straight into the pages (random rows, quantized on write for packed
formats): decode speed depends on how much KV it reads, not on what the rows say, and this keeps
32K contexts cheap.
"""
from __future__ import annotations

import re
import statistics
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.attention.choices import DEFAULT_KERNELS, KernelChoices
from engine.attention.cuda.page_key_decode import PAGE_TOKENS as WARP_PT
from engine.kv.store import KVStore, Slots
from engine.sched.seq import Chunk
from bench.kv_runners import PAGE_TOKENS, make_runner, progress
from bench.step_graph import graphs_since


def _fill(store: KVStore, seqs: int, context: int, room: int, seed: int = 0):
    """Write `context` random rows for each of `seqs` sequences, leave `room` tokens to decode;
    return their page tables."""
    pt = store.page_tokens
    per = -(-(context + room) // pt)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(seqs)]
    key = mx.random.key(seed)
    for table in tables:
        for s in range(0, context, 4096):
            pos = np.arange(s, min(context, s + 4096))
            slots = Slots.from_flat(np.asarray(table)[pos // pt] * pt + pos % pt, pt)
            for index in store.layers:
                g = store.geometry.layers[index]
                key, k1, k2 = mx.random.split(key, 3)
                k = mx.random.normal((len(pos), g.kv_heads, g.head_dim), key=k1).astype(store.dtype)
                v = mx.random.normal((len(pos), g.kv_heads, g.v_head_dim), key=k2).astype(store.dtype)
                store.write(index, slots, k, v)
            mx.eval(*store.arrays())
    return tables


# Decode format variants: "int4:tiles" decodes packed layers through the prefill tile kernel
# (engine/attention/cuda/packed_prefill.py), "int4:split" through engine/attention/cuda/packed_decode.py
# (v1), "int4:v2" through the tiled engine/attention/cuda/packed_decode_v2.py; a bare name takes
# the bench's kernel choices (KernelChoices.decode_tiles, packed_decode). "k6v4-kivi:tiled-keys"
# scores page keys by dequantizing them tile by tile (KernelChoices.page_key_scores and
# page_key_qmm off), "k6v4-kivi:qmm" through MLX's quantized matmuls (page_key_qmm on:
# engine/attention/page_qmm.py; ":qmm-bf16" with bf16 activations), "k6v4-kivi:scores"
# through page_scores (page_key_qmm off), "k6v4-kivi:kernel" through the CUDA page-key kernel
# (KernelChoices.page_key_kernel: engine/attention/cuda/page_key_decode.py; CUDA only),
# "int8:mx-softmax" with mx.softmax where the CPU takes NumPy's (KernelChoices.cpu_softmax),
# "k6v4-kivi:mlx-decode" through MLX ops where the CPU takes the Numba page-key kernel
# (KernelChoices.cpu_decode off: engine/attention/cpu_page_key_decode.py's "before"),
# "k6v4-kivi:own-write" with the decode kernel storing the step's rows (CUDA; the default),
# "k6v4-kivi:write-kernel" with the write kernel storing them.
DECODE_KERNELS = {"tiles": dict(decode_tiles=True),
                  "split": dict(decode_tiles=False, packed_decode="v1"),
                  "v2": dict(decode_tiles=False, packed_decode="v2"),
                  # The CUDA page-key kernel is the default there and takes precedence, so the
                  # MLX-path specs turn it off.
                  "tiled-keys": dict(page_key_scores=False, page_key_qmm=False,
                                     page_key_kernel=False),
                  "qmm": dict(page_key_qmm=True, page_key_kernel=False),
                  "qmm-bf16": dict(page_key_qmm=True, page_key_qmm_bf16=True,
                                   page_key_kernel=False),
                  "scores": dict(page_key_qmm=False, page_key_kernel=False),
                  "kernel": dict(page_key_kernel=True),
                  # Native pages through the walk CUDA decode kernel (KernelChoices
                  # .native_decode; the default before the tiled one), and the tiled one.
                  "walk": dict(native_decode="walk"),
                  "tiled": dict(native_decode="tiled"),
                  # ... with 64-key splits: its blocks walk no keys one by one, so finer
                  # splits (more blocks at batch 1) may pay where the walk kernel's did not.
                  "tiled-64": dict(native_decode="tiled", decode_split_min_keys=64),
                  # On the CPU: the softmax by mx.softmax, not NumPy (KernelChoices.cpu_softmax
                  # off; native keeps it on), to measure what the NumPy softmax gives packed
                  # decode.
                  "mx-softmax": dict(cpu_softmax=False),
                  "mlx-decode": dict(cpu_decode=False),
                  # Page keys on CUDA: compiled steps' rows stored by the decode kernel itself
                  # (KernelChoices.page_key_own_write, the default), or by the write kernel.
                  "own-write": dict(page_key_own_write=True),
                  "write-kernel": dict(page_key_own_write=False),
                  # ... and its score pass on tensor cores (KernelChoices.page_key_mma).
                  "mma": dict(page_key_mma=True),
                  # ... and its key codes copied in 8-byte pieces (page_key_wide_copies off;
                  # the default before device run 13).
                  "narrow-copies": dict(page_key_wide_copies=False),
                  # ... or the warp-page kernel at every page size it reads
                  # (KernelChoices.page_key_warp_pages; the default at pages of 16 and 64 since
                  # device runs 14 and 15), or the block-tiled one everywhere.
                  "warp-pages": dict(page_key_warp_pages=True, page_key_warp_page_tokens=WARP_PT),
                  "block-tiled": dict(page_key_warp_pages=False)}


def decode_kernels(spec: str, kernels: KernelChoices) -> tuple[str, KernelChoices]:
    """(format, kernel choices) of a decode format spec FORMAT[:KERNEL[+KERNEL...]], each
    KERNEL a key of DECODE_KERNELS (native:walk: the walk native decode kernel),
    `warp-pages-WxS`: the warp-page kernel with W warps a block and S copy stages a warp,
    `split-T[-K]`:
    the split plan aimed at T blocks a layer with splits of at least K keys (KernelChoices
    .decode_split_target, decode_split_min_keys), for this variant only, so a sweep of one
    kernel's plan times it paired with the others at their defaults (`mma+split-512`: both)."""
    fmt, _, kernel = spec.partition(":")
    for part in kernel.split("+") if kernel else ():
        plan = re.fullmatch(r"split-(\d+)(?:-(\d+))?", part)
        if plan:
            target, keys = int(plan[1]), int(plan[2]) if plan[2] else None
            if target < 1 or (keys is not None and keys < 1):
                raise ValueError(f"decode format {spec!r}: split target and keys must be "
                                 "positive")
            kernels = replace(kernels, decode_split_target=target, decode_split_min_keys=keys)
        elif shape := re.fullmatch(r"warp-pages-(\d)x(\d)", part):
            kernels = replace(kernels, page_key_warp_pages=True, page_key_warp_page_tokens=WARP_PT,
                              page_key_warp_shape=(int(shape[1]), int(shape[2])))
        elif part in DECODE_KERNELS:
            kernels = replace(kernels, **DECODE_KERNELS[part])
        else:
            raise ValueError(f"decode format {spec!r}: kernel must be one of "
                             f"{sorted(DECODE_KERNELS)}, warp-pages-WxS or split-T[-K], "
                             "joined by +")
    return fmt, kernels


class DecodeTimer:
    """One format's decode at batch b and context n, ready to time rounds of steps."""

    def __init__(self, loaded, spec, pages, b, n, room, kernels: KernelChoices = DEFAULT_KERNELS,
                 pipelined: bool = False, page_tokens: int = PAGE_TOKENS):
        fmt, kernels = decode_kernels(spec, kernels)
        self.runner = make_runner(loaded, fmt, pages, kernels=kernels, seqs=b,
                                  page_tokens=page_tokens)
        self.tables = _fill(self.runner.kvstore, b, n, room)
        self.pos, self.pipelined = n, pipelined

    def round(self, steps: int) -> float:
        """Seconds for `steps` decode steps.

        Synchronous (default): each step is built, run and read back before the next is built.
        `pipelined`: as the engine's steady decode runs every KV format (engine/steps.py), step
        n+1 is built and queued before step n's result is read back, so graph building overlaps
        the device's work."""
        runner = self.runner
        mx.synchronize()
        t0 = time.perf_counter()
        prev, marks, split = None, [t0], []
        for _ in range(steps):
            s0 = time.perf_counter()
            logits = runner.forward([Chunk(i, [7], self.pos, t)
                                     for i, t in enumerate(self.tables)])
            s1 = time.perf_counter()
            mx.async_eval(logits, *runner.kvstore.arrays())
            s2 = time.perf_counter()
            # Pipelined, the engine reads step n back while step n+1 is queued.
            waited, prev = (prev, logits) if self.pipelined else (logits, None)
            if waited is not None:
                mx.eval(waited)
                marks.append(time.perf_counter())
                split.append((s1 - s0, s2 - s1, marks[-1] - s2))
            self.pos += 1
        if prev is not None:
            mx.eval(prev)
            marks.append(time.perf_counter())
        # Step intervals (a pipelined step's: from one step's result to the next one's), so
        # a round's time can be told apart into steady steps and stalls.
        self.last_step_ms = [1e3 * (b - a) for a, b in zip(marks[1:], marks[2:])]
        # Median ms of building a step's graph (Python), issuing it (mx.async_eval: MLX
        # encodes and launches its kernels) and waiting for a result: synchronous steps wait
        # for their own, pipelined steps for the previous step's (queued one step earlier), so
        # there a host that waits on the device shows in build or issue, not in wait.
        self.last_split_ms = ([round(1e3 * statistics.median(x), 3) for x in zip(*split)]
                              if split else [])
        return marks[-1] - t0


def _decode_time(loaded, spec, pages, b, n, room, steps, repeats,
                 kernels: KernelChoices = DEFAULT_KERNELS, pipelined: bool = False,
                 page_tokens: int = PAGE_TOKENS) -> float:
    """Best time of `steps` decode steps of `b` rows at context n (first round is warm-up)."""
    timer = DecodeTimer(loaded, spec, pages, b, n, room, kernels, pipelined, page_tokens)
    timer.round(steps)   # warm-up
    return min(timer.round(steps) for _ in range(max(1, repeats)))


def _quantiles(ms: list[float]) -> list[float]:
    """[p10, p50, p90, max] of a round's step intervals, ms (empty: a round of one step)."""
    if not ms:
        return []
    q = np.quantile(np.asarray(ms), [0.1, 0.5, 0.9, 1.0])
    return [round(float(x), 3) for x in q]


def _per_step(found: tuple, steps: int) -> dict:
    """CUDA graph nodes of one round (step_graph.graphs_since's (files, nodes by kernel)) per
    step, with the kernels that make up at least half a node per step."""
    files, names = found
    return {"graphs": round(files / steps, 2), "nodes": round(sum(names.values()) / steps, 1),
            "by_kernel": {k: round(v / steps, 2) for k, v in names.most_common()
                          if v / steps >= 0.5}}


def _interleaved_row(loaded, formats, pages, b, n, room, steps, repeats, kernels,
                     pipelined, dots: Path | None = None, page_tokens: int = PAGE_TOKENS) -> dict:
    """Every format's decode set up first, then timed in turns (native, then each format, per
    round), so a slow spell of the machine lands on every format of its round: the ratio of
    each round is paired, and the row reports their median beside the best tok/s."""
    row, timers = {}, {}
    for fmt in ["native", *formats]:
        try:
            timers[fmt] = DecodeTimer(loaded, fmt, pages, b, n, room, kernels, pipelined,
                                      page_tokens)
            timers[fmt].round(steps)   # warm-up
        except Exception as e:  # a backend missing a kernel: record it, bench the rest
            row[fmt] = {"error": f"{type(e).__name__}: {e}"[:300]}
    times = {fmt: [] for fmt in timers}
    steps_ms = {fmt: [] for fmt in timers}
    split_ms = {fmt: [] for fmt in timers}
    graphs = {}
    for r in range(repeats):
        for fmt, timer in timers.items():
            count = dots is not None and r == 0
            seen: set = set()
            if count:
                graphs_since(dots, seen)   # the files earlier rounds and set-up left
            times[fmt].append(timer.round(steps))
            steps_ms[fmt].append(_quantiles(timer.last_step_ms))
            split_ms[fmt].append(timer.last_split_ms)
            if count:
                graphs[fmt] = _per_step(graphs_since(dots, seen), steps)
    for fmt, ts in times.items():
        row[fmt] = {"tok_s": round(b * steps / min(ts), 2),
                    "tok_s_rounds": [round(b * steps / t, 2) for t in ts],
                    "step_ms_rounds_p10_p50_p90_max": steps_ms[fmt]}
        row[fmt]["build_issue_wait_ms_rounds"] = split_ms[fmt]
        if fmt in graphs:
            row[fmt]["graph_nodes_per_step"] = graphs[fmt]
        if fmt != "native" and "native" in times:
            paired = [tn / t for tn, t in zip(times["native"], ts)]
            row[fmt]["ratios_paired"] = [round(r, 3) for r in paired]
            row[fmt]["ratio_paired_median"] = round(statistics.median(paired), 3)
    return row


def decode_section(loaded, contexts, batches, formats, steps, repeats, out: dict, save,
                   kernels: KernelChoices = DEFAULT_KERNELS, pipelined: bool = False,
                   interleave: bool = False, dots: Path | None = None,
                   page_tokens: int = PAGE_TOKENS) -> dict:
    for n in contexts:
        for b in batches:
            room = steps * (repeats + 1)
            pages = b * -(-(n + room) // page_tokens)
            if interleave:
                row = _interleaved_row(loaded, formats, pages, b, n, room, steps, repeats,
                                       kernels, pipelined, dots, page_tokens)
                for fmt in row:
                    progress(f"decode ctx {n} batch {b} {fmt}: {row[fmt].get('tok_s')} tok/s, "
                             f"paired ratios {row[fmt].get('ratios_paired')}")
            else:
                row = {}
                for fmt in ["native", *formats]:
                    try:
                        row[fmt] = {"tok_s": round(b * steps / _decode_time(
                            loaded, fmt, pages, b, n, room, steps, repeats, kernels,
                            pipelined, page_tokens), 2)}
                        progress(f"decode ctx {n} batch {b} {fmt}: {row[fmt]['tok_s']} tok/s")
                    except Exception as e:  # a backend missing a kernel: record it
                        row[fmt] = {"error": f"{type(e).__name__}: {e}"[:300]}
            for fmt in row:
                if "tok_s" in row[fmt] and "tok_s" in row["native"]:
                    row[fmt]["ratio_to_native"] = round(
                        row[fmt]["tok_s"] / row["native"]["tok_s"], 3)
            out[f"ctx{n}-b{b}"] = row
            save()
    return out
