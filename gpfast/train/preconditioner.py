"""The engine's preconditioner: a rank-k pivoted Cholesky factor of K, applied to K + noise I by Woodbury.

``P = L L^T + noise I`` with L (n, k) from the greedy pivoted Cholesky of K (Harbrecht et al. 2012; the
preconditioner of Gardner et al. 2018 and GPyTorch). Each pivot costs one fused row evaluation
(:meth:`~gpfast.train.product.CovarianceProduct.kernel_rows`, O(n d)) and an (n, m) x (m,) product, so a build is
O(n k^2) with no n x n matrix and no host synchronisation. The factor is kept in float64.

Between builds the outputscale and the noise change exactly at no cost: L is rescaled by sqrt(s / s_build) and the
Woodbury factor is redone for the current noise in O(n k^2) (:meth:`Preconditioner.set_scales`):

    C = noise I_k + L^T L = R R^T (Cholesky, k x k, float64),   Q = L R^{-T} (n, k),
    P^{-1} v = (v - Q Q^T v) / noise,   log|P| = (n - k) log(noise) + 2 sum(log diag R).

Q Q^T has eigenvalues in [0, 1), so the apply is stable in float32. Probes with covariance exactly P are
``L w_1 + sqrt(noise) w_2`` (w_1 (k,), w_2 (n,) standard normal), which makes P^{-1} z their natural partner in
the Hutchinson estimate and their preconditioned Lanczos coefficients a stochastic-Lanczos log-determinant
(:mod:`gpfast.train.logdet`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["Preconditioner", "pivoted_cholesky"]


def pivoted_cholesky(
    kernel_rows: Callable[[torch.Tensor], torch.Tensor], diagonal: torch.Tensor, rank: int, rel_floor: float = 1e-8
) -> torch.Tensor:
    """Greedy pivoted Cholesky: L (n, rank), float64, with K ~= L L^T.

    kernel_rows(index) returns the rows ``K[index, :]`` (1, n); diagonal is K's diagonal (n,). A pivot whose
    remaining diagonal is below ``rel_floor * max(diagonal)`` (K's rank is exhausted) gives a zero column instead
    of a division by a vanishing pivot; no step synchronises with the device.
    """
    n = diagonal.shape[0]
    rank = min(rank, n)
    L = torch.zeros(n, rank, dtype=torch.float64, device=diagonal.device)
    d = diagonal.to(torch.float64).clone()
    floor = rel_floor * d.max()
    for m in range(rank):
        i = torch.argmax(d).reshape(1)
        pivot = d.index_select(0, i)
        row = kernel_rows(i).reshape(-1).to(torch.float64)
        if m:
            row = row - L[:, :m] @ L.index_select(0, i)[0, :m]
        ok = pivot > floor
        col = torch.where(ok, row / pivot.clamp_min(floor).sqrt(), torch.zeros_like(row))
        L[:, m] = col
        d = (d - col * col).clamp_min_(0.0)
        d.index_fill_(0, i, 0.0)
    return L


class Preconditioner:
    """``P = (s / s_build) L L^T + noise I`` with its Woodbury inverse, log-determinant and probe sampler.

    L: (n, k) float64 pivoted Cholesky factor of K at outputscale ``s_build`` (k = 0 gives P = noise I);
    dtype: the working dtype of the vectors it is applied to.
    """

    def __init__(self, L: torch.Tensor, s_build: float, dtype: torch.dtype):
        self.L = L
        self.gram = L.t() @ L  # (k, k) float64
        self.s_build = float(s_build)
        self.dtype = dtype
        self.n, self.k = L.shape

    def set_scales(self, outputscale: float, noise: float) -> None:
        """Woodbury factor for the current outputscale and noise (O(n k^2), float64)."""
        c = outputscale / self.s_build
        self.noise = float(noise)
        self.scale = math.sqrt(c)
        if self.k == 0:
            self.Q = self.L.to(self.dtype)
            self.log_det = self.n * math.log(self.noise)
            return
        C = c * self.gram + self.noise * torch.eye(self.k, dtype=torch.float64, device=self.L.device)
        R = torch.linalg.cholesky(C)
        self.Q = torch.linalg.solve_triangular(R, self.scale * self.L.t(), upper=False).t().to(self.dtype)
        self.log_det = (self.n - self.k) * math.log(self.noise) + 2.0 * float(R.diagonal().log().sum())

    def solve(self, V: torch.Tensor) -> torch.Tensor:
        """P^{-1} V for V (n, t)."""
        if self.k == 0:
            return V / self.noise
        return (V - self.Q @ (self.Q.t() @ V)) / self.noise

    def sample(self, W1: torch.Tensor, W2: torch.Tensor) -> torch.Tensor:
        """Probes with covariance P from standard normal W1 (k, s) and W2 (n, s): ``L W1 + sqrt(noise) W2``."""
        Z = W2 * math.sqrt(self.noise)
        if self.k:
            Z = Z + (self.scale * (self.L @ W1.to(torch.float64))).to(self.dtype)
        return Z
