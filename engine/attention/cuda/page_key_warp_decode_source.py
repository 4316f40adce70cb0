"""The warp-page decode kernel's CUDA source: page-key history (k6v4-kivi, int4-kivi) at pages
of 16, 32 or 64 tokens, each warp a pipeline of its own (host side and choice:
page_key_decode.py, KernelChoices.page_key_warp_pages and page_key_warp_page_tokens).

Why a second kernel: the block-tiled one (page_key_decode_source.py) keeps its four warps in
lockstep, four barriers a 64-key tile (fold, scores, softmax, PV), and cutting any of its
phases out saved 17-29 us of 236 at 32K keys batch 8 on an H100 while its copies alone took
183 (device run 14, `bench.device.page_key_phase_probe`): the phases add up instead of
overlapping. Here warp w of a block (NWB warps) takes pages w, w + NWB, ... of the block's
range and runs copy, scores, softmax and PV over 16 keys of a page at a time (a quarter of a
page of 64) with its own ST copy stages (ST - 1 quarters in flight while it computes one) and
its own online-softmax state; only `__syncwarp` inside the loop. A page's per-channel key
scales and offsets come once, with its first quarter (at pages of 64 they are 1/12 of a
page's bytes at head dim 128; at 16, 4/15: why pages of 64 should read faster). Both
products are tensor-core mma's (tile_helpers.MMA, fp16 in, fp32 sums):

- scores S^T = Q K^T per 8 keys: A = the block's G query heads (rows, zero past G) scaled,
  B = 8 keys dequantized in fp32 (c' * 2^KB s + (o - 2^KB s), c' = 1 + c / 2^KB) and rounded
  to fp16. A lane's reduction places {2q, 2q + 1, 2q + 8, 2q + 9} (q = lane % 4) of step kk
  are channels 16 kk + 4q + {0..3}: one run of 4 KB bits of a key row. The result lands with
  head lane / 4 and keys 2q, 2q + 1 in the lane: exactly the B fragment the PV mma wants.
- PV O^T = V^T P per 16 channels: A = value codes as the fp16 c / 16 (1 + c / 16 by its bits,
  0x3c00 | c << 6, less 1.0: exact), rows r and r + 8 = channels 16 j + r and 16 j + 8 + r
  (nibble r of words 2j and 2j + 1 of a row), B = the softmax weights times each key's value
  scale (x 16) per 64-channel group; the offsets' terms p * o sum on the CUDA cores beside.
  (With 1 + c / 16 itself, the fold the block-tiled kernel uses, the fp16 weights' rounding
  met a cancellation against the offset terms: 5x its error in a runner's logits.)

The split plan, the merge kernel and OWN are the block-tiled kernel's (ranges of whole 64-key
tiles; the row's partial page and own key, native, after the pages, by the whole block).
The CPU emulator (bench/cuda_emulate_page_keys.py --warp-pages) runs it and
`python -m bench.cuda_nvcc_check --only page-key-warp` compiles it.
"""
from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from engine.attention.cuda.page_key_decode_source import INPUTS, OUTPUTS, header
from engine.attention.cuda.tile_helpers import native_key_scores

_SOURCE = """
// A warp's unit of work is a page (PT tokens, 16, 32 or 64), computed 16 keys (a quarter: the
// mma's unit) at a time; its stages hold quarters, its key metadata buffers whole pages.
constexpr int QT = 16, QP = PT / QT;         // keys a quarter, quarters a page
constexpr int VB = 4;
constexpr int RPP = PT * HK;
constexpr int LW = D * KB / 32, VW = D * VB / 32, NGK = D / PT, NG = D / 64;
constexpr int KC_OFF = 0, VC_OFF = RPP * LW, KS_OFF = VC_OFF + RPP * VW;
constexpr int KO_OFF = KS_OFF + RPP * NGK, VS_OFF = KO_OFF + RPP * NGK;
constexpr int VO_OFF = VS_OFF + RPP * NG, PGW = VO_OFF + RPP * NG;
constexpr int NW = NWB, NT = 32 * NW;        // launch_split's block: NWB warps
constexpr int KT = 64;                       // the split plan's unit (the block-tiled kernel's)
constexpr int VPT = D / 32;
constexpr int KCH = LW / 4, VCH = VW / 4;    // 16-byte pieces of a row's key / value codes
// A page's key scales (or offsets) for head hk: row t of the page carries channels t * NGK..
// (in row order they are channel order), NGK floats a row, copied in pieces of MPW words
// (16 bytes where a row holds that many), MPR pieces a row, NPS a section.
constexpr int MPW = NGK < 4 ? NGK : 4, MPR = NGK / MPW, NPS = PT * MPR;
static_assert(ST >= 2 && ST <= 4, "page-key warp decode: 2..4 copy stages a warp");
static_assert(PT == 16 || PT == 32 || PT == 64, "page-key warp decode: pages of 16, 32 or 64");
// A warp's stage (32-bit words): a quarter's key code rows [QT][KS], value code rows [QT][VS]
// (16 bytes of padding each: lanes 2q's rows then start 8 banks apart), value scales then
// offsets [2][QT][NG]. After its ST stages, MB buffers of a page's key scales then offsets
// [2][D]: page j's in buffer j % MB, copied with its first quarter (enough buffers for every
// page a quarter in flight may belong to, and the one in use).
constexpr int KS = LW + 4, VS = VW + 4;
constexpr int V_OFF = QT * KS, VM_OFF = V_OFF + QT * VS;
constexpr int STAGE = (VM_OFF + 2 * QT * NG + 3) / 4 * 4;
constexpr int MB = 1 + (ST - 1 + QP - 1) / QP, KM_W = 2 * D;
constexpr int WARP_W = ST * STAGE + MB * KM_W;
// After the loop the stages hold each warp's partial [NW] (acc [G][D], m, l [G], group terms
// [G][NG]) and the native keys' numerators [G][D].
constexpr int PART = G * D + 2 * G + G * NG;
constexpr float TWO_KB = (float)(1 << KB);
static_assert(G >= 1 && G <= 8, "page-key warp decode: 1..8 query heads per KV head");
static_assert(KB == 4 || KB == 6, "page-key warp decode: 4- or 6-bit keys");
static_assert(D == 64 || D == 128, "page-key warp decode: head dim 64 or 128");
static_assert(LW % 4 == 0 && VW % 4 == 0 && PGW % 4 == 0,
              "cp.async: 16-byte pieces of codes in every section");
static_assert(D % PT == 0, "page-key warp decode: a page's rows carry its key metadata");
static_assert(NW * PART + G * D <= NW * WARP_W, "partials fit the stages");
__shared__ __align__(16) float smem[NW * WARP_W];
__shared__ float qs[G * D];                  // scaled queries (the native keys' pass)
__shared__ float sp[G * PT];                 // the native keys' scores, then weights
__shared__ float tml[2 * G];                 // their max and sum
""" + "const int HQ = dims[0], HKV = dims[1], P = dims[2];\n" + """\
const int hk = blockIdx.x % HKV;
const int b = blockIdx.x / HKV;
const int split = blockIdx.y, NS = gridDim.y;
const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
const int n = ends[b];
const int nh = n - 1, nfull = nh / PT * PT;
const int per = (((n + NS - 1) / NS) + KT - 1) / KT * KT;
const int j0 = split * per, j1 = min(n, j0 + per);
const int hend = min(j1, nfull);
const int p0 = j0 / PT, npages = hend > j0 ? (hend - j0) / PT : 0;
const int mine = npages > warp ? (npages - warp + NW - 1) / NW : 0;   // this warp's pages
const int nq = mine * QP;                    // ... and their quarters
const float NEG_INF = -__int_as_float(0x7f800000);
const unsigned int ONE = orch_one_bits(scale[0]);
const size_t fresh = ((size_t)b * HKV + hk) * D;
float* const ws = smem + warp * WARP_W;
const int q4 = lane & 3, r8 = lane >> 2;     // mma fragment coordinates

// Copies: lane pair (2t, 2t + 1) takes row t of the quarter: its key and value codes, split
// between the pair piece by piece, its value scale by one and offset by the other. A page's
// first quarter brings its key scales and offsets too, piece e by lane e % 32 (a row's pieces
// are neighbours: one 32-byte sector where a row has two).
const int ct = lane >> 1, ch = lane & 1;
float* const kmeta = ws + ST * STAGE;
auto issue = [&](int i) {                    // the warp's i-th quarter into stage i % ST
  if (i < nq) {
    const int j = i / QP, qq = i % QP;       // the warp's page j, its quarter qq
    const uint32_t* src = pool + (size_t)pages[(size_t)b * P + p0 + warp + j * NW] * PGW;
    const int crow = (qq * QT + ct) * HK + hk;
    unsigned int* st = reinterpret_cast<unsigned int*>(ws + (i % ST) * STAGE);
    #pragma unroll
    for (int c = ch; c < KCH; c += 2)
      orch_cp_async<16>(st + ct * KS + 4 * c, src + KC_OFF + crow * LW + 4 * c);
    #pragma unroll
    for (int c = ch; c < VCH; c += 2)
      orch_cp_async<16>(st + V_OFF + ct * VS + 4 * c, src + VC_OFF + crow * VW + 4 * c);
    orch_cp_async<4 * NG>(st + VM_OFF + (ch * QT + ct) * NG,
                          src + (ch ? VO_OFF : VS_OFF) + crow * NG);
    if (qq == 0) {
      float* const km = kmeta + (j % MB) * KM_W;
      #pragma unroll
      for (int e = lane; e < 2 * NPS; e += 32) {
        const int sec = e / NPS, t = (e % NPS) / MPR, c = e % MPR;   // sec 0: scales
        orch_cp_async<4 * MPW>(km + sec * D + t * NGK + c * MPW,
                               src + (sec ? KO_OFF : KS_OFF) + (t * HK + hk) * NGK + c * MPW);
      }
    }
  }
  orch_cp_commit();
};
#pragma unroll
for (int i = 0; i < ST - 1; ++i) issue(i);   // the first ST - 1 quarters in flight

// OWN: as in the block-tiled kernel (page_key_decode_source.py), which says why it races with
// no read of this launch.
__shared__ unsigned char wcodes[OWN ? D : 1];
if (OWN && split == 0 && warp == 0) {
  const int pos = n - 1, wpg = pages[(size_t)b * P + pos / PT], wo = pos % PT;
  const size_t src = (size_t)max(tslot[b], 0) * PT * HKV * D + (size_t)hk * D + lane * VPT;
  auto key = [&](int t, int i) -> float {
    return t == wo ? to_f(kf[fresh + lane * VPT + i]) : to_f(kt[src + (size_t)t * HKV * D + i]);
  };
  orch_page_key_write_row<D, PT, HK, KB>(kf + fresh, vf + fresh, const_cast<uint32_t*>(pool),
                                         const_cast<TT*>(kt), const_cast<TT*>(vt), wpg, wo, hk,
                                         tw[b], key, wcodes, lane);
}

for (int e = tid; e < G * D; e += NT)
  qs[e] = to_f(q[((size_t)(b * HQ + hk * G)) * D + e]) * scale[0];
__syncthreads();
// A fragments of the scores: head r8 (zero past G), channels 16 kk + 4 q4 + {0, 1} / {2, 3}.
unsigned int qa[D / 8];
#pragma unroll
for (int kk = 0; kk < D / 16; ++kk) {
  const float4 x = r8 < G ? *reinterpret_cast<const float4*>(qs + r8 * D + 16 * kk + 4 * q4)
                          : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  qa[2 * kk] = orch_half2(x.x, x.y);
  qa[2 * kk + 1] = orch_half2(x.z, x.w);
}

// The warp's state: head r8's running max (the same in its four lanes), the lane's part of
// that head's sum and group terms, and O^T fragments acc[j]: channels 16 j + r8 (+ 8) of
// heads 2 q4, 2 q4 + 1.
float m_run = NEG_INF, l_part = 0.0f, pvo[NG];
#pragma unroll
for (int g = 0; g < NG; ++g) pvo[g] = 0.0f;
float acc[D / 16][4];
#pragma unroll
for (int j = 0; j < D / 16; ++j) {
  #pragma unroll
  for (int i = 0; i < 4; ++i) acc[j][i] = 0.0f;
}

for (int i = 0; i < nq; ++i) {
  orch_cp_wait<ST - 2>();                    // quarter i's group (newer ones may fly)
  __syncwarp();                              // quarter i landed; i - 1 is done with
  issue(i + ST - 1);                         // into the stage quarter i - 1 used
  float* const st = ws + (i % ST) * STAGE;
  const unsigned int* sk = reinterpret_cast<const unsigned int*>(st);
  float* const km = kmeta + ((i / QP) % MB) * KM_W;
  if (i % QP == 0) {                         // a page's first quarter: fold its key metadata
    #pragma unroll
    for (int e = lane; e < D; e += 32) {     // c * s + o = c' * (2^KB s) + (o - 2^KB s)
      const float S = km[e] * TWO_KB;
      km[e] = S;
      km[D + e] -= S;
    }
    __syncwarp();
  }

  // 1. Scores of keys 8 nt + 2 q4, + 1 for head r8 (sc[nt][0..1]).
  float sc[2][4];
  #pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    #pragma unroll
    for (int k = 0; k < 4; ++k) sc[nt][k] = 0.0f;
    const unsigned int* w0 = sk + (8 * nt + r8) * KS + ((4 * q4 * KB) >> 5);
    const int sh = (4 * q4 * KB) & 31;
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const float4 S = *reinterpret_cast<const float4*>(km + 16 * kk + 4 * q4);
      const float4 O = *reinterpret_cast<const float4*>(km + D + 16 * kk + 4 * q4);
      const unsigned int* w = w0 + kk * (KB / 2);
      const unsigned int x = KB == 4 ? w[0] >> sh : __funnelshift_r(w[0], w[1], sh);
      unsigned int bk[2];
      bk[0] = orch_half2(fmaf(orch_code1<KB>(x, 0, ONE), S.x, O.x),
                         fmaf(orch_code1<KB>(x, 1, ONE), S.y, O.y));
      bk[1] = orch_half2(fmaf(orch_code1<KB>(x, 2, ONE), S.z, O.z),
                         fmaf(orch_code1<KB>(x, 3, ONE), S.w, O.w));
      const unsigned int aq[4] = {qa[2 * kk], 0u, qa[2 * kk + 1], 0u};   // rows 8..15: none
      orch_mma_f16(sc[nt], aq, bk);
    }
  }
  // 2. Online softmax over the quarter's 16 keys (all valid: pages in codes are full), head r8
  // across lanes 4 r8 .. 4 r8 + 3.
  float tmax = fmaxf(fmaxf(sc[0][0], sc[0][1]), fmaxf(sc[1][0], sc[1][1]));
  tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffff, tmax, 1));
  tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffff, tmax, 2));
  const float m_new = fmaxf(m_run, tmax);
  const float c = __expf(m_run - m_new);
  m_run = m_new;
  float p[4];
  p[0] = __expf(sc[0][0] - m_new); p[1] = __expf(sc[0][1] - m_new);
  p[2] = __expf(sc[1][0] - m_new); p[3] = __expf(sc[1][1] - m_new);
  l_part = l_part * c + (p[0] + p[1]) + (p[2] + p[3]);
  // PV weights per group: p * 2^VB s (keys 2 q4, 2 q4 + 1 | 2 q4 + 8, 2 q4 + 9; head r8),
  // and the group offsets' terms p * o.
  const float* vm = st + VM_OFF;
  unsigned int bw[NG][2];
  #pragma unroll
  for (int g = 0; g < NG; ++g) {
    float wv[4];
    float t = 0.0f;
    #pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int key = 2 * q4 + (k & 1) + 8 * (k >> 1);
      const float s16 = vm[key * NG + g] * 16.0f;
      wv[k] = p[k] * s16;
      t = fmaf(p[k], vm[(QT + key) * NG + g], t);
    }
    pvo[g] = pvo[g] * c + t;
    bw[g][0] = orch_half2(wv[0], wv[1]);
    bw[g][1] = orch_half2(wv[2], wv[3]);
  }
  // 3. PV: the accumulators' heads 2 q4, 2 q4 + 1 rescaled by their factors (held by lanes
  // 8 q4 and 8 q4 + 4), then O^T += V^T P, 16 channels an mma.
  const float c0 = __shfl_sync(0xffffffff, c, 8 * q4);
  const float c1 = __shfl_sync(0xffffffff, c, 8 * q4 + 4);
  const unsigned int* sv = sk + V_OFF;
  const int nib = 4 * r8;
  #pragma unroll
  for (int jj = 0; jj < D / 32; ++jj) {      // words 4 jj .. 4 jj + 3: channel tiles 2 jj, + 1
    uint4 wk[4];
    #pragma unroll
    for (int k = 0; k < 4; ++k)
      wk[k] = *reinterpret_cast<const uint4*>(sv + (2 * q4 + (k & 1) + 8 * (k >> 1)) * VS + 4 * jj);
    #pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      const int j = 2 * jj + h2;
      auto code = [&](int k, int hi) -> unsigned int {   // nibble r8 of word 2j + hi, key k
        const unsigned int w = h2 == 0 ? (hi ? wk[k].y : wk[k].x) : (hi ? wk[k].w : wk[k].z);
        return (w >> nib) & 15u;
      };
      unsigned int a[4];
      a[0] = orch_half2_minus_one(0x3c003c00u | (code(0, 0) << 6) | (code(1, 0) << 22));
      a[1] = orch_half2_minus_one(0x3c003c00u | (code(0, 1) << 6) | (code(1, 1) << 22));
      a[2] = orch_half2_minus_one(0x3c003c00u | (code(2, 0) << 6) | (code(3, 0) << 22));
      a[3] = orch_half2_minus_one(0x3c003c00u | (code(2, 1) << 6) | (code(3, 1) << 22));
      acc[j][0] *= c0; acc[j][1] *= c1; acc[j][2] *= c0; acc[j][3] *= c1;
      orch_mma_f16(acc[j], a, bw[(16 * j) / 64]);
    }
  }
}

// Each warp's partial to the stages (free once every warp left its loop): the sums and group
// terms over head r8's four lanes, then acc by channel.
l_part += __shfl_xor_sync(0xffffffff, l_part, 1);
l_part += __shfl_xor_sync(0xffffffff, l_part, 2);
#pragma unroll
for (int g = 0; g < NG; ++g) {
  pvo[g] += __shfl_xor_sync(0xffffffff, pvo[g], 1);
  pvo[g] += __shfl_xor_sync(0xffffffff, pvo[g], 2);
}
__syncthreads();
float* const wp = smem + warp * PART;        // acc [G][D], m [G], l [G], terms [G][NG]
#pragma unroll
for (int j = 0; j < D / 16; ++j) {
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int h = 2 * q4 + (i & 1), chn = 16 * j + r8 + 8 * (i >> 1);
    if (h < G) wp[h * D + chn] = acc[j][i];
  }
}
if (q4 == 0 && r8 < G) {
  wp[G * D + r8] = m_run;
  wp[G * D + G + r8] = l_part;
  #pragma unroll
  for (int g = 0; g < NG; ++g) wp[G * D + 2 * G + r8 * NG + g] = pvo[g];
}

// The native keys in this split's range (the row's partial last page from its tail slot as
// the step began, and the step's own key), at most PT, in full precision: a fifth partial.
float* const tn = smem + NW * PART;          // their numerators [G][D]
const int a0 = max(j0, nfull), a1 = min(j1, n), ncnt = max(a1 - a0, 0);
const size_t tbase = (size_t)max(tslot[b], 0) * PT;
auto native_row = [&](int pos) -> size_t {   // element offset of (key pos, head hk)
  return (pos < nh ? ((tbase + pos - nfull) * HKV + hk) * D : fresh);
};
""" + native_key_scores("PT") + """\
__syncthreads();
for (int h = warp; h < G; h += NW) {       // their softmax, a warp a head, lanes over keys
  float mx_ = NEG_INF, sum = 0.0f;
  for (int r = lane; r < ncnt; r += 32) mx_ = fmaxf(mx_, sp[h * PT + r]);
  mx_ = orch_warp_max(mx_);
  for (int r = lane; r < ncnt; r += 32) {
    const float e = __expf(sp[h * PT + r] - mx_);
    sp[h * PT + r] = e;
    sum += e;
  }
  sum = orch_warp_sum(sum);
  if (lane == 0) {
    tml[h] = mx_;
    tml[G + h] = sum;
  }
}
__syncthreads();
// Their numerators: a thread a channel, every head, over the keys 8 at a time (their value
// loads in flight together, each value read once for the G heads; tile_helpers'
// _NATIVE_KEY_SCORES says what device run 16 measured of this pass).
for (int chn = tid; chn < D; chn += NT) {
  float num[G];
  #pragma unroll
  for (int h = 0; h < G; ++h) num[h] = 0.0f;
  #pragma unroll 8
  for (int r = 0; r < ncnt; ++r) {
    const int pos = a0 + r;
    const size_t at = native_row(pos) + chn;
    const float x = pos < nh ? to_f(vt[at]) : to_f(vf[at]);
    #pragma unroll
    for (int h = 0; h < G; ++h) num[h] = fmaf(sp[h * PT + r], x, num[h]);
  }
  #pragma unroll
  for (int h = 0; h < G; ++h) tn[h * D + chn] = num[h];
}
__syncthreads();

// The block's output or partial (BLOCK_MERGE's format): the five partials merged per head.
for (int e = tid; e < G * D; e += NT) {
  const int h = e / D, chn = e % D, g = chn / 64;
  float M = tml[h];
  #pragma unroll
  for (int w = 0; w < NW; ++w) M = fmaxf(M, smem[w * PART + G * D + h]);
  float num = 0.0f, den = 0.0f;
  if (M != NEG_INF) {
    const float ft = __expf(tml[h] - M);
    num = tn[e] * ft;
    den = tml[G + h] * ft;
    #pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float* pw = smem + w * PART;
      const float f = __expf(pw[G * D + h] - M);
      num += f * (pw[e] + pw[G * D + 2 * G + h * NG + g]);
      den += f * pw[G * D + G + h];
    }
  }
  const size_t rh = (size_t)(b * HQ + hk * G + h);
  if (SPLIT) {
    part[(rh * NS + split) * D + chn] = num;
    if (chn == 0) { ml[(rh * NS + split) * 2] = M; ml[(rh * NS + split) * 2 + 1] = den; }
  } else {
    put(out + rh * D + chn, num / den);
  }
}
"""


@lru_cache(maxsize=None)
def kernel():
    """The kernel (template: D, G, HK, KB, TQ, TK, TT, OWN, NWB warps a block, ST copy stages
    a warp; SPLIT and TO from launch_split).
    Inputs and outputs: the block-tiled kernel's (page_key_decode_source.INPUTS, OUTPUTS)."""
    return mx.fast.cuda_kernel(
        name="orchard_page_key_warp_decode", input_names=INPUTS, output_names=OUTPUTS,
        source=_SOURCE, header=header(), ensure_row_contiguous=True)
