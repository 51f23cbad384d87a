"""gpfast.kernels against GPyTorch's own RBFKernel: the kernel test mixin, parity of values and gradients,
and an exact GP with either kernel."""

import pickle
import unittest

import gpytorch
import pytest
import torch
from gpytorch.test.base_kernel_test_case import BaseKernelTestCase

from conftest import DEVICES, rel_err
from gpfast.kernels import RBFKernel, ScaleRBFKernel
from gpfast.models import ExactGPModel


class TestRBFKernelMixin(BaseKernelTestCase, unittest.TestCase):
    def create_kernel_no_ard(self, **kwargs):
        return RBFKernel(**kwargs)

    def create_kernel_ard(self, num_dims, **kwargs):
        return RBFKernel(ard_num_dims=num_dims, **kwargs)


class TestScaleRBFKernelMixin(BaseKernelTestCase, unittest.TestCase):
    def create_kernel_no_ard(self, **kwargs):
        return ScaleRBFKernel(**kwargs)

    def create_kernel_ard(self, num_dims, **kwargs):
        return ScaleRBFKernel(ard_num_dims=num_dims, **kwargs)


def random_pair(ard, batch_shape, dtype, device, scaled):
    d = 4
    kw = dict(ard_num_dims=d if ard else None, batch_shape=batch_shape)
    if scaled:
        ours = ScaleRBFKernel(**kw)
        theirs = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(**kw), batch_shape=batch_shape)
    else:
        ours, theirs = RBFKernel(**kw), gpytorch.kernels.RBFKernel(**kw)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p))
    ours.load_state_dict(theirs.state_dict())
    return ours.to(device, dtype), theirs.to(device, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("ard,batch_shape", [(False, torch.Size()), (True, torch.Size()), (True, torch.Size([2]))])
def test_parity_with_gpytorch_float64(device, scaled, ard, batch_shape):
    ours, theirs = random_pair(ard, batch_shape, torch.float64, device, scaled)
    x1 = torch.randn(*batch_shape, 30, 4, dtype=torch.float64, device=device)
    x2 = torch.randn(*batch_shape, 20, 4, dtype=torch.float64, device=device)
    w = torch.randn(*batch_shape, 30, 20, dtype=torch.float64, device=device)
    results = []
    for k in (ours, theirs):
        a, b = x1.clone().requires_grad_(), x2.clone().requires_grad_()
        K = k(a, b).to_dense()
        grads = torch.autograd.grad((K * w).sum(), [a, b, *k.parameters()])
        results.append((K.detach(), grads))
    assert rel_err(results[0][0], results[1][0]) < 1e-10
    for g1, g2 in zip(results[0][1], results[1][1]):
        assert rel_err(g1, g2) < 1e-10
    diag1 = ours(x1, x1[..., :30, :], diag=True)
    assert rel_err(diag1, theirs(x1, x1, diag=True)) < 1e-12
    # paired rows of two different sets (not the K(x, x) = outputscale shortcut)
    x1b = torch.randn(*batch_shape, 30, 4, dtype=torch.float64, device=device)
    diag2 = ours(x1, x1b, diag=True)
    assert rel_err(diag2, theirs(x1, x1b, diag=True)) < 1e-12
    assert rel_err(diag2, ours(x1, x1b).to_dense().diagonal(dim1=-2, dim2=-1)) < 1e-12
    assert (
        diag2.max() - diag2.min() > 1e-3 * diag2.abs().max() > 0
    )  # not a constant (random lengthscales can make it tiny)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaled", [False, True])
def test_parity_with_gpytorch_float32(device, scaled):
    ours, theirs = random_pair(True, torch.Size(), torch.float32, device, scaled)
    _, ref64 = random_pair(True, torch.Size(), torch.float64, device, scaled)
    ref64.load_state_dict({k: v.double() for k, v in theirs.state_dict().items()})
    x1, x2 = torch.randn(300, 4, device=device), torch.randn(200, 4, device=device)
    w = torch.randn(300, 200, device=device)

    def value_and_grads(k, dtype):
        a, b = x1.to(dtype).requires_grad_(), x2.to(dtype).requires_grad_()
        K = k(a, b).to_dense()
        return [K, *torch.autograd.grad((K * w.to(dtype)).sum(), [a, b, *k.parameters()])]

    got, theirs32, want = (
        value_and_grads(ours, torch.float32),
        value_and_grads(theirs, torch.float32),
        value_and_grads(ref64, torch.float64),
    )
    for g, t, r in zip(got, theirs32, want):
        assert rel_err(g, r) <= 2 * rel_err(t, r) + 1e-6  # as close to float64 as GPyTorch's own float32
        assert rel_err(g, r) < 5e-5  # and float32-accurate outright (GPyTorch's own error reaches 1e-4 here)


def test_state_dict_round_trip_and_pickle():
    # float64: GPyTorch's float32 path (|a|^2 + |b|^2 - 2ab) alone can be 1e-4 off for random hyperparameters
    ours, theirs = random_pair(True, torch.Size([3]), torch.float64, "cpu", True)
    back = gpytorch.kernels.ScaleKernel(
        gpytorch.kernels.RBFKernel(ard_num_dims=4, batch_shape=torch.Size([3])), batch_shape=torch.Size([3])
    ).double()
    back.load_state_dict(ours.state_dict())
    assert set(back.state_dict()) == set(ours.state_dict())
    x = torch.randn(3, 10, 4, dtype=torch.float64)
    assert torch.allclose(back(x).to_dense(), ours(x).to_dense(), rtol=1e-10, atol=1e-12)
    clone = pickle.loads(pickle.dumps(ours))
    assert torch.equal(clone(x).to_dense(), ours(x).to_dense())


def test_input_gradients_flow():
    k = ScaleRBFKernel(ard_num_dims=3)
    x = torch.randn(15, 3, requires_grad=True)
    k(x, x).to_dense().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert k.raw_outputscale.grad is not None and k.base_kernel.raw_lengthscale.grad is not None


def test_active_dims_and_priors():
    k = ScaleRBFKernel(ard_num_dims=2, active_dims=(0, 2), lengthscale_prior=gpytorch.priors.GammaPrior(3.0, 6.0))
    x = torch.randn(12, 4)
    ref = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=2, active_dims=(0, 2)))
    ref.load_state_dict(k.state_dict(), strict=False)
    assert torch.allclose(k(x).to_dense(), ref(x).to_dense(), rtol=1e-5, atol=1e-6)
    assert any("lengthscale_prior" in name for name, *_ in k.named_priors())


def gp_loss_grads_preds(kernel, x, y, xt, dtype):
    torch.manual_seed(1)
    lik = gpytorch.likelihoods.GaussianLikelihood()
    lik.noise = 0.05  # a well-conditioned system, so CG converges to its tolerance
    model = ExactGPModel(x, y, lik, kernel=kernel).to(dtype)
    model.train(), lik.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(lik, model)
    loss = -mll(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    model.eval(), lik.eval()
    with torch.no_grad():
        pred = lik(model(xt))
        mean, var = pred.mean, pred.variance
    return loss.detach(), grads, mean, var


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["cholesky", "cg"])
def test_exact_gp_same_as_gpytorch(mode):
    torch.manual_seed(0)
    n = 300 if mode == "cholesky" else 1200
    x = torch.randn(n, 3, dtype=torch.float64)
    y = torch.sin(2 * x[:, 0]) + 0.5 * x[:, 1] ** 2 + 0.1 * torch.randn(n, dtype=torch.float64)
    xt = torch.randn(50, 3, dtype=torch.float64)
    settings = [gpytorch.settings.max_cholesky_size(10**6 if mode == "cholesky" else 0)]
    if mode == "cg":
        settings += [
            gpytorch.settings.cg_tolerance(1e-6),
            gpytorch.settings.max_cg_iterations(2000),
            gpytorch.settings.num_trace_samples(8),
            gpytorch.settings.deterministic_probes(True),
            gpytorch.settings.eval_cg_tolerance(1e-8),
        ]
    out = []
    for kern in (
        ScaleRBFKernel(ard_num_dims=3),
        gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=3)),
    ):
        with torch.no_grad():
            kern.base_kernel.lengthscale = torch.tensor([0.7, 1.2, 2.0])
            kern.outputscale = 1.3
        with settings[0]:
            if mode == "cg":
                with settings[1], settings[2], settings[3], settings[4], settings[5]:
                    out.append(gp_loss_grads_preds(kern, x, y, xt, torch.float64))
            else:
                out.append(gp_loss_grads_preds(kern, x, y, xt, torch.float64))
    (l1, g1, m1, v1), (l2, g2, m2, v2) = out
    # Under CG the log-determinant is a stochastic Lanczos estimate built from CG run to its tolerance, so the
    # two kernels agree to that level (about 1e-4), not to rounding; predictions are solves to 1e-8.
    if mode == "cholesky":
        assert abs(l1 - l2) <= 1e-9 * abs(l2)
        for a, b in zip(g1, g2):
            assert rel_err(a, b) < 1e-8
        assert rel_err(m1, m2) < 1e-9 and rel_err(v1, v2) < 1e-9
    else:
        assert abs(l1 - l2) <= 1e-3 * abs(l2)
        for a, b in zip(g1, g2):  # the same probes and CG runs: observed agreement ~4e-7
            assert rel_err(a, b) < 1e-5
        assert rel_err(m1, m2) < 1e-5 and rel_err(v1, v2) < 1e-4
