"""The exact GP posterior: float64 Cholesky factorisation of a dense training covariance.

These are the textbook algorithms (Rasmussen & Williams, *Gaussian Processes for Machine Learning*, 2006,
Algorithm 2.1), written in torch so that they run on the GPU as well as the CPU. Everything is computed in
float64 whatever the dtype of the inputs: the point of this module is an exact reference answer (log marginal
likelihood, posterior mean and variance) for hyperparameters that may have been trained in float32.

* :func:`robust_cholesky` factors ``A = L L^T`` with ``torch.linalg.cholesky_ex`` and, when that fails,
  retries with a growing jitter on the diagonal (1e-8 .. 1e-4 times the mean diagonal), warning with the
  jitter it used, and raising :class:`CholeskyError` when it still fails.
* :class:`ExactPosterior` factors ``K + noise I`` once, then gives the exact log marginal likelihood and the
  posterior mean, variance and (optionally) full covariance at test points from their cross-covariances ``K_*``
  in bounded-memory chunks.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Union

import torch

__all__ = [
    "DEFAULT_JITTERS",
    "CholeskyError",
    "CholeskyJitterWarning",
    "ExactPosterior",
    "inverse_from_cholesky",
    "robust_cholesky",
]

#: Relative jitters tried in turn (times the mean of the diagonal) when the plain factorisation fails.
DEFAULT_JITTERS: tuple[float, ...] = (1e-8, 1e-7, 1e-6, 1e-5, 1e-4)

# Upper bound on the size (in bytes) of the (n, chunk) float64 temporaries used to solve for test points.
_CHUNK_BYTES = 256 * 2**20

TensorLike = Union[torch.Tensor, float, int]


class CholeskyError(torch.linalg.LinAlgError):
    """The covariance matrix is not positive definite, even after adding the largest jitter."""


class CholeskyJitterWarning(RuntimeWarning):
    """The Cholesky factorisation only succeeded after adding jitter to the diagonal."""


def _as_f64(x: TensorLike, device) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float64, device=device)


def robust_cholesky(
    A: torch.Tensor,
    jitters: Sequence[float] = DEFAULT_JITTERS,
    overwrite: bool = False,
) -> tuple[torch.Tensor, float]:
    """Lower Cholesky factor of the symmetric matrix ``A`` (n, n), in float64.

    Tries the plain factorisation first; if it fails, adds ``jitter * mean(diag(A))`` to the diagonal for each
    relative jitter in ``jitters`` (increasing) until it succeeds, and warns (:class:`CholeskyJitterWarning`)
    with the jitter it used.

    Parameters
    ----------
    A : torch.Tensor of shape (n, n)
        Symmetric matrix. Cast to float64 (a copy unless it already is float64 and ``overwrite``).
    jitters : sequence of float
        Relative jitters to try, in increasing order.
    overwrite : bool
        Allow the function to add the jitter to ``A``'s diagonal in place (saves one n x n copy when ``A`` is
        already float64; its diagonal is then left with the jitter added).

    Returns
    -------
    L : torch.Tensor of shape (n, n)
        The lower factor (float64).
    jitter : float
        The absolute jitter added to the diagonal (0.0 when none was needed).

    Raises
    ------
    CholeskyError
        The matrix is not positive definite even with the largest jitter.
    """
    if A.dim() != 2 or A.shape[0] != A.shape[1]:
        raise ValueError(f"A must be a square matrix (n, n), got shape {tuple(A.shape)}")
    if A.dtype != torch.float64 or not overwrite:
        A = A.to(torch.float64, copy=True)
    if not bool(torch.isfinite(A.diagonal()).all()):
        raise CholeskyError("cannot factor the covariance matrix: its diagonal contains NaN or inf")
    L, info = torch.linalg.cholesky_ex(A)
    if int(info) == 0:
        return L, 0.0
    scale = float(A.diagonal().mean())
    if not math.isfinite(scale) or scale <= 0:
        scale = 1.0
    added = 0.0
    diag = A.diagonal()
    for rel in jitters:
        jitter = rel * scale
        diag.add_(jitter - added)  # total jitter on the diagonal is now `jitter`
        added = jitter
        L, info = torch.linalg.cholesky_ex(A)
        if int(info) == 0:
            warnings.warn(
                f"Cholesky factorisation of the {A.shape[0]}x{A.shape[0]} covariance matrix failed without "
                f"jitter; succeeded after adding {jitter:.3g} to the diagonal ({rel:.0e} x its mean "
                f"{scale:.3g}).",
                CholeskyJitterWarning,
                stacklevel=2,
            )
            return L, jitter
    raise CholeskyError(
        f"Cholesky factorisation of the {A.shape[0]}x{A.shape[0]} covariance matrix failed even after adding "
        f"jitter {added:.3g} ({jitters[-1]:.0e} x the mean diagonal {scale:.3g}); the matrix is not positive "
        f"definite (info={int(info)}). Check the inputs for duplicated points with a tiny noise, or increase "
        f"the noise."
    )


#: Below this order :func:`inverse_from_cholesky` hands the block to ``torch.cholesky_inverse``.
INVERSE_BLOCK = 2048


def inverse_from_cholesky(L: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """``A^{-1}`` (n, n), both triangles, from the lower Cholesky factor ``L`` of ``A = L L^T`` (n, n).

    On the CPU this is LAPACK's potri through ``torch.cholesky_inverse`` (2 n^3 / 3 flops). On CUDA torch runs
    ``cholesky_inverse`` as cuSOLVER's potrs on an identity, two triangular solves with n right-hand sides (2 n^3
    flops), so there the inverse is built by blocks instead, with GEMMs and triangular solves that run on the FP64
    tensor cores (n^3 flops). With ``L = [[L11, 0], [L21, L22]]`` and ``W = A^{-1}``::

        W22 = (L22 L22^T)^{-1}                            (the same function on L22)
        W12 = -L11^{-T} L21^T W22                         (a GEMM and a triangular solve)
        W11 = (L11 L11^T)^{-1} - W12 L21 L11^{-1}         (the same function on L11, a GEMM and a solve)

    which is ``W = L^{-T} L^{-1}`` written out for the blocks of ``L^{-1}``: at each level two GEMMs and two
    solves of half the order, 3 n^3 / 4 flops, so n^3 over the recursion. ``block`` (default
    :data:`INVERSE_BLOCK`; 0 for ``torch.cholesky_inverse`` at any size) is the order at which the recursion
    stops; a ``block`` given explicitly applies on the CPU too (the tests run the recursion there).
    """
    if L.dim() != 2 or L.shape[0] != L.shape[1]:
        raise ValueError(f"inverse_from_cholesky: L must be a square matrix (n, n), got shape {tuple(L.shape)}")
    if block is None:
        block = INVERSE_BLOCK if L.is_cuda else 0
    if block <= 0 or L.shape[0] <= block:
        return torch.cholesky_inverse(L)
    W = torch.empty_like(L)
    _inverse_blocks(L, W, block)
    return W


def _inverse_blocks(L: torch.Tensor, W: torch.Tensor, block: int) -> None:
    n = L.shape[0]
    if n <= block:
        W.copy_(torch.cholesky_inverse(L))
        return
    h = n // 2
    L11, L21 = L[:h, :h], L[h:, :h]
    _inverse_blocks(L[h:, h:], W[h:, h:], block)
    W12 = torch.linalg.solve_triangular(L11.T, L21.T @ W[h:, h:], upper=True).neg_()
    W[:h, h:] = W12
    W[h:, :h] = W12.T
    _inverse_blocks(L11, W[:h, :h], block)
    W[:h, :h] -= torch.linalg.solve_triangular(L11, W12 @ L21, upper=False, left=False)


def _cho_solve(L: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``(L L^T)^{-1} r`` for r (n,) or (n, k), by two triangular solves. ``torch.cholesky_solve`` would first copy L
    (another n x n float64, a third of the peak memory of an exact prediction)."""
    z = torch.linalg.solve_triangular(L, r.reshape(r.shape[0], -1), upper=False)
    return torch.linalg.solve_triangular(L.mT, z, upper=True).reshape(r.shape)


def _residual(y: torch.Tensor, mean: TensorLike) -> torch.Tensor:
    """y - mean in float64: (n,) for y (n,) or (n, 1), (n, k) for k > 1 outputs."""
    y = y.to(torch.float64)
    if y.dim() != 2 or y.shape[1] == 1:
        y = y.reshape(-1)
    return y - _as_f64(mean, y.device)


class ExactPosterior:
    """Exact GP posterior from a dense training covariance, factored once in float64.

    ``ExactPosterior(K_train, y, noise, mean)`` factors ``K_train + noise I = L L^T`` (with jitter retries,
    see :func:`robust_cholesky`) and stores ``L`` and ``alpha = (K_train + noise I)^{-1} (y - mean)``. A ``y`` of
    shape (n, k) holds k outputs with this covariance in common: ``alpha`` and the means get a column per output,
    the variances are shared and the log marginal likelihood is the sum over the outputs.
    :meth:`predict` then returns, for test points with cross-covariances ``K_* = k(X_train, X_test)``
    (n, n_test) and prior variances ``k_** = diag k(X_test, X_test)`` (n_test,)::

        mean = K_*^T alpha + mean
        var  = max(k_** - |L^{-1} K_*|^2, 0)     (+ noise with ``include_noise=True``)

    solving in chunks of test points so the temporaries stay below ~256 MB.

    Parameters
    ----------
    K_train : torch.Tensor of shape (n, n)
        Noise-free prior covariance of the training points.
    y : torch.Tensor of shape (n,), (n, 1) or (n, k)
        Training targets; (n, k) holds k outputs sharing the covariance.
    noise : float or 0-dim torch.Tensor
        Gaussian noise variance.
    mean : float or 0-dim torch.Tensor
        Constant prior mean.
    overwrite : bool
        Allow ``K_train`` (if already float64) to be overwritten (saves an n x n copy).
    jitters : sequence of float
        See :func:`robust_cholesky`.

    Attributes
    ----------
    L : torch.Tensor of shape (n, n)
        Lower Cholesky factor (float64) of ``K_train + (noise + jitter) I``.
    alpha : torch.Tensor of shape (n,) or (n, k)
        float64, a column per output for k outputs.
    jitter : float
        Absolute jitter that had to be added to the diagonal (0.0 normally).
    noise, mean : float
        As given.
    n : int
        Number of training points.
    """

    def __init__(
        self,
        K_train: torch.Tensor,
        y: torch.Tensor,
        noise: TensorLike,
        mean: TensorLike = 0.0,
        overwrite: bool = False,
        jitters: Sequence[float] = DEFAULT_JITTERS,
    ):
        r = _residual(y, mean)
        n = r.shape[0]
        if K_train.shape != (n, n):
            raise ValueError(f"K_train must have shape ({n}, {n}) to match y, got {tuple(K_train.shape)}")
        self.n = n
        self.noise = float(noise)
        self.mean = float(mean)
        if overwrite and K_train.dtype == torch.float64:
            A = K_train
        else:
            A = K_train.to(torch.float64, copy=True)
        A.diagonal().add_(self.noise)
        self.L, self.jitter = robust_cholesky(A, jitters=jitters, overwrite=True)
        del A
        self.alpha = _cho_solve(self.L, r)
        self._r = r

    @property
    def device(self) -> torch.device:
        return self.L.device

    def log_marginal_likelihood(self) -> torch.Tensor:
        """Total (not averaged) exact log marginal likelihood ``log N(y | mean, K + noise I)`` (float64), summed
        over the outputs when y has several."""
        n = self.n
        k = 1 if self._r.dim() == 1 else self._r.shape[1]
        quad = self._r @ self.alpha if k == 1 else (self._r * self.alpha).sum()
        log_det = self.L.diagonal().log().sum()
        return -0.5 * quad - k * log_det - 0.5 * n * k * math.log(2 * math.pi)

    def chunk_size(self) -> int:
        """Number of test points per chunk so an (n, chunk) float64 block stays under ~256 MB."""
        return max(1, _CHUNK_BYTES // (8 * max(self.n, 1)))

    def predict(
        self,
        K_star: torch.Tensor,
        k_star_star: torch.Tensor | None = None,
        return_var: bool = False,
        include_noise: bool = False,
        K_star_star: torch.Tensor | None = None,
        return_cov: bool = False,
    ):
        """Posterior at test points.

        Parameters
        ----------
        K_star : torch.Tensor of shape (n, n_test)
            Cross-covariance between the training and test points.
        k_star_star : torch.Tensor of shape (n_test,) or None
            Prior variances of the test points (needed for ``return_var``).
        return_var : bool
            Also return the posterior variance (n_test,).
        include_noise : bool
            Add the noise variance (predictive variance of a noisy target ``y`` rather than of the latent ``f``).
        K_star_star : torch.Tensor of shape (n_test, n_test) or None
            Prior covariance of the test points (needed for ``return_cov``).
        return_cov : bool
            Also return the full posterior covariance (n_test, n_test) (symmetrised).

        Returns
        -------
        mean or (mean, var) or (mean, cov)
            ``mean`` (n_test,) float64 ((n_test, k) for k outputs), with ``var`` (n_test,) or ``cov``
            (n_test, n_test) when asked for, the variance and covariance being those of every output.
        """
        if return_var and return_cov:
            raise ValueError("at most one of return_var and return_cov can be True")
        if K_star.dim() != 2 or K_star.shape[0] != self.n:
            raise ValueError(f"K_star must have shape ({self.n}, n_test), got {tuple(K_star.shape)}")
        K_star = K_star.to(device=self.device, dtype=torch.float64)
        n_test = K_star.shape[1]
        mean = K_star.T @ self.alpha + self.mean
        if return_cov:
            if K_star_star is None:
                raise ValueError("return_cov=True needs K_star_star, the (n_test, n_test) prior covariance")
            V = torch.linalg.solve_triangular(self.L, K_star, upper=False)
            cov = K_star_star.to(device=self.device, dtype=torch.float64) - V.T @ V
            cov = 0.5 * (cov + cov.T)
            if include_noise:
                cov.diagonal().add_(self.noise)
            return mean, cov
        if not return_var:
            return mean
        if k_star_star is None:
            raise ValueError("return_var=True needs k_star_star, the (n_test,) prior variances")
        kss = k_star_star.to(device=self.device, dtype=torch.float64).reshape(-1)
        var = torch.empty(n_test, dtype=torch.float64, device=self.device)
        step = self.chunk_size()
        for s in range(0, n_test, step):
            V = torch.linalg.solve_triangular(self.L, K_star[:, s : s + step], upper=False)
            var[s : s + step] = kss[s : s + step] - V.pow(2).sum(0)
        var.clamp_(min=0.0)
        if include_noise:
            var.add_(self.noise)
        return mean, var

    def predict_from_kernel(
        self,
        kernel: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        x_train: torch.Tensor,
        x_test: torch.Tensor,
        prior_var: float,
        return_var: bool = False,
        return_cov: bool = False,
        include_noise: bool = False,
        chunk_size: int | None = None,
    ):
        """Like :meth:`predict`, forming ``K_*`` chunk by chunk with ``kernel(x_train, x_test_chunk)``.

        Only an (n, chunk) block of ``K_*`` exists at a time (unless ``return_cov``, which needs all of it).

        Parameters
        ----------
        kernel : callable
            ``kernel(a, b)`` returns the (len(a), len(b)) float64 covariance.
        x_train : torch.Tensor of shape (n, d)
            Training inputs in the units ``kernel`` expects.
        x_test : torch.Tensor of shape (n_test, d)
            Test inputs.
        prior_var : float
            Prior variance ``k(x, x)`` of the (stationary) kernel.
        return_var, return_cov, include_noise : bool
            As in :meth:`predict`.
        chunk_size : int or None
            Test points per chunk (default :meth:`chunk_size`).
        """
        n_test = x_test.shape[0]
        if return_cov:
            K_star = kernel(x_train, x_test)
            K_ss = kernel(x_test, x_test)
            return self.predict(K_star, return_cov=True, K_star_star=K_ss, include_noise=include_noise)
        step = chunk_size or self.chunk_size()
        means, variances = [], []
        for s in range(0, n_test, step):
            xc = x_test[s : s + step]
            K_star = kernel(x_train, xc)
            if not return_var:
                means.append(self.predict(K_star))
                continue
            kss = torch.full((xc.shape[0],), float(prior_var), dtype=torch.float64, device=self.device)
            m, v = self.predict(K_star, kss, return_var=True, include_noise=include_noise)
            means.append(m)
            variances.append(v)
        empty = torch.zeros(0, dtype=torch.float64, device=self.device)
        mean = torch.cat(means) if means else empty
        if not return_var:
            return mean
        return mean, (torch.cat(variances) if variances else empty)
