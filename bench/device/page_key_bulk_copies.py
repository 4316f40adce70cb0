"""Bulk copies for the page-key phase probe: the warp-page kernel's page copies as Hopper's
`cp.async.bulk` (one lane a warp asks the copy engine for each section's run of a head's page,
an mbarrier a stage counts the bytes in), where the kernel issues 16-byte `cp.async` pieces
from every lane. A probe: the runs are where a page laid out with each (page, head) one run of
its sections (`head-pages`) would hold them, so on today's pools the cut kernel computes
garbage; only its time is read (bench/device/page_key_phase_probe.py, `bulk`).

Why: device run 14 (docs/lab/benchmarks-kv-page-keys.md) found the warp kernel's copies alone,
at the most contiguous addressing, at 1.67 TB/s, and more pages in flight a warp no faster: is
it the 16-byte pieces' issue that tops out, or the memory side?
"""
from __future__ import annotations

# sm_90 PTX (mbarrier with transaction counts, bulk copies into shared memory).
HELPERS = """
__device__ __forceinline__ void orch_bulk_init(unsigned int bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void orch_bulk_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// The stage's earlier reads (generic proxy) before the copy engine (async proxy) refills it.
__device__ __forceinline__ void orch_bulk_expect(unsigned int bar, unsigned int bytes) {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void orch_bulk(void* dst, const void* src, unsigned int bytes,
                                          unsigned int bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
               "[%0], [%1], %2, [%3];"
               :: "r"(orch_smem_u32(dst)), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void orch_bulk_wait(unsigned int bar, unsigned int parity) {
  unsigned int ok = 0;
  while (!ok) {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
                 "selp.u32 %0, 1, 0, p; }" : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
  }
}
"""

# The warp-page kernel's copy issue (its `issue` lambda) as bulk copies of a head's runs.
ISSUE = """__shared__ __align__(8) unsigned long long wbar[NW][ST];
auto issue = [&](int i) {                    // the warp's i-th quarter into stage i % ST
  if (i < nq && lane == 0) {
    const int j = i / QP, qq = i % QP;       // the warp's page j, its quarter qq
    const uint32_t* src = pool + (size_t)pages[(size_t)b * P + p0 + warp + j * NW] * PGW
                          + hk * (PGW / HK);
    float* st = ws + (i % ST) * STAGE;
    float* km = kmeta + (j % MB) * KM_W;
    const unsigned int bar = orch_smem_u32(&wbar[warp][i % ST]);
    orch_bulk_expect(bar, 4 * QT * (LW + VW + 2 * NG) + (qq == 0 ? 8 * D : 0));
    orch_bulk(st, src + KC_OFF / HK + qq * QT * LW, 4 * QT * LW, bar);
    orch_bulk(st + V_OFF, src + VC_OFF / HK + qq * QT * VW, 4 * QT * VW, bar);
    orch_bulk(st + VM_OFF, src + VS_OFF / HK + qq * QT * NG, 4 * QT * NG, bar);
    orch_bulk(st + VM_OFF + QT * NG, src + VO_OFF / HK + qq * QT * NG, 4 * QT * NG, bar);
    if (qq == 0) {                           // the page's key scales and offsets
      orch_bulk(km, src + KS_OFF / HK, 4 * D, bar);
      orch_bulk(km + D, src + KO_OFF / HK, 4 * D, bar);
    }
  }
};
if (lane == 0) {
  for (int s = 0; s < ST; ++s) orch_bulk_init(orch_smem_u32(&wbar[warp][s]));
  orch_bulk_fence_init();
}
__syncwarp();
"""
WAIT = "  orch_bulk_wait(orch_smem_u32(&wbar[warp][i % ST]), (i / ST) & 1);\n"
