// The (lengthscale, outputscale) backward of K @ V in float32 on tensor cores: the bilinear form
//   sum(G * (K V)) = sum_ij W_ij K_ij,   W = G V^T   (G (n, t), V (m, t)),
// whose gradients are, with M = W o E (E = K / s) and z = (x - mu) / l (mu any centre),
//   d/ds   = S = sum_ij M_ij,
//   d/dl_k = s L_k / l_k,   L_k = sum_ij M_ij (z_ik - z_jk)^2
//          = sum_i (r_i z_ik^2 - 2 z_ik P_ik + R_ik),   r = M 1,  P = M Z,  R = M (Z o Z).
// Per tile of 16 rows (a warp) and 8 columns, three tensor-core products do the work per pair: the exponent's
// cross term 2 Z_I Z_J^T (m8n8k4 FP64 MMAs, k = the features), W = G_I V_J^T (m16n8k8 TF32, k = the right-hand
// sides), and M [Z_J | Z_J o Z_J] (m8n8k4 FP64, k = the 8 columns), whose A operand is M in the accumulator layout
// of the first two, in registers: k-step 0 takes the columns 0, 2, 4, 6 and k-step 1 the columns 1, 3, 5, 7, which
// is how a thread holds them, and the B operand's rows are read in the same order (no shuffles).
// For K(x, x) (BilinearArgs::symmetric) each pair is taken once: with row weights [G | V] and column weights
// [V | G], W'_ij = W_ij + W_ji, and since E and (z_i - z_j)^2 are symmetric, block I summing over the columns from
// its own first row on (its diagonal tile with weight 1/2) gives the sums over all ordered pairs, at 3 (2t/8) TF32
// and 2 (D/4 + D/2) FP64 MMAs per 16 x 8 pairs instead of twice 3 (t/8) and 2 (D/4 + D/2).
//
// Why tensor cores. On CUDA cores the work is about 2d + t + 5 FMAs per pair (the distance, the weight, the
// product with Z; 61 at d = 20, t = 17): 3.5 ms at the H200's peak for n = 44k, no margin below the 5 ms target.
// TF32 alone keeps 11 bits, so the weights are split 3xTF32: a = a_hi + a_lo (both rounded to nearest),
// a b ~ a_hi b_hi + a_hi b_lo + a_lo b_hi, which drops a_lo b_lo (2^-24 relative) and leaves each product about as
// accurate as float32's own rounding. Their B operand is staged in shared memory so that a lane's fragment, hi
// and lo, is one 16-byte load.
//
// Why double for everything but the weights. S and L have no error bound relative to their terms (they have either
// sign), so the error of every term must be independent of the others and about as small as the plain float32
// formula's, whose exponent error scales with |z_i - z_j|^2 and mostly with the rounding of each point (shared by
// all its pairs, which cancels in the sums). An emulation of the kernel's arithmetic on the tests' draws
// (experiments/bilinear_emulation.py) found, against the accuracy rule: the norm expansion 2 z_i.z_j - |z_i|^2 -
// |z_j|^2 in float32 or 3xTF32 (terms of size |z|^2; also with centred points, norms in double and TwoSum
// additions) over it on 6 of 162 draws; with the exponent in double but the exponential on the special-function
// unit (2 ulp), over it on 3; with M [Z | Z o Z] in 3xTF32, whose expanded form r z_i^2 - 2 z_i P + R cancels
// where z_i is far from the block centre against |z_i - z_j| (small d), over it on 2. So z = (x - mu) / l, the
// exponent (FP64 tensor cores for the cross term), exp (a polynomial on the FP64 units), M = W E, P, R and the
// sums are in double; K(x, x) = s exactly then needs no recomputation of near pairs. The cost is tensor time: the
// FP64 MMAs run at about an eighth of the TF32 rate per flop.
//
// Sums: each thread folds every chunk of 8 columns into its double totals (rows' L per feature, and S); the
// block's totals are added in double, in a fixed order, and the host adds the blocks' in double.
#pragma once

#include "device_common.cuh"
#include "mma.cuh"

namespace gpfast {
namespace cuda {

constexpr int kBilTile = 32;  // columns staged per tile (4 chunks of 8)

// Feature or weight count of the tensor-core kernel: rounded up to 8, the TF32 MMA's k (at most 32 features, 40
// weights).
__host__ __device__ constexpr int bilinear_features(int d) { return (d + 7) / 8 * 8; }

// Row pitch (32-bit words) of an operand row of `words` words stored as 16-byte fragments: 16 mod 32, so that
// the 8 lanes of a quarter-warp (two rows, four fragments each) read 8 distinct groups of 4 banks.
__host__ __device__ constexpr int bilinear_pitch(int words) { return words + (48 - words % 32) % 32; }

struct BilinearArgs {
  const float* x1;     // rows' points (B, n, d)
  const float* x2;     // columns' points (B, m, d)
  const float* ls;     // (B, d)
  const float* g;      // (B, n, t): the gradient of K V
  const float* v;      // (B, m, t)
  double* part_l;      // (splits, row blocks, B, D): L
  double* part_s;      // (splits, row blocks, B): S
  int64_t n, m, batch, cols_per_split;
  int d, t;
  // K(x, x) with weights g = [G | V], v = [V | G]: block I takes only the columns from its own first row on,
  // with weights W_ij + W_ji for the pairs (i, j) and (j, i) at once, halved on its diagonal tile of rows x rows
  bool symmetric;
};

// D: features rounded up to 8 (bilinear_features); TK: weights (t, or 2t when symmetric) rounded up to 8; kWarps
// warps of 16 rows.
template <int D, int TK, int kWarps>
__global__ void __launch_bounds__(kWarps * 32) bwd_bilinear_kernel(const BilinearArgs a) {
  constexpr int kThreads = kWarps * 32, kRows = kWarps * 16;
  constexpr int KD = D / 4, KT = TK / 8, NQ = D / 4;  // k-steps of the exponent and of W; n-tiles of M [Z | Z o Z]
  // The exponent's cross term 2 z_i.z_j in double on the FP64 tensor cores (m8n8k4: two 8-row tiles, D/4
  // k-steps): s_zd[j][k] holds the tile's points in double (pitch D + 4: 8-byte loads free of bank conflicts).
  // The weights' and M [Z | Z o Z]'s B operands are staged so that a lane's whole fragment, hi and lo, is one
  // 16-byte load (b0 hi, b1 hi, b0 lo, b1 lo), with pitches that make each quarter-warp's 8 loads hit 32 banks:
  //   s_vc[j][16 ks + 4 t + .]: V_j's entries 8 ks + t (b0) and 8 ks + t + 4 (b1) (pitch 16 mod 32)
  // M [Z | Z o Z] in double too (m8n8k4): s_b3[j][n] = z_jf (n = 2f) or z_jf^2 (n = 2f + 1), so that n-tile q
  // holds features 4q..4q+3 and quad lane t gets P and R of feature 4q + t side by side in its accumulator (pitch
  // 2 mod 8 doubles: the 8-byte loads below are free of bank conflicts)
  constexpr int kZP = D + 4, kVC = bilinear_pitch(2 * TK), kB3 = 2 * D + 2;
  __shared__ __align__(16) double s_zd[kBilTile][kZP];
  __shared__ __align__(16) uint32_t s_vc[kBilTile][kVC];
  __shared__ __align__(16) double s_b3[kBilTile][kB3];
  __shared__ __align__(16) double s_b2[kBilTile];  // -|z_j|^2
  __shared__ double s_mu[D], s_il[D];
  __shared__ double s_scratch[kWarps * (D + 1)];
  __shared__ double s_tot[D + 1];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;  // the MMA fragments' row group and quad lane
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int split = blockIdx.y;
  const int64_t b = blockIdx.z;
  const int64_t j_begin = (a.symmetric ? row0 : 0) + split * a.cols_per_split;
  const int64_t j_end = min(a.m, j_begin + a.cols_per_split);
  const int d = a.d, tt = a.t;
  const float* x1 = a.x1 + b * a.n * d;
  const float* x2 = a.x2 + b * a.m * d;
  const float* gr = a.g + b * a.n * tt;
  const float* vc = a.v + b * a.m * tt;

  // the block's centre: the mean of its rows (any centre gives the same distances; see device_common.cuh)
  if (tid < D) {
    const int64_t rows = min(a.n - row0, static_cast<int64_t>(kRows));
    double acc = 0.0;
    if (tid < d)
      for (int64_t r = 0; r < rows; ++r) acc += x1[(row0 + r) * d + tid];
    s_mu[tid] = tid < d ? acc / static_cast<double>(rows) : 0.0;
    s_il[tid] = tid < d ? 1.0 / static_cast<double>(a.ls[b * d + tid]) : 0.0;
  }
  __syncthreads();

  // This thread's two rows (g and g + 8 of the warp's 16): z = (x - mu) / l in double (exact to 2^-53: no
  // rounding of the points enters the exponent), A fragments of 2z (exponent, double) and of G (weights, split
  // hi/lo), z of feature 4q + t for L in float, and -|z|^2.
  const int64_t ri[2] = {row0 + warp * 16 + g, row0 + warp * 16 + g + 8};
  auto row_z = [&](int r, int k) -> double {
    return (ri[r] < a.n && k < d) ? (static_cast<double>(x1[ri[r] * d + k]) - s_mu[k]) * s_il[k] : 0.0;
  };
  double az[KD][2];  // m8n8k4 A: row g (tile 0) or g + 8 (tile 1), feature 4 ks + t
  uint32_t agh[KT][4], agl[KT][4];
#pragma unroll
  for (int ks = 0; ks < KD; ++ks)
#pragma unroll
    for (int r = 0; r < 2; ++r) az[ks][r] = 2.0 * row_z(r, 4 * ks + t);
#pragma unroll
  for (int ks = 0; ks < KT; ++ks)
#pragma unroll
    for (int e = 0; e < 4; ++e) {  // a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4)
      const int r = e & 1, c = 8 * ks + t + 4 * (e >> 1);
      split_tf32((ri[r] < a.n && c < tt) ? gr[ri[r] * tt + c] : 0.0f, agh[ks][e], agl[ks][e]);
    }
  double yf[NQ][2];
  double b1[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    double nrm = 0.0;
#pragma unroll
    for (int k = 0; k < D; ++k) {
      const double z = row_z(r, k);
      nrm = fma(z, z, nrm);
    }
    b1[r] = -nrm;
#pragma unroll
    for (int q = 0; q < NQ; ++q) yf[q][r] = row_z(r, 4 * q + t);
  }

  double lsum[NQ], ssum = 0.0;  // this thread's shares of L (feature 4q + t) and of S
#pragma unroll
  for (int q = 0; q < NQ; ++q) lsum[q] = 0.0;

  // Staging: lanes [LPC sj, LPC sj + LPC) own column sj of a tile, features and right-hand sides sl + LPC i; the
  // next tile's raw values are loaded into registers while this tile's products run.
  constexpr int LPC = kThreads / kBilTile, XD = D / LPC, XT = TK / LPC;
  static_assert(kThreads % kBilTile == 0 && D % LPC == 0 && TK % LPC == 0, "staging splits columns evenly");
  const int sj = tid / LPC, sl = tid % LPC;
  float px[XD], pv[XT];
  bool pin = false;
  auto fetch = [&](int64_t jt) {
    const int64_t j = jt + sj;
    pin = j < j_end;
#pragma unroll
    for (int i = 0; i < XD; ++i) px[i] = (pin && sl + LPC * i < d) ? x2[j * d + sl + LPC * i] : 0.0f;
#pragma unroll
    for (int i = 0; i < XT; ++i) pv[i] = (pin && sl + LPC * i < tt) ? vc[j * tt + sl + LPC * i] : 0.0f;
  };
  auto stage = [&]() {
    double nrm = 0.0;
#pragma unroll
    for (int i = 0; i < XD; ++i) {
      const int k = sl + LPC * i;
      const double z = (pin && k < d) ? (static_cast<double>(px[i]) - s_mu[k]) * s_il[k] : 0.0;
      nrm = fma(z, z, nrm);
      s_zd[sj][k] = z;
      s_b3[sj][2 * k] = z;
      s_b3[sj][2 * k + 1] = z * z;
    }
#pragma unroll
    for (int off = 1; off < LPC; off *= 2) nrm += __shfl_xor_sync(kFull, nrm, off);
    if (sl == 0) s_b2[sj] = -nrm;
#pragma unroll
    for (int i = 0; i < XT; ++i) {
      const int c = sl + LPC * i;
      uint32_t h, l;
      split_tf32(pv[i], h, l);
      const int vi = 16 * (c >> 3) + 4 * (c & 3) + ((c >> 2) & 1);
      s_vc[sj][vi] = h, s_vc[sj][vi + 2] = l;
    }
  };

  fetch(j_begin);
  for (int64_t jt = j_begin; jt < j_end; jt += kBilTile) {
    const int cols = static_cast<int>(min(static_cast<int64_t>(kBilTile), j_end - jt));
    const float diag = a.symmetric && jt < row0 + kRows ? 0.5f : 1.0f;  // exact: a power of two
    __syncthreads();  // the previous tile's reads are done
    stage();
    fetch(jt + kBilTile);
    __syncthreads();

#pragma unroll
    for (int ch = 0; ch < kBilTile / 8; ++ch) {
      const int jb = 8 * ch;
      if (jb >= cols) break;  // block-uniform
      double cr[2][2] = {{0.0, 0.0}, {0.0, 0.0}};  // 2 z_i.z_j: rows g, g + 8 by columns jb + 2t, jb + 2t + 1
#pragma unroll
      for (int ks = 0; ks < KD; ++ks) {  // b = B[k = t][n = g]: column jb + g, feature 4 ks + t
        const double zb = s_zd[jb + g][4 * ks + t];
        mma_f64(cr[0], az[ks][0], zb);
        mma_f64(cr[1], az[ks][1], zb);
      }
      float w[4] = {0.0f, 0.0f, 0.0f, 0.0f}, w_lo[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int ks = 0; ks < KT; ++ks) {
        const uint4 f = *reinterpret_cast<const uint4*>(&s_vc[jb + g][16 * ks + 4 * t]);
        mma_3xtf32_split(w, w_lo, agh[ks], agl[ks], f.x, f.y, f.z, f.w);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) w[e] += w_lo[e];
      // accumulator element e: row g (e < 2) or g + 8, column jb + 2t + (e & 1); E = exp(q / 2) with
      // q = 2 z_i.z_j - |z_i|^2 - |z_j|^2 = -|z_i - z_j|^2, all in double (exp_nonpositive<8>: 2e-10 relative; the
      // special-function unit's float exponential, about 2 ulp, took an emulation of the tests' draws over the
      // accuracy rule)
      const double2 b2 = *reinterpret_cast<const double2*>(&s_b2[jb + 2 * t]);
      double md[4];  // M = W E in double (a float32 times a double: exact to 2^-53)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const double q = (cr[e >> 1][e & 1] + b1[e >> 1]) + ((e & 1) ? b2.y : b2.x);
        md[e] = static_cast<double>(diag * w[e]) * exp_nonpositive<8>(0.5 * fmin(q, 0.0));
      }
      ssum += (md[0] + md[1]) + (md[2] + md[3]);
      // the chunk's row sums of M: this thread's two columns, then the quad's eight
      double rr[2] = {md[0] + md[1], md[2] + md[3]};
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        rr[r] += __shfl_xor_sync(kFull, rr[r], 1);
        rr[r] += __shfl_xor_sync(kFull, rr[r], 2);
      }
      // P and R of the chunk (m8n8k4 in double; k-step 0 takes the columns 2t, k-step 1 the columns 2t + 1, which
      // is how this thread holds M: A = M[g][2t + ks] or M[g + 8][2t + ks], B = B3[2t + ks][8q + g]), folded into
      // sum_j M_ij (z_i - z_j)^2 = r z_i^2 - 2 z_i P + R at once, in double
#pragma unroll
      for (int q = 0; q < NQ; ++q) {
        double pr[2][2] = {{0.0, 0.0}, {0.0, 0.0}};  // rows g, g + 8: P, R of feature 4q + t
#pragma unroll
        for (int ks = 0; ks < 2; ++ks) {
          const double bb = s_b3[jb + 2 * t + ks][8 * q + g];
          mma_f64(pr[0], md[ks], bb);
          mma_f64(pr[1], md[2 + ks], bb);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) lsum[q] += fma(fma(rr[r], yf[q][r], -2.0 * pr[r][0]), yf[q][r], pr[r][1]);
      }
    }
  }

  // the block's totals, in double: feature 4q + t from quad lane t, S from every thread
  double tot[D + 1];
#pragma unroll
  for (int q = 0; q < NQ; ++q)
#pragma unroll
    for (int u = 0; u < 4; ++u)
      tot[4 * q + u] = t == u ? lsum[q] : 0.0;
  tot[D] = ssum;
  block_sum(tot, s_scratch, s_tot);
  const int64_t blk = (static_cast<int64_t>(split) * gridDim.x + blockIdx.x) * a.batch + b;
  if (tid < D) a.part_l[blk * D + tid] = s_tot[tid];
  if (tid == D) a.part_s[blk] = s_tot[D];
}

}  // namespace cuda
}  // namespace gpfast
