// Probe for sm_90a: does multicasting the B tile across a 2-CTA cluster lift a blockwise fp8
// GEMM's rate? Both Triton-side kernels (forward 128 x 256, wgrad 128 x 128) move ~7.2-7.5 TB/s
// from L2 at their measured rates, and ncu put the wgrad's L2 at 86% of peak (round 61); the
// device's Triton 3.6 Gluon has no TMA multicast, so this is plain CUDA.
//
// Contract (dense, no masking: M % 256 == 0, N % 256 == 0, K % 128 == 0):
//   a [M, K] e4m3 K-major, sa [K / 128, M] float (one scale per row and K block, rows contiguous),
//   b [N, K] e4m3 K-major, sb [N / 128, K / 128] float (one per 128 x 128 block),
//   c [M, N] bf16 = sum over K blocks of (a_blk @ b_blk^T) * sa * sb, promoted in fp32 per block.
// One CTA: a 128 x 256 tile, one TMA warpgroup (one thread issues), two math warpgroups of 64
// rows, each working the 256 columns as two 128-column halves (accumulators 2 x 64 registers,
// one 64-register partial), the same schedule as the Gluon kernel gluon-ws-r8.
// Grid: (M / 128) * (N / 256) CTAs in one dimension.
// fp8bw_c2: clusters of two CTAs along M; each CTA loads its own A tile and one 128-row half of
// B, multicast into both CTAs, so each CTA reads 32 KiB per K block from L2 instead of 48.
#include <cuda_bf16.h>
#include <stdint.h>

struct __align__(64) TmaDesc {
  unsigned long long v[16];
};

namespace {
constexpr int BM = 128, BN = 256, BK = 128, STAGES = 4;
constexpr int A_BYTES = BM * BK;
constexpr int B_HALF_BYTES = 128 * BK;
constexpr int STAGE_BYTES = A_BYTES + 2 * B_HALF_BYTES;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}
__device__ __forceinline__ void mbar_arrive_local(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Arrive on the barrier at the same offset in cluster CTA `cta` (which may be this one).
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t cta) {
  asm volatile(
      "{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
      "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [ra];\n}\n" ::"r"(bar),
      "r"(cta)
      : "memory");
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void tma_load(const TmaDesc* desc, uint32_t dst, uint32_t bar, int x, int y) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(desc)), "r"(x), "r"(y), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tma_load_multicast(const TmaDesc* desc, uint32_t dst, uint32_t bar, int x, int y,
                                                   uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(desc)), "r"(x), "r"(y), "r"(bar), "h"(mask)
      : "memory");
}
// wgmma shared-memory descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
__device__ __forceinline__ void fence_regs(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void wgmma_m64n128k32(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// 64 x 128 partial of one K block: four k32 wgmmas, the first overwriting.
__device__ __forceinline__ void mma_block(float (&part)[64], uint32_t a_tile, uint32_t b_tile) {
  wgmma_fence();
  fence_regs(part);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    wgmma_m64n128k32(part, smem_desc(a_tile) + 2 * kk, smem_desc(b_tile) + 2 * kk, kk > 0);
  }
  wgmma_commit();
  wgmma_wait_all();
  fence_regs(part);
}
__device__ __forceinline__ void promote(float (&acc)[64], const float (&part)[64], float s0, float s1) {
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = fmaf(part[i], (i & 2) ? s1 : s0, acc[i]);
}

template <int CLUSTER>
__device__ __forceinline__ void gemm_body(const TmaDesc& tm_a, const TmaDesc& tm_b, const float* __restrict__ sa,
                                          const float* __restrict__ sb, __nv_bfloat16* __restrict__ c, int M, int N,
                                          int K) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023) & ~1023u;  // 128-byte swizzle needs 1 KiB aligned tiles
  const uint32_t bars = base + STAGES * STAGE_BYTES;
  auto a_slot = [&](int s) { return base + s * STAGE_BYTES; };
  auto b_slot = [&](int s) { return base + s * STAGE_BYTES + A_BYTES; };
  auto full = [&](int s) { return bars + 8 * s; };
  auto empty = [&](int s) { return bars + 8 * (STAGES + s); };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = threadIdx.x / 128;
  uint32_t rank = 0;
  if (CLUSTER > 1) asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  // Tiles run N-fastest in pairs of M tiles (a cluster's two CTAs share one N tile), so the
  // CTAs resident at once share a few A tiles and all of B in L2. Both kernels use this order.
  const int num_n = N / BN, pair = blockIdx.x >> 1;
  const int m0 = (2 * (pair / num_n) + (blockIdx.x & 1)) * BM, n0 = (pair % num_n) * BN, nk = K / BK;

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), CLUSTER * 8);  // every math warp of every CTA that reads the slot's B
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (CLUSTER > 1) cluster_sync(); else __syncthreads();

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      for (int kb = 0; kb < nk; ++kb) {
        const int s = kb % STAGES;
        if (kb >= STAGES) mbar_wait(empty(s), ((kb / STAGES) - 1) & 1);
        mbar_expect_tx(full(s), STAGE_BYTES);
        tma_load(&tm_a, a_slot(s), full(s), kb * BK, m0);
        if (CLUSTER == 2) {
          tma_load_multicast(&tm_b, b_slot(s) + rank * B_HALF_BYTES, full(s), kb * BK, n0 + rank * 128, 0x3);
        } else {
          tma_load(&tm_b, b_slot(s), full(s), kb * BK, n0);
          tma_load(&tm_b, b_slot(s) + B_HALF_BYTES, full(s), kb * BK, n0 + 128);
        }
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int cw = wg - 1;
    const int r0 = m0 + cw * 64 + (warp % 4) * 16 + lane / 4, r1 = r0 + 8;
    const float* sb0 = sb + static_cast<size_t>(n0 / 128) * nk;
    const float* sb1 = sb0 + nk;
    float acc0[64], acc1[64], part[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc0[i] = acc1[i] = 0.f;
    for (int kb = 0; kb < nk; ++kb) {
      const int s = kb % STAGES;
      const float a0 = __ldg(sa + static_cast<size_t>(kb) * M + r0), a1 = __ldg(sa + static_cast<size_t>(kb) * M + r1);
      const float b0 = __ldg(sb0 + kb), b1 = __ldg(sb1 + kb);
      mbar_wait(full(s), (kb / STAGES) & 1);
      const uint32_t a_tile = a_slot(s) + cw * 64 * BK;
      mma_block(part, a_tile, b_slot(s));
      promote(acc0, part, a0 * b0, a1 * b0);
      mma_block(part, a_tile, b_slot(s) + B_HALF_BYTES);
      if (CLUSTER == 2) {
        if (lane < 2) mbar_arrive_cluster(empty(s), lane);
      } else if (lane == 0) {
        mbar_arrive_local(empty(s));
      }
      promote(acc1, part, a0 * b1, a1 * b1);
    }
    // Straight from registers: 4-byte stores, enough for a probe whose K loop dominates.
    const int col = n0 + (lane % 4) * 2;
#pragma unroll
    for (int q = 0; q < 16; ++q) {
      __nv_bfloat162* p0 = reinterpret_cast<__nv_bfloat162*>(c + static_cast<size_t>(r0) * N + col + q * 8);
      __nv_bfloat162* p1 = reinterpret_cast<__nv_bfloat162*>(c + static_cast<size_t>(r1) * N + col + q * 8);
      *p0 = __floats2bfloat162_rn(acc0[4 * q], acc0[4 * q + 1]);
      *p1 = __floats2bfloat162_rn(acc0[4 * q + 2], acc0[4 * q + 3]);
      __nv_bfloat162* p2 = reinterpret_cast<__nv_bfloat162*>(c + static_cast<size_t>(r0) * N + col + 128 + q * 8);
      __nv_bfloat162* p3 = reinterpret_cast<__nv_bfloat162*>(c + static_cast<size_t>(r1) * N + col + 128 + q * 8);
      *p2 = __floats2bfloat162_rn(acc1[4 * q], acc1[4 * q + 1]);
      *p3 = __floats2bfloat162_rn(acc1[4 * q + 2], acc1[4 * q + 3]);
    }
  }
  // A CTA must outlive its peer's multicasts into it and its peer's arrivals on its barriers.
  if (CLUSTER > 1) cluster_sync();
}
}  // namespace

extern "C" __global__ void __launch_bounds__(384, 1)
    fp8bw_c1(const __grid_constant__ TmaDesc tm_a, const __grid_constant__ TmaDesc tm_b, const float* sa,
             const float* sb, __nv_bfloat16* c, int M, int N, int K) {
  gemm_body<1>(tm_a, tm_b, sa, sb, c, M, N, K);
}

extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(384, 1)
    fp8bw_c2(const __grid_constant__ TmaDesc tm_a, const __grid_constant__ TmaDesc tm_b, const float* sa,
             const float* sb, __nv_bfloat16* c, int M, int N, int K) {
  gemm_body<2>(tm_a, tm_b, sa, sb, c, M, N, K);
}
