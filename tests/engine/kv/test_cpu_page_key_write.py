"""A page-key store's CPU writes (engine/kv/cpu_page_key_write.py) leave the pool and the native
tails byte for byte as the MLX ops' writes do, and the runner's stores take them on the CPU."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from capacity.formats import KVFormat
from engine.attention.choices import KernelChoices
from engine.kv import cpu_page_key_write
from engine.kv.page_key_store import PageKeyStore
from engine.kv.store import Slots
from engine.kv.tails import TailMap
from engine.model.loader import LayerGeometry, load_model
from engine.runner.packed import PackedModelRunner
from engine.sched.seq import Chunk
from tests.engine.attention.runner_pairs import record_calls
from tests.engine.kv.tail_helpers import tail_store


def _rows(rng, n, heads, dim):
    """Keys/values with what quantization must get right: a few wide channels, a constant
    group (scale 0), values on a half-step grid (codes that round half to even)."""
    x = rng.standard_normal((n, heads, dim)).astype(np.float32)
    x[:, :, rng.choice(dim, 2, replace=False)] *= 8.0
    x[n // 2:, 0, :64] = 1.25                        # constant groups for half the rows
    x[:, -1, -8:] = np.round(x[:, -1, -8:] * 2) / 2   # half-steps
    return mx.array(x)


@pytest.mark.parametrize("fmt", ["k6v4-kivi", "int4-kivi"])
@pytest.mark.parametrize("heads,dim,t", [(3, 64, 64), (1, 128, 16), (2, 64, 32), (2, 64, 4)])
def test_writes_leave_the_same_bytes_as_the_mlx_ops(fmt, heads, dim, t):
    """Prompt writes (whole pages, a partial one, a page completed over an earlier tail),
    then decode writes crossing page fills, into two stores: every array byte-identical."""
    rng = np.random.default_rng(heads * dim + t)
    stores = [PageKeyStore(LayerGeometry(0, "full", heads, dim, dim),
                           KVFormat(fmt, dim, "float32", page_tokens=t), 24, t,
                           tails=TailMap(4, t), cpu_writes=cpu) for cpu in (True, False)]
    assert stores[0].cpu_writes and not stores[1].cpu_writes
    table = rng.permutation(24)[:12]
    pos = 0
    for n in (2 * t + 3, t - 3 + 5, 1, 1, t, 1):   # the second chunk completes a page
        p = np.arange(pos, pos + n)
        k, v = _rows(rng, n, heads, dim), _rows(rng, n, heads, dim)
        for s in stores:   # each its own TailMap and Slots (a step's plans are cached on it)
            s.write(Slots(table[p // t], p % t), k, v)
            s.flush_tail()
        a, b = ([np.array(x) for x in s.arrays()] for s in stores)
        assert all(np.array_equal(x.view(np.uint8), y.view(np.uint8)) for x, y in zip(a, b)), n
        pos += n


def test_value_records_and_page_keys_match_the_mlx_quantizers():
    from engine.kv.page_quant import meta_rows, quantize_pages
    from engine.kv.quant import quantize
    rng = np.random.default_rng(1)
    v = _rows(rng, 9, 3, 128)
    for bits in (4, 8):
        got = cpu_page_key_write.value_record_parts(v, bits, 64)
        want = quantize(v, bits)
        assert all(np.array_equal(np.array(g).view(np.uint8), np.array(w).view(np.uint8))
                   for g, w in zip(got, want))
    t = 16
    tail = _rows(rng, 2 * t, 2, 64).reshape(2, t, 2, 64)
    k = _rows(rng, 5, 2, 64)
    sources, where = np.array([1, 0], np.int32), np.array([0, 0, 1, 1, 1], np.int32)
    offs, rows = np.array([3, 15, 0, 7, 15], np.int32), np.arange(5, dtype=np.int32)
    for bits in (4, 6, 8):
        got = cpu_page_key_write.filled_page_keys(tail, sources, where, offs, rows, k, bits)
        page = np.array(tail)[sources]
        page[where, offs] = np.array(k)[rows]
        codes, scales, offsets = quantize_pages(mx.array(page).transpose(0, 2, 1, 3), bits)
        want = (codes.transpose(0, 2, 1, 3), meta_rows(scales, t), meta_rows(offsets, t))
        assert all(np.array_equal(np.array(g).view(np.uint8), np.array(w).view(np.uint8))
                   for g, w in zip(got, want)), bits


def test_runner_stores_take_the_cpu_writes(tiny_model_dirs, monkeypatch):
    lm = load_model(tiny_model_dirs["llama"])
    on = PackedModelRunner(lm, tail_store(lm, "k6v4-kivi"))
    assert all(s.cpu_writes for s in on.kvstore.layers.values() if s.packed)
    calls = record_calls(monkeypatch, cpu_page_key_write, "value_record_parts",
                         lambda v: v.shape[0])
    mx.eval(on.forward([Chunk(0, list(range(3, 40)), 0, [3, 1, 4, 5])]))
    assert calls and calls[0] == 37
    from engine.attention.layers import packed_layer_factory
    from engine.kv.store import KVStore
    off = KVStore(lm.geometry, 24, 16, lm.dtype, layer_factory=packed_layer_factory(
        "k6v4-kivi", kernels=KernelChoices(cpu_page_key_write=False), tail_slots=4))
    assert not any(s.cpu_writes for s in off.layers.values() if s.packed)
