// Covariance, forward, in float32 on tensor cores: K (B, n, m) = s * 2^e with the exponent's cross term on the
// TF32 tensor cores (3xTF32), for 8 < d <= 32.
//
// Why. With the norm expansion e = 2 z_i.z_j - |z_i|^2 - |z_j|^2 the work per pair is d FMAs for the cross term
// and a handful of operations beside one exponential and one store. On CUDA cores that is the limit at d = 32:
// the row-streaming kernel took 1.21 ms for (4, 8192, 8192, 32) on the H200, against 0.25 ms to write K at the copy
// bandwidth. Here the cross term of a 16 x 8 tile is 3 KD m16n8k8 MMAs (KD = d / 8 rounded up, 3xTF32 as in
// mma.cuh: each product within a few times 2^-22 of its value), which leaves the CUDA cores the biases, the near
// test, the exponential and the store, the same per pair at any d.
//
// A block owns kRows = 16 MT kWarps rows (each warp MT tiles of 16) and walks a range of column tiles of kTile
// columns. The rows' A operand (2 z_i split hi + lo), their -|z_i|^2 and their near thresholds stay in registers;
// each column tile is staged in shared memory as the MMAs' B fragments (z_j split hi + lo, one 16-byte load a
// lane and k-step) and -|z_j|^2, double-buffered: the next tile's raw points are loaded into registers before this
// tile's products and written to the other buffer after them. Every lane then writes, per chunk of 8 columns, the
// two columns it holds of rows g and g + 8 (the accumulator layout) with one 8-byte streaming store each: a warp's
// store covers 8 rows x 32 bytes, whole sectors.
//
// Points and accuracy as in matmul_tensor.cuh: z = (x - mu) sqrt(log2(e) / 2) / l with mu the columns' mean (one
// centre for rows and columns, so that equal points scale to equal bits); a pair whose expanded exponent is within
// 2 tau |z_i|^2 of zero is recomputed as -|z_i - z_j|^2 from the raw points behind a warp vote, which keeps
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
  int64_t n, m, cols_per_split;
  int d;
  bool vec_store;  // rows of K start 8-byte aligned: one float2 store per lane, row and chunk
};

// KD = features / 8 rounded up (2..4); MT row tiles of 16 per warp; kWarps warps; kTile columns per staged tile.
template <int KD, int MT, int kWarps, int kTile>
__global__ void __launch_bounds__(kWarps * 32) cov_fwd_tc_kernel(const CovTcArgs a) {
  constexpr int D = 8 * KD, kThreads = kWarps * 32, kRows = kWarps * 16 * MT, kChunks = kTile / 8;
  // Staging: kTile columns by D features; lanes [LPC c, LPC c + LPC) own column c, features LPC i + (lane % LPC).
  // LPC = 4 so that a thread's features 4 i + t are the quad lane t's of every k-step (b0 for even i, b1 for odd).
  constexpr int LPC = 4, kStagers = kTile * LPC, XD = D / LPC;
  static_assert(kStagers <= kThreads, "one staging thread per column and quad lane");
  // B fragments [chunk][k-step][lane]: {b0 hi, b1 hi, b0 lo, b1 lo} with b0 = z[col 8 ch + g][8 ks + t] and b1 its
  // feature + 4; then -|z_j|^2 per column
  __shared__ uint4 s_frag[2][kChunks * KD * 32];
  __shared__ __align__(16) float s_nrm[2][kTile];
  __shared__ float s_mu[D], s_w[D];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, q = lane & 3;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int64_t b = blockIdx.z;
  const int64_t j_begin = static_cast<int64_t>(blockIdx.y) * a.cols_per_split;
  const int64_t j_end = min(a.m, j_begin + a.cols_per_split);
  const int d = a.d;
  const float* x1 = a.x1 + b * a.n * d;
  const float* x2 = a.x2 + b * a.m * d;

  if (tid < D) {
    s_mu[tid] = tid < d ? a.mu[b * d + tid] : 0.0f;
    s_w[tid] = tid < d ? static_cast<float>(kSqrtHalfLog2e) / a.ls[b * d + tid] : 0.0f;
  }
  __syncthreads();

  // the staging thread's column and raw features of the next tile, in registers while this tile computes
  const int sc = tid / LPC, sl = tid % LPC;
  float px[XD];
  auto fetch = [&](int64_t jt) {
    const int64_t j = jt + sc;
    const bool in = tid < kStagers && j < j_end;
#pragma unroll
    for (int i = 0; i < XD; ++i) px[i] = (in && LPC * i + sl < d) ? x2[j * d + LPC * i + sl] : 0.0f;
  };
  auto stage = [&](int buf, int64_t jt) {
    if (tid >= kStagers) return;
    const bool in = jt + sc < j_end;
    uint32_t* frag = reinterpret_cast<uint32_t*>(s_frag[buf]);
    const int ch = sc >> 3, gc = sc & 7;
    float nrm = 0.0f;
#pragma unroll
    for (int i = 0; i < XD; ++i) {
      const int k = LPC * i + sl;
      const float z = (in && k < d) ? scale_point(px[i], s_mu[k], s_w[k]) : 0.0f;
      nrm = fmaf(z, z, nrm);
      uint32_t hi, lo;
      split_tf32(z, hi, lo);
      const int word = 4 * ((ch * KD + (i >> 1)) * 32 + 4 * gc + sl) + (i & 1);
      frag[word] = hi;
      frag[word + 2] = lo;
    }
    nrm += __shfl_xor_sync(kFull, nrm, 1);
    nrm += __shfl_xor_sync(kFull, nrm, 2);
    if (sl == 0) s_nrm[buf][sc] = -nrm;
  };

  // this lane's rows g and g + 8 of each of the warp's row tiles: A operand (2 z_i, split), -|z_i|^2, thresholds
  const int64_t wrow = row0 + warp * 16 * MT;
  uint32_t ah[MT][KD][4], al[MT][KD][4];
  float b1[MT][2], thr[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t i = wrow + 16 * mt + g + 8 * h;
      const float* xi = x1 + i * d;
      auto z = [&](int k) { return (i < a.n && k < d) ? scale_point(xi[k], s_mu[k], s_w[k]) : 0.0f; };
      float nrm = 0.0f;
#pragma unroll
      for (int k = 0; k < D; ++k) nrm = fmaf(z(k), z(k), nrm);
      b1[mt][h] = -nrm;
      thr[mt][h] = -nrm * (2 * kNearTau);
#pragma unroll
      for (int ks = 0; ks < KD; ++ks) {  // a0/a2 of row g, a1/a3 of row g + 8; doubling is exact
        split_tf32(2.0f * z(8 * ks + q), ah[mt][ks][h], al[mt][ks][h]);
        split_tf32(2.0f * z(8 * ks + q + 4), ah[mt][ks][2 + h], al[mt][ks][2 + h]);
      }
    }
  }

  const float s = a.scale[b];
  float* out = a.out + b * a.n * a.m;
  fetch(j_begin);
  stage(0, j_begin);
  int buf = 0;
  for (int64_t jt = j_begin; jt < j_end; jt += kTile, buf ^= 1) {
    fetch(jt + kTile);  // the next tile's raw points, in flight during this tile's products
    __syncthreads();    // tile jt is staged in s_frag[buf]; every read of s_frag[buf ^ 1] (two tiles ago) is done
    const uint4* frag = s_frag[buf];
    const float* nc_s = s_nrm[buf];
#pragma unroll 2
    for (int ch = 0; ch < kChunks; ++ch) {
      const int c0 = 8 * ch + 2 * q;  // this lane's columns c0 and c0 + 1 of the tile
      const int64_t j = jt + c0;
      if (jt + 8 * ch >= j_end) break;  // block-uniform
      const float2 nc = *reinterpret_cast<const float2*>(&nc_s[c0]);
      uint4 zf[KD];
#pragma unroll
      for (int ks = 0; ks < KD; ++ks) zf[ks] = frag[(ch * KD + ks) * 32 + lane];
      // e[mt][0..3] for (g, c0), (g, c0 + 1), (g + 8, c0), (g + 8, c0 + 1): the accumulator layout
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
          e[mt][u] = ((sb[u] + ss[u]) + b1[mt][u >> 1]) + ((u & 1) ? nc.y : nc.x);  // the dot product first
          near |= e[mt][u] >= thr[mt][u >> 1];
        }
      }
      if (__any_sync(kFull, near)) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const int64_t i = wrow + 16 * mt + g + 8 * (u >> 1), jj = j + (u & 1);
            if (e[mt][u] >= thr[mt][u >> 1] && i < a.n && jj < j_end)
              e[mt][u] = tc_neg_sq_dist<D>(x1 + i * d, x2 + jj * d, s_mu, s_w, d);
          }
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int64_t i = wrow + 16 * mt + g + 8 * h;
          if (i >= a.n) continue;
          const float v0 = kernel_value(e[mt][2 * h], s), v1 = kernel_value(e[mt][2 * h + 1], s);
          float* dst = out + i * a.m + j;
          if (a.vec_store && j + 1 < j_end) {
            __stcs(reinterpret_cast<float2*>(dst), make_float2(v0, v1));
          } else {
            if (j < j_end) __stcs(dst, v0);
            if (j + 1 < j_end) __stcs(dst + 1, v1);
          }
        }
    }
    stage(buf ^ 1, jt + kTile);  // the buffer last read two tiles ago: the barrier above ordered those reads
  }
}

}  // namespace cuda
}  // namespace gpfast
