"""Posterior predictions of a fitted :class:`gpfast.ExactGP`: exact in float64 by Cholesky, or GPyTorch's CG."""

from __future__ import annotations

import contextlib
import warnings

import gpytorch
import torch

from gpfast.estimator.fitting import solver_settings
from gpfast.models import ExactGPModel, ExactPosterior
from gpfast.ops import rbf_covariance
from gpfast.train.settings import CGSettings

__all__ = ["exact_posterior", "hyperparameters_float64", "predict_cg", "predict_exact"]

# Bytes of (chunk x n) temporaries allowed per prediction chunk with the CG solver.
_CG_CHUNK_BYTES = 256 * 2**20


def hyperparameters_float64(model: ExactGPModel) -> dict[str, torch.Tensor]:
    """Hyperparameters in standardised units, computed in float64 from the raw parameters (so that the reported
    values and the float64 predictions agree exactly, whatever the training dtype)."""
    kern = model.covar_module
    base = kern.base_kernel
    lik = model.likelihood.noise_covar
    with torch.no_grad():
        ls = base.raw_lengthscale_constraint.transform(base.raw_lengthscale.detach().to(torch.float64))
        os_ = kern.raw_outputscale_constraint.transform(kern.raw_outputscale.detach().to(torch.float64))
        noise = lik.raw_noise_constraint.transform(lik.raw_noise.detach().to(torch.float64))
        mean = model.mean_module.constant.detach().to(torch.float64)
    return {
        "lengthscale": ls.reshape(1, -1),
        "outputscale": os_.reshape(()),
        "noise": noise.reshape(()),
        "mean": mean.reshape(()),
    }


def _kernel64(a: torch.Tensor, b: torch.Tensor, hyp: dict[str, torch.Tensor]) -> torch.Tensor:
    """Noise-free prior covariance k(a, b) in float64 (standardised units)."""
    a = a.to(torch.float64)
    b = b.to(device=a.device, dtype=torch.float64)
    return rbf_covariance(a, b, hyp["lengthscale"].to(a.device), hyp["outputscale"].to(a.device))


def exact_posterior(X: torch.Tensor, y: torch.Tensor, hyp: dict[str, torch.Tensor]) -> ExactPosterior:
    """The float64 Cholesky posterior of the training data (one n x n float64 matrix, factored in place)."""
    return ExactPosterior(_kernel64(X, X, hyp), y, hyp["noise"], hyp["mean"], overwrite=True)


def predict_exact(
    posterior: ExactPosterior,
    X_train: torch.Tensor,
    X: torch.Tensor,
    hyp,
    return_std: bool,
    return_cov: bool,
    include_noise: bool,
):
    """Mean (and variance or covariance) at standardised inputs X, float64, by the exact posterior."""
    return posterior.predict_from_kernel(
        lambda a, b: _kernel64(a, b, hyp),
        X_train,
        X,
        prior_var=float(hyp["outputscale"]),
        return_var=return_std,
        return_cov=return_cov,
        include_noise=include_noise,
    )


def predict_cg(
    model: ExactGPModel,
    X: torch.Tensor,
    dtype: torch.dtype,
    cg: CGSettings,
    return_std: bool,
    return_cov: bool,
    include_noise: bool,
):
    """GPyTorch's prediction (``fast_pred_var`` off, so variances are solved for) in the training dtype, in chunks
    of test points whose (chunk x n) temporaries stay under ~256 MB. Returns float64 tensors."""
    likelihood = model.likelihood
    model.eval()
    likelihood.eval()
    device = X.device
    Xd = X.to(dtype)
    n = model.train_inputs[0].shape[0]
    step = max(1, _CG_CHUNK_BYTES // (4 * max(n, 1)))
    if return_cov:
        step = max(Xd.shape[0], 1)  # the full covariance needs all test points at once
    means, seconds = [], []
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(solver_settings("cg", cg))
        stack.enter_context(gpytorch.settings.fast_pred_var(False))
        stack.enter_context(gpytorch.settings.skip_posterior_variances(not (return_std or return_cov)))
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message=".*input matches the stored training data.*")
        for s in range(0, Xd.shape[0], step):
            dist = model(Xd[s : s + step])
            if include_noise:
                dist = likelihood(dist)
            means.append(dist.mean.to(torch.float64))
            if return_std:
                seconds.append(dist.variance.to(torch.float64))
            elif return_cov:
                seconds.append(dist.covariance_matrix.to(torch.float64))
    empty = torch.zeros(0, dtype=torch.float64, device=device)
    mean = torch.cat(means) if means else empty
    if not (return_std or return_cov):
        return mean
    if return_cov:
        return mean, (seconds[0] if seconds else torch.zeros(0, 0, dtype=torch.float64, device=device))
    return mean, (torch.cat(seconds) if seconds else empty)
