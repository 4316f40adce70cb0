"""CPU-side tests of the CUDA packed prefill kernel's host logic (engine/attention/cuda/packed_prefill.py)
and of the reference harness its device check uses (bench/cuda_check.py, prefill_case).

The kernel itself only runs on a CUDA GPU (`python -m bench.cuda_check` there; results in
docs/lab/benchmarks-gpu.md). What runs here: the split plan, when a packed layer routes to the
kernel, and that the harness's numpy model of the kernel's contract (pools read by page table,
per-row history and own-key bounds, NaN padding) agrees with the engine's direct packed
attention (history written as the engine writes it: records into one pool per layer,
engine/kv/page_layout.py), and catches a kernel that gets the contract wrong.
"""
from __future__ import annotations

import numpy as np
import pytest

from bench import cuda_check
from engine.attention.cuda import packed_prefill as cuda_packed_prefill

pytestmark = pytest.mark.gpu


def test_split_plan():
    # A chunk of 512 at 4K history in 96 blocks: 3 splits reach the target.
    assert cuda_packed_prefill.split_count(96, 64 + 8) == 3
    # Enough blocks already: one split, one launch.
    assert cuda_packed_prefill.split_count(300, 1000) == 1
    # Short key ranges are not split below MIN_TILES_PER_SPLIT tiles.
    assert cuda_packed_prefill.split_count(4, 9) == 1
    assert cuda_packed_prefill.split_count(4, 0) == 1
    # Batch 1 decode at 32K over 4 KV heads: capped.
    assert cuda_packed_prefill.split_count(4, 513) == cuda_packed_prefill.MAX_SPLITS
    with pytest.raises(ValueError):
        cuda_packed_prefill.split_count(0, 10)


def test_query_warps_fill_the_block_but_not_with_padding():
    assert cuda_packed_prefill.query_warps(4, 512) == 2        # 8 warps: 4 heads x 32 positions
    assert cuda_packed_prefill.query_warps(3, 512) == 2        # SmolLM2's 3:1 groups
    assert cuda_packed_prefill.query_warps(1, 512) == cuda_packed_prefill.MAX_QUERY_WARPS
    assert cuda_packed_prefill.query_warps(8, 512) == 1
    assert cuda_packed_prefill.query_warps(4, 1) == 1          # decode: one tile of 16
    assert cuda_packed_prefill.query_warps(1, 20) == 2         # no warp of pure padding
    for g in (1, 2, 3, 4, 6, 8):
        assert g * cuda_packed_prefill.query_warps(g, 4096) <= cuda_packed_prefill.MAX_WARPS


def test_formats_and_cpu_routing(tmp_path):
    from engine.attention.paged import StepBatch
    from engine.sched.seq import Chunk
    from engine.kv.store import KVStore
    from engine.model.loader import load_model
    from engine.attention.layers import packed_layer_factory
    from bench.synthetic import build_tiny_model
    import mlx.core as mx

    assert cuda_packed_prefill.supports(8, 4, 64) and cuda_packed_prefill.supports(4, 4, 128)
    assert not cuda_packed_prefill.supports(4, 4, 256) and not cuda_packed_prefill.supports(2, 4, 64)
    loaded = load_model(str(build_tiny_model("llama", tmp_path / "m")))
    store = KVStore(loaded.geometry, 4, 16, loaded.dtype,
                    layer_factory=packed_layer_factory("int4")).layer(0)
    step = StepBatch([Chunk(0, [0] * 8, 16, [0, 1])], 16)
    q = mx.zeros((1, 4, 8, store.geometry.head_dim))
    # No CUDA here: never routed, whatever the step.
    assert not cuda_packed_prefill.applies(store, step, q, kernel_decode=True)


@pytest.mark.parametrize("fmt", ["int8", "int4", "k8v4"])
def test_device_check_reference_matches_engine_packed_attention(fmt):
    """The numpy model of the kernel's contract agrees with direct packed attention: ragged
    rows (one without history), NaN in the chunk padding, a decode-shaped call."""
    rng = np.random.default_rng(1)
    for hq, kvh, d, history, own in ((4, 2, 64, [40, 0, 75], [9, 17, 1]),
                                     (4, 1, 128, [33], [20]), (3, 3, 64, [50, 20], [1, 1])):
        case = cuda_check.prefill_case(rng, fmt, hq, kvh, d, history, own,
                                       kernel=cuda_check.reference_packed_prefill)
        assert case["ok"] and case["max_abs_err"] < 0.02, case   # bf16 output rounding


def test_device_check_reference_catches_contract_errors():
    """A kernel that drops the last history key, or lets a position see its successor, fails."""
    rng = np.random.default_rng(2)

    def short_history(q, k_new, v_new, pool, layout, kb, vb, pages, bounds, longest, scale,
                      splits=None):
        import mlx.core as mx
        cut = np.array(bounds)
        cut[:, 0] -= 1
        return cuda_check.reference_packed_prefill(q, k_new, v_new, pool, layout, kb, vb,
                                                   pages, mx.array(cut), longest, scale)

    def peeks_ahead(q, k_new, v_new, *rest, splits=None):
        import mlx.core as mx
        # Position i also sees key i + 1 (shift the fresh keys one step earlier).
        shifted = mx.concatenate([k_new[:, :, 1:], k_new[:, :, -1:]], axis=2)
        return cuda_check.reference_packed_prefill(q, shifted, v_new, *rest)

    for wrong in (short_history, peeks_ahead):
        case = cuda_check.prefill_case(rng, "int8", 4, 2, 64, [5, 30], [12, 12], kernel=wrong)
        assert not case["ok"], (wrong.__name__, case)
