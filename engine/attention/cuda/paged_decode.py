"""Decode attention straight from native pages as one CUDA kernel (CUDA backend only).

Why: on the H200 a decode step is bound by the host cost of issuing its graph, and the gather
path costs, per layer, a gather of every row's pages for K and for V, index and cast nodes, and
(batch > 1) a boolean mask that MLX's CUDA SDPA cannot take natively (`supports_bool_mask` is
false, and an array mask rules out its vector kernel). This kernel replaces all of that by one
launch: one block per (row, KV head, split) serves the head's GQA query heads, walks its part of
the row's page table, and keeps an online softmax per warp (FP32) that the block merges at the
end.

Split-K over the history: with few rows (batch 1 at 4K is 3-4 blocks on a 132-SM GPU) one block
per (row, head) leaves the GPU idle, so the keys of each row are cut into `splits` contiguous
ranges, one block each; every block writes an unnormalised partial (running max, sum, FP32
output) and `merge_splits` (a second small kernel) combines them. Short contexts keep one split
and one launch, as before. The split plan and the merge are shared with the packed-page decode
kernel (engine/attention/cuda/packed_decode.py): the tiling lives here once, so a Metal twin
(`mx.fast.metal_kernel`) can follow the same structure (none exists yet; nothing here ran on
Metal).

Only rows of one query token, full attention (no window), no sinks; the runner checks that and
keeps the gather path otherwise.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from functools import lru_cache

import mlx.core as mx

THREADS = 128          # 4 warps per block
WARPS = THREADS // 32
HEAD_DIMS = (64, 128)
# Split plan (measured on the H200 only at the sizes in docs/lab/benchmarks-gpu.md): aim for about
# TARGET_BLOCKS blocks per layer (132 SMs, a few blocks resident each), never fewer than
# MIN_KEYS_PER_SPLIT keys per block (below that the partials cost more than they save), at most
# MAX_SPLITS.
TARGET_BLOCKS = 528
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64
# Warps per block of the native kernel where a caller asks for more than WARPS
# (KernelChoices.decode_warps): at batch 1 and short contexts one split gives rows * KV heads
# blocks (8 at the Llama 8B shape), so each of 4 warps walks a quarter of the row's keys one
# after another; more warps per block shorten that walk without the merge kernel a split
# costs. The block merge keeps NW * G * D floats in shared memory, so the count is capped to
# stay inside SHARED_FLOATS (static shared memory is 48 KB per block).
SHARED_FLOATS = 10240
# The warp count compiled traces ask for (`decode_warps`): a context variable, not an argument,
# because the call site in engine/attention/paged.py passes split choices only. None: WARPS.
_ASKED_WARPS: ContextVar[int | None] = ContextVar("orchard_decode_warps", default=None)
# Unasked, a grid of at most SMALL_GRID_BLOCKS blocks (batch 1-2 at short contexts: one split,
# rows x KV heads blocks) gets SMALL_GRID_WARPS warps per block. Measured on the H200 at batch
# 1 after 160 tokens (bench.decode_sweep, docs/lab/decode-graph-8b.md "Sweep run 1"): 16 warps
# made the Llama-3.1-8B step 5.06-5.20 ms against 5.93-6.05 with 4, the 1B step 1.69-2.26
# against 2.11-2.42. Larger grids keep WARPS (not measured with more).
SMALL_GRID_BLOCKS = 16
SMALL_GRID_WARPS = 16

HEADER = """
#include <cuda_bf16.h>
#include <cuda_fp16.h>
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ void put(float* p, float v) { *p = v; }
__device__ __forceinline__ void put(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }
__device__ __forceinline__ void put(__half* p, float v) { *p = __float2half(v); }
"""

# The block-level end of every decode kernel here. Each warp has merged its keys into one
# online-softmax state (m[g], l[g] and FP32 outputs); `store` (kernel-specific) writes it to
# sm/sl/sa, then the warps are merged and the block writes either the final output (SPLIT
# false) or its partial: part[(row_head * NS + split) * D + d] and
# ml[(row_head * NS + split) * 2 + {0: running max, 1: sum}].
# Expects: NW, G, D, SPLIT, NEG_INF, b, hk, HQ, split, NS, out, part, ml.
BLOCK_MERGE = """
__shared__ float sm[NW][G], sl[NW][G], sa[NW][G][D];
{store}
__syncthreads();
for (int e = threadIdx.x; e < G * D; e += blockDim.x) {{
  const int g = e / D, d = e % D;
  float mx_ = NEG_INF;
  for (int w = 0; w < NW; ++w) mx_ = fmaxf(mx_, sm[w][g]);
  float den = 0.0f, num = 0.0f;
  for (int w = 0; w < NW; ++w) {{
    if (sm[w][g] == NEG_INF) continue;   // a warp that saw no key
    const float c = __expf(sm[w][g] - mx_);
    den += sl[w][g] * c;
    num += sa[w][g][d] * c;
  }}
  const size_t rh = (size_t)(b * HQ + hk * G + g);
  if (SPLIT) {{
    part[(rh * NS + split) * D + d] = num;
    if (d == 0) {{ ml[(rh * NS + split) * 2] = mx_; ml[(rh * NS + split) * 2 + 1] = den; }}
  }} else {{
    put(out + rh * D + d, num / den);
  }}
}}
"""

# The native kernel's body. With OWN (the `_native_kernel(own=True)` variant) the row's newest
# key, position ends[b] - 1, is not read from the pages but from the inputs kn / vn [B, HKV, D]
# (the step's own keys after RoPE and its values), and the kernel writes them to their page
# slot itself: the decode step then issues no page scatter at all (see
# `paged_decode_attention`'s `own`). No block reads that slot from the pages, so the write
# races with no read; split 0's last warp writes, the block whose key range holds the position
# attends to it from the inputs, in the plain kernel's order.
_NATIVE = """
constexpr int NW = 4;
constexpr int VPT = D / 32;
const int HQ = dims[0], HKV = dims[1], NP = dims[2], P = dims[3];
const int hk = blockIdx.x % HKV;
const int b = blockIdx.x / HKV;
const int split = blockIdx.y, NS = gridDim.y;
const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
const int n = ends[b];
const int per = (n + NS - 1) / NS;
const int j0 = split * per;
const int j1 = min(OWN ? n - 1 : n, j0 + per);   // keys read from the pages
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
// One key into every query head's online softmax (kv, vv: this lane's VPT elements).
auto visit = [&](const float* kv, const float* vv) {
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
};
for (int j = j0 + warp; j < j1; j += NW) {
  const int page = pages[(size_t)b * P + j / PT];
  const size_t base = (((size_t)hk * NP + page) * PT + j % PT) * D + lane * VPT;
  float kv[VPT], vv[VPT];
  #pragma unroll
  for (int i = 0; i < VPT; ++i) {
    kv[i] = to_f(kp[base + i]);
    vv[i] = to_f(vp[base + i]);
  }
  visit(kv, vv);
}
""" + BLOCK_MERGE.format(store="""
#pragma unroll
for (int g = 0; g < G; ++g) {
  if (lane == 0) { sm[warp][g] = m[g]; sl[warp][g] = l[g]; }
  #pragma unroll
  for (int i = 0; i < VPT; ++i) sa[warp][g][lane * VPT + i] = acc[g][i];
}""")

# The OWN variant's extra part, placed before the block merge (`_native_source`).
_OWN = """
const int pos = n - 1;
const size_t own = ((size_t)b * HKV + hk) * D + lane * VPT;
// The warp that would read it last from the pages (j = j0 + warp, step NW) attends to it, so
// every sum runs in the plain kernel's order: the output is bit-identical to the scatter path.
if (pos >= j0 && pos < j0 + per && warp == (pos - j0) % NW) {
  float kv[VPT], vv[VPT];
  #pragma unroll
  for (int i = 0; i < VPT; ++i) { kv[i] = to_f(kn[own + i]); vv[i] = to_f(vn[own + i]); }
  visit(kv, vv);
}
if (split == 0 && warp == NW - 1) {
  // The write MLX does not know of: kp / vp are inputs (const) to MLX, written in place here.
  const int page = pages[(size_t)b * P + pos / PT];
  const size_t slot = (((size_t)hk * NP + page) * PT + pos % PT) * D + lane * VPT;
  #pragma unroll
  for (int i = 0; i < VPT; ++i) {
    put(const_cast<TK*>(kp) + slot + i, to_f(kn[own + i]));
    put(const_cast<TK*>(vp) + slot + i, to_f(vn[own + i]));
  }
}
"""


def _native_source(own: bool, warps: int = WARPS) -> str:
    """The kernel body: `_NATIVE` with the OWN part spliced in before the block merge, and
    `warps` warps per block (the default text is unchanged for WARPS, which the emulator
    checks of bench/cuda_emulate_inplace.py run)."""
    head, merge = _NATIVE.split("__shared__ float sm[NW][G]", 1)
    if warps != WARPS:
        head = head.replace(f"constexpr int NW = {WARPS};", f"constexpr int NW = {warps};", 1)
    return head + (_OWN if own else "") + "__shared__ float sm[NW][G]" + merge


def block_warps(asked: int | None, group: int, head_dim: int) -> int:
    """Warps per block for `asked` (None: WARPS): a power of two from WARPS up, at most what
    SHARED_FLOATS holds for the block merge of `group` query heads of `head_dim`."""
    warps = WARPS
    while warps * 2 <= (asked or WARPS) and warps * 2 * group * head_dim <= SHARED_FLOATS:
        warps *= 2
    return warps


def launch_warps(asked: int | None, blocks: int, group: int, head_dim: int) -> int:
    """Warps per block for a native decode launch of `blocks` blocks: `asked` where given, else
    SMALL_GRID_WARPS on a small grid and WARPS on a larger one (capped as block_warps caps)."""
    if asked is None and blocks <= SMALL_GRID_BLOCKS:
        asked = SMALL_GRID_WARPS
    return block_warps(asked, group, head_dim)


@contextmanager
def asked_warps(warps: int | None):
    """Native decode kernels launched inside take `warps` warps per block (see _ASKED_WARPS;
    engine/runner/compiled_decode.py wraps its trace in it)."""
    token = _ASKED_WARPS.set(warps)
    try:
        yield
    finally:
        _ASKED_WARPS.reset(token)


_MERGE = """
const int r = blockIdx.x, d = threadIdx.x;
const int NS = dims[0];
const float NEG_INF = -__int_as_float(0x7f800000);
float M = NEG_INF;
for (int s = 0; s < NS; ++s) M = fmaxf(M, ml[((size_t)r * NS + s) * 2]);
float num = 0.0f, den = 0.0f;
for (int s = 0; s < NS; ++s) {
  const float m = ml[((size_t)r * NS + s) * 2];
  if (m == NEG_INF) continue;   // a split with no key (rows shorter than the longest)
  const float c = __expf(m - M);
  den += ml[((size_t)r * NS + s) * 2 + 1] * c;
  num += part[((size_t)r * NS + s) * D + d] * c;
}
put(out + (size_t)r * D + d, num / den);
"""


@lru_cache(maxsize=None)
def _native_kernel(own: bool = False, warps: int = WARPS):
    """The native decode kernel; `own`: the variant that attends to and writes the step's own
    keys and values (inputs kn, vn); `warps` per block."""
    extra = ["kn", "vn"] if own else []
    return mx.fast.cuda_kernel(
        name="orchard_paged_decode" + ("_own" if own else "")
        + ("" if warps == WARPS else f"_w{warps}"),
        input_names=["q", "kp", "vp", "pages", "ends", "dims", "scale", *extra],
        output_names=["out", "part", "ml"], source=_native_source(own, warps), header=HEADER,
        ensure_row_contiguous=True)


@lru_cache(maxsize=None)
def _merge_kernel():
    return mx.fast.cuda_kernel(
        name="orchard_decode_merge", input_names=["part", "ml", "dims"], output_names=["out"],
        source=_MERGE, header=HEADER, ensure_row_contiguous=True)


def available() -> bool:
    """Whether the default device is a CUDA GPU (the kernels' only backend)."""
    cuda = getattr(mx, "cuda", None)
    return (mx.default_device() == mx.gpu and cuda is not None
            and bool(getattr(cuda, "is_available", lambda: False)()))


@lru_cache(maxsize=4096)
def split_count(rows: int, kv_heads: int, longest: int,
                target_blocks: int | None = None, min_keys: int | None = None) -> int:
    """Blocks per (row, KV head) for a decode step whose longest row attends `longest` keys.

    Pure host arithmetic (tests pin it): as many splits as it takes to reach about
    `target_blocks` blocks (None: TARGET_BLOCKS), but no split shorter than `min_keys` keys
    (None: MIN_KEYS_PER_SPLIT).
    """
    if rows < 1 or kv_heads < 1 or longest < 1:
        raise ValueError(f"split_count needs positive sizes, got {rows}, {kv_heads}, {longest}")
    by_blocks = -(-(target_blocks or TARGET_BLOCKS) // (rows * kv_heads))
    by_keys = -(-longest // (min_keys or MIN_KEYS_PER_SPLIT))
    return max(1, min(by_blocks, by_keys, MAX_SPLITS))


@lru_cache(maxsize=256)
def _dims(*values: int) -> mx.array:
    return mx.array(values, dtype=mx.int32)


@lru_cache(maxsize=None)
def _scale(scale: float) -> mx.array:
    return mx.array([scale], dtype=mx.float32)


def launch_split(kernel, inputs: list, template: list, rows: int, kv_heads: int, hq: int,
                 head_dim: int, splits: int, dtype: mx.Dtype,
                 threads: int = THREADS) -> mx.array:
    """Launch a decode kernel built on BLOCK_MERGE over (rows * kv_heads, splits) blocks of
    `threads` threads and return [rows, hq, 1, head_dim] in `dtype` (merging the partials
    when splits > 1)."""
    out, part, ml = kernel(inputs=inputs, **_launch_args(tuple(template), rows, kv_heads, hq,
                                                         head_dim, splits, dtype, threads))
    if splits == 1:
        return out
    (merged,) = _merge_kernel()(inputs=[part, ml, _dims(splits)],
                                **_merge_args(rows, hq, head_dim, dtype))
    return merged


def native_template(head_dim: int, group: int, page_tokens: int, q_dtype: mx.Dtype,
                    kv_dtype: mx.Dtype, own: bool) -> list:
    """The native kernel's template arguments (besides SPLIT and TO, which launch_split adds):
    what a compiled variant is keyed by (decode_precompile compiles the same ones)."""
    return [("D", head_dim), ("G", group), ("PT", page_tokens), ("TQ", q_dtype),
            ("TK", kv_dtype), ("OWN", own)]


@lru_cache(maxsize=1024)
def _launch_args(template: tuple, rows: int, kv_heads: int, hq: int, head_dim: int,
                 splits: int, dtype: mx.Dtype, threads: int = THREADS) -> dict:
    """The launch's keyword arguments, built once per shape (every layer of a step, and every
    step of a batch size, launches with the same ones)."""
    parts = splits if splits > 1 else 1
    return dict(template=[*template, ("SPLIT", splits > 1), ("TO", dtype)],
                grid=(rows * kv_heads * threads, splits, 1), threadgroup=(threads, 1, 1),
                output_shapes=[(rows, hq, 1, head_dim), (rows * hq * parts, head_dim),
                               (rows * hq * parts, 2)],
                output_dtypes=[dtype, mx.float32, mx.float32])


@lru_cache(maxsize=1024)
def _merge_args(rows: int, hq: int, head_dim: int, dtype: mx.Dtype) -> dict:
    return dict(template=[("D", head_dim), ("TO", dtype)], grid=(rows * hq * head_dim, 1, 1),
                threadgroup=(head_dim, 1, 1), output_shapes=[(rows, hq, 1, head_dim)],
                output_dtypes=[dtype])


def paged_decode_attention(q: mx.array, k_pages: mx.array, v_pages: mx.array, pages: mx.array,
                           ends: mx.array, scale: float, longest: int,
                           target_blocks: int | None = None,
                           min_keys: int | None = None,
                           own: tuple[mx.array, mx.array] | None = None,
                           warps: int | None = None) -> mx.array:
    """Attention of one query per row [B, Hq, 1, D] over head-major pages [kvh, NP, T, D]:
    row b reads keys 0..ends[b]-1 through its page table `pages[b]`; `longest` is max(ends) on
    the host (it picks the split count, aiming at `target_blocks`). Returns [B, Hq, 1, D].

    `own`: the step's own keys and values [B, kvh, 1, D] (key ends[b] - 1 of each row, not yet
    in the pages). The kernel attends to them from these arrays and writes them to their page
    slot IN PLACE, behind MLX's back (MLX sees the pages as inputs only), so the step issues no
    scatter. Why: the scatters are two graph nodes per layer, and in pipelined decode a page
    array is often still held by the previous step's kernels when the next scatter is issued,
    so MLX cannot update it in place and copies the layer's whole page array first (counted:
    docs/lab/engine-kernel-notes.md). What this relies on: the page arrays are
    whole row-contiguous arrays the store holds (so MLX passes the kernel their buffers, never a
    copy), and every reader of the pages runs on the same stream after this kernel, or reads
    them on the host only after the step retired (as the engine does).

    `warps`: warps per block (None: what `asked_warps` set, else SMALL_GRID_WARPS on a grid of
    at most SMALL_GRID_BLOCKS blocks and WARPS on larger ones; see block_warps)."""
    b, hq, _, d = q.shape
    kvh, num_pages, page_tokens, _ = k_pages.shape
    splits = split_count(b, kvh, longest, target_blocks, min_keys)
    extra = [] if own is None else [a if a.dtype == k_pages.dtype else a.astype(k_pages.dtype)
                                    for a in own]
    nw = launch_warps(warps if warps is not None else _ASKED_WARPS.get(), b * kvh * splits,
                      hq // kvh, d)
    return launch_split(
        _native_kernel(own is not None, nw),
        [q, k_pages, v_pages, pages, ends, _dims(hq, kvh, num_pages, pages.shape[1]),
         _scale(float(scale)), *extra],
        native_template(d, hq // kvh, page_tokens, q.dtype, k_pages.dtype, own is not None),
        b, kvh, hq, d, splits, q.dtype, 32 * nw)
