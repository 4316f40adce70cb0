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
from engine.attention.choices import DEFAULT_KERNELS, KernelChoices
from engine.attention.cuda import page_key_decode as cuda_page_key_decode
from engine.attention.cuda import paged_decode as cuda_paged_decode
from engine.attention.layers import packed_layer_factory
from engine.attention.packed_cache import PackedLayerCache
from engine.kv.store import KVStore
from engine.runner.packed import PackedModelRunner
from engine.sched.seq import Chunk
from tests.engine.kv.tail_helpers import T, llama, tail_store  # noqa: F401 (fixture)

FORMATS = ["k6v4-kivi", "int4-kivi"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_source_matches_the_dequantized_reference_on_cpu_fibers(fmt, tmp_path):
    """Ragged rows (one without history, partial tails, one ending on a page boundary), GQA
    groups 4, 8 (the most) and 3, head dims 64 and 128, pages of 16, 32 and 64 tokens, and
    several splits (the merge kernel) where a split starts at the first key of a native
    tail."""
    assert shutil.which("g++"), "the CPU emulation of the CUDA kernel compiles with g++"
    rng = np.random.default_rng(7)

    def kernel(*args):
        return emu.page_key_decode(*args, workdir=tmp_path)

    cases = [((300, 0, 77), 16, 4, 128, 16, 1),         # one split, a row with no history
             ((600, 64, 129), 16, 2, 64, 32, 16),        # 3 splits; 64: no tail at all
             ((512, 45), 9, 3, 64, 64, 64)]              # 9 splits; the tail starts a split
    for hist, hq, kvh, d, pt, target in cases:
        case = emu.page_key_case(rng, fmt, hist, hq, kvh, d, pt, kernel, target)
        assert case["ok"] and case["max_abs_err"] < emu.TOLERANCE, case
    layout = cuda_page_key_decode.kernel_layout(64, 3, 64, 6)
    assert cuda_page_key_decode.split_plan(layout, 2, 3, 513, True, (4, 2), 64, None)[1] == 9


# The kernel's variants on the emulator: name -> (page_key_decode's keywords, seed, cases of
# (history per row, hq, kvh, head dim, page tokens, split target)). The plain cases above run
# the default (16-byte key-code copies where rows allow: KernelChoices.page_key_wide_copies).
VARIANT_CASES = {
    # KernelChoices.page_key_mma: scores by mma.sync over fp16 keys and queries, its CPU twin
    # exchanging the warp's fragments as the PTX layout places them; GQA 4, 8 and 3 (heads
    # past G padded with zero queries), pages of 16-64 (of 32 and 64: warps of one page share
    # its scales), splits.
    "mma": ({"mma": True, "warp_pages": False}, 11, [((300, 0, 77), 16, 4, 128, 16, None),
                                                     ((600, 64, 129), 16, 2, 64, 32, 16),
                                                     ((512, 45), 9, 3, 64, 64, 64)]),
    # page_key_wide_copies off: key codes in 8-byte pieces, at the head dims where the default
    # takes 16 (6-bit keys at head dim 128, group <= 4) and where it cannot (head dim 64).
    "narrow-copies": ({"wide_copies": False, "warp_pages": False}, 17,
                      [((300, 0, 77), 16, 4, 128, 16, None),
                       ((600, 64, 129), 16, 2, 128, 32, 16),
                       ((200, 45), 9, 3, 64, 16, 1)]),   # one split
    # The block-tiled kernel at pages of 16 and 64 (KernelChoices.page_key_warp_pages off; the
    # plain cases above run the warp-page kernel there, the block-tiled one at 32).
    "block-tiled": ({"warp_pages": False}, 19, [((300, 0, 77), 16, 4, 128, 16, None),
                                                ((700, 47, 192), 9, 3, 64, 16, 16),
                                                ((512, 45), 9, 3, 64, 64, 64)]),
    # KernelChoices.page_key_warp_pages: each warp its own pages, scores and PV by mma.sync;
    # GQA 4, 7 and 8, ragged rows, a row of no history, splits whose later warps get no page
    # and a split holding only the native tail; pages of 64 and 32 (16 keys at a time, the
    # page's key metadata buffered once).
    "warp-pages": ({"warp_pages": True}, 23, [((300, 0, 77), 16, 4, 128, 16, None),
                                              ((700, 64, 129), 14, 2, 128, 16, 16),
                                              ((200, 45), 16, 2, 64, 16, 1),
                                              ((700, 64, 129), 14, 2, 128, 64, 16),
                                              ((300, 45), 8, 2, 64, 32, None)]),
    # ... with 2 warps a block and 3 copy stages a warp (wait_group 1: a page read before its
    # group landed reads stale data on the emulator too), and 1 warp with 4 stages (at pages
    # of 32: three key metadata buffers).
    "warp-pages-2x3": ({"warp_pages": True, "warp_shape": (2, 3)}, 29,
                       [((300, 0, 77), 16, 4, 128, 16, None),
                        ((700, 64, 129), 14, 2, 128, 16, 16),
                        ((600, 45), 16, 2, 128, 64, 16)]),
    "warp-pages-1x4": ({"warp_pages": True, "warp_shape": (1, 4)}, 31,
                       [((300, 0, 77), 16, 4, 128, 16, None),
                        ((200, 45), 16, 2, 64, 16, 1),
                        ((400, 33), 16, 2, 128, 32, None)]),
}


@pytest.mark.parametrize("variant", sorted(VARIANT_CASES))
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_variants_match_the_reference_on_cpu_fibers(fmt, variant, tmp_path):
    kwargs, seed, cases = VARIANT_CASES[variant]
    rng = np.random.default_rng(seed)

    def kernel(*args):
        return emu.page_key_decode(*args, workdir=tmp_path, **kwargs)

    for hist, hq, kvh, d, pt, target in cases:
        case = emu.page_key_case(rng, fmt, hist, hq, kvh, d, pt, kernel, target)
        assert case["ok"] and case["max_abs_err"] < emu.TOLERANCE, case


def test_the_cpu_mma_twin_follows_the_ptx_fragment_layout(tmp_path):
    """The emulator's orch_mma_f16 against numpy: each lane loads A (16 x 16) and B (16 x 8)
    fragments by the PTX ISA's formulas for mma.m16n8k16 (.row.col, f16: "Matrix Fragments for
    mma.m16n8k16 with floating point type"), written out here apart from the twin, and stores
    D by the accumulators' formula; fp16-exact inputs, so the sums must match exactly."""
    from bench import cuda_emulate as ce
    from engine.attention.cuda.tile_helpers import HELPERS
    source = """
const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
unsigned int a[4], b[2];
for (int i = 0; i < 4; ++i) {        // a[i] holds elements 2i, 2i + 1
  const int row = g + ((i & 1) ? 8 : 0), col = 2 * t + ((i & 2) ? 8 : 0);
  a[i] = orch_half2(A[row * 16 + col], A[row * 16 + col + 1]);
}
for (int i = 0; i < 2; ++i) {
  const int k = 2 * t + (i ? 8 : 0);
  b[i] = orch_half2(B[k * 8 + g], B[(k + 1) * 8 + g]);
}
float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
orch_mma_f16(d, a, b);
for (int i = 0; i < 4; ++i) D[(g + (i >= 2 ? 8 : 0)) * 8 + 2 * t + (i & 1)] = d[i];
"""
    rng = np.random.default_rng(3)
    a = rng.integers(-8, 9, (16, 16)).astype(np.float32) / 4
    b = rng.integers(-8, 9, (16, 8)).astype(np.float32) / 4
    (got,) = ce.run("mma_layout", [("A", "float32"), ("B", "float32")], [("D", "float32")],
                    source, HELPERS, [], [a, b], [(16, 8)], (1, 1), 32, tmp_path)
    assert np.array_equal(got, a @ b)


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
    assert KernelChoices().page_key_kernel is None    # on for CUDA (measured on the H200)


def test_warp_pages_serve_pages_of_16_to_64_and_refuse_shapes_past_shared_memory():
    # on by default (device run 14, H100); a shape whose stages pass 48 KB is refused before
    # any launch, so it needs no GPU here
    assert KernelChoices().page_key_warp_pages and KernelChoices().page_key_warp_shape == (4, 2)
    # taken at the page sizes timed on a GPU (16, 64), never with the choice off
    assert [KernelChoices().page_key_warp_at(t) for t in (16, 32, 64)] == [True, False, True]
    assert not KernelChoices(page_key_warp_pages=False).page_key_warp_at(64)
    rng = np.random.default_rng(5)
    store, tables, slots = emu.page_key_store(rng, "k6v4-kivi", (40,), 2, 128, 16)
    wide, _, _ = emu.page_key_store(rng, "k6v4-kivi", (40,), 2, 128, 32)
    assert cuda_page_key_decode.warp_pages_serve(store.layout)
    assert cuda_page_key_decode.warp_pages_serve(wide.layout)      # 32: it reads 16, 32, 64
    q, kn = mx.zeros((1, 8, 1, 128), mx.bfloat16), mx.zeros((1, 2, 1, 128), mx.bfloat16)
    for shape in ((4, 3), (3, 2), (2, 1)):
        with pytest.raises(ValueError, match="at most 8 stages"):
            cuda_page_key_decode.page_key_decode_attention(
                q, kn, kn, store.pool, store.layout, 6, store.tail, mx.array(tables),
                mx.array([41], mx.int32), mx.array(slots), 41, 0.1, warp_pages=True,
                warp_shape=shape)


def test_page_key_split_plan_floors_at_one_tile_where_the_target_asks_more():
    # Batch 1 at 4K keys, 4 KV heads: the target (528 blocks) wants 132 splits a head; the
    # floor of 64 keys (MIN_KEYS, device run 16) would give 65 and MAX_SPLITS caps it at 64;
    # paged_decode's 256 gave 17.
    layout = cuda_page_key_decode.kernel_layout(64, 4, 128, 6)
    plan = cuda_page_key_decode.split_plan
    assert plan(layout, 1, 4, 4097, True, (4, 2), None, None) == (True, 64)
    assert plan(layout, 1, 4, 4097, True, (4, 2), None, 256) == (True, 17)   # the choice's
    assert cuda_paged_decode.split_count(1, 4, 4097) == 17                   # native's floor
    # Where the target sets the plan (batch 8, 4K-32K) the floor changes nothing.
    for keys in (4097, 32769):
        assert plan(layout, 8, 4, keys, True, (4, 2), None, None) == (True, 17)
        assert plan(layout, 8, 4, keys, True, (4, 2), None, 256) == (True, 17)
    # The block-tiled kernel (pages of 32 by default) takes the same floor.
    tiled = cuda_page_key_decode.kernel_layout(32, 4, 128, 6)
    assert plan(tiled, 1, 4, 4097, False, (4, 2), None, None) == (False, 64)


def _emulate_the_kernel(monkeypatch, workdir, calls=None, modes=None):
    """Route page_key_decode_attention to the kernel source on the CPU emulator (float32, as
    the store holds it), with CUDA reported available; `calls` collects each call's tail
    slots, `modes` whether it asked for the tensor-core score pass."""
    modes = [] if modes is None else modes
    def emulated(q, k_new, v_new, pool, layout, k_bits, tail, pages, ends, tail_slots,
                 longest, scale, target_blocks=None, min_keys=None, tail_write=None, mma=False,
                 wide_copies=True, warp_pages=False, warp_shape=(4, 2)):
        assert tail_write is None   # the OWN variant: test_cuda_page_key_own_write.py
        if calls is not None:
            calls.append(np.array(tail_slots).tolist())
            modes.append((mma, warp_pages))
        out = emu.page_key_decode(q, k_new, v_new, pool, layout, k_bits, tail,
                                  np.array(pages), np.array(ends), np.array(tail_slots),
                                  scale, target_blocks, workdir=workdir, mma=mma,
                                  wide_copies=wide_copies, warp_pages=warp_pages,
                                  warp_shape=warp_shape)
        return mx.array(out).astype(q.dtype)

    monkeypatch.setattr(cuda_paged_decode, "available", lambda: True)
    monkeypatch.setattr(cuda_page_key_decode, "page_key_decode_attention", emulated)


def _decode_side_by_side(kernel, plain, tables, prompts, steps, bound):
    """Prefill rows of `prompts` tokens into both runners, then `steps` decode steps; each
    step's logits from the kernel's runner within `bound` of the MLX path's."""
    seqs = [list(range(3 + 37 * i, 3 + 37 * i + n)) for i, n in enumerate(prompts)]
    for runner in (kernel, plain):
        runner.forward([Chunk(i, s, 0, t) for i, (s, t) in enumerate(zip(seqs, tables))])
    for step in range(steps):
        chunks = [Chunk(i, [7 + step], len(s) + step, t)
                  for i, (s, t) in enumerate(zip(seqs, tables))]
        got, want = kernel.forward(chunks), plain.forward(chunks)
        assert mx.abs(got - want).max().item() < bound, step


@pytest.mark.parametrize("fmt,mma,warp", [("k6v4-kivi", False, False),
                                          ("int4-kivi", False, False),
                                          ("k6v4-kivi", True, False), ("k6v4-kivi", False, True)])
def test_runner_decode_steps_through_the_kernel_match_the_mlx_path(llama, fmt, mma, warp,
                                                                    monkeypatch, tmp_path):
    """A runner with KernelChoices.page_key_kernel on CUDA (here: `available` patched, the
    kernel run on the emulator in float32 as the store holds it) sends every decode step of a
    page-key layer to the kernel with the right pages, ends and tail slots (as each step began),
    across a page fill, and its logits equal the MLX path's; with page_key_mma, through the
    tensor-core score pass (fp16 operands: a looser bound); with page_key_warp_pages,
    through the warp-page kernel (fp16 scores and PV: the same bound)."""
    calls, modes = [], []
    _emulate_the_kernel(monkeypatch, tmp_path, calls, modes)
    # Uncompiled steps: the emulator runs the kernel out of process, which a trace cannot
    # (compiled steps: test_compiled_decode_steps_over_page_keys_match_uncompiled_ones).
    kernel = PackedModelRunner(llama, tail_store(llama, fmt),
                               kernels=KernelChoices(page_key_kernel=True, compiled_decode=False,
                                                     page_key_mma=mma,
                                                     page_key_warp_pages=warp))
    plain = PackedModelRunner(llama, tail_store(llama, fmt),
                              kernels=KernelChoices(page_key_kernel=False))   # the MLX path
    assert kernel.kernel_decode and kernel.compiled is None
    assert not plain.kernel_decode and plain.compiled is None
    assert PackedLayerCache.kernel_decode_fits(kernel.kvstore.layers[0],
                                               KernelChoices(page_key_kernel=None))
    # row 0 fills its second page at step 3
    _decode_side_by_side(kernel, plain, [[5, 1, 3], [7, 2, 9]], [2 * T - 4, T + 5], 6,
                         1e-2 if mma or warp else 1e-3)
    layers = len(kernel.kvstore.layers)
    assert len(calls) == 6 * layers and modes == [(mma, warp)] * len(calls)
    assert all(-1 not in c for c in calls[:3 * layers])   # both rows had a partial page
    assert calls[4 * layers][0] == -1                     # row 0's page filled: no tail yet


@pytest.mark.parametrize("warp_sizes,warp", [(DEFAULT_KERNELS.page_key_warp_page_tokens,
                                              64 in DEFAULT_KERNELS.page_key_warp_page_tokens),
                                             ((16, 32, 64), True), ((16,), False)])
def test_the_engine_takes_the_warp_kernel_at_the_page_sizes_its_choice_names(
        llama, warp_sizes, warp, monkeypatch, tmp_path):
    """At pages of 64 (the engine's default page) the runner asks for the warp-page kernel only
    where KernelChoices.page_key_warp_page_tokens names 64, and either kernel's logits (the
    kernel emulated) match the MLX path's across a page fill."""
    calls, modes = [], []
    _emulate_the_kernel(monkeypatch, tmp_path, calls, modes)

    def store():
        return KVStore(llama.geometry, 8, 64, llama.dtype,
                       layer_factory=packed_layer_factory("k6v4-kivi", tail_slots=2))
    kernel = PackedModelRunner(llama, store(), kernels=KernelChoices(
        page_key_kernel=True, compiled_decode=False, page_key_warp_page_tokens=warp_sizes))
    plain = PackedModelRunner(llama, store(), kernels=KernelChoices(page_key_kernel=False))
    # row 0 fills its second page at step 1
    _decode_side_by_side(kernel, plain, [[5, 1, 3], [7, 2, 6]], [126, 70], 3,
                         1e-2 if warp else 1e-3)
    assert calls and modes == [(False, warp)] * len(calls)


def test_device_check_runs_on_cpu_fibers(llama, monkeypatch, tmp_path):
    """bench/device/page_key_kernel_check.py (the device bench's kernel check) with the kernel
    emulated: its engine-path calls (PackedLayerCache.attend, kernel and tiled) agree with the
    reference, and its engine step routes to the kernel."""
    from bench.device import page_key_kernel_check
    _emulate_the_kernel(monkeypatch, tmp_path)
    geometry = dict(num_attention_heads=6, num_key_value_heads=2, head_dim=64)
    got = page_key_kernel_check.attention_check(geometry, 100, 3, "k6v4-kivi", T)
    assert got["ok"] and got["tiled_vs_reference"] < 1e-2, got
    assert got["history"][0] == 99 and any(h % T for h in got["history"])
    logits = page_key_kernel_check.logits_check(llama, "int4-kivi", 40, 2)
    # the engine's kernel at pages of 16 is the warp-page one (fp16 scores and PV weights):
    # the tensor-core bound of test_runner_decode_steps_through_the_kernel_match_the_mlx_path
    bound = 1e-2 if DEFAULT_KERNELS.page_key_warp_pages else 1e-3
    assert logits["kernel_routed"] and logits["kernel_vs_tiled_logits"] < bound, logits


def _mlx_kernel(q, k_new, v_new, pool, layout, k_bits, tail, pages, ends, tail_slots, longest,
                scale, target_blocks=None, min_keys=None, tail_write=None, mma=False,
                wide_copies=True, warp_pages=False, warp_shape=(4, 2)):
    """page_key_decode_attention's contract in MLX ops (traceable, so a compiled step can run
    it on the CPU): full pages from the pool's codes, positions of the row's partial page from
    its tail slot, the own key last, one float32 softmax (not the OWN variant)."""
    assert tail_write is None
    from engine.kv.page_layout import K_SECTIONS, V_SECTIONS
    from engine.kv.page_quant import PagePacked, dequantize_pages, meta_pages
    from engine.kv.quant import Packed, dequantize
    b, hq, _, d = q.shape
    kvh, t, n = k_new.shape[1], layout.page_tokens, pages.shape[1] * layout.page_tokens
    keys = PagePacked(layout.gather(pool, pages, "k_codes"),
                      *(meta_pages(layout.gather_pages(pool, pages, s)) for s in K_SECTIONS[1:]))
    hist = (dequantize_pages(keys, k_bits),
            dequantize(Packed(*(layout.gather(pool, pages, s) for s in V_SECTIONS)), 4))
    pos = mx.arange(n)[None, :]
    nh = (ends - 1)[:, None]
    in_tail = ((pos >= nh // t * t) & (pos < nh))[:, None, :, None]
    own = (pos == nh)[:, None, :, None]
    at = mx.broadcast_to((pos % t)[:, None, :, None], (b, kvh, n, d))
    picked = []
    for h, pool_t, new in zip(hist, tail, (k_new, v_new)):
        rows = pool_t[mx.maximum(tail_slots, 0)].transpose(0, 2, 1, 3).astype(mx.float32)
        rows = mx.take_along_axis(rows, at % t, axis=2)
        picked.append(mx.where(own, new.astype(mx.float32),
                               mx.where(in_tail, rows, h.astype(mx.float32))))
    qg = q.astype(mx.float32).reshape(b, kvh, hq // kvh, d) * scale
    s = mx.where((pos <= nh)[:, None, None, :], qg @ picked[0].swapaxes(-1, -2), -1e30)
    out = mx.softmax(s, axis=-1, precise=True) @ picked[1]
    return out.reshape(b, hq, 1, d).astype(q.dtype)


@pytest.mark.parametrize("fmt", FORMATS)
def test_compiled_decode_steps_over_page_keys_match_uncompiled_ones(llama, fmt, monkeypatch):
    """With the kernel on, page-key decode steps compile (engine/runner/compiled_decode.py):
    the tail slots planned on the host per step and the page keyed on device every step give
    the uncompiled steps' logits and stores, across page fills, a new page, a padded row
    bucket (3 rows -> 4) and a row leaving; the kernel here is its contract in MLX ops."""
    monkeypatch.setattr(cuda_paged_decode, "available", lambda: True)
    monkeypatch.setattr(cuda_page_key_decode, "page_key_decode_attention", _mlx_kernel)
    # The store's MLX write (the fused CUDA write: test_cuda_page_key_write.py).
    compiled = PackedModelRunner(llama, tail_store(llama, fmt),
                                 kernels=KernelChoices(page_key_kernel=True, page_key_write=False))
    plain = PackedModelRunner(llama, tail_store(llama, fmt),
                              kernels=KernelChoices(page_key_kernel=True, compiled_decode=False))
    mlx_path = PackedModelRunner(llama, tail_store(llama, fmt))
    assert compiled.compiled is not None and plain.compiled is None
    tables = [[5, 1, 3], [7, 2, 9], [11, 12, 13]]
    seqs = [list(range(3, 3 + T - 2)), list(range(40, 40 + T + 5)), list(range(60, 60 + 2))]
    runners = (compiled, plain, mlx_path)
    for runner in runners:
        runner.forward([Chunk(i, s, 0, t) for i, (s, t) in enumerate(zip(seqs, tables))])
    for step in range(12):   # row 0 fills page 0 at step 1 and starts page 1 at step 2;
        rows = 3 if step < 8 else 2   # row 1 fills its page at step 10, after row 2 left
        chunks = [Chunk(i, [7 + step], len(s) + step, t)
                  for i, (s, t) in enumerate(zip(seqs[:rows], tables[:rows]))]
        got, want, ref = (r.forward(chunks) for r in runners)
        assert mx.abs(got - want).max().item() < 1e-5, step
        assert mx.abs(got - ref).max().item() < 1e-3, step
    assert compiled.compiled is not None and compiled.compiled.failure is None
    assert compiled.compiled.traces >= 2   # the 4-row bucket and the 2-row one
    a, b = compiled.kvstore.layers[0], plain.kvstore.layers[0]
    assert a.tails.slot_of == b.tails.slot_of
    mx.eval(a.pool, b.pool, *a.tail, *b.tail)
    for table, seq in zip(tables[:2], seqs[:2]):   # full pages' codes agree exactly
        full = (len(seq) + 12) // T
        pages = mx.array([table[:full]])
        assert mx.array_equal(a.gather_packed(pages).k.codes, b.gather_packed(pages).k.codes)


def test_nvcc_compiles_the_largest_variant():
    """The variant with the most shared memory (6-bit keys, head dim 128, pages of 16, group 8)
    compiles with nvcc where one is installed; without it the check says so (exit 2)."""
    code = cuda_nvcc_check.main(["--only", "page-key d128 k6 pt16 g8"])
    assert code == (2 if shutil.which("nvcc") is None else 0)
