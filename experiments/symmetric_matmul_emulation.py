"""The symmetric stored product's kernel (csrc/cuda/symmetric_matmul.cuh) emulated on the CPU, lane by lane: its
copies into swizzled shared memory, the pipeline's buffers, the MMA fragments of both roles, the column partials'
scratch and fixed-order sums, the output slots and the final sum, so that its index arithmetic is tested where there
is no GPU (tests/test_symmetric_matmul.py runs it against K @ V in float64).

    python -m experiments.symmetric_matmul_emulation [--n 1000] [--t 11] [--block 256] [--grid 5] [--tf32]

Arithmetic: exact (float64, the default: any difference from K @ V is an indexing error), or with ``--tf32`` the
kernel's: operands split hi + lo (hi rounded half up to TF32, lo truncated to TF32 as the tensor cores read it),
three products a k-step each summed exactly and rounded into float32 accumulators. Not emulated: the tensor cores'
own rounding of a k-step's sum, and timing (the stages run in program order, which is what the barriers enforce).
"""

from __future__ import annotations

import argparse

import numpy as np

WARPS, THREADS, ROWS, COLS = 8, 256, 128, 64
LANE = np.arange(32)
G, T4 = LANE >> 2, LANE & 3


def stages_for(S: int) -> int:
    return 3 if S >= 1024 else 4


def swz(r):
    return ((r & 1) << 2) | (r & 2)


def _tf32_half_up(x: np.ndarray) -> np.ndarray:
    bits = (x.astype(np.float32).view(np.uint32) + np.uint32(0x1000)) & np.uint32(0xFFFFE000)
    return bits.view(np.float32)


def _tf32_trunc(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


class Arith:
    """mma3 on lane registers: exact in float64, or the kernel's 3xTF32 rounding into float32 accumulators."""

    def __init__(self, tf32: bool):
        self.tf32 = tf32

    def split(self, x):
        if not self.tf32:
            return np.asarray(x, np.float64), np.zeros(32)
        hi = _tf32_half_up(x)
        return hi.astype(np.float64), _tf32_trunc(np.float32(x) - hi).astype(np.float64)

    @staticmethod
    def _mma(c, a, b0, b1):
        A = np.zeros((16, 8))
        A[G, T4], A[G + 8, T4], A[G, T4 + 4], A[G + 8, T4 + 4] = a
        B = np.zeros((8, 8))
        B[T4, G], B[T4 + 4, G] = b0, b1
        C = A @ B
        return [C[G, 2 * T4], C[G, 2 * T4 + 1], C[G + 8, 2 * T4], C[G + 8, 2 * T4 + 1]]

    def mma3(self, c, ah, al, bh0, bh1, bl0, bl1):
        for a, b0, b1 in ((al, bh0, bh1), (ah, bl0, bl1), (ah, bh0, bh1)):
            add = self._mma(c, a, b0, b1)
            for k in range(4):
                c[k] = c[k] + add[k]
                if self.tf32:
                    c[k] = c[k].astype(np.float32).astype(np.float64)


class Cursor:
    def __init__(self, u: int, ns: int):
        self.A = 0
        while u >= ns - self.A:
            u -= ns - self.A
            self.A += 1
        self.B = self.A + u

    def next(self, ns: int):
        self.B += 1
        if self.B == ns:
            self.A += 1
            self.B = self.A


def emulate(K: np.ndarray, V: np.ndarray, S: int, grid: int, tf32: bool = False, stages: int = 0) -> np.ndarray:
    """K @ V as the kernel computes it, K (n, n) symmetric (only its block upper triangle is read), V (n, t);
    ``stages`` copies in flight (0: the super-tile's default)."""
    n, t = V.shape
    ns = -(-n // S)
    tiles = ns * (ns + 1) // 2
    grid = min(grid, tiles)
    part = np.full((ns, ns, S, t), np.nan)  # poisoned: a slot never written shows in the sum
    ar = Arith(tf32)
    nst, NB, NCS = stages or stages_for(S), S // ROWS, S // COLS
    SPT = NB * NCS
    Kp = np.full((n + S, n + S), np.nan)  # the copies read only inside K: a read past n would show as a NaN
    Kp[:n, :n] = K
    for blk in range(grid):
        u_begin, u_end = blk * tiles // grid, (blk + 1) * tiles // grid
        my_stages = (u_end - u_begin) * SPT
        sK = np.full((nst, ROWS * COLS), np.nan)
        sV = np.zeros((16, S + 16))
        scr = np.full((2, WARPS * 512), np.nan)
        sYI = np.full(4 * 512, np.nan)
        loader = {"lc": Cursor(u_begin, ns), "ls": 0, "lst": 0}

        def issue():
            lc = loader["lc"]
            if loader["ls"] < my_stages:
                b, cs = divmod(loader["lst"], NCS)
                row0, col0 = lc.A * S + b * ROWS, lc.B * S + cs * COLS
                dst = sK[loader["ls"] % nst]
                for e in range(ROWS * COLS // 4):
                    r, ch = e >> 4, e & 15
                    row, col = row0 + r, col0 + 4 * ch
                    left = (n - col) * 4 if row < n else 0
                    nbytes = max(0, min(16, left))
                    vals = np.zeros(4)
                    vals[: nbytes // 4] = Kp[row, col : col + nbytes // 4]
                    pos = r * COLS + ((ch ^ swz(r)) << 2)
                    dst[pos : pos + 4] = vals
                loader["lst"] += 1
                if loader["lst"] == SPT:
                    loader["lst"] = 0
                    lc.next(ns)
            loader["ls"] += 1

        for _ in range(nst - 1):
            issue()
        cc = Cursor(u_begin, ns)
        gs = 0
        tid = np.arange(THREADS)
        for _u in range(u_begin, u_end):
            diag = cc.A == cc.B
            R0, C0 = cc.A * S, cc.B * S
            sV[:, :] = 0.0
            for c in range(S):
                if C0 + c < n:
                    sV[:t, c] = V[C0 + c]
            acc = np.zeros((NCS, 4, THREADS))

            def reduce(cs_dst, frm):
                src = scr[frm & 1]
                for k in range(4):
                    idx = tid + k * THREADS
                    c, rem = idx >> 9, idx & 511
                    s = np.zeros(THREADS)
                    for w in range(4):
                        s = s + src[(2 * w + c) * 512 + rem]
                    acc[cs_dst, k] += s

            for b in range(NB):
                band0 = R0 + b * ROWS
                vi = {}
                if not diag:
                    for w in range(WARPS):
                        wr = w >> 1
                        for s in range(4):
                            regs = []
                            for k in range(4):
                                row = band0 + 32 * wr + 8 * s + T4 + 4 * (k >> 1)
                                rhs = G + 8 * (k & 1)
                                ok = (row < n) & (rhs < t)
                                v = np.where(ok, V[np.minimum(row, n - 1), np.minimum(rhs, t - 1)], 0.0)
                                regs.append(ar.split(v))
                            vi[w, s] = ([r[0] for r in regs], [r[1] for r in regs])
                yi = {w: np.zeros((2, 2, 4, 32)) for w in range(WARPS)}
                for cs in range(NCS):
                    issue()
                    if not diag and (cs > 0 or b > 0):
                        reduce(cs - 1 if cs > 0 else NCS - 1, gs - 1)
                    sk = sK[gs % nst]
                    for w in range(WARPS):
                        wr, wc = w >> 1, w & 1
                        for q in range(2):
                            chunk = 8 * wc + 4 * q + T4
                            vc = cs * COLS + 32 * wc + 16 * q + 4 * T4
                            va = np.stack([sV[G, vc + i] for i in range(4)])
                            vb = np.stack([sV[G + 8, vc + i] for i in range(4)])
                            bsplit = [[ar.split(vv[i]) for i in range(4)] for vv in (va, vb)]
                            for mt in range(2):
                                r = 32 * wr + 16 * mt + G
                                off = (chunk ^ swz(r)) << 2
                                ka = np.stack([sk[r * COLS + off + i] for i in range(4)])
                                kb = np.stack([sk[(r + 8) * COLS + off + i] for i in range(4)])
                                for p in range(2):
                                    parts = [ar.split(x) for x in (ka[2 * p], kb[2 * p], ka[2 * p + 1], kb[2 * p + 1])]
                                    ah, al = [x[0] for x in parts], [x[1] for x in parts]
                                    for nt in range(2):
                                        (bh0, bl0), (bh1, bl1) = bsplit[nt][2 * p], bsplit[nt][2 * p + 1]
                                        c = list(yi[w][mt, nt])
                                        ar.mma3(c, ah, al, bh0, bh1, bl0, bl1)
                                        yi[w][mt, nt] = np.stack(c)
                        if not diag:
                            yj = [[np.zeros(32) for _ in range(4)] for _ in range(4)]
                            for s in range(4):
                                r = 32 * wr + 8 * s + T4
                                off = ((8 * wc + G) ^ swz(r)) << 2
                                k0 = np.stack([sk[r * COLS + off + i] for i in range(4)])
                                k1 = np.stack([sk[(r + 4) * COLS + off + i] for i in range(4)])
                                vih, vil = vi[w, s]
                                for e in range(4):
                                    (h0, l0), (h1, l1) = ar.split(k0[e]), ar.split(k1[e])
                                    ar.mma3(yj[e], vih, vil, h0, h1, l0, l1)
                            for e in range(4):
                                for k in range(4):
                                    scr[gs & 1, w * 512 + (4 * e + k) * 32 + LANE] = yj[e][k]
                    gs += 1
                for w in range(WARPS):
                    wr, wc = w >> 1, w & 1
                    if wc == 1:
                        for mt in range(2):
                            for nt in range(2):
                                for k in range(4):
                                    sYI[wr * 512 + ((2 * mt + nt) * 4 + k) * 32 + LANE] = yi[w][mt, nt, k]
                for w in range(WARPS):
                    wr, wc = w >> 1, w & 1
                    if wc == 0:
                        for mt in range(2):
                            for nt in range(2):
                                for k in range(4):
                                    r = 32 * wr + 16 * mt + G + 8 * (k >> 1)
                                    rhs = 8 * nt + 2 * T4 + (k & 1)
                                    v = yi[w][mt, nt, k] + sYI[wr * 512 + ((2 * mt + nt) * 4 + k) * 32 + LANE]
                                    ok = rhs < t
                                    part[cc.A, cc.B, b * ROWS + r[ok], rhs[ok]] = v[ok]
            if not diag:
                reduce(NCS - 1, gs - 1)
                for cs in range(NCS):
                    for k in range(4):
                        idx = tid + k * THREADS
                        c, rem = idx >> 9, idx & 511
                        reg, ln = rem >> 5, rem & 31
                        e, f = reg >> 2, reg & 3
                        rhs = (ln >> 2) + 8 * (f >> 1)
                        nn = 2 * (ln & 3) + (f & 1)
                        col = cs * COLS + 32 * c + 4 * nn + e
                        ok = rhs < t
                        part[cc.B, cc.A, col[ok], rhs[ok]] = acc[cs, k][ok]
            cc.next(ns)
    out = np.zeros((n, t))
    for i in range(n):
        A = i // S
        out[i] = part[A, :, i - A * S, :].sum(0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--t", type=int, default=11)
    ap.add_argument("--block", type=int, default=256, choices=(256, 512, 1024))
    ap.add_argument("--grid", type=int, default=5)
    ap.add_argument("--tf32", action="store_true")
    args = ap.parse_args()
    rng = np.random.default_rng()
    x = rng.standard_normal((args.n, 3))
    K = np.exp(-0.5 * ((x[:, None, :] - x[None, :, :]) ** 2).sum(-1))
    V = rng.standard_normal((args.n, args.t))
    if args.tf32:
        K, V = K.astype(np.float32).astype(np.float64), V.astype(np.float32).astype(np.float64)
    got = emulate(K, V, args.block, args.grid, args.tf32)
    want = K @ V
    scale = np.abs(K) @ np.abs(V)
    print(f"max |error| / (|K| |V|): {np.max(np.abs(got - want) / scale):.3e}")


if __name__ == "__main__":
    main()
