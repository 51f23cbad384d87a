// Host-side helpers shared by the CUDA launchers: compile-time buckets, grid sizing, the dense fall-backs' hooks.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "../common.h"

namespace gpfast {
namespace cuda {

// The fused kernels keep rows of points in registers, so the feature count is a template parameter: d is rounded
// up to 4, 8, 16 or 32 (zero features cost time, never accuracy). 0 = too wide for the fused kernels.
inline int feature_bucket(int64_t d) {
  for (int D : {4, 8, 16, 32})
    if (d <= D) return D;
  return 0;
}

// Right-hand-side columns per thread for K @ V: one chunk for t <= 32, chunks of 32 beyond (each chunk recomputes
// K). 12 serves the training engine's 11 columns (probe vectors plus the solve) without padding to 16.
inline int rhs_bucket(int64_t t, bool is_double) {
  if (t == 1) return 1;
  if (t <= 8) return 8;
  if (!is_double && t <= 12) return 12;
  if (!is_double && t <= 16) return 16;
  return 32;
}

// The one bucket dispatcher: calls fn(std::integral_constant<int, V>{}) for the V in Values equal to `value`.
template <int... Values, typename Fn>
void with_bucket(int value, const char* what, Fn&& fn) {
  const bool found = (... || (value == Values && (fn(std::integral_constant<int, Values>{}), true)));
  GPF_CHECK(found, "gpfast: internal error, no ", what, " bucket ", value);
}

template <typename Fn>
void with_feature_bucket(int D, Fn&& fn) {
  with_bucket<4, 8, 16, 32>(D, "feature", std::forward<Fn>(fn));
}

template <typename Fn>
void with_rhs_bucket(int TC, Fn&& fn) {
  with_bucket<1, 8, 12, 16, 32>(TC, "right-hand-side", std::forward<Fn>(fn));
}

// A number as text, for messages built outside GPF_CHECK (common.h says why numbers are not streamed here).
inline std::string as_text(int64_t v) { return std::to_string(static_cast<long long>(v)); }

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Multiprocessor count of the current device, queried once per device.
inline int sm_count() {
  static int cache[64] = {0};
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 64 && cache[device] > 0) return cache[device];
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  if (device < 64) cache[device] = count;
  return count;
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

inline bool aligned(const void* p, size_t bytes) { return (reinterpret_cast<uintptr_t>(p) % bytes) == 0; }
inline bool aligned16(const void* p) { return aligned(p, 16); }

// The covariance forward (rbf_covariance.cu): the dense fall-backs of K @ V and of the backward (d > 32, or more
// than 32 right-hand sides) build blocks of K with it.
at::Tensor covariance_cuda(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
                           const at::Tensor& outputscale);

// Rows of a dense block of K: bounded so that a block of doubles stays near 512 MB.
inline int64_t dense_block_rows(int64_t m) {
  return std::max<int64_t>(1, (int64_t(1) << 26) / std::max<int64_t>(m, 1));
}

// Blocks that split the columns when the rows alone give too few blocks to fill the GPU; returns the columns
// per split, a multiple of `tile`, and sets `splits`.
inline int64_t split_columns(int64_t blocks, int64_t m, int64_t tile, int blocks_per_sm, int64_t& splits) {
  const int64_t target = int64_t(blocks_per_sm) * sm_count();
  splits = std::clamp<int64_t>(ceil_div(target, std::max<int64_t>(blocks, 1)), 1, ceil_div(m, tile));
  const int64_t cols = ceil_div(ceil_div(m, splits), tile) * tile;
  splits = ceil_div(m, cols);
  return cols;
}

}  // namespace cuda
}  // namespace gpfast
