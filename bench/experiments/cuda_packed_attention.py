"""EXPERIMENT (not wired into the engine): packed-history prefill attention as one CUDA kernel.

Why: on the H200 every composition of MLX ops for attention over packed history costs >= 2x
native fused SDPA (docs/lab/benchmarks-kv.md, bench/attention.py): the dequantize, matmul and
softmax launches and their intermediate tensors dominate. This kernel unpacks codes inside the
attention tile instead, flash-attention style: per block 32 query rows of one query head (two
warps of 16), key tiles of 32 (packed history first, then the chunk's own fresh keys under the
causal rule), K and V tiles dequantized into shared memory as bf16, QK^T and PV on tensor cores
(WMMA bf16 with FP32 accumulators), one online softmax in FP32, O accumulated in FP32 in shared
memory. Nothing the size of the history is materialized.

Status (2026-11-29, H200, MLX 0.32.4 CUDA, `python -m bench.attention --dtype bfloat16
--history 3584,15872 --formats int8,int4 --variants direct_tiled,direct_cuda`): **correct, slow.**
Its max error against the FP32 reference equals the tiled path's (7.6e-4 / 6.2e-4 at 3,584
history tokens), so the packing layout, masks and online softmax are right and NVRTC compiles
WMMA through `mx.fast.cuda_kernel`. But it takes 2.0-2.8 ms where native SDPA takes 0.3 ms and
the tiled MLX-op path 1.6-1.7 ms (6.9-16.6x native; four variants tried, JSON in
docs/lab/benchmarks-kv/h200-attention-cuda-kernel-v*.json). Why, and what a fast version needs:
O lives in shared memory and is loaded, rescaled and stored for every key tile (FlashAttention-2
keeps it in registers: use `mma.sync.m16n8k16` PTX, whose accumulator layout is known, instead
of WMMA's opaque one); two warps per block and no double buffering leave global latency exposed
(use 4-8 warps and `cp.async` K/V tile prefetch); and each KV head's tiles are dequantized once
per query head and query tile (let one block serve all GQA heads of a KV head). Until it beats
the tiled path, `direct_attention` does not call it.
"""
from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from capacity.formats import GROUP_SIZE
from engine.kv.rotation import rotate

QUERY_ROWS = 32     # per block: 2 warps x 16 rows
KEY_TILE = 32
THREADS = 64

_HEADER = """
#include <mma.h>
#include <cuda_bf16.h>
"""

_SOURCE = """
using namespace nvcuda;
constexpr int QT = 32, KT = 32, KP = D + 8, G = 64, NW = 2;
// Padded row strides of the per-warp score and probability tiles: unpadded, the two lanes of a
// row pair and the 16 rows all hit the same shared-memory banks.
constexpr int SS = KT + 4, PS = KT + 8;
const float NEG_INF = -__int_as_float(0x7f800000);
const int HQ = dims[1], HKV = dims[2], L = dims[3], S = dims[4];
const int T = S + L;
const int rep = HQ / HKV;
const int nqt = (L + QT - 1) / QT;
int bid = blockIdx.x;
const int qt = bid % nqt; bid /= nqt;
const int h = bid % HQ;
const int b = bid / HQ;
const int hk = h / rep;
const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
const int q0 = qt * QT;

extern __shared__ __align__(32) unsigned char smem_raw[];
__nv_bfloat16* Ks = reinterpret_cast<__nv_bfloat16*>(smem_raw);
__nv_bfloat16* Vs = Ks + KT * KP;
float* Ss = reinterpret_cast<float*>(Vs + KT * KP);
__nv_bfloat16* Ps = reinterpret_cast<__nv_bfloat16*>(Ss + NW * 16 * SS);
float* Os = reinterpret_cast<float*>(Ps + NW * 16 * PS);
float* Ms = Os + NW * 16 * D;
float* Ls = Ms + QT;
float* Cs = Ls + QT;
float* Ss_w = Ss + warp * 16 * SS;
__nv_bfloat16* Ps_w = Ps + warp * 16 * PS;
float* Os_w = Os + warp * 16 * D;

// Stage this warp's 16 query rows through shared memory (zero rows past L), into fragments.
__nv_bfloat16* Qs_w = reinterpret_cast<__nv_bfloat16*>(Os_w);   // 16 x KP bf16 fits in 16 x D floats
for (int e = lane; e < 16 * D; e += 32) {
  int r = e / D, d = e % D, i = q0 + warp * 16 + r;
  Qs_w[r * KP + d] = i < L ? q[(((size_t)b * HQ + h) * L + i) * D + d] : __float2bfloat16(0.0f);
}
__syncwarp();
wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> qa[D / 16];
#pragma unroll
for (int k = 0; k < D / 16; ++k) wmma::load_matrix_sync(qa[k], Qs_w + k * 16, KP);
__syncwarp();
for (int e = lane; e < 16 * D; e += 32) Os_w[e] = 0.0f;
if (lane < 16) { Ms[warp * 16 + lane] = NEG_INF; Ls[warp * 16 + lane] = 0.0f; }
__syncthreads();

const size_t bh = (size_t)b * HKV + hk;
const int r = lane / 2, half = lane % 2;
const int iq = min(q0 + warp * 16 + r, L - 1);   // padded rows compute as the last row; dropped
const int key_end = min(T, S + q0 + QT);          // the last key any row of this block sees
for (int t0 = 0; t0 < key_end; t0 += KT) {
  // Dequantize (or copy fresh) KT keys and values, one packed word per thread step.
  for (int e = tid; e < KT * (D * KB / 32); e += NW * 32) {
    constexpr int KW = D * KB / 32, VPW = 32 / KB;
    int row = e / KW, w = e % KW, t = t0 + row, d0 = w * VPW;
    __nv_bfloat16* kd = Ks + row * KP + d0;
    if (t < S) {
      size_t base = bh * S + t;
      unsigned int word = kc[base * KW + w];
      float sc = ks[base * (D / G) + d0 / G], of = ko[base * (D / G) + d0 / G];
      #pragma unroll
      for (int j = 0; j < VPW; ++j)
        kd[j] = __float2bfloat16((float)((word >> (j * KB)) & ((1u << KB) - 1u)) * sc + of);
    } else if (t < T) {
      size_t base = (bh * L + (t - S)) * D + d0;
      #pragma unroll
      for (int j = 0; j < VPW; ++j) kd[j] = kf[base + j];
    } else {
      #pragma unroll
      for (int j = 0; j < VPW; ++j) kd[j] = __float2bfloat16(0.0f);
    }
  }
  for (int e = tid; e < KT * (D * VB / 32); e += NW * 32) {
    constexpr int VW = D * VB / 32, VPW = 32 / VB;
    int row = e / VW, w = e % VW, t = t0 + row, d0 = w * VPW;
    __nv_bfloat16* vd = Vs + row * KP + d0;
    if (t < S) {
      size_t base = bh * S + t;
      unsigned int word = vc[base * VW + w];
      float sc = vs[base * (D / G) + d0 / G], of = vo[base * (D / G) + d0 / G];
      #pragma unroll
      for (int j = 0; j < VPW; ++j)
        vd[j] = __float2bfloat16((float)((word >> (j * VB)) & ((1u << VB) - 1u)) * sc + of);
    } else if (t < T) {
      size_t base = (bh * L + (t - S)) * D + d0;
      #pragma unroll
      for (int j = 0; j < VPW; ++j) vd[j] = vf[base + j];
    } else {
      #pragma unroll
      for (int j = 0; j < VPW; ++j) vd[j] = __float2bfloat16(0.0f);
    }
  }
  __syncthreads();

  // Scores: 16 rows x KT keys per warp.
  #pragma unroll
  for (int n = 0; n < KT / 16; ++n) {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    #pragma unroll
    for (int k = 0; k < D / 16; ++k) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> kb;
      wmma::load_matrix_sync(kb, Ks + n * 16 * KP + k * 16, KP);
      wmma::mma_sync(acc, qa[k], kb, acc);
    }
    wmma::store_matrix_sync(Ss_w + n * 16, acc, SS, wmma::mem_row_major);
  }
  __syncwarp();

  // Online softmax: two lanes per row, KT/2 columns each.
  float mx_ = NEG_INF;
  float sv[KT / 2];
  #pragma unroll
  for (int j = 0; j < KT / 2; ++j) {
    int c = half * (KT / 2) + j, t = t0 + c;
    bool ok = t < S || (t < T && (t - S) <= iq);
    sv[j] = ok ? Ss_w[r * SS + c] : NEG_INF;
    mx_ = fmaxf(mx_, sv[j]);
  }
  mx_ = fmaxf(mx_, __shfl_xor_sync(0xffffffffu, mx_, 1));
  float m_old = Ms[warp * 16 + r];
  float m_new = fmaxf(m_old, mx_);
  float sum = 0.0f;
  #pragma unroll
  for (int j = 0; j < KT / 2; ++j) {
    float p = sv[j] == NEG_INF ? 0.0f : __expf(sv[j] - m_new);
    sum += p;
    Ps_w[r * PS + half * (KT / 2) + j] = __float2bfloat16(p);
  }
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  float corr = m_old == NEG_INF ? 0.0f : __expf(m_old - m_new);
  __syncwarp();
  if (half == 0) {
    Ms[warp * 16 + r] = m_new; Ls[warp * 16 + r] = Ls[warp * 16 + r] * corr + sum;
    Cs[warp * 16 + r] = corr;
  }
  __syncwarp();
  // Consecutive lanes take consecutive channels: conflict-free, unlike one row per lane pair.
  for (int e = lane; e < 16 * D; e += 32) Os_w[e] *= Cs[warp * 16 + e / D];
  __syncwarp();

  // O += P V on tensor cores, accumulated through shared memory.
  #pragma unroll
  for (int n = 0; n < D / 16; ++n) {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::load_matrix_sync(acc, Os_w + n * 16, D, wmma::mem_row_major);
    #pragma unroll
    for (int k = 0; k < KT / 16; ++k) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> pa;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> vb;
      wmma::load_matrix_sync(pa, Ps_w + k * 16, PS);
      wmma::load_matrix_sync(vb, Vs + k * 16 * KP + n * 16, KP);
      wmma::mma_sync(acc, pa, vb, acc);
    }
    wmma::store_matrix_sync(Os_w + n * 16, acc, D, wmma::mem_row_major);
  }
  __syncthreads();
}

__syncwarp();
for (int e = lane; e < 16 * D; e += 32) {
  int row = e / D, i = q0 + warp * 16 + row;
  if (i < L) out[(((size_t)b * HQ + h) * L + i) * D + e % D] = Os_w[e] / Ls[warp * 16 + row];
}
"""


def shared_bytes(head_dim: int) -> int:
    kp = head_dim + 8
    warps = THREADS // 32
    return (2 * KEY_TILE * kp * 2 + warps * 16 * (KEY_TILE + 4) * 4
            + warps * 16 * (KEY_TILE + 8) * 2 + warps * 16 * head_dim * 4 + 3 * QUERY_ROWS * 4)


@lru_cache(maxsize=None)
def _kernel(head_dim: int):
    return mx.fast.cuda_kernel(
        name=f"orchard_packed_prefill_d{head_dim}",
        input_names=["q", "kf", "vf", "kc", "ks", "ko", "vc", "vs", "vo", "dims"],
        output_names=["out"], source=_SOURCE, header=_HEADER,
        ensure_row_contiguous=True, shared_memory=shared_bytes(head_dim))


def packed_prefill_attention(q, hist, k_new, v_new, *, fmt, scale: float):
    """Same contract as engine.attention.packed.direct_attention with the default causal mask,
    no history mask and no sinks; CUDA only."""
    B, Hq, L, D = q.shape
    Hkv = k_new.shape[1]
    S = hist.length
    if D % GROUP_SIZE or D % 16:
        raise ValueError(f"head dim {D} unsupported")
    qh = rotate(q.astype(mx.float32) * scale).astype(mx.bfloat16)
    kf = rotate(k_new).astype(mx.bfloat16)
    vf = v_new.astype(mx.bfloat16)
    dims = mx.array([B, Hq, Hkv, L, S], dtype=mx.int32)
    blocks = B * Hq * -(-L // QUERY_ROWS)
    (out,) = _kernel(D)(
        inputs=[qh, kf, vf, hist.k.codes, hist.k.scales, hist.k.offsets,
                hist.v.codes, hist.v.scales, hist.v.offsets, dims],
        template=[("D", D), ("KB", fmt.k_bits), ("VB", fmt.v_bits)],
        grid=(blocks * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, Hq, L, D)], output_dtypes=[mx.float32])
    return out.astype(q.dtype)
