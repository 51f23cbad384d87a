// Covariance, forward, float32, d <= 32, on tensor cores: K (B, n, m) = s * 2^(-|y1 - y2|^2) with the cross term
// 2 y1 . y2 by mma.sync m16n8k8 TF32, split 3xTF32 as in matmul_tc.cuh (about float32's 24 bits).
//
// Each block owns a strip of kCovTcStrip columns: their scaled points are staged once in shared memory as split B
// fragments, with their biases -|y2|^2; the block's centre mu is the mean of the strip's points (as in
// covariance_forward.cuh). Its warps then walk down a range of rows, 16 at a time: a lane loads the 4 KD features of
// rows g and g + 8 that its A fragments need (the quad's four lanes hold every feature of the two rows, so the
// rows' norms are quad sums), and for each 8-column tile of the strip forms e = (S - |y1|^2) - |y2|^2, recomputes
// near duplicates by differences (K(x, x) = s exactly; non-negative distances) and stores s 2^e, two columns per
// lane and row. The next row tile's features are loaded while this one computes.
#pragma once

#include <cstdint>

#include "covariance_forward.cuh"
#include "device_common.cuh"
#include "matmul_tc.cuh"

namespace gpfast {
namespace cuda {

constexpr int kCovTcWarps = 4, kCovTcThreads = 32 * kCovTcWarps, kCovTcStrip = 128;

struct CovTcArgs {
  const float* x1;     // (B, n, d) raw points
  const float* x2;     // (B, m, d)
  const float* ls;     // (B, d)
  const float* scale;  // (B)
  float* out;          // (B, n, m)
  int64_t n, m;
  int d;
  int64_t rows_per_block;  // a multiple of 16
  bool vec_store;          // m even and out 8-byte aligned: one 8-byte store per lane, row and tile
};

template <int KD>
__global__ void __launch_bounds__(kCovTcThreads) cov_tc_kernel(const CovTcArgs a) {
  constexpr int D = 8 * KD, kTiles = kCovTcStrip / 8;
  __shared__ __align__(8) uint32_t s_bh[kTiles][KD][32][2];
  __shared__ __align__(8) uint32_t s_bl[kTiles][KD][32][2];
  __shared__ __align__(8) float s_b2[kCovTcStrip];
  __shared__ float s_mu[D], s_w[D];
  __shared__ float s_scratch[kCovTcWarps * D];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
  const int64_t b = blockIdx.z;
  const int64_t strip0 = static_cast<int64_t>(blockIdx.x) * kCovTcStrip;
  const int64_t i_begin = static_cast<int64_t>(blockIdx.y) * a.rows_per_block;
  const int64_t i_end = min(a.n, i_begin + a.rows_per_block);
  const int d = a.d;
  const float* x1 = a.x1 + b * a.n * d;
  const float* x2 = a.x2 + b * a.m * d;
  const float* ls = a.ls + b * d;

  // the strip's columns: thread tid owns column strip0 + tid (kCovTcThreads == kCovTcStrip)
  static_assert(kCovTcThreads == kCovTcStrip, "one thread per column of the strip");
  const int64_t j = strip0 + tid;
  float y2[D];
#pragma unroll
  for (int k = 0; k < D; ++k) y2[k] = (j < a.m && k < d) ? x2[j * d + k] : 0.0f;
  block_sum(y2, s_scratch, s_mu);  // ends with a barrier
  if (tid < D) {
    const float count = static_cast<float>(min(a.m - strip0, static_cast<int64_t>(kCovTcStrip)));
    s_mu[tid] = tid < d ? s_mu[tid] / count : 0.0f;
    s_w[tid] = tid < d ? static_cast<float>(kSqrtHalfLog2e) / ls[tid] : 0.0f;
  }
  __syncthreads();
  {
    float nrm = 0.0f;
    const int tile = tid >> 3, col = tid & 7;
#pragma unroll
    for (int k = 0; k < D; ++k) {
      const float y = (j < a.m && k < d) ? scale_point(y2[k], s_mu[k], s_w[k]) : 0.0f;
      nrm = fmaf(y, y, nrm);
      uint32_t hi, lo;
      split_tf32(y, hi, lo);
      const int kk = k & 7;  // B fragment: b.x = y2[column g][feature q], b.y = feature q + 4
      s_bh[tile][k >> 3][col * 4 + (kk & 3)][kk >> 2] = hi;
      s_bl[tile][k >> 3][col * 4 + (kk & 3)][kk >> 2] = lo;
    }
    s_b2[tid] = -nrm;
  }
  __syncthreads();

  // a row tile's raw features for this lane: [row half h][k-step][w] = x1[row g + 8 h][8 ks + 4 w + q]
  float raw[2][KD][2];
  auto fetch = [&](int64_t i16) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t i = i16 + g + 8 * h;
#pragma unroll
      for (int ks = 0; ks < KD; ++ks)
#pragma unroll
        for (int w = 0; w < 2; ++w) {
          const int k = 8 * ks + 4 * w + q;
          raw[h][ks][w] = (i < i_end && k < d) ? x1[i * d + k] : 0.0f;
        }
    }
  };

  const float s = a.scale[b];
  float* out = a.out + b * a.n * a.m;
  constexpr int64_t kStep = 16 * kCovTcWarps;
  fetch(i_begin + warp * 16);
  for (int64_t i16 = i_begin + warp * 16; i16 < i_end; i16 += kStep) {
    uint32_t ah[KD][4], al[KD][4];
    float b1[2], thr[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float part = 0.0f;
#pragma unroll
      for (int ks = 0; ks < KD; ++ks)
#pragma unroll
        for (int w = 0; w < 2; ++w) {
          const int k = 8 * ks + 4 * w + q;
          const float y = k < d ? scale_point(raw[h][ks][w], s_mu[k], s_w[k]) : 0.0f;
          part = fmaf(y, y, part);
          split_tf32(2.0f * y, ah[ks][h + 2 * w], al[ks][h + 2 * w]);  // doubling is exact
        }
      // the quad's four lanes hold the row's features: its norm is their sum
      part += __shfl_xor_sync(kFull, part, 1);
      part += __shfl_xor_sync(kFull, part, 2);
      b1[h] = -part;
      thr[h] = -part * (2.0f * kNearTau);
    }
    fetch(i16 + kStep);

    // warp-uniform trip count (i16 is), so every lane takes part in the vote below
#pragma unroll 2
    for (int nt = 0; nt < kTiles; ++nt) {
      float s4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int ks = 0; ks < KD; ++ks) {
        const uint2 bh = *reinterpret_cast<const uint2*>(&s_bh[nt][ks][lane][0]);
        const uint2 bl = *reinterpret_cast<const uint2*>(&s_bl[nt][ks][lane][0]);
        mma_tf32(s4, al[ks], bh);
        mma_tf32(s4, ah[ks], bl);
      }
#pragma unroll
      for (int ks = 0; ks < KD; ++ks) mma_tf32(s4, ah[ks], *reinterpret_cast<const uint2*>(&s_bh[nt][ks][lane][0]));
      const float2 b2 = *reinterpret_cast<const float2*>(&s_b2[nt * 8 + 2 * q]);
      float e[4];
      bool near = false;
#pragma unroll
      for (int c = 0; c < 4; ++c) {  // s4[2 h + w]: row g + 8 h, column 2 q + w of the tile
        e[c] = (s4[c] + b1[c >> 1]) + (c & 1 ? b2.y : b2.x);
        near |= e[c] >= thr[c >> 1];
      }
      const int64_t j0 = strip0 + nt * 8 + 2 * q;
      if (__any_sync(kFull, near)) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int64_t i = i16 + g + 8 * (c >> 1), jc = j0 + (c & 1);
          if (e[c] >= thr[c >> 1] && i < i_end && jc < a.m) {
            float acc = 0.0f;
            for (int k = 0; k < d; ++k) {
              const float y1 = scale_point(x1[i * d + k], s_mu[k], s_w[k]);
              const float diff = y1 - scale_point(x2[jc * d + k], s_mu[k], s_w[k]);
              acc = fmaf(-diff, diff, acc);
            }
            e[c] = acc;
          }
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t i = i16 + g + 8 * h;
        if (i >= i_end) continue;
        float kv[2] = {kernel_value(e[2 * h], s), kernel_value(e[2 * h + 1], s)};
        float* row = out + i * a.m + j0;
        if (a.vec_store && j0 + 2 <= a.m) {
          store_streaming<float, 2>(row, kv);
        } else {
          if (j0 < a.m) __stcs(row, kv[0]);
          if (j0 + 1 < a.m) __stcs(row + 1, kv[1]);
        }
      }
    }
  }
}

}  // namespace cuda
}  // namespace gpfast
