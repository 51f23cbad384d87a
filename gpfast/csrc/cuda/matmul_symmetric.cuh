// K(x, x) @ V in float32 on tensor cores, never storing K, each pair of points computed once and used for both of
// its products: O_I += P V_J for its rows and O_J += P^T V_I for its columns. Why: the training engine's products
// are all K(x, x) V, and kv_tc_kernel (matmul_tensor.cuh) spends about 15.6 instructions a pair (Nsight Compute),
// of which the cross term's MMAs, the exponential, the near test and P's split are paid once per pair here, for two
// outputs. The column side adds, per 16 x 8 pairs, a transposition of P through the warp's shared memory (four
// 8-byte stores, two 16-byte loads), 3xTF32 MMAs V_I^T P and an addition into shared memory.
//
// Work. The points are cut into super-tiles of S rows (S = 512 or 1024); a block takes one super-tile pair
// (A, C), A <= C, the pairs ordered so that the diagonal ones, which have half the work, come last. It sweeps A's
// rows in bands of 128 (4 warps x 2 row tiles of 16, the layout of kv_tc_kernel's default instance) and, for each
// band, C's columns in the 64-column tiles that kv_tc_stage_kernel staged for x2 = x, copied by cp.async one tile
// ahead (the copy runs on across bands). A tile to the right of the band's own 128 x 128 square gives both
// products; the square itself (a band's tiles 2 I and 2 I + 1 for band I) gives its rows' products only, every
// ordered pair in it, as kv_tc_kernel does; tiles to its left are skipped (their pairs are the column side of
// another band's tiles). So every ordered pair (i, j) is counted once.
//
// Sums. The row side is kv_tc_kernel's: fresh accumulators over two tiles, then a compensated (Kahan) sum over the
// band's tiles in registers. The column side goes, per 8 columns and warp, from the MMAs' accumulators (32 rows)
// into a float32 array of the super-tile's S columns x 16 right-hand sides in shared memory by shared-memory
// atomic adds: S / 32 additions into each element. At the end of a band the rows' sums, and at the end of the
// super-tile the columns' sums, are added into the float64 output by global atomics, about n / S additions into
// each output element from different blocks, whose rounding float64 keeps far below float32's. The launcher
// scales the float64 sums by s and rounds them to float32. The order of both kinds of atomic addition follows the
// warps' and blocks' timing, so results are not bitwise repeatable (kv_tc_kernel's are): they differ from run to
// run by about float32's rounding of the column sums in shared memory.
//
// Near pairs: recomputed by differences where the expanded exponent is within 2 tau |z_i|^2 of zero (the row's
// threshold, as kv_tc_kernel), so K(x, x) = s exactly on the diagonal (the square's row products).
//
// Transposition. The MMAs leave P[r][c] for r = g, g + 8 and c = 2 q, 2 q + 1 in lane 4 g + q (q = lane & 3); the
// column product's B operand (k = row, n = column) wants P[k][g] in lane 4 g + q with k = q and q + 4. Each half
// of 8 rows goes through shared memory as (hi, lo) pairs, column c at word 16 c + 8 (c >> 1): the 8-byte stores
// then hit 16 distinct bank pairs in each half-warp, and each lane reads rows 2 q and 2 q + 1 of its column g as
// one 16-byte load, conflict-free in each quarter-warp. The k index is a summation index, so k = q is taken to be
// row 2 q and k = q + 4 row 2 q + 1 of the half, and V_I's fragments (the A operand, m = right-hand side) are
// loaded in the same order.
#pragma once

#include "matmul_tensor.cuh"

namespace gpfast {
namespace cuda {

constexpr int kKvSymWarps = 4, kKvSymThreads = kKvSymWarps * 32, kKvSymBand = 128;
constexpr int kKvSymHalf = 152;  // words of one half's transposition scratch (8 columns x 8 rows, the last at 151)
constexpr int kKvSymScratch = 2 * 2 * kKvSymHalf;  // a warp's: 2 row tiles x 2 halves
using KvSymTile = TcTile<1, 2, 64>;

// the column sums' pitch: 8 more than S (a multiple of 32) words, so that right-hand sides g and g + 4 fall in
// banks 8 g apart and the swap below makes each atomic instruction's 32 lanes hit distinct banks
template <int S>
__host__ __device__ constexpr int kv_sym_pitch() {
  return S + 8;
}
template <int S>
__host__ __device__ constexpr int kv_sym_smem_bytes() {
  return 2 * KvSymTile::kWords * 16 + (16 * kv_sym_pitch<S>() + kKvSymWarps * kKvSymScratch + 16) * 4;
}

struct KvSymArgs {
  const float* x;      // (B, n, d) raw points
  const float* ls;     // (B, d)
  const float* mu;     // (B, d): the centre the tiles were staged with
  const float* v;      // (B, n, t)
  const uint4* tiles;  // (B, tiles_per_batch, KvSymTile::kWords): kv_tc_stage_kernel's, with x2 = x
  double* out;         // (B, n, t), zeroed by the caller: sum_j (K_ij / s) V_j
  int64_t n, tiles_per_batch, supers;  // supers: super-tiles a side, ceil(n / S)
  int d, t;
};

// The super-tile pair of block k (0 <= k < supers (supers + 1) / 2): row r of the triangle r (r + 1) / 2 <= k,
// column c = k - r (r + 1) / 2 <= r; pair (c, c + supers - 1 - r), so that the pairs furthest off the diagonal
// come first and the diagonal ones (r = supers - 1) last.
__device__ __forceinline__ void kv_sym_pair(int64_t k, int64_t supers, int64_t& A, int64_t& C) {
  int64_t r = static_cast<int64_t>((sqrt(8.0 * static_cast<double>(k) + 1.0) - 1.0) * 0.5);
  while (r * (r + 1) / 2 > k) --r;
  while ((r + 1) * (r + 2) / 2 <= k) ++r;
  const int64_t c = k - r * (r + 1) / 2;
  A = c;
  C = c + (supers - 1 - r);
}

// grid (supers (supers + 1) / 2, B), kKvSymThreads threads, kv_sym_smem_bytes<S>() of dynamic shared memory
template <int S, int kMinBlocks>
__global__ void __launch_bounds__(kKvSymThreads, kMinBlocks) kv_sym_kernel(const KvSymArgs a) {
  constexpr int MT = 2, NT = 2, kBands = S / kKvSymBand, kSuperTiles = S / 64, kGroup = 2, kPitch = kv_sym_pitch<S>();
  static_assert(S % kKvSymBand == 0 && kPitch % 32 == 8, "S is a multiple of 128");
  extern __shared__ __align__(16) unsigned char kv_sym_smem[];
  uint4(*s_tile)[KvSymTile::kWords] = reinterpret_cast<uint4(*)[KvSymTile::kWords]>(kv_sym_smem);
  float* col_acc = reinterpret_cast<float*>(kv_sym_smem + 2 * KvSymTile::kWords * 16);  // [rhs][kPitch]
  float* scratch = col_acc + 16 * kPitch;                                                  // [warp][kKvSymScratch]
  float* s_mu = scratch + kKvSymWarps * kKvSymScratch;
  float* s_w = s_mu + 8;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, q = lane & 3;
  const int64_t b = blockIdx.y, n = a.n;
  const int d = a.d, tt = a.t;
  int64_t A, C;
  kv_sym_pair(blockIdx.x, a.supers, A, C);
  const float* x = a.x + b * n * d;
  const float* v = a.v + b * n * tt;
  const uint4* tiles = a.tiles + b * a.tiles_per_batch * KvSymTile::kWords;
  double* out = a.out + b * n * tt;

  const int nb = static_cast<int>(min(static_cast<int64_t>(kBands), (n - A * S + kKvSymBand - 1) / kKvSymBand));
  const int64_t jhi = min((C + 1) * kSuperTiles, a.tiles_per_batch);
  // the first tile of band bb: its own square's in a diagonal pair, C's first otherwise
  auto jlo = [&](int bb) -> int64_t { return A == C ? 2 * (A * kBands + bb) : C * kSuperTiles; };
  auto fetch = [&](int buf, int64_t J) {
    const uint4* src = tiles + J * KvSymTile::kWords;
    for (int e = tid; e < KvSymTile::kWords; e += kKvSymThreads) cp_async16(&s_tile[buf][e], src + e);
  };
  fetch(0, jlo(0));
  cp_async_commit();
  if (tid < 8) {
    s_mu[tid] = tid < d ? a.mu[b * d + tid] : 0.0f;
    s_w[tid] = tid < d ? tc_weight(a.ls + b * d, tid) : 0.0f;
  }
  for (int e = tid; e < 16 * kPitch; e += kKvSymThreads) col_acc[e] = 0.0f;
  __syncthreads();

  float* sc = scratch + warp * kKvSymScratch;
  int buf = 0;
  for (int bb = 0; bb < nb; ++bb) {
    const int64_t band = A * kBands + bb;  // global index: rows 128 band .., tiles 2 band and 2 band + 1
    const int64_t wrow = band * kKvSymBand + warp * 16 * MT;
    // the rows' operands, as kv_tc_kernel
    uint32_t ah[MT][1][4], al[MT][1][4];
    float b1[MT][2], thr[MT][2];
    tc_row_operands<MT, 1>(x, n, d, wrow, g, q, s_mu, s_w, ah, al, b1, thr);
    // V_I as the column product's A operand (m = right-hand side, k = row), k = q row 2 q and k = q + 4 row 2 q + 1
    // of each half of 8 rows
    uint32_t vh[MT][2][4], vl[MT][2][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t r0 = wrow + 16 * mt + 8 * h + 2 * q;
        auto vv = [&](int64_t r, int c) { return (r < n && c < tt) ? v[r * tt + c] : 0.0f; };
        split_tf32(vv(r0, g), vh[mt][h][0], vl[mt][h][0]);
        split_tf32(vv(r0, g + 8), vh[mt][h][1], vl[mt][h][1]);
        split_tf32(vv(r0 + 1, g), vh[mt][h][2], vl[mt][h][2]);
        split_tf32(vv(r0 + 1, g + 8), vh[mt][h][3], vl[mt][h][3]);
      }

    float acc[MT][NT][4], comp[MT][NT][4], big[MT][NT][4], small[MT][NT][4];
    tc_zero(acc, comp);

    const int64_t j0 = jlo(bb);
    for (int64_t J = j0; J < jhi; ++J) {
      // the next tile (this band's or the next band's first) into the buffer read in the previous step
      const bool same = J + 1 < jhi;
      if (same || bb + 1 < nb) fetch(buf ^ 1, same ? J + 1 : jlo(bb + 1));
      cp_async_commit();
      cp_async_wait_one();
      __syncthreads();
      const uint4* zf_s = s_tile[buf];
      const uint4* vf_s = zf_s + KvSymTile::kZ;
      const float* nc_s = reinterpret_cast<const float*>(zf_s + KvSymTile::kZ + KvSymTile::kV);
      const int64_t jt = J * 64;
      const bool both = J >= 2 * band + 2;  // right of the band's own square (block-uniform)
      const int lc0 = static_cast<int>((J - C * kSuperTiles) * 64);  // the tile's first column in col_acc
      const int64_t kk = J - j0;

      if (kk % kGroup == 0) tc_zero(big, small);

#pragma unroll
      for (int ch = 0; ch < KvSymTile::kChunks; ++ch) {
        const int c0 = 8 * ch + 2 * q;
        const float2 nc = *reinterpret_cast<const float2*>(&nc_s[c0]);
        const uint4 zf[1] = {zf_s[ch * 32 + lane]};
        float e[MT][4];  // the MMAs start from the biases (kv_tc_kernel's kBias = 1)
        const bool near = tc_exponents<MT, 1, 1>(e, ah, al, zf, b1, thr, nc);
        tc_recompute_near<MT, 8>(e, thr, near, x, x, d, n, n, wrow, jt, c0, g, s_mu, s_w);
        uint4 vf[NT];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) vf[nt] = vf_s[(ch * NT + nt) * 32 + lane];
        uint32_t ph[MT][4], pl[MT][4];  // A operand order: (g, c0), (g + 8, c0), (g, c0 + 1), (g + 8, c0 + 1)
        tc_p_times_v<MT, NT, 2>(e, vf, ph, pl, big, small);
        if (both) {
          // P through the scratch: lane (g, q) writes rows g (half 0) and g + 8 (half 1) of columns 2 q, 2 q + 1
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int u = 0; u < 4; ++u) {
              const int h = u >> 1, c = 2 * q + (u & 1), k = (u >> 1) | ((u & 1) << 1);  // k: A-operand slot
              *reinterpret_cast<float2*>(&sc[(2 * mt + h) * kKvSymHalf + 16 * c + 8 * (c >> 1) + 2 * g]) =
                  make_float2(__uint_as_float(ph[mt][k]), __uint_as_float(pl[mt][k]));
            }
          __syncwarp();
          float cbig[4] = {0.0f, 0.0f, 0.0f, 0.0f}, csmall[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {  // rows 2 q, 2 q + 1 of the half, column g: (hi, lo, hi, lo)
              const float4 w = *reinterpret_cast<const float4*>(&sc[(2 * mt + h) * kKvSymHalf + 16 * g + 8 * (g >> 1) + 4 * q]);
              mma_3xtf32_split(cbig, csmall, vh[mt][h], vl[mt][h], __float_as_uint(w.x), __float_as_uint(w.z),
                               __float_as_uint(w.y), __float_as_uint(w.w));
            }
          __syncwarp();  // every lane has read the scratch before the next chunk writes it
          // accumulator (rhs g, column 2 q), (g, 2 q + 1), (g + 8, 2 q), (g + 8, 2 q + 1); lanes with g >= 4 take
          // their two columns in the other order, so that each instruction's lanes hit 32 distinct banks
          const int sw = (g >> 2) & 1, lc = lc0 + 8 * ch + 2 * q;
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) {
            const float va = cbig[2 * hr] + csmall[2 * hr], vb = cbig[2 * hr + 1] + csmall[2 * hr + 1];
            float* row = col_acc + (g + 8 * hr) * kPitch + lc;
            atomicAdd(row + sw, sw ? vb : va);
            atomicAdd(row + 1 - sw, sw ? va : vb);
          }
        }
      }
      if ((kk + 1) % kGroup == 0 || J + 1 == jhi) tc_kahan_add(acc, comp, big, small);
      __syncthreads();  // every thread is done with this buffer before the copy two steps on
      buf ^= 1;
    }
    // the band's row sums over C's columns (the Kahan total less its lost low part)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t i = wrow + 16 * mt + g + 8 * h;
        if (i >= n) continue;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const int c = 8 * nt + 2 * q;
          if (c < tt)
            atomicAdd(out + i * tt + c, static_cast<double>(acc[mt][nt][2 * h]) - comp[mt][nt][2 * h]);
          if (c + 1 < tt)
            atomicAdd(out + i * tt + c + 1, static_cast<double>(acc[mt][nt][2 * h + 1]) - comp[mt][nt][2 * h + 1]);
        }
      }
  }
  // the super-tile's column sums (the loop's last barrier orders every shared-memory addition before these reads)
  for (int e = tid; e < 16 * S; e += kKvSymThreads) {
    const int lc = e >> 4, rhs = e & 15;
    const int64_t j = C * S + lc;
    if (j < n && rhs < tt) atomicAdd(out + j * tt + rhs, static_cast<double>(col_acc[rhs * kPitch + lc]));
  }
}

}  // namespace cuda
}  // namespace gpfast
