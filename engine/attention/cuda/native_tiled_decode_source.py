"""The tiled native decode kernel's CUDA source (its design and host side:
native_tiled_decode.py).

Inputs and outputs are the native walk kernel's OWN contract (cuda/paged_decode.py `_NATIVE`
with `_OWN`): q [B, HQ, D], head-major bf16 pages kp / vp [HKV, NP, PT, D], page tables, row
lengths, dims (HQ, HKV, NP, P), scale and, with OWN, the step's own keys and values kn / vn
[B, HKV, D]; outputs out / part / ml in BLOCK_MERGE's format, so launch_split and the merge
kernel serve it unchanged. The CPU emulator (bench/cuda_emulate_native_tiled.py) runs it and
`python -m bench.cuda_nvcc_check --only native-tiled` compiles it.
"""
from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from engine.attention.cuda.paged_decode import HEADER
from engine.attention.cuda.tile_helpers import (ASYNC, BLOCK_INDEX, HELPERS, online_softmax,
                                               split_output)

_HEADER = HEADER + ASYNC + HELPERS

_SOURCE = """
constexpr int NT = 128, NW = 4;              // launch_split's block: 4 warps
// Keys per tile: 16 KB of K and V per stage at either head size, and the shared total (two
// stages, queries, scores, weights) under the 48 KB of static shared memory.
constexpr int KT = D == 64 ? 64 : 32;
constexpr int KPT = KT / 32;                 // keys per lane in the softmax pass
constexpr int KSW = D / 2 + 4;               // K / V row stride in words: 16 bytes of padding
                                             // spread the rows over the banks
constexpr int RPC = D / 8;                   // 16-byte pieces per row
constexpr int CPW = 8;                       // channels per piece (split_output)
constexpr int NSL = NT / KT;                 // score pass: thread = (key, channel slice)
constexpr int SC = D / NSL;                  // channels per slice
constexpr int NSUB = NT / RPC;               // PV pass: thread = (piece of a row, key subset)
constexpr int GP = (G + 3) / 4 * 4;
constexpr int STAGE = 2 * KT * KSW;          // words: K rows, then V rows
constexpr int QS_OFF = 2 * STAGE;            // scaled queries [G][D] (floats)
constexpr int SP_OFF = QS_OFF + G * D;       // slice partial scores [NSL][G][KT]
constexpr int PW_OFF = SP_OFF + NSL * G * KT;   // softmax weights [KT][GP]
constexpr int ST_OFF = PW_OFF + KT * GP;     // m, l, cf [GP] each
constexpr int TOTAL = ST_OFF + 3 * GP;
static_assert(G >= 1 && G <= 8, "native tiled decode: 1..8 query heads per KV head");
static_assert(D == 64 || D == 128, "native tiled decode: head dim 64 or 128");
static_assert(sizeof(TK) == 2, "native tiled decode: bfloat16 pages");
static_assert(SC % 8 == 0 && RPC <= 32 && KT % NSUB == 0, "tile geometry");
static_assert(NW * G * D <= 2 * STAGE, "the final reduction reuses the stage buffers");
__shared__ __align__(16) float smem[TOTAL];
unsigned int* const words = reinterpret_cast<unsigned int*>(smem);
float* const qs = smem + QS_OFF;
float* const sp = smem + SP_OFF;
float* const pw = smem + PW_OFF;
float* const st_m = smem + ST_OFF;
float* const st_l = st_m + GP;
float* const cf = st_l + GP;
""" + BLOCK_INDEX + """\
const int NP = dims[3];                      // dims: HQ, HKV, P, NP (BLOCK_INDEX reads 3)
// Splits start on tile boundaries; a row shorter than the split plan's range leaves the
// later splits empty (their partial's max is -inf, which the merge skips).
const int per = (((n + NS - 1) / NS) + KT - 1) / KT * KT;
const int j0 = split * per, j1 = min(n, j0 + per);
const int ntile = j1 > j0 ? (j1 - j0 + KT - 1) / KT : 0;
const float NEG_INF = -__int_as_float(0x7f800000);
const size_t own = ((size_t)b * HKV + hk) * D;

// Element offset of key j's row in kp / vp, or -1 for the step's own key under OWN: its page
// slot holds nothing valid yet, the key comes from kn / vn.
auto row_at = [&](int j) -> long long {
  if (OWN && j == n - 1) return -1;
  const int page = pages[(size_t)b * P + j / PT];
  return (((long long)hk * NP + page) * PT + j % PT) * D;
};
// Copy ownership: TPR threads copy row ir of every tile (its 16-byte pieces dealt out among
// them), so a thread looks its row's page up once a tile, not once a piece (a lookup and a
// 64-bit address per piece were about a third of the tile loop: bench.cuda_sass_loops).
constexpr int TPR = NT / KT;                 // threads per row: 2 (head dim 64), 4 (128)
static_assert(NT % KT == 0 && RPC % TPR == 0, "tile loads: a row's pieces split evenly");
auto issue = [&](int t) {                    // cp.async of tile t into stage t & 1
  const int ir = tid / TPR, ih = tid % TPR;
  const int j = j0 + t * KT + ir;
  if (j < j1) {
    unsigned int* const sk = words + (t & 1) * STAGE;
    const long long at = row_at(j);
    const TK* ksrc = at < 0 ? kn + own : kp + at;
    const TK* vsrc = at < 0 ? vn + own : vp + at;
    #pragma unroll 2                         // fully: 16-32 more registers, fewer blocks an SM
    for (int i = 0; i < RPC / TPR; ++i) {
      const int c = i * TPR + ih;
      orch_cp_async<16>(sk + ir * KSW + c * 4, ksrc + c * 8);
      orch_cp_async<16>(sk + (KT + ir) * KSW + c * 4, vsrc + c * 8);
    }
  }
  orch_cp_commit();
};
if (ntile > 0) issue(0);                     // the first tile lands while the queries load

for (int e = tid; e < G * D; e += NT)
  qs[e] = to_f(q[((size_t)(b * HQ + hk * G)) * D + e]) * scale[0];
if (tid < GP) { st_m[tid] = NEG_INF; st_l[tid] = 0.0f; }
if (OWN && split == 0) {
  // The write MLX does not know of (kp / vp are its inputs): no block reads this slot (row_at
  // sends key n - 1 to kn / vn), so it races with no read.
  const int pos = n - 1;
  const size_t slot = (((size_t)hk * NP + pages[(size_t)b * P + pos / PT]) * PT + pos % PT) * D;
  for (int e = tid; e < D; e += NT) {
    const_cast<TK*>(kp)[slot + e] = kn[own + e];
    const_cast<TK*>(vp)[slot + e] = vn[own + e];
  }
}

// PV ownership: piece pk of a value row (8 channels from c0) for keys sub, sub + NSUB, ...
const int pk = tid % RPC, sub = tid / RPC, c0 = pk * 8;
float acc[G][8];
#pragma unroll
for (int h = 0; h < G; ++h) {
  #pragma unroll
  for (int i = 0; i < 8; ++i) acc[h][i] = 0.0f;
}
// Score ownership: key kr of the tile, channels sl * SC .. (queries read as broadcasts).
const int kr = tid % KT, sl = tid / KT;

for (int t = 0; t < ntile; ++t) {
  orch_cp_wait_all();
  __syncthreads();                           // tile t landed; tile t - 1's PV pass is done
  if (t + 1 < ntile) issue(t + 1);           // prefetch into the stage tile t - 1 used
  const int cnt = min(KT, j1 - (j0 + t * KT));
  const unsigned int* const sk = words + (t & 1) * STAGE;

  // 1. Scores: one key per thread over its channel slice, every query head. Rows past cnt hold
  // stale words; their scores are never read.
  {
    float dot[G];
    #pragma unroll
    for (int h = 0; h < G; ++h) dot[h] = 0.0f;
    #pragma unroll
    for (int u = 0; u < SC / 8; ++u) {
      const int ch = sl * SC + 8 * u;
      const uint4 kw = *reinterpret_cast<const uint4*>(sk + kr * KSW + ch / 2);
      const float x[8] = {__uint_as_float(kw.x << 16), __uint_as_float(kw.x & 0xffff0000u),
                          __uint_as_float(kw.y << 16), __uint_as_float(kw.y & 0xffff0000u),
                          __uint_as_float(kw.z << 16), __uint_as_float(kw.z & 0xffff0000u),
                          __uint_as_float(kw.w << 16), __uint_as_float(kw.w & 0xffff0000u)};
      #pragma unroll
      for (int h = 0; h < G; ++h) {
        const float4 qa = *reinterpret_cast<const float4*>(qs + h * D + ch);
        const float4 qb = *reinterpret_cast<const float4*>(qs + h * D + ch + 4);
        dot[h] = fmaf(qa.x, x[0], dot[h]); dot[h] = fmaf(qa.y, x[1], dot[h]);
        dot[h] = fmaf(qa.z, x[2], dot[h]); dot[h] = fmaf(qa.w, x[3], dot[h]);
        dot[h] = fmaf(qb.x, x[4], dot[h]); dot[h] = fmaf(qb.y, x[5], dot[h]);
        dot[h] = fmaf(qb.z, x[6], dot[h]); dot[h] = fmaf(qb.w, x[7], dot[h]);
      }
    }
    #pragma unroll
    for (int h = 0; h < G; ++h) sp[(sl * G + h) * KT + kr] = dot[h];
  }
  __syncthreads();

  // 2. The tile's online-softmax step, warp h for head h: weights p in pw, rescale factor cf
  // (tile_helpers.online_softmax without value-group terms: bf16 values have no offsets).
""" + online_softmax("NSL", "    pw[r * GP + h] = p;\n", value_groups=False) + """\
  __syncthreads();

  // 3. PV: lanes over a value row's pieces, every head for the piece's 8 channels. Rows past
  // cnt are skipped, not weighted by 0: stale words may be NaN bit patterns.
  #pragma unroll
  for (int h = 0; h < G; ++h) {
    const float ch = cf[h];
    #pragma unroll
    for (int i = 0; i < 8; ++i) acc[h][i] *= ch;
  }
  #pragma unroll
  for (int u = 0; u < KT / NSUB; ++u) {
    const int r = sub + u * NSUB;
    if (r >= cnt) break;
    const uint4 vw = *reinterpret_cast<const uint4*>(sk + (KT + r) * KSW + c0 / 2);
    const float x[8] = {__uint_as_float(vw.x << 16), __uint_as_float(vw.x & 0xffff0000u),
                        __uint_as_float(vw.y << 16), __uint_as_float(vw.y & 0xffff0000u),
                        __uint_as_float(vw.z << 16), __uint_as_float(vw.z & 0xffff0000u),
                        __uint_as_float(vw.w << 16), __uint_as_float(vw.w & 0xffff0000u)};
    #pragma unroll
    for (int h = 0; h < G; ++h) {
      const float p = pw[r * GP + h];
      #pragma unroll
      for (int i = 0; i < 8; ++i) acc[h][i] = fmaf(p, x[i], acc[h][i]);
    }
  }
}
__syncthreads();                             // stages free: the reduction reuses them

// The key subsets of a warp by shuffles, the warps through shared memory; then the block's
// output (one split) or its partial (BLOCK_MERGE's format).
""" + split_output("RPC", value_groups=False)

INPUTS = ["q", "kp", "vp", "pages", "ends", "dims", "scale"]
OWN_INPUTS = ["kn", "vn"]
OUTPUTS = ["out", "part", "ml"]


# The plain variant's body names kn / vn in branches it never takes (row_at gives -1 only
# under OWN); null pointers keep one text for both.
_NO_OWN = "const TK* const kn = nullptr;\nconst TK* const vn = nullptr;\n"


def source(own: bool) -> str:
    """The kernel body of the OWN (`own`) or the plain variant."""
    return _SOURCE if own else _NO_OWN + _SOURCE


def name(own: bool) -> str:
    """The kernel's name (the emulator and nvcc check use the same)."""
    return "orchard_native_tiled_decode" + ("_own" if own else "")


@lru_cache(maxsize=None)
def kernel(own: bool):
    """The kernel (template: D, G, PT, TQ, TK, OWN; SPLIT and TO from launch_split)."""
    return mx.fast.cuda_kernel(
        name=name(own), input_names=INPUTS + (OWN_INPUTS if own else []),
        output_names=OUTPUTS, source=source(own), header=_HEADER, ensure_row_contiguous=True)
