"""Posterior predictions of a fitted :class:`gpfast.ExactGP`: exact in float64 by Cholesky, or by CG with a
certified error bound on every mean and variance (:mod:`gpfast.models.cg_posterior`)."""

from __future__ import annotations

import torch

from gpfast.models import CGPosterior, ExactGPModel, ExactPosterior
from gpfast.ops import rbf_covariance
from gpfast.train.settings import CGSettings

__all__ = [
    "cg_posterior",
    "cg_posterior_of_fit",
    "exact_posterior",
    "fitted_cg_posterior",
    "fitted_exact_posterior",
    "hyperparameters_float64",
    "predict_cg",
    "predict_exact",
]


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


def fitted_exact_posterior(est) -> ExactPosterior:
    """The fitted estimator's exact posterior, factored again when loading or unpickling has dropped it."""
    if getattr(est, "_posterior", None) is None:
        est._posterior = exact_posterior(est.X_train_, est.y_train_, hyperparameters_float64(est.model_))
    return est._posterior


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


def cg_posterior(
    X: torch.Tensor, y: torch.Tensor, hyp: dict[str, torch.Tensor], dtype: torch.dtype, cg: CGSettings
) -> CGPosterior:
    """The CG posterior of the training data: solves in ``dtype`` refined in float64, each prediction with a
    certified error bound (:class:`gpfast.models.CGPosterior`), under the ``predict_*`` fields of ``cg``."""
    return CGPosterior(
        X,
        y,
        hyp["lengthscale"].reshape(-1),
        float(hyp["outputscale"]),
        float(hyp["noise"]),
        float(hyp["mean"]),
        dtype=dtype,
        rank=cg.predict_preconditioner_rank,
        variance_rtol=cg.predict_cg_tolerance,
        max_iter=cg.predict_max_cg_iterations,
    )


def cg_posterior_of_fit(model: ExactGPModel, X: torch.Tensor, y: torch.Tensor, solver: str, cg: CGSettings):
    """The CG posterior at the fitted hyperparameters when predictions are by CG (``solver == "cg"``), else None."""
    if solver != "cg":
        return None
    return cg_posterior(X, y, hyperparameters_float64(model), model.covar_module.raw_outputscale.dtype, cg)


def fitted_cg_posterior(est) -> CGPosterior:
    """The fitted estimator's CG posterior, built again when loading or unpickling has dropped it."""
    if getattr(est, "_cg_posterior", None) is None:
        dtype = est.model_.covar_module.raw_outputscale.dtype
        hyp = hyperparameters_float64(est.model_)
        est._cg_posterior = cg_posterior(est.X_train_, est.y_train_, hyp, dtype, CGSettings.from_value(est.cg))
    return est._cg_posterior


def predict_cg(posterior: CGPosterior, X: torch.Tensor, return_std: bool, return_cov: bool, include_noise: bool):
    """Mean (and variance or covariance) at standardised inputs X, float64, by the CG posterior."""
    if return_cov:
        return posterior.predict_covariance(X, include_noise=include_noise)
    return posterior.predict(X, return_var=return_std, include_noise=include_noise)
