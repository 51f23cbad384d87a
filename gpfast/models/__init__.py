"""GPyTorch models and exact float64 Cholesky routines."""

from .cholesky import CholeskyError, CholeskyJitterWarning, CholeskyPredictor, exact_mll, robust_cholesky
from .exact_gp import ExactGPModel

__all__ = [
    "ExactGPModel",
    "CholeskyPredictor",
    "CholeskyError",
    "CholeskyJitterWarning",
    "exact_mll",
    "robust_cholesky",
]
