// The one dispatch of the fused K @ V kernels (forward and backward): dtype x feature bucket x right-hand-side
// bucket, without the float64 kernels that the 12- and 16-column buckets do not have.
#pragma once

#include "dispatch.h"

namespace gpfast {
namespace cuda {

// Calls fn(scalar_t{}, dc, tc) with dc, tc the std::integral_constant of the feature bucket D and the
// right-hand-side bucket TC (rhs_bucket picks neither 12 nor 16 for float64).
template <typename Fn>
void with_kv_buckets(at::ScalarType dtype, int D, int TC, Fn&& fn) {
  AT_DISPATCH_FLOATING_TYPES(dtype, "gpfast_kv_kernels", [&] {
    with_feature_bucket(D, [&](auto dc) {
      with_rhs_bucket(TC, [&](auto tc) {
        constexpr int kTC = decltype(tc)::value;
        if constexpr (sizeof(scalar_t) == 8 && (kTC == 12 || kTC == 16)) {
          GPF_CHECK(false, "gpfast: internal error, no float64 kernel for ", kTC, " columns");
        } else {
          fn(scalar_t{}, dc, tc);
        }
      });
    });
  });
}

}  // namespace cuda
}  // namespace gpfast
