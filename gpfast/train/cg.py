"""Batched preconditioned conjugate gradients with warm starts, a relative-residual tolerance and a cap.

Every column of B is its own CG run (Saad, Iterative Methods, Alg. 9.1), but all columns share each product with
A, so a step of the engine costs one product of K̂ with an (n, 1 + s) block per iteration. The solve stops when
the relative residuals ``|b - A x| / |b|`` of the columns, summarised by ``measure`` (default: the largest), are at
most ``tol``, or after ``max_iter`` iterations. Reading that number on the host makes a GPU wait for the device, so
``check_at`` can name the few iterations at which it is read; in between the iterations go on unchecked (a column
that has converged is frozen on the device and costs nothing but its share of the product). A column
is frozen (its step size set to zero) once it has converged far below ``tol`` or when its curvature ``p^T A p``
is not positive (a numerically indefinite K̂ in float32), so finished columns cannot break down while the others
go on.

Columns started from x0 = 0 also yield their Lanczos tridiagonal matrices from the CG coefficients (Saad, Sec.
6.7.3), which :mod:`gpfast.train.logdet` turns into a stochastic-Lanczos log-determinant.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["CGResult", "pcg"]


@dataclass
class CGResult:
    """What :func:`pcg` returns.

    x: (n, t) solutions; residual: (n, t) the recursively updated ``b - A x``; rel_residual: (t,) its column norms
    over ``|b|``; iterations: CG iterations (products with A inside the loop); products: all products with A
    (iterations, plus one for the initial residual when a warm start was given); alphas, betas: per iteration,
    the (t,) step and direction coefficients (zero for frozen columns), for the Lanczos matrices; broke_down:
    columns frozen for non-positive curvature.
    """

    x: torch.Tensor
    residual: torch.Tensor
    rel_residual: torch.Tensor
    iterations: int
    products: int
    alphas: list[torch.Tensor]
    betas: list[torch.Tensor]
    broke_down: torch.Tensor


def pcg(
    matmul: Callable[[torch.Tensor], torch.Tensor],
    B: torch.Tensor,
    precond: Callable[[torch.Tensor], torch.Tensor],
    x0: torch.Tensor | None = None,
    warm: Sequence[int] | None = None,
    tol: float = 0.01,
    max_iter: int = 15,
    freeze_rtol: float | None = None,
    measure: Callable[[torch.Tensor], torch.Tensor] | None = None,
    check_at: Sequence[int] | None = None,
) -> CGResult:
    """Solve ``A X = B`` column by column with preconditioner ``precond`` (applies P^{-1}).

    x0: initial guesses (n, t), or None for zeros; warm: the columns of x0 that are not zero (only those enter
    the initial-residual product; default all when x0 is given). freeze_rtol: relative residual below which a
    column stops updating (default ``1e-3 * tol``, at least 100 machine epsilons). measure: maps the (t,) relative
    residuals to the 0-dim number compared with ``tol`` (default: their maximum). check_at: the iteration counts
    (0: the start) after which that number is read on the host to stop early (default: every one, 0 to max_iter - 1;
    an empty list runs max_iter iterations with no host read).
    """
    measure = measure or (lambda rel: rel.max())
    eps = torch.finfo(B.dtype).eps
    freeze = max(1e-3 * tol, 100 * eps) if freeze_rtol is None else freeze_rtol
    b_norm = torch.linalg.vector_norm(B, dim=0).clamp_min(torch.finfo(B.dtype).tiny)
    products = 0
    if x0 is None:
        X = torch.zeros_like(B)
        R = B.clone()
    else:
        X = x0.clone()
        cols = list(range(B.shape[1])) if warm is None else list(warm)
        R = B.clone()
        if cols:
            idx = torch.tensor(cols, device=B.device)
            R[:, cols] -= matmul(X.index_select(1, idx))
            products += 1
    rel = torch.linalg.vector_norm(R, dim=0) / b_norm
    alphas: list[torch.Tensor] = []
    betas: list[torch.Tensor] = []
    broke = torch.zeros(B.shape[1], dtype=torch.bool, device=B.device)
    iterations = 0
    checks = set(range(max_iter)) if check_at is None else set(check_at)
    if max_iter <= 0 or (0 in checks and bool(measure(rel) <= tol)):
        return CGResult(X, R, rel, 0, products, alphas, betas, broke)
    active = rel > freeze
    Zp = precond(R)
    P = Zp.clone()
    rz = (R * Zp).sum(0)
    for _ in range(max_iter):
        AP = matmul(P)
        products += 1
        iterations += 1
        pAp = (P * AP).sum(0)
        broke |= active & ~(pAp > 0)
        active &= pAp > 0
        alpha = torch.where(active, rz / torch.where(active, pAp, 1.0), 0.0)
        X.addcmul_(P, alpha)
        R.addcmul_(AP, alpha, value=-1.0)
        rel = torch.linalg.vector_norm(R, dim=0) / b_norm
        alphas.append(alpha)
        if iterations == max_iter or (iterations in checks and bool(measure(rel) <= tol)):
            betas.append(torch.zeros_like(alpha))
            break
        active &= rel > freeze
        Zp = precond(R)
        rz_new = (R * Zp).sum(0)
        beta = torch.where(active, rz_new / torch.where(active, rz, 1.0), 0.0)
        betas.append(beta)
        P = torch.addcmul(Zp, P, beta)  # not in place: precond may return its argument
        rz = torch.where(active, rz_new, rz)
    return CGResult(X, R, rel, iterations, products, alphas, betas, broke)
