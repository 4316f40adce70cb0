"""Decode attention straight from packed pages as one CUDA kernel (CUDA backend only).

The packed twin of engine/attention/cuda/paged_decode.py, and what a packed decode step attends
through on CUDA: the codes are dequantized inside the kernel, in registers, one key row at a time,
so neither a gathered copy of the history nor a dequantized one ever exists (the direct path's MLX
ops gather every row's pages and unpack them into an FP32 tile per layer and step).

Layout it reads: the layer's one uint32 pool [NP, page_words] (engine/kv/page_layout.py), each
page the sections k_codes | v_codes | k_scales | k_offsets | v_scales | v_offsets, token-major
[T, Hkv, width] words (codes D*bits/32 words per row, FP32 scales and offsets D/64 per row as
raw bits), addressed in the kernel by page_layout.CUDA_SECTIONS; keys stored in the rotated basis
(engine/kv/rotation.py). A key row of D channels is W = D*bits/32 words; one lane takes one word
(32/bits channels of one 64-channel group), so a warp scores 32/W keys per step and reduces
each score over its W lanes. The score of a packed key needs no dequantized copy of it:
q . (code * scale + offset) = scale * (q . code) + offset * sum(q) per group. Values are
dequantized in registers and accumulated under the same online softmax (FP32).

The step's own key (the last of each row) attends in full precision, as in the direct path: it
is read from the fresh K/V the model just computed, in the model's basis, against the
unrotated query. Blocks, splits over the history and the final merge are shared with the
native kernel (`cuda_paged_decode.launch_split`): one block per (row, KV head, split) serves
the head's GQA query heads.

Formats: equal key and value bits (int8, int4), head dim 64 or 128; others (k8v4) keep the
direct path. Checked with `python -m bench.cuda_check --kernels packed` on a GPU; never run on
Metal. The tiled second version (cuda/packed_decode_v2.py: scores per tile of keys, one softmax
step per tile, PV with lanes over channels, cp.async prefetch) is the default
(KernelChoices.packed_decode); this one serves `version="v1"` and GQA groups past v2's
MAX_GROUP. Where it was checked and timed: docs/lab/engine-kernel-notes.md.
"""
from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from engine.attention.cuda import packed_decode_v2
from engine.attention.cuda.paged_decode import (BLOCK_MERGE, HEADER, _dims, _scale, launch_split,
                                                split_count)
from engine.attention.cuda.tile_helpers import check_pool
from engine.kv.page_layout import CUDA_SECTIONS, PageLayout
from engine.kv.rotation import rotate

HEAD_DIMS = (64, 128)
BITS = (4, 8)

_SOURCE = """
constexpr int VB = KB;                 // equal key and value bits (`supports`)
""" + CUDA_SECTIONS + """
const float* const poolf = reinterpret_cast<const float*>(pool);   // scale/offset sections
constexpr int NW = 4;
constexpr int LW = D * KB / 32;        // lanes (words) per key row
constexpr int KPW = 32 / LW;           // keys a warp scores per step
constexpr int VPW = 32 / KB;           // channels per lane
constexpr int NG = D / 64;             // scale/offset groups per row
constexpr unsigned int MASK = (1u << KB) - 1u;
const int HQ = dims[0], HKV = dims[1], P = dims[2];
const int hk = blockIdx.x % HKV;
const int b = blockIdx.x / HKV;
const int split = blockIdx.y, NS = gridDim.y;
const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
const int sub = lane / LW, w = lane % LW;
const int c0 = w * VPW, grp = c0 / 64;
const int n = ends[b];                 // keys of this row, the step's own key last
const int nh = n - 1;                  // of which packed history
const int per = (n + NS - 1) / NS;
const int j0 = split * per, j1 = min(n, j0 + per);
const float sc = scale[0];
const float NEG_INF = -__int_as_float(0x7f800000);

float qv[G][VPW], qsum[G], acc[G][VPW], m[G], l[G];
#pragma unroll
for (int g = 0; g < G; ++g) {
  m[g] = NEG_INF; l[g] = 0.0f; qsum[g] = 0.0f;
  #pragma unroll
  for (int i = 0; i < VPW; ++i) {
    qv[g][i] = qr[((size_t)(b * HQ + hk * G + g)) * D + c0 + i] * sc;
    qsum[g] += qv[g][i];
    acc[g][i] = 0.0f;
  }
}
const size_t fresh = ((size_t)b * HKV + hk) * D + c0;
for (int jb = j0 + warp * KPW; jb < j1; jb += NW * KPW) {   // warp-uniform bound
  const int j = jb + sub;
  const bool valid = j < j1;
  float s[G], vv[VPW];
  if (valid && j < nh) {
    const int page = pages[(size_t)b * P + j / PT];
    const size_t row = ((size_t)page * PT + j % PT) * HKV + hk;
    const unsigned int kw = pool[sec(row, KC_OFF, LW) + w], vw = pool[sec(row, VC_OFF, LW) + w];
    const float ksc = poolf[sec(row, KS_OFF, NG) + grp], kof = poolf[sec(row, KO_OFF, NG) + grp];
    const float vsc = poolf[sec(row, VS_OFF, NG) + grp], vof = poolf[sec(row, VO_OFF, NG) + grp];
    float code[VPW];
    #pragma unroll
    for (int i = 0; i < VPW; ++i) {
      code[i] = (float)((kw >> (i * KB)) & MASK);
      vv[i] = (float)((vw >> (i * KB)) & MASK) * vsc + vof;
    }
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      float dot = 0.0f;
      #pragma unroll
      for (int i = 0; i < VPW; ++i) dot += qv[g][i] * code[i];
      s[g] = dot * ksc + kof * qsum[g];
    }
  } else if (valid) {   // the step's own key: full precision, model basis
    #pragma unroll
    for (int i = 0; i < VPW; ++i) vv[i] = to_f(vf[fresh + i]);
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      float dot = 0.0f;
      #pragma unroll
      for (int i = 0; i < VPW; ++i)
        dot += to_f(q[((size_t)(b * HQ + hk * G + g)) * D + c0 + i]) * to_f(kf[fresh + i]);
      s[g] = dot * sc;
    }
  } else {
    #pragma unroll
    for (int g = 0; g < G; ++g) s[g] = 0.0f;
    #pragma unroll
    for (int i = 0; i < VPW; ++i) vv[i] = 0.0f;
  }
  #pragma unroll
  for (int g = 0; g < G; ++g) {
    #pragma unroll
    for (int o = LW / 2; o > 0; o >>= 1) s[g] += __shfl_xor_sync(0xffffffff, s[g], o);
    if (valid) {
      const float mn = fmaxf(m[g], s[g]);
      const float c = __expf(m[g] - mn), p = __expf(s[g] - mn);
      l[g] = l[g] * c + p;
      #pragma unroll
      for (int i = 0; i < VPW; ++i) acc[g][i] = acc[g][i] * c + p * vv[i];
      m[g] = mn;
    }
  }
}
// Merge the warp's KPW key lanes-groups (lanes w, w + LW, ...) into lanes 0..LW-1.
#pragma unroll
for (int o = LW; o < 32; o <<= 1) {
  #pragma unroll
  for (int g = 0; g < G; ++g) {
    const float mo = __shfl_xor_sync(0xffffffff, m[g], o);
    const float lo = __shfl_xor_sync(0xffffffff, l[g], o);
    const float M = fmaxf(m[g], mo);
    const float c1 = m[g] == NEG_INF ? 0.0f : __expf(m[g] - M);
    const float c2 = mo == NEG_INF ? 0.0f : __expf(mo - M);
    l[g] = l[g] * c1 + lo * c2;
    #pragma unroll
    for (int i = 0; i < VPW; ++i) {
      const float ao = __shfl_xor_sync(0xffffffff, acc[g][i], o);
      acc[g][i] = acc[g][i] * c1 + ao * c2;
    }
    m[g] = M;
  }
}
""" + BLOCK_MERGE.format(store="""
if (sub == 0) {
  #pragma unroll
  for (int g = 0; g < G; ++g) {
    if (w == 0) { sm[warp][g] = m[g]; sl[warp][g] = l[g]; }
    #pragma unroll
    for (int i = 0; i < VPW; ++i) sa[warp][g][c0 + i] = acc[g][i];
  }
}""")


@lru_cache(maxsize=None)
def _kernel():
    return mx.fast.cuda_kernel(
        name="orchard_packed_decode",
        input_names=["q", "qr", "kf", "vf", "pool", "pages", "ends", "dims", "scale"],
        output_names=["out", "part", "ml"], source=_SOURCE, header=HEADER,
        ensure_row_contiguous=True)


def supports(k_bits: int | None, v_bits: int | None, head_dim: int) -> bool:
    """Whether a packed layer of these bits and head size can decode through the kernel."""
    return k_bits == v_bits and k_bits in BITS and head_dim in HEAD_DIMS


def writes_own(version: str, k_bits: int, v_bits: int, head_dim: int, group: int) -> bool:
    """Whether a decode of this layer goes through the v2 kernel, which can store the step's
    own rows itself (`packed_decode_attention(..., own=True)`)."""
    return version == "v2" and packed_decode_v2.supports(k_bits, v_bits, head_dim, group)


def packed_decode_attention(q: mx.array, k_new: mx.array, v_new: mx.array, pool: mx.array,
                            layout: PageLayout, bits: int, pages: mx.array, ends: mx.array,
                            longest: int, scale: float, target_blocks: int | None = None,
                            version: str = "v1", min_keys: int | None = None,
                            own: bool = False) -> mx.array:
    """Attention of one query per row q [B, Hq, 1, D] over packed history plus its own key.

    k_new/v_new [B, Hkv, 1, D]: the step's fresh rows (model basis). pool [num_pages,
    page_words] uint32: the layer's packed pages as `layout` (engine.kv.page_layout) describes
    them, keys rotated. Row b attends its first ends[b] - 1 keys through page table pages[b]
    and then its own key; `longest` = max(ends) on the host (with `target_blocks`, it picks
    the split count). Returns [B, Hq, 1, D] in q's
    dtype. `version` "v2": the tiled kernel (cuda/packed_decode_v2.py) where it supports the
    GQA group (KernelChoices.packed_decode); this one otherwise. `own`: the v2 kernel also
    stores the own rows into the pool (`writes_own` says where it can); this one never does.
    """
    b, hq, _, d = q.shape
    kvh = k_new.shape[1]
    if writes_own(version, bits, bits, d, hq // kvh):
        return packed_decode_v2.packed_decode_attention(
            q, k_new, v_new, pool, layout, bits, pages, ends, longest, scale, target_blocks,
            min_keys, own=own)
    if own:
        raise ValueError(f"packed decode {version}: only the v2 kernel stores own rows")
    check_pool(pool, layout, d, bits, bits, kvh, vectors=False)   # word reads only
    splits = split_count(b, kvh, longest, target_blocks, min_keys)
    return launch_split(
        _kernel(), [q, rotate(q), k_new, v_new, pool, pages, ends,
                    _dims(hq, kvh, pages.shape[1]), _scale(float(scale))],
        [("D", d), ("G", hq // kvh), ("PT", layout.page_tokens), ("HK", layout.heads),
         ("KB", bits), ("TQ", q.dtype), ("TK", k_new.dtype)],
        b, kvh, hq, d, splits, q.dtype)
