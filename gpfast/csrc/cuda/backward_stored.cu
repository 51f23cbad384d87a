// Launchers of the backwards from a K in memory (device code: backward_stored.cuh): stored_backward, the
// (lengthscale, outputscale) gradients of sum(G * (K V)), and _rbf_covariance_backward_from_k, every gradient of
// sum(grad * K) for the forward's K; the float64 ATen references take the shapes the kernel does not.
#include <algorithm>
#include <string>

#include "../common.h"
#include "backward_host.h"
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
  GPF_CHECK(rowblocks < (int64_t(1) << 31) && splits <= 65535,
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
  a.ldg = 0, a.k_batch = 0, a.g_batch = 0, a.ls_batch = 0, a.part_a = nullptr, a.transposed = false, a.gk = nullptr;
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

// One launch of the dense-weight kernel over the rows of x_rows against the columns of x_cols: K and G (B, rows,
// cols) contiguous, or (transposed) (B, cols, rows) read down their columns. Returns its partial sums in the row
// passes' layout (backward_host.h): A (splits, B, rows, D) when want_a, L (splits, row blocks, B, D) and sum M
// (splits, row blocks, B).
RowPassSums from_k_pass(const at::Tensor& K, const at::Tensor& G, const at::Tensor& x_rows, const at::Tensor& x_cols,
                        const at::Tensor& ls, bool transposed, bool want_a) {
  constexpr int kWarps = 4, kBlocksPerSm = 6;
  const int64_t B = x_rows.size(0), n = x_rows.size(1), m = x_cols.size(1), d = x_rows.size(2);
  const int D = bilinear_features(static_cast<int>(d));
  const int64_t rowblocks = ceil_div(n, int64_t(16) * kWarps);
  int64_t splits = 1;
  const int64_t cols = split_columns(rowblocks * B, m, kBilTile, kBlocksPerSm, splits);
  GPF_CHECK(rowblocks < (int64_t(1) << 31) && splits <= 65535 && B <= 65535,
            "rbf_covariance backward: shape too large for one launch (B=", B, ", rows=", n, ", columns=", m, ")");
  const auto opts = x_rows.options().dtype(at::kDouble);
  RowPassSums out;
  if (want_a) out.a = at::empty({splits, B, n, D}, opts);
  out.l = at::empty({splits, rowblocks, B, D}, opts);
  out.s = at::empty({splits, rowblocks, B}, opts);
  StoredArgs a{};
  a.k = K.data_ptr<float>();
  a.gk = G.data_ptr<float>();
  a.x1 = x_rows.data_ptr<float>();
  a.x2 = x_cols.data_ptr<float>();
  a.ls = ls.data_ptr<float>();
  a.part_l = out.l.data_ptr<double>();
  a.part_s = out.s.data_ptr<double>();
  a.part_a = want_a ? out.a.data_ptr<double>() : nullptr;
  a.n = n, a.m = m, a.cols_per_split = cols;
  a.ldk = a.ldg = transposed ? n : m;
  a.k_batch = a.g_batch = n * m, a.ls_batch = d;
  a.d = static_cast<int>(d), a.t = 0;
  a.symmetric = false, a.transposed = transposed;
  a.pairs = !transposed && m % 2 == 0 && aligned(K.data_ptr(), 8) && aligned(G.data_ptr(), 8);
  const dim3 grid(static_cast<unsigned>(rowblocks), static_cast<unsigned>(splits), static_cast<unsigned>(B));
  with_bucket<8, 16, 24, 32>(D, "feature", [&](auto dc) {
    constexpr int kD = decltype(dc)::value;
    bwd_stored_kernel<kD, 8, kWarps, true><<<grid, kWarps * 32, 0, current_stream()>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> stored_backward_cuda(const at::Tensor& K, const at::Tensor& x1,
                                                        const at::Tensor& x2, const at::Tensor& lengthscale,
                                                        const at::Tensor& outputscale, const at::Tensor& G,
                                                        const at::Tensor& V, c10::string_view kernel) {
  check_stored_backward(K, x1, x2, lengthscale, outputscale, G, V, "stored_backward");
  const std::string name(kernel);
  const bool named_tc = name == "tc4" || name == "tc8" || name == "tc4_nosym" || name == "tc8_nosym";
  GPF_CHECK(name == "auto" || name == "reference" || named_tc,
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
    GPF_CHECK(fits, "stored_backward: the tensor-core kernel takes float32 K with column stride 1, 1 <= d <= 32 ",
              "and at most 40 weights a pair (t, or 2t for K(x, x)), got ", K.scalar_type(), ", strides ",
              K.strides(), ", d=", d, ", t=", t);
  if (!fits) return stored_backward_reference(K, x1, x2, lengthscale, outputscale, G, V);
  return stored_kernel(K, x1, x2, lengthscale, outputscale, G, V, name.substr(0, 3) == "tc8" ? 8 : 4, symmetric);
}

// Every gradient of sum(grad * K) from the forward's K: no exponential recomputed, M = grad o K in double on the
// FP64 tensor cores (backward_stored.cuh). Pass 1 over K's rows gives A1, L and sum M; with x_grads, pass 2 reads
// K and grad transposed for A2. Float32 with 1 <= d <= 32; otherwise the float64 ATen reference.
Grads covariance_backward_from_k_cuda(const at::Tensor& grad, const at::Tensor& K, const at::Tensor& x1,
                                      const at::Tensor& x2, const at::Tensor& lengthscale,
                                      const at::Tensor& outputscale, bool x_grads, c10::string_view kernel) {
  constexpr const char* kOp = "_rbf_covariance_backward_from_k";
  check_backward_from_k(grad, K, x1, x2, lengthscale, outputscale, kOp);
  GPF_CHECK(kernel == "auto" || kernel == "reference", kOp, ": kernel must be 'auto' or 'reference', got '",
            std::string(kernel), "'");
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), d = x1.size(2);
  if (B == 0 || n == 0 || m == 0 || d == 0) return zero_grads(x1, x2, lengthscale, outputscale, x_grads);
  if (kernel == "reference" || x1.scalar_type() != at::kFloat || d > 32)
    return covariance_backward_from_k_reference(grad, K, x1, x2, lengthscale, outputscale, x_grads);
  const c10::cuda::CUDAGuard guard(x1.device());
  const at::Tensor Kc = K.contiguous(), G = grad.to(at::kFloat).contiguous();
  const at::Tensor p1 = x1.contiguous(), p2 = x2.contiguous(), ls = lengthscale.contiguous();
  RowPassSums rows = from_k_pass(Kc, G, p1, p2, ls, false, x_grads);
  rows.s = rows.s / outputscale.to(at::kDouble).view({1, 1, B});
  std::optional<RowPassSums> cols;
  if (x_grads) cols = from_k_pass(Kc, G, p2, p1, ls, true, true);
  return finish_grads(p1, p2, ls, rows, cols, x_grads);
}

}  // namespace cuda
}  // namespace gpfast

TORCH_LIBRARY_IMPL(gpfast, CUDA, m) {
  m.impl("stored_backward", &gpfast::cuda::stored_backward_cuda);
  m.impl("_rbf_covariance_backward_from_k", &gpfast::cuda::covariance_backward_from_k_cuda);
}
