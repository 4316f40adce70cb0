"""Affine group-64 quantization: error bounds per format, byte layout, MLX kernel compatibility."""
import mlx.core as mx
import pytest

from capacity.formats import KVFormat
from engine.kv.quant import Packed, dequantize, from_row_bytes, quantize, row_bytes, to_row_bytes


def _data(shape, seed=0):
    mx.random.seed(seed)
    x = mx.random.normal(shape)
    # A few large channels per row, like real keys, plus a shifted (all-positive) head.
    return x.at[..., 3].multiply(20.0).at[..., 0, :].add(5.0)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("bits", [4, 8])
def test_error_within_half_a_step_of_each_group(bits, head_dim):
    x = _data((2, 4, 33, head_dim))
    p = quantize(x, bits)
    err = mx.abs(dequantize(p, bits) - x).reshape(2, 4, 33, head_dim // 64, 64).max(axis=-1)
    # Rounding to the nearest code loses at most half a step; allow float32 rounding on top.
    bound = p.scales / 2 + 1e-6 * (1 + mx.abs(p.offsets) + p.scales * (2**bits - 1))
    assert mx.all(err <= bound).item()
    assert p.scales.dtype == mx.float32 and p.offsets.dtype == mx.float32
    assert p.codes.dtype == mx.uint32 and p.codes.shape[-1] == head_dim * bits // 32


@pytest.mark.parametrize("bits,rel_rms", [(8, 0.006), (4, 0.1)])
def test_relative_rms_error_per_bit_width(bits, rel_rms):
    x = mx.random.normal((512, 128), key=mx.random.key(1))
    d = dequantize(quantize(x, bits), bits)
    assert (mx.sqrt(((d - x) ** 2).mean()) / mx.sqrt((x**2).mean())).item() < rel_rms


def test_constant_group_is_exact():
    x = mx.full((2, 128), 0.37).at[1, 64:].add(1.0)
    assert mx.array_equal(dequantize(quantize(x, 4), 4), x).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_metadata_is_float32_whatever_the_input_dtype(dtype):
    x = _data((4, 64)).astype(dtype)
    p = quantize(x, 8)
    assert p.scales.dtype == mx.float32 and p.offsets.dtype == mx.float32
    assert dequantize(p, 8, dtype).dtype == dtype


def test_strided_input_matches_contiguous():
    x = _data((8, 2, 256))
    view = x[::2, :, 64:192]
    assert all(mx.array_equal(a, b).item() for a, b in zip(quantize(view, 4),
                                                           quantize(mx.array(view.tolist()), 4)))


@pytest.mark.parametrize("bits", [4, 8])
def test_codes_are_the_layout_mlx_kernels_read(bits):
    # quantized_matmul must see exactly the values our dequantize returns.
    k = _data((3, 40, 128))
    p = quantize(k, bits)
    q = mx.random.normal((3, 5, 128), key=mx.random.key(2))
    got = mx.quantized_matmul(q, *p, transpose=True, group_size=64, bits=bits)
    ref = q @ dequantize(p, bits).swapaxes(-1, -2)
    assert mx.allclose(got, ref, atol=1e-3, rtol=1e-5).item()
    w = mx.softmax(got, axis=-1)
    pv = mx.quantized_matmul(w, *p, transpose=False, group_size=64, bits=bits)
    assert mx.allclose(pv, w @ dequantize(p, bits), atol=1e-4).item()


@pytest.mark.parametrize("name", ["int8", "k8v4", "int4"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_row_bytes_layout_and_exact_round_trip(name, head_dim):
    fmt = KVFormat(name, head_dim)
    kp = quantize(_data((2, 7, head_dim)), fmt.k_bits)
    vp = quantize(_data((2, 7, head_dim), seed=3), fmt.v_bits)
    krows, vrows = to_row_bytes(kp), to_row_bytes(vp)
    assert krows.shape[-1] + vrows.shape[-1] == fmt.bytes_per_token(1)
    assert krows.shape[-1] == row_bytes(head_dim, fmt.k_bits) == fmt.k_row_bytes()
    # codes | scales | offsets, little-endian FP32 metadata at the documented offsets.
    nc = head_dim * fmt.k_bits // 8
    scale0 = krows[0, 0, nc:nc + 4].view(mx.float32)
    assert scale0.item() == kp.scales[0, 0, 0].item()
    back = from_row_bytes(krows, head_dim, fmt.k_bits)
    assert all(mx.array_equal(a, b).item() for a, b in zip(kp, back))


def test_row_bytes_refuse_wrong_sizes():
    rows = to_row_bytes(quantize(_data((2, 64)), 4))
    with pytest.raises(ValueError):
        from_row_bytes(rows[..., :-1], 64, 4)
    with pytest.raises(ValueError):
        from_row_bytes(rows, 64, 8)


def test_refuses_unsupported_shapes_and_bits():
    with pytest.raises(ValueError):
        quantize(mx.zeros((2, 96)), 4)
    with pytest.raises(ValueError):
        quantize(mx.zeros((2, 64)), 3)
    assert isinstance(quantize(mx.zeros((1, 64)), 8), Packed)
