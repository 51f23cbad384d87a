// Device code of the pivoted Cholesky's block steps (torch-free), the same steps in the same order as
// cpu/pivot_block.cpp:
//   pivot_update_kernel  the previous block's update of the remaining diagonal (at the first block only the clamp
//                        d = max(d, 0)), one point a thread;
//   pivot_select_kernel  the next block's candidates (the c largest remaining diagonals) over all n points;
//   pivot_block_kernel   the greedy pivots among the candidates, the b x b factor G of the pivots and its inverse,
//                        one thread block of 256 on the c x c residual.
// As torch operations a block was some 36 launches (torch.topk alone several); with these it is 14, which a CUDA
// graph of a rank-3200 build replays 100 times.
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>

#include "device_common.cuh"

namespace gpfast {
namespace cuda {

constexpr int kPivotMaxPivots = 32;  // b <= 32 (c <= 64 candidates)
constexpr int kSelectThreads = 256;                       // 8 warps of 256 slots each
constexpr int kSelectSlots = 2048;                        // keys a block sorts at once in shared memory
constexpr int kSelectKeep = 64;                           // the best kept between rounds: c <= 64
constexpr int kSelectFresh = kSelectSlots - kSelectKeep;  // new keys a round
constexpr int kSelectMaxDrop = 64;

// The selection's total order: the larger remaining diagonal first, the smaller index among equals, so the c best
// are one set in one order whatever the grid (and the CPU's std::partial_sort gives the same). Empty slots hold
// (-inf, INT_MAX), below every real key (diagonals are >= 0 after the update, and no index is INT_MAX).
__device__ __forceinline__ bool sel_better(double v1, int i1, double v2, int i2) {
  return v1 > v2 || (v1 == v2 && i1 < i2);
}

// Compare-exchange: slot a takes the better key of a and b when desc, the worse otherwise.
__device__ __forceinline__ void sel_exchange(double* sv, int* si, int a, int b, bool desc) {
  const double va = sv[a], vb = sv[b];
  const int ia = si[a], ib = si[b];
  if (desc ? sel_better(vb, ib, va, ia) : sel_better(va, ia, vb, ib)) {
    sv[a] = vb;
    sv[b] = va;
    si[a] = ib;
    si[b] = ia;
  }
}

// One level of the merge of sorted 64-key runs, by one warp over slots [base, base + size): runs A and B = A + span
// (span = 64 << level) give A[i] = the better of A[i] and B[63 - i], a bitonic run holding the best 64 of both,
// then sorted by a bitonic merge.
__device__ __forceinline__ void select_merge_level(double* sv, int* si, int base, int level, int size, int lane) {
  const int span = kSelectKeep << level, pairs = size / (2 * span);
  for (int u = lane; u < pairs * kSelectKeep; u += 32) {
    const int a = base + (u >> 6) * 2 * span + (u & 63), b = base + (u >> 6) * 2 * span + span + 63 - (u & 63);
    if (sel_better(sv[b], si[b], sv[a], si[a])) {
      sv[a] = sv[b];
      si[a] = si[b];
    }
  }
  __syncwarp();
  for (int j = 32; j > 0; j >>= 1) {
    for (int u = lane; u < pairs * 32; u += 32) {
      const int t = u & 31, a = base + (u >> 5) * 2 * span + 2 * (t & ~(j - 1)) + (t & (j - 1));
      sel_exchange(sv, si, a, a + j, true);
    }
    __syncwarp();
  }
}

// The best kSelectKeep of the block's kSelectSlots keys into slots [0, kSelectKeep), best first (all threads; the
// slots written before the call). Each warp sorts its 256 slots' runs of 64 (bitonic) and merges its four runs into
// one, then the eight warps' runs are merged pairwise (4, 2, then 1 warp): four block-wide barriers a round. On
// the H200 at 43,945 points a
// call took 73 us with a bitonic sort of all 2048 keys (a barrier at each of its 66 steps) and each point's loads
// one after another, and 91-101 us with keys inserted one at a time into sorted warp lists.
__device__ __forceinline__ void select_best(double* sv, int* si) {
  const int lane = threadIdx.x & 31, base = (threadIdx.x >> 5) * 256;
  __syncthreads();
  for (int k = 2; k <= kSelectKeep; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int t = lane; t < 128; t += 32) {
        const int a = base + 2 * (t & ~(j - 1)) + (t & (j - 1));
        sel_exchange(sv, si, a, a + j, k == kSelectKeep || (a & k) == 0);
      }
      __syncwarp();
    }
  }
  select_merge_level(sv, si, base, 0, 256, lane);
  select_merge_level(sv, si, base, 1, 256, lane);
  // the warps' runs merged pairwise, a pair a warp: 4, then 2, then 1 warp (one warp for all seven merges left the
  // other seven waiting at the barrier)
  const int warp = threadIdx.x >> 5;
#pragma unroll 1
  for (int level = 2; level <= 4; ++level) {
    __syncthreads();
    const int span = kSelectKeep << level;
    if (warp < kSelectSlots / (2 * span)) select_merge_level(sv, si, warp * 2 * span, level, 2 * span, lane);
  }
  __syncthreads();
}

// d = max(d - sum_j Lb[j, :]^2, 0) with d[cand[piv[j]]] = 0 for the np pivots (the previous block's columns, r
// rows of n), one point a thread. The sum runs over j in order by fused multiply-adds, as the CPU's std::fma loop,
// so both update d to the same bits. Why a kernel of its own: reading Lb (r x n float64, 3.5 MB at pol's 13,500
// points and r = 32) is most of the update's time, and the selection's few blocks (one a 1,984 points) could not
// draw it from L2 fast enough: in one kernel with the selection, on an H100 at pol's shape, a third of its warps'
// stall samples waited on these loads, and a call took 49.7 us; split, the selection took 26 us and this kernel
// 5.7 us with all of a thread's rows in flight (11.1 us with eight at a time).
constexpr int kUpdateThreads = 256;
constexpr int kUpdateRows = 32;  // rows of Lb a chunk: all of the engine's (r = b <= 32; the op takes r <= 64)

__global__ void __launch_bounds__(kUpdateThreads, 2) pivot_update_kernel(double* __restrict__ d,
                                                                      const double* __restrict__ Lb, int r,
                                                                      const int64_t* __restrict__ cand, int q,
                                                                      const int64_t* __restrict__ piv, int np, int n) {
  __shared__ int drop[kSelectMaxDrop];
  if (threadIdx.x < np) {  // out-of-range positions drop nothing (the CPU op checks them; here that would sync)
    const int64_t p = piv[threadIdx.x];
    drop[threadIdx.x] = (p >= 0 && p < q) ? static_cast<int>(cand[p]) : -1;
  }
  __syncthreads();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kUpdateThreads + threadIdx.x;
  if (i >= n) return;
  // a chunk's loads all issued before its first FMA waits on one (one chunk for the engine's r <= 32): rows past r
  // load row r - 1 and add an exact zero (acc >= 0, so acc + 0 is acc's bits: the CPU's sum over j < r, in order)
  double acc = 0.0;
  for (int j0 = 0; j0 < r; j0 += kUpdateRows) {
    double l[kUpdateRows];
#pragma unroll
    for (int jj = 0; jj < kUpdateRows; ++jj) l[jj] = Lb[static_cast<int64_t>(min(j0 + jj, r - 1)) * n + i];
#pragma unroll
    for (int jj = 0; jj < kUpdateRows; ++jj) {
      const double x = j0 + jj < r ? l[jj] : 0.0;
      acc = fma(x, x, acc);
    }
  }
  double v = fmax(d[i] - acc, 0.0);
  for (int j = 0; j < np; ++j)
    if (drop[j] == i) v = 0.0;
  d[i] = v;
}

// out = the c best of d by sel_better (d already updated by pivot_update_kernel). Each block takes rounds of
// kSelectFresh points beside its best 64 so far and leaves those in part_v / part_i; the last block to finish
// (ticket, zero on entry) merges them the same way.
__global__ void __launch_bounds__(kSelectThreads) pivot_select_kernel(const double* __restrict__ d, int n, int c,
                                                                      double* __restrict__ part_v,
                                                                      int* __restrict__ part_i,
                                                                      unsigned* __restrict__ ticket,
                                                                      int64_t* __restrict__ out) {
  __shared__ double sv[kSelectSlots];
  __shared__ int si[kSelectSlots];
  __shared__ bool last;
  if (threadIdx.x < kSelectKeep) {
    sv[threadIdx.x] = -INFINITY;
    si[threadIdx.x] = INT_MAX;
  }
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kSelectFresh; base < n;
       base += static_cast<int64_t>(gridDim.x) * kSelectFresh) {
    for (int slot = threadIdx.x; slot < kSelectFresh; slot += kSelectThreads) {
      const int64_t i = base + slot;
      sv[kSelectKeep + slot] = i < n ? d[i] : -INFINITY;
      si[kSelectKeep + slot] = i < n ? static_cast<int>(i) : INT_MAX;
    }
    select_best(sv, si);
  }
  if (threadIdx.x < kSelectKeep) {
    part_v[blockIdx.x * kSelectKeep + threadIdx.x] = sv[threadIdx.x];
    part_i[blockIdx.x * kSelectKeep + threadIdx.x] = si[threadIdx.x];
  }
  __threadfence();  // this block's list is visible before its ticket
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (threadIdx.x < kSelectKeep) {
    sv[threadIdx.x] = -INFINITY;
    si[threadIdx.x] = INT_MAX;
  }
  const int entries = static_cast<int>(gridDim.x) * kSelectKeep;
  for (int base = 0; base < entries; base += kSelectFresh) {
    for (int slot = threadIdx.x; slot < kSelectFresh; slot += kSelectThreads) {
      const int e = base + slot;
      sv[kSelectKeep + slot] = e < entries ? __ldcg(part_v + e) : -INFINITY;
      si[kSelectKeep + slot] = e < entries ? __ldcg(part_i + e) : INT_MAX;
    }
    select_best(sv, si);
  }
  if (threadIdx.x < c) out[threadIdx.x] = si[threadIdx.x];
}

// The greedy pivots of one block, one thread block of kPivotThreads on the c x c residual S = rows[:, cand].
// Step j takes the untaken candidate p with the largest remaining diagonal (the first on ties),
// s = sqrt(max(d_p, floor)), the column C[:, j] = S[:, p] * (1 / s) (C[p, j] = s; zero when d_p <= floor), then
// S -= C[:, j] C[:, j]^T, d = max(d - C[:, j]^2, 0), d_p = 0. Then G[j, :] = C[piv_j, :j+1] (a unit row for a pivot
// below the floor) and Ginv = G^{-1} by forward substitution, its (j, j) zeroed for such a pivot, so that
// Ginv @ rows[piv] is zero there.
//
// Why this form. The steps are a chain: each pivot needs the diagonal after the one before, so a block of 32 pivots
// is 32 rounds of (choose, column, update), then G's inverse, and their latency is the kernel's time. S is spread
// over 256 threads (thread (rg, cg) holds rows rg + 16 a and columns cg + 16 e: kPer x kPer values), every warp keeps
// the whole diagonal and chooses the pivot itself (shuffles, no barrier), the 16 owners of column p write C[:, j] to
// shared memory, and one barrier a round publishes it. On an H100 at pol's shape (32 pivots from 64 candidates)
// this layout alone took 64.6 us, as long as one thread a candidate (62 us): Nsight Compute put 25 of its 61 stall
// samples in the forward substitution (one warp working down b(b - 1)/2 dependent FMAs with a division at each row)
// and 27 in the rounds' serial chain, where each owner's four divisions ran one after another. With one
// division a pivot (the column times 1 / s, as LAPACK's unblocked Cholesky scales; the CPU op does the same) and the
// inverse swept by columns of G with the reciprocals of its diagonal (a chain of b multiplies, each sum's terms still
// in the order jj = t, t + 1, ...) it took 29.9 us (experiments/results/h100_2026-12-05_session23). The arithmetic of
// every value is the CPU op's, in its order. For a NaN diagonal the two differ: sel_better never prefers a NaN, so
// where every untaken candidate is NaN this kernel names no pivot (INT_MAX) and the CPU takes the first; the
// selection's update (fmax(., 0)) leaves no NaN in the d the engine passes.
constexpr int kPivotThreads = 256;

// c ? a : b by one selp in inline PTX: written in C++, the compiler turns a chain of such selects over a register
// array into an indexed load, and the array then lives in local memory
__device__ __forceinline__ double select_f64(bool c, double a, double b) {
  double r;
  asm("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %3, 0;\n\tselp.f64 %0, %1, %2, q;\n\t}"
      : "=d"(r)
      : "d"(a), "d"(b), "r"(static_cast<int>(c)));
  return r;
}

template <int kC>
__global__ void __launch_bounds__(kPivotThreads) pivot_block_kernel(
    const double* __restrict__ rows, int64_t ld, const int64_t* __restrict__ cand, const double* __restrict__ d,
    const double* __restrict__ floor_ptr, int c, int b, int64_t* __restrict__ piv, double* __restrict__ G,
    double* __restrict__ Ginv) {
  constexpr int kPer = kC / 16;   // rows (and columns) of S a thread holds
  constexpr int kLane = kC / 32;  // candidates of the diagonal a lane holds, in every warp
  static_assert(kC == 32 || kC == 64, "32 or 64 candidates");
  __shared__ int cidx[kC];
  __shared__ double col[2][kC];               // C[:, j] by step parity
  __shared__ double Cs[kPivotMaxPivots][kC];  // Cs[j][k] = C[k, j]
  __shared__ double Gs[kPivotMaxPivots][kPivotMaxPivots + 1];
  __shared__ double rdiag[kPivotMaxPivots];  // 1 / G[i, i]
  __shared__ int piv_s[kPivotMaxPivots], ok_s[kPivotMaxPivots];
  const int tid = threadIdx.x, lane = tid & 31, rg = tid >> 4, cg = tid & 15;
  if (tid < kC) cidx[tid] = tid < c ? static_cast<int>(cand[tid]) : 0;
  __syncthreads();
  double R[kPer][kPer];  // R[a][e] = S[rg + 16 a, cg + 16 e]
#pragma unroll
  for (int a = 0; a < kPer; ++a)
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      const int k = rg + 16 * a, l = cg + 16 * e;
      R[a][e] = (k < c && l < c) ? rows[k * ld + cidx[l]] : 0.0;
    }
  double dl[kLane];  // the diagonal of candidates lane + 32 u, the same in every warp
  bool taken[kLane];
#pragma unroll
  for (int u = 0; u < kLane; ++u) {
    const int k = lane + 32 * u;
    dl[u] = k < c ? d[cidx[k]] : 0.0;
    taken[u] = k >= c;
  }
  const double fl = *floor_ptr;
  for (int j = 0; j < b; ++j) {
    double v = -INFINITY;
    int qk = INT_MAX;
#pragma unroll
    for (int u = 0; u < kLane; ++u)
      if (!taken[u] && sel_better(dl[u], lane + 32 * u, v, qk)) {
        v = dl[u];
        qk = lane + 32 * u;
      }
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) {
      const double ov = __shfl_xor_sync(kFull, v, off);
      const int oq = __shfl_xor_sync(kFull, qk, off);
      if (sel_better(ov, oq, v, qk)) {
        v = ov;
        qk = oq;
      }
    }
    const int p = qk;
    const bool good = v > fl;
    const double s = sqrt(fmax(v, fl)), inv = 1.0 / s;
    double* cj = col[j & 1];
    if (cg == (p & 15)) {  // the owners of column p: one thread a row group
#pragma unroll
      for (int a = 0; a < kPer; ++a) {
        const int k = rg + 16 * a;
        double rkp = R[a][0];
#pragma unroll
        for (int e = 1; e < kPer; ++e) rkp = select_f64(e == (p >> 4), R[a][e], rkp);
        const double ck = (k < c && good) ? (k == p ? s : rkp * inv) : 0.0;
        cj[k] = ck;
        Cs[j][k] = ck;
      }
    }
    if (tid == 0) {
      piv[j] = p;
      piv_s[j] = p;
      ok_s[j] = good;
    }
    // the column complete; the parity keeps step j + 1's writes off the column that slower threads still read
    __syncthreads();
    double ca[kPer], ce[kPer];
#pragma unroll
    for (int a = 0; a < kPer; ++a) ca[a] = cj[rg + 16 * a];
#pragma unroll
    for (int e = 0; e < kPer; ++e) ce[e] = cj[cg + 16 * e];
#pragma unroll
    for (int a = 0; a < kPer; ++a)
#pragma unroll
      for (int e = 0; e < kPer; ++e) R[a][e] = fma(-ca[a], ce[e], R[a][e]);
#pragma unroll
    for (int u = 0; u < kLane; ++u) {
      const int k = lane + 32 * u;
      const double ck = cj[k];
      dl[u] = k == p ? 0.0 : fmax(fma(-ck, ck, dl[u]), 0.0);
      if (k == p) taken[u] = true;
    }
  }
  __syncthreads();  // Cs, piv_s and ok_s complete
  for (int e = tid; e < b * b; e += kPivotThreads) {
    const int t = e / b, jj = e % b;
    Gs[t][jj] = jj > t ? 0.0 : (ok_s[t] ? Cs[jj][piv_s[t]] : (jj == t ? 1.0 : 0.0));
  }
  __syncthreads();
  if (tid < 32) {  // lane t: column t of G^{-1}, every lane the same instructions (no predicate on t)
    const int t = tid;
    if (t < b) rdiag[t] = 1.0 / Gs[t][t];
    __syncwarp();
    // x_jj = (its sum) * rdiag[jj], then x_jj's term added to every later row's sum, so that each sum takes its terms
    // in the order jj = 0, 1, ...; the rows above t hold exact zeros, whose terms leave a sum's bits as they are, so
    // the result is the CPU's sum from jj = t
    double x[kPivotMaxPivots];
#pragma unroll
    for (int i = 0; i < kPivotMaxPivots; ++i) x[i] = i == t ? 1.0 : 0.0;
#pragma unroll
    for (int jj = 0; jj < kPivotMaxPivots; ++jj) {
      if (jj >= b) break;  // uniform
      x[jj] *= rdiag[jj];
#pragma unroll
      for (int i = jj + 1; i < kPivotMaxPivots; ++i)
        if (i < b) x[i] = fma(-Gs[i][jj], x[jj], x[i]);
    }
    if (t < b) {
#pragma unroll
      for (int i = 0; i < kPivotMaxPivots; ++i) {
        if (i < b) {
          G[i * b + t] = Gs[i][t];
          Ginv[i * b + t] = (i < t || (i == t && !ok_s[t])) ? 0.0 : x[i];
        }
      }
    }
  }
}

}  // namespace cuda
}  // namespace gpfast
