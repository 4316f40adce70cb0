"""Page-key prefill chunks through the CUDA write kernel (engine/attention/cuda/page_key_write.py,
PageKeyStore `chunk_writer`) without a GPU: the kernel's source on the CPU emulator against the
store's MLX write, chunk after chunk, byte for byte (pool and native tails); the same check with
the chunk-row lookup broken on purpose; the store's refusal of rows it cannot hand the kernel.
The comparison (bench/page_key_chunk_compare.py) runs on the GPU with the real kernel too.

Needs g++ (the emulator compiles the kernel body with it)."""
import shutil

import mlx.core as mx
import numpy as np
import pytest

from bench.page_key_chunk_compare import CASES, compare, store as _store
from engine.attention.cuda import page_key_write
from engine.kv.store import Slots
from tests.engine.attention.test_cuda_page_key_write import _writer


def _compare(fmt, d, kvh, t, calls, dtype, workdir, mutation=None, modes=None):
    writer = _writer(workdir, mutation)
    diff = compare(fmt, d, kvh, t, calls, dtype, writer)
    if modes is not None:
        modes.extend(writer.modes)
    return diff


@pytest.mark.parametrize("fmt", ["k6v4-kivi", "int4-kivi"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"d{c[0]}-h{c[1]}-pt{c[2]}")
def test_chunk_writes_are_the_mlx_writes_bytes(fmt, case, tmp_path):
    assert shutil.which("g++"), "the CPU emulation of the CUDA kernel compiles with g++"
    modes = []
    assert _compare(fmt, *case, mx.bfloat16, tmp_path, modes=modes) is None
    if case is CASES[0]:
        # Its calls 1 and 2 need more tail slots than are free and take given-back ones (the
        # kernel copies the tails into new arrays); its first and last write them in place.
        assert modes == [True, False, False, True]


def test_a_tail_copy_that_overwrites_the_calls_rows_is_caught(tmp_path):
    assert _compare("k6v4-kivi", *CASES[0][:4], mx.bfloat16, tmp_path,
                    ("if (!hit) {", "if (true) {")) is not None


def test_float32_rows(tmp_path):
    assert _compare("k6v4-kivi", 64, 2, 16, CASES[0][3], mx.float32, tmp_path) is None


def test_keys_of_a_filled_page_must_come_from_the_chunk(tmp_path):
    """With the lookup of the call's own rows broken (every earlier token read from the tail),
    a page a chunk fills gets other codes: the comparison sees it."""
    old = "return rr >= 0 && page[rr] == pg && off[rr] == t"
    broken = "return rr < 0 && page[rr] == pg && off[rr] == t"
    assert _compare("k6v4-kivi", 64, 2, 16, CASES[0][3][:2], mx.bfloat16, tmp_path,
                    (old, broken)) is not None


def test_rows_of_one_page_out_of_order_take_the_mlx_write(tmp_path):
    """The kernel keys a filled page from consecutive rows; a call whose rows of one page are
    not one run (never built by the runner) is written by the MLX ops instead, correctly."""
    def refuse(*args):
        raise AssertionError("the kernel took rows it cannot key")
    writer = _writer(tmp_path)
    writer.write_decode = refuse
    store = _store("k6v4-kivi", 64, 2, 16, 8, 2, mx.bfloat16, writer)
    ref = _store("k6v4-kivi", 64, 2, 16, 8, 2, mx.bfloat16)
    pos = np.r_[np.arange(8, 16), np.arange(0, 8)]          # page 3's rows in two runs
    k = mx.random.normal((16, 2, 64)).astype(mx.bfloat16)
    for s in (store, ref):
        s.write(Slots(np.full(16, 3, np.int32), pos), k, k)
        s.flush_tail()
    assert np.array_equal(np.array(store.pool), np.array(ref.pool))


@pytest.mark.parametrize("choice,taken", [(False, False), (None, True), (True, True)])
def test_the_kernel_choice_decides_whether_stores_get_the_chunk_writer(monkeypatch, choice, taken):
    """KernelChoices.page_key_chunk_write: on by default (None) since device run 12; None or
    True hand page-key stores the CUDA write kernel where CUDA runs (faked here: `available`)."""
    from engine.attention.choices import KernelChoices
    from engine.attention.cuda import paged_decode
    from engine.attention.layers import packed_layer_factory
    from engine.model.loader import LayerGeometry
    def store(cuda: bool):
        monkeypatch.setattr(paged_decode, "available", lambda: cuda)
        make = packed_layer_factory("k6v4-kivi", tail_slots=2,
                                    kernels=KernelChoices(page_key_chunk_write=choice))
        return make(LayerGeometry(0, "full", 2, 64, 64), 8, 16, mx.bfloat16)
    assert (store(True).chunk_writer is page_key_write) is taken
    assert store(False).chunk_writer is None              # no CUDA: the MLX write
