// K @ V, forward, float32, on tensor cores (mma.sync m16n8k8 TF32), never storing K. Same arguments and output
// as kv_fwd_kernel (matmul_forward.cuh): out (splits, B, n, t) partial products, summed on the host.
//
// Per warp: 16 MT rows of y1 = (x1 - mu) w, held as MMA A fragments for the whole launch. Per tile of kTcCols
// columns staged in shared memory (already split and laid out in fragment order, so each lane reads its operands
// with 8-byte loads), and per 8 columns of it:
//   1. S = 2 y1 . y2 on tensor cores, a 16 x 8 tile per MMA; e = (S - |y1|^2) - |y2|^2 in registers. TF32 keeps
//      11 significant bits, so every operand is split as hi + lo (both TF32) and S = lo.hi + hi.lo + hi.hi,
//      the small products first (3xTF32): about float32's 24 bits, as the CUDA-core norm expansion.
//   2. Near duplicates (e >= -2 tau |y1|^2, among them every pair with e >= 0) recomputed by differences in
//      float32 behind a warp-uniform branch, as in covariance_forward.cuh: distances stay non-negative and
//      K(x, x) = s exactly.
//   3. P = 2^e by MUFU.EX2, or for kPoly of each lane's four values by a polynomial on the FMA units (the MUFU unit
//      issues 16 exponentials per clock and SM; a share moved to the FMA pipes shortens its queue).
//   4. tile += P @ V on tensor cores, with P never leaving registers: the accumulator layout of step 1 (lane holds
//      rows g, g+8 and columns 2q, 2q+1) is read as the A fragment of step 4 (rows g, g+8, k = q, q+4) by
//      permuting the summation index (k = q <-> column 2q, k = q + 4 <-> column 2q + 1), and V's rows are staged
//      in the same permuted order. P and V are split as in step 1.
// The tile's sum is folded into the running sum once per kTcCols columns: two-level sums, as kv_fwd_kernel, so
// that m = 10^6 columns do not lose log2(m / 64) bits in one running float32 sum.
// kSplit = false drops the lo terms (one MMA instead of three): about 11 bits, far outside the accuracy rule; it
// exists only to measure what the split costs.
#pragma once

#include <cstdint>

#include "covariance_forward.cuh"
#include "device_common.cuh"
#include "matmul_forward.cuh"

namespace gpfast {
namespace cuda {

constexpr int kTcWarps = 4, kTcThreads = 32 * kTcWarps, kTcCols = 64;

// x rounded to TF32 (10 stored mantissa bits, round to nearest), returned as the bits the MMA reads.
__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

// x = hi + lo with hi its TF32 rounding; lo = x - hi is exact in float32 (at most 13 significant bits) and its own
// rounding to TF32 costs about 2^-22 |x|.
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = to_tf32(x);
  lo = to_tf32(__fsub_rn(x, __uint_as_float(hi)));
}

// c += a b for a 16 x 8 (row-major) by 8 x 8 (column-major) TF32 product, float32 accumulation.
__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], uint2 b) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y));
}

// c += P V for one 8 x 8 block of V: lo.hi + hi.lo + hi.hi (the small products first), or hi.hi alone.
template <bool kSplit>
__device__ __forceinline__ void pv_products(float (&c)[4], const uint32_t (&ph)[4], const uint32_t (&pl)[4],
                                            uint2 vh, uint2 vl) {
  if constexpr (kSplit) {
    mma_tf32(c, pl, vh);
    mma_tf32(c, ph, vl);
  }
  mma_tf32(c, ph, vh);
}

// 2^e for e <= 0 on the FMA units: e = n + r with n = round(e), r in [-1/2, 1/2], 2^r by its Taylor series of
// degree 7 (truncation 5e-9 relative, under float32's rounding), 2^n added to the exponent bits. Results below
// 2^-125 come out as 2^-125-ish instead of 0 or a subnormal: no pair's contribution that small is visible in a sum
// whose terms are at most 1.
__device__ __forceinline__ float exp2_poly(float e) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  e = fmaxf(e, -125.0f);
  const float shifted = __fadd_rn(e, kRound);
  const float r = __fsub_rn(e, __fsub_rn(shifted, kRound));
  float p = 1.5252733804059840e-05f;
  p = fmaf(p, r, 1.5403530393381606e-04f);
  p = fmaf(p, r, 1.3333558146428443e-03f);
  p = fmaf(p, r, 9.6181291076284772e-03f);
  p = fmaf(p, r, 5.5504108664821580e-02f);
  p = fmaf(p, r, 2.4022650695910071e-01f);
  p = fmaf(p, r, 6.9314718055994531e-01f);
  p = fmaf(p, r, 1.0f);
  const int n = __float_as_int(shifted) - 0x4B400000;
  return __int_as_float(__float_as_int(p) + (n << 23));
}

// 16-row tiles per warp by default: 4 while the fragments fit in registers without spilling (ptxas: about 210 at
// KD = 1, NT = 2), 2 beyond.
template <int KD, int NT>
constexpr int tc_rows_tiles() {
  return KD + NT <= 3 ? 4 : 2;
}

// KD: features in steps of 8 (d <= 8 KD); NT: right-hand-side columns in steps of 8 (this chunk's t <= 8 NT);
// MT: 16-row MMA tiles per warp; kSplit: 3xTF32 (see above); kPoly: exponentials (of 4 per lane and tile) taken by
// exp2_poly; kFlush: each 8 columns' products summed by the tensor core from zero and added to the tile's sum by a
// float32 addition, instead of chaining the tile's 24 MMAs on one accumulator (the tensor core's float32
// accumulation is not round-to-nearest; a chain of 24 of its roundings, each toward zero, may bias the sum by a
// few units of 2^-24; the flush costs 4 NT MT additions per 8 columns).
template <int KD, int NT, int MT, bool kSplit, int kPoly, bool kFlush = false>
__global__ void __launch_bounds__(kTcThreads) kv_tc_kernel(const KvFwdArgs<float> a) {
  constexpr int D = 8 * KD, kRows = 16 * MT * kTcWarps, kGroups = kTcCols / 8;
  constexpr int kPitch = D + 1;  // odd: the rare recompute reads columns of s_y2 without bank conflicts
  __shared__ float s_y2[kTcCols][kPitch];
  __shared__ __align__(8) float s_b2[kTcCols];
  // fragment-ordered operands: [group of 8 columns][k-step or n-tile][lane][2]
  __shared__ __align__(8) uint32_t s_bh[kGroups][KD][32][2];
  __shared__ __align__(8) uint32_t s_bl[kGroups][KD][32][2];
  __shared__ __align__(8) uint32_t s_vh[kGroups][NT][32][2];
  __shared__ __align__(8) uint32_t s_vl[kGroups][NT][32][2];
  __shared__ float s_mu[D], s_w[D];
  __shared__ float s_scratch[kTcWarps * D];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int split = blockIdx.y;
  const int64_t b = blockIdx.z / a.t_chunks;
  const int t0 = static_cast<int>(blockIdx.z % a.t_chunks) * 8 * NT;
  const int64_t j_begin = split * a.cols_per_split;
  const int64_t j_end = min(a.m, j_begin + a.cols_per_split);
  const int d = a.d;
  const float* x1 = a.x1 + b * a.n * d;
  const float* x2 = a.x2 + b * a.m * d;
  const float* ls = a.ls + b * d;
  const float* v = a.v + b * a.m * a.t;

  // the block's centre: the mean of its rows
  {
    float part[D];
#pragma unroll
    for (int k = 0; k < D; ++k) part[k] = 0.0f;
    for (int r = tid; r < kRows; r += kTcThreads) {
      const int64_t i = row0 + r;
#pragma unroll
      for (int k = 0; k < D; ++k)
        if (i < a.n && k < d) part[k] += x1[i * d + k];
    }
    block_sum(part, s_scratch, s_mu);
    if (tid < D) {
      const float count = static_cast<float>(min(a.n - row0, static_cast<int64_t>(kRows)));
      s_mu[tid] = tid < d ? s_mu[tid] / count : 0.0f;
      s_w[tid] = tid < d ? static_cast<float>(kSqrtHalfLog2e) / ls[tid] : 0.0f;
    }
    __syncthreads();
  }

  // this lane's rows (g and g + 8 of each tile) as A fragments of 2 y1, their biases -|y1|^2 and thresholds
  uint32_t ah[MT][KD][4], al[MT][KD][4];
  float b1[MT][2], thr[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t i = row0 + (warp * MT + mt) * 16 + g + 8 * h;
      float y[D];
      float nrm = 0.0f;
#pragma unroll
      for (int k = 0; k < D; ++k) {
        y[k] = (i < a.n && k < d) ? scale_point(x1[i * d + k], s_mu[k], s_w[k]) : 0.0f;
        nrm = fmaf(y[k], y[k], nrm);
      }
      b1[mt][h] = -nrm;
      thr[mt][h] = -nrm * (2.0f * kNearTau);
#pragma unroll
      for (int ks = 0; ks < KD; ++ks) {
#pragma unroll
        for (int w = 0; w < 2; ++w) {
          float yk = 0.0f;  // feature 8 ks + 4 w + q, selected with constant register indices
#pragma unroll
          for (int u = 0; u < 4; ++u)
            if (u == q) yk = y[ks * 8 + 4 * w + u];
          uint32_t hi, lo;
          split_tf32(2.0f * yk, hi, lo);  // doubling is exact
          ah[mt][ks][h + 2 * w] = hi;
          al[mt][ks][h + 2 * w] = kSplit ? lo : 0u;
        }
      }
    }
  }

  float acc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[mt][nt][c] = 0.0f;

  // The next tile's raw columns and right-hand sides are loaded into registers while this one computes, so that
  // no warp waits on global memory at the tile's barrier: lane tid < kTcCols holds column tid's point, and every
  // lane kVPer values of V (element tid + u kTcThreads of the tile, row-major over its 8 NT columns).
  constexpr int kVPer = kTcCols * 8 * NT / kTcThreads;
  float px[D], pv[kVPer];
  auto fetch = [&](int64_t jt) {
#pragma unroll
    for (int k = 0; k < D; ++k) px[k] = (tid < kTcCols && jt + tid < j_end && k < d) ? x2[(jt + tid) * d + k] : 0.0f;
#pragma unroll
    for (int u = 0; u < kVPer; ++u) {
      const int e = tid + u * kTcThreads, jj = e / (8 * NT), c = e - jj * (8 * NT);
      pv[u] = (jt + jj < j_end && t0 + c < a.t) ? v[(jt + jj) * a.t + t0 + c] : 0.0f;
    }
  };
  // the staged tile: scaled points (for the recompute), their biases -|y2|^2 and both operands split, in fragment
  // order
  auto stage = [&](int cols) {
    if (tid < kTcCols) {
      float nrm = 0.0f;
      const int grp = tid >> 3, col = tid & 7;
#pragma unroll
      for (int k = 0; k < D; ++k) {
        const float y = (tid < cols && k < d) ? scale_point(px[k], s_mu[k], s_w[k]) : 0.0f;
        nrm = fmaf(y, y, nrm);
        s_y2[tid][k] = y;
        uint32_t hi, lo;
        split_tf32(y, hi, lo);
        // B fragment of S: b.x = y2[column g][feature q], b.y = feature q + 4 (within the k-step)
        const int kk = k & 7;
        s_bh[grp][k >> 3][col * 4 + (kk & 3)][kk >> 2] = hi;
        s_bl[grp][k >> 3][col * 4 + (kk & 3)][kk >> 2] = lo;
      }
      s_b2[tid] = -nrm;
    }
#pragma unroll
    for (int u = 0; u < kVPer; ++u) {
      const int e = tid + u * kTcThreads, jj = e / (8 * NT), c = e - jj * (8 * NT);
      uint32_t hi, lo;
      split_tf32(pv[u], hi, lo);
      // B fragment of P @ V in the permuted order: b.x = V[column 2q][rhs g], b.y = V[column 2q + 1][rhs g]
      const int r8 = jj & 7;
      s_vh[jj >> 3][c >> 3][(c & 7) * 4 + (r8 >> 1)][r8 & 1] = hi;
      s_vl[jj >> 3][c >> 3][(c & 7) * 4 + (r8 >> 1)][r8 & 1] = lo;
    }
  };

  fetch(j_begin);
  for (int64_t jt = j_begin; jt < j_end; jt += kTcCols) {
    const int cols = static_cast<int>(min(static_cast<int64_t>(kTcCols), j_end - jt));
    __syncthreads();  // the previous tile's reads are done
    stage(cols);
    __syncthreads();
    fetch(jt + kTcCols);

    float tile[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) tile[mt][nt][c] = 0.0f;

    const int groups = (cols + 7) >> 3;  // block-uniform: every lane takes part in the vote below
#pragma unroll 1
    for (int gi = 0; gi < groups; ++gi) {
      uint2 bh[KD], bl[KD], vh[NT], vl[NT];
#pragma unroll
      for (int ks = 0; ks < KD; ++ks) {
        bh[ks] = *reinterpret_cast<const uint2*>(&s_bh[gi][ks][lane][0]);
        bl[ks] = *reinterpret_cast<const uint2*>(&s_bl[gi][ks][lane][0]);
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        vh[nt] = *reinterpret_cast<const uint2*>(&s_vh[gi][nt][lane][0]);
        vl[nt] = *reinterpret_cast<const uint2*>(&s_vl[gi][nt][lane][0]);
      }
      const float2 b2 = *reinterpret_cast<const float2*>(&s_b2[gi * 8 + 2 * q]);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        float s4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if constexpr (kSplit) {
#pragma unroll
          for (int ks = 0; ks < KD; ++ks) {
            mma_tf32(s4, al[mt][ks], bh[ks]);
            mma_tf32(s4, ah[mt][ks], bl[ks]);
          }
        }
#pragma unroll
        for (int ks = 0; ks < KD; ++ks) mma_tf32(s4, ah[mt][ks], bh[ks]);
        // accumulator layout: s4[2 h + w] is row g + 8 h, column 2 q + w of this group
        float e[4];
        bool near = false;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          e[c] = (s4[c] + b1[mt][c >> 1]) + (c & 1 ? b2.y : b2.x);
          near |= e[c] >= thr[mt][c >> 1];
        }
        if (__any_sync(kFull, near)) {
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            if (e[c] >= thr[mt][c >> 1]) {
              const int64_t i = row0 + (warp * MT + mt) * 16 + g + 8 * (c >> 1);
              const float* y2 = &s_y2[gi * 8 + 2 * q + (c & 1)][0];
              float acc_e = 0.0f;
#pragma unroll
              for (int k = 0; k < D; ++k) {
                const float y1 = (i < a.n && k < d) ? scale_point(x1[i * d + k], s_mu[k], s_w[k]) : 0.0f;
                const float diff = y1 - y2[k];
                acc_e = fmaf(-diff, diff, acc_e);
              }
              e[c] = acc_e;
            }
          }
        }
        // P as the A fragment of P @ V: a = (P[g][2q], P[g+8][2q], P[g][2q+1], P[g+8][2q+1])
        uint32_t ph[4], pl[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float p = c >= 4 - kPoly ? exp2_poly(e[c]) : exp2_fast(e[c]);
          const int slot = (c >> 1) + 2 * (c & 1);
          ph[slot] = to_tf32(p);
          // lo = p - hi, exact, handed to the MMA unrounded: the tensor core drops its last 13 bits, an error
          // under 2^-21 p of either sign (lo's sign is random), where rounding it would cost one more instruction
          if constexpr (kSplit) pl[slot] = __float_as_uint(__fsub_rn(p, __uint_as_float(ph[slot])));
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          if constexpr (kFlush) {
            float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            pv_products<kSplit>(part, ph, pl, vh[nt], vl[nt]);
#pragma unroll
            for (int c = 0; c < 4; ++c) tile[mt][nt][c] += part[c];
          } else {
            pv_products<kSplit>(tile[mt][nt], ph, pl, vh[nt], vl[nt]);
          }
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[mt][nt][c] += tile[mt][nt][c];
  }

  const float s = a.scale[b];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t i = row0 + (warp * MT + mt) * 16 + g + 8 * h;
      if (i >= a.n) continue;
      float* dst = a.out + ((static_cast<int64_t>(split) * a.batch + b) * a.n + i) * a.t + t0;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int w = 0; w < 2; ++w) {
          const int c = nt * 8 + 2 * q + w;
          if (t0 + c < a.t) dst[c] = s * acc[mt][nt][2 * h + w];
        }
    }
  }
}

}  // namespace cuda
}  // namespace gpfast
