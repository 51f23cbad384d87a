"""The arithmetic of the tensor-core (lengthscale, outputscale) backward (csrc/cuda/backward_bilinear.cuh),
emulated on the CPU, against the accuracy rule of the CUDA tests: error against float64 at most 4x the plain float32
formula's + 1e-6, for both gradients, on the shapes and draws of tests/test_cuda_kernels.py.

    python -m experiments.bilinear_emulation [--draws 3]

Four arithmetics are compared. ``kernel`` (the kernel's): z = (x - mu) / l, the exponent, its exponential,
M = W E, P = M Z, R = M (Z o Z) and every sum in double; only the weights W = G V^T are float32, as 3xTF32 products
(operands split hi + lo, rounded to nearest, the small products first, each k-step of 8 rounded into a float32
accumulator). ``mufu``: the same with E rounded to float32 with a relative error uniform within 2 ulp (the
special-function unit's exponential). ``mz32``: the kernel's exponent, but M = W E in float32 and P, R as 3xTF32
products over tiles of 32 columns, folded in float32. ``expansion32``: as ``mz32`` with z rounded to float32 and the
exponent's cross term 3xTF32, its norms and additions and the exponential in float32. Rows in blocks of 64, centred
on their mean. Not emulated: the tensor cores' own rounding of a k-step's sum.
Prints the draws above half the bound and the worst ratio; writes experiments/results/bilinear_emulation.md.
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch

from experiments import RESULTS
from gpfast import _reference as ref
from gpfast.bench.report import md_table, write_results

F32, F64 = torch.float32, torch.float64
SHAPES = [(129, 1000), (70, 90), (300, 33)]
FEATURES = [1, 3, 8, 20, 26, 32]
COLUMNS = [1, 11, 17]


def tf32(x: torch.Tensor) -> torch.Tensor:
    """Rounded to TF32 (10 fraction bits), to nearest with ties away from zero, as cvt.rna.tf32.f32."""
    bits = (x.contiguous().view(torch.int32) + 0x1000) & ~0x1FFF
    return bits.view(F32)


def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hi = tf32(x)
    return hi, tf32(x - hi)


def mma_3xtf32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (r, k) @ b (k, c) as the kernel's 3xTF32 MMAs: per k-step of 8 the three products, each summed exactly
    and rounded into float32 accumulators (large and small apart, added at the end)."""
    (ah, al), (bh, bl) = split(a), split(b)
    big = torch.zeros(a.shape[0], b.shape[1], dtype=F32)
    small = torch.zeros_like(big)
    for k in range(0, a.shape[1], 8):
        s = slice(k, k + 8)
        small = (small.double() + al[:, s].double() @ bh[s].double()).float()
        small = (small.double() + ah[:, s].double() @ bl[s].double()).float()
        big = (big.double() + ah[:, s].double() @ bh[s].double()).float()
    return big + small


def kernel_values(zr: torch.Tensor, zc: torch.Tensor, mode: str, gen: torch.Generator) -> torch.Tensor:
    """E = K / s (double) from double points (rows zr, columns zc), as the arithmetic ``mode`` forms it."""
    if mode == "expansion32":
        yr, yc = zr.float(), zc.float()
        q = (mma_3xtf32(2 * yr, yc.T.contiguous()) - (yr * yr).sum(1, keepdim=True)) - (yc * yc).sum(1)
        return torch.exp2(q.clamp(max=0) * torch.tensor(0.5 * math.log2(math.e), dtype=F32)).double()
    q = 2 * zr @ zc.T - (zr * zr).sum(1, keepdim=True) - (zc * zc).sum(1)
    E = torch.exp(0.5 * q.clamp(max=0))
    if mode == "mufu":
        noise = (2 * torch.rand(E.shape, generator=gen, dtype=F64) - 1) * 2.0**-22
        E = (E * (1 + noise)).float().double()
    return E


def emulated_grads(x1, x2, l, s, g, v, mode: str, gen: torch.Generator, rows: int = 64, tile: int = 32):
    """The lengthscale (d,) and outputscale () gradients as the arithmetic ``mode`` forms them."""
    d = x1.shape[1]
    gl, gs = torch.zeros(d, dtype=F64), torch.zeros((), dtype=F64)
    for r0 in range(0, x1.shape[0], rows):
        xr = x1[r0 : r0 + rows].double()
        mu = xr.mean(0)
        zr, zc = (xr - mu) / l.double(), (x2.double() - mu) / l.double()
        for j0 in range(0, x2.shape[0], tile):
            zj = zc[j0 : j0 + tile]
            W = mma_3xtf32(g[r0 : r0 + rows], v[j0 : j0 + tile].T.contiguous())
            M = W.double() * kernel_values(zr, zj, mode, gen)
            if mode in ("kernel", "mufu"):
                P, R, r = M @ zj, M @ (zj * zj), M.sum(1)
                gl += ((r[:, None] * zr - 2 * P) * zr + R).sum(0)
            else:
                M, zrf, zjf = M.float(), zr.float(), zj.float()
                acc = mma_3xtf32(M, torch.cat([zjf, zjf * zjf], 1))
                P, R, r = acc[:, :d], acc[:, d:], M.sum(1)
                gl += ((r[:, None] * zrf - 2 * P) * zrf + R).double().sum(0)
            gs += r.double().sum()
    return gl * s.double() / l.double(), gs


def draw_inputs(n, m, d, t, shift, gen):
    x1 = torch.randn(n, d, generator=gen) + shift
    x2 = torch.randn(m, d, generator=gen) + shift
    l = (torch.rand(d, generator=gen) * 1.5 + 0.5) * max(1.0, (d / 8) ** 0.5)
    s = torch.rand((), generator=gen) + 0.5
    return x1, x2, l, s, torch.randn(m, t, generator=gen), torch.randn(n, t, generator=gen)


def plain_and_reference(x1, x2, l, s, v, g):
    def grads(args, weight):
        args = [a.detach().clone().requires_grad_() for a in args]
        (ref.rbf_matmul(*args) * weight).sum().backward()
        return args[2].grad, args[3].grad

    return grads((x1, x2, l, s, v), g), grads([a.double() for a in (x1, x2, l, s, v)], g.double())


def rel(a, b) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--draws", type=int, default=3, help="draws per shape (odd ones shifted by 10)")
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(1)
    modes = ("kernel", "mufu", "mz32", "expansion32")
    worst = {mode: [0.0, 0.0] for mode in modes}
    fails = {mode: 0 for mode in modes}
    noise = torch.Generator().manual_seed(2)
    count = 0
    for (n, m), d, t, draw in itertools.product(SHAPES, FEATURES, COLUMNS, range(args.draws)):
        x1, x2, l, s, v, g = draw_inputs(n, m, d, t, 10.0 * (draw % 2), gen)
        plain, want = plain_and_reference(x1, x2, l, s, v, g)
        count += 1
        for mode in worst:
            got = emulated_grads(x1, x2, l, s, g, v, mode, noise)
            ratios = [rel(a, w) / (4 * rel(p, w) + 1e-6) for a, w, p in zip(got, want, plain)]
            worst[mode] = [max(a, b) for a, b in zip(worst[mode], ratios)]
            fails[mode] += max(ratios) > 1
            if max(ratios) > 0.5:
                print(mode, (n, m, d, t, draw), [f"{q:.2f}" for q in ratios], flush=True)
    rows = [
        {"exponent": k, "draws": count, "fail": fails[k], "worst_l": w[0], "worst_s": w[1]} for k, w in worst.items()
    ]
    table = md_table(
        ["exponent", "draws", "draws over the bound", "worst error / bound, lengthscale", "worst, outputscale"],
        [[r["exponent"], r["draws"], r["fail"], f"{r['worst_l']:.2f}", f"{r['worst_s']:.2f}"] for r in rows],
    )
    title = "Emulated accuracy of the tensor-core (lengthscale, outputscale) backward against the CUDA tests' rule"
    print(write_results(RESULTS, "bilinear_emulation", title, table, rows, draws=args.draws))


if __name__ == "__main__":
    main()
