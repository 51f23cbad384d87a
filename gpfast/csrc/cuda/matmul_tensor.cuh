// K @ V in float32 on tensor cores, never storing K: out (splits, B, n, t) partial products, as kv_fwd_kernel.
//
// Two kernels. kv_tc_stage_kernel writes, once per product, every tile of kTile columns in the layout the product
// kernel's MMAs read: the cross term's B operand Z_J and V's rows, both split hi + lo, and -|z_j|^2. kv_tc_kernel
// then streams those tiles into shared memory by cp.async, double-buffered, so that no row block rescales, splits
// or waits on the columns it shares with every other row block.
//
// A warp owns MT tiles of 16 rows. Per 16 x 8 pairs (one MMA tile) and 8 columns at a time:
//   1. the exponent's cross term S = 2 Z_I Z_J^T as m16n8k8 TF32 MMAs over the features (k), 3xTF32 (below);
//   2. e = (S - |z_i|^2) - |z_j|^2 in log2 units, near pairs recomputed by differences (below), P = 2^e;
//   3. O += P V_J as m16n8k8 TF32 MMAs over the 8 columns (k), 3xTF32. P goes from the accumulator registers of
//      step 1 straight into the A operand: a thread holds columns 2t and 2t + 1 of rows g and g + 8, and the A
//      operand wants k = t and t + 4; since k runs over columns, which are summed, k = t is taken to be column 2t
//      and k = t + 4 column 2t + 1, and V's rows are staged in the same order (no shuffles).
// Steps 1 and 2 run for all of a warp's row tiles before step 3, with one vote for near pairs, so that the MMAs
// and exponentials of different tiles can overlap.
//
// Points: z = (x - mu) sqrt(log2(e) / 2) / l, so that K / s = 2^e, with mu the mean of the columns (per batch,
// given by the host): rows and columns use the same centre, so the same x gives the same z bit for bit, and a pair
// whose expanded exponent is within a fraction 2 tau of |z_i|^2 of zero has it recomputed as -|z_i - z_j|^2 from
// the raw points, which makes K(x, x) = s exactly (as kv_fwd_kernel, covariance_forward.cuh).
//
// Why 3xTF32. TF32 keeps 11 bits of the significand, so each operand is split a = a_hi + a_lo (a_hi TF32, rounded
// to nearest; a_lo within 2^-22 |a| of TF32) and a b ~ a_hi b_hi + a_hi b_lo + a_lo b_hi, dropping a_lo b_lo: each
// product is then within a few times 2^-22 of a b, against float32's 2^-24 rounding. On CUDA cores the work is
// about d + t + 4 FMAs a pair (28 at d = 8, t = 16: 1.1 s for n = m = 10^6 at the 51 TFLOP/s measured on the H200);
// here the CUDA cores keep about ten operations a pair (the biases, the near test, the split of P) beside one
// exponential, and the tensor cores take 3 (d / 8 + t / 8) MMAs per 128 pairs.
//
// Why a compensated sum across tiles. Each tile's products are summed in fresh accumulators (`big` for hi x hi,
// `small` for the two cross products) and then added to the row's total: m / kTile float32 additions into one
// total (15,625 at 10^6 columns and 64-column tiles), whose rounding grows as their square root. Left plain, it
// dominated the error (H200, 10^6 points, 32-column tiles: 3.1e-6 against float64, plain float32's formula
// 1.5e-6); a Kahan sum (the total and its lost low part), four additions per tile and value, took it to 6.9e-7.
#pragma once

#include "device_common.cuh"
#include "matmul_forward.cuh"
#include "mma.cuh"

namespace gpfast {
namespace cuda {

// One staged tile of kTile columns, in 16-byte words: the cross term's fragments [chunk][k-step][lane], V's
// [chunk][n-tile][lane] (each {b0 hi, b1 hi, b0 lo, b1 lo}), then -|z_j|^2 for the tile's columns.
template <int KD, int NT, int kTile>
struct TcTile {
  static constexpr int kChunks = kTile / 8;
  static constexpr int kZ = kChunks * KD * 32, kV = kChunks * NT * 32, kN = kTile / 4;
  static constexpr int kWords = kZ + kV + kN;
};

struct KvTcArgs {
  const float* x1;     // (B, n, d) raw points
  const float* x2;     // (B, m, d)
  const float* ls;     // (B, d)
  const float* scale;  // (B)
  const float* mu;     // (B, d): the centre, the mean of x2
  const float* v;      // (B, m, t)
  uint4* tiles;        // (B, ceil(m / kTile), TcTile::kWords) staged column tiles
  float* out;          // (splits, B, n, t)
  int64_t n, m, batch, tiles_per_batch, cols_per_split;
  int d, t;
};

__device__ __forceinline__ float tc_weight(const float* ls, int k) { return static_cast<float>(kSqrtHalfLog2e) / ls[k]; }

// Pieces of the product kernels' per-lane work (kv_tc_kernel here and kv_sym_kernel, matmul_symmetric.cuh), each
// over a warp's MT row tiles of 16 rows from row wrow. Lane 4 g + q holds rows g and g + 8 of each tile and, in a
// chunk of 8 columns from c0 = 8 ch + 2 q, columns c0 and c0 + 1: e[mt][0..3] for (g, c0), (g, c0 + 1),
// (g + 8, c0), (g + 8, c0 + 1), the MMAs' accumulator layout.

// The lane's rows: the cross term's A operand (2 Z_I, split; doubling is exact), the biases -|z_i|^2 and the
// near thresholds. x is the raw points, n of them, d features; rows past n are zero.
template <int MT, int KD>
__device__ __forceinline__ void tc_row_operands(const float* x, int64_t n, int d, int64_t wrow, int g, int q,
                                                const float* s_mu, const float* s_w, uint32_t (&ah)[MT][KD][4],
                                                uint32_t (&al)[MT][KD][4], float (&b1)[MT][2], float (&thr)[MT][2]) {
  constexpr int D = 8 * KD;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t i = wrow + 16 * mt + g + 8 * h;
      const float* xi = x + i * d;
      auto z = [&](int k) { return (i < n && k < d) ? scale_point(xi[k], s_mu[k], s_w[k]) : 0.0f; };
      float nrm = 0.0f;
#pragma unroll
      for (int k = 0; k < D; ++k) nrm = fmaf(z(k), z(k), nrm);
      b1[mt][h] = -nrm;
      thr[mt][h] = -nrm * (2 * kNearTau);
#pragma unroll
      for (int ks = 0; ks < KD; ++ks) {  // a0/a2 of row g, a1/a3 of row g + 8
        split_tf32(2.0f * z(8 * ks + q), ah[mt][ks][h], al[mt][ks][h]);
        split_tf32(2.0f * z(8 * ks + q + 4), ah[mt][ks][2 + h], al[mt][ks][2 + h]);
      }
    }
  }
}

// The chunk's exponents from its staged Z_J fragments zf and column biases nc = -|z_j|^2 (kBias as in
// kv_tc_kernel); returns whether any of the lane's pairs passes its row's near threshold.
template <int MT, int KD, int kBias>
__device__ __forceinline__ bool tc_exponents(float (&e)[MT][4], const uint32_t (&ah)[MT][KD][4],
                                             const uint32_t (&al)[MT][KD][4], const uint4 (&zf)[KD],
                                             const float (&b1)[MT][2], const float (&thr)[MT][2], float2 nc) {
  bool near = false;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    float sb[4], ss[4];
    if constexpr (kBias == 0) {
#pragma unroll
      for (int u = 0; u < 4; ++u) sb[u] = ss[u] = 0.0f;
#pragma unroll
      for (int ks = 0; ks < KD; ++ks)
        mma_3xtf32_split(sb, ss, ah[mt][ks], al[mt][ks], zf[ks].x, zf[ks].y, zf[ks].z, zf[ks].w);
    } else {  // the first k-step's MMAs start from the biases; the others accumulate as in mma_3xtf32_split
      const float cb[4] = {b1[mt][0], b1[mt][0], b1[mt][1], b1[mt][1]}, cs[4] = {nc.x, nc.y, nc.x, nc.y};
      mma_tf32_from(ss, al[mt][0], zf[0].x, zf[0].y, cs);
      mma_tf32(ss, ah[mt][0], zf[0].z, zf[0].w);
      mma_tf32_from(sb, ah[mt][0], zf[0].x, zf[0].y, cb);
#pragma unroll
      for (int ks = 1; ks < KD; ++ks)
        mma_3xtf32_split(sb, ss, ah[mt][ks], al[mt][ks], zf[ks].x, zf[ks].y, zf[ks].z, zf[ks].w);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      if constexpr (kBias == 0)
        e[mt][u] = ((sb[u] + ss[u]) + b1[mt][u >> 1]) + ((u & 1) ? nc.y : nc.x);  // the dot product first
      else
        e[mt][u] = sb[u] + ss[u];
      near |= e[mt][u] >= thr[mt][u >> 1];
    }
  }
  return near;
}

// Where any lane of the warp has a near pair, those pairs' exponents recomputed by differences from the raw
// points (rows from x1, n of them; columns jt + c0 .. from x2, those before j_end)
template <int MT, int D>
__device__ __forceinline__ void tc_recompute_near(float (&e)[MT][4], const float (&thr)[MT][2], bool near,
                                                  const float* x1, const float* x2, int d, int64_t n, int64_t j_end,
                                                  int64_t wrow, int64_t jt, int c0, int g, const float* s_mu,
                                                  const float* s_w) {
  if (__any_sync(kFull, near)) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int64_t i = wrow + 16 * mt + g + 8 * (u >> 1), j = jt + c0 + (u & 1);
        if (e[mt][u] >= thr[mt][u >> 1] && i < n && j < j_end)
          e[mt][u] = tc_neg_sq_dist<D>(x1 + i * d, x2 + j * d, s_mu, s_w, d);
      }
  }
}

// P = 2^e split as the A operand (k = q is column c0, k = q + 4 column c0 + 1: (g, c0), (g + 8, c0), (g, c0 + 1),
// (g + 8, c0 + 1)), and O += P V_J over the chunk's NT staged n-tiles vf, into `big` and `small`
template <int MT, int NT, int kSplit>
__device__ __forceinline__ void tc_p_times_v(const float (&e)[MT][4], const uint4 (&vf)[NT], uint32_t (&ph)[MT][4],
                                             uint32_t (&pl)[MT][4], float (&big)[MT][NT][4],
                                             float (&small)[MT][NT][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    split_p<kSplit>(exp2_fast(e[mt][0]), ph[mt][0], pl[mt][0]);
    split_p<kSplit>(exp2_fast(e[mt][2]), ph[mt][1], pl[mt][1]);
    split_p<kSplit>(exp2_fast(e[mt][1]), ph[mt][2], pl[mt][2]);
    split_p<kSplit>(exp2_fast(e[mt][3]), ph[mt][3], pl[mt][3]);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      mma_3xtf32_split(big[mt][nt], small[mt][nt], ph[mt], pl[mt], vf[nt].x, vf[nt].y, vf[nt].z, vf[nt].w);
  }
}

template <int MT, int NT>
__device__ __forceinline__ void tc_zero(float (&a)[MT][NT][4], float (&b)[MT][NT][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int u = 0; u < 4; ++u) a[mt][nt][u] = b[mt][nt][u] = 0.0f;
}

// A group of tiles' sums (big + small) added into the Kahan totals (acc, and comp its lost low part, so that the
// sum is acc - comp)
template <int MT, int NT>
__device__ __forceinline__ void tc_kahan_add(float (&acc)[MT][NT][4], float (&comp)[MT][NT][4],
                                             const float (&big)[MT][NT][4], const float (&small)[MT][NT][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int u = 0; u < 4; ++u) {  // explicit roundings: fast-math must not reassociate the compensation away
        const float y = __fsub_rn(__fadd_rn(big[mt][nt][u], small[mt][nt][u]), comp[mt][nt][u]);
        const float s = __fadd_rn(acc[mt][nt][u], y);
        comp[mt][nt][u] = __fsub_rn(__fsub_rn(s, acc[mt][nt][u]), y);
        acc[mt][nt][u] = s;
      }
}

// grid (tiles, B), 128 threads: one tile of columns in the product kernel's layout
template <int KD, int NT, int kTile>
__global__ void __launch_bounds__(128) kv_tc_stage_kernel(const KvTcArgs a) {
  using Tile = TcTile<KD, NT, kTile>;
  constexpr int D = 8 * KD;
  __shared__ float s_mu[D], s_w[D];
  const int tid = threadIdx.x;
  const int64_t b = blockIdx.y, j0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int d = a.d, tt = a.t;
  const float* x2 = a.x2 + b * a.m * d;
  const float* v = a.v + b * a.m * tt;
  if (tid < D) {
    s_mu[tid] = tid < d ? a.mu[b * d + tid] : 0.0f;
    s_w[tid] = tid < d ? tc_weight(a.ls + b * d, tid) : 0.0f;
  }
  __syncthreads();
  uint4* tile = a.tiles + (b * a.tiles_per_batch + blockIdx.x) * Tile::kWords;
  auto z = [&](int c, int k) {
    return (j0 + c < a.m && k < d) ? scale_point(x2[(j0 + c) * d + k], s_mu[k], s_w[k]) : 0.0f;
  };
  for (int e = tid; e < Tile::kZ; e += 128) {  // Z_J: b0 = z[col g][8 ks + t], b1 = z[col g][8 ks + t + 4]
    const int ln = e & 31, ks = (e >> 5) % KD, ch = (e >> 5) / KD;
    const int c = 8 * ch + (ln >> 2), k0 = 8 * ks + (ln & 3);
    uint4 f;
    split_tf32(z(c, k0), f.x, f.z);
    split_tf32(z(c, k0 + 4), f.y, f.w);
    tile[e] = f;
  }
  for (int e = tid; e < Tile::kV; e += 128) {  // V: b0 = V[col 2t][8 nt + g], b1 = V[col 2t + 1][8 nt + g]
    const int ln = e & 31, nt = (e >> 5) % NT, ch = (e >> 5) / NT;
    const int64_t j = j0 + 8 * ch + 2 * (ln & 3);
    const int rhs = 8 * nt + (ln >> 2);
    const float v0 = (j < a.m && rhs < tt) ? v[j * tt + rhs] : 0.0f;
    const float v1 = (j + 1 < a.m && rhs < tt) ? v[(j + 1) * tt + rhs] : 0.0f;
    uint4 f;
    split_tf32(v0, f.x, f.z);
    split_tf32(v1, f.y, f.w);
    tile[Tile::kZ + e] = f;
  }
  float* nc = reinterpret_cast<float*>(tile + Tile::kZ + Tile::kV);
  for (int c = tid; c < kTile; c += 128) {
    float nrm = 0.0f;
#pragma unroll
    for (int k = 0; k < D; ++k) {
      const float y = z(c, k);
      nrm = fmaf(y, y, nrm);
    }
    nc[c] = -nrm;
  }
}

// KD = features / 8 (rounded up), NT = right-hand sides / 8 (rounded up, at most 4: t <= 32); kMinBlocks blocks
// per multiprocessor bound the registers (the sweep's occupancy against registers); kSplit as in split_p; kGroup
// tiles summed in the fresh accumulators before each compensated addition to the totals (1: every tile). Why
// kGroup: the addition is five FADDs per accumulator a tile (the two accumulators' sum and Kahan's four), 1.25
// instructions a pair at 64-column tiles, where Nsight Compute counted about 18 a pair in all at MT = 1 (H100,
// n = 200,000, d = 8, t = 16).
//
// kBias, the exponent's two biases (-|z_i|^2 and -|z_j|^2), which cost two FADDs a pair when added to the MMAs'
// result (FADD was the most frequent instruction: 5.26 of 15.6 a pair, Nsight Compute as above):
//   0: added after the MMAs, as ((S_big + S_small) - |z_i|^2) - |z_j|^2;
//   1: the MMAs start from them: the large products' accumulator from -|z_i|^2 and the small ones' from -|z_j|^2
//      (mma_tf32_from), so that e = S_big + S_small is one FADD. Each bias is then added inside the tensor core's
//      float32 sum instead of by an FADD at the same magnitude (|z|^2). That sum is not documented to round to
//      nearest, so its rounding rests on measurement: the error against float64 came out lower (5.2e-7 against
//      6.4e-7 at 10^6 points, d = 8, t = 16), with 0.920 against 0.940 s on an H100
//      (experiments/results/h100_2026-12-05_session24).
// A third form was measured and dropped: each row's exponent shifted by the integer floor(-2 tau |z_i|^2), so that
// the near test became the AND of the values' sign bits and each row's total was scaled by the exact power of two
// at the end. It took 1.74 s: rounding the threshold down to an integer widened the near band (for |z_i|^2 < 16
// from P >= 2^(-|z_i|^2 / 16) to P >= 1/2), and the warps' recomputations with it.
template <int KD, int NT, int MT, int kWarps, int kTile, int kMinBlocks, int kSplit, int kGroup = 1, int kBias = 0>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks) kv_tc_kernel(const KvTcArgs a) {
  using Tile = TcTile<KD, NT, kTile>;
  constexpr int D = 8 * KD, kThreads = kWarps * 32, kRows = kWarps * 16 * MT;
  static_assert(kBias == 0 || kBias == 1, "kBias is 0 or 1");
  __shared__ uint4 s_tile[2][Tile::kWords];
  __shared__ float s_mu[D], s_w[D];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, q = lane & 3;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int split = blockIdx.y;
  const int64_t b = blockIdx.z;
  const int64_t j_begin = split * a.cols_per_split;  // a multiple of kTile
  const int64_t j_end = min(a.m, j_begin + a.cols_per_split);
  const int d = a.d, tt = a.t;
  const float* x1 = a.x1 + b * a.n * d;
  const float* x2 = a.x2 + b * a.m * d;
  const uint4* tiles = a.tiles + b * a.tiles_per_batch * Tile::kWords;
  const int64_t tile0 = j_begin / kTile, ntiles = (j_end - j_begin + kTile - 1) / kTile;

  auto fetch = [&](int buf, int64_t k) {
    const uint4* src = tiles + (tile0 + k) * Tile::kWords;
    for (int e = tid; e < Tile::kWords; e += kThreads) cp_async16(&s_tile[buf][e], src + e);
  };
  fetch(0, 0);  // the first tile's copy overlaps the rows' set-up
  cp_async_commit();

  if (tid < D) {
    s_mu[tid] = tid < d ? a.mu[b * d + tid] : 0.0f;
    s_w[tid] = tid < d ? tc_weight(a.ls + b * d, tid) : 0.0f;
  }
  __syncthreads();

  // this lane's rows g and g + 8 of each of the warp's row tiles
  const int64_t wrow = row0 + warp * 16 * MT;
  uint32_t ah[MT][KD][4], al[MT][KD][4];
  float b1[MT][2], thr[MT][2];
  tc_row_operands<MT, KD>(x1, a.n, d, wrow, g, q, s_mu, s_w, ah, al, b1, thr);

  float acc[MT][NT][4], comp[MT][NT][4];  // Kahan sums: the total and its lost low part
  tc_zero(acc, comp);

  float big[MT][NT][4], small[MT][NT][4];  // the current group of tiles: hi x hi and the two cross products
  for (int64_t k = 0; k < ntiles; ++k) {
    if (k + 1 < ntiles) fetch((k + 1) & 1, k + 1);  // into the buffer read in the previous tile (synced below)
    cp_async_commit();
    cp_async_wait_one();  // tile k has landed (this thread's part)
    __syncthreads();      // ... and every thread's
    const uint4* zf_s = s_tile[k & 1];
    const uint4* vf_s = zf_s + Tile::kZ;
    const float* nc_s = reinterpret_cast<const float*>(zf_s + Tile::kZ + Tile::kV);
    const int64_t jt = j_begin + k * kTile;

    if (k % kGroup == 0) tc_zero(big, small);

#pragma unroll
    for (int ch = 0; ch < Tile::kChunks; ++ch) {
      const int c0 = 8 * ch + 2 * q;  // this lane's columns c0 and c0 + 1 of the tile
      const float2 nc = *reinterpret_cast<const float2*>(&nc_s[c0]);
      uint4 zf[KD];
#pragma unroll
      for (int ks = 0; ks < KD; ++ks) zf[ks] = zf_s[(ch * KD + ks) * 32 + lane];
      float e[MT][4];
      const bool near = tc_exponents<MT, KD, kBias>(e, ah, al, zf, b1, thr, nc);
      tc_recompute_near<MT, D>(e, thr, near, x1, x2, d, a.n, j_end, wrow, jt, c0, g, s_mu, s_w);
      uint4 vf[NT];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) vf[nt] = vf_s[(ch * NT + nt) * 32 + lane];
      uint32_t ph[MT][4], pl[MT][4];
      tc_p_times_v<MT, NT, kSplit>(e, vf, ph, pl, big, small);
    }
    if ((k + 1) % kGroup == 0 || k + 1 == ntiles) tc_kahan_add(acc, comp, big, small);
    __syncthreads();  // every thread is done with buffer k & 1 before the next tile's copy into it
  }

  // accumulator layout: (row g, rhs 8 nt + 2t), (g, 8 nt + 2t + 1), (g + 8, ...)
  const float s = a.scale[b];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t i = wrow + 16 * mt + g + 8 * h;
      if (i >= a.n) continue;
      float* dst = a.out + ((static_cast<int64_t>(split) * a.batch + b) * a.n + i) * tt;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int c = 8 * nt + 2 * q;
        if (c < tt) dst[c] = s * acc[mt][nt][2 * h];
        if (c + 1 < tt) dst[c + 1] = s * acc[mt][nt][2 * h + 1];
      }
    }
  }
}

}  // namespace cuda
}  // namespace gpfast
