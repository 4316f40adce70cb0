"""The page-key CUDA decode kernel (engine/attention/cuda/page_key_decode.py) without a GPU: its
source on the CPU emulator (bench/cuda_emulate_page_keys.py: one fiber per GPU thread) against
the store's own dequantized history and a plain softmax, the engine routing decode steps to it
(the kernel emulated), and its variants through nvcc where one is installed.

Needs g++ (the emulator compiles the kernel body with it)."""
import shutil

import mlx.core as mx
import numpy as np
import pytest

from bench import cuda_emulate_page_keys as emu
from bench import cuda_nvcc_check
from engine.attention.choices import KernelChoices
from engine.attention.cuda import page_key_decode as cuda_page_key_decode
from engine.attention.cuda import paged_decode as cuda_paged_decode
from engine.attention.packed_cache import PackedLayerCache
from engine.runner.packed import PackedModelRunner
from engine.sched.seq import Chunk
from tests.engine.kv.tail_helpers import T, llama, tail_store  # noqa: F401 (fixture)

FORMATS = ["k6v4-kivi", "int4-kivi"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_source_matches_the_dequantized_reference_on_cpu_fibers(fmt, tmp_path):
    """Ragged rows (one without history, partial tails, one ending on a page boundary), GQA
    groups 3 and 4, head dims 64 and 128, pages of 16, 32 and 64 tokens, and several splits
    (the merge kernel) where a split starts at the first key of a native tail."""
    assert shutil.which("g++"), "the CPU emulation of the CUDA kernel compiles with g++"
    rng = np.random.default_rng(7)

    def kernel(*args):
        return emu.page_key_decode(*args, workdir=tmp_path)

    cases = [((300, 0, 77), 12, 4, 128, 16, None),      # one split, a row with no history
             ((600, 64, 129), 6, 2, 64, 32, 16),         # 3 splits; 64: no tail at all
             ((512, 45), 9, 3, 64, 64, 64)]              # 3 splits; the tail starts a split
    for hist, hq, kvh, d, pt, target in cases:
        case = emu.page_key_case(rng, fmt, hist, hq, kvh, d, pt, kernel, target)
        assert case["ok"] and case["max_abs_err"] < emu.TOLERANCE, case
    assert cuda_paged_decode.split_count(2, 2, 601, 16) == 3
    assert cuda_paged_decode.split_count(2, 3, 513, 64) == 3


def test_the_reference_catches_a_kernel_that_reads_pages_as_unquantized_tail():
    """The check has teeth: attending the tail page's codes instead of its native rows (here:
    the reference itself with the tail slot dropped) is off by far more than the tolerance."""
    rng = np.random.default_rng(1)
    store, tables, slots = emu.page_key_store(rng, "k6v4-kivi", (40,), 2, 64, 16)
    assert slots[0] >= 0 and store.tails.slot_of
    q = mx.array(rng.standard_normal((1, 4, 1, 64)).astype(np.float32))
    k_new = v_new = mx.array(rng.standard_normal((1, 2, 1, 64)).astype(np.float32))
    want = emu.reference(q, k_new, v_new, store, tables, [40], 64 ** -0.5)
    store.tails.slot_of.clear()     # the gather now reads the (never written) tail codes
    wrong = emu.reference(q, k_new, v_new, store, tables, [40], 64 ** -0.5)
    assert np.abs(want - wrong).max() > 10 * emu.TOLERANCE


def test_formats_and_choice():
    assert cuda_page_key_decode.supports(6, 4, 128, 4, 16)
    assert cuda_page_key_decode.supports(4, 4, 64, 8, 64)
    assert not cuda_page_key_decode.supports(6, 4, 64, 9, 16)     # past the GQA group
    assert not cuda_page_key_decode.supports(6, 4, 64, 4, 8)      # pages below 16 tokens
    assert not cuda_page_key_decode.supports(6, 4, 128, 4, 128)   # a page wider than a tile
    assert not cuda_page_key_decode.supports(8, 8, 64, 4, 16)     # token-local formats: v2
    assert KernelChoices().page_key_kernel is False   # off until measured on a GPU


@pytest.mark.parametrize("fmt", FORMATS)
def test_runner_decode_steps_through_the_kernel_match_the_mlx_path(llama, fmt, monkeypatch,
                                                                    tmp_path):
    """A runner with KernelChoices.page_key_kernel on CUDA (here: `available` patched, the
    kernel run on the emulator in float32 as the store holds it) sends every decode step of a
    page-key layer to the kernel with the right pages, ends and tail slots (as each step began),
    across a page fill, and its logits equal the MLX path's."""
    calls = []

    def emulated(q, k_new, v_new, pool, layout, k_bits, tail, pages, ends, tail_slots,
                 longest, scale, target_blocks=None, min_keys=None):
        calls.append(np.array(tail_slots).tolist())
        out = emu.page_key_decode(q, k_new, v_new, pool, layout, k_bits, tail,
                                  np.array(pages), np.array(ends), np.array(tail_slots),
                                  scale, target_blocks, workdir=tmp_path)
        return mx.array(out).astype(q.dtype)

    monkeypatch.setattr(cuda_paged_decode, "available", lambda: True)
    monkeypatch.setattr(cuda_page_key_decode, "page_key_decode_attention", emulated)
    kernel = PackedModelRunner(llama, tail_store(llama, fmt),
                               kernels=KernelChoices(page_key_kernel=True))
    plain = PackedModelRunner(llama, tail_store(llama, fmt))
    assert kernel.kernel_decode and kernel.compiled is None   # page keys: never compiled
    assert not plain.kernel_decode
    assert PackedLayerCache.kernel_decode_fits(kernel.kvstore.layers[0],
                                               KernelChoices(page_key_kernel=None))
    tables = [[5, 1, 3], [7, 2, 9]]
    seqs = [list(range(3, 3 + 2 * T - 4)), list(range(40, 40 + T + 5))]
    for runner in (kernel, plain):
        runner.forward([Chunk(i, s, 0, t) for i, (s, t) in enumerate(zip(seqs, tables))])
    for step in range(6):   # row 0 fills its second page at step 3
        chunks = [Chunk(i, [7 + step], len(s) + step, t)
                  for i, (s, t) in enumerate(zip(seqs, tables))]
        got, want = kernel.forward(chunks), plain.forward(chunks)
        assert mx.abs(got - want).max().item() < 1e-3, step
    layers = len(kernel.kvstore.layers)
    assert len(calls) == 6 * layers
    assert all(-1 not in c for c in calls[:3 * layers])   # both rows had a partial page
    assert calls[4 * layers][0] == -1                     # row 0's page filled: no tail yet


def test_device_check_runs_on_cpu_fibers(llama, monkeypatch, tmp_path):
    """bench/device/page_key_kernel_check.py (the device bench's kernel check) with the kernel
    emulated: its engine-path calls (PackedLayerCache.attend, kernel and tiled) agree with the
    reference, and its engine step routes to the kernel."""
    from bench.device import page_key_kernel_check

    def emulated(q, k_new, v_new, pool, layout, k_bits, tail, pages, ends, tail_slots,
                 longest, scale, target_blocks=None, min_keys=None):
        out = emu.page_key_decode(q, k_new, v_new, pool, layout, k_bits, tail,
                                  np.array(pages), np.array(ends), np.array(tail_slots),
                                  scale, target_blocks, workdir=tmp_path)
        return mx.array(out).astype(q.dtype)

    monkeypatch.setattr(cuda_paged_decode, "available", lambda: True)
    monkeypatch.setattr(cuda_page_key_decode, "page_key_decode_attention", emulated)
    geometry = dict(num_attention_heads=6, num_key_value_heads=2, head_dim=64)
    got = page_key_kernel_check.attention_check(geometry, 100, 3, "k6v4-kivi", T)
    assert got["ok"] and got["tiled_vs_reference"] < 1e-2, got
    assert got["history"][0] == 99 and any(h % T for h in got["history"])
    logits = page_key_kernel_check.logits_check(llama, "int4-kivi", 40, 2)
    assert logits["kernel_routed"] and logits["kernel_vs_tiled_logits"] < 1e-3, logits


def test_nvcc_compiles_the_largest_variant():
    """The variant with the most shared memory (6-bit keys, head dim 128, pages of 16, group 8)
    compiles with nvcc where one is installed; without it the check says so (exit 2)."""
    code = cuda_nvcc_check.main(["--only", "page-key d128 k6 pt16 g8"])
    assert code == (2 if shutil.which("nvcc") is None else 0)
