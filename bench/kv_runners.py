"""The KV stores and model runners `bench.kv` times: one per format, on the bench's pages."""
from __future__ import annotations

import argparse
import sys
import time

from engine.attention.choices import DEFAULT_KERNELS, KernelChoices
from engine.kv.pages import is_power_of_two
from engine.kv.store import KVStore
from engine.runner.packed import PackedModelRunner
from engine.attention.layers import packed_layer_factory
from engine.runner.paged import ModelRunner

# The benches' page size unless a run names another (`bench.kv --page-tokens`): the engine
# serves pages of 64 by default (engine/kv/pages.DEFAULT_PAGE_TOKENS); rows before device run
# 15 all ran at 16.
PAGE_TOKENS = 16


def page_tokens_arg(text: str) -> int:
    """argparse type of a bench's --page-tokens: a power of two, as the engine's pages are."""
    value = int(text)
    if not is_power_of_two(value):
        raise argparse.ArgumentTypeError(f"must be a power of two, got {value}")
    return value


def make_store(loaded, fmt, pages, seqs: int = 1, page_tokens: int = PAGE_TOKENS,
               **kw) -> KVStore:
    """`seqs`: sequences the bench runs at once (native-tail formats keep a native page each)."""
    return KVStore(loaded.geometry, pages, page_tokens, loaded.dtype,
                   layer_factory=packed_layer_factory(fmt, tail_slots=seqs, **kw))


def make_runner(loaded, fmt, pages, mode="direct", kernels: KernelChoices = DEFAULT_KERNELS,
                seqs: int = 1, page_tokens: int = PAGE_TOKENS):
    """A runner over `pages` pages of `page_tokens` in format `fmt` for `seqs` sequences at
    once; store and runner share `kernels`."""
    if fmt == "native":
        return ModelRunner(loaded, make_store(loaded, fmt, pages, page_tokens=page_tokens),
                           kernels=kernels)
    # The bench's permit hook always grants: it measures the fused path, not the ledger.
    return PackedModelRunner(loaded, make_store(loaded, fmt, pages, seqs, page_tokens,
                                               prefill_mode=mode, permit=lambda n: True,
                                               kernels=kernels),
                             kernels=kernels)


def progress(message: str, bench: str = "bench_kv") -> None:
    """One line per measured variant on stderr (a 16K CPU prefill takes minutes per variant);
    stdout stays the JSON document."""
    print(f"[{bench} {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
