"""Rotate and quantize a step's new K/V rows in one CUDA kernel (CUDA backend only).

Why: a packed layer's write in MLX ops is ~40 ops per layer and step (rotation: cast, sign
multiply, Hadamard; then per K and per V: reshape, min, max, subtract, divide, where, round,
clip, cast, shift, sum, squeezes), and on a GPU a decode step is bound by the host cost of
issuing its graph: that alone made int4 decode at batch 1 much slower than native
(docs/lab/engine-kernel-notes.md).
This kernel computes the same codes, scales and offsets as `quantize(rotate(k))` and
`quantize(v)` (engine/kv/quant.py, engine/kv/rotation.py) in one launch: one warp per (row, head) of
K or V holds the D channels in registers (D/32 per lane), applies the fixed signs and the
Sylvester-order fast Walsh-Hadamard transform (in registers, then across lanes by shuffles),
takes each 64-channel group's min and max by shuffles, and packs codes little-end-first into
uint32 words. It emits each row's record for the layer's one pool (engine.kv.page_layout: the
row's K codes, V codes, K scales, K offsets, V scales, V offsets, each [heads, width], FP32 as its
bits), so the store writes the step with one scatter. Same FP32 arithmetic and round-half-even
as the MLX path, so codes agree except where a value sits on a rounding boundary
(`python -m bench.cuda_check` reports the fraction).

Head dims 64 and 128 (one Hadamard block), 4 or 8 bits; anything else keeps the MLX ops.
Checked by `bench.cuda_check --kernels write` on a GPU (bit-exact) and on the CPU emulator
(bench/cuda_emulate.py); never run on Metal. Where it was checked: docs/lab/engine-kernel-notes.md.
"""
from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from capacity.formats import GROUP_SIZE
from engine.attention.cuda.paged_decode import HEADER, available
from engine.kv.page_layout import PageLayout, record_template
from engine.kv.rotation import rotation_signs

HEAD_DIMS = (64, 128)
BITS = (4, 8)
WARPS = 4
# One (row, head) of K or V quantized by one warp, as engine/kv/quant.py does (keys after
# engine/kv/rotation.py's rotation): x holds this lane's VPT = D / 32 channels from lane * VPT.
# `rotate` (keys): x R first (the fixed signs, then the normalised Sylvester-order Walsh-Hadamard
# transform: in registers, then across lanes). Leaves in `word` the packed word that holds
# channel lane * VPT (every lane sharing that word gets it whole) and in `sc` / `lo` the scale and
# offset of the lane's 64-channel group. Whole warps only (it shuffles). Shared with the packed
# decode kernel, which stores a step's own row this way (cuda/packed_decode_v2_source.py).
QUANTIZE = """
template <int D, int BITS>
__device__ __forceinline__ void orch_quantize(float (&x)[D / 32], bool rotate, const float* signs,
                                              int lane, unsigned int& word, float& sc, float& lo) {
  constexpr int VPT = D / 32;          // channels per lane
  constexpr int LPG = 64 / VPT;        // lanes per 64-channel group
  constexpr int VPW = 32 / BITS;       // channels per packed word
  const float top = (float)((1 << BITS) - 1);
  if (rotate) {
    #pragma unroll
    for (int i = 0; i < VPT; ++i) x[i] *= signs[lane * VPT + i];
    #pragma unroll
    for (int h = 1; h < VPT; h <<= 1) {
      #pragma unroll
      for (int i = 0; i < VPT; ++i) {
        if (!(i & h)) { const float a = x[i], b = x[i + h]; x[i] = a + b; x[i + h] = a - b; }
      }
    }
    #pragma unroll
    for (int h = 1; h < 32; h <<= 1) {
      #pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const float o = __shfl_xor_sync(0xffffffff, x[i], h);
        x[i] = (lane & h) ? o - x[i] : x[i] + o;
      }
    }
    const float norm = rsqrtf((float)D);
    #pragma unroll
    for (int i = 0; i < VPT; ++i) x[i] *= norm;
  }
  lo = x[0];
  float hi = x[0];
  #pragma unroll
  for (int i = 1; i < VPT; ++i) { lo = fminf(lo, x[i]); hi = fmaxf(hi, x[i]); }
  #pragma unroll
  for (int o = 1; o < LPG; o <<= 1) {
    lo = fminf(lo, __shfl_xor_sync(0xffffffff, lo, o));
    hi = fmaxf(hi, __shfl_xor_sync(0xffffffff, hi, o));
  }
  sc = (hi - lo) / top;
  const float safe = sc > 0.0f ? sc : 1.0f;
  word = 0;
  #pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const float qf = fminf(fmaxf(rintf((x[i] - lo) / safe), 0.0f), top);
    word |= ((unsigned int)qf) << (((lane * VPT + i) % VPW) * BITS);
  }
  #pragma unroll
  for (int o = 1; o < VPW / VPT; o <<= 1) word |= __shfl_xor_sync(0xffffffff, word, o);
}
"""
_SOURCE = """
constexpr int VPT = D / 32;            // channels per lane
const int N = dims[0], H = dims[1];
const int lane = threadIdx.x % 32;
const int wi = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
if (wi >= 2 * N * H) return;           // whole warps only: shuffles below see every lane
const bool is_k = wi < N * H;
const int r = is_k ? wi : wi - N * H;  // row * H + head
const int vpw = 32 / (is_k ? KB : VB); // channels per packed word
float x[VPT];
#pragma unroll
for (int i = 0; i < VPT; ++i) x[i] = to_f((is_k ? k : v)[(size_t)r * D + lane * VPT + i]);
unsigned int word;
float sc, lo;
if (is_k) orch_quantize<D, KB>(x, true, signs, lane, word, sc, lo);
else orch_quantize<D, VB>(x, false, signs, lane, word, sc, lo);
// The row's record (engine.kv.page_layout.SECTIONS order): K codes [H][KW], V codes [H][VW],
// then K scales, K offsets, V scales, V offsets, each [H][NG] as FP32 bits.
constexpr int KW = D * KB / 32, VW = D * VB / 32, NG = D / 64;
const int row = r / H, head = r % H;
const int RW = H * (KW + VW + 4 * NG);  // words of one row's record
const int words = D / vpw, c0 = lane * VPT;
STORE_WORD
if (c0 % vpw == 0) store((is_k ? 0 : H * KW) + head * words + c0 / vpw, word);
if (c0 % 64 == 0) {
  const int meta = H * (KW + VW) + (is_k ? 0 : 2 * H * NG) + head * NG + c0 / 64;
  store(meta, __float_as_uint(sc));
  store(meta + H * NG, __float_as_uint(lo));
}
"""
# How word j of the row's record is stored: into the output records, or (IN_PLACE) straight into
# the layer's pool at the row's slot, behind MLX's back (the pool is an input to MLX): page
# slot[row][0], column tmpl[j] + slot[row][1] * tmpl[RW + j] (page_layout's record template).
_TO_RECORDS = """auto store = [&](int j, unsigned int w) { rec[(size_t)row * RW + j] = w; };"""
_IN_PLACE = """const int PWORDS = dims[2];
if (wi == 0 && lane == 0) done[0] = 0u;
auto store = [&](int j, unsigned int w) {
  const_cast<uint32_t*>(pool)[(size_t)slot[2 * row] * PWORDS + tmpl[j]
                              + (size_t)slot[2 * row + 1] * tmpl[RW + j]] = w;
};"""


def source(in_place: bool) -> str:
    """The kernel body, emitting records or (`in_place`) writing them into the pool."""
    return _SOURCE.replace("STORE_WORD", _IN_PLACE if in_place else _TO_RECORDS)


@lru_cache(maxsize=None)
def _kernel(in_place: bool = False):
    extra, output = (["pool", "slot", "tmpl"], "done") if in_place else ([], "rec")
    return mx.fast.cuda_kernel(
        name="orchard_packed_write" + ("_in_place" if in_place else ""),
        input_names=["k", "v", "signs", "dims", *extra], output_names=[output],
        source=source(in_place), header=HEADER + QUANTIZE, ensure_row_contiguous=True)


def supports(k_bits: int | None, v_bits: int | None, head_dim: int) -> bool:
    return k_bits in BITS and v_bits in BITS and head_dim in HEAD_DIMS


@lru_cache(maxsize=None)
def _signs(head_dim: int) -> mx.array:
    return mx.array(rotation_signs(head_dim), dtype=mx.float32)


@lru_cache(maxsize=256)
def _dims(*values: int) -> mx.array:
    return mx.array(values, dtype=mx.int32)


def quantize_record(k: mx.array, v: mx.array, k_bits: int, v_bits: int,
                    layout: PageLayout) -> mx.array:
    """Rows [N, H, D] as their pool records [N, layout.record_words] in one launch: the same
    words as `page_layout.packed_record(quantize(rotate(k), k_bits), quantize(v, v_bits))`."""
    return _launch(k, v, k_bits, v_bits, layout, None, None)


def write_in_place(k: mx.array, v: mx.array, k_bits: int, v_bits: int, layout: PageLayout,
                   pool: mx.array, slot: mx.array) -> mx.array:
    """Rows [N, H, D] quantized as `quantize_record` does, each record written straight into
    `pool` at its row's `slot` ([N, 2] int32: page, offset) by the kernel itself, IN PLACE:
    MLX sees the pool as an input only. Returns a one-word array that is ready once the pool
    holds the rows; the caller makes every later reader of the pool depend on it
    (`mx.depends`). Why: the record scatter it replaces is a graph node per layer and step,
    and a scatter in pipelined decode may find its array still held by the previous step, so
    MLX copies the whole array first (docs/lab/engine-kernel-notes.md counts them).
    Relies on the pool being a whole row-contiguous array the store holds, as it is."""
    return _launch(k, v, k_bits, v_bits, layout, pool, slot)


def _launch(k, v, k_bits, v_bits, layout, pool, slot) -> mx.array:
    """One launch of the kernel: records out, or (with `pool`, `slot`) written in place."""
    n, h, d = k.shape
    if (h, d * k_bits // 32, d * v_bits // 32) != (layout.heads, layout.k_words, layout.v_words) \
            or layout.k_groups != d // GROUP_SIZE or layout.v_groups != d // GROUP_SIZE:
        raise ValueError(f"rows [{n}, {h}, {d}] at {k_bits}/{v_bits} bits do not fit {layout}")
    in_place = pool is not None
    inputs = ([k, v, _signs(d), _dims(n, h, pool.shape[1]), pool, slot, _template(layout)]
              if in_place else [k, v, _signs(d), _dims(n, h)])
    warps = 2 * n * h
    (out,) = _kernel(in_place)(
        inputs=inputs, template=[("D", d), ("KB", k_bits), ("VB", v_bits), ("TI", k.dtype)],
        grid=(-(-warps // WARPS) * WARPS * 32, 1, 1), threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(1,) if in_place else (n, layout.record_words)],
        output_dtypes=[mx.uint32])
    return out


@lru_cache(maxsize=None)
def _template(layout: PageLayout) -> mx.array:
    """[2 * record_words] int32: the record template's base columns, then per-offset strides."""
    return mx.concatenate(list(record_template(layout)))


def usable(k_bits, v_bits, head_dim: int) -> bool:
    """Whether a packed store's writes may go through the kernel here and now."""
    return supports(k_bits, v_bits, head_dim) and available()
