"""The page-key decode kernel's OWN variant (engine/attention/cuda/page_key_decode.py,
`tail_write`: the kernel stores the step's own rows, KernelChoices.page_key_own_write) without a
GPU: on the CPU emulator against the write kernel followed by the plain decode kernel, step
after step across page fills and new pages, byte for byte (pool, tails) and output for output;
the same with the kernel's write call broken on purpose; and a runner whose compiled steps take
it (the compiled body run eagerly, the kernel emulated) against the MLX path.

Needs g++ (the emulator compiles the kernel body with it)."""
import shutil

import mlx.core as mx
import numpy as np
import pytest

from bench import cuda_emulate_page_keys as emu
from engine.attention.choices import KernelChoices
from engine.attention.cuda import page_key_decode as cuda_page_key_decode
from engine.attention.cuda import page_key_decode_source
from engine.attention.cuda import page_key_write
from engine.attention.cuda import paged_decode as cuda_paged_decode
from engine.runner.packed import PackedModelRunner
from engine.sched.seq import Chunk
from tests.engine.attention.test_cuda_page_key_write import _stores
from tests.engine.kv.tail_helpers import T, llama, tail_store  # noqa: F401 (fixture)


def _bytes(a):
    return np.array(a.view(mx.uint8))


def _compare(fmt, d, hq, kvh, t, hist, steps, workdir, target=None, source=None,
             warp_pages=False):
    """`steps` decode steps: store A through the write kernel then the plain decode kernel,
    store B through the OWN decode kernel (`source`: a broken one; `warp_pages`: both decodes
    through the warp-page kernel); the first difference."""
    (a, b), tables, rng, wide = _stores(fmt, d, kvh, t, hist, mx.bfloat16)
    width = max(len(tab) for tab in tables)
    table = np.array([np.pad(tab, (0, width - len(tab)), mode="edge") for tab in tables],
                     np.int32)
    pos = np.array(hist)
    for step in range(steps):
        q = mx.array(rng.standard_normal((len(hist), hq, 1, d))).astype(mx.bfloat16)
        k = mx.array(rng.standard_normal((len(hist), kvh, 1, d)) * wide).astype(mx.bfloat16)
        v = mx.array(rng.standard_normal((len(hist), kvh, 1, d))).astype(mx.bfloat16)
        page = table[np.arange(len(hist)), pos // t]
        offset = (pos % t).astype(np.int32)
        before, write = a.tails.decode_slots(page, offset)
        b.tails.decode_slots(page, offset)
        assert not a.tails.reused
        args = (a.layout, a.fmt.k_bits)
        want = emu.page_key_decode(q, k, v, a.pool, *args, a.tail, table, pos + 1, before,
                                   d ** -0.5, target, workdir=workdir, warp_pages=warp_pages)
        a.pool, a.tail = emu.page_key_write(k[:, :, 0], v[:, :, 0], a.pool, *args, a.tail,
                                            mx.array(page), mx.array(offset), mx.array(before),
                                            mx.array(write), workdir=workdir)
        real = page_key_decode_source._SOURCE
        page_key_decode_source._SOURCE = source or real
        try:
            got, b.pool, b.tail = emu.page_key_decode_own(
                q, k, v, b.pool, *args, b.tail, table, pos + 1, before, d ** -0.5, write,
                target, workdir=workdir, warp_pages=warp_pages)
        finally:
            page_key_decode_source._SOURCE = real
        if not np.array_equal(want, got):
            return f"step {step}: output"
        if not np.array_equal(np.array(a.pool), np.array(b.pool)):
            return f"step {step}: pool words"
        for name, x, y in zip(("K tail", "V tail"), a.tail, b.tail):
            if not np.array_equal(_bytes(x), _bytes(y)):
                return f"step {step}: {name}"
        pos = pos + 1
    return None


# (head dim, query heads, KV heads, page tokens, history per row, steps, split target): rows
# that fill their page, one starting a new page in the same step, several splits (only the
# first split's warp 0 writes), GQA groups of 4 and 8.
CASES = [(128, 8, 2, 16, (15, 32, 7), 3, None), (64, 8, 1, 64, (63, 128), 2, 16),
         (64, 8, 2, 32, (95, 31, 40), 2, 8)]


@pytest.mark.parametrize("fmt", ["k6v4-kivi", "int4-kivi"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"d{c[0]}-g{c[1] // c[2]}-pt{c[3]}")
def test_own_variant_writes_and_attends_as_write_kernel_then_decode(fmt, case, tmp_path):
    assert shutil.which("g++"), "the CPU emulation of the CUDA kernel compiles with g++"
    d, hq, kvh, t, hist, steps, target = case
    assert _compare(fmt, d, hq, kvh, t, hist, steps, tmp_path, target) is None


@pytest.mark.parametrize("fmt", ["k6v4-kivi", "int4-kivi"])
def test_warp_page_kernel_own_variant_writes_and_attends_as_write_then_decode(fmt, tmp_path):
    # the warp-page kernel runs the same OWN write: rows that fill their page, one starting a
    # new page, two splits; at pages of 16 and of 64 (the engine's default page)
    assert _compare(fmt, 128, 8, 2, 16, (15, 32, 7), 3, tmp_path, None,
                    warp_pages=True) is None
    assert _compare(fmt, 64, 8, 1, 16, (63, 130), 2, tmp_path, 16, warp_pages=True) is None
    assert _compare(fmt, 128, 8, 2, 64, (63, 128, 301), 2, tmp_path, 16,
                    warp_pages=True) is None


def test_a_kernel_that_skips_the_write_is_caught(tmp_path):
    old = "if (OWN && split == 0 && warp == 0) {"
    assert page_key_decode_source._SOURCE.count(old) == 1
    broken = page_key_decode_source._SOURCE.replace(old, "if (OWN && split == 1) {")
    assert _compare("k6v4-kivi", 128, 8, 2, 16, (15, 32, 7), 1, tmp_path, None,
                    broken) is not None


def test_compiled_steps_let_the_decode_kernel_store_their_rows(llama, monkeypatch, tmp_path):
    """KernelChoices.page_key_own_write on (CUDA reported available, the kernel emulated; the
    compiled step's body run eagerly): every layer's decode write goes through the decode
    kernel's launch (tail_write given), never the write kernel, and the logits match the MLX
    path's across a page fill and a new page."""
    launches, writes = [], []

    def attention(q, k_new, v_new, pool, layout, k_bits, tail, pages, ends, tail_slots,
                  longest, scale, target_blocks=None, min_keys=None, tail_write=None,
                  mma=False, wide_copies=True, warp_pages=False, warp_shape=(4, 2)):
        launches.append(tail_write is not None)
        if tail_write is None:
            return mx.array(emu.page_key_decode(
                q, k_new, v_new, pool, layout, k_bits, tail, np.array(pages), np.array(ends),
                np.array(tail_slots), scale, workdir=tmp_path,
                warp_pages=warp_pages)).astype(q.dtype)
        out, written, tails = emu.page_key_decode_own(
            q, k_new, v_new, pool, layout, k_bits, tail, np.array(pages), np.array(ends),
            np.array(tail_slots), scale, np.array(tail_write), workdir=tmp_path,
            warp_pages=warp_pages)
        pool[...] = written           # the kernel writes in place: so does its emulation
        for old, new in zip(tail, tails):
            old[...] = new
        return mx.array(out).astype(q.dtype)

    monkeypatch.setattr(cuda_paged_decode, "available", lambda: True)
    monkeypatch.setattr(cuda_page_key_decode, "page_key_decode_attention", attention)
    monkeypatch.setattr(page_key_write, "write_decode",
                        lambda *a, **kw: writes.append(1) or emu.page_key_write(*a, **kw))
    # the block-tiled decode kernel (fp32 throughout: a tight bound; the warp-page kernel's
    # OWN write: test_warp_page_kernel_own_variant_writes_and_attends_as_write_then_decode)
    own = PackedModelRunner(llama, tail_store(llama, "k6v4-kivi"), kernels=KernelChoices(
        page_key_kernel=True, page_key_write=None, page_key_own_write=True,
        page_key_warp_pages=False))
    plain = PackedModelRunner(llama, tail_store(llama, "k6v4-kivi"),
                              kernels=KernelChoices(page_key_kernel=False))   # the MLX path
    own.compiled._fn = own.compiled._step   # the traced function's body, eagerly
    tables = [[5, 1, 3], [7, 2, 9]]
    seqs = [list(range(3, 3 + T - 3)), list(range(40, 40 + T + 2))]
    for runner in (own, plain):
        runner.forward([Chunk(i, s, 0, t) for i, (s, t) in enumerate(zip(seqs, tables))])
    for step in range(4):   # row 0 fills page 0 at step 2 and starts page 1 at step 3
        chunks = [Chunk(i, [7 + step], len(s) + step, t)
                  for i, (s, t) in enumerate(zip(seqs, tables))]
        got, want = own.forward(chunks), plain.forward(chunks)
        assert mx.abs(got - want).max().item() < 1e-3, step
    assert own.compiled.failure is None and not writes
    assert launches == [True] * 4 * len(own.kvstore.layers)
    # Uncompiled steps plan their tails inside the store's write: never the OWN variant.
    launches.clear()
    uncompiled = PackedModelRunner(llama, tail_store(llama, "k6v4-kivi"), kernels=KernelChoices(
        page_key_kernel=True, page_key_own_write=True, compiled_decode=False))
    uncompiled.forward([Chunk(0, seqs[0], 0, tables[0])])
    uncompiled.forward([Chunk(0, [7], len(seqs[0]), tables[0])])
    assert launches and not any(launches)


def test_on_by_default_where_the_write_kernel_is():
    # Measured on the H100 (device run 11): bit-identical steps, 0.73x -> 0.85x native at 4K b1.
    assert KernelChoices().page_key_own_write is None
