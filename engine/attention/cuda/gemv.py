"""One-token linear layers (y = W x, W [out, in] row-major) as a CUDA kernel (CUDA only).

Why (issue 33): batch-1 decode streams every weight once per token, so its speed is the GEMV's
bandwidth. MLX's CUDA GEMV (`gemv_impl`, what both mlx-lm and the engine run for `x @ W.T`)
gives each row one warp that loads 4 elements (8 bytes) per lane per iteration; at the
Llama-3.1-8B shape mlx-lm decodes at about two thirds of the H200's HBM limit. This kernel loads
16 bytes per lane (8 elements) and unrolls the walk over a row four times, so each lane has up
to 64 bytes in flight; one warp per row, 8 rows per block, FP32 accumulation, the output
rounded to the weight's dtype as MLX's is. Whether it is faster on the device, and whether its
launch (a custom kernel costs more host time than MLX's own) pays, is bench.decode_sweep's
question (`gemv_kernel` variant, `matmul_alone`); nothing uses it by default.

Lives beside the attention kernels because it shares their header and conventions.
"""
from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from engine.attention.cuda.paged_decode import HEADER

ROWS_PER_BLOCK = 8      # warps per block, one output row each
VEC = 8                 # bf16 elements per 16-byte load

# Expects: TW (the weight's, x's and the output's dtype: bfloat16), K (input features, a
# multiple of VEC), N, ROWS.
# No early return: every lane of every warp reaches the shuffles (rows past N read nothing).
SOURCE = """
const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
const int row = blockIdx.x * ROWS + warp;
const bool live = row < N;
const uint4* wr = reinterpret_cast<const uint4*>(w + (size_t)(live ? row : 0) * K);
const uint4* xr = reinterpret_cast<const uint4*>(x);
float sum = 0.0f;
if (live) {
  #pragma unroll 4
  for (int c = lane; c < K / 8; c += 32) {
    const uint4 a = wr[c];
    const uint4 b = xr[c];
    // Each 32-bit word holds two bf16 (low half first); widened by shifting into a float's
    // high bits (bf16 is float32's top half), not by casting the vector to element pointers,
    // which breaks C++ aliasing rules (the CPU emulator's g++ -O2 then reads garbage).
    const unsigned int aw[4] = {a.x, a.y, a.z, a.w}, bw[4] = {b.x, b.y, b.z, b.w};
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
      sum += __uint_as_float(aw[i] << 16) * __uint_as_float(bw[i] << 16);
      sum += __uint_as_float(aw[i] & 0xffff0000u) * __uint_as_float(bw[i] & 0xffff0000u);
    }
  }
}
#pragma unroll
for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
if (live && lane == 0) put(out + row, sum);
"""


@lru_cache(maxsize=None)
def _kernel():
    return mx.fast.cuda_kernel(name="orchard_gemv", input_names=["w", "x"],
                               output_names=["out"], source=SOURCE, header=HEADER,
                               ensure_row_contiguous=True)


def fits(x: mx.array, weight: mx.array) -> bool:
    """One token of bfloat16 (the kernel widens bf16 bits) whose width the kernel's 16-byte
    loads divide."""
    return (x.size == x.shape[-1] and weight.ndim == 2 and x.shape[-1] == weight.shape[1]
            and weight.shape[1] % VEC == 0 and x.dtype == weight.dtype == mx.bfloat16)


def gemv(x: mx.array, weight: mx.array) -> mx.array:
    """`x @ weight.T` for one token x [..., K] (`fits`): [..., N] in the weight's dtype."""
    n, k = weight.shape
    (out,) = _kernel()(
        inputs=[weight, x.reshape(k)],
        template=[("TW", weight.dtype), ("K", k), ("N", n), ("ROWS", ROWS_PER_BLOCK)],
        grid=(-(-n // ROWS_PER_BLOCK) * 32 * ROWS_PER_BLOCK, 1, 1),
        threadgroup=(32 * ROWS_PER_BLOCK, 1, 1), output_shapes=[(n,)],
        output_dtypes=[weight.dtype])
    return out.reshape(*x.shape[:-1], n)
