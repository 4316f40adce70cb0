"""The per-(row, KV head) part of a page-key layer's write as a CUDA device function
(WRITE_ROW): the write kernel (page_key_write.py) runs it for a launch's rows, the page-key
decode kernel's OWN variant (page_key_decode_source.py) for its step's own row. Its own module
so both kernels' sources can include it without importing each other.
"""
from __future__ import annotations

from engine.attention.cuda.packed_write import QUANTIZE

# One (row, KV head) of the write, by one warp. `kr`, `vr`: the row's key and value at head h;
# (pg, o): where it lands; `slot`: its tail slot (-1: none); key(t, i): token t of page pg at
# this lane's channel i (the fill's source).
WRITE_ROW = """
template <int D, int PT, int HK, int KB, typename TI, typename TT, typename KeyAt>
__device__ __forceinline__ void orch_page_key_write_row(
    const TI* kr, const TI* vr, unsigned int* pw, TT* ktw, TT* vtw, int pg, int o, int h,
    int slot, KeyAt key, unsigned char* codes, int lane) {
  constexpr int VB = 4, VPT = D / 32;        // value bits, channels per lane
  // The pool's page-key sections (page_layout.PageLayout with key metadata rows of D/PT
  // words: page_key_decode.kernel_layout), token-major [PT][HK][width] words each.
  constexpr int RPP = PT * HK;
  constexpr int LW = D * KB / 32, VW = D * VB / 32, NGK = D / PT, NG = D / 64;
  constexpr int KC_OFF = 0, VC_OFF = RPP * LW, KS_OFF = VC_OFF + RPP * VW;
  constexpr int KO_OFF = KS_OFF + RPP * NGK, VS_OFF = KO_OFF + RPP * NGK;
  constexpr int VO_OFF = VS_OFF + RPP * NG, PGW = VO_OFF + RPP * NG;
  static_assert(KB == 4 || KB == 6, "page-key write: 4- or 6-bit keys");
  static_assert((D == 64 || D == 128) && D % PT == 0 && LW <= 32,
                "page-key write: head dims 64, 128");
  auto sec = [](size_t r, int off, int w) -> size_t {  // first word of row r in a section
    return (r / RPP) * (size_t)PGW + off + (r % RPP) * (size_t)w;
  };
  const size_t row = ((size_t)pg * PT + o) * HK + h;
  const int c0 = lane * VPT;
  // 1. The value row's record (engine/kv/quant.py quantize; orch_quantize leaves x as is).
  float x[VPT];
  #pragma unroll
  for (int i = 0; i < VPT; ++i) x[i] = to_f(vr[c0 + i]);
  unsigned int word;
  float sc, lo;
  orch_quantize<D, VB>(x, false, nullptr, lane, word, sc, lo);
  if (c0 % (32 / VB) == 0) pw[sec(row, VC_OFF, VW) + c0 / (32 / VB)] = word;
  if (c0 % 64 == 0) {
    pw[sec(row, VS_OFF, NG) + c0 / 64] = __float_as_uint(sc);
    pw[sec(row, VO_OFF, NG) + c0 / 64] = __float_as_uint(lo);
  }
  // 2. The rows to their tail slot (a filling row's slot is the one it gives back, as on the
  // MLX path: never read again).
  if (slot >= 0) {
    const size_t dst = (((size_t)slot * PT + o) * HK + h) * D + c0;
    #pragma unroll
    for (int i = 0; i < VPT; ++i) {
      put(ktw + dst + i, to_f(kr[c0 + i]));
      put(vtw + dst + i, x[i]);
    }
  }
  // 3. A page this row fills: per-channel scale and offset over its PT keys (key(t, i)), then
  // its codes (engine/kv/page_quant.py quantize_pages: the same FP32 min, max, divide, rint).
  if (o == PT - 1) {
    const float top = (float)((1 << KB) - 1);
    float kl[VPT], ks[VPT];
    #pragma unroll
    for (int i = 0; i < VPT; ++i) {
      float l = key(0, i), u = l;
      for (int t = 1; t < PT; ++t) { const float y = key(t, i); l = fminf(l, y); u = fmaxf(u, y); }
      kl[i] = l;
      ks[i] = (u - l) / top;
      const int c = c0 + i;   // channel c's metadata: token c / NGK's row, word c % NGK
      const size_t m = ((size_t)pg * PT + c / NGK) * HK + h;
      pw[sec(m, KS_OFF, NGK) + c % NGK] = __float_as_uint(ks[i]);
      pw[sec(m, KO_OFF, NGK) + c % NGK] = __float_as_uint(l);
    }
    for (int t = 0; t < PT; ++t) {
      #pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const float safe = ks[i] > 0.0f ? ks[i] : 1.0f;
        codes[c0 + i] = (unsigned char)fminf(fmaxf(rintf((key(t, i) - kl[i]) / safe), 0.0f), top);
      }
      __syncwarp();
      if (lane < LW) {   // word `lane` of the row: the codes overlapping its 32 bits
        unsigned int w = 0;
        for (int c = lane * 32 / KB; c <= (lane * 32 + 31) / KB; ++c) {
          const int s = c * KB - lane * 32;   // < 0: a 6-bit code begun in the word before
          w |= s >= 0 ? (unsigned int)codes[c] << s : (unsigned int)codes[c] >> -s;
        }
        pw[sec(((size_t)pg * PT + t) * HK + h, KC_OFF, LW) + lane] = w;
      }
      __syncwarp();
    }
  }
}
"""


def helpers() -> str:
    """The device functions a page-key write needs (read when a kernel is built, so a test may
    swap WRITE_ROW's text): packed_write's quantizer and WRITE_ROW."""
    return QUANTIZE + WRITE_ROW
