// The greedy pivots of one pivoted-Cholesky block on the CPU (the CUDA kernel is cuda/pivot_block.cu; both follow
// the same steps, in the same order).
#include <cmath>
#include <vector>

#include "../common.h"

namespace gpfast {

// Returns (piv (b,) int64, C (c, b) float64, ok (b,) float64). Step j takes the untaken candidate p with the largest
// remaining diagonal (the first on ties, as torch.argmax), ok = d_p > floor, and the column C[:, j] = R[:, p] / s
// with s = sqrt(d_p) (C[p, j] = s exactly; all zero when not ok); then R -= C[:, j] C[:, j]^T and
// d = max(d - C[:, j]^2, 0), d_p = 0. The block's columns over all n points follow from a triangular solve with the
// b x b matrix C[piv, :] (gpfast/train/preconditioner.py).
std::tuple<at::Tensor, at::Tensor, at::Tensor> pivot_block_cpu(const at::Tensor& S, const at::Tensor& d,
                                                               const at::Tensor& floor, int64_t b) {
  check_pivot_block(S, d, floor, b);
  const int64_t c = S.size(0);
  at::Tensor Sc = S.contiguous();
  std::vector<double> R(Sc.data_ptr<double>(), Sc.data_ptr<double>() + c * c);
  at::Tensor dc = d.contiguous();
  std::vector<double> dl(dc.data_ptr<double>(), dc.data_ptr<double>() + c);
  std::vector<char> taken(c, 0);
  std::vector<double> col(c);
  const double fl = floor.item<double>();
  at::Tensor piv = at::empty({b}, S.options().dtype(at::kLong));
  at::Tensor C = at::zeros({c, b}, S.options());
  at::Tensor ok = at::empty({b}, S.options());
  int64_t* pp = piv.data_ptr<int64_t>();
  double* Cp = C.data_ptr<double>();
  double* okp = ok.data_ptr<double>();
  for (int64_t j = 0; j < b; ++j) {
    int64_t p = -1;
    for (int64_t q = 0; q < c; ++q)
      if (!taken[q] && (p < 0 || dl[q] > dl[p])) p = q;
    const double pivot = dl[p];
    const bool good = pivot > fl;
    const double s = std::sqrt(std::max(pivot, fl));
    taken[p] = 1;
    pp[j] = p;
    okp[j] = good ? 1.0 : 0.0;
    for (int64_t k = 0; k < c; ++k) col[k] = good ? (k == p ? s : R[k * c + p] / s) : 0.0;
    for (int64_t k = 0; k < c; ++k) {
      Cp[k * b + j] = col[k];
      for (int64_t l = 0; l < c; ++l) R[k * c + l] -= col[k] * col[l];
      dl[k] = std::max(dl[k] - col[k] * col[k], 0.0);
    }
    dl[p] = 0.0;
  }
  return {piv, C, ok};
}

}  // namespace gpfast

TORCH_LIBRARY_IMPL(gpfast, CPU, m) { m.impl("_pivot_block", &gpfast::pivot_block_cpu); }
