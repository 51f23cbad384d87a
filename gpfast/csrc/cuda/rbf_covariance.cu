// CUDA launchers for rbf_covariance (the forward), and the private _rbf_covariance_kernel that runs a named kernel.
// Device code: covariance_forward.cuh (row streaming), covariance_tile.cuh (tiles), covariance_tensor.cuh (tensor
// cores).
#include <string>

#include "covariance_forward.cuh"
#include "covariance_tensor.cuh"
#include "covariance_tile.cuh"
#include "dispatch.h"

namespace gpfast {
namespace cuda {

namespace {

// Columns per lane of the row-streaming kernel: 4 (16-byte stores of float32) while the columns' points fit in
// registers.
template <typename T, int D>
constexpr int stream_cols_per_lane() {
  return (sizeof(T) == 4 ? D <= 16 : D <= 8) ? 4 : 2;
}

// Features in registers for the row-streaming kernel: the common buckets, and for float32 also 24 and 28, so that
// d = 17..28 (elevators, bike, keggdirected, pol, keggundirected) does not pay for 32 features' FMAs and registers
// (zero features add exact zeros; at 28 the blocks' columns, and so their centres, are those of 32: the same bits).
template <typename T, typename Fn>
void with_stream_bucket(int64_t d, Fn&& fn) {
  if constexpr (std::is_same_v<T, float>) {
    if (d > 16 && d <= 28) return with_bucket<24, 28>(d <= 24 ? 24 : 28, "feature", std::forward<Fn>(fn));
  }
  with_feature_bucket(feature_bucket(d), std::forward<Fn>(fn));
}

// Whether the row-streaming kernel's symmetric form takes K(x, x) for these features: float32's expansion with 2
// columns a lane (17 <= d <= 32).
bool stream_symmetric_applies(at::ScalarType dtype, int64_t d) { return dtype == at::kFloat && d > 16 && d <= 32; }

// out: (B, n, m) with rows ldo apart. sym (K(x, x): x1 = x2, n = m, stream_symmetric_applies): each pair once.
void covariance_stream(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& ls, const at::Tensor& s,
                       bool expand, at::Tensor& out, int64_t ldo, bool sym = false) {
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1);
  const int64_t d = x1.size(2);
  AT_DISPATCH_FLOATING_TYPES(x1.scalar_type(), "rbf_covariance_stream_cuda", [&] {
    with_stream_bucket<scalar_t>(d, [&](auto dc) {
      constexpr int kD = decltype(dc)::value;
      constexpr int kCpl = stream_cols_per_lane<scalar_t, kD>();
      constexpr int kThreads = fwd_stream_threads(kD);
      const int64_t strips = ceil_div(m, int64_t(kThreads) * kCpl);
      // the symmetric form's blocks past their strip's end return at once: twice the row blocks keep the GPU full
      const int64_t want = (sym ? 8 : 4) * sm_count();
      int64_t rowblocks = std::clamp<int64_t>(ceil_div(want, strips * B), 1, ceil_div(n, kFwdRows));
      const int64_t rows_per_block = ceil_div(ceil_div(n, rowblocks), kFwdRows) * kFwdRows;
      rowblocks = ceil_div(n, rows_per_block);
      GPF_CHECK(strips < (int64_t(1) << 31) && rowblocks <= 65535 && B <= 65535,
                "rbf_covariance: output of shape ", out.sizes(), " is too large for one launch");
      const size_t vec_bytes = std::min<size_t>(16, kCpl * sizeof(scalar_t));
      const bool vec = (ldo * sizeof(scalar_t)) % vec_bytes == 0 && aligned(out.data_ptr(), vec_bytes);
      CovStreamArgs<scalar_t> a{};
      a.x1 = x1.data_ptr<scalar_t>(), a.x2 = x2.data_ptr<scalar_t>(), a.ls = ls.data_ptr<scalar_t>();
      a.scale = s.data_ptr<scalar_t>(), a.out = out.data_ptr<scalar_t>();
      a.n = n, a.m = m, a.d = static_cast<int>(d), a.rows_per_block = rows_per_block, a.vec_store = vec;
      a.ldo = ldo;
      a.vec_mirror = (ldo * sizeof(scalar_t)) % 16 == 0 && aligned16(out.data_ptr());
      const dim3 grid(static_cast<unsigned>(strips), static_cast<unsigned>(rowblocks), static_cast<unsigned>(B));
      constexpr bool kSymOk = sizeof(scalar_t) == 4 && kCpl == 2;
      if (sym && kSymOk)
        cov_fwd_stream_kernel<scalar_t, kD, kCpl, kSymOk, kSymOk><<<grid, kThreads, 0, current_stream()>>>(a);
      else if (expand && sizeof(scalar_t) == 4)
        cov_fwd_stream_kernel<scalar_t, kD, kCpl, sizeof(scalar_t) == 4><<<grid, kThreads, 0, current_stream()>>>(a);
      else
        cov_fwd_stream_kernel<scalar_t, kD, kCpl, false><<<grid, kThreads, 0, current_stream()>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

// The tiled kernel: any d (the feature axis is staged in chunks), 64 x 64 output tiles.
void covariance_tile(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& ls, const at::Tensor& s,
                            at::Tensor& out) {
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), d = x1.size(2);
  const int64_t dp = ceil_div(std::max<int64_t>(d, 1), 4) * 4;
  GPF_CHECK(dp <= (1 << 30), "rbf_covariance: d=", d, " is too large");
  const int64_t tiles_m = ceil_div(m, kCovTile), tiles_per_batch = ceil_div(n, kCovTile) * tiles_m;
  const int64_t blocks = B * tiles_per_batch;
  GPF_CHECK(blocks < (int64_t(1) << 31), "rbf_covariance: output of shape ", out.sizes(),
            " needs more thread blocks than one launch allows");
  const bool vec = (m % 4 == 0) && aligned16(out.data_ptr());
  AT_DISPATCH_FLOATING_TYPES(x1.scalar_type(), "rbf_covariance_tile_cuda", [&] {
    CovTileArgs<scalar_t> a{x1.data_ptr<scalar_t>(), x2.data_ptr<scalar_t>(), ls.data_ptr<scalar_t>(),
                           s.data_ptr<scalar_t>(),  out.data_ptr<scalar_t>(), n,
                           m, static_cast<int>(d), static_cast<int>(dp), tiles_m, tiles_per_batch};
    if (vec)
      cov_fwd_tile_kernel<scalar_t, true><<<blocks, kCovThreads, 0, current_stream()>>>(a);
    else
      cov_fwd_tile_kernel<scalar_t, false><<<blocks, kCovThreads, 0, current_stream()>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// The tensor-core kernel (float32, 8 < d <= 32): KD = d / 8 rounded up, MT column tiles a warp, W warps, kTile rows
// a staged tile; row splits so that about 4 blocks an SM are in the grid (few: the splits' rows are written at once).
template <int KD, int MT, int W, int kTile>
void launch_covariance_tc(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& ls, const at::Tensor& s,
                          at::Tensor& out) {
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), d = x1.size(2);
  constexpr int kCols = W * 16 * MT;
  const int64_t strips = ceil_div(m, int64_t(kCols));
  GPF_CHECK(strips < (int64_t(1) << 31), "rbf_covariance: m=", m, " columns is too many for one launch (at most ",
            ((int64_t(1) << 31) - 1) * kCols, ")");
  GPF_CHECK(B <= 65535, "rbf_covariance: a batch of ", B, " is too large for one launch (at most 65535)");
  int64_t splits = 1;
  const int64_t rows = split_columns(strips * B, n, kTile, 4, splits);
  GPF_CHECK(splits <= 65535, "rbf_covariance: n=", n, " rows gives ", splits, " row splits (at most 65535)");
  const at::Tensor mu = x2.mean(1).contiguous();  // one centre for rows and columns: equal points, equal bits
  CovTcArgs a{x1.data_ptr<float>(), x2.data_ptr<float>(), ls.data_ptr<float>(), s.data_ptr<float>(),
              mu.data_ptr<float>(), out.data_ptr<float>(), n, m, rows, static_cast<int>(d)};
  const dim3 grid(static_cast<unsigned>(strips), static_cast<unsigned>(splits), static_cast<unsigned>(B));
  cov_fwd_tc_kernel<KD, MT, W, kTile><<<grid, W * 32, 0, current_stream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The tensor-core kernel's shapes: the default and the variants a sweep compares with it.
enum class TcShape { kDefault, kRows2, kWarps4 };

void covariance_tc(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& ls, const at::Tensor& s,
                   TcShape shape, at::Tensor& out) {
  const int64_t d = x1.size(2);
  GPF_CHECK(x1.scalar_type() == at::kFloat,
            "_rbf_covariance_kernel: the tensor-core kernels take float32 points, got ", x1.scalar_type());
  GPF_CHECK(d > 8 && d <= 32, "_rbf_covariance_kernel: the tensor-core kernels take 8 < d <= 32, got d=",
            as_text(d));
  with_bucket<2, 3, 4>(static_cast<int>(ceil_div(d, 8)), "tensor-core feature", [&](auto kc) {
    constexpr int KD = decltype(kc)::value;
    if (shape == TcShape::kRows2)
      launch_covariance_tc<KD, 2, 8, 64>(x1, x2, ls, s, out);
    else if (shape == TcShape::kWarps4)
      launch_covariance_tc<KD, 2, 4, 32>(x1, x2, ls, s, out);
    else
      launch_covariance_tc<KD, 1, 8, 64>(x1, x2, ls, s, out);
  });
}

// The forward's kernels: the tiled one, the row-streaming one forming distances by differences or by the norm
// expansion, and the tensor-core one (with its sweep variants).
enum class Forward { kTile, kDiff, kExpand, kTc, kTcRows2, kTcWarps4 };

// The kernel each shape gets: row streaming (d <= 32) for outputs of 1024 columns or more, where it fills the GPU by
// strips of columns, the tiled kernel below that; float32 with 8 < d <= 32 forms distances by the norm expansion
// (instruction-bound there), d <= 8 and float64 by differences, which cost no time while the kernel waits on its
// stores. The tensor-core kernel is not a default: on Gaussian draws it was faster at 16 < d <= 32 (0.93 against
// 1.20 ms at (4, 8192, 8192, 32), 6.5 against 7.3 at (1, 43945, 43945, 20)), but on the UCI sets the engine trains
// on it took 27.4 ms against 8.1 for keggdirected's K and 100.7 against 14.3 for keggundirected's (H200, 2026-12-03,
// experiments/results/h200_2026-12-03_session9): their duplicate points make near pairs in most warps' tiles, and
// its recomputation of a near pair reads both raw points from global memory while the warp waits, where the
// expansion recomputes from registers.
Forward default_forward(int64_t m, int D, bool is_float) {
  if (D == 0 || m < 1024) return Forward::kTile;
  return is_float && D >= 16 ? Forward::kExpand : Forward::kDiff;
}

at::Tensor run_forward(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
                       const at::Tensor& outputscale, const Forward* forced) {
  check_canonical(x1, x2, lengthscale, outputscale, "rbf_covariance");
  const c10::cuda::CUDAGuard guard(x1.device());
  const int64_t B = x1.size(0), n = x1.size(1), m = x2.size(1), d = x1.size(2);
  at::Tensor out = at::empty({B, n, m}, x1.options());
  if (out.numel() == 0) return out;
  const at::Tensor p1 = x1.contiguous(), p2 = x2.contiguous(), ls = lengthscale.contiguous();
  const at::Tensor s = outputscale.contiguous();
  const int D = feature_bucket(d);
  const Forward kernel = forced ? *forced : default_forward(m, D, x1.scalar_type() == at::kFloat);
  GPF_CHECK(kernel == Forward::kTile || D != 0,
            "_rbf_covariance_kernel: the row-streaming and tensor-core kernels need d <= 32, got d=", as_text(d));
  if (kernel == Forward::kTile)
    covariance_tile(p1, p2, ls, s, out);
  else if (kernel == Forward::kDiff || kernel == Forward::kExpand)
    covariance_stream(p1, p2, ls, s, kernel == Forward::kExpand, out, m);
  else
    covariance_tc(p1, p2, ls, s,
                  kernel == Forward::kTcRows2    ? TcShape::kRows2
                  : kernel == Forward::kTcWarps4 ? TcShape::kWarps4
                                                 : TcShape::kDefault,
                  out);
  return out;
}

}  // namespace

at::Tensor covariance_cuda(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
                           const at::Tensor& outputscale) {
  return run_forward(x1, x2, lengthscale, outputscale, nullptr);
}

// rbf_covariance with a named kernel, "tile", "diff", "expand", "tc" or a tensor-core variant ("tc_mt2": two column
// tiles a warp; "tc_w4": two column tiles a warp, 4 warps, 32-row tiles), whatever the shape: for tests and
// benchmarks.
at::Tensor covariance_kernel_cuda(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& lengthscale,
                                  const at::Tensor& outputscale, c10::string_view kernel) {
  Forward forced = Forward::kTile;
  if (kernel == "tile")
    forced = Forward::kTile;
  else if (kernel == "diff")
    forced = Forward::kDiff;
  else if (kernel == "expand")
    forced = Forward::kExpand;
  else if (kernel == "tc")
    forced = Forward::kTc;
  else if (kernel == "tc_mt2")
    forced = Forward::kTcRows2;
  else if (kernel == "tc_w4")
    forced = Forward::kTcWarps4;
  else
    GPF_CHECK(false, "_rbf_covariance_kernel: kernel must be 'tile', 'diff', 'expand', 'tc', 'tc_mt2' or 'tc_w4', ",
              "got '", std::string(kernel), "'");
  return run_forward(x1, x2, lengthscale, outputscale, &forced);
}

// K(x, x) into an (n, pitch) buffer, K in its first n columns (the training engine's stored K, whose rows it pads
// to 16 bytes for the product kernel); the padding columns are not written. Float32's expansion (17 <= d <= 32)
// computes each pair once (the symmetric row-streaming form); other row-streaming cases write the buffer's rows
// directly, and n < 1024 or d > 32 copies the tiled kernel's K into it.
at::Tensor covariance_symmetric_cuda(const at::Tensor& x, const at::Tensor& lengthscale, const at::Tensor& outputscale,
                                     int64_t pitch) {
  GPF_CHECK(x.dim() == 2, "_rbf_covariance_symmetric: x must be (n, d), got shape ", x.sizes());
  const int64_t n = x.size(0), d = x.size(1);
  GPF_CHECK(lengthscale.dim() == 1 && lengthscale.size(0) == d && outputscale.dim() == 0,
            "_rbf_covariance_symmetric: lengthscale must be (d,) = (", as_text(d), ",) and outputscale 0-dim, got ",
            lengthscale.sizes(), " and ", outputscale.sizes());
  GPF_CHECK(pitch >= n, "_rbf_covariance_symmetric: pitch must be at least n = ", as_text(n), ", got ",
            as_text(pitch));
  const at::Tensor p = x.contiguous().unsqueeze(0), ls = lengthscale.contiguous().unsqueeze(0);
  const at::Tensor s = outputscale.reshape({1}).contiguous();
  check_canonical(p, p, ls, s, "_rbf_covariance_symmetric");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor buf = at::empty({n, pitch}, x.options());
  if (n == 0) return buf;
  const bool is_float = x.scalar_type() == at::kFloat;
  const Forward kernel = default_forward(n, feature_bucket(d), is_float);
  if (kernel == Forward::kDiff || kernel == Forward::kExpand) {
    at::Tensor out = buf.unsqueeze(0);
    const bool expand = kernel == Forward::kExpand;
    covariance_stream(p, p, ls, s, expand, out, pitch, expand && stream_symmetric_applies(x.scalar_type(), d));
  } else {
    buf.narrow(1, 0, n).copy_(run_forward(p, p, ls, s, nullptr)[0]);
  }
  return buf;
}

}  // namespace cuda
}  // namespace gpfast

TORCH_LIBRARY_IMPL(gpfast, CUDA, m) {
  m.impl("_rbf_covariance_symmetric", &gpfast::cuda::covariance_symmetric_cuda);
  m.impl("rbf_covariance", &gpfast::cuda::covariance_cuda);
  m.impl("_rbf_covariance_kernel", &gpfast::cuda::covariance_kernel_cuda);
}
