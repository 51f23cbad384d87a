"""gpfast: exact Gaussian-process regression on a fused CUDA RBF kernel.

Public API: :class:`gpfast.ExactGP` (scikit-learn-style estimator), :class:`gpfast.CGSettings` (the settings of
its conjugate-gradient solves), :mod:`gpfast.kernels` (GPyTorch kernels on the fused op), :mod:`gpfast.ops` (the
fused ops), :mod:`gpfast.models` and :mod:`gpfast.datasets`.
"""

from gpfast import datasets, kernels, ops
from gpfast._version import __version__
from gpfast.estimator import ExactGP
from gpfast.train import CGSettings

__all__ = ["CGSettings", "ExactGP", "__version__", "datasets", "kernels", "ops"]
