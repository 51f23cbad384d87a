"""RBFLinearOperator against the dense covariance, and an exact GP run matrix-free against the dense one."""

import gpytorch
import pytest
import torch

from conftest import DEVICES, rel_err
from gpfast import _reference as ref
from gpfast.kernels import RBFLinearOperator, ScaleRBFKernel


def make(device, dtype=torch.float64, batch=(), n=70, m=50, d=3):
    x1 = torch.randn(*batch, n, d, device=device, dtype=dtype)
    x2 = torch.randn(*batch, m, d, device=device, dtype=dtype)
    l = (torch.rand(*batch, 1, d, device=device, dtype=dtype) + 0.5).requires_grad_()
    s = (torch.rand(tuple(batch), device=device, dtype=dtype) + 0.5).requires_grad_()
    return x1, x2, l, s


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", [(), (2,)])
def test_products_diagonal_and_rows(device, batch):
    x1, x2, l, s = make(device, batch=batch)
    op = RBFLinearOperator(x1, x2, l, s)
    K = ref.rbf_covariance(x1, x2, l, s).detach()
    assert op.shape == K.shape
    v = torch.randn(*batch, 50, 4, device=device, dtype=torch.float64)
    assert rel_err(op._matmul(v).detach(), K @ v) < 1e-12
    u = torch.randn(*batch, 70, 3, device=device, dtype=torch.float64)
    assert rel_err(op._t_matmul(u).detach(), K.transpose(-1, -2) @ u) < 1e-12
    assert rel_err(op.to_dense().detach(), K) < 1e-12
    sq = RBFLinearOperator(x1, x1, l, s)
    Ksq = ref.rbf_covariance(x1, x1, l, s).detach()
    assert rel_err(sq._diagonal().detach(), Ksq.diagonal(dim1=-2, dim2=-1)) < 1e-14
    x3 = torch.randn_like(x1)  # square but x1 != x2: the diagonal is not the outputscale
    pair = RBFLinearOperator(x1, x3, l, s)
    want = ref.rbf_covariance(x1, x3, l, s).detach().diagonal(dim1=-2, dim2=-1)
    assert rel_err(pair._diagonal().detach(), want) < 1e-14 and want.std() > 1e-3
    rows = torch.tensor([3, 0, 69], device=device)
    cols = torch.tensor([1, 49, 7], device=device)
    bidx = [torch.tensor([1, 0, 1], device=device)] if batch else []  # both batch members, in mixed order
    got = op._get_indices(rows, cols, *bidx).detach()
    assert rel_err(got, K[(*bidx, rows, cols)]) < 1e-14
    assert rel_err(op[..., rows, :].to_dense().detach(), K[..., rows, :]) < 1e-12


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shared", [False, True])
def test_entries_and_their_gradients(device, shared):
    # _get_indices on a batch of 3 with repeated and mixed indices (as linear_operator's pivoted-Cholesky backward
    # asks for them): the dense reference's entries, and the same gradients for the points and hyperparameters
    f64 = dict(dtype=torch.float64, device=device)
    x1 = torch.randn(*(() if shared else (3,)), 40, 3, **f64).requires_grad_()  # shared: points broadcast
    x2 = torch.randn(3, 30, 3, **f64).requires_grad_()
    l = (torch.rand(3, 1, 3, **f64) + 0.5).requires_grad_()
    s = (torch.rand(3, **f64) + 0.5).requires_grad_()
    g = torch.Generator().manual_seed(5)
    rows, cols = torch.randint(0, 40, (2, 50), generator=g).to(device), torch.randint(0, 30, (50,), generator=g)
    members = torch.randint(0, 3, (2, 1), generator=g).to(device)  # broadcast against the (2, 50) rows
    got = RBFLinearOperator(x1, x2, l, s)._get_indices(rows, cols.to(device), members)
    want = ref.rbf_covariance(x1, x2, l, s)[members, rows, cols.to(device)]
    assert got.shape == want.shape == (2, 50) and rel_err(got.detach(), want.detach()) < 1e-14
    w = torch.randn(2, 50, **f64)
    for a, b in zip(
        torch.autograd.grad((got * w).sum(), [x1, x2, l, s]), torch.autograd.grad((want * w).sum(), [x1, x2, l, s])
    ):
        assert rel_err(a, b) < 1e-12


@pytest.mark.parametrize("device", DEVICES)
def test_bilinear_derivative_matches_dense(device):
    x1, x2, l, s = make(device)
    op = RBFLinearOperator(x1, x2, l, s)
    left, right = (
        torch.randn(70, 5, dtype=torch.float64, device=device),
        torch.randn(50, 5, dtype=torch.float64, device=device),
    )
    got = op._bilinear_derivative(left, right)
    assert got[0] is None and got[1] is None  # x1, x2 need no gradient
    K = ref.rbf_covariance(x1, x2, l, s)
    want = torch.autograd.grad((left * (K @ right)).sum(), [l, s])
    assert rel_err(got[2], want[0]) < 1e-12 and rel_err(got[3], want[1]) < 1e-12


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", [(), (2,)])
def test_bilinear_derivative_is_the_fused_backward_alone(device, batch, monkeypatch):
    """No forward product is computed, point gradients come only when asked for, and every gradient has its
    argument's shape (shared lengthscale, broadcast batch dims)."""
    from gpfast import ops

    calls = []
    real = ops.rbf_matmul
    monkeypatch.setattr(ops, "rbf_matmul", lambda *a, **k: calls.append(1) or real(*a, **k))
    f64 = dict(dtype=torch.float64, device=device)
    x1 = torch.randn(*batch, 40, 3, **f64).requires_grad_()
    x2 = torch.randn(30, 3, **f64).requires_grad_()
    ls = torch.tensor([[0.9]], **f64).requires_grad_()  # one lengthscale shared by the 3 dims, not batched
    s = (torch.rand(batch, **f64) + 0.5).requires_grad_()
    left, right = torch.randn(*batch, 40, 4, **f64), torch.randn(*batch, 30, 4, **f64)
    got = RBFLinearOperator(x1, x2, ls, s)._bilinear_derivative(left, right)
    assert calls == []
    K = ref.rbf_covariance(x1, x2, ls, s)
    want = torch.autograd.grad((left * (K @ right)).sum(), [x1, x2, ls, s])
    for g, w in zip(got, want):
        assert g.shape == w.shape and rel_err(g, w) < 1e-12


@pytest.mark.parametrize("device", DEVICES)
def test_zero_right_hand_side_costs_nothing(device, monkeypatch):
    from gpfast import ops

    calls = []
    real = ops.rbf_matmul
    monkeypatch.setattr(ops, "rbf_matmul", lambda *a, **k: calls.append(1) or real(*a, **k))
    x1, x2, ls, s = make(device, batch=(2,))
    op = RBFLinearOperator(x1, x2, ls, s)
    zero = torch.zeros(2, 50, 3, dtype=torch.float64, device=device)
    out = op._matmul(zero)
    assert calls == [] and out.shape == (2, 70, 3) and not out.any()
    assert op._matmul(torch.zeros(50, dtype=torch.float64, device=device)).shape == (2, 70)
    v = torch.randn(50, 3, dtype=torch.float64, device=device)
    assert rel_err(op._matmul(v).detach(), ref.rbf_covariance(x1, x2, ls, s).detach() @ v) < 1e-12
    assert calls == [1]


class _GP(gpytorch.models.ExactGP):
    def __init__(self, x, y, lik, threshold):
        super().__init__(x, y, lik)
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = ScaleRBFKernel(ard_num_dims=x.shape[-1], matrix_free_threshold=threshold)

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def run_gp(threshold, x, y, xt):
    torch.manual_seed(3)
    lik = gpytorch.likelihoods.GaussianLikelihood()
    lik.noise = 0.05
    model = _GP(x, y, lik, threshold).to(x.dtype)
    with torch.no_grad():
        model.covar_module.base_kernel.lengthscale = torch.tensor([0.8, 1.1, 1.6, 0.9])
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(lik, model)
    with (
        gpytorch.settings.max_cholesky_size(0),
        gpytorch.settings.cg_tolerance(1e-4),
        gpytorch.settings.num_trace_samples(10),
        gpytorch.settings.eval_cg_tolerance(1e-6),
        gpytorch.settings.max_preconditioner_size(15),
    ):
        loss = -mll(model(x), y)
        grads = torch.autograd.grad(loss, list(model.parameters()))
        model.eval(), lik.eval()
        with torch.no_grad(), gpytorch.settings.fast_pred_var(False):
            pred = lik(model(xt))
            mean, var = pred.mean, pred.variance
    return loss.detach(), grads, mean, var, model


def test_exact_gp_matrix_free_equals_dense():
    torch.manual_seed(0)
    n = 1000
    x = torch.randn(n, 4, dtype=torch.float64)
    y = torch.sin(2 * x[:, 0]) * torch.cos(x[:, 1]) + 0.3 * x[:, 2] + 0.1 * torch.randn(n, dtype=torch.float64)
    xt = torch.randn(40, 4, dtype=torch.float64)
    l_free, g_free, m_free, v_free, model = run_gp(0, x, y, xt)  # every covariance matrix-free
    l_dense, g_dense, m_dense, v_dense, _ = run_gp(None, x, y, xt)
    assert isinstance(model.covar_module(x).evaluate_kernel(), RBFLinearOperator)
    # the log-determinant is a stochastic Lanczos estimate whose tridiagonal coefficients come from CG run to
    # cg_tolerance (1e-4): the two operators agree to that level, not to rounding
    assert abs(l_free - l_dense) < 1e-3 * abs(l_dense)
    for a, b in zip(g_free, g_dense):
        assert rel_err(a, b) < 1e-2
    # predictions are deterministic solves to eval_cg_tolerance (1e-6)
    assert rel_err(m_free, m_dense) < 1e-5 and rel_err(v_free, v_dense) < 1e-4
