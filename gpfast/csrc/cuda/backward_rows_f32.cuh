// The covariance backward's row pass for float32 (dense weights), with float32 arithmetic wherever the accuracy
// rule allows it. Same sums and outputs as bwd_rows_kernel (backward_rows.cuh): per row i of the pass
//   A_i = sum_j W_ij (z1_i - z2_j),   L = sum_ij W_ij (z1_i - z2_j)^2,   S = sum_ij W_ij / s,
// W_ij = s E_ij g_ij, E = K / s, into the same float64 partial buffers, so the host's reduction is shared.
//
// Where the precision goes (the accuracy rule: each gradient's error against float64 at most 4x the plain float32
// formula's + 1e-6, on every draw):
//   - the exponent q = -|y1 - y2|^2 in double by the norm expansion (its cancellation costs nothing there), and
//     2^q in double (exp2_nonpositive). A float32 q carries an error of |q| 2^-24, which where every pair is far
//     apart (the extreme-lengthscale test: K ~ 1e-27 at its largest) put the gradients 10x over the rule in an
//     emulation of this arithmetic (python -m experiments.backward_f32_emulation).
//   - S = sum g E in double term by term. S is a single sum of terms of either sign, and any float32 rounding of
//     its terms is independent from pair to pair, while the plain formula's errors come mostly from rounding each
//     point (shared by all its pairs, so they average out over a row): with E from a float32 polynomial (0.5 ulp)
//     S exceeded the rule on the H200 on about 1 draw in 100 (n = 70, m = 90; experiments/backward_f32_probe.py).
//   - the weights g E rounded to float32 and the terms W (y1 - y2), W (y1 - y2)^2 in float32, from differences of
//     the points rounded to float32 (a per-point rounding, as the plain formula's z = x / l).
//   - sums: each thread sums a run of kRun columns in float32 (the rounding of 16 additions), then adds the run into
//     float64 totals; blocks and splits are added in float64 as by bwd_rows_kernel.
// The float32 weights are formed 2^kExp2Bias too large (float32's range then reaches the plain formula's smallest
// denormal) and the runs scaled back exactly when they are added into double.
//
// Per pair and feature: one FP64 FMA (the expansion) and 2 (A), 2 (L) or 4 (both) float32 operations, and per pair
// about 16 FP64 operations for the exponential and S.
#pragma once

#include "backward_rows.cuh"

namespace gpfast {
namespace cuda {

constexpr int kBwd32Tile = 32;  // columns staged per tile
constexpr int kBwd32Run = 16;   // columns summed in float32 before the float64 totals

// kA: the rows' A (point gradients); kL: L; kS: S. One row per thread, kBwdThreads rows per block.
template <int D, bool kA, bool kL, bool kS>
__global__ void __launch_bounds__(kBwdThreads) bwd_rows_f32_kernel(const BwdArgs<float> a) {
  constexpr int BN = kBwd32Tile;
  static_assert(BN % kBwd32Run == 0, "runs tile the staged columns");
  __shared__ __align__(16) double s_y64[BN][D];
  __shared__ __align__(16) float s_y32[BN][D];
  __shared__ double s_b2[BN];
  __shared__ float s_g[kBwdThreads][BN + 1];  // +1: conflict-free column reads
  __shared__ double s_mu[D], s_w[D];
  __shared__ double s_scratch[(kBwdThreads / 32) * (D + 1)];
  __shared__ double s_tot[D + 1];

  const int tid = threadIdx.x;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kBwdThreads;
  const int64_t i = row0 + tid;
  const int split = blockIdx.y;
  const int64_t b = blockIdx.z;
  const int64_t j_begin = split * a.cols_per_split;
  const int64_t j_end = min(a.m, j_begin + a.cols_per_split);
  const int d = a.d;
  const float* x1 = a.x1 + b * a.n * d;
  const float* x2 = a.x2 + b * a.m * d;

  // this thread's row, and the block's centre: the mean of its rows
  double y1[D];
#pragma unroll
  for (int k = 0; k < D; ++k) y1[k] = (i < a.n && k < d) ? static_cast<double>(x1[i * d + k]) : 0.0;
  block_sum(y1, s_scratch, s_mu);
  if (tid < D) {
    const double count = static_cast<double>(min(a.n - row0, static_cast<int64_t>(kBwdThreads)));
    s_mu[tid] = tid < d ? s_mu[tid] / count : 0.0;
    s_w[tid] = tid < d ? kSqrtHalfLog2e / static_cast<double>(a.ls[b * d + tid]) : 0.0;
  }
  __syncthreads();
  // y = (x - mu) sqrt(log2(e) / 2) / l, so that E = 2^-|y1 - y2|^2
  float y1f[D];
  double b1 = 0.0;
#pragma unroll
  for (int k = 0; k < D; ++k) {
    y1[k] = (i < a.n && k < d) ? (y1[k] - s_mu[k]) * s_w[k] : 0.0;
    y1f[k] = static_cast<float>(y1[k]);
    b1 = fma(-y1[k], y1[k], b1);
  }

  double racc = 0.0, acc_a[kA ? D : 1], acc_l[kL ? D : 1];
#pragma unroll
  for (int k = 0; k < (kA ? D : 1); ++k) acc_a[k] = 0.0;
#pragma unroll
  for (int k = 0; k < (kL ? D : 1); ++k) acc_l[k] = 0.0;
  constexpr double kUnbias = 1.0 / static_cast<double>(1ull << kExp2Bias);

  const float* g = a.g + b * a.g_batch;
  for (int64_t jt = j_begin; jt < j_end; jt += BN) {
    const int cols = static_cast<int>(min(static_cast<int64_t>(BN), j_end - jt));
    __syncthreads();  // the previous tile's reads are done
    if (tid < BN) {
      const int64_t j = jt + tid;
      double nrm = 0.0;
#pragma unroll
      for (int k = 0; k < D; ++k) {
        const double y = (tid < cols && k < d) ? (static_cast<double>(x2[j * d + k]) - s_mu[k]) * s_w[k] : 0.0;
        nrm = fma(y, y, nrm);
        s_y64[tid][k] = y;
        s_y32[tid][k] = static_cast<float>(y);
      }
      s_b2[tid] = -nrm;
    }
    if (a.g_col == 1) {  // contiguous along the columns: a warp reads 32 consecutive columns of a row
      for (int e = tid; e < kBwdThreads * BN; e += kBwdThreads) {
        const int rr = e / BN, cc = e - rr * BN;
        const int64_t r = row0 + rr;
        s_g[rr][cc] = (r < a.n && cc < cols) ? g[r * a.g_row + jt + cc] : 0.0f;
      }
    } else {  // contiguous along the rows (g_row == 1): a warp reads 32 consecutive rows of a column
      for (int e = tid; e < kBwdThreads * BN; e += kBwdThreads) {
        const int cc = e / kBwdThreads, rr = e - cc * kBwdThreads;
        const int64_t r = row0 + rr;
        s_g[rr][cc] = (r < a.n && cc < cols) ? g[r + (jt + cc) * a.g_col] : 0.0f;
      }
    }
    __syncthreads();

    for (int j0 = 0; j0 < cols; j0 += kBwd32Run) {
      const int run_end = min(cols, j0 + kBwd32Run);
      float ra[kA ? D : 1], rl[kL ? D : 1];
#pragma unroll
      for (int k = 0; k < (kA ? D : 1); ++k) ra[k] = 0.0f;
#pragma unroll
      for (int k = 0; k < (kL ? D : 1); ++k) rl[k] = 0.0f;
      for (int jj = j0; jj < run_end; ++jj) {
        double p[4] = {0.0, 0.0, 0.0, 0.0};  // y1 . y2 in four chains
#pragma unroll
        for (int k = 0; k < D; k += 2) {
          const double2 z = *reinterpret_cast<const double2*>(&s_y64[jj][k]);
          p[k & 3] = fma(y1[k], z.x, p[k & 3]);
          p[(k + 1) & 3] = fma(y1[k + 1], z.y, p[(k + 1) & 3]);
        }
        const double q = fma(2.0, (p[0] + p[1]) + (p[2] + p[3]), b1 + s_b2[jj]);
        const double e = exp2_nonpositive(fmin(q, 0.0));
        const float gw = s_g[tid][jj];
        racc = fma(static_cast<double>(gw), e, racc);
        const float w = gw * static_cast<float>(e * kExp2BiasScale);
        float y2[D];
        load_row<float, D>(&s_y32[jj][0], y2);
#pragma unroll
        for (int k = 0; k < D; ++k) {
          const float diff = y1f[k] - y2[k];
          if constexpr (kA) ra[k] = fmaf(w, diff, ra[k]);
          if constexpr (kL) rl[k] = fmaf(w * diff, diff, rl[k]);
        }
      }
#pragma unroll
      for (int k = 0; k < (kA ? D : 0); ++k) acc_a[k] += static_cast<double>(ra[k]);
#pragma unroll
      for (int k = 0; k < (kL ? D : 0); ++k) acc_l[k] += static_cast<double>(rl[k]);
    }
  }

  // back to the z = (x - mu) / l units of bwd_rows_kernel: y = z sqrt(log2(e) / 2), and the bias
  const double s = static_cast<double>(a.scale[b]);
  constexpr double kInvC = 1.0 / kSqrtHalfLog2e, kInvC2 = 1.0 / kHalfLog2e;
  if constexpr (kA) {
    if (i < a.n && a.part_a != nullptr) {
      double* dst = a.part_a + ((static_cast<int64_t>(split) * a.batch + b) * a.n + i) * D;
#pragma unroll
      for (int k = 0; k < D; k += 2)
        *reinterpret_cast<double2*>(dst + k) =
            make_double2(s * kInvC * kUnbias * acc_a[k], s * kInvC * kUnbias * acc_a[k + 1]);
    }
  }
  if constexpr (kS || kL) {
    double tot[D + 1];  // rows past n have zero weights, so they add nothing here
#pragma unroll
    for (int k = 0; k < D; ++k) tot[k] = kL ? s * kInvC2 * kUnbias * acc_l[kL ? k : 0] : 0.0;
    tot[D] = racc;
    block_sum(tot, s_scratch, s_tot);
    const int64_t blk = (static_cast<int64_t>(split) * gridDim.x + blockIdx.x) * a.batch + b;
    if (kL && tid < D) a.part_l[blk * D + tid] = s_tot[tid];
    if (kS && tid == D) a.part_s[blk] = s_tot[D];
  }
}

}  // namespace cuda
}  // namespace gpfast
