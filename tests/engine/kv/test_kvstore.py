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


def test_slots_runs_are_stretches_of_consecutive_slots_in_one_page():
    # Tokens 0-5 on page 6 from offset 2 (a page boundary after 2 of them), a page change, a
    # gap inside a page, a lone token.
    slots = Slots(np.array([6, 6, 1, 1, 1, 1, 3, 3, 9]), np.array([2, 3, 0, 1, 2, 3, 0, 2, 7]))
    assert slots.runs() == [(6, 2, 0, 2), (1, 0, 2, 4), (3, 0, 6, 1), (3, 2, 7, 1), (9, 7, 8, 1)]
    assert Slots(np.array([4]), np.array([0])).runs() == [(4, 0, 0, 1)]


@pytest.mark.parametrize("run_tokens", [1, 10 ** 9])   # slice updates / the scatter
def test_a_write_by_stretches_equals_the_scatter(run_tokens, monkeypatch):
    """A prompt's write on the CPU goes by one slice update per stretch of consecutive slots
    where they average RUN_TOKENS or more, else one scatter: same pages either way."""
    from engine.kv import store as store_mod
    monkeypatch.setattr(store_mod, "RUN_TOKENS", run_tokens)
    layer = NativeLayerStore(GEOM.layers[0], 8, 4, mx.float32)
    table = [6, 1, 3, 0]
    tokens = list(range(2, 13))                # starts mid-page, crosses three page bounds
    slots = Slots.from_flat(np.array([table[t // 4] * 4 + t % 4 for t in tokens]), 4)
    k, v = _rows(len(tokens), 7), _rows(len(tokens), 8)
    before = np.array(layer.k)
    layer.write(slots, mx.array(k), mx.array(v))
    want_k = before.copy()
    want_v = np.zeros_like(want_k)
    for i, t in enumerate(tokens):
        want_k[:, table[t // 4], t % 4] = k[i]
        want_v[:, table[t // 4], t % 4] = v[i]
    np.testing.assert_array_equal(np.array(layer.k), want_k)
    np.testing.assert_array_equal(np.array(layer.v), want_v)
