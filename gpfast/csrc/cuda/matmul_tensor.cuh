// K @ V in float32 on tensor cores, never storing K: out (splits, B, n, t) partial products, as kv_fwd_kernel.
//
// A warp owns MT tiles of 16 rows; the block's warps share tiles of kKvTcTile columns staged in shared memory.
// Per 16 x 8 pairs (one MMA tile) and 8 columns at a time:
//   1. the exponent's cross term S = 2 Z_I Z_J^T as m16n8k8 TF32 MMAs over the features (k), 3xTF32 (below);
//      kTcCross = false computes it on the CUDA cores instead, as kv_fwd_kernel does (a variant for the sweep);
//   2. e = (S - |z_i|^2) - |z_j|^2 in log2 units, near pairs recomputed by differences (below), P = 2^e;
//   3. O += P V_J as m16n8k8 TF32 MMAs over the 8 columns (k), 3xTF32. P goes from the accumulator registers of
//      step 1 straight into the A operand: a thread holds columns 2t and 2t + 1 of rows g and g + 8, and the A
//      operand wants k = t and t + 4; since k runs over columns, which are summed, k = t is taken to be column 2t
//      and k = t + 4 column 2t + 1, and V's rows are staged in the same order (no shuffles).
// The point scaling, the block's centre (the mean of its own rows) and the near-duplicate recomputation are those
// of kv_fwd_kernel (covariance_forward.cuh): z = (x - mu) sqrt(log2(e) / 2) / l, so that K / s = 2^e, and a pair
// whose expanded exponent is within a fraction 2 tau of |z_i|^2 of zero has it recomputed as -|z_i - z_j|^2 from
// float32 copies of the points, which makes K(x, x) = s exactly.
//
// Why 3xTF32. TF32 keeps 11 bits of the significand, so each operand is split a = a_hi + a_lo (both TF32, rounded
// to nearest) and a b ~ a_hi b_hi + a_hi b_lo + a_lo b_hi, dropping a_lo b_lo (2^-22 relative at most): each
// product is then about as accurate as float32's own rounding. On CUDA cores the work is about d + t + 4 FMAs a
// pair (28 at d = 8, t = 16: 1.1 s at the H200's float32 peak for n = m = 10^6); here the CUDA cores keep about
// eight operations a pair (the biases, the near test, the split of P) beside one exponential, and the tensor cores
// take 3 (d / 8 + t / 8) MMAs per 128 pairs.
//
// Why the sums are folded. The tensor cores accumulate in float32 with truncation, so a long chain of MMAs into one
// accumulator drifts; each tile of kKvTcTile columns is summed in fresh accumulators (`big` for hi x hi, `small`
// for the two cross products) and folded into the row's total by ordinary float32 additions, as kv_fwd_kernel folds
// its per-tile sums (fold per chunk of 8 columns instead with kFoldChunk, a variant for the sweep).
#pragma once

#include "covariance_forward.cuh"
#include "device_common.cuh"
#include "matmul_forward.cuh"
#include "mma.cuh"

namespace gpfast {
namespace cuda {

constexpr int kKvTcTile = 32;  // columns staged per tile (4 chunks of 8)

// KD = features / 8 (rounded up), NT = right-hand sides / 8 (rounded up, at most 4: one chunk of t <= 32).
template <int KD, int NT, int MT, int kWarps, bool kTcCross, bool kFoldChunk>
__global__ void __launch_bounds__(kWarps * 32) kv_tc_kernel(const KvFwdArgs<float> a) {
  constexpr int D = 8 * KD, kThreads = kWarps * 32, kRows = kWarps * 16 * MT, kChunks = kKvTcTile / 8;
  constexpr int kP = D + 4;  // float pitch of the points' copies: 16-byte rows for the CUDA-core variant
  static_assert(kTcCross || KD == 1, "the CUDA-core cross term is a variant for d <= 8 (points in registers)");
  __shared__ __align__(16) float s_zr[kRows][kP];  // rows' scaled points
  __shared__ float s_nr[kRows];                    // -|z_i|^2
  __shared__ __align__(16) float s_zc[kKvTcTile][kP];
  __shared__ __align__(16) float s_nc[kKvTcTile];  // -|z_j|^2
  // B operands, one 16-byte fragment per lane {b0 hi, b1 hi, b0 lo, b1 lo}, lane-major (conflict-free loads):
  // the cross term's Z_J (chunk, k-step) and V's rows (chunk, n-tile) in the column order described above
  __shared__ uint4 s_zf[kTcCross ? kChunks : 1][KD][32];
  __shared__ uint4 s_vf[kChunks][NT][32];
  __shared__ float s_mu[D], s_w[D];
  __shared__ float s_scratch[kWarps * D];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, q = lane & 3;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int split = blockIdx.y;
  const int64_t b = blockIdx.z;  // t <= 32: one chunk of right-hand sides
  const int64_t j_begin = split * a.cols_per_split;
  const int64_t j_end = min(a.m, j_begin + a.cols_per_split);
  const int d = a.d, tt = a.t;
  const float* x1 = a.x1 + b * a.n * d;
  const float* x2 = a.x2 + b * a.m * d;
  const float* v = a.v + b * a.m * tt;

  // the block's rows, raw, and its centre: the mean of its rows
  {
    float part[D];
#pragma unroll
    for (int k = 0; k < D; ++k) part[k] = 0.0f;
    for (int r = tid; r < kRows; r += kThreads) {
      const int64_t i = row0 + r;
#pragma unroll
      for (int k = 0; k < D; ++k) {
        const float xv = (i < a.n && k < d) ? x1[i * d + k] : 0.0f;
        s_zr[r][k] = xv;
        part[k] += xv;
      }
    }
    block_sum(part, s_scratch, s_mu);
    if (tid < D) {
      const float count = static_cast<float>(min(a.n - row0, static_cast<int64_t>(kRows)));
      s_mu[tid] = tid < d ? s_mu[tid] / count : 0.0f;
      s_w[tid] = tid < d ? static_cast<float>(kSqrtHalfLog2e) / a.ls[b * d + tid] : 0.0f;
    }
    __syncthreads();
    for (int r = tid; r < kRows; r += kThreads) {
      const int64_t i = row0 + r;
      float nrm = 0.0f;
#pragma unroll
      for (int k = 0; k < D; ++k) {
        const float y = (i < a.n && k < d) ? scale_point(s_zr[r][k], s_mu[k], s_w[k]) : 0.0f;
        nrm = fmaf(y, y, nrm);
        s_zr[r][k] = y;
      }
      s_nr[r] = -nrm;
    }
    __syncthreads();
  }

  // this lane's rows g and g + 8 of each of the warp's row tiles: the cross term's A operand (2 Z_I, split), or the
  // doubled points themselves for the CUDA-core variant; biases and near thresholds
  const int wrow = warp * 16 * MT;
  uint32_t ah[MT][KD][4], al[MT][KD][4];
  float zr2[kTcCross ? 1 : MT][2][kTcCross ? 1 : D];
  float b1[MT][2], thr[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int r0 = wrow + 16 * mt + g, r1 = r0 + 8;
    if constexpr (kTcCross) {
#pragma unroll
      for (int ks = 0; ks < KD; ++ks) {
        const int k0 = 8 * ks + q;
        split_tf32(2.0f * s_zr[r0][k0], ah[mt][ks][0], al[mt][ks][0]);  // doubling is exact
        split_tf32(2.0f * s_zr[r1][k0], ah[mt][ks][1], al[mt][ks][1]);
        split_tf32(2.0f * s_zr[r0][k0 + 4], ah[mt][ks][2], al[mt][ks][2]);
        split_tf32(2.0f * s_zr[r1][k0 + 4], ah[mt][ks][3], al[mt][ks][3]);
      }
    } else {
#pragma unroll
      for (int k = 0; k < D; ++k) {
        zr2[mt][0][k] = 2.0f * s_zr[r0][k];
        zr2[mt][1][k] = 2.0f * s_zr[r1][k];
      }
    }
    b1[mt][0] = s_nr[r0];
    b1[mt][1] = s_nr[r1];
    thr[mt][0] = b1[mt][0] * (2 * kNearTau);
    thr[mt][1] = b1[mt][1] * (2 * kNearTau);
  }

  float acc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.0f;

  for (int64_t jt = j_begin; jt < j_end; jt += kKvTcTile) {
    const int cols = static_cast<int>(min(static_cast<int64_t>(kKvTcTile), j_end - jt));
    __syncthreads();  // the previous tile's reads are done
    for (int c = tid; c < kKvTcTile; c += kThreads) {
      float nrm = 0.0f;
#pragma unroll
      for (int k = 0; k < D; ++k) {
        const float y = (c < cols && k < d) ? scale_point(x2[(jt + c) * d + k], s_mu[k], s_w[k]) : 0.0f;
        nrm = fmaf(y, y, nrm);
        s_zc[c][k] = y;
      }
      s_nc[c] = -nrm;
    }
    if constexpr (kTcCross) {  // Z_J's fragments, from the same scaling (bit for bit the values in s_zc)
      for (int e = tid; e < kChunks * KD * 32; e += kThreads) {
        const int ln = e & 31, ks = (e >> 5) % KD, ch = (e >> 5) / KD;
        const int c = 8 * ch + (ln >> 2), k0 = 8 * ks + (ln & 3), k1 = k0 + 4;
        const float y0 = (c < cols && k0 < d) ? scale_point(x2[(jt + c) * d + k0], s_mu[k0], s_w[k0]) : 0.0f;
        const float y1 = (c < cols && k1 < d) ? scale_point(x2[(jt + c) * d + k1], s_mu[k1], s_w[k1]) : 0.0f;
        uint4 f;
        split_tf32(y0, f.x, f.z);
        split_tf32(y1, f.y, f.w);
        s_zf[ch][ks][ln] = f;
      }
    }
    for (int e = tid; e < kChunks * NT * 32; e += kThreads) {
      const int ln = e & 31, nt = (e >> 5) % NT, ch = (e >> 5) / NT;
      const int c0 = 8 * ch + 2 * (ln & 3), rhs = 8 * nt + (ln >> 2);
      const float v0 = (c0 < cols && rhs < tt) ? v[(jt + c0) * tt + rhs] : 0.0f;
      const float v1 = (c0 + 1 < cols && rhs < tt) ? v[(jt + c0 + 1) * tt + rhs] : 0.0f;
      uint4 f;
      split_tf32(v0, f.x, f.z);
      split_tf32(v1, f.y, f.w);
      s_vf[ch][nt][ln] = f;
    }
    __syncthreads();

    float big[MT][NT][4], small[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) big[mt][nt][e] = small[mt][nt][e] = 0.0f;

#pragma unroll
    for (int ch = 0; ch < kChunks; ++ch) {
      const int c0 = 8 * ch + 2 * q;  // this lane's columns c0 and c0 + 1 of the chunk
      const float2 nc = *reinterpret_cast<const float2*>(&s_nc[c0]);
      uint4 vf[NT];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) vf[nt] = s_vf[ch][nt][lane];
      uint4 zf[KD];
      if constexpr (kTcCross) {
#pragma unroll
        for (int ks = 0; ks < KD; ++ks) zf[ks] = s_zf[ch][ks][lane];
      }
      float zc[2][kTcCross ? 1 : D];
      if constexpr (!kTcCross) {
        load_row<float, D>(&s_zc[c0][0], zc[0]);
        load_row<float, D>(&s_zc[c0 + 1][0], zc[1]);
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        // e[0..3] for (g, c0), (g, c0 + 1), (g + 8, c0), (g + 8, c0 + 1): the accumulator layout
        float e[4];
        if constexpr (kTcCross) {
          float sb[4] = {0.0f, 0.0f, 0.0f, 0.0f}, ss[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
          for (int ks = 0; ks < KD; ++ks) mma_3xtf32_split(sb, ss, ah[mt][ks], al[mt][ks], zf[ks].x, zf[ks].y,
                                                           zf[ks].z, zf[ks].w);
#pragma unroll
          for (int u = 0; u < 4; ++u) e[u] = sb[u] + ss[u];
        } else {
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const float(&zi)[D] = zr2[mt][u >> 1];
            const float(&zj)[D] = zc[u & 1];
            float s = zi[0] * zj[0];
#pragma unroll
            for (int k = 1; k < D; ++k) s = fmaf(zi[k], zj[k], s);
            e[u] = s;
          }
        }
        bool near = false;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          e[u] = (e[u] + b1[mt][u >> 1]) + ((u & 1) ? nc.y : nc.x);  // the dot product first, then the biases
          near |= e[u] >= thr[mt][u >> 1];
        }
        if (__any_sync(kFull, near)) {
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            if (e[u] >= thr[mt][u >> 1]) {
              const float* zi = s_zr[wrow + 16 * mt + g + 8 * (u >> 1)];
              const float* zj = s_zc[c0 + (u & 1)];
              float s = 0.0f;
#pragma unroll
              for (int k = 0; k < D; ++k) {
                const float dk = zi[k] - zj[k];
                s = fmaf(dk, dk, s);
              }
              e[u] = -s;
            }
          }
        }
        uint32_t ph[4], pl[4];  // A operand: k = t is column c0, k = t + 4 column c0 + 1
        split_tf32(exp2_fast(e[0]), ph[0], pl[0]);
        split_tf32(exp2_fast(e[2]), ph[1], pl[1]);
        split_tf32(exp2_fast(e[1]), ph[2], pl[2]);
        split_tf32(exp2_fast(e[3]), ph[3], pl[3]);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          mma_3xtf32_split(big[mt][nt], small[mt][nt], ph, pl, vf[nt].x, vf[nt].y, vf[nt].z, vf[nt].w);
      }
      if constexpr (kFoldChunk) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int u = 0; u < 4; ++u) {
              acc[mt][nt][u] += big[mt][nt][u] + small[mt][nt][u];
              big[mt][nt][u] = small[mt][nt][u] = 0.0f;
            }
      }
    }
    if constexpr (!kFoldChunk) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int u = 0; u < 4; ++u) acc[mt][nt][u] += big[mt][nt][u] + small[mt][nt][u];
    }
  }

  // accumulator layout: (row g, rhs 8 nt + 2t), (g, 8 nt + 2t + 1), (g + 8, ...)
  const float s = a.scale[b];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t i = row0 + wrow + 16 * mt + g + 8 * h;
      if (i >= a.n) continue;
      float* dst = a.out + ((static_cast<int64_t>(split) * a.batch + b) * a.n + i) * tt;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int c = 8 * nt + 2 * q;
        if (c < tt) dst[c] = s * acc[mt][nt][2 * h];
        if (c + 1 < tt) dst[c + 1] = s * acc[mt][nt][2 * h + 1];
      }
    }
  }
}

}  // namespace cuda
}  // namespace gpfast
