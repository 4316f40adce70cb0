"""The tiled packed decode kernel's CUDA source (its design and host side: packed_decode_v2.py).

It reads the layer's one pool (engine/kv/page_layout.py, addressed by CUDA_SECTIONS); the CPU
emulator (bench/cuda_emulate.py) runs it and `python -m bench.cuda_nvcc_check --only decode-v2`
compiles it. Where it was checked: docs/lab/engine-kernel-notes.md.
"""
from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from engine.attention.cuda.packed_write import QUANTIZE
from engine.attention.cuda.paged_decode import HEADER
from engine.attention.cuda.tile_helpers import (ACCUMULATORS, ASYNC, BLOCK_INDEX, DOT4,
                                                HELPERS, RESCALE, online_softmax, packed_pv,
                                                split_output)
from engine.kv.page_layout import CUDA_SECTIONS

_HEADER = HEADER + ASYNC + HELPERS + QUANTIZE

_SOURCE = """
constexpr int VB = KB;                       // equal key and value bits (`supports`)
""" + CUDA_SECTIONS + """
constexpr int NT = 128, NW = 4;              // launch_split's block: 4 warps
constexpr int KT = KB == 8 ? 32 : 64;        // keys per tile (int8: half, for shared memory)
constexpr int KPT = KT / 32;                 // keys per lane in the score pass
constexpr int LW = D * KB / 32;              // 32-bit words per packed row
constexpr int CPW = 32 / KB;                 // channels per word
constexpr int NG = D / 64;                   // scale/offset groups per row
constexpr int SW = LW / NW, SC = D / NW;     // score pass: warp w owns channel slice w
constexpr int KCB = LW == 8 ? 8 : 16;        // bytes per cp.async of a key row
constexpr int KS = LW + KCB / 4;             // padded K row stride: conflict-free column reads
constexpr int KCH = LW * 4 / KCB;            // cp.async pieces per K row
constexpr int NSUB = NT / LW;                // PV pass: thread = (word of the row, key subset)
constexpr int VPT = D / 32;                  // channels per lane (query rotation, own key)
constexpr int GP = (G + 3) / 4 * 4;
constexpr float TWO_KB = (float)(1 << KB);
// Shared memory, in 32-bit words. A stage = one tile: K codes [KT][KS], V codes [KT][LW],
// then ks, ko, vs, vo [4][KT][NG]. Two stages (the next tile lands while this one is used).
constexpr int V_OFF = KT * KS, M_OFF = V_OFF + KT * LW;
constexpr int STAGE = (M_OFF + 4 * KT * NG + 3) / 4 * 4;
constexpr int QS_OFF = 2 * STAGE;            // rotated, scaled queries [G][D]
constexpr int QSS_OFF = QS_OFF + G * D;      // their sums per slice [G][NW]
constexpr int SP_OFF = QSS_OFF + G * NW;     // slice partial scores [NW][G][KT]
constexpr int PW_OFF = SP_OFF + NW * G * KT; // p * vs * 2^KB [KT][NG][GP]
constexpr int ST_OFF = PW_OFF + KT * NG * GP;   // m, l, cf, pown [GP] each; ao [NG][GP]
constexpr int TOTAL = ST_OFF + 4 * GP + NG * GP;
static_assert(G >= 1 && G <= 8, "v2 packed decode: 1..8 query heads per KV head");
static_assert(SW >= 2 && NT % KT == 0 && KCH % (NT / KT) == 0 && (LW / 4) % (NT / KT) == 0
              && 4 % (NT / KT) == 0, "tile loads: each row's pieces split evenly over its threads");
static_assert(NW * G * D <= 2 * STAGE, "the final reduction reuses the stage buffers");
static_assert(PGW % 4 == 0 && VC_OFF % 4 == 0 && KS_OFF % 4 == 0 && LW % 4 == 0,
              "cp.async: 16-byte code pieces, 4*NG-byte group pieces aligned in every page (check_pool)");
__shared__ __align__(16) float smem[TOTAL];
float* const qs = smem + QS_OFF;
float* const qss = smem + QSS_OFF;
float* const sp = smem + SP_OFF;
float* const pw = smem + PW_OFF;
float* const st_m = smem + ST_OFF;
float* const st_l = st_m + GP;
float* const cf = st_l + GP;
float* const pown = cf + GP;
float* const st_ao = pown + GP;
""" + BLOCK_INDEX + """\
const int nh = n - 1;                        // of which packed history
// Splits start on tile boundaries, so only the row's last tile is partial.
const int per = (((n + NS - 1) / NS) + KT - 1) / KT * KT;
const int j0 = split * per, j1 = min(n, j0 + per);
const int hend = min(j1, nh);
const int ntile = hend > j0 ? (hend - j0 + KT - 1) / KT : 0;
const float sc = scale[0];
const unsigned int ONE = orch_one_bits(sc);  // 1.0f's bits for the codes (HELPERS)
const float NEG_INF = -__int_as_float(0x7f800000);
const size_t fresh = ((size_t)b * HKV + hk) * D;

auto row_of = [&](int j) -> size_t {         // packed row of key j: [page, slot, head]
  return ((size_t)pages[(size_t)b * P + j / PT] * PT + j % PT) * HKV + hk;
};
// Copy ownership: TPR threads copy row ir of every tile (its code pieces dealt out among them,
// and the four metadata groups one section each), so a thread looks its row's page up once a
// tile and every piece's address is the row's base plus a constant. (A lookup and a 64-bit
// address per piece took about half the page-key kernel's tile loop: bench.cuda_sass_loops.)
constexpr int TPR = NT / KT;                 // threads per row: 2 (int4), 4 (int8)
const int ir = tid / TPR, ih = tid % TPR;
auto issue = [&](int t) {                    // cp.async of tile t into stage t & 1
  const int j = j0 + t * KT + ir;
  if (j < hend) {
    const int slot = j % PT * HK + hk;       // the row's place in each section of its page
    const uint32_t* src = pool + (size_t)pages[(size_t)b * P + j / PT] * PGW;
    unsigned int* sk = reinterpret_cast<unsigned int*>(smem + (t & 1) * STAGE);
    #pragma unroll
    for (int i = 0; i < KCH / TPR; ++i) {
      const int c = i * TPR + ih;
      orch_cp_async<KCB>(sk + ir * KS + c * (KCB / 4), src + KC_OFF + slot * LW + c * (KCB / 4));
    }
    #pragma unroll
    for (int i = 0; i < LW / 4 / TPR; ++i) {
      const int c = i * TPR + ih;
      orch_cp_async<16>(sk + V_OFF + ir * LW + c * 4, src + VC_OFF + slot * LW + c * 4);
    }
    #pragma unroll
    for (int i = 0; i < 4 / TPR; ++i) {
      const int a = i * TPR + ih;
      const int off = a == 0 ? KS_OFF : a == 1 ? KO_OFF : a == 2 ? VS_OFF : VO_OFF;
      orch_cp_async<4 * NG>(smem + (t & 1) * STAGE + M_OFF + (a * KT + ir) * NG,
                            src + off + slot * NG);
    }
  }
  orch_cp_commit();
};
if (ntile > 0) issue(0);                     // the first tile lands while the queries rotate

// Queries in the keys' rotated basis, in-kernel (the v1 kernel took rotate(q), 3 more MLX ops
// per layer and step): signs, then the Sylvester-order Walsh-Hadamard transform as in
// cuda/packed_write.py (registers, then lanes), scaled by D^-1/2 and the softmax scale.
for (int h = warp; h < G; h += NW) {
  const size_t qrow = ((size_t)(b * HQ + hk * G + h)) * D;
  float x[VPT];
  #pragma unroll
  for (int i = 0; i < VPT; ++i) x[i] = to_f(q[qrow + lane * VPT + i]) * signs[lane * VPT + i];
  #pragma unroll
  for (int s = 1; s < VPT; s <<= 1) {
    #pragma unroll
    for (int i = 0; i < VPT; ++i) {
      if (!(i & s)) { const float a = x[i], c = x[i + s]; x[i] = a + c; x[i + s] = a - c; }
    }
  }
  #pragma unroll
  for (int s = 1; s < 32; s <<= 1) {
    #pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const float o = __shfl_xor_sync(0xffffffff, x[i], s);
      x[i] = (lane & s) ? o - x[i] : x[i] + o;
    }
  }
  const float norm = rsqrtf((float)D);
  float part_sum = 0.0f;
  #pragma unroll
  for (int i = 0; i < VPT; ++i) {
    x[i] = x[i] * norm * sc;
    qs[h * D + lane * VPT + i] = x[i];
    part_sum += x[i];
  }
  // A slice is SC = 8 * VPT channels: lanes 8s..8s+7.
  #pragma unroll
  for (int o = 1; o < 8; o <<= 1) part_sum += __shfl_xor_sync(0xffffffff, part_sum, o);
  if ((lane & 7) == 0) qss[h * NW + lane / 8] = part_sum;
}
if (tid < GP) { st_m[tid] = NEG_INF; st_l[tid] = 0.0f; }
if (tid < NG * GP) st_ao[tid] = 0.0f;

// PV ownership: word pk of a row (CPW channels from c0, group pg) for keys sub, sub + NSUB, ...
const int pk = tid % LW, sub = tid / LW, c0 = pk * CPW, pg = c0 / 64;
""" + ACCUMULATORS + """\

for (int t = 0; t < ntile; ++t) {
  orch_cp_wait_all();
  __syncthreads();                           // tile t landed; tile t - 1's PV pass is done
  if (t + 1 < ntile) issue(t + 1);           // prefetch into the stage tile t - 1 used
  const int cnt = min(KT, hend - (j0 + t * KT));
  const unsigned int* sk = reinterpret_cast<const unsigned int*>(smem + (t & 1) * STAGE);
  const unsigned int* sv = sk + V_OFF;
  const float* meta = smem + (t & 1) * STAGE + M_OFF;   // ks, ko, vs, vo: [4][KT][NG]

  // 1. Scores: warp w = channel slice w (inside one group), lane = key, every query head.
  // Partial of group g over the slice: q . c = 2^KB (q . c' - sum q) for c' = 1 + c / 2^KB,
  // so s_g (q . c) + o_g sum(q) = (2^KB s_g) (q . c') + (o_g - 2^KB s_g) sum(q); queries are
  // read from shared memory as broadcasts (every lane the same address).
  {
    const int sl = warp, grp = sl * SC / 64;
    unsigned int wd[KPT][SW];
    float dot[KPT][G];
    #pragma unroll
    for (int i = 0; i < KPT; ++i) {
      orch_load_words<SW>(sk + (lane + 32 * i) * KS + sl * SW, wd[i]);
      #pragma unroll
      for (int h = 0; h < G; ++h) dot[i][h] = 0.0f;
    }
    #pragma unroll
    for (int k = 0; k < SW; ++k) {
      #pragma unroll
      for (int e = 0; e < CPW; e += 4) {
        const float* qp = qs + sl * SC + k * CPW + e;
        float4 qv[G];
        #pragma unroll
        for (int h = 0; h < G; ++h) qv[h] = *reinterpret_cast<const float4*>(qp + h * D);
        #pragma unroll
        for (int i = 0; i < KPT; ++i) {
          const float x0 = orch_code1<KB>(wd[i][k], e, ONE);
          const float x1 = orch_code1<KB>(wd[i][k], e + 1, ONE);
          const float x2 = orch_code1<KB>(wd[i][k], e + 2, ONE);
          const float x3 = orch_code1<KB>(wd[i][k], e + 3, ONE);
""" + DOT4 + """\
        }
      }
    }
    #pragma unroll
    for (int i = 0; i < KPT; ++i) {
      const int r = lane + 32 * i;
      const float S = meta[r * NG + grp] * TWO_KB;
      const float O = meta[(KT + r) * NG + grp] - S;
      #pragma unroll
      for (int h = 0; h < G; ++h) sp[(sl * G + h) * KT + r] = fmaf(dot[i][h], S, qss[h * NW + sl] * O);
    }
  }
  __syncthreads();

  // 2. One online-softmax step per tile and head (warp h): tile max, rescale factor, p.
  // PV weights pw = p * vs * 2^KB per (key, group, head); the constant part of every value of a
  // group, sum_j p_j (vo_j - 2^KB vs_j), goes into the head's group term ao.
""" + online_softmax("NW", """\
    #pragma unroll
    for (int g = 0; g < NG; ++g) {
      const float vsg = meta[(2 * KT + r) * NG + g] * TWO_KB;
      pw[(r * NG + g) * GP + h] = valid ? p * vsg : 0.0f;   // never stale data times 0
      if (valid) pvo[g] += p * (meta[(3 * KT + r) * NG + g] - vsg);
    }
""") + """
  __syncthreads();

  // 3. PV: lanes over a row's words (a warp reads whole rows: no bank conflicts), each thread
  // every head for its CPW channels over the keys of its subset; all subsets share the block's
  // running max, so they are simply summed at the end.
""" + RESCALE + packed_pv("LW", "KB") + """\
}
__syncthreads();                             // stages, pw and state free / final

// The step's own key (last of the row), in the block whose range holds it: full precision,
// model basis, against the unrotated query (as the direct path and the v1 kernel do).
if (j0 <= nh && nh < j1) {
  for (int h = warp; h < G; h += NW) {
    const size_t qrow = ((size_t)(b * HQ + hk * G + h)) * D;
    float d_ = 0.0f;
    #pragma unroll
    for (int i = 0; i < VPT; ++i)
      d_ += to_f(q[qrow + lane * VPT + i]) * to_f(kf[fresh + lane * VPT + i]);
    const float s = orch_warp_sum(d_) * sc;
    const float m_old = st_m[h], m_new = fmaxf(m_old, s);
    const float c = __expf(m_old - m_new), p = __expf(s - m_new);
    __syncwarp();
    if (lane == 0) {
      st_l[h] = st_l[h] * c + p;
      st_m[h] = m_new;
      cf[h] = c;
      pown[h] = p;
      #pragma unroll
      for (int g = 0; g < NG; ++g) st_ao[g * GP + h] *= c;
    }
  }
  __syncthreads();
  #pragma unroll
  for (int h = 0; h < G; ++h) {
    const float ch = cf[h], ph = sub == 0 ? pown[h] : 0.0f;
    #pragma unroll
    for (int i = 0; i < CPW; ++i) acc[h][i] = fmaf(acc[h][i], ch, ph * to_f(vf[fresh + c0 + i]));
  }
}

// The block's output or partial (tile_helpers.split_output: one text with the page-key kernel).
""" + split_output("LW") + """
// OWN: the step's own key and value (the row's last, position nh) are quantized and stored
// into the pool, word for word as the write kernel (cuda/packed_write.py) would: split 0's
// warp 0 takes this head's key, warp 1 its value. The pool is an MLX input, written behind
// MLX's back; no block of this launch reads that row (every history range ends before nh).
// Last in the kernel: placed first, it raised ptxas's count to 128 registers from 96 (int4,
// head dim 128), one block less per SM.
if (OWN && split == 0 && warp < 2) {
  float x[VPT];
  #pragma unroll
  for (int i = 0; i < VPT; ++i) x[i] = to_f((warp == 0 ? kf : vf)[fresh + lane * VPT + i]);
  unsigned int word;
  float qsc, qlo;
  orch_quantize<D, KB>(x, warp == 0, signs, lane, word, qsc, qlo);
  const size_t r = row_of(nh);
  uint32_t* const dst = const_cast<uint32_t*>(pool);
  const int c = lane * VPT;
  if (c % CPW == 0) dst[sec(r, warp == 0 ? KC_OFF : VC_OFF, LW) + c / CPW] = word;
  if (c % 64 == 0) {
    dst[sec(r, warp == 0 ? KS_OFF : VS_OFF, NG) + c / 64] = __float_as_uint(qsc);
    dst[sec(r, warp == 0 ? KO_OFF : VO_OFF, NG) + c / 64] = __float_as_uint(qlo);
  }
}
"""


@lru_cache(maxsize=None)
def kernel(own: bool = False):
    """The kernel; `own`: the variant that also stores the step's own rows into the pool (its
    template's OWN, set by the caller; one source, so the two agree in everything else)."""
    return mx.fast.cuda_kernel(
        name="orchard_packed_decode_v2" + ("_own" if own else ""),
        input_names=["q", "kf", "vf", "pool", "pages", "ends", "dims", "scale", "signs"],
        output_names=["out", "part", "ml"], source=_SOURCE, header=_HEADER,
        ensure_row_contiguous=True)
