// The legacy (first-generation) covariance backward, GPFAST_BWD=legacy: legacy_kernels.cuh's cov_bwd_kernel, one
// pass over grad_K with float32 sums. Kept as a fall-back; in its own translation unit so that it builds in
// parallel with rbf_covariance_backward.cu.
#include "backward_host.h"

namespace gpfast {
namespace cuda {

// legacy_kernels.cuh's fused backward (GPFAST_BWD=legacy), float32 sums.
Grads covariance_backward_legacy(const at::Tensor& G, const at::Tensor& x1, const at::Tensor& x2,
                                 const at::Tensor& lengthscale, const at::Tensor& outputscale, int D) {
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), d = x1.size(2);
  const at::Tensor z1 = prescale(x1, lengthscale, D), z2 = prescale(x2, lengthscale, D);
  const at::Tensor s = outputscale.contiguous();
  const int cpl = D <= 8 ? 4 : (D == 16 ? 2 : 1);  // columns per lane: bounded by registers
  const int64_t cols_per_warp = 32 * cpl;
  const int nwarps = static_cast<int>(std::min<int64_t>(kBwdMaxWarps, ceil_div(m, cols_per_warp)));
  const int64_t strips = ceil_div(m, nwarps * cols_per_warp);
  int64_t rowblocks = std::clamp<int64_t>(ceil_div(8 * sm_count(), strips * B), 1, ceil_div(n, kBwdRows));
  const int64_t rows_per_block = ceil_div(ceil_div(n, rowblocks), kBwdRows) * kBwdRows;
  rowblocks = ceil_div(n, rows_per_block);
  TORCH_CHECK(strips < (int64_t(1) << 31) && rowblocks <= 65535, "rbf_covariance_backward: shape too large");
  auto opts = x1.options();
  at::Tensor part_a = at::empty({strips, B, n, D}, opts);
  at::Tensor part_b = at::empty({rowblocks, B, m, D}, opts);
  at::Tensor part_l = at::empty({rowblocks, strips, B, D}, opts);
  at::Tensor part_s = at::empty({rowblocks, strips, B}, opts);
  const bool vec = cpl == 4 && (m % 4 == 0) && aligned16(G.data_ptr());
  const dim3 grid(static_cast<unsigned>(strips), static_cast<unsigned>(rowblocks), static_cast<unsigned>(B));
  AT_DISPATCH_FLOATING_TYPES(x1.scalar_type(), "rbf_covariance_backward_legacy", [&] {
    CovBwdArgs<scalar_t> a{G.data_ptr<scalar_t>(),      z1.data_ptr<scalar_t>(),     z2.data_ptr<scalar_t>(),
                           s.data_ptr<scalar_t>(),      part_a.data_ptr<scalar_t>(), part_b.data_ptr<scalar_t>(),
                           part_l.data_ptr<scalar_t>(), part_s.data_ptr<scalar_t>(), n,
                           m,                           B,                           rows_per_block,
                           static_cast<int>(strips),    static_cast<int>(rowblocks)};
    with_feature_bucket(D, [&](auto dc) {
      constexpr int kD = decltype(dc)::value;
      constexpr int kCpl = kD <= 8 ? 4 : (kD == 16 ? 2 : 1);
      if (vec)
        cov_bwd_kernel<scalar_t, kD, kCpl, true><<<grid, nwarps * 32, 0, current_stream()>>>(a);
      else
        cov_bwd_kernel<scalar_t, kD, kCpl, false><<<grid, nwarps * 32, 0, current_stream()>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  const at::Tensor l = lengthscale.unsqueeze(1);
  const at::Tensor A = part_a.sum(0).narrow(2, 0, d), Bc = part_b.sum(0).narrow(2, 0, d);
  const at::Tensor L = part_l.sum(at::IntArrayRef{0, 1}).narrow(1, 0, d), S = part_s.sum(at::IntArrayRef{0, 1});
  return {-A / l, Bc / l, L / lengthscale, S};
}

}  // namespace cuda
}  // namespace gpfast
