// Warp-level tensor-core products (mma.sync) and the 3xTF32 split that keeps them about as accurate as float32,
// shared by the tensor-core kernels. Free of torch headers (compiles with plain nvcc).
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

// c += (ah + al)(bh + bl) less al bl (3xTF32), with the large products in `big` and the small ones in `small`
// (added by the caller): two dependency chains of the tensor pipe instead of one three times as long.
__device__ __forceinline__ void mma_3xtf32_split(float (&big)[4], float (&small)[4], const uint32_t (&ah)[4],
                                                 const uint32_t (&al)[4], uint32_t bh0, uint32_t bh1, uint32_t bl0,
                                                 uint32_t bl1) {
  mma_tf32(small, al, bh0, bh1);
  mma_tf32(small, ah, bl0, bl1);
  mma_tf32(big, ah, bh0, bh1);
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
