// The legacy (first-generation) K @ V forward, GPFAST_MATMUL=legacy: legacy_kernels.cuh's matmul_fwd_kernel on
// host-prescaled points. Kept as a fall-back; in its own translation unit so that it builds in parallel with
// rbf_matmul.cu.
#include "backward_host.h"

namespace gpfast {
namespace cuda {

// Its right-hand-side buckets: 1, 8, 16, 32 columns.
at::Tensor matmul_legacy(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
                         const at::Tensor& outputscale, const at::Tensor& v, int D) {
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), t = v.size(2);
  const bool is_double = x1.scalar_type() == at::kDouble;
  const int TC = t == 1 ? 1 : (t <= 8 ? 8 : (t <= 16 && !is_double ? 16 : 32));
  const int64_t t_chunks = ceil_div(t, TC);
  TORCH_CHECK(B * t_chunks <= 65535, "rbf_matmul: at most 65535 (batch x rhs-chunks) on CUDA, got ", B * t_chunks);
  const at::Tensor z1 = prescale(x1, lengthscale, D), z2 = prescale(x2, lengthscale, D);
  const at::Tensor s = outputscale.contiguous(), V = v.contiguous();
  at::Tensor result;
  AT_DISPATCH_FLOATING_TYPES(x1.scalar_type(), "rbf_matmul_legacy", [&] {
    with_feature_bucket(D, [&](auto dc) {
      with_bucket<1, 8, 16, 32>(TC, "right-hand-side", [&](auto tc) {
        constexpr int kD = decltype(dc)::value, kTC = decltype(tc)::value;
        if constexpr (sizeof(scalar_t) == 8 && kTC == 16) {
          TORCH_CHECK(false, "gpfast: internal error, no float64 kernel for 16 columns");
        } else {
          constexpr int kTM = (sizeof(scalar_t) == 8 || kD + kTC > 24) ? 2 : 4;
          const int64_t rowblocks = ceil_div(n, kMmThreads * kTM);
          TORCH_CHECK(rowblocks < (int64_t(1) << 31), "rbf_matmul: n=", n, " too large");
          int64_t splits = 1;
          const int64_t cols = split_columns(rowblocks * B * t_chunks, m, kMmTileJ, 6, splits);
          at::Tensor part = at::empty({splits, B, n, t}, x1.options());
          MatmulArgs<scalar_t> a{z1.data_ptr<scalar_t>(), z2.data_ptr<scalar_t>(), s.data_ptr<scalar_t>(),
                                 V.data_ptr<scalar_t>(), nullptr, part.data_ptr<scalar_t>(), nullptr, nullptr, n, m,
                                 B, static_cast<int>(t), static_cast<int>(t_chunks), static_cast<int>(splits), cols};
          const dim3 grid(static_cast<unsigned>(rowblocks), static_cast<unsigned>(splits),
                          static_cast<unsigned>(B * t_chunks));
          matmul_fwd_kernel<scalar_t, kD, kTC, kTM><<<grid, kMmThreads, 0, current_stream()>>>(a);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
          result = splits == 1 ? part[0] : part.sum(0);
        }
      });
    });
  });
  return result;
}

}  // namespace cuda
}  // namespace gpfast
