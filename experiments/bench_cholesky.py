"""The float64 factorisations around the training engine, each against its plain form:

- **factor**: the exact posterior's Cholesky of ``K + noise I`` (the largest part of a CG fit's time outside its
  steps on the larger UCI sets): ``torch.linalg.cholesky_ex`` (one cuSOLVER call on a GPU, what gpfast uses)
  against :func:`cholesky_blocked` below, a right-looking blocked factorisation whose flops are nearly all GEMMs,
  at several block orders. On an H100 (2026-12-05) it was no faster: 687-709 ms against 700 ms at 44,000 (cuSOLVER
  at 40.6 TFLOP/s, 61% of the FP64 peak, where one float64 GEMM of the gram ran at 53), 87-90 against 75 ms at
  20,000, so gpfast keeps cuSOLVER;
- **gram**: the preconditioner's ``L^T L`` at each rebuild: one GEMM against
  :func:`gpfast.train.preconditioner.gram` (its upper triangle by row blocks) at several block counts.

K is the RBF covariance (lengthscale 1, outputscale 1) of standard normal points in 8 dimensions plus noise 0.01 on
its diagonal; L is a standard normal (n, k) matrix (the gram's time does not depend on its values). Times are
medians by CUDA events after a warm-up (wall clock on the CPU); the rate counts the useful flops (n^3 / 3 for the
factor, n k^2 for the gram: its upper triangle) against the FP64 tensor cores' 67 TFLOP/s (H100 SXM and H200,
NVIDIA's datasheets). ``max |L L^T - A| / max |A|`` of each factor (over 256 random rows) is listed beside its time.

    python -m experiments.bench_cholesky                               # on a GPU: n 20,000 and 44,000
    python -m experiments.bench_cholesky --n 600 --blocks 64 128 --gram-n 2000 --ranks 128 --device cpu

Writes ``<stem>.{md,json}`` in ``--out`` (default experiments/results), naming the machine, date and commit.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from experiments import RESULTS
from gpfast import ops
from gpfast.bench.report import md_table, write_results
from gpfast.bench.timing import time_ms
from gpfast.train.preconditioner import gram

#: FP64 tensor-core peak of the H100 SXM and the H200 (NVIDIA's datasheets), TFLOP/s.
FP64_PEAK = 67.0
F64 = torch.float64


def cholesky_blocked(A: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """``(L, info)`` as ``torch.linalg.cholesky_ex(A)`` (A's lower triangle read; A left as it was), right-looking by
    blocks: each diagonal block's factor D (``cholesky_ex``), the panel below it ``X = A21 D^{-T}`` (a triangular
    solve) and the trailing lower triangle less ``X X^T``, one GEMM a block column, so that all but O(n^2 block)
    of the n^3 / 3 flops are GEMMs of at least ``block`` square. ``info``: 0, or the order of the first leading
    minor found not positive definite (the factorisation stops there, one wait a block)."""
    n = A.shape[0]
    L = A.clone()
    for j0 in range(0, n, block):
        j1 = min(j0 + block, n)
        D, info = torch.linalg.cholesky_ex(L[j0:j1, j0:j1])
        if int(info):
            return L.tril_(), j0 + int(info)
        L[j0:j1, j0:j1] = D
        if j1 == n:
            break
        X = torch.linalg.solve_triangular(D.mT, L[j1:, j0:j1], upper=True, left=False)
        L[j1:, j0:j1] = X
        for i0 in range(j1, n, block):
            i1 = min(i0 + block, n)
            L[i0:, i0:i1].addmm_(X[i0 - j1 :], X[i0 - j1 : i1 - j1].mT, alpha=-1.0)
    return L.tril_(), 0


def _covariance(n: int, device) -> torch.Tensor:
    X = torch.randn(n, 8, dtype=F64, device=device)
    A = ops.rbf_covariance(X, X, torch.ones(8, dtype=F64, device=device), 1.0)
    A.diagonal().add_(0.01)
    return A


def _residual(A: torch.Tensor, L: torch.Tensor, rows: int = 256) -> float:
    """max |L L^T - A| / max |A| over ``rows`` random rows (all of them would cost twice the factorisation)."""
    idx = torch.randperm(A.shape[0], device=A.device)[:rows]
    return float((L[idx] @ L.T - A[idx]).abs().max() / A.abs().max())


def factor_rows(sizes, blocks, reps, device) -> list[dict]:
    rows = []
    for n in sizes:
        A = _covariance(n, device)
        flops = n**3 / 3
        variants = [("cholesky_ex", lambda A=A: torch.linalg.cholesky_ex(A)[0])]
        variants += [(f"blocked {b}", lambda A=A, b=b: cholesky_blocked(A, b)[0]) for b in blocks if b < n]
        for name, fn in variants:
            ms = time_ms(fn, device, reps=reps, warmup=1)
            L = fn()
            rows.append({"n": n, "variant": name, "ms": ms, "tflops": flops / ms / 1e9,
                         "of_peak": flops / ms / 1e9 / FP64_PEAK, "residual": _residual(A, L)})  # fmt: skip
            del L
            print(rows[-1], flush=True)
        del A
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return rows


def gram_rows(n: int, ranks, counts, reps, device) -> list[dict]:
    rows = []
    for k in ranks:
        L = torch.randn(n, k, dtype=F64, device=device)
        G0 = L.t() @ L
        flops = n * k * k  # the upper triangle's: half of the whole product's 2 n k^2
        for q in counts:
            ms = time_ms(lambda q=q: gram(L, q), device, reps=reps, warmup=2)
            err = float((gram(L, q) - G0).abs().max() / G0.abs().max())
            used = max(1, min(q, k // 64))  # gram's cap: at least 64 columns a block
            rows.append({"n": n, "k": k, "blocks": used, "ms": ms, "tflops": flops / ms / 1e9,
                         "of_peak": flops / ms / 1e9 / FP64_PEAK, "vs_one_gemm": err})  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[20000, 44000], help="orders of the factor")
    ap.add_argument("--blocks", type=int, nargs="+", default=[1024, 2048, 4096], help="cholesky_blocked's blocks")
    ap.add_argument("--gram-n", type=int, default=44000, help="rows of the gram's factor")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1600, 3200])
    ap.add_argument("--gram-blocks", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--stem", default="bench_cholesky")
    args = ap.parse_args(argv)
    gram_part = gram_rows(args.gram_n, args.ranks, args.gram_blocks, max(args.reps, 5), args.device)
    factor_part = factor_rows(args.n, args.blocks, args.reps, args.device)

    def f(v, p=2):
        return f"{v:.{p}f}"

    t1 = md_table(
        ["n", "variant", "ms", "TFLOP/s", "of FP64 peak", "max abs(LL^T - A) / max abs(A)"],
        [[r["n"], r["variant"], f(r["ms"], 1), f(r["tflops"], 1), f"{100 * r['of_peak']:.0f}%",
          f"{r['residual']:.1e}"] for r in factor_part],
    )  # fmt: skip
    t2 = md_table(
        ["n", "k", "blocks", "ms", "TFLOP/s (upper triangle)", "of FP64 peak", "max diff / max (vs one GEMM)"],
        [[r["n"], r["k"], r["blocks"], f(r["ms"]), f(r["tflops"], 1), f"{100 * r['of_peak']:.0f}%",
          f"{r['vs_one_gemm']:.1e}"] for r in gram_part],
    )  # fmt: skip
    text = write_results(
        args.out,
        args.stem,
        f"float64 factorisations ({args.device}): the posterior's Cholesky and the preconditioner's gram",
        "Medians of " + str(args.reps) + " (gram: " + str(max(args.reps, 5)) + ") after a warm-up, CUDA events on a "
        "GPU. Rates count the useful flops (n^3 / 3; n k^2) against 67 TFLOP/s.\n\n## Cholesky of K + 0.01 I\n\n"
        + t1
        + "\n\n## gram L^T L\n\n"
        + t2,
        factor_part + gram_part,
        device=args.device,
    )
    print(text)


if __name__ == "__main__":
    main()
