"""The C++ text the CPU emulator (bench/cuda_emulate.py) compiles a kernel body into, kept
apart from the emulator's Python (build, run, the kernels' runners) so that module stays
under the 400-line limit as its shared helpers grow: PRELUDE, CUDA's builtins and the fiber
barriers and warp shuffles in plain C++; ASYNC_CPU, tile_helpers.ASYNC's CPU twins (cp.async
queued per thread and done at its wait); MMA_CPU, tile_helpers.MMA's (a warp's fragments
exchanged through shared slots, as shuffles are); MAIN, the program that runs a grid block by
block, one fiber per GPU thread (LOAD, CALL and SAVE filled in by cuda_emulate.build).
"""

PRELUDE = r"""
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <ucontext.h>
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
struct Dim { unsigned int x = 0, y = 0, z = 0; };
static Dim threadIdx, blockIdx, blockDim, gridDim;
struct __nv_bfloat16 { uint16_t x; };
struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(8) uint2 { unsigned int x, y; };
struct alignas(16) float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __expf(float x) { return std::exp(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
inline unsigned int __funnelshift_r(unsigned int lo, unsigned int hi, unsigned int sh) {
  const uint64_t x = ((uint64_t)hi << 32) | lo;
  return (unsigned int)(x >> (sh & 31u));
}
inline float to_f(float x) { return x; }
inline float to_f(__nv_bfloat16 v) { return __uint_as_float((unsigned int)v.x << 16); }
inline void put(float* p, float v) { *p = v; }
inline void put(__nv_bfloat16* p, float v) {
  unsigned int u; std::memcpy(&u, &v, 4);
  u += 0x7fffu + ((u >> 16) & 1u);           // round to nearest even
  p->x = (uint16_t)(u >> 16);
}

// Fibers: one per GPU thread of the running block; sync points switch back to the scheduler.
static int g_threads = 0, g_current = 0;
static std::vector<ucontext_t> g_ctx;
static ucontext_t g_main;
static std::vector<int> g_wait;              // 0 runnable, 1 waiting at a barrier, 2 done
static int g_block_arrived = 0;
static int g_warp_arrived[32];
static void block_barrier() {
  const int me = g_current;
  if (++g_block_arrived == g_threads) {
    g_block_arrived = 0;
    for (int t = 0; t < g_threads; ++t) if (g_wait[t] == 1) g_wait[t] = 0;
    return;
  }
  g_wait[me] = 1;
  swapcontext(&g_ctx[me], &g_main);
}
static void warp_barrier() {
  const int me = g_current, w = me / 32;
  if (++g_warp_arrived[w] == 32) {
    g_warp_arrived[w] = 0;
    for (int t = w * 32; t < w * 32 + 32; ++t) if (g_wait[t] == 3) g_wait[t] = 0;
    return;
  }
  g_wait[me] = 3;
  swapcontext(&g_ctx[me], &g_main);
}
inline void __syncthreads() { block_barrier(); }
inline void __syncwarp() { warp_barrier(); }
static unsigned int g_slot[32][32];
template <typename T>
inline T __shfl_sync(unsigned int, T v, int src) {
  const int me = g_current, w = me / 32, lane = me % 32;
  std::memcpy(&g_slot[w][lane], &v, 4);
  warp_barrier();
  T r; std::memcpy(&r, &g_slot[w][src & 31], 4);
  warp_barrier();
  return r;
}
template <typename T>
inline T __shfl_xor_sync(unsigned int m, T v, int o) {
  return __shfl_sync(m, v, (g_current % 32) ^ o);
}
struct Copy { void* dst; const void* src; int n; int group; };
static std::vector<std::vector<Copy>> g_pending;
static std::vector<int> g_groups;   // groups each thread committed
"""

ASYNC_CPU = r"""
template <int N> inline void orch_cp_async(void* dst, const void* src) {
  // The GPU faults on a misaligned cp.async; buffers here are 16-byte aligned as MLX's are.
  if (((uintptr_t)dst | (uintptr_t)src) % N) {
    std::fprintf(stderr, "misaligned cp.async of %d bytes\n", N);
    std::exit(5);
  }
  g_pending[g_current].push_back({dst, src, N, g_groups[g_current]});
}
inline void orch_cp_commit() { ++g_groups[g_current]; }
// Copies of every group but the newest N committed land; the rest stay queued.
template <int N> inline void orch_cp_wait() {
  std::vector<Copy>& q = g_pending[g_current];
  std::vector<Copy> keep;
  for (const Copy& c : q) {
    if (c.group < g_groups[g_current] - N) std::memcpy(c.dst, c.src, c.n);
    else keep.push_back(c);
  }
  q.swap(keep);
}
inline void orch_cp_wait_all() { orch_cp_wait<0>(); }
"""

MMA_CPU = r"""
// tile_helpers.MMA's twins. fp16 <-> float by bits (round to nearest even; the kernels' values
// are normal and in range: no subnormal or overflow path is needed to check them).
inline uint16_t orch_f16_bits(float f) {
  unsigned int u; std::memcpy(&u, &f, 4);
  const unsigned int sign = (u >> 16) & 0x8000u;
  const int e = (int)((u >> 23) & 0xffu) - 127 + 15;
  unsigned int m = u & 0x7fffffu;
  if (e <= 0) return (uint16_t)sign;          // below fp16's normal range: 0 (never reached)
  unsigned int h = ((unsigned int)e << 10) | (m >> 13);
  const unsigned int rest = m & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return (uint16_t)(sign | h);
}
inline float orch_f16_float(uint16_t h) {
  const unsigned int sign = (unsigned int)(h & 0x8000u) << 16;
  const unsigned int e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) return 0.0f;
  const unsigned int u = sign | ((e - 15 + 127) << 23) | (m << 13);
  float f; std::memcpy(&f, &u, 4); return f;
}
inline unsigned int orch_half2(float lo, float hi) {
  return (unsigned int)orch_f16_bits(lo) | ((unsigned int)orch_f16_bits(hi) << 16);
}
inline unsigned int orch_half2_minus_one(unsigned int x) {
  return orch_half2(orch_f16_float((uint16_t)(x & 0xffffu)) - 1.0f,
                    orch_f16_float((uint16_t)(x >> 16)) - 1.0f);
}
// Every lane posts its fragments, then computes its four outputs from the warp's (the PTX
// fragment layout of mma.m16n8k16 .row.col: tile_helpers.MMA's comment).
static unsigned int g_frag[32][32][6];
inline void orch_mma_f16(float* d, const unsigned int* a, const unsigned int* b) {
  const int me = g_current, w = me / 32, lane = me % 32;
  for (int i = 0; i < 4; ++i) g_frag[w][lane][i] = a[i];
  for (int i = 0; i < 2; ++i) g_frag[w][lane][4 + i] = b[i];
  warp_barrier();
  auto half = [&](int l, int reg, int k) {
    const unsigned int x = g_frag[w][l][reg];
    return orch_f16_float((uint16_t)((k & 1) ? x >> 16 : x & 0xffffu));
  };
  for (int i = 0; i < 4; ++i) {
    const int row = lane / 4 + (i >= 2 ? 8 : 0), col = 2 * (lane % 4) + (i & 1);
    float acc = d[i];
    for (int k = 0; k < 16; ++k) {
      const float x = half((row % 8) * 4 + (k % 8) / 2, (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0), k);
      const float y = half(col * 4 + (k % 8) / 2, 4 + (k >= 8 ? 1 : 0), k);
      acc += x * y;
    }
    d[i] = acc;
  }
  warp_barrier();
}
"""

MAIN = r"""
static void (*g_body)() = nullptr;
static void fiber_entry() {
  threadIdx.x = g_current;
  g_body();
  g_wait[g_current] = 2;
  swapcontext(&g_ctx[g_current], &g_main);
}
static std::vector<char> read_file(const char* dir, const char* name) {
  char path[4096]; std::snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE* f = std::fopen(path, "rb");
  if (!f) { std::fprintf(stderr, "missing %s\n", path); std::exit(3); }
  std::fseek(f, 0, SEEK_END); long n = std::ftell(f); std::fseek(f, 0, SEEK_SET);
  std::vector<char> buf(n + 16);
  if (std::fread(buf.data(), 1, n, f) != (size_t)n) std::exit(3);
  std::fclose(f);
  return buf;
}
int main(int argc, char** argv) {
  const char* dir = argv[1];
  const int gx = std::atoi(argv[2]), gy = std::atoi(argv[3]), nt = std::atoi(argv[4]);
  LOAD
  g_threads = nt; blockDim.x = nt; gridDim.x = gx; gridDim.y = gy; gridDim.z = 1;
  blockDim.y = blockDim.z = 1;
  g_ctx.resize(nt); g_wait.assign(nt, 0); g_pending.assign(nt, {});
  g_groups.assign(nt, 0);
  const size_t stack = 1 << 18;
  std::vector<char> stacks((size_t)nt * stack);
  g_body = [] { CALL };
  for (int by = 0; by < gy; ++by) {
    for (int bx = 0; bx < gx; ++bx) {
      blockIdx.x = bx; blockIdx.y = by;
      for (int t = 0; t < nt; ++t) {
        getcontext(&g_ctx[t]);
        g_ctx[t].uc_stack.ss_sp = stacks.data() + (size_t)t * stack;
        g_ctx[t].uc_stack.ss_size = stack;
        g_ctx[t].uc_link = nullptr;
        makecontext(&g_ctx[t], fiber_entry, 0);
        g_wait[t] = 0;
      }
      int done = 0;
      while (done < nt) {
        bool ran = false;
        for (int t = 0; t < nt; ++t) {
          if (g_wait[t] != 0) continue;
          g_current = t; threadIdx.x = t;
          swapcontext(&g_main, &g_ctx[t]);
          ran = true;
          if (g_wait[t] == 2) ++done;
        }
        if (!ran && done < nt) { std::fprintf(stderr, "deadlock in block %d,%d\n", bx, by); return 4; }
      }
    }
  }
  SAVE
  return 0;
}
"""
