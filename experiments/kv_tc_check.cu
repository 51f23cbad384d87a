// Standalone check and timing of the tensor-core K @ V (gpfast/csrc/cuda/matmul_tc.cuh) against a float64 CPU loop
// and the CUDA-core kv_fwd_kernel, without torch: it needs only nvcc, so it runs before the extension is built.
//
//   nvcc -O3 -arch=sm_90 -std=c++17 -o /tmp/kv_tc_check experiments/kv_tc_check.cu && /tmp/kv_tc_check [N M REPS]
//
// Prints, per case, the norm-wise relative error of each kernel against float64 (on a sample of rows) and exits 1
// if a tensor-core kernel (with the split) errs by more than max(2 x the CUDA-core kernel's error, 1e-6), or if
// K(x, x) = s is not exact; the same for the tensor-core covariance forward (covariance_tc.cuh) against float32
// differences. With N M REPS it then times every K @ V variant at d = 8, t = 16 (CUDA events, medians), and the
// covariance forward at (4, 8192, 8192, 32) and (1, 16384, 16384, 8).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "../gpfast/csrc/cuda/covariance_tc.cuh"
#include "../gpfast/csrc/cuda/matmul_tc.cuh"

using gpfast::cuda::KvFwdArgs;

#define CHECK(x)                                                                        \
  do {                                                                                  \
    cudaError_t err_ = (x);                                                             \
    if (err_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(err_)); \
      std::exit(2);                                                                     \
    }                                                                                   \
  } while (0)

struct Problem {
  int64_t n, m;
  int d, t;
  std::vector<float> x1, x2, ls, v;
  float s = 1.3f;
};

Problem make_problem(int64_t n, int64_t m, int d, int t, float shift, float ls_scale, unsigned seed) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> unif(0.5f, 2.0f);
  Problem p{n, m, d, t, {}, {}, {}, {}};
  p.x1.resize(n * d), p.x2.resize(m * d), p.ls.resize(d), p.v.resize(m * t);
  for (auto& x : p.x1) x = normal(gen) + shift;
  for (auto& x : p.x2) x = normal(gen) + shift;
  const float widen = std::max(1.0f, std::sqrt(d / 8.0f));
  for (auto& x : p.ls) x = unif(gen) * widen * ls_scale;
  for (auto& x : p.v) x = normal(gen);
  return p;
}

struct Device {
  float *x1, *x2, *ls, *s, *v, *out;
  int64_t out_size;
};

Device upload(const Problem& p, int64_t max_splits) {
  Device dv{};
  CHECK(cudaMalloc(&dv.x1, p.x1.size() * 4));
  CHECK(cudaMalloc(&dv.x2, p.x2.size() * 4));
  CHECK(cudaMalloc(&dv.ls, p.ls.size() * 4));
  CHECK(cudaMalloc(&dv.s, 4));
  CHECK(cudaMalloc(&dv.v, p.v.size() * 4));
  dv.out_size = max_splits * p.n * p.t;
  CHECK(cudaMalloc(&dv.out, dv.out_size * 4));
  CHECK(cudaMemcpy(dv.x1, p.x1.data(), p.x1.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dv.x2, p.x2.data(), p.x2.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dv.ls, p.ls.data(), p.ls.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dv.s, &p.s, 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dv.v, p.v.data(), p.v.size() * 4, cudaMemcpyHostToDevice));
  return dv;
}

void release(Device& dv) {
  for (float* ptr : {dv.x1, dv.x2, dv.ls, dv.s, dv.v, dv.out}) CHECK(cudaFree(ptr));
}

int sms() {
  int dev = 0, count = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev));
  return count;
}

// Columns per split as the launcher's split_columns (dispatch.h).
int64_t split_cols(int64_t blocks, int64_t m, int64_t tile, int per_sm, int64_t& splits) {
  auto cdiv = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  splits = std::clamp<int64_t>(cdiv(int64_t(per_sm) * sms(), std::max<int64_t>(blocks, 1)), 1, cdiv(m, tile));
  const int64_t cols = cdiv(cdiv(m, splits), tile) * tile;
  splits = cdiv(m, cols);
  return cols;
}

// A kernel run: launches into dv.out (splits, 1, n, t) and returns the number of splits.
using Runner = int64_t (*)(const Problem&, Device&);

template <int KD, int NT, int MT, bool kSplit, int kPoly, bool kFlush = false>
int64_t run_tc(const Problem& p, Device& dv) {
  const int64_t rowblocks = (p.n + 16 * gpfast::cuda::kTcWarps * MT - 1) / (16 * gpfast::cuda::kTcWarps * MT);
  const int t_chunks = (p.t + 8 * NT - 1) / (8 * NT);
  int64_t splits = 1;
  const int64_t cols = split_cols(rowblocks * t_chunks, p.m, gpfast::cuda::kTcCols, 4, splits);
  KvFwdArgs<float> a{dv.x1, dv.x2, dv.ls, dv.s, dv.v, dv.out, p.n, p.m, 1, p.d, p.t, t_chunks, cols};
  const dim3 grid(static_cast<unsigned>(rowblocks), static_cast<unsigned>(splits), static_cast<unsigned>(t_chunks));
  gpfast::cuda::kv_tc_kernel<KD, NT, MT, kSplit, kPoly, kFlush><<<grid, gpfast::cuda::kTcThreads>>>(a);
  CHECK(cudaGetLastError());
  return splits;
}

// The CUDA-core kernel as rbf_matmul launches it for float32, d <= 8, t in 9..16.
int64_t run_cuda_core(const Problem& p, Device& dv) {
  constexpr int kTM = 4;
  const int64_t rowblocks = (p.n + 128 * kTM - 1) / (128 * kTM);
  int64_t splits = 1;
  const int64_t cols = split_cols(rowblocks, p.m, gpfast::cuda::kKvTile, 6, splits);
  KvFwdArgs<float> a{dv.x1, dv.x2, dv.ls, dv.s, dv.v, dv.out, p.n, p.m, 1, p.d, p.t, 1, cols};
  const dim3 grid(static_cast<unsigned>(rowblocks), static_cast<unsigned>(splits), 1);
  gpfast::cuda::kv_fwd_kernel<float, 8, 16, kTM, true><<<grid, gpfast::cuda::kKvThreads>>>(a);
  CHECK(cudaGetLastError());
  return splits;
}

std::vector<double> result(const Problem& p, Device& dv, int64_t splits) {
  std::vector<float> part(splits * p.n * p.t);
  CHECK(cudaMemcpy(part.data(), dv.out, part.size() * 4, cudaMemcpyDeviceToHost));
  std::vector<double> out(p.n * p.t, 0.0);
  for (int64_t sp = 0; sp < splits; ++sp)
    for (int64_t e = 0; e < p.n * p.t; ++e) out[e] += part[sp * p.n * p.t + e];
  return out;
}

// float64 rows of K @ V for the sampled rows.
std::vector<double> reference(const Problem& p, const std::vector<int64_t>& rows) {
  std::vector<double> want(rows.size() * p.t, 0.0);
  for (size_t r = 0; r < rows.size(); ++r) {
    const int64_t i = rows[r];
    for (int64_t j = 0; j < p.m; ++j) {
      double sq = 0.0;
      for (int k = 0; k < p.d; ++k) {
        const double z = (double(p.x1[i * p.d + k]) - double(p.x2[j * p.d + k])) / double(p.ls[k]);
        sq += z * z;
      }
      const double kij = double(p.s) * std::exp(-0.5 * sq);
      for (int c = 0; c < p.t; ++c) want[r * p.t + c] += kij * double(p.v[j * p.t + c]);
    }
  }
  return want;
}

double rel_err(const std::vector<double>& got, const std::vector<int64_t>& rows, int t,
               const std::vector<double>& want) {
  double num = 0.0, den = 0.0;
  for (size_t r = 0; r < rows.size(); ++r)
    for (int c = 0; c < t; ++c) {
      const double g = got[rows[r] * t + c], w = want[r * t + c];
      num += (g - w) * (g - w);
      den += w * w;
    }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-300);
}

struct Named {
  const char* name;
  Runner run;
  bool split;
};

// The default tensor-core kernel for this problem's (d, t) buckets.
Runner tc_default(int d, int t) {
  const int kd = d <= 8 ? 1 : (d <= 16 ? 2 : 4), nt = t <= 8 ? 1 : (t <= 16 ? 2 : 4);
  using gpfast::cuda::tc_rows_tiles;
  const Runner table[3][3] = {
      {run_tc<1, 1, tc_rows_tiles<1, 1>(), true, 0>, run_tc<1, 2, tc_rows_tiles<1, 2>(), true, 0>,
       run_tc<1, 4, tc_rows_tiles<1, 4>(), true, 0>},
      {run_tc<2, 1, tc_rows_tiles<2, 1>(), true, 0>, run_tc<2, 2, tc_rows_tiles<2, 2>(), true, 0>,
       run_tc<2, 4, tc_rows_tiles<2, 4>(), true, 0>},
      {run_tc<4, 1, tc_rows_tiles<4, 1>(), true, 0>, run_tc<4, 2, tc_rows_tiles<4, 2>(), true, 0>,
       run_tc<4, 4, tc_rows_tiles<4, 4>(), true, 0>}};
  return table[kd == 1 ? 0 : (kd == 2 ? 1 : 2)][nt == 1 ? 0 : (nt == 2 ? 1 : 2)];
}

const std::vector<Named> kVariants = {
    {"tc", run_tc<1, 2, 4, true, 0>, true},          {"tc_m2", run_tc<1, 2, 2, true, 0>, true},
    {"tc_poly1", run_tc<1, 2, 4, true, 1>, true},    {"tc_poly2", run_tc<1, 2, 4, true, 2>, true},
    {"tc_m2_poly1", run_tc<1, 2, 2, true, 1>, true}, {"tc_nosplit", run_tc<1, 2, 4, false, 0>, false},
    {"tc_flush", run_tc<1, 2, 4, true, 0, true>, true}, {"tc_m2_flush", run_tc<1, 2, 2, true, 0, true>, true},
    {"tc_poly1_flush", run_tc<1, 2, 4, true, 1, true>, true},
};

int check_case(int64_t n, int64_t m, int d, int t, float shift, float ls_scale, unsigned seed) {
  const Problem p = make_problem(n, m, d, t, shift, ls_scale, seed);
  Device dv = upload(p, 4096);
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < n; i += std::max<int64_t>(1, n / 256)) rows.push_back(i);
  if (rows.back() != n - 1) rows.push_back(n - 1);
  const std::vector<double> want = reference(p, rows);
  int fails = 0;
  double core = -1.0;
  if (d <= 8 && t > 8 && t <= 16) core = rel_err(result(p, dv, run_cuda_core(p, dv)), rows, t, want);
  const double bound = std::max(2.0 * std::max(core, 0.0), 1e-6);
  std::printf("n=%lld m=%lld d=%d t=%d shift=%g ls*%g: cuda_core %.3g", (long long)n, (long long)m, d, t, shift,
              ls_scale, core);
  std::vector<Named> runs = {{"tc", tc_default(d, t), true}};
  if (d <= 8 && t > 8 && t <= 16) runs = kVariants;
  for (const Named& r : runs) {
    const double err = rel_err(result(p, dv, r.run(p, dv)), rows, t, want);
    const bool bad = r.split && !(err <= bound);
    fails += bad;
    std::printf("  %s %.3g%s", r.name, err, bad ? " FAIL" : "");
  }
  std::printf("\n");
  release(dv);
  return fails;
}

// K(x, x) = s exactly: x2 = x1 and V = the first t columns of the identity.
int check_diagonal(int d) {
  const int64_t n = 300;
  const int t = 16;
  Problem p = make_problem(n, n, d, t, 3.0f, 1.0f, 7);
  p.x2 = p.x1;
  for (int64_t j = 0; j < n; ++j)
    for (int c = 0; c < t; ++c) p.v[j * t + c] = j == c ? 1.0f : 0.0f;
  Device dv = upload(p, 4096);
  const std::vector<double> got = result(p, dv, tc_default(d, t)(p, dv));
  int bad = 0;
  for (int c = 0; c < t; ++c) bad += got[c * t + c] != double(p.s);
  std::printf("diagonal d=%d: %d of %d entries differ from s%s\n", d, bad, t, bad ? " FAIL" : "");
  release(dv);
  return bad != 0;
}

// The tensor-core covariance forward on `batch` copies of one problem: the points uploaded once (CovPoints), then
// launched as the launcher does (strips of columns, rows split so that the grid has about 4 blocks per SM).
struct CovPoints {
  float *x1, *x2, *ls, *s;
};

CovPoints upload_cov(const Problem& p, int batch) {
  CovPoints c{};
  CHECK(cudaMalloc(&c.x1, p.x1.size() * batch * 4));
  CHECK(cudaMalloc(&c.x2, p.x2.size() * batch * 4));
  CHECK(cudaMalloc(&c.ls, p.d * batch * 4));
  CHECK(cudaMalloc(&c.s, batch * 4));
  for (int b = 0; b < batch; ++b) {
    CHECK(cudaMemcpy(c.x1 + b * p.x1.size(), p.x1.data(), p.x1.size() * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(c.x2 + b * p.x2.size(), p.x2.data(), p.x2.size() * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(c.ls + b * p.d, p.ls.data(), p.d * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(c.s + b, &p.s, 4, cudaMemcpyHostToDevice));
  }
  return c;
}

void release_cov(CovPoints& c) {
  for (float* ptr : {c.x1, c.x2, c.ls, c.s}) CHECK(cudaFree(ptr));
}

void launch_cov_tc(const Problem& p, const CovPoints& c, float* out, int batch) {
  auto cdiv = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  const int64_t strips = cdiv(p.m, gpfast::cuda::kCovTcStrip);
  int64_t rowblocks = std::clamp<int64_t>(cdiv(4 * sms(), strips * batch), 1, cdiv(p.n, 64));
  const int64_t rows_per_block = cdiv(cdiv(p.n, rowblocks), 64) * 64;
  rowblocks = cdiv(p.n, rows_per_block);
  const gpfast::cuda::CovTcArgs a{c.x1, c.x2, c.ls, c.s, out, p.n, p.m, p.d, rows_per_block, p.m % 2 == 0};
  const dim3 grid(static_cast<unsigned>(strips), static_cast<unsigned>(rowblocks), static_cast<unsigned>(batch));
  if (p.d <= 8)
    gpfast::cuda::cov_tc_kernel<1><<<grid, gpfast::cuda::kCovTcThreads>>>(a);
  else if (p.d <= 16)
    gpfast::cuda::cov_tc_kernel<2><<<grid, gpfast::cuda::kCovTcThreads>>>(a);
  else
    gpfast::cuda::cov_tc_kernel<4><<<grid, gpfast::cuda::kCovTcThreads>>>(a);
  CHECK(cudaGetLastError());
}

// Norm-wise error of the tensor-core covariance against float64, next to float32 differences on the CPU (the plain
// formula); fails above max(2x plain, 1e-6), on NaN (poisoned output) or if K(x, x) != s for the duplicated rows.
int check_covariance(int64_t n, int64_t m, int d, float shift, float ls_scale, unsigned seed) {
  Problem p = make_problem(n, m, d, 1, shift, ls_scale, seed);
  for (int64_t i = 0; i < std::min<int64_t>(n, m) / 3; ++i)  // every third row of x1 also in x2, shuffled
    for (int k = 0; k < d; ++k) p.x2[((i * 7) % m) * d + k] = p.x1[(3 * i) * d + k];
  float* out;
  CHECK(cudaMalloc(&out, n * m * 4));
  CHECK(cudaMemset(out, 0xff, n * m * 4));  // NaN: an element never written shows
  CovPoints c = upload_cov(p, 1);
  launch_cov_tc(p, c, out, 1);
  release_cov(c);
  std::vector<float> got(n * m);
  CHECK(cudaMemcpy(got.data(), out, n * m * 4, cudaMemcpyDeviceToHost));
  CHECK(cudaFree(out));
  double num = 0, den = 0, num32 = 0;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < m; ++j) {
      double sq = 0.0;
      float sq32 = 0.0f;
      for (int k = 0; k < d; ++k) {
        const double z = (double(p.x1[i * d + k]) - double(p.x2[j * d + k])) / double(p.ls[k]);
        const float z32 = (p.x1[i * d + k] - p.x2[j * d + k]) / p.ls[k];
        sq += z * z;
        sq32 += z32 * z32;
      }
      const double want = double(p.s) * std::exp(-0.5 * sq), plain = p.s * std::exp(-0.5f * sq32);
      nan |= std::isnan(got[i * m + j]);
      num += (got[i * m + j] - want) * (got[i * m + j] - want);
      num32 += (plain - want) * (plain - want);
      den += want * want;
    }
  int diag_bad = 0;
  for (int64_t i = 0; i < std::min<int64_t>(n, m) / 3; ++i) diag_bad += got[(3 * i) * m + (i * 7) % m] != p.s;
  const double err = std::sqrt(num / den), plain = std::sqrt(num32 / den);
  const bool bad = nan || diag_bad || !(err <= std::max(2 * plain, 1e-6));
  std::printf("covariance n=%lld m=%lld d=%d shift=%g ls*%g: tc %.3g plain fp32 %.3g, K(x,x) != s: %d%s%s\n",
              (long long)n, (long long)m, d, shift, ls_scale, err, plain, diag_bad, nan ? " NaN" : "",
              bad ? " FAIL" : "");
  return bad;
}

void bench_covariance(int batch, int64_t n, int d, int reps) {
  const Problem p = make_problem(n, n, d, 1, 0.0f, 1.0f, 17);
  float* out;
  CHECK(cudaMalloc(&out, batch * n * n * 4));
  CovPoints c = upload_cov(p, batch);
  launch_cov_tc(p, c, out, batch);  // warm-up
  CHECK(cudaDeviceSynchronize());
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int k = 0; k < reps; ++k) {
    CHECK(cudaEventRecord(e0));
    launch_cov_tc(p, c, out, batch);
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  const double floor_ms = batch * n * n * 4.0 / 4.27e12 * 1e3;  // one write of K at the measured copy rate
  std::printf("bench covariance (%d, %lld, %lld, %d) tc: median %.3f ms (store floor %.3f ms)\n", batch,
              (long long)n, (long long)n, d, ms[ms.size() / 2], floor_ms);
  release_cov(c);
  CHECK(cudaFree(out));
}

void bench(int64_t n, int64_t m, int reps) {
  const Problem p = make_problem(n, m, 8, 16, 0.0f, 1.0f, 11);
  Device dv = upload(p, 4096);
  std::vector<Named> runs = {{"cuda_core", run_cuda_core, true}};
  runs.insert(runs.end(), kVariants.begin(), kVariants.end());
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  for (const Named& r : runs) {
    r.run(p, dv);  // warm-up
    CHECK(cudaDeviceSynchronize());
    std::vector<float> ms;
    for (int k = 0; k < reps; ++k) {
      CHECK(cudaEventRecord(e0));
      r.run(p, dv);
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      float t = 0;
      CHECK(cudaEventElapsedTime(&t, e0, e1));
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    std::printf("bench n=%lld m=%lld d=8 t=16 %-12s median %.3f ms (kernel only, no host sum of splits)\n",
                (long long)n, (long long)m, r.name, ms[ms.size() / 2]);
  }
  release(dv);
}

int main(int argc, char** argv) {
  int fails = 0;
  fails += check_case(1000, 3001, 8, 16, 0.0f, 1.0f, 1);
  fails += check_case(777, 5003, 8, 11, 10.0f, 1.0f, 2);
  fails += check_case(517, 2049, 3, 16, 0.0f, 0.05f, 3);
  fails += check_case(517, 2049, 5, 12, 0.0f, 30.0f, 4);
  for (int d : {1, 17, 32})
    for (int t : {1, 11, 16, 33}) fails += check_case(301, 1027, d, t, 0.0f, 1.0f, 5 + d + t);
  for (int d : {3, 8, 32}) fails += check_diagonal(d);
  fails += check_covariance(333, 1027, 32, 0.0f, 1.0f, 21);
  fails += check_covariance(200, 515, 17, 10.0f, 1.0f, 22);
  fails += check_covariance(129, 301, 8, 0.0f, 0.05f, 23);
  fails += check_covariance(77, 1001, 3, 100.0f, 30.0f, 24);
  fails += check_covariance(64, 640, 1, 0.0f, 1.0f, 25);
  std::printf("%s: %d failures\n", fails ? "FAIL" : "ok", fails);
  if (argc >= 4) {
    bench(std::atoll(argv[1]), std::atoll(argv[2]), std::atoi(argv[3]));
    bench_covariance(4, 8192, 32, 20);
    bench_covariance(1, 16384, 8, 20);
  }
  return fails ? 1 : 0;
}
