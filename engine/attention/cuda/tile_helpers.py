"""CUDA helper text for tiled kernels (first user: cuda/packed_decode_v2_source.py), and the
host-side check that a packed layer's pool is addressed as the kernels assume (`check_pool`).

ASYNC: cp.async global -> shared copies (inline PTX, sm_80+). MMA: a warp's 16 x 8 x 16
tensor-core product and fp16 packing. HELPERS: packed-code unpacking without conversion
instructions, shared-memory word loads, warp reductions. Kept apart from the kernels so the
CPU emulation (bench/cuda_emulate.py) can swap ASYNC and MMA for CPU twins and run the rest as
written. Names carry an `orch_` prefix: the kernels live in namespace mlx::core::cu,
where an MLX helper of the same plain name (MLX's default header comes first) would win
unqualified lookup. Then the kernel-body text the split decode kernels (v2 and
cuda/page_key_decode_source.py) share, one text so a fix reaches both: BLOCK_INDEX,
ACCUMULATORS, DOT4, online_softmax, RESCALE, packed_pv, split_output.
"""
from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from capacity.formats import GROUP_SIZE
from engine.kv.page_layout import SECTIONS, PageLayout

# The asynchronous-copy helpers (inline PTX); bench/cuda_emulate.py swaps in CPU twins.
ASYNC = """
// A shared-memory pointer as cp.async's 32-bit shared address. Through the intrinsic, not an
// asm block: the compiler then adds offsets to the array's 32-bit address, where an opaque cvta
// made it build a 64-bit generic address for every piece first (about half of the page-key
// kernel's copy issue: bench.cuda_sass_loops).
__device__ __forceinline__ unsigned int orch_smem_u32(const void* p) {
  return static_cast<unsigned int>(__cvta_generic_to_shared(p));
}
// Asynchronous global -> shared copy of N bytes (4, 8 or 16; 16 bypasses L1: streamed once).
template <int N>
__device__ __forceinline__ void orch_cp_async(void* dst, const void* src) {
  if (N == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(orch_smem_u32(dst)), "l"(src)
                 : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" :: "r"(orch_smem_u32(dst)), "l"(src),
                 "n"(N) : "memory");
  }
}
__device__ __forceinline__ void orch_cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void orch_cp_wait_all() {
  asm volatile("cp.async.wait_group 0;" ::: "memory");
}
// Wait until at most N of this thread's newest committed groups are still in flight.
template <int N>
__device__ __forceinline__ void orch_cp_wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}
"""

# Tensor-core helpers (inline PTX, sm_80+); bench/cuda_emulate.py swaps in CPU twins (a warp's
# fragments exchanged as its shuffles are).
MMA = """
// D += A B for one warp: A 16 x 16 (rows: lane / 4 and lane / 4 + 8; columns 2 (lane % 4) + {0, 1}
// in a[0] / a[1], + 8 in a[2] / a[3]), B 16 x 8 (column lane / 4; rows as A's columns, b[0] and
// b[1]), fp16 pairs (low half first); D 16 x 8 float (d[0], d[1]: row lane / 4, columns
// 2 (lane % 4) + {0, 1}; d[2], d[3]: the row 8 below).
__device__ __forceinline__ void orch_mma_f16(float* d, const unsigned int* a,
                                             const unsigned int* b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
               "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// Two floats as an fp16 pair, rounded to nearest even: lo in the low half.
__device__ __forceinline__ unsigned int orch_half2(float lo, float hi) {
  unsigned int r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
// An fp16 pair minus 1.0 each (exact for the codes 1 + c / 2^k it is given: c / 2^k).
__device__ __forceinline__ unsigned int orch_half2_minus_one(unsigned int x) {
  unsigned int r;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(x), "r"(0x3c003c00u));
  return r;
}
"""

HELPERS = """
// 1.0f's bits as a value ptxas cannot fold into an immediate. The codes below are
// (x & mask) | one: with both constants immediate ptxas emits an AND and an OR per code (a LOP3
// takes one immediate), with `one` in a register a single LOP3 (bench.cuda_sass_loops: the
// page-key score pass 612 -> 556 instructions a tile). ptxas folds every constant it can see, so
// the bits are ORed with a test on a kernel input that is never NaN (the softmax scale).
__device__ __forceinline__ unsigned int orch_one_bits(float never_nan) {
  return 0x3f800000u | (unsigned int)(never_nan != never_nan);
}
// A packed code c as the float 1 + c / 2^KB: the code goes into the top KB mantissa bits of 1.0f
// (a shift and a LOP3 with `one` = orch_one_bits; no int-to-float conversion, no subtraction).
// Any bits give a finite value, so stale shared memory past a tile's last key can never make a
// NaN. The kernel corrects for the 1 with sum(q) terms it already needs for the group offsets.
template <int KB>
__device__ __forceinline__ float orch_code1(unsigned int w, int i, unsigned int one) {
  constexpr int TOP = 23 - KB;
  const int sh = i * KB;
  const unsigned int x = sh <= TOP ? (w << (TOP - sh)) : (w >> (sh - TOP));
  return __uint_as_float((x & (((1u << KB) - 1u) << TOP)) | one);
}
// N consecutive 32-bit words from shared memory in the widest aligned loads.
template <int N>
__device__ __forceinline__ void orch_load_words(const unsigned int* p, unsigned int* w) {
  if (N % 4 == 0) {
    #pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const uint4 v = reinterpret_cast<const uint4*>(p)[i];
      w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
    }
  } else if (N % 2 == 0) {
    #pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const uint2 v = reinterpret_cast<const uint2*>(p)[i];
      w[2 * i] = v.x; w[2 * i + 1] = v.y;
    }
  } else {
    #pragma unroll
    for (int i = 0; i < N; ++i) w[i] = p[i];
  }
}
__device__ __forceinline__ float orch_warp_sum(float v) {
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  return v;
}
__device__ __forceinline__ float orch_warp_max(float v) {
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
  return v;
}
"""

# Kernel-body text the split decode kernels (cuda/packed_decode_v2_source.py and
# cuda/page_key_decode_source.py: launch_split's grid and block) share word for word, so a fix
# to one reaches both. BLOCK_INDEX: which (row, KV head, split) this block is and its thread.
BLOCK_INDEX = """
const int HQ = dims[0], HKV = dims[1], P = dims[2];
const int hk = blockIdx.x % HKV;
const int b = blockIdx.x / HKV;
const int split = blockIdx.y, NS = gridDim.y;
const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
const int n = ends[b];                       // keys of this row, the step's own key last
"""

# A thread's PV accumulators: every head for its CPW channels.
ACCUMULATORS = """
float acc[G][CPW];
#pragma unroll
for (int h = 0; h < G; ++h) {
  #pragma unroll
  for (int i = 0; i < CPW; ++i) acc[h][i] = 0.0f;
}
"""

# A thread's accumulators times each head's rescale factor cf (before a tile's PV pass).
RESCALE = """
#pragma unroll
for (int h = 0; h < G; ++h) {
  const float ch = cf[h];
  #pragma unroll
  for (int i = 0; i < CPW; ++i) acc[h][i] *= ch;
}
"""

# The score pass's inner step: key i's four channels x0..x3 (dequantized or not) into every
# head's running dot product, against qv[h], the head's four query channels.
DOT4 = """
        #pragma unroll
        for (int h = 0; h < G; ++h) {
          dot[i][h] = fmaf(qv[h].x, x0, dot[i][h]);
          dot[i][h] = fmaf(qv[h].y, x1, dot[i][h]);
          dot[i][h] = fmaf(qv[h].z, x2, dot[i][h]);
          dot[i][h] = fmaf(qv[h].w, x3, dot[i][h]);
        }
"""

# One online-softmax step per head (warp h) over the scores s[h][r] = sp[h * KT + r] summed
# over SLICES slices, r < cnt: tile max, rescale factor cf, p; WEIGHTS stores each key's PV
# weights from p (and its `valid`) and, for packed values, adds the group terms pvo
# (online_softmax). GROUP_* lines: those terms (value groups' offsets folded into the sums).
_ONLINE_SOFTMAX = """
for (int h = warp; h < G; h += NW) {
  float s[KPT];
  float tmax = NEG_INF;
  #pragma unroll
  for (int i = 0; i < KPT; ++i) {
    const int r = lane + 32 * i;
    s[i] = NEG_INF;
    if (r < cnt) {
      float v = 0.0f;
      #pragma unroll
      for (int w = 0; w < SLICES; ++w) v += sp[(w * G + h) * KT + r];
      s[i] = v;
      tmax = fmaxf(tmax, v);
    }
  }
  tmax = orch_warp_max(tmax);
  const float m_old = st_m[h], m_new = fmaxf(m_old, tmax);   // finite: cnt >= 1
  const float c = __expf(m_old - m_new);
  float psum = 0.0f;
GROUP_INIT
  #pragma unroll
  for (int i = 0; i < KPT; ++i) {
    const int r = lane + 32 * i;
    const bool valid = r < cnt;
    const float p = valid ? __expf(s[i] - m_new) : 0.0f;
    psum += p;
WEIGHTS
  }
  psum = orch_warp_sum(psum);
GROUP_SUM
  if (lane == 0) {
    st_l[h] = st_l[h] * c + psum;
    st_m[h] = m_new;
    cf[h] = c;
GROUP_STATE
  }
}
"""

_GROUP_TERMS = {
    "GROUP_INIT": "  float pvo[NG];\n  #pragma unroll\n"
                  "  for (int g = 0; g < NG; ++g) pvo[g] = 0.0f;",
    "GROUP_SUM": "  #pragma unroll\n"
                 "  for (int g = 0; g < NG; ++g) pvo[g] = orch_warp_sum(pvo[g]);",
    "GROUP_STATE": "    #pragma unroll\n    for (int g = 0; g < NG; ++g)\n"
                   "      st_ao[g * GP + h] = st_ao[g * GP + h] * c + pvo[g];",
}


def online_softmax(slices: str, weights: str, value_groups: bool = True) -> str:
    """_ONLINE_SOFTMAX summing `slices` (an expression) slices, with `weights` (lines);
    `value_groups` off: no group terms (bf16 values carry no per-group offsets)."""
    text = _ONLINE_SOFTMAX.replace("SLICES", slices).replace("WEIGHTS\n", weights)
    for marker, lines in _GROUP_TERMS.items():
        text = text.replace(marker + "\n", lines + "\n" if value_groups else "")
    return text


# A tile's PV pass over packed values (inside the tile loop, sv: the stage's value codes):
# thread (pk, sub) takes word pk of the rows of keys sub, sub + NSUB, ..., every head for its
# CPW channels, weights pw per (key, group, head) (0 past the tile's keys, so the whole tile
# is read). WORDS, BITS: the kernel's value code words per row and value bits (packed_pv);
# the kernel defines ONE = orch_one_bits(scale) (HELPERS) before it.
_PACKED_PV = """
  #pragma unroll
  for (int u = 0; u < KT / NSUB; ++u) {
    const int r = sub + u * NSUB;
    const unsigned int wv = sv[r * WORDS + pk];
    float ph[GP];
    #pragma unroll
    for (int v = 0; v < GP / 4; ++v) {
      const float4 x = *reinterpret_cast<const float4*>(pw + (r * NG + pg) * GP + 4 * v);
      ph[4 * v] = x.x; ph[4 * v + 1] = x.y; ph[4 * v + 2] = x.z; ph[4 * v + 3] = x.w;
    }
    #pragma unroll
    for (int i = 0; i < CPW; ++i) {
      const float x = orch_code1<BITS>(wv, i, ONE);
      #pragma unroll
      for (int h = 0; h < G; ++h) acc[h][i] = fmaf(ph[h], x, acc[h][i]);
    }
  }
"""


def packed_pv(words: str, bits: str) -> str:
    """_PACKED_PV for value rows of `words` code words of `bits` bits (constexprs' names)."""
    return _PACKED_PV.replace("WORDS", words).replace("BITS", bits)


# The page-key kernels' native keys (a row's partial last page from its tail slot as the step
# began, and the step's own key), in full precision: warp w scores keys w, w + NW, ... of the
# ncnt from a0 against every query head (qs, scaled) into sp[h * STRIDE + r]. Expects a0,
# ncnt, nh, native_row(pos) (a key's element offset), kt, kf, qs, sp, NW, VPT.
# NKU keys a warp a pass, all loads before the first sum (device run 16, m3: no change at 4K
# batch 1 in 192-key splits; at MIN_KEYS's 64-key splits up to 63 of a split's keys are native).
_NATIVE_KEY_SCORES = """
constexpr int NKU = 4;                       // native keys a warp loads at once
for (int r0 = warp; r0 < ncnt; r0 += NW * NKU) {
  float k[NKU][VPT];
  #pragma unroll
  for (int u = 0; u < NKU; ++u) {
    const int r = r0 + u * NW, pos = a0 + r;
    const size_t at = native_row(pos) + lane * VPT;
    #pragma unroll
    for (int i = 0; i < VPT; ++i)
      k[u][i] = r >= ncnt ? 0.0f : pos < nh ? to_f(kt[at + i]) : to_f(kf[at + i]);
  }
  #pragma unroll
  for (int u = 0; u < NKU; ++u) {
    #pragma unroll
    for (int h = 0; h < G; ++h) {
      float d_ = 0.0f;
      #pragma unroll
      for (int i = 0; i < VPT; ++i) d_ = fmaf(qs[h * D + lane * VPT + i], k[u][i], d_);
      d_ = orch_warp_sum(d_);
      if (lane == 0 && r0 + u * NW < ncnt) sp[h * STRIDE + r0 + u * NW] = d_;
    }
  }
}
"""


def native_key_scores(stride: str) -> str:
    """_NATIVE_KEY_SCORES with score rows `stride` apart (a constexpr's name)."""
    return _NATIVE_KEY_SCORES.replace("STRIDE", stride)


# The end of a split decode block: sum the key subsets inside a warp by shuffles (lanes pk +
# WORDS * s), then the warps through shared memory (the stage buffers, free now); add each
# group's constant term (NUM0); write the block's output (one split) or its partial for the
# merge kernel (BLOCK_MERGE's format). WORDS: the lanes a value row spans (split_output).
_SPLIT_OUTPUT = """
#pragma unroll
for (int o = WORDS; o < 32; o <<= 1) {
  #pragma unroll
  for (int h = 0; h < G; ++h) {
    #pragma unroll
    for (int i = 0; i < CPW; ++i) acc[h][i] += __shfl_xor_sync(0xffffffff, acc[h][i], o);
  }
}
float* const red = smem;                     // [NW][G][D]
if (lane < WORDS) {
  #pragma unroll
  for (int h = 0; h < G; ++h) {
    #pragma unroll
    for (int i = 0; i < CPW; ++i) red[(warp * G + h) * D + c0 + i] = acc[h][i];
  }
}
__syncthreads();
for (int e = tid; e < G * D; e += NT) {
  const int h = e / D, d = e % D;
  float num = NUM0;
  #pragma unroll
  for (int w = 0; w < NW; ++w) num += red[(w * G + h) * D + d];
  const size_t rh = (size_t)(b * HQ + hk * G + h);
  if (SPLIT) {
    part[(rh * NS + split) * D + d] = num;
    if (d == 0) { ml[(rh * NS + split) * 2] = st_m[h]; ml[(rh * NS + split) * 2 + 1] = st_l[h]; }
  } else {
    put(out + rh * D + d, num / st_l[h]);
  }
}
"""


def split_output(words: str, value_groups: bool = True) -> str:
    """_SPLIT_OUTPUT for a kernel whose value rows span `words` (a constexpr's name) lanes;
    `value_groups` off: no group terms to add (bf16 values)."""
    num0 = "st_ao[(d / 64) * GP + h]" if value_groups else "0.0f"
    return _SPLIT_OUTPUT.replace("WORDS", words).replace("NUM0", num0)


def kernel_layout(page_tokens: int, heads: int, head_dim: int, k_bits: int,
                  v_bits: int) -> PageLayout:
    """The page layout the kernels' CUDA_SECTIONS computes from its template ints (64-channel
    groups for keys and values)."""
    return PageLayout.for_format(page_tokens, heads, head_dim, k_bits, v_bits, GROUP_SIZE,
                                 GROUP_SIZE)


@lru_cache(maxsize=None)
def _pool_problem(layout: PageLayout, head_dim: int, k_bits: int, v_bits: int,
                  vectors: bool) -> str | None:
    want = kernel_layout(layout.page_tokens, layout.heads, head_dim, k_bits, v_bits)
    if layout != want:
        return (f"layout {layout} is not the one the kernel computes from its template ints "
                f"(engine.kv.page_layout.CUDA_SECTIONS: {want})")
    if not vectors:
        return None
    # Code sections are read by 16-byte pieces (uint4 loads, cp.async of 16 bytes) and v2
    # copies a row's scale/offset groups by one cp.async of 4 * D/64 bytes: every such piece
    # must start aligned in every page (the pool's base is; MLX allocations are 16-byte aligned).
    for name in SECTIONS:
        unit = 4 if name.endswith("codes") else layout.width(name)
        if layout.offsets[name] % unit or layout.width(name) % unit or layout.page_words % unit:
            return (f"section {name} of layout {layout} (offset {layout.offsets[name]}, page "
                    f"{layout.page_words} words) breaks the {4 * unit}-byte alignment of the "
                    f"kernel's vector reads")
    return None


def check_pool(pool, layout: PageLayout, head_dim: int, k_bits: int, v_bits: int,
               kv_heads: int, vectors: bool = True) -> None:
    """Raise ValueError unless `pool` [num_pages, page_words] uint32 and its `layout` are what a
    packed kernel's CUDA_SECTIONS addressing assumes: the layout of these bits and head dim
    (64-channel groups) for `kv_heads` heads, and, with `vectors` (kernels that read sections by
    16-byte vectors or cp.async), sections starting aligned in every page. Cheap per call (the
    layout part is cached): the decode kernels run it every layer and step."""
    problem = _pool_problem(layout, head_dim, k_bits, v_bits, vectors)
    if problem is None and layout.heads != kv_heads:
        problem = f"layout has {layout.heads} heads, the fresh rows {kv_heads}"
    if problem is None and (pool.ndim != 2 or pool.shape[1] != layout.page_words
                            or pool.dtype != mx.uint32):
        problem = (f"pool {pool.dtype} {tuple(pool.shape)} is not uint32 "
                   f"[pages, {layout.page_words}]")
    if problem is not None:
        raise ValueError(f"packed kernel pool: {problem}")
