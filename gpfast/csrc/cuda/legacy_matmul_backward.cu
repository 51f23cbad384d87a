// The legacy (first-generation) K @ V backward, GPFAST_BWD=legacy: two row passes of legacy_kernels.cuh's
// matmul_bwd_kernel with float32 sums. Kept as a fall-back; in its own translation unit so that it builds in
// parallel with rbf_matmul_backward.cu.
#include "backward_host.h"

namespace gpfast {
namespace cuda {

namespace {

// legacy_kernels.cuh's K @ V backward (GPFAST_BWD=legacy): two row passes, float32 sums.
template <typename scalar_t, int kD, int kTC, bool kWithL>
void legacy_row_pass(const at::Tensor& z1, const at::Tensor& z2, const at::Tensor& s, const at::Tensor& g,
                     const at::Tensor& v, int64_t d, at::Tensor& A, at::Tensor& L, at::Tensor& S) {
  constexpr int kTM = (2 * (2 * kD + kTC) + kD <= 120) ? 2 : 1;
  const int64_t B = z1.size(0), n = z1.size(1), m = z2.size(1), t = v.size(2);
  const int64_t rowblocks = ceil_div(n, kMmThreads * kTM);
  int64_t splits = 1;
  const int64_t cols = split_columns(rowblocks * B, m, kMmTileJ, 6, splits);
  at::Tensor part_a = at::empty({splits, B, n, kD}, z1.options());
  at::Tensor part_l, part_s;
  if (kWithL) {
    part_l = at::empty({splits, rowblocks, B, kD}, z1.options());
    part_s = at::empty({splits, rowblocks, B}, z1.options());
  }
  MatmulArgs<scalar_t> a{z1.data_ptr<scalar_t>(), z2.data_ptr<scalar_t>(), s.data_ptr<scalar_t>(),
                         v.data_ptr<scalar_t>(),  g.data_ptr<scalar_t>(),  part_a.data_ptr<scalar_t>(),
                         kWithL ? part_l.data_ptr<scalar_t>() : nullptr,
                         kWithL ? part_s.data_ptr<scalar_t>() : nullptr,
                         n, m, B, static_cast<int>(t), 1, static_cast<int>(splits), cols};
  const dim3 grid(static_cast<unsigned>(rowblocks), static_cast<unsigned>(splits), static_cast<unsigned>(B));
  matmul_bwd_kernel<scalar_t, kD, kTC, kTM, kWithL><<<grid, kMmThreads, 0, current_stream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  A = part_a.sum(0).narrow(2, 0, d);
  if (kWithL) {
    L = part_l.sum(at::IntArrayRef{0, 1}).narrow(1, 0, d);
    S = part_s.sum(at::IntArrayRef{0, 1});
  }
}

}  // namespace

Grads matmul_backward_legacy(const at::Tensor& G, const at::Tensor& x1, const at::Tensor& x2,
                             const at::Tensor& lengthscale, const at::Tensor& outputscale, const at::Tensor& V,
                             int D) {
  const int64_t d = x1.size(2), t = V.size(2);
  const bool is_double = x1.scalar_type() == at::kDouble;
  const int TC = t <= 8 ? 8 : (t <= 16 && !is_double ? 16 : 32);
  const at::Tensor z1 = prescale(x1, lengthscale, D), z2 = prescale(x2, lengthscale, D);
  const at::Tensor s = outputscale.contiguous();
  at::Tensor A1, A2, L, S, unused_l, unused_s;
  AT_DISPATCH_FLOATING_TYPES(x1.scalar_type(), "rbf_matmul_backward_legacy", [&] {
    with_feature_bucket(D, [&](auto dc) {
      with_bucket<8, 16, 32>(TC, "right-hand-side", [&](auto tc) {
        constexpr int kD = decltype(dc)::value, kTC = decltype(tc)::value;
        if constexpr (sizeof(scalar_t) == 8 && kTC == 16) {
          TORCH_CHECK(false, "gpfast: internal error, rhs bucket ", kTC);
        } else {
          legacy_row_pass<scalar_t, kD, kTC, true>(z1, z2, s, G, V, d, A1, L, S);
          legacy_row_pass<scalar_t, kD, kTC, false>(z2, z1, s, V, G, d, A2, unused_l, unused_s);
        }
      });
    });
  });
  const at::Tensor l = lengthscale.unsqueeze(1);
  return {-A1 / l, -A2 / l, L / lengthscale, S};
}

}  // namespace cuda
}  // namespace gpfast
