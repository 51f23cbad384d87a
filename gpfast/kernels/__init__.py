"""GPyTorch kernels on gpfast's fused op, and the operators they return: stored (dense) or, for large inputs,
matrix-free."""

from gpfast.kernels.operator import DenseRBFOperator, RBFLinearOperator
from gpfast.kernels.rbf import MATRIX_FREE_THRESHOLD, STORED_MEMORY_SHARE, RBFKernel, ScaleRBFKernel

__all__ = [
    "MATRIX_FREE_THRESHOLD",
    "STORED_MEMORY_SHARE",
    "DenseRBFOperator",
    "RBFKernel",
    "RBFLinearOperator",
    "ScaleRBFKernel",
]
