// The covariance backward for float32 in one pass over the pairs (d <= 16): both point gradients, L and S from
// one exponential per pair and one read of the incoming gradient G, where the row passes (backward_rows.cuh) make
// two, one per point set, in float64 arithmetic. Sums as in backward_rows.cuh, with W = s E o G, E = K / s:
//   A_i = sum_j W_ij (z1_i - z2_j)   (rows),   A2_j = sum_i W_ij (z2_j - z1_i)   (columns),
//   L = sum_ij W_ij (z1_i - z2_j)^2,   S = sum_ij W_ij / s,
// into float64 partial buffers that finish_grads adds up.
//
// Where the precision goes (the accuracy rule: each gradient's error against float64 at most 4x the plain float32
// formula's + 1e-6, on every draw; experiments/backward_f32_probe.py measures it on many draws):
//   - the exponent q = -|y1 - y2|^2 in double by the norm expansion (its cancellation costs nothing there), and
//     2^q in double (exp2_nonpositive). A float32 q carries an error of |q| 2^-24, which where every pair is far
//     apart (the extreme-lengthscale test: K ~ 1e-27 at its largest) put the gradients 10x over the rule in an
//     emulation of this arithmetic (experiments/backward_f32_emulation.py).
//   - S = sum g E in double term by term. S is a single sum of terms of either sign; any float32 rounding of its
//     terms is independent from pair to pair, while the plain formula's errors come mostly from rounding each point
//     (shared by all its pairs, so they average out over a row): with E from a float32 polynomial (0.5 ulp) S
//     exceeded the rule on the H200 on about 1 draw in 100 (n = 70, m = 90).
//   - the weight g E rounded to float32 (scaled up by 2^kExp2Bias, so that float32's range reaches the plain
//     formula's smallest denormal), and the terms W (y1 - y2), W (y1 - y2)^2 in float32 from differences of the
//     points rounded to float32 (a per-point rounding, like the plain formula's z = x / l).
//   - sums: in float32 over at most 16 rows and CPL columns (and a warp), then in double.
// Per pair and feature: one FP64 FMA (the expansion) and 5 float32 operations (3 without the point gradients);
// per pair about 16 FP64 operations for the exponential and S.
//
// Layout, as the streaming forward (covariance_forward.cuh): each lane owns CPL consecutive columns (their points
// in registers, their sums A2 in float32 over a chunk of 16 rows, then in double in shared memory); the block walks
// down a range of rows staged 16 at a time in shared memory (read as broadcasts; the next chunk's loads in flight
// while this one computes); each lane reads its CPL weights of a row straight from global memory, one row ahead. A
// row's A is summed over the lane's columns, then over the warp by a reduce-scatter, then over the block's warps in
// double; L per thread over a chunk, then over the warp, in double per warp.
#pragma once

#include "device_common.cuh"

namespace gpfast {
namespace cuda {

constexpr int kOneRows = 16;  // rows staged per chunk, and the float32 runs' length down the columns
constexpr int kOneThreads = 128;

// Columns per lane: as many as keep a lane's points, weights and sums within about 160 registers.
__host__ __device__ constexpr int onepass_cols_per_lane(int D) { return D <= 4 ? 4 : D <= 8 ? 2 : 1; }

struct OnePassArgs {
  const float* x1;     // (B, n, d)
  const float* x2;     // (B, m, d)
  const float* ls;     // (B, d)
  const float* scale;  // (B)
  const float* g;      // (B, n, m), contiguous
  double* part_a;      // (strips, B, n, D): A, with kX
  double* part_b;      // (row blocks, B, m, D): A2, with kX
  double* part_l;      // (row blocks, strips, B, D)
  double* part_s;      // (row blocks, strips, B)
  int64_t n, m, batch, rows_per_block;
  int d;
  bool vec_load;  // each lane's CPL weights of a row are one aligned vector load
};

// kX: the point gradients (A and A2); L and S always. kMinBlocks: resident blocks per SM asked of the compiler.
template <int D, int CPL, bool kX, int kMinBlocks>
__global__ void __launch_bounds__(kOneThreads, kMinBlocks) bwd_onepass_f32_kernel(const OnePassArgs a) {
  constexpr int kWarps = kOneThreads / 32, kCols = kOneThreads * CPL;
  static_assert(D <= 32 && (D & (D - 1)) == 0, "the row sums' reduce-scatter takes a power of two");
  __shared__ __align__(16) double s_yd[kOneRows][D];
  __shared__ __align__(16) float s_yf[kOneRows][D];
  __shared__ double s_b1[kOneRows];
  __shared__ float s_a[kX ? kWarps : 1][kOneRows][D];
  __shared__ double s_bt[kX ? D : 1][kX ? kCols : 1];  // feature-major: a warp's lanes hit consecutive words
  __shared__ double s_lt[kWarps][D + 1];
  __shared__ double s_mu[D], s_w[D];
  __shared__ double s_scratch[kWarps * D];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int strip = blockIdx.x, rowblock = blockIdx.y;
  const int64_t b = blockIdx.z;
  const int64_t strip0 = static_cast<int64_t>(strip) * kCols;
  const int64_t j0 = strip0 + static_cast<int64_t>(tid) * CPL;
  const int64_t i_begin = static_cast<int64_t>(rowblock) * a.rows_per_block;
  const int64_t i_end = min(a.n, i_begin + a.rows_per_block);
  const int d = a.d;
  const float* x1 = a.x1 + b * a.n * d;
  const float* x2 = a.x2 + b * a.m * d;
  const float* g = a.g + b * a.n * a.m;

  // this lane's columns, and the block's centre: the mean of its columns
  double y2d[CPL][D];
#pragma unroll
  for (int c = 0; c < CPL; ++c)
#pragma unroll
    for (int k = 0; k < D; ++k) y2d[c][k] = (j0 + c < a.m && k < d) ? static_cast<double>(x2[(j0 + c) * d + k]) : 0.0;
  {
    double part[D];
#pragma unroll
    for (int k = 0; k < D; ++k) {
      part[k] = 0.0;
#pragma unroll
      for (int c = 0; c < CPL; ++c) part[k] += y2d[c][k];
    }
    block_sum(part, s_scratch, s_mu);
    if (tid < D) {
      const double count = static_cast<double>(min(a.m - strip0, static_cast<int64_t>(kCols)));
      s_mu[tid] = tid < d ? s_mu[tid] / count : 0.0;
      s_w[tid] = tid < d ? kSqrtHalfLog2e / static_cast<double>(a.ls[b * d + tid]) : 0.0;
    }
    for (int e = tid; e < kWarps * (D + 1); e += kOneThreads) (&s_lt[0][0])[e] = 0.0;
    if constexpr (kX)
      for (int e = tid; e < D * kCols; e += kOneThreads) (&s_bt[0][0])[e] = 0.0;
    __syncthreads();
  }
  float y2f[CPL][D];
  double b2[CPL];
#pragma unroll
  for (int c = 0; c < CPL; ++c) {
    double nrm = 0.0;
#pragma unroll
    for (int k = 0; k < D; ++k) {
      y2d[c][k] = (j0 + c < a.m && k < d) ? (y2d[c][k] - s_mu[k]) * s_w[k] : 0.0;
      y2f[c][k] = static_cast<float>(y2d[c][k]);
      nrm = fma(y2d[c][k], y2d[c][k], nrm);
    }
    b2[c] = -nrm;
  }

  // rows: thread r < kOneRows loads row ic + r into registers (prefetch), then writes it scaled to shared memory
  float xr[D];
  auto fetch = [&](int64_t ic) {
#pragma unroll
    for (int k = 0; k < D; ++k) xr[k] = (tid < kOneRows && ic + tid < i_end && k < d) ? x1[(ic + tid) * d + k] : 0.0f;
  };
  auto stage = [&]() {
    if (tid < kOneRows) {
      double nrm = 0.0;
#pragma unroll
      for (int k = 0; k < D; ++k) {
        const double y = k < d ? (static_cast<double>(xr[k]) - s_mu[k]) * s_w[k] : 0.0;
        nrm = fma(y, y, nrm);
        s_yd[tid][k] = y;
        s_yf[tid][k] = static_cast<float>(y);
      }
      s_b1[tid] = -nrm;
    }
  };
  // this lane's weights of row i (zero past the columns' end)
  auto load_g = [&](int64_t i, float (&gv)[CPL]) {
    const float* row = g + i * a.m + j0;
    if (a.vec_load && j0 + CPL <= a.m) {
      if constexpr (CPL == 4) {
        const float4 v = *reinterpret_cast<const float4*>(row);
        gv[0] = v.x, gv[1] = v.y, gv[2] = v.z, gv[3] = v.w;
      } else if constexpr (CPL == 2) {
        const float2 v = *reinterpret_cast<const float2*>(row);
        gv[0] = v.x, gv[1] = v.y;
      } else {
        gv[0] = row[0];
      }
    } else {
#pragma unroll
      for (int c = 0; c < CPL; ++c) gv[c] = j0 + c < a.m ? row[c] : 0.0f;
    }
  };

  double ssum = 0.0;  // S, term by term in double
  fetch(i_begin);
  for (int64_t ic = i_begin; ic < i_end; ic += kOneRows) {
    __syncthreads();  // the previous chunk's reads of s_yd, s_yf, s_b1 and s_a are done
    stage();
    __syncthreads();
    fetch(ic + kOneRows);
    const int rows = static_cast<int>(min(static_cast<int64_t>(kOneRows), i_end - ic));  // block-uniform
    float lrun[D], brun[kX ? CPL : 1][kX ? D : 1];
#pragma unroll
    for (int k = 0; k < D; ++k) lrun[k] = 0.0f;
#pragma unroll
    for (int c = 0; c < (kX ? CPL : 1); ++c)
#pragma unroll
      for (int k = 0; k < (kX ? D : 1); ++k) brun[c][k] = 0.0f;
    float gn[CPL];
    load_g(ic, gn);
    for (int r = 0; r < rows; ++r) {
      float gc[CPL];
#pragma unroll
      for (int c = 0; c < CPL; ++c) gc[c] = gn[c];
      if (r + 1 < rows) load_g(ic + r + 1, gn);
      double yd[D];
      float yf[D];
      load_row<double, D>(&s_yd[r][0], yd);
      load_row<float, D>(&s_yf[r][0], yf);
      const double b1 = s_b1[r];
      float arow[kX ? D : 1];
#pragma unroll
      for (int k = 0; k < (kX ? D : 1); ++k) arow[k] = 0.0f;
#pragma unroll
      for (int c = 0; c < CPL; ++c) {
        double p[4] = {0.0, 0.0, 0.0, 0.0};  // y1 . y2 in four chains
#pragma unroll
        for (int k = 0; k < D; ++k) p[k & 3] = fma(yd[k], y2d[c][k], p[k & 3]);
        const double q = fma(2.0, (p[0] + p[1]) + (p[2] + p[3]), b1 + b2[c]);
        const double e = exp2_nonpositive(fmin(q, 0.0));
        ssum = fma(static_cast<double>(gc[c]), e, ssum);
        const float w = gc[c] * static_cast<float>(e * kExp2BiasScale);
#pragma unroll
        for (int k = 0; k < D; ++k) {
          const float diff = yf[k] - y2f[c][k];
          const float wd = w * diff;
          lrun[k] = fmaf(wd, diff, lrun[k]);
          if constexpr (kX) {
            arow[k] += wd;
            brun[c][k] -= wd;
          }
        }
      }
      if constexpr (kX) {
        int dim;
        const float red = warp_reduce_scatter<float, D>(arow, lane, dim);
        if ((lane & (32 / D - 1)) == 0) s_a[warp][r][dim] = red;
      }
    }
    // the chunk's sums: rows' A over the warps in double, the columns' and L, S into their double totals
    if constexpr (kX) {
#pragma unroll
      for (int c = 0; c < CPL; ++c)
#pragma unroll
        for (int k = 0; k < D; ++k) s_bt[k][tid * CPL + c] += static_cast<double>(brun[c][k]);
      __syncthreads();
      constexpr double kScaleA = 1.0 / kSqrtHalfLog2e / static_cast<double>(1 << kExp2Bias);
      const double sa = static_cast<double>(a.scale[b]) * kScaleA;
      for (int e = tid; e < rows * D; e += kOneThreads) {
        const int r = e / D, k = e - r * D;
        double acc = 0.0;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) acc += static_cast<double>(s_a[w][r][k]);
        a.part_a[((static_cast<int64_t>(strip) * a.batch + b) * a.n + ic + r) * D + k] = sa * acc;
      }
    }
#pragma unroll
    for (int k = 0; k < D; ++k) lrun[k] = warp_sum(lrun[k]);
    if (lane == 0) {
#pragma unroll
      for (int k = 0; k < D; ++k) s_lt[warp][k] += static_cast<double>(lrun[k]);
    }
  }
  ssum = warp_sum(ssum);
  if (lane == 0) s_lt[warp][D] = ssum;

  __syncthreads();
  const double s = static_cast<double>(a.scale[b]);
  constexpr double kUnbias = 1.0 / static_cast<double>(1 << kExp2Bias);
  if constexpr (kX) {
    const double sb = s / kSqrtHalfLog2e * kUnbias;
#pragma unroll
    for (int c = 0; c < CPL; ++c) {
      const int64_t j = j0 + c;
      if (j >= a.m) continue;
      double* dst = a.part_b + ((static_cast<int64_t>(rowblock) * a.batch + b) * a.m + j) * D;
#pragma unroll
      for (int k = 0; k < D; ++k) dst[k] = sb * s_bt[k][tid * CPL + c];
    }
  }
  if (tid <= D) {
    double acc = 0.0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) acc += s_lt[w][tid];
    const int64_t blk = (static_cast<int64_t>(rowblock) * gridDim.x + strip) * a.batch + b;
    if (tid < D)
      a.part_l[blk * D + tid] = s / kHalfLog2e * kUnbias * acc;
    else
      a.part_s[blk] = acc;
  }
}

}  // namespace cuda
}  // namespace gpfast
