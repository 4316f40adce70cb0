"""Shared by the native-tail format tests (test_packed_tail.py: int4-tail, int4-k32-tail, and the
page-key formats where a test runs for them too; test_packed_kivi.py: int4-kivi, k6v4-kivi)."""
import mlx.core as mx
import numpy as np
import pytest

from engine.attention.layers import packed_layer_factory
from engine.kv.store import KVStore
from engine.model.loader import load_model

T = 16   # page tokens: small, so short sequences cross page boundaries


@pytest.fixture(scope="module")
def llama(tiny_model_dirs):
    return load_model(tiny_model_dirs["llama"])


def tail_store(loaded, fmt, pages=24, slots=4):
    """A packed store of `fmt` with `slots` native tail pages."""
    return KVStore(loaded.geometry, pages, T, loaded.dtype,
                   layer_factory=packed_layer_factory(fmt, tail_slots=slots))


def gathered_native(loaded, packed: KVStore, table):
    """A native store holding exactly what `packed` gives attention for these pages."""
    native = KVStore(loaded.geometry, packed.num_pages, T, loaded.dtype)
    flat = np.asarray([p * T + o for p in table for o in range(T)])
    for i, store in packed.layers.items():
        k, v = store.gather(mx.array([table], dtype=mx.int32))
        native.write(i, flat, k[0].swapaxes(0, 1), v[0].swapaxes(0, 1))
    return native
