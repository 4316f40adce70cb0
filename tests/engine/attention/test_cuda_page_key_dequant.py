"""The page-key prefill dequant kernel (engine/attention/cuda/page_key_dequant.py) without a
GPU: its source on the CPU emulator (bench/cuda_emulate_page_keys.py) against the store's own
dequantized history, and the engine routing prefill chunks over page-key history to it (the
kernel emulated) with the MLX path's logits. Needs g++."""
import shutil

import mlx.core as mx
import numpy as np
import pytest

from bench import cuda_emulate_page_keys as emu
from bench import cuda_nvcc_check
from engine.attention.choices import KernelChoices
from engine.attention.cuda import page_key_dequant as cuda_page_key_dequant
from engine.attention.cuda import paged_decode as cuda_paged_decode
from engine.runner.packed import PackedModelRunner
from engine.sched.seq import Chunk
from tests.engine.kv.tail_helpers import T, llama, tail_store  # noqa: F401 (fixture)

FORMATS = ["k6v4-kivi", "int4-kivi"]


@pytest.mark.parametrize("fmt,d,pt", [("k6v4-kivi", 128, 16), ("int4-kivi", 64, 32),
                                      ("k6v4-kivi", 64, 4)])
def test_kernel_source_writes_the_stores_history_then_the_own_rows(fmt, d, pt, tmp_path):
    """Ragged rows (no history, a partial tail, history on a page boundary), own rows shorter
    than the call's width (the kernel reads pages for history positions only, so the history's
    page tables serve): the copy is the store's dequantized gather (codes for full pages,
    the native tail for the partial one) up to each row's history, zeros to the span, its own
    rows, zeros past them."""
    assert shutil.which("g++"), "the CPU emulation of the CUDA kernel compiles with g++"
    rng = np.random.default_rng(11)
    hist, own, w, kvh = np.array([70, 0, 2 * pt]), np.array([5, 3, 1]), 5, 2
    store, tables, slots = emu.page_key_store(rng, fmt, hist, kvh, d, pt)
    k_new, v_new = (mx.array(rng.standard_normal((3, kvh, w, d)).astype(np.float32))
                    for _ in range(2))
    bounds = np.stack([hist, own], axis=1).astype(np.int32)
    span = int(hist.max())
    k, v = emu.page_key_dequant(k_new, v_new, store.pool, store.layout, 6 if "k6" in fmt else 4,
                                store.tail, tables, bounds, slots, span, workdir=tmp_path)
    gk, gv = (np.array(a.astype(mx.float32)) for a in store.gather(mx.array(tables)))
    for got, hist_rows, fresh in ((k, gk, k_new), (v, gv, v_new)):
        got, fresh = np.array(got), np.array(fresh)
        for b in range(3):
            h, n = int(hist[b]), int(own[b])
            np.testing.assert_allclose(got[b, :, :h], hist_rows[b, :, :h], rtol=0, atol=1e-5)
            assert not got[b, :, h:span].any()
            np.testing.assert_array_equal(got[b, :, span:span + n], fresh[b, :, :n])
            assert not got[b, :, span + n:].any()
    assert (slots >= 0).sum() == 1   # the 70-token row's partial page came from its tail


@pytest.mark.parametrize("fmt", FORMATS)
def test_runner_prefill_chunks_through_the_kernel_match_the_mlx_path(llama, fmt, monkeypatch,
                                                                    tmp_path):
    """Chunked prefill of two rows (second chunks over history with a partial page, rows of
    different lengths: the joint mask) through the emulated kernel, then decode, equals the
    MLX path's logits; the kernel saw each chunk over history and none without."""
    calls = []

    def emulated(*args):
        calls.append(int(args[7].shape[0]))   # bounds rows
        return emu.page_key_dequant(*args, workdir=tmp_path)

    monkeypatch.setattr(cuda_paged_decode, "available", lambda: True)
    monkeypatch.setattr(cuda_page_key_dequant, "dequantized_history", emulated)
    # Decode on the MLX path: only the prefill kernel is emulated here.
    kernel = PackedModelRunner(llama, tail_store(llama, fmt),
                               kernels=KernelChoices(page_key_prefill=True, page_key_kernel=False))
    plain = PackedModelRunner(llama, tail_store(llama, fmt),
                              kernels=KernelChoices(page_key_prefill=False,
                                                    page_key_kernel=False))   # the MLX path
    tables = [[5, 1, 3, 8], [7, 2, 9, 10]]
    seqs = [list(range(3, 3 + 3 * T + 2)), list(range(40, 40 + 2 * T + 5))]
    cuts = [(0, 20), (0, 13)], [(20, 3 * T + 2), (13, 2 * T + 5)]
    for part in cuts:
        chunks = [Chunk(i, s[a:b], a, t)
                  for i, (s, t, (a, b)) in enumerate(zip(seqs, tables, part))]
        got, want = kernel.forward(chunks), plain.forward(chunks)
        assert mx.abs(got - want).max().item() < 1e-4
    assert calls == [2] * len(kernel.kvstore.layers)   # the second chunks only
    step = [Chunk(i, [9], len(s), t) for i, (s, t) in enumerate(zip(seqs, tables))]
    assert mx.abs(kernel.forward(step) - plain.forward(step)).max().item() < 1e-4


def test_formats_choice_and_nvcc():
    assert cuda_page_key_dequant.supports(6, 4, 128, 16)
    assert cuda_page_key_dequant.supports(4, 4, 64, 4)
    assert not cuda_page_key_dequant.supports(8, 8, 64, 16)
    assert KernelChoices().page_key_prefill is None   # on for CUDA (measured on the H200)
    code = cuda_nvcc_check.main(["--only", "page-key-dequant d128 k6"])
    assert code == (2 if shutil.which("nvcc") is None else 0)
