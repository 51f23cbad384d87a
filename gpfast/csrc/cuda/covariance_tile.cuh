// Covariance, forward, tiled: K (B, n, m) for any number of features, the kernel for outputs of fewer than 1024
// columns and for d > 32, where the row-streaming kernel (covariance_forward.cuh) does not apply: it keeps a row's
// points in registers, so it needs d <= 32, and it fills the GPU by strips of 1024 columns.
//
// The kernel reads the raw points and scales them while staging, z = x / lengthscale, and forms distances from
// differences, never from the expansion |a|^2 + |b|^2 - 2ab, so they are never negative and K(x, x) == s exactly:
// K_ij = s * exp(-0.5 * |z1_i - z2_j|^2).
#pragma once

#include <cstdint>

#include "device_common.cuh"

namespace gpfast {
namespace cuda {

// exp(-0.5 sq) = 2^(c sq) with c = -0.5 log2(e). Rounding c sq to float would cost |c sq| * 2^-24 of relative
// accuracy (1e-6 at sq = 40), so c is split in two floats and the product's rounding error is kept (two FMAs);
// the MUFU ex2 of the rounded product is then corrected to first order: 2^(y + lo) ~ 2^y (1 + lo ln 2).
__device__ __forceinline__ float exp_neg_half(float sq) {
  constexpr float c_hi = -0.72134752044448170368f;
  constexpr float c_lo = static_cast<float>(-0.72134752044448170368 - static_cast<double>(c_hi));
  const float y = sq * c_hi;
  const float lo = fmaf(sq, c_lo, fmaf(sq, c_hi, -y));
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(y));
  return fmaf(e, lo * 0.69314718055994530942f, e);
}
__device__ __forceinline__ double exp_neg_half(double sq) { return exp(-0.5 * sq); }

// Each block writes a 64 x 64 tile of K; each thread a 4 x 4 micro-tile whose
// four columns are contiguous, so stores are 16-byte vectors and a half-warp writes 256 contiguous bytes.
// The feature axis is staged through shared memory in chunks of 32, so any d works.
constexpr int kCovTile = 64, kCovChunk = 32, kCovThreads = 256;

// Division by the lengthscale while staging (IEEE division, so z matches x / l computed by PyTorch bit for bit):
// no separate pre-scaling launches, which matter at the small sizes this kernel serves.
__device__ __forceinline__ float scaled(float x, float l) { return __fdiv_rn(x, l); }
__device__ __forceinline__ double scaled(double x, double l) { return __ddiv_rn(x, l); }

template <typename T>
struct CovTileArgs {
  const T* x1;     // (B, n, d)
  const T* x2;     // (B, m, d)
  const T* ls;     // (B, d)
  const T* scale;  // (B)
  T* out;          // (B, n, m)
  int64_t n, m;
  int d, dp;  // features, and that rounded up to a multiple of 4
  int64_t tiles_m, tiles_per_batch;
};

template <typename T, bool kVecStore>
__global__ void __launch_bounds__(kCovThreads) cov_fwd_tile_kernel(const CovTileArgs<T> a) {
  __shared__ __align__(16) T s1[kCovChunk][kCovTile];
  __shared__ __align__(16) T s2[kCovChunk][kCovTile];
  const int64_t tile = blockIdx.x;
  const int64_t b = tile / a.tiles_per_batch;
  const int64_t rem = tile - b * a.tiles_per_batch;
  const int64_t i0 = (rem / a.tiles_m) * kCovTile, j0 = (rem % a.tiles_m) * kCovTile;
  const T* x1 = a.x1 + b * a.n * a.d;
  const T* x2 = a.x2 + b * a.m * a.d;
  const T* ls = a.ls + b * a.d;
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;

  // four accumulation chains per output (features k mod 4): shorter rounding chains and more ILP
  T acc[4][4][4];
#pragma unroll
  for (int u = 0; u < 4; ++u)
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[u][r][c] = T(0);

  for (int k0 = 0; k0 < a.dp; k0 += kCovChunk) {
    const int kc = min(kCovChunk, a.dp - k0);
    for (int e = threadIdx.x; e < kCovTile * kc; e += kCovThreads) {
      const int r = e / kc, k = e - r * kc, f = k0 + k;
      s1[k][r] = (i0 + r < a.n && f < a.d) ? scaled(x1[(i0 + r) * a.d + f], ls[f]) : T(0);
      s2[k][r] = (j0 + r < a.m && f < a.d) ? scaled(x2[(j0 + r) * a.d + f], ls[f]) : T(0);
    }
    __syncthreads();
    for (int k = 0; k < kc; k += 4) {  // kc is a multiple of 4
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        T xa[4], xb[4];
        load4(&s1[k + u][ty * 4], xa);
        load4(&s2[k + u][tx * 4], xb);
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const T diff = xa[r] - xb[c];
            acc[u][r][c] = fma(diff, diff, acc[u][r][c]);
          }
      }
    }
    __syncthreads();
  }

  const T s = a.scale[b];
  T* out = a.out + b * a.n * a.m;
  const int64_t j = j0 + tx * 4;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int64_t i = i0 + ty * 4 + r;
    if (i >= a.n) break;
    T v[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) v[c] = s * exp_neg_half((acc[0][r][c] + acc[1][r][c]) + (acc[2][r][c] + acc[3][r][c]));
    T* row = out + i * a.m;
    if (kVecStore && j + 3 < a.m) {
      store_streaming<T, 4>(row + j, v);
    } else {
#pragma unroll
      for (int c = 0; c < 4; ++c)
        if (j + c < a.m) row[j + c] = v[c];
    }
  }
}

}  // namespace cuda
}  // namespace gpfast
