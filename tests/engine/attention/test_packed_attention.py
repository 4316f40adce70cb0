"""Direct and fused packed attention agree with native attention across geometries.

Stated tolerances (max abs error of outputs, unit-variance K/V/Q):
- direct vs a float32 reference over the *dequantized* history: 2e-5 (pure arithmetic error);
- fused vs direct: 2e-5 (same math, different kernels);
- direct vs native (quantization error), max / mean abs: int8 0.02 / 0.004, k8v4 0.25 / 0.06,
  int4 0.35 / 0.07. The max is set by one-row histories, where one quantized V row is not averaged.
"""
import os
import shutil
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from capacity.formats import KVFormat
from engine.attention.packed import (
    PackedAttention, PackedKV, direct_attention, fused_attention, fused_workspace_bytes)
from engine.attention import cpu_softmax
from engine.kv.quant import dequantize, quantize
from engine.kv.rotation import rotate

NATIVE_TOL = {"int8": (0.02, 0.004), "k8v4": (0.25, 0.06), "int4": (0.35, 0.07)}
EXACT_TOL = 2e-5


def _geometry(D, Hq, Hkv, S, L, B=2, seed=0):
    keys = mx.random.split(mx.random.key(seed), 5)
    # Queries arrive as (B, L, H, D) from the projection and are transposed: a strided view.
    q = mx.random.normal((B, L, Hq, D), key=keys[0]).transpose(0, 2, 1, 3)
    kh, vh = (mx.random.normal((B, Hkv, S, D), key=k) for k in keys[1:3])
    kn, vn = (mx.random.normal((B, L, Hkv, D), key=k).transpose(0, 2, 1, 3) for k in keys[3:5])
    return q, kh, vh, kn, vn


def _pack(fmt, kh, vh):
    return PackedKV(quantize(rotate(kh), fmt.k_bits), quantize(vh, fmt.v_bits))


def _reference(q, k, v, scale, mask, sinks=None):
    """Plain float32 attention with GQA by repetition and an optional sink column."""
    rep = q.shape[1] // k.shape[1]
    k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
    s = (q * scale) @ k.swapaxes(-1, -2)
    s = mx.where(mask, s, -mx.inf)
    if sinks is not None:
        s = mx.concatenate([s, mx.broadcast_to(sinks.reshape(1, -1, 1, 1), (*s.shape[:-1], 1))], -1)
    p = mx.softmax(s, axis=-1, precise=True)
    return p[..., :k.shape[2]] @ v


def _causal(L, S):
    return mx.arange(S, S + L)[:, None] >= mx.arange(S + L)[None]


@pytest.mark.parametrize("name", ["int8", "k8v4", "int4"])
@pytest.mark.parametrize("D,Hq,Hkv", [(64, 4, 4), (128, 8, 4), (256, 8, 2), (128, 8, 1), (64, 6, 2)])
@pytest.mark.parametrize("S,L", [(1, 1), (63, 1), (64, 9), (100, 16), (129, 3)])
def test_direct_fused_native_agree(name, D, Hq, Hkv, S, L):
    fmt = KVFormat(name, D)
    q, kh, vh, kn, vn = _geometry(D, Hq, Hkv, S, L)
    hist = _pack(fmt, kh, vh)
    scale = D ** -0.5
    mask = "causal" if L > 1 else None
    direct = direct_attention(q, hist, kn, vn, fmt=fmt, scale=scale, new_mask=mask)
    # Both direct methods: quantized_matmul over all history, and unpacking in tiles of 32 rows
    # (so 63..129-row histories cross tile boundaries, including a 1-row last tile).
    qmm = direct_attention(q, hist, kn, vn, fmt=fmt, scale=scale, new_mask=mask,
                           qmm_max_queries=10**6)
    tiled = direct_attention(q, hist, kn, vn, fmt=fmt, scale=scale, new_mask=mask,
                             qmm_max_queries=0, tile=32)
    # ...and the chunk's own causal keys scored 4 queries at a time (uneven last block at 9).
    blocks = direct_attention(q, hist, kn, vn, fmt=fmt, scale=scale, new_mask=mask,
                              qmm_max_queries=0, tile=32, causal_block=4)
    # ...and the CPU's NumPy softmax (the runner's flag on the CPU in float32).
    numpy_softmax = direct_attention(q, hist, kn, vn, fmt=fmt, scale=scale, new_mask=mask,
                                     cpu_softmax=True)
    fused = fused_attention(q, hist, kn, vn, fmt=fmt, scale=scale, new_mask=mask)
    # Exact reference: rotated q against the dequantized rotated keys = what was stored.
    k_deq = mx.concatenate([dequantize(hist.k, fmt.k_bits), rotate(kn)], axis=2)
    v_deq = mx.concatenate([dequantize(hist.v, fmt.v_bits), vn], axis=2)
    exact = _reference(rotate(q), k_deq, v_deq, scale, _causal(L, S))
    native = mx.fast.scaled_dot_product_attention(
        q, mx.concatenate([kh, kn], 2), mx.concatenate([vh, vn], 2), scale=scale, mask=mask)
    for out in (direct, qmm, tiled, blocks, numpy_softmax):
        assert mx.abs(out - exact).max().item() < EXACT_TOL
    assert mx.abs(fused - direct).max().item() < EXACT_TOL
    err = mx.abs(direct - native)
    assert err.max().item() < NATIVE_TOL[name][0] and err.mean().item() < NATIVE_TOL[name][1]


def test_int8_error_is_much_smaller_than_int4():
    q, kh, vh, kn, vn = _geometry(128, 8, 2, 200, 8)
    native = mx.fast.scaled_dot_product_attention(
        q, mx.concatenate([kh, kn], 2), mx.concatenate([vh, vn], 2), scale=128 ** -0.5, mask="causal")
    err = {}
    for name in ("int8", "int4"):
        fmt = KVFormat(name, 128)
        out = direct_attention(q, _pack(fmt, kh, vh), kn, vn, fmt=fmt, scale=128 ** -0.5)
        err[name] = mx.abs(out - native).mean().item()
    assert err["int8"] * 8 < err["int4"]


def test_no_history_is_native_sdpa_bit_for_bit():
    fmt = KVFormat("int4", 128)
    q, _, _, kn, vn = _geometry(128, 8, 2, 0, 12)
    out = direct_attention(q, None, kn, vn, fmt=fmt, scale=0.1)
    ref = mx.fast.scaled_dot_product_attention(q, kn, vn, scale=0.1, mask="causal")
    assert mx.array_equal(out, ref).item()
    # On the CPU in float32 it is native's CPU prefill attention (NumPy softmax), bit for bit.
    out = direct_attention(q, None, kn, vn, fmt=fmt, scale=0.1, cpu_softmax=True)
    assert mx.array_equal(out, cpu_softmax.prefill_attention(q, kn, vn, 0.1, "causal")).item()


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_sinks_and_ragged_history_masks(name):
    fmt = KVFormat(name, 64)
    D, Hq, Hkv, S, L = 64, 8, 2, 40, 10
    q, kh, vh, kn, vn = _geometry(D, Hq, Hkv, S, L)
    sinks = mx.random.normal((Hq,), key=mx.random.key(9))
    # Row 0 sees all 40 history rows, row 1 only its last 25 (left padding in a ragged batch).
    hist_mask = (mx.arange(S)[None] >= mx.array([0, 15])[:, None]).reshape(2, 1, 1, S)
    hist = _pack(fmt, kh, vh)
    kw = dict(fmt=fmt, scale=D ** -0.5, hist_mask=hist_mask, sinks=sinks)
    direct = direct_attention(q, hist, kn, vn, **kw)
    qmm = direct_attention(q, hist, kn, vn, **kw, qmm_max_queries=10**6)
    tiled = direct_attention(q, hist, kn, vn, **kw, qmm_max_queries=0, tile=16)
    blocks = direct_attention(q, hist, kn, vn, **kw, qmm_max_queries=0, tile=16, causal_block=4)
    numpy_softmax = direct_attention(q, hist, kn, vn, **kw, qmm_max_queries=10**6,
                                     cpu_softmax=True)
    fused = fused_attention(q, hist, kn, vn, **kw)
    mask = mx.concatenate([mx.broadcast_to(hist_mask, (2, 1, L, S)),
                           mx.broadcast_to(_causal(L, 0)[None, None], (2, 1, L, L))], -1)
    k_deq = mx.concatenate([dequantize(hist.k, fmt.k_bits), rotate(kn)], axis=2)
    v_deq = mx.concatenate([dequantize(hist.v, fmt.v_bits), vn], axis=2)
    exact = _reference(rotate(q), k_deq, v_deq, D ** -0.5, mask, sinks)
    for out in (direct, qmm, tiled, blocks, numpy_softmax):
        assert mx.abs(out - exact).max().item() < EXACT_TOL
    assert mx.abs(fused - direct).max().item() < EXACT_TOL
    # Masked-out history really is ignored: changing it does not move row 1.
    hist2 = _pack(fmt, kh.at[1, :, :15].add(100.0), vh.at[1, :, :15].add(100.0))
    for extra in (dict(qmm_max_queries=10**6), dict(qmm_max_queries=0, tile=16)):
        moved = direct_attention(q, hist2, kn, vn, **kw, **extra)
        same = direct_attention(q, hist, kn, vn, **kw, **extra)
        assert mx.array_equal(moved[1], same[1]).item()


def test_bf16_activations_return_bf16_with_fp32_accumulation():
    fmt = KVFormat("int8", 128)
    q, kh, vh, kn, vn = _geometry(128, 4, 2, 70, 1)
    hist = _pack(fmt, kh, vh)
    out = direct_attention(q.astype(mx.bfloat16), hist, kn.astype(mx.bfloat16),
                           vn.astype(mx.bfloat16), fmt=fmt, scale=128 ** -0.5)
    ref = direct_attention(q, hist, kn, vn, fmt=fmt, scale=128 ** -0.5)
    assert out.dtype == mx.bfloat16
    assert mx.abs(out.astype(mx.float32) - ref).max().item() < 0.02


def test_router_counts_paths_and_takes_one_permit_per_fused_call():
    fmt = KVFormat("int4", 64)
    q, kh, vh, kn, vn = _geometry(64, 4, 2, 32, 12)
    hist = _pack(fmt, kh, vh)
    asked = []
    grant = [True]

    def permit(nbytes):
        asked.append(nbytes)
        return grant[0]

    att = PackedAttention(fmt, prefill_mode="fused", permit=permit)
    a = att(q, hist, kn, vn, scale=0.125)
    assert asked == [fused_workspace_bytes(q, hist, kn)] and att.counters.fused == 1
    grant[0] = False
    b = att(q, hist, kn, vn, scale=0.125)       # refused permit: direct for the whole call
    assert att.counters.budget_fallback == 1 and att.counters.direct == 1
    assert mx.abs(a - b).max().item() < EXACT_TOL
    att(q[:, :, :4], hist, kn[:, :, :4], vn[:, :, :4], scale=0.125)   # too few queries
    att(q, None, kn, vn, scale=0.125)                                 # nothing packed to read
    att(q[:, :, :1], hist, kn[:, :, :1], vn[:, :, :1], scale=0.125)   # decode: not a candidate
    assert att.counters.as_dict() == dict(direct=4, fused=1, budget_fallback=1,
                                          ineligible_fallback=2)
    assert len(asked) == 2
    no_hook = PackedAttention(fmt, prefill_mode="fused")
    no_hook(q, hist, kn, vn, scale=0.125)
    assert no_hook.counters.budget_fallback == 1 and no_hook.counters.fused == 0
    with pytest.raises(ValueError):
        PackedAttention(fmt, prefill_mode="opportunistic")


_NO_TOOLCHAIN_SCRIPT = """
import mlx.core as mx, numpy as np, sys
from capacity.formats import KVFormat
from engine.attention.packed import direct_attention
from engine.kv.quant import PackedKV
from engine.kv.quant import quantize
from engine.kv.rotation import rotate
keys = mx.random.split(mx.random.key(3), 5)
q = mx.random.normal((1, 4, 40, 64), key=keys[0])
kh, vh = (mx.random.normal((1, 2, 70, 64), key=k) for k in keys[1:3])
kn, vn = (mx.random.normal((1, 2, 40, 64), key=k) for k in keys[3:5])
fmt = KVFormat("int8", 64)
hist = PackedKV(quantize(rotate(kh), 8), quantize(vh, 8))
out = direct_attention(q, hist, kn, vn, fmt=fmt, scale=0.125, qmm_max_queries=0, tile=32)
np.save(sys.argv[1], np.array(out))
"""


def test_tiled_prefill_needs_no_cpu_toolchain(tmp_path):
    # The fused exp(s - m) kernel is JIT-compiled by g++ on the CPU. Run the same tiled prefill
    # in a child whose PATH has no compiler at all (a real missing toolchain, not a fake) and
    # check it computes what the compiled kernel computes here.
    child_bin = tmp_path / "bin"
    child_bin.mkdir()
    (child_bin / "python").symlink_to(sys.executable)
    env = {**os.environ, "PATH": str(child_bin)}
    assert shutil.which("g++", path=env["PATH"]) is None
    outs = []
    for name, run_env in (("with", os.environ), ("without", env)):
        path = tmp_path / f"{name}.npy"
        subprocess.run([sys.executable, "-c", _NO_TOOLCHAIN_SCRIPT, str(path)], env=run_env,
                       check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
        outs.append(np.load(path))
    assert np.allclose(outs[0], outs[1], atol=1e-6, rtol=0)
