"""The GPyTorch model, and the GP posterior: exact by float64 Cholesky, or by CG with certified error bounds."""

from gpfast.models.cg_posterior import CGPosterior, CGPredictionWarning
from gpfast.models.exact_posterior import CholeskyError, CholeskyJitterWarning, ExactPosterior, robust_cholesky
from gpfast.models.gp import KERNELS, ExactGPModel

__all__ = [
    "KERNELS",
    "CGPosterior",
    "CGPredictionWarning",
    "CholeskyError",
    "CholeskyJitterWarning",
    "ExactGPModel",
    "ExactPosterior",
    "robust_cholesky",
]
