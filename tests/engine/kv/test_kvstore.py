"""Physical pages: writes land in the right slot, gathers return rows in page-table order, and
the byte accounting is exact (it feeds admission)."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from capacity.formats import KVFormat
from engine.kv.store import KVStore, NativeLayerStore, Slots
from engine.model.loader import LayerGeometry, ModelGeometry

GEOM = ModelGeometry(layers=(LayerGeometry(0, "full", 2, 64, 64),
                             LayerGeometry(1, "sliding", 2, 64, 64, window=16),
                             LayerGeometry(2, "recurrent")), vocab_size=10)


def _rows(n, seed, heads=2, dim=64):
    return np.random.default_rng(seed).standard_normal((n, heads, dim)).astype(np.float32)


def test_write_then_gather_follows_page_table_across_pages():
    store = KVStore(GEOM, num_pages=8, page_tokens=4)
    table = [6, 1, 3]                      # non-contiguous, out of order
    k, v = _rows(11, 0), _rows(11, 1)
    slots = np.array([table[t // 4] * 4 + t % 4 for t in range(11)])
    store.write(0, slots, mx.array(k), mx.array(v))
    gk, gv = store.gather(0, np.array([table]))
    assert gk.shape == (1, 2, 12, 64) and gv.shape == (1, 2, 12, 64)
    np.testing.assert_array_equal(np.array(gk[0].transpose(1, 0, 2))[:11], k)
    np.testing.assert_array_equal(np.array(gv[0].transpose(1, 0, 2))[:11], v)


def test_chunked_writes_do_not_disturb_other_pages_or_layers():
    store = KVStore(GEOM, num_pages=4, page_tokens=4)
    a, b = _rows(4, 2), _rows(4, 3)
    store.write(0, np.arange(8, 12), mx.array(a), mx.array(a))        # page 2
    store.write(0, np.array([0, 1]), mx.array(b[:2]), mx.array(b[:2]))  # page 0, then more
    store.write(0, np.array([2, 3]), mx.array(b[2:]), mx.array(b[2:]))
    gk, _ = store.gather(0, np.array([[2], [0]]))
    np.testing.assert_array_equal(np.array(gk[0].transpose(1, 0, 2)), a)
    np.testing.assert_array_equal(np.array(gk[1].transpose(1, 0, 2)), b)
    other, _ = store.gather(1, np.array([[0, 1, 2, 3]]))
    assert not np.any(np.array(other))


def test_only_attention_layers_are_paged_and_bytes_are_exact():
    store = KVStore(GEOM, num_pages=5, page_tokens=16, dtype=mx.float32)
    assert sorted(store.layers) == [0, 1]
    per_layer = KVFormat("native", 64, "float32").bytes_per_token(2)
    assert store.bytes_per_token == 2 * per_layer
    assert store.page_bytes == 16 * 2 * per_layer
    assert store.nbytes == 5 * store.page_bytes == sum(a.nbytes for a in store.arrays())
    half = KVStore(GEOM, num_pages=5, page_tokens=16, dtype=mx.bfloat16)
    assert half.page_bytes * 2 == store.page_bytes


def test_native_dtype_is_kept_on_write():
    store = KVStore(GEOM, num_pages=2, page_tokens=4, dtype=mx.bfloat16)
    store.write(0, np.array([5]), mx.array(_rows(1, 4)), mx.array(_rows(1, 5)))
    k, v = store.gather(0, np.array([[1]]))
    assert k.dtype == v.dtype == mx.bfloat16


def test_page_size_must_be_a_power_of_two_and_pages_positive():
    with pytest.raises(ValueError):
        KVStore(GEOM, num_pages=4, page_tokens=12)
    with pytest.raises(ValueError):
        KVStore(GEOM, num_pages=0, page_tokens=16)


def test_layer_factory_plugs_in_another_layer_store():
    made = []

    def factory(g, num_pages, page_tokens, dtype):
        made.append(g.index)
        return NativeLayerStore(g, num_pages, page_tokens, dtype)

    store = KVStore(GEOM, num_pages=2, page_tokens=4, layer_factory=factory)
    assert made == [0, 1] and store.page_bytes > 0


def test_slots_split_into_page_and_offset():
    s = Slots.from_flat(np.array([0, 5, 17]), 8)
    assert s.page.tolist() == [0, 0, 2] and s.offset.tolist() == [0, 5, 1] and s.count == 3
