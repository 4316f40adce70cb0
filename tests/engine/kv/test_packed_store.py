"""Packed layer store: exact bytes, quantize-on-write, verbatim packed I/O, layer eligibility."""
import mlx.core as mx
import numpy as np
import pytest

from capacity.formats import KVFormat, KVFormatError
from engine.kv.store import KVStore, NativeLayerStore, Slots
from engine.model.loader import LayerGeometry, ModelGeometry
from engine.attention.layers import packed_layer_factory
from engine.kv.identity import layer_report
from engine.kv.packed_store import PackedLayerStore
from engine.kv.quant import quantize
from engine.kv.rotation import rotate

GEOM = ModelGeometry(layers=(
    LayerGeometry(0, "sliding", 2, 64, 64, window=16),
    LayerGeometry(1, "full", 2, 64, 64),
    LayerGeometry(2, "full", 4, 128, 128)), vocab_size=10)


@pytest.mark.parametrize("name", ["int8", "k8v4", "int4"])
def test_page_bytes_are_the_format_arithmetic(name):
    store = KVStore(GEOM, num_pages=8, page_tokens=16, layer_factory=packed_layer_factory(name))
    assert isinstance(store.layer(0), NativeLayerStore)      # windowed layers stay native
    expected = (2 * 2 * 64 * 4                                 # native f32 sliding layer
                + KVFormat(name, 64).bytes_per_token(2) + KVFormat(name, 128).bytes_per_token(4))
    assert store.bytes_per_token == expected
    assert store.nbytes == 8 * 16 * expected
    report = layer_report(store)
    assert [r["storage"] for r in report] == [
        "native-v1-f32", KVFormat(name, 64).identity, KVFormat(name, 128).identity]


def test_write_quantizes_rotated_keys_and_plain_values():
    g = GEOM.layers[2]
    fmt = KVFormat("int8", 128)
    store = PackedLayerStore(g, fmt, num_pages=4, page_tokens=16)
    k = mx.random.normal((5, 4, 128), key=mx.random.key(0))
    v = mx.random.normal((5, 4, 128), key=mx.random.key(1))
    slots = Slots.from_flat(np.array([17, 18, 19, 3, 63]), 16)
    store.write(slots, k, v)
    kp, vp = store.read_packed(slots)
    for got, want in ((kp, quantize(rotate(k), 8)), (vp, quantize(v, 8))):
        assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))
    # Dequantized gather returns the model's basis again, within the int8 step.
    kg, vg = store.gather(mx.array([[1]]))
    assert mx.abs(kg[0, :, 1:4] - k[:3].transpose(1, 0, 2)).max().item() < 0.03
    assert mx.abs(vg[0, :, 1:4] - v[:3].transpose(1, 0, 2)).max().item() < 0.03


def test_write_packed_is_verbatim_and_touches_only_its_slots():
    g = GEOM.layers[1]
    store = PackedLayerStore(g, KVFormat("int4", 64), num_pages=2, page_tokens=16)
    before = [*store.k, *store.v]   # every section of the pool, [pages, tokens, heads, width]
    src = PackedLayerStore(g, KVFormat("int4", 64), num_pages=2, page_tokens=16)
    slots = Slots.from_flat(np.array([5, 6]), 16)
    src.write(slots, mx.random.normal((2, 2, 64)), mx.random.normal((2, 2, 64)))
    store.write_packed(slots, *src.read_packed(slots))
    assert all(mx.array_equal(a, b).item() for a, b in zip(store.arrays(), src.arrays()))
    changed = [mx.any(a != b, axis=(2, 3)) for a, b in zip([*store.k, *store.v], before)]
    for c in changed:   # only page 0, offsets 5 and 6 differ from the zeroed pool
        assert set(zip(*np.nonzero(np.array(c)))) <= {(0, 5), (0, 6)}


def test_gather_packed_orders_history_by_page_table():
    g = GEOM.layers[1]
    store = PackedLayerStore(g, KVFormat("int8", 64), num_pages=4, page_tokens=4)
    k = mx.arange(8 * 2 * 64, dtype=mx.float32).reshape(8, 2, 64) / 100
    store.write(Slots.from_flat(np.array([12, 13, 14, 15, 4, 5, 6, 7]), 4), k, k)
    hist = store.gather_packed(mx.array([[3, 1]]))
    want = quantize(k.transpose(1, 0, 2), 8)
    assert mx.array_equal(hist.v.codes[0], want.codes).item()
    assert hist.length == 8


def test_packed_store_refuses_layers_it_cannot_hold():
    with pytest.raises(KVFormatError):
        PackedLayerStore(GEOM.layers[0], KVFormat("int8", 64), 2, 16)
    with pytest.raises(KVFormatError):
        PackedLayerStore(LayerGeometry(0, "full", 2, 64, 128), KVFormat("int8", 64), 2, 16)
    odd = ModelGeometry(layers=(LayerGeometry(0, "full", 2, 96, 96),), vocab_size=10)
    with pytest.raises(KVFormatError):   # never a silent native fallback
        KVStore(odd, 2, 16, layer_factory=packed_layer_factory("int4"))
    assert KVStore(odd, 2, 16, layer_factory=packed_layer_factory("native")).bytes_per_token == 2 * 2 * 96 * 4


@pytest.mark.parametrize("name", ["int8", "k8v4", "int4"])
def test_one_row_write_touches_only_its_record(name):
    """A batch-1 decode write is one scatter of the row's record into the layer's pool: the row
    reads back as the same row written in a two-row write, and no pool word outside the record's
    columns of its page changes."""
    g = GEOM.layers[2]
    k = mx.random.normal((2, 4, 128), key=mx.random.key(3))
    v = mx.random.normal((2, 4, 128), key=mx.random.key(4))
    pair = PackedLayerStore(g, KVFormat(name, 128), num_pages=4, page_tokens=16)
    pair.write(Slots.from_flat(np.array([40, 37]), 16), k, v)
    one = PackedLayerStore(g, KVFormat(name, 128), num_pages=4, page_tokens=16)
    slot = Slots.from_flat(np.array([37]), 16)
    one.write(slot, k[1:], v[1:])
    for a, b in zip(one.read_packed(slot), pair.read_packed(slot)):
        assert all(mx.array_equal(x, y).item() for x, y in zip(a, b))
    assert one.arrays() == [one.pool]
    touched = set(zip(*np.nonzero(np.array(one.pool))))
    record = {(2, int(c)) for c in np.array(one.layout.row_columns(np.array([5])))[0]}
    assert touched and touched <= record
