"""Fused prefill over formats that keep native rows beside their codes (a native tail page, sink
rows): those rows join the step's fresh keys, so the fused mask must count them. A chunk that
starts mid-page (its tail page partly written) through the opt-in fused path agrees with the
direct path and is counted fused, on the tiny llama's real model code."""
import mlx.core as mx
import pytest

from engine.attention.layers import counters_of, packed_layer_factory
from engine.kv.store import KVStore
from engine.model.loader import load_model
from engine.runner.packed import PackedModelRunner
from engine.sched.seq import Chunk

T = 16
PAGES = list(range(8))


def _runner(loaded, fmt, **kw):
    store = KVStore(loaded.geometry, len(PAGES), T, loaded.dtype,
                    layer_factory=packed_layer_factory(fmt, tail_slots=2, **kw))
    return PackedModelRunner(loaded, store)


@pytest.mark.parametrize("fmt", ["int4-tail", "int4-k32-tail", "int4-sink"])
def test_fused_prefill_with_native_rows_agrees_with_direct(tiny_model_dirs, fmt):
    loaded = load_model(tiny_model_dirs["llama"])
    prompt = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)
    cut = T + 8   # the second chunk starts half way into page 1: 8 native tail rows
    assert len(prompt) - cut >= 9   # enough queries for the fused path
    granted = []
    fused = _runner(loaded, fmt, prefill_mode="fused",
                    permit=lambda n: granted.append(n) or True)
    direct = _runner(loaded, fmt)
    for r in (fused, direct):
        r.forward([Chunk(0, prompt[:cut], 0, PAGES)])
    a = fused.forward([Chunk(0, prompt[cut:], cut, PAGES)])
    b = direct.forward([Chunk(0, prompt[cut:], cut, PAGES)])
    assert mx.abs(a - b).max().item() < 1e-3
    layers = len(loaded.geometry.layers)
    assert counters_of(fused.kvstore)["fused"] == layers
    # The permit priced the native rows too: K and V scratch over the history, the native rows
    # (the whole tail page, masked to its written rows; or 4 sink rows per history page) and
    # the chunk's own keys.
    q_heads, kv_heads, d = 4, 2, 64
    n = len(prompt) - cut
    native = T if fmt.endswith("tail") else 4 * -(-cut // T)
    assert granted[-1] == 4 * (2 * kv_heads * (cut + native + n) * d + 2 * q_heads * n * d)
