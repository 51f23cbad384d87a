// Launcher of the tensor-core (lengthscale, outputscale) backward of K @ V, and the reduction of its per-block
// sums into gradients. Device code: backward_bilinear.cuh. A translation unit of its own, so that its kernels
// compile in parallel with the row passes'.
#include <algorithm>

#include "backward_bilinear.cuh"
#include "backward_bilinear.h"
#include "dispatch.h"

namespace gpfast {
namespace cuda {

namespace {

// Whether the pairs can be taken once each, (i, j) and (j, i) together: K(x, x) (one tensor, or views of the same
// memory) with 2t <= 40 weights a pair.
bool symmetric_case(const at::Tensor& x1, const at::Tensor& x2, int64_t t) {
  return x1.data_ptr() == x2.data_ptr() && x1.sizes() == x2.sizes() && x1.strides() == x2.strides() && 2 * t <= 40;
}

}  // namespace

std::pair<at::Tensor, at::Tensor> bilinear_backward(const at::Tensor& G, const at::Tensor& x1, const at::Tensor& x2,
                                                    const at::Tensor& lengthscale, const at::Tensor& outputscale,
                                                    const at::Tensor& V, int warps, bool allow_symmetric) {
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), d = x1.size(2), t = V.size(2);
  GPF_CHECK(x1.scalar_type() == at::kFloat && d >= 1 && d <= 32 && t >= 1 && t <= 32,
            "gpfast: the tensor-core backward takes float32 with 1 <= d <= 32 and 1 <= t <= 32, got ",
            x1.scalar_type(), " with d=", d, " and t=", t);
  GPF_CHECK(warps == 4 || warps == 8, "gpfast: the tensor-core backward runs 4 or 8 warps a block, got ", warps);
  const bool symmetric = allow_symmetric && symmetric_case(x1, x2, t);
  // symmetric: row weights [G | V] against column weights [V | G], so that W'_ij = W_ij + W_ji
  const at::Tensor gw = symmetric ? at::cat({G, V}, 2) : G, vw = symmetric ? at::cat({V, G}, 2) : V;
  const int D = bilinear_features(static_cast<int>(d)), TK = bilinear_features(static_cast<int>(vw.size(2)));
  const int64_t rows = int64_t(16) * warps, rowblocks = ceil_div(n, rows);
  // blocks asked for per SM when the columns are split: 1 (8 warps) or 2 (4 warps) fit at 240 registers a thread,
  // 3 at 150; asking for a few times that keeps the last wave short
  const int blocks_per_sm = warps == 4 ? 6 : 3;
  int64_t splits = 1, cols = 0;
  if (symmetric) {  // block (I, s) takes columns [row0 + s cols, row0 + (s + 1) cols): at least 8 column ranges, so
    // that the first row blocks (the longest) do not set the time alone; the blocks past m return at once
    splits = std::min(std::max<int64_t>(ceil_div(2 * blocks_per_sm * sm_count(), rowblocks * B), 8),
                      ceil_div(m, kBilTile));
    cols = ceil_div(ceil_div(m, splits), kBilTile) * kBilTile;
    splits = ceil_div(m, cols);
  } else {
    cols = split_columns(rowblocks * B, m, kBilTile, blocks_per_sm, splits);
  }
  GPF_CHECK(rowblocks < (int64_t(1) << 31) && splits <= 65535 && B <= 65535,
            "gpfast backward: shape too large for one launch (B=", B, ", n=", n, ", m=", m, ")");
  const auto opts = x1.options().dtype(at::kDouble);
  const at::Tensor part_l = at::empty({splits, rowblocks, B, D}, opts);
  const at::Tensor part_s = at::empty({splits, rowblocks, B}, opts);
  BilinearArgs a{};
  a.x1 = x1.data_ptr<float>();
  a.x2 = x2.data_ptr<float>();
  a.ls = lengthscale.data_ptr<float>();
  a.g = gw.data_ptr<float>();
  a.v = vw.data_ptr<float>();
  a.part_l = part_l.data_ptr<double>();
  a.part_s = part_s.data_ptr<double>();
  a.n = n, a.m = m, a.batch = B, a.cols_per_split = cols;
  a.d = static_cast<int>(d), a.t = static_cast<int>(vw.size(2));
  a.symmetric = symmetric;
  const dim3 grid(static_cast<unsigned>(rowblocks), static_cast<unsigned>(splits), static_cast<unsigned>(B));
  with_bucket<8, 16, 24, 32>(D, "feature", [&](auto dc) {
    with_bucket<8, 16, 24, 32, 40>(TK, "weight", [&](auto tc) {
      constexpr int kD = decltype(dc)::value, kTK = decltype(tc)::value;
      if (warps == 4)
        bwd_bilinear_kernel<kD, kTK, 4><<<grid, 4 * 32, 0, current_stream()>>>(a);
      else
        bwd_bilinear_kernel<kD, kTK, 8><<<grid, 8 * 32, 0, current_stream()>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  // d/dl = s L / l, d/ds = S; every sum from here on in double
  const at::Tensor L = part_l.sum(at::IntArrayRef{0, 1}).narrow(1, 0, d);
  const at::Tensor S = part_s.sum(at::IntArrayRef{0, 1});
  const at::Tensor gl = L * outputscale.to(at::kDouble).unsqueeze(1) / lengthscale.to(at::kDouble);
  return {gl.to(at::kFloat), S.to(at::kFloat)};
}

}  // namespace cuda
}  // namespace gpfast
