"""The engine's preconditioner: a rank-k pivoted Cholesky factor of K, applied to K + noise I by Woodbury.

``P = L L^T + noise I`` with L (n, k) from the greedy pivoted Cholesky of K (Harbrecht et al. 2012; the
preconditioner of Gardner et al. 2018 and GPyTorch). The pivots are taken in blocks: one fused evaluation of the
candidate rows (:meth:`~gpfast.train.product.CovarianceProduct.kernel_rows`, O(n d) each) per block, and an
(n, m) x (m,) product per pivot, so a build is O(n k^2) with no n x n matrix and no host synchronisation. The
factor is kept in float64.

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

from collections.abc import Callable

import torch

from gpfast import ops  # noqa: F401  (registers torch.ops.gpfast._pivot_block)

__all__ = ["Preconditioner", "pivoted_cholesky"]


def pivoted_cholesky(
    kernel_rows: Callable[[torch.Tensor], torch.Tensor],
    diagonal: torch.Tensor,
    rank: int,
    rel_floor: float = 1e-8,
    block: int = 16,
) -> torch.Tensor:
    """Greedy pivoted Cholesky: L (n, rank), float64, with K ~= L L^T, built on the device in blocks.

    kernel_rows(index) returns the rows ``K[index, :]`` (len(index), n); diagonal is K's diagonal (n,). Each block
    evaluates the rows of the ``2 * block`` points with the largest remaining diagonal in one call and takes
    ``block`` pivots among them greedily (each the candidate with the largest remaining diagonal), so a build makes
    about ``rank / block`` row evaluations instead of ``rank``. The greedy rule is the unblocked one restricted to
    the candidates: a pivot can only differ from it when more than ``block`` of the top ``2 * block`` diagonals
    collapse inside one block. A pivot whose remaining diagonal is below ``rel_floor * max(diagonal)`` (K's rank is
    exhausted) gives a zero column instead of a division by a vanishing pivot.

    The pivots of a block depend only on the candidates' c x c residual covariance, so one call of the op
    ``_pivot_block`` takes them all (a single thread block on a GPU), and the block's columns over all n points
    then come from one triangular solve with the b x b factor of the pivots:
    ``L_b^T = G^{-1} R[piv, :]``, G the rows of the candidates' columns at the pivots. A block is about fifteen
    kernels, none of them per pivot, and nothing is read back to the host.
    """
    n = diagonal.shape[0]
    rank = min(rank, n)
    L = torch.zeros(n, rank, dtype=torch.float64, device=diagonal.device)
    d = diagonal.to(torch.float64).clone()
    floor = rel_floor * d.max()
    m = 0
    while m < rank:
        b = min(block, rank - m)
        cand = torch.topk(d, min(2 * b, n)).indices  # this block's pivots are taken among these candidates
        rows = kernel_rows(cand).to(torch.float64)  # (c, n)
        if m:  # the candidates' rows of the residual K - L L^T after the previous blocks: one GEMM
            rows = rows - L.index_select(0, cand)[:, :m] @ L[:, :m].t()
        piv, C, ok = torch.ops.gpfast._pivot_block(rows.index_select(1, cand), d.index_select(0, cand), floor, b)
        # G = C[piv, :] is lower triangular with G[j, j] = sqrt(pivot_j); a pivot below the floor gets a unit row
        # and a zero right-hand side, so its column is zero, as in the unblocked rule
        G = C.index_select(0, piv) * ok.unsqueeze(1)
        G.diagonal().add_(1.0 - ok)
        Lb = torch.linalg.solve_triangular(G, rows.index_select(0, piv) * ok.unsqueeze(1), upper=False)  # (b, n)
        L[:, m : m + b] = Lb.t()
        d.sub_((Lb * Lb).sum(0)).clamp_min_(0.0)
        d.index_fill_(0, cand.index_select(0, piv), 0.0)
        m += b
    return L


class Preconditioner:
    """``P = (s / s_build) L L^T + noise I`` with its Woodbury inverse, log-determinant and probe sampler.

    The scales may stay on the device as 0-dim tensors: nothing here reads them back to the host.

    Parameters
    ----------
    L : torch.Tensor of shape (n, k)
        float64 pivoted Cholesky factor of K at outputscale ``s_build``; k = 0 gives P = noise I.
    s_build : float or 0-dim torch.Tensor
        The outputscale that ``L`` was built at.
    dtype : torch.dtype
        The working dtype of the vectors it is applied to.
    orthonormal : bool, default=False
        Apply P^{-1} through an orthonormal basis of L (a QR of L at construction, O(n k^2)): the same P, with
        less rounding in a float32 working dtype; for a preconditioner built once (predictions), not for the
        training steps' rebuilds.
    """

    def __init__(self, L: torch.Tensor, s_build, dtype: torch.dtype, orthonormal: bool = False):
        self.L = L
        self.gram = L.t() @ L  # (k, k) float64
        # the n x k matrix the per-iteration products read: L itself, or with ``orthonormal`` U of L = U T (a QR
        # at each build), whose rounding to the working dtype stays relative to |V| where L's nearly dependent
        # columns, rounded, are amplified by C^{-1}: in float32 the latter tripled the CG posterior's covariance
        # error against Cholesky, while the engine's solves converged as before
        self.T = None
        if orthonormal and self.L.shape[1]:
            U, self.T = torch.linalg.qr(L)
            self.basis = U.to(dtype)
        else:
            self.basis = L.to(dtype)
        self.s_build = torch.as_tensor(s_build, dtype=torch.float64, device=L.device)
        self.dtype = dtype
        self.n, self.k = L.shape

    def set_scales(self, outputscale, noise) -> None:
        """Woodbury factor for the current outputscale and noise (floats or 0-dim tensors; O(k^3), float64).
        ``log_det`` is then a 0-dim float64 tensor on L's device.

        With ``c = s / s_build`` and ``C = c L^T L + noise I`` (k, k), ``P^{-1} = (I - c L C^{-1} L^T) / noise``.
        Only C's Cholesky factor changes with the scales, so a step costs O(k^3) here whatever n is; folding that
        factor into an n x k matrix instead costs O(n k^2) every step (in float64 about 16 ms at n = 41k,
        k = 3200 on an H200). With a QR of L at every build on top (the ``orthonormal`` form), rank 3200 took 25
        rather than 38 iterations a step on protein (H200) but 136 rather than 108 ms a step on average, the
        rebuild steps included; the training steps therefore use L itself.
        """
        as64 = dict(dtype=torch.float64, device=self.L.device)
        c = torch.as_tensor(outputscale, **as64) / self.s_build
        noise64 = torch.as_tensor(noise, **as64)
        self.noise = noise64.to(self.dtype)
        self.scale = c.sqrt()
        if self.k == 0:
            self.log_det = self.n * noise64.log()
            return
        C = c * self.gram + noise64 * torch.eye(self.k, **as64)
        R, _ = torch.linalg.cholesky_ex(C)  # no error check: that would wait for the device
        # M = c C^{-1} once per step: applying C's factor by two triangular solves in every iteration instead
        # took the rank-3200 steps on protein from 89 to 140 ms on the H200 (a solve with 17 right-hand sides
        # runs far below the GEMM rate)
        self.M = c * torch.cholesky_inverse(R)
        if self.T is not None:
            self.M = self.T @ self.M @ self.T.t()
        self.log_det = (self.n - self.k) * noise64.log() + 2.0 * R.diagonal().log().sum()

    def solve(self, V: torch.Tensor) -> torch.Tensor:
        """P^{-1} V for V (n, t)."""
        if self.k == 0:
            return V / self.noise
        # the k x t middle in float64: M's entries reach c / noise
        W = self.M @ (self.basis.t() @ V).to(torch.float64)
        return (V - self.basis @ W.to(self.dtype)) / self.noise

    def sample(self, W1: torch.Tensor, W2: torch.Tensor) -> torch.Tensor:
        """Probes with covariance P from standard normal W1 (k, s) and W2 (n, s): ``L W1 + sqrt(noise) W2``."""
        Z = W2 * self.noise.sqrt()
        if self.k:
            Z = Z + (self.scale * (self.L @ W1.to(torch.float64))).to(self.dtype)
        return Z
