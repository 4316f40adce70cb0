"""Page-key decode scores as matmuls on the codes (engine/attention/page_scores.py): equal to
scoring the dequantized keys, in slices or not, and through the model the same logits as the
tiled path that dequantizes every key (KernelChoices.page_key_scores off)."""
from dataclasses import replace

import mlx.core as mx
import pytest

from engine.attention.choices import DEFAULT_KERNELS
from engine.attention.layers import counters_of, packed_layer_factory
from engine.attention.page_scores import page_scores
from engine.kv.page_quant import PagePacked, dequantize_pages, quantize_pages
from engine.kv.store import KVStore
from engine.model.loader import load_model
from engine.runner.packed import PackedModelRunner
from engine.sched.seq import Chunk


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("scratch", [1 << 22, 2 * 16 * 64])   # whole, and one page per slice
def test_page_scores_equal_scores_of_the_dequantized_keys(bits, scratch):
    B, H, R, P, T, D = 2, 3, 3, 5, 16, 64
    k = mx.random.normal((B, H, P, T, D), key=mx.random.key(bits))
    k = k + 8.0 * (mx.arange(D) == 5)             # an outlier channel, as real keys have
    codes, scales, offsets = quantize_pages(k, bits)
    keys = PagePacked(codes.reshape(B, H, P * T, -1), scales, offsets)
    q = mx.random.normal((B, H, R, D), key=mx.random.key(7))
    want = q @ dequantize_pages(keys, bits).swapaxes(-1, -2)
    got = page_scores(q, keys, bits, scratch_elements=scratch)
    assert got.shape == (B, H, R, P * T)
    assert mx.abs(got - want).max().item() < 1e-3 * mx.abs(want).max().item()


@pytest.mark.parametrize("fmt", ["k6v4-kivi", "int4-kivi"])
def test_decode_through_page_scores_equals_the_tiled_path(tiny_model_dirs, fmt):
    loaded = load_model(tiny_model_dirs["llama"])
    pages = list(range(8))

    def runner(kernels):
        store = KVStore(loaded.geometry, len(pages), 16, loaded.dtype,
                        layer_factory=packed_layer_factory(fmt, kernels=kernels, tail_slots=2))
        return PackedModelRunner(loaded, store, kernels=kernels)

    # The MLX decode paths both (on the CPU decode rows would take the Numba kernel).
    mlx_path = replace(DEFAULT_KERNELS, cpu_decode=False)
    fast, tiled = runner(mlx_path), runner(replace(mlx_path, page_key_scores=False))
    prompt = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)[:40]
    for r in (fast, tiled):
        r.forward([Chunk(0, prompt, 0, pages)])
    token = 5
    for pos in range(len(prompt), len(prompt) + 12):   # across a page boundary (48)
        a = fast.forward([Chunk(0, [token], pos, pages)])
        b = tiled.forward([Chunk(0, [token], pos, pages)])
        assert mx.abs(a - b).max().item() < 1e-4
        token = int(mx.argmax(b[0]).item())
    assert counters_of(fast.kvstore)["direct"] > 0


@pytest.mark.parametrize("fmt", ["k6v4-kivi", "int8"])
def test_packed_steps_take_the_numpy_softmax_on_the_cpu(tiny_model_dirs, fmt, monkeypatch):
    """A packed runner's first prefill chunk and its decode steps softmax in NumPy on the CPU,
    as native's do (MLX's CPU exp is scalar), with the logits of the mx.softmax path."""
    from engine.attention import packed

    loaded = load_model(tiny_model_dirs["llama"])
    pages = list(range(8))
    calls = {"prefill": 0, "decode": 0}

    def counted(name, real):
        def call(*args):
            calls[name] += 1
            return real(*args)
        return call

    monkeypatch.setattr(packed, "cpu_softmax_attention",
                        counted("prefill", packed.cpu_softmax_attention))
    monkeypatch.setattr(packed, "softmax_in_place", counted("decode", packed.softmax_in_place))

    def runner(kernels):
        store = KVStore(loaded.geometry, len(pages), 16, loaded.dtype,
                        layer_factory=packed_layer_factory(fmt, kernels=kernels, tail_slots=2))
        return PackedModelRunner(loaded, store, kernels=kernels)

    # Page-key decode rows and prompt chunks would take the Numba kernels (their own
    # softmax): the MLX path here.
    mlx_path = replace(DEFAULT_KERNELS, cpu_decode=False, cpu_prefill=False)
    fast, plain = runner(mlx_path), runner(replace(mlx_path, cpu_softmax=False))
    assert fast.cpu_softmax and not plain.cpu_softmax   # the CPU suite, float32
    prompt = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)[:40]
    a, b = (r.forward([Chunk(0, prompt, 0, pages)]) for r in (fast, plain))
    assert calls["prefill"] > 0 and mx.abs(a - b).max().item() < 1e-4
    token = 5
    for pos in range(len(prompt), len(prompt) + 4):
        a = fast.forward([Chunk(0, [token], pos, pages)])
        b = plain.forward([Chunk(0, [token], pos, pages)])
        assert mx.abs(a - b).max().item() < 1e-4
        token = int(mx.argmax(b[0]).item())
    assert calls["decode"] > 0
