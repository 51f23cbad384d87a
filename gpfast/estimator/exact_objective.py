"""The exact negative log marginal likelihood of :class:`gpfast.models.ExactGPModel`, in float64 by one Cholesky
factorisation, with its gradient in closed form: the training objective of the ``"cholesky"`` solver.

Rasmussen & Williams (2006), eq. 2.30 and 5.9, with ``A = K + noise I`` and ``r = y - mean``::

    nll = 0.5 r^T A^-1 r + 0.5 log|A| + 0.5 n log(2 pi)          (Alg. 2.1: L = cholesky(A), alpha = A^-1 r)
    d nll / dA = 0.5 (A^-1 - alpha alpha^T),   d nll / dr = alpha

and ``d nll / dA`` flows into the lengthscales and the outputscale through the fused op's backward (O(n^2 d)),
into the noise as its trace and into the mean as ``-sum(alpha)``. Against GPyTorch's autograd through its
Cholesky (a float32 factorisation, a triangular-solve backward and a dense kernel built twice), this costs one
float64 Cholesky (n^3 / 3 flops) and one inverse from it (2 n^3 / 3 on the CPU, n^3 on CUDA:
:func:`~gpfast.models.exact_posterior.inverse_from_cholesky`), and gives the gradient that a line search
needs: exact, deterministic, in float64. A factorisation that fails is retried with a growing jitter
(:func:`~gpfast.models.exact_posterior.robust_cholesky`), which then counts as part of the noise.
"""

from __future__ import annotations

import math
import warnings

import torch
from linear_operator.utils.errors import NotPSDError

from gpfast import ops
from gpfast.models import ExactGPModel
from gpfast.models.exact_posterior import CholeskyError, CholeskyJitterWarning, inverse_from_cholesky, robust_cholesky

__all__ = ["cholesky_objective", "negative_log_likelihood"]


class _GaussianNLL(torch.autograd.Function):
    """nll(K, noise, r) of the module docstring; K (n, n) the noise-free covariance, noise a 0-dim tensor, r (n,)
    or (n, k): k outputs sharing the covariance, whose likelihoods add up (each adds its own log|A|)."""

    @staticmethod
    def forward(ctx, K: torch.Tensor, noise: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        n = r.shape[0]
        R = r.reshape(n, -1)
        k = R.shape[1]
        A = K.clone()
        A.diagonal().add_(noise)
        # The noise floor of this path is low enough (1e-8 x var(y)) that duplicated inputs or rounding in K can
        # make a factorisation fail; the jitter it then needs acts as extra noise, in the loss and its gradient
        # alike. The optimiser probes such points on its way, so they pass quietly; the fitted posterior warns.
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", CholeskyJitterWarning)
                L, _ = robust_cholesky(A, overwrite=True)
        except CholeskyError as exc:
            raise NotPSDError(f"the {n}x{n} training covariance (noise {float(noise):.3g}): {exc}") from exc
        alpha = torch.cholesky_solve(R, L)
        # One output keeps the dot product's rounding: near the noise floor the loss is flat to its rounding error
        # and L-BFGS's path follows it (noise-free Branin, 100 points, stops short with the elementwise sum).
        fit = R[:, 0] @ alpha[:, 0] if k == 1 else (R * alpha).sum()
        nll = 0.5 * fit + k * L.diagonal().log().sum() + 0.5 * n * k * math.log(2 * math.pi)
        ctx.save_for_backward(L, alpha)
        ctx.r_shape = r.shape
        return nll

    @staticmethod
    def backward(ctx, grad):
        L, alpha = ctx.saved_tensors
        k = alpha.shape[1]
        W = inverse_from_cholesky(L)  # A^-1: LAPACK potri on the CPU, by blocks of GEMMs on CUDA
        if k == 1:
            W.addr_(alpha[:, 0], alpha[:, 0], alpha=-1.0)
        else:
            W.addmm_(alpha, alpha.T, beta=float(k), alpha=-1.0)
        W.mul_(0.5 * grad)
        return W, W.diagonal().sum(), (grad * alpha).reshape(ctx.r_shape)


def negative_log_likelihood(
    X: torch.Tensor,
    y: torch.Tensor,
    lengthscale: torch.Tensor,
    outputscale: torch.Tensor,
    noise: torch.Tensor,
    mean: torch.Tensor,
) -> torch.Tensor:
    """Total exact negative log marginal likelihood of ``y`` (n,) at inputs ``X`` (n, d), all float64,
    differentiable in the four hyperparameters (lengthscale (1, d or 1), outputscale, noise and mean 0-dim). A ``y``
    of shape (n, k) holds k outputs with these hyperparameters in common: the sum of their likelihoods."""
    K = ops.rbf_covariance(X, X, lengthscale, outputscale, check_values=False)
    return _GaussianNLL.apply(K, noise.reshape(()), y - mean.reshape(()))


def cholesky_objective(model: ExactGPModel):
    """An :data:`~gpfast.estimator.fitting.Objective` for ``model``: the exact negative log marginal likelihood per
    data point (float64, whatever the model's dtype), with ``.grad`` set on the model's raw parameters. Targets of
    shape (k, n), GPyTorch's layout of k outputs sharing one kernel, give the sum over the outputs divided by
    ``k n``: the loss per data point and output, the same for ``[y, y]`` as for ``y``."""
    X = model.train_inputs[0].detach().to(torch.float64)
    targets = model.train_targets.detach().to(torch.float64)
    y = targets if targets.dim() == 1 else targets.T
    n = targets.numel()
    kern = model.covar_module

    def closure() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        f64 = torch.float64
        nll = negative_log_likelihood(
            X,
            y,
            kern.base_kernel.lengthscale.to(f64),
            kern.outputscale.to(f64),
            model.likelihood.noise.to(f64),
            model.mean_module.constant.to(f64),
        )
        loss = nll / n
        loss.backward()
        return loss.detach()

    return closure
