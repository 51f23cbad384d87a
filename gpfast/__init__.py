"""gpfast: exact Gaussian-process regression on a fused CUDA RBF kernel.

Public API: :class:`gpfast.ExactGP` (scikit-learn-style estimator), :mod:`gpfast.kernels` (GPyTorch kernels on
the fused op), :mod:`gpfast.ops` (the fused ops), :mod:`gpfast.models` and :mod:`gpfast.datasets`.
"""

__version__ = "0.1.0"

from gpfast import datasets, kernels, ops  # noqa: E402
from gpfast.estimator import ExactGP  # noqa: E402

__all__ = ["ExactGP", "kernels", "ops", "datasets", "__version__"]
