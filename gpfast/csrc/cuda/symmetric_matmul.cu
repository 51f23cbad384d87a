// CUDA launcher for symmetric_matmul (K @ V for a symmetric stored K, reading its block upper triangle). Device
// code: symmetric_matmul.cuh.
#include "dispatch.h"
#include "symmetric_matmul.cuh"

namespace gpfast {
namespace cuda {

at::Tensor dense_matmul_cuda(const at::Tensor& K, const at::Tensor& V);

namespace {

template <int S, int kStages>
void launch_symmetric(const at::Tensor& K, int64_t ldk, const at::Tensor& V, at::Tensor& out) {
  constexpr int smem = sym_smem_bytes<S, kStages>();
  static bool configured[64] = {false};  // the shared-memory limit is per device
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  if (device >= 64 || !configured[device]) {
    C10_CUDA_CHECK(
        cudaFuncSetAttribute(sym_matmul_kernel<S, kStages>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    if (device < 64) configured[device] = true;
  }
  const int64_t n = K.size(0), t = V.size(1);
  const int ns = static_cast<int>(ceil_div(n, S));
  const int64_t tiles = int64_t(ns) * (ns + 1) / 2;
  at::Tensor part = at::empty({ns, ns, S, t}, out.options());
  SymArgs a{};
  a.K = K.data_ptr<float>();
  a.V = V.data_ptr<float>();
  a.part = part.data_ptr<float>();
  a.ldk = ldk, a.n = n, a.tiles = tiles;
  a.t = static_cast<int>(t), a.ns = ns;
  const int64_t grid = std::min<int64_t>(tiles, sm_count());
  sym_matmul_kernel<S, kStages><<<static_cast<unsigned>(grid), kSymThreads, smem, current_stream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t count = n * t;
  const int64_t blocks = std::min<int64_t>(ceil_div(count, 256), 8 * sm_count());
  sym_sum_kernel<<<static_cast<unsigned>(blocks), 256, 0, current_stream()>>>(part.data_ptr<float>(),
                                                                             out.data_ptr<float>(), n,
                                                                             static_cast<int>(t), ns, S);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The super-tile for n when the op chooses: 512 (on the H200 it was as fast as or faster than 256 at every UCI
// size, 13,500 to 57,248 points, and 1024 with its 3 stages in flight took twice as long), and 0 (the full-matrix
// kernel) under 4096 points, where one product is a few microseconds either way.
int64_t auto_block(int64_t n) { return n < 4096 ? 0 : 512; }

// "(a, b)" without streaming integers (common.h's GPF_CHECK says why)
std::string strides_text(const at::Tensor& K) {
  std::string s = "(";
  for (int64_t i = 0; i < K.dim(); ++i) s += (i ? ", " : "") + as_text(K.stride(i));
  return s + ")";
}

}  // namespace

at::Tensor symmetric_matmul_cuda(const at::Tensor& K, const at::Tensor& V, int64_t block, int64_t stages) {
  check_dense_matmul(K, V, "symmetric_matmul");
  GPF_CHECK(K.size(0) == K.size(1), "symmetric_matmul: K must be square, got ", as_text(K.size(0)), " x ",
            as_text(K.size(1)));
  GPF_CHECK(block == 0 || block == -1 || block == 256 || block == 512 || block == 1024,
            "symmetric_matmul: block must be 0 (auto), -1 (the full-matrix kernel), 256, 512 or 1024, got ",
            as_text(block));
  const c10::cuda::CUDAGuard guard(K.device());
  const int64_t n = K.size(0), t = V.size(1);
  const int64_t ldk = n > 1 ? K.stride(0) : n;
  const bool fits = K.scalar_type() == at::kFloat && t >= 1 && t <= 16 && n > 0 && (K.stride(1) == 1 || n == 1) &&
                    ldk % 4 == 0 && aligned16(K.data_ptr());
  if (block > 0)
    GPF_CHECK(fits, "symmetric_matmul: block ", as_text(block), " takes a float32 K with column stride 1, rows ",
              "of 16-byte multiples at a 16-byte aligned start and 1 <= t <= 16; got ", K.scalar_type(),
              ", strides ", strides_text(K), ", t = ", as_text(t));
  const int64_t S = block == 0 ? (fits ? auto_block(n) : 0) : (block < 0 ? 0 : block);
  if (S == 0) return dense_matmul_cuda(K, V);
  // stages in flight: the default for the super-tile, or 5 at 256 (for the benchmarks' sweep)
  const int64_t st = stages == 0 ? (S >= 1024 ? 3 : 4) : stages;
  GPF_CHECK(st == (S >= 1024 ? 3 : 4) || (S == 256 && st == 5), "symmetric_matmul: stages must be 0 (the default",
            " for the super-tile), 4 (256, 512), 5 (256) or 3 (1024), got ", as_text(stages), " at block ",
            as_text(S));
  const at::Tensor Vc = V.contiguous();
  at::Tensor out = at::empty({n, t}, K.options());
  if (S == 256 && st == 5)
    launch_symmetric<256, 5>(K, ldk, Vc, out);
  else
    with_bucket<256, 512, 1024>(static_cast<int>(S), "super-tile", [&](auto s) {
      constexpr int kS = decltype(s)::value;
      launch_symmetric<kS, sym_stages<kS>()>(K, ldk, Vc, out);
    });
  return out;
}

}  // namespace cuda
}  // namespace gpfast

TORCH_LIBRARY_IMPL(gpfast, CUDA, m) { m.impl("symmetric_matmul", &gpfast::cuda::symmetric_matmul_cuda); }
