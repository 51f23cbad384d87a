// The first generation of gpfast kernels, kept reachable for debugging and as a fall-back (GPFAST_COV_FWD=tile|rows,
// GPFAST_BWD=legacy, GPFAST_MATMUL=legacy) and still the forward for d > 32 or m < 1024 (`cov_fwd_kernel`).
//
// Every kernel here works on pre-scaled inputs z = x / lengthscale, zero-padded to `D` (or `dp`) features, so
// K_ij = s * exp(-0.5 * |z1_i - z2_j|^2). Distances are formed from differences, never from the expansion
// |a|^2 + |b|^2 - 2ab, so they are never negative and K(x, x) == s exactly.
//
// Gradients use W_ij = dLoss/dK_ij * K_ij and, per row i, A_i = sum_j W_ij (z1_i - z2_j),
// L = sum_ij W_ij (z1_i - z2_j)^2 (per feature) and S = sum_ij W_ij / s; the host turns these into the
// gradients of x1, x2, lengthscale and outputscale. Partial sums go to per-block buffers that the host adds
// up, so results are deterministic and no n x m intermediate is written.
#pragma once

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

// ------------------------------------------------------------------------------------------------------------
// Covariance, forward: K (B, n, m). Each block writes a 64 x 64 tile; each thread a 4 x 4 micro-tile whose
// four columns are contiguous, so stores are 16-byte vectors and a half-warp writes 256 contiguous bytes.
// The feature axis is staged through shared memory in chunks of 32, so any d works.
constexpr int kCovTile = 64, kCovChunk = 32, kCovThreads = 256;

// The forward kernels read the raw points and divide by the lengthscale while staging them (IEEE division, so
// z matches x / l computed by PyTorch bit for bit): no separate pre-scaling launches, which matter at small sizes.
__device__ __forceinline__ float scaled(float x, float l) { return __fdiv_rn(x, l); }
__device__ __forceinline__ double scaled(double x, double l) { return __ddiv_rn(x, l); }

template <typename T>
struct CovFwdArgs {
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
__global__ void __launch_bounds__(kCovThreads) cov_fwd_kernel(const CovFwdArgs<T> a) {
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

// |a - b|^2 over D features (a multiple of 4) in four chains; diff receives a - b.
template <typename T, int D>
__device__ __forceinline__ T sq_dist4(const T (&a)[D], const T (&b)[D], T (&diff)[D]) {
  T p[4] = {T(0), T(0), T(0), T(0)};
#pragma unroll
  for (int k = 0; k < D; ++k) {
    diff[k] = a[k] - b[k];
    p[k & 3] = fma(diff[k], diff[k], p[k & 3]);
  }
  return (p[0] + p[1]) + (p[2] + p[3]);
}

// ------------------------------------------------------------------------------------------------------------
// Covariance, forward, row-streaming form for d <= 32: each lane owns CPL consecutive columns whose z2 rows stay
// in registers; the block walks down a range of rows (z1 rows staged 32 at a time in shared memory, read as
// broadcasts) and every lane stores its CPL outputs of each row (16 bytes for CPL = 4), so a warp writes
// 512 contiguous bytes per row and keeps many independent stores in flight, with no barrier inside a chunk.
constexpr int kRowsStage = 32, kRowsThreads = 256;

template <typename T>
struct CovRowsArgs {
  const T* x1;     // (B, n, d)
  const T* x2;     // (B, m, d)
  const T* ls;     // (B, d)
  const T* scale;  // (B)
  T* out;          // (B, n, m)
  int64_t n, m;
  int d;
  int64_t rows_per_block;
};

template <typename T, int D, int CPL, bool kVecStore>
__global__ void __launch_bounds__(kRowsThreads) cov_fwd_rows_kernel(const CovRowsArgs<T> a) {
  __shared__ __align__(16) T s_z1[kRowsStage][D];
  const int64_t b = blockIdx.z;
  const int64_t j0 = (static_cast<int64_t>(blockIdx.x) * kRowsThreads + threadIdx.x) * CPL;
  const int64_t i_begin = static_cast<int64_t>(blockIdx.y) * a.rows_per_block;
  const int64_t i_end = min(a.n, i_begin + a.rows_per_block);
  const T* x1 = a.x1 + b * a.n * a.d;
  const T* ls = a.ls + b * a.d;
  T* out = a.out + b * a.n * a.m;
  const T s = a.scale[b];
  T z2[CPL][D];
#pragma unroll
  for (int c = 0; c < CPL; ++c)
#pragma unroll
    for (int k = 0; k < D; ++k)
      z2[c][k] = (j0 + c < a.m && k < a.d) ? scaled(a.x2[(b * a.m + j0 + c) * a.d + k], ls[k]) : T(0);

  for (int64_t ic = i_begin; ic < i_end; ic += kRowsStage) {
    const int rows = static_cast<int>(min(static_cast<int64_t>(kRowsStage), i_end - ic));
    __syncthreads();  // the previous chunk's reads of s_z1 are done
    for (int e = threadIdx.x; e < rows * D; e += kRowsThreads) {
      const int r = e / D, k = e % D;
      s_z1[r][k] = k < a.d ? scaled(x1[(ic + r) * a.d + k], ls[k]) : T(0);
    }
    __syncthreads();
    if (j0 >= a.m) continue;
    for (int r = 0; r < rows; ++r) {
      T zr[D];
#pragma unroll
      for (int k = 0; k < D; k += 4) {
        T q[4];
        load4(&s_z1[r][k], q);
#pragma unroll
        for (int u = 0; u < 4; ++u) zr[k + u] = q[u];
      }
      T v[CPL];
#pragma unroll
      for (int c = 0; c < CPL; ++c) {
        T diff[D];
        v[c] = s * exp_neg_half(sq_dist4<T, D>(zr, z2[c], diff));
      }
      T* row = out + (ic + r) * a.m + j0;
      if constexpr (kVecStore && CPL == 4) {
        if (j0 + 4 <= a.m) {
          store_streaming<T, 4>(row, v);
          continue;
        }
      }
#pragma unroll
      for (int c = 0; c < CPL; ++c)
        if (j0 + c < a.m) row[c] = v[c];
    }
  }
}

// ------------------------------------------------------------------------------------------------------------
// Covariance, backward: one pass over grad_K that recomputes K on the fly.
// Block = up to 8 warps side by side on a strip of columns (each lane owns CPL consecutive columns, whose z2
// rows and column sums B live in registers for the whole block); the block walks down a range of rows.
// Per row the warp reduce-scatters its contribution to A_i into shared memory; every 32 rows the block adds
// the warps' slots and writes them to part_a[strip]. At the end each lane writes its columns' B to
// part_b[rowblock]; L and S are reduced over the block into part_l / part_s[block].
constexpr int kBwdRows = 32, kBwdMaxWarps = 8;

template <typename T>
struct CovBwdArgs {
  const T* grad;   // (B, n, m)
  const T* z1;     // (B, n, D)
  const T* z2;     // (B, m, D)
  const T* scale;  // (B)
  T* part_a;       // (strips, B, n, D)
  T* part_b;       // (rowblocks, B, m, D)  holds sum_i W_ij (z1_i - z2_j)
  T* part_l;       // (rowblocks, strips, B, D)
  T* part_s;       // (rowblocks, strips, B)
  int64_t n, m, batch;
  int64_t rows_per_block;
  int strips, rowblocks;
};

template <typename T, int D, int CPL, bool kVecLoad>
__global__ void __launch_bounds__(kBwdMaxWarps * 32) cov_bwd_kernel(const CovBwdArgs<T> a) {
  // float64 with D = 32 would pass the 48 KB static limit with 32 staged rows: stage 16 (the host's row
  // ranges are multiples of 32, hence of 16 too)
  constexpr int kRows = (sizeof(T) == 8 && D == 32) ? kBwdRows / 2 : kBwdRows;
  __shared__ __align__(16) T s_z1[kRows][D];
  __shared__ T s_a[kBwdMaxWarps][kRows][D];
  __shared__ T s_red[kBwdMaxWarps][D + 1];
  const int strip = blockIdx.x, rowblock = blockIdx.y;
  const int64_t b = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  const int64_t jw = (static_cast<int64_t>(strip) * nwarps + warp) * 32 * CPL + lane * CPL;  // first column
  const int64_t i_begin = rowblock * a.rows_per_block;
  const int64_t i_end = min(a.n, i_begin + a.rows_per_block);
  const T s = a.scale[b];
  const T* z1 = a.z1 + b * a.n * D;
  const T* grad = a.grad + b * a.n * a.m;

  T z2[CPL][D], bacc[CPL][D], lacc[D], sacc = T(0);
#pragma unroll
  for (int c = 0; c < CPL; ++c) {
    const int64_t j = jw + c;
#pragma unroll
    for (int k = 0; k < D; ++k) {
      z2[c][k] = j < a.m ? a.z2[(b * a.m + j) * D + k] : T(0);
      bacc[c][k] = T(0);
    }
  }
#pragma unroll
  for (int k = 0; k < D; ++k) lacc[k] = T(0);

  for (int64_t ic = i_begin; ic < i_end; ic += kRows) {
    const int rows = static_cast<int>(min(static_cast<int64_t>(kRows), i_end - ic));
    for (int e = threadIdx.x; e < rows * D; e += blockDim.x) s_z1[e / D][e % D] = z1[ic * D + e];
    __syncthreads();
    for (int r = 0; r < rows; ++r) {
      const int64_t i = ic + r;
      T zr[D];
#pragma unroll
      for (int k = 0; k < D; k += 4) {
        T q[4];
        load4(&s_z1[r][k], q);
#pragma unroll
        for (int u = 0; u < 4; ++u) zr[k + u] = q[u];
      }
      T g[CPL];
      const T* grow = grad + i * a.m;
      if (kVecLoad && jw + CPL <= a.m) {
        if constexpr (CPL == 4) {
          T q[4];
          load4(grow + jw, q);
#pragma unroll
          for (int c = 0; c < 4; ++c) g[c] = q[c];
        } else {
#pragma unroll
          for (int c = 0; c < CPL; ++c) g[c] = grow[jw + c];
        }
      } else {
#pragma unroll
        for (int c = 0; c < CPL; ++c) g[c] = (jw + c < a.m) ? grow[jw + c] : T(0);
      }
      T arow[D];
#pragma unroll
      for (int k = 0; k < D; ++k) arow[k] = T(0);
#pragma unroll
      for (int c = 0; c < CPL; ++c) {
        T diff[D];
        const T dist = sq_dist4<T, D>(zr, z2[c], diff);
        const T ge = g[c] * exp_neg_half(dist);  // G_ij * K_ij / s
        const T w = s * ge;
        sacc += ge;
#pragma unroll
        for (int k = 0; k < D; ++k) {
          const T wd = w * diff[k];
          arow[k] += wd;
          bacc[c][k] += wd;
          lacc[k] = fma(wd, diff[k], lacc[k]);
        }
      }
      int dim;
      const T red = warp_reduce_scatter<T, D>(arow, lane, dim);
      if ((lane & (32 / D - 1)) == 0) s_a[warp][r][dim] = red;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < rows * D; e += blockDim.x) {
      const int r = e / D, k = e % D;
      T acc = T(0);
      for (int w = 0; w < nwarps; ++w) acc += s_a[w][r][k];
      a.part_a[((static_cast<int64_t>(strip) * a.batch + b) * a.n + ic + r) * D + k] = acc;
    }
    // the next chunk overwrites s_z1 and s_a only after the __syncthreads at its top
  }

#pragma unroll
  for (int c = 0; c < CPL; ++c) {
    const int64_t j = jw + c;
    if (j < a.m) {
      T* dst = a.part_b + ((static_cast<int64_t>(rowblock) * a.batch + b) * a.m + j) * D;
#pragma unroll
      for (int k = 0; k < D; ++k) dst[k] = bacc[c][k];
    }
  }
  // block reduction of L (per feature) and S
  T tot[D + 1];
#pragma unroll
  for (int k = 0; k < D; ++k) tot[k] = lacc[k];
  tot[D] = sacc;
  __shared__ T s_tot[D + 1];
  block_sum(tot, &s_red[0][0], s_tot);
  const int64_t blk = (static_cast<int64_t>(rowblock) * a.strips + strip) * a.batch + b;
  if (threadIdx.x < D) a.part_l[blk * D + threadIdx.x] = s_tot[threadIdx.x];
  if (threadIdx.x == D) a.part_s[blk] = s_tot[D];
}

// ------------------------------------------------------------------------------------------------------------
// K @ V, forward. Each thread owns TM rows and TC right-hand-side columns, accumulating in registers; the
// block walks a range of columns j (the whole of m, or a 1/splits share of it when n alone gives too few
// blocks) in tiles of 64 staged in shared memory, read as broadcasts. part (splits, B, n, t) is summed on the
// host when splits > 1.
constexpr int kMmThreads = 128, kMmTileJ = 64;

template <typename T>
struct MatmulArgs {
  const T* z1;     // (B, n, D)
  const T* z2;     // (B, m, D)
  const T* scale;  // (B)
  const T* v;      // (B, m, t)  right-hand sides (the backward's "v")
  const T* g;      // (B, n, t)  backward only: grad of the output
  T* out;          // forward: (splits, B, n, t); backward: A partials (splits, B, n, D)
  T* part_l;       // backward: (splits, rowblocks, B, D)
  T* part_s;       // backward: (splits, rowblocks, B)
  int64_t n, m, batch;
  int t, t_chunks, splits;
  int64_t cols_per_split;
};

template <typename T, int D, int TC, int TM>
__global__ void __launch_bounds__(kMmThreads) matmul_fwd_kernel(const MatmulArgs<T> a) {
  __shared__ __align__(16) T s_z2[kMmTileJ][D];
  __shared__ __align__(16) T s_v[kMmTileJ][TC];
  const int64_t rowblock = blockIdx.x;
  const int split = blockIdx.y;
  const int64_t b = blockIdx.z / a.t_chunks;
  const int t0 = static_cast<int>(blockIdx.z % a.t_chunks) * TC;
  const int64_t j_begin = split * a.cols_per_split;
  const int64_t j_end = min(a.m, j_begin + a.cols_per_split);

  // Two-level sums: `tile` collects one 64-column tile, then is folded into `acc`. A single running sum over
  // m = 10^6 columns would lose about log2(m / 64) more bits than cuBLAS-style blocked sums.
  T zr[TM][D], acc[TM][TC], tile[TM][TC];
#pragma unroll
  for (int r = 0; r < TM; ++r) {
    const int64_t i = rowblock * kMmThreads * TM + r * kMmThreads + threadIdx.x;
#pragma unroll
    for (int k = 0; k < D; ++k) zr[r][k] = i < a.n ? a.z1[(b * a.n + i) * D + k] : T(0);
#pragma unroll
    for (int c = 0; c < TC; ++c) acc[r][c] = T(0);
  }

  for (int64_t jt = j_begin; jt < j_end; jt += kMmTileJ) {
    const int cols = static_cast<int>(min(static_cast<int64_t>(kMmTileJ), j_end - jt));
    __syncthreads();
    for (int e = threadIdx.x; e < kMmTileJ * D; e += kMmThreads) {
      const int jj = e / D;
      s_z2[jj][e % D] = jj < cols ? a.z2[(b * a.m + jt) * D + e] : T(0);
    }
    for (int e = threadIdx.x; e < kMmTileJ * TC; e += kMmThreads) {
      const int jj = e / TC, c = e % TC;
      s_v[jj][c] = (jj < cols && t0 + c < a.t) ? a.v[(b * a.m + jt + jj) * a.t + t0 + c] : T(0);
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < TM; ++r)
#pragma unroll
      for (int c = 0; c < TC; ++c) tile[r][c] = T(0);
    for (int jj = 0; jj < cols; ++jj) {
      T zc[D], vc[TC];
#pragma unroll
      for (int k = 0; k < D; k += 4) {
        T q[4];
        load4(&s_z2[jj][k], q);
#pragma unroll
        for (int u = 0; u < 4; ++u) zc[k + u] = q[u];
      }
      if constexpr (TC % 4 == 0) {
#pragma unroll
        for (int c = 0; c < TC; c += 4) {
          T q[4];
          load4(&s_v[jj][c], q);
#pragma unroll
          for (int u = 0; u < 4; ++u) vc[c + u] = q[u];
        }
      } else {
#pragma unroll
        for (int c = 0; c < TC; ++c) vc[c] = s_v[jj][c];
      }
#pragma unroll
      for (int r = 0; r < TM; ++r) {
        T diff[D];
        const T e = exp_neg_half(sq_dist4<T, D>(zr[r], zc, diff));
#pragma unroll
        for (int c = 0; c < TC; ++c) tile[r][c] = fma(e, vc[c], tile[r][c]);
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
    const int64_t i = rowblock * kMmThreads * TM + r * kMmThreads + threadIdx.x;
    if (i >= a.n) continue;
    T* dst = a.out + ((static_cast<int64_t>(split) * a.batch + b) * a.n + i) * a.t + t0;
#pragma unroll
    for (int c = 0; c < TC; ++c)
      if (t0 + c < a.t) dst[c] = s * acc[r][c];
  }
}

// K @ V, backward row pass: with W_ij = K_ij (G_i . V_j), per row A_i = sum_j W_ij (z1_i - z2_j); with kWithL
// also L and S summed over the block. Called twice by the host: on (x1, x2, G, V) for the rows and on
// (x2, x1, V, G) for the columns. Needs t <= TC (one chunk).
template <typename T, int D, int TC, int TM, bool kWithL>
__global__ void __launch_bounds__(kMmThreads) matmul_bwd_kernel(const MatmulArgs<T> a) {
  __shared__ __align__(16) T s_z2[kMmTileJ][D];
  __shared__ __align__(16) T s_v[kMmTileJ][TC];
  __shared__ T s_red[kMmThreads / 32][D + 1];
  const int64_t rowblock = blockIdx.x;
  const int split = blockIdx.y;
  const int64_t b = blockIdx.z;
  const int64_t j_begin = split * a.cols_per_split;
  const int64_t j_end = min(a.m, j_begin + a.cols_per_split);
  const T s = a.scale[b];

  T zr[TM][D], gr[TM][TC], ar[TM][D], lacc[kWithL ? D : 1], sacc = T(0);
#pragma unroll
  for (int r = 0; r < TM; ++r) {
    const int64_t i = rowblock * kMmThreads * TM + r * kMmThreads + threadIdx.x;
#pragma unroll
    for (int k = 0; k < D; ++k) {
      zr[r][k] = i < a.n ? a.z1[(b * a.n + i) * D + k] : T(0);
      ar[r][k] = T(0);
    }
#pragma unroll
    for (int c = 0; c < TC; ++c) gr[r][c] = (i < a.n && c < a.t) ? a.g[(b * a.n + i) * a.t + c] : T(0);
  }
#pragma unroll
  for (int k = 0; k < (kWithL ? D : 1); ++k) lacc[k] = T(0);

  for (int64_t jt = j_begin; jt < j_end; jt += kMmTileJ) {
    const int cols = static_cast<int>(min(static_cast<int64_t>(kMmTileJ), j_end - jt));
    __syncthreads();
    for (int e = threadIdx.x; e < kMmTileJ * D; e += kMmThreads) {
      const int jj = e / D;
      s_z2[jj][e % D] = jj < cols ? a.z2[(b * a.m + jt) * D + e] : T(0);
    }
    for (int e = threadIdx.x; e < kMmTileJ * TC; e += kMmThreads) {
      const int jj = e / TC, c = e % TC;
      s_v[jj][c] = (jj < cols && c < a.t) ? a.v[(b * a.m + jt + jj) * a.t + c] : T(0);
    }
    __syncthreads();
    for (int jj = 0; jj < cols; ++jj) {
      T zc[D], vc[TC];
#pragma unroll
      for (int k = 0; k < D; k += 4) {
        T q[4];
        load4(&s_z2[jj][k], q);
#pragma unroll
        for (int u = 0; u < 4; ++u) zc[k + u] = q[u];
      }
#pragma unroll
      for (int c = 0; c < TC; ++c) vc[c] = s_v[jj][c];
#pragma unroll
      for (int r = 0; r < TM; ++r) {
        T dot = T(0), diff[D];
#pragma unroll
        for (int c = 0; c < TC; ++c) dot = fma(gr[r][c], vc[c], dot);
        const T dist = sq_dist4<T, D>(zr[r], zc, diff);
        const T ge = exp_neg_half(dist) * dot;
        const T w = s * ge;
#pragma unroll
        for (int k = 0; k < D; ++k) {
          if constexpr (kWithL) {
            const T wd = w * diff[k];
            ar[r][k] += wd;
            lacc[k] = fma(wd, diff[k], lacc[k]);
          } else {
            ar[r][k] = fma(w, diff[k], ar[r][k]);
          }
        }
        if constexpr (kWithL) sacc += ge;
      }
    }
  }

#pragma unroll
  for (int r = 0; r < TM; ++r) {
    const int64_t i = rowblock * kMmThreads * TM + r * kMmThreads + threadIdx.x;
    if (i >= a.n) continue;
    T* dst = a.out + ((static_cast<int64_t>(split) * a.batch + b) * a.n + i) * D;
#pragma unroll
    for (int k = 0; k < D; ++k) dst[k] = ar[r][k];
  }
  if constexpr (kWithL) {
    T tot[D + 1];
#pragma unroll
    for (int k = 0; k < D; ++k) tot[k] = lacc[k];
    tot[D] = sacc;
    __shared__ T s_tot[D + 1];
    block_sum(tot, &s_red[0][0], s_tot);
    const int64_t blk = (static_cast<int64_t>(split) * gridDim.x + rowblock) * a.batch + b;
    if (threadIdx.x < D) a.part_l[blk * D + threadIdx.x] = s_tot[threadIdx.x];
    if (threadIdx.x == D) a.part_s[blk] = s_tot[D];
  }
}

}  // namespace cuda
}  // namespace gpfast
