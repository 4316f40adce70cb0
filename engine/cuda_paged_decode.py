"""Decode attention straight from native pages as one CUDA kernel (CUDA backend only).

Why: on the H200 a decode step is bound by the host cost of issuing its graph, and the gather
path costs, per layer, a gather of every row's pages for K and for V, index and cast nodes, and
(batch > 1) a boolean mask that MLX's CUDA SDPA cannot take natively (`supports_bool_mask` is
false, and an array mask rules out its vector kernel). This kernel replaces all of that by one
launch: one block per (row, KV head) serves the head's GQA query heads, walks the row's page
table, and keeps an online softmax per warp (FP32) that the block merges at the end.

Only rows of one query token, full attention (no window), no sinks; the runner checks that and
keeps the gather path otherwise. Parallelism is one block per (row, KV head) with no split over
the history, so very long contexts at small batch would be slow: above `MAX_KEYS` keys the runner
keeps the gather path.
"""
from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

THREADS = 128          # 4 warps; warp w takes keys w, w + 4, ...
MAX_KEYS = 4096        # longest row the kernel serves (no split-K yet)
HEAD_DIMS = (64, 128)

_HEADER = """
#include <cuda_bf16.h>
#include <cuda_fp16.h>
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ void put(float* p, float v) { *p = v; }
__device__ __forceinline__ void put(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }
__device__ __forceinline__ void put(__half* p, float v) { *p = __float2half(v); }
"""

_SOURCE = """
constexpr int NW = 4;
constexpr int VPT = D / 32;
const int HQ = dims[0], HKV = dims[1], NP = dims[2], P = dims[3];
const int hk = blockIdx.x % HKV;
const int b = blockIdx.x / HKV;
const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
const int n = ends[b];
const float sc = scale[0];
const float NEG_INF = -__int_as_float(0x7f800000);

float qv[G][VPT], acc[G][VPT], m[G], l[G];
#pragma unroll
for (int g = 0; g < G; ++g) {
  m[g] = NEG_INF; l[g] = 0.0f;
  #pragma unroll
  for (int i = 0; i < VPT; ++i) {
    qv[g][i] = to_f(q[((size_t)(b * HQ + hk * G + g)) * D + lane * VPT + i]) * sc;
    acc[g][i] = 0.0f;
  }
}
for (int j = warp; j < n; j += NW) {
  const int page = pages[(size_t)b * P + j / PT];
  const size_t base = (((size_t)hk * NP + page) * PT + j % PT) * D + lane * VPT;
  float kv[VPT], vv[VPT];
  #pragma unroll
  for (int i = 0; i < VPT; ++i) {
    kv[i] = to_f(kp[base + i]);
    vv[i] = to_f(vp[base + i]);
  }
  #pragma unroll
  for (int g = 0; g < G; ++g) {
    float s = 0.0f;
    #pragma unroll
    for (int i = 0; i < VPT; ++i) s += qv[g][i] * kv[i];
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
    const float mn = fmaxf(m[g], s);
    const float c = __expf(m[g] - mn), p = __expf(s - mn);
    l[g] = l[g] * c + p;
    #pragma unroll
    for (int i = 0; i < VPT; ++i) acc[g][i] = acc[g][i] * c + p * vv[i];
    m[g] = mn;
  }
}
__shared__ float sm[NW][G], sl[NW][G], sa[NW][G][D];
#pragma unroll
for (int g = 0; g < G; ++g) {
  if (lane == 0) { sm[warp][g] = m[g]; sl[warp][g] = l[g]; }
  #pragma unroll
  for (int i = 0; i < VPT; ++i) sa[warp][g][lane * VPT + i] = acc[g][i];
}
__syncthreads();
for (int e = threadIdx.x; e < G * D; e += blockDim.x) {
  const int g = e / D, d = e % D;
  float mx_ = NEG_INF;
  for (int w = 0; w < NW; ++w) mx_ = fmaxf(mx_, sm[w][g]);
  float den = 0.0f, num = 0.0f;
  for (int w = 0; w < NW; ++w) {
    if (sm[w][g] == NEG_INF) continue;   // a warp that saw no key
    const float c = __expf(sm[w][g] - mx_);
    den += sl[w][g] * c;
    num += sa[w][g][d] * c;
  }
  put(out + ((size_t)(b * HQ + hk * G + g)) * D + d, num / den);
}
"""


@lru_cache(maxsize=None)
def _kernel():
    return mx.fast.cuda_kernel(
        name="orchard_paged_decode", input_names=["q", "kp", "vp", "pages", "ends", "dims",
                                                   "scale"],
        output_names=["out"], source=_SOURCE, header=_HEADER, ensure_row_contiguous=True)


def available() -> bool:
    """Whether the default device is a CUDA GPU (the kernel's only backend)."""
    cuda = getattr(mx, "cuda", None)
    return (mx.default_device() == mx.gpu and cuda is not None
            and bool(getattr(cuda, "is_available", lambda: False)()))


@lru_cache(maxsize=256)
def _dims(hq: int, kvh: int, num_pages: int, width: int) -> mx.array:
    return mx.array([hq, kvh, num_pages, width], dtype=mx.int32)


@lru_cache(maxsize=None)
def _scale(scale: float) -> mx.array:
    return mx.array([scale], dtype=mx.float32)


def paged_decode_attention(q: mx.array, k_pages: mx.array, v_pages: mx.array, pages: mx.array,
                           ends: mx.array, scale: float) -> mx.array:
    """Attention of one query per row [B, Hq, 1, D] over head-major pages [kvh, NP, T, D]:
    row b reads keys 0..ends[b]-1 through its page table `pages[b]`. Returns [B, Hq, 1, D]."""
    b, hq, _, d = q.shape
    kvh, num_pages, page_tokens, _ = k_pages.shape
    dims = _dims(hq, kvh, num_pages, pages.shape[1])
    (out,) = _kernel()(
        inputs=[q, k_pages, v_pages, pages, ends, dims, _scale(float(scale))],
        template=[("D", d), ("G", hq // kvh), ("PT", page_tokens)],
        grid=(b * kvh * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[q.shape], output_dtypes=[q.dtype])
    return out
