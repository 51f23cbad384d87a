// The backward of both ops, in GEMM form, one row pass per launch.
//
// With W_ij = s E_ij g_ij (E = K / s, g = dLoss/dK for the covariance, g_ij = G_i . V_j for K @ V), per row i
//   r_i = sum_j E_ij g_ij,  P_i = sum_j E_ij g_ij z2_j,  R_i = sum_j E_ij g_ij z2_j^2 (per feature),
// and from them
//   A_i = s (r_i z1_i - P_i)                              = sum_j W_ij (z1_i - z2_j)   (x1's gradient is -A_i / l)
//   L   = s sum_i (r_i z1_i^2 - 2 z1_i P_i + R_i)          = sum_ij W_ij (z1_i - z2_j)^2 (the lengthscale's, L / l)
//   S   = sum_i r_i                                        = sum_ij W_ij / s             (the outputscale's)
// The x2 gradient is the same pass with the roles of the two point sets swapped (the host's second launch).
//
// Why double. S and L are single sums over n m terms of random sign, so their relative error is the terms'
// error times |sum|terms|| / |sum|, which is unbounded: float32 distances and exponentials (error ~1e-7 per term,
// mostly from rounding the exponent) made the outputscale gradient's error several times that of the plain
// PyTorch formula on some draws. Here z, the exponent (norm expansion in double: cancellation costs nothing
// there), exp (a polynomial, see exp_nonpositive) and every sum are double, as on the CPU, whatever the input
// dtype; only the low-rank weight G_i . V_j is a float32 dot product for float32 inputs.
//
// Layout: each thread owns TM rows (points and sums in registers); the block walks a range of columns (all of m,
// or a 1/splits share) in tiles of BN staged in shared memory: scaled points, their squares and -|z2|^2 / 2, and
// either the block's tile of the dense weights (read from global memory coalesced, along whichever axis is
// contiguous) or the columns' rows of V. Partials go to per-(split, row block) buffers that the host adds up,
// so results are deterministic. The block's centre is the mean of its own rows.
#pragma once

#include "device_common.cuh"

namespace gpfast {
namespace cuda {

constexpr int kBwdThreads = 128;

template <typename T>
__host__ __device__ constexpr int bwd_tile_cols() {
  return sizeof(T) == 8 ? 16 : 32;
}

template <typename T>
struct BwdArgs {
  const T* x1;     // rows' points (B, n, d)
  const T* x2;     // columns' points (B, m, d)
  const T* ls;     // (B, d)
  const T* scale;  // (B)
  // dense weights: pair (i, j) of batch b at g[b * g_batch + i * g_row + j * g_col]; g_col == 1 or g_row == 1
  const T* g;
  int64_t g_batch, g_row, g_col;
  // low-rank weights: gr_i . vc_j with gr (B, n, t) and vc (B, m, t)
  const T* gr;
  const T* vc;
  int t;
  double* part_a;  // (splits, B, n, D) or null
  double* part_l;  // (splits, row blocks, B, D), with kL
  double* part_s;  // (splits, row blocks, B), with kS
  int64_t n, m, batch, cols_per_split;
  int d;
};

// TC = 0: dense weights; TC > 0: low-rank weights with t <= TC. The dense weights' tile is read with plain
// loads: a double-buffered cp.async pipeline of the same arithmetic was slower on an H200 (see csrc/README.md).
template <typename T, int D, int TM, int TC, bool kS, bool kL>
__global__ void __launch_bounds__(kBwdThreads) bwd_rows_kernel(const BwdArgs<T> a) {
  constexpr int BN = bwd_tile_cols<T>();
  constexpr int RB = kBwdThreads * TM;  // rows per block
  constexpr bool kDense = TC == 0;
  constexpr int kDegree = sizeof(T) == 8 ? 13 : 8;
  constexpr int kTC = kDense ? 1 : TC;
  constexpr bool kReload = D >= 32;
  // D = 32 with L: P and R (2 x 32 doubles) beside the row's points would not fit in registers, so L is summed
  // directly, Lt += w (z1 - z2)^2 (3 instead of 2 operations per feature), and A is not formed: the host asks
  // for L from this kernel only when no point gradient is wanted.
  constexpr bool kDirectL = kL && D >= 32;
  static_assert(!kDirectL || TM == 1, "the direct L sum is per thread: one row per thread");
  __shared__ __align__(16) double s_z2[BN][D];
  __shared__ __align__(16) double s_z2sq[kL && D < 32 ? BN : 1][D];
  __shared__ double s_b2[BN];
  __shared__ T s_g[kDense ? RB : 1][kDense ? BN + 1 : 1];  // +1: conflict-free column reads
  __shared__ __align__(16) T s_v[kDense ? 1 : BN][kTC];
  __shared__ double s_mu[D], s_il[D];
  __shared__ double s_scratch[(kBwdThreads / 32) * (D + 1)];
  __shared__ double s_tot[D + 1];

  const int tid = threadIdx.x;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * RB;
  const int split = blockIdx.y;
  const int64_t b = blockIdx.z;
  const int64_t j_begin = split * a.cols_per_split;
  const int64_t j_end = min(a.m, j_begin + a.cols_per_split);
  const int d = a.d;
  const T* x1 = a.x1 + b * a.n * d;
  const T* x2 = a.x2 + b * a.m * d;

  // this thread's rows, raw, and the block's centre: the mean of its rows
  double z1[TM][D];
#pragma unroll
  for (int r = 0; r < TM; ++r) {
    const int64_t i = row0 + r * kBwdThreads + tid;
#pragma unroll
    for (int k = 0; k < D; ++k) z1[r][k] = (i < a.n && k < d) ? static_cast<double>(x1[i * d + k]) : 0.0;
  }
  {
    double part[D];
#pragma unroll
    for (int k = 0; k < D; ++k) {
      part[k] = 0.0;
#pragma unroll
      for (int r = 0; r < TM; ++r) part[k] += z1[r][k];
    }
    block_sum(part, s_scratch, s_mu);
    if (tid < D) {
      const double count = static_cast<double>(min(a.n - row0, static_cast<int64_t>(RB)));
      s_mu[tid] = tid < d ? s_mu[tid] / count : 0.0;
      s_il[tid] = tid < d ? 1.0 / static_cast<double>(a.ls[b * d + tid]) : 0.0;
    }
    __syncthreads();
  }
  double b1[TM];
#pragma unroll
  for (int r = 0; r < TM; ++r) {
    const int64_t i = row0 + r * kBwdThreads + tid;
    double nrm = 0.0;
#pragma unroll
    for (int k = 0; k < D; ++k) {
      z1[r][k] = (i < a.n && k < d) ? (z1[r][k] - s_mu[k]) * s_il[k] : 0.0;
      nrm = fma(z1[r][k], z1[r][k], nrm);
    }
    b1[r] = -0.5 * nrm;
  }
  T gw[TM][kTC];  // low-rank: the rows' weights
#pragma unroll
  for (int r = 0; r < TM; ++r) {
    const int64_t i = row0 + r * kBwdThreads + tid;
#pragma unroll
    for (int c = 0; c < kTC; ++c) gw[r][c] = (!kDense && i < a.n && c < a.t) ? a.gr[(b * a.n + i) * a.t + c] : T(0);
  }

  constexpr int kP = kDirectL ? 1 : TM, kR = kL && !kDirectL ? TM : 1;
  double racc[TM], P[kP][D], R[kR][D];
#pragma unroll
  for (int r = 0; r < TM; ++r) racc[r] = 0.0;
#pragma unroll
  for (int r = 0; r < kP; ++r)
#pragma unroll
    for (int k = 0; k < D; ++k) P[r][k] = 0.0;
#pragma unroll
  for (int r = 0; r < kR; ++r)
#pragma unroll
    for (int k = 0; k < D; ++k) R[r][k] = 0.0;

  for (int64_t jt = j_begin; jt < j_end; jt += BN) {
    const int cols = static_cast<int>(min(static_cast<int64_t>(BN), j_end - jt));
    __syncthreads();  // the previous tile's reads are done (s_z2 and the weights may be rewritten)
    if (tid < BN) {
      const int64_t j = jt + tid;
      double nrm = 0.0;
#pragma unroll
      for (int k = 0; k < D; ++k) {
        const double z = (tid < cols && k < d) ? (static_cast<double>(x2[j * d + k]) - s_mu[k]) * s_il[k] : 0.0;
        nrm = fma(z, z, nrm);
        s_z2[tid][k] = z;
        if constexpr (kL && D < 32) s_z2sq[tid][k] = z * z;
      }
      s_b2[tid] = -0.5 * nrm;
    }
    if constexpr (kDense) {
      const T* g = a.g + b * a.g_batch;
      if (a.g_col == 1) {  // contiguous along the columns: a warp reads 32 consecutive columns of a row
        for (int e = tid; e < RB * BN; e += kBwdThreads) {
          const int rr = e / BN, cc = e - rr * BN;
          const int64_t i = row0 + rr;
          s_g[rr][cc] = (i < a.n && cc < cols) ? g[i * a.g_row + jt + cc] : T(0);
        }
      } else {  // contiguous along the rows (g_row == 1): a warp reads 32 consecutive rows of a column
        for (int e = tid; e < RB * BN; e += kBwdThreads) {
          const int cc = e / RB, rr = e - cc * RB;
          const int64_t i = row0 + rr;
          s_g[rr][cc] = (i < a.n && cc < cols) ? g[i + (jt + cc) * a.g_col] : T(0);
        }
      }
    } else if constexpr (!kDense) {
      const T* vc = a.vc + b * a.m * a.t;
      for (int e = tid; e < BN * TC; e += kBwdThreads) {
        const int jj = e / TC, c = e - jj * TC;
        s_v[jj][c] = (jj < cols && c < a.t) ? vc[(jt + jj) * a.t + c] : T(0);
      }
    }
    __syncthreads();
    for (int jj = 0; jj < cols; ++jj) {
      // kReload (D = 32): the column's points are read from shared memory again for the sums instead of being
      // held in registers across the exponential, which would not fit beside P and R
      double z2[kReload ? 1 : D], z2sq[kReload || !kL ? 1 : D];
      if constexpr (!kReload) {
#pragma unroll
        for (int k = 0; k < D; k += 2) {
          const double2 q = *reinterpret_cast<const double2*>(&s_z2[jj][k]);
          z2[k] = q.x, z2[k + 1] = q.y;
          if constexpr (kL) {
            const double2 p = *reinterpret_cast<const double2*>(&s_z2sq[jj][k]);
            z2sq[k] = p.x, z2sq[k + 1] = p.y;
          }
        }
      }
      const double b2 = s_b2[jj];
      T vv[kTC];
      if constexpr (!kDense) {
        if constexpr (TC % 4 == 0) {
          load_row<T, TC>(&s_v[jj][0], vv);
        } else {
#pragma unroll
          for (int c = 0; c < TC; ++c) vv[c] = s_v[jj][c];
        }
      }
#pragma unroll
      for (int r = 0; r < TM; ++r) {
        // -|z1 - z2|^2 / 2 by the expansion (in double its cancellation costs nothing); one row per thread from
        // D = 16 on, so the dot product runs in four chains there to keep the FP64 pipe busy
        double q;
        if constexpr (kReload) {
          double p[4] = {b1[r] + b2, 0.0, 0.0, 0.0};
#pragma unroll
          for (int k = 0; k < D; k += 2) {
            const double2 z = *reinterpret_cast<const double2*>(&s_z2[jj][k]);
            p[k & 3] = fma(z1[r][k], z.x, p[k & 3]);
            p[(k + 1) & 3] = fma(z1[r][k + 1], z.y, p[(k + 1) & 3]);
          }
          q = (p[0] + p[1]) + (p[2] + p[3]);
        } else if constexpr (D >= 16) {
          double p[4] = {b1[r] + b2, 0.0, 0.0, 0.0};
#pragma unroll
          for (int k = 0; k < D; ++k) p[k & 3] = fma(z1[r][k], z2[k], p[k & 3]);
          q = (p[0] + p[1]) + (p[2] + p[3]);
        } else {
          q = b1[r] + b2;
#pragma unroll
          for (int k = 0; k < D; ++k) q = fma(z1[r][k], z2[k], q);
        }
        const double e = exp_nonpositive<kDegree>(fmin(q, 0.0));  // K_ij / s
        T g;
        if constexpr (kDense) {
          g = s_g[r * kBwdThreads + tid][jj];
        } else {
          g = T(0);
#pragma unroll
          for (int c = 0; c < TC; ++c) g = fma(gw[r][c], vv[c], g);
        }
        const double w = e * static_cast<double>(g);
        racc[r] += w;
        if constexpr (kDirectL) {  // P holds Lt
#pragma unroll
          for (int k = 0; k < D; k += 2) {
            const double2 z = lds_f64x2_volatile(&s_z2[jj][k]);
            const double d0 = z1[r][k] - z.x, d1 = z1[r][k + 1] - z.y;
            P[0][k] = fma(w * d0, d0, P[0][k]);
            P[0][k + 1] = fma(w * d1, d1, P[0][k + 1]);
          }
        } else if constexpr (kReload) {
#pragma unroll
          for (int k = 0; k < D; k += 2) {
            const double2 z = lds_f64x2_volatile(&s_z2[jj][k]);
            P[r][k] = fma(w, z.x, P[r][k]);
            P[r][k + 1] = fma(w, z.y, P[r][k + 1]);
            if constexpr (kL) {
              const double2 zz = lds_f64x2_volatile(&s_z2sq[jj][k]);
              R[r][k] = fma(w, zz.x, R[r][k]);
              R[r][k + 1] = fma(w, zz.y, R[r][k + 1]);
            }
          }
        } else {
#pragma unroll
          for (int k = 0; k < D; ++k) P[r][k] = fma(w, z2[k], P[r][k]);
          if constexpr (kL) {
#pragma unroll
            for (int k = 0; k < D; ++k) R[r][k] = fma(w, z2sq[k], R[r][k]);
          }
        }
      }
    }
  }

  const double s = static_cast<double>(a.scale[b]);
  if (!kDirectL && a.part_a != nullptr) {
#pragma unroll
    for (int r = 0; r < TM; ++r) {
      const int64_t i = row0 + r * kBwdThreads + tid;
      if (i >= a.n) continue;
      double* dst = a.part_a + ((static_cast<int64_t>(split) * a.batch + b) * a.n + i) * D;
#pragma unroll
      for (int k = 0; k < D; k += 2) {
        const double2 v2 = make_double2(s * fma(racc[r], z1[r][k], -P[r][k]),
                                        s * fma(racc[r], z1[r][k + 1], -P[r][k + 1]));
        *reinterpret_cast<double2*>(dst + k) = v2;
      }
    }
  }
  if constexpr (kS || kL) {
    // rows past n have zero weights, so they add nothing here
    double tot[D + 1];
    tot[D] = 0.0;
#pragma unroll
    for (int r = 0; r < TM; ++r) tot[D] += racc[r];
#pragma unroll
    for (int k = 0; k < D; ++k) {
      tot[k] = 0.0;
      if constexpr (kDirectL) {
        tot[k] = s * P[0][k];
      } else if constexpr (kL) {
#pragma unroll
        for (int r = 0; r < TM; ++r)
          tot[k] += s * (z1[r][k] * fma(racc[r], z1[r][k], -2.0 * P[r][k]) + R[r][k]);
      }
    }
    block_sum(tot, s_scratch, s_tot);
    const int64_t blk = (static_cast<int64_t>(split) * gridDim.x + blockIdx.x) * a.batch + b;
    if (kL && tid < D) a.part_l[blk * D + tid] = s_tot[tid];
    if (kS && tid == D) a.part_s[blk] = s_tot[D];
  }
}

}  // namespace cuda
}  // namespace gpfast
