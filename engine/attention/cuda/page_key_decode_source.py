"""The page-key decode kernel's CUDA source (its design and host side: page_key_decode.py).

It reads the layer's one pool (engine/kv/page_layout.py) with page-key widths: key codes of KB
bits (4, or 6 packed 4 codes to 3 bytes), key metadata D/PT words per row (token j of a page
carries channels j*D/PT.. of the page's per-channel scales and offsets: page_quant.meta_rows),
4-bit values in 64-channel groups. The CPU emulator (bench/cuda_emulate.py, `page_key_decode`)
runs it and `python -m bench.cuda_nvcc_check --only page-key` compiles it.
"""
from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from engine.attention.cuda import page_key_write_row
from engine.attention.cuda.paged_decode import HEADER
from engine.attention.cuda.tile_helpers import (ACCUMULATORS, ASYNC, BLOCK_INDEX, DOT4,
                                                HELPERS, MMA, RESCALE, native_key_scores,
                                                online_softmax, packed_pv, split_output)

# A code of KB bits at channel cc of a run of words (little-end first, as page_quant packs
# 6-bit codes: 4 codes to 3 bytes is the same bit stream), as the float 1 + c / 2^KB (see
# orch_code1). A 6-bit code may straddle two words; with cc a compile-time constant after
# unrolling, the branch and indices fold away.
PAGE_KEY_HELPERS = """
template <int KB>
__device__ __forceinline__ float orch_code_at(const unsigned int* w, int cc, unsigned int one) {
  constexpr int TOP = 23 - KB;
  const int bit = cc * KB, wi = bit / 32, sh = bit % 32;
  const unsigned int x = sh + KB <= 32 ? (w[wi] >> sh) : ((w[wi] >> sh) | (w[wi + 1] << (32 - sh)));
  return __uint_as_float(((x & ((1u << KB) - 1u)) << TOP) | one);
}
"""

_HEADER = HEADER + ASYNC + MMA + HELPERS + PAGE_KEY_HELPERS

_SOURCE = """
constexpr int VB = 4;                        // values: token-local int4, 64-channel groups
// The pool's page: k_codes | v_codes | k_scales | k_offsets | v_scales | v_offsets, each
// token-major [PT][HK][width] words (page_layout.PageLayout; page_key_decode.check_layout).
constexpr int RPP = PT * HK;
constexpr int LW = D * KB / 32;              // key code words per row
constexpr int VW = D * VB / 32;              // value code words per row
constexpr int NGK = D / PT;                  // key metadata words per row (of its page's D)
constexpr int NG = D / 64;                   // value groups per row
constexpr int KC_OFF = 0, VC_OFF = RPP * LW, KS_OFF = VC_OFF + RPP * VW;
constexpr int KO_OFF = KS_OFF + RPP * NGK, VS_OFF = KO_OFF + RPP * NGK;
constexpr int VO_OFF = VS_OFF + RPP * NG, PGW = VO_OFF + RPP * NG;
constexpr int NT = 128, NW = 4;              // launch_split's block: 4 warps
constexpr int KT = 64;                       // keys per tile: whole pages (PT divides it)
constexpr int KPT = KT / 32;                 // keys per lane in the score pass
constexpr int CPW = 32 / VB;                 // value channels per word
constexpr int SW = LW / NW, SC = D / NW;     // score pass: warp w owns channel slice w
// Bytes per cp.async of key codes: the widest piece a warp's channel slice (SW words) keeps
// aligned, or with WKC 16 wherever a row's codes are whole 16-byte pieces in pairs (6-bit keys
// at head dim 128: 6 pieces of 16 bytes, not 12 of 8, through L2 only; the score pass's 8-byte
// loads of its slice then meet 2-way bank conflicts: KS is 28 words, not 26) and the wider
// rows fit 48 KB of shared memory (up to 4 query heads a KV head; 8 would pass it by 160 bytes).
constexpr int KCB = (WKC && LW % 8 == 0 && G <= 4) || SW % 4 == 0 ? 16 : SW % 2 == 0 ? 8 : 4;
constexpr int KS = LW + KCB / 4;             // padded key row stride (odd in KCB units)
constexpr int KCH = LW * 4 / KCB;            // cp.async pieces per key row
constexpr int MCW = NGK < 4 ? NGK : 4;       // words per cp.async piece of key metadata
constexpr int MCH = NGK / MCW;
constexpr int NSUB = NT / VW;                // PV pass: thread = (word of the row, key subset)
constexpr int VPT = D / 32;                  // channels per lane (queries, native keys)
constexpr int GP = (G + 3) / 4 * 4;
constexpr float TWO_KB = (float)(1 << KB), TWO_VB = (float)(1 << VB);
// Shared memory, in 32-bit words. A stage = one tile: key codes [KT][KS], value codes [KT][VW],
// key metadata [2][KT/PT][D] (scale, offset of every channel of each page: row r of the tile
// lands at r * NGK, which is channel j*NGK.. of page r / PT), value metadata [2][KT][NG].
constexpr int V_OFF = KT * KS, KM_OFF = V_OFF + KT * VW, VM_OFF = KM_OFF + 2 * KT * NGK;
constexpr int STAGE = (VM_OFF + 2 * KT * NG + 3) / 4 * 4;
constexpr int QS_OFF = 2 * STAGE;            // scaled queries [G][D]
constexpr int SP_OFF = QS_OFF + G * D;       // slice partial scores [NW][G][KT]
constexpr int PW_OFF = SP_OFF + NW * G * KT; // PV weights [KT][NG][GP]
constexpr int ST_OFF = PW_OFF + KT * NG * GP;   // m, l, cf [GP] each; ao [NG][GP]
constexpr int TOTAL = ST_OFF + 3 * GP + NG * GP;
static_assert(G >= 1 && G <= 8, "page-key decode: 1..8 query heads per KV head");
static_assert(KB == 4 || KB == 6, "page-key decode: 4- or 6-bit keys");
static_assert(KT % PT == 0 && D % PT == 0 && PT >= 16, "pages of 16..64 tokens dividing D");
static_assert(SC % 4 == 0 && SW * 32 == SC * KB, "a channel slice is whole words");
static_assert(NW * G * D <= 2 * STAGE, "the final reduction reuses the stage buffers");
static_assert(NT == 2 * KT && KCH % 2 == 0 && VW % 8 == 0, "issue: a thread pair a row");
static_assert(PGW % 4 == 0 && VC_OFF % 4 == 0 && KS_OFF % 4 == 0 && VS_OFF % NG == 0,
              "cp.async: pieces aligned in every page (page_key_decode.check_layout)");
__shared__ __align__(16) float smem[TOTAL];
float* const qs = smem + QS_OFF;
float* const sp = smem + SP_OFF;
float* const pw = smem + PW_OFF;
float* const st_m = smem + ST_OFF;
float* const st_l = st_m + GP;
float* const cf = st_l + GP;
float* const st_ao = cf + GP;
""" + BLOCK_INDEX + """\
const int nh = n - 1;                        // history before it
const int nfull = nh / PT * PT;              // of which in full pages (codes); the rest: tail
// Splits start on tile boundaries (so on page boundaries), so only the last code tile of a
// row is partial and it still ends on a page boundary.
const int per = (((n + NS - 1) / NS) + KT - 1) / KT * KT;
const int j0 = split * per, j1 = min(n, j0 + per);
const int hend = min(j1, nfull);
const int ntile = hend > j0 ? (hend - j0 + KT - 1) / KT : 0;
const float NEG_INF = -__int_as_float(0x7f800000);
const unsigned int ONE = orch_one_bits(scale[0]);   // 1.0f's bits for the codes (HELPERS)
const size_t fresh = ((size_t)b * HKV + hk) * D;
// Copy ownership: thread pair (2r, 2r + 1) copies row r = ir of every tile (key codes and value
// codes split between the pair, scales by one and offsets by the other), so a thread looks up
// its row's page once a tile and every piece's address is that page's base plus a constant.
// Tiles start on page boundaries, so a row's slot in its page is the same in every tile.
// (One lookup and address per piece cost ~1,450 instructions a thread a tile at head dim 128:
// half the loop; SASS in docs/lab/benchmarks-kv-page-keys.md.)
const int ir = tid >> 1, ih = tid & 1;
const int irow = (ir % PT) * HK + hk;        // the row's place in each section of its page
auto issue = [&](int t) {                    // cp.async of tile t into stage t & 1
  const int base = j0 + t * KT;
  if (ir < hend - base) {
    const uint32_t* src = pool + (size_t)pages[(size_t)b * P + (base + ir) / PT] * PGW;
    float* st = smem + (t & 1) * STAGE;
    unsigned int* sk = reinterpret_cast<unsigned int*>(st);
    #pragma unroll
    for (int i = 0; i < KCH / 2; ++i) {
      const int c = 2 * i + ih;
      orch_cp_async<KCB>(sk + ir * KS + c * (KCB / 4), src + KC_OFF + irow * LW + c * (KCB / 4));
    }
    #pragma unroll
    for (int i = 0; i < VW / 8; ++i) {
      const int c = 2 * i + ih;
      orch_cp_async<16>(sk + V_OFF + ir * VW + c * 4, src + VC_OFF + irow * VW + c * 4);
    }
    const int km_off = ih ? KO_OFF : KS_OFF, vm_off = ih ? VO_OFF : VS_OFF;
    #pragma unroll
    for (int c = 0; c < MCH; ++c)
      orch_cp_async<4 * MCW>(st + KM_OFF + (ih * KT + ir) * NGK + c * MCW,
                             src + km_off + irow * NGK + c * MCW);
    orch_cp_async<4 * NG>(st + VM_OFF + (ih * KT + ir) * NG, src + vm_off + irow * NG);
  }
  orch_cp_commit();
};
if (ntile > 0) issue(0);                     // the first tile lands while the queries load

// OWN: this step's own row stored by this launch (page_key_decode.py, `tail_write`), by warp 0
// of the row's first split, with the write kernel's device function (page_key_write_row.py):
// its value record and tail row in place, and its page's key codes when it fills the page.
// Nothing this launch reads is written: attention takes the row's partial page from its tail
// rows before it (tslot, as the step began) and its own key from kf; a new page's slot was no
// row's when the step began (engine/kv/tails.py). So it runs after the first tile's copies were
// issued, which read only full pages (never this row's), and the copies land meanwhile.
__shared__ unsigned char wcodes[OWN ? D : 1];
if (OWN && split == 0 && warp == 0) {
  const int pos = n - 1, wpg = pages[(size_t)b * P + pos / PT], wo = pos % PT;
  const size_t src = (size_t)max(tslot[b], 0) * PT * HKV * D + (size_t)hk * D + lane * VPT;
  auto key = [&](int t, int i) -> float {   // token t of the page: the tail's, or this row's
    return t == wo ? to_f(kf[fresh + lane * VPT + i]) : to_f(kt[src + (size_t)t * HKV * D + i]);
  };
  orch_page_key_write_row<D, PT, HK, KB>(kf + fresh, vf + fresh, const_cast<uint32_t*>(pool),
                                         const_cast<TT*>(kt), const_cast<TT*>(vt), wpg, wo, hk,
                                         tw[b], key, wcodes, lane);
}

// Queries scaled by the softmax scale, unrotated (page-key formats store keys unrotated).
for (int e = tid; e < G * D; e += NT)
  qs[e] = to_f(q[((size_t)(b * HQ + hk * G)) * D + e]) * scale[0];
if (tid < GP) { st_m[tid] = NEG_INF; st_l[tid] = 0.0f; }
if (tid < NG * GP) st_ao[tid] = 0.0f;
// MMA: the lane's query fragments (B, head lane / 4: zero past G), once a block, as fp16 pairs
// in the channel order of the score pass.
unsigned int qf[MMA ? D / 8 : 1];
if (MMA && ntile > 0) {
  __syncthreads();                           // qs written
  const int h = lane >> 2;
  #pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const float4 x = h < G ? *reinterpret_cast<const float4*>(qs + h * D + 16 * kk + 4 * (lane & 3))
                           : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    qf[2 * kk] = orch_half2(x.x, x.y);
    qf[2 * kk + 1] = orch_half2(x.z, x.w);
  }
}

// PV ownership: word pk of a value row (CPW channels from c0, group pg) for keys sub, sub +
// NSUB, ... of a tile.
const int pk = tid % VW, sub = tid / VW, c0 = pk * CPW, pg = c0 / 64;
""" + ACCUMULATORS + """\

// One online-softmax step (tile_helpers.online_softmax) over `slices` slices of scores, keys
// r < cnt. `quantized`: PV weights p * vs * 2^VB per (key, group, head) and each group's
// constant term into ao (packed values); otherwise p per (key, head) in pw[r * GP + h] (native
// values). v2's step is the same text with its packed weights.
auto softmax_step = [&](int cnt, int slices, bool quantized, const float* vmeta) {
""" + online_softmax("slices", """\
    if (quantized) {
      #pragma unroll
      for (int g = 0; g < NG; ++g) {
        const float vsg = vmeta[r * NG + g] * TWO_VB;
        pw[(r * NG + g) * GP + h] = valid ? p * vsg : 0.0f;   // never stale data times 0
        if (valid) pvo[g] += p * (vmeta[(KT + r) * NG + g] - vsg);
      }
    } else {
      pw[r * GP + h] = p;
    }
""") + """
};
auto rescale = [&]() {
""" + RESCALE + """\
};

for (int t = 0; t < ntile; ++t) {
  orch_cp_wait_all();
  __syncthreads();                           // tile t landed; tile t - 1's PV pass is done
  if (t + 1 < ntile) issue(t + 1);           // prefetch into the stage tile t - 1 used
  const int cnt = min(KT, hend - (j0 + t * KT));
  float* const stage = smem + (t & 1) * STAGE;
  float* const km = stage + KM_OFF;          // [2][KT / PT][D]
  // Key metadata as the score pass wants it: with c' = 1 + c / 2^KB, a key channel is
  // c * s + o = c' * (2^KB s) + (o - 2^KB s): one FMA per (key, channel), shared by all heads.
  for (int e = tid; e < cnt * NGK; e += NT) {
    const float S = km[e] * TWO_KB;
    km[e] = S;
    km[KT * NGK + e] -= S;
  }
  __syncthreads();

  // 1. Scores. MMA: on tensor cores, warp w = keys 16w.. of the tile (one page: PT >= 16),
  // every channel and head (orch_mma_f16: A = the keys dequantized in fp32 and rounded to fp16,
  // B = the block's query fragments qf). The mma's 16 reduction columns of step kk are channels
  // 16 kk + 4 (lane % 4) + {0, 1, 2, 3} in the lane's four A / B places, so a lane's codes of a
  // row are one run of 4 KB bits (one funnel shift). Rows past cnt read stale codes and
  // metadata: their scores (their own output rows) are never read.
  if (MMA) {
    const unsigned int* sk = reinterpret_cast<const unsigned int*>(stage);
    const int r0 = 16 * warp + (lane >> 2), qt = lane & 3;
    const float* const ks = km + (16 * warp / PT) * D + 4 * qt;
    const float* const ko = ks + KT * NGK;
    // The lane's run starts bit 4 qt KB into each 16-channel step's KB / 2 words.
    const int lw = (4 * qt * KB) >> 5, sh = (4 * qt * KB) & 31;
    const unsigned int* const w0 = sk + r0 * KS + lw;
    float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const float4 S = *reinterpret_cast<const float4*>(ks + 16 * kk);
      const float4 O = *reinterpret_cast<const float4*>(ko + 16 * kk);
      unsigned int a[4];
      #pragma unroll
      for (int half = 0; half < 2; ++half) {
        const unsigned int* w = w0 + 8 * half * KS + kk * (KB / 2);
        const unsigned int x = KB == 4 ? w[0] >> sh : __funnelshift_r(w[0], w[1], sh);
        a[half] = orch_half2(fmaf(orch_code1<KB>(x, 0, ONE), S.x, O.x),
                             fmaf(orch_code1<KB>(x, 1, ONE), S.y, O.y));
        a[2 + half] = orch_half2(fmaf(orch_code1<KB>(x, 2, ONE), S.z, O.z),
                                 fmaf(orch_code1<KB>(x, 3, ONE), S.w, O.w));
      }
      orch_mma_f16(sc, a, qf + 2 * kk);
    }
    const int h0 = 2 * qt;                   // sc: (key r0, heads h0, h0 + 1), then key r0 + 8
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int h = h0 + (i & 1), r = r0 + 8 * (i >> 1);
      if (h < G) sp[h * KT + r] = sc[i];
    }
  } else {
    const unsigned int* sk = reinterpret_cast<const unsigned int*>(stage);
    const int sl = warp;
    unsigned int wd[KPT][SW + 1];
    float dot[KPT][G];
    #pragma unroll
    for (int i = 0; i < KPT; ++i) {
      orch_load_words<SW>(sk + (lane + 32 * i) * KS + sl * SW, wd[i]);
      wd[i][SW] = 0u;
      #pragma unroll
      for (int h = 0; h < G; ++h) dot[i][h] = 0.0f;
    }
    #pragma unroll
    for (int u = 0; u < SC / 4; ++u) {
      const int ch = sl * SC + 4 * u;
      float4 qv[G];
      #pragma unroll
      for (int h = 0; h < G; ++h) qv[h] = *reinterpret_cast<const float4*>(qs + h * D + ch);
      #pragma unroll
      for (int i = 0; i < KPT; ++i) {
        const int pg_ = (lane + 32 * i) / PT;
        const float4 S = *reinterpret_cast<const float4*>(km + pg_ * D + ch);
        const float4 O = *reinterpret_cast<const float4*>(km + KT * NGK + pg_ * D + ch);
        const float x0 = fmaf(orch_code_at<KB>(wd[i], 4 * u, ONE), S.x, O.x);
        const float x1 = fmaf(orch_code_at<KB>(wd[i], 4 * u + 1, ONE), S.y, O.y);
        const float x2 = fmaf(orch_code_at<KB>(wd[i], 4 * u + 2, ONE), S.z, O.z);
        const float x3 = fmaf(orch_code_at<KB>(wd[i], 4 * u + 3, ONE), S.w, O.w);
""" + DOT4 + """\
      }
    }
    #pragma unroll
    for (int i = 0; i < KPT; ++i) {
      #pragma unroll
      for (int h = 0; h < G; ++h) sp[(sl * G + h) * KT + lane + 32 * i] = dot[i][h];
    }
  }
  __syncthreads();

  // 2. The tile's softmax step (values packed: v2's group terms).
  softmax_step(cnt, MMA ? 1 : NW, true, stage + VM_OFF);
  __syncthreads();

  // 3. PV, as in v2: lanes over a row's words, each thread every head for its CPW channels
  // over the keys of its subset (pw is 0 past cnt).
  rescale();
  const unsigned int* sv = reinterpret_cast<const unsigned int*>(stage) + V_OFF;
""" + packed_pv("VW", "VB") + """\
}
__syncthreads();                             // stages, pw and state free / final

// Native keys in this split's range: the row's partial last page (native tail slot tslot[b],
// as the step began) and the step's own key (kf, vf), in full precision. At most PT of them,
// all in one split (no tile boundary falls inside a page).
const int a0 = max(j0, nfull), a1 = min(j1, n), ncnt = a1 - a0;
if (ncnt > 0) {
  const size_t tbase = (size_t)max(tslot[b], 0) * PT;
  auto native_row = [&](int pos) -> size_t {   // element offset of (key pos, head hk)
    return (pos < nh ? ((tbase + pos - nfull) * HKV + hk) * D : fresh);
  };
""" + native_key_scores("KT") + """\
  __syncthreads();
  softmax_step(ncnt, 1, false, nullptr);
  __syncthreads();
  rescale();
  for (int r = sub; r < ncnt; r += NSUB) {
    const int pos = a0 + r;
    const size_t at = native_row(pos) + c0;
    float ph[G];
    #pragma unroll
    for (int h = 0; h < G; ++h) ph[h] = pw[r * GP + h];
    #pragma unroll
    for (int i = 0; i < CPW; ++i) {
      const float x = pos < nh ? to_f(vt[at + i]) : to_f(vf[at + i]);
      #pragma unroll
      for (int h = 0; h < G; ++h) acc[h][i] = fmaf(ph[h], x, acc[h][i]);
    }
  }
  __syncthreads();
}

// The block's output or partial (tile_helpers.split_output: one text with v2).
""" + split_output("VW")

# tw: each row's tail slot for its own row (OWN; unread otherwise).
INPUTS = ["q", "kf", "vf", "pool", "kt", "vt", "pages", "ends", "tslot", "dims", "scale", "tw"]
OUTPUTS = ["out", "part", "ml"]


def header() -> str:
    """The kernel's device functions: the tile helpers, the code reader and the page-key
    write's (read when the kernel is built)."""
    return _HEADER + page_key_write_row.helpers()


@lru_cache(maxsize=None)
def kernel():
    """The kernel (template: D, G, PT, HK, KB, TQ, TK, TT, OWN, MMA; SPLIT and TO from
    launch_split)."""
    return mx.fast.cuda_kernel(
        name="orchard_page_key_decode", input_names=INPUTS, output_names=OUTPUTS,
        source=_SOURCE, header=header(), ensure_row_contiguous=True)
