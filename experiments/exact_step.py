"""Where the time of one exact (Cholesky) training step goes: the objective of ``ExactGP(solver="cholesky")``
(:mod:`gpfast.estimator.exact_objective`) taken apart, at n points of d features in float64.

    python -m experiments.exact_step --n 44000 --d 20

Parts, each timed alone with CUDA events (median of ``--reps`` after a warm-up; wall time on the CPU): the
covariance (the fused forward), the copy with the noise added, the factorisation, alpha (two triangular solves),
the inverse (:func:`gpfast.models.exact_posterior.inverse_from_cholesky`), the fused backward given the n x n weight
``0.5 (A^-1 - alpha alpha^T)``, and the whole step (loss and gradient through autograd) for comparison with their sum.
Writes experiments/results/exact_step.{md,json}.
"""

from __future__ import annotations

import argparse

import torch

from experiments import RESULTS
from gpfast import ops
from gpfast.bench.report import md_table, write_results
from gpfast.bench.timing import time_ms
from gpfast.estimator.exact_objective import negative_log_likelihood
from gpfast.models.exact_posterior import inverse_from_cholesky


def _factor_parts(X, y, ls, s, noise, device: str, reps: int, add) -> None:
    """Time the parts that need the step's matrices (K, A, L and W, four n x n float64 at once); they are freed
    when this returns."""
    K = ops.rbf_covariance(X, X, ls, s, check_values=False)
    A = K.clone()
    A.diagonal().add_(noise)
    L = torch.linalg.cholesky(A)
    alpha = torch.cholesky_solve(y.reshape(-1, 1), L)
    W = inverse_from_cholesky(L)
    W.addr_(alpha[:, 0], alpha[:, 0], alpha=-1.0).mul_(0.5)
    add(
        "covariance (fused forward)", time_ms(lambda: ops.rbf_covariance(X, X, ls, s, check_values=False), device, reps)
    )
    add("A = K + noise I (copy)", time_ms(lambda: K.clone().diagonal().add_(noise), device, reps))
    add("cholesky", time_ms(lambda: torch.linalg.cholesky_ex(A), device, reps))
    add("alpha (cholesky_solve)", time_ms(lambda: torch.cholesky_solve(y.reshape(-1, 1), L), device, reps))
    add("inverse from the factor", time_ms(lambda: inverse_from_cholesky(L), device, reps))
    add(
        "fused backward (lengthscale, outputscale)",
        time_ms(lambda: ops.rbf_covariance_backward(W, X, X, ls, s, x_grads=False), device, reps),
    )


def parts(n: int, d: int, reps: int, device: str) -> list[dict]:
    f64 = torch.float64
    g = torch.Generator(device=device).manual_seed(0)
    X = torch.randn(n, d, device=device, dtype=f64, generator=g)
    y = torch.randn(n, device=device, dtype=f64, generator=g)
    ls = torch.full((1, d), 0.5 * d**0.5, device=device, dtype=f64)
    s, noise = torch.tensor(1.0, device=device, dtype=f64), torch.tensor(0.05, device=device, dtype=f64)
    rows = []

    def add(part: str, ms: float) -> None:
        rows.append({"n": n, "d": d, "part": part, "ms": ms})
        print(rows[-1], flush=True)

    _factor_parts(X, y, ls, s, noise, device, reps, add)
    if device == "cuda":
        torch.cuda.empty_cache()
    leaves = [t.clone().requires_grad_() for t in (ls, s, noise)]
    zero = torch.zeros((), device=device, dtype=f64)

    def step():
        negative_log_likelihood(X, y, leaves[0], leaves[1], leaves[2], zero).backward()

    add("whole step (loss and gradient)", time_ms(step, device, reps))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=44000)
    ap.add_argument("--d", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--stem", default="exact_step")
    ap.add_argument("--out", default=str(RESULTS), help="output folder (default experiments/results)")
    args = ap.parse_args(argv)
    rows = parts(args.n, args.d, args.reps, args.device)
    whole = rows[-1]["ms"]
    table = md_table(
        ["n", "d", "part", "ms (median)", "share of the whole step"],
        [[r["n"], r["d"], r["part"], f"{r['ms']:.1f}", f"{100 * r['ms'] / whole:.0f}%"] for r in rows],
    )
    print(write_results(args.out, args.stem, "One exact (float64 Cholesky) training step, by part", table, rows))


if __name__ == "__main__":
    main()
