"""The GPyTorch model, and the exact float64 GP posterior by Cholesky factorisation."""

from gpfast.models.exact_posterior import CholeskyError, CholeskyJitterWarning, ExactPosterior, robust_cholesky
from gpfast.models.gp import KERNELS, ExactGPModel

__all__ = ["KERNELS", "CholeskyError", "CholeskyJitterWarning", "ExactGPModel", "ExactPosterior", "robust_cholesky"]
