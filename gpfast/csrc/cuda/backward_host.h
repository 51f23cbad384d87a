// Host side of the backward of both ops: launches of the row pass (backward_rows.cuh), the reduction of its
// partial sums into gradients, and the float64 dense fallback for shapes the fused kernel does not take.
#pragma once

#include <algorithm>
#include <optional>
#include <tuple>

#include "backward_rows.cuh"
#include "dispatch.h"

namespace gpfast {
namespace cuda {

using Grads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The (0,) stand-in for a point gradient nobody asked for: a new tensor each call, since two outputs of one op
// must not alias (opcheck's schema test).
inline at::Tensor not_computed(const at::Tensor& x) { return at::empty({0}, x.options()); }

// The gradients when a size is zero: zeros, and (0,) point gradients when none is asked for.
inline Grads zero_grads(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
                        const at::Tensor& outputscale, bool x_grads) {
  return {x_grads ? at::zeros_like(x1) : not_computed(x1), x_grads ? at::zeros_like(x2) : not_computed(x1),
          at::zeros_like(lengthscale),
          at::zeros_like(outputscale)};
}

// Partial sums of one row pass: A (splits, B, rows, D), L (splits, row blocks, B, D), S (splits, row blocks, B).
struct RowPassSums {
  at::Tensor a, l, s;
};

// Rows per thread of the row pass: two while the accumulators fit in registers.
constexpr int bwd_rows_per_thread(int D) { return D <= 8 ? 2 : 1; }

// One row pass over rows x_rows (B, n, d) against columns x_cols (B, m, d) (all contiguous). The weight of pair
// (i, j) is g[b * g_batch + i * g_row + j * g_col] (dense, TC = 0) or gr_i . vc_j (low-rank, TC > 0).
template <typename scalar_t, int kD, int kTC, bool kS, bool kL>
RowPassSums row_pass(const at::Tensor& x_rows, const at::Tensor& x_cols, const at::Tensor& ls, const at::Tensor& s,
                     const scalar_t* g, int64_t g_batch, int64_t g_row, int64_t g_col, const at::Tensor* gr,
                     const at::Tensor* vc, bool want_a) {
  constexpr int kTM = bwd_rows_per_thread(kD);
  const int64_t B = x_rows.size(0), n = x_rows.size(1), m = x_cols.size(1);
  const int64_t rowblocks = ceil_div(n, int64_t(kBwdThreads) * kTM);
  int64_t splits = 1;
  const int64_t cols = split_columns(rowblocks * B, m, bwd_tile_cols<scalar_t>(), 4, splits);
  GPF_CHECK(rowblocks < (int64_t(1) << 31) && splits <= 65535 && B <= 65535,
            "gpfast backward: shape too large for one launch (B=", B, ", rows=", n, ", columns=", m, ")");
  const auto opts = x_rows.options().dtype(at::kDouble);
  RowPassSums out;
  if (want_a) out.a = at::empty({splits, B, n, kD}, opts);
  if (kL) out.l = at::empty({splits, rowblocks, B, kD}, opts);
  if (kS) out.s = at::empty({splits, rowblocks, B}, opts);
  BwdArgs<scalar_t> a{};
  a.x1 = x_rows.data_ptr<scalar_t>();
  a.x2 = x_cols.data_ptr<scalar_t>();
  a.ls = ls.data_ptr<scalar_t>();
  a.scale = s.data_ptr<scalar_t>();
  a.g = g, a.g_batch = g_batch, a.g_row = g_row, a.g_col = g_col;
  a.gr = gr ? gr->data_ptr<scalar_t>() : nullptr;
  a.vc = vc ? vc->data_ptr<scalar_t>() : nullptr;
  a.t = vc ? static_cast<int>(vc->size(2)) : 0;
  a.part_a = want_a ? out.a.data_ptr<double>() : nullptr;
  a.part_l = kL ? out.l.data_ptr<double>() : nullptr;
  a.part_s = kS ? out.s.data_ptr<double>() : nullptr;
  a.n = n, a.m = m, a.batch = B, a.cols_per_split = cols;
  a.d = static_cast<int>(x_rows.size(2));
  const dim3 grid(static_cast<unsigned>(rowblocks), static_cast<unsigned>(splits), static_cast<unsigned>(B));
  bwd_rows_kernel<scalar_t, kD, kTM, kTC, kS, kL><<<grid, kBwdThreads, 0, current_stream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// Gradients from the row passes' sums: pass 1 over the rows of x1 (S, and L when it has it), pass 2 over the rows
// of x2 (x_grads only). Without L from pass 1, L comes from the expansion identity
//   L = sum_i z1_i A_i + sum_j z2_j A2_j,   z = (x - c) / l for any common centre c,
// (A2_j = sum_i W_ij (z2_j - z1_i) is pass 2's A), in float64 on the host.
inline Grads finish_grads(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& ls, const RowPassSums& p1,
                          const std::optional<RowPassSums>& p2, bool x_grads) {
  const int64_t d = x1.size(2);
  const auto dtype = x1.scalar_type();
  const at::Tensor l64 = ls.to(at::kDouble), l3 = l64.unsqueeze(1);
  const at::Tensor S = p1.s.sum(at::IntArrayRef{0, 1});
  at::Tensor A1, A2, L;
  if (x_grads) A1 = p1.a.sum(0).narrow(2, 0, d), A2 = p2->a.sum(0).narrow(2, 0, d);
  if (p1.l.defined()) {
    L = p1.l.sum(at::IntArrayRef{0, 1}).narrow(1, 0, d);
  } else {
    const at::Tensor X1 = x1.to(at::kDouble), X2 = x2.to(at::kDouble), c = X2.mean(1, true);
    L = (((X1 - c) / l3) * A1).sum(1) + (((X2 - c) / l3) * A2).sum(1);
  }
  if (!x_grads) return {not_computed(x1), not_computed(x1), (L / l64).to(dtype), S.to(dtype)};
  return {(-A1 / l3).to(dtype), (-A2 / l3).to(dtype), (L / l64).to(dtype), S.to(dtype)};
}

// The row passes of one backward. pass(kS, kL, over_x1, want_a) launches a row pass with the compile-time flags
// kS and kL (std::bool_constant) over the rows of x1 (over_x1) or of x2, and returns its sums. L comes from pass 1
// whether or not point gradients are wanted, so both give the same lengthscale gradient bit for bit; at D = 32,
// where pass 1 cannot hold A and L together, the points' case takes L from the identity instead.
template <int kD, typename PassFn>
Grads run_backward(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& ls, bool x_grads, PassFn&& pass) {
  using Yes = std::true_type;
  using No = std::false_type;
  if (!x_grads) return finish_grads(x1, x2, ls, pass(Yes{}, Yes{}, true, false), std::nullopt, false);
  RowPassSums p1;
  if constexpr (kD <= 16)
    p1 = pass(Yes{}, Yes{}, true, true);
  else
    p1 = pass(Yes{}, No{}, true, true);
  return finish_grads(x1, x2, ls, p1, pass(No{}, No{}, false, true), true);
}

// The backward through dense blocks of K (d > 32, or K @ V with t > 32), in float64 whatever the input dtype, for
// the same reason as the row pass (see backward_rows.cuh). weight(i0, rows) returns dLoss/dK for rows
// [i0, i0 + rows), (B, rows, m), float64.
template <typename WeightFn>
Grads dense_backward(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
                     const at::Tensor& outputscale, bool x_grads, WeightFn&& weight) {
  const int64_t n = x1.size(1), m = x2.size(1);
  const auto dtype = x1.scalar_type();
  const at::Tensor X1 = x1.to(at::kDouble), X2 = x2.to(at::kDouble), l = lengthscale.to(at::kDouble);
  const at::Tensor s = outputscale.to(at::kDouble), l3 = l.unsqueeze(1), c = X2.mean(1, true);
  const at::Tensor Z1 = (X1 - c) / l3, Z2 = (X2 - c) / l3;
  at::Tensor A1 = x_grads ? at::empty_like(Z1) : at::Tensor(), A2 = x_grads ? at::zeros_like(Z2) : at::Tensor();
  at::Tensor L = at::zeros_like(l), S = at::zeros_like(s);
  const at::Tensor ones = at::ones_like(s), sv = s.view({-1, 1, 1}), z2sq = Z2 * Z2;
  const int64_t rb = dense_block_rows(m);
  for (int64_t i = 0; i < n; i += rb) {
    const int64_t r = std::min(rb, n - i);
    const at::Tensor Z1b = Z1.narrow(1, i, r);
    const at::Tensor GE = covariance_cuda(X1.narrow(1, i, r), X2, l, ones) * weight(i, r);
    const at::Tensor W = GE * sv;
    const at::Tensor roww = W.sum(2, true), colw = W.sum(1).unsqueeze(-1), Wz2 = at::bmm(W, Z2);
    if (x_grads) {
      A1.narrow(1, i, r).copy_(roww * Z1b - Wz2);
      A2 += colw * Z2 - at::bmm(W.transpose(1, 2), Z1b);
    }
    L += (Z1b * Z1b * roww).sum(1) - 2 * (Z1b * Wz2).sum(1) + (z2sq * colw).sum(1);
    S += GE.sum(at::IntArrayRef{1, 2});
  }
  return {x_grads ? (-A1 / l3).to(dtype) : not_computed(x1), x_grads ? (-A2 / l3).to(dtype) : not_computed(x1),
          (L / l).to(dtype),
          S.to(dtype)};
}

}  // namespace cuda
}  // namespace gpfast
