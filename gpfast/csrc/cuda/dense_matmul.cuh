// K @ V for a stored K (rows, n), row-major (column stride 1, any row stride), and a skinny V (n, t), t <= 16: the
// training engine's stored-K product (target: >= 80% of 4.27 TB/s at n = 36k, t = 11). Memory-bound: K is read
// once, so the kernel's job is to keep enough 16-byte loads in flight and to keep everything else off the critical
// path.
//
// Work units. The columns are cut into S chunks of `chunk` columns (a multiple of 32 * VEC, at most CB) and the
// rows into groups of RB = 8 warps x R rows; a unit is (chunk s, group g), numbered chunk-major (u = s * groups + g).
// The grid is persistent (one block per SM at most blocks-per-SM) and block b takes the contiguous range of units
// [b U / G, (b + 1) U / G): every block gets the same number of units to within one, and consecutive units share
// their chunk, so a block stages V's rows of a chunk in shared memory (transposed, sV[c][j]) about once or twice in
// its life: barriers only then, never per tile, so the warps drift freely and keep their loads in flight.
//
// A warp's share of a unit: R rows x the chunk's columns. Lane l reads, per row, VEC consecutive columns
// (16 bytes: ld.global.nc, no L1 allocation) at (it * 32 + l) * VEC, so a warp reads 512 contiguous bytes per row per
// iteration; the next iteration's R loads are issued before this one's arithmetic (two register buffers). V's
// values for those VEC columns come from shared memory as one 16-byte load per right-hand side (conflict-free:
// consecutive lanes, consecutive 16 bytes) and serve all R rows. Accumulators R x TC per lane, reduced over the warp
// at the unit's end by a reduce-scatter (31 NP / 32 shuffles for NP values instead of 5 NP), in a fixed order.
//
// Output: unit (s, g) writes its rows of partial s, out[(s * rows + i) * t + c]; each element is written by exactly
// one unit. With S == 1 that is the result; otherwise dmm_sum_kernel adds the S partials in a fixed order (in
// double). Results are bitwise repeatable.
//
// Rows past `rows` (the last group) read row rows-1 again (finite values) and are never written; columns past n
// read zeros and meet zero V. Rows whose stride or start is not 16-byte aligned take the kAligned = false variant
// (scalar loads, same arithmetic).
//
// K may also be float16 with float32 V (TK = __half, T = float): eight values a 16-byte load, widened to float32
// before the same FMAs. For a K that tolerates 16-bit storage and is read far more often than written, such as the
// preconditioner's factor, it halves the bytes read.
#pragma once

#include <cuda_fp16.h>

#include <type_traits>

#include "device_common.cuh"

namespace gpfast {
namespace cuda {

constexpr int kDmmThreads = 256;
constexpr int kDmmWarps = kDmmThreads / 32;

template <typename T>
__host__ __device__ constexpr int dmm_vec() {
  return 16 / static_cast<int>(sizeof(T));
}

// Rows per warp: as many as the accumulators (R x TC) and two load buffers (2 x R x VEC) leave registers for
// (about 200 at one block of 256 threads per SM).
template <typename T, int TC, typename TK = T>
__host__ __device__ constexpr int dmm_rows_per_warp() {
  // a float16 K: its 16-byte loads widened once each to 8 floats a row (below), and V's 8 values a load
  if (sizeof(TK) == 2) return 4;
  if (sizeof(T) == 4) return TC <= 12 ? 8 : 6;
  return TC <= 4 ? 8 : (TC <= 8 ? 6 : 4);
}

// Columns of V staged per chunk: the largest of 4096 .. 512 whose TC x (CB + 4) values fit in 200 KiB.
template <typename T, int TC>
__host__ __device__ constexpr int dmm_chunk_cols() {
  int cb = 4096;
  while (cb > 512 && static_cast<long>(TC) * (cb + 4) * static_cast<long>(sizeof(T)) > 200L * 1024) cb /= 2;
  return cb;
}

template <typename T, int TC>
__host__ __device__ constexpr int dmm_smem_bytes() {
  return TC * (dmm_chunk_cols<T, TC>() + 4) * static_cast<int>(sizeof(T));
}

template <typename T, typename TK = T>
struct DmmArgs {
  const TK* K;    // (rows, n): element (i, j) at K[i * ldk + j]
  const T* V;     // (n, t) contiguous
  T* out;         // (S, rows, t) contiguous
  int64_t ldk;
  int64_t rows, n;
  int64_t chunk;   // columns per chunk: a multiple of 32 * VEC, at most CB
  int64_t groups;  // row groups: ceil(rows / (kDmmWarps * R))
  int64_t units;   // S * groups
  int t;
};

// 16 bytes of K, read once: not kept in L1 (V lives in shared memory; nothing else is reused).
__device__ __forceinline__ void ldg_stream(const float* p, float (&v)[4]) {
  asm volatile("ld.global.nc.L1::no_allocate.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3])
               : "l"(p));
}
__device__ __forceinline__ void ldg_stream(const double* p, double (&v)[2]) {
  asm volatile("ld.global.nc.L1::no_allocate.v2.f64 {%0, %1}, [%2];" : "=d"(v[0]), "=d"(v[1]) : "l"(p));
}

// VEC values from 16-byte aligned shared memory.
__device__ __forceinline__ void lds16(const float* p, float (&v)[4]) {
  const float4 q = *reinterpret_cast<const float4*>(p);
  v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
}
__device__ __forceinline__ void lds16(const double* p, double (&v)[2]) {
  const double2 q = *reinterpret_cast<const double2*>(p);
  v[0] = q.x, v[1] = q.y;
}
__device__ __forceinline__ void lds16(const float* p, float (&v)[8]) {  // a float16 K's 8 columns: two loads
  const float4 q0 = *reinterpret_cast<const float4*>(p), q1 = *reinterpret_cast<const float4*>(p + 4);
  v[0] = q0.x, v[1] = q0.y, v[2] = q0.z, v[3] = q0.w, v[4] = q1.x, v[5] = q1.y, v[6] = q1.z, v[7] = q1.w;
}

// A float16 K's 16-byte load: four 32-bit words of two values each (the registers of a float32 load), widened to
// float at use. (float and double K keep their values in registers as loaded.)
struct DmmHalfK {
  __device__ static void load(const __half* p, uint32_t (&w)[4]) {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                 : "l"(p));
  }
  __device__ static void set(uint32_t (&w)[4], int i, const __half* p, bool in) {  // value i of 8 (zero past the end)
    const uint32_t h = in ? static_cast<uint32_t>(__half_as_ushort(__ldg(p))) : 0u;
    w[i >> 1] = (i & 1) ? (w[i >> 1] | (h << 16)) : h;  // the even value first (the caller goes in order)
  }
  __device__ static float get(const uint32_t (&w)[4], int i) {
    const uint32_t h = (i & 1) ? (w[i >> 1] >> 16) : (w[i >> 1] & 0xffffu);
    return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
  }
};

template <typename T, int TC, bool kAligned, typename TK = T>
__global__ void __launch_bounds__(kDmmThreads, 1) dense_matmul_kernel(const DmmArgs<T, TK> a) {
  constexpr bool kHalf = !std::is_same_v<TK, T>;  // a float16 K with float V (the only other pairing)
  static_assert(!kHalf || (std::is_same_v<TK, __half> && std::is_same_v<T, float>), "K float16 with V float32");
  constexpr int VEC = dmm_vec<TK>();  // K's values a 16-byte load
  constexpr int R = dmm_rows_per_warp<T, TC, TK>();
  constexpr int CB = dmm_chunk_cols<T, TC>();
  constexpr int kPitch = CB + 4;  // 16-byte rows; (4 c + j) spreads the staging stores over the banks
  constexpr int RB = kDmmWarps * R;
  constexpr int N = R * TC, NP = (N + 31) / 32 * 32;
  constexpr int kStep = 32 * VEC;  // columns per warp iteration
  extern __shared__ __align__(16) unsigned char dmm_smem[];
  T* sV = reinterpret_cast<T*>(dmm_smem);  // [TC][kPitch]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int t = a.t;
  const int64_t u_begin = static_cast<int64_t>(blockIdx.x) * a.units / gridDim.x;
  const int64_t u_end = (static_cast<int64_t>(blockIdx.x) + 1) * a.units / gridDim.x;

  // right-hand sides t .. TC-1 are zero for good (the first staging's barrier orders these stores)
  for (int e = tid; e < (TC - t) * kPitch; e += kDmmThreads) sV[t * kPitch + e] = T(0);

  int64_t staged = -1;
  for (int64_t u = u_begin; u < u_end; ++u) {
    const int64_t s = u / a.groups, g = u - s * a.groups;
    const int64_t j0 = s * a.chunk;
    const int cols = static_cast<int>(min(a.chunk, a.n - j0));
    if (s != staged) {  // block-uniform
      __syncthreads();  // every warp is done with the previous chunk
      const T* v = a.V + j0 * t;
      for (int e = tid; e < CB * t; e += kDmmThreads) {
        const int jj = e / t, c = e - jj * t;
        sV[c * kPitch + jj] = jj < cols ? v[e] : T(0);
      }
      __syncthreads();
      staged = s;
    }
    const int64_t row0 = g * RB + static_cast<int64_t>(warp) * R;
    if (row0 >= a.rows) continue;  // warp-uniform; the next staging's barriers are still met

    const TK* krow[R];
#pragma unroll
    for (int r = 0; r < R; ++r) krow[r] = a.K + min(row0 + r, a.rows - 1) * a.ldk + j0;

    using Word = std::conditional_t<kHalf, uint32_t, T>;  // a register of a 16-byte load
    constexpr int W = kHalf ? 4 : VEC;
    auto load = [&](int it, Word (&buf)[R][W]) {
      const int lc = (it * 32 + lane) * VEC;
      if (kAligned && lc + VEC <= cols) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          if constexpr (kAligned && kHalf) DmmHalfK::load(krow[r] + lc, buf[r]);
          if constexpr (kAligned && !kHalf) ldg_stream(krow[r] + lc, buf[r]);
        }
      } else {
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            if constexpr (kHalf)
              DmmHalfK::set(buf[r], i, krow[r] + lc + i, lc + i < cols);
            else
              buf[r][i] = lc + i < cols ? __ldg(krow[r] + lc + i) : T(0);
          }
      }
    };

    T acc[R][TC];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int c = 0; c < TC; ++c) acc[r][c] = T(0);

    auto compute = [&](int it, const Word (&buf)[R][W]) {
      const T* vrow = sV + (it * 32 + lane) * VEC;
      // a float16 K widened once a value (one conversion per VEC x TC FMAs), not at each of its TC uses
      T kw[kHalf ? R : 1][kHalf ? VEC : 1];
      if constexpr (kHalf) {
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int i = 0; i < VEC; ++i) kw[r][i] = DmmHalfK::get(buf[r], i);
      }
#pragma unroll
      for (int c = 0; c < TC; ++c) {
        T v[VEC];
        lds16(vrow + c * kPitch, v);
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            if constexpr (kHalf)
              acc[r][c] = fma(kw[r][i], v[i], acc[r][c]);
            else
              acc[r][c] = fma(buf[r][i], v[i], acc[r][c]);
          }
      }
    };

    const int nit = (cols + kStep - 1) / kStep;
    Word b0[R][W], b1[R][W];
    load(0, b0);
    for (int it = 0; it < nit; it += 2) {  // two buffers, no register copies
      if (it + 1 < nit) load(it + 1, b1);
      compute(it, b0);
      if (it + 2 < nit) load(it + 2, b0);
      if (it + 1 < nit) compute(it + 1, b1);
    }

    T red[NP];
#pragma unroll
    for (int k = 0; k < NP; ++k) red[k] = k < N ? acc[k / TC][k % TC] : T(0);
    int base = 0;
    reduce_scatter_step<16, NP>(red, lane, base);  // this lane: the sums of red[base .. base + NP / 32)
    T* out = a.out + (s * a.rows) * t;
#pragma unroll
    for (int k = 0; k < NP / 32; ++k) {
      const int idx = base + k;
      const int r = idx / TC, c = idx - r * TC;
      if (idx < N && c < t && row0 + r < a.rows) out[(row0 + r) * t + c] = red[k];
    }
  }
}

// out[i] = sum over s of part[s * count + i], in double, in order of s.
template <typename T>
__global__ void dmm_sum_kernel(const T* __restrict__ part, T* __restrict__ out, int64_t count, int splits) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    double acc = 0.0;
    for (int s = 0; s < splits; ++s) acc += static_cast<double>(part[s * count + i]);
    out[i] = static_cast<T>(acc);
  }
}

}  // namespace cuda
}  // namespace gpfast
