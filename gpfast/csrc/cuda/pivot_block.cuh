// Device code of the pivoted Cholesky's block pivots (torch-free): one thread block of kPivotThreads threads runs
// the greedy steps of cpu/pivot_block.cpp on the candidates' c x c residual in shared memory. A block of pivots was
// ~20 small kernels per pivot before (argmax, gathers, a GEMV, updates); here it is one launch.
#pragma once

#include <cstdint>

namespace gpfast {
namespace cuda {

constexpr int kPivotThreads = 64;  // one thread per candidate: c <= 64

__global__ void pivot_block_kernel(const double* __restrict__ S, const double* __restrict__ d,
                                   const double* __restrict__ floor_ptr, int c, int b, int64_t* __restrict__ piv,
                                   double* __restrict__ C, double* __restrict__ ok) {
  __shared__ double R[kPivotThreads][kPivotThreads + 1];  // +1: rows on different banks
  __shared__ double dl[kPivotThreads];
  __shared__ double col[kPivotThreads];
  __shared__ int taken[kPivotThreads];
  __shared__ int p_s;
  __shared__ double s_s;
  __shared__ int good_s;
  const int k = threadIdx.x;
  for (int idx = k; idx < c * c; idx += blockDim.x) R[idx / c][idx % c] = S[idx];
  if (k < c) {
    dl[k] = d[k];
    taken[k] = 0;
  }
  __syncthreads();
  const double fl = *floor_ptr;
  for (int j = 0; j < b; ++j) {
    if (k == 0) {  // c <= 64 comparisons: a serial scan keeps torch.argmax's first-on-ties rule simply
      int p = -1;
      for (int q = 0; q < c; ++q)
        if (!taken[q] && (p < 0 || dl[q] > dl[p])) p = q;
      const double pivot = dl[p];
      good_s = pivot > fl;
      s_s = sqrt(fmax(pivot, fl));
      p_s = p;
      taken[p] = 1;
      piv[j] = p;
      ok[j] = good_s ? 1.0 : 0.0;
    }
    __syncthreads();
    const int p = p_s;
    const double s = s_s;
    if (k < c) {
      const double v = good_s ? (k == p ? s : R[k][p] / s) : 0.0;
      col[k] = v;
      C[k * b + j] = v;
    }
    __syncthreads();
    if (k < c) {
      const double ck = col[k];
      for (int l = 0; l < c; ++l) R[k][l] -= ck * col[l];
      dl[k] = k == p ? 0.0 : fmax(dl[k] - ck * ck, 0.0);
    }
    __syncthreads();
  }
}

}  // namespace cuda
}  // namespace gpfast
