"""scikit-learn's ``log_marginal_likelihood(theta, eval_gradient)`` for :class:`gpfast.ExactGP`.

The vector, as scikit-learn's ``kernel_.theta``, holds the logs of the kernel's and the noise's hyperparameters::

    theta = log([lengthscale_1, ..., lengthscale_k, outputscale, noise])      (k = n_features with ARD, else 1)

in the units the model is fitted in: the standardised ones (each input column and each output scaled to unit
variance by :mod:`gpfast.standardize`; with ``standardize=False``, the data's own). The reported hyperparameters
follow from it as ``lengthscale_ = exp(theta[:k]) * x_std_``, ``outputscale_ = exp(theta[k]) * y_std_**2`` and
``noise_ = exp(theta[k + 1]) * y_std_**2``. The likelihood is that of the standardised targets, as scikit-learn's
with ``normalize_y=True``; with several outputs it is the sum over them. The constant prior mean is not part of
theta (scikit-learn's kernels have none): it stays at its fitted value.

The value and gradient are exact: one float64 Cholesky factorisation (Rasmussen & Williams 2006, Alg. 2.1) and the
closed-form gradient of :mod:`~gpfast.estimator.exact_objective` (eq. 5.9), carried into the lengthscales and the
outputscale by autograd through :func:`gpfast.ops.rbf_covariance`, whose backward on the GPU is the fused kernel.
"""

from __future__ import annotations

import numpy as np
import torch
from linear_operator.utils.errors import NotPSDError

from gpfast.estimator import independent
from gpfast.estimator.exact_objective import negative_log_likelihood
from gpfast.estimator.hyperparameters import theta_array
from gpfast.estimator.prediction import hyperparameters_float64

__all__ = ["estimator_theta", "fitted_theta", "log_marginal_likelihood", "of_estimator"]


def fitted_theta(hyp: dict[str, torch.Tensor]) -> np.ndarray:
    """theta (module docstring) of float64 hyperparameters in standardised units (as
    :func:`gpfast.estimator.prediction.hyperparameters_float64` returns them), float64 of shape (k + 2,)."""
    parts = [hyp["lengthscale"].reshape(-1), hyp["outputscale"].reshape(1), hyp["noise"].reshape(1)]
    return torch.cat(parts).detach().log().cpu().numpy()


def _as_theta(theta, size: int, device: torch.device) -> torch.Tensor:
    hint = f"log lengthscale(s) ({size - 2}), log outputscale and log noise, in standardised units"
    return torch.as_tensor(theta_array(theta, (size,), hint), device=device)


def log_marginal_likelihood(
    X: torch.Tensor, y: torch.Tensor, mean: torch.Tensor, n_lengthscales: int, theta, eval_gradient: bool
) -> float | tuple[float, np.ndarray]:
    """Exact log marginal likelihood of standardised targets ``y`` (n,) or (n, k) at standardised inputs ``X`` (n, d)
    (float64 tensors on one device) with prior mean ``mean`` (0-dim) and hyperparameters ``theta`` (module
    docstring, ``n_lengthscales + 2`` entries), and with ``eval_gradient`` its gradient with respect to theta
    (float64 array of theta's shape).

    As scikit-learn's, ``-inf`` (and a zero gradient) where the covariance is not positive definite in float64.
    """
    size = n_lengthscales + 2
    t = _as_theta(theta, size, X.device).requires_grad_(bool(eval_gradient))
    with torch.enable_grad() if eval_gradient else torch.no_grad():
        v = t.exp()
        lengthscale, outputscale, noise = v[:n_lengthscales].reshape(1, -1), v[n_lengthscales], v[n_lengthscales + 1]
        try:
            nll = negative_log_likelihood(X, y, lengthscale, outputscale, noise, mean.to(X.device, torch.float64))
        except NotPSDError:
            return (-np.inf, np.zeros(size)) if eval_gradient else -np.inf
        if not eval_gradient:
            return -float(nll)
        (grad,) = torch.autograd.grad(nll, t)
    return -float(nll.detach()), (-grad).cpu().numpy()


def estimator_theta(est) -> np.ndarray:
    """``est.theta_`` of a fitted :class:`gpfast.ExactGP`: (k + 2,), or a row per output (without its mean) after
    a fit with ``independent_outputs=True``."""
    if getattr(est, "_independent_theta", None) is not None:
        return est._independent_theta[:, :-1].copy()
    return fitted_theta(hyperparameters_float64(est.model_))


def of_estimator(est, theta, eval_gradient: bool):
    """``est.log_marginal_likelihood(theta, eval_gradient)`` of a fitted :class:`gpfast.ExactGP` (its docstring
    says what it returns)."""
    if theta is None:
        if eval_gradient:
            raise ValueError(
                "ExactGP.log_marginal_likelihood: eval_gradient=True needs a theta, got theta=None (pass "
                "theta=gp.theta_ for the gradient at the fitted hyperparameters)."
            )
        return est.log_marginal_likelihood_
    if getattr(est, "_independent_theta", None) is not None:
        fitted = est._independent_theta
        args = (est.X_train_, est.y_train_, fitted, fitted.shape[1] - 3, theta, eval_gradient)
        return independent.log_marginal_likelihood(*args)
    hyp = hyperparameters_float64(est.model_)
    n_lengthscales = hyp["lengthscale"].numel()
    return log_marginal_likelihood(est.X_train_, est.y_train_, hyp["mean"], n_lengthscales, theta, eval_gradient)
