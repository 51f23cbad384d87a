// The pivoted Cholesky's block steps on the CPU (the CUDA kernels are cuda/pivot_block.cuh; both follow the same
// steps in the same order, with explicit fused multiply-adds where the GPU has them, so that the selection and the
// pivots agree bit for bit on the same inputs).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "../common.h"

namespace gpfast {

// d = max(d - sum_j Lb[j, :]^2, 0), then d[cand[piv[j]]] = 0 (in place), and the c indices of the largest d, the
// largest first, the smaller index first among equals.
at::Tensor pivot_select_cpu(at::Tensor& d, const at::Tensor& Lb, const at::Tensor& cand, const at::Tensor& piv,
                            int64_t c) {
  check_pivot_select(d, Lb, cand, piv, c);
  const int64_t n = d.size(0), r = Lb.size(0), q = cand.size(0);
  const at::Tensor Lc = Lb.contiguous(), cc = cand.contiguous(), pc = piv.contiguous();
  const int64_t* cp = cc.data_ptr<int64_t>();
  const int64_t* pp = pc.data_ptr<int64_t>();
  for (int64_t j = 0; j < piv.size(0); ++j)
    TORCH_CHECK(pp[j] >= 0 && pp[j] < q && cp[pp[j]] >= 0 && cp[pp[j]] < n, "_pivot_select: piv[",
                std::to_string(j), "] must index cand, and cand[piv] the n=", std::to_string(n),
                " points; got piv ", std::to_string(pp[j]));
  double* dp = d.data_ptr<double>();
  const double* lp = Lc.data_ptr<double>();
  at::parallel_for(0, n, 4096, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      double s = 0.0;
      for (int64_t j = 0; j < r; ++j) s = std::fma(lp[j * n + i], lp[j * n + i], s);
      dp[i] = std::fmax(dp[i] - s, 0.0);
    }
  });
  for (int64_t j = 0; j < piv.size(0); ++j) dp[cp[pp[j]]] = 0.0;
  std::vector<int64_t> idx(n);
  std::iota(idx.begin(), idx.end(), int64_t{0});
  std::partial_sort(idx.begin(), idx.begin() + c, idx.end(),
                    [dp](int64_t a, int64_t b) { return dp[a] > dp[b] || (dp[a] == dp[b] && a < b); });
  at::Tensor out = at::empty({c}, d.options().dtype(at::kLong));
  std::copy(idx.begin(), idx.begin() + c, out.data_ptr<int64_t>());
  return out;
}

// Returns (piv (b,) int64, G (b, b), Ginv (b, b)). S = rows[:, cand] is the candidates' residual covariance and
// d[cand] their remaining diagonal. Step j takes the untaken candidate p with the largest remaining diagonal (the
// first on ties), ok = d_p > floor, and the column C[:, j] = S[:, p] * (1 / s) with s = sqrt(max(d_p, floor))
// (C[p, j] = s exactly; all zero when not ok); then S -= C[:, j] C[:, j]^T, d = max(d - C[:, j]^2, 0), d_p = 0.
// G[j, :] = C[piv_j, :j+1] (lower triangular; a unit row where not ok) and Ginv = G^{-1} by forward substitution
// (each row's sum times the reciprocal of G's diagonal), with its (j, j) zeroed where not ok, so that the block's
// columns over all n points, Ginv @ rows[piv] (refined once; see gpfast/train/preconditioner.py), are zero there.
std::tuple<at::Tensor, at::Tensor, at::Tensor> pivot_block_cpu(const at::Tensor& rows, const at::Tensor& cand,
                                                               const at::Tensor& d, const at::Tensor& floor,
                                                               int64_t b) {
  check_pivot_block(rows, cand, d, floor, b);
  const int64_t c = rows.size(0), n = rows.size(1);
  const at::Tensor rc = rows.contiguous(), cc = cand.contiguous(), dc = d.contiguous();
  const int64_t* cp = cc.data_ptr<int64_t>();
  for (int64_t k = 0; k < c; ++k)
    TORCH_CHECK(cp[k] >= 0 && cp[k] < n, "_pivot_block: cand must index the n=", std::to_string(n),
                " columns of rows, got cand[", std::to_string(k), "] = ", std::to_string(cp[k]));
  const double* rp = rc.data_ptr<double>();
  const double* dp = dc.data_ptr<double>();
  std::vector<double> R(c * c), dl(c), col(c), Cm(c * b, 0.0);
  for (int64_t k = 0; k < c; ++k) {
    for (int64_t l = 0; l < c; ++l) R[k * c + l] = rp[k * n + cp[l]];
    dl[k] = dp[cp[k]];
  }
  std::vector<char> taken(c, 0), ok(b, 0);
  std::vector<int64_t> pv(b);
  const double fl = floor.item<double>();
  for (int64_t j = 0; j < b; ++j) {
    int64_t p = -1;
    for (int64_t q = 0; q < c; ++q)
      if (!taken[q] && (p < 0 || dl[q] > dl[p])) p = q;
    const double pivot = dl[p];
    const bool good = pivot > fl;
    const double s = std::sqrt(std::fmax(pivot, fl));
    const double inv = 1.0 / s;  // one division a pivot, then products (as LAPACK's unblocked Cholesky scales)
    taken[p] = 1;
    pv[j] = p;
    ok[j] = good;
    for (int64_t k = 0; k < c; ++k) col[k] = good ? (k == p ? s : R[k * c + p] * inv) : 0.0;
    for (int64_t k = 0; k < c; ++k) {
      Cm[k * b + j] = col[k];
      for (int64_t l = 0; l < c; ++l) R[k * c + l] = std::fma(-col[k], col[l], R[k * c + l]);
      dl[k] = k == p ? 0.0 : std::fmax(std::fma(-col[k], col[k], dl[k]), 0.0);
    }
  }
  at::Tensor piv = at::empty({b}, rows.options().dtype(at::kLong));
  at::Tensor G = at::zeros({b, b}, rows.options());
  at::Tensor Ginv = at::zeros({b, b}, rows.options());
  std::copy(pv.begin(), pv.end(), piv.data_ptr<int64_t>());
  double* g = G.data_ptr<double>();
  double* x = Ginv.data_ptr<double>();
  for (int64_t i = 0; i < b; ++i)
    for (int64_t jj = 0; jj <= i; ++jj) g[i * b + jj] = ok[i] ? Cm[pv[i] * b + jj] : (jj == i ? 1.0 : 0.0);
  std::vector<double> rdiag(b);
  for (int64_t i = 0; i < b; ++i) rdiag[i] = 1.0 / g[i * b + i];
  for (int64_t t = 0; t < b; ++t)  // column t of G^{-1}, as the CUDA kernel's lane t
    for (int64_t i = t; i < b; ++i) {
      double acc = i == t ? 1.0 : 0.0;
      for (int64_t jj = t; jj < i; ++jj) acc = std::fma(-g[i * b + jj], x[jj * b + t], acc);
      x[i * b + t] = acc * rdiag[i];
    }
  for (int64_t j = 0; j < b; ++j)
    if (!ok[j]) x[j * b + j] = 0.0;
  return {piv, G, Ginv};
}

}  // namespace gpfast

TORCH_LIBRARY_IMPL(gpfast, CPU, m) {
  m.impl("_pivot_block", &gpfast::pivot_block_cpu);
  m.impl("_pivot_select", &gpfast::pivot_select_cpu);
}
