"""Decode scores as a GEMM on the codes (engine.attention.cpu_gemm) equal the dequantized math."""
import mlx.core as mx
import pytest

import engine.attention.packed as pa
from capacity.formats import KVFormat
from engine.attention.choices import KernelChoices
from engine.attention.cpu_gemm import code_planes, scores
from engine.kv.quant import Packed, dequantize, quantize


def _gathered(p: Packed) -> Packed:
    # Gathered history is a transposed view of the page pool, not a contiguous array.
    return Packed(*(mx.contiguous(a.swapaxes(1, 2)).swapaxes(1, 2) for a in p))


@pytest.mark.parametrize("bits", [8, 4])
def test_code_planes_rebuild_the_dequantized_rows(bits):
    x = mx.random.normal((2, 3, 5, 128), key=mx.random.key(1))
    p = quantize(x, bits)
    codes = mx.zeros((2, 3, 5, 128))
    for plane, channels in code_planes(p, bits):
        codes[..., channels] = plane
    rebuilt = (codes.reshape(2, 3, 5, 2, 64) * p.scales[..., None]
               + p.offsets[..., None]).reshape(2, 3, 5, 128)
    assert mx.allclose(rebuilt, dequantize(p, bits), atol=1e-5).item()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("D,R,S", [(64, 1, 33), (128, 4, 70), (256, 8, 17)])
def test_scores_match_the_dequantized_keys(bits, D, R, S):
    keys = mx.random.split(mx.random.key(D + R), 2)
    rows = mx.random.normal((2, 2, R, D), key=keys[0]) * 0.1
    p = _gathered(quantize(mx.random.normal((2, 2, S, D), key=keys[1]) * 3, bits))
    ref = rows @ dequantize(p, bits).swapaxes(-1, -2)
    assert scores(rows, p, bits).shape == (2, 2, R, S)
    assert mx.abs(scores(rows, p, bits) - ref).max().item() < 2e-5
    # A scratch of 64 rows per slice: the history is scored in slices (last one partial).
    sliced = scores(rows, p, bits, scratch_elements=2 * 2 * D * 64)
    assert mx.abs(sliced - ref).max().item() < 2e-5


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_decode_attention_agrees_with_mlx_quantized_matmul(name):
    fmt = KVFormat(name, 128)
    keys = mx.random.split(mx.random.key(7), 5)
    q = mx.random.normal((3, 8, 1, 128), key=keys[0])
    hist = pa.PackedKV(_gathered(quantize(mx.random.normal((3, 2, 90, 128), key=keys[1]), fmt.k_bits)),
                       _gathered(quantize(mx.random.normal((3, 2, 90, 128), key=keys[2]), fmt.v_bits)))
    kn, vn = (mx.random.normal((3, 2, 1, 128), key=k) for k in keys[3:5])
    kw = dict(fmt=fmt, scale=128 ** -0.5, new_mask=None)
    ours = pa.direct_attention(q, hist, kn, vn, **kw)
    mlx_qmm = pa.direct_attention(q, hist, kn, vn, kernels=KernelChoices(cpu_code_gemm=False),
                                  **kw)
    assert mx.abs(ours - mlx_qmm).max().item() < 2e-5
