"""CPU-side tests of the CUDA decode kernels' host logic (engine/attention/cuda/paged_decode.py,
engine/attention/cuda/packed_decode.py, bench/cuda_check.py).

The kernels themselves only run on a CUDA GPU: they are exercised there by
`python -m bench.cuda_check` (results in docs/lab/benchmarks-gpu.md), never in this suite. What
runs here: the split plan, which layers may use the kernels, that a CPU runner never routes to
them, and the reference harness the device check uses (its numpy model of the packed kernel's
arithmetic and page layout must agree with the engine's own packed attention).
"""
from __future__ import annotations

import numpy as np
import pytest

from bench import cuda_check
from engine.attention.cuda import packed_decode as cuda_packed_decode
from engine.attention.cuda import paged_decode as cuda_paged_decode
from engine.attention.packed_cache import PackedLayerCache

pytestmark = pytest.mark.gpu


def test_split_plan_keeps_short_contexts_whole_and_splits_long_ones():
    # SmolLM2-sized decode at 256 keys: one split, one launch (as before split-K existed).
    for rows in (1, 8, 32):
        assert cuda_paged_decode.split_count(rows, 3, 256) == 1
    # Batch 1 at 4K over 4 KV heads: cut into 256-key splits.
    assert cuda_paged_decode.split_count(1, 4, 4096) == 16
    # Many rows fill the GPU without splitting much; no more splits than 256-key pieces.
    assert cuda_paged_decode.split_count(8, 4, 32768) == -(-cuda_paged_decode.TARGET_BLOCKS // 32)
    assert cuda_paged_decode.split_count(1, 1, 10**7) == cuda_paged_decode.MAX_SPLITS
    for rows, heads, keys in ((1, 4, 300), (3, 2, 5000), (64, 8, 100000)):
        s = cuda_paged_decode.split_count(rows, heads, keys)
        assert 1 <= s <= -(-keys // cuda_paged_decode.MIN_KEYS_PER_SPLIT)


def test_split_plan_refuses_empty_sizes():
    with pytest.raises(ValueError):
        cuda_paged_decode.split_count(0, 4, 100)


def test_packed_kernel_formats():
    assert cuda_packed_decode.supports(8, 8, 64) and cuda_packed_decode.supports(4, 4, 128)
    assert not cuda_packed_decode.supports(8, 4, 128)     # k8v4 keeps the direct path
    assert not cuda_packed_decode.supports(4, 4, 256)


def test_cpu_runner_never_routes_to_the_kernels(tmp_path):
    import mlx.core as mx

    from engine.kv.store import KVStore
    from engine.model.loader import load_model
    from engine.runner.packed import PackedModelRunner
    from engine.attention.packed_store import packed_layer_factory
    from engine.runner.paged import ModelRunner
    from bench.synthetic import build_tiny_model

    assert not cuda_paged_decode.available()
    loaded = load_model(str(build_tiny_model("llama", tmp_path / "m")))
    native = ModelRunner(loaded, KVStore(loaded.geometry, 4, 16, loaded.dtype))
    packed = PackedModelRunner(loaded, KVStore(loaded.geometry, 4, 16, loaded.dtype,
                                               layer_factory=packed_layer_factory("int4")))
    assert not native.kernel_decode and not packed.kernel_decode
    store = packed.kvstore.layer(0)
    assert PackedLayerCache.kernel_decode_fits(store)   # it would on CUDA
    assert mx.default_device() == mx.cpu
    assert cuda_check.main(["--out", str(tmp_path / "c.json")]) == 2   # nothing to check here


def test_device_check_reference_matches_engine_packed_attention():
    """The numpy model of the packed kernel (token-major pages by page table, scores as
    scale * (q . codes) + offset * sum(q) per group, the step's own key in full precision last)
    agrees with direct packed attention; the device check compares the kernel with the latter."""
    rng = np.random.default_rng(0)
    for fmt in ("int8", "int4"):
        for rows, longest, hq, kvh, d in ((1, 1, 9, 3, 64), (1, 300, 9, 3, 64),
                                          (3, 200, 16, 4, 128)):
            case = cuda_check.packed_case(rng, fmt, rows, hq, kvh, d, longest,
                                          kernel=cuda_check.reference_packed_decode)
            assert case["ok"] and case["max_abs_err"] < 0.01, case


def test_device_check_reference_catches_a_layout_error():
    """A kernel that reads the wrong key group's scale fails the check (the harness is not
    vacuous)."""
    rng = np.random.default_rng(1)

    def wrong(q, k_new, v_new, k_hist, v_hist, bits, tables, ends, scale):
        codes, scales, offsets = k_hist
        flipped = type(k_hist)(codes, scales[..., ::-1], offsets)
        return cuda_check.reference_packed_decode(q, k_new, v_new, flipped, v_hist, bits,
                                                  tables, ends, scale)

    case = cuda_check.packed_case(rng, "int4", 2, 16, 4, 128, 300, kernel=wrong)
    assert not case["ok"]
