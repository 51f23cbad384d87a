// K @ V for a symmetric stored K (n, n) and a skinny V (n, t), t <= 16, reading only K's blocks on and above the
// diagonal: the training engine's product with K(x, x). Why: dense_matmul.cuh reads all of K and runs at the
// bandwidth, so half the reads is the only way left to make the product faster, and each element read then serves
// two products, K_IJ V_J (its row block) and K_IJ^T V_I (its column block). That doubles the arithmetic per byte
// (2 t multiply-adds per 4 bytes), past what the float32 FMA units give at the H200's bandwidth, so both products
// run on the tensor cores in 3xTF32 (mma.cuh): K = Kh + Kl, V = Vh + Vl, K V ~ Kh Vh + Kh Vl + Kl Vh.
//
// Work. K is cut into S x S super-tiles (A, B), A <= B (S = 256, 512 or 1024); a block of 8 warps takes a contiguous
// range of them (persistent grid, one block per SM). A super-tile is swept in bands of 128 rows and, within a
// band, in stages of 64 columns: each stage's 128 x 64 floats come into shared memory by cp.async, 16 bytes a
// thread-copy, several stages ahead of the arithmetic (the pipeline runs on across bands and super-tiles). Warp
// (wr, wc) of the 4 x 2 warp grid owns the stage's rows 32 wr .. +32 and columns 32 wc .. +32 and does both
// products on them:
//   rows:    Y_I (32 rows x 16 rhs) += K (32 x 32) V_J (32 x 16), accumulated over the band in registers, the two
//            warp columns added at the band's end (shared memory, fixed order);
//   columns: Y_J^T (16 rhs x 32 cols) += V_I^T (16 x 32 rows) K (32 x 32), V_I's fragments in registers for the
//            band; the 4 warp rows' partials go through shared memory once a stage and are summed in a fixed order,
//            one stage later, by all threads into registers that hold the super-tile's column sums.
// A diagonal super-tile (A == B) is read whole and gives only its rows' products (K stored in full: the forward
// writes both triangles), so every element of the upper block triangle counts once.
//
// Fragments. Lane 4 g + t4 reads K in 16-byte runs in both roles, which the MMAs allow because their k index may
// be any fixed permutation of the columns (rows: k = column) or rows (columns: k = row): for the rows' product
// a run of row g at columns 16 q + 4 t4 .. + 3 holds A's (g, t4) and (g, t4 + 4) of two k-steps; for the columns'
// product a run of row 8 s + t4 at columns 4 g .. + 3 holds B's (t4, g) of four 8-column n-tiles (n-tile e: columns
// 4 g + e). The stage's rows are 64 floats (256 bytes) with each 16-byte chunk c stored at c ^ swz(r), so that both
// patterns and the copies hit 8 distinct 16-byte bank groups per quarter-warp.
//
// Measured (H200): correct to 1.5e-7 of sum |K| |V|, but no faster than the full read at 11 columns (57,248
// points: 3.37 against 3.34 ms) and 1.2x faster at 16. Nsight Compute: 46% of the issue slots, 33% of DRAM
// bandwidth, an instruction every 4.07 cycles a warp with 2 warps a scheduler: latency, from the occupancy that the
// 201 registers and 201 KiB of shared memory leave; the split's integer work makes ALU the busiest pipe (37%).
//
// Output. Super-tile (A, B) writes its rows' sums to part[A][B] and, off the diagonal, its columns' sums to
// part[B][A] (each S x t, float32); every slot of part (ns x ns) is written exactly once, and sym_sum_kernel adds
// a row block's ns slots in order, in double. Results are bitwise repeatable. Rows and columns past n are read
// as zeros (cp.async's zero fill), so whatever lies in K's padding never enters.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "mma.cuh"

namespace gpfast {
namespace cuda {

constexpr int kSymWarps = 8, kSymThreads = kSymWarps * 32;
constexpr int kSymRows = 128;  // a band
constexpr int kSymCols = 64;   // a stage's columns
constexpr int kSymStageFloats = kSymRows * kSymCols;
constexpr int kSymScratch = kSymWarps * 512;  // one stage's column partials: 8 warps x 16 values x 32 lanes

// Stages in flight by default: as many 32 KiB stages as shared memory holds beside V's rows (3 at S = 1024)
template <int S>
__host__ __device__ constexpr int sym_stages() {
  return S >= 1024 ? 3 : 4;
}
// V's staged rows (right-hand side r, the super-tile's columns): a pitch of 16 mod 32 floats puts the two
// right-hand sides a quarter-warp reads in different bank groups
template <int S>
__host__ __device__ constexpr int sym_vpitch() {
  return S + 16;
}
template <int S, int kStages>
__host__ __device__ constexpr int sym_smem_bytes() {
  return (kStages * kSymStageFloats + 16 * sym_vpitch<S>() + 2 * kSymScratch + 4 * 512) * 4;
}

struct SymArgs {
  const float* K;  // (n, n), element (i, j) at K[i * ldk + j]; ldk and K 16-byte aligned
  const float* V;  // (n, t) contiguous
  float* part;     // (ns, ns, S, t)
  int64_t ldk, n;
  int64_t tiles;  // ns (ns + 1) / 2
  int t, ns;
};

__device__ __forceinline__ int sym_swz(int r) { return ((r & 1) << 2) | (r & 2); }

// c += (ah + al)(bh + bl) less al bl
__device__ __forceinline__ void mma3(float (&c)[4], const uint32_t (&ah)[4], const uint32_t (&al)[4], uint32_t bh0,
                                     uint32_t bh1, uint32_t bl0, uint32_t bl1) {
  mma_tf32(c, al, bh0, bh1);
  mma_tf32(c, ah, bl0, bl1);
  mma_tf32(c, ah, bh0, bh1);
}

// Super-tile u of the upper triangle, row-major: (A, B), A <= B
struct SymCursor {
  int A, B;
  __device__ void seek(int64_t u, int ns) {
    A = 0;
    while (u >= ns - A) u -= ns - A, ++A;
    B = A + static_cast<int>(u);
  }
  __device__ void next(int ns) {
    if (++B == ns) B = ++A;
  }
};

template <int S, int kStages>
__global__ void __launch_bounds__(kSymThreads, 1) sym_matmul_kernel(const SymArgs a) {
  constexpr int VP = sym_vpitch<S>();
  constexpr int NB = S / kSymRows, NCS = S / kSymCols, SPT = NB * NCS;  // bands, stages a band, stages a tile
  extern __shared__ __align__(16) float sym_smem[];
  float* sK = sym_smem;                             // [kStages][128][64], swizzled chunks
  float* sV = sK + kStages * kSymStageFloats;       // [16][VP]: V's rows of the super-tile's columns, transposed
  float* sScr = sV + 16 * VP;                       // [2][8 warps][16][32]: column partials
  float* sYI = sScr + 2 * kSymScratch;              // [4 warp rows][16][32]: the second warp column's row sums

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3, wr = warp >> 1, wc = warp & 1;
  const int t = a.t, ns = a.ns;
  const int64_t n = a.n;
  const int64_t u_begin = static_cast<int64_t>(blockIdx.x) * a.tiles / gridDim.x;
  const int64_t u_end = (static_cast<int64_t>(blockIdx.x) + 1) * a.tiles / gridDim.x;
  const int64_t my_stages = (u_end - u_begin) * SPT;

  // right-hand sides t .. 15 stay zero (the first super-tile's barrier orders these stores)
  for (int e = tid; e < (16 - t) * VP; e += kSymThreads) sV[t * VP + e] = 0.0f;

  // the copies: stage ls of this block's sequence into buffer ls % kStages
  SymCursor lc;
  lc.seek(u_begin, ns);
  int64_t ls = 0;
  int lst = 0;  // stage within the loader's super-tile
  auto issue = [&]() {
    if (ls < my_stages) {
      const int b = lst / NCS, cs = lst - b * NCS;
      const int64_t row0 = static_cast<int64_t>(lc.A) * S + b * kSymRows;
      const int64_t col0 = static_cast<int64_t>(lc.B) * S + cs * kSymCols;
      float* dst = sK + (ls % kStages) * kSymStageFloats;
#pragma unroll
      for (int i = 0; i < kSymStageFloats / 4 / kSymThreads; ++i) {
        const int e = tid + i * kSymThreads, r = e >> 4, ch = e & 15;
        const int64_t row = row0 + r, col = col0 + 4 * ch;
        const int64_t left = row < n ? (n - col) * 4 : 0;
        const int bytes = static_cast<int>(left < 0 ? 0 : (left > 16 ? 16 : left));
        const float* src = bytes > 0 ? a.K + row * a.ldk + col : a.K;
        cp_async16_zfill(dst + r * kSymCols + ((ch ^ sym_swz(r)) << 2), src, bytes);
      }
      if (++lst == SPT) lst = 0, lc.next(ns);
    }
    ++ls;
    cp_async_commit();  // an empty group past the end keeps the wait counts uniform
  };
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue();

  SymCursor cc;
  cc.seek(u_begin, ns);
  int64_t gs = 0;  // the stage being computed
  for (int64_t u = u_begin; u < u_end; ++u, cc.next(ns)) {
    const bool diag = cc.A == cc.B;
    const int64_t R0 = static_cast<int64_t>(cc.A) * S, C0 = static_cast<int64_t>(cc.B) * S;
    __syncthreads();  // every warp is done with the previous super-tile's sV
    for (int e = tid; e < S * t; e += kSymThreads) {
      const int c = e / t, r = e - c * t;
      sV[r * VP + c] = C0 + c < n ? a.V[(C0 + c) * t + r] : 0.0f;
    }
    float acc[NCS][4];  // this thread's share of the super-tile's column sums (4 per stage of a band)
#pragma unroll
    for (int cs = 0; cs < NCS; ++cs)
#pragma unroll
      for (int k = 0; k < 4; ++k) acc[cs][k] = 0.0f;

    // the 4 warp rows' partials of stage `from` into acc[cs], rows in order
    auto reduce = [&](float (&dst)[4], int64_t from) {
      const float* src = sScr + (from & 1) * kSymScratch;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int idx = tid + k * kSymThreads, c = idx >> 9, rem = idx & 511;
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < 4; ++w) s += src[(2 * w + c) * 512 + rem];
        dst[k] += s;
      }
    };

    for (int b = 0; b < NB; ++b) {
      const int64_t band0 = R0 + b * kSymRows;
      // V_I^T's A fragments (m = right-hand side, k = row) of this warp's 32 rows, for the columns' product
      uint32_t vih[4][4], vil[4][4];
      if (!diag) {
#pragma unroll
        for (int s = 0; s < 4; ++s)
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const int64_t row = band0 + 32 * wr + 8 * s + t4 + 4 * (k >> 1);
            const int rhs = g + 8 * (k & 1);
            const float v = row < n && rhs < t ? a.V[row * t + rhs] : 0.0f;
            split_p<2>(v, vih[s][k], vil[s][k]);
          }
      }
      float yi[2][2][4];  // rows' sums: [m-tile][n-tile (right-hand sides 8 nt ..)][fragment]
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int k = 0; k < 4; ++k) yi[mt][nt][k] = 0.0f;

#pragma unroll
      for (int cs = 0; cs < NCS; ++cs) {
        cp_async_wait<kStages - 2>();
        __syncthreads();  // stage gs is in for every thread; every warp is done with stage gs - 1's buffer
        issue();
        if (!diag && (cs > 0 || b > 0)) reduce(acc[cs > 0 ? cs - 1 : NCS - 1], gs - 1);  // the previous stage's
        const float* sk = sK + (gs % kStages) * kSymStageFloats;
        // rows: A = K (row g / g + 8, k = column), B = V_J (k = column, n = right-hand side)
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const int chunk = 8 * wc + 4 * q + t4;
          const int vc = cs * kSymCols + 32 * wc + 16 * q + 4 * t4;
          const float4 va = *reinterpret_cast<const float4*>(sV + g * VP + vc);
          const float4 vb = *reinterpret_cast<const float4*>(sV + (g + 8) * VP + vc);
          const float vv[2][4] = {{va.x, va.y, va.z, va.w}, {vb.x, vb.y, vb.z, vb.w}};
          uint32_t bh[2][4], bl[2][4];
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int k = 0; k < 4; ++k) split_p<2>(vv[nt][k], bh[nt][k], bl[nt][k]);
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            const int r = 32 * wr + 16 * mt + g;  // and r + 8 (same swizzle)
            const int off = (chunk ^ sym_swz(r)) << 2;
            const float4 ka = *reinterpret_cast<const float4*>(sk + r * kSymCols + off);
            const float4 kb = *reinterpret_cast<const float4*>(sk + (r + 8) * kSymCols + off);
            const float kk[2][4] = {{ka.x, ka.y, ka.z, ka.w}, {kb.x, kb.y, kb.z, kb.w}};
#pragma unroll
            for (int p = 0; p < 2; ++p) {
              uint32_t ah[4], al[4];
              split_p<2>(kk[0][2 * p], ah[0], al[0]);
              split_p<2>(kk[1][2 * p], ah[1], al[1]);
              split_p<2>(kk[0][2 * p + 1], ah[2], al[2]);
              split_p<2>(kk[1][2 * p + 1], ah[3], al[3]);
#pragma unroll
              for (int nt = 0; nt < 2; ++nt)
                mma3(yi[mt][nt], ah, al, bh[nt][2 * p], bh[nt][2 * p + 1], bl[nt][2 * p], bl[nt][2 * p + 1]);
            }
          }
        }
        if (!diag) {
          // columns: A = V_I^T (m = right-hand side, k = row), B = K (k = row 8 s + t4 / + 4, n = column 4 g + e)
          float yj[4][4];
#pragma unroll
          for (int e = 0; e < 4; ++e)
#pragma unroll
            for (int k = 0; k < 4; ++k) yj[e][k] = 0.0f;
#pragma unroll
          for (int s = 0; s < 4; ++s) {
            const int r = 32 * wr + 8 * s + t4;  // and r + 4 (same swizzle)
            const int off = ((8 * wc + g) ^ sym_swz(r)) << 2;
            const float4 k0 = *reinterpret_cast<const float4*>(sk + r * kSymCols + off);
            const float4 k1 = *reinterpret_cast<const float4*>(sk + (r + 4) * kSymCols + off);
            const float b0[4] = {k0.x, k0.y, k0.z, k0.w}, b1[4] = {k1.x, k1.y, k1.z, k1.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              uint32_t h0, l0, h1, l1;
              split_p<2>(b0[e], h0, l0);
              split_p<2>(b1[e], h1, l1);
              mma3(yj[e], vih[s], vil[s], h0, h1, l0, l1);
            }
          }
          float* dst = sScr + (gs & 1) * kSymScratch + warp * 512 + lane;
#pragma unroll
          for (int e = 0; e < 4; ++e)
#pragma unroll
            for (int k = 0; k < 4; ++k) dst[(4 * e + k) * 32] = yj[e][k];
        }
        ++gs;
      }

      // the band's rows: the second warp column's sums through shared memory, added to the first's in order
      if (wc == 1) {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int k = 0; k < 4; ++k) sYI[wr * 512 + ((2 * mt + nt) * 4 + k) * 32 + lane] = yi[mt][nt][k];
      }
      __syncthreads();
      if (wc == 0) {
        float* out = a.part + ((static_cast<int64_t>(cc.A) * ns + cc.B) * S + b * kSymRows) * t;
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int k = 0; k < 4; ++k) {
              const int r = 32 * wr + 16 * mt + g + 8 * (k >> 1), rhs = 8 * nt + 2 * t4 + (k & 1);
              const float v = yi[mt][nt][k] + sYI[wr * 512 + ((2 * mt + nt) * 4 + k) * 32 + lane];
              if (rhs < t) out[r * t + rhs] = v;
            }
      }
    }

    if (!diag) {  // the last stage's column partials, then the super-tile's column sums into part[B][A]
      __syncthreads();
      reduce(acc[NCS - 1], gs - 1);
      float* out = a.part + (static_cast<int64_t>(cc.B) * ns + cc.A) * S * t;
#pragma unroll
      for (int cs = 0; cs < NCS; ++cs)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int idx = tid + k * kSymThreads, c = idx >> 9, rem = idx & 511;
          const int reg = rem >> 5, ln = rem & 31, e = reg >> 2, f = reg & 3;
          const int rhs = (ln >> 2) + 8 * (f >> 1), nn = 2 * (ln & 3) + (f & 1);
          const int col = cs * kSymCols + 32 * c + 4 * nn + e;
          if (rhs < t) out[col * t + rhs] = acc[cs][k];
        }
    }
  }
  cp_async_wait<0>();  // no copy outlives the block
}

// out[i, c] = sum over j of part[A][j][i - A S][c], A = i / S, in double, in order of j
__global__ void sym_sum_kernel(const float* __restrict__ part, float* __restrict__ out, int64_t n, int t, int ns,
                               int S) {
  const int64_t count = n * t;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < count;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = e / t, A = i / S;
    const int c = static_cast<int>(e - i * t);
    const float* p = part + (A * ns * S + (i - A * S)) * t + c;
    double s = 0.0;
    for (int j = 0; j < ns; ++j) s += static_cast<double>(p[static_cast<int64_t>(j) * S * t]);
    out[e] = static_cast<float>(s);
  }
}

}  // namespace cuda
}  // namespace gpfast
