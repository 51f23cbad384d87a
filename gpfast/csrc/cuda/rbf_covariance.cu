// CUDA launchers for rbf_covariance and its fused backward. The device code is in rbf_kernels.cuh.
#include <cstdlib>
#include <string>

#include "dispatch.h"
#include "rbf_kernels.cuh"

namespace gpfast {
namespace cuda {

namespace {

at::Tensor covariance_rows_cuda(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
                                const at::Tensor& outputscale, int D, at::Tensor& out) {
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1);
  TORCH_CHECK(B <= 65535, "rbf_covariance: at most 65535 batch entries on CUDA, got ", B);
  const at::Tensor p1 = x1.contiguous(), p2 = x2.contiguous(), ls = lengthscale.contiguous();
  const at::Tensor s = outputscale.contiguous();
  const int cpl = D <= 8 ? 4 : (D == 16 ? 2 : 1);
  const int64_t strips = ceil_div(m, int64_t(kRowsThreads) * cpl);
  int64_t rowblocks = std::clamp<int64_t>(ceil_div(8 * sm_count(), strips * B), 1, ceil_div(n, kRowsStage));
  const int64_t rows_per_block = ceil_div(ceil_div(n, rowblocks), kRowsStage) * kRowsStage;
  rowblocks = ceil_div(n, rows_per_block);
  TORCH_CHECK(strips < (int64_t(1) << 31) && rowblocks <= 65535, "rbf_covariance: shape too large");
  const bool vec = cpl == 4 && (m % 4 == 0) && aligned16(out.data_ptr());
  const dim3 grid(static_cast<unsigned>(strips), static_cast<unsigned>(rowblocks), static_cast<unsigned>(B));
  AT_DISPATCH_FLOATING_TYPES(x1.scalar_type(), "rbf_covariance_rows_cuda", [&] {
    CovRowsArgs<scalar_t> a{p1.data_ptr<scalar_t>(), p2.data_ptr<scalar_t>(), ls.data_ptr<scalar_t>(),
                            s.data_ptr<scalar_t>(),  out.data_ptr<scalar_t>(), n, m, static_cast<int>(x1.size(2)),
                            rows_per_block};
    with_feature_bucket(D, [&](auto dc) {
      constexpr int kD = decltype(dc)::value;
      constexpr int kCpl = kD <= 8 ? 4 : (kD == 16 ? 2 : 1);
      if (vec)
        cov_fwd_rows_kernel<scalar_t, kD, kCpl, true><<<grid, kRowsThreads, 0, current_stream()>>>(a);
      else
        cov_fwd_rows_kernel<scalar_t, kD, kCpl, false><<<grid, kRowsThreads, 0, current_stream()>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return out;
}

}  // namespace

at::Tensor covariance_cuda(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
                           const at::Tensor& outputscale) {
  check_canonical(x1, x2, lengthscale, outputscale, "rbf_covariance");
  const c10::cuda::CUDAGuard guard(x1.device());
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), d = x1.size(2);
  at::Tensor out = at::empty({B, n, m}, x1.options());
  if (out.numel() == 0) return out;
  // Two forward kernels: the row-streaming one (d <= 32, registers hold the columns' points) for wide outputs, the
  // tiled one otherwise. GPFAST_COV_FWD=tile|rows forces one (for benchmarks and tests).
  const char* choice = std::getenv("GPFAST_COV_FWD");
  const int D = feature_bucket(d);
  const bool force_tile = choice && std::string(choice) == "tile";
  const bool force_rows = choice && std::string(choice) == "rows";
  if (D != 0 && !force_tile && (force_rows || m >= 1024)) return covariance_rows_cuda(x1, x2, lengthscale, outputscale, D, out);
  const int64_t dp = ceil_div(std::max<int64_t>(d, 1), 4) * 4;
  TORCH_CHECK(dp <= (1 << 30), "rbf_covariance: d=", d, " is too large");
  const at::Tensor p1 = x1.contiguous(), p2 = x2.contiguous(), ls = lengthscale.contiguous();
  const at::Tensor s = outputscale.contiguous();
  const int64_t tiles_m = ceil_div(m, kCovTile), tiles_per_batch = ceil_div(n, kCovTile) * tiles_m;
  const int64_t blocks = B * tiles_per_batch;
  TORCH_CHECK(blocks < (int64_t(1) << 31), "rbf_covariance: output of shape ", out.sizes(),
              " needs more thread blocks than one launch allows");
  const bool vec = (m % 4 == 0) && aligned16(out.data_ptr());
  auto stream = current_stream();
  AT_DISPATCH_FLOATING_TYPES(x1.scalar_type(), "rbf_covariance_cuda", [&] {
    CovFwdArgs<scalar_t> a{p1.data_ptr<scalar_t>(), p2.data_ptr<scalar_t>(), ls.data_ptr<scalar_t>(),
                           s.data_ptr<scalar_t>(),  out.data_ptr<scalar_t>(), n,
                           m, static_cast<int>(d), static_cast<int>(dp), tiles_m, tiles_per_batch};
    if (vec)
      cov_fwd_kernel<scalar_t, true><<<blocks, kCovThreads, 0, stream>>>(a);
    else
      cov_fwd_kernel<scalar_t, false><<<blocks, kCovThreads, 0, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

namespace {

// Dense fallback for d > 32 (the fused kernel keeps a row in registers): forms E = K / s in memory.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> covariance_backward_dense(
    const at::Tensor& G, const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
    const at::Tensor& outputscale) {
  const at::Tensor E = covariance_cuda(x1, x2, lengthscale, at::ones_like(outputscale));
  const at::Tensor GE = G * E;
  const at::Tensor W = GE * outputscale.view({-1, 1, 1});
  const at::Tensor l = lengthscale.unsqueeze(1);
  const at::Tensor z1 = x1 / l, z2 = x2 / l;
  const at::Tensor roww = W.sum(2, true), colw = W.sum(1).unsqueeze(-1);
  const at::Tensor Wz2 = at::bmm(W, z2);
  const at::Tensor A = roww * z1 - Wz2;
  const at::Tensor Bc = at::bmm(W.transpose(1, 2), z1) - colw * z2;
  const at::Tensor L = (z1 * z1 * roww).sum(1) - 2 * (z1 * Wz2).sum(1) + (z2 * z2 * colw).sum(1);
  return {-A / l, Bc / l, L / lengthscale, GE.sum(at::IntArrayRef{1, 2})};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> covariance_backward_cuda(
    const at::Tensor& grad, const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
    const at::Tensor& outputscale) {
  check_canonical(x1, x2, lengthscale, outputscale, "rbf_covariance_backward");
  const c10::cuda::CUDAGuard guard(x1.device());
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), d = x1.size(2);
  TORCH_CHECK(grad.dim() == 3 && grad.size(0) == B && grad.size(1) == n && grad.size(2) == m,
              "rbf_covariance_backward: grad must be (B, n, m) = (", B, ", ", n, ", ", m, "), got ", grad.sizes());
  const at::Tensor G = grad.to(x1.scalar_type()).contiguous();
  if (B == 0 || n == 0 || m == 0 || d == 0)
    return {at::zeros_like(x1), at::zeros_like(x2), at::zeros_like(lengthscale), at::zeros_like(outputscale)};
  const int D = feature_bucket(d);
  if (D == 0) return covariance_backward_dense(G, x1, x2, lengthscale, outputscale);
  TORCH_CHECK(B <= 65535, "rbf_covariance_backward: at most 65535 batch entries on CUDA, got ", B);

  const at::Tensor z1 = prescale(x1, lengthscale, D), z2 = prescale(x2, lengthscale, D);
  const at::Tensor s = outputscale.contiguous();
  const int cpl = D <= 8 ? 4 : (D == 16 ? 2 : 1);  // columns per lane: bounded by registers
  const int64_t cols_per_warp = 32 * cpl;
  const int nwarps = static_cast<int>(std::min<int64_t>(kBwdMaxWarps, ceil_div(m, cols_per_warp)));
  const int64_t strips = ceil_div(m, nwarps * cols_per_warp);
  // enough blocks to fill the GPU a few times over; rows per block a multiple of the staging chunk
  const int64_t target = 8 * sm_count();
  int64_t rowblocks = std::clamp<int64_t>(ceil_div(target, strips * B), 1, ceil_div(n, kBwdRows));
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
  auto stream = current_stream();
  AT_DISPATCH_FLOATING_TYPES(x1.scalar_type(), "rbf_covariance_backward_cuda", [&] {
    CovBwdArgs<scalar_t> a{G.data_ptr<scalar_t>(),      z1.data_ptr<scalar_t>(),     z2.data_ptr<scalar_t>(),
                           s.data_ptr<scalar_t>(),      part_a.data_ptr<scalar_t>(), part_b.data_ptr<scalar_t>(),
                           part_l.data_ptr<scalar_t>(), part_s.data_ptr<scalar_t>(), n,
                           m,                           B,                           rows_per_block,
                           static_cast<int>(strips),    static_cast<int>(rowblocks)};
    with_feature_bucket(D, [&](auto dc) {
      constexpr int kD = decltype(dc)::value;
      constexpr int kCpl = kD <= 8 ? 4 : (kD == 16 ? 2 : 1);
      if (vec)
        cov_bwd_kernel<scalar_t, kD, kCpl, true><<<grid, nwarps * 32, 0, stream>>>(a);
      else
        cov_bwd_kernel<scalar_t, kD, kCpl, false><<<grid, nwarps * 32, 0, stream>>>(a);
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

TORCH_LIBRARY_IMPL(gpfast, CUDA, m) {
  m.impl("rbf_covariance", &gpfast::cuda::covariance_cuda);
  m.impl("rbf_covariance_backward", &gpfast::cuda::covariance_backward_cuda);
}
