"""Stochastic Lanczos quadrature (SLQ) of log|K̂| from the coefficients of a preconditioned CG run.

With probes z ~ N(0, P) solved from x0 = 0 by CG preconditioned with P, the CG coefficients of each column give
the Lanczos tridiagonal matrix T of M = P^{-1/2} K̂ P^{-1/2} started at P^{-1/2} z / |P^{-1/2} z|, and
P^{-1/2} z ~ N(0, I). So (Ubaru, Chen and Saad 2017; Gardner et al. 2018, Sec. 4)

    log|K̂| = log|P| + tr log M ~= log|P| + mean_i (z_i^T P^{-1} z_i) e_1^T log(T_i) e_1.

T from the CG step sizes a_j and direction coefficients b_j (Saad, Sec. 6.7.3): T_00 = 1/a_0,
T_jj = 1/a_j + b_{j-1}/a_{j-1}, T_{j,j+1} = sqrt(b_j)/a_j.
"""

from __future__ import annotations

import torch

__all__ = ["lanczos_matrices", "slq_log_det"]


def lanczos_matrices(alphas: list[torch.Tensor], betas: list[torch.Tensor], columns) -> list[torch.Tensor]:
    """The Lanczos tridiagonal matrix (m, m), float64 on the CPU, of each column in ``columns``; m is the number of
    leading iterations in which the column was still updating (non-zero step size)."""
    if not alphas:
        return [torch.zeros(0, 0, dtype=torch.float64) for _ in columns]
    a = torch.stack(alphas).to("cpu", torch.float64)  # (iters, t)
    b = torch.stack(betas).to("cpu", torch.float64)
    out = []
    for c in columns:
        ac, bc = a[:, c], b[:, c]
        m = int((ac != 0).to(torch.int64).cumprod(0).sum())
        ac, bc = ac[:m], bc[:m]
        diag = 1.0 / ac
        diag[1:] += bc[:-1] / ac[:-1]
        off = bc[:-1].clamp_min(0).sqrt() / ac[:-1]
        out.append(torch.diag(diag) + torch.diag(off, 1) + torch.diag(off, -1))
    return out


def slq_log_det(
    alphas: list[torch.Tensor], betas: list[torch.Tensor], columns, probe_norms: torch.Tensor, log_det_P: float
) -> tuple[float, float]:
    """``(log|K̂|, its standard error)`` estimated from the CG coefficients of the probe ``columns`` (solved from
    zero, preconditioned by P), their squared norms ``z_i^T P^{-1} z_i`` (len(columns),) and ``log|P|``. The
    standard error is that of the mean over the probes (the quadrature's own error is not in it)."""
    weights = probe_norms.to("cpu", torch.float64)
    terms = []
    for T, w in zip(lanczos_matrices(alphas, betas, columns), weights):
        if T.shape[0] == 0:  # solved by the preconditioner alone: M = I on this probe's Krylov space
            terms.append(torch.zeros((), dtype=torch.float64))
            continue
        theta, U = torch.linalg.eigh(T)
        terms.append(w * (U[0] ** 2 * theta.clamp_min(1e-300).log()).sum())
    terms = torch.stack(terms)
    se = float(terms.std() / len(terms) ** 0.5) if len(terms) > 1 else float("inf")
    return float(log_det_P + terms.mean()), se
