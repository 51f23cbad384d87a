// CPU implementations of the gpfast ops: plain loops over pre-scaled inputs, parallel over rows with
// at::parallel_for, sums in double. They favour clarity and a fixed accumulation order (independent of the number
// of threads) over speed; CI runs on them.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <vector>

#include "../common.h"

namespace gpfast {
namespace {

// Sums are accumulated in double whatever the input dtype: on the CPU it costs little, and it keeps the float32
// result as close to the float64 reference as its rounding allows.
template <typename T>
inline double sq_dist(const T* a, const T* b, int64_t d) {
  double acc = 0;
  for (int64_t k = 0; k < d; ++k) {
    const double diff = static_cast<double>(a[k] - b[k]);
    acc += diff * diff;
  }
  return acc;
}

at::Tensor covariance_cpu(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
                          const at::Tensor& outputscale) {
  check_canonical(x1, x2, lengthscale, outputscale, "rbf_covariance");
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), d = x1.size(2);
  at::Tensor out = at::empty({B, n, m}, x1.options());
  if (out.numel() == 0) return out;
  const at::Tensor z1 = prescale(x1, lengthscale, d), z2 = prescale(x2, lengthscale, d);
  const at::Tensor s = outputscale.contiguous();
  AT_DISPATCH_FLOATING_TYPES(x1.scalar_type(), "rbf_covariance_cpu", [&] {
    const scalar_t* pz1 = z1.data_ptr<scalar_t>();
    const scalar_t* pz2 = z2.data_ptr<scalar_t>();
    const scalar_t* ps = s.data_ptr<scalar_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    at::parallel_for(0, B * n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t b = r / n;
        const scalar_t* a = pz1 + r * d;
        const scalar_t* zb = pz2 + b * m * d;
        scalar_t* row = po + r * m;
        for (int64_t j = 0; j < m; ++j) row[j] = static_cast<scalar_t>(ps[b] * std::exp(-0.5 * sq_dist(a, zb + j * d, d)));
      }
    });
  });
  return out;
}

// Row i of a (B, n, m) weight W given by `weight(j)`: accumulates acc_a = sum_j W_ij (z1_i - z2_j) and, when
// `with_l`, acc_l = sum_j W_ij (z1_i - z2_j)^2; when `col` is given (m x d), also col_j -= W_ij (z1_i - z2_j),
// the column side. Returns sum_j W_ij / s.
template <typename scalar_t, typename WeightFn>
inline double accumulate_row(const scalar_t* a, const scalar_t* zb, int64_t m, int64_t d, double sb, bool with_l,
                             WeightFn&& weight, double* acc_a, double* acc_l, double* diff, double* col) {
  double srow = 0;
  std::fill(acc_a, acc_a + d, 0.0);
  std::fill(acc_l, acc_l + d, 0.0);
  for (int64_t j = 0; j < m; ++j) {
    const scalar_t* c = zb + j * d;
    double dist = 0;
    for (int64_t k = 0; k < d; ++k) {
      diff[k] = static_cast<double>(a[k] - c[k]);
      dist += diff[k] * diff[k];
    }
    const double ge = static_cast<double>(weight(j)) * std::exp(-0.5 * dist);  // dLoss/ds contribution
    const double w = sb * ge;                                                  // G_ij * K_ij
    srow += ge;
    double* cj = col ? col + j * d : nullptr;
    for (int64_t k = 0; k < d; ++k) {
      const double wd = w * diff[k];
      acc_a[k] += wd;
      if (with_l) acc_l[k] += wd * diff[k];
      if (cj) cj[k] -= wd;
    }
  }
  return srow;
}

// One pass over the rows of W = `grad_of(b, i, j)` * K: per row i, A_i = sum_j W_ij (z1_i - z2_j) and, when
// `with_l`, L_i = sum_j W_ij (z1_i - z2_j)^2 and S_i = sum_j W_ij / s. The gradients of both ops are built from
// these sums over rows and over columns; no n x m intermediate is ever stored.
template <typename scalar_t, typename GradFn>
void row_pass(const scalar_t* pz1, const scalar_t* pz2, const scalar_t* ps, int64_t B, int64_t n, int64_t m,
              int64_t d, bool with_l, GradFn grad_of, scalar_t* A, scalar_t* L, scalar_t* S) {
  at::parallel_for(0, B * n, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> diff(d), acc_a(d), acc_l(d);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / n, i = r % n;
      const double srow = accumulate_row(pz1 + r * d, pz2 + b * m * d, m, d, static_cast<double>(ps[b]), with_l,
                                         [&](int64_t j) { return grad_of(b, i, j); }, acc_a.data(), acc_l.data(),
                                         diff.data(), nullptr);
      for (int64_t k = 0; k < d; ++k) {
        A[r * d + k] = static_cast<scalar_t>(acc_a[k]);
        if (with_l) L[r * d + k] = static_cast<scalar_t>(acc_l[k]);
      }
      if (with_l) S[r] = static_cast<scalar_t>(srow);
    }
  });
}

// The row pass with L and S that also gives the column side A2_j = sum_i W_ij (z2_j - z1_i), so the backward
// evaluates each exp once instead of twice. The rows are cut into a fixed number of chunks (whatever the number
// of threads, so results do not depend on it); each chunk sums its column side into its own buffer and the
// buffers are added in chunk order. Returns false, doing nothing, when the buffers would exceed 256 MB (or
// GPFAST_CPU_COLUMN_BUFFER_MB, which the tests set to 0 to reach the fallback); the caller then runs a second row
// pass over the columns.
template <typename scalar_t, typename GradFn>
bool fused_pass(const scalar_t* pz1, const scalar_t* pz2, const scalar_t* ps, int64_t B, int64_t n, int64_t m,
                int64_t d, GradFn grad_of, scalar_t* A, scalar_t* L, scalar_t* S, scalar_t* A2) {
  constexpr int64_t kChunks = 16;
  const char* env = std::getenv("GPFAST_CPU_COLUMN_BUFFER_MB");
  const int64_t kMaxBytes = (env ? std::atoll(env) : 256) << 20;
  const int64_t rows = B * n, per_chunk = B * m * d;
  const int64_t grain = std::max<int64_t>(1, (rows + kChunks - 1) / kChunks);
  const int64_t chunks = (rows + grain - 1) / grain;
  if (chunks * per_chunk * static_cast<int64_t>(sizeof(double)) > kMaxBytes) return false;
  std::vector<double> col(static_cast<size_t>(chunks * per_chunk), 0.0);
  at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
    std::vector<double> diff(d), acc_a(d), acc_l(d);
    for (int64_t c = cb; c < ce; ++c) {
      for (int64_t r = c * grain; r < std::min(rows, (c + 1) * grain); ++r) {
        const int64_t b = r / n, i = r % n;
        const double srow = accumulate_row(pz1 + r * d, pz2 + b * m * d, m, d, static_cast<double>(ps[b]), true,
                                           [&](int64_t j) { return grad_of(b, i, j); }, acc_a.data(), acc_l.data(),
                                           diff.data(), col.data() + c * per_chunk + b * m * d);
        for (int64_t k = 0; k < d; ++k) {
          A[r * d + k] = static_cast<scalar_t>(acc_a[k]);
          L[r * d + k] = static_cast<scalar_t>(acc_l[k]);
        }
        S[r] = static_cast<scalar_t>(srow);
      }
    }
  });
  at::parallel_for(0, per_chunk, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      double acc = 0;
      for (int64_t c = 0; c < chunks; ++c) acc += col[c * per_chunk + q];
      A2[q] = static_cast<scalar_t>(acc);
    }
  });
  return true;
}

// Both backward ops' sums for the weight `grad_of(b, i, j)`: the fused pass, or when its buffers would be too
// large, a row pass and a second row pass over the columns (the rows of the transposed problem).
template <typename scalar_t, typename GradFn>
void backward_sums(const scalar_t* pz1, const scalar_t* pz2, const scalar_t* ps, int64_t B, int64_t n, int64_t m,
                   int64_t d, GradFn grad_of, scalar_t* A1, scalar_t* L, scalar_t* S, scalar_t* A2) {
  if (fused_pass<scalar_t>(pz1, pz2, ps, B, n, m, d, grad_of, A1, L, S, A2)) return;
  row_pass<scalar_t>(pz1, pz2, ps, B, n, m, d, true, grad_of, A1, L, S);
  row_pass<scalar_t>(pz2, pz1, ps, B, m, n, d, false, [&](int64_t b, int64_t j, int64_t i) { return grad_of(b, i, j); },
                     A2, nullptr, nullptr);
}

// Assemble (gx1, gx2, glengthscale, goutputscale) from the row and column passes. With z = x / l:
// dK/dx1 = -K (z1 - z2) / l, dK/dx2 = +K (z1 - z2) / l, dK/dl_k = K (z1_k - z2_k)^2 / l_k, dK/ds = K / s.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> assemble_grads(const at::Tensor& A1, const at::Tensor& A2,
                                                                          const at::Tensor& L, const at::Tensor& S,
                                                                          const at::Tensor& lengthscale) {
  const at::Tensor l = lengthscale.unsqueeze(1);
  return {-A1 / l, -A2 / l, L.sum(1) / lengthscale, S.sum(1)};
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
  const at::Tensor z1 = prescale(x1, lengthscale, d), z2 = prescale(x2, lengthscale, d);
  const at::Tensor s = outputscale.contiguous();
  const at::Tensor G = grad.to(x1.scalar_type()).contiguous();
  at::Tensor A1 = at::zeros_like(z1), A2 = at::zeros_like(z2), L = at::zeros_like(z1);
  at::Tensor S = at::zeros({B, n}, x1.options());
  AT_DISPATCH_FLOATING_TYPES(x1.scalar_type(), "rbf_covariance_backward_cpu", [&] {
    const scalar_t* pg = G.data_ptr<scalar_t>();
    const scalar_t *pz1 = z1.data_ptr<scalar_t>(), *pz2 = z2.data_ptr<scalar_t>(), *ps = s.data_ptr<scalar_t>();
    backward_sums<scalar_t>(
        pz1, pz2, ps, B, n, m, d, [&](int64_t b, int64_t i, int64_t j) { return pg[(b * n + i) * m + j]; },
        A1.data_ptr<scalar_t>(), L.data_ptr<scalar_t>(), S.data_ptr<scalar_t>(), A2.data_ptr<scalar_t>());
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
  const at::Tensor z1 = prescale(x1, lengthscale, d), z2 = prescale(x2, lengthscale, d);
  const at::Tensor s = outputscale.contiguous();
  const at::Tensor V = v.contiguous();
  AT_DISPATCH_FLOATING_TYPES(x1.scalar_type(), "rbf_matmul_cpu", [&] {
    const scalar_t *pz1 = z1.data_ptr<scalar_t>(), *pz2 = z2.data_ptr<scalar_t>(), *ps = s.data_ptr<scalar_t>();
    const scalar_t* pv = V.data_ptr<scalar_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    at::parallel_for(0, B * n, 1, [&](int64_t begin, int64_t end) {
      std::vector<double> acc(t);
      for (int64_t r = begin; r < end; ++r) {
        const int64_t b = r / n;
        const scalar_t* a = pz1 + r * d;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t j = 0; j < m; ++j) {
          const double e = std::exp(-0.5 * sq_dist(a, pz2 + (b * m + j) * d, d));
          const scalar_t* vrow = pv + (b * m + j) * t;
          for (int64_t c = 0; c < t; ++c) acc[c] += e * vrow[c];
        }
        for (int64_t c = 0; c < t; ++c) po[r * t + c] = static_cast<scalar_t>(ps[b] * acc[c]);
      }
    });
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
  const at::Tensor z1 = prescale(x1, lengthscale, d), z2 = prescale(x2, lengthscale, d);
  const at::Tensor s = outputscale.contiguous();
  const at::Tensor G = grad.to(x1.scalar_type()).contiguous(), V = v.contiguous();
  at::Tensor A1 = at::zeros_like(z1), A2 = at::zeros_like(z2), L = at::zeros_like(z1);
  at::Tensor S = at::zeros({B, n}, x1.options());
  AT_DISPATCH_FLOATING_TYPES(x1.scalar_type(), "rbf_matmul_backward_cpu", [&] {
    const scalar_t *pg = G.data_ptr<scalar_t>(), *pv = V.data_ptr<scalar_t>();
    const scalar_t *pz1 = z1.data_ptr<scalar_t>(), *pz2 = z2.data_ptr<scalar_t>(), *ps = s.data_ptr<scalar_t>();
    // The weight of pair (i, j) is dLoss/dK_ij = G_i . V_j.
    auto dot = [t](const scalar_t* a, const scalar_t* b) {
      double acc = 0;
      for (int64_t c = 0; c < t; ++c) acc += static_cast<double>(a[c]) * b[c];
      return acc;
    };
    backward_sums<scalar_t>(
        pz1, pz2, ps, B, n, m, d,
        [&](int64_t b, int64_t i, int64_t j) { return dot(pg + (b * n + i) * t, pv + (b * m + j) * t); },
        A1.data_ptr<scalar_t>(), L.data_ptr<scalar_t>(), S.data_ptr<scalar_t>(), A2.data_ptr<scalar_t>());
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
