// Warp-level tensor-core products (mma.sync), the 3xTF32 splits that keep them about as accurate as float32, and the
// cp.async copies that stage their tiles, shared by the tensor-core kernels. Free of torch headers (compiles with
// plain nvcc).
//
// Fragment layouts of m16n8k8 TF32 (row.col), lane = 4 g + t:
//   A (16 x 8): a0 = A[g][t], a1 = A[g + 8][t], a2 = A[g][t + 4], a3 = A[g + 8][t + 4]
//   B (8 x 8):  b0 = B[t][g], b1 = B[t + 4][g]
//   C (16 x 8): c0 = C[g][2t], c1 = C[g][2t + 1], c2 = C[g + 8][2t], c3 = C[g + 8][2t + 1]
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace gpfast {
namespace cuda {

__device__ __forceinline__ uint32_t tf32_round(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

// x = hi + lo with hi, lo in TF32 (lo rounded too: x - hi is exact in float32)
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = tf32_round(x);
  lo = tf32_round(__fsub_rn(x, __uint_as_float(hi)));
}

// c += a b for a 16x8 A and an 8x8 B (m16n8k8, TF32 in, float32 accumulate)
__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d = a b + c (m16n8k8, TF32 in, float32 accumulate) with c in registers of its own, so that a bias can start an
// accumulator without a copy into it
__device__ __forceinline__ void mma_tf32_from(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                              const float (&c)[4]) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %11, %12, %13};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

// c += (ah + al)(bh + bl) less al bl (3xTF32), with the large products in `big` and the small ones in `small`
// (added by the caller): two dependency chains of the tensor pipe instead of one three times as long.
__device__ __forceinline__ void mma_3xtf32_split(float (&big)[4], float (&small)[4], const uint32_t (&ah)[4],
                                                 const uint32_t (&al)[4], uint32_t bh0, uint32_t bh1, uint32_t bl0,
                                                 uint32_t bl1) {
  mma_tf32(small, al, bh0, bh1);
  mma_tf32(small, ah, bl0, bl1);
  mma_tf32(big, ah, bh0, bh1);
}

// cp.async copies into shared memory (16 bytes a thread), as the tensor-core kernels stage their tiles
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void cp_async_wait_one() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }
// 16 bytes from global to shared memory, those past the first `bytes` (0 .. 16) zero-filled
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, int bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(bytes));
}
// until at most N of this thread's committed groups are in flight
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// x = hi + lo for an MMA operand, three ways (kSplit): 0, both halves rounded to TF32 by cvt.rna (as every other
// operand); 1, Veltkamp's split (hi = c - (c - p) with c = p (2^13 + 1): hi keeps 11 bits, rounded to nearest, on
// the FMA units) and lo passed as it is, the tensor core dropping its bits below TF32 (at most 2^-23 p); 2, hi
// rounded half up by an integer add and mask, lo as in 1. Why: Nsight Compute put the integer/logic pipe first in
// K @ V's tensor-core kernel (matmul_tensor.cuh, its operand P) with the cvt.rna split (47.6% of its cycles at
// n = 200,000, H200, measured with 32-column tiles). On the H200 at 10^6 points (d = 8, t = 16) the three took
// 1.28, 1.09 and 1.07 s with the same error (4.7e-7 against float64; plain float32 1.5e-6),
// experiments/results/bench_matmul_kernels.md. symmetric_matmul.cuh takes 2 for every operand: it splits each
// element of K twice (its two roles) and is short of issue slots, not of accuracy.
template <int kSplit>
__device__ __forceinline__ void split_p(float p, uint32_t& hi, uint32_t& lo) {
  if constexpr (kSplit == 0) {
    split_tf32(p, hi, lo);
  } else if constexpr (kSplit == 1) {
    const float c = __fmul_rn(p, 8193.0f);  // explicit roundings: a contraction into an FMA would break the split
    const float h = __fsub_rn(c, __fsub_rn(c, p));
    hi = __float_as_uint(h);
    lo = __float_as_uint(__fsub_rn(p, h));
  } else {
    const float h = __uint_as_float((__float_as_uint(p) + 0x1000u) & 0xffffe000u);
    hi = __float_as_uint(h);
    lo = __float_as_uint(__fsub_rn(p, h));
  }
}

// c += a b for an 8x4 A and a 4x8 B in double (m8n8k4, the FP64 tensor cores): a = A[g][t], b = B[t][g],
// c = {C[g][2t], C[g][2t + 1]} for lane 4g + t
__device__ __forceinline__ void mma_f64(double (&c)[2], double a, double b) {
  asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%0, %1};"
      : "+d"(c[0]), "+d"(c[1])
      : "d"(a), "d"(b));
}

}  // namespace cuda
}  // namespace gpfast
