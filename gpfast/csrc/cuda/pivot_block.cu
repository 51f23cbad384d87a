// CUDA launchers of the pivoted Cholesky's block steps, _pivot_select and _pivot_block. Device code: pivot_block.cuh.
#include "../common.h"
#include "dispatch.h"
#include "pivot_block.cuh"

namespace gpfast {
namespace cuda {

at::Tensor pivot_select_cuda(at::Tensor& d, const at::Tensor& Lb, const at::Tensor& cand, const at::Tensor& piv,
                             int64_t c) {
  check_pivot_select(d, Lb, cand, piv, c);
  const c10::cuda::CUDAGuard guard(d.device());
  const int64_t n = d.size(0);
  const at::Tensor Lc = Lb.contiguous(), cc = cand.contiguous(), pc = piv.contiguous();
  const int r = static_cast<int>(Lc.size(0)), np = static_cast<int>(pc.size(0));
  // also at the first block (r = np = 0), where it only clamps d to max(d, 0) as the CPU op does: without it a
  // negative or NaN diagonal entry would reach the selection, and the two ops would no longer agree
  pivot_update_kernel<<<static_cast<unsigned>(ceil_div(n, int64_t(kUpdateThreads))), kUpdateThreads, 0,
                        current_stream()>>>(d.data_ptr<double>(), Lc.data_ptr<double>(), r, cc.data_ptr<int64_t>(),
                                            static_cast<int>(cc.size(0)), pc.data_ptr<int64_t>(), np,
                                            static_cast<int>(n));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // a round of kSelectFresh points a block, at most one wave (more points take more rounds): the last block merges
  // 64 keys a block, kSelectFresh a round
  const int blocks =
      static_cast<int>(std::min<int64_t>(std::max<int64_t>(ceil_div(n, kSelectFresh), 1), sm_count()));
  at::Tensor part_v = at::empty({blocks * kSelectKeep}, d.options());
  at::Tensor part_i = at::empty({blocks * kSelectKeep}, d.options().dtype(at::kInt));
  at::Tensor ticket = at::zeros({1}, d.options().dtype(at::kInt));
  at::Tensor out = at::empty({c}, d.options().dtype(at::kLong));
  pivot_select_kernel<<<blocks, kSelectThreads, 0, current_stream()>>>(
      d.data_ptr<double>(), static_cast<int>(n), static_cast<int>(c), part_v.data_ptr<double>(),
      part_i.data_ptr<int>(), reinterpret_cast<unsigned*>(ticket.data_ptr<int>()), out.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> pivot_block_cuda(const at::Tensor& rows, const at::Tensor& cand,
                                                                const at::Tensor& d, const at::Tensor& floor,
                                                                int64_t b) {
  check_pivot_block(rows, cand, d, floor, b);
  const c10::cuda::CUDAGuard guard(rows.device());
  const at::Tensor rc = rows.stride(1) == 1 ? rows : rows.contiguous();
  const at::Tensor cc = cand.contiguous(), dc = d.contiguous(), fc = floor.contiguous();
  at::Tensor piv = at::empty({b}, rows.options().dtype(at::kLong));
  at::Tensor G = at::empty({b, b}, rows.options());
  at::Tensor Ginv = at::empty({b, b}, rows.options());
  const int64_t c = rc.size(0);
  auto* launch = c <= 32 ? pivot_block_kernel<32> : pivot_block_kernel<64>;  // fewer values a thread at c <= 32
  launch<<<1, kPivotThreads, 0, current_stream()>>>(
      rc.data_ptr<double>(), rc.stride(0), cc.data_ptr<int64_t>(), dc.data_ptr<double>(), fc.data_ptr<double>(),
      static_cast<int>(c), static_cast<int>(b), piv.data_ptr<int64_t>(), G.data_ptr<double>(),
      Ginv.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {piv, G, Ginv};
}

}  // namespace cuda
}  // namespace gpfast

TORCH_LIBRARY_IMPL(gpfast, CUDA, m) {
  m.impl("_pivot_block", &gpfast::cuda::pivot_block_cuda);
  m.impl("_pivot_select", &gpfast::cuda::pivot_select_cuda);
}
