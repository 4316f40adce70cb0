"""quality.key4_variants' simulated layouts: the page-key image, wide channels, pre-RoPE keys."""
import mlx.core as mx
import numpy as np

from quality.key4_variants import VARIANTS, KeyVariant, page_key_image, rope_rotate
from quality.variants import fake_quant


def _keys():
    k = mx.random.normal((2, 3, 128, 64), key=mx.random.key(0))
    return k * mx.concatenate([mx.ones(60), mx.array([10.0, 20.0, 30.0, 40.0])])


def test_plain_page_keys_are_int4_kivi():
    k = _keys()
    ref = fake_quant(k.reshape(2, 3, 2, 64, 64).swapaxes(-1, -2), 4, 64)
    ref = ref.swapaxes(-1, -2).reshape(k.shape)
    assert mx.array_equal(page_key_image(k, VARIANTS["int4-kivi"], 64), ref)


def test_wide_channels_are_the_widest_and_kept_at_their_bits():
    k = _keys()
    err = mx.abs(page_key_image(k, KeyVariant("w", wide=4, wide_bits=16), 64) - k).max(axis=2)
    assert float(err[..., 60:].max()) == 0.0        # the 4 wide-range channels: native
    assert float(err[..., :60].min()) > 0.0          # the rest: 4-bit


def test_rope_rotate_is_mlx_rope_and_inverts():
    x = mx.random.normal((1, 2, 40, 64), key=mx.random.key(1))
    pos = mx.arange(40)[None]
    ref = mx.fast.rope(x, 64, traditional=False, base=1e5, scale=1.0, offset=0)
    assert np.allclose(np.array(rope_rotate(x, pos, 1e5)), np.array(ref), atol=1e-4)
    back = rope_rotate(rope_rotate(x, pos, 1e5), pos, 1e5, inverse=True)
    assert np.allclose(np.array(back), np.array(x), atol=1e-5)


def test_bytes():
    assert VARIANTS["int4-kivi"].row_bytes() == 80
    assert VARIANTS["k6v4-kivi"].row_bytes() == 96
    assert VARIANTS["kivi-w8x8"].row_bytes() == 80 + 8 * 4 / 8 + 8 / 64


def test_key_pages_span_runner_pages_and_keep_their_partial_page_native():
    """kivi-k6v5-p128: key scales over 128 tokens (two runner pages), 0.391x bf16; a window
    shorter than one key page reads every key native (its tail), where 64-token pages do not."""
    from engine.model.loader import load_model
    from quality import runs
    from quality.key4_variants import make_runner

    p128 = VARIANTS["kivi-k6v5-p128"]
    assert p128.row_bytes() == 48 + 8 * 64 / 128 + 40 + 8 == 100.0
    assert VARIANTS["kivi-k6v5"].row_bytes() == 104.0
    k = _keys()
    ref = fake_quant(k.reshape(2, 3, 1, 128, 64).swapaxes(-1, -2), 6, 128)
    assert mx.array_equal(page_key_image(k, p128, 128), ref.swapaxes(-1, -2).reshape(k.shape))
    loaded = load_model("models/orchard-tiny")
    wins = [np.random.default_rng(s).integers(0, 200, 120) for s in range(2)]
    scores = runs.teacher_forced(loaded, wins, ["kivi-k6v5-p128", "kivi-k6v5"], 32, 2,
                                 log=lambda m: None, make=make_runner)
    native_like, quantized = (abs(float(scores[n].kl.sum())) for n in ("kivi-k6v5-p128",
                                                                        "kivi-k6v5"))
    assert native_like < 1e-4 and quantized > 1e-3   # float32 rounding vs quantization
