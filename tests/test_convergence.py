"""ExactGP fits to the marginal-likelihood optimum by default and says when a fit went wrong: the exact
objective's gradient, convergence against scikit-learn, the max_iter cap, L-BFGS in both dtypes, restarts, any
target scale, the bound/collapse warnings, the blow-up error, and silence by default."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from sklearn.exceptions import ConvergenceWarning
from sklearn.gaussian_process import GaussianProcessRegressor
from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel

from gpfast import ops
from gpfast.datasets import load_uci
from gpfast.estimator import ExactGP
from gpfast.estimator.exact_objective import negative_log_likelihood
from gpfast.estimator.hyperparameters import OUTPUTSCALE_BOUNDS, HyperparameterSpace
from gpfast.estimator.optimize import TrainingDivergedError
from gpfast.models import ExactGPModel


def _gp(**kw):
    kw.setdefault("device", "cpu")
    return ExactGP(**kw)


def _smooth(seed: int, n: int = 60, d: int = 2, noise: float = 0.1):
    rng = np.random.default_rng(seed)
    X = rng.uniform(-2, 2, (n, d)) * np.array([1.0, 3.0])[:d]
    y = np.sin(X[:, 0]) + 0.5 * np.cos(X[:, -1] / 3.0) + noise * rng.normal(size=n)
    return X, y


def test_exact_objective_gradient_matches_autograd_through_torch_cholesky():
    g = torch.Generator().manual_seed(0)
    n, d = 50, 3
    X = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = torch.randn(n, generator=g, dtype=torch.float64)
    params = [
        torch.rand(1, d, generator=g, dtype=torch.float64) + 0.5,
        torch.tensor(1.3, dtype=torch.float64),
        torch.tensor(0.1, dtype=torch.float64),
        torch.tensor(0.2, dtype=torch.float64),
    ]
    params = [p.requires_grad_() for p in params]
    ours = negative_log_likelihood(X, y, *params)
    K = ops.rbf_covariance(X, X, params[0], params[1]) + params[2] * torch.eye(n, dtype=torch.float64)
    ref = -torch.distributions.MultivariateNormal(params[3].expand(n), K).log_prob(y)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=0)
    for a, b in zip(torch.autograd.grad(ours, params), torch.autograd.grad(ref, params)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_default_fit_reaches_sklearns_optimum(seed):
    """A small problem whose optimum scikit-learn finds (5 restarts): the default fit's log marginal likelihood is
    within 0.1% of it (gpfast also fits a constant mean, so it may be higher)."""
    X, y = _smooth(seed)
    sk = GaussianProcessRegressor(
        ConstantKernel() * RBF(np.ones(2)) + WhiteKernel(), normalize_y=True, n_restarts_optimizer=5, random_state=0
    ).fit(X, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no warning on a well-posed problem
        gp = _gp().fit(X, y)
    best = sk.log_marginal_likelihood_value_
    assert gp.converged_ and gp.optimizer_ == "lbfgs" and 0 < gp.n_iter_ < gp.max_iter
    assert gp.log_marginal_likelihood_ >= best - 1e-3 * abs(best), (gp.log_marginal_likelihood_, best)


def test_cap_hit_warns_and_converged_is_false():
    X, y = _smooth(0)
    with pytest.warns(ConvergenceWarning, match=r"stopped after 2 iterations without converging.*max_iter"):
        gp = _gp(max_iter=2).fit(X, y)
    assert gp.n_iter_ == 2 and not gp.converged_
    with pytest.warns(ConvergenceWarning, match="adam"):
        gp = _gp(max_iter=3, optimizer="adam").fit(X, y)
    assert gp.n_iter_ == 3 and not gp.converged_
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gp = _gp(max_iter=0).fit(X, y)  # no training asked for: nothing to warn about
        assert gp.n_iter_ == 0 and not gp.converged_
        gp = _gp(max_iter=3, optimizer="adam", tol=0).fit(X, y)  # tol=0: all steps, as asked
        assert gp.n_iter_ == 3


@pytest.mark.slow
@pytest.mark.parametrize("solver", ["cholesky", "cg"])
def test_lbfgs_converges_in_float32_and_float64(solver):
    """L-BFGS on a float32 Cholesky objective can stall (energy) or fail with NotPSDError (yacht). With the Cholesky
    solver the objective is float64 whatever the dtype; with CG it is GPyTorch's float32/float64 estimate."""
    X, y = _load("yacht")
    lml = {}
    for dtype in ("float32", "float64"):
        if solver == "cg":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ConvergenceWarning)  # a stochastic line search may stop early
                gp = _gp(optimizer="lbfgs", solver=solver, dtype=dtype, random_state=0, max_iter=30).fit(X, y)
            assert gp.history_[-1] < gp.history_[0] - 0.5, (dtype, gp.history_)
            continue
        gp = _gp(optimizer="lbfgs", solver=solver, dtype=dtype).fit(X, y)
        assert gp.converged_, dtype
        lml[dtype] = gp.log_marginal_likelihood_
    if lml:
        assert abs(lml["float32"] - lml["float64"]) <= 1e-3 * abs(lml["float64"]), lml


def _load(name):
    ds = load_uci(name, 0, standardize=False)
    return ds.X_train, ds.y_train


def test_restarts_keep_the_best_and_are_seeded():
    X, y = _smooth(3)
    a = _gp(n_restarts=3, random_state=7).fit(X, y)
    b = _gp(n_restarts=3, random_state=7).fit(X, y)
    assert len(a.restart_losses_) == 4 and a.restart_losses_ == b.restart_losses_
    assert a.history_[-1] == pytest.approx(min(a.restart_losses_), rel=1e-9)
    one = _gp().fit(X, y)
    assert a.log_marginal_likelihood_ >= one.log_marginal_likelihood_ - 1e-6 * abs(one.log_marginal_likelihood_)


@pytest.mark.parametrize("scale", [1e-15, 1e-12, 1e-6, 1e6, 1e15])
def test_any_target_scale_predicts_the_same(scale):
    X, y = _smooth(4)
    Xt, _ = _smooth(5, n=20)
    ref = _gp().fit(X, y)
    m1, s1 = ref.predict(Xt, return_std=True)
    gp = _gp().fit(X, y * scale)
    m, s = gp.predict(Xt, return_std=True)
    np.testing.assert_allclose(m / scale, m1, rtol=1e-6, atol=1e-6 * y.std())
    np.testing.assert_allclose(s / scale, s1, rtol=1e-6)
    assert gp.log_marginal_likelihood_ == pytest.approx(ref.log_marginal_likelihood_, rel=1e-6)


def test_initial_values_outside_the_bounds_warn_and_are_clipped():
    """Unbounded, lengthscale_init=1e-6 would end with lengthscales of about 0, and 1e6 or 1e30 would stay where
    they started, silently. Both are moved into the bounds with a warning; from the lower bound every pair of
    points is uncorrelated (exp(-50) at the nearest pair), the gradient vanishes, and the fit says where it
    ended."""
    X, y = _smooth(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _gp(lengthscale_init=1e-6).fit(X, y)
    msgs = [str(w.message) for w in caught]
    assert any(r"initial lengthscale[0], lengthscale[1] lie outside the bounds" in m for m in msgs), msgs
    assert any("feature(s) [0, 1] ended at the lower bound" in m for m in msgs), msgs
    for init in (1e6, 1e30):
        with pytest.warns(UserWarning, match=r"initial lengthscale\[0\], lengthscale\[1\] lie outside the bounds"):
            gp = _gp(lengthscale_init=init).fit(X, y)
        assert gp.converged_


def test_diagnose_names_a_collapse_and_a_lower_lengthscale_bound():
    model = ExactGPModel(
        torch.zeros(3, 2, dtype=torch.float64),
        torch.zeros(3, dtype=torch.float64),
        __import__("gpytorch").likelihoods.GaussianLikelihood(),
    )
    space = HyperparameterSpace.for_data(model, torch.ones(2, dtype=torch.float64), 1.0)
    theta = space.initial()
    assert space.diagnose(theta) == []
    theta[2] = space.lower[2]  # outputscale at its lower bound
    theta[0] = space.lower[0]
    msgs = space.diagnose(theta)
    assert any("collapsed" in m and f"{OUTPUTSCALE_BOUNDS[0]:g}" in m for m in msgs)
    assert any("feature(s) [0] ended at the lower bound" in m for m in msgs)
    theta = space.initial()
    theta[:2] = space.upper[:2]  # every lengthscale at the upper bound: no dependence on X left
    assert any("every lengthscale" in m for m in space.diagnose(theta))
    theta[0] = 0.0  # one feature switched off is a legitimate ARD outcome
    assert space.diagnose(theta) == []


def test_outputscale_collapse_warns():
    """A target that alternates from one point to the next of a regular grid: no lengthscale inside the bounds
    (at least 1e-2 x the std of x, a quarter of the spacing) can follow it, so the fit explains it as noise."""
    rng = np.random.default_rng(0)
    X = np.c_[np.linspace(0, 1, 80), rng.uniform(size=80)]
    y = (np.arange(80) % 2) * 2.0 - 1.0 + 0.01 * rng.normal(size=80)
    with pytest.warns(UserWarning, match=r"outputscale collapsed to its lower bound .* predicts a constant"):
        gp = _gp().fit(X, y)
    assert gp.outputscale_ <= 1.01 * OUTPUTSCALE_BOUNDS[0] * y.var()


def test_learning_rate_blow_up_is_an_error_and_keeps_the_fit():
    X, y = _smooth(0)
    gp = _gp().fit(X, y)
    before = gp.predict(X[:5])
    with pytest.raises(TrainingDivergedError, match=r"blew up.*lr=100.*smaller lr.*not modified"):
        gp.set_params(optimizer="adam", lr=100.0).fit(X, y)
    assert isinstance(TrainingDivergedError("x"), FloatingPointError)
    np.testing.assert_array_equal(gp.predict(X[:5]), before)


def test_quiet_by_default(capfd):
    X, y = _smooth(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gp = ExactGP(device="cpu").fit(X, y)
        gp.predict(X, return_std=True)
    out = capfd.readouterr()
    assert out.err == "" and out.out == ""
    assert ExactGP().verbose is False


def test_adam_follows_torch_adam():
    """gpfast's numpy Adam takes torch.optim.Adam's steps (its defaults and formula) to rounding, over 200 steps of
    fresh random gradients spanning nine decades."""
    from gpfast.estimator.optimize import Adam

    rng = np.random.default_rng()
    size = int(rng.integers(1, 40))
    theta = rng.standard_normal(size)
    ours, reference = Adam(size, 0.05), torch.tensor(theta.copy())
    opt = torch.optim.Adam([reference], lr=0.05)
    for _ in range(200):
        grad = rng.standard_normal(size) * 10.0 ** rng.uniform(-6, 3, size)
        theta = ours.step(theta, grad)
        reference.grad = torch.from_numpy(grad.copy())
        opt.step()
        # a step moves theta by at most about lr; the two differ by the rounding of a few operations on it
        np.testing.assert_allclose(theta, reference.detach().numpy(), rtol=0, atol=1e-12)
        theta = reference.detach().numpy().copy()  # each step compared from the same point: no drift to bound
