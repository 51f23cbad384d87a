// The gpfast op schemas, in one place. CPU and CUDA implementations live in cpu/ and cuda/; the fake
// (meta) implementations and autograd formulas are registered from Python (gpfast/ops.py).
#include <algorithm>
#include <string>
#include <tuple>

#include "common.h"

namespace gpfast {

// K(x1_i, x2_i) for paired rows (GPyTorch's diag=True). O(n d) work, so it is written with ATen ops and
// registered as CompositeImplicitAutograd: autograd, meta and every backend come for free.
at::Tensor rbf_covariance_diag(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
                               const at::Tensor& outputscale) {
  check_canonical(x1, x2, lengthscale, outputscale, "rbf_covariance_diag");
  TORCH_CHECK(x1.size(1) == x2.size(1), "rbf_covariance_diag: diag=True needs as many rows in x2 as in x1, got n=",
              x1.size(1), " and m=", x2.size(1));
  at::Tensor diff = (x1 - x2) / lengthscale.unsqueeze(1);
  return outputscale.unsqueeze(1) * at::exp(-0.5 * diff.pow(2).sum(-1));
}

// K @ V for a stored K, on the CPU: at::mm (the CUDA kernel is cuda/dense_matmul.cu).
at::Tensor dense_matmul_cpu(const at::Tensor& K, const at::Tensor& V) {
  check_dense_matmul(K, V, "dense_matmul");
  return at::mm(K, V);
}

// K (float16) @ V (float32) on the CPU: K widened to float32, then at::mm.
at::Tensor dense_matmul_half_cpu(const at::Tensor& K, const at::Tensor& V) {
  check_dense_matmul_half(K, V);
  return at::mm(K.to(at::kFloat), V);
}

// K @ V for a symmetric K, on the CPU: at::mm of the whole K (the CUDA kernel, cuda/symmetric_matmul.cu, reads its
// block upper triangle). block is checked as on CUDA, so that a bad value fails the same way everywhere.
at::Tensor symmetric_matmul_cpu(const at::Tensor& K, const at::Tensor& V, int64_t block, int64_t stages) {
  check_dense_matmul(K, V, "symmetric_matmul");
  TORCH_CHECK(K.size(0) == K.size(1), "symmetric_matmul: K must be square, got shape ", K.sizes());
  TORCH_CHECK(block == 0 || block == -1 || block == 256 || block == 512 || block == 1024,
              "symmetric_matmul: block must be 0 (auto), -1 (the full-matrix kernel), 256, 512 or 1024, got ", block);
  TORCH_CHECK(stages >= 0 && stages <= 5, "symmetric_matmul: stages must be 0 .. 5, got ", stages);
  return at::mm(K, V);
}

// Chunks of rows so that M (rows, m) in float64 takes about 64 MB. The centre is x1's mean: (z_i - z_j)^2 is the
// same for any centre, and in float64 the expanded form's cancellation costs 2^-53 relative to its terms.
std::tuple<at::Tensor, at::Tensor> stored_backward_reference(const at::Tensor& K, const at::Tensor& x1,
                                                             const at::Tensor& x2, const at::Tensor& lengthscale,
                                                             const at::Tensor& outputscale, const at::Tensor& G,
                                                             const at::Tensor& V) {
  const auto f64 = at::kDouble;
  const int64_t n = K.size(0), m = K.size(1), d = x1.size(1);
  const at::Tensor l = lengthscale.to(f64);
  const at::Tensor mu = n > 0 ? x1.to(f64).mean(0) : at::zeros({d}, l.options());
  const at::Tensor z1 = (x1.to(f64) - mu) / l, z2 = (x2.to(f64) - mu) / l;
  const at::Tensor Gd = G.to(f64), Vt = V.to(f64).t();
  at::Tensor L = at::zeros({d}, l.options()), S = at::zeros({}, l.options()), c = at::zeros({m}, l.options());
  const int64_t chunk = std::max<int64_t>(1, (int64_t(8) << 20) / std::max<int64_t>(m, 1));
  for (int64_t r0 = 0; r0 < n; r0 += chunk) {
    const int64_t rows = std::min(chunk, n - r0);
    const at::Tensor M = at::mm(Gd.narrow(0, r0, rows), Vt) * K.narrow(0, r0, rows).to(f64);
    const at::Tensor r = M.sum(1), zc = z1.narrow(0, r0, rows);
    c += M.sum(0);
    S += r.sum();
    L += (r.unsqueeze(1) * zc * zc).sum(0) - 2.0 * (zc * at::mm(M, z2)).sum(0);
  }
  L += at::mv((z2 * z2).t(), c);
  return {(L / l).to(K.scalar_type()), (S / outputscale.to(f64)).to(K.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor> stored_backward_cpu(const at::Tensor& K, const at::Tensor& x1,
                                                       const at::Tensor& x2, const at::Tensor& lengthscale,
                                                       const at::Tensor& outputscale, const at::Tensor& G,
                                                       const at::Tensor& V, c10::string_view kernel) {
  check_stored_backward(K, x1, x2, lengthscale, outputscale, G, V, "stored_backward");
  TORCH_CHECK(kernel == "auto" || kernel == "reference", "stored_backward: on the CPU the kernel is 'auto' or ",
              "'reference' (the tensor-core kernels run on CUDA tensors only), got '", std::string(kernel), "'");
  return stored_backward_reference(K, x1, x2, lengthscale, outputscale, G, V);
}

// M = grad o K in float64, row chunks of about 64 MB; z = (x - c) / l with c x2's mean (any common centre gives the
// same (z_i - z_j)), and with r = M 1, c = M^T 1, P = M Z2, Q = M^T Z1:
//   A1 = r z1 - P, A2 = c z2 - Q,  d/dx1 = -A1 / l, d/dx2 = -A2 / l,
//   L = sum r z1^2 - 2 z1 P + sum c z2^2,  d/dl = L / l,  d/ds = sum M / s.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> covariance_backward_from_k_reference(
    const at::Tensor& grad, const at::Tensor& K, const at::Tensor& x1, const at::Tensor& x2,
    const at::Tensor& lengthscale, const at::Tensor& outputscale, bool x_grads) {
  const auto f64 = at::kDouble;
  const auto dtype = x1.scalar_type();
  const int64_t n = x1.size(1), m = x2.size(1);
  const at::Tensor l = lengthscale.to(f64).unsqueeze(1), X1 = x1.to(f64), X2 = x2.to(f64);
  const at::Tensor c = m > 0 ? X2.mean(1, true) : at::zeros({x1.size(0), 1, x1.size(2)}, X1.options());
  const at::Tensor Z1 = (X1 - c) / l, Z2 = (X2 - c) / l;
  at::Tensor A1 = at::zeros_like(Z1), colw = at::zeros({x1.size(0), m, 1}, Z1.options());
  at::Tensor Q = at::zeros_like(Z2), L = at::zeros_like(lengthscale.to(f64)),
             S = at::zeros_like(outputscale.to(f64));
  const int64_t chunk = std::max<int64_t>(1, (int64_t(8) << 20) / std::max<int64_t>(m, 1));
  for (int64_t r0 = 0; r0 < n; r0 += chunk) {
    const int64_t rows = std::min(chunk, n - r0);
    const at::Tensor M = grad.narrow(1, r0, rows).to(f64) * K.narrow(1, r0, rows).to(f64);
    const at::Tensor r = M.sum(2, true), zc = Z1.narrow(1, r0, rows), P = at::bmm(M, Z2);
    A1.narrow(1, r0, rows).copy_(r * zc - P);
    colw += M.sum(1).unsqueeze(-1);
    Q += at::bmm(M.transpose(1, 2), zc);
    L += (r * zc * zc - 2.0 * zc * P).sum(1);
    S += r.sum(at::IntArrayRef{1, 2});
  }
  L += (colw * Z2 * Z2).sum(1);
  const at::Tensor gl = (L / l.squeeze(1)).to(dtype), gs = (S / outputscale.to(f64)).to(dtype);
  if (!x_grads) return {at::empty({0}, x1.options()), at::empty({0}, x1.options()), gl, gs};
  return {(-A1 / l).to(dtype), (-(colw * Z2 - Q) / l).to(dtype), gl, gs};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> covariance_backward_from_k_cpu(
    const at::Tensor& grad, const at::Tensor& K, const at::Tensor& x1, const at::Tensor& x2,
    const at::Tensor& lengthscale, const at::Tensor& outputscale, bool x_grads, c10::string_view kernel) {
  check_backward_from_k(grad, K, x1, x2, lengthscale, outputscale, "_rbf_covariance_backward_from_k");
  TORCH_CHECK(kernel == "auto" || kernel == "reference", "_rbf_covariance_backward_from_k: kernel must be 'auto' or ",
              "'reference', got '", std::string(kernel), "'");
  return covariance_backward_from_k_reference(grad, K, x1, x2, lengthscale, outputscale, x_grads);
}

// The CUDA kernels' variants have no CPU counterpart: the CPU backward has one design (cpu/rbf.cpp).
std::tuple<at::Tensor, at::Tensor> matmul_backward_kernel_cpu(const at::Tensor&, const at::Tensor& x1,
                                                              const at::Tensor&, const at::Tensor&,
                                                              const at::Tensor&, const at::Tensor&,
                                                              c10::string_view kernel) {
  TORCH_CHECK(false, "_rbf_matmul_backward_kernel: the kernel '", std::string(kernel),
              "' runs on CUDA tensors only, got x1 on ", x1.device());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> covariance_backward_kernel_cpu(
    const at::Tensor&, const at::Tensor& x1, const at::Tensor&, const at::Tensor&, const at::Tensor&, bool,
    c10::string_view kernel) {
  TORCH_CHECK(false, "_rbf_covariance_backward_kernel: the kernel '", std::string(kernel),
              "' runs on CUDA tensors only, got x1 on ", x1.device());
}

at::Tensor matmul_kernel_cpu(const at::Tensor& x1, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, c10::string_view kernel) {
  TORCH_CHECK(false, "_rbf_matmul_kernel: the kernel '", std::string(kernel), "' runs on CUDA tensors only, got x1 on ",
              x1.device());
}

}  // namespace gpfast

TORCH_LIBRARY(gpfast, m) {
  m.def("rbf_covariance(Tensor x1, Tensor x2, Tensor lengthscale, Tensor outputscale) -> Tensor");
  // The backward ops' x_grads is the gradient mask: when false, the point gradients are not computed and the
  // first two outputs are empty tensors of shape (0,); the lengthscale and outputscale gradients always are.
  m.def(
      "rbf_covariance_backward(Tensor grad, Tensor x1, Tensor x2, Tensor lengthscale, Tensor outputscale,"
      " bool x_grads=True) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("rbf_covariance_diag(Tensor x1, Tensor x2, Tensor lengthscale, Tensor outputscale) -> Tensor");
  m.def("rbf_matmul(Tensor x1, Tensor x2, Tensor lengthscale, Tensor outputscale, Tensor v) -> Tensor");
  // Gradients of K(x1, x2) @ v for x1, x2, lengthscale, outputscale (the v-gradient is K^T grad, which is
  // rbf_matmul itself with x1 and x2 swapped).
  m.def(
      "rbf_matmul_backward(Tensor grad, Tensor x1, Tensor x2, Tensor lengthscale, Tensor outputscale, Tensor v,"
      " bool x_grads=True) -> (Tensor, Tensor, Tensor, Tensor)");
  // K @ V for a stored K (rows, n), row-major, and V (n, t): the training engine's stored-K product. CUDA: a
  // bandwidth kernel for t <= 16 (cuBLAS beyond, or for K with a column stride other than 1).
  m.def("dense_matmul(Tensor K, Tensor V) -> Tensor");
  // K float16, V float32: the preconditioner's factor stored in 16 bits (gpfast/train/preconditioner.py)
  m.def("_dense_matmul_half(Tensor K, Tensor V) -> Tensor");
  // K @ V for a symmetric stored K (n, n) and V (n, t): on CUDA, float32 and t <= 16, a tensor-core kernel reads
  // only K's blocks on and above the diagonal (K is taken as symmetric). block: the super-tile (256, 512, 1024),
  // 0 for the op's choice, -1 for dense_matmul's full-matrix kernel; stages: the copies in flight (0: the
  // super-tile's default), for the benchmarks.
  m.def("symmetric_matmul(Tensor K, Tensor V, int block=0, int stages=0) -> Tensor");
  // The lengthscale (d) and outputscale (0-dim) gradients of sum(G * (K V)) from a stored K = K(x1, x2) (n, m)
  // at that lengthscale and outputscale: the training engine's backward, which recomputes no exponential. kernel:
  // "auto", "reference" (float64 ATen operations, any device) or, on CUDA, "tc4" / "tc8" (tensor cores, 4 or 8
  // warps a block, each pair of K(x, x) once) and "tc4_nosym" / "tc8_nosym" (every ordered pair).
  m.def(
      "stored_backward(Tensor K, Tensor x1, Tensor x2, Tensor lengthscale, Tensor outputscale, Tensor G, Tensor V,"
      " str kernel=\"auto\") -> (Tensor, Tensor)");
  // Private, for rbf_covariance's autograd: the gradients of sum(grad * K) given the forward's K = K(x1, x2) (B, n,
  // m), so that no exponential is recomputed; the same outputs as rbf_covariance_backward. kernel: "auto" or
  // "reference" (float64 ATen operations, any device). CUDA float32 with d <= 32 runs on FP64 tensor cores.
  m.def(
      "_rbf_covariance_backward_from_k(Tensor grad, Tensor K, Tensor x1, Tensor x2, Tensor lengthscale,"
      " Tensor outputscale, bool x_grads=True, str kernel=\"auto\") -> (Tensor, Tensor, Tensor, Tensor)");
  // Private, for the training engine: K(x, x) (x (n, d), lengthscale (d), outputscale 0-dim) in the first n columns
  // of an (n, pitch) buffer, on CUDA; float32 with 17 <= d <= 32 computes each pair once and mirrors it.
  m.def("_rbf_covariance_symmetric(Tensor x, Tensor lengthscale, Tensor outputscale, int pitch) -> Tensor");
  // Private, for tests and benchmarks: run one kernel variant explicitly instead of the one the shape gets.
  // rbf_covariance on CUDA with the named kernel: "tile", "diff" or "expand" (csrc/README.md).
  m.def("_rbf_covariance_kernel(Tensor x1, Tensor x2, Tensor lengthscale, Tensor outputscale, str kernel) -> Tensor");
  // rbf_matmul on CUDA with the named kernel: "cuda_cores", "tc" or a tensor-core variant (csrc/README.md).
  m.def("_rbf_matmul_kernel(Tensor x1, Tensor x2, Tensor lengthscale, Tensor outputscale, Tensor v, str kernel) -> Tensor");
  // The lengthscale and outputscale gradients of rbf_matmul (no point gradients) on CUDA with the named kernel:
  // "rows" (the float64 row pass), "bilinear4" or "bilinear8" (tensor cores, float32), or the same with "_nosym"
  // (every ordered pair of K(x, x), not each pair once; csrc/README.md).
  m.def(
      "_rbf_matmul_backward_kernel(Tensor grad, Tensor x1, Tensor x2, Tensor lengthscale, Tensor outputscale,"
      " Tensor v, str kernel) -> (Tensor, Tensor)");
  // rbf_covariance_backward on CUDA with the named kernel: "rows64" (two row passes in float64 arithmetic, any
  // dtype) or "onepass32" (one pass in float32 arithmetic where the accuracy rule allows it; float32, d <= 16;
  // csrc/README.md).
  m.def(
      "_rbf_covariance_backward_kernel(Tensor grad, Tensor x1, Tensor x2, Tensor lengthscale, Tensor outputscale,"
      " bool x_grads, str kernel) -> (Tensor, Tensor, Tensor, Tensor)");
  // One of the four rbf ops on the CPU (its tensor arguments in schema order), with the portable build instead of
  // AVX2+FMA, and a budget in MB for the one-pass backward's column buffers (0: the two-pass form).
  m.def(
      "_rbf_cpu_path(str op, Tensor[] args, bool x_grads, bool portable, int column_buffer_mb) -> Tensor[]");
  // The pivoted Cholesky's block steps (gpfast/train/preconditioner.py), float64 with int64 indices. _pivot_select:
  // the previous block's update of the remaining diagonal d (in place) and the next c candidates; _pivot_block: a
  // block's b pivots among the candidates (rows (c, n) their residual rows, cand their columns), their factor G
  // (b, b) and its inverse (zero on the diagonal where a pivot fell below the floor).
  m.def("_pivot_select(Tensor(a!) d, Tensor Lb, Tensor cand, Tensor piv, int c) -> Tensor");
  m.def("_pivot_block(Tensor rows, Tensor cand, Tensor d, Tensor floor, int b) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(gpfast, CompositeImplicitAutograd, m) {
  m.impl("rbf_covariance_diag", &gpfast::rbf_covariance_diag);
}

TORCH_LIBRARY_IMPL(gpfast, CPU, m) {
  m.impl("dense_matmul", &gpfast::dense_matmul_cpu);
  m.impl("_dense_matmul_half", &gpfast::dense_matmul_half_cpu);
  m.impl("symmetric_matmul", &gpfast::symmetric_matmul_cpu);
  m.impl("stored_backward", &gpfast::stored_backward_cpu);
  m.impl("_rbf_covariance_backward_from_k", &gpfast::covariance_backward_from_k_cpu);
  m.impl("_rbf_matmul_backward_kernel", &gpfast::matmul_backward_kernel_cpu);
  m.impl("_rbf_matmul_kernel", &gpfast::matmul_kernel_cpu);
  m.impl("_rbf_covariance_backward_kernel", &gpfast::covariance_backward_kernel_cpu);
}
