// Launcher of stored_backward on CUDA: the (lengthscale, outputscale) gradients of sum(G * (K V)) from a stored K,
// on tensor cores (device code: backward_stored.cuh), or by the float64 ATen reference for the shapes the kernel
// does not take.
#include <algorithm>
#include <string>

#include "../common.h"
#include "backward_stored.cuh"
#include "dispatch.h"

namespace gpfast {
namespace cuda {

namespace {

std::tuple<at::Tensor, at::Tensor> stored_kernel(const at::Tensor& K, const at::Tensor& x1, const at::Tensor& x2,
                                                 const at::Tensor& lengthscale, const at::Tensor& outputscale,
                                                 const at::Tensor& G, const at::Tensor& V, int warps,
                                                 bool symmetric) {
  const int64_t n = K.size(0), m = K.size(1), d = x1.size(1);
  const at::Tensor p1 = x1.contiguous(), p2 = x2.contiguous(), ls = lengthscale.contiguous();
  // symmetric: row weights [G | V] against column weights [V | G], so that W'_ij = W_ij + W_ji
  const at::Tensor gw = symmetric ? at::cat({G, V}, 1).contiguous() : G.contiguous();
  const at::Tensor vw = symmetric ? at::cat({V, G}, 1).contiguous() : V.contiguous();
  const int D = bilinear_features(static_cast<int>(d)), TK = bilinear_features(static_cast<int>(vw.size(1)));
  const int64_t rows = int64_t(16) * warps, rowblocks = ceil_div(n, rows);
  const int blocks_per_sm = warps == 4 ? 6 : 3;
  int64_t splits = 1, cols = 0;
  if (symmetric) {  // as bilinear_backward: at least 8 column ranges, so the first (longest) row blocks share out
    splits = std::min(std::max<int64_t>(ceil_div(2 * blocks_per_sm * sm_count(), rowblocks), 8),
                      ceil_div(m, kBilTile));
    cols = ceil_div(ceil_div(m, splits), kBilTile) * kBilTile;
    splits = ceil_div(m, cols);
  } else {
    cols = split_columns(rowblocks, m, kBilTile, blocks_per_sm, splits);
  }
  TORCH_CHECK(rowblocks < (int64_t(1) << 31) && splits <= 65535,
              "stored_backward: shape too large for one launch (n=", n, ", m=", m, ")");
  const auto opts = x1.options().dtype(at::kDouble);
  const at::Tensor part_l = at::empty({splits, rowblocks, D}, opts);
  const at::Tensor part_s = at::empty({splits, rowblocks}, opts);
  StoredArgs a{};
  a.k = K.data_ptr<float>();
  a.x1 = p1.data_ptr<float>();
  a.x2 = p2.data_ptr<float>();
  a.ls = ls.data_ptr<float>();
  a.g = gw.data_ptr<float>();
  a.v = vw.data_ptr<float>();
  a.part_l = part_l.data_ptr<double>();
  a.part_s = part_s.data_ptr<double>();
  a.n = n, a.m = m, a.ldk = n > 1 ? K.stride(0) : m, a.cols_per_split = cols;
  a.d = static_cast<int>(d), a.t = static_cast<int>(vw.size(1));
  a.symmetric = symmetric;
  a.pairs = a.ldk % 2 == 0 && aligned(K.data_ptr(), 8);
  const dim3 grid(static_cast<unsigned>(rowblocks), static_cast<unsigned>(splits), 1);
  with_bucket<8, 16, 24, 32>(D, "feature", [&](auto dc) {
    with_bucket<8, 16, 24, 32, 40>(TK, "weight", [&](auto tc) {
      constexpr int kD = decltype(dc)::value, kTK = decltype(tc)::value;
      if (warps == 4)
        bwd_stored_kernel<kD, kTK, 4><<<grid, 4 * 32, 0, current_stream()>>>(a);
      else
        bwd_stored_kernel<kD, kTK, 8><<<grid, 8 * 32, 0, current_stream()>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  // d/dl = L / l, d/ds = sum M / s; every sum from here on in double
  const at::Tensor L = part_l.sum(at::IntArrayRef{0, 1}).narrow(0, 0, d);
  const at::Tensor S = part_s.sum();
  return {(L / ls.to(at::kDouble)).to(at::kFloat), (S / outputscale.to(at::kDouble)).to(at::kFloat)};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> stored_backward_cuda(const at::Tensor& K, const at::Tensor& x1,
                                                        const at::Tensor& x2, const at::Tensor& lengthscale,
                                                        const at::Tensor& outputscale, const at::Tensor& G,
                                                        const at::Tensor& V, c10::string_view kernel) {
  check_stored_backward(K, x1, x2, lengthscale, outputscale, G, V, "stored_backward");
  const std::string name(kernel);
  const bool named_tc = name == "tc4" || name == "tc8" || name == "tc4_nosym" || name == "tc8_nosym";
  TORCH_CHECK(name == "auto" || name == "reference" || named_tc,
              "stored_backward: kernel must be 'auto', 'reference', 'tc4', 'tc8', 'tc4_nosym' or 'tc8_nosym', got '",
              name, "'");
  const int64_t n = K.size(0), m = K.size(1), d = x1.size(1), t = G.size(1);
  if (n == 0 || m == 0 || name == "reference") return stored_backward_reference(K, x1, x2, lengthscale, outputscale, G, V);
  const c10::cuda::CUDAGuard guard(K.device());
  // K(x, x): one tensor (or views of the same memory) for both point sets and a square K
  const bool same_points = x1.data_ptr() == x2.data_ptr() && x1.sizes() == x2.sizes() && x1.strides() == x2.strides();
  const bool nosym = name.size() > 3 && name.substr(3) == "_nosym";
  const bool symmetric = !nosym && same_points && n == m && 2 * t <= 40;
  const bool fits = K.scalar_type() == at::kFloat && d >= 1 && d <= 32 && (symmetric ? 2 * t : t) <= 40 &&
                    (K.stride(1) == 1 || m == 1) && K.stride(0) >= 0;
  if (named_tc)
    TORCH_CHECK(fits, "stored_backward: the tensor-core kernel takes float32 K with column stride 1, 1 <= d <= 32 ",
                "and at most 40 weights a pair (t, or 2t for K(x, x)), got ", K.scalar_type(), ", strides ",
                K.strides(), ", d=", d, ", t=", t);
  if (!fits) return stored_backward_reference(K, x1, x2, lengthscale, outputscale, G, V);
  return stored_kernel(K, x1, x2, lengthscale, outputscale, G, V, name.substr(0, 3) == "tc8" ? 8 : 4, symmetric);
}

}  // namespace cuda
}  // namespace gpfast

TORCH_LIBRARY_IMPL(gpfast, CUDA, m) { m.impl("stored_backward", &gpfast::cuda::stored_backward_cuda); }
