"""The matrix-free symmetric K(x, x) @ V kernel (csrc/cuda/matmul_symmetric.cuh, ``kv_sym_kernel``) emulated on the
CPU, lane by lane: the super-tile pairs of the grid, the bands and the tiles each pair sweeps (and which of them give
both products, rows only or none), the tile copies one step ahead across bands, the staged tiles' fragments
(``kv_tc_stage_kernel``), the MMAs' fragments of the rows' and the columns' products, the transposition of P
through each warp's scratch, the column sums' shared-memory array with its per-lane swap, and the atomic additions
into the output. Where there is no GPU, this is what tests the kernel's index arithmetic
(tests/test_kv_symmetric_emulation.py runs it against K @ V in float64).

    python -m experiments.kv_symmetric_emulation [--n 700] [--t 16] [--d 5] [--super 256]

Arithmetic is exact (float64, the TF32 splits' low parts zero): any difference from K @ V beyond float64's rounding
is an indexing error. Not emulated: the tensor cores' rounding, the near pairs' recomputation (in exact arithmetic the
expanded exponent is the difference's) and timing (warps run one after another; only the column sums are shared
between them, and the kernel adds into those with atomics).
"""

from __future__ import annotations

import argparse
import functools

import numpy as np

from experiments.symmetric_matmul_emulation import Arith

WARPS, BAND, TILE, MT, NT = 4, 128, 64, 2, 2
HALF = 152  # words of one half's transposition scratch
LANE = np.arange(32)
G, Q = LANE >> 2, LANE & 3


def super_pair(k: int, supers: int) -> tuple[int, int]:
    """kv_sym_pair: block k's super-tile pair (A, C), A <= C, the diagonal pairs last."""
    r = int((np.sqrt(8.0 * k + 1.0) - 1.0) * 0.5)
    while r * (r + 1) // 2 > k:
        r -= 1
    while (r + 1) * (r + 2) // 2 <= k:
        r += 1
    c = k - r * (r + 1) // 2
    return c, c + supers - 1 - r


# m16n8k8 on lane registers, exact: mma(a[0..3], b0, b1) -> c[0..3], each an array over the 32 lanes
mma = functools.partial(Arith._mma, None)


def stage(z: np.ndarray, V: np.ndarray, J: int):
    """kv_tc_stage_kernel's tile J (d <= 8, t <= 16, 64 columns): Z_J's B fragments per chunk [8][32][2] (the high
    parts; the low ones are zero here), V's per chunk and n-tile [8][2][32][2], and -|z_j|^2 [64]."""
    n, t = V.shape

    def zv(j, k):
        return np.where(j < n, z[np.minimum(j, n - 1), k], 0.0)

    def vv(j, r):
        ok = (j < n) & (r < t)
        return np.where(ok, V[np.minimum(j, n - 1), np.minimum(r, t - 1)], 0.0)

    zf = np.zeros((8, 32, 2))
    vf = np.zeros((8, 2, 32, 2))
    for ch in range(8):
        c = J * TILE + 8 * ch + G
        zf[ch, :, 0], zf[ch, :, 1] = zv(c, Q), zv(c, Q + 4)
        for nt in range(NT):
            j, r = J * TILE + 8 * ch + 2 * Q, 8 * nt + G
            vf[ch, nt, :, 0], vf[ch, nt, :, 1] = vv(j, r), vv(j + 1, r)
    cols = J * TILE + np.arange(TILE)
    nc = np.where(cols < n, -(z[np.minimum(cols, n - 1)] ** 2).sum(1), 0.0)
    return zf, vf, nc


def emulate(x: np.ndarray, lengthscale: np.ndarray, s: float, V: np.ndarray, S: int = 1024):
    """K(x, x) @ V as kv_sym_kernel computes it (one batch member), with the kernel's indices; also returns the
    count of each kind of tile step, for tests that want every kind exercised."""
    n, d = x.shape
    t = V.shape[1]
    assert d <= 8 and t <= 16 and S % BAND == 0
    bands_per, tiles_per = S // BAND, S // TILE
    pitch = S + 8
    w = np.sqrt(np.log2(np.e) / 2) / lengthscale
    z = np.zeros((n, 8))
    z[:, :d] = (x - x.mean(0)) * w
    tiles = -(-n // TILE)
    supers = -(-n // S)
    staged = [stage(z, V, J) for J in range(tiles)]
    out = np.zeros((n, t))
    steps = {"both": 0, "rows": 0}
    seen = set()
    for k in range(supers * (supers + 1) // 2):
        A, C = super_pair(k, supers)
        assert 0 <= A <= C < supers and (A, C) not in seen
        seen.add((A, C))
        col_acc = np.zeros((16, pitch))
        nb = min(bands_per, -(-(n - A * S) // BAND))
        jhi = min((C + 1) * tiles_per, tiles)

        def jlo(bb, A=A, C=C):
            return 2 * (A * bands_per + bb) if A == C else C * tiles_per

        bufs = [jlo(0), None]
        buf = 0
        for bb in range(nb):
            band = A * bands_per + bb
            rows = []  # per warp: operands and accumulators
            for warp in range(WARPS):
                wrow = band * BAND + warp * 16 * MT
                ah, b1, vh = [], [], []
                for mt in range(MT):
                    i = [wrow + 16 * mt + G + 8 * h for h in range(2)]
                    zi = [np.where((ii < n)[:, None], z[np.minimum(ii, n - 1)], 0.0) for ii in i]
                    b1.append([-(zz**2).sum(1) for zz in zi])
                    ah.append([2 * zi[0][LANE, Q], 2 * zi[1][LANE, Q], 2 * zi[0][LANE, Q + 4], 2 * zi[1][LANE, Q + 4]])
                    vmt = []
                    for h in range(2):
                        r0 = wrow + 16 * mt + 8 * h + 2 * Q

                        def vv(r, c):
                            return np.where((r < n) & (c < t), V[np.minimum(r, n - 1), np.minimum(c, t - 1)], 0.0)

                        vmt.append([vv(r0, G), vv(r0, G + 8), vv(r0 + 1, G), vv(r0 + 1, G + 8)])
                    vh.append(vmt)
                rows.append({"wrow": wrow, "ah": ah, "b1": b1, "vh": vh, "acc": np.zeros((MT, NT, 4, 32))})
            for J in range(jlo(bb), jhi):
                same = J + 1 < jhi
                if same or bb + 1 < nb:
                    bufs[buf ^ 1] = J + 1 if same else jlo(bb + 1)
                assert bufs[buf] == J, "the tile in the buffer is not the one the step reads"
                zf, vf, nc = staged[J]
                both = J >= 2 * band + 2
                steps["both" if both else "rows"] += 1
                lc0 = (J - C * tiles_per) * TILE
                for r in rows:
                    for ch in range(8):
                        c0 = 8 * ch + 2 * Q
                        ph = []
                        for mt in range(MT):
                            bias = [r["b1"][mt][0] + nc[c0], r["b1"][mt][0] + nc[c0 + 1]]
                            bias += [r["b1"][mt][1] + nc[c0], r["b1"][mt][1] + nc[c0 + 1]]
                            cross = mma(r["ah"][mt], zf[ch, :, 0], zf[ch, :, 1])
                            e = [cross[u] + bias[u] for u in range(4)]
                            P = [2.0 ** np.minimum(eu, 0.0) for eu in e]
                            ph.append([P[0], P[2], P[1], P[3]])
                            for nt in range(NT):
                                prod = mma(ph[mt], vf[ch, nt, :, 0], vf[ch, nt, :, 1])
                                for u in range(4):
                                    r["acc"][mt, nt, u] += prod[u]
                        if not both:
                            continue
                        sc = np.full(2 * 2 * HALF, np.nan)
                        written = []
                        for mt in range(MT):
                            for u in range(4):
                                h, c, slot = u >> 1, 2 * Q + (u & 1), (u >> 1) | ((u & 1) << 1)
                                addr = (2 * mt + h) * HALF + 16 * c + 8 * (c >> 1) + 2 * G
                                sc[addr], sc[addr + 1] = ph[mt][slot], 0.0
                                written.append(addr)
                        allw = np.concatenate(written)
                        assert len(np.unique(allw)) == allw.size, "two lanes write one scratch pair"
                        cacc = [np.zeros(32) for _ in range(4)]
                        for mt in range(MT):
                            for h in range(2):
                                base = (2 * mt + h) * HALF + 16 * G + 8 * (G >> 1) + 4 * Q
                                wv = [sc[base + o] for o in range(4)]
                                assert not any(np.isnan(x_).any() for x_ in wv), "a lane reads unwritten scratch"
                                prod = mma(r["vh"][mt][h], wv[0], wv[2])
                                for u in range(4):
                                    cacc[u] += prod[u]
                        sw, lc = (G >> 2) & 1, lc0 + 8 * ch + 2 * Q
                        for hr in range(2):
                            va, vb = cacc[2 * hr], cacc[2 * hr + 1]
                            rr = G + 8 * hr
                            for first in (True, False):
                                col = lc + sw if first else lc + 1 - sw
                                val = np.where(sw == 1, vb, va) if first else np.where(sw == 1, va, vb)
                                banks = (rr * pitch + col) % 32
                                assert len(np.unique(banks)) == 32, "an atomic instruction's lanes share a bank"
                                np.add.at(col_acc, (rr, col), val)
                buf ^= 1
            for r in rows:
                for mt in range(MT):
                    for h in range(2):
                        i = r["wrow"] + 16 * mt + G + 8 * h
                        for nt in range(NT):
                            for o in range(2):
                                c = 8 * nt + 2 * Q + o
                                ok = (i < n) & (c < t)
                                np.add.at(out, (i[ok], c[ok]), r["acc"][mt, nt, 2 * h + o][ok])
        e_ = np.arange(16 * S)
        lc, rhs = e_ >> 4, e_ & 15
        j = C * S + lc
        ok = (j < n) & (rhs < t)
        np.add.at(out, (j[ok], rhs[ok]), col_acc[rhs[ok], lc[ok]])
        assert not col_acc[:, S:].any(), "a column sum landed in the padding"
    return s * out, steps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=700)
    ap.add_argument("--t", type=int, default=16)
    ap.add_argument("--d", type=int, default=5)
    ap.add_argument("--super", type=int, default=256, help="super-tile size S (the kernels build 512 and 1024)")
    args = ap.parse_args(argv)
    rng = np.random.default_rng()
    x = rng.standard_normal((args.n, args.d))
    ls = rng.uniform(0.5, 1.5, args.d)
    V = rng.standard_normal((args.n, args.t))
    got, steps = emulate(x, ls, 1.3, V, args.super)
    K = 1.3 * np.exp(-0.5 * (((x[:, None, :] - x[None, :, :]) / ls) ** 2).sum(-1))
    want = K @ V
    err = np.abs(got - want).max() / np.abs(K).sum(1).max()
    print(f"n={args.n} t={args.t} S={args.super}: max error {err:.2e} of max_i sum_j |K_ij|; steps {steps}")


if __name__ == "__main__":
    main()
