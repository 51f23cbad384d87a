// CUDA launchers for rbf_covariance_backward and the private _rbf_covariance_backward_kernel that runs a named
// kernel. Device code: backward_rows.cuh (float64 arithmetic), backward_rows_f32.cuh (float32).
#include <string>
#include <type_traits>

#include "backward_host.h"
#include "dispatch.h"

namespace gpfast {
namespace cuda {

namespace {

// rows32: float32 inputs by bwd_rows_f32_kernel; otherwise bwd_rows_kernel (float64 arithmetic, any dtype).
Grads covariance_backward_impl(const at::Tensor& grad, const at::Tensor& x1, const at::Tensor& x2,
                               const at::Tensor& lengthscale, const at::Tensor& outputscale, bool x_grads,
                               bool rows32, const char* op) {
  check_canonical(x1, x2, lengthscale, outputscale, op);
  const c10::cuda::CUDAGuard guard(x1.device());
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), d = x1.size(2);
  TORCH_CHECK(grad.dim() == 3 && grad.size(0) == B && grad.size(1) == n && grad.size(2) == m, op,
              ": grad must be (B, n, m) = (", B, ", ", n, ", ", m, "), got ", grad.sizes());
  if (B == 0 || n == 0 || m == 0 || d == 0) return zero_grads(x1, x2, lengthscale, outputscale, x_grads);
  TORCH_CHECK(B <= 65535, op, ": at most 65535 batch entries on CUDA, got ", B);
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
      auto passes = [&](auto f32) {
        constexpr bool kF32 = decltype(f32)::value;
        return run_backward<kD>(p1, p2, ls, x_grads, [&](auto with_s, auto with_l, bool over_x1, bool want_a) {
          constexpr bool kS = decltype(with_s)::value, kL = decltype(with_l)::value;
          return over_x1
                     ? row_pass<scalar_t, kD, 0, kS, kL, kF32>(p1, p2, ls, s, g, n * m, m, 1, nullptr, nullptr, want_a)
                     : row_pass<scalar_t, kD, 0, kS, kL, kF32>(p2, p1, ls, s, g, n * m, 1, m, nullptr, nullptr, want_a);
        });
      };
      if constexpr (std::is_same_v<scalar_t, float>) {
        out = rows32 ? passes(std::true_type{}) : passes(std::false_type{});
      } else {
        out = passes(std::false_type{});
      }
    });
  });
  return out;
}

}  // namespace

Grads covariance_backward_cuda(const at::Tensor& grad, const at::Tensor& x1, const at::Tensor& x2,
                               const at::Tensor& lengthscale, const at::Tensor& outputscale, bool x_grads) {
  return covariance_backward_impl(grad, x1, x2, lengthscale, outputscale, x_grads,
                                  x1.scalar_type() == at::kFloat, "rbf_covariance_backward");
}

// The backward by a named kernel, for tests and benchmarks: "rows64" (bwd_rows_kernel, float64 arithmetic) or
// "rows32" (bwd_rows_f32_kernel, float32 only; the float32 default). d > 32 takes the dense fall-back either way.
Grads covariance_backward_kernel_cuda(const at::Tensor& grad, const at::Tensor& x1, const at::Tensor& x2,
                                      const at::Tensor& lengthscale, const at::Tensor& outputscale, bool x_grads,
                                      c10::string_view kernel) {
  constexpr const char* kOp = "_rbf_covariance_backward_kernel";
  const std::string name(kernel);
  TORCH_CHECK(name == "rows64" || name == "rows32", kOp, ": kernel must be 'rows64' or 'rows32', got '", name, "'");
  TORCH_CHECK(name == "rows64" || x1.scalar_type() == at::kFloat, kOp, ": 'rows32' takes float32, got ",
              x1.scalar_type());
  return covariance_backward_impl(grad, x1, x2, lengthscale, outputscale, x_grads, name == "rows32", kOp);
}

}  // namespace cuda
}  // namespace gpfast

TORCH_LIBRARY_IMPL(gpfast, CUDA, m) {
  m.impl("rbf_covariance_backward", &gpfast::cuda::covariance_backward_cuda);
  m.impl("_rbf_covariance_backward_kernel", &gpfast::cuda::covariance_backward_kernel_cuda);
}
