"""GPyTorch kernels on gpfast's fused op, and the matrix-free operator they return for large inputs."""

from gpfast.kernels.operator import RBFLinearOperator
from gpfast.kernels.rbf import MATRIX_FREE_THRESHOLD, RBFKernel, ScaleRBFKernel

__all__ = ["MATRIX_FREE_THRESHOLD", "RBFKernel", "RBFLinearOperator", "ScaleRBFKernel"]
