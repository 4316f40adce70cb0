"""The packed prefill kernel's CUDA source (its tiling and host side: packed_prefill.py).

History is read from the layer's one uint32 pool (engine/kv/page_layout.py) through
CUDA_SECTIONS; `bench.cuda_check --kernels prefill` checks it on a GPU (where it was:
docs/lab/engine-kernel-notes.md). This kernel has no CPU emulation: its tensor-core MMAs are
inline PTX.
"""
from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from engine.attention.cuda.paged_decode import HEADER
from engine.kv.page_layout import CUDA_SECTIONS

_HEADER = HEADER + """
__device__ __forceinline__ void mma_bf16(float* c, const unsigned int* a, unsigned int b0,
                                         unsigned int b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ unsigned int pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);   // .x (low half) = lo
  return *reinterpret_cast<unsigned int*>(&v);
}
// A code as a float without an int-to-float conversion (a quarter-rate instruction that bound
// the tile's unpacking): 2^23 + code has the code as its mantissa, exactly.
__device__ __forceinline__ float code_f(unsigned int word, int shift, unsigned int mask) {
  return __uint_as_float(((word >> shift) & mask) | 0x4b000000u) - 8388608.0f;
}
__device__ __forceinline__ unsigned int ld32(const __nv_bfloat16* p) {
  return *reinterpret_cast<const unsigned int*>(p);
}
"""

_SOURCE = CUDA_SECTIONS + """
static_assert(PGW % 4 == 0 && VC_OFF % 4 == 0 && KS_OFF % 4 == 0 && KW_ % 4 == 0 && VW_ % 4 == 0,
              "16-byte loads of code units: aligned in every page and row (check_pool)");
const float* const poolf = reinterpret_cast<const float*>(pool);   // scale/offset sections
constexpr int QT = 16 * QW, KT = 64, NW = G * QW, NT = NW * 32;
constexpr int KS = D + 8, VS = KT + 8;        // padded shared row strides (bf16)
constexpr int KW = D * KB / 32, VW = D * VB / 32;
constexpr int KPW = 32 / KB, VPW = 32 / VB;   // channels per packed word
constexpr int NG = D / 64;
constexpr unsigned int KM = (1u << KB) - 1u, VM = (1u << VB) - 1u;
__shared__ __align__(16) __nv_bfloat16 Ks[KT * KS];
__shared__ __align__(16) __nv_bfloat16 Vt[D * VS];
const float NEG_INF = -__int_as_float(0x7f800000);
const int HQ = dims[0], HKV = dims[1], L = dims[2], P = dims[3];
const int nqt = (L + QT - 1) / QT;
const int qt = nqt - 1 - (int)(blockIdx.x % nqt);   // latest (longest) query tiles first
const int hk = (blockIdx.x / nqt) % HKV;
const int b = blockIdx.x / (nqt * HKV);
const int split = blockIdx.y, NS = gridDim.y;
const int S = bounds[2 * b], Lb = bounds[2 * b + 1];
const int q0 = qt * QT;
const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
const int gid = lane >> 2, tig = lane & 3;
const int h = hk * G + warp / QW;                 // QW warps (16 positions each) per head
const int ia = q0 + (warp % QW) * 16 + gid, ib = ia + 8;   // this lane's two positions

// Key tiles: history first, then the chunk's own keys up to the block's causal end.
const int nh = (S + KT - 1) / KT;
const int fresh_end = min(Lb, q0 + QT);
const int nf = fresh_end > 0 ? (fresh_end + KT - 1) / KT : 0;
const int per = (nh + nf + NS - 1) / NS;
const int tile0 = split * per, tile1 = min(nh + nf, tile0 + per);

unsigned int qa[D / 16][4];
{
  const __nv_bfloat16* qa_row = q + (((size_t)b * HQ + h) * L + min(ia, L - 1)) * D;
  const __nv_bfloat16* qb_row = q + (((size_t)b * HQ + h) * L + min(ib, L - 1)) * D;
  #pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    qa[kk][0] = ld32(qa_row + kk * 16 + tig * 2);
    qa[kk][1] = ld32(qb_row + kk * 16 + tig * 2);
    qa[kk][2] = ld32(qa_row + kk * 16 + 8 + tig * 2);
    qa[kk][3] = ld32(qb_row + kk * 16 + 8 + tig * 2);
  }
}
float o[D / 8][4];
#pragma unroll
for (int n = 0; n < D / 8; ++n) { o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f; }
float m_a = NEG_INF, m_b = NEG_INF, l_a = 0.0f, l_b = 0.0f;
const size_t fresh_base = ((size_t)b * HKV + hk) * L;

// History tiles are unpacked in units of one (key, 64-channel group) of K or of V: a thread
// loads a unit's 2*bits words as 16-byte vectors plus its scale and offset into registers one
// tile ahead (the loads of tile n + 1 are in flight during tile n's MMAs), then unpacks it
// into shared memory. Consecutive threads take consecutive keys: K rows are stored as 16-byte
// vectors and V columns as 2-byte stores, both without bank conflicts.
constexpr int UNITS = 2 * KT * NG, UI = (UNITS + NT - 1) / NT;
unsigned int buf[UI][16];
float bsc[UI], bof[UI];
auto load_units = [&](int t0) {
  #pragma unroll
  for (int i = 0; i < UI; ++i) {
    const int u = tid + i * NT;
    bsc[i] = 0.0f; bof[i] = 0.0f;
    #pragma unroll
    for (int j = 0; j < 16; ++j) buf[i][j] = 0u;
    if (u < UNITS) {
      const bool is_v = u >= KT * NG;
      const int uu = is_v ? u - KT * NG : u;
      const int kr = uu % KT, grp = uu / KT, t = t0 + kr;
      if (t < S) {
        const int page = pages[(size_t)b * P + t / PT];
        const size_t row = ((size_t)page * PT + t % PT) * HKV + hk;
        const uint4* src = is_v ? reinterpret_cast<const uint4*>(pool + sec(row, VC_OFF, VW) + grp * 2 * VB)
                                : reinterpret_cast<const uint4*>(pool + sec(row, KC_OFF, KW) + grp * 2 * KB);
        const int vecs = (is_v ? VB : KB) / 2;   // 16-byte vectors per unit
        #pragma unroll
        for (int x = 0; x < 4; ++x) {
          if (x < vecs) {
            const uint4 v4 = src[x];
            buf[i][4 * x] = v4.x; buf[i][4 * x + 1] = v4.y;
            buf[i][4 * x + 2] = v4.z; buf[i][4 * x + 3] = v4.w;
          }
        }
        bsc[i] = poolf[sec(row, is_v ? VS_OFF : KS_OFF, NG) + grp];
        bof[i] = poolf[sec(row, is_v ? VO_OFF : KO_OFF, NG) + grp];
      }
    }
  }
};
if (tile0 < min(tile1, nh)) load_units(tile0 * KT);

for (int tile = tile0; tile < tile1; ++tile) {
  const bool hist = tile < nh;
  const int t0 = (hist ? tile : tile - nh) * KT;
  __syncthreads();                 // every warp is done reading the previous tile
  if (hist) {
    #pragma unroll
    for (int i = 0; i < UI; ++i) {
      const int u = tid + i * NT;
      if (u >= UNITS) continue;
      const bool is_v = u >= KT * NG;
      const int uu = is_v ? u - KT * NG : u;
      const int kr = uu % KT, c0 = (uu / KT) * 64;
      const float sc = bsc[i], of = bof[i];    // rows past the history: all zero, unpack to 0
      if (!is_v) {
        __nv_bfloat16* dst = Ks + kr * KS + c0;
        #pragma unroll
        for (int c = 0; c < 64; c += 8) {
          unsigned int pk[4];
          #pragma unroll
          for (int j = 0; j < 8; j += 2)
            pk[j / 2] = pack_bf16(
                code_f(buf[i][(c + j) / KPW], ((c + j) % KPW) * KB, KM) * sc + of,
                code_f(buf[i][(c + j + 1) / KPW], ((c + j + 1) % KPW) * KB, KM) * sc + of);
          *reinterpret_cast<uint4*>(dst + c) = make_uint4(pk[0], pk[1], pk[2], pk[3]);
        }
      } else {
        #pragma unroll
        for (int c = 0; c < 64; ++c)
          Vt[(c0 + c) * VS + kr] =
              __float2bfloat16(code_f(buf[i][c / VPW], (c % VPW) * VB, VM) * sc + of);
      }
    }
  } else {
    // The chunk's own keys (rotated, bf16) and values; rows past the row's length are zero
    // (padding positions may hold anything, and 0 * NaN would poison the PV product).
    for (int e = tid; e < KT * (D / 8); e += NT) {
      const int kr = e / (D / 8), c = (e % (D / 8)) * 8, j = t0 + kr;
      uint4 kv = make_uint4(0u, 0u, 0u, 0u);
      if (j < Lb) kv = *reinterpret_cast<const uint4*>(kf + (fresh_base + j) * D + c);
      *reinterpret_cast<uint4*>(Ks + kr * KS + c) = kv;
    }
    for (int e = tid; e < KT * (D / 8); e += NT) {
      const int kr = e % KT, c = (e / KT) * 8, j = t0 + kr;
      uint4 vv = make_uint4(0u, 0u, 0u, 0u);
      if (j < Lb) vv = *reinterpret_cast<const uint4*>(vf + (fresh_base + j) * D + c);
      const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(&vv);
      #pragma unroll
      for (int i = 0; i < 8; ++i) Vt[(c + i) * VS + kr] = x[i];
    }
  }
  __syncthreads();
  if (tile + 1 < min(tile1, nh)) load_units((tile + 1) * KT);   // in flight during the MMAs

  // Scores of this warp's 16 positions against the tile's KT keys.
  float s[KT / 8][4];
  #pragma unroll
  for (int n = 0; n < KT / 8; ++n) {
    s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
    const __nv_bfloat16* krow = Ks + (n * 8 + gid) * KS + tig * 2;
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      mma_bf16(s[n], qa[kk], ld32(krow + kk * 16), ld32(krow + kk * 16 + 8));
  }
  // Masks: history keys past the row's history; own keys after the position or the row.
  float mx_a = NEG_INF, mx_b = NEG_INF;
  #pragma unroll
  for (int n = 0; n < KT / 8; ++n) {
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int t = t0 + n * 8 + tig * 2 + (e & 1);
      const int pos = e < 2 ? ia : ib;
      const bool ok = hist ? t < S : (t <= pos && t < Lb);
      if (!ok) s[n][e] = NEG_INF;
    }
    mx_a = fmaxf(mx_a, fmaxf(s[n][0], s[n][1]));
    mx_b = fmaxf(mx_b, fmaxf(s[n][2], s[n][3]));
  }
  mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
  mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
  mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
  mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
  const float mn_a = fmaxf(m_a, mx_a), mn_b = fmaxf(m_b, mx_b);
  // A row that has seen no key yet keeps max -inf: shift by 0 so exp gives 0, not NaN.
  const float sh_a = mn_a == NEG_INF ? 0.0f : mn_a, sh_b = mn_b == NEG_INF ? 0.0f : mn_b;
  const float c_a = __expf(m_a - sh_a), c_b = __expf(m_b - sh_b);
  m_a = mn_a; m_b = mn_b;
  l_a *= c_a; l_b *= c_b;
  #pragma unroll
  for (int n = 0; n < D / 8; ++n) { o[n][0] *= c_a; o[n][1] *= c_a; o[n][2] *= c_b; o[n][3] *= c_b; }
  unsigned int pa[KT / 16][4];
  #pragma unroll
  for (int n = 0; n < KT / 8; ++n) {
    const float p0 = __expf(s[n][0] - sh_a), p1 = __expf(s[n][1] - sh_a);
    const float p2 = __expf(s[n][2] - sh_b), p3 = __expf(s[n][3] - sh_b);
    l_a += p0 + p1; l_b += p2 + p3;
    // The score accumulator of keys n*8.. is the P operand's half (n % 2) of k-step n / 2.
    pa[n / 2][(n % 2) * 2] = pack_bf16(p0, p1);
    pa[n / 2][(n % 2) * 2 + 1] = pack_bf16(p2, p3);
  }
  #pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    const __nv_bfloat16* vrow = Vt + (n * 8 + gid) * VS + tig * 2;
    #pragma unroll
    for (int kk = 0; kk < KT / 16; ++kk)
      mma_bf16(o[n], pa[kk], ld32(vrow + kk * 16), ld32(vrow + kk * 16 + 8));
  }
}

l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
#pragma unroll
for (int half = 0; half < 2; ++half) {
  const int i = half ? ib : ia;
  if (i >= L) continue;
  const size_t r = ((size_t)b * HQ + h) * L + i;
  const float l = half ? l_b : l_a, m = half ? m_b : m_a;
  #pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    const int d = n * 8 + tig * 2;
    if (SPLIT) {
      part[(r * NS + split) * D + d] = o[n][half * 2];
      part[(r * NS + split) * D + d + 1] = o[n][half * 2 + 1];
    } else {
      put(out + r * D + d, o[n][half * 2] / l);
      put(out + r * D + d + 1, o[n][half * 2 + 1] / l);
    }
  }
  if (SPLIT && tig == 0) { ml[(r * NS + split) * 2] = m; ml[(r * NS + split) * 2 + 1] = l; }
}
"""


@lru_cache(maxsize=None)
def kernel():
    return mx.fast.cuda_kernel(
        name="orchard_packed_prefill",
        input_names=["q", "kf", "vf", "pool", "pages", "bounds", "dims"],
        output_names=["out", "part", "ml"], source=_SOURCE, header=_HEADER,
        ensure_row_contiguous=True)
