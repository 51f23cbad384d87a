// Host side of the tensor-core (lengthscale, outputscale) backward of K @ V (device code: backward_bilinear.cuh).
#pragma once

#include <ATen/ATen.h>

#include <utility>

namespace gpfast {
namespace cuda {

// Whether bwd_bilinear_kernel takes this backward by default: float32, no point gradients, d <= 32 and t <= 17 (one
// solve and 16 probes, the engine's case). The kernel runs to t = 32 (the private op), but the accuracy tests hold it
// at t = 1, 11 and 17 only, and at t = 32 its outputscale gradient was 2e-6 (relative) from the float64 row pass on
// the H200, where t <= 17 stayed within 1e-6 in the same test.
inline bool bilinear_backward_applies(const at::Tensor& x1, int64_t t, bool x_grads) {
  return !x_grads && x1.scalar_type() == at::kFloat && x1.size(2) <= 32 && t <= 17;
}

// The lengthscale (B, d) and outputscale (B) gradients of sum(G * (K(x1, x2) V)), for canonical contiguous
// float32 inputs with B, n, m, d, t >= 1, d <= 32 and t <= 32, G (B, n, t) and V (B, m, t). `warps` (4 or 8) sets
// the rows per block, 16 a warp. With allow_symmetric, K(x, x) (x1 and x2 the same memory) with t <= 20 takes
// each pair of points once, with the weights of both orders (about 1.7x fewer MMAs at t = 17).
std::pair<at::Tensor, at::Tensor> bilinear_backward(const at::Tensor& G, const at::Tensor& x1, const at::Tensor& x2,
                                                    const at::Tensor& lengthscale, const at::Tensor& outputscale,
                                                    const at::Tensor& V, int warps, bool allow_symmetric);

}  // namespace cuda
}  // namespace gpfast
