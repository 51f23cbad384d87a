"""GPyTorch kernels on gpfast's fused op, and the operators they return: stored (dense) or, for large inputs,
matrix-free."""

from gpfast.kernels.operator import DenseRBFOperator, RBFLinearOperator
from gpfast.kernels.rbf import MATRIX_FREE_THRESHOLD, RBFKernel, ScaleRBFKernel

__all__ = ["MATRIX_FREE_THRESHOLD", "DenseRBFOperator", "RBFKernel", "RBFLinearOperator", "ScaleRBFKernel"]
