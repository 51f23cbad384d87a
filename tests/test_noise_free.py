"""Noise-free data fit as well as scikit-learn's GaussianProcessRegressor: the noise floor follows the training path
(float64 Cholesky, CG in float64, CG in float32), a CG fit at its floor says how to go lower, the low-noise start,
and data whose rows are all repeated."""

from __future__ import annotations

import warnings

import gpytorch
import numpy as np
import pytest
import torch

from experiments.sklearn_compare import LML_MARGIN, fit_noise_free, noise_free_data, sklearn_gp
from gpfast.datasets import load_uci
from gpfast.estimator import ExactGP
from gpfast.estimator.hyperparameters import (
    NOISE_FLOORS,
    HyperparameterSpace,
    noise_constraint,
    noise_floor,
    repeated_rows,
)
from gpfast.estimator.batched_lbfgs import minimize_batched_lbfgs
from gpfast.estimator.optimize import _PROBE_FIRST, LBFGS_FLAT_NATS, descent_left, minimize_lbfgs
from gpfast.estimator.restarts import LOW_NOISE_MAX_N, LOW_NOISE_START, best_of_restarts, low_noise_start
from gpfast.models import ExactGPModel


@pytest.mark.parametrize(
    "name, n",
    [("franke", 300), ("branin", 100), ("hartmann3", 100), ("otl", 150)],
)
def test_noise_free_functions_fit_as_well_as_sklearn(name, n):
    """Both with their defaults (no random restarts), seeded draws: gpfast's test RMSE is at most scikit-learn's
    and its log marginal likelihood at least scikit-learn's - 1 nat, with a converged fit and no warning. With the
    float32 CG floor of 1e-4 x var(y), Franke's function (300 points) fits to an RMSE of 0.0075 against
    scikit-learn's 0.0040."""
    X, y, Xt, yt = noise_free_data(name, n)
    g = fit_noise_free("gpfast", X, y, Xt, yt)
    s = fit_noise_free("sklearn", X, y, Xt, yt)
    assert g["warnings"] == [], g["warnings"]
    assert g["rmse"] <= s["rmse"], (name, g["rmse"], s["rmse"])
    assert g["lml"] >= s["lml"] - LML_MARGIN, (name, g["lml"], s["lml"])


def _fit(X, y, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gp = ExactGP(device="cpu", random_state=0, **kw).fit(X, y)
    return gp, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


@pytest.mark.parametrize(
    "solver, dtype, floor",
    [("cholesky", "float32", NOISE_FLOORS["cholesky"]), ("cg", "float32", 1e-4), ("cg", "float64", 1e-6)],
)
def test_the_noise_floor_follows_the_training_path(solver, dtype, floor):
    """The likelihood's noise constraint is the path's floor (times var(y): 1 after standardising), so the fitted
    GPyTorch model keeps it; a noise_init below the floor starts at the floor, with a warning."""
    X, y, _, _ = noise_free_data("franke", 40)
    gp, msgs = _fit(X, y, solver=solver, dtype=dtype, max_iter=0, noise_init=1e-12 * y.var())
    bound = float(gp.likelihood_.noise_covar.raw_noise_constraint.lower_bound)
    assert bound == pytest.approx(floor, rel=1e-6)
    assert floor == noise_floor(solver, getattr(torch, dtype))
    assert gp.noise_ == pytest.approx(floor * y.var(), rel=1e-4)
    assert any("initial noise lie outside the bounds" in m for m in msgs), msgs
    lik_bound = float(noise_constraint(solver, getattr(torch, dtype), 4.0).lower_bound)
    assert lik_bound == pytest.approx(4.0 * floor)


def test_cg_fit_at_its_float32_floor_warns_once_with_the_remedy():
    X, y, _, _ = noise_free_data("franke", 150)
    # started near the optimum's lengthscales (scikit-learn's: 0.14-0.15), so that 20 Adam steps reach the floor
    start = dict(noise_init=2e-4 * y.var(), lengthscale_init=0.15, outputscale_init=0.4 * y.var())
    gp, msgs = _fit(X, y, solver="cg", max_iter=20, tol=0, cg={"num_probes": 16}, **start)
    floor = [m for m in msgs if "floor of CG training" in m]
    assert len(floor) == 1, msgs
    assert "dtype='float64'" in floor[0] and "solver='cholesky'" in floor[0], floor[0]
    assert gp.noise_ == pytest.approx(NOISE_FLOORS[("cg", torch.float32)] * y.var(), rel=1e-2)
    # the same data on the exact path go far below that floor, and nothing is said
    exact, msgs = _fit(X, y)
    assert exact.noise_ < 0.1 * gp.noise_ and msgs == []


def test_low_noise_start_is_made_only_on_the_exact_path_after_a_low_noise_end():
    likelihood = gpytorch.likelihoods.GaussianLikelihood(
        noise_constraint=noise_constraint("cholesky", torch.float64, 1)
    )
    model = ExactGPModel(torch.zeros(3, 2, dtype=torch.float64), torch.zeros(3, dtype=torch.float64), likelihood)
    space = HyperparameterSpace.for_data(model, torch.ones(2, dtype=torch.float64), 1.0)
    theta0 = space.initial()
    low_end, high_end = theta0.copy(), theta0.copy()
    low_end[3], high_end[3] = np.log(1e-3), np.log(0.1)
    start = low_noise_start(space, theta0, low_end, "cholesky", 500)
    assert start is not None and start[3] == pytest.approx(np.log(LOW_NOISE_START))
    np.testing.assert_array_equal(np.delete(start, 3), np.delete(theta0, 3))
    assert low_noise_start(space, theta0, high_end, "cholesky", 500) is None
    assert low_noise_start(space, theta0, low_end, "cg", 500) is None
    assert low_noise_start(space, theta0, low_end, "cholesky", LOW_NOISE_MAX_N) is not None
    assert low_noise_start(space, theta0, low_end, "cholesky", LOW_NOISE_MAX_N + 1) is None  # too dear for its gain
    # the extra start runs second, and the best run is kept
    seen = []
    best, losses = best_of_restarts(
        [theta0, theta0 + 1], lambda t, first: seen.append((t, first)) or float(t[3]), lambda r: r, lambda r: start
    )
    assert [(s[3], first) for s, first in seen] == [(theta0[3], True), (start[3], False), (theta0[3] + 1, False)]
    assert best == start[3] and losses == [theta0[3], start[3], theta0[3] + 1]


def _rounded_cosh(step):
    """A loss known only to ``step`` (rounded), with its exact gradient, and its unrounded values."""
    scale = np.array([1.0, 3.0, 10.0, 30.0])

    def exact(t):
        return float(np.sum(scale * np.cosh(t)))

    def fun(t):
        return float(np.round(exact(t) / step) * step), scale * np.sinh(t)

    return fun, exact


def _left_on_the_line(exact, grad, theta):
    """The true fall of ``exact`` along the steepest-descent line from ``theta`` (no bound in the way)."""
    from scipy.optimize import minimize_scalar

    d = -grad / np.linalg.norm(grad)
    line = minimize_scalar(lambda a: exact(theta + a * d), bounds=(0.0, 10.0), method="bounded",
                           options={"xatol": 1e-12})  # fmt: skip
    return exact(theta) - min(line.fun, exact(theta))


@pytest.mark.parametrize("step, converged", [(3e-2, True), (1.0, False)])
def test_lbfgs_stop_on_a_loss_flat_to_its_rounding_counts_as_converged(step, converged):
    """L-BFGS-B's line search ends finding no decrease on a rounded loss. Where the steepest-descent line then offers
    at most LBFGS_FLAT_NATS the fit is as converged as the loss can tell (as near the noise floor of noise-free
    data); where its bound exceeds that, it is not (the line's true fall then exceeds 1/8 of it: descent_left's
    bound on a convex line). The single fit and the batched one judge alike."""
    fun, exact = _rounded_cosh(step)
    space = HyperparameterSpace(1, np.full(4, -10.0), np.full(4, 10.0), np.zeros(1), 0.0)
    theta0 = np.array([2.0, -1.5, 1.0, 0.7])
    single = minimize_lbfgs(fun, theta0, space, n=1, max_iter=100)
    batched = minimize_batched_lbfgs(
        lambda rows, thetas: (np.array([fun(t)[0] for t in thetas]), np.stack([fun(t)[1] for t in thetas])),
        theta0[None], space, n=1, max_iter=100,
    )[0]  # fmt: skip
    for res in (single, batched):
        left = _left_on_the_line(exact, fun(res.theta)[1], res.theta)
        assert res.converged == converged and ("flat" in res.message) == converged, (res.message, left)
        assert left <= LBFGS_FLAT_NATS if converged else left > LBFGS_FLAT_NATS / 8, (res.message, left)
        assert "line search found no decrease" in res.message, res.message


def test_descent_left_bounds_the_fall_on_the_line():
    """On quadratics of fresh random curvature and gradient the bound is at least the true fall g^2 / (2 h) and, with
    the probe's steps growing fourfold, at most 8 times it plus |g| times the first step (a minimum nearer than the
    first step is seen only there); a line whose slope stays negative up to a step of 1, or
    that meets the box first, is not bounded; a zero projected gradient leaves nothing."""
    rng = np.random.default_rng()
    space = HyperparameterSpace(1, np.full(3, -50.0), np.full(3, 50.0), np.zeros(1), 0.0)
    h = 10.0 ** rng.uniform(-1, 6, size=64)
    g = rng.normal(size=(64, 3))
    x0 = rng.uniform(-1, 1, size=(64, 3))

    def grad_at(rows, thetas):  # the gradient of 0.5 h |x - c|^2 with x0 - c = g / h
        return g[rows] + h[rows, None] * (thetas - x0[rows])

    left = descent_left(grad_at, x0, g, space)
    true = np.sum(g**2, 1) / (2 * h)
    reached = np.linalg.norm(g, axis=1) / h <= 1.0  # the minimum lies within a step of 1
    most = 8 * true + np.linalg.norm(g, axis=1) * _PROBE_FIRST
    assert np.all(left[reached] >= true[reached] * (1 - 1e-9)) and np.all(left[reached] <= most[reached])
    assert np.all(np.isinf(left[~reached]))
    boxed = HyperparameterSpace(1, np.full(3, -1e-3), np.full(3, 1e-3), np.zeros(1), 0.0)
    linear = lambda rows, thetas: np.ones_like(thetas)  # noqa: E731 (a slope that never turns)
    assert np.isinf(descent_left(linear, np.zeros((1, 3)), np.ones((1, 3)), boxed)).all()
    assert descent_left(grad_at, x0[:1], np.zeros((1, 3)), space)[0] == 0.0


def _yacht(split, rows=None):
    ds = load_uci("yacht", split, standardize=False)
    return ds.X_train[:rows], ds.y_train[:rows]


@pytest.mark.slow
def test_yacht_low_noise_optimum_is_found():
    """On yacht split 2 the default start alone stopped at a log marginal likelihood of 239.5, scikit-learn at 264.0;
    the low-noise start reaches scikit-learn's optimum."""
    X, y = _yacht(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sk = sklearn_gp(X.shape[1]).fit(X, y)
    gp, msgs = _fit(X, y)
    assert len(gp.restart_losses_) == 2 and msgs == []
    assert gp.log_marginal_likelihood_ >= sk.log_marginal_likelihood_value_ - LML_MARGIN


def test_every_row_duplicated_reaches_sklearns_optimum_and_warns():
    """With every row twice the marginal likelihood rises without bound as the noise falls; the default fit ends at
    its floor, at least as high as scikit-learn's (whose floor is higher), and says why."""
    X, y = _yacht(0, rows=60)
    X, y = np.concatenate([X, X]), np.concatenate([y, y])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sk = sklearn_gp(X.shape[1]).fit(X, y)
    gp, msgs = _fit(X, y)
    assert gp.log_marginal_likelihood_ >= sk.log_marginal_likelihood_value_ - LML_MARGIN
    assert any("60 of the 120 training rows repeat another row exactly" in m for m in msgs), msgs
    assert repeated_rows(torch.as_tensor(X), torch.as_tensor(y)) == 60
    assert repeated_rows(torch.as_tensor(X[:60]), torch.as_tensor(y[:60])) == 0
