// CUDA launchers for rbf_covariance_backward. Device code: backward_rows.cuh.
#include "backward_host.h"
#include "dispatch.h"

namespace gpfast {
namespace cuda {

Grads covariance_backward_cuda(const at::Tensor& grad, const at::Tensor& x1, const at::Tensor& x2,
                               const at::Tensor& lengthscale, const at::Tensor& outputscale, bool x_grads) {
  check_canonical(x1, x2, lengthscale, outputscale, "rbf_covariance_backward");
  const c10::cuda::CUDAGuard guard(x1.device());
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), d = x1.size(2);
  TORCH_CHECK(grad.dim() == 3 && grad.size(0) == B && grad.size(1) == n && grad.size(2) == m,
              "rbf_covariance_backward: grad must be (B, n, m) = (", B, ", ", n, ", ", m, "), got ", grad.sizes());
  if (B == 0 || n == 0 || m == 0 || d == 0) return zero_grads(x1, x2, lengthscale, outputscale, x_grads);
  TORCH_CHECK(B <= 65535, "rbf_covariance_backward: at most 65535 batch entries on CUDA, got ", B);
  const at::Tensor G = grad.to(x1.scalar_type()).contiguous();
  const int D = feature_bucket(d);
  if (D == 0)
    return dense_backward(x1, x2, lengthscale, outputscale, x_grads,
                          [&](int64_t i, int64_t r) { return G.narrow(1, i, r).to(at::kDouble); });

  const at::Tensor p1 = x1.contiguous(), p2 = x2.contiguous(), ls = lengthscale.contiguous();
  const at::Tensor s = outputscale.contiguous();
  Grads out;
  AT_DISPATCH_FLOATING_TYPES(x1.scalar_type(), "rbf_covariance_backward_cuda", [&] {
    const scalar_t* g = G.data_ptr<scalar_t>();
    with_feature_bucket(D, [&](auto dc) {
      constexpr int kD = decltype(dc)::value;
      // pass 1 over the rows of x1 (G read along its rows), pass 2 over the rows of x2 (G read down its columns)
      out = run_backward<kD>(p1, p2, ls, x_grads, [&](auto with_s, auto with_l, bool over_x1, bool want_a) {
        constexpr bool kS = decltype(with_s)::value, kL = decltype(with_l)::value;
        return over_x1 ? row_pass<scalar_t, kD, 0, kS, kL>(p1, p2, ls, s, g, n * m, m, 1, nullptr, nullptr, want_a)
                       : row_pass<scalar_t, kD, 0, kS, kL>(p2, p1, ls, s, g, n * m, 1, m, nullptr, nullptr, want_a);
      });
    });
  });
  return out;
}

}  // namespace cuda
}  // namespace gpfast

TORCH_LIBRARY_IMPL(gpfast, CUDA, m) {
  m.impl("rbf_covariance_backward", &gpfast::cuda::covariance_backward_cuda);
}
