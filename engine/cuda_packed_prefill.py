"""Prefill attention straight from packed pages as one tensor-core CUDA kernel (CUDA only).

What a packed layer's prefill chunk attends through on CUDA (engine/packed_cache.py calls it
in direct mode when the chunk has history): the chunk's queries against (1) the row's packed
history, read by page table from the pool itself, and (2) the chunk's own fresh keys in full
precision under the causal rule, under one FP32 online softmax. Nothing the size of the history
is ever copied: the direct MLX-op path gathered every row's packed pages (a copy of the
history per layer and chunk) and unpacked it into FP32 tiles with ~10 launches per tile.

Tiling (FlashAttention-2 style; the one place it is defined, so a Metal twin can follow it):
- a block serves one (row, KV head, tile of QT = 16 * QW query positions, split of the keys);
  its G * QW warps each take one query head's m16 tile of 16 positions, so every K/V tile is
  dequantized once for all query heads of the KV head and QT positions (`query_warps`);
- key tiles of KT = 64: the block unpacks a tile's codes (scale * code + offset per 64-channel
  group; codes become floats by exponent bits, not int-to-float conversions) into shared
  memory as bf16, K row-major and V transposed, so both MMAs read their B
  operands as aligned 32-bit pairs without bank conflicts (row strides padded by 8);
- per warp: S = Q K^T and O += P V with `mma.sync.m16n8k16` bf16 -> FP32 (PTX, documented
  fragment layout: the score accumulator is the P operand's layout, so P never leaves
  registers), Q fragments loaded once, O in registers, row max and sum over the lane quad;
- split-K: when (rows x KV heads x query tiles) leaves SMs idle, the key tiles of each block
  are cut into `splits` ranges whose partials (running max, sum, FP32 output) are merged by
  the decode path's merge kernel (engine/cuda_paged_decode.py).
Keys in history are stored rotated (engine/rotation.py): queries are rotated and the fresh keys
rotated too, so one query fragment scores both; values are never rotated.

Formats: 4 or 8 bits for K and V independently (int8, int4, k8v4), head dim 64 or 128, up to
MAX_WARPS query heads per KV head. Checked only on the H200 (`python -m bench.cuda_check`:
max error 0.016 against the FP32 direct path, bf16 output rounding); never run on Metal.
Measured there (docs/lab/benchmarks-gpu.md, session 6; synthetic 0.5B geometry, chunks of 512):
prefill 1.02-1.22x native time at 4K and 1.23-1.32x at 16K, against 2.5x / 3.9x for the MLX-op
direct path. What bounds it now: one block (8 warps, ~240 registers each) per SM, so a tile's
unpacking and its MMAs do not overlap across blocks; `cp.async` staging of the raw codes or a
`wgmma` version would be the next steps.
"""
from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

from engine.cuda_paged_decode import HEADER, _merge_kernel, available
from engine.rotation import rotate

HEAD_DIMS = (64, 128)
BITS = (4, 8)
# Query positions per block: QW m16 tiles of 16 per query head, one warp each, so a block has
# G * QW warps and each dequantized K/V tile serves G * QW * 16 query rows. The tile's unpacking
# is the kernel's overhead over native attention, so rows per block matter; MAX_WARPS bounds
# the block (about 170 registers per thread: 8 warps leave one block per SM).
MAX_WARPS = 8
MAX_QUERY_WARPS = 4
KEY_TILE = 64
# Split plan (H200, 132 SMs): aim for about TARGET_BLOCKS blocks per launch, no split shorter
# than MIN_TILES_PER_SPLIT key tiles, at most MAX_SPLITS.
TARGET_BLOCKS = 264
MIN_TILES_PER_SPLIT = 8
MAX_SPLITS = 16
# Benches switch it off to compare with the MLX-op direct path (bench.kv
# --no-prefill-kernel).
enabled = True
# Decode steps (one query per row) through this kernel too, instead of
# engine/cuda_packed_decode.py. Off: measured slower on the H200 with this kernel's first
# version (int4 at 32K batch 8: 0.62x native vs 0.83x; docs/lab/benchmarks-gpu.md session 6): a
# decode tile has one query row per head, so the MMAs do 1/16 useful work while every block
# still unpacks whole tiles.
# `bench.kv --decode-formats int4:tiles` measures it.
decode_tiles = False

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

_SOURCE = """
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
        const uint4* src = is_v ? reinterpret_cast<const uint4*>(vc + row * VW + grp * 2 * VB)
                                : reinterpret_cast<const uint4*>(kc + row * KW + grp * 2 * KB);
        const int vecs = (is_v ? VB : KB) / 2;   // 16-byte vectors per unit
        #pragma unroll
        for (int x = 0; x < 4; ++x) {
          if (x < vecs) {
            const uint4 v4 = src[x];
            buf[i][4 * x] = v4.x; buf[i][4 * x + 1] = v4.y;
            buf[i][4 * x + 2] = v4.z; buf[i][4 * x + 3] = v4.w;
          }
        }
        bsc[i] = (is_v ? vs : ks)[row * NG + grp];
        bof[i] = (is_v ? vo : ko)[row * NG + grp];
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
def _kernel():
    return mx.fast.cuda_kernel(
        name="orchard_packed_prefill",
        input_names=["q", "kf", "vf", "kc", "ks", "ko", "vc", "vs", "vo", "pages", "bounds",
                     "dims"],
        output_names=["out", "part", "ml"], source=_SOURCE, header=_HEADER,
        ensure_row_contiguous=True)


def supports(k_bits: int | None, v_bits: int | None, head_dim: int) -> bool:
    """Whether a packed layer of these bits and head size can prefill through the kernel."""
    return k_bits in BITS and v_bits in BITS and head_dim in HEAD_DIMS


def usable(k_bits, v_bits, head_dim: int) -> bool:
    """Whether a packed store's prefill chunks may attend through the kernel here and now."""
    return enabled and supports(k_bits, v_bits, head_dim) and available()


def applies(store, step, queries: mx.array, kernel_decode: bool) -> bool:
    """Whether a packed layer's call attends through this kernel: CUDA, a supported format,
    direct prefill mode for chunks (the fused mode stays opt-in), history in some row for
    chunks; decode steps where the runner chose kernel decode and `decode_tiles` is on."""
    fmt = store.fmt
    if not usable(fmt.k_bits, fmt.v_bits, store.geometry.head_dim):
        return False
    if queries.shape[1] // store.geometry.kv_heads > MAX_WARPS:
        return False   # one warp per query head at least: the block would not fit an SM
    if queries.shape[2] == 1:
        return kernel_decode and decode_tiles
    return store.attention.prefill_mode == "direct" and bool(step.starts.max() > 0)


def step_bounds(step, view) -> tuple[mx.array, int]:
    """(bounds [B, 2] int32: history keys and own keys per row, longest history), built once
    per forward call and shared by every packed layer."""
    cached = view.masks.get("packed_tiles")
    if cached is None:
        bounds = np.stack([step.starts, step.lengths], axis=1).astype(np.int32)
        cached = (mx.array(bounds), int(step.starts.max()))
        view.masks["packed_tiles"] = cached
    return cached


def query_warps(group: int, length: int) -> int:
    """Warps (m16 query tiles) per query head in a block: as many as MAX_WARPS allows, but one
    for decode-sized calls (more would only compute padding)."""
    if length <= 16:
        return 1
    return max(1, min(MAX_QUERY_WARPS, MAX_WARPS // group, -(-length // 16)))


def split_count(blocks: int, key_tiles: int) -> int:
    """Key splits per block for `blocks` blocks whose longest key range is `key_tiles` tiles.

    Pure host arithmetic (tests pin it): enough splits to reach about TARGET_BLOCKS blocks, but
    no split shorter than MIN_TILES_PER_SPLIT tiles and at most MAX_SPLITS.
    """
    if blocks < 1 or key_tiles < 0:
        raise ValueError(f"split_count needs positive sizes, got {blocks}, {key_tiles}")
    by_blocks = -(-TARGET_BLOCKS // blocks)
    by_tiles = key_tiles // MIN_TILES_PER_SPLIT
    return max(1, min(by_blocks, by_tiles, MAX_SPLITS))


@lru_cache(maxsize=256)
def _dims(*values: int) -> mx.array:
    return mx.array(values, dtype=mx.int32)


def packed_prefill_attention(q: mx.array, k_new: mx.array, v_new: mx.array, k_pool, v_pool,
                             k_bits: int, v_bits: int, pages: mx.array, bounds: mx.array,
                             longest_history: int, scale: float,
                             splits: int | None = None) -> mx.array:
    """Attention of a prefill chunk over packed history by page table plus its own keys.

    q [B, Hq, L, D]; k_new/v_new [B, Hkv, L, D] the chunk's fresh rows (model basis, right
    padded to L). k_pool/v_pool: the layer's whole packed pools (codes, scales, offsets;
    [pages, page_tokens, Hkv, ...]), keys rotated. pages [B, P] int32 page tables;
    bounds [B, 2] int32: row b attends its first bounds[b, 0] history keys, then its own keys
    0..i (i < bounds[b, 1]) at position i. `longest_history` = max(bounds[:, 0]) on the host
    (it picks the split count; `splits` pins it, for checks). Returns [B, Hq, L, D] in q's dtype; positions past a row's
    length hold finite values nobody should read.
    """
    b, hq, length, d = q.shape
    kvh = k_new.shape[1]
    if (d not in HEAD_DIMS or hq % kvh or hq // kvh > MAX_WARPS or k_bits not in BITS
            or v_bits not in BITS):
        raise ValueError(f"packed prefill kernel: unsupported head dim {d}, heads {hq}/{kvh} "
                         f"or bits {k_bits}/{v_bits}")
    page_tokens = k_pool[0].shape[1]
    qh = rotate(q.astype(mx.float32) * scale).astype(mx.bfloat16)
    kf = rotate(k_new).astype(mx.bfloat16)
    vf = v_new.astype(mx.bfloat16)
    group = hq // kvh
    qw = query_warps(group, length)
    blocks = b * kvh * -(-length // (16 * qw))
    if splits is None:
        splits = split_count(blocks, -(-longest_history // KEY_TILE) + -(-length // KEY_TILE))
    parts = b * hq * length * splits if splits > 1 else 1
    out, part, ml = _kernel()(
        inputs=[qh, kf, vf, *k_pool, *v_pool, pages, bounds,
                _dims(hq, kvh, length, pages.shape[1])],
        template=[("D", d), ("G", group), ("QW", qw), ("KB", k_bits), ("VB", v_bits),
                  ("PT", page_tokens), ("SPLIT", splits > 1), ("TO", q.dtype)],
        grid=(blocks * group * qw * 32, splits, 1), threadgroup=(group * qw * 32, 1, 1),
        # Unsplit launches write `out` only: the partial outputs get a token allocation.
        output_shapes=[(b, hq, length, d), (parts, d), (parts, 2)],
        output_dtypes=[q.dtype, mx.float32, mx.float32])
    if splits == 1:
        return out
    (merged,) = _merge_kernel()(
        inputs=[part, ml, _dims(splits)], template=[("D", d), ("TO", q.dtype)],
        grid=(b * hq * length * d, 1, 1), threadgroup=(d, 1, 1),
        output_shapes=[(b, hq, length, d)], output_dtypes=[q.dtype])
    return merged
