"""The KV stores and model runners `bench.kv` times: one per format, on the bench's pages."""
from __future__ import annotations

import sys
import time

from engine.attention.choices import DEFAULT_KERNELS, KernelChoices
from engine.kv.store import KVStore
from engine.runner.packed import PackedModelRunner
from engine.attention.layers import packed_layer_factory
from engine.runner.paged import ModelRunner

PAGE_TOKENS = 16


def make_store(loaded, fmt, pages, seqs: int = 1, **kw) -> KVStore:
    """`seqs`: sequences the bench runs at once (native-tail formats keep a native page each)."""
    return KVStore(loaded.geometry, pages, PAGE_TOKENS, loaded.dtype,
                   layer_factory=packed_layer_factory(fmt, tail_slots=seqs, **kw))


def make_runner(loaded, fmt, pages, mode="direct", kernels: KernelChoices = DEFAULT_KERNELS,
                seqs: int = 1):
    """A runner over `pages` pages in format `fmt` for `seqs` sequences at once; store and
    runner share `kernels`."""
    if fmt == "native":
        return ModelRunner(loaded, make_store(loaded, fmt, pages), kernels=kernels)
    # The bench's permit hook always grants: it measures the fused path, not the ledger.
    return PackedModelRunner(loaded, make_store(loaded, fmt, pages, seqs, prefill_mode=mode,
                                               permit=lambda n: True, kernels=kernels),
                             kernels=kernels)


def progress(message: str, bench: str = "bench_kv") -> None:
    """One line per measured variant on stderr (a 16K CPU prefill takes minutes per variant);
    stdout stays the JSON document."""
    print(f"[{bench} {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
