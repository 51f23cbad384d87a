"""The GP posterior by preconditioned conjugate gradients, with a certified error bound on every prediction.

Where the n x n Cholesky factor does not fit, the posterior at a test point x* needs, with ``A = K + noise I``
and ``b = k(X, x*)``::

    mean = c + b^T A^{-1} (y - c),        var = k(x*, x*) - q,   q = b^T A^{-1} b.

The variance is a difference of two numbers that nearly cancel wherever the data pin f down (high
signal-to-noise, near the training points), so a solve that is good enough for the mean can give a variance that
is off by orders of magnitude or negative. This module therefore does not stop CG on a residual norm; it stops
each test point's solve on a bound of the error of its own variance, and it first tries bounds that need no solve
at all (the exact posterior of the nearest training points, and the preconditioner).

The bound. For any y with residual ``r = b - A y``::

    q = b^T y + y^T r + r^T A^{-1} r,      0 <= r^T A^{-1} r <= r^T P^{-1} r,

where ``P = L L^T + noise I`` and L is the pivoted Cholesky factor of K (:mod:`gpfast.train.preconditioner`).
The right inequality holds because the pivoted Cholesky leaves a Schur complement ``K - L L^T`` that is positive
semi-definite, so ``A >= P`` and ``A^{-1} <= P^{-1}``. So ``q`` lies in ``[q_lo, q_lo + gap]`` with
``q_lo = b^T y + y^T r`` and ``gap = r^T P^{-1} r`` -- the number preconditioned CG computes at every iteration
anyway (``r^T z``). The same bound and Cauchy-Schwarz in the ``A^{-1}`` inner product bound the mean's error by
``sqrt(k(x*, x*) * gap_alpha)`` for the residual of the solve for ``alpha = A^{-1}(y - c)``.

The solves run in the working dtype (float32 by default: the fast products) and are refined in float64: after
each inner solve the residual is recomputed with a float64 product, the bound is evaluated from that true
residual, and the columns whose bound is not yet tight enough are solved again for their correction (classical
iterative refinement). The reported variance is the middle of its certified interval, and the half-width is kept
(:attr:`CGPosterior.variance_error`), so every number this module returns comes with its own error bar.

Why this method rather than LOVE or a low-rank factor alone: a Lanczos or low-rank approximation gives only the
lower end ``q_lo`` (a Galerkin projection never overestimates ``q``), with an error that nothing measures and
that is worst exactly where the signal-to-noise is high; exact float64 Cholesky is O(n^3). Per-point solves cost
products with K, which are what gpfast is fast at, and each test point stops as soon as its own answer is known
to the requested accuracy (far from the data, b ~ 0 and it stops at once).
"""

from __future__ import annotations

import math
import time
import warnings

import torch

from gpfast.ops import rbf_covariance
from gpfast.train.preconditioner import Preconditioner, pivoted_cholesky
from gpfast.train.product import CovarianceProduct

__all__ = ["CGPosterior", "CGPredictionWarning"]


class CGPredictionWarning(RuntimeWarning):
    """A CG prediction could not certify the requested accuracy within its iteration budget."""


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum(0)


class CGPosterior:
    """GP posterior mean and variance by preconditioned CG, each with a certified error bound.

    Parameters
    ----------
    X : (n, d) tensor
        Training inputs (standardised units), on the device the solves run on.
    y : (n,) or (n, k) tensor
        Training targets: one output, or k outputs under the same kernel (their means are solved together, and
        they share the variance).
    lengthscale : (d,) or (1,) tensor
    outputscale, noise, mean : float
        Kernel output scale ``s``, noise variance and constant prior mean.
    dtype : torch.dtype, default=torch.float32
        Working dtype of the CG iterations; the bounds, the refinement residuals and the results are float64.
    rank : int, default=1024
        Rank of the pivoted-Cholesky preconditioner (capped at n). The bound above needs it; a higher rank cuts
        the iterations where the kernel's spectrum decays slowly (synthetic d=8, n=3000, noise 0.01: 1024
        against 256 took a third of the CG iterations, 86 against 270 for the mean weights and 31 against 102
        for 32 variances). Its cost is O(n rank^2) once: 8 GB and about a second of bandwidth at n = 1M.
    variance_rtol : float, default=1e-2
        Each test point's variance is certified to within this fraction of its predictive variance (of y when
        ``include_noise``, else of f). 1e-2 in the variance is 0.5% in the standard deviation.
    local_points : int, default=512
        Training points nearest to each test point whose exact posterior gives a variance bound with no solve
        (see :meth:`_quick_bounds`); 0 leaves every variance to CG.
    mean_atol : float, default=1e-3
        Certified bound on each mean's error, in the units of y (standardised: a fraction of std(y)). The CG path
        promises means within 0.5% of std(y); 1e-3 certifies a fifth of that, and the solve for the mean weights
        is the set-up's one solve with K that grows with n (synthetic d=8, noise 0.01, rank 1024: 104 and 180
        iterations at n = 5k and 10k, against 134 and 229 for 1e-5).
    max_iter : int, default=1000
        Cap on the CG iterations of one inner solve.
    refinements : int, default=8
        Cap on the float64 refinement rounds (each tightens the target with the latest lower bound of q, and each
        float32 round gains about five digits).
    product : {"stored", "matrix_free"} or None
        How the working-dtype products are made (see :class:`gpfast.train.product.CovarianceProduct`); None
        stores K when it takes at most a quarter of the free memory.
    chunk_bytes : int or None, default=None
        Memory for the (n, chunk) float64 blocks of one chunk of test points (about six of them are alive at
        once); None takes a tenth of the device's free memory when the posterior is built, so that at n = 1M on
        a 141 GB device a chunk holds some 250 test points rather than the 11 of a fixed 512 MiB (each chunk
        pays one pass over the n rows for its top-k and its preconditioner solve, and CG products amortise the
        kernel's evaluation over the columns of a block).
    variance_budget : float or None, default=None
        Wall-clock seconds one :meth:`predict` call may run before it stops starting CG work for the variances
        (checked between CG iterations, so it can overrun by one iteration and one float64 residual). The means
        and the bounds that need no solve are always computed. Points whose intervals are still wider than
        ``variance_rtol`` when it is spent keep the middle of their certified interval, whose half-width is in
        :attr:`variance_error` (the method's own error estimate, which a :class:`CGPredictionWarning` reports).
        None: no limit.

    Attributes
    ----------
    alpha : (n,) or (n, k) float64 tensor
        ``A^{-1} (y - mean)``.
    mean_error : float
        Certified bound on the error of every predicted mean (standardised units; the largest over the outputs).
    variance_error : (m,) float64 tensor or None
        Half-widths of the certified variance intervals of the last :meth:`predict` call.
    iterations : int
        CG iterations (products in the working dtype) spent so far.
    """

    def __init__(
        self,
        X: torch.Tensor,
        y: torch.Tensor,
        lengthscale: torch.Tensor,
        outputscale: float,
        noise: float,
        mean: float = 0.0,
        *,
        dtype: torch.dtype = torch.float32,
        rank: int = 1024,
        variance_rtol: float = 1e-2,
        local_points: int = 512,
        mean_atol: float = 1e-3,
        max_iter: int = 1000,
        refinements: int = 8,
        product: str | None = None,
        chunk_bytes: int | None = None,
        variance_budget: float | None = None,
    ):
        if not noise > 0:
            raise ValueError(f"CGPosterior: noise must be > 0 (the bounds divide by it), got {noise!r}")
        self.n = X.shape[0]
        self.s, self.noise, self.mean = float(outputscale), float(noise), float(mean)
        self.dtype = dtype
        self.variance_rtol, self.mean_atol = float(variance_rtol), float(mean_atol)
        self.local_points = int(local_points)
        self.max_iter, self.refinements = int(max_iter), int(refinements)
        if variance_budget is not None and not variance_budget >= 0:
            raise ValueError(f"CGPosterior: variance_budget must be None or >= 0 seconds, got {variance_budget!r}")
        self.variance_budget = None if variance_budget is None else float(variance_budget)
        self._deadline: float | None = None
        self.iterations = 0
        self.variance_error: torch.Tensor | None = None
        self.x64 = X.to(torch.float64).contiguous()
        self.ls64 = lengthscale.to(device=X.device, dtype=torch.float64).reshape(-1)
        s64 = torch.tensor(self.s, dtype=torch.float64, device=X.device)
        n64 = torch.tensor(self.noise, dtype=torch.float64, device=X.device)
        work_mode, exact_mode = self._product_modes(X.device, product)
        # the float64 products serve only the residuals the bounds rest on: stored only where both Ks fit
        self.exact = CovarianceProduct(self.x64, exact_mode)
        self.exact.update(self.ls64, s64, n64)
        if dtype == torch.float64 and work_mode == exact_mode:
            self.work = self.exact
        else:
            self.work = CovarianceProduct(X.to(dtype).contiguous(), work_mode)
            self.work.update(self.ls64.to(dtype), s64.to(dtype), n64.to(dtype))
        diagonal = torch.full((self.n,), self.s, dtype=torch.float64, device=X.device)
        L = pivoted_cholesky(self.exact.kernel_rows, diagonal, min(int(rank), self.n))
        self.precond64 = Preconditioner(L, self.s, torch.float64, fold=True)
        self.precond64.set_scales(self.s, self.noise)
        self.precond = Preconditioner(L, self.s, dtype, fold=True)
        self.precond.set_scales(self.s, self.noise)
        r = y.to(device=X.device, dtype=torch.float64).reshape(self.n, -1) - self.mean
        self.alpha, _, _, gap = self._solve(r, lambda q_lo: torch.full_like(q_lo, self.mean_atol**2 / self.s))
        self.mean_error = math.sqrt(self.s * float(gap.clamp_min(0).max()))
        self.alpha = self.alpha.reshape(y.shape)
        if chunk_bytes is None:  # measured once the preconditioner and any stored K hold their memory
            from gpfast.estimator.solver import free_memory_bytes

            chunk_bytes = free_memory_bytes(X.device) // 10
        self.chunk_bytes = int(chunk_bytes)

    def _product_modes(self, device: torch.device, requested: str | None) -> tuple[str, str]:
        """(working, float64) product modes: K is stored when it takes at most a quarter of the free memory."""
        from gpfast.estimator.solver import free_memory_bytes  # the one memory probe; imported late (layering)

        budget = free_memory_bytes(device) // 4
        item = torch.empty((), dtype=self.dtype).element_size()
        work = requested or ("stored" if item * self.n * self.n <= budget else "matrix_free")
        stored_bytes = (item * self.n * self.n if work == "stored" and item != 8 else 0) + 8 * self.n * self.n
        return work, ("stored" if stored_bytes <= budget else "matrix_free")

    # ------------------------------------------------------------------------------------------------------
    def _inner(self, R: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Working-dtype PCG for ``A D = R`` (n, t); a column stops once its ``r^T P^{-1} r`` is at most its
        ``target`` (scaled to this right-hand side). Returns D in float64."""
        B = R.to(self.dtype)
        D = torch.zeros_like(B)
        Z = self.precond.solve(B)
        P = Z.clone()
        rz = _dot(B, Z)
        # a working dtype cannot take r^T P^{-1} r much below (100 eps)^2 of where it started: past that the
        # float64 refinement round takes over instead of iterating on rounding noise
        floor = rz * (100 * torch.finfo(self.dtype).eps) ** 2
        active = torch.arange(B.shape[1], device=B.device)
        Rw, Pw, Dw, rzw, tw = B, P, D.clone(), rz, torch.maximum(target.to(self.dtype), floor)
        for _ in range(self.max_iter):
            keep = torch.nonzero(rzw > tw).reshape(-1)
            if self._out_of_time():  # the columns keep the progress they made: the float64 bound still holds
                keep = keep[:0]
            if keep.numel() < active.numel():  # columns whose bound is met leave the block
                D[:, active] = Dw
                if keep.numel() == 0:
                    break
                active, Rw, Pw, Dw, rzw, tw = (
                    active[keep],
                    Rw[:, keep],
                    Pw[:, keep],
                    Dw[:, keep],
                    rzw[keep],
                    tw[keep],
                )
            AP = self.work.matmul(Pw)
            self.iterations += 1
            pap = _dot(Pw, AP)
            alpha = rzw / torch.where(pap > 0, pap, torch.ones_like(pap))
            alpha = torch.where(pap > 0, alpha, torch.zeros_like(alpha))  # a breakdown column stops moving
            Dw = Dw + Pw * alpha
            Rw = Rw - AP * alpha
            Z = self.precond.solve(Rw)
            rz_new = _dot(Rw, Z)
            beta = rz_new / rzw.clamp_min(torch.finfo(self.dtype).tiny)
            Pw = Z + Pw * beta
            rzw = torch.where(pap > 0, rz_new, torch.zeros_like(rz_new))
        else:
            D[:, active] = Dw
        return D.to(torch.float64)

    def _solve(self, B: torch.Tensor, target_of):
        """Float64 solution Y of ``A Y = B`` (n, t), refined until every column's certified ``gap`` is at most
        ``target_of(q_lo)``. Returns (Y, R, q_lo, gap): R the float64 residuals ``B - A Y``; ``b^T A^{-1} b``
        lies in ``[q_lo, q_lo + gap]``."""
        Y = torch.zeros_like(B)
        R = B.clone()
        gap = _dot(R, self.precond64.solve(R))
        q_lo = torch.zeros_like(gap)
        for _ in range(self.refinements + 1):
            target = target_of(q_lo)
            todo = torch.nonzero(gap > target).reshape(-1)
            if todo.numel() == 0 or self._out_of_time():
                break
            # the inner solve works on the correction; its stopping target is the remaining share of the gap
            Y[:, todo] += self._inner(R[:, todo], 0.25 * target[todo])
            R[:, todo] = B[:, todo] - self.exact.matmul(Y[:, todo])
            gap[todo] = _dot(R[:, todo], self.precond64.solve(R[:, todo]))
            q_lo[todo] = _dot(B[:, todo], Y[:, todo]) + _dot(Y[:, todo], R[:, todo])
        return Y, R, q_lo, gap

    def _out_of_time(self) -> bool:
        return self._deadline is not None and time.perf_counter() > self._deadline

    # ------------------------------------------------------------------------------------------------------
    def _chunk(self) -> int:
        return max(1, self.chunk_bytes // (6 * 8 * max(self.n, 1)))

    def _quick_bounds(self, Kx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Bounds ``q_lo <= b^T A^{-1} b <= q_hi`` for the columns b of Kx (n, c) that cost no solve with A.

        Lower: the posterior from the ``local_points`` training points nearest to each test point (the largest
        entries of b) is a Galerkin projection, so ``b_S^T A_SS^{-1} b_S <= q`` (conditioning on fewer points
        never lowers a variance); exact when they are all n points. Upper: ``b^T P^{-1} b`` (A >= P) and the
        prior variance s (a variance is not negative). Where the data are dense the local posterior already pins
        the latent variance far below the noise; far from the data b ~ 0 and ``b^T P^{-1} b`` is tiny: both are
        then certified without CG.
        """
        q_hi = _dot(Kx, self.precond64.solve(Kx)).clamp(max=self.s)
        k = min(self.local_points, self.n)
        if k == 0:
            return torch.zeros_like(q_hi), q_hi
        q_lo = torch.empty_like(q_hi)
        step = max(1, (64 * 2**20) // (8 * k * k))  # (step, k, k) float64 blocks of ~64 MB
        for a in range(0, Kx.shape[1], step):
            b_all = Kx[:, a : a + step]
            b_S, idx = torch.topk(b_all, k, dim=0)  # (k, c): the nearest points in the kernel's own metric
            X_S = self.x64[idx.t()]  # (c, k, d)
            A_SS = rbf_covariance(X_S, X_S, self.ls64, self.s, check_values=False)
            A_SS.diagonal(dim1=-2, dim2=-1).add_(self.noise)
            L, info = torch.linalg.cholesky_ex(A_SS)
            z = torch.linalg.solve_triangular(L, b_S.t().unsqueeze(-1), upper=False).squeeze(-1)
            q_lo[a : a + step] = torch.where(info == 0, z.pow(2).sum(-1), torch.zeros_like(info, dtype=z.dtype))
        if k == self.n:  # the local posterior is the whole posterior: exact but for float64 rounding
            q_hi = torch.minimum(q_hi, q_lo + 1e-10 * self.s)
        return q_lo, q_hi

    def predict(self, X_test: torch.Tensor, return_var: bool = False, include_noise: bool = False):
        """Mean (m,) (or (m, k) for k outputs) and, with ``return_var``, the variance (m,) at X_test (m, d), float64.

        Each variance is the middle of its certified interval: first the bounds that need no solve
        (:meth:`_quick_bounds`) for all m points, then, for the points where those are too wide (the widest
        relative to their target first, so that a ``variance_budget`` spent part-way has narrowed the worst ones),
        the refined CG solve. :attr:`variance_error` holds the half-widths. A :class:`CGPredictionWarning` names
        the points whose interval is wider than ``variance_rtol`` of their variance when the solves stop.
        """
        start = time.perf_counter()
        x = X_test.to(device=self.x64.device, dtype=torch.float64)
        m, chunk = x.shape[0], self._chunk()
        mean = torch.empty((m, *self.alpha.shape[1:]), dtype=torch.float64, device=x.device)
        q_lo = torch.empty(m, dtype=torch.float64, device=x.device)
        q_hi = torch.empty_like(q_lo)
        for a in range(0, m, chunk):
            Kx = rbf_covariance(self.x64, x[a : a + chunk], self.ls64, self.s, check_values=False)  # (n, chunk)
            mean[a : a + chunk] = Kx.t() @ self.alpha + self.mean
            if return_var:
                q_lo[a : a + chunk], q_hi[a : a + chunk] = self._quick_bounds(Kx)
        if not return_var:
            return mean
        extra = self.noise if include_noise else 0.0
        tiny = 1e-14 * (self.s + extra)

        def target(q):
            return (self.variance_rtol * (self.s - q + extra)).clamp_min(tiny)

        excess = (q_hi - q_lo) / target(q_lo)
        todo = torch.nonzero(excess > 1).reshape(-1)
        todo = todo[torch.argsort(excess[todo], descending=True)]
        self._deadline = None if self.variance_budget is None else start + self.variance_budget
        # CG blocks of at most 128 columns: a product costs about (d + t) per pair of points, so wider blocks gain
        # at most 6% per column (d = 8), and narrower ones are certified sooner when a budget cuts them short
        block = min(chunk, 128)
        try:
            for a in range(0, todo.numel(), block):
                if self._out_of_time():
                    break
                idx = todo[a : a + block]
                # evaluated again rather than kept from the first pass: all m columns would take n x m float64
                Kx = rbf_covariance(self.x64, x[idx], self.ls64, self.s, check_values=False)
                _, _, lo, gap = self._solve(Kx, target)
                q_lo[idx] = torch.maximum(q_lo[idx], lo)
                q_hi[idx] = torch.minimum(q_hi[idx], lo + gap)
        finally:
            self._deadline = None
        var = (self.s - 0.5 * (q_lo + q_hi)).clamp_min(0.0) + extra
        self.variance_error = 0.5 * (q_hi - q_lo)
        self._warn_if_uncertified(var, self.variance_error)
        return mean, var

    def predict_covariance(self, X_test: torch.Tensor, include_noise: bool = False):
        """Mean (m,) (or (m, k) for k outputs) and full covariance (m, m) at X_test (m, d), float64 (all m test
        points are solved together, so m is what the memory allows).

        With ``r_i = b_i - A y_i``: ``b_i^T A^{-1} b_j = y_i^T b_j + r_i^T y_j + r_i^T A^{-1} r_j``, and the last
        term is at most ``sqrt(gap_i gap_j)`` (Cauchy-Schwarz in the ``A^{-1}`` inner product), so every entry
        is certified to within the geometric mean of its two diagonal bounds; the diagonal is as in
        :meth:`predict`.
        """
        x = X_test.to(device=self.x64.device, dtype=torch.float64)
        Kx = rbf_covariance(self.x64, x, self.ls64, self.s, check_values=False)
        mean = Kx.t() @ self.alpha + self.mean
        extra = self.noise if include_noise else 0.0
        tiny = 1e-14 * (self.s + extra)
        Y, R, q_lo, gap = self._solve(Kx, lambda q: (self.variance_rtol * (self.s - q + extra)).clamp_min(tiny))
        cross = Y.t() @ Kx + R.t() @ Y
        cov = rbf_covariance(x, x, self.ls64, self.s, check_values=False) - 0.5 * (cross + cross.t())
        var = (self.s - q_lo - 0.5 * gap).clamp_min(0.0)
        cov.diagonal().copy_(var + extra)
        self.variance_error = 0.5 * gap
        self._warn_if_uncertified(var + extra, self.variance_error)
        return mean, cov

    def _warn_if_uncertified(self, var: torch.Tensor, err: torch.Tensor) -> None:
        bad = err > self.variance_rtol * var.clamp_min(torch.finfo(torch.float64).tiny)
        if bool(bad.any()):
            worst = float((err / var.clamp_min(torch.finfo(torch.float64).tiny)).max())
            # the true std lies in [sqrt(var - err), sqrt(var + err)]: the lower end is the farther one
            std_worst = 1 - math.sqrt(max(0.0, 1 - worst))
            warnings.warn(
                f"CG prediction: the variances of {int(bad.sum())} of {var.numel()} test points are certified only "
                f"to within {100 * worst:.3g}% (asked: {100 * self.variance_rtol:.3g}%) after {self.refinements} "
                f"refinement rounds of at most {self.max_iter} CG iterations"
                + ("" if self.variance_budget is None else f" or {self.variance_budget:.3g} s of predict")
                + ". Each is the middle of its certified interval (half-widths in variance_error); their standard "
                f"deviations are still within {100 * std_worst:.3g}%; for tighter ones raise the preconditioner "
                f"rank or the iteration cap, or use solver='cholesky' where it fits.",
                CGPredictionWarning,
                stacklevel=3,
            )
