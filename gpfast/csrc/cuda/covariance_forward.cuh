// Covariance, forward: K (B, n, m) = s * 2^(-|y1 - y2|^2), y = (x - mu) sqrt(log2(e) / 2) / l, by row streaming.
//
// Each lane owns CPL consecutive columns whose scaled points stay in registers; the block walks down a range of
// rows, staged kFwdRows at a time in shared memory (the next chunk's loads in flight while this one computes) and
// read as broadcasts; every lane writes its CPL outputs of a row with one streaming vector store, so a warp
// writes 32 * CPL contiguous values per row with no barrier inside a chunk.
//
// Two ways to form the exponent e = -|y1 - y2|^2:
//   differences (kExpand = false): 2 instructions per feature; never negative distances, K(x, x) = s exactly.
//   norm expansion (kExpand = true): e = 2 y1.y2 - |y1|^2 - |y2|^2, one FMA per feature. Its rounding error is
//     about 2^-24 |y|^2 rather than 2^-24 |y1 - y2|^2 (an emulation of this arithmetic on the tests' data, d = 9..32,
//     centred and shifted by 10: 3-6e-7 norm-wise against float64, plain float32 1-3e-7), so pairs whose squared distance is under 2 tau |y1|^2 (near
//     duplicates, the diagonal of K(x, x) among them) are recomputed by differences behind a warp-uniform branch.
//     Every pair with e >= 0 is such a pair, so distances stay non-negative and K(x, x) = s stays exact.
// The block's centre mu is the mean of its own columns' points (any centre gives the same distances; one near the
// points keeps |y|^2, and with it the expansion's rounding, small even for data far from the origin).
#pragma once

#include "device_common.cuh"

namespace gpfast {
namespace cuda {

constexpr int kFwdRows = 32;
// Threads per block: 256, or 128 from D = 28 on (float32's expansion takes 150 registers a thread at 28 and 164 at
// 32 in 128-thread blocks, 3 to an SM; at 28 in 256-thread blocks 137, one to an SM)
__host__ __device__ constexpr int fwd_stream_threads(int D) { return D >= 28 ? 128 : 256; }
// The expansion's near-duplicate threshold (see above). Pairs under it are rare for n >> 1 (the diagonal of
// K(x, x) and genuine near duplicates), so the branch is rarely taken.
constexpr float kNearTau = 1.0f / 32.0f;

template <typename T>
struct CovStreamArgs {
  const T* x1;     // (B, n, d) raw points
  const T* x2;     // (B, m, d)
  const T* ls;     // (B, d)
  const T* scale;  // (B)
  T* out;          // (B, n, m) with rows ldo apart
  int64_t n, m;
  int d;
  int64_t rows_per_block;
  bool vec_store;  // rows of K start 16-byte aligned (or 8 for CPL = 2): one vector store per lane and row
  int64_t ldo;     // out's row pitch (>= m)
  bool vec_mirror;  // kSym: rows ldo apart start 16-byte aligned (the mirror's 4-value runs)
};

// -|a * a_scale - b|^2 over D features, one FMA chain (callers have several columns or rows in flight).
template <typename T, int D>
__device__ __forceinline__ T neg_sq_dist(const T (&a)[D], const T (&b)[D], T a_scale = T(1)) {
  T acc = T(0);
#pragma unroll
  for (int k = 0; k < D; ++k) {
    const T diff = a[k] * a_scale - b[k];
    acc = fma(-diff, diff, acc);
  }
  return acc;
}

__device__ __forceinline__ float kernel_value(float e, float s) { return s * fminf(exp2_fast(e), 1.0f); }
__device__ __forceinline__ double kernel_value(double e, double s) { return s * fmin(exp2(e), 1.0); }

// kSym: K(x, x) (x1 = x2, n = m) with each pair computed once. Block (strip X, row range) takes only the rows
// before the strip's end: rows inside the strip directly (both triangles of its diagonal square), rows before the
// strip directly and, mirrored, K[j][i] for its columns j. Each warp gathers its 32 CPL columns' values of 16 rows
// in shared memory and writes them as 16-value runs of the rows j; a row range past the strip's end is written by
// the mirrors of the later strips. float32 with CPL = 2 only (the expansion's 24, 28 and 32 buckets), where the
// mirror tiles fit in 35 KB.
template <typename T, int D, int CPL, bool kExpand, bool kSym = false>
__global__ void __launch_bounds__(fwd_stream_threads(D)) cov_fwd_stream_kernel(const CovStreamArgs<T> a) {
  constexpr int kFwdThreads = fwd_stream_threads(D);
  static_assert(!kSym || (sizeof(T) == 4 && CPL == 2), "the symmetric form takes float32 with 2 columns a lane");
  // a staged row: y (2y with kExpand) in [0, D), then -|y|^2 and the near-duplicate threshold
  constexpr int kPitch = D + 4;
  constexpr int kWarps = kFwdThreads / 32, kMirRows = 16, kMirPitch = kMirRows + 1;
  __shared__ __align__(16) T s_row[kFwdRows][kPitch];
  __shared__ T s_mu[D], s_w[D];
  __shared__ T s_scratch[(kFwdThreads / 32) * D];
  __shared__ T s_mir[kSym ? kWarps : 1][kSym ? 32 * CPL : 1][kSym ? kMirPitch : 1];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t b = blockIdx.z;
  const int64_t strip0 = static_cast<int64_t>(blockIdx.x) * kFwdThreads * CPL;
  const int64_t j0 = strip0 + static_cast<int64_t>(tid) * CPL;
  const int64_t i_begin = static_cast<int64_t>(blockIdx.y) * a.rows_per_block;
  const int64_t row_stop = kSym ? min(a.m, strip0 + static_cast<int64_t>(kFwdThreads) * CPL) : a.n;
  const int64_t i_end = min(row_stop, i_begin + a.rows_per_block);
  if (kSym && i_begin >= i_end) return;  // block-uniform, before any barrier: rows past the strip come by mirror
  const int d = a.d;
  const T* x1 = a.x1 + b * a.n * d;
  const T* x2 = a.x2 + b * a.m * d;
  const T* ls = a.ls + b * d;

  // this lane's columns, raw, and the block's centre: the mean of its columns
  T y2[CPL][D];
#pragma unroll
  for (int c = 0; c < CPL; ++c)
#pragma unroll
    for (int k = 0; k < D; ++k) y2[c][k] = (j0 + c < a.m && k < d) ? x2[(j0 + c) * d + k] : T(0);
  {
    T part[D];
#pragma unroll
    for (int k = 0; k < D; ++k) {
      part[k] = T(0);
#pragma unroll
      for (int c = 0; c < CPL; ++c) part[k] += y2[c][k];
    }
    block_sum(part, s_scratch, s_mu);  // ends with a barrier
    if (tid < D) {
      const T count = static_cast<T>(min(a.m - strip0, static_cast<int64_t>(kFwdThreads) * CPL));
      s_mu[tid] = tid < d ? s_mu[tid] / count : T(0);
      s_w[tid] = tid < d ? static_cast<T>(kSqrtHalfLog2e) / ls[tid] : T(0);
    }
    __syncthreads();
  }
  T b2[CPL];
#pragma unroll
  for (int c = 0; c < CPL; ++c) {
    b2[c] = T(0);
#pragma unroll
    for (int k = 0; k < D; ++k) {
      y2[c][k] = (j0 + c < a.m && k < d) ? scale_point(y2[c][k], s_mu[k], s_w[k]) : T(0);
      b2[c] = fma(-y2[c][k], y2[c][k], b2[c]);
    }
  }

  // rows: thread r < kFwdRows loads row ic + r into registers (prefetch), then writes it scaled to s_row
  T xr[D];
  auto fetch = [&](int64_t ic) {
#pragma unroll
    for (int k = 0; k < D; ++k) xr[k] = (tid < kFwdRows && ic + tid < i_end && k < d) ? x1[(ic + tid) * d + k] : T(0);
  };
  auto stage = [&]() {
    if (tid < kFwdRows) {
      T nrm = T(0);
#pragma unroll
      for (int k = 0; k < D; ++k) {
        const T y = k < d ? scale_point(xr[k], s_mu[k], s_w[k]) : T(0);
        nrm = fma(y, y, nrm);
        s_row[tid][k] = kExpand ? y * T(2) : y;  // doubling is exact
      }
      s_row[tid][D] = -nrm;
      s_row[tid][D + 1] = -nrm * static_cast<T>(2 * kNearTau);
    }
  };

  const T s = a.scale[b];
  T* out = a.out + b * a.n * a.ldo;
  // kSym: the warp's gathered values of rows i0 .. i0 + nr - 1 written as runs of the rows j of its columns; lane
  // (q, p) of a pass writes values 4p .. 4p + 3 of column 8 pass + q (one 16-byte store for a full run)
  auto flush_mirror = [&](int64_t i0, int nr) {
    if constexpr (kSym) {
      __syncwarp();
      const int q = lane >> 2, p = lane & 3;
#pragma unroll
      for (int pass = 0; pass < 4 * CPL; ++pass) {
        const int col = 8 * pass + q;
        const int64_t j = strip0 + static_cast<int64_t>(warp) * 32 * CPL + col;
        if (j < a.m) {
          T* dst = out + j * a.ldo + i0 + 4 * p;
          T w[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) w[e] = s_mir[warp][col][4 * p + e];
          if (a.vec_mirror && nr == kMirRows) {
            store_streaming<T, 4>(dst, w);
          } else {
#pragma unroll
            for (int e = 0; e < 4; ++e)
              if (4 * p + e < nr) __stcs(dst + e, w[e]);
          }
        }
      }
      __syncwarp();
    }
  };
  fetch(i_begin);
  for (int64_t ic = i_begin; ic < i_end; ic += kFwdRows) {
    __syncthreads();  // the previous chunk's reads of s_row are done
    stage();
    __syncthreads();
    fetch(ic + kFwdRows);
    const int rows = static_cast<int>(min(static_cast<int64_t>(kFwdRows), i_end - ic));
    for (int r = 0; r < rows; ++r) {  // rows is block-uniform: every lane takes part in the vote below
      T yr[D];
      load_row<T, D>(&s_row[r][0], yr);
      T e[CPL];
      if constexpr (kExpand) {
        const T b1 = s_row[r][D], thr = s_row[r][D + 1];
        bool near = false;
#pragma unroll
        for (int c = 0; c < CPL; ++c) {
          // dot product first, in four chains, then the biases: the rounding errors then scale with the partial
          // sums, which stay small for most pairs (starting from b1 + b2 put every rounding at |y|^2: 2x worse)
          T p[4] = {T(0), T(0), T(0), T(0)};
#pragma unroll
          for (int k = 0; k < D; ++k) p[k & 3] = fma(yr[k], y2[c][k], p[k & 3]);
          const T q = (((p[0] + p[1]) + (p[2] + p[3])) + b1) + b2[c];
          e[c] = q;
          near |= q >= thr;
        }
        if (__any_sync(kFull, near)) {
#pragma unroll
          for (int c = 0; c < CPL; ++c)
            if (e[c] >= thr) e[c] = neg_sq_dist<T, D>(yr, y2[c], T(0.5));
        }
      } else {
#pragma unroll
        for (int c = 0; c < CPL; ++c) e[c] = neg_sq_dist<T, D>(yr, y2[c]);
      }
      T v[CPL];
#pragma unroll
      for (int c = 0; c < CPL; ++c) v[c] = kernel_value(e[c], s);
      T* row = out + (ic + r) * a.ldo + j0;
      if (a.vec_store && j0 + CPL <= a.m) {
        store_streaming<T, CPL>(row, v);
      } else {
#pragma unroll
        for (int c = 0; c < CPL; ++c)
          if (j0 + c < a.m) __stcs(row + c, v[c]);
      }
      if constexpr (kSym) {
        // rows before the strip (a whole chunk: chunks and strips start at multiples of 32) are mirrored
        if (ic < strip0) {
          const int rr = r & (kMirRows - 1);
#pragma unroll
          for (int c = 0; c < CPL; ++c) s_mir[warp][lane * CPL + c][rr] = v[c];
          if (rr == kMirRows - 1 || r == rows - 1) flush_mirror(ic + (r - rr), rr + 1);
        }
      }
    }
  }
}

}  // namespace cuda
}  // namespace gpfast
