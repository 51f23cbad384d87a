// The (lengthscale, outputscale) backward of K @ V from a K already in memory (the training engine's stored K):
//   sum(G * (K V)) = sum_ij W_ij K_ij,   W = G V^T   (G (n, t), V (m, t)),
// whose gradients are, with M = W o K and z = (x - mu) / l (mu any centre),
//   d/ds   = sum_ij M_ij / s,
//   d/dl_k = L_k / l_k,   L_k = sum_ij M_ij (z_ik - z_jk)^2 = sum_i r_i z_ik^2 - 2 sum_i z_ik P_ik + sum_j c_j z_jk^2,
// r = M 1 (row sums), c = 1^T M (column sums), P = M Z.
//
// Why a kernel of its own. The backward that recomputes K (backward_bilinear.cuh) spends most of its FP64 tensor
// time on the exponent's cross term and on M [Z | Z o Z], and its exponential is a double polynomial. With K
// read from memory both the exponent and the exponential go, and the third term needs no product at all: its
// column sums c_j come from the M fragments a warp already holds (three shuffles), so per 16 x 8 pairs only
// P = M Z remains on the FP64 tensor cores, D / 2 m8n8k4 MMAs instead of 3 D / 2. The pairs' K is one read of
// half of K (K(x, x), each pair once) at 4 bytes a pair.
//
// Accuracy. The weights W are 3xTF32 products, about as accurate as float32's own rounding (mma.cuh); M = W K,
// P, the row and column sums and every total are in double (a float32 times a float32 is exact in double), so the
// expanded form's cancellation where z_i is far from mu costs 2^-53 relative to its terms, not 2^-24. What the
// result cannot be more accurate than is the stored K itself: this is the gradient of sum(G * (K V)) for the K
// given, its float32 rounding included.
//
// K(x, x) (StoredArgs::symmetric) takes each pair once as backward_bilinear.cuh does: row weights [G | V] against
// column weights [V | G], so W'_ij = W_ij + W_ji; block I sums over the columns from its own first row on (its
// diagonal tile at weight 1/2), reading K_ij for j >= i only: K is taken as symmetric (a forward's K_ij and K_ji
// may differ in their last bits).
//
// The covariance backward from the forward's K (kDense): the weight of pair (i, j) is G_ij itself (the gradient
// of K, laid out as K), so M = G o K needs no MMA and no rounding (a float32 times a float32 is exact in double).
// The points' gradients need A_i = sum_j M_ij (z_i - z_j) = r_i z_i - P_i for the rows (part_a) and the same for
// the columns: a second launch reads K and G transposed (element (i, j) at [j * ld + i]), so that K's columns
// are its rows; each warp load still fills whole 32-byte sectors (8 consecutive rows of K a quad position).
#pragma once

#include "backward_bilinear.cuh"
#include "device_common.cuh"
#include "mma.cuh"

namespace gpfast {
namespace cuda {

struct StoredArgs {
  const float* k;   // K (n, m), row stride ldk, column stride 1 (transposed: K (m, n), element (i, j) at [j ldk + i])
  const float* x1;  // rows' points (n, d)
  const float* x2;  // columns' points (m, d)
  const float* ls;  // (d)
  const float* g;   // (n, t): the gradient of K V (with V: [G | V] when symmetric)
  const float* v;   // (m, t) ([V | G] when symmetric)
  const float* gk;  // kDense: the pairs' weights, laid out as K with row stride ldg
  double* part_l;   // (splits, row blocks, batch, D): L
  double* part_s;   // (splits, row blocks, batch): sum M
  double* part_a;   // (splits, batch, n, D): A_i = r_i z_i - P_i of this split's columns, or null
  int64_t n, m, ldk, ldg, cols_per_split;
  int64_t k_batch, g_batch, ls_batch;  // batch strides (entries) of K, the dense weights and the lengthscale
  int d, t;
  bool symmetric;
  bool transposed;  // K and the dense weights read transposed (kDense only)
  bool pairs;  // K's (and the dense weights') rows and pointers allow 8-byte loads of two neighbouring columns
};

// D: features rounded up to 8 (bilinear_features); TK: weights rounded up to 8 (kDense: unused, 8); kWarps warps
// of 16 rows; kDense: weights G_ij read from gk instead of formed as G_i . V_j. Batch entry blockIdx.z.
template <int D, int TK, int kWarps, bool kDense = false>
__global__ void __launch_bounds__(kWarps * 32) bwd_stored_kernel(StoredArgs a) {
  constexpr int kThreads = kWarps * 32, kRows = kWarps * 16;
  constexpr int KT = TK / 8, NP = D / 8;  // k-steps of W; n-tiles of P (8 features each)
  // s_z[j][f]: the tile's z in double, read as P's B operand (column jb + 2t + ks, feature 8q + g) and for the
  // column term (the same pattern): a pitch of 2 mod 8 doubles puts each half-warp's 16 loads in 16 distinct
  // bank pairs. s_vc: the weights' B operand, hi and lo, one 16-byte load a lane (as backward_bilinear.cuh).
  constexpr int kZP = D + 2, kVC = bilinear_pitch(2 * TK);
  __shared__ __align__(16) double s_z[kBilTile][kZP];
  __shared__ __align__(16) uint32_t s_vc[kBilTile][kVC];
  __shared__ double s_mu[D], s_il[D];
  __shared__ double s_scratch[kWarps * (D + 1)];
  __shared__ double s_tot[D + 1];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int split = blockIdx.y;
  const int64_t j_begin = (a.symmetric ? row0 : 0) + split * a.cols_per_split;
  const int64_t j_end = min(a.m, j_begin + a.cols_per_split);
  const int d = a.d, tt = a.t;
  const int64_t bz = blockIdx.z;
  a.x1 += bz * a.n * d, a.x2 += bz * a.m * d, a.ls += bz * a.ls_batch, a.k += bz * a.k_batch;
  if constexpr (kDense) a.gk += bz * a.g_batch;

  if (tid < D) {  // the block's centre: the mean of its rows
    const int64_t rows = min(a.n - row0, static_cast<int64_t>(kRows));
    double acc = 0.0;
    if (tid < d)
      for (int64_t r = 0; r < rows; ++r) acc += a.x1[(row0 + r) * d + tid];
    s_mu[tid] = tid < d ? acc / static_cast<double>(rows) : 0.0;
    s_il[tid] = tid < d ? 1.0 / static_cast<double>(a.ls[tid]) : 0.0;
  }
  __syncthreads();

  // this thread's rows g and g + 8 of the warp's 16, and their weights' A fragments split hi/lo
  const int64_t ri[2] = {row0 + warp * 16 + g, row0 + warp * 16 + g + 8};
  uint32_t agh[KT][4], agl[KT][4];
  if constexpr (!kDense) {
#pragma unroll
    for (int ks = 0; ks < KT; ++ks)
#pragma unroll
      for (int e = 0; e < 4; ++e) {  // a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4)
        const int r = e & 1, c = 8 * ks + t + 4 * (e >> 1);
        split_tf32((ri[r] < a.n && c < tt) ? a.g[ri[r] * tt + c] : 0.0f, agh[ks][e], agl[ks][e]);
      }
  }

  double pacc[NP][2][2];  // P of rows g, g + 8 (r), features 8q + 2t + e, over every column
  double racc[2] = {0.0, 0.0}, ssum = 0.0, cacc[NP];  // row sums (this thread's columns), sum M, column term
#pragma unroll
  for (int q = 0; q < NP; ++q) {
    cacc[q] = 0.0;
#pragma unroll
    for (int r = 0; r < 2; ++r) pacc[q][r][0] = pacc[q][r][1] = 0.0;
  }

  // Staging as in backward_bilinear.cuh: lanes [LPC sj, LPC sj + LPC) own column sj of a tile. This thread's K
  // entries of the next tile (rows g, g + 8; columns 8 ch + 2t, 8 ch + 2t + 1) are loaded while this tile's run.
  constexpr int LPC = kThreads / kBilTile, XD = D / LPC, XT = TK / LPC, kCh = kBilTile / 8;
  static_assert(kThreads % kBilTile == 0 && D % LPC == 0 && TK % LPC == 0, "staging splits columns evenly");
  const int sj = tid / LPC, sl = tid % LPC;
  float px[XD], pv[XT], kn[kCh][4], kc[kCh][4], wn[kCh][4], wc[kCh][4];
  bool pin = false;
  // entries (row, col) and (row, col + 1) of K or of the dense weights, zero outside the rows and j_end
  auto load_pair = [&](const float* base, int64_t ld, int64_t row, int64_t col, bool row_in, int64_t end,
                       float* out) {
    if (a.transposed) {
      out[0] = (row_in && col < end) ? base[col * ld + row] : 0.0f;
      out[1] = (row_in && col + 1 < end) ? base[(col + 1) * ld + row] : 0.0f;
      return;
    }
    const float* p = base + row * ld + col;
    if (row_in && a.pairs && col + 1 < end) {
      const float2 v2 = *reinterpret_cast<const float2*>(p);
      out[0] = v2.x, out[1] = v2.y;
    } else {
      out[0] = (row_in && col < end) ? p[0] : 0.0f;
      out[1] = (row_in && col + 1 < end) ? p[1] : 0.0f;
    }
  };
  auto fetch = [&](int64_t jt) {
    const int64_t j = jt + sj;
    pin = j < j_end;
#pragma unroll
    for (int i = 0; i < XD; ++i) px[i] = (pin && sl + LPC * i < d) ? a.x2[j * d + sl + LPC * i] : 0.0f;
    if constexpr (!kDense) {
#pragma unroll
      for (int i = 0; i < XT; ++i) pv[i] = (pin && sl + LPC * i < tt) ? a.v[j * tt + sl + LPC * i] : 0.0f;
    }
#pragma unroll
    for (int ch = 0; ch < kCh; ++ch)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        // the weights of columns past j_end and rows past n are zero; their K is read as zero (never past the
        // tensor's end) so that nothing but finite values meets them
        const int64_t col = jt + 8 * ch + 2 * t;
        const bool row_in = ri[r] < a.n;
        load_pair(a.k, a.ldk, ri[r], col, row_in, j_end, kn[ch] + 2 * r);
        if constexpr (kDense) load_pair(a.gk, a.ldg, ri[r], col, row_in, j_end, wn[ch] + 2 * r);
      }
  };
  auto stage = [&]() {
#pragma unroll
    for (int i = 0; i < XD; ++i) {
      const int k = sl + LPC * i;
      s_z[sj][k] = (pin && k < d) ? (static_cast<double>(px[i]) - s_mu[k]) * s_il[k] : 0.0;
    }
    if constexpr (!kDense) {
#pragma unroll
      for (int i = 0; i < XT; ++i) {
        const int c = sl + LPC * i;
        uint32_t h, l;
        split_tf32(pv[i], h, l);
        const int vi = 16 * (c >> 3) + 4 * (c & 3) + ((c >> 2) & 1);
        s_vc[sj][vi] = h, s_vc[sj][vi + 2] = l;
      }
    }
  };

  fetch(j_begin);
  for (int64_t jt = j_begin; jt < j_end; jt += kBilTile) {
    const int cols = static_cast<int>(min(static_cast<int64_t>(kBilTile), j_end - jt));
    const float diag = a.symmetric && jt < row0 + kRows ? 0.5f : 1.0f;  // exact: a power of two
    __syncthreads();  // the previous tile's reads are done
    stage();
#pragma unroll
    for (int ch = 0; ch < kCh; ++ch)
#pragma unroll
      for (int e = 0; e < 4; ++e) kc[ch][e] = kn[ch][e], wc[ch][e] = wn[ch][e];
    fetch(jt + kBilTile);
    __syncthreads();

#pragma unroll
    for (int ch = 0; ch < kCh; ++ch) {
      const int jb = 8 * ch;
      if (jb >= cols) break;  // block-uniform
      // accumulator element e: row g (e < 2) or g + 8, column jb + 2t + (e & 1), as kc[ch][e] is laid out
      double md[4];
      if constexpr (kDense) {
#pragma unroll
        for (int e = 0; e < 4; ++e) md[e] = static_cast<double>(wc[ch][e]) * kc[ch][e];
      } else {
        float w[4] = {0.0f, 0.0f, 0.0f, 0.0f}, w_lo[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int ks = 0; ks < KT; ++ks) {
          const uint4 f = *reinterpret_cast<const uint4*>(&s_vc[jb + g][16 * ks + 4 * t]);
          mma_3xtf32_split(w, w_lo, agh[ks], agl[ks], f.x, f.y, f.z, f.w);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) md[e] = static_cast<double>(diag * (w[e] + w_lo[e])) * kc[ch][e];
      }
      racc[0] += md[0] + md[1];
      racc[1] += md[2] + md[3];
      // P += M Z_J (m8n8k4: k-step ks takes the columns jb + 2t + ks, which is how this thread holds M)
#pragma unroll
      for (int q = 0; q < NP; ++q)
#pragma unroll
        for (int ks = 0; ks < 2; ++ks) {
          const double bb = s_z[jb + 2 * t + ks][8 * q + g];
          mma_f64(pacc[q][0], md[ks], bb);
          mma_f64(pacc[q][1], md[2 + ks], bb);
        }
      // the warp's column sums of M (over its 16 rows): every lane of quad position t then holds columns
      // jb + 2t and jb + 2t + 1, and lane g of them takes the features g + 8q of both
      double cs[2] = {md[0] + md[2], md[1] + md[3]};
#pragma unroll
      for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int off = 4; off < 32; off *= 2) cs[e] += __shfl_xor_sync(kFull, cs[e], off);
      ssum += cs[0] + cs[1];  // every lane the warp's sum: added once per quad position below
#pragma unroll
      for (int q = 0; q < NP; ++q) {
        const double z0 = s_z[jb + 2 * t][8 * q + g], z1 = s_z[jb + 2 * t + 1][8 * q + g];
        cacc[q] = fma(cs[0] * z0, z0, fma(cs[1] * z1, z1, cacc[q]));
      }
    }
  }

  // the rows' full sums over this block's columns (the quad's eight column shares)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    racc[r] += __shfl_xor_sync(kFull, racc[r], 1);
    racc[r] += __shfl_xor_sync(kFull, racc[r], 2);
  }
  // the rows' A_i = r_i z_i - P_i over this split's columns (zero in the padded features)
  if (a.part_a != nullptr) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (ri[r] >= a.n) continue;
      double* out = a.part_a + ((static_cast<int64_t>(split) * gridDim.z + bz) * a.n + ri[r]) * D;
#pragma unroll
      for (int q = 0; q < NP; ++q)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int f = 8 * q + 2 * t + e;
          const double z = f < d ? (static_cast<double>(a.x1[ri[r] * d + f]) - s_mu[f]) * s_il[f] : 0.0;
          out[f] = f < d ? fma(racc[r], z, -pacc[q][r][e]) : 0.0;
        }
    }
  }
  // totals a thread contributes: row terms r_i z_if^2 - 2 z_if P_if for its rows and features 8q + 2t + e, the
  // column term for features 8q + g, and (lanes g = 0 only, one per quad position) the sum of M
  double tot[D + 1];
#pragma unroll
  for (int f = 0; f <= D; ++f) tot[f] = 0.0;
#pragma unroll
  for (int q = 0; q < NP; ++q) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int f = 8 * q + 2 * t + e;
      double acc = 0.0;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const double z = (ri[r] < a.n && f < d) ? (static_cast<double>(a.x1[ri[r] * d + f]) - s_mu[f]) * s_il[f] : 0.0;
        acc += z * fma(racc[r], z, -2.0 * pacc[q][r][e]);
      }
      // f = 8q + 2t + e is this thread's own slot; 8q + g is the column term's (each a compile-time index
      // after the selects below unroll)
#pragma unroll
      for (int u = 0; u < 8; ++u)
        if (u == 2 * t + e) tot[8 * q + u] += acc;
    }
#pragma unroll
    for (int u = 0; u < 8; ++u)
      if (u == g) tot[8 * q + u] += cacc[q];
  }
  tot[D] = g == 0 ? ssum : 0.0;
  block_sum(tot, s_scratch, s_tot);
  const int64_t blk = (static_cast<int64_t>(split) * gridDim.x + blockIdx.x) * gridDim.z + bz;
  if (tid < D) a.part_l[blk * D + tid] = s_tot[tid];
  if (tid == D) a.part_s[blk] = s_tot[D];
}

}  // namespace cuda
}  // namespace gpfast
