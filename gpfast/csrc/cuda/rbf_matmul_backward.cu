// CUDA launchers for rbf_matmul_backward, the matrix-free gradients of K @ V for x1, x2, lengthscale and
// outputscale (V's gradient K^T G is rbf_matmul itself), and the private _rbf_matmul_backward_kernel that runs a
// named kernel. Device code: backward_rows.cuh (row passes), backward_bilinear.cuh (tensor cores, (l, s) only).
#include <string>

#include "backward_bilinear.h"
#include "backward_host.h"
#include "kv_dispatch.h"

namespace gpfast {
namespace cuda {

namespace {

// The backward's argument checks; returns whether any size is zero (the gradients are then zeros). Run before the
// device guard and any pointer use: the dispatcher sends a call here when any one tensor is on CUDA, so x1 itself
// may be on the CPU, and grad's device is not among check_canonical's.
bool check_matmul_backward(const at::Tensor& grad, const at::Tensor& x1, const at::Tensor& x2,
                           const at::Tensor& lengthscale, const at::Tensor& outputscale, const at::Tensor& v,
                           const char* op) {
  GPF_CHECK(x1.is_cuda(), op, ": x1 must be a CUDA tensor (its CUDA kernel got the call), got x1 on ",
            x1.device());
  check_canonical(x1, x2, lengthscale, outputscale, op);
  check_rhs(x1, x2, v, op);
  GPF_CHECK(grad.device() == x1.device(), op, ": grad must be on x1's device ", x1.device(), ", got ",
            grad.device());
  GPF_CHECK(grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kDouble, op,
            ": grad must be float32 or float64, got ", grad.scalar_type());
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), d = x1.size(2), t = v.size(2);
  GPF_CHECK(grad.dim() == 3 && grad.size(0) == B && grad.size(1) == n && grad.size(2) == t, op,
            ": grad must be (B, n, t) = (", B, ", ", n, ", ", t, "), got ", grad.sizes());
  if (B == 0 || n == 0 || m == 0 || d == 0 || t == 0) return true;
  GPF_CHECK(B <= 65535, op, ": at most 65535 batch entries on CUDA, got ", B);
  return false;
}

// The row passes (d <= 32 and t <= 32), float64 sums; pass 1 over the rows of x1 with weights G_i . V_j, pass 2
// (point gradients only) over the rows of x2 with weights V_j . G_i.
Grads rows_backward(const at::Tensor& G, const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
                    const at::Tensor& outputscale, const at::Tensor& V, bool x_grads) {
  const int D = feature_bucket(x1.size(2));
  const int TC = rhs_bucket(V.size(2), x1.scalar_type() == at::kDouble);
  const at::Tensor p1 = x1.contiguous(), p2 = x2.contiguous(), ls = lengthscale.contiguous();
  const at::Tensor s = outputscale.contiguous();
  Grads out;
  with_kv_buckets(x1.scalar_type(), D, TC, [&](auto zero, auto dc, auto tc) {
    using scalar_t = decltype(zero);
    constexpr int kD = decltype(dc)::value, kTC = decltype(tc)::value;
    out = run_backward<kD>(p1, p2, ls, x_grads, [&](auto with_s, auto with_l, bool over_x1, bool want_a) {
      constexpr bool kS = decltype(with_s)::value, kL = decltype(with_l)::value;
      return over_x1 ? row_pass<scalar_t, kD, kTC, kS, kL>(p1, p2, ls, s, nullptr, 0, 0, 0, &G, &V, want_a)
                     : row_pass<scalar_t, kD, kTC, kS, kL>(p2, p1, ls, s, nullptr, 0, 0, 0, &V, &G, want_a);
    });
  });
  return out;
}

Grads bilinear_grads(const at::Tensor& G, const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
                     const at::Tensor& outputscale, const at::Tensor& V, int warps, bool allow_symmetric) {
  auto [gl, gs] = bilinear_backward(G, x1.contiguous(), x2.contiguous(), lengthscale.contiguous(),
                                    outputscale.contiguous(), V, warps, allow_symmetric);
  return {not_computed(x1), not_computed(x1), gl, gs};
}

}  // namespace

Grads matmul_backward_cuda(const at::Tensor& grad, const at::Tensor& x1, const at::Tensor& x2,
                           const at::Tensor& lengthscale, const at::Tensor& outputscale, const at::Tensor& v,
                           bool x_grads) {
  const bool empty = check_matmul_backward(grad, x1, x2, lengthscale, outputscale, v, "rbf_matmul_backward");
  const c10::cuda::CUDAGuard guard(x1.device());
  if (empty) return zero_grads(x1, x2, lengthscale, outputscale, x_grads);
  const at::Tensor G = grad.to(x1.scalar_type()).contiguous(), V = v.contiguous();
  const int64_t t = v.size(2);
  if (bilinear_backward_applies(x1, t, x_grads))
    return bilinear_grads(G, x1, x2, lengthscale, outputscale, V, 4, true);
  if (feature_bucket(x1.size(2)) == 0 || t > 32) {  // dense blocks of K, float64
    const at::Tensor G64 = G.to(at::kDouble), Vt = V.to(at::kDouble).transpose(1, 2);
    return dense_backward(x1, x2, lengthscale, outputscale, x_grads,
                          [&](int64_t i, int64_t r) { return at::bmm(G64.narrow(1, i, r), Vt); });
  }
  return rows_backward(G, x1, x2, lengthscale, outputscale, V, x_grads);
}

// The lengthscale and outputscale gradients (x_grads = false) by the named kernel: "rows" (the float64 row pass),
// "bilinear4" or "bilinear8" (tensor cores, 4 or 8 warps a block; float32 only), each pair once for K(x, x) as by
// default, or with the suffix "_nosym" every ordered pair.
std::tuple<at::Tensor, at::Tensor> matmul_backward_kernel_cuda(const at::Tensor& grad, const at::Tensor& x1,
                                                               const at::Tensor& x2, const at::Tensor& lengthscale,
                                                               const at::Tensor& outputscale, const at::Tensor& v,
                                                               c10::string_view kernel) {
  constexpr const char* kOp = "_rbf_matmul_backward_kernel";
  const std::string name(kernel);
  const bool rows = name == "rows", nosym = name.size() > 6 && name.substr(name.size() - 6) == "_nosym";
  const std::string base = nosym ? name.substr(0, name.size() - 6) : name;
  const int warps = base == "bilinear4" ? 4 : base == "bilinear8" ? 8 : 0;
  GPF_CHECK(rows || warps > 0, kOp,
            ": kernel must be 'rows', 'bilinear4', 'bilinear8', 'bilinear4_nosym' or 'bilinear8_nosym', got '",
            name, "'");
  const bool empty = check_matmul_backward(grad, x1, x2, lengthscale, outputscale, v, kOp);
  const int64_t d = x1.size(2), t = v.size(2);
  GPF_CHECK(d <= 32 && t <= 32, kOp, ": the fused kernels take d <= 32 and t <= 32, got d=", as_text(d), " and t=",
            as_text(t));
  GPF_CHECK(rows || x1.scalar_type() == at::kFloat, kOp, ": the tensor-core kernel takes float32, got ",
            x1.scalar_type());
  if (empty) return {at::zeros_like(lengthscale), at::zeros_like(outputscale)};
  const c10::cuda::CUDAGuard guard(x1.device());
  const at::Tensor G = grad.to(x1.scalar_type()).contiguous(), V = v.contiguous();
  const Grads out = rows ? rows_backward(G, x1, x2, lengthscale, outputscale, V, false)
                         : bilinear_grads(G, x1, x2, lengthscale, outputscale, V, warps, !nosym);
  return {std::get<2>(out), std::get<3>(out)};
}

}  // namespace cuda
}  // namespace gpfast

TORCH_LIBRARY_IMPL(gpfast, CUDA, m) {
  m.impl("rbf_matmul_backward", &gpfast::cuda::matmul_backward_cuda);
  m.impl("_rbf_matmul_backward_kernel", &gpfast::cuda::matmul_backward_kernel_cuda);
}
