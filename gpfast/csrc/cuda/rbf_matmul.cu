// CUDA launchers for rbf_matmul (K @ V without storing K). Device code: matmul_forward.cuh.
#include <algorithm>
#include <string>

#include "kv_dispatch.h"
#include "matmul_forward.cuh"
#include "matmul_tc.cuh"

namespace gpfast {
namespace cuda {

namespace {

// Rows per thread: as many as registers allow (accumulators 2 x TM x TC for the two-level sums, points TM x D).
template <typename T, int D, int TC>
constexpr int kv_rows_per_thread() {
  if (sizeof(T) == 8) return D + TC > 24 ? 1 : 2;
  return D + TC <= 28 ? 4 : (D + TC <= 40 ? 2 : 1);
}

}  // namespace

at::Tensor matmul_cuda(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
                       const at::Tensor& outputscale, const at::Tensor& v) {
  check_canonical(x1, x2, lengthscale, outputscale, "rbf_matmul");
  check_rhs(x1, x2, v, "rbf_matmul");
  const c10::cuda::CUDAGuard guard(x1.device());
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), d = x1.size(2), t = v.size(2);
  if (B == 0 || n == 0 || t == 0) return at::empty({B, n, t}, x1.options());
  if (m == 0) return at::zeros({B, n, t}, x1.options());
  const int D = feature_bucket(d);
  if (D == 0) {  // d > 32: dense blocks of rows of K (memory rows x m), times V by cuBLAS
    at::Tensor out = at::empty({B, n, t}, x1.options());
    const int64_t rb = dense_block_rows(m);
    for (int64_t i = 0; i < n; i += rb) {
      const int64_t r = std::min(rb, n - i);
      out.narrow(1, i, r).copy_(at::bmm(covariance_cuda(x1.narrow(1, i, r), x2, lengthscale, outputscale), v));
    }
    return out;
  }
  const bool is_double = x1.scalar_type() == at::kDouble;
  const int TC = rhs_bucket(t, is_double);
  const int64_t t_chunks = ceil_div(t, TC);
  TORCH_CHECK(B * t_chunks <= 65535, "rbf_matmul: at most 65535 (batch x rhs-chunks) on CUDA, got ", B * t_chunks);
  const at::Tensor p1 = x1.contiguous(), p2 = x2.contiguous(), ls = lengthscale.contiguous();
  const at::Tensor s = outputscale.contiguous(), V = v.contiguous();
  at::Tensor result;
  with_kv_buckets(x1.scalar_type(), D, TC, [&](auto zero, auto dc, auto tc) {
    using scalar_t = decltype(zero);
    constexpr int kD = decltype(dc)::value, kTC = decltype(tc)::value;
    constexpr int kTM = kv_rows_per_thread<scalar_t, kD, kTC>();
    const int64_t rowblocks = ceil_div(n, int64_t(kKvThreads) * kTM);
    TORCH_CHECK(rowblocks < (int64_t(1) << 31), "rbf_matmul: n=", n, " too large");
    int64_t splits = 1;
    const int64_t cols = split_columns(rowblocks * B * t_chunks, m, kKvTile, 6, splits);
    TORCH_CHECK(splits <= 65535, "rbf_matmul: m=", m, " too large");
    at::Tensor part = at::empty({splits, B, n, t}, x1.options());
    KvFwdArgs<scalar_t> a{p1.data_ptr<scalar_t>(), p2.data_ptr<scalar_t>(), ls.data_ptr<scalar_t>(),
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
  return result;
}


// ------------------------------------------------------------------------------------------------------------
// The tensor-core K @ V (matmul_tc.cuh), float32, d <= 32, reached only through the private _rbf_matmul_kernel
// until it wins on the benchmark shapes. Its variants (rows per warp, the 3xTF32 split, a share of polynomial
// exponentials) are compiled for d <= 8 with 9 to 16 right-hand sides only (the benchmark's shape), the default
// variant for every shape: every variant at every shape would be about a hundred kernels to compile.
namespace {

struct TcVariant {
  int rows_tiles = 0;  // 16-row MMA tiles per warp, 0: the shape's default (tc_rows_tiles)
  bool split = true;   // 3xTF32
  int poly = 0;        // exponentials of each lane's 4 per tile taken by polynomial
  bool flush = false;  // each 8 columns' products added to the tile's sum in float32 (kv_tc_kernel's kFlush)
  bool is_default() const { return rows_tiles == 0 && split && poly == 0 && !flush; }
};

// "tc", optionally followed by "_m2" (2 row tiles per warp), "_nosplit", "_poly1", "_poly2" or "_flush", in any
// order.
TcVariant parse_tc_variant(const std::string& name) {
  TcVariant var;
  std::string rest = name.substr(2);
  while (!rest.empty()) {
    const size_t next = rest.find('_', 1);
    const std::string tok = rest.substr(0, next);
    if (tok == "_m2")
      var.rows_tiles = 2;
    else if (tok == "_nosplit")
      var.split = false;
    else if (tok == "_poly1")
      var.poly = 1;
    else if (tok == "_poly2")
      var.poly = 2;
    else if (tok == "_flush")
      var.flush = true;
    else
      TORCH_CHECK(false, "_rbf_matmul_kernel: unknown part '", tok, "' in kernel '", name,
                  "'; expected 'tc' followed by any of _m2, _nosplit, _poly1, _poly2, _flush");
    rest = next == std::string::npos ? "" : rest.substr(next);
  }
  return var;
}

template <int KD, int NT, int MT, bool kSplit, int kPoly, bool kFlush = false>
void launch_tc(const KvFwdArgs<float>& a, int64_t rowblocks, int64_t splits, int64_t z) {
  const dim3 grid(static_cast<unsigned>(rowblocks), static_cast<unsigned>(splits), static_cast<unsigned>(z));
  kv_tc_kernel<KD, NT, MT, kSplit, kPoly, kFlush><<<grid, kTcThreads, 0, current_stream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int KD, int NT>
void launch_tc_variant(const TcVariant& var, const KvFwdArgs<float>& a, int64_t rowblocks, int64_t splits,
                       int64_t z) {
  if (var.is_default()) return launch_tc<KD, NT, tc_rows_tiles<KD, NT>(), true, 0>(a, rowblocks, splits, z);
  if constexpr (KD == 1 && NT == 2) {
    // 0 rows: 4 here
    const int code = (var.flush ? 1000 : 0) + (var.rows_tiles == 2 ? 100 : 0) + (var.split ? 10 : 0) + var.poly;
    switch (code) {
      case 1010: return launch_tc<1, 2, 4, true, 0, true>(a, rowblocks, splits, z);
      case 1110: return launch_tc<1, 2, 2, true, 0, true>(a, rowblocks, splits, z);
      case 1011: return launch_tc<1, 2, 4, true, 1, true>(a, rowblocks, splits, z);
      case 1: return launch_tc<1, 2, 4, false, 1>(a, rowblocks, splits, z);
      case 2: return launch_tc<1, 2, 4, false, 2>(a, rowblocks, splits, z);
      case 0: return launch_tc<1, 2, 4, false, 0>(a, rowblocks, splits, z);
      case 11: return launch_tc<1, 2, 4, true, 1>(a, rowblocks, splits, z);
      case 12: return launch_tc<1, 2, 4, true, 2>(a, rowblocks, splits, z);
      case 100: return launch_tc<1, 2, 2, false, 0>(a, rowblocks, splits, z);
      case 110: return launch_tc<1, 2, 2, true, 0>(a, rowblocks, splits, z);
      case 111: return launch_tc<1, 2, 2, true, 1>(a, rowblocks, splits, z);
      case 112: return launch_tc<1, 2, 2, true, 2>(a, rowblocks, splits, z);
      default: break;
    }
  }
  TORCH_CHECK(false, "_rbf_matmul_kernel: this tensor-core variant (", var.rows_tiles, " row tiles, split ", var.split,
              ", poly ", var.poly, ", flush ", var.flush, ") is not compiled for ", 8 * KD, " features and ", 8 * NT,
              " right-hand sides; the variants are compiled for d <= 8 and t in 9..16, with the split");
}

at::Tensor matmul_tc_cuda(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
                          const at::Tensor& outputscale, const at::Tensor& v, const TcVariant& var) {
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), d = x1.size(2), t = v.size(2);
  TORCH_CHECK(x1.scalar_type() == at::kFloat, "_rbf_matmul_kernel: the tensor-core kernel is float32 only, got ",
              x1.scalar_type());
  TORCH_CHECK(d <= 32, "_rbf_matmul_kernel: the tensor-core kernel needs d <= 32, got d=", d);
  if (B == 0 || n == 0 || t == 0) return at::empty({B, n, t}, x1.options());
  if (m == 0) return at::zeros({B, n, t}, x1.options());
  const int KD = d <= 8 ? 1 : (d <= 16 ? 2 : 4);
  const int NT = t <= 8 ? 1 : (t <= 16 ? 2 : 4);
  const int64_t t_chunks = ceil_div(t, 8 * NT);
  TORCH_CHECK(B * t_chunks <= 65535, "_rbf_matmul_kernel: at most 65535 (batch x rhs-chunks), got ", B * t_chunks);
  const at::Tensor p1 = x1.contiguous(), p2 = x2.contiguous(), ls = lengthscale.contiguous();
  const at::Tensor s = outputscale.contiguous(), V = v.contiguous();
  const int default_tiles = KD + NT <= 3 ? 4 : 2;  // tc_rows_tiles<KD, NT>()
  const int64_t rowblocks = ceil_div(n, int64_t(16) * kTcWarps * (var.rows_tiles ? var.rows_tiles : default_tiles));
  TORCH_CHECK(rowblocks < (int64_t(1) << 31), "_rbf_matmul_kernel: n=", n, " too large");
  int64_t splits = 1;
  const int64_t cols = split_columns(rowblocks * B * t_chunks, m, kTcCols, 4, splits);
  TORCH_CHECK(splits <= 65535, "_rbf_matmul_kernel: m=", m, " too large");
  at::Tensor part = at::empty({splits, B, n, t}, x1.options());
  const KvFwdArgs<float> a{p1.data_ptr<float>(), p2.data_ptr<float>(), ls.data_ptr<float>(),
                           s.data_ptr<float>(),  V.data_ptr<float>(),  part.data_ptr<float>(),
                           n,                    m,                    B,
                           static_cast<int>(d),  static_cast<int>(t),  static_cast<int>(t_chunks),
                           cols};
  const int64_t z = B * t_chunks;
  with_bucket<1, 2, 4>(KD, "feature step", [&](auto kd) {
    with_bucket<1, 2, 4>(NT, "right-hand-side tile", [&](auto nt) {
      launch_tc_variant<decltype(kd)::value, decltype(nt)::value>(var, a, rowblocks, splits, z);
    });
  });
  return splits == 1 ? part[0] : part.sum(0);
}

}  // namespace

// rbf_matmul with a named kernel whatever the shape, for tests and benchmarks: "cuda_core" (the default path of
// rbf_matmul) or "tc[...]" (the tensor-core kernel and its variants, see parse_tc_variant).
at::Tensor matmul_kernel_cuda(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
                              const at::Tensor& outputscale, const at::Tensor& v, c10::string_view kernel) {
  const std::string name(kernel);
  if (name == "cuda_core") return matmul_cuda(x1, x2, lengthscale, outputscale, v);
  TORCH_CHECK(name.rfind("tc", 0) == 0, "_rbf_matmul_kernel: kernel must be 'cuda_core' or 'tc[_variant...]', got '",
              name, "'");
  const TcVariant var = parse_tc_variant(name);
  check_canonical(x1, x2, lengthscale, outputscale, "_rbf_matmul_kernel");
  check_rhs(x1, x2, v, "_rbf_matmul_kernel");
  const c10::cuda::CUDAGuard guard(x1.device());
  return matmul_tc_cuda(x1, x2, lengthscale, outputscale, v, var);
}

}  // namespace cuda
}  // namespace gpfast

TORCH_LIBRARY_IMPL(gpfast, CUDA, m) {
  m.impl("rbf_matmul", &gpfast::cuda::matmul_cuda);
  m.impl("_rbf_matmul_kernel", &gpfast::cuda::matmul_kernel_cuda);
}
