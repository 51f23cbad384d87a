// CUDA launchers for rbf_matmul_backward, the matrix-free gradients of K @ V for x1, x2, lengthscale and
// outputscale (V's gradient K^T G is rbf_matmul itself). Device code: backward_rows.cuh.
#include "backward_host.h"
#include "dispatch.h"

namespace gpfast {
namespace cuda {

Grads matmul_backward_cuda(const at::Tensor& grad, const at::Tensor& x1, const at::Tensor& x2,
                           const at::Tensor& lengthscale, const at::Tensor& outputscale, const at::Tensor& v,
                           bool x_grads) {
  check_canonical(x1, x2, lengthscale, outputscale, "rbf_matmul_backward");
  check_rhs(x1, x2, v, "rbf_matmul_backward");
  const c10::cuda::CUDAGuard guard(x1.device());
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), d = x1.size(2), t = v.size(2);
  TORCH_CHECK(grad.dim() == 3 && grad.size(0) == B && grad.size(1) == n && grad.size(2) == t,
              "rbf_matmul_backward: grad must be (B, n, t) = (", B, ", ", n, ", ", t, "), got ", grad.sizes());
  if (B == 0 || n == 0 || m == 0 || d == 0 || t == 0) return zero_grads(x1, x2, lengthscale, outputscale, x_grads);
  TORCH_CHECK(B <= 65535, "rbf_matmul_backward: at most 65535 batch entries on CUDA, got ", B);
  const at::Tensor G = grad.to(x1.scalar_type()).contiguous(), V = v.contiguous();
  const int D = feature_bucket(d);
  if (D == 0 || t > 32) {  // dense blocks of K, float64
    const at::Tensor G64 = G.to(at::kDouble), Vt = V.to(at::kDouble).transpose(1, 2);
    return dense_backward(x1, x2, lengthscale, outputscale, x_grads,
                          [&](int64_t i, int64_t r) { return at::bmm(G64.narrow(1, i, r), Vt); });
  }
  const bool is_double = x1.scalar_type() == at::kDouble;
  const int TC = rhs_bucket(t, is_double);
  const at::Tensor p1 = x1.contiguous(), p2 = x2.contiguous(), ls = lengthscale.contiguous();
  const at::Tensor s = outputscale.contiguous();
  Grads out;
  AT_DISPATCH_FLOATING_TYPES(x1.scalar_type(), "rbf_matmul_backward_cuda", [&] {
    with_feature_bucket(D, [&](auto dc) {
      with_rhs_bucket(TC, [&](auto tc) {
        constexpr int kD = decltype(dc)::value, kTC = decltype(tc)::value;
        if constexpr (sizeof(scalar_t) == 8 && (kTC == 12 || kTC == 16)) {
          TORCH_CHECK(false, "gpfast: internal error, no float64 kernel for ", kTC, " columns");
        } else {
          // pass 1: rows of x1, weights G_i . V_j; pass 2: rows of x2, weights V_j . G_i
          out = run_backward<kD>(p1, p2, ls, x_grads, [&](auto with_s, auto with_l, bool over_x1, bool want_a) {
            constexpr bool kS = decltype(with_s)::value, kL = decltype(with_l)::value;
            return over_x1 ? row_pass<scalar_t, kD, kTC, kS, kL>(p1, p2, ls, s, nullptr, 0, 0, 0, &G, &V, want_a)
                           : row_pass<scalar_t, kD, kTC, kS, kL>(p2, p1, ls, s, nullptr, 0, 0, 0, &V, &G, want_a);
          });
        }
      });
    });
  });
  return out;
}

}  // namespace cuda
}  // namespace gpfast

TORCH_LIBRARY_IMPL(gpfast, CUDA, m) { m.impl("rbf_matmul_backward", &gpfast::cuda::matmul_backward_cuda); }
