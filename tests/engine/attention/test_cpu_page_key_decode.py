"""Decode attention over page-key history through the Numba kernel
(engine/attention/cpu_page_key_decode.py) gives the MLX path's result and leaves the store as it
does, and the runner takes it for page-key decode rows on the CPU."""
from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

from capacity.formats import KVFormat
from engine.attention import cpu_decode, cpu_page_key_decode
from engine.attention.choices import KernelChoices
from engine.attention.packed_cache import PackedLayerCache
from engine.attention.paged import StepBatch
from engine.kv.page_key_store import PageKeyStore
from engine.kv.page_quant import _pack
from engine.kv.quant import pack_codes
from engine.kv.store import Slots
from engine.kv.tails import TailMap
from engine.model.loader import LayerGeometry, load_model
from engine.runner.packed import PackedModelRunner
from engine.sched.seq import Chunk
from tests.engine.kv.tail_helpers import T, tail_store

FORMATS = ["k6v4-kivi", "int4-kivi"]
ARCHS = ["llama", "qwen3", "gemma3_text", "gpt_oss"]


def _contexts(t):
    """Each row's history when it decodes, for pages of t tokens: none; a tail only; ending on a
    page boundary (two full pages, one); its own row filling its page (the slot that frees goes
    to a row starting a page this step: a tail written before attention reads it would show);
    full pages and a tail; many full pages and a short tail."""
    return (0, min(5, t - 1), 2 * t, t, 2 * t - 1, 3 * t + t // 2 - 1, 8 * t + 2)


def _store(fmt, contexts, kv_heads, head_dim, page_tokens, rng):
    """A float32 PageKeyStore holding `contexts[b]` tokens of history per row (each row written
    by one write, as a prefill: full pages coded on fill, the partial one in the native tail),
    on shuffled pages; keys with a few wide channels. Returns (store, page tables)."""
    t = page_tokens
    need = [c // t + 2 for c in contexts]   # history, the own row, one spare
    ids = rng.permutation(sum(need) + 3).astype(np.int32)
    store = PageKeyStore(LayerGeometry(0, "full", kv_heads, head_dim, head_dim),
                         KVFormat(fmt, head_dim, "float32", page_tokens=t), len(ids), t,
                         tails=TailMap(len(contexts) + 1, t))
    wide = np.ones(head_dim, np.float32)
    wide[rng.choice(head_dim, 3, replace=False)] = 8.0
    tables, at = [], 0
    for c, n in zip(contexts, need):
        table = ids[at:at + n]
        at += n
        tables.append(table.tolist())
        if c:
            pos = np.arange(c)
            k = rng.standard_normal((c, kv_heads, head_dim)).astype(np.float32) * wide
            v = rng.standard_normal((c, kv_heads, head_dim)).astype(np.float32)
            store.write(Slots(table[pos // t], pos % t), mx.array(k), mx.array(v))
            store.flush_tail()
    return store, tables


def _steps(fmt, contexts, q_heads, kv_heads, head_dim, page_tokens, cpu_decode, steps=2):
    """`steps` decode steps of every row through PackedLayerCache (write, then attend) on a
    fresh store; each step's attention output, and the store's arrays after."""
    rng = np.random.default_rng(3)
    store, tables = _store(fmt, contexts, kv_heads, head_dim, page_tokens, rng)
    outs = []
    for s in range(steps):
        b = len(contexts)
        q = mx.array(rng.standard_normal((b, q_heads, 1, head_dim)).astype(np.float32))
        k, v = (mx.array(rng.standard_normal((b, kv_heads, 1, head_dim)).astype(np.float32))
                for _ in range(2))
        step = StepBatch([Chunk(i, [1], c + s, table)
                          for i, (c, table) in enumerate(zip(contexts, tables))], page_tokens)
        step.cpu_decode = cpu_decode
        cache = PackedLayerCache(store, step, None, direct=True, in_place_decode=True)
        k, v = cache.update_and_fetch(k, v)
        outs.append(cache.attend(q, k, v, scale=head_dim ** -0.5))
        assert store._pending is None   # the step's tail rows went in after attention
        mx.eval(outs[-1])
    return outs, [np.array(a) for a in store.arrays()]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,page_tokens", [
    (9, 3, 64, 16),    # SmolLM2's heads
    (2, 2, 64, 16),    # no GQA
    (8, 1, 128, 32),   # one KV head for eight, two value groups per row
    (6, 2, 64, 64),    # pages as wide as a head
    (4, 2, 64, 4)])    # small pages: 16 key channels' metadata per stored row
def test_kernel_matches_the_mlx_path(fmt, q_heads, kv_heads, head_dim, page_tokens,
                                     monkeypatch):
    contexts = _contexts(page_tokens)
    calls = []
    real = cpu_page_key_decode.decode_attention
    monkeypatch.setattr(cpu_page_key_decode, "decode_attention",
                        lambda *args: calls.append(args[3].shape) or real(*args))
    got, got_arrays = _steps(fmt, contexts, q_heads, kv_heads, head_dim, page_tokens, True)
    want, want_arrays = _steps(fmt, contexts, q_heads, kv_heads, head_dim, page_tokens, False)
    # Both steps of the kernel's run took it; the MLX path's never did.
    assert calls == [(len(contexts), q_heads, 1, head_dim)] * 2
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == mx.float32
        assert mx.abs(a - b).max().item() <= 1e-5
    # The same pool and tails after (the step's tail rows written after attention read them).
    assert all(np.array_equal(a, b) for a, b in zip(got_arrays, want_arrays))


def test_a_split_call_equals_the_unsplit_one_and_the_worker_runs_part(monkeypatch):
    """From cpu_decode.SPLIT_MIN_ROWS rows a call runs its later rows on the parked worker
    thread, each row computed as unsplit (bit-identical)."""
    args = ("k6v4-kivi", _contexts(16), 9, 3, 64, 16, True)
    monkeypatch.setattr(cpu_decode, "SPLIT", False)
    whole, _ = _steps(*args)
    monkeypatch.setattr(cpu_decode, "SPLIT", True)
    real, threads = cpu_page_key_decode.cpu_worker.parked_worker(), []

    class Recording:
        def submit(self, fn, *a):
            return real.submit(lambda *b: (threads.append(threading.get_ident()), fn(*b)), *a)

    monkeypatch.setattr(cpu_page_key_decode.cpu_worker, "parked_worker", lambda: Recording())
    split, _ = _steps(*args)
    assert len(threads) == 2 and threading.get_ident() not in threads   # one per step
    assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(split, whole))


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_byte_parts_rebuild_the_stored_codes(bits):
    """The kernel's split of code bytes into low and high parts sums back to the codes the
    stores pack (page_quant's packing for page keys, quant's for values and 8 bits)."""
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 2 ** bits, (5, 128)).astype(np.uint32)
    words = (_pack(mx.array(codes), bits) if bits == 6 else pack_codes(mx.array(codes), bits))
    raw = np.array(words).view(np.uint8).astype(np.float32)
    split, chans = cpu_page_key_decode.byte_parts(bits, 128)
    high = np.floor(raw * split[0])
    low = raw - split[1] * high
    got = np.zeros(codes.shape, np.float32)
    for k in range(raw.shape[1]):
        got[:, chans[0, k]] += split[2, k] * low[:, k]
        got[:, chans[1, k]] += high[:, k]
    assert np.array_equal(got, codes.astype(np.float32))
    assert (low >= 0).all() and (low * split[2] <= 2 ** bits - 1).all()   # no part cancels


def _decode(runner, prompts, tables, steps):
    """Prefill each prompt, then `steps` decode steps of every row together (crossing page
    boundaries and fills); the decode steps' logits."""
    for i, (p, t) in enumerate(zip(prompts, tables)):
        runner.forward([Chunk(i, p, 0, t)])
    return [runner.forward([Chunk(i, [5 + s], len(p) + s, t)
                            for i, (p, t) in enumerate(zip(prompts, tables))])
            for s in range(steps)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", ARCHS)
def test_runner_decode_takes_the_kernel(tiny_model_dirs, arch, fmt, monkeypatch):
    lm = load_model(tiny_model_dirs[arch])
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, lm.geometry.vocab_size, n).tolist() for n in (2 * T - 3, 12, T)]
    tables = [[5, 1, 3], [7, 2, 9], [11, 4, 0]]
    new = PackedModelRunner(lm, tail_store(lm, fmt))
    old = PackedModelRunner(lm, tail_store(lm, fmt), kernels=KernelChoices(cpu_decode=False))
    assert new.cpu_decode and not old.cpu_decode   # the CPU suite, float32
    calls = []
    real = cpu_page_key_decode.decode_attention
    monkeypatch.setattr(cpu_page_key_decode, "decode_attention",
                        lambda store, step, view, q, *a: calls.append(q.shape)
                        or real(store, step, view, q, *a))
    got = _decode(new, prompts, tables, 6)   # row 0 fills its second page at step 2
    # Decode rows of page-key layers without sinks took it; gpt_oss's sinks never; prompts
    # (many tokens per row) never.
    packed = sum(s.packed for s in new.kvstore.layers.values())
    if arch == "gpt_oss":
        assert not calls
    else:
        assert len(calls) == 6 * packed and all(s[0] == 3 and s[2] == 1 for s in calls)
    ref = _decode(old, prompts, tables, 6)
    for a, b in zip(got, ref):
        assert mx.abs(a - b).max().item() <= 1e-4
        assert mx.array_equal(mx.argmax(a, axis=-1), mx.argmax(b, axis=-1))
