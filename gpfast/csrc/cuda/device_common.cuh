// Device helpers shared by every gpfast kernel: point scaling, exponentials, vector stores, warp and block
// reductions. Free of torch headers (compiles with plain nvcc).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace gpfast {
namespace cuda {

constexpr unsigned kFull = 0xffffffffu;

// ------------------------------------------------------------------------------------------------------------
// Point scaling. The new kernels centre each block's points on a centre mu of the block's own choosing (distances
// do not depend on it, but the norm expansion's rounding grows with |z|^2, and data shifted far from the origin
// would otherwise lose digits) and scale them by w = sqrt(log2(e) / 2) / l, so that
//   log2 K/s = -|y1 - y2|^2 = 2 y1.y2 - |y1|^2 - |y2|^2   with y = (x - mu) w.
// The same x always gives the same y bit for bit (no contraction into an FMA), which is what makes
// K(x, x) = s exact: both points' y are equal and their difference is zero.
constexpr double kHalfLog2e = 0.72134752044448170368;       // log2(e) / 2
constexpr double kSqrtHalfLog2e = 0.84932180028801904272;   // sqrt(log2(e) / 2)

__device__ __forceinline__ float scale_point(float x, float mu, float w) { return __fmul_rn(__fsub_rn(x, mu), w); }
__device__ __forceinline__ double scale_point(double x, double mu, double w) {
  return __dmul_rn(__dsub_rn(x, mu), w);
}

// -|z_i - z_j|^2 from the raw float32 points (the tensor-core kernels' recomputation of near pairs): the same
// scaling as everywhere, so equal points give exactly 0
template <int D>
__device__ __forceinline__ float tc_neg_sq_dist(const float* xi, const float* xj, const float* mu, const float* w,
                                                int d) {
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < D; ++k) {
    if (k < d) {
      const float dk = scale_point(xi[k], mu[k], w[k]) - scale_point(xj[k], mu[k], w[k]);
      s = fmaf(dk, dk, s);
    }
  }
  return -s;
}

// 2^e for e <= 0 by the special-function unit (one MUFU.EX2; flushes results below 2^-126 to zero).
__device__ __forceinline__ float exp2_fast(float e) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(e));
  return r;
}
__device__ __forceinline__ double exp2_fast(double e) { return exp2(e); }

// exp(x) for x <= 0 in double, to about 2e-10 relative with kDegree = 8 (enough for a float32 result: its
// rounding is 6e-8) or to the last bit with 13 (the CPU kernels' exp_nonpositive, after Cody and Waite):
// n = round(x / ln2), r = x - n ln2 in [-ln2/2, ln2/2], exp(r) by its Taylor series, 2^n in the exponent bits.
// Below -708 it returns 0.
template <int kDegree>
__device__ __forceinline__ double exp_nonpositive(double x) {
  constexpr double kLog2e = 1.4426950408889634074;
  constexpr double kLn2Hi = 6.93147180369123816490e-01, kLn2Lo = 1.90821492927058770002e-10;
  constexpr double kShift = 6755399441055744.0;  // 1.5 * 2^52: adding it rounds to an integer
  const bool underflow = x < -708.0;
  const double xc = underflow ? -708.0 : x;
  const double shifted = fma(xc, kLog2e, kShift);
  const double nd = shifted - kShift;
  const double r = fma(-nd, kLn2Lo, fma(-nd, kLn2Hi, xc));
  static_assert(kDegree >= 1 && kDegree <= 13, "Taylor degree 1..13");
  constexpr double kInvFact[14] = {1.0,
                                   1.0,
                                   1.0 / 2.0,
                                   1.0 / 6.0,
                                   1.0 / 24.0,
                                   1.0 / 120.0,
                                   1.0 / 720.0,
                                   1.0 / 5040.0,
                                   1.0 / 40320.0,
                                   1.0 / 362880.0,
                                   1.0 / 3628800.0,
                                   1.0 / 39916800.0,
                                   1.0 / 479001600.0,
                                   1.0 / 6227020800.0};
  double p = kInvFact[kDegree];
#pragma unroll
  for (int k = kDegree - 1; k >= 0; --k) p = fma(p, r, kInvFact[k]);
  const int n = __double2loint(shifted);  // the low word of 1.5 * 2^52 + n is n (|n| < 2^20)
  const double scale = __hiloint2double((n + 1023) << 20, 0);  // 2^n, n >= -1022
  return underflow ? 0.0 : p * scale;
}

// 2^q in double for q <= 0, to about 1e-11 relative: n = round(q) (the 1.5 * 2^52 shift), f = q - n in [-1/2, 1/2]
// (exact), 2^f by its Taylor series to degree 9 (truncation 9.4e-12 on [-1/2, 1/2]), 2^n into the exponent bits.
// Zero below 2^-1022. For kernels whose exponent q is already in base 2: no multiplication by ln 2 and no
// two-part range reduction, 11 FP64 operations.
__device__ __forceinline__ double exp2_nonpositive(double q) {
  constexpr double kShift = 6755399441055744.0;  // 1.5 * 2^52: adding it rounds to an integer
  constexpr double kC[10] = {1.0,
                             0.6931471805599453,
                             0.2402265069591007,
                             0.055504108664821576,
                             0.009618129107628477,
                             0.0013333558146428441,
                             0.00015403530393381606,
                             1.5252733804059838e-05,
                             1.3215486790144305e-06,
                             1.0178086009239696e-07};  // (ln 2)^k / k!
  const bool underflow = q < -1022.0;
  const double qc = underflow ? -1022.0 : q;
  const double shifted = qc + kShift;
  const double f = qc - (shifted - kShift);
  double p = kC[9];
#pragma unroll
  for (int k = 8; k >= 0; --k) p = fma(p, f, kC[k]);
  const int n = __double2loint(shifted);  // the low word of 1.5 * 2^52 + n is n
  return underflow ? 0.0 : p * __hiloint2double((n + 1023) << 20, 0);
}

// The float32 kernels form their float32 weights 2^kExp2Bias too large and scale their sums back exactly in
// double: float32's normal range then reaches 2^-149, the plain float32 formula's smallest denormal, so no pair that
// formula keeps underflows there. The price is headroom: sums overflow for weights above about 1e28.
constexpr int kExp2Bias = 24;
constexpr double kExp2BiasScale = 16777216.0;  // 2^kExp2Bias

// ------------------------------------------------------------------------------------------------------------
// Stores. K is written once and never read back by the kernel that writes it: streaming (evict-first) stores of
// 16 bytes where the row pitch and pointer allow (the host checks), through inline PTX because nvcc merges a
// float4 store with a scalar fallback into four scalar stores.
template <typename T, int N>
__device__ __forceinline__ void store_streaming(T* p, const T (&v)[N]);

template <>
__device__ __forceinline__ void store_streaming<float, 4>(float* p, const float (&v)[4]) {
  asm volatile("st.global.cs.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3])
               : "memory");
}
template <>
__device__ __forceinline__ void store_streaming<float, 2>(float* p, const float (&v)[2]) {
  asm volatile("st.global.cs.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(v[0]), "f"(v[1]) : "memory");
}
template <>
__device__ __forceinline__ void store_streaming<double, 2>(double* p, const double (&v)[2]) {
  asm volatile("st.global.cs.v2.f64 [%0], {%1, %2};" ::"l"(p), "d"(v[0]), "d"(v[1]) : "memory");
}
template <>
__device__ __forceinline__ void store_streaming<double, 4>(double* p, const double (&v)[4]) {
  asm volatile("st.global.cs.v2.f64 [%0], {%1, %2};" ::"l"(p), "d"(v[0]), "d"(v[1]) : "memory");
  asm volatile("st.global.cs.v2.f64 [%0], {%1, %2};" ::"l"(p + 2), "d"(v[2]), "d"(v[3]) : "memory");
}

// Shared-memory vector loads of 4 values (16-byte aligned addresses only).
template <typename T>
__device__ __forceinline__ void load4(const T* p, T (&v)[4]);
template <>
__device__ __forceinline__ void load4<float>(const float* p, float (&v)[4]) {
  const float4 t = *reinterpret_cast<const float4*>(p);
  v[0] = t.x, v[1] = t.y, v[2] = t.z, v[3] = t.w;
}
template <>
__device__ __forceinline__ void load4<double>(const double* p, double (&v)[4]) {
  const double2 a = *reinterpret_cast<const double2*>(p), b = *reinterpret_cast<const double2*>(p + 2);
  v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
}

// Two doubles from 16-byte aligned shared memory, always re-read (the compiler may not reuse an earlier load of
// the same address: that would keep the values in registers).
__device__ __forceinline__ double2 lds_f64x2_volatile(const double* p) {
  double2 v;
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ld.shared.v2.f64 {%0, %1}, [%2];" : "=d"(v.x), "=d"(v.y) : "r"(addr));
  return v;
}

// D consecutive values (D a multiple of 4) from 16-byte aligned shared memory into registers.
template <typename T, int D>
__device__ __forceinline__ void load_row(const T* p, T (&v)[D]) {
  static_assert(D % 4 == 0, "rows are padded to a multiple of 4");
#pragma unroll
  for (int k = 0; k < D; k += 4) {
    T q[4];
    load4(p + k, q);
#pragma unroll
    for (int u = 0; u < 4; ++u) v[k + u] = q[u];
  }
}

// ------------------------------------------------------------------------------------------------------------
// Reductions. All are in an order fixed by the code, so results repeat run to run.
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) v += __shfl_xor_sync(kFull, v, off);
  return v;
}

// Warp reduce-scatter of D values (D a power of two <= 32): afterwards lane l holds the warp-wide sum of
// v[dim] in v[0], where dim is returned in `dim`. About 2D shuffles instead of 5D for D all-reduces. Written as a
// compile-time recursion so that every register index is a constant (a loop with a run-time count sent v to
// local memory: 42 local loads and 22 local stores per row at D = 32). Called as reduce_scatter_step<16, kCnt> with
// kCnt a multiple of 32, it leaves each lane the sums of the kCnt / 32 values dim .. dim + kCnt / 32 - 1 in
// v[0 .. kCnt / 32), pairwise in a fixed order.
template <int kOff, int kCnt, typename T, int D>
__device__ __forceinline__ void reduce_scatter_step(T (&v)[D], int lane, int& dim) {
  if constexpr (kOff >= 1) {
    if constexpr (kCnt > 1) {
      constexpr int kHalf = kCnt / 2;
      const bool upper = (lane & kOff) != 0;
#pragma unroll
      for (int k = 0; k < kHalf; ++k) {
        const T send = upper ? v[k] : v[k + kHalf];
        const T keep = upper ? v[k + kHalf] : v[k];
        v[k] = keep + __shfl_xor_sync(kFull, send, kOff);
      }
      if (upper) dim += kHalf;
      reduce_scatter_step<kOff / 2, kHalf>(v, lane, dim);
    } else {
      v[0] += __shfl_xor_sync(kFull, v[0], kOff);
      reduce_scatter_step<kOff / 2, 1>(v, lane, dim);
    }
  }
}

template <typename T, int D>
__device__ __forceinline__ T warp_reduce_scatter(T (&v)[D], int lane, int& dim) {
  static_assert(D >= 1 && D <= 32 && (D & (D - 1)) == 0, "D must be a power of two <= 32");
  dim = 0;
  reduce_scatter_step<16, D>(v, lane, dim);
  return v[0];
}

// The one block reduction of the gpfast kernels: N values per thread summed over the block, in a fixed order.
// Thread k < N writes the block's total of v[k] to dst[k] (global or shared memory). `scratch` holds
// (blockDim.x / 32) * N values. Every thread of the block must call it; it starts and ends with a barrier, so
// scratch may alias shared memory in use before or after.
template <int N, typename T>
__device__ __forceinline__ void block_sum(const T (&v)[N], T* scratch, T* dst) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  __syncthreads();
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const T s = warp_sum(v[k]);
    if (lane == 0) scratch[warp * N + k] = s;
  }
  __syncthreads();
  for (int k = threadIdx.x; k < N; k += blockDim.x) {
    T acc = T(0);
    for (int w = 0; w < nwarps; ++w) acc += scratch[w * N + k];
    dst[k] = acc;
  }
  __syncthreads();
}

}  // namespace cuda
}  // namespace gpfast
