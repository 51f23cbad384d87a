// CUDA launchers for rbf_covariance_backward and the private _rbf_covariance_backward_kernel that runs a named
// kernel. Device code: backward_rows.cuh (two row passes, float64 arithmetic), backward_onepass_f32.cuh (one pass,
// float32 arithmetic where the accuracy rule allows it).
#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

#include "backward_host.h"
#include "backward_onepass_f32.cuh"
#include "dispatch.h"

namespace gpfast {
namespace cuda {

namespace {

enum class BwdKernel { kRows64, kOnePass32 };

// The one-pass float32 backward (d <= 16): grid of column strips by row blocks by batch, about 16 blocks per SM so
// that the last wave is short; partial sums in double, added by finish_grads. Registers capped for 4 resident blocks
// an SM (3 at d = 16): uncapped (170 registers at d = 8, 3 blocks) it took 2.67 ms at n = 16384, d = 8 on the H200,
// capped 2.32 ms, and 15.7 against 13.2 ms at n = 40,000 (experiments/results/h200_2026-12-02_session7/call4_*).
template <int kD>
Grads onepass_backward(const at::Tensor& G, const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& ls,
                       const at::Tensor& s, bool x_grads) {
  constexpr int kCPL = onepass_cols_per_lane(kD), kMinBlocks = kD <= 8 ? 4 : 3;
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1);
  const int64_t strips = ceil_div(m, int64_t(kOneThreads) * kCPL);
  int64_t rowblocks = std::clamp<int64_t>(ceil_div(int64_t(16) * sm_count(), strips * B), 1, ceil_div(n, int64_t(kOneRows)));
  const int64_t rows_per_block = ceil_div(ceil_div(n, rowblocks), int64_t(kOneRows)) * kOneRows;
  rowblocks = ceil_div(n, rows_per_block);
  GPF_CHECK(strips < (int64_t(1) << 31) && rowblocks <= 65535,
            "rbf_covariance_backward: shape too large for one launch (rows=", n, ", columns=", m, ")");
  const auto opts = x1.options().dtype(at::kDouble);
  RowPassSums rows, cols;
  if (x_grads) {
    rows.a = at::empty({strips, B, n, kD}, opts);
    cols.a = at::empty({rowblocks, B, m, kD}, opts);
  }
  rows.l = at::empty({rowblocks, strips, B, kD}, opts);
  rows.s = at::empty({rowblocks, strips, B}, opts);
  OnePassArgs a{};
  a.x1 = x1.data_ptr<float>();
  a.x2 = x2.data_ptr<float>();
  a.ls = ls.data_ptr<float>();
  a.scale = s.data_ptr<float>();
  a.g = G.data_ptr<float>();
  a.part_a = x_grads ? rows.a.data_ptr<double>() : nullptr;
  a.part_b = x_grads ? cols.a.data_ptr<double>() : nullptr;
  a.part_l = rows.l.data_ptr<double>();
  a.part_s = rows.s.data_ptr<double>();
  a.n = n, a.m = m, a.batch = B, a.rows_per_block = rows_per_block;
  a.d = static_cast<int>(x1.size(2));
  a.vec_load = m % kCPL == 0 && reinterpret_cast<uintptr_t>(a.g) % (sizeof(float) * kCPL) == 0;
  const dim3 grid(static_cast<unsigned>(strips), static_cast<unsigned>(rowblocks), static_cast<unsigned>(B));
  if (x_grads)
    bwd_onepass_f32_kernel<kD, kCPL, true, kMinBlocks><<<grid, kOneThreads, 0, current_stream()>>>(a);
  else
    bwd_onepass_f32_kernel<kD, kCPL, false, kMinBlocks><<<grid, kOneThreads, 0, current_stream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return finish_grads(x1, x2, ls, rows, x_grads ? std::optional<RowPassSums>(cols) : std::nullopt, x_grads);
}

// kRows64: bwd_rows_kernel (float64 arithmetic, any dtype); kOnePass32: bwd_onepass_f32_kernel (float32, d <= 16).
Grads covariance_backward_impl(const at::Tensor& grad, const at::Tensor& x1, const at::Tensor& x2,
                               const at::Tensor& lengthscale, const at::Tensor& outputscale, bool x_grads,
                               BwdKernel kernel, const char* op) {
  check_canonical(x1, x2, lengthscale, outputscale, op);
  const c10::cuda::CUDAGuard guard(x1.device());
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), d = x1.size(2);
  GPF_CHECK(grad.dim() == 3 && grad.size(0) == B && grad.size(1) == n && grad.size(2) == m, op,
            ": grad must be (B, n, m) = (", B, ", ", n, ", ", m, "), got ", grad.sizes());
  if (B == 0 || n == 0 || m == 0 || d == 0) return zero_grads(x1, x2, lengthscale, outputscale, x_grads);
  GPF_CHECK(B <= 65535, op, ": at most 65535 batch entries on CUDA, got ", B);
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
      if constexpr (std::is_same_v<scalar_t, float> && kD <= 16) {
        if (kernel == BwdKernel::kOnePass32) {
          out = onepass_backward<kD>(G, p1, p2, ls, s, x_grads);
          return;
        }
      }
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

}  // namespace

// float32 with d <= 16: one pass in float32 arithmetic; otherwise the float64 row passes (at d = 32 the one pass's
// registers would not hold a column's points in double and in float32 beside its sums).
Grads covariance_backward_cuda(const at::Tensor& grad, const at::Tensor& x1, const at::Tensor& x2,
                               const at::Tensor& lengthscale, const at::Tensor& outputscale, bool x_grads) {
  const BwdKernel kernel =
      x1.scalar_type() == at::kFloat && x1.size(2) <= 16 ? BwdKernel::kOnePass32 : BwdKernel::kRows64;
  return covariance_backward_impl(grad, x1, x2, lengthscale, outputscale, x_grads, kernel, "rbf_covariance_backward");
}

// The backward by a named kernel, for tests and benchmarks: "rows64" (bwd_rows_kernel, float64 arithmetic) or
// "onepass32" (bwd_onepass_f32_kernel, float32, d <= 16). d > 32 takes the dense fall-back either way.
Grads covariance_backward_kernel_cuda(const at::Tensor& grad, const at::Tensor& x1, const at::Tensor& x2,
                                      const at::Tensor& lengthscale, const at::Tensor& outputscale, bool x_grads,
                                      c10::string_view kernel) {
  constexpr const char* kOp = "_rbf_covariance_backward_kernel";
  const std::string name(kernel);
  GPF_CHECK(name == "rows64" || name == "onepass32", kOp, ": kernel must be 'rows64' or 'onepass32', got '", name,
            "'");
  const bool onepass = name == "onepass32";
  GPF_CHECK(!onepass || x1.scalar_type() == at::kFloat, kOp, ": 'onepass32' takes float32, got ",
            x1.scalar_type());
  GPF_CHECK(!onepass || x1.size(2) <= 16, kOp, ": 'onepass32' takes d <= 16");
  return covariance_backward_impl(grad, x1, x2, lengthscale, outputscale, x_grads,
                                  onepass ? BwdKernel::kOnePass32 : BwdKernel::kRows64, kOp);
}

}  // namespace cuda
}  // namespace gpfast

TORCH_LIBRARY_IMPL(gpfast, CUDA, m) {
  m.impl("rbf_covariance_backward", &gpfast::cuda::covariance_backward_cuda);
  m.impl("_rbf_covariance_backward_kernel", &gpfast::cuda::covariance_backward_kernel_cuda);
}
