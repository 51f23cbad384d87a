// Host-side helpers shared by the CUDA launchers: feature-count buckets and grid sizing.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

#include "../common.h"

namespace gpfast {
namespace cuda {

// The fused gradient and K@V kernels keep one row of z in registers, so the feature count is a template
// parameter: d is rounded up to 4, 8, 16 or 32 (zero features cost time, never accuracy). 0 = too wide.
inline int feature_bucket(int64_t d) {
  for (int D : {4, 8, 16, 32})
    if (d <= D) return D;
  return 0;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int sm_count() {
  int device = 0, count = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Dispatch on the feature bucket; `fn` is called with std::integral_constant<int, D>.
template <typename Fn>
void with_feature_bucket(int D, Fn&& fn) {
  switch (D) {
    case 4: fn(std::integral_constant<int, 4>{}); break;
    case 8: fn(std::integral_constant<int, 8>{}); break;
    case 16: fn(std::integral_constant<int, 16>{}); break;
    case 32: fn(std::integral_constant<int, 32>{}); break;
    default: TORCH_CHECK(false, "gpfast: internal error, feature bucket ", D);
  }
}

}  // namespace cuda
}  // namespace gpfast
