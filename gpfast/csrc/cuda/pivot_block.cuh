// Device code of the pivoted Cholesky's block steps (torch-free), the same steps in the same order as
// cpu/pivot_block.cpp:
//   pivot_select_kernel  the previous block's update of the remaining diagonal and the next block's candidates (the
//                        c largest), in one launch over all n points;
//   pivot_block_kernel   the greedy pivots among the candidates, the b x b factor G of the pivots and its inverse,
//                        one thread block on the c x c residual.
// As torch operations a block was some 36 launches (torch.topk alone eight to thirty, by n); with these it is about
// a dozen, which a CUDA graph of a rank-3200 build replays 200 times.
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>

#include "device_common.cuh"

namespace gpfast {
namespace cuda {

constexpr int kPivotThreads = 64;    // one thread per candidate: c <= 64
constexpr int kPivotMaxPivots = 32;  // b <= 32: the C columns in shared memory stay within 48 KiB with R in registers
constexpr int kSelectThreads = 256;
constexpr int kSelectWarps = kSelectThreads / 32;
constexpr int kSelectKeep = 64;  // each list keeps the 64 best keys: c <= 64
constexpr int kSelectMaxDrop = 64;

// The selection's total order: the larger remaining diagonal first, the smaller index among equals, so the c best
// are one set in one order whatever the grid (and the CPU's std::partial_sort gives the same).
__device__ __forceinline__ bool sel_better(double v1, int i1, double v2, int i2) {
  return v1 > v2 || (v1 == v2 && i1 < i2);
}

// A warp's sorted list of its 64 best keys: lane l holds ranks l (v0, i0) and l + 32 (v1, i1). Empty ranks hold
// (-inf, INT_MAX), below every real key (diagonals are >= 0 after the update, and no index is INT_MAX).
struct WarpTop {
  double v0, v1;
  int i0, i1;

  __device__ void init() {
    v0 = v1 = -INFINITY;
    i0 = i1 = INT_MAX;
  }

  // Insert a key better than rank 63: the ranks at and after its position move down one.
  __device__ void insert(double nv, int ni, int lane) {
    const int p = __popc(__ballot_sync(kFull, sel_better(v0, i0, nv, ni))) +
                  __popc(__ballot_sync(kFull, sel_better(v1, i1, nv, ni)));
    double up0v = __shfl_up_sync(kFull, v0, 1), up1v = __shfl_up_sync(kFull, v1, 1);
    int up0i = __shfl_up_sync(kFull, i0, 1), up1i = __shfl_up_sync(kFull, i1, 1);
    const double w31v = __shfl_sync(kFull, v0, 31);  // rank 31 moves to rank 32 (lane 0's second)
    const int w31i = __shfl_sync(kFull, i0, 31);
    if (lane == 0) {
      up1v = w31v;
      up1i = w31i;
    }
    if (lane > p) {
      v0 = up0v;
      i0 = up0i;
    } else if (lane == p) {
      v0 = nv;
      i0 = ni;
    }
    if (lane + 32 > p) {
      v1 = up1v;
      i1 = up1i;
    } else if (lane + 32 == p) {
      v1 = nv;
      i1 = ni;
    }
  }

  // Offer one key a lane (valid or not); those better than the current rank 63 go in, one at a time. Once the list
  // is full most chunks of 32 keys cost one ballot.
  __device__ void offer(double v, int i, bool valid, int lane) {
    double tv = __shfl_sync(kFull, v1, 31);
    int ti = __shfl_sync(kFull, i1, 31);
    bool want = valid && sel_better(v, i, tv, ti);
    unsigned mask = __ballot_sync(kFull, want);
    while (mask) {
      const int src = __ffs(mask) - 1;
      insert(__shfl_sync(kFull, v, src), __shfl_sync(kFull, i, src), lane);
      tv = __shfl_sync(kFull, v1, 31);
      ti = __shfl_sync(kFull, i1, 31);
      want = want && lane != src && sel_better(v, i, tv, ti);
      mask = __ballot_sync(kFull, want);
    }
  }
};

// Every warp's list into shared memory; warp 0 then holds the block's 64 best. All threads of the block call it.
__device__ __forceinline__ void select_block_merge(WarpTop& top, double* sv, int* si, int lane, int warp) {
  sv[warp * kSelectKeep + lane] = top.v0;
  sv[warp * kSelectKeep + lane + 32] = top.v1;
  si[warp * kSelectKeep + lane] = top.i0;
  si[warp * kSelectKeep + lane + 32] = top.i1;
  __syncthreads();
  if (warp == 0) {
    top.init();
    for (int e = lane; e < kSelectWarps * kSelectKeep; e += 32) top.offer(sv[e], si[e], true, lane);
  }
}

// d = max(d - sum_j Lb[j, :]^2, 0) with d[cand[piv[j]]] = 0 for the np pivots (the previous block's columns, r
// rows of n; r = np = 0 at the first block), then out = the c best of d by sel_better. Each block keeps its 64 best
// in part_v / part_i; the last block to finish (ticket, zero on entry) merges them. The sum runs over j in order by
// fused multiply-adds, as the CPU's std::fma loop, so both update d to the same bits.
__global__ void __launch_bounds__(kSelectThreads) pivot_select_kernel(
    double* __restrict__ d, const double* __restrict__ Lb, int r, const int64_t* __restrict__ cand, int q,
    const int64_t* __restrict__ piv, int np, int n, int c, double* __restrict__ part_v, int* __restrict__ part_i,
    unsigned* __restrict__ ticket, int64_t* __restrict__ out) {
  __shared__ double sv[kSelectWarps * kSelectKeep];
  __shared__ int si[kSelectWarps * kSelectKeep];
  __shared__ int drop[kSelectMaxDrop];
  __shared__ bool last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x < np) {  // out-of-range positions drop nothing (the CPU op checks them; here that would sync)
    const int64_t p = piv[threadIdx.x];
    drop[threadIdx.x] = (p >= 0 && p < q) ? static_cast<int>(cand[p]) : -1;
  }
  __syncthreads();
  WarpTop top;
  top.init();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kSelectThreads;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kSelectThreads + warp * 32; base < n; base += stride) {
    const int64_t i = base + lane;  // the bound is per warp, so all lanes stay in the ballots
    const bool valid = i < n;
    double v = -INFINITY;
    if (valid) {
      double s = 0.0;
      for (int j = 0; j < r; ++j) {
        const double l = Lb[static_cast<int64_t>(j) * n + i];
        s = fma(l, l, s);
      }
      v = fmax(d[i] - s, 0.0);
      for (int j = 0; j < np; ++j)
        if (drop[j] == i) v = 0.0;
      d[i] = v;
    }
    top.offer(v, static_cast<int>(i), valid, lane);
  }
  select_block_merge(top, sv, si, lane, warp);
  if (warp == 0) {
    part_v[blockIdx.x * kSelectKeep + lane] = top.v0;
    part_v[blockIdx.x * kSelectKeep + lane + 32] = top.v1;
    part_i[blockIdx.x * kSelectKeep + lane] = top.i0;
    part_i[blockIdx.x * kSelectKeep + lane + 32] = top.i1;
  }
  __threadfence();  // this block's list is visible before its ticket
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  top.init();
  const int entries = static_cast<int>(gridDim.x) * kSelectKeep;  // a multiple of 32: whole warps
  for (int e = warp * 32 + lane; e - lane < entries; e += kSelectThreads)
    top.offer(__ldcg(part_v + e), __ldcg(part_i + e), true, lane);
  select_block_merge(top, sv, si, lane, warp);
  if (warp == 0) {
    if (lane < c) out[lane] = top.i0;
    if (lane + 32 < c) out[lane + 32] = top.i1;
  }
}

// The greedy pivots of one block: thread k owns candidate k, its remaining diagonal and its residual row
// S[k, :] = rows[k, cand] in registers. Step j takes the untaken candidate p with the largest remaining diagonal (the
// first on ties), s = sqrt(max(d_p, floor)), the column C[:, j] = S[:, p] / s (C[p, j] = s; zero when d_p <= floor),
// then S -= C[:, j] C[:, j]^T, d = max(d - C[:, j]^2, 0), d_p = 0. Then G[j, :] = C[piv_j, :j+1] (a unit row for a
// pivot below the floor) and Ginv = G^{-1} by forward substitution, its (j, j) zeroed for such a pivot, so that
// Ginv @ rows[piv] is zero there.
__global__ void __launch_bounds__(kPivotThreads) pivot_block_kernel(
    const double* __restrict__ rows, int64_t ld, const int64_t* __restrict__ cand, const double* __restrict__ d,
    const double* __restrict__ floor_ptr, int c, int b, int64_t* __restrict__ piv, double* __restrict__ G,
    double* __restrict__ Ginv) {
  __shared__ int cidx[kPivotThreads];
  __shared__ double col[kPivotThreads];
  __shared__ double Cs[kPivotMaxPivots][kPivotThreads];  // Cs[j][k] = C[k, j]
  __shared__ double Gs[kPivotMaxPivots][kPivotMaxPivots + 1];
  __shared__ double best_v[2][2];  // [step parity][warp]
  __shared__ int best_q[2][2];
  __shared__ int piv_s[kPivotMaxPivots], ok_s[kPivotMaxPivots];
  const int k = threadIdx.x, lane = k & 31, warp = k >> 5;
  cidx[k] = k < c ? static_cast<int>(cand[k]) : 0;
  __syncthreads();
  double R[kPivotThreads];
#pragma unroll
  for (int l = 0; l < kPivotThreads; ++l) R[l] = (k < c && l < c) ? rows[k * ld + cidx[l]] : 0.0;
  double dl = k < c ? d[cidx[k]] : 0.0;
  bool taken = k >= c;
  const double fl = *floor_ptr;
  for (int j = 0; j < b; ++j) {
    double v = taken ? -INFINITY : dl;
    int qk = taken ? INT_MAX : k;
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) {
      const double ov = __shfl_xor_sync(kFull, v, off);
      const int oq = __shfl_xor_sync(kFull, qk, off);
      if (sel_better(ov, oq, v, qk)) {
        v = ov;
        qk = oq;
      }
    }
    if (lane == 0) {
      best_v[j & 1][warp] = v;
      best_q[j & 1][warp] = qk;
    }
    __syncthreads();  // both warps' bests; the parity keeps the next step's writes off this step's reads
    if (sel_better(best_v[j & 1][1], best_q[j & 1][1], v, qk)) {
      v = best_v[j & 1][1];
      qk = best_q[j & 1][1];
    }
    if (sel_better(best_v[j & 1][0], best_q[j & 1][0], v, qk)) {
      v = best_v[j & 1][0];
      qk = best_q[j & 1][0];
    }
    const int p = qk;
    const bool good = v > fl;
    const double s = sqrt(fmax(v, fl));
    double rkp = 0.0;
#pragma unroll
    for (int l = 0; l < kPivotThreads; ++l)
      if (l == p) rkp = R[l];
    const double ck = (k < c && good) ? (k == p ? s : rkp / s) : 0.0;
    col[k] = ck;
    Cs[j][k] = ck;
    if (k == 0) {
      piv[j] = p;
      piv_s[j] = p;
      ok_s[j] = good;
    }
    if (k == p) taken = true;
    __syncthreads();  // the column complete
#pragma unroll
    for (int l = 0; l < kPivotThreads; ++l) R[l] = fma(-ck, col[l], R[l]);
    dl = k == p ? 0.0 : fmax(fma(-ck, ck, dl), 0.0);
    __syncthreads();  // every read of col done before the next step writes it
  }
  if (k < b) {
    const int t = k;
    for (int jj = 0; jj < b; ++jj)
      Gs[t][jj] = jj > t ? 0.0 : (ok_s[t] ? Cs[jj][piv_s[t]] : (jj == t ? 1.0 : 0.0));
  }
  __syncthreads();
  if (k < b) {  // column t of G^{-1} (rows t.. b-1; zero above)
    const int t = k;
    double x[kPivotMaxPivots];
#pragma unroll
    for (int i = 0; i < kPivotMaxPivots; ++i) {
      if (i < b) {
        double acc = i == t ? 1.0 : 0.0;
#pragma unroll
        for (int jj = 0; jj < i; ++jj)
          if (jj >= t) acc = fma(-Gs[i][jj], x[jj], acc);
        x[i] = i < t ? 0.0 : acc / Gs[i][i];
      }
    }
#pragma unroll
    for (int i = 0; i < kPivotMaxPivots; ++i) {
      if (i < b) {
        G[i * b + t] = Gs[i][t];
        Ginv[i * b + t] = (i == t && !ok_s[t]) ? 0.0 : x[i];
      }
    }
  }
}

}  // namespace cuda
}  // namespace gpfast
