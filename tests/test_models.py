"""Tests of gpfast.models: the GPyTorch model and the exact float64 Cholesky routines."""

from __future__ import annotations

import math

import gpytorch
import numpy as np
import pytest
import torch

import gpfast.models.exact_posterior as chol
from conftest import DEVICES, poison_allocator
from gpfast.models import (
    CholeskyError,
    CholeskyJitterWarning,
    ExactGPModel,
    ExactPosterior,
    robust_cholesky,
)

F64 = torch.float64
BIG = 10**9


def _seed():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    torch.manual_seed(seed)
    return seed


def _rbf(a, b, ls, os_):
    d = (a.unsqueeze(-2) - b.unsqueeze(-3)) / ls
    return os_ * torch.exp(-0.5 * d.pow(2).sum(-1))


def _data(n=30, d=3, n_test=20):
    x = torch.randn(n, d, dtype=F64)
    y = torch.sin(x.sum(-1)) + 0.1 * torch.randn(n, dtype=F64)
    xt = torch.randn(n_test, d, dtype=F64)
    ls = 0.5 + torch.rand(1, d, dtype=F64)
    os_ = 0.5 + float(torch.rand(()))
    noise = 0.01 + 0.2 * float(torch.rand(()))
    mean = float(torch.randn(())) * 0.3
    return x, y, xt, ls, os_, noise, mean


class _PlainGPyTorch(gpytorch.models.ExactGP):
    """The textbook GPyTorch model gpfast's ExactGPModel replaces."""

    def __init__(self, x, y, likelihood, ard=True):
        super().__init__(x, y, likelihood)
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(
            gpytorch.kernels.RBFKernel(ard_num_dims=x.shape[-1] if ard else None)
        )

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def _set_hypers(model, ls, os_, noise, mean):
    # float64 tensors: GPyTorch would round Python floats through float32
    t = lambda v: torch.as_tensor(v, dtype=F64)  # noqa: E731
    model.covar_module.base_kernel.lengthscale = t(ls)
    model.covar_module.outputscale = t(os_)
    model.likelihood.noise = t(noise)
    model.mean_module.constant = t(mean)


# ----------------------------------------------------------------------------------------------------------
# ExactGPModel
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ard", [True, False])
def test_model_state_dict_matches_plain_gpytorch(ard):
    x = torch.randn(10, 4)
    y = torch.randn(10)
    ours = ExactGPModel(x, y, gpytorch.likelihoods.GaussianLikelihood(), ard=ard)
    plain = _PlainGPyTorch(x, y, gpytorch.likelihoods.GaussianLikelihood(), ard=ard)
    sd_ours, sd_plain = ours.state_dict(), plain.state_dict()
    assert list(sd_ours.keys()) == list(sd_plain.keys())
    for k in sd_plain:
        assert sd_ours[k].shape == sd_plain[k].shape, k
    assert ours.covar_module.base_kernel.lengthscale.shape == (1, 4 if ard else 1)
    # the state dicts are interchangeable
    plain.load_state_dict(sd_ours)
    ours.load_state_dict(sd_plain)


@pytest.mark.parametrize("ard", [True, False])
def test_model_mll_and_posterior_equal_plain_gpytorch(ard):
    seed = _seed()
    x, y, xt, ls, os_, noise, mean = _data()
    if not ard:
        ls = ls[:, :1]
    models = []
    for cls in (ExactGPModel, _PlainGPyTorch):
        lik = gpytorch.likelihoods.GaussianLikelihood()
        m = cls(x, y, lik, ard=ard).to(F64)
        _set_hypers(m, ls, os_, noise, mean)
        models.append(m)
    with gpytorch.settings.max_cholesky_size(BIG):
        mlls = [gpytorch.mlls.ExactMarginalLogLikelihood(m.likelihood, m)(m(x), y) for m in models]
        torch.testing.assert_close(mlls[0], mlls[1], rtol=1e-10, atol=1e-12, msg=f"seed {seed}")
        for m in models:
            m.eval()
        with torch.no_grad():
            preds = [m.likelihood(m(xt)) for m in models]
    out = models[0](xt)
    assert isinstance(out, gpytorch.distributions.MultivariateNormal)
    torch.testing.assert_close(preds[0].mean, preds[1].mean, rtol=1e-9, atol=1e-10, msg=f"seed {seed}")
    torch.testing.assert_close(preds[0].variance, preds[1].variance, rtol=1e-9, atol=1e-10, msg=f"seed {seed}")


def test_model_trains_with_plain_gpytorch_loop():
    _seed()
    x = torch.rand(60, 2) * 4 - 2
    y = torch.sin(2 * x[:, 0]) * x[:, 1] + 0.05 * torch.randn(60)
    lik = gpytorch.likelihoods.GaussianLikelihood()
    model = ExactGPModel(x, y, lik)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(lik, model)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    losses = []
    model.train()
    lik.train()
    for _ in range(40):
        opt.zero_grad()
        loss = -mll(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5
    model.eval()
    lik.eval()
    with torch.no_grad(), pytest.warns(gpytorch.utils.warnings.GPInputWarning):
        pred = lik(model(x))  # predicting at the training inputs is deliberate here
    assert float((pred.mean - y).pow(2).mean().sqrt()) < 0.3


# ----------------------------------------------------------------------------------------------------------
# the exact log marginal likelihood
# ----------------------------------------------------------------------------------------------------------
def test_log_marginal_likelihood_matches_scipy_and_gpytorch():
    scipy_stats = pytest.importorskip("scipy.stats")
    seed = _seed()
    x, y, _, ls, os_, noise, mean = _data(n=40)
    K = _rbf(x, x, ls, os_)
    ours = ExactPosterior(K, y, noise, mean).log_marginal_likelihood() / 40
    assert ours.dtype == F64 and ours.dim() == 0
    cov = (K + noise * torch.eye(40, dtype=F64)).numpy()
    ref = scipy_stats.multivariate_normal(mean=np.full(40, mean), cov=cov).logpdf(y.numpy()) / 40
    assert abs(float(ours) - ref) < 1e-10 * max(1.0, abs(ref)), f"seed {seed}"
    # same normalisation (average per data point) as GPyTorch's ExactMarginalLogLikelihood
    lik = gpytorch.likelihoods.GaussianLikelihood()
    m = ExactGPModel(x, y, lik).to(F64)
    _set_hypers(m, ls, os_, noise, mean)
    with gpytorch.settings.max_cholesky_size(BIG):
        gp = gpytorch.mlls.ExactMarginalLogLikelihood(lik, m)(m(x), y)
    assert abs(float(ours) - float(gp.detach())) < 1e-10, f"seed {seed}"
    # float32 K and (n, 1) y give the same float64 answer
    ours32 = ExactPosterior(K.float(), y.reshape(-1, 1), noise, mean).log_marginal_likelihood() / 40
    assert ours32.dtype == F64
    assert abs(float(ours32) - float(ours)) < 1e-5


# ----------------------------------------------------------------------------------------------------------
# robust_cholesky
# ----------------------------------------------------------------------------------------------------------
def test_robust_cholesky_plain_no_warning(recwarn):
    A = torch.eye(5, dtype=F64) * 2
    L, jitter = robust_cholesky(A)
    assert jitter == 0.0
    torch.testing.assert_close(L @ L.T, A)
    assert not [w for w in recwarn if issubclass(w.category, CholeskyJitterWarning)]


def test_robust_cholesky_adds_jitter_and_warns():
    v = torch.randn(6, 1, dtype=F64)
    A = v @ v.T  # rank one, singular
    A0 = A.clone()
    with pytest.warns(CholeskyJitterWarning, match="adding .* to the diagonal"):
        L, jitter = robust_cholesky(A)
    assert jitter > 0
    mean_diag = float(A0.diagonal().mean())
    assert 1e-8 * mean_diag * 0.999 <= jitter <= 1e-4 * mean_diag * 1.001
    torch.testing.assert_close(L @ L.T, A0 + jitter * torch.eye(6, dtype=F64), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(A, A0)  # not overwritten by default


def test_robust_cholesky_raises_when_not_positive_definite():
    A = torch.diag(torch.tensor([1.0, 1.0, -1.0], dtype=F64))
    with pytest.raises(CholeskyError, match="not positive"):
        robust_cholesky(A)
    assert issubclass(CholeskyError, torch.linalg.LinAlgError)
    with pytest.raises(CholeskyError, match="NaN or inf"):
        robust_cholesky(torch.full((2, 2), float("nan"), dtype=F64))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [257, 1000])
def test_inverse_from_cholesky_by_blocks_equals_the_inverse(device, n):
    """The blocked inverse against torch.cholesky_inverse on fresh SPD matrices of condition number <= 1e4: the
    error of either is about cond x eps x |W| (5e-12 |W| at 1e4), so 1e-10 |W| holds on every draw. Blocks of 16
    and 100 make the recursion several levels deep with halves of unequal orders (n odd)."""
    seed = _seed()
    X = torch.randn(n, n, dtype=F64, device=device)
    Q, _ = torch.linalg.qr(X)
    eig = torch.logspace(0, 4, n, dtype=F64, device=device)[torch.randperm(n, device=device)]
    A = (Q * eig) @ Q.T
    A = 0.5 * (A + A.T)
    L = torch.linalg.cholesky(A)
    W0 = torch.cholesky_inverse(L)
    # the exact path factors in place, so the strict upper triangle holds A's old values: it must not be read
    L = L + torch.triu(torch.randn_like(L), 1)
    for block in (16, 100):
        poison_allocator(device, n * n * 8)  # an element the blocks never write shows as NaN
        W = chol.inverse_from_cholesky(L, block=block)
        assert torch.isfinite(W).all(), (seed, block)
        err = ((W - W0).abs().max() / W0.abs().max()).item()
        assert err < 1e-10, (seed, block, err)
        resid = (A @ W - torch.eye(n, dtype=F64, device=device)).abs().max().item()
        assert resid < 1e-8, (seed, block, resid)
    torch.testing.assert_close(chol.inverse_from_cholesky(L, block=0), W0, rtol=0, atol=0)


def test_inverse_from_cholesky_refuses_a_non_square_factor():
    with pytest.raises(ValueError, match=r"L must be a square matrix \(n, n\), got shape \(3, 2\)"):
        chol.inverse_from_cholesky(torch.zeros(3, 2, dtype=F64))


# ----------------------------------------------------------------------------------------------------------
# ExactPosterior
# ----------------------------------------------------------------------------------------------------------
def _dense_posterior(x, y, xt, ls, os_, noise, mean):
    K = _rbf(x, x, ls, os_) + noise * torch.eye(x.shape[0], dtype=F64)
    Ks = _rbf(x, xt, ls, os_)
    Kss = _rbf(xt, xt, ls, os_)
    mu = Ks.T @ torch.linalg.solve(K, y - mean) + mean
    cov = Kss - Ks.T @ torch.linalg.solve(K, Ks)
    return mu, cov


def test_predictor_matches_dense_formulas():
    seed = _seed()
    x, y, xt, ls, os_, noise, mean = _data(n=50, n_test=30)
    mu_ref, cov_ref = _dense_posterior(x, y, xt, ls, os_, noise, mean)
    K = _rbf(x, x, ls, os_)
    K_copy = K.clone()
    pred = ExactPosterior(K, y, noise, mean)
    torch.testing.assert_close(K, K_copy)  # not overwritten without overwrite=True
    assert pred.jitter == 0.0 and pred.n == 50
    Ks = _rbf(x, xt, ls, os_)
    kss = torch.full((30,), os_, dtype=F64)
    msg = f"seed {seed}"
    torch.testing.assert_close(pred.predict(Ks), mu_ref, rtol=1e-10, atol=1e-10, msg=msg)
    m, v = pred.predict(Ks, kss, return_var=True)
    torch.testing.assert_close(m, mu_ref, rtol=1e-10, atol=1e-10, msg=msg)
    torch.testing.assert_close(v, cov_ref.diagonal(), rtol=1e-8, atol=1e-10, msg=msg)
    _, vn = pred.predict(Ks, kss, return_var=True, include_noise=True)
    torch.testing.assert_close(vn, cov_ref.diagonal() + noise, rtol=1e-8, atol=1e-10, msg=msg)
    _, c = pred.predict(Ks, return_cov=True, K_star_star=_rbf(xt, xt, ls, os_))
    torch.testing.assert_close(c, cov_ref, rtol=1e-8, atol=1e-10, msg=msg)
    _, cn = pred.predict(Ks, return_cov=True, K_star_star=_rbf(xt, xt, ls, os_), include_noise=True)
    torch.testing.assert_close(cn, cov_ref + noise * torch.eye(30, dtype=F64), rtol=1e-8, atol=1e-10, msg=msg)
    # total log marginal likelihood, against the dense formula
    lml = pred.log_marginal_likelihood()
    Ky = K + noise * torch.eye(50, dtype=F64)
    r = y - mean
    dense = -0.5 * r @ torch.linalg.solve(Ky, r) - 0.5 * torch.logdet(Ky) - 25 * math.log(2 * math.pi)
    torch.testing.assert_close(lml, dense, rtol=1e-10, atol=1e-10)


def test_predictor_chunked_kernel_path_matches_unchunked(monkeypatch):
    seed = _seed()
    x, y, xt, ls, os_, noise, mean = _data(n=40, n_test=37)
    kern = lambda a, b: _rbf(a, b, ls, os_)  # noqa: E731
    pred = ExactPosterior(kern(x, x), y, noise, mean)
    m_full, v_full = pred.predict(kern(x, xt), torch.full((37,), os_, dtype=F64), return_var=True)
    # force tiny chunks (3 test points per chunk) both through chunk_size and through the memory budget
    for kwargs in ({"chunk_size": 3}, {}):
        if not kwargs:
            monkeypatch.setattr(chol, "_CHUNK_BYTES", 8 * 40 * 3)
            assert pred.chunk_size() == 3
        m, v = pred.predict_from_kernel(kern, x, xt, prior_var=os_, return_var=True, **kwargs)
        torch.testing.assert_close(m, m_full, rtol=1e-12, atol=1e-12, msg=f"seed {seed}")
        torch.testing.assert_close(v, v_full, rtol=1e-12, atol=1e-12, msg=f"seed {seed}")
    m2 = pred.predict_from_kernel(kern, x, xt, prior_var=os_)
    torch.testing.assert_close(m2, m_full, rtol=1e-12, atol=1e-12)
    _, c = pred.predict_from_kernel(kern, x, xt, prior_var=os_, return_cov=True)
    torch.testing.assert_close(c.diagonal(), v_full, rtol=1e-8, atol=1e-12)
    empty = pred.predict_from_kernel(kern, x, xt[:0], prior_var=os_, return_var=True)
    assert empty[0].shape == (0,) and empty[1].shape == (0,)
    # predict's own chunk loop over a whole K_*, with prior variances that differ per test point
    kss = os_ + torch.rand(37, dtype=F64)
    m_ref, v_ref = pred.predict(kern(x, xt), kss, return_var=True)  # still the 3-point chunks (patched above)
    monkeypatch.setattr(chol, "_CHUNK_BYTES", 2**40)
    assert pred.chunk_size() >= 37
    m_one, v_one = pred.predict(kern(x, xt), kss, return_var=True)
    torch.testing.assert_close(m_ref, m_one, rtol=1e-12, atol=1e-12, msg=f"seed {seed}")
    torch.testing.assert_close(v_ref, v_one, rtol=1e-12, atol=1e-12, msg=f"seed {seed}")


def test_predictor_variance_clamped_and_jitter_on_duplicates():
    x = torch.randn(5, 2, dtype=F64)
    x = torch.cat([x, x])  # duplicated points, zero noise: singular
    y = torch.cat([torch.randn(5, dtype=F64)] * 2)
    ls = torch.ones(1, 2, dtype=F64)
    with pytest.warns(CholeskyJitterWarning):
        pred = ExactPosterior(_rbf(x, x, ls, 1.0), y, 0.0, 0.0)
    assert pred.jitter > 0
    _, v = pred.predict(_rbf(x, x, ls, 1.0), torch.ones(10, dtype=F64), return_var=True)
    assert bool((v >= 0).all())
    # prior variances below what the data explain: the raw variance is negative and must be clamped to 0
    _, v0 = pred.predict(_rbf(x, x, ls, 1.0), torch.full((10,), 0.5, dtype=F64), return_var=True)
    assert bool((v0 == 0).all())
    with pytest.raises(ValueError, match="K_star must have shape"):
        pred.predict(torch.zeros(3, 2, dtype=F64))
    with pytest.raises(ValueError, match="k_star_star"):
        pred.predict(torch.zeros(10, 2, dtype=F64), return_var=True)
    with pytest.raises(ValueError, match="K_train must have shape"):
        ExactPosterior(torch.eye(3, dtype=F64), torch.zeros(4, dtype=F64), 0.1)


def test_predictor_overwrite_saves_a_copy():
    x, y, xt, ls, os_, noise, mean = _data(n=20)
    K = _rbf(x, x, ls, os_)
    pred = ExactPosterior(K.clone(), y, noise, mean, overwrite=True)
    ref = ExactPosterior(K, y, noise, mean)
    torch.testing.assert_close(pred.L, ref.L, rtol=0, atol=0)
    assert math.isfinite(float(pred.log_marginal_likelihood()))


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="needs /proc/self/statm")
def test_predictor_holds_one_extra_matrix_at_its_peak():
    """With overwrite=True the factorisation adds only L to K: no copy of L for the solve (torch.cholesky_solve
    made one, a third of the peak of an exact prediction)."""
    from gpfast.bench.timing import PeakMemory

    n = 4000
    x, y = torch.randn(n, 3, dtype=F64), torch.randn(n, dtype=F64)
    K = _rbf(x, x, torch.ones(3, dtype=F64), 1.0)
    with PeakMemory(torch.device("cpu")) as mem:
        pred = ExactPosterior(K, y, 0.1, 0.0, overwrite=True)
    matrix = n * n * 8
    assert mem.peak < 1.5 * matrix, f"peak {mem.peak / matrix:.2f} n x n float64 matrices beyond K"
    r = y - 0.0
    K.diagonal().sub_(0.1)  # K was overwritten with K + noise I; the solve must still be exact
    torch.testing.assert_close((K + 0.1 * torch.eye(n, dtype=F64)) @ pred.alpha, r, rtol=1e-8, atol=1e-8)


def test_model_uses_gpfast_kernel():
    from gpfast.kernels import RBFKernel, ScaleRBFKernel

    m = ExactGPModel(torch.randn(5, 2), torch.randn(5), gpytorch.likelihoods.GaussianLikelihood())
    assert isinstance(m.covar_module, ScaleRBFKernel)
    assert isinstance(m.covar_module, gpytorch.kernels.ScaleKernel)
    assert isinstance(m.covar_module.base_kernel, RBFKernel)
