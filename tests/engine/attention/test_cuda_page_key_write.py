"""The page-key write kernel (engine/attention/cuda/page_key_write.py) without a GPU: its source
on the CPU emulator (bench/cuda_emulate_page_keys.py) against the store's MLX decode write
(page_key_store `_write_planned`) step after step, byte for byte; the same check with the source
broken on purpose; a compiled step's body with both kernels emulated against the MLX path; a
compiled step through the kernel's contract in MLX ops; and nvcc.

Needs g++ (the emulator compiles the kernel body with it)."""
import shutil
import types

import mlx.core as mx
import numpy as np
import pytest

from bench import cuda_emulate_page_keys as emu
from bench import cuda_nvcc_check
from capacity.formats import KVFormat
from engine.attention.choices import KernelChoices
from engine.attention.cuda import page_key_decode as cuda_page_key_decode
from engine.attention.cuda import page_key_write, page_key_write_row
from engine.attention.cuda import paged_decode as cuda_paged_decode
from engine.kv.page_key_store import PageKeyStore
from engine.kv.page_layout import K_SECTIONS
from engine.kv.page_quant import meta_rows, quantize_pages
from engine.kv.quant import quantize
from engine.kv.store import Slots
from engine.kv.tails import TailMap
from engine.model.loader import LayerGeometry, load_model
from engine.runner.compiled_decode import DeviceSlots
from engine.runner.packed import PackedModelRunner
from engine.sched.seq import Chunk
from tests.engine.attention.test_cuda_page_key_decode import _emulate_the_kernel, _mlx_kernel
from tests.engine.kv.tail_helpers import T, llama, tail_store  # noqa: F401 (fixture)

FORMATS = ["k6v4-kivi", "int4-kivi"]


def _stores(fmt, d, kvh, t, hist, dtype, seed=3):
    """Two identical page-key stores (the MLX write's and the kernel's): rows of hist[b] tokens
    written by the host path, each row's table with room for a few more pages."""
    rng = np.random.default_rng(seed)
    need = [h // t + 3 for h in hist]
    ids = rng.permutation(sum(need) + 2).astype(np.int32)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n])
        at += n
    wide = np.ones(d, np.float32)
    wide[rng.choice(d, 3, replace=False)] = 8.0   # a few wide key channels
    rows = [(rng.standard_normal((h, kvh, d)) * wide, rng.standard_normal((h, kvh, d)))
            for h in hist]
    out = []
    for _ in range(2):
        store = PageKeyStore(LayerGeometry(0, "full", kvh, d, d),
                             KVFormat(fmt, d, str(dtype).removeprefix("mlx.core."),
                                      page_tokens=t), len(ids), t, tails=TailMap(len(hist), t))
        for table, h, (k, v) in zip(tables, hist, rows):
            if h:
                pos = np.arange(h)
                store.write(Slots(table[pos // t], pos % t), mx.array(k).astype(dtype),
                            mx.array(v).astype(dtype))
                store.flush_tail()
        out.append(store)
    return out, tables, rng, wide


def _mutated(mutation):
    """(module attribute, broken text) for a mutation (old, new) of the write's CUDA text: the
    kernel body or the per-row device function, whichever holds `old` (exactly once)."""
    old, new = mutation
    for module, name in ((page_key_write, "_SOURCE"), (page_key_write_row, "WRITE_ROW")):
        text = getattr(module, name)
        if old in text:
            assert text.count(old) == 1
            return module, name, text.replace(old, new)
    raise AssertionError(f"no kernel text holds {old!r}")


def _writer(workdir, mutation=None):
    """The kernel's module with its launch run on the emulator (`mutation`: (old, new) text,
    for a broken kernel); `modes` records each launch's `in_place`."""
    modes = []

    def write_decode(*args, in_place=True):
        modes.append(in_place)
        if mutation is None:
            return emu.page_key_write(*args, in_place=in_place, workdir=workdir)
        module, name, broken = _mutated(mutation)
        real = getattr(module, name)
        setattr(module, name, broken)
        try:
            return emu.page_key_write(*args, in_place=in_place, workdir=workdir)
        finally:
            setattr(module, name, real)
    return types.SimpleNamespace(serves=page_key_write.serves, write_decode=write_decode,
                                 modes=modes)


def _step(store, table_rows, pos, k, v, writer=None):
    """One decode write as a compiled step issues it (tails planned on the host), then the
    flush attention does; returns which pages it filled."""
    t = store.page_tokens
    page = np.array([tab[p // t] for tab, p in zip(table_rows, pos)], np.int32)
    offset = (np.asarray(pos) % t).astype(np.int32)
    before, write = store.tails.decode_slots(page, offset)
    slots = DeviceSlots(mx.array(page), mx.array(offset))
    slots.tail_before, slots.tail_write = mx.array(before), mx.array(write)
    slots.page_key_writer = writer
    store.write_decode(slots, k[:, :, None], v[:, :, None])
    store.flush_tail()
    mx.eval(store.pool, *store.tail)
    return page, offset, before, write


def _key_words(store, pages):
    """The key sections' words of `pages` (codes, scales, offsets), uint32."""
    return [np.array(store.layout.gather_pages(store.pool, mx.array(np.asarray(pages, np.int32)), n).view(mx.uint32))
            for n in K_SECTIONS]


def _compare(fmt, d, kvh, t, hist, dtype, steps, workdir, mutation=None):
    """Run `steps` decode steps through both writes (the kernel's tails in place, as compiled
    steps write them); returns the first difference (or None) and whether a new page started
    in a step where another row filled its page (the slot it gives back is not the one taken:
    TailMap.plan)."""
    (mlx_store, kernel_store), tables, rng, wide = _stores(fmt, d, kvh, t, hist, dtype)
    writer = _writer(workdir, mutation)
    pos, reused = list(hist), False
    for step in range(steps):
        k = mx.array(rng.standard_normal((len(hist), kvh, d)) * wide).astype(dtype)
        v = mx.array(rng.standard_normal((len(hist), kvh, d))).astype(dtype)
        keys_before = _key_words(kernel_store, [tab[p // t] for tab, p in zip(tables, pos)])
        page, offset, before, write = _step(mlx_store, tables, pos, k, v)
        _step(kernel_store, tables, pos, k, v, writer)
        fill = offset == t - 1
        assert not np.isin(write[offset == 0], before[fill]).any()   # never in a decode step
        reused |= bool(fill.any() and (offset == 0).any())
        for name, a, b in zip(("K tail", "V tail"), mlx_store.tail, kernel_store.tail):
            if not np.array_equal(np.array(a.view(mx.uint8)), np.array(b.view(mx.uint8))):
                return f"step {step}: {name}", reused
        # The MLX write re-keys every row's page each step; those interim codes are never read,
        # so a partial page must keep its key words and a filled one get the MLX path's.
        want = _key_words(mlx_store, page)
        for s, (w, old) in enumerate(zip(want, keys_before)):
            w[~fill] = old[~fill]
        got = _key_words(kernel_store, page)
        for name, a, b in zip(K_SECTIONS, want, got):
            if not np.array_equal(a, b):
                return f"step {step}: {name} of pages {page[(a != b).any(axis=(1, 2, 3))]}", reused
        # Everything else in the pool (value records included) byte for byte.
        pm, pk = np.array(mlx_store.pool), np.array(kernel_store.pool)
        lay = mlx_store.layout
        for n in K_SECTIONS:
            cols = slice(lay.offsets[n], lay.offsets[n] + t * kvh * lay.width(n))
            pm[:, cols] = pk[:, cols]
        if not np.array_equal(pm, pk):
            return f"step {step}: value records / other words", reused
        pos = [p + 1 for p in pos]
    return None, reused


# (head dim, KV heads, page tokens, history per row, steps): rows that fill their page in the
# steps run, one starting a new page in the step another fills its page, GQA layouts of 1-4 KV
# heads.
CASES = [(128, 2, 16, (15, 32, 7), 3), (64, 4, 32, (31, 64, 40), 2), (64, 1, 64, (63, 128), 2),
         (128, 1, 64, (62, 5), 3)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"d{c[0]}-h{c[1]}-pt{c[2]}")
def test_kernel_source_writes_what_the_mlx_write_does(fmt, case, tmp_path):
    """Tails, value records and the codes and metadata of every page filled are the MLX write's
    bytes, step after step (bf16 stores, as on the GPU; partial pages keep their old key
    words: the MLX write's interim codes there are never read)."""
    assert shutil.which("g++"), "the CPU emulation of the CUDA kernel compiles with g++"
    diff, reused = _compare(fmt, *case[:4], mx.bfloat16, case[4], tmp_path)
    assert diff is None, diff
    if case[2] == 16:
        assert reused   # a new page started in the step another row filled its page


def test_float32_stores(tmp_path):
    diff, _ = _compare("k6v4-kivi", 64, 2, 16, (15, 16, 9), mx.float32, 2, tmp_path)
    assert diff is None, diff


# Mutations the comparison must catch: a wrong offset, a fill skipped, a wrong section, a
# 6-bit straddle dropped, a tail row of slot 0 not written. (The copy of the tails as new arrays,
# which decode steps never take: test_cuda_page_key_chunk_write.py.)
BROKEN = [("const int pg = page[r], o = off[r];", "const int pg = page[r], o = off[r] ^ 1;"),
          ("if (o == PT - 1) {", "if (o == PT - 2) {"),
          ("pw[sec(m, KO_OFF, NGK)", "pw[sec(m, KS_OFF, NGK)"),
          (": (unsigned int)codes[c] >> -s;", ": 0u;"),
          ("if (slot >= 0) {", "if (slot > 0) {")]


@pytest.mark.parametrize("mutation", BROKEN, ids=lambda m: m[1][:24])
def test_a_broken_kernel_is_caught(mutation, tmp_path):
    diff, _ = _compare("k6v4-kivi", 64, 2, 16, (15, 32, 7), mx.bfloat16, 2, tmp_path, mutation)
    assert diff is not None


def _mlx_write(k, v, pool, layout, k_bits, tail, page, offset, tail_before, tail_write):
    """page_key_write.write_decode's contract in MLX ops (traceable): the value records; the
    key sections of a page only where its row fills it (chosen on the device); the tails as
    new arrays, the old ones left as they were."""
    from engine.kv.page_layout import V_SECTIONS, record
    t, n = layout.page_tokens, k.shape[0]
    layout.write_rows(pool, layout.row_index(page, offset, V_SECTIONS),
                      record(list(quantize(v, 4)), V_SECTIONS))
    rows = tail[0][mx.maximum(tail_before, 0)].astype(mx.float32)
    rows[mx.arange(n), offset] = k.astype(mx.float32)
    codes, scales, offsets = quantize_pages(rows.transpose(0, 2, 1, 3), k_bits)
    fill = (offset == t - 1)[:, None, None, None]
    for name, new in zip(K_SECTIONS, (codes.transpose(0, 2, 1, 3), meta_rows(scales, t),
                                      meta_rows(offsets, t))):
        old = layout.gather_pages(pool, page, name)
        layout.write_pages(pool, page, name, mx.where(fill, new.astype(old.dtype), old))
    out = []
    for a, x in zip(tail, (k, v)):
        a = mx.stop_gradient(a)   # a new array: the old one stays as attention read it
        a[tail_write, offset] = x.astype(a.dtype)
        out.append(a)
    return pool, tuple(out)


@pytest.mark.parametrize("fmt", FORMATS)
def test_compiled_steps_through_the_fused_write_match_uncompiled_ones(llama, fmt, monkeypatch):
    """KernelChoices.page_key_write (None: on for CUDA) in compiled steps, the kernel its
    contract in MLX ops: logits and full pages' codes equal uncompiled steps' across fills, a
    new page and a padded row bucket."""
    calls = []
    monkeypatch.setattr(cuda_paged_decode, "available", lambda: True)
    monkeypatch.setattr(cuda_page_key_decode, "page_key_decode_attention", _mlx_kernel)
    monkeypatch.setattr(page_key_write, "write_decode",
                        lambda *a, in_place=True: calls.append(in_place) or _mlx_write(*a))
    compiled = PackedModelRunner(llama, tail_store(llama, fmt),
                                 kernels=KernelChoices(page_key_kernel=True, page_key_write=None,
                                                       page_key_own_write=False))
    plain = PackedModelRunner(llama, tail_store(llama, fmt),
                              kernels=KernelChoices(page_key_kernel=True, compiled_decode=False))
    tables = [[5, 1, 3], [7, 2, 9], [11, 12, 13]]
    seqs = [list(range(3, 3 + T - 2)), list(range(40, 40 + T + 5)), list(range(60, 62))]
    for runner in (compiled, plain):
        runner.forward([Chunk(i, s, 0, t) for i, (s, t) in enumerate(zip(seqs, tables))])
    for step in range(12):   # row 0 fills page 0 at step 1, row 1 its page at step 10
        chunks = [Chunk(i, [7 + step], len(s) + step, t)
                  for i, (s, t) in enumerate(zip(seqs, tables))]
        got, want = compiled.forward(chunks), plain.forward(chunks)
        assert mx.abs(got - want).max().item() < 1e-5, step
    assert compiled.compiled.failure is None and calls   # traced through the fused write
    a, b = compiled.kvstore.layers[0], plain.kvstore.layers[0]
    for table, seq in zip(tables[:2], seqs[:2]):
        pages = mx.array([table[:(len(seq) + 12) // T]])
        assert mx.array_equal(a.gather_packed(pages).k.codes, b.gather_packed(pages).k.codes)


def test_a_step_whose_plan_reuses_a_slot_runs_uncompiled_and_the_next_compiles(
        llama, monkeypatch):
    """The traced write kernel writes tails in place; a decode step whose tail plan had to hand
    a given-back slot to a new page (no other free: here a third page holds one) runs
    uncompiled, without turning compiled steps off, and gives the uncompiled runner's logits."""
    calls = []
    monkeypatch.setattr(cuda_paged_decode, "available", lambda: True)
    monkeypatch.setattr(cuda_page_key_decode, "page_key_decode_attention", _mlx_kernel)
    monkeypatch.setattr(page_key_write, "write_decode",
                        lambda *a, in_place=True: calls.append(in_place) or _mlx_write(*a))
    kernels = KernelChoices(page_key_kernel=True, page_key_write=None,
                            page_key_own_write=False)
    compiled = PackedModelRunner(llama, tail_store(llama, "k6v4-kivi", slots=2), kernels=kernels)
    plain = PackedModelRunner(llama, tail_store(llama, "k6v4-kivi", slots=2),
                              kernels=KernelChoices(page_key_kernel=True, compiled_decode=False))
    tables = [[5, 1, 3], [7, 2, 9]]
    seqs = [list(range(3, 3 + 2 * T - 1)), list(range(40, 40 + T))]   # offsets T-1 and 0 next
    tails = compiled.kvstore.layers[0].tails
    for runner in (compiled, plain):
        runner.forward([Chunk(i, s, 0, t) for i, (s, t) in enumerate(zip(seqs, tables))])
    tails.claim(20)   # the only free slot: row 1's new page must take the one row 0 gives back
    for step in range(2):
        chunks = [Chunk(i, [7 + step], len(s) + step, t)
                  for i, (s, t) in enumerate(zip(seqs, tables))]
        got, want = compiled.forward(chunks), plain.forward(chunks)
        assert mx.abs(got - want).max().item() < 1e-5, step
        if step == 0:
            assert tails.reused and not calls and compiled.compiled is not None
            tails.release([20])
    assert calls and all(calls) and compiled.compiled.failure is None   # step 1: compiled


@pytest.mark.parametrize("fmt", FORMATS)
def test_compiled_step_body_through_both_emulated_kernels_matches_the_mlx_path(
        llama, fmt, monkeypatch, tmp_path):
    """A compiled step's body run eagerly (the emulator runs out of process, which a trace
    cannot): the page-key decode kernel and this write kernel on the emulator, across a page
    fill and a new page, against the MLX path's logits."""
    calls = []
    _emulate_the_kernel(monkeypatch, tmp_path, calls)
    writes = []
    monkeypatch.setattr(page_key_write, "write_decode", lambda *a, in_place=True: writes.append(
        np.array(a[7]).tolist()) or emu.page_key_write(*a, in_place=in_place, workdir=tmp_path))
    # the block-tiled decode kernel (fp32 throughout), so the bound stays tight for the write
    fused = PackedModelRunner(llama, tail_store(llama, fmt),
                              kernels=KernelChoices(page_key_kernel=True, page_key_write=None,
                                                    page_key_own_write=False,
                                                    page_key_warp_pages=False))
    plain = PackedModelRunner(llama, tail_store(llama, fmt),
                              kernels=KernelChoices(page_key_kernel=False))   # the MLX path
    fused.compiled._fn = fused.compiled._step   # the traced function's body, eagerly
    tables = [[5, 1, 3], [7, 2, 9]]
    seqs = [list(range(3, 3 + T - 3)), list(range(40, 40 + T + 2))]
    for runner in (fused, plain):
        runner.forward([Chunk(i, s, 0, t) for i, (s, t) in enumerate(zip(seqs, tables))])
    for step in range(4):   # row 0 fills page 0 at step 2 and starts page 1 at step 3
        chunks = [Chunk(i, [7 + step], len(s) + step, t)
                  for i, (s, t) in enumerate(zip(seqs, tables))]
        got, want = fused.forward(chunks), plain.forward(chunks)
        assert mx.abs(got - want).max().item() < 1e-3, step
    layers = len(fused.kvstore.layers)
    assert fused.compiled.failure is None and len(calls) == len(writes) == 4 * layers
    assert writes[2 * layers] == [T - 1, 4]   # the write that fills row 0's page


def test_both_kernels_get_row_contiguous_rows_at_batch_above_one(tiny_model_dirs, monkeypatch):
    """Each CUDA kernel copies a strided input first (ensure_row_contiguous); at batch > 1 the
    values are a slice of the fused q/k/v projection. The cache makes the step's rows
    contiguous once, so neither the write kernel nor the attention kernel copies them (an
    uncompiled step's body, both kernels their contracts in MLX ops)."""
    seen = []

    def attention(q, k_new, v_new, *args, **kw):
        seen.extend([k_new, v_new])
        return _mlx_kernel(q, k_new, v_new, *args, **kw)

    monkeypatch.setattr(cuda_paged_decode, "available", lambda: True)
    monkeypatch.setattr(cuda_page_key_decode, "page_key_decode_attention", attention)
    monkeypatch.setattr(page_key_write, "write_decode",
                        lambda *a, in_place=True: seen.extend(a[:2]) or _mlx_write(*a))
    fused = load_model(tiny_model_dirs["llama"], fuse=True)   # as the engine loads models
    runner = PackedModelRunner(fused, tail_store(fused, "k6v4-kivi"),
                               kernels=KernelChoices(page_key_kernel=True, page_key_write=None,
                                                     page_key_own_write=False))
    runner.compiled._fn = runner.compiled._step   # the compiled step's body, eagerly
    tables = [[5, 1, 3], [7, 2, 9], [11, 12, 13]]
    seqs = [list(range(3, 12)), list(range(40, 45)), list(range(60, 62))]
    runner.forward([Chunk(i, s, 0, t) for i, (s, t) in enumerate(zip(seqs, tables))])
    runner.forward([Chunk(i, [7], len(s), t) for i, (s, t) in enumerate(zip(seqs, tables))])
    assert len(seen) == 4 * len(runner.kvstore.layers)
    mx.eval(*seen)
    assert all(memoryview(a).c_contiguous for a in seen)


def test_choice_and_support():
    # On by default where CUDA runs (None), checked and timed on the H200; never without CUDA.
    assert KernelChoices().page_key_write is None
    assert page_key_write.chosen(KernelChoices()) is None   # no CUDA here
    assert page_key_write.chosen(KernelChoices(page_key_write=False)) is None
    assert page_key_write.supports(6, 4, 128, 16) and page_key_write.supports(4, 4, 64, 64)
    assert not page_key_write.supports(8, 8, 64, 16) and not page_key_write.supports(6, 4, 64, 8)


def test_nvcc_compiles_the_variants():
    code = cuda_nvcc_check.main(["--only", "page-key-write d128 k6 pt16"])
    assert code == (2 if shutil.which("nvcc") is None else 0)
