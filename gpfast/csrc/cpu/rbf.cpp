// CPU implementations of the gpfast ops.
//
// Every op works on z = (x - mu) / l in double, whatever the input dtype (mu: the mean of x2's rows), a tile of kPanel
// rows of x1 by kTile columns of x2 at a time. Inside a tile, the squared distances (by differences) and every
// product with the tile are small GEMMs in register tiles (axpy_block), the exp is a branch-free polynomial, and all
// of it is compiled twice, portably and for AVX2+FMA, the second used when the CPU has both. Double throughout keeps a
// float32 result as close to the float64 reference as its own rounding allows: rounding z to float32 would put one
// error on a whole row of K, and those errors do not average out in sums over K (the outputscale gradient of a loss
// with signed weights is the usual victim), where the plain float32 formula's per-pair errors do. Every sum runs in an
// order fixed by the shapes (tiles, fixed row chunks, explicit lanes), never by the number of threads, so results
// repeat run to run; the AVX2 build may differ from the portable one in the last bits (it contracts multiply-adds into
// FMAs).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "../common.h"

#if defined(__GNUC__) && defined(__x86_64__)
#define RBF_X86_DISPATCH 1
#endif
#define ALWAYS_INLINE inline __attribute__((always_inline))

namespace gpfast {
namespace {

constexpr int64_t kLanes = 8;    // independent partial sums per reduction, added in lane order at the end
constexpr int64_t kPanel = 64;   // rows of a tile
constexpr int64_t kTile = 128;   // columns of a tile (a multiple of 8): a tile of doubles takes 64 KB, in L2
constexpr int64_t kChunks = 16;  // fixed row chunks of the one-pass backward, whatever the number of threads

// exp(x) for x <= 0, branch-free so that loops over it vectorise; NaN passes through. x / ln2 is rounded to the
// nearest integer n by adding and subtracting 1.5 * 2^52, r = x - n ln2 (ln2 in two parts, after Cody and Waite)
// lies in [-ln2/2, ln2/2], exp(r) is its Taylor series to r^13 (truncation below 2e-17 relative), and 2^n is
// built in the exponent bits. Below -708, where 2^n would leave the normal range, it returns 0 (std::exp gives a
// subnormal under 3.4e-308 there).
ALWAYS_INLINE double exp_nonpositive(double x) {
  constexpr double kLog2e = 1.4426950408889634074;
  constexpr double kLn2Hi = 6.93147180369123816490e-01, kLn2Lo = 1.90821492927058770002e-10;
  constexpr double kShift = 6755399441055744.0;        // 1.5 * 2^52
  constexpr int64_t kShiftBits = 0x4338000000000000;   // its bit pattern
  const bool underflow = x < -708.0;
  const double xc = underflow ? -708.0 : x;
  const double shifted = xc * kLog2e + kShift;
  const double nd = shifted - kShift;
  const double r = (xc - nd * kLn2Hi) - nd * kLn2Lo;
  double p = 1.0 / 6227020800.0;  // 1/13!
  p = p * r + 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  int64_t bits;
  std::memcpy(&bits, &shifted, sizeof bits);
  const int64_t scale_bits = (bits - kShiftBits + 1023) << 52;  // 2^n, n >= -1022
  double scale;
  std::memcpy(&scale, &scale_bits, sizeof scale);
  return underflow ? 0.0 : p * scale;
}

// at::parallel_for's grain for items of `work` operations each: a parallel region costs microseconds (far more when
// the machine is oversubscribed), so work is spread over threads only in portions of about 32k operations. Results
// never depend on it: every split below is either fixed by the shapes or row by row.
int64_t grain_for(int64_t work) { return std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, work)); }

// The kLanes partial sums of a reduction, added in lane order.
ALWAYS_INLINE double lane_sum(const double* lanes) {
  double sum = 0;
  for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

// How the kernels run: the instruction set, and the memory the one-pass backward may take for its column sums
// (see ChunkPlan). The ops run the default path; the private op _rbf_cpu_path runs any other, for the tests that
// compare the builds and the two backward forms.
struct CpuPath {
  bool avx2_fma;
  int64_t column_buffer_bytes;
};

bool cpu_has_avx2_fma() {
#ifdef RBF_X86_DISPATCH
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return ok;
#else
  return false;
#endif
}

constexpr int64_t kColumnBufferBytes = int64_t{256} << 20;

CpuPath default_path() { return {cpu_has_avx2_fma(), kColumnBufferBytes}; }

// Runs kernel(begin, end), built for AVX2+FMA when the path asks for it (only on a CPU that has both). Kernels
// inline everything they call, so the whole loop nest is compiled for the caller's target.
template <class Kernel>
void run_portable(const Kernel& kernel, int64_t begin, int64_t end) {
  kernel(begin, end);
}
#ifdef RBF_X86_DISPATCH
template <class Kernel>
__attribute__((target("avx2,fma"))) void run_avx2(const Kernel& kernel, int64_t begin, int64_t end) {
  kernel(begin, end);
}
#endif
template <class Kernel>
void run(const CpuPath& path, const Kernel& kernel, int64_t begin, int64_t end) {
#ifdef RBF_X86_DISPATCH
  if (path.avx2_fma) return run_avx2(kernel, begin, end);
#endif
  run_portable(kernel, begin, end);
}

// ---------------------------------------------------------------------------------------------------------------
// Small GEMMs in registers. MKL's dgemm on the same blocks ran at 1-9 GFMA/s on the 2-core EPYC CI machine, several
// times slower than these loops (and its results may depend on the thread count).

typedef double v4d __attribute__((vector_size(32)));
constexpr int64_t kW = 4;  // doubles per v4d

ALWAYS_INLINE int64_t round_up(int64_t x, int64_t k) { return (x + k - 1) / k * k; }
ALWAYS_INLINE void load4(v4d& v, const double* p) { std::memcpy(&v, p, sizeof v); }
ALWAYS_INLINE void store4(double* p, const v4d& v) { std::memcpy(p, &v, sizeof v); }

// out[r][v] (+)= sum_{q < Q} a[r * ars + q * aqs] * M[q * ldm + v] for r < R and the NV * kW columns v, in an R x NV
// register tile; with kSquaredDiff, the terms are (a[..] - M[..])^2 instead. Each output is summed in q order, so a
// row's result does not depend on the tile it falls in.
template <int R, int NV, bool kAccumulate, bool kSquaredDiff = false>
ALWAYS_INLINE void axpy_tile(const double* a, int64_t ars, int64_t aqs, const double* M, int64_t ldm, int64_t Q,
                             double* out, int64_t ldo) {
  v4d acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      if (kAccumulate) {
        load4(acc[r][v], out + r * ldo + v * kW);
      } else {
        acc[r][v] = v4d{0.0, 0.0, 0.0, 0.0};
      }
    }
  for (int64_t q = 0; q < Q; ++q) {
    v4d m[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) load4(m[v], M + q * ldm + v * kW);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const double s = a[r * ars + q * aqs];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        if (kSquaredDiff) {
          const v4d diff = s - m[v];
          acc[r][v] += diff * diff;
        } else {
          acc[r][v] += s * m[v];
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) store4(out + r * ldo + v * kW, acc[r][v]);
}

template <int R, int NV, bool kAccumulate, bool kSquaredDiff>
ALWAYS_INLINE void axpy_rows_tail(int64_t rows, const double* a, int64_t ars, int64_t aqs, const double* M,
                                  int64_t ldm, int64_t Q, double* out, int64_t ldo) {
  if constexpr (R > 0) {
    if (rows == R) return axpy_tile<R, NV, kAccumulate, kSquaredDiff>(a, ars, aqs, M, ldm, Q, out, ldo);
    axpy_rows_tail<R - 1, NV, kAccumulate, kSquaredDiff>(rows, a, ars, aqs, M, ldm, Q, out, ldo);
  }
}

template <int R, int NV, bool kAccumulate, bool kSquaredDiff>
ALWAYS_INLINE void axpy_rows(int64_t rows, const double* a, int64_t ars, int64_t aqs, const double* M, int64_t ldm,
                             int64_t Q, double* out, int64_t ldo) {
  int64_t r = 0;
  for (; r + R <= rows; r += R)
    axpy_tile<R, NV, kAccumulate, kSquaredDiff>(a + r * ars, ars, aqs, M, ldm, Q, out + r * ldo, ldo);
  if (r < rows)
    axpy_rows_tail<R - 1, NV, kAccumulate, kSquaredDiff>(rows - r, a + r * ars, ars, aqs, M, ldm, Q, out + r * ldo,
                                                         ldo);
}

// out (rows x nvec * kW, row stride ldo) (+)= A M, where A[r][q] = a[r * ars + q * aqs] and M is Q x nvec * kW (row
// stride ldm): a small GEMM, in register tiles of 4 x 3, 6 x 2 or 8 x 1 vectors (12 or 8 of the 16 AVX2 registers
// hold accumulators).
template <bool kAccumulate, bool kSquaredDiff = false>
ALWAYS_INLINE void axpy_block(int64_t rows, int64_t nvec, const double* a, int64_t ars, int64_t aqs, const double* M,
                              int64_t ldm, int64_t Q, double* out, int64_t ldo) {
  int64_t v = 0;
  for (; v + 3 <= nvec; v += 3)
    axpy_rows<4, 3, kAccumulate, kSquaredDiff>(rows, a, ars, aqs, M + v * kW, ldm, Q, out + v * kW, ldo);
  M += v * kW;
  out += v * kW;
  if (nvec - v == 2) axpy_rows<6, 2, kAccumulate, kSquaredDiff>(rows, a, ars, aqs, M, ldm, Q, out, ldo);
  if (nvec - v == 1) axpy_rows<8, 1, kAccumulate, kSquaredDiff>(rows, a, ars, aqs, M, ldm, Q, out, ldo);
}

// One point set, centred, scaled and laid out for the kernels: z (B, n, dp) row-major and zt (B, dp, np) transposed,
// double, with d and n rounded up to dp (a multiple of kW) and np (a multiple of 8) by zeros.
struct Side {
  at::Tensor z, zt;
  int64_t n, np;
  const double* zp() const { return z.data_ptr<double>(); }
  const double* ztp() const { return zt.data_ptr<double>(); }
};

template <typename T>
Side scaled_side(const at::Tensor& x, const double* mu, const double* l, int64_t dp) {
  const int64_t B = x.size(0), n = x.size(1), d = x.size(2), np = round_up(n, 8);
  const auto opts = x.options().dtype(at::kDouble);
  Side side{at::zeros({B, n, dp}, opts), at::zeros({B, dp, np}, opts), n, np};
  const auto xa = x.accessor<T, 3>();
  double *z = side.z.data_ptr<double>(), *zt = side.zt.data_ptr<double>();
  at::parallel_for(0, B * n, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / n, i = r % n;
      for (int64_t k = 0; k < d; ++k) {
        const double v = (static_cast<double>(xa[b][i][k]) - mu[b * d + k]) / l[b * d + k];
        z[r * dp + k] = v;
        zt[(b * dp + k) * np + i] = v;
      }
    }
  });
  return side;
}

// Both sides of an op: mu = the mean of x2's rows (per batch and feature), then the scaled sides. Differences do not
// see mu, so K(x, x) is still exactly s; the backward's sums cancel less with it. mu comes from x2 alone so that a row
// of x1 gets the same result, bit for bit, whichever other rows come with it (gpfast.distributed splits x1's rows
// over the ranks).
template <typename T>
std::pair<Side, Side> scaled_sides(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& l64, int64_t dp) {
  const int64_t B = x1.size(0), m = x2.size(1), d = x1.size(2);
  std::vector<double> mu(static_cast<size_t>(B * d), 0.0);
  const auto a2 = x2.accessor<T, 3>();
  for (int64_t b = 0; b < B; ++b) {
    double* mb = mu.data() + b * d;
    for (int64_t j = 0; j < m; ++j)
      for (int64_t k = 0; k < d; ++k) mb[k] += static_cast<double>(a2[b][j][k]);
    // a non-finite mean (a NaN or inf among the points) falls back to 0: a bad point then spoils only its own row
    // or column, as it would without centring
    for (int64_t k = 0; k < d; ++k) mb[k] = std::isfinite(mb[k]) && m > 0 ? mb[k] / static_cast<double>(m) : 0.0;
  }
  const double* l = l64.data_ptr<double>();
  return {scaled_side<T>(x1, mu.data(), l, dp), scaled_side<T>(x2, mu.data(), l, dp)};
}

// ---------------------------------------------------------------------------------------------------------------
// Forward ops

// Rows [begin, end) (of B * n) of K = s exp(-|z1_i - z2_j|^2 / 2).
template <typename T>
struct CovarianceRows {
  const double *z1, *z2t;  // (B, n, dp), (B, dp, mp)
  const T* s;
  T* out;
  int64_t n, m, mp, d, dp;
  ALWAYS_INLINE void operator()(int64_t begin, int64_t end) const {
    std::vector<double> buf(static_cast<size_t>(kPanel * kTile));
    double* dist = buf.data();
    for (int64_t p0 = begin; p0 < end;) {
      const int64_t b = p0 / n, P = std::min({kPanel, end - p0, n - p0 % n});
      const double sb = static_cast<double>(s[b]);
      for (int64_t j0 = 0; j0 < m; j0 += kTile) {
        const int64_t C = std::min(kTile, m - j0);
        axpy_block<false, true>(P, round_up(C, kW) / kW, z1 + p0 * dp, dp, 1, z2t + b * dp * mp + j0, mp, d, dist,
                                kTile);
        for (int64_t i = 0; i < P; ++i) {
          const double* di = dist + i * kTile;
          T* o = out + (p0 + i) * m + j0;
          for (int64_t j = 0; j < C; ++j) o[j] = static_cast<T>(sb * exp_nonpositive(-0.5 * di[j]));
        }
      }
      p0 += P;
    }
  }
};

// Rows [begin, end) of K V, from V (B, m, tp) in double, zero-padded to tp columns (a multiple of kW).
template <typename T>
struct MatmulRows {
  const double *z1, *z2t, *v;
  const T* s;
  T* out;
  int64_t n, m, mp, d, dp, t, tp;
  ALWAYS_INLINE void operator()(int64_t begin, int64_t end) const {
    std::vector<double> buf(static_cast<size_t>(kPanel * (kTile + tp)));
    double* E = buf.data();
    double* acc = E + kPanel * kTile;  // (P, tp)
    for (int64_t p0 = begin; p0 < end;) {
      const int64_t b = p0 / n, P = std::min({kPanel, end - p0, n - p0 % n});
      std::fill_n(acc, P * tp, 0.0);
      for (int64_t j0 = 0; j0 < m; j0 += kTile) {
        const int64_t C = std::min(kTile, m - j0);
        axpy_block<false, true>(P, round_up(C, kW) / kW, z1 + p0 * dp, dp, 1, z2t + b * dp * mp + j0, mp, d, E,
                                kTile);
        for (int64_t i = 0; i < P; ++i) {
          double* e = E + i * kTile;
          for (int64_t j = 0; j < C; ++j) e[j] = exp_nonpositive(-0.5 * e[j]);
        }
        axpy_block<true>(P, tp / kW, E, kTile, 1, v + (b * m + j0) * tp, tp, C, acc, tp);  // acc += E V
      }
      const double sb = static_cast<double>(s[b]);
      for (int64_t i = 0; i < P; ++i)
        for (int64_t c = 0; c < t; ++c) out[(p0 + i) * t + c] = static_cast<T>(sb * acc[i * tp + c]);
      p0 += P;
    }
  }
};

// ---------------------------------------------------------------------------------------------------------------
// The backward ops, in GEMM form (the formulation of the CUDA kernels). With z = (x - mu) / l, where mu is
// the mean of x2's rows (differences do not see it; the sums below cancel less with it: by a factor of |z| /
// |z1 - z2|, squared for the lengthscale), U = G o K / s (dLoss/dK times the unscaled kernel), r = U 1, c = U^T 1:
//   dLoss/dx1 = s (U Z2 - diag(r) Z1) / l,   dLoss/dx2 = s (U^T Z1 - diag(c) Z2) / l,
//   dLoss/dl_k = s / l_k sum_ij U_ij (z1_ik - z2_jk)^2
//              = s / l_k (sum_i z1_ik (r_i z1_ik - 2 (U Z2)_ik) + sum_j c_j z2_jk^2),
//   dLoss/ds = sum_ij U_ij.
// U is formed a tile at a time and each product with U is an axpy_block over the tile. The distances inside K are
// taken by differences, not by the expansion |a|^2 + |b|^2 - 2 a.b: the expansion puts an error of eps |z|^2 on each
// exponent, 1e-9 relative at a lengthscale of 1e-3 on standardised data, which float64 results would show; this way K
// is the forward's, bit for bit. The lengthscale gradient's identity keeps an error of about eps (spread of z)^2 /
// (distance of the pairs that matter)^2: far below float32's rounding, about 1e-12 relative in float64 at lengthscale
// 0.05 on standardised data (1e-9 at 1e-3).

// Weights dLoss/dK of the covariance op, G (B, rows, cols) (for the rows of x2, G transposed and made contiguous):
// w[i][j] = G[b, i0 + i, j0 + j] for j < C, zero up to Cp.
template <typename T>
struct DenseWeights {
  const T* g;
  int64_t rows, cols;
  ALWAYS_INLINE void operator()(int64_t b, int64_t i0, int64_t P, int64_t j0, int64_t C, int64_t Cp, double* w,
                                int64_t ldw) const {
    for (int64_t i = 0; i < P; ++i) {
      const T* p = g + (b * rows + i0 + i) * cols + j0;
      double* wi = w + i * ldw;
      for (int64_t j = 0; j < C; ++j) wi[j] = static_cast<double>(p[j]);
      for (int64_t j = C; j < Cp; ++j) wi[j] = 0.0;
    }
  }
};

// Weights of the K V op, dLoss/dK_ij = G_i . V_j, from G (B, rows, t) and V^T (B, t, colsp) in double, V^T
// zero-padded to colsp columns (so the padding gets zero weight).
struct ProductWeights {
  const double *g, *vt;
  int64_t rows, colsp, t;
  ALWAYS_INLINE void operator()(int64_t b, int64_t i0, int64_t P, int64_t j0, int64_t, int64_t Cp, double* w,
                                int64_t ldw) const {
    axpy_block<false>(P, Cp / kW, g + (b * rows + i0) * t, t, 1, vt + b * t * colsp + j0, colsp, t, w, ldw);
  }
};

// Rows [begin, end) (of B * nr) of U against all columns: rw += U zc (skipped when null) and rsum = U 1 for
// these rows; when col / csum are set (chunk buffers holding batches b0 on), also col (., dp, ncp) += U^T zr and
// csum (., ncp) += U^T 1, the column side.
template <class Weights>
struct BackwardRows {
  const double *zr, *zc, *zct;
  int64_t nr, nc, ncp, d, dp;
  Weights weights;
  double *rw, *rsum, *col, *csum;
  int64_t b0;
  ALWAYS_INLINE void operator()(int64_t begin, int64_t end) const {
    std::vector<double> buf(static_cast<size_t>(2 * kPanel * kTile));
    double* U = buf.data();
    double* w = U + kPanel * kTile;
    double lanes[kPanel][kLanes];
    for (int64_t p0 = begin; p0 < end;) {
      const int64_t b = p0 / nr, i0 = p0 % nr, P = std::min({kPanel, end - p0, nr - i0});
      const double* z = zr + p0 * dp;
      for (int64_t i = 0; i < P; ++i) std::fill_n(lanes[i], kLanes, 0.0);
      for (int64_t j0 = 0; j0 < nc; j0 += kTile) {
        const int64_t C = std::min(kTile, nc - j0), Cp = round_up(C, 8);
        axpy_block<false, true>(P, Cp / kW, z, dp, 1, zct + b * dp * ncp + j0, ncp, d, U, kTile);  // |zr - zc|^2
        weights(b, i0, P, j0, C, Cp, w, kTile);
        for (int64_t i = 0; i < P; ++i) {
          double* u = U + i * kTile;
          const double* wi = w + i * kTile;
          for (int64_t j = 0; j < Cp; ++j) u[j] = wi[j] * exp_nonpositive(-0.5 * u[j]);
          double part[kLanes];
          std::copy_n(lanes[i], kLanes, part);
          for (int64_t j = 0; j < Cp; j += kLanes)
            for (int64_t l = 0; l < kLanes; ++l) part[l] += u[j + l];
          std::copy_n(part, kLanes, lanes[i]);
        }
        if (csum) {
          double* cs = csum + (b - b0) * ncp + j0;
          for (int64_t i = 0; i < P; ++i)
            for (int64_t j = 0; j < Cp; ++j) cs[j] += U[i * kTile + j];
        }
        if (rw) axpy_block<true>(P, dp / kW, U, kTile, 1, zc + (b * nc + j0) * dp, dp, C, rw + p0 * dp, dp);
        if (col) axpy_block<true>(dp, Cp / kW, z, 1, dp, U, kTile, P, col + (b - b0) * dp * ncp + j0, ncp);
      }
      for (int64_t i = 0; i < P; ++i) rsum[p0 + i] = lane_sum(lanes[i]);
      p0 += P;
    }
  }
};

// The one-pass backward keeps each row chunk's column sums in its own buffer, for the batches the chunk touches
// (doubles per batch: width). Above the path's budget (256 MB by default; the tests set 0 to reach it) the column
// side comes from a second pass over the rows of the transposed problem instead.
struct ChunkPlan {
  int64_t grain, chunks, width;
  std::vector<int64_t> first_batch, offset;  // per chunk; offset in doubles, offset[chunks] = the total
  bool fits;
};

ChunkPlan plan_chunks(int64_t B, int64_t n, int64_t width, int64_t max_bytes) {
  ChunkPlan plan;
  const int64_t rows = B * n;
  plan.grain = std::max<int64_t>(1, (rows + kChunks - 1) / kChunks);
  plan.chunks = (rows + plan.grain - 1) / plan.grain;
  plan.width = width;
  plan.offset.push_back(0);
  for (int64_t c = 0; c < plan.chunks; ++c) {
    const int64_t b_lo = c * plan.grain / n, b_hi = (std::min(rows, (c + 1) * plan.grain) - 1) / n;
    plan.first_batch.push_back(b_lo);
    plan.offset.push_back(plan.offset.back() + (b_hi - b_lo + 1) * width);
  }
  plan.fits = plan.offset.back() * static_cast<int64_t>(sizeof(double)) <= max_bytes;
  return plan;
}

// The row sums rw1 = U Z2 (B, n, dp), r1 = U 1 (B, n) and the column sums rw2 = U^T Z1 (B, m, dp; only with
// x_grads) and r2 = U^T 1 (B, m). by_col (the weights seen from x2's rows) is made only if a second pass needs it.
template <class Weights, class MakeByCol>
void backward_sums(const CpuPath& path, const Side& s1, const Side& s2, int64_t B, int64_t d, int64_t dp,
                   const Weights& by_row, const MakeByCol& make_by_col, bool x_grads, double* rw1, double* r1,
                   double* rw2, double* r2) {
  const int64_t n = s1.n, m = s2.n, mp = s2.np;
  BackwardRows<Weights> pass{s1.zp(), s2.zp(), s2.ztp(), n, m, mp, d, dp, by_row, rw1, r1, nullptr, nullptr, 0};
  const int64_t per_batch = (x_grads ? dp + 1 : 1) * mp;  // col (dp, mp) and csum (mp)
  const ChunkPlan plan = plan_chunks(B, n, per_batch, path.column_buffer_bytes);
  if (plan.fits) {
    std::vector<double> buf(static_cast<size_t>(plan.offset.back()), 0.0);
    at::parallel_for(0, plan.chunks, grain_for(plan.grain * m * (dp + 8)), [&](int64_t cb, int64_t ce) {
      for (int64_t c = cb; c < ce; ++c) {
        BackwardRows<Weights> chunk = pass;
        double* base = buf.data() + plan.offset[c];
        const int64_t batches = (plan.offset[c + 1] - plan.offset[c]) / per_batch;
        chunk.col = x_grads ? base : nullptr;
        chunk.csum = base + (x_grads ? batches * dp * mp : 0);
        chunk.b0 = plan.first_batch[c];
        run(path, chunk, c * plan.grain, std::min(B * n, (c + 1) * plan.grain));
      }
    });
    // Column sums: each chunk's buffer added in chunk order. q runs over (b, k), k = dp standing for csum.
    const int64_t K1 = x_grads ? dp + 1 : 1;
    at::parallel_for(0, B * K1, grain_for(m * (plan.chunks / B + 2)), [&](int64_t begin, int64_t end) {
      std::vector<double> acc(static_cast<size_t>(m));
      for (int64_t q = begin; q < end; ++q) {
        const int64_t b = q / K1, k = x_grads ? q % K1 : dp;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t c = b * n / plan.grain; c < plan.chunks && plan.first_batch[c] <= b; ++c) {
          const int64_t batches = (plan.offset[c + 1] - plan.offset[c]) / per_batch, bb = b - plan.first_batch[c];
          if (bb >= batches) continue;
          const double* base = buf.data() + plan.offset[c];
          const double* src = k < dp ? base + (bb * dp + k) * mp : base + (x_grads ? batches * dp * mp : 0) + bb * mp;
          for (int64_t j = 0; j < m; ++j) acc[j] += src[j];
        }
        if (k < dp) {
          for (int64_t j = 0; j < m; ++j) rw2[(b * m + j) * dp + k] = acc[j];
        } else {
          std::copy_n(acc.data(), m, r2 + b * m);
        }
      }
    });
    return;
  }
  at::parallel_for(0, B * n, std::max(kPanel, grain_for(m * (dp + 8))),
                   [&](int64_t begin, int64_t end) { run(path, pass, begin, end); });
  const auto by_col = make_by_col();
  BackwardRows<std::decay_t<decltype(by_col)>> cols{s2.zp(), s1.zp(), s1.ztp(), m, n, s1.np, d, dp, by_col,
                                                    x_grads ? rw2 : nullptr, r2, nullptr, nullptr, 0};
  at::parallel_for(0, B * m, std::max(kPanel, grain_for(n * (dp + 8))),
                   [&](int64_t begin, int64_t end) { run(path, cols, begin, end); });
}

// (gx1, gx2, glengthscale, goutputscale) from the sums, by the formulas at the top of this section; gx1 and gx2 stay
// empty without x_grads. One batch per task, each sum in row order.
template <typename T>
void assemble_grads(const Side& s1, const Side& s2, int64_t B, int64_t d, int64_t dp, const double* rw1,
                    const double* r1, const double* rw2, const double* r2, const double* l, const T* s, bool x_grads,
                    at::Tensor& gx1, at::Tensor& gx2, at::Tensor& gl, at::Tensor& gs) {
  const int64_t n = s1.n, m = s2.n;
  const double *z1 = s1.zp(), *z2 = s2.zp();
  T *px1 = x_grads ? gx1.data_ptr<T>() : nullptr, *px2 = x_grads ? gx2.data_ptr<T>() : nullptr;
  T *pl = gl.data_ptr<T>(), *ps = gs.data_ptr<T>();
  at::parallel_for(0, B, grain_for((n + m) * d), [&](int64_t bb, int64_t be) {
    std::vector<double> scale(static_cast<size_t>(d)), acc(static_cast<size_t>(d));
    for (int64_t b = bb; b < be; ++b) {
      const double sb = static_cast<double>(s[b]);
      for (int64_t k = 0; k < d; ++k) scale[k] = sb / l[b * d + k];
      std::fill(acc.begin(), acc.end(), 0.0);
      double total = 0;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t row = b * n + i;
        const double r = r1[row];
        total += r;
        for (int64_t k = 0; k < d; ++k) {
          const double z = z1[row * dp + k], R = rw1[row * dp + k];
          if (px1) px1[row * d + k] = static_cast<T>(scale[k] * (R - r * z));
          acc[k] += z * (r * z - 2 * R);
        }
      }
      for (int64_t j = 0; j < m; ++j) {
        const int64_t row = b * m + j;
        const double c = r2[row];
        for (int64_t k = 0; k < d; ++k) {
          const double z = z2[row * dp + k];
          if (px2) px2[row * d + k] = static_cast<T>(scale[k] * (rw2[row * dp + k] - c * z));
          acc[k] += c * z * z;
        }
      }
      for (int64_t k = 0; k < d; ++k) pl[b * d + k] = static_cast<T>(scale[k] * acc[k]);
      ps[b] = static_cast<T>(total);
    }
  });
}

using Grads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Output tensors of a backward op: the point gradients are (0,) without x_grads (the gradient mask).
Grads empty_grads(const at::Tensor& x1, const at::Tensor& x2, bool x_grads) {
  const int64_t B = x1.size(0), d = x1.size(2);
  return {x_grads ? at::zeros_like(x1, at::MemoryFormat::Contiguous) : at::empty({0}, x1.options()),
          x_grads ? at::zeros_like(x2, at::MemoryFormat::Contiguous) : at::empty({0}, x1.options()),
          at::zeros({B, d}, x1.options()), at::zeros({B}, x1.options())};
}

// The shared body of both backward ops once the weights are known.
template <typename T, class Weights, class MakeByCol>
Grads backward(const CpuPath& path, const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
               const at::Tensor& outputscale, bool x_grads, const Weights& by_row, const MakeByCol& make_by_col,
               Grads grads) {
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), d = x1.size(2), dp = round_up(d, kW);
  const at::Tensor l64 = lengthscale.to(at::kDouble).contiguous(), s = outputscale.contiguous();
  const auto sides = scaled_sides<T>(x1, x2, l64, dp);
  const auto opts = x1.options().dtype(at::kDouble);
  at::Tensor rw1 = at::zeros({B, n, dp}, opts), r1 = at::empty({B, n}, opts);
  at::Tensor rw2 = x_grads ? at::zeros({B, m, dp}, opts) : at::Tensor(), r2 = at::empty({B, m}, opts);
  double* prw2 = x_grads ? rw2.data_ptr<double>() : nullptr;
  backward_sums(path, sides.first, sides.second, B, d, dp, by_row, make_by_col, x_grads, rw1.data_ptr<double>(),
                r1.data_ptr<double>(), prw2, r2.data_ptr<double>());
  auto& [gx1, gx2, gl, gs] = grads;
  assemble_grads<T>(sides.first, sides.second, B, d, dp, rw1.data_ptr<double>(), r1.data_ptr<double>(), prw2,
                    r2.data_ptr<double>(), l64.data_ptr<double>(), s.data_ptr<T>(), x_grads, gx1, gx2, gl, gs);
  return grads;
}

at::Tensor covariance_path(const CpuPath& path, const at::Tensor& x1, const at::Tensor& x2,
                           const at::Tensor& lengthscale, const at::Tensor& outputscale) {
  check_canonical(x1, x2, lengthscale, outputscale, "rbf_covariance");
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), d = x1.size(2), dp = round_up(d, kW);
  at::Tensor out = at::empty({B, n, m}, x1.options());
  if (out.numel() == 0) return out;
  const at::Tensor l64 = lengthscale.to(at::kDouble).contiguous(), s = outputscale.contiguous();
  AT_DISPATCH_FLOATING_TYPES(x1.scalar_type(), "rbf_covariance_cpu", [&] {
    const auto [z1, z2] = scaled_sides<scalar_t>(x1, x2, l64, dp);
    CovarianceRows<scalar_t> rows{z1.zp(), z2.ztp(), s.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), n, m, z2.np,
                                  d, dp};
    at::parallel_for(0, B * n, grain_for(m * (d + 8)), [&](int64_t b, int64_t e) { run(path, rows, b, e); });
  });
  return out;
}

Grads covariance_backward_path(const CpuPath& path, const at::Tensor& grad, const at::Tensor& x1, const at::Tensor& x2,
                               const at::Tensor& lengthscale, const at::Tensor& outputscale, bool x_grads) {
  check_canonical(x1, x2, lengthscale, outputscale, "rbf_covariance_backward");
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1);
  TORCH_CHECK(grad.dim() == 3 && grad.size(0) == B && grad.size(1) == n && grad.size(2) == m,
              "rbf_covariance_backward: grad must be (B, n, m) = (", B, ", ", n, ", ", m, "), got ", grad.sizes());
  Grads grads = empty_grads(x1, x2, x_grads);
  if (B == 0 || n == 0 || m == 0) return grads;
  AT_DISPATCH_FLOATING_TYPES(x1.scalar_type(), "rbf_covariance_backward_cpu", [&] {
    const at::Tensor G = grad.to(x1.scalar_type()).contiguous();
    at::Tensor Gt;
    const auto by_col = [&] {
      Gt = G.transpose(1, 2).contiguous();
      return DenseWeights<scalar_t>{Gt.data_ptr<scalar_t>(), m, n};
    };
    grads = backward<scalar_t>(path, x1, x2, lengthscale, outputscale, x_grads,
                               DenseWeights<scalar_t>{G.data_ptr<scalar_t>(), n, m}, by_col, grads);
  });
  return grads;
}

at::Tensor matmul_path(const CpuPath& path, const at::Tensor& x1, const at::Tensor& x2,
                       const at::Tensor& lengthscale, const at::Tensor& outputscale, const at::Tensor& v) {
  check_canonical(x1, x2, lengthscale, outputscale, "rbf_matmul");
  check_rhs(x1, x2, v, "rbf_matmul");
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), d = x1.size(2), t = v.size(2);
  const int64_t dp = round_up(d, kW), tp = round_up(t, kW);
  at::Tensor out = at::zeros({B, n, t}, x1.options());
  if (out.numel() == 0 || m == 0) return out;
  const at::Tensor l64 = lengthscale.to(at::kDouble).contiguous(), s = outputscale.contiguous();
  const at::Tensor V = at::zeros({B, m, tp}, x1.options().dtype(at::kDouble));
  V.narrow(2, 0, t).copy_(v);
  AT_DISPATCH_FLOATING_TYPES(x1.scalar_type(), "rbf_matmul_cpu", [&] {
    const auto [z1, z2] = scaled_sides<scalar_t>(x1, x2, l64, dp);
    MatmulRows<scalar_t> rows{z1.zp(), z2.ztp(), V.data_ptr<double>(), s.data_ptr<scalar_t>(),
                              out.data_ptr<scalar_t>(), n, m, z2.np, d, dp, t, tp};
    at::parallel_for(0, B * n, grain_for(m * (d + t + 8)), [&](int64_t b, int64_t e) { run(path, rows, b, e); });
  });
  return out;
}

Grads matmul_backward_path(const CpuPath& path, const at::Tensor& grad, const at::Tensor& x1, const at::Tensor& x2,
                           const at::Tensor& lengthscale, const at::Tensor& outputscale, const at::Tensor& v,
                           bool x_grads) {
  check_canonical(x1, x2, lengthscale, outputscale, "rbf_matmul_backward");
  check_rhs(x1, x2, v, "rbf_matmul_backward");
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), t = v.size(2);
  TORCH_CHECK(grad.dim() == 3 && grad.size(0) == B && grad.size(1) == n && grad.size(2) == t,
              "rbf_matmul_backward: grad must be (B, n, t) = (", B, ", ", n, ", ", t, "), got ", grad.sizes());
  Grads grads = empty_grads(x1, x2, x_grads);
  if (B == 0 || n == 0 || m == 0) return grads;
  // dLoss/dK_ij = G_i . V_j; each side's rows meet the other side transposed and zero-padded.
  const auto opts = x1.options().dtype(at::kDouble);
  const int64_t np = round_up(n, 8), mp = round_up(m, 8);
  const at::Tensor Gd = grad.to(at::kDouble).contiguous(), Vt = at::zeros({B, t, mp}, opts);
  Vt.narrow(2, 0, m).copy_(v.transpose(1, 2));
  at::Tensor Vd, Gt;
  const auto by_col = [&] {
    Vd = v.to(at::kDouble).contiguous();
    Gt = at::zeros({B, t, np}, opts);
    Gt.narrow(2, 0, n).copy_(grad.transpose(1, 2));
    return ProductWeights{Vd.data_ptr<double>(), Gt.data_ptr<double>(), m, np, t};
  };
  const ProductWeights by_row{Gd.data_ptr<double>(), Vt.data_ptr<double>(), n, mp, t};
  AT_DISPATCH_FLOATING_TYPES(x1.scalar_type(), "rbf_matmul_backward_cpu", [&] {
    grads = backward<scalar_t>(path, x1, x2, lengthscale, outputscale, x_grads, by_row, by_col, grads);
  });
  return grads;
}

at::Tensor covariance_cpu(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
                          const at::Tensor& outputscale) {
  return covariance_path(default_path(), x1, x2, lengthscale, outputscale);
}

Grads covariance_backward_cpu(const at::Tensor& grad, const at::Tensor& x1, const at::Tensor& x2,
                              const at::Tensor& lengthscale, const at::Tensor& outputscale, bool x_grads) {
  return covariance_backward_path(default_path(), grad, x1, x2, lengthscale, outputscale, x_grads);
}

at::Tensor matmul_cpu(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
                      const at::Tensor& outputscale, const at::Tensor& v) {
  return matmul_path(default_path(), x1, x2, lengthscale, outputscale, v);
}

Grads matmul_backward_cpu(const at::Tensor& grad, const at::Tensor& x1, const at::Tensor& x2,
                          const at::Tensor& lengthscale, const at::Tensor& outputscale, const at::Tensor& v,
                          bool x_grads) {
  return matmul_backward_path(default_path(), grad, x1, x2, lengthscale, outputscale, v, x_grads);
}

// The op `op` (rbf_covariance, rbf_covariance_backward, rbf_matmul or rbf_matmul_backward) on its tensor
// arguments in schema order, run portably (portable) or not, with column_buffer_mb MB for the one-pass backward.
std::vector<at::Tensor> cpu_path_op(c10::string_view op, at::TensorList args, bool x_grads, bool portable,
                                    int64_t column_buffer_mb) {
  TORCH_CHECK(column_buffer_mb >= 0 && column_buffer_mb < (int64_t{1} << 40),
              "_rbf_cpu_path: column_buffer_mb must be in [0, 2^40), got ", column_buffer_mb);
  const CpuPath path{default_path().avx2_fma && !portable, column_buffer_mb << 20};
  const std::string name(op);
  const size_t want = name == "rbf_covariance" ? 4 : name == "rbf_matmul" || name == "rbf_covariance_backward" ? 5 : 6;
  TORCH_CHECK(name == "rbf_covariance" || name == "rbf_covariance_backward" || name == "rbf_matmul" ||
                  name == "rbf_matmul_backward",
              "_rbf_cpu_path: op must be rbf_covariance, rbf_covariance_backward, rbf_matmul or rbf_matmul_backward, "
              "got '", name, "'");
  TORCH_CHECK(args.size() == want, "_rbf_cpu_path: ", name, " takes ", want, " tensors, got ", args.size());
  const auto& a = args;
  if (name == "rbf_covariance") return {covariance_path(path, a[0], a[1], a[2], a[3])};
  if (name == "rbf_matmul") return {matmul_path(path, a[0], a[1], a[2], a[3], a[4])};
  const Grads g = name == "rbf_covariance_backward"
                      ? covariance_backward_path(path, a[0], a[1], a[2], a[3], a[4], x_grads)
                      : matmul_backward_path(path, a[0], a[1], a[2], a[3], a[4], a[5], x_grads);
  return {std::get<0>(g), std::get<1>(g), std::get<2>(g), std::get<3>(g)};
}

}  // namespace
}  // namespace gpfast

TORCH_LIBRARY_IMPL(gpfast, CPU, m) {
  m.impl("rbf_covariance", &gpfast::covariance_cpu);
  m.impl("rbf_covariance_backward", &gpfast::covariance_backward_cpu);
  m.impl("rbf_matmul", &gpfast::matmul_cpu);
  m.impl("rbf_matmul_backward", &gpfast::matmul_backward_cpu);
  m.impl("_rbf_cpu_path", &gpfast::cpu_path_op);
}
