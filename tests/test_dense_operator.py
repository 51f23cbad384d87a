"""DenseRBFOperator: the stored K the kernels return below the matrix-free threshold. Everything that reads the
matrix must behave as a DenseLinearOperator over K; GPyTorch's marginal-likelihood derivative must come from the
stored K (stored_backward) and agree with K's own autograd; the fall-backs must keep every gradient."""

import unittest

import gpytorch
import pytest
import torch
from conftest import DEVICES, rel_err
from linear_operator.operators import DenseLinearOperator
from linear_operator.test.linear_operator_test_case import LinearOperatorTestCase, RectangularLinearOperatorTestCase

from gpfast import _reference as ref
from gpfast import ops
from gpfast.kernels import DenseRBFOperator, RBFKernel, RBFLinearOperator, ScaleRBFKernel
from gpfast.kernels import rbf as rbf_module

F64 = torch.float64


def make_op(n, m, d, dtype=F64, device="cpu", same=False, seed=None):
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    x1 = torch.randn(n, d, generator=g, dtype=dtype).to(device)
    x2 = x1 if same else torch.randn(m, d, generator=g, dtype=dtype).to(device)
    l = (0.5 + torch.rand(1, d, generator=g, dtype=dtype)).to(device).requires_grad_()
    s = (0.5 + torch.rand((), generator=g, dtype=dtype)).to(device).requires_grad_()
    return DenseRBFOperator.from_points(x1, x2, l, s)


def counting(monkeypatch, name):
    calls = []
    real = getattr(ops, name)
    monkeypatch.setattr(ops, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


# ---------------------------------------------------------------------------------- linear_operator's own suites


class _Reference:
    """The suites' dense reference: the plain torch formula (gpfast._reference) on the operator's own tensors."""

    def evaluate_linear_op(self, linear_op):
        return ref.rbf_covariance(linear_op.x1, linear_op.x2, linear_op.lengthscale, linear_op.outputscale)


class TestSquareDenseRBFOperator(_Reference, LinearOperatorTestCase, unittest.TestCase):
    """K(x, x) of 6 points: every method the suite exercises. Its tests set requires_grad on every representation
    tensor, the points too, so their gradients come from the fused backward (the fall-back), the reference's from
    autograd. The outputscale puts the log-determinant at about 5.6, where the suite's stochastic estimate (relative
    tolerance 0.2) holds; at s = 1.3 it is 0.14 and the estimate missed it."""

    seed = 0
    should_test_sample = True

    def create_linear_op(self):
        x = torch.randn(6, 3, generator=torch.Generator().manual_seed(12))
        l = (0.4 + torch.rand(1, 3, generator=torch.Generator().manual_seed(13))).requires_grad_()
        s = torch.tensor(2.5).requires_grad_()
        return DenseRBFOperator.from_points(x, x, l, s)


class TestRectangularDenseRBFOperator(_Reference, RectangularLinearOperatorTestCase, unittest.TestCase):
    seed = 0

    def create_linear_op(self):
        g = torch.Generator().manual_seed(11)
        x1, x2 = torch.randn(5, 3, generator=g), torch.randn(4, 3, generator=g)
        l = (0.4 + torch.rand(1, 3, generator=g)).requires_grad_()
        s = torch.tensor(0.8).requires_grad_()
        return DenseRBFOperator.from_points(x1, x2, l, s)


class TestBatchDenseRBFOperator(_Reference, LinearOperatorTestCase, unittest.TestCase):
    """A batch of two K(x, x) with their own hyperparameters (GPyTorch's batch_shape kernels)."""

    seed = 0
    should_test_sample = True

    def create_linear_op(self):
        g = torch.Generator().manual_seed(14)
        x = torch.randn(2, 6, 3, generator=g)
        l = (0.4 + torch.rand(2, 1, 3, generator=g)).requires_grad_()
        s = torch.tensor([2.5, 1.8]).requires_grad_()
        return DenseRBFOperator.from_points(x, x, l, s)


# ----------------------------------------------------------------------------------------- the derivative itself


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("same", [True, False])
def test_stored_derivative_matches_float64(device, same, monkeypatch):
    # float64: the stored-K derivative against autograd through the float64 covariance, to rounding
    calls = counting(monkeypatch, "stored_backward")
    op = make_op(90, 90 if same else 70, 4, device=device, same=same)
    left = torch.randn(90, 11, dtype=F64, device=device)
    right = torch.randn(op.shape[-1], 11, dtype=F64, device=device)
    got = op._stored_derivative(left, right)
    assert calls == [1] and got[:2] == (None, None)
    K = ref.rbf_covariance(op.x1, op.x2, op.lengthscale, op.outputscale)
    want = torch.autograd.grad((left * (K @ right)).sum(), [op.lengthscale, op.outputscale])
    assert got[2].shape == op.lengthscale.shape and got[3].shape == op.outputscale.shape
    assert rel_err(got[2], want[0]) < 1e-11 and rel_err(got[3], want[1]) < 1e-11


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_derivative_from_stored_k_for_float32_on_cuda_only(device, dtype, monkeypatch):
    # the stored K's kernel for float32 on CUDA; on the CPU the matrix-free fused backward; for float64 on CUDA the
    # covariance backward over left @ right^T; each the gradient of the same bilinear form (float64 reference)
    stored, free = counting(monkeypatch, "stored_backward"), counting(monkeypatch, "rbf_matmul_backward")
    dense = counting(monkeypatch, "rbf_covariance_backward")
    op = make_op(120, 120, 5, dtype=dtype, device=device, same=True)
    left, right = (torch.randn(120, 11, dtype=dtype, device=device) for _ in range(2))
    got = op._bilinear_derivative(left, right)
    from_k = device == "cuda" and dtype == torch.float32
    want_calls = (1, 0, 0) if from_k else (0, 1, 0) if device == "cpu" else (0, 0, 1)
    assert (len(stored), len(free), len(dense)) == want_calls
    x, l, s = (a.detach().double().cpu() for a in (op.x1, op.lengthscale, op.outputscale))
    l, s = l.requires_grad_(), s.requires_grad_()
    L, R = left.double().cpu(), right.double().cpu()
    want = torch.autograd.grad((L * (ref.rbf_covariance(x, x, l, s) @ R)).sum(), [l, s])
    # float32 from the stored K carries K's rounding, which the next test bounds term by term; here the check is
    # that this is the gradient of this form (a wrong term or factor is off by its own size)
    tol = 1e-2 if from_k else 1e-11 if dtype == F64 else 1e-5
    assert got[:2] == (None, None)
    for g, w in zip(got[2:], want):
        assert g.shape == w.shape and rel_err(g.cpu(), w) < tol


@pytest.mark.parametrize("device", DEVICES)
def test_bilinear_derivative_float32_within_the_rounding_of_k(device):
    # the stored-K derivative in float32 (on CUDA the tensor-core kernel, on the CPU the float64 form on the float32
    # K), fresh points each run, against float64 arithmetic on the float64 K. Two errors add up: the difference
    # between the float32 K and the float64 one, which enters each term as |W_ij| |dK_ij| (its exact first-order
    # effect, summed with absolute values), and stored_backward's own on the K it is given (its test's bound: 1e-5
    # of the sums with |W|, plus 2^-23 of the value)
    op = make_op(300, 300, 6, dtype=torch.float32, device=device, same=True)
    left, right = torch.randn(300, 11, device=device), torch.randn(300, 11, device=device)
    _, _, gl, gs = op._stored_derivative(left, right)
    x, l, s = (a.detach().double().cpu() for a in (op.x1, op.lengthscale, op.outputscale))
    L, R = left.double().cpu(), right.double().cpu()
    l64, s64 = l.clone().requires_grad_(), s.clone().requires_grad_()
    K64 = ref.rbf_covariance(x, x, l64, s64)
    want_l, want_s = torch.autograd.grad((L * (K64 @ R)).sum(), [l64, s64])
    want_l = want_l.reshape(-1)
    W = L.abs() @ R.abs().t()
    dK = (op.tensor.detach().double().cpu() - K64.detach()).abs()
    dK = torch.maximum(dK, dK.t())  # K(x, x)'s kernel reads one triangle of K for both orders of a pair
    z = x / l
    sq = (z.unsqueeze(1) - z.unsqueeze(0)).pow(2)  # (n, n, d)

    def sums(A):  # the gradients' sums with A_ij for the weights times K, with absolute values
        return (A.unsqueeze(-1) * sq).sum((0, 1)) / l.reshape(-1), A.sum() / s

    k_l, k_s = sums(W * dK)
    scale_l, scale_s = sums(W * K64.detach())
    err_l = (gl.double().cpu().reshape(-1) - want_l).abs()
    assert (err_l <= k_l + 1e-5 * scale_l + 2**-23 * want_l.abs()).all(), (err_l / scale_l).max()
    assert abs(gs.double().cpu() - want_s) <= k_s + 1e-5 * scale_s + 2**-23 * abs(want_s)


def test_no_gradient_wanted_costs_nothing(monkeypatch):
    stored, free = counting(monkeypatch, "stored_backward"), counting(monkeypatch, "rbf_matmul_backward")
    op = make_op(20, 20, 2, same=True)
    frozen = DenseRBFOperator(op.x1, op.x2, op.lengthscale.detach(), op.outputscale.detach())
    assert frozen._bilinear_derivative(torch.randn(20, 3, dtype=F64), torch.randn(20, 3, dtype=F64)) == (None,) * 4
    assert stored == [] and free == []


@pytest.mark.parametrize("device", DEVICES)
def test_points_that_need_gradients_take_the_fused_backward(device, monkeypatch):
    # deep-kernel learning: x requires grad, so the derivative is the matrix-free operator's fused backward, which
    # gives the points' gradients too (x1 and x2 one tensor: each gets the full gradient, autograd adds them)
    calls = counting(monkeypatch, "stored_backward")
    x = torch.randn(40, 3, dtype=F64, device=device).requires_grad_()
    l = torch.tensor([[0.7, 1.1, 0.9]], dtype=F64, device=device).requires_grad_()
    s = torch.tensor(1.2, dtype=F64, device=device).requires_grad_()
    op = DenseRBFOperator.from_points(x, x, l, s)
    left, right = torch.randn(40, 5, dtype=F64, device=device), torch.randn(40, 5, dtype=F64, device=device)
    got = op._bilinear_derivative(left, right)
    assert calls == []
    x1 = x.detach().clone().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    K = ref.rbf_covariance(x1, x2, l, s)
    want = torch.autograd.grad((left * (K @ right)).sum(), [x1, x2, l, s])
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-12


def test_k_is_recomputed_only_when_its_sources_change(monkeypatch):
    op = make_op(25, 25, 3, same=True)
    calls = counting(monkeypatch, "rbf_covariance")
    K = op.to_dense()
    assert calls == [] and K.requires_grad  # computed by from_points, with its autograd history
    clone = op.clone()  # new tensors of the same values: K recomputed from them, so autograd reaches them
    Kc = clone.to_dense()
    assert calls == [1] and torch.equal(Kc, K)
    (g_clone,) = torch.autograd.grad(Kc.sum(), [clone.lengthscale], allow_unused=True)
    assert g_clone is not None  # the stored K would not reach the clone's lengthscale
    x = op.x1.detach()
    frozen = DenseRBFOperator.from_points(x, x, op.lengthscale, op.outputscale)
    frozen.to_dense()
    assert len(calls) == 2  # from_points, and no recomputation
    x.requires_grad_()  # points that start to require grad after K was computed: K again, with them in its history
    (g_x,) = torch.autograd.grad(frozen.to_dense().sum(), [x])
    assert len(calls) == 3 and g_x.shape == x.shape


@pytest.mark.parametrize("device", DEVICES)
def test_batch_derivative_shapes_and_values(device):
    # shared points, a lengthscale and an outputscale per batch member: each gradient in its argument's shape
    x = torch.randn(40, 3, dtype=F64, device=device)
    l = (0.5 + torch.rand(2, 1, 3, dtype=F64, device=device)).requires_grad_()
    s = (0.5 + torch.rand(2, dtype=F64, device=device)).requires_grad_()
    op = DenseRBFOperator.from_points(x, x, l, s)
    left, right = (torch.randn(2, 40, 4, dtype=F64, device=device) for _ in range(2))
    got = op._bilinear_derivative(left, right)
    want = torch.autograd.grad((left * (ref.rbf_covariance(x, x, l, s) @ right)).sum(), [l, s])
    assert got[:2] == (None, None)
    for g, w in zip(got[2:], want):
        assert g.shape == w.shape and rel_err(g, w) < 1e-11


@pytest.mark.parametrize("device", DEVICES)
def test_products_and_reshaping(device, monkeypatch):
    op = make_op(30, 20, 3, device=device)
    K = op.tensor.detach()
    v = torch.randn(20, 4, dtype=F64, device=device)
    calls = counting(monkeypatch, "dense_matmul")
    assert rel_err(op._matmul(v).detach(), K @ v) < 1e-14
    assert rel_err(op._matmul(v[:, 0]).detach(), K @ v[:, 0]) < 1e-14
    assert calls == ([1, 1] if device == "cuda" else [])  # gpfast's stored product on CUDA, torch.matmul on the CPU
    # indexing and batch reshaping give plain dense operators of the same values
    for sub in (op[2:7, 1:4], op.expand(2, 30, 20), op.unsqueeze(0), op[..., 1:3, :]):
        assert type(sub) is DenseLinearOperator
    assert torch.equal(op[2:7, 1:4].to_dense(), op.tensor[2:7, 1:4])
    assert torch.equal(op.expand(2, 30, 20).to_dense()[1], op.tensor)


# ------------------------------------------------------------------------------------------ through the kernels


def test_kernels_return_the_operator():
    x = torch.randn(30, 3)
    for kern in (RBFKernel(ard_num_dims=3), ScaleRBFKernel(ard_num_dims=3)):
        out = kern(x).evaluate_kernel()
        assert isinstance(out, DenseRBFOperator)
        assert out.x1 is x and out.x2 is x and out.outputscale.numel() == 1
        assert kern(x, diag=True).shape == (30,)
    batched = ScaleRBFKernel(ard_num_dims=3, batch_shape=torch.Size([2]))(x).evaluate_kernel()
    assert isinstance(batched, DenseRBFOperator) and batched.shape == (2, 30, 30)
    want = ref.rbf_covariance(x, x, batched.lengthscale[1], batched.outputscale[1])
    assert rel_err(batched.to_dense()[1].detach(), want.detach()) < 1e-6
    assert RBFKernel()(torch.randn(2, 30, 3)).evaluate_kernel().shape == (2, 30, 30)


def test_default_threshold_keeps_the_stored_k_within_a_share_of_memory(monkeypatch):
    # a batch of 2 K(x, x) of 30 x 30 float32 entries takes 7,200 bytes: stored while that is at most a quarter of
    # the device's memory, matrix-free past it; an explicit threshold decides alone, whatever the memory
    x = torch.randn(30, 3)
    kern = ScaleRBFKernel(ard_num_dims=3, batch_shape=torch.Size([2]))
    monkeypatch.setitem(rbf_module._device_memory, "cpu", 4 * 7_200)
    assert isinstance(kern(x).evaluate_kernel(), DenseRBFOperator)
    assert isinstance(RBFKernel()(x).evaluate_kernel(), DenseRBFOperator)
    monkeypatch.setitem(rbf_module._device_memory, "cpu", 4 * 7_200 - 4)
    assert isinstance(kern(x).evaluate_kernel(), RBFLinearOperator)
    assert isinstance(RBFKernel()(x).evaluate_kernel(), DenseRBFOperator)  # one matrix: 3,600 bytes
    explicit = {"ard_num_dims": 3, "batch_shape": torch.Size([2])}
    assert isinstance(ScaleRBFKernel(**explicit, matrix_free_threshold=30 * 30)(x).evaluate_kernel(), DenseRBFOperator)
    assert isinstance(ScaleRBFKernel(matrix_free_threshold=30 * 30 - 1)(x).evaluate_kernel(), RBFLinearOperator)
    monkeypatch.setitem(rbf_module._device_memory, "cpu", None)  # unknown memory: the entry count alone
    assert isinstance(kern(x).evaluate_kernel(), DenseRBFOperator)
    assert rbf_module._total_memory(torch.device("meta")) is None


def gp_grads(kern, x, y, probes_seed=0):
    batch = kern.batch_shape  # a batch of independent GPs (one per output) on the same inputs
    if batch:
        y = torch.stack([y, y.flip(0)]).reshape(*batch, -1)
    lik = gpytorch.likelihoods.GaussianLikelihood(batch_shape=batch).to(x.dtype)
    lik.noise = 0.05

    class GP(gpytorch.models.ExactGP):
        def __init__(self):
            super().__init__(x, y, lik)
            self.mean_module = gpytorch.means.ConstantMean(batch_shape=batch)
            self.covar_module = kern

        def forward(self, z):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(z), self.covar_module(z))

    model = GP().to(x.dtype)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(lik, model)
    torch.manual_seed(probes_seed)
    with (
        gpytorch.settings.max_cholesky_size(0),
        gpytorch.settings.cg_tolerance(1e-6),
        gpytorch.settings.max_cg_iterations(2000),
        gpytorch.settings.num_trace_samples(8),
        gpytorch.settings.deterministic_probes(True),
    ):
        loss = -mll(model(x), y).sum()
        names = [n for n, _ in model.named_parameters()]
        grads = torch.autograd.grad(loss, list(model.parameters()))
    return loss.detach(), dict(zip(names, grads))


def set_hypers(kern, lengthscale, outputscale=None):
    base = kern.base_kernel if hasattr(kern, "base_kernel") else kern
    with torch.no_grad():
        base.lengthscale = lengthscale
        if outputscale is not None:
            kern.outputscale = outputscale
    return kern


@pytest.mark.parametrize(
    "build",
    [
        lambda: ScaleRBFKernel(ard_num_dims=3),
        lambda: gpytorch.kernels.ScaleKernel(RBFKernel(ard_num_dims=3)),  # GPyTorch's scale over gpfast's RBF
        lambda: ScaleRBFKernel(ard_num_dims=3) + gpytorch.kernels.ScaleKernel(gpytorch.kernels.LinearKernel()),
        lambda: ScaleRBFKernel(ard_num_dims=3) * gpytorch.kernels.PeriodicKernel(),
        lambda: ScaleRBFKernel(ard_num_dims=3, batch_shape=torch.Size([2])),
    ],
    ids=["scale_rbf", "gpytorch_scale", "sum", "product", "batch"],
)
def test_cg_marginal_likelihood_same_as_gpytorch(build, monkeypatch):
    # GPyTorch's CG path (every solve by mBCG, the derivative by _bilinear_derivative), the same probes and CG runs
    # with gpfast's kernels and with GPyTorch's: the same loss and gradients up to CG's tolerance
    calls = counting(monkeypatch, "stored_backward")
    free = counting(monkeypatch, "rbf_matmul_backward")
    torch.manual_seed(1)
    x = torch.randn(400, 3, dtype=F64)
    y = torch.sin(2 * x[:, 0]) + 0.5 * x[:, 1] ** 2 + 0.1 * torch.randn(400, dtype=F64)
    ls = torch.tensor([0.7, 1.2, 2.0])

    def stock(kern):  # the same structure with GPyTorch's RBF kernels in place of gpfast's
        if isinstance(kern, ScaleRBFKernel):
            b = kern.batch_shape
            return gpytorch.kernels.ScaleKernel(
                gpytorch.kernels.RBFKernel(ard_num_dims=3, batch_shape=b), batch_shape=b
            )
        if isinstance(kern, RBFKernel):
            return gpytorch.kernels.RBFKernel(ard_num_dims=3)
        if isinstance(kern, gpytorch.kernels.ScaleKernel):
            return gpytorch.kernels.ScaleKernel(stock(kern.base_kernel))
        if isinstance(kern, (gpytorch.kernels.AdditiveKernel, gpytorch.kernels.ProductKernel)):
            return type(kern)(*(stock(k) for k in kern.kernels))
        return type(kern)()

    ours = build()
    theirs = stock(ours)
    theirs.load_state_dict(ours.state_dict())
    for kern in (ours, theirs):
        for mod in kern.modules():
            if isinstance(mod, (RBFKernel, gpytorch.kernels.RBFKernel)):
                set_hypers(mod, ls)
    loss_ours, g_ours = gp_grads(ours, x, y)
    fast_calls = len(calls) + len(free)
    loss_theirs, g_theirs = gp_grads(theirs, x, y)
    # the product kernel multiplies dense matrices (linear_operator's rule for a DenseLinearOperator factor), so its
    # derivative is K's autograd; the others take the operator's (here, float64 on the CPU, the fused backward)
    assert (fast_calls == 0) == isinstance(ours, gpytorch.kernels.ProductKernel)
    # the two kernels' K differ in their last bits, so the CG iterates part at CG's tolerance (1e-6) and the
    # stochastic Lanczos estimate with them: agreement to about 1e-5 was seen, far below any error in the
    # derivative's formula (a wrong term moves a gradient by its own size)
    assert abs(loss_ours - loss_theirs) <= 1e-4 * abs(loss_theirs)
    assert g_ours.keys() == g_theirs.keys()
    for name in g_ours:
        assert rel_err(g_ours[name], g_theirs[name]) < 1e-4, name
