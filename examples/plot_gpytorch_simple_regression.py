"""
GPyTorch's simple-regression tutorial, with gpfast's kernel
===========================================================

GPyTorch's first tutorial ("GPyTorch Regression Tutorial") fits ``sin(2 pi x)`` plus noise with a constant
mean and ``ScaleKernel(RBFKernel())``, trained by Adam on the exact marginal log likelihood. The only change for
gpfast is the kernel: :class:`gpfast.kernels.ScaleRBFKernel` computes the same covariance in one fused op, with
the same constructor arguments, parameters and ``state_dict``. Everything else below is the tutorial's code.
"""

import math

import gpytorch
import matplotlib.pyplot as plt
import torch

import gpfast.kernels

torch.manual_seed(0)
train_x = torch.linspace(0, 1, 100)
train_y = torch.sin(train_x * (2 * math.pi)) + torch.randn(train_x.size()) * math.sqrt(0.04)


class ExactGPModel(gpytorch.models.ExactGP):
    def __init__(self, train_x, train_y, likelihood, fused=True):
        super().__init__(train_x, train_y, likelihood)
        self.mean_module = gpytorch.means.ConstantMean()
        if fused:
            self.covar_module = gpfast.kernels.ScaleRBFKernel()  # the one-line swap
        else:
            self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def train_and_predict(fused, training_iter=50):
    """The tutorial's loop: Adam (lr 0.1) on the negative exact marginal log likelihood, then predict."""
    torch.manual_seed(0)
    likelihood = gpytorch.likelihoods.GaussianLikelihood()
    model = ExactGPModel(train_x, train_y, likelihood, fused=fused)
    model.train()
    likelihood.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    for _ in range(training_iter):
        optimizer.zero_grad()
        loss = -mll(model(train_x), train_y)
        loss.backward()
        optimizer.step()
    model.eval()
    likelihood.eval()
    test_x = torch.linspace(0, 1, 51)
    with torch.no_grad(), gpytorch.settings.fast_pred_var():
        pred = likelihood(model(test_x))
    return model, likelihood, loss.item(), test_x, pred


model, likelihood, loss, test_x, pred = train_and_predict(fused=True)
print(
    f"gpfast kernel: loss {loss:.4f}, lengthscale {model.covar_module.base_kernel.lengthscale.item():.4f}, "
    f"noise {likelihood.noise.item():.4f}"
)

# %%
# The same fit with GPyTorch's own kernel lands on the same hyperparameters and predictions, up to float32
# rounding: the swap changes how the covariance is computed, not what it is.

ref_model, ref_likelihood, ref_loss, _, ref_pred = train_and_predict(fused=False)
print(
    f"GPyTorch kernel: loss {ref_loss:.4f}, "
    f"lengthscale {ref_model.covar_module.base_kernel.lengthscale.item():.4f}, "
    f"noise {ref_likelihood.noise.item():.4f}"
)
print(f"largest difference of the predictive means: {(pred.mean - ref_pred.mean).abs().max().item():.2e}")
print("state_dict keys are the same:", list(model.state_dict()) == list(ref_model.state_dict()))

# %%
# The tutorial's plot: the data, the predictive mean and two standard deviations either side.

lower, upper = pred.confidence_region()
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(train_x.numpy(), train_y.numpy(), "k*", label="observed data")
ax.plot(test_x.numpy(), pred.mean.numpy(), "b", label="mean")
ax.fill_between(test_x.numpy(), lower.numpy(), upper.numpy(), alpha=0.5, label="confidence (2 std)")
ax.set_ylim(-3, 3)
ax.legend(fontsize=8)
fig.tight_layout()
