"""The GPyTorch model behind :class:`gpfast.ExactGP`, usable on its own by GPyTorch users."""

from __future__ import annotations

import gpytorch
import torch

from gpfast.kernels import ScaleRBFKernel

__all__ = ["ExactGPModel"]


class ExactGPModel(gpytorch.models.ExactGP):
    """Exact GP regression model: constant mean, scaled RBF kernel (gpfast's fused implementation).

    A drop-in for the textbook GPyTorch model
    ``ConstantMean() + ScaleKernel(RBFKernel(ard_num_dims=d))`` with the same ``state_dict`` keys, so it trains
    with the usual GPyTorch loop::

        likelihood = gpytorch.likelihoods.GaussianLikelihood()
        model = ExactGPModel(train_x, train_y, likelihood)
        mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
        ...
        model.eval(); likelihood.eval()
        pred = likelihood(model(test_x))

    Args:
        train_x: training inputs (n, d) (a 1-D tensor is treated as (n, 1)).
        train_y: training targets (n,).
        likelihood: a ``gpytorch.likelihoods.GaussianLikelihood`` (or compatible).
        ard: one lengthscale per input dimension (True) or a single shared lengthscale (False).
        distributed: split every covariance product by rows over the ranks of ``torch.distributed``
            (see :mod:`gpfast.distributed`); the covariance is then always matrix-free.
    """

    def __init__(self, train_x: torch.Tensor, train_y: torch.Tensor, likelihood, ard: bool = True,
                 distributed: bool = False):
        super().__init__(train_x, train_y, likelihood)
        d = 1 if train_x.dim() == 1 else train_x.shape[-1]
        self.ard = bool(ard)
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = ScaleRBFKernel(ard_num_dims=d if ard else None, distributed=distributed)

    def forward(self, x: torch.Tensor) -> gpytorch.distributions.MultivariateNormal:
        mean_x = self.mean_module(x)
        covar_x = self.covar_module(x)
        return gpytorch.distributions.MultivariateNormal(mean_x, covar_x)
