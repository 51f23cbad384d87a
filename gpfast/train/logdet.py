"""Stochastic Lanczos quadrature (SLQ) of log|K̂| from the coefficients of a preconditioned CG run.

With probes z ~ N(0, P) solved from x0 = 0 by CG preconditioned with P, the CG coefficients of each column give
the Lanczos tridiagonal matrix T of M = P^{-1/2} K̂ P^{-1/2} started at P^{-1/2} z / |P^{-1/2} z|, and
P^{-1/2} z ~ N(0, I). So (Ubaru, Chen and Saad 2017; Gardner et al. 2018, Sec. 4)

    log|K̂| = log|P| + tr log M ~= log|P| + mean_i (z_i^T P^{-1} z_i) e_1^T log(T_i) e_1.

T from the CG step sizes a_j and direction coefficients b_j (Saad, Sec. 6.7.3): T_00 = 1/a_0,
T_jj = 1/a_j + b_{j-1}/a_{j-1}, T_{j,j+1} = sqrt(b_j)/a_j.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["lanczos_matrices", "slq_log_det"]


def _host(values) -> np.ndarray:
    """A list of (t,) tensors, or an array already on the host, as a float64 numpy array (iters, t)."""
    if isinstance(values, (list, tuple)) and values and isinstance(values[0], torch.Tensor):
        return torch.stack(values).to("cpu", torch.float64).numpy()
    return np.asarray(values, dtype=np.float64)


def lanczos_matrices(alphas, betas, columns) -> list[np.ndarray]:
    """The Lanczos tridiagonal matrix (m, m), float64 numpy, of each column in ``columns``; m is the number of
    leading iterations in which the column was still updating (non-zero step size). alphas, betas: CG's per-iteration
    (t,) coefficients as a list of tensors, or as one host array (iters, t)."""
    if len(alphas) == 0:
        return [np.zeros((0, 0)) for _ in columns]
    a, b = _host(alphas), _host(betas)
    out = []
    for c in columns:
        ac, bc = a[:, c], b[:, c]
        m = int(np.cumprod(ac != 0).sum())
        ac, bc = ac[:m], bc[:m]
        diag = 1.0 / ac
        diag[1:] += bc[:-1] / ac[:-1]
        off = np.sqrt(np.clip(bc[:-1], 0, None)) / ac[:-1]
        out.append(np.diag(diag) + np.diag(off, 1) + np.diag(off, -1))
    return out


def slq_log_det(alphas, betas, columns, probe_norms, log_det_P: float) -> tuple[float, float]:
    """``(log|K̂|, its standard error)`` estimated from the CG coefficients of the probe ``columns`` (solved from
    zero, preconditioned by P), their squared norms ``z_i^T P^{-1} z_i`` (len(columns),) and ``log|P|``. The
    standard error is that of the mean over the probes (the quadrature's own error is not in it). The inputs may
    be tensors on any device or host arrays; the quadrature runs on the host."""
    weights = probe_norms.to("cpu", torch.float64).numpy() if torch.is_tensor(probe_norms) else probe_norms
    terms = []
    for T, w in zip(lanczos_matrices(alphas, betas, columns), np.asarray(weights, dtype=np.float64)):
        if T.shape[0] == 0:  # solved by the preconditioner alone: M = I on this probe's Krylov space
            terms.append(0.0)
            continue
        theta, U = np.linalg.eigh(T)
        terms.append(w * (U[0] ** 2 * np.log(np.clip(theta, 1e-300, None))).sum())
    terms = np.asarray(terms)
    se = float(terms.std(ddof=1) / len(terms) ** 0.5) if len(terms) > 1 else float("inf")
    return float(log_det_P + terms.mean()), se
