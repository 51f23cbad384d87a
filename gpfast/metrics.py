"""Test-set metrics of a Gaussian predictive distribution, in one place for the estimator, CLI and benchmarks."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["MIN_VARIANCE", "gaussian_nll", "regression_metrics", "rmse"]

#: Predictive variances are clamped to at least this (in the units the metric is computed in) before the NLL, so
#: that a variance rounded to zero gives a large, finite penalty rather than inf or NaN.
MIN_VARIANCE = 1e-12


def rmse(mean, y) -> float:
    """Root mean squared error of the predictive mean."""
    err = np.asarray(mean, dtype=np.float64).reshape(-1) - np.asarray(y, dtype=np.float64).reshape(-1)
    return float(np.sqrt(np.mean(err**2)))


def gaussian_nll(mean, var, y) -> float:
    """Mean negative log density of ``y`` under independent Gaussians N(mean, var) (var clamped at MIN_VARIANCE)."""
    mean = np.asarray(mean, dtype=np.float64).reshape(-1)
    var = np.maximum(np.asarray(var, dtype=np.float64).reshape(-1), MIN_VARIANCE)
    err = mean - np.asarray(y, dtype=np.float64).reshape(-1)
    return float(np.mean(0.5 * np.log(2 * np.pi * var) + 0.5 * err**2 / var))


def regression_metrics(mean, var, y, y_std: float = 1.0) -> dict:
    """RMSE and NLL on standardised targets (``*_std``) and in the original units (``*_orig``), where the
    targets were standardised by ``y_std``: RMSE scales by ``y_std`` and the NLL shifts by ``log(y_std)``."""
    r = rmse(mean, y)
    nll = gaussian_nll(mean, var, y)
    return {"rmse_std": r, "rmse_orig": r * float(y_std), "nll_std": nll, "nll_orig": nll + math.log(float(y_std))}
