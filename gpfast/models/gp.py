"""The one GPyTorch model of gpfast: constant mean, scaled RBF kernel (gpfast's fused one or GPyTorch's)."""

from __future__ import annotations

import gpytorch
import torch

from gpfast.kernels import ScaleRBFKernel

__all__ = ["KERNELS", "ExactGPModel"]

#: Kernel choices: ``"gpfast"`` (:class:`gpfast.kernels.ScaleRBFKernel`, the fused op) or ``"gpytorch"`` (stock
#: ``ScaleKernel(RBFKernel(ard_num_dims=d))``, for side-by-side comparisons).
KERNELS = ("gpfast", "gpytorch")


class ExactGPModel(gpytorch.models.ExactGP):
    """Exact GP regression model: constant mean, scaled RBF kernel.

    The textbook GPyTorch model ``ConstantMean() + ScaleKernel(RBFKernel(ard_num_dims=d))``, with the same
    ``state_dict`` keys whichever kernel is chosen, so it trains with the usual GPyTorch loop::

        likelihood = gpytorch.likelihoods.GaussianLikelihood()
        model = ExactGPModel(train_x, train_y, likelihood)
        mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
        ...
        model.eval(); likelihood.eval()
        pred = likelihood(model(test_x))

    Parameters
    ----------
    train_x : torch.Tensor of shape (n, d)
        Training inputs (a 1-D tensor is treated as (n, 1)).
    train_y : torch.Tensor of shape (n,)
        Training targets.
    likelihood : gpytorch.likelihoods.GaussianLikelihood
        Or a compatible likelihood.
    ard : bool, default=True
        One lengthscale per input dimension (True) or a single shared lengthscale (False).
    kernel : {"gpfast", "gpytorch"} or gpytorch.kernels.Kernel, default="gpfast"
        The fused kernel or GPyTorch's (see :data:`KERNELS`), or a covariance module to use as it is.
    distributed : bool, default=False
        (gpfast kernel only) Split every covariance product by rows over the ranks of ``torch.distributed`` (see
        :mod:`gpfast.kernels.distributed`); the covariance is then always matrix-free.
    """

    def __init__(
        self,
        train_x: torch.Tensor,
        train_y: torch.Tensor,
        likelihood,
        ard: bool = True,
        kernel: str = "gpfast",
        distributed: bool = False,
    ):
        super().__init__(train_x, train_y, likelihood)
        custom = isinstance(kernel, gpytorch.kernels.Kernel)
        if not custom and kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS} or a gpytorch.kernels.Kernel, got {kernel!r}")
        if distributed and kernel != "gpfast":
            raise ValueError(f"distributed=True needs kernel='gpfast', got kernel={kernel!r}")
        d = 1 if train_x.dim() == 1 else train_x.shape[-1]
        ard_dims = d if ard else None
        self.ard = bool(ard)
        self.mean_module = gpytorch.means.ConstantMean()
        if custom:
            self.covar_module = kernel
        elif kernel == "gpfast":
            self.covar_module = ScaleRBFKernel(ard_num_dims=ard_dims, distributed=distributed)
        else:
            self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=ard_dims))

    def forward(self, x: torch.Tensor) -> gpytorch.distributions.MultivariateNormal:
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
