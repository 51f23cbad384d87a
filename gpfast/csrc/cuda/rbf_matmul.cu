// CUDA launchers for rbf_matmul (K @ V without storing K) and its matrix-free backward.
#include "dispatch.h"
#include "rbf_kernels.cuh"

namespace gpfast {
namespace cuda {

at::Tensor covariance_cuda(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
                           const at::Tensor& outputscale);

namespace {

// Right-hand-side columns per thread: one chunk for t <= 32, chunks of 32 beyond (each chunk recomputes K).
int rhs_bucket(int64_t t, bool is_double) {
  if (t == 1) return 1;
  if (t <= 8) return 8;
  if (t <= 16 && !is_double) return 16;
  return 32;
}

template <typename Fn>
void with_rhs_bucket(int TC, Fn&& fn) {
  switch (TC) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 8: fn(std::integral_constant<int, 8>{}); break;
    case 16: fn(std::integral_constant<int, 16>{}); break;
    case 32: fn(std::integral_constant<int, 32>{}); break;
    default: TORCH_CHECK(false, "gpfast: internal error, rhs bucket ", TC);
  }
}

// Rows per thread: as many as registers allow (accumulators TM x TC, points TM x D).
template <typename T, int D, int TC>
constexpr int rows_per_thread() {
  return (sizeof(T) == 8 || D + TC > 24) ? 2 : 4;
}

// Split the columns over blocks when the rows alone give too few blocks to fill the GPU.
int64_t column_splits(int64_t blocks, int64_t m) {
  const int64_t target = 6 * sm_count();
  return std::clamp<int64_t>(ceil_div(target, std::max<int64_t>(blocks, 1)), 1, ceil_div(m, kMmTileJ));
}

// Row-blocked dense fallback for d > 32 (and the backward for t > 32): K is formed one block of rows at a
// time, so memory stays at rows x m.
int64_t dense_block_rows(int64_t m) { return std::max<int64_t>(1, (int64_t(1) << 26) / std::max<int64_t>(m, 1)); }

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
  if (D == 0) {
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
  const at::Tensor z1 = prescale(x1, lengthscale, D), z2 = prescale(x2, lengthscale, D);
  const at::Tensor s = outputscale.contiguous(), V = v.contiguous();
  auto stream = current_stream();
  at::Tensor result;
  AT_DISPATCH_FLOATING_TYPES(x1.scalar_type(), "rbf_matmul_cuda", [&] {
    with_feature_bucket(D, [&](auto dc) {
      with_rhs_bucket(TC, [&](auto tc) {
        constexpr int kD = decltype(dc)::value, kTC = decltype(tc)::value;
        if constexpr (sizeof(scalar_t) == 8 && kTC == 16) {
          TORCH_CHECK(false, "gpfast: internal error, no float64 kernel for 16 columns");
        } else {
          constexpr int kTM = rows_per_thread<scalar_t, kD, kTC>();
          const int64_t rowblocks = ceil_div(n, kMmThreads * kTM);
          TORCH_CHECK(rowblocks < (int64_t(1) << 31), "rbf_matmul: n=", n, " too large");
          int64_t splits = column_splits(rowblocks * B * t_chunks, m);
          const int64_t cols = ceil_div(ceil_div(m, splits), kMmTileJ) * kMmTileJ;
          splits = ceil_div(m, cols);
          at::Tensor part = at::empty({splits, B, n, t}, x1.options());
          MatmulArgs<scalar_t> a{z1.data_ptr<scalar_t>(), z2.data_ptr<scalar_t>(), s.data_ptr<scalar_t>(),
                                 V.data_ptr<scalar_t>(), nullptr, part.data_ptr<scalar_t>(), nullptr, nullptr, n, m,
                                 B, static_cast<int>(t), static_cast<int>(t_chunks), static_cast<int>(splits), cols};
          const dim3 grid(static_cast<unsigned>(rowblocks), static_cast<unsigned>(splits),
                          static_cast<unsigned>(B * t_chunks));
          matmul_fwd_kernel<scalar_t, kD, kTC, kTM><<<grid, kMmThreads, 0, stream>>>(a);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
          result = splits == 1 ? part[0] : part.sum(0);
        }
      });
    });
  });
  return result;
}

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> matmul_backward_dense(
    const at::Tensor& G, const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
    const at::Tensor& outputscale, const at::Tensor& V) {
  const int64_t n = x1.size(1), m = x2.size(1);
  const at::Tensor l = lengthscale.unsqueeze(1);
  const at::Tensor z1 = x1 / l, z2 = x2 / l;
  at::Tensor A = at::empty_like(x1), Bc = at::zeros_like(x2);
  at::Tensor L = at::zeros_like(lengthscale), S = at::zeros_like(outputscale);
  const at::Tensor ones = at::ones_like(outputscale), sv = outputscale.view({-1, 1, 1});
  const int64_t rb = dense_block_rows(m);
  for (int64_t i = 0; i < n; i += rb) {
    const int64_t r = std::min(rb, n - i);
    const at::Tensor zb = z1.narrow(1, i, r);
    const at::Tensor GE = covariance_cuda(x1.narrow(1, i, r), x2, lengthscale, ones) *
                          at::bmm(G.narrow(1, i, r), V.transpose(1, 2));
    const at::Tensor W = GE * sv;
    const at::Tensor roww = W.sum(2, true), colw = W.sum(1).unsqueeze(-1), Wz2 = at::bmm(W, z2);
    A.narrow(1, i, r).copy_(roww * zb - Wz2);
    Bc += at::bmm(W.transpose(1, 2), zb) - colw * z2;
    L += (zb * zb * roww).sum(1) - 2 * (zb * Wz2).sum(1) + (z2 * z2 * colw).sum(1);
    S += GE.sum(at::IntArrayRef{1, 2});
  }
  return {-A / l, Bc / l, L / lengthscale, S};
}

// One row pass of the backward (see matmul_bwd_kernel); returns A (B, n, d) and, with_l, L (B, d) and S (B).
template <typename scalar_t, int kD, int kTC, bool kWithL>
void row_pass(const at::Tensor& z1, const at::Tensor& z2, const at::Tensor& s, const at::Tensor& g,
              const at::Tensor& v, int64_t d, at::Tensor& A, at::Tensor& L, at::Tensor& S) {
  constexpr int kTM = (2 * (2 * kD + kTC) + kD <= 120) ? 2 : 1;
  const int64_t B = z1.size(0), n = z1.size(1), m = z2.size(1), t = v.size(2);
  const int64_t rowblocks = ceil_div(n, kMmThreads * kTM);
  int64_t splits = column_splits(rowblocks * B, m);
  const int64_t cols = ceil_div(ceil_div(m, splits), kMmTileJ) * kMmTileJ;
  splits = ceil_div(m, cols);
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

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> matmul_backward_cuda(
    const at::Tensor& grad, const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
    const at::Tensor& outputscale, const at::Tensor& v) {
  check_canonical(x1, x2, lengthscale, outputscale, "rbf_matmul_backward");
  check_rhs(x1, x2, v, "rbf_matmul_backward");
  const c10::cuda::CUDAGuard guard(x1.device());
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), d = x1.size(2), t = v.size(2);
  TORCH_CHECK(grad.dim() == 3 && grad.size(0) == B && grad.size(1) == n && grad.size(2) == t,
              "rbf_matmul_backward: grad must be (B, n, t) = (", B, ", ", n, ", ", t, "), got ", grad.sizes());
  const at::Tensor G = grad.to(x1.scalar_type()).contiguous(), V = v.contiguous();
  if (B == 0 || n == 0 || m == 0 || d == 0 || t == 0)
    return {at::zeros_like(x1), at::zeros_like(x2), at::zeros_like(lengthscale), at::zeros_like(outputscale)};
  const int D = feature_bucket(d);
  if (D == 0 || t > 32) return matmul_backward_dense(G, x1, x2, lengthscale, outputscale, V);
  TORCH_CHECK(B <= 65535, "rbf_matmul_backward: at most 65535 batch entries on CUDA, got ", B);
  const bool is_double = x1.scalar_type() == at::kDouble;
  const int TC = rhs_bucket(t, is_double) == 1 ? 8 : rhs_bucket(t, is_double);
  const at::Tensor z1 = prescale(x1, lengthscale, D), z2 = prescale(x2, lengthscale, D);
  const at::Tensor s = outputscale.contiguous();
  at::Tensor A1, A2, L, S, unused_l, unused_s;
  AT_DISPATCH_FLOATING_TYPES(x1.scalar_type(), "rbf_matmul_backward_cuda", [&] {
    with_feature_bucket(D, [&](auto dc) {
      with_rhs_bucket(TC, [&](auto tc) {
        constexpr int kD = decltype(dc)::value, kTC = decltype(tc)::value;
        if constexpr (kTC == 1 || (sizeof(scalar_t) == 8 && kTC == 16)) {
          TORCH_CHECK(false, "gpfast: internal error, rhs bucket ", kTC);
        } else {
          row_pass<scalar_t, kD, kTC, true>(z1, z2, s, G, V, d, A1, L, S);           // rows: W_ij, i over x1
          row_pass<scalar_t, kD, kTC, false>(z2, z1, s, V, G, d, A2, unused_l, unused_s);  // columns
        }
      });
    });
  });
  const at::Tensor l = lengthscale.unsqueeze(1);
  return {-A1 / l, -A2 / l, L / lengthscale, S};
}

}  // namespace cuda
}  // namespace gpfast

TORCH_LIBRARY_IMPL(gpfast, CUDA, m) {
  m.impl("rbf_matmul", &gpfast::cuda::matmul_cuda);
  m.impl("rbf_matmul_backward", &gpfast::cuda::matmul_backward_cuda);
}
