"""The fixed signed Hadamard rotation: orthogonal, deterministic, score-preserving, outlier-spreading."""
import mlx.core as mx
import pytest

from engine.kv.quant import dequantize, quantize
from engine.kv.rotation import rotate, rotation_matrix, rotation_signs


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_orthogonal_and_block_diagonal(head_dim):
    r = rotation_matrix(head_dim)
    assert mx.allclose(r @ r.T, mx.eye(head_dim), atol=1e-5).item()
    b = min(128, head_dim)
    if head_dim > b:  # no mixing across blocks
        assert mx.all(r[:b, b:] == 0).item() and mx.all(r[b:, :b] == 0).item()
    assert mx.allclose(mx.abs(r[:b, :b]), mx.full((b, b), b ** -0.5), atol=1e-6).item()


def test_sign_mask_is_fixed_by_seed_1():
    # Stored pages and checkpoints live in this basis: the mask must never change.
    signs = "".join("+" if s > 0 else "-" for s in rotation_signs(64))
    assert signs == "-++++----+--+-+----++--+++-+--++-++-+----++-++-+-+-+-+-+-+-+---+"
    assert rotation_signs(256)[:64] == rotation_signs(64)
    assert rotation_signs(64, seed=2) != rotation_signs(64)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_scores_are_unchanged(head_dim):
    q = mx.random.normal((2, 3, 5, head_dim), key=mx.random.key(0))
    k = mx.random.normal((2, 3, 9, head_dim), key=mx.random.key(1))
    ref = q @ k.swapaxes(-1, -2)
    got = rotate(q) @ rotate(k).swapaxes(-1, -2)
    assert mx.allclose(got, ref, atol=1e-4).item()
    assert mx.allclose(rotate(k), k @ rotation_matrix(head_dim), atol=1e-5).item()


def test_strided_and_bf16_inputs():
    x = mx.random.normal((4, 6, 256), key=mx.random.key(3))
    assert mx.allclose(rotate(x[:, ::2, 128:]), rotate(mx.array(x[:, ::2, 128:].tolist())),
                       atol=1e-6).item()
    assert rotate(x.astype(mx.bfloat16)).dtype == mx.float32


def test_rotation_cuts_int4_error_on_outlier_channels():
    # Keys with a few huge channels: without rotation the 4-bit step is set by the outlier.
    k = mx.random.normal((256, 128), key=mx.random.key(4)).at[:, 7].multiply(40.0)
    plain = mx.abs(dequantize(quantize(k, 4), 4) - k).mean()
    rk = rotate(k)
    rotated = mx.abs(dequantize(quantize(rk, 4), 4) @ rotation_matrix(128).T - k).mean()
    assert (rotated < 0.6 * plain).item()


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_dense_fallback_is_the_same_rotation(head_dim):
    # Backends without mx.hadamard_transform use a dense matrix; it must be the same R.
    from engine.kv.rotation import _block_diag_hadamard, _signs
    x = mx.random.normal((5, head_dim), key=mx.random.key(7))
    dense = (x * _signs(head_dim)) @ _block_diag_hadamard(head_dim)
    assert mx.allclose(dense, rotate(x), atol=1e-5).item()
