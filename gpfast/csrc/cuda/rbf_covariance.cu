// CUDA launchers for rbf_covariance (the forward). Device code: covariance_forward.cuh, legacy_kernels.cuh.
#include "dispatch.h"
#include "rbf_kernels.cuh"

namespace gpfast {
namespace cuda {

namespace {

// Columns per lane of the row-streaming kernel: 4 (16-byte stores of float32) while the columns' points fit in
// registers.
template <typename T, int D>
constexpr int stream_cols_per_lane() {
  return (sizeof(T) == 4 ? D <= 16 : D <= 8) ? 4 : 2;
}

void covariance_stream(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& ls, const at::Tensor& s,
                       int D, bool expand, at::Tensor& out) {
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1);
  const int64_t d = x1.size(2);
  AT_DISPATCH_FLOATING_TYPES(x1.scalar_type(), "rbf_covariance_stream_cuda", [&] {
    with_feature_bucket(D, [&](auto dc) {
      constexpr int kD = decltype(dc)::value;
      constexpr int kCpl = stream_cols_per_lane<scalar_t, kD>();
      constexpr int kThreads = fwd_stream_threads(kD);
      const int64_t strips = ceil_div(m, int64_t(kThreads) * kCpl);
      int64_t rowblocks = std::clamp<int64_t>(ceil_div(4 * sm_count(), strips * B), 1, ceil_div(n, kFwdRows));
      const int64_t rows_per_block = ceil_div(ceil_div(n, rowblocks), kFwdRows) * kFwdRows;
      rowblocks = ceil_div(n, rows_per_block);
      TORCH_CHECK(strips < (int64_t(1) << 31) && rowblocks <= 65535 && B <= 65535,
                  "rbf_covariance: output of shape ", out.sizes(), " is too large for one launch");
      const size_t vec_bytes = std::min<size_t>(16, kCpl * sizeof(scalar_t));
      const bool vec = (m * sizeof(scalar_t)) % vec_bytes == 0 && aligned(out.data_ptr(), vec_bytes);
      CovStreamArgs<scalar_t> a{x1.data_ptr<scalar_t>(), x2.data_ptr<scalar_t>(), ls.data_ptr<scalar_t>(),
                                s.data_ptr<scalar_t>(),  out.data_ptr<scalar_t>(), n,
                                m,                       static_cast<int>(d),      rows_per_block,
                                vec};
      const dim3 grid(static_cast<unsigned>(strips), static_cast<unsigned>(rowblocks), static_cast<unsigned>(B));
      if (expand && sizeof(scalar_t) == 4)
        cov_fwd_stream_kernel<scalar_t, kD, kCpl, sizeof(scalar_t) == 4><<<grid, kThreads, 0, current_stream()>>>(a);
      else
        cov_fwd_stream_kernel<scalar_t, kD, kCpl, false><<<grid, kThreads, 0, current_stream()>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

// legacy_kernels.cuh's row-streaming kernel (GPFAST_COV_FWD=rows).
void covariance_legacy_rows(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& ls, const at::Tensor& s,
                            int D, at::Tensor& out) {
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1);
  TORCH_CHECK(B <= 65535, "rbf_covariance: at most 65535 batch entries on CUDA, got ", B);
  const int cpl = D <= 8 ? 4 : (D == 16 ? 2 : 1);
  const int64_t strips = ceil_div(m, int64_t(kRowsThreads) * cpl);
  int64_t rowblocks = std::clamp<int64_t>(ceil_div(8 * sm_count(), strips * B), 1, ceil_div(n, kRowsStage));
  const int64_t rows_per_block = ceil_div(ceil_div(n, rowblocks), kRowsStage) * kRowsStage;
  rowblocks = ceil_div(n, rows_per_block);
  TORCH_CHECK(strips < (int64_t(1) << 31) && rowblocks <= 65535, "rbf_covariance: shape too large");
  const bool vec = cpl == 4 && (m % 4 == 0) && aligned16(out.data_ptr());
  const dim3 grid(static_cast<unsigned>(strips), static_cast<unsigned>(rowblocks), static_cast<unsigned>(B));
  AT_DISPATCH_FLOATING_TYPES(x1.scalar_type(), "rbf_covariance_rows_cuda", [&] {
    CovRowsArgs<scalar_t> a{x1.data_ptr<scalar_t>(), x2.data_ptr<scalar_t>(), ls.data_ptr<scalar_t>(),
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
}

// legacy_kernels.cuh's tiled kernel: any d (the feature axis is staged in chunks), 64 x 64 output tiles.
void covariance_legacy_tile(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& ls, const at::Tensor& s,
                            at::Tensor& out) {
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), d = x1.size(2);
  const int64_t dp = ceil_div(std::max<int64_t>(d, 1), 4) * 4;
  TORCH_CHECK(dp <= (1 << 30), "rbf_covariance: d=", d, " is too large");
  const int64_t tiles_m = ceil_div(m, kCovTile), tiles_per_batch = ceil_div(n, kCovTile) * tiles_m;
  const int64_t blocks = B * tiles_per_batch;
  TORCH_CHECK(blocks < (int64_t(1) << 31), "rbf_covariance: output of shape ", out.sizes(),
              " needs more thread blocks than one launch allows");
  const bool vec = (m % 4 == 0) && aligned16(out.data_ptr());
  AT_DISPATCH_FLOATING_TYPES(x1.scalar_type(), "rbf_covariance_tile_cuda", [&] {
    CovFwdArgs<scalar_t> a{x1.data_ptr<scalar_t>(), x2.data_ptr<scalar_t>(), ls.data_ptr<scalar_t>(),
                           s.data_ptr<scalar_t>(),  out.data_ptr<scalar_t>(), n,
                           m, static_cast<int>(d), static_cast<int>(dp), tiles_m, tiles_per_batch};
    if (vec)
      cov_fwd_kernel<scalar_t, true><<<blocks, kCovThreads, 0, current_stream()>>>(a);
    else
      cov_fwd_kernel<scalar_t, false><<<blocks, kCovThreads, 0, current_stream()>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

at::Tensor covariance_cuda(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
                           const at::Tensor& outputscale) {
  check_canonical(x1, x2, lengthscale, outputscale, "rbf_covariance");
  const c10::cuda::CUDAGuard guard(x1.device());
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), d = x1.size(2);
  at::Tensor out = at::empty({B, n, m}, x1.options());
  if (out.numel() == 0) return out;
  const at::Tensor p1 = x1.contiguous(), p2 = x2.contiguous(), ls = lengthscale.contiguous();
  const at::Tensor s = outputscale.contiguous();
  // The row-streaming kernel (d <= 32) for outputs of 1024 columns or more, the tiled legacy kernel otherwise.
  // Float32 with d > 8 forms distances by the norm expansion (instruction-bound there); d <= 8 stays with
  // differences, which cost no time while the kernel waits on its stores, and float64 always does.
  // GPFAST_COV_FWD = tile | rows (the legacy kernels) | diff | expand forces one.
  const int D = feature_bucket(d);
  if (D == 0 || env_is("GPFAST_COV_FWD", "tile")) {
    covariance_legacy_tile(p1, p2, ls, s, out);
  } else if (env_is("GPFAST_COV_FWD", "rows")) {
    covariance_legacy_rows(p1, p2, ls, s, D, out);
  } else if (env_is("GPFAST_COV_FWD", "diff") || env_is("GPFAST_COV_FWD", "expand")) {
    covariance_stream(p1, p2, ls, s, D, env_is("GPFAST_COV_FWD", "expand"), out);
  } else if (m < 1024) {
    covariance_legacy_tile(p1, p2, ls, s, out);
  } else {
    covariance_stream(p1, p2, ls, s, D, D >= 16, out);
  }
  return out;
}

}  // namespace cuda
}  // namespace gpfast

TORCH_LIBRARY_IMPL(gpfast, CUDA, m) { m.impl("rbf_covariance", &gpfast::cuda::covariance_cuda); }
