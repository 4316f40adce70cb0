"""CPU-side tests of the CUDA decode kernels' host logic (engine/attention/cuda/paged_decode.py,
engine/attention/cuda/packed_decode.py, bench/cuda_check.py).

The kernels themselves only run on a CUDA GPU: they are exercised there by
`python -m bench.cuda_check` (results in docs/lab/benchmarks-gpu.md), never in this suite. What
runs here: the split plan, which layers may use the kernels, that a CPU runner never routes to
them, and the reference harness the device check uses (its numpy model of the packed kernel's
arithmetic and page layout must agree with the engine's own packed attention).
"""
from __future__ import annotations

import shutil

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
    # A shorter minimum split (KernelChoices.decode_split_min_keys) cuts short rows finer.
    assert cuda_paged_decode.split_count(1, 2, 4096, min_keys=64) == 64
    assert cuda_paged_decode.split_count(1, 2, 4096, min_keys=128) == 32
    assert cuda_paged_decode.split_count(8, 2, 4096, 528, min_keys=64) == 33


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
    from engine.attention.layers import packed_layer_factory
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
    """A kernel that reads the wrong key group's scale, or takes the key scales for their
    offsets, fails the check (the harness is not vacuous)."""
    import mlx.core as mx

    rng = np.random.default_rng(1)

    def wrong(read):
        def kernel(q, k_new, v_new, pool, layout, bits, tables, ends, scale):
            pool = mx.array(np.array(pool))   # a copy: the case's pool stays as written
            every = mx.arange(pool.shape[0], dtype=mx.int32)
            layout.write_pages(pool, every, "k_scales", read(layout, pool))
            return cuda_check.reference_packed_decode(q, k_new, v_new, pool, layout, bits,
                                                      tables, ends, scale)
        return kernel

    for read in (lambda layout, pool: layout.section(pool, "k_scales")[..., ::-1],
                 lambda layout, pool: layout.section(pool, "k_offsets")):
        case = cuda_check.packed_case(rng, "int4", 2, 16, 4, 128, 300, kernel=wrong(read))
        assert not case["ok"]


def test_kernel_pool_check():
    """The kernels' host side refuses a pool whose layout their CUDA addressing would misread."""
    import mlx.core as mx

    from engine.attention.cuda.tile_helpers import check_pool, kernel_layout
    from engine.kv.page_layout import PageLayout

    layout = kernel_layout(16, 4, 128, 4, 4)
    check_pool(layout.zeros(3), layout, 128, 4, 4, 4)
    k32 = PageLayout.for_format(16, 4, 128, 4, 4, 32, 64)   # 32-channel key groups
    bad = (  # (pool, layout, head dim, bits, KV heads)
        (layout.zeros(3), layout, 128, 8, 4),                 # other bits than the layout's
        (layout.zeros(3), layout, 128, 4, 2),                 # other heads than the rows'
        (mx.zeros((3, layout.page_words), mx.float32), layout, 128, 4, 4),
        (layout.zeros(3)[:, 1:], layout, 128, 4, 4),
        (k32.zeros(3), k32, 128, 4, 4),
    )
    for pool, lay, d, bits, heads in bad:
        for vectors in (False, True):
            with pytest.raises(ValueError, match="packed kernel pool"):
                check_pool(pool, lay, d, bits, bits, heads, vectors)
    # 3-bit codes (no shipped format): 6-word code rows fall off the 16-byte grid, which only
    # the kernels reading sections by vectors (v2, prefill) refuse.
    odd = kernel_layout(16, 4, 64, 3, 3)
    check_pool(odd.zeros(2), odd, 64, 3, 3, 4, vectors=False)
    with pytest.raises(ValueError, match="alignment"):
        check_pool(odd.zeros(2), odd, 64, 3, 3, 4)


def test_device_check_write_harness():
    """bench.cuda_check's write case splits records by the layout's sections: the MLX record
    passes it, one with K scales and offsets swapped or codes off by one step does not."""
    import mlx.core as mx

    from engine.kv.page_layout import packed_record
    from engine.kv.quant import quantize
    from engine.kv.rotation import rotate

    def reference(k, v, kb, vb, layout):
        return packed_record(quantize(rotate(k), kb), quantize(v, vb))

    def swapped(k, v, kb, vb, layout):
        kq, vq = quantize(rotate(k), kb), quantize(v, vb)
        return packed_record(type(kq)(kq.codes, kq.offsets, kq.scales), vq)

    def shifted(k, v, kb, vb, layout):
        kq, vq = quantize(rotate(k), kb), quantize(v, vb)
        return packed_record(kq, type(vq)(vq.codes ^ mx.array(1, mx.uint32), *vq[1:]))

    rng = np.random.default_rng(4)
    for fmt, heads, d in (("int8", 3, 64), ("int4", 4, 128), ("k8v4", 4, 128)):
        case = cuda_check.write_case(rng, fmt, 37, heads, d, kernel=reference)
        assert case["ok"] and case["k_code_max_diff"] == 0 == case["v_code_max_diff"], case
        for wrong in (swapped, shifted):
            assert not cuda_check.write_case(rng, fmt, 37, heads, d, kernel=wrong)["ok"], fmt


def test_v2_kernel_formats_and_choice():
    from engine.attention.choices import KernelChoices
    from engine.attention.cuda import packed_decode_v2

    assert packed_decode_v2.supports(4, 4, 128, 4) and packed_decode_v2.supports(8, 8, 64, 8)
    assert not packed_decode_v2.supports(8, 4, 128, 4)    # k8v4 keeps the direct path
    assert not packed_decode_v2.supports(4, 4, 128, 9)    # past MAX_GROUP: v1 serves it
    assert KernelChoices().packed_decode == "v2"          # the default since the H200 run
    with pytest.raises(ValueError):
        KernelChoices(packed_decode="v3")


def test_bench_decode_format_suffixes_pick_the_kernel():
    from bench.kv_decode import decode_kernels
    from engine.attention.choices import KernelChoices

    base = KernelChoices(packed_decode="v2", decode_tiles=True)
    assert decode_kernels("int4", base) == ("int4", base)
    fmt, k = decode_kernels("int4:v2", KernelChoices())
    assert fmt == "int4" and k.packed_decode == "v2" and not k.decode_tiles
    fmt, k = decode_kernels("int8:split", base)
    assert fmt == "int8" and k.packed_decode == "v1" and not k.decode_tiles
    assert decode_kernels("int4:tiles", KernelChoices())[1].decode_tiles
    with pytest.raises(ValueError):
        decode_kernels("int4:v9", KernelChoices())


def test_device_check_kernel_filter(tmp_path):
    assert cuda_check.main(["--kernels", "packed-v2", "--out", str(tmp_path / "c.json")]) == 2
    with pytest.raises(SystemExit):
        cuda_check.main(["--kernels", "packed-v3"])


def test_v2_kernel_source_runs_on_cpu_fibers(tmp_path):
    """The tiled kernel's CUDA source itself (bench/cuda_emulate.py: one fiber per GPU thread,
    barriers and shuffles among them, cp.async done at its wait) against direct packed attention:
    several splits and the merge kernel, ragged rows, a row without history, GQA group 3.
    Needs g++ (part of every machine this project runs CI on: the emulator compiles with it)."""
    from bench import cuda_emulate

    assert shutil.which("g++"), "the CPU emulation of the CUDA kernel compiles with g++"

    rng = np.random.default_rng(3)
    for fmt, rows, hq, kvh, d, longest in (("int4", 3, 16, 4, 128, 600),
                                           ("int8", 2, 9, 3, 64, 700)):
        def kernel(*args):
            return cuda_emulate.packed_decode_v2(*args, workdir=tmp_path)
        case = cuda_check.packed_case(rng, fmt, rows, hq, kvh, d, longest, kernel=kernel)
        assert case["ok"] and case["max_abs_err"] < 0.01, case
    assert cuda_paged_decode.split_count(3, 4, 600) > 1   # the merge ran too


def test_native_kernel_writes_its_own_key_in_place_on_cpu_fibers(tmp_path):
    """The native kernel's OWN variant (cuda/paged_decode.py) on the emulator: it attends to the
    step's own key from its inputs and writes it, and only it, into the row's page slot. Rows:
    one with no history, one whose own key opens a page, one long enough to split (the own key
    in the last split), pages interleaved; the slots start poisoned, so attending to the slot
    instead of the input shows. The plain kernel over pages that already hold the key (the
    scatter path) gives the same output, bit for bit."""
    from bench import cuda_emulate_inplace

    assert shutil.which("g++"), "the CPU emulation of the CUDA kernel compiles with g++"
    rng = np.random.default_rng(11)
    hq, kvh, d, pt = 9, 3, 64, 16
    c = cuda_emulate_inplace.own_key_pages(rng, [600, 1, 33], hq, kvh, d, pt)
    q, tables, ends = c["q"], c["tables"], c["ends"]
    written_k, written_v = c["written_k"], c["written_v"]
    assert cuda_paged_decode.split_count(len(ends), kvh, int(ends.max())) > 1
    scale = d ** -0.5
    out, k_after, v_after = cuda_emulate_inplace.native_decode(
        q, c["k_pages"], c["v_pages"], tables, ends, scale, own=(c["kn"], c["vn"]),
        workdir=tmp_path)
    assert np.array_equal(k_after, written_k) and np.array_equal(v_after, written_v)
    plain, k_same, _ = cuda_emulate_inplace.native_decode(q, written_k, written_v, tables, ends,
                                                          scale, workdir=tmp_path)
    assert np.array_equal(k_same, written_k)   # the plain kernel writes nothing
    assert np.array_equal(out, plain)   # same sums in the same order: bit-identical
    ref = cuda_emulate_inplace.reference(q, written_k, written_v, tables, ends, scale)
    assert np.abs(out - ref).max() < 0.02 and np.abs(plain - ref).max() < 0.02


def test_v1_kernel_source_runs_on_cpu_fibers(tmp_path):
    """The v1 kernel's source on the same emulator: its pool reads (word by word, no vectors)
    against direct packed attention, with splits and a ragged batch."""
    from bench import cuda_emulate

    assert shutil.which("g++"), "the CPU emulation of the CUDA kernel compiles with g++"

    rng = np.random.default_rng(5)
    for fmt, rows, hq, kvh, d, longest in (("int4", 2, 16, 4, 128, 700),
                                           ("int8", 2, 9, 3, 64, 200)):
        def kernel(*args):
            return cuda_emulate.packed_decode(*args, workdir=tmp_path, version="v1")
        case = cuda_check.packed_case(rng, fmt, rows, hq, kvh, d, longest, kernel=kernel)
        assert case["ok"] and case["max_abs_err"] < 0.01, case
    assert cuda_paged_decode.split_count(2, 4, 700) > 1   # the merge ran too


def test_write_kernel_source_runs_on_cpu_fibers(tmp_path):
    """The write kernel's source on the emulator: the pool records it emits for int8, int4 and
    k8v4 rows (head dims 64 and 128, several heads, a last block with idle warps) match
    packed_record(quantize(rotate(k)), quantize(v)) section by section (device check's rule)."""
    from bench import cuda_emulate

    assert shutil.which("g++"), "the CPU emulation of the CUDA kernel compiles with g++"

    def kernel(*args):
        return cuda_emulate.packed_write(*args, workdir=tmp_path)

    rng = np.random.default_rng(7)
    for fmt, rows, heads, d in (("int8", 3, 2, 64), ("int4", 5, 3, 128), ("k8v4", 2, 4, 128)):
        case = cuda_check.write_case(rng, fmt, rows, heads, d, kernel=kernel)
        assert case["ok"], case


def test_write_kernel_in_place_variant_writes_exactly_the_records(tmp_path):
    """The write kernel's in-place variant on the emulator: the pool it leaves equals the record
    kernel's records scattered by page_layout (the path it replaces), word for word, for int8,
    int4 and k8v4, rows at scattered pages and offsets; every other word is untouched."""
    import mlx.core as mx

    from bench import cuda_emulate, cuda_emulate_inplace
    from capacity.formats import KVFormat
    from engine.attention.cuda.tile_helpers import kernel_layout

    assert shutil.which("g++"), "the CPU emulation of the CUDA kernel compiles with g++"
    rng = np.random.default_rng(13)
    for fmt_name, rows, heads, d in (("int8", 3, 2, 64), ("int4", 4, 3, 128),
                                     ("k8v4", 2, 4, 128)):
        fmt = KVFormat(fmt_name, d, "bfloat16")
        layout = kernel_layout(16, heads, d, fmt.k_bits, fmt.v_bits)
        k, v = (mx.array(rng.standard_normal((rows, heads, d)).astype(np.float32))
                .astype(mx.bfloat16) for _ in range(2))
        pool = rng.integers(0, 2**32, (6, layout.page_words), dtype=np.uint32)
        slot = np.array([[5, 15], [0, 0], [3, 7], [1, 9]][:rows], np.int32)
        got = cuda_emulate_inplace.packed_write_in_place(k, v, fmt.k_bits, fmt.v_bits, layout,
                                                         pool, slot, workdir=tmp_path)
        records = cuda_emulate.packed_write(k, v, fmt.k_bits, fmt.v_bits, layout,
                                            workdir=tmp_path)
        want = mx.array(pool)
        layout.write_rows(want, layout.row_index(mx.array(slot[:, 0]), mx.array(slot[:, 1])),
                          records)
        assert np.array_equal(got, np.array(want)), fmt_name


def test_device_check_counts_nan_as_a_failure():
    """A kernel output with a NaN fails its case (max() alone would skip the NaN)."""
    rng = np.random.default_rng(6)

    def nan_kernel(*args):
        out = cuda_check.reference_packed_decode(*args)
        out[0, 0, 0, 0] = np.nan
        return out

    case = cuda_check.packed_case(rng, "int8", 2, 9, 3, 64, 50, kernel=nan_kernel)
    assert not case["ok"]


def test_kernel_timing_bench_flow(tmp_path, monkeypatch):
    """bench.decode_kernels (kernel-only timing) on CPU: no device, exit 2; with the kernels
    stubbed, every case and kernel gets a time and a ratio to native."""
    import json

    import mlx.core as mx

    from bench import decode_kernels

    out = tmp_path / "k.json"
    assert decode_kernels.main(["--out", str(out)]) == 2
    calls = []

    def fake(q, *args, **kwargs):
        calls.append(kwargs.get("version", "native"))
        return mx.zeros(q.shape, q.dtype)

    monkeypatch.setattr(cuda_paged_decode, "available", lambda: True)
    monkeypatch.setattr(cuda_paged_decode, "paged_decode_attention", fake)
    monkeypatch.setattr(cuda_packed_decode, "packed_decode_attention", fake)
    assert decode_kernels.main(["--contexts", "100", "--batches", "1,2", "--layers", "2",
                                "--rounds", "2", "--out", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert set(cases) == {"ctx100-b1", "ctx100-b2"}
    for row in cases.values():
        assert set(row) == {"native", "int4:v1", "int4:v2", "int8:v1", "int8:v2"}
        assert all("speed_vs_native" in r for r in row.values()), row
    assert {"native", "v1", "v2"} <= set(calls)


def test_v2_kernel_own_variant_stores_the_write_kernels_records(tmp_path):
    """The v2 kernel's OWN variant (it stores the step's own rows into the pool itself, so a
    decode step launches no write kernel) on the emulator: its output equals the plain kernel's
    bit for bit, and the pool it leaves equals the write kernel's in-place variant applied to
    the same pool (one quantizer: the same words at the same slot, nothing else touched).
    Rows: a long one (several splits; the own key in its last), one without history, one whose
    own key opens a page; int4 at head dim 128 and int8 at 64."""
    from bench import cuda_emulate, cuda_emulate_inplace
    from bench.decode_kernels import _case_inputs

    assert shutil.which("g++"), "the CPU emulation of the CUDA kernel compiles with g++"
    rng = np.random.default_rng(17)
    pt = 16
    for bits, hq, kvh, d in ((4, 16, 4, 128), (8, 9, 3, 64)):
        q, k_new, v_new, _, pool_of, tables, _ = _case_inputs(rng, 3, 600, hq, kvh, d, pt)
        pool, layout = pool_of(bits)
        tables, before = np.array(tables), np.array(pool)
        ends = np.array([600, 1, 33], np.int32)
        assert cuda_paged_decode.split_count(3, kvh, 600) > 1
        args = (q, k_new, v_new, pool, layout, bits, tables, ends, d ** -0.5)
        plain = cuda_emulate.packed_decode(*args, workdir=tmp_path)
        out, pool_after = cuda_emulate.packed_decode(*args, workdir=tmp_path, own=True)
        assert np.array_equal(out, plain), bits
        slot = np.array([[tables[b, (n - 1) // pt], (n - 1) % pt] for b, n in enumerate(ends)],
                        np.int32)
        want = cuda_emulate_inplace.packed_write_in_place(
            k_new[:, :, 0], v_new[:, :, 0], bits, bits, layout, before, slot, workdir=tmp_path)
        assert not np.array_equal(want, before)   # the slots did change
        assert np.array_equal(pool_after, want), bits
