"""Packed prefill as native prefill: history dequantized by one kernel, then MLX's own SDPA.

Why: the tile kernel (cuda/packed_prefill.py) unpacks history inside its attention, and its
~240 registers per thread leave one block per SM, so unpacking and MMAs do not overlap: it
stayed slower than native prefill (docs/lab/engine-kernel-notes.md). A
native prefill chunk already copies its history (it gathers the row's pages into one [B, H, S,
D] array) before `mx.fast.scaled_dot_product_attention`. This path does the same with one
difference: the copy is made by a kernel that reads the packed pool and writes the keys and
values dequantized, so the attention that follows is native's own, and the extra work over
native is the unpacking arithmetic of that copy (it reads 2-4x fewer bytes than native's).

Layout of the copy, per row b and KV head: keys 0..S-1 are the history (S = the longest row's
history in the call; positions past row b's own history are zero and masked), then the call's
own W keys, unquantized (the direct path's rule: a chunk attends to its own rows exactly).
Keys stay in the rotated basis they are stored in (engine/kv/rotation.py), so the queries and
the fresh keys are rotated to match: (qR)(kR)^T = qk^T. Values are never rotated.

One thread per (row, head, key, 8 channels) of K and V: code words read as stored (little end
first, 32 / bits channels per word), one FP32 scale and offset per 64-channel group, 8 outputs.
Workspace: the copy is the size of native's gathered history (the packed formats save memory
on stored pages, not on this transient). Taken where the tile kernel would be
(`packed_prefill.applies`) for chunks, when `KernelChoices.prefill_path` is "dequant" (the
default, on the measurements in docs/lab/engine-kernel-notes.md). Checked by `bench.cuda_check
--kernels dequant` on a GPU and in CPU tests through the emulator (bench/cuda_emulate.py);
never run on Metal.
"""
from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

from engine.attention.cuda.paged_decode import HEADER
from engine.kv.page_layout import CUDA_SECTIONS, PageLayout
from engine.kv.rotation import rotate

HEAD_DIMS = (64, 128)
BITS = (4, 8)
THREADS = 256

# This thread's unit of the copy (row b, KV head hk, key t, channels c0..c0+7; C8: 8-channel
# units per key) and, for t past the history span S, the call's own rows: word for word the
# same in cuda/page_key_dequant.py, which differs only in how it unpacks history.
UNIT = """
const float* const poolf = reinterpret_cast<const float*>(pool);
const int B = dims[0], HKV = dims[1], S = dims[2], W = dims[3], P = dims[4];
const int T = S + W;
const size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
if (e >= (size_t)B * HKV * T * C8) return;
const int c0 = (int)(e % C8) * 8;
const size_t r = e / C8;                       // (b, hk, t)
const int t = (int)(r % T), hk = (int)((r / T) % HKV), b = (int)(r / ((size_t)T * HKV));
TO* const ko = kout + r * D + c0;
TO* const vo = vout + r * D + c0;
if (t >= S) {                                  // the call's own rows, as given
  const size_t src = (((size_t)b * HKV + hk) * W + (t - S)) * D + c0;
  const bool live = t - S < bounds[2 * b + 1];   // padding may hold anything: 0 * NaN poisons PV
  #pragma unroll
  for (int j = 0; j < 8; ++j) {
    put(ko + j, live ? to_f(kf[src + j]) : 0.0f);
    put(vo + j, live ? to_f(vf[src + j]) : 0.0f);
  }
  return;
}
"""

_SOURCE = CUDA_SECTIONS + """
constexpr int C8 = D / 8;                      // 8-channel units per key
""" + UNIT + """\
if (t >= bounds[2 * b]) {                      // past this row's history: masked, kept finite
  #pragma unroll
  for (int j = 0; j < 8; ++j) { put(ko + j, 0.0f); put(vo + j, 0.0f); }
  return;
}
const int page = pages[(size_t)b * P + t / PT];
const size_t row = ((size_t)page * PT + t % PT) * HKV + hk;
const int grp = c0 / 64;
// One section pair (codes, scales, offsets) of K or V: 8 channels of this key as floats.
auto unpack8 = [&](TO* out, int codes, int words, int scales, int offsets, int bits) {
  const int pw = 32 / bits;
  const unsigned int m = (1u << bits) - 1u;
  const unsigned int* w = pool + sec(row, codes, words);
  const float sc = poolf[sec(row, scales, NG_) + grp], of = poolf[sec(row, offsets, NG_) + grp];
  #pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int c = c0 + j;
    put(out + j, (float)((w[c / pw] >> ((c % pw) * bits)) & m) * sc + of);
  }
};
unpack8(ko, KC_OFF, KW_, KS_OFF, KO_OFF, KB);
unpack8(vo, VC_OFF, VW_, VS_OFF, VO_OFF, VB);
"""

INPUTS = [("kf", "TO"), ("vf", "TO"), ("pool", "uint32"), ("pages", "int32"),
          ("bounds", "int32"), ("dims", "int32")]
OUTPUTS = [("kout", "TO"), ("vout", "TO")]


@lru_cache(maxsize=None)
def _kernel():
    return mx.fast.cuda_kernel(
        name="orchard_packed_dequant", input_names=[n for n, _ in INPUTS],
        output_names=[n for n, _ in OUTPUTS], source=_SOURCE, header=HEADER,
        ensure_row_contiguous=True)


def supports(k_bits: int | None, v_bits: int | None, head_dim: int) -> bool:
    return k_bits in BITS and v_bits in BITS and head_dim in HEAD_DIMS


def step_mask(step, view):
    """`joint_mask` of one forward call, built once and shared by every packed layer."""
    mask = view.masks.get("packed_dequant", False)
    if mask is False:
        mask = view.masks["packed_dequant"] = joint_mask(step.starts, step.lengths, step.width)
    return mask


def template(layout: PageLayout, k_bits: int, v_bits: int) -> list:
    """The kernel's template ints for one layout (also what the emulator builds)."""
    d = layout.k_words * 32 // k_bits
    return [("D", d), ("KB", k_bits), ("VB", v_bits), ("PT", layout.page_tokens),
            ("HK", layout.heads)]


def dequantized_history(k_fresh: mx.array, v_fresh: mx.array, pool: mx.array,
                        layout: PageLayout, k_bits: int, v_bits: int, pages: mx.array,
                        bounds: mx.array, span: int) -> tuple[mx.array, mx.array]:
    """Keys and values [B, Hkv, span + W, D] in k_fresh's dtype: row b's first bounds[b, 0]
    history keys (rotated basis, as stored) read through its page table `pages` [B, P] from
    the layer's pool, zeros up to `span`, then its first bounds[b, 1] own rows of k_fresh /
    v_fresh [B, Hkv, W, D] (k_fresh already rotated), zeros after them."""
    b, hkv, w, d = k_fresh.shape
    if not supports(k_bits, v_bits, d) or hkv != layout.heads:
        raise ValueError(f"packed dequant kernel: unsupported head dim {d}, bits {k_bits}/"
                         f"{v_bits} or heads {hkv} (layout has {layout.heads})")
    return launch(_kernel(), [k_fresh, v_fresh.astype(k_fresh.dtype), pool, pages, bounds,
                              mx.array([b, hkv, span, w, pages.shape[1]], dtype=mx.int32)],
                  [*template(layout, k_bits, v_bits), ("TO", k_fresh.dtype)],
                  (b, hkv, span + w, d), k_fresh.dtype)


def launch(kernel, inputs: list, template: list, shape: tuple, dtype) -> tuple[mx.array, mx.array]:
    """A history-dequant kernel (this one or cuda/page_key_dequant.py) over the copy's `shape`
    [B, Hkv, span + W, D], one thread per UNIT: its keys and values in `dtype`."""
    b, hkv, t, d = shape
    units = b * hkv * t * (d // 8)
    return tuple(kernel(
        inputs=inputs, template=template,
        grid=(-(-units // THREADS) * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[shape] * 2, output_dtypes=[dtype] * 2))


def joint_mask(history: np.ndarray, own: np.ndarray, width: int):
    """The SDPA mask over [history (max(history) keys) | own keys (width)] for rows with
    `history[b]` packed keys and `own[b]` new tokens: "causal" when every row has the same
    history and fills the width (MLX aligns a causal mask to the last key), None for one
    query, else a boolean array [B, 1, width, span + width]. Padded query positions see their
    row's keys as its last real position does (so none is fully masked)."""
    span = int(history.max())
    if (history == span).all() and (own == width).all():
        return "causal" if width > 1 else None
    i = np.minimum(np.arange(width)[None, :, None], own[:, None, None] - 1)   # [B, W, 1]
    hist = np.broadcast_to(np.arange(span)[None, None, :] < history[:, None, None],
                           (len(own), width, span))
    j = np.arange(width)[None, None, :]
    fresh = (j <= i) & (j < own[:, None, None])
    return mx.array(np.concatenate([hist, fresh], axis=-1))[:, None]


def dequant_prefill_attention(q: mx.array, k_new: mx.array, v_new: mx.array, pool: mx.array,
                              layout: PageLayout, k_bits: int, v_bits: int, pages: mx.array,
                              bounds: mx.array, longest_history: int, scale: float,
                              mask=None, history=None) -> mx.array:
    """Attention of a prefill chunk q [B, Hq, W, D] over its packed history plus its own rows
    k_new / v_new [B, Hkv, W, D] (model basis), with the tile kernel's signature
    (cuda/packed_prefill.py: bounds [B, 2] = history and own keys per row, `longest_history` =
    max history): the history dequantized by one kernel (`history`: that function, replaceable
    by the CPU emulator in checks), then `mx.fast.scaled_dot_product_attention`. `mask`: the
    `joint_mask` of the bounds (computed from them when not given). Returns [B, Hq, W, D] in
    q's dtype."""
    if mask is None:
        host = np.array(bounds)
        mask = joint_mask(host[:, 0], host[:, 1], q.shape[2])
    dtype = q.dtype
    k, v = (history or dequantized_history)(
        rotate(k_new).astype(dtype), v_new.astype(dtype), pool, layout, k_bits, v_bits, pages,
        bounds, longest_history)
    return mx.fast.scaled_dot_product_attention(rotate(q).astype(dtype), k, v, scale=scale,
                                                mask=mask)
