"""How far the tensor-core (lengthscale, outputscale) backward of K @ V sits from the CUDA tests' accuracy rule, on
many fresh draws of the mask test's case (n = 300, m = 700, d = 9), next to the float64 row pass.

    python -m experiments.bilinear_rule_probe [--draws 400] [--columns 8 11 16 17]

Per draw and gradient: the error against float64 of the tensor-core kernel (``bilinear4``, what float32 takes
without point gradients), of the row pass, of the plain float32 formula, and of the float64 formula with W = G V^T
formed by the kernel's 3xTF32 MMAs (emulated on the CPU, experiments/bilinear_emulation.py). Three bounds: the rule,
4x plain + 1e-6; the rule with "plain" the worse of plain float32 and the emulated 3xTF32 formula; and the CUDA
tests' rule, which adds to the outputscale's bound 2^-18 sqrt(t) sigma / |S|, sigma = sqrt(sum_ij (K_ij / s)^2
sum_k g_ik^2 v_jk^2) the size of the rounding that float32 weights put into S (tests/test_cuda_kernels.py,
outputscale_error_scale). Writes experiments/results/bilinear_rule_probe.{md,json}: draws over each bound (either
kernel) and the worst ratios.
"""

from __future__ import annotations

import argparse

import torch

from experiments import RESULTS
from experiments.bilinear_emulation import mma_3xtf32
from gpfast import ops
from gpfast.bench.report import md_table, write_results

NAMES = ("lengthscale", "outputscale")


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def theta(g, x1, x2, l, s, v, w=None, rows=100):
    """The (lengthscale, outputscale) gradients of sum(g * (K v)) by their definition, in the inputs' dtype (W =
    g v^T, or w)."""
    z1, z2 = x1 / l, x2 / l
    gl, gs = torch.zeros_like(l), torch.zeros_like(s)
    for i in range(0, x1.shape[0], rows):
        diff2 = (z1[i : i + rows, None, :] - z2[None]).pow(2)
        Wb = g[i : i + rows] @ v.T if w is None else w[i : i + rows]
        WK = Wb * torch.exp(-0.5 * diff2.sum(-1))
        gs += WK.sum()
        gl += s * (WK[..., None] * diff2).sum((0, 1)) / l
    return gl, gs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=400)
    parser.add_argument("--columns", type=int, nargs="+", default=[8, 11, 16, 17])
    args = parser.parse_args(argv)
    ops._ensure_loaded()
    n, m, d = 300, 700, 9
    rows = []
    for t in args.columns:
        stats = {"over_rule": 0, "over_split_rule": 0, "rows_over_rule": 0, "worst_rule": 0.0, "worst_split": 0.0}
        stats["worst_rows"] = 0.0
        stats["over_tests_rule"], stats["worst_tests_rule"] = 0, 0.0
        for draw in range(args.draws):
            x1, x2 = torch.randn(n, d, device="cuda"), torch.randn(m, d, device="cuda")
            l = (torch.rand(d, device="cuda") * 1.5 + 0.5) * (d / 8) ** 0.5
            s = torch.rand((), device="cuda") + 0.5
            v, g = torch.randn(m, t, device="cuda"), torch.randn(n, t, device="cuda")
            tc = ops._rbf_matmul_backward_kernel(g, x1, x2, l, s, v, "bilinear4")
            rp = ops._rbf_matmul_backward_kernel(g, x1, x2, l, s, v, "rows")
            args64 = [a.double() for a in (g, x1, x2, l, s, v)]
            want = theta(*args64)
            plain = theta(g, x1, x2, l, s, v)
            w = mma_3xtf32(g.cpu(), v.cpu().T.contiguous()).to("cuda", torch.float64)
            split = theta(*args64, w=w)
            ratios = []
            z1, z2 = args64[1] / args64[3], args64[2] / args64[3]
            q2 = (z1[:, None, :] - z2[None]).pow(2).sum(-1)
            sigma = (torch.exp(-q2) * (args64[0] ** 2 @ (args64[5] ** 2).T)).sum().sqrt().item()
            extras = (0.0, 2**-18 * t**0.5 * sigma / abs(want[1].item()))
            for a, b, r, p, q, extra in zip(tc, rp, want, plain, split, extras):
                rule = 4 * rel(p, r) + 1e-6
                split_rule = 4 * max(rel(p, r), rel(q, r)) + 1e-6
                ratios.append((rel(a, r) / rule, rel(a, r) / split_rule, rel(b, r) / rule))
                worst = max(rel(a, r), rel(b, r)) / (rule + extra)
                stats["worst_tests_rule"] = max(stats["worst_tests_rule"], worst)
                stats["over_tests_rule"] += worst > 1
            stats["over_rule"] += max(x[0] for x in ratios) > 1
            stats["over_split_rule"] += max(x[1] for x in ratios) > 1
            stats["rows_over_rule"] += max(x[2] for x in ratios) > 1
            stats["worst_rule"] = max(stats["worst_rule"], *(x[0] for x in ratios))
            stats["worst_split"] = max(stats["worst_split"], *(x[1] for x in ratios))
            stats["worst_rows"] = max(stats["worst_rows"], *(x[2] for x in ratios))
            if max(x[0] for x in ratios) > 1:
                print(t, draw, [f"{x[0]:.2f}/{x[1]:.2f}" for x in ratios], flush=True)
        rows.append({"t": t, "draws": args.draws, **stats})
        print(rows[-1], flush=True)
    table = md_table(
        [
            "t",
            "draws",
            "tensor cores over the rule",
            "over the rule with the 3xTF32 formula",
            "row pass over the rule",
            "worst / rule",
            "worst / rule with 3xTF32",
            "row pass worst / rule",
            "either over the tests' rule",
            "worst / tests' rule",
        ],
        [
            [r["t"], r["draws"], r["over_rule"], r["over_split_rule"], r["rows_over_rule"]]
            + [f"{r[k]:.3g}" for k in ("worst_rule", "worst_split", "worst_rows")]
            + [r["over_tests_rule"], f"{r['worst_tests_rule']:.3g}"]
            for r in rows
        ],
    )
    title = "The tensor-core (lengthscale, outputscale) backward against the accuracy rule (n = 300, m = 700, d = 9)"
    print(write_results(RESULTS, "bilinear_rule_probe", title, table, rows, draws=args.draws))


if __name__ == "__main__":
    main()
