// Host-side helpers shared by the CPU and CUDA implementations: argument checks and the pre-scaling
// z = x / lengthscale that every kernel works on.
//
// Every registered op takes canonical shapes; the Python wrapper (gpfast/ops.py) broadcasts the user's
// shapes into them:
//   x1: (B, n, d)   x2: (B, m, d)   lengthscale: (B, d)   outputscale: (B)   v: (B, m, t)
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <type_traits>

namespace gpfast {

inline std::string dims_text(at::IntArrayRef dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(static_cast<long long>(dims[i]));
  return text + "]";
}

// GPF_CHECK(cond, ...) is TORCH_CHECK with its message's integers and shapes turned into text by std::to_string
// before the message is streamed. Why: in the CUDA launchers (compiled by nvcc) a failed TORCH_CHECK whose message
// streamed an integer, or a shape (whose stream operator streams integers), ended the interpreter with a
// segmentation fault on the GPU machine instead of raising, while messages of strings, dtypes and devices raised.
// Every check here and in cuda/ goes through it; like TORCH_CHECK, the message is only built on failure.
template <typename T>
decltype(auto) check_piece(const T& v) {
  if constexpr (std::is_same_v<T, bool>) {
    return std::string(v ? "true" : "false");
  } else if constexpr (std::is_integral_v<T> && !std::is_same_v<T, char> && std::is_signed_v<T>) {
    return std::to_string(static_cast<long long>(v));
  } else if constexpr (std::is_integral_v<T> && !std::is_same_v<T, char>) {
    return std::to_string(static_cast<unsigned long long>(v));
  } else if constexpr (std::is_same_v<T, at::IntArrayRef>) {
    return dims_text(v);
  } else {
    return (v);
  }
}
template <typename... Args>
std::string check_text(const Args&... args) {
  return c10::str(check_piece(args)...);
}
#define GPF_CHECK(cond, ...) TORCH_CHECK(cond, ::gpfast::check_text(__VA_ARGS__))

inline void check_canonical(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
                            const at::Tensor& outputscale, const char* op) {
  GPF_CHECK(x1.dim() == 3, op, ": x1 must be (B, n, d), got ", x1.dim(), " dims with shape ", x1.sizes());
  GPF_CHECK(x2.dim() == 3, op, ": x2 must be (B, m, d), got ", x2.dim(), " dims with shape ", x2.sizes());
  GPF_CHECK(x1.size(0) == x2.size(0), op, ": batch of x1 (", x1.size(0), ") and x2 (", x2.size(0),
            ") must match");
  GPF_CHECK(x1.size(2) == x2.size(2), op, ": x1 has d=", x1.size(2), " features but x2 has d=", x2.size(2));
  GPF_CHECK(lengthscale.dim() == 2 && lengthscale.size(0) == x1.size(0) && lengthscale.size(1) == x1.size(2),
            op, ": lengthscale must be (B, d) = (", x1.size(0), ", ", x1.size(2), "), got ", lengthscale.sizes());
  GPF_CHECK(outputscale.dim() == 1 && outputscale.size(0) == x1.size(0), op, ": outputscale must be (B,) = (",
            x1.size(0), ",), got ", outputscale.sizes());
  GPF_CHECK(x1.scalar_type() == at::kFloat || x1.scalar_type() == at::kDouble, op,
            ": x1 must be float32 or float64, got ", x1.scalar_type());
  for (const at::Tensor* t : {&x2, &lengthscale, &outputscale}) {
    GPF_CHECK(t->scalar_type() == x1.scalar_type(), op, ": all inputs must share x1's dtype ",
              x1.scalar_type(), ", got ", t->scalar_type());
    GPF_CHECK(t->device() == x1.device(), op, ": all inputs must be on x1's device ", x1.device(), ", got ",
              t->device());
  }
}

inline void check_rhs(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& v, const char* op) {
  GPF_CHECK(v.dim() == 3 && v.size(0) == x2.size(0) && v.size(1) == x2.size(1), op,
            ": v must be (B, m, t) with (B, m) = (", x2.size(0), ", ", x2.size(1), "), got ", v.sizes());
  GPF_CHECK(v.scalar_type() == x1.scalar_type(), op, ": v must share x1's dtype ", x1.scalar_type(), ", got ",
            v.scalar_type());
  GPF_CHECK(v.device() == x1.device(), op, ": v must be on x1's device ", x1.device(), ", got ", v.device());
}

// dense_matmul's arguments: K (rows, n) and V (n, t), float32 or float64, one dtype, one device.
inline void check_dense_matmul(const at::Tensor& K, const at::Tensor& V, const char* op) {
  GPF_CHECK(K.dim() == 2, op, ": K must be (rows, n), got ", K.dim(), " dims with shape ", K.sizes());
  GPF_CHECK(V.dim() == 2, op, ": V must be (n, t), got ", V.dim(), " dims with shape ", V.sizes());
  GPF_CHECK(K.size(1) == V.size(0), op, ": K is ", K.sizes(), " but V has ", V.size(0), " rows (need ",
            K.size(1), ")");
  GPF_CHECK(K.scalar_type() == at::kFloat || K.scalar_type() == at::kDouble, op,
            ": K must be float32 or float64, got ", K.scalar_type());
  GPF_CHECK(V.scalar_type() == K.scalar_type(), op, ": V must share K's dtype ", K.scalar_type(), ", got ",
            V.scalar_type());
  GPF_CHECK(V.device() == K.device(), op, ": V must be on K's device ", K.device(), ", got ", V.device());
}

// _dense_matmul_half's arguments: K (rows, n) float16 and V (n, t) float32, one device.
inline void check_dense_matmul_half(const at::Tensor& K, const at::Tensor& V) {
  const char* op = "_dense_matmul_half";
  GPF_CHECK(K.dim() == 2, op, ": K must be (rows, n), got ", K.dim(), " dims with shape ", K.sizes());
  GPF_CHECK(V.dim() == 2, op, ": V must be (n, t), got ", V.dim(), " dims with shape ", V.sizes());
  GPF_CHECK(K.size(1) == V.size(0), op, ": K is ", K.sizes(), " but V has ", V.size(0), " rows (need ",
            K.size(1), ")");
  GPF_CHECK(K.scalar_type() == at::kHalf, op, ": K must be float16, got ", K.scalar_type());
  GPF_CHECK(V.scalar_type() == at::kFloat, op, ": V must be float32, got ", V.scalar_type());
  GPF_CHECK(V.device() == K.device(), op, ": V must be on K's device ", K.device(), ", got ", V.device());
}

// stored_backward's arguments: K (n, m) with column stride 1 (any row stride), x1 (n, d), x2 (m, d), lengthscale
// (d), outputscale 0-dim, G (n, t), V (m, t); one floating dtype and one device.
inline void check_stored_backward(const at::Tensor& K, const at::Tensor& x1, const at::Tensor& x2,
                                  const at::Tensor& lengthscale, const at::Tensor& outputscale, const at::Tensor& G,
                                  const at::Tensor& V, const char* op) {
  GPF_CHECK(K.dim() == 2, op, ": K must be (n, m), got shape ", K.sizes());
  const int64_t n = K.size(0), m = K.size(1);
  GPF_CHECK(x1.dim() == 2 && x1.size(0) == n, op, ": x1 must be (n, d) with n = ", n, " (K's rows), got ",
            x1.sizes());
  const int64_t d = x1.size(1);
  GPF_CHECK(x2.dim() == 2 && x2.size(0) == m && x2.size(1) == d, op, ": x2 must be (m, d) = (", m, ", ", d,
            "), got ", x2.sizes());
  GPF_CHECK(lengthscale.dim() == 1 && lengthscale.size(0) == d, op, ": lengthscale must be (d,) = (", d,
            ",), got ", lengthscale.sizes());
  GPF_CHECK(outputscale.dim() == 0, op, ": outputscale must be 0-dim, got ", outputscale.sizes());
  GPF_CHECK(G.dim() == 2 && G.size(0) == n, op, ": G must be (n, t) with n = ", n, ", got ", G.sizes());
  GPF_CHECK(V.dim() == 2 && V.size(0) == m && V.size(1) == G.size(1), op, ": V must be (m, t) = (", m, ", ",
            G.size(1), "), got ", V.sizes());
  GPF_CHECK(K.scalar_type() == at::kFloat || K.scalar_type() == at::kDouble, op,
            ": K must be float32 or float64, got ", K.scalar_type());
  for (const at::Tensor* a : {&x1, &x2, &lengthscale, &outputscale, &G, &V}) {
    GPF_CHECK(a->scalar_type() == K.scalar_type(), op, ": all inputs must share K's dtype ", K.scalar_type(),
              ", got ", a->scalar_type());
    GPF_CHECK(a->device() == K.device(), op, ": all inputs must be on K's device ", K.device(), ", got ",
              a->device());
  }
}

// The covariance backward's arguments when the forward's K comes with them: grad and K (B, n, m) for canonical
// points (check_canonical), K of x1's dtype and device.
inline void check_backward_from_k(const at::Tensor& grad, const at::Tensor& K, const at::Tensor& x1,
                                  const at::Tensor& x2, const at::Tensor& lengthscale, const at::Tensor& outputscale,
                                  const char* op) {
  check_canonical(x1, x2, lengthscale, outputscale, op);
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1);
  for (const at::Tensor* t : {&grad, &K}) {
    GPF_CHECK(t->dim() == 3 && t->size(0) == B && t->size(1) == n && t->size(2) == m, op, ": ",
              t == &K ? "K" : "grad", " must be (B, n, m) = (", B, ", ", n, ", ", m, "), got ", t->sizes());
    GPF_CHECK(t->device() == x1.device(), op, ": ", t == &K ? "K" : "grad", " must be on x1's device ",
              x1.device(), ", got ", t->device());
  }
  GPF_CHECK(K.scalar_type() == x1.scalar_type(), op, ": K must share x1's dtype ", x1.scalar_type(), ", got ",
            K.scalar_type());
}

// The gradients of sum(grad * K) for K = K(x1, x2) given (the forward's output), by ATen operations in float64 on
// any device: the CPU implementation, the CUDA fallback for the shapes its kernel does not take, and the tests'
// reference (ops.cpp). Returns (x1, x2, lengthscale, outputscale) gradients, the first two (0,) without x_grads.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> covariance_backward_from_k_reference(
    const at::Tensor& grad, const at::Tensor& K, const at::Tensor& x1, const at::Tensor& x2,
    const at::Tensor& lengthscale, const at::Tensor& outputscale, bool x_grads);

// stored_backward by ATen operations in float64 on any device: the CPU implementation, the CUDA fallback for the
// shapes the kernel does not take, and the tests' reference (ops.cpp).
std::tuple<at::Tensor, at::Tensor> stored_backward_reference(const at::Tensor& K, const at::Tensor& x1,
                                                             const at::Tensor& x2, const at::Tensor& lengthscale,
                                                             const at::Tensor& outputscale, const at::Tensor& G,
                                                             const at::Tensor& V);

// z = x / lengthscale, contiguous, zero-padded on the feature axis to `dpad` columns. Zero columns add
// nothing to a squared distance and get zero gradient, so kernels may round d up freely.
inline at::Tensor prescale(const at::Tensor& x, const at::Tensor& lengthscale, int64_t dpad) {
  at::Tensor z = x / lengthscale.unsqueeze(1);
  const int64_t d = x.size(2);
  if (dpad == d) return z.contiguous();
  at::Tensor out = at::zeros({x.size(0), x.size(1), dpad}, x.options());
  out.narrow(2, 0, d).copy_(z);
  return out;
}

}  // namespace gpfast

namespace gpfast {

// The pivoted Cholesky's block steps (gpfast/train/preconditioner.py).
constexpr int64_t kPivotBlockMaxCandidates = 64;
constexpr int64_t kPivotBlockMaxPivots = 32;

inline void check_f64_on(const at::Tensor& t, const at::Tensor& like, const char* op, const char* name) {
  GPF_CHECK(t.scalar_type() == at::kDouble, op, ": ", name, " must be float64, got ", t.scalar_type());
  GPF_CHECK(t.device() == like.device(), op, ": ", name, " must be on ", like.device(), ", got ", t.device());
}

inline void check_index_on(const at::Tensor& t, const at::Tensor& like, const char* op, const char* name) {
  GPF_CHECK(t.dim() == 1 && t.scalar_type() == at::kLong, op, ": ", name, " must be a 1-d int64 tensor, got ",
            t.scalar_type(), " of shape ", dims_text(t.sizes()));
  GPF_CHECK(t.device() == like.device(), op, ": ", name, " must be on ", like.device(), ", got ", t.device());
}

// _pivot_block(rows, cand, d, floor, b): rows (c, n) the candidates' residual rows, cand (c,) their columns in
// rows, d (n,) the remaining diagonal, floor 0-dim; 1 <= c <= 64, 1 <= b <= min(c, 32).
inline void check_pivot_block(const at::Tensor& rows, const at::Tensor& cand, const at::Tensor& d,
                              const at::Tensor& floor, int64_t b) {
  const char* op = "_pivot_block";
  GPF_CHECK(rows.dim() == 2, op, ": rows must be (c, n), got shape ", dims_text(rows.sizes()));
  const int64_t c = rows.size(0), n = rows.size(1);
  GPF_CHECK(c >= 1 && c <= kPivotBlockMaxCandidates, op, ": candidates c = rows.size(0) must be in [1, ",
            std::to_string(kPivotBlockMaxCandidates), "], got ", std::to_string(c));
  GPF_CHECK(b >= 1 && b <= std::min(c, kPivotBlockMaxPivots), op, ": pivots b must be in [1, min(c=",
            std::to_string(c), ", ", std::to_string(kPivotBlockMaxPivots), ")], got ", std::to_string(b));
  check_index_on(cand, rows, op, "cand");
  GPF_CHECK(cand.size(0) == c, op, ": cand must be (c,) = (", std::to_string(c), ",), got ",
               dims_text(cand.sizes()));
  GPF_CHECK(d.dim() == 1 && d.size(0) == n, op, ": d must be (n,) = (", std::to_string(n), ",), got ",
            dims_text(d.sizes()));
  GPF_CHECK(floor.dim() == 0, op, ": floor must be a 0-dim tensor, got shape ", dims_text(floor.sizes()));
  check_f64_on(rows, rows, op, "rows");
  check_f64_on(d, rows, op, "d");
  check_f64_on(floor, rows, op, "floor");
}

// _pivot_select(d, Lb, cand, piv, c): d (n,) contiguous (updated in place), Lb (r, n) the previous block's columns,
// cand (q,) and piv (p,) int64 (the points cand[piv] are zeroed), 1 <= c <= min(n, 64); r, p <= 64.
inline void check_pivot_select(const at::Tensor& d, const at::Tensor& Lb, const at::Tensor& cand,
                               const at::Tensor& piv, int64_t c) {
  const char* op = "_pivot_select";
  GPF_CHECK(d.dim() == 1 && d.is_contiguous(), op, ": d must be a contiguous 1-d tensor (it is updated in place), "
            "got shape ", dims_text(d.sizes()), " and strides ", dims_text(d.strides()));
  const int64_t n = d.size(0);
  GPF_CHECK(n <= (int64_t{1} << 30), op, ": at most 2^30 points, got n = ", std::to_string(n));
  GPF_CHECK(c >= 1 && c <= std::min(n, kPivotBlockMaxCandidates), op, ": candidates c must be in [1, min(n=",
            std::to_string(n), ", ", std::to_string(kPivotBlockMaxCandidates), ")], got ", std::to_string(c));
  GPF_CHECK(Lb.dim() == 2 && Lb.size(1) == n && Lb.size(0) <= kPivotBlockMaxCandidates, op,
            ": Lb must be (r, n) with n = ", std::to_string(n), " and r <= ",
            std::to_string(kPivotBlockMaxCandidates), ", got shape ", dims_text(Lb.sizes()));
  check_index_on(cand, d, op, "cand");
  check_index_on(piv, d, op, "piv");
  GPF_CHECK(piv.size(0) <= kPivotBlockMaxCandidates, op, ": at most ", std::to_string(kPivotBlockMaxCandidates),
            " pivots, got ", std::to_string(piv.size(0)));
  check_f64_on(d, d, op, "d");
  check_f64_on(Lb, d, op, "Lb");
}

}  // namespace gpfast
