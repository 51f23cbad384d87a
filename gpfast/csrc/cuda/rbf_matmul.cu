// CUDA launchers for rbf_matmul (K @ V without storing K), and the private _rbf_matmul_kernel that runs a named
// kernel. Device code: matmul_forward.cuh (CUDA cores, any dtype), matmul_tensor.cuh (tensor cores, float32).
#include <algorithm>
#include <string>

#include "kv_dispatch.h"
#include "matmul_forward.cuh"
#include "matmul_symmetric.cuh"
#include "matmul_tensor.cuh"

namespace gpfast {
namespace cuda {

namespace {

// Rows per thread: as many as registers allow (accumulators 2 x TM x TC for the two-level sums, points TM x D).
template <typename T, int D, int TC>
constexpr int kv_rows_per_thread() {
  if (sizeof(T) == 8) return D + TC > 24 ? 1 : 2;
  return D + TC <= 28 ? 4 : (D + TC <= 40 ? 2 : 1);
}

// Where float32 products get the tensor-core kernel by default: where it was timed against the CUDA-core kernel on
// the H200 (experiments/results/bench_matmul_kernels.md, d = 8): faster at n = m = 200,000 (43.4 against 61.7 ms,
// t = 16) and 10^6 (1.07 against 1.50 s), slower at 36,000 (2.34 against 2.21 ms, t = 11; why is not measured:
// there it has 282 row blocks of 128 rows for 264 resident blocks). The pair threshold lies between the measured
// sizes; the other feature and right-hand-side buckets were tested but not timed, so they keep the CUDA cores.
constexpr double kTcMinPairs = 1e10;
bool tensor_core_default(int64_t B, int64_t n, int64_t m, int64_t d, int64_t t) {
  return d <= 8 && t > 8 && t <= 16 && static_cast<double>(B) * n * m >= kTcMinPairs;
}

// out (splits, B, n, t) by the CUDA-core kernel
void kv_cuda_cores(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& ls, const at::Tensor& s,
                   const at::Tensor& V, int D, at::Tensor& result) {
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), d = x1.size(2), t = V.size(2);
  const bool is_double = x1.scalar_type() == at::kDouble;
  const int TC = rhs_bucket(t, is_double);
  const int64_t t_chunks = ceil_div(t, TC);
  GPF_CHECK(B * t_chunks <= 65535, "rbf_matmul: at most 65535 (batch x rhs-chunks) on CUDA, got ", B * t_chunks);
  with_kv_buckets(x1.scalar_type(), D, TC, [&](auto zero, auto dc, auto tc) {
    using scalar_t = decltype(zero);
    constexpr int kD = decltype(dc)::value, kTC = decltype(tc)::value;
    constexpr int kTM = kv_rows_per_thread<scalar_t, kD, kTC>();
    const int64_t rowblocks = ceil_div(n, int64_t(kKvThreads) * kTM);
    GPF_CHECK(rowblocks < (int64_t(1) << 31), "rbf_matmul: n=", n, " too large");
    int64_t splits = 1;
    const int64_t cols = split_columns(rowblocks * B * t_chunks, m, kKvTile, 6, splits);
    GPF_CHECK(splits <= 65535, "rbf_matmul: m=", m, " too large");
    at::Tensor part = at::empty({splits, B, n, t}, x1.options());
    KvFwdArgs<scalar_t> a{x1.data_ptr<scalar_t>(), x2.data_ptr<scalar_t>(), ls.data_ptr<scalar_t>(),
                          s.data_ptr<scalar_t>(),  V.data_ptr<scalar_t>(),  part.data_ptr<scalar_t>(),
                          n,                       m,                       B,
                          static_cast<int>(d),     static_cast<int>(t),     static_cast<int>(t_chunks),
                          cols};
    const dim3 grid(static_cast<unsigned>(rowblocks), static_cast<unsigned>(splits),
                    static_cast<unsigned>(B * t_chunks));
    kv_fwd_kernel<scalar_t, kD, kTC, kTM, sizeof(scalar_t) == 4><<<grid, kKvThreads, 0, current_stream()>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    result = splits == 1 ? part[0] : part.sum(0);
  });
}

template <int KD, int NT, int MT, int W, int kTile, int kMinBlocks, int kSplit, int kGroup = 1, int kBias = 0>
void launch_tc(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& ls, const at::Tensor& s,
               const at::Tensor& V, at::Tensor& result) {
  using Tile = TcTile<KD, NT, kTile>;
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), d = x1.size(2), t = V.size(2);
  constexpr int kRows = W * 16 * MT;
  const int64_t rowblocks = ceil_div(n, int64_t(kRows)), tiles = ceil_div(m, int64_t(kTile));
  GPF_CHECK(rowblocks < (int64_t(1) << 31), "rbf_matmul: n=", n, " rows is too many for one launch (at most ",
            ((int64_t(1) << 31) - 1) * kRows, ")");
  GPF_CHECK(tiles < (int64_t(1) << 31), "rbf_matmul: m=", m, " columns is too many for one launch (at most ",
            ((int64_t(1) << 31) - 1) * kTile, ")");
  GPF_CHECK(B <= 65535, "rbf_matmul: a batch of ", B, " is too large for one launch (at most 65535)");
  int64_t splits = 1;
  const int64_t cols = split_columns(rowblocks * B, m, kTile, 2, splits);
  GPF_CHECK(splits <= 65535, "rbf_matmul: m=", m, " columns gives ", splits, " column splits (at most 65535)");
  // the centre: the columns' mean, shared by rows and columns so that equal points scale to equal bits; the staged
  // tiles take Tile::kWords * 16 / kTile bytes a column (196 at d <= 8, t <= 16: 0.2 GB at 10^6 columns)
  const at::Tensor mu = x2.mean(1).contiguous();
  at::Tensor staged = at::empty({B, tiles, Tile::kWords * 4}, x1.options().dtype(at::kInt));
  at::Tensor part = at::empty({splits, B, n, t}, x1.options());
  KvTcArgs a{x1.data_ptr<float>(),
             x2.data_ptr<float>(),
             ls.data_ptr<float>(),
             s.data_ptr<float>(),
             mu.data_ptr<float>(),
             V.data_ptr<float>(),
             reinterpret_cast<uint4*>(staged.data_ptr<int>()),
             part.data_ptr<float>(),
             n,
             m,
             B,
             tiles,
             cols,
             static_cast<int>(d),
             static_cast<int>(t)};
  kv_tc_stage_kernel<KD, NT, kTile>
      <<<dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(B)), 128, 0, current_stream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const dim3 grid(static_cast<unsigned>(rowblocks), static_cast<unsigned>(splits), static_cast<unsigned>(B));
  kv_tc_kernel<KD, NT, MT, W, kTile, kMinBlocks, kSplit, kGroup, kBias><<<grid, W * 32, 0, current_stream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  result = splits == 1 ? part[0] : part.sum(0);
}

// The current device's shared memory a block may opt into (227 KB on the H100 and H200, 99 KB on some others)
int kv_sym_smem_limit() {
  static int limit[64] = {0};
  int device = 0, v = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 64) v = limit[device];
  if (v == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    if (device < 64) limit[device] = v;
  }
  return v;
}

// K(x, x) @ V by kv_sym_kernel (matmul_symmetric.cuh; d <= 8, t <= 16): x1 and x2 must be one tensor. The
// points' tiles are staged as for launch_tc (x2 = x1), the sums taken in float64, then scaled by s and rounded.
template <int S, int kMinBlocks>
void launch_sym(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& ls, const at::Tensor& s,
                const at::Tensor& V, at::Tensor& result) {
  GPF_CHECK(x1.data_ptr() == x2.data_ptr() && x1.sizes() == x2.sizes() && x1.strides() == x2.strides(),
            "rbf_matmul: the symmetric kernels take K(x, x): x1 and x2 must be the same tensor");
  const int64_t B = x1.size(0), n = x1.size(1), d = x1.size(2), t = V.size(2);
  const int64_t tiles = ceil_div(n, int64_t(64)), supers = ceil_div(n, int64_t(S));
  const int64_t pairs = supers * (supers + 1) / 2;
  GPF_CHECK(pairs < (int64_t(1) << 31), "rbf_matmul: n=", n, " points give ", pairs,
            " super-tile pairs for one launch (at most 2^31 - 1)");
  GPF_CHECK(B <= 65535, "rbf_matmul: a batch of ", B, " is too large for one launch (at most 65535)");
  const at::Tensor mu = x1.mean(1).contiguous();
  at::Tensor staged = at::empty({B, tiles, KvSymTile::kWords * 4}, x1.options().dtype(at::kInt));
  uint4* staged_p = reinterpret_cast<uint4*>(staged.data_ptr<int>());
  const KvTcArgs st{x1.data_ptr<float>(), x1.data_ptr<float>(), ls.data_ptr<float>(), s.data_ptr<float>(),
                    mu.data_ptr<float>(), V.data_ptr<float>(),  staged_p,             nullptr,
                    n,                    n,                    B,                    tiles,
                    0,                    static_cast<int>(d),  static_cast<int>(t)};
  kv_tc_stage_kernel<1, 2, 64>
      <<<dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(B)), 128, 0, current_stream()>>>(st);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::Tensor sums = at::zeros({B, n, t}, x1.options().dtype(at::kDouble));
  const KvSymArgs a{x1.data_ptr<float>(), ls.data_ptr<float>(), mu.data_ptr<float>(), V.data_ptr<float>(),
                    staged_p,             sums.data_ptr<double>(), n,                 tiles,
                    supers,               static_cast<int>(d),     static_cast<int>(t)};
  constexpr int smem = kv_sym_smem_bytes<S>();
  auto kernel = &kv_sym_kernel<S, kMinBlocks>;
  GPF_CHECK(smem <= kv_sym_smem_limit(), "rbf_matmul: the symmetric kernel with ", S, "-point super-tiles needs ",
            smem, " bytes of shared memory a block; this GPU allows ", kv_sym_smem_limit());
  static bool configured[64] = {false};  // the shared-memory limit is per device
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  if (device >= 64 || !configured[device]) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    if (device < 64) configured[device] = true;
  }
  kernel<<<dim3(static_cast<unsigned>(pairs), static_cast<unsigned>(B)), kKvSymThreads, smem, current_stream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  result = sums.mul_(s.to(at::kDouble).view({B, 1, 1})).to(at::kFloat);
}

using KvLaunch = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, at::Tensor&);

// The variants a sweep compares with the default (d <= 8, t <= 16 only): more blocks per multiprocessor,
// 32-column tiles, P split by Veltkamp's method or by the integer round (split_p); two row tiles a warp (MT = 2:
// each staged fragment read from shared memory and each tile's loop overhead serve twice the pairs, and the two
// tiles' MMAs fill each other's dependency gaps), with 8 warps and one block or 4 warps and two or three blocks per
// multiprocessor; the compensated addition every two tiles (kGroup); and tc_mt2w4b3 with the exponent's biases
// in the MMAs' accumulators (kBias = 1, matmul_tensor.cuh), with the compensated addition every tile, two or four;
// and that with four blocks per multiprocessor (16 warps, registers capped at 128, where the default's 3 blocks
// leave 12 warps at 168 registers and Nsight Compute found 0.93 eligible warps a scheduler); and, for K(x, x)
// only, the symmetric kernel (each pair once for both products) with 1024-point super-tiles and two blocks per
// multiprocessor (the shared memory's limit there), or 512-point ones with three or two; null for another name.
KvLaunch tc_variant(const std::string& name) {
  if (name == "tc_occ3") return &launch_tc<1, 2, 1, 8, 64, 3, 0>;
  if (name == "tc_t32") return &launch_tc<1, 2, 1, 8, 32, 2, 0>;
  if (name == "tc_vsplit") return &launch_tc<1, 2, 1, 8, 64, 2, 1>;
  if (name == "tc_isplit") return &launch_tc<1, 2, 1, 8, 64, 2, 2>;
  if (name == "tc_mt2") return &launch_tc<1, 2, 2, 8, 64, 1, 2>;
  if (name == "tc_mt2w4") return &launch_tc<1, 2, 2, 4, 64, 2, 2>;
  if (name == "tc_mt2w4b3") return &launch_tc<1, 2, 2, 4, 64, 3, 2>;
  if (name == "tc_g2") return &launch_tc<1, 2, 1, 8, 64, 2, 2, 2>;
  if (name == "tc_mt2w4g2") return &launch_tc<1, 2, 2, 4, 64, 2, 2, 2>;
  if (name == "tc_bias") return &launch_tc<1, 2, 2, 4, 64, 3, 2, 1, 1>;
  if (name == "tc_bias_g2") return &launch_tc<1, 2, 2, 4, 64, 3, 2, 2, 1>;
  if (name == "tc_bias_g4") return &launch_tc<1, 2, 2, 4, 64, 3, 2, 4, 1>;
  if (name == "tc_bias_g2b4") return &launch_tc<1, 2, 2, 4, 64, 4, 2, 2, 1>;
  if (name == "tc_sym") return &launch_sym<1024, 2>;
  if (name == "tc_sym512") return &launch_sym<512, 3>;
  if (name == "tc_sym512b2") return &launch_sym<512, 2>;
  return nullptr;
}

// out by the tensor-core kernel (float32, d <= 32, t <= 32), in the instance of its feature and right-hand-side
// bucket: one row tile a warp and 8 warps a block, except two row tiles and 4 warps at d <= 8, 9 <= t <= 16 (with
// the biases in the MMAs' accumulators and the compensated addition every two tiles there)
void kv_tensor_cores(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& ls, const at::Tensor& s,
                     const at::Tensor& V, at::Tensor& result) {
  // d = 0 (every distance zero) takes the first bucket
  const int KD = static_cast<int>(std::max<int64_t>(1, ceil_div(x1.size(2), 8)));
  const int NT = static_cast<int>(ceil_div(V.size(2), 8));
  with_bucket<1, 2, 3, 4>(KD, "tensor-core feature", [&](auto kd) {
    with_bucket<1, 2, 3, 4>(NT, "tensor-core right-hand-side", [&](auto nt) {
      constexpr int kKD = decltype(kd)::value, kNT = decltype(nt)::value;
      // 64-column tiles, two blocks per SM (three in the two-tile bucket below); wider buckets: two 64-column
      // tiles would pass the 48 KB of static shared memory (32-column tiles there), and under that register bound
      // ptxas spills (one block per SM from d > 16 or d + t > 40; 8 bytes still spill at d <= 16, t <= 16)
      constexpr int kTile = kKD + kNT <= 5 ? 64 : 32;
      constexpr int kMinBlocks = (kKD >= 3 || kKD + kNT > 5) ? 1 : 2;
      // P split by the integer round (split_p<2>) in the bucket where that was timed on the H200, d <= 8 and
      // 9 <= t <= 16 (the "tc_isplit" instance: 1.07 against 1.28 s for cvt.rna at 10^6 points, t = 16, the same
      // error); cvt.rna in the others, whose timings with either split are not measured. In that bucket also two
      // row tiles a warp, 4 warps and three blocks per SM (the "tc_mt2w4b3" instance: 0.94 against 1.04 s for
      // "tc_isplit" at 10^6 points on an H100, the same error; with 8 warps and one block, or 4 warps and two,
      // slower than "tc_isplit"); and there the exponent's biases in the MMAs' accumulators, with the compensated
      // addition every two tiles (the "tc_bias_g2" instance: 0.914 against 0.940 s for "tc_mt2w4b3" at 10^6
      // points on an H100, error against float64 5.4e-7 against 6.4e-7; every tile, "tc_bias", 0.920)
      if constexpr (kKD == 1 && kNT == 2) {
        launch_tc<1, 2, 2, 4, 64, 3, 2, 2, 1>(x1, x2, ls, s, V, result);
      } else {
        launch_tc<kKD, kNT, 1, 8, kTile, kMinBlocks, 0>(x1, x2, ls, s, V, result);
      }
    });
  });
}

// The kernel a shape gets: tensor cores where tensor_core_default says (float32); CUDA cores otherwise (float64,
// small products, untimed buckets, and t > 32, which the CUDA-core kernel takes in chunks of 32 columns). The
// symmetric K(x, x) kernels run only when named, until timings on the GPU show one faster than kv_tc_kernel.
at::Tensor run_matmul(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
                      const at::Tensor& outputscale, const at::Tensor& v, const std::string* forced) {
  const char* op = forced ? "_rbf_matmul_kernel" : "rbf_matmul";
  check_canonical(x1, x2, lengthscale, outputscale, op);
  check_rhs(x1, x2, v, op);
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), d = x1.size(2), t = v.size(2);
  const int D = feature_bucket(d);
  const bool fp32 = x1.scalar_type() == at::kFloat;
  KvLaunch variant = nullptr;  // a sweep's variant instead of the default tensor-core kernel
  bool tensor = fp32 && tensor_core_default(B, n, m, d, t);
  if (forced) {
    if (*forced == "cuda_cores") {
      tensor = false;
    } else {
      const bool is_default = *forced == "tc";
      variant = is_default ? nullptr : tc_variant(*forced);
      GPF_CHECK(is_default || variant, op, ": kernel must be 'cuda_cores', 'tc', 'tc_occ3', 'tc_t32', ",
                "'tc_vsplit', 'tc_isplit', 'tc_mt2', 'tc_mt2w4', 'tc_mt2w4b3', 'tc_g2', 'tc_mt2w4g2', 'tc_bias', ",
                "'tc_bias_g2', 'tc_bias_g4', 'tc_bias_g2b4', 'tc_sym', 'tc_sym512' or 'tc_sym512b2', got '",
                *forced, "'");
      GPF_CHECK(fp32, op, ": the tensor-core kernels take float32 points, got x1 of dtype ", x1.scalar_type());
      GPF_CHECK(d <= (is_default ? 32 : 8) && t <= (is_default ? 32 : 16), op, ": the kernel '", *forced,
                "' takes d <= ", is_default ? "32" : "8", " and t <= ", is_default ? "32" : "16", ", got d=",
                as_text(d), " and t=", as_text(t));
      tensor = true;
    }
  }
  const c10::cuda::CUDAGuard guard(x1.device());
  if (B == 0 || n == 0 || t == 0) return at::empty({B, n, t}, x1.options());
  if (m == 0) return at::zeros({B, n, t}, x1.options());
  if (D == 0) {  // d > 32: dense blocks of rows of K (memory rows x m), times V by cuBLAS
    at::Tensor out = at::empty({B, n, t}, x1.options());
    const int64_t rb = dense_block_rows(m);
    for (int64_t i = 0; i < n; i += rb) {
      const int64_t r = std::min(rb, n - i);
      out.narrow(1, i, r).copy_(at::bmm(covariance_cuda(x1.narrow(1, i, r), x2, lengthscale, outputscale), v));
    }
    return out;
  }
  // one tensor as x1 and x2 stays one after the copies (the symmetric kernels take K(x, x) only)
  const bool same = x1.data_ptr() == x2.data_ptr() && x1.sizes() == x2.sizes() && x1.strides() == x2.strides();
  const at::Tensor p1 = x1.contiguous(), p2 = same ? p1 : x2.contiguous(), ls = lengthscale.contiguous();
  const at::Tensor s = outputscale.contiguous(), V = v.contiguous();
  at::Tensor result;
  if (variant)
    variant(p1, p2, ls, s, V, result);
  else if (tensor)
    kv_tensor_cores(p1, p2, ls, s, V, result);
  else
    kv_cuda_cores(p1, p2, ls, s, V, D, result);
  return result;
}

}  // namespace

at::Tensor matmul_cuda(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
                       const at::Tensor& outputscale, const at::Tensor& v) {
  return run_matmul(x1, x2, lengthscale, outputscale, v, nullptr);
}

// rbf_matmul by a named kernel: "cuda_cores" (any dtype, d <= 32), "tc" (the tensor-core kernel in every bucket,
// float32, d <= 32, t <= 32; float32's default where tensor_core_default says) or one of the tensor-core variants a
// sweep compares (d <= 8, t <= 16): for tests and benchmarks.
at::Tensor matmul_kernel_cuda(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
                              const at::Tensor& outputscale, const at::Tensor& v, c10::string_view kernel) {
  const std::string name(kernel);
  return run_matmul(x1, x2, lengthscale, outputscale, v, &name);
}

}  // namespace cuda
}  // namespace gpfast

TORCH_LIBRARY_IMPL(gpfast, CUDA, m) {
  m.impl("rbf_matmul", &gpfast::cuda::matmul_cuda);
  m.impl("_rbf_matmul_kernel", &gpfast::cuda::matmul_kernel_cuda);
}
