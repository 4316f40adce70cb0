"""Page-key decode through MLX's quantized matmuls (engine/attention/page_qmm.py, on the CPU):
equal to the dequantized reference and to the existing path (page_scores), with GQA, batch > 1
and ragged page counts; the in-place gather_qmm shape (expert_attention) equal to the reference;
and through the tiny llama the same logits as the tiled path."""
from dataclasses import replace

import mlx.core as mx
import pytest

from capacity.formats import KVFormat
from engine.attention import page_qmm
from engine.attention.choices import DEFAULT_KERNELS
from engine.attention.layers import counters_of, packed_layer_factory
from engine.attention.packed import direct_attention
from engine.kv.page_quant import PagePacked, dequantize_pages, quantize_pages
from engine.kv.quant import PackedKV, dequantize, quantize
from engine.kv.store import KVStore
from engine.model.loader import load_model
from engine.runner.packed import PackedModelRunner
from engine.sched.seq import Chunk

FORMATS = {"k6v4-kivi": (6, 4), "int4-kivi": (4, 4)}


def _history(B, H, P, T, D, k_bits, v_bits, seed=0):
    """Page-key history (B, H, P*T) with an outlier key channel, as real keys have."""
    k1, k2 = mx.random.split(mx.random.key(seed))
    k = mx.random.normal((B, H, P, T, D), key=k1) + 6.0 * (mx.arange(D) == 3)
    v = mx.random.normal((B, H, P * T, D), key=k2)
    codes, scales, offsets = quantize_pages(k, k_bits)
    return PackedKV(PagePacked(codes.reshape(B, H, P * T, -1), scales, offsets),
                    quantize(v, v_bits))


def _reference(q, hist, k_new, v_new, k_bits, v_bits, scale, hist_mask):
    """Softmax attention over the dequantized history plus the fresh rows, float32."""
    B, Hq, L, D = q.shape
    Hkv = k_new.shape[1]
    k = mx.concatenate([dequantize_pages(hist.k, k_bits), k_new], axis=2)
    v = mx.concatenate([dequantize(hist.v, v_bits), v_new], axis=2)
    k, v = (mx.repeat(a, Hq // Hkv, axis=1) for a in (k, v))
    s = (q * scale) @ k.swapaxes(-1, -2)
    fresh = mx.ones((*hist_mask.shape[:-1], k_new.shape[2]), mx.bool_)
    visible = mx.concatenate([hist_mask, fresh], -1)
    s = mx.where(visible, s, mx.finfo(mx.float32).min)
    return mx.softmax(s, axis=-1) @ v


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("T", [16, 64])
def test_folded_scores_equal_scores_of_the_dequantized_keys(bits, T):
    B, H, R, P, D = 2, 2, 3, 3, 64
    hist = _history(B, H, P, T, D, bits, 4, seed=bits)
    q = mx.random.normal((B, H, R, D), key=mx.random.key(7))
    want = q @ dequantize_pages(hist.k, bits).swapaxes(-1, -2)
    got = page_qmm.scores(q, hist.k, bits)
    assert got.shape == (B, H, R, P * T)
    assert mx.abs(got - want).max().item() < 1e-4 * mx.abs(want).max().item()


def test_values_in_chunks_equal_the_dequantized_product():
    B, H, R, S, D = 2, 2, 3, 5 * 16, 64
    v = quantize(mx.random.normal((B, H, S, D), key=mx.random.key(2)), 4)
    p = mx.softmax(mx.random.normal((B, H, R, S), key=mx.random.key(3)), axis=-1)
    want = p @ dequantize(v, 4)
    for chunk in (16, 32, 64, 256):   # whole chunks, a remainder, and one short chunk
        got = page_qmm.values(p, v, 4, chunk=chunk)
        assert mx.abs(got - want).max().item() < 1e-5


@pytest.mark.parametrize("max_entries", [10_000, 5])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_decode_attention_equals_reference_and_page_scores(fmt, max_entries, monkeypatch):
    """Batch 3, 6 query heads on 2 KV heads, 5 pages gathered but 5 / 2 / 3 of them real
    (ragged: the rest masked as the engine masks padding), two fresh rows (tail + own)."""
    monkeypatch.setattr(page_qmm, "MAX_ENTRIES", max_entries)   # 5: matmuls over page slices
    k_bits, v_bits = FORMATS[fmt]
    monkeypatch.setattr(page_qmm, "VALUE_CHUNK", 32)   # the values in chunks and a remainder
    B, Hq, Hkv, P, T, D = 3, 6, 2, 5, 16, 64
    hist = _history(B, Hkv, P, T, D, k_bits, v_bits)
    keys = mx.random.split(mx.random.key(11), 3)
    q = mx.random.normal((B, Hq, 1, D), key=keys[0])
    k_new = mx.random.normal((B, Hkv, 2, D), key=keys[1])
    v_new = mx.random.normal((B, Hkv, 2, D), key=keys[2])
    real = mx.array([5, 2, 3])[:, None] * T
    hist_mask = (mx.arange(P * T)[None] < real)[:, None, None, :]        # (B, 1, 1, S)
    new_mask = mx.ones((1, 1, 1, 2), mx.bool_)
    kw = dict(fmt=KVFormat(fmt, D), scale=D ** -0.5, new_mask=new_mask, hist_mask=hist_mask)
    on = replace(DEFAULT_KERNELS, page_key_qmm=True)
    off = replace(DEFAULT_KERNELS, page_key_qmm=False)
    got = direct_attention(q, hist, k_new, v_new, kernels=on, **kw)
    old = direct_attention(q, hist, k_new, v_new, kernels=off, **kw)
    want = _reference(q, hist, k_new, v_new, k_bits, v_bits, D ** -0.5, hist_mask)
    assert got.shape == (B, Hq, 1, D)
    assert mx.abs(got - want).max().item() < 1e-4
    assert mx.abs(got - old).max().item() < 1e-4
    bf16 = direct_attention(q, hist, k_new, v_new, **kw,
                            kernels=replace(on, page_key_qmm_bf16=True))
    # bf16 activations: their rounding only (on this CPU 0.03-0.05 here, against 0.002-0.004
    # for attention over bf16-rounded q, K and V; a broken path is off by 0.3 or more).
    assert 0 < mx.abs(bf16 - want).max().item() < 0.1
    # The padding pages are really hidden: un-masking them changes the answer.
    unmasked = direct_attention(q, hist, k_new, v_new, kernels=on,
                                **{**kw, "hist_mask": mx.ones_like(hist_mask)})
    assert mx.abs(unmasked - got).max().item() > 1e-2


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("T,max_entries", [(16, 10_000), (32, 10_000), (16, 1)])
def test_expert_attention_reads_pages_in_place(fmt, T, max_entries, monkeypatch):
    """gather_qmm over a pool of pages, page tables out of order and sharing a page."""
    monkeypatch.setattr(page_qmm, "MAX_ENTRIES", max_entries)   # 1: one page per matmul
    k_bits, v_bits = FORMATS[fmt]
    N, Hkv, rep, D = 6, 2, 3, 64
    hist = _history(N, Hkv, 1, T, D, k_bits, v_bits, seed=3)    # page n = "sequence" n
    kp, vp = hist.k, hist.v
    page_major = lambda a: a.swapaxes(1, 2)                      # (N, H, T, w) -> (N, T, H, w)
    pool = page_qmm.page_experts(page_major(kp.codes), kp.scales[:, :, 0], kp.offsets[:, :, 0],
                                 *(page_major(a) for a in vp))
    tables = mx.array([[4, 0, 2], [1, 5, 4]])
    q = mx.random.normal((2, Hkv * rep, D), key=mx.random.key(5))
    got = page_qmm.expert_attention(q, pool, tables, k_bits, v_bits, D ** -0.5)
    k, v = dequantize_pages(kp, k_bits), dequantize(vp, v_bits)  # (N, H, T, D)
    kk, vv = (a[tables].swapaxes(1, 2).reshape(2, Hkv, -1, D) for a in (k, v))
    qq = q.reshape(2, Hkv, rep, D) * D ** -0.5
    want = (mx.softmax(qq @ kk.swapaxes(-1, -2), axis=-1) @ vv).reshape(2, Hkv * rep, D)
    assert mx.abs(got - want).max().item() < 1e-4


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_decode_through_page_qmm_equals_the_tiled_path(tiny_model_dirs, fmt):
    """Two sequences of different lengths decoding together, across a page fill."""
    loaded = load_model(tiny_model_dirs["llama"])
    tables = [list(range(0, 6)), list(range(6, 12))]

    def runner(kernels):
        store = KVStore(loaded.geometry, 12, 16, loaded.dtype,
                        layer_factory=packed_layer_factory(fmt, kernels=kernels, tail_slots=2))
        return PackedModelRunner(loaded, store, kernels=kernels)

    # The MLX decode paths both (on the CPU decode rows would take the Numba kernel).
    qmm = runner(replace(DEFAULT_KERNELS, page_key_qmm=True, cpu_decode=False))
    tiled = runner(replace(DEFAULT_KERNELS, page_key_qmm=False, page_key_scores=False,
                           cpu_decode=False))
    text = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)
    prompts = [text[:40], text[:21]]
    for r in (qmm, tiled):
        r.forward([Chunk(i, p, 0, t) for i, (p, t) in enumerate(zip(prompts, tables))])
    tokens = [5, 9]
    for step in range(10):   # the first sequence fills its page at 48
        chunks = [Chunk(i, [tokens[i]], len(prompts[i]) + step, tables[i]) for i in range(2)]
        a, b = qmm.forward(chunks), tiled.forward(chunks)
        assert mx.abs(a - b).max().item() < 1e-4
        tokens = [int(x) for x in mx.argmax(b, axis=-1).tolist()]
    assert counters_of(qmm.kvstore)["direct"] > 0
