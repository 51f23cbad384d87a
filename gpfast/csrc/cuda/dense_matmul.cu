// CUDA launcher for dense_matmul (K @ V with a stored K, skinny V). Device code: dense_matmul.cuh.
#include <vector>

#include "dense_matmul.cuh"
#include "dispatch.h"

namespace gpfast {
namespace cuda {

namespace {

// Right-hand-side columns the kernel is compiled for: 1, 2, 4, 8, 12, 16 (0: more than 16, cuBLAS).
int dmm_rhs_bucket(int64_t t) {
  for (int TC : {1, 2, 4, 8, 12, 16})
    if (t <= TC) return TC;
  return 0;
}

// Resident blocks per SM of one instantiation, queried once per device (after raising its shared-memory limit,
// which is per device too).
template <typename T, int TC, bool kAligned, typename TK = T>
int dmm_blocks_per_sm() {
  static int cache[64] = {0};
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 64 && cache[device] > 0) return cache[device];
  constexpr int smem = dmm_smem_bytes<T, TC>();
  auto kernel = dense_matmul_kernel<T, TC, kAligned, TK>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int blocks = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kDmmThreads, smem));
  blocks = std::max(blocks, 1);
  if (device < 64) cache[device] = blocks;
  return blocks;
}

template <typename T, int TC, bool kAligned, typename TK = T>
void launch_dense_matmul(const at::Tensor& K, int64_t ldk, const at::Tensor& V, at::Tensor& out) {
  constexpr int VEC = dmm_vec<TK>(), R = dmm_rows_per_warp<T, TC, TK>(), CB = dmm_chunk_cols<T, TC>();
  constexpr int64_t kStep = 32 * VEC;
  const int64_t rows = K.size(0), n = K.size(1), t = V.size(1);
  const int64_t slots = int64_t(dmm_blocks_per_sm<T, TC, kAligned, TK>()) * sm_count();
  const int64_t groups = ceil_div(rows, int64_t(kDmmWarps) * R);
  // chunks: at least what shared memory needs, and enough units (about 16 per block) that blocks finish together,
  // but no narrower than 512 columns; equal widths in multiples of the warp's step
  int64_t S = std::max(ceil_div(n, CB), std::min(ceil_div(16 * slots, groups), ceil_div(n, 512)));
  const int64_t chunk = ceil_div(ceil_div(n, S), kStep) * kStep;
  S = ceil_div(n, chunk);
  const int64_t units = S * groups;
  const int64_t grid = std::min(units, slots);
  at::Tensor part = S == 1 ? out : at::empty({S, rows, t}, out.options());
  DmmArgs<T, TK> a{};
  a.K = reinterpret_cast<const TK*>(K.const_data_ptr());
  a.V = V.data_ptr<T>();
  a.out = part.data_ptr<T>();
  a.ldk = ldk, a.rows = rows, a.n = n, a.chunk = chunk, a.groups = groups, a.units = units;
  a.t = static_cast<int>(t);
  dense_matmul_kernel<T, TC, kAligned, TK>
      <<<static_cast<unsigned>(grid), kDmmThreads, dmm_smem_bytes<T, TC>(), current_stream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (S > 1) {
    const int64_t count = rows * t;
    const int64_t blocks = std::min<int64_t>(ceil_div(count, 256), 8 * sm_count());
    dmm_sum_kernel<T><<<static_cast<unsigned>(blocks), 256, 0, current_stream()>>>(part.data_ptr<T>(),
                                                                                   out.data_ptr<T>(), count,
                                                                                   static_cast<int>(S));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// out = K @ V by the kernel for V's t <= 16 right-hand sides (K with column stride 1, row stride ldk >= 0): the
// 16-byte-load variant where every row starts 16-byte aligned, the scalar-load one otherwise.
template <typename T, typename TK = T>
void run_dense_matmul(const at::Tensor& K, int64_t ldk, const at::Tensor& Vc, at::Tensor& out) {
  const bool aligned = ldk % dmm_vec<TK>() == 0 && aligned16(K.data_ptr());
  with_bucket<1, 2, 4, 8, 12, 16>(dmm_rhs_bucket(Vc.size(1)), "right-hand-side", [&](auto tc) {
    constexpr int kTC = decltype(tc)::value;
    if (aligned)
      launch_dense_matmul<T, kTC, true, TK>(K, ldk, Vc, out);
    else
      launch_dense_matmul<T, kTC, false, TK>(K, ldk, Vc, out);
  });
}

}  // namespace

at::Tensor dense_matmul_cuda(const at::Tensor& K, const at::Tensor& V) {
  check_dense_matmul(K, V, "dense_matmul");
  const c10::cuda::CUDAGuard guard(K.device());
  const int64_t rows = K.size(0), n = K.size(1), t = V.size(1);
  if (rows == 0 || t == 0) return at::empty({rows, t}, K.options());
  if (n == 0) return at::zeros({rows, t}, K.options());
  const int TC = dmm_rhs_bucket(t);
  // the kernel reads rows with column stride 1 (any row stride, 0 included); anything else, or more than 16
  // right-hand sides: cuBLAS
  const bool rows_contiguous = K.stride(1) == 1 || n == 1;
  if (TC == 0 || !rows_contiguous) return at::mm(K, V);
  const int64_t ldk = rows > 1 ? K.stride(0) : n;
  GPF_CHECK(ldk >= 0, "dense_matmul: K must not have a negative row stride, got ", K.strides());
  const at::Tensor Vc = V.contiguous();
  at::Tensor out = at::empty({rows, t}, K.options());
  AT_DISPATCH_FLOATING_TYPES(K.scalar_type(), "dense_matmul_cuda",
                             [&] { run_dense_matmul<scalar_t>(K, ldk, Vc, out); });
  return out;
}

// K (rows, n) float16 @ V (n, t) float32 -> float32: K's values widened, float32 FMAs, as dense_matmul's kernel
// for a K with column stride 1, in passes of 16 right-hand sides (a K of another layout is widened to float32 and
// multiplied by cuBLAS).
at::Tensor dense_matmul_half_cuda(const at::Tensor& K, const at::Tensor& V) {
  check_dense_matmul_half(K, V);
  const c10::cuda::CUDAGuard guard(K.device());
  const int64_t rows = K.size(0), n = K.size(1), t = V.size(1);
  if (rows == 0 || t == 0) return at::empty({rows, t}, V.options());
  if (n == 0) return at::zeros({rows, t}, V.options());
  const bool rows_contiguous = K.stride(1) == 1 || n == 1;
  if (!rows_contiguous) return at::mm(K.to(at::kFloat), V);
  if (t > 16) {  // 16 right-hand sides a pass (the training engine's first step has 21 or more): K read per pass
    std::vector<at::Tensor> parts;
    for (int64_t c0 = 0; c0 < t; c0 += 16)
      parts.push_back(dense_matmul_half_cuda(K, V.narrow(1, c0, std::min<int64_t>(16, t - c0))));
    return at::cat(parts, 1);
  }
  const int64_t ldk = rows > 1 ? K.stride(0) : n;
  GPF_CHECK(ldk >= 0, "_dense_matmul_half: K must not have a negative row stride, got ", K.strides());
  const at::Tensor Vc = V.contiguous();
  at::Tensor out = at::empty({rows, t}, V.options());
  run_dense_matmul<float, __half>(K, ldk, Vc, out);
  return out;
}

}  // namespace cuda
}  // namespace gpfast

TORCH_LIBRARY_IMPL(gpfast, CUDA, m) {
  m.impl("dense_matmul", &gpfast::cuda::dense_matmul_cuda);
  m.impl("_dense_matmul_half", &gpfast::cuda::dense_matmul_half_cuda);
}
