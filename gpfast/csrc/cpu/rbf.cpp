// CPU implementations of the gpfast ops.
//
// Each thread takes whole rows of K (at::parallel_for over rows). Along a row the columns go in blocks of kBlock,
// with the other point set transposed (d x m), so that the distance, exp and weight loops run over contiguous
// columns and vectorise; the hot loops are compiled twice, portably and for AVX2+FMA, and the second is used when
// the CPU has both. The scaled points x / l, distances and sums are all double whatever the input dtype: it keeps
// a float32 result as close to the float64 reference as its own rounding allows. Every sum runs in an order fixed
// by the code (explicit lanes, fixed row chunks), never by the number of threads, so results repeat run to run; the
// AVX2 build may differ from the portable one in the last bits (it contracts multiply-adds into FMAs).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../common.h"

#if defined(__GNUC__) && defined(__x86_64__)
#define GPFAST_X86_DISPATCH 1
#endif
#define GPFAST_INLINE inline __attribute__((always_inline))

namespace gpfast {
namespace {

constexpr int64_t kBlock = 128;  // columns per block: the per-block buffers (kBlock doubles each) stay in L1
constexpr int64_t kLanes = 8;    // independent partial sums per reduction, added in lane order at the end

// exp(x) for x <= 0, branch-free so that loops over it vectorise; NaN passes through. x / ln2 is rounded to the
// nearest integer n by adding and subtracting 1.5 * 2^52, r = x - n ln2 (ln2 in two parts, after Cody and Waite)
// lies in [-ln2/2, ln2/2], exp(r) is its Taylor series to r^13 (truncation below 2e-17 relative), and 2^n is
// built in the exponent bits. Below -708, where 2^n would leave the normal range, it returns 0 (std::exp gives a
// subnormal under 3.4e-308 there).
GPFAST_INLINE double exp_nonpositive(double x) {
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

// The kLanes partial sums of a reduction, added in lane order.
GPFAST_INLINE double lane_sum(const double* lanes) {
  double sum = 0;
  for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

// dist[j] = |a - z_j|^2 for the C columns whose transposed features start at zt (row stride m).
GPFAST_INLINE void block_dist(const double* a, const double* zt, int64_t m, int64_t d, int64_t C, double* dist) {
  for (int64_t j = 0; j < C; ++j) dist[j] = 0;
  for (int64_t k = 0; k < d; ++k) {
    const double ak = a[k];
    const double* z = zt + k * m;
    for (int64_t j = 0; j < C; ++j) {
      const double diff = ak - z[j];
      dist[j] += diff * diff;
    }
  }
}

// Runs kernel(begin, end), built for AVX2+FMA when this CPU has them. Kernels inline everything they call, so the
// whole loop nest is compiled for the caller's target.
template <class Kernel>
void run_portable(const Kernel& kernel, int64_t begin, int64_t end) {
  kernel(begin, end);
}
#ifdef GPFAST_X86_DISPATCH
template <class Kernel>
__attribute__((target("avx2,fma"))) void run_avx2(const Kernel& kernel, int64_t begin, int64_t end) {
  kernel(begin, end);
}
// GPFAST_CPU_PORTABLE=1 forces the portable build (the tests compare the two).
bool use_avx2_fma() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  const char* env = std::getenv("GPFAST_CPU_PORTABLE");
  return ok && !(env && env[0] == '1');
}
#endif
template <class Kernel>
void run(const Kernel& kernel, int64_t begin, int64_t end) {
#ifdef GPFAST_X86_DISPATCH
  if (use_avx2_fma()) return run_avx2(kernel, begin, end);
#endif
  run_portable(kernel, begin, end);
}

// z = x / lengthscale in double whatever the input dtype. Rounding z to float32 would put one error on a whole row
// of K; those errors do not average out in sums over K (the outputscale gradient of a loss with signed weights
// is the usual victim), where the plain float32 formula's per-pair errors do.
at::Tensor prescale64(const at::Tensor& x, const at::Tensor& lengthscale, int64_t d) {
  return prescale(x.to(at::kDouble), lengthscale.to(at::kDouble), d);
}

// (B, n, d) -> (B, d, n), contiguous.
at::Tensor transposed(const at::Tensor& z) { return z.transpose(1, 2).contiguous(); }

// Rows [begin, end) of K = s exp(-|z1_i - z2_j|^2 / 2).
template <typename T>
struct CovarianceRows {
  const double *z1, *z2t;
  const T* s;
  T* out;
  int64_t n, m, d;
  GPFAST_INLINE void operator()(int64_t begin, int64_t end) const {
    double dist[kBlock];
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / n;
      const double sb = static_cast<double>(s[b]);
      for (int64_t j0 = 0; j0 < m; j0 += kBlock) {
        const int64_t C = std::min(kBlock, m - j0);
        block_dist(z1 + r * d, z2t + b * d * m + j0, m, d, C, dist);
        T* o = out + r * m + j0;
        for (int64_t j = 0; j < C; ++j) o[j] = static_cast<T>(sb * exp_nonpositive(-0.5 * dist[j]));
      }
    }
  }
};

// Rows [begin, end) of K V, v: (B, m, t).
template <typename T>
struct MatmulRows {
  const double *z1, *z2t;
  const T *s, *v;
  T* out;
  int64_t n, m, d, t;
  GPFAST_INLINE void operator()(int64_t begin, int64_t end) const {
    double dist[kBlock];
    std::vector<double> acc(static_cast<size_t>(t * kLanes));
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / n;
      std::fill(acc.begin(), acc.end(), 0.0);
      double* a = acc.data();
      for (int64_t j0 = 0; j0 < m; j0 += kBlock) {
        const int64_t C = std::min(kBlock, m - j0);
        block_dist(z1 + r * d, z2t + b * d * m + j0, m, d, C, dist);
        for (int64_t j = 0; j < C; ++j) dist[j] = exp_nonpositive(-0.5 * dist[j]);
        const T* vb = v + (b * m + j0) * t;
        if (t >= kLanes) {  // vectorised over the right-hand sides, kLanes of them at a time in registers
          int64_t c0 = 0;
          for (; c0 + kLanes <= t; c0 += kLanes) {
            double part[kLanes];
            for (int64_t l = 0; l < kLanes; ++l) part[l] = a[c0 + l];
            for (int64_t j = 0; j < C; ++j)
              for (int64_t l = 0; l < kLanes; ++l) part[l] += dist[j] * static_cast<double>(vb[j * t + c0 + l]);
            for (int64_t l = 0; l < kLanes; ++l) a[c0 + l] = part[l];
          }
          for (int64_t j = 0; j < C; ++j)
            for (int64_t c = c0; c < t; ++c) a[c] += dist[j] * static_cast<double>(vb[j * t + c]);
        } else {  // few right-hand sides: over the columns, in lanes
          for (int64_t c = 0; c < t; ++c) {
            double* lane = a + c * kLanes;
            int64_t j = 0;
            for (; j + kLanes <= C; j += kLanes)
              for (int64_t l = 0; l < kLanes; ++l) lane[l] += dist[j + l] * static_cast<double>(vb[(j + l) * t + c]);
            for (; j < C; ++j) lane[j % kLanes] += dist[j] * static_cast<double>(vb[j * t + c]);
          }
        }
      }
      const double sb = static_cast<double>(s[b]);
      for (int64_t c = 0; c < t; ++c)
        out[r * t + c] = static_cast<T>(sb * (t >= kLanes ? a[c] : lane_sum(a + c * kLanes)));
    }
  }
};

// dLoss/dK for the covariance op: w[j] = G[b, i, j0 + j], or, transposed (rows of the problem are x2's), the
// column G[b, j0 + j, i].
template <typename T>
struct DenseWeights {
  const T* g;
  int64_t n, m;  // G is (B, n, m)
  bool transposed;
  GPFAST_INLINE void operator()(int64_t b, int64_t row, int64_t col0, int64_t C, double* w) const {
    if (!transposed) {
      const T* p = g + (b * n + row) * m + col0;
      for (int64_t j = 0; j < C; ++j) w[j] = static_cast<double>(p[j]);
    } else {
      const T* p = g + (b * n + col0) * m + row;
      for (int64_t j = 0; j < C; ++j) w[j] = static_cast<double>(p[j * m]);
    }
  }
};

// dLoss/dK for the matmul op: w[j] = G_row . V_{col0 + j}, with G (B, rows, t) and V transposed (B, t, cols).
template <typename T>
struct ProductWeights {
  const T *g, *vt;
  int64_t rows, cols, t;
  GPFAST_INLINE void operator()(int64_t b, int64_t row, int64_t col0, int64_t C, double* w) const {
    for (int64_t j = 0; j < C; ++j) w[j] = 0;
    const T* gr = g + (b * rows + row) * t;
    for (int64_t c = 0; c < t; ++c) {
      const double gc = static_cast<double>(gr[c]);
      const T* p = vt + (b * t + c) * cols + col0;
      for (int64_t j = 0; j < C; ++j) w[j] += gc * static_cast<double>(p[j]);
    }
  }
};

// Over rows [begin, end) of W = weight * K (the rows are z1's, the columns z2's, given transposed):
// A_i = sum_j W_ij (z1_i - z2_j), L_i = sum_j W_ij (z1_i - z2_j)^2 and S_i = sum_j W_ij / s; when col is set
// (a (B, d, m) buffer), also col[b, :, j] -= W_ij (z1_i - z2_j), the column side. No n x m intermediate.
template <typename T, class Weights>
struct BackwardRows {
  const double *z1, *z2t;
  const T* s;
  int64_t n, m, d;
  Weights weights;
  double *A, *L, *S;  // L and S may be null
  double* col;   // may be null
  GPFAST_INLINE void operator()(int64_t begin, int64_t end) const {
    double dist[kBlock], w[kBlock];
    std::vector<double> lanes(static_cast<size_t>((2 * d + 1) * kLanes));
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / n, i = r % n;
      const double sb = static_cast<double>(s[b]);
      const double* a = z1 + r * d;
      std::fill(lanes.begin(), lanes.end(), 0.0);
      double* srow = lanes.data() + 2 * d * kLanes;
      for (int64_t j0 = 0; j0 < m; j0 += kBlock) {
        const int64_t C = std::min(kBlock, m - j0);
        block_dist(a, z2t + b * d * m + j0, m, d, C, dist);
        weights(b, i, j0, C, w);
        for (int64_t j = 0; j < C; ++j) dist[j] = w[j] * exp_nonpositive(-0.5 * dist[j]);  // dLoss/ds terms
        for (int64_t j = 0; j < C; ++j) srow[j % kLanes] += dist[j];
        for (int64_t j = 0; j < C; ++j) w[j] = sb * dist[j];  // W_ij
        for (int64_t k = 0; k < d; ++k) {
          const double ak = a[k];
          const double* z = z2t + (b * d + k) * m + j0;
          double pa[kLanes], pl[kLanes];  // locals, so the compiler sees they alias nothing
          std::copy_n(lanes.data() + k * kLanes, kLanes, pa);
          std::copy_n(lanes.data() + (d + k) * kLanes, kLanes, pl);
          double* ck = col ? col + (b * d + k) * m + j0 : nullptr;
          int64_t j = 0;
          if (ck) {
            for (; j + kLanes <= C; j += kLanes)
              for (int64_t l = 0; l < kLanes; ++l) {
                const double diff = ak - z[j + l], wd = w[j + l] * diff;
                pa[l] += wd;
                pl[l] += wd * diff;
                ck[j + l] -= wd;
              }
          } else {
            for (; j + kLanes <= C; j += kLanes)
              for (int64_t l = 0; l < kLanes; ++l) {
                const double diff = ak - z[j + l], wd = w[j + l] * diff;
                pa[l] += wd;
                pl[l] += wd * diff;
              }
          }
          for (; j < C; ++j) {
            const double diff = ak - z[j], wd = w[j] * diff;
            pa[j % kLanes] += wd;
            pl[j % kLanes] += wd * diff;
            if (ck) ck[j] -= wd;
          }
          std::copy_n(pa, kLanes, lanes.data() + k * kLanes);
          std::copy_n(pl, kLanes, lanes.data() + (d + k) * kLanes);
        }
      }
      for (int64_t k = 0; k < d; ++k) {
        A[r * d + k] = lane_sum(lanes.data() + k * kLanes);
        if (L) L[r * d + k] = lane_sum(lanes.data() + (d + k) * kLanes);
      }
      if (S) S[r] = lane_sum(srow);
    }
  }
};

// Both backward ops' sums A1, L, S (over rows) and A2 (over columns) for a weight given both ways round.
//
// Fused: one pass over the rows, each exp evaluated once. The rows are cut into a fixed number of chunks (whatever
// the number of threads, so results do not depend on it); each chunk sums its column side into its own buffer and
// the buffers are added in chunk order. When the buffers would pass 256 MB (or GPFAST_CPU_COLUMN_BUFFER_MB, which
// the tests set to 0 to reach this), a second pass over the rows of the transposed problem gives A2 instead.
template <typename T, class Weights>
void backward_sums(const at::Tensor& z1, const at::Tensor& z2, const T* s, const Weights& by_row,
                   const Weights& by_col, at::Tensor& A1, at::Tensor& L, at::Tensor& S, at::Tensor& A2) {
  const int64_t B = z1.size(0), n = z1.size(1), m = z2.size(1), d = z1.size(2);
  const at::Tensor z2t = transposed(z2);
  constexpr int64_t kChunks = 16;
  const char* env = std::getenv("GPFAST_CPU_COLUMN_BUFFER_MB");
  const int64_t max_bytes = (env ? std::atoll(env) : 256) << 20;
  const int64_t rows = B * n, per_chunk = B * m * d;
  const int64_t grain = std::max<int64_t>(1, (rows + kChunks - 1) / kChunks);
  const int64_t chunks = (rows + grain - 1) / grain;
  BackwardRows<T, Weights> pass{z1.data_ptr<double>(), z2t.data_ptr<double>(), s, n, m, d, by_row,
                                A1.data_ptr<double>(), L.data_ptr<double>(), S.data_ptr<double>(), nullptr};
  if (chunks * per_chunk * static_cast<int64_t>(sizeof(double)) <= max_bytes) {
    std::vector<double> col(static_cast<size_t>(chunks * per_chunk), 0.0);  // (chunks, B, d, m)
    at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
      for (int64_t c = cb; c < ce; ++c) {
        BackwardRows<T, Weights> chunk = pass;
        chunk.col = col.data() + c * per_chunk;
        run(chunk, c * grain, std::min(rows, (c + 1) * grain));
      }
    });
    double* out = A2.data_ptr<double>();  // (B, m, d)
    at::parallel_for(0, per_chunk, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t q = begin; q < end; ++q) {
        const int64_t b = q / (m * d), j = (q / d) % m, k = q % d;
        double acc = 0;
        for (int64_t c = 0; c < chunks; ++c) acc += col[c * per_chunk + (b * d + k) * m + j];
        out[q] = acc;
      }
    });
    return;
  }
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) { run(pass, begin, end); });
  const at::Tensor z1t = transposed(z1);
  BackwardRows<T, Weights> cols{z2.data_ptr<double>(), z1t.data_ptr<double>(), s, m, n, d, by_col,
                                A2.data_ptr<double>(), nullptr, nullptr, nullptr};
  at::parallel_for(0, B * m, 1, [&](int64_t begin, int64_t end) { run(cols, begin, end); });
}

// Assemble (gx1, gx2, glengthscale, goutputscale) from the row and column sums. With z = x / l:
// dK/dx1 = -K (z1 - z2) / l, dK/dx2 = +K (z1 - z2) / l, dK/dl_k = K (z1_k - z2_k)^2 / l_k, dK/ds = K / s.
// A2 = sum_i W_ij (z1_i - z2_j) with the sign flipped, as BackwardRows' column side gives it. All four sums are
// double; the sums over rows (L, S) are taken in double too, since with signed weights they cancel.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> assemble_grads(const at::Tensor& A1, const at::Tensor& A2,
                                                                          const at::Tensor& L, const at::Tensor& S,
                                                                          const at::Tensor& lengthscale) {
  const auto dtype = lengthscale.scalar_type();
  const at::Tensor l64 = lengthscale.to(at::kDouble);
  return {(-A1 / l64.unsqueeze(1)).to(dtype), (-A2 / l64.unsqueeze(1)).to(dtype), (L.sum(1) / l64).to(dtype),
          S.sum(1).to(dtype)};
}

at::Tensor covariance_cpu(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
                          const at::Tensor& outputscale) {
  check_canonical(x1, x2, lengthscale, outputscale, "rbf_covariance");
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), d = x1.size(2);
  at::Tensor out = at::empty({B, n, m}, x1.options());
  if (out.numel() == 0) return out;
  const at::Tensor z1 = prescale64(x1, lengthscale, d), z2t = transposed(prescale64(x2, lengthscale, d));
  const at::Tensor s = outputscale.contiguous();
  AT_DISPATCH_FLOATING_TYPES(x1.scalar_type(), "rbf_covariance_cpu", [&] {
    CovarianceRows<scalar_t> rows{z1.data_ptr<double>(), z2t.data_ptr<double>(), s.data_ptr<scalar_t>(),
                                  out.data_ptr<scalar_t>(), n, m, d};
    at::parallel_for(0, B * n, 1, [&](int64_t begin, int64_t end) { run(rows, begin, end); });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> covariance_backward_cpu(const at::Tensor& grad,
                                                                                   const at::Tensor& x1,
                                                                                   const at::Tensor& x2,
                                                                                   const at::Tensor& lengthscale,
                                                                                   const at::Tensor& outputscale) {
  check_canonical(x1, x2, lengthscale, outputscale, "rbf_covariance_backward");
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), d = x1.size(2);
  TORCH_CHECK(grad.dim() == 3 && grad.size(0) == B && grad.size(1) == n && grad.size(2) == m,
              "rbf_covariance_backward: grad must be (B, n, m) = (", B, ", ", n, ", ", m, "), got ", grad.sizes());
  const at::Tensor z1 = prescale64(x1, lengthscale, d), z2 = prescale64(x2, lengthscale, d);
  const at::Tensor s = outputscale.contiguous();
  const at::Tensor G = grad.to(x1.scalar_type()).contiguous();
  at::Tensor A1 = at::zeros_like(z1), A2 = at::zeros_like(z2), L = at::zeros_like(z1);  // all double
  at::Tensor S = at::zeros({B, n}, z1.options());
  if (n == 0 || m == 0) return assemble_grads(A1, A2, L, S, lengthscale);
  AT_DISPATCH_FLOATING_TYPES(x1.scalar_type(), "rbf_covariance_backward_cpu", [&] {
    const scalar_t* pg = G.data_ptr<scalar_t>();
    backward_sums<scalar_t>(z1, z2, s.data_ptr<scalar_t>(), DenseWeights<scalar_t>{pg, n, m, false},
                            DenseWeights<scalar_t>{pg, n, m, true}, A1, L, S, A2);
  });
  return assemble_grads(A1, A2, L, S, lengthscale);
}

at::Tensor matmul_cpu(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
                      const at::Tensor& outputscale, const at::Tensor& v) {
  check_canonical(x1, x2, lengthscale, outputscale, "rbf_matmul");
  check_rhs(x1, x2, v, "rbf_matmul");
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), d = x1.size(2), t = v.size(2);
  at::Tensor out = at::zeros({B, n, t}, x1.options());
  if (out.numel() == 0 || m == 0) return out;
  const at::Tensor z1 = prescale64(x1, lengthscale, d), z2t = transposed(prescale64(x2, lengthscale, d));
  const at::Tensor s = outputscale.contiguous();
  const at::Tensor V = v.contiguous();
  AT_DISPATCH_FLOATING_TYPES(x1.scalar_type(), "rbf_matmul_cpu", [&] {
    MatmulRows<scalar_t> rows{z1.data_ptr<double>(), z2t.data_ptr<double>(), s.data_ptr<scalar_t>(),
                              V.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), n, m, d, t};
    at::parallel_for(0, B * n, 1, [&](int64_t begin, int64_t end) { run(rows, begin, end); });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> matmul_backward_cpu(
    const at::Tensor& grad, const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
    const at::Tensor& outputscale, const at::Tensor& v) {
  check_canonical(x1, x2, lengthscale, outputscale, "rbf_matmul_backward");
  check_rhs(x1, x2, v, "rbf_matmul_backward");
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), d = x1.size(2), t = v.size(2);
  TORCH_CHECK(grad.dim() == 3 && grad.size(0) == B && grad.size(1) == n && grad.size(2) == t,
              "rbf_matmul_backward: grad must be (B, n, t) = (", B, ", ", n, ", ", t, "), got ", grad.sizes());
  const at::Tensor z1 = prescale64(x1, lengthscale, d), z2 = prescale64(x2, lengthscale, d);
  const at::Tensor s = outputscale.contiguous();
  const at::Tensor G = grad.to(x1.scalar_type()).contiguous(), V = v.contiguous();
  at::Tensor A1 = at::zeros_like(z1), A2 = at::zeros_like(z2), L = at::zeros_like(z1);  // all double
  at::Tensor S = at::zeros({B, n}, z1.options());
  if (n == 0 || m == 0) return assemble_grads(A1, A2, L, S, lengthscale);
  // The weight of pair (i, j) is dLoss/dK_ij = G_i . V_j; each side's rows meet the other side transposed.
  const at::Tensor Vt = transposed(V), Gt = transposed(G);
  AT_DISPATCH_FLOATING_TYPES(x1.scalar_type(), "rbf_matmul_backward_cpu", [&] {
    backward_sums<scalar_t>(z1, z2, s.data_ptr<scalar_t>(),
                            ProductWeights<scalar_t>{G.data_ptr<scalar_t>(), Vt.data_ptr<scalar_t>(), n, m, t},
                            ProductWeights<scalar_t>{V.data_ptr<scalar_t>(), Gt.data_ptr<scalar_t>(), m, n, t}, A1,
                            L, S, A2);
  });
  return assemble_grads(A1, A2, L, S, lengthscale);
}

}  // namespace
}  // namespace gpfast

TORCH_LIBRARY_IMPL(gpfast, CPU, m) {
  m.impl("rbf_covariance", &gpfast::covariance_cpu);
  m.impl("rbf_covariance_backward", &gpfast::covariance_backward_cpu);
  m.impl("rbf_matmul", &gpfast::matmul_cpu);
  m.impl("rbf_matmul_backward", &gpfast::matmul_backward_cpu);
}
