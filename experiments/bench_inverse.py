"""The inverse that the exact (Cholesky) training path needs every step: ``A^{-1}`` from ``L = cholesky(A)``, in
float64, by ``torch.cholesky_inverse`` (on CUDA cuSOLVER's potrs on an identity, 2 n^3 flops) and by
:func:`gpfast.models.exact_posterior.inverse_from_cholesky` (blocks of GEMMs and triangular solves, n^3 flops),
beside the factorisation itself (potrf, n^3 / 3). One exact step costs about potrf + inverse + a fused backward.

    python -m experiments.bench_inverse --sizes 20000 40000 --blocks 1024 2048 4096

A is an RBF covariance of n points (d = 8, lengthscale 1.5) plus 0.01 I, as the exact path builds it. Times are
CUDA-event medians after a warm-up (CPU: wall time); each row gives its rate in TFLOP/s by the flop count above
and its share of the H200's float64 tensor-core peak (67 TFLOP/s, NVIDIA's data sheet), and the largest
difference between the two inverses relative to the largest element. Writes experiments/results/bench_inverse.{md,json}.
"""

from __future__ import annotations

import argparse

import torch

from experiments import RESULTS
from gpfast import ops
from gpfast.bench.report import md_table, write_results
from gpfast.bench.timing import time_ms
from gpfast.models.exact_posterior import inverse_from_cholesky

#: NVIDIA's H200 data sheet: FP64 tensor core, 67 TFLOP/s.
FP64_PEAK = 67e12


def _potrf_ms(L: torch.Tensor, device: str, reps: int) -> float:
    A = L @ L.T  # torch.linalg.cholesky leaves A as it is, so every repetition factors the same matrix
    return time_ms(lambda: torch.linalg.cholesky(A), device, reps)


def bench(n: int, blocks: list[int], reps: int, device: str) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(n)
    x = torch.randn(n, 8, device=device, dtype=torch.float64, generator=g)
    A = ops.rbf_covariance(x, x, torch.full((8,), 1.5, device=device, dtype=torch.float64), 1.0)
    A.diagonal().add_(0.01)
    del x
    L = torch.linalg.cholesky(A)
    del A
    ref = torch.cholesky_inverse(L)
    scale = ref.abs().max()
    rows = []

    def row(method: str, flops: float, ms: float, err: float | None) -> dict:
        rate = flops / (ms / 1e3)
        r = {
            "n": n,
            "method": method,
            "ms": ms,
            "flops": flops,
            "TFLOP_per_s": rate / 1e12,
            "share_of_fp64_peak": rate / FP64_PEAK,
            "max_rel_diff": err,
        }
        print(r, flush=True)
        return r

    rows.append(row("potrf (torch.linalg.cholesky)", n**3 / 3, _potrf_ms(L, device, reps), None))
    # torch.cholesky_inverse: cuSOLVER's potrs on an identity on CUDA (2 n^3), LAPACK's potri on the CPU (2 n^3 / 3)
    flops = 2 * n**3 if device == "cuda" else 2 * n**3 / 3
    rows.append(row("torch.cholesky_inverse", flops, time_ms(lambda: torch.cholesky_inverse(L), device, reps), 0.0))
    for b in blocks:
        W = inverse_from_cholesky(L, block=b)
        err = float((W - ref).abs().max() / scale)
        del W
        ms = time_ms(lambda b=b: inverse_from_cholesky(L, block=b), device, reps)
        rows.append(row(f"inverse_from_cholesky, block {b}", n**3, ms, err))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[20000, 40000])
    ap.add_argument("--blocks", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--stem", default="bench_inverse")
    ap.add_argument("--out", default=str(RESULTS), help="output folder (default experiments/results)")
    args = ap.parse_args(argv)
    rows = []
    for n in args.sizes:
        rows += bench(n, args.blocks, args.reps, args.device)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    table = md_table(
        ["n", "method", "ms (median)", "flops counted", "TFLOP/s", "share of 67 TFLOP/s", "max diff / max |W|"],
        [
            [
                r["n"],
                r["method"],
                f"{r['ms']:.1f}",
                f"{r['flops']:.2e}",
                f"{r['TFLOP_per_s']:.1f}",
                f"{100 * r['share_of_fp64_peak']:.0f}%",
                "-" if r["max_rel_diff"] is None else f"{r['max_rel_diff']:.1e}",
            ]
            for r in rows
        ],
    )
    print(write_results(args.out, args.stem, "float64 inverse from a Cholesky factor", table, rows))


if __name__ == "__main__":
    main()
