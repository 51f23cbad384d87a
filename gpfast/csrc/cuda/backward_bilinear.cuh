// The (lengthscale, outputscale) backward of K @ V in float32 on tensor cores: the bilinear form
//   sum(G * (K V)) = sum_ij W_ij K_ij,   W = G V^T   (G (n, t), V (m, t)),
// whose gradients are, with M = W o E (E = K / s) and y = (x - mu) sqrt(log2(e) / 2) / l,
//   d/ds   = S = sum_ij M_ij,
//   d/dl_k = s L_k / (l_k log2(e) / 2),   L_k = sum_ij M_ij (y_ik - y_jk)^2
//          = sum_i (r_i y_ik^2 - 2 y_ik P_ik + R_ik),   r = M 1,  P = M Y,  R = M (Y o Y).
// Per tile of 16 rows (a warp) and 8 columns, three m16n8k8 TF32 products do all the work per pair:
//   the cross term 2 Y_I Y_J^T of the exponent (k = the features), W = G_I V_J^T (k = the right-hand sides), and
//   M [Y_J | Y_J o Y_J] (k = the 8 columns), whose A operand is the first two's accumulator, in registers: the
//   columns of M are taken in the order 0, 2, 4, 6, 1, 3, 5, 7, which is the order a thread holds them in the
//   accumulator layout, and the B operand's rows are read in the same order (no shuffles).
//
// Why tensor cores and this split. On CUDA cores the work is about 2d + t + 5 FMAs per pair (the distance, the
// weight, the product with Y; 61 at d = 20, t = 17): 3.5 ms at the H200's peak for n = 44k, no margin below the
// 5 ms target. On tensor cores it is 12 TF32 MMAs per 8 columns per k-step set, about 2.3 ms at peak with the
// exponential and the elementwise work left to the CUDA cores. TF32 alone keeps 11 bits, so every product is
// split 3xTF32: a = a_hi + a_lo (both rounded to nearest), a b ~ a_hi b_hi + a_hi b_lo + a_lo b_hi, which drops
// a_lo b_lo (2^-22 relative) and leaves each product about as accurate as float32's own rounding.
//
// Why this summation. S and L are single sums of n m terms of either sign, so a running float32 sum would lose
// log2(m) bits and more. The tensor cores sum 8 columns per MMA into an accumulator that is cleared every tile of
// kBilTile columns (a bounded number of terms, each rounding relative to the tile's partial sums); each tile's
// result is then added to per-thread float32 totals by TwoSum (error-free transformation: the rounding error of
// every addition is kept and added back), which bounds the error of the totals by about 2 eps times the sum of
// the tiles' magnitudes, whatever the count; the block's totals are added in double.
//
// Accuracy limits of the expansion. The exponent is the norm expansion, as in the float32 forwards: its error is
// about 2^-23 |y|^2, so the points are centred on the block's row mean, and pairs with squared distance under
// 2 tau |y_i|^2 (near duplicates, the diagonal of K(x, x)) are recomputed by differences behind a warp-uniform
// branch, as in covariance_forward.cuh. L's expanded form has the same kind of error, about 2^-23 |y|^2 sum |M|
// against sum M (y_i - y_j)^2; the centring keeps |y| near the data's own scale over the lengthscale.
#pragma once

#include "covariance_forward.cuh"
#include "device_common.cuh"

namespace gpfast {
namespace cuda {

constexpr int kBilTile = 32;  // columns staged per tile (4 chunks of 8)

// Feature count of the tensor-core kernel: d rounded up to 8 (the MMA's k), at most 32.
__host__ __device__ constexpr int bilinear_features(int d) { return d <= 8 ? 8 : d <= 16 ? 16 : d <= 24 ? 24 : 32; }

struct BilinearArgs {
  const float* x1;     // rows' points (B, n, d)
  const float* x2;     // columns' points (B, m, d)
  const float* ls;     // (B, d)
  const float* g;      // (B, n, t): the gradient of K V
  const float* v;      // (B, m, t)
  double* part_l;      // (splits, row blocks, B, D): L, in the y units above
  double* part_s;      // (splits, row blocks, B): S
  int64_t n, m, batch, cols_per_split;
  int d, t;
};

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

// c += (ah + al)(bh + bl) less al bl; the small products first, so that they are not lost against the large one
__device__ __forceinline__ void mma_3xtf32(float (&c)[4], const uint32_t (&ah)[4], const uint32_t (&al)[4],
                                           uint32_t bh0, uint32_t bh1, uint32_t bl0, uint32_t bl1) {
  mma_tf32(c, al, bh0, bh1);
  mma_tf32(c, ah, bl0, bl1);
  mma_tf32(c, ah, bh0, bh1);
}

// The same over k-steps with the large products in `big` and the small ones in `small` (added by the caller):
// two dependency chains of the tensor pipe instead of one three times as long.
__device__ __forceinline__ void mma_3xtf32_split(float (&big)[4], float (&small)[4], const uint32_t (&ah)[4],
                                                 const uint32_t (&al)[4], uint32_t bh0, uint32_t bh1, uint32_t bl0,
                                                 uint32_t bl1) {
  mma_tf32(small, al, bh0, bh1);
  mma_tf32(small, ah, bl0, bl1);
  mma_tf32(big, ah, bh0, bh1);
}

// s + c += x by TwoSum (Knuth): s + x = t + err exactly; err goes to the compensation c. Rounded intrinsics, so
// that no compiler contraction or reordering can change the error-free transformation.
__device__ __forceinline__ void two_sum_add(float& s, float& c, float x) {
  const float t = __fadd_rn(s, x);
  const float bp = __fsub_rn(t, s);
  const float err = __fadd_rn(__fsub_rn(s, __fsub_rn(t, bp)), __fsub_rn(x, bp));
  s = t;
  c = __fadd_rn(c, err);
}

// D: features rounded up to 8 (bilinear_features); TK: right-hand sides rounded up to 8; kWarps warps of 16 rows.
template <int D, int TK, int kWarps>
__global__ void __launch_bounds__(kWarps * 32) bwd_bilinear_kernel(const BilinearArgs a) {
  constexpr int kThreads = kWarps * 32, kRows = kWarps * 16;
  constexpr int KD = D / 8, KT = TK / 8, NQ = D / 4;  // k-steps of the exponent and of W; n-tiles of M [Y | Y o Y]
  // Pitches of 4 mod 8 (words) make every fragment load below free of bank conflicts.
  constexpr int kYP = D + 4, kVP = TK + 4, kBP = 2 * D + 4;
  __shared__ float s_y[kBilTile][kYP];  // the tile's columns, scaled (the near pairs' differences read them)
  __shared__ uint32_t s_yh[kBilTile][kYP], s_yl[kBilTile][kYP];
  __shared__ uint32_t s_vh[kBilTile][kVP], s_vl[kBilTile][kVP];
  // B operand of M [Y | Y o Y]: column 2f is y_f, column 2f + 1 is y_f^2, so that n-tile q holds features
  // 4q..4q+3 and the thread of quad lane t gets P and R of feature 4q + t side by side in its accumulator
  __shared__ uint32_t s_bh[kBilTile][kBP], s_bl[kBilTile][kBP];
  __shared__ float s_b2[kBilTile];
  __shared__ float s_mu[D], s_w[D];
  __shared__ double s_scratch[kWarps * (D + 1)];
  __shared__ double s_tot[D + 1];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;  // the MMA fragments' row group and quad lane
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int split = blockIdx.y;
  const int64_t b = blockIdx.z;
  const int64_t j_begin = split * a.cols_per_split;
  const int64_t j_end = min(a.m, j_begin + a.cols_per_split);
  const int d = a.d, tt = a.t;
  const float* x1 = a.x1 + b * a.n * d;
  const float* x2 = a.x2 + b * a.m * d;
  const float* gr = a.g + b * a.n * tt;
  const float* vc = a.v + b * a.m * tt;

  // the block's centre: the mean of its rows (any centre gives the same distances; see device_common.cuh)
  if (tid < D) {
    const int64_t rows = min(a.n - row0, static_cast<int64_t>(kRows));
    float acc = 0.0f;
    if (tid < d)
      for (int64_t r = 0; r < rows; ++r) acc += x1[(row0 + r) * d + tid];
    s_mu[tid] = tid < d ? acc / static_cast<float>(rows) : 0.0f;
    s_w[tid] = tid < d ? static_cast<float>(kSqrtHalfLog2e) / a.ls[b * d + tid] : 0.0f;
  }
  __syncthreads();

  // This thread's two rows (g and g + 8 of the warp's 16): A fragments of 2 y (exponent) and of G (weights),
  // split hi/lo; y of feature 4q + t for L; -|y|^2 and the near-pair threshold.
  const int64_t ri[2] = {row0 + warp * 16 + g, row0 + warp * 16 + g + 8};
  auto row_y = [&](int r, int k) -> float {
    return (ri[r] < a.n && k < d) ? scale_point(x1[ri[r] * d + k], s_mu[k], s_w[k]) : 0.0f;
  };
  uint32_t ayh[KD][4], ayl[KD][4], agh[KT][4], agl[KT][4];
#pragma unroll
  for (int ks = 0; ks < KD; ++ks)
#pragma unroll
    for (int e = 0; e < 4; ++e)  // a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4)
      split_tf32(2.0f * row_y(e & 1, 8 * ks + t + 4 * (e >> 1)), ayh[ks][e], ayl[ks][e]);
#pragma unroll
  for (int ks = 0; ks < KT; ++ks)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e & 1, c = 8 * ks + t + 4 * (e >> 1);
      split_tf32((ri[r] < a.n && c < tt) ? gr[ri[r] * tt + c] : 0.0f, agh[ks][e], agl[ks][e]);
    }
  float yf[NQ][2], b1[2], thr[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float nrm = 0.0f;
#pragma unroll
    for (int k = 0; k < D; ++k) {
      const float y = row_y(r, k);
      nrm = fmaf(y, y, nrm);
    }
    b1[r] = -nrm;
    thr[r] = -nrm * (2.0f * kNearTau);
#pragma unroll
    for (int q = 0; q < NQ; ++q) yf[q][r] = row_y(r, 4 * q + t);
  }

  float lsum[NQ], lcmp[NQ], ssum = 0.0f, scmp = 0.0f;
#pragma unroll
  for (int q = 0; q < NQ; ++q) lsum[q] = lcmp[q] = 0.0f;

  for (int64_t jt = j_begin; jt < j_end; jt += kBilTile) {
    const int cols = static_cast<int>(min(static_cast<int64_t>(kBilTile), j_end - jt));
    __syncthreads();  // the previous tile's reads are done
    for (int e = tid; e < kBilTile * D; e += kThreads) {
      const int jj = e / D, k = e - jj * D;
      const float y = (jj < cols && k < d) ? scale_point(x2[(jt + jj) * d + k], s_mu[k], s_w[k]) : 0.0f;
      uint32_t h, l, h2, l2;
      split_tf32(y, h, l);
      split_tf32(__fmul_rn(y, y), h2, l2);
      s_y[jj][k] = y;
      s_yh[jj][k] = h, s_yl[jj][k] = l;
      s_bh[jj][2 * k] = h, s_bl[jj][2 * k] = l;
      s_bh[jj][2 * k + 1] = h2, s_bl[jj][2 * k + 1] = l2;
    }
    for (int e = tid; e < kBilTile * TK; e += kThreads) {
      const int jj = e / TK, c = e - jj * TK;
      split_tf32((jj < cols && c < tt) ? vc[(jt + jj) * tt + c] : 0.0f, s_vh[jj][c], s_vl[jj][c]);
    }
    __syncthreads();
    if (tid < kBilTile) {
      float nrm = 0.0f;
#pragma unroll
      for (int k = 0; k < D; ++k) nrm = fmaf(s_y[tid][k], s_y[tid][k], nrm);
      s_b2[tid] = -nrm;
    }
    __syncthreads();

    float acc[NQ][4];  // this tile's M [Y | Y o Y]: P (g), R (g), P (g + 8), R (g + 8) of feature 4q + t
#pragma unroll
    for (int q = 0; q < NQ; ++q) acc[q][0] = acc[q][1] = acc[q][2] = acc[q][3] = 0.0f;
    float rs[2] = {0.0f, 0.0f};  // this thread's share of the tile's row sums of M
#pragma unroll
    for (int ch = 0; ch < kBilTile / 8; ++ch) {
      const int jb = 8 * ch;
      if (jb >= cols) break;  // block-uniform
      float cr[4] = {0.0f, 0.0f, 0.0f, 0.0f}, w[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      float cr_lo[4] = {0.0f, 0.0f, 0.0f, 0.0f}, w_lo[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int ks = 0; ks < KD; ++ks) {  // b0 (k = t, n = g), b1 (k = t + 4, n = g): column jb + g, feature k
        const int k = 8 * ks + t;
        mma_3xtf32_split(cr, cr_lo, ayh[ks], ayl[ks], s_yh[jb + g][k], s_yh[jb + g][k + 4], s_yl[jb + g][k],
                         s_yl[jb + g][k + 4]);
      }
#pragma unroll
      for (int ks = 0; ks < KT; ++ks) {
        const int c = 8 * ks + t;
        mma_3xtf32_split(w, w_lo, agh[ks], agl[ks], s_vh[jb + g][c], s_vh[jb + g][c + 4], s_vl[jb + g][c],
                         s_vl[jb + g][c + 4]);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) cr[e] += cr_lo[e], w[e] += w_lo[e];
      // accumulator element e: row g (e < 2) or g + 8, column jb + 2t + (e & 1)
      const float b2[2] = {s_b2[jb + 2 * t], s_b2[jb + 2 * t + 1]};
      float ex[4];
      bool near = false;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        ex[e] = (cr[e] + b1[e >> 1]) + b2[e & 1];
        near |= ex[e] >= thr[e >> 1];
      }
      if (__any_sync(kFull, near)) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (ex[e] >= thr[e >> 1]) {
            const float* yj = &s_y[jb + 2 * t + (e & 1)][0];
            float acc2 = 0.0f;
#pragma unroll
            for (int k = 0; k < D; ++k) {
              const float diff = row_y(e >> 1, k) - yj[k];
              acc2 = fmaf(-diff, diff, acc2);
            }
            ex[e] = acc2;
          }
        }
      }
      float mv[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) mv[e] = w[e] * exp2_fast(fminf(ex[e], 0.0f));
      rs[0] += mv[0] + mv[1];
      rs[1] += mv[2] + mv[3];
      // A operand of M [Y | Y o Y] with k = 0..3 the even columns 2t and k = 4..7 the odd ones 2t + 1:
      // a0 (g, 2t) = mv[0], a1 (g + 8, 2t) = mv[2], a2 (g, 2t + 1) = mv[1], a3 (g + 8, 2t + 1) = mv[3]
      uint32_t mh[4], ml[4];
      split_tf32(mv[0], mh[0], ml[0]);
      split_tf32(mv[2], mh[1], ml[1]);
      split_tf32(mv[1], mh[2], ml[2]);
      split_tf32(mv[3], mh[3], ml[3]);
#pragma unroll
      for (int q = 0; q < NQ; ++q) {  // b0 (k = t: column jb + 2t), b1 (k = t + 4: column jb + 2t + 1), n = g
        const int n = 8 * q + g;
        mma_3xtf32(acc[q], mh, ml, s_bh[jb + 2 * t][n], s_bh[jb + 2 * t + 1][n], s_bl[jb + 2 * t][n],
                   s_bl[jb + 2 * t + 1][n]);
      }
    }
    // fold the tile into the totals: the row sums of M over the quad, then per row sum_j M_ij (y_i - y_j)^2
    two_sum_add(ssum, scmp, rs[0] + rs[1]);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      rs[r] += __shfl_xor_sync(kFull, rs[r], 1);
      rs[r] += __shfl_xor_sync(kFull, rs[r], 2);
    }
#pragma unroll
    for (int q = 0; q < NQ; ++q) {
      const float l0 = fmaf(fmaf(rs[0], yf[q][0], -2.0f * acc[q][0]), yf[q][0], acc[q][1]);
      const float l1 = fmaf(fmaf(rs[1], yf[q][1], -2.0f * acc[q][2]), yf[q][1], acc[q][3]);
      two_sum_add(lsum[q], lcmp[q], l0 + l1);
    }
  }

  // the block's totals, in double: feature 4q + t from quad lane t, S from every thread
  double tot[D + 1];
#pragma unroll
  for (int q = 0; q < NQ; ++q)
#pragma unroll
    for (int u = 0; u < 4; ++u)
      tot[4 * q + u] = t == u ? static_cast<double>(lsum[q]) + static_cast<double>(lcmp[q]) : 0.0;
  tot[D] = static_cast<double>(ssum) + static_cast<double>(scmp);
  block_sum(tot, s_scratch, s_tot);
  const int64_t blk = (static_cast<int64_t>(split) * gridDim.x + blockIdx.x) * a.batch + b;
  if (tid < D) a.part_l[blk * D + tid] = s_tot[tid];
  if (tid == D) a.part_s[blk] = s_tot[D];
}

}  // namespace cuda
}  // namespace gpfast
