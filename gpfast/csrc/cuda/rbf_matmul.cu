// CUDA launchers for rbf_matmul (K @ V without storing K). Device code: matmul_forward.cuh.
#include <algorithm>

#include "kv_dispatch.h"
#include "matmul_forward.cuh"

namespace gpfast {
namespace cuda {

namespace {

// Rows per thread: as many as registers allow (accumulators 2 x TM x TC for the two-level sums, points TM x D).
template <typename T, int D, int TC>
constexpr int kv_rows_per_thread() {
  if (sizeof(T) == 8) return D + TC > 24 ? 1 : 2;
  return D + TC <= 28 ? 4 : (D + TC <= 40 ? 2 : 1);
}

}  // namespace

at::Tensor matmul_cuda(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
                       const at::Tensor& outputscale, const at::Tensor& v) {
  check_canonical(x1, x2, lengthscale, outputscale, "rbf_matmul");
  check_rhs(x1, x2, v, "rbf_matmul");
  const c10::cuda::CUDAGuard guard(x1.device());
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), d = x1.size(2), t = v.size(2);
  if (B == 0 || n == 0 || t == 0) return at::empty({B, n, t}, x1.options());
  if (m == 0) return at::zeros({B, n, t}, x1.options());
  const int D = feature_bucket(d);
  if (D == 0) {  // d > 32: dense blocks of rows of K (memory rows x m), times V by cuBLAS
    at::Tensor out = at::empty({B, n, t}, x1.options());
    const int64_t rb = dense_block_rows(m);
    for (int64_t i = 0; i < n; i += rb) {
      const int64_t r = std::min(rb, n - i);
      out.narrow(1, i, r).copy_(at::bmm(covariance_cuda(x1.narrow(1, i, r), x2, lengthscale, outputscale), v));
    }
    return out;
  }
  const bool is_double = x1.scalar_type() == at::kDouble;
  const int TC = rhs_bucket(t, is_double);
  const int64_t t_chunks = ceil_div(t, TC);
  TORCH_CHECK(B * t_chunks <= 65535, "rbf_matmul: at most 65535 (batch x rhs-chunks) on CUDA, got ", B * t_chunks);
  const at::Tensor p1 = x1.contiguous(), p2 = x2.contiguous(), ls = lengthscale.contiguous();
  const at::Tensor s = outputscale.contiguous(), V = v.contiguous();
  at::Tensor result;
  with_kv_buckets(x1.scalar_type(), D, TC, [&](auto zero, auto dc, auto tc) {
    using scalar_t = decltype(zero);
    constexpr int kD = decltype(dc)::value, kTC = decltype(tc)::value;
    constexpr int kTM = kv_rows_per_thread<scalar_t, kD, kTC>();
    const int64_t rowblocks = ceil_div(n, int64_t(kKvThreads) * kTM);
    TORCH_CHECK(rowblocks < (int64_t(1) << 31), "rbf_matmul: n=", n, " too large");
    int64_t splits = 1;
    const int64_t cols = split_columns(rowblocks * B * t_chunks, m, kKvTile, 6, splits);
    TORCH_CHECK(splits <= 65535, "rbf_matmul: m=", m, " too large");
    at::Tensor part = at::empty({splits, B, n, t}, x1.options());
    KvFwdArgs<scalar_t> a{p1.data_ptr<scalar_t>(), p2.data_ptr<scalar_t>(), ls.data_ptr<scalar_t>(),
                          s.data_ptr<scalar_t>(),  V.data_ptr<scalar_t>(),  part.data_ptr<scalar_t>(),
                          n,                       m,                       B,
                          static_cast<int>(d),     static_cast<int>(t),     static_cast<int>(t_chunks),
                          cols};
    const dim3 grid(static_cast<unsigned>(rowblocks), static_cast<unsigned>(splits),
                    static_cast<unsigned>(B * t_chunks));
    kv_fwd_kernel<scalar_t, kD, kTC, kTM, sizeof(scalar_t) == 4><<<grid, kKvThreads, 0, current_stream()>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    result = splits == 1 ? part[0] : part.sum(0);
  });
  return result;
}

}  // namespace cuda
}  // namespace gpfast

TORCH_LIBRARY_IMPL(gpfast, CUDA, m) { m.impl("rbf_matmul", &gpfast::cuda::matmul_cuda); }
