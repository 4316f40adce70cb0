"""Page-key prefill as native prefill: history dequantized by one kernel, then MLX's SDPA
(k6v4-kivi, int4-kivi; CUDA backend only; the page-key twin of cuda/packed_dequant.py).

Why: a prefill chunk over page-key history took the MLX direct path on CUDA, which unpacks the
history tile by tile in MLX ops (about 4x native's prefill time at 4K on the H200: issue 32).
A native chunk gathers its history into one [B, H, S, D] copy before SDPA anyway; this kernel
makes that copy from the pool instead, so the attention is native's own and the extra work is
the unpacking arithmetic of the copy (reading ~2.7x fewer bytes than native's gather).

Layout of the copy, per row b and KV head: keys 0..S-1 are the history as the step began
(S = the longest row's history in the call): full pages from their codes (per-channel scales
and offsets per page, spread over the page's token rows: page_quant.meta_rows; 4- or 6-bit
codes), the row's partial last page from its native tail slot (`tail_slots[b]`, as the step
began: engine/kv/tails.py), zeros past the row's own history (masked); then the call's own W
rows as given, zeros past each row's length. Keys are unrotated (page keys are), so neither the
queries nor the fresh keys are rotated. One thread per (row, head, key, 8 channels) of K and V.

Checked on the CPU emulator (tests/engine/attention/test_cuda_page_key_dequant.py) and by a
local nvcc (`python -m bench.cuda_nvcc_check --only page-key-dequant`); never run on a GPU.
Off by default (KernelChoices.page_key_prefill).
"""
from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from engine.attention.cuda.packed_dequant import THREADS, UNIT, launch
from engine.attention.cuda.page_key_decode import check_layout
from engine.attention.cuda.paged_decode import HEADER

HEAD_DIMS = (64, 128)
KEY_BITS = (4, 6)

_SOURCE = """
constexpr int VB = 4;
constexpr int RPP = PT * HK;
constexpr int LW = D * KB / 32, VW = D * VB / 32, NGK = D / PT, NG = D / 64, C8 = D / 8;
constexpr int KC_OFF = 0, VC_OFF = RPP * LW, KS_OFF = VC_OFF + RPP * VW;
constexpr int KO_OFF = KS_OFF + RPP * NGK, VS_OFF = KO_OFF + RPP * NGK;
constexpr int VO_OFF = VS_OFF + RPP * NG, PGW = VO_OFF + RPP * NG;
auto sec = [](size_t r, int off, int w) -> size_t {  // first word of row r in a section
  return (r / RPP) * (size_t)PGW + off + (r % RPP) * (size_t)w;
};
""" + UNIT + """\
const int hist = bounds[2 * b], nfull = hist / PT * PT;
if (t >= hist) {                               // past this row's history: masked, kept finite
  #pragma unroll
  for (int j = 0; j < 8; ++j) { put(ko + j, 0.0f); put(vo + j, 0.0f); }
  return;
}
if (t >= nfull) {                              // the partial last page: its native tail rows
  const size_t src = (((size_t)max(tslot[b], 0) * PT + t % PT) * HKV + hk) * D + c0;
  #pragma unroll
  for (int j = 0; j < 8; ++j) { put(ko + j, to_f(kt[src + j])); put(vo + j, to_f(vt[src + j])); }
  return;
}
const int page = pages[(size_t)b * P + t / PT];
const size_t row = ((size_t)page * PT + t % PT) * HKV + hk;
// Keys: codes of KB bits along the row's bit stream (a 6-bit code may straddle two words),
// scale and offset of channel c from the page's token row c / NGK (page_quant.meta_rows).
const unsigned int* kw = pool + sec(row, KC_OFF, LW);
const size_t page_row = (size_t)page * PT * HKV + hk;   // token 0 of this page, head hk
#pragma unroll
for (int j = 0; j < 8; ++j) {
  const int c = c0 + j, bit = c * KB, wi = bit / 32, sh = bit % 32;
  const unsigned int x = sh + KB <= 32 ? kw[wi] >> sh : (kw[wi] >> sh) | (kw[wi + 1] << (32 - sh));
  const size_t mrow = page_row + (size_t)(c / NGK) * HKV;
  const float sc = poolf[sec(mrow, KS_OFF, NGK) + c % NGK];
  const float of = poolf[sec(mrow, KO_OFF, NGK) + c % NGK];
  put(ko + j, (float)(x & ((1u << KB) - 1u)) * sc + of);
}
// Values: token-local int4, 64-channel groups (packed_dequant's unpack).
const unsigned int vw = pool[sec(row, VC_OFF, VW) + c0 / 8];
const float vsc = poolf[sec(row, VS_OFF, NG) + c0 / 64], vof = poolf[sec(row, VO_OFF, NG) + c0 / 64];
#pragma unroll
for (int j = 0; j < 8; ++j) put(vo + j, (float)((vw >> (4 * j)) & 15u) * vsc + vof);
"""

INPUTS = ["kf", "vf", "pool", "kt", "vt", "pages", "bounds", "tslot", "dims"]
OUTPUTS = ["kout", "vout"]


@lru_cache(maxsize=None)
def _kernel():
    return mx.fast.cuda_kernel(
        name="orchard_page_key_dequant", input_names=INPUTS, output_names=OUTPUTS,
        source=_SOURCE, header=HEADER, ensure_row_contiguous=True)


def supports(k_bits: int | None, v_bits: int | None, head_dim: int, page_tokens: int) -> bool:
    return (k_bits in KEY_BITS and v_bits == 4 and head_dim in HEAD_DIMS
            and page_tokens >= 2 and head_dim % page_tokens == 0)


def template(head_dim: int, page_tokens: int, heads: int, k_bits: int) -> list:
    """The kernel's template ints (TO and TT, the dtypes, added by the caller)."""
    return [("D", head_dim), ("KB", k_bits), ("PT", page_tokens), ("HK", heads)]


def dequantized_history(k_fresh: mx.array, v_fresh: mx.array, pool: mx.array, layout,
                        k_bits: int, tail: tuple[mx.array, mx.array], pages: mx.array,
                        bounds: mx.array, tail_slots: mx.array,
                        span: int) -> tuple[mx.array, mx.array]:
    """Keys and values [B, Hkv, span + W, D] in k_fresh's dtype (the module docstring's copy):
    row b's first bounds[b, 0] history keys, read through its page table `pages` [B, P] and
    its tail slot tail_slots[b] (`tail`: the layer's native tail pool, K and V [slots, PT, Hkv,
    D]), zeros up to `span`, then its first bounds[b, 1] rows of k_fresh / v_fresh [B, Hkv, W,
    D], zeros after them."""
    b, hkv, w, d = k_fresh.shape
    if not supports(k_bits, 4, d, layout.page_tokens):
        raise ValueError(f"page-key dequant kernel: unsupported head dim {d}, key bits {k_bits} "
                         f"or pages of {layout.page_tokens}")
    check_layout(pool, layout, d, k_bits, hkv)
    return launch(_kernel(),
                  [k_fresh, v_fresh.astype(k_fresh.dtype), pool, *tail, pages, bounds, tail_slots,
                   mx.array([b, hkv, span, w, pages.shape[1]], dtype=mx.int32)],
                  [*template(d, layout.page_tokens, hkv, k_bits), ("TO", k_fresh.dtype),
                   ("TT", tail[0].dtype)], (b, hkv, span + w, d), k_fresh.dtype)


def dequant_prefill_attention(q: mx.array, k_new: mx.array, v_new: mx.array, pool: mx.array,
                              layout, k_bits: int, tail: tuple[mx.array, mx.array],
                              pages: mx.array, bounds: mx.array, tail_slots: mx.array,
                              longest_history: int, scale: float, mask,
                              history=None) -> mx.array:
    """A prefill chunk q [B, Hq, W, D] over its page-key history and its own rows k_new / v_new
    [B, Hkv, W, D]: the copy of `dequantized_history` (`history`: that function, replaceable by
    the CPU emulator in checks), then `mx.fast.scaled_dot_product_attention` under `mask`
    (cuda/packed_dequant.joint_mask of the bounds). Returns [B, Hq, W, D] in q's dtype."""
    dtype = q.dtype
    k, v = (history or dequantized_history)(
        k_new.astype(dtype), v_new.astype(dtype), pool, layout, k_bits, tail, pages, bounds,
        tail_slots, longest_history)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
