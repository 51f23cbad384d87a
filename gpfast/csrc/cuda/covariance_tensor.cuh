// Covariance, forward, in float32 on tensor cores: K (B, n, m) = s * 2^e with the exponent's cross term on the
// TF32 tensor cores (3xTF32), for 8 < d <= 32. Run by name only (the private op's "tc"): faster than the norm
// expansion on Gaussian draws, but 3-7x slower on real data with duplicate points, where most tiles hold a near pair
// and the warp waits on its recomputation from global memory (rbf_covariance.cu, default_forward).
//
// Why. With the norm expansion e = 2 z_i.z_j - |z_i|^2 - |z_j|^2 the work per pair is d FMAs for the cross term
// and a handful of operations beside one exponential and one store. On CUDA cores that is the limit at d = 32:
// the row-streaming kernel took 1.21 ms for (4, 8192, 8192, 32) on the H200, against 0.25 ms to write K at the copy
// bandwidth. Here the cross term of a 16 x 8 tile is 3 KD m16n8k8 MMAs (KD = d / 8 rounded up, 3xTF32 as in
// mma.cuh: each product within a few times 2^-22 of its value), which leaves the CUDA cores the biases, the near
// test, the exponential and the store, the same per pair at any d.
//
// A block owns kCols = 16 MT kWarps columns of K (each warp MT tiles of 16) and walks down a range of rows in tiles of
// kTile rows, so that the blocks in flight write the same few rows at any time, as the row-streaming kernel does. With
// rows in registers and columns streamed instead, every block in flight wrote rows of its own, all over K: on the H200
// that took 16.9 ms at 43,945 x 43,945 points (d = 20) against 6.5 ms in this layout, though it was faster where K is
// small (0.72 against 0.93 ms at (4, 8192, 8192, 32), 0.65 against 0.78 at 13,500 points, d = 26). Both layouts stay at
// 3-5x the time of writing K at the copy bandwidth; what holds them there is not measured
// (experiments/results/h200_2026-12-03_session8). The columns' A operand (2 z_j split hi + lo), their -|z_j|^2 and
// their near thresholds stay in registers; each row tile is staged in shared memory as the MMAs' B fragments (z_i split
// hi + lo, one 16-byte load a lane and k-step) and -|z_i|^2, double-buffered: the next tile's raw points are loaded
// into registers before this tile's products and written to the other buffer after them. The accumulator holds (column
// g or g + 8, row 2t or 2t + 1) of each 16 x 8 tile, so each of a lane's four values is one 4-byte streaming store, and
// a warp's store covers 4 rows x 8 consecutive columns: whole 32-byte sectors where rows start 32-byte aligned.
//
// Points and accuracy as in matmul_tensor.cuh: z = (x - mu) sqrt(log2(e) / 2) / l with mu the columns' mean (one
// centre for rows and columns, so that equal points scale to equal bits); a pair whose expanded exponent is within
// 2 tau |z_j|^2 of zero is recomputed as -|z_i - z_j|^2 from the raw points behind a warp vote, which keeps
// distances non-negative and K(x, x) = s exact. An emulation of this arithmetic on the tests' draws (d = 9..32,
// centred and shifted by 10) put its error against float64 at 0.2-0.36 of the norm expansion's bound,
// max(2x plain float32, 1e-6); the float32 expansion's at 0.15-0.21.
#pragma once

#include "covariance_forward.cuh"
#include "device_common.cuh"
#include "mma.cuh"

namespace gpfast {
namespace cuda {

struct CovTcArgs {
  const float* x1;     // (B, n, d) raw points
  const float* x2;     // (B, m, d)
  const float* ls;     // (B, d)
  const float* scale;  // (B)
  const float* mu;     // (B, d): the centre, the mean of x2
  float* out;          // (B, n, m)
  int64_t n, m, rows_per_split;
  int d;
};

// KD = features / 8 rounded up (2..4); MT column tiles of 16 per warp; kWarps warps; kTile rows per staged tile.
template <int KD, int MT, int kWarps, int kTile>
__global__ void __launch_bounds__(kWarps * 32) cov_fwd_tc_kernel(const CovTcArgs a) {
  constexpr int D = 8 * KD, kThreads = kWarps * 32, kCols = kWarps * 16 * MT, kChunks = kTile / 8;
  // Staging: kTile rows by D features; lanes [LPC r, LPC r + LPC) own row r, features LPC i + (lane % LPC).
  // LPC = 4 so that a thread's features 4 i + t are the quad lane t's of every k-step (b0 for even i, b1 for odd).
  constexpr int LPC = 4, kStagers = kTile * LPC, XD = D / LPC;
  static_assert(kStagers <= kThreads, "one staging thread per row and quad lane");
  // B fragments [chunk][k-step][lane]: {b0 hi, b1 hi, b0 lo, b1 lo} with b0 = z[row 8 ch + g][8 ks + t] and b1 its
  // feature + 4; then -|z_i|^2 per row
  __shared__ uint4 s_frag[2][kChunks * KD * 32];
  __shared__ __align__(16) float s_nrm[2][kTile];
  __shared__ float s_mu[D], s_w[D];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, q = lane & 3;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kCols;
  const int64_t b = blockIdx.z;
  const int64_t i_begin = static_cast<int64_t>(blockIdx.y) * a.rows_per_split;
  const int64_t i_end = min(a.n, i_begin + a.rows_per_split);
  const int d = a.d;
  const float* x1 = a.x1 + b * a.n * d;
  const float* x2 = a.x2 + b * a.m * d;

  if (tid < D) {
    s_mu[tid] = tid < d ? a.mu[b * d + tid] : 0.0f;
    s_w[tid] = tid < d ? static_cast<float>(kSqrtHalfLog2e) / a.ls[b * d + tid] : 0.0f;
  }
  __syncthreads();

  // the staging thread's row and raw features of the next tile, in registers while this tile computes
  const int sr = tid / LPC, sl = tid % LPC;
  float px[XD];
  auto fetch = [&](int64_t it) {
    const int64_t i = it + sr;
    const bool in = tid < kStagers && i < i_end;
#pragma unroll
    for (int k = 0; k < XD; ++k) px[k] = (in && LPC * k + sl < d) ? x1[i * d + LPC * k + sl] : 0.0f;
  };
  auto stage = [&](int buf, int64_t it) {
    if (tid >= kStagers) return;
    const bool in = it + sr < i_end;
    uint32_t* frag = reinterpret_cast<uint32_t*>(s_frag[buf]);
    const int ch = sr >> 3, gr = sr & 7;
    float nrm = 0.0f;
#pragma unroll
    for (int k = 0; k < XD; ++k) {
      const int f = LPC * k + sl;
      const float z = (in && f < d) ? scale_point(px[k], s_mu[f], s_w[f]) : 0.0f;
      nrm = fmaf(z, z, nrm);
      uint32_t hi, lo;
      split_tf32(z, hi, lo);
      const int word = 4 * ((ch * KD + (k >> 1)) * 32 + 4 * gr + sl) + (k & 1);
      frag[word] = hi;
      frag[word + 2] = lo;
    }
    nrm += __shfl_xor_sync(kFull, nrm, 1);
    nrm += __shfl_xor_sync(kFull, nrm, 2);
    if (sl == 0) s_nrm[buf][sr] = -nrm;
  };

  // this lane's columns g and g + 8 of each of the warp's column tiles: A operand (2 z_j, split), -|z_j|^2 and the
  // near thresholds
  const int64_t wcol = col0 + warp * 16 * MT;
  uint32_t ah[MT][KD][4], al[MT][KD][4];
  float b2[MT][2], thr[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t j = wcol + 16 * mt + g + 8 * h;
      const float* xj = x2 + j * d;
      auto z = [&](int k) { return (j < a.m && k < d) ? scale_point(xj[k], s_mu[k], s_w[k]) : 0.0f; };
      float nrm = 0.0f;
#pragma unroll
      for (int k = 0; k < D; ++k) nrm = fmaf(z(k), z(k), nrm);
      b2[mt][h] = -nrm;
      thr[mt][h] = -nrm * (2 * kNearTau);
#pragma unroll
      for (int ks = 0; ks < KD; ++ks) {  // a0/a2 of column g, a1/a3 of column g + 8; doubling is exact
        split_tf32(2.0f * z(8 * ks + q), ah[mt][ks][h], al[mt][ks][h]);
        split_tf32(2.0f * z(8 * ks + q + 4), ah[mt][ks][2 + h], al[mt][ks][2 + h]);
      }
    }
  }

  const float s = a.scale[b];
  float* out = a.out + b * a.n * a.m;
  fetch(i_begin);
  stage(0, i_begin);
  int buf = 0;
  for (int64_t it = i_begin; it < i_end; it += kTile, buf ^= 1) {
    fetch(it + kTile);  // the next tile's raw points, in flight during this tile's products
    __syncthreads();    // tile it is staged in s_frag[buf]; every read of s_frag[buf ^ 1] (two tiles ago) is done
    const uint4* frag = s_frag[buf];
    const float* nr_s = s_nrm[buf];
#pragma unroll 2
    for (int ch = 0; ch < kChunks; ++ch) {
      const int r0 = 8 * ch + 2 * q;  // this lane's rows r0 and r0 + 1 of the tile
      const int64_t i = it + r0;
      if (it + 8 * ch >= i_end) break;  // block-uniform
      const float2 nr = *reinterpret_cast<const float2*>(&nr_s[r0]);
      uint4 zf[KD];
#pragma unroll
      for (int ks = 0; ks < KD; ++ks) zf[ks] = frag[(ch * KD + ks) * 32 + lane];
      // e[mt][0..3] for (column g, row r0), (g, r0 + 1), (g + 8, r0), (g + 8, r0 + 1): the accumulator layout
      float e[MT][4];
      bool near = false;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        float sb[4] = {0.0f, 0.0f, 0.0f, 0.0f}, ss[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int ks = 0; ks < KD; ++ks)
          mma_3xtf32_split(sb, ss, ah[mt][ks], al[mt][ks], zf[ks].x, zf[ks].y, zf[ks].z, zf[ks].w);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          e[mt][u] = ((sb[u] + ss[u]) + b2[mt][u >> 1]) + ((u & 1) ? nr.y : nr.x);  // the dot product first
          near |= e[mt][u] >= thr[mt][u >> 1];
        }
      }
      if (__any_sync(kFull, near)) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const int64_t j = wcol + 16 * mt + g + 8 * (u >> 1), ii = i + (u & 1);
            if (e[mt][u] >= thr[mt][u >> 1] && j < a.m && ii < i_end)
              e[mt][u] = tc_neg_sq_dist<D>(x1 + ii * d, x2 + j * d, s_mu, s_w, d);
          }
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int64_t j = wcol + 16 * mt + g + 8 * (u >> 1), ii = i + (u & 1);
          if (j < a.m && ii < i_end) __stcs(out + ii * a.m + j, kernel_value(e[mt][u], s));
        }
    }
    stage(buf ^ 1, it + kTile);  // the buffer last read two tiles ago: the barrier above ordered those reads
  }
}

}  // namespace cuda
}  // namespace gpfast
