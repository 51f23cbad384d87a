// CUDA launcher for _pivot_block (one pivoted-Cholesky block's greedy pivots). Device code: pivot_block.cuh.
#include "../common.h"
#include "dispatch.h"
#include "pivot_block.cuh"

namespace gpfast {
namespace cuda {

std::tuple<at::Tensor, at::Tensor, at::Tensor> pivot_block_cuda(const at::Tensor& S, const at::Tensor& d,
                                                                const at::Tensor& floor, int64_t b) {
  check_pivot_block(S, d, floor, b);
  const c10::cuda::CUDAGuard guard(S.device());
  const int64_t c = S.size(0);
  const at::Tensor Sc = S.contiguous(), dc = d.contiguous(), fc = floor.contiguous();
  at::Tensor piv = at::empty({b}, S.options().dtype(at::kLong));
  at::Tensor C = at::empty({c, b}, S.options());
  at::Tensor ok = at::empty({b}, S.options());
  pivot_block_kernel<<<1, kPivotThreads, 0, current_stream()>>>(
      Sc.data_ptr<double>(), dc.data_ptr<double>(), fc.data_ptr<double>(), static_cast<int>(c),
      static_cast<int>(b), piv.data_ptr<int64_t>(), C.data_ptr<double>(), ok.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {piv, C, ok};
}

}  // namespace cuda
}  // namespace gpfast

TORCH_LIBRARY_IMPL(gpfast, CUDA, m) { m.impl("_pivot_block", &gpfast::cuda::pivot_block_cuda); }
