// K @ V, forward, never storing K: out (splits, B, n, t) partial products, summed on the host when splits > 1.
//
// Each thread owns TM rows and TC right-hand-side columns (one chunk of t), accumulating in registers; the block
// walks a range of columns j (the whole of m, or a 1/splits share of it when n alone gives too few blocks) in
// tiles of kKvTile staged in shared memory (scaled points, their bias -|y2|^2 and the rows of V), read as
// broadcasts. The exponent is the norm expansion (float32) or differences (float64), as in covariance_forward.cuh,
// with the same near-duplicate recomputation; the block's centre is the mean of its own rows.
#pragma once

#include "covariance_forward.cuh"
#include "device_common.cuh"

namespace gpfast {
namespace cuda {

constexpr int kKvThreads = 128, kKvTile = 64;

template <typename T>
struct KvFwdArgs {
  const T* x1;     // (B, n, d) raw points
  const T* x2;     // (B, m, d)
  const T* ls;     // (B, d)
  const T* scale;  // (B)
  const T* v;      // (B, m, t)
  T* out;          // (splits, B, n, t)
  int64_t n, m, batch;
  int d, t, t_chunks;
  int64_t cols_per_split;
};

template <typename T, int D, int TC, int TM, bool kExpand>
__global__ void __launch_bounds__(kKvThreads) kv_fwd_kernel(const KvFwdArgs<T> a) {
  constexpr int kPitch = D + 4;  // y2 in [0, D), -|y2|^2 at D
  __shared__ __align__(16) T s_y2[kKvTile][kPitch];
  __shared__ __align__(16) T s_v[kKvTile][TC];
  __shared__ T s_mu[D], s_w[D];
  __shared__ T s_scratch[(kKvThreads / 32) * D];

  const int tid = threadIdx.x;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kKvThreads * TM;
  const int split = blockIdx.y;
  const int64_t b = blockIdx.z / a.t_chunks;
  const int t0 = static_cast<int>(blockIdx.z % a.t_chunks) * TC;
  const int64_t j_begin = split * a.cols_per_split;
  const int64_t j_end = min(a.m, j_begin + a.cols_per_split);
  const int d = a.d;
  const T* x1 = a.x1 + b * a.n * d;
  const T* x2 = a.x2 + b * a.m * d;
  const T* ls = a.ls + b * d;
  const T* v = a.v + b * a.m * a.t;

  // this thread's rows, raw, and the block's centre: the mean of its rows
  T yr[TM][D];
#pragma unroll
  for (int r = 0; r < TM; ++r) {
    const int64_t i = row0 + r * kKvThreads + tid;
#pragma unroll
    for (int k = 0; k < D; ++k) yr[r][k] = (i < a.n && k < d) ? x1[i * d + k] : T(0);
  }
  {
    T part[D];
#pragma unroll
    for (int k = 0; k < D; ++k) {
      part[k] = T(0);
#pragma unroll
      for (int r = 0; r < TM; ++r) part[k] += yr[r][k];
    }
    block_sum(part, s_scratch, s_mu);
    if (tid < D) {
      const T count = static_cast<T>(min(a.n - row0, static_cast<int64_t>(kKvThreads) * TM));
      s_mu[tid] = tid < d ? s_mu[tid] / count : T(0);
      s_w[tid] = tid < d ? static_cast<T>(kSqrtHalfLog2e) / ls[tid] : T(0);
    }
    __syncthreads();
  }
  T b1[TM], thr[TM];
#pragma unroll
  for (int r = 0; r < TM; ++r) {
    const int64_t i = row0 + r * kKvThreads + tid;
    T nrm = T(0);
#pragma unroll
    for (int k = 0; k < D; ++k) {
      const T y = (i < a.n && k < d) ? scale_point(yr[r][k], s_mu[k], s_w[k]) : T(0);
      nrm = fma(y, y, nrm);
      yr[r][k] = kExpand ? y * T(2) : y;  // doubling is exact
    }
    b1[r] = -nrm;
    thr[r] = -nrm * static_cast<T>(2 * kNearTau);
  }

  // Two-level sums: `tile` collects one tile of columns, then is folded into `acc`. A single running sum over
  // m = 10^6 columns would lose about log2(m / 64) more bits than cuBLAS-style blocked sums.
  T acc[TM][TC], tile[TM][TC];
#pragma unroll
  for (int r = 0; r < TM; ++r)
#pragma unroll
    for (int c = 0; c < TC; ++c) acc[r][c] = T(0);

  for (int64_t jt = j_begin; jt < j_end; jt += kKvTile) {
    const int cols = static_cast<int>(min(static_cast<int64_t>(kKvTile), j_end - jt));
    __syncthreads();  // the previous tile's reads are done
    if (tid < kKvTile) {
      const int64_t j = jt + tid;
      T nrm = T(0);
#pragma unroll
      for (int k = 0; k < D; ++k) {
        const T y = (tid < cols && k < d) ? scale_point(x2[j * d + k], s_mu[k], s_w[k]) : T(0);
        nrm = fma(y, y, nrm);
        s_y2[tid][k] = y;
      }
      s_y2[tid][D] = -nrm;
    }
    for (int e = tid; e < kKvTile * TC; e += kKvThreads) {
      const int jj = e / TC, c = e - jj * TC;
      s_v[jj][c] = (jj < cols && t0 + c < a.t) ? v[(jt + jj) * a.t + t0 + c] : T(0);
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < TM; ++r)
#pragma unroll
      for (int c = 0; c < TC; ++c) tile[r][c] = T(0);
#pragma unroll 2
    for (int jj = 0; jj < cols; ++jj) {  // cols is block-uniform: every lane takes part in the vote below
      T y2[D], vc[TC];
      load_row<T, D>(&s_y2[jj][0], y2);
      if constexpr (TC % 4 == 0) {
        load_row<T, TC>(&s_v[jj][0], vc);
      } else {
#pragma unroll
        for (int c = 0; c < TC; ++c) vc[c] = s_v[jj][c];
      }
      T e[TM];
      if constexpr (kExpand) {
        const T b2 = s_y2[jj][D];
        bool near = false;
#pragma unroll
        for (int r = 0; r < TM; ++r) {
          T q = yr[r][0] * y2[0];  // the dot product first, then the biases (see covariance_forward.cuh)
#pragma unroll
          for (int k = 1; k < D; ++k) q = fma(yr[r][k], y2[k], q);
          q = (q + b1[r]) + b2;
          e[r] = q;
          near |= q >= thr[r];
        }
        if (__any_sync(kFull, near)) {
#pragma unroll
          for (int r = 0; r < TM; ++r)
            if (e[r] >= thr[r]) e[r] = neg_sq_dist<T, D>(yr[r], y2, T(0.5));
        }
      } else {
#pragma unroll
        for (int r = 0; r < TM; ++r) e[r] = neg_sq_dist<T, D>(yr[r], y2);
      }
#pragma unroll
      for (int r = 0; r < TM; ++r) {
        const T k_ij = exp2_fast(e[r]);  // K / s
#pragma unroll
        for (int c = 0; c < TC; ++c) tile[r][c] = fma(k_ij, vc[c], tile[r][c]);
      }
    }
#pragma unroll
    for (int r = 0; r < TM; ++r)
#pragma unroll
      for (int c = 0; c < TC; ++c) acc[r][c] += tile[r][c];
  }

  const T s = a.scale[b];
#pragma unroll
  for (int r = 0; r < TM; ++r) {
    const int64_t i = row0 + r * kKvThreads + tid;
    if (i >= a.n) continue;
    T* dst = a.out + ((static_cast<int64_t>(split) * a.batch + b) * a.n + i) * a.t + t0;
#pragma unroll
    for (int c = 0; c < TC; ++c)
      if (t0 + c < a.t) dst[c] = s * acc[r][c];
  }
}

}  // namespace cuda
}  // namespace gpfast
