"""Tests of gpfast.ExactGP's scikit-learn extras: log_marginal_likelihood and theta_, sample_y, and targets with
several outputs (CPU; the CUDA test is marked and skipped without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.gaussian_process import GaussianProcessRegressor
from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel

from conftest import DEVICES, fresh_rng
from gpfast.estimator import ExactGP
from gpfast.estimator.hyperparameters import LENGTHSCALE_BOUNDS, NOISE_CEILING, NOISE_FLOORS, OUTPUTSCALE_BOUNDS

# short fits (a few optimiser steps) are enough for what these tests check
pytestmark = pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")


def _data(rng, n=40, d=3, n_test=7):
    """Inputs on uneven scales and offsets, a smooth target plus noise."""
    scales = rng.uniform(0.5, 5.0, d)
    offsets = rng.normal(0, 10, d)
    w = rng.normal(size=d)
    X = rng.uniform(-1, 1, (n, d)) * scales + offsets
    Xt = rng.uniform(-1.2, 1.2, (n_test, d)) * scales + offsets
    y = np.sin(((X - offsets) / scales) @ w) * 3.0 + 20.0 + 0.2 * rng.normal(size=n)
    return X, y, Xt


def _gp(**kw):
    kw.setdefault("device", "cpu")
    kw.setdefault("solver", "cholesky")
    return ExactGP(**kw)


def _central_differences(f, theta, h=1e-3):
    """Fourth-order central differences: truncation ~h^4 |f^(5)| / 30, rounding ~|error of f| / h. The error of f
    grows with cond(K) ~ n / noise, which reaches 1e7 when a short fit leaves the noise near its floor; a
    second-order rule needs h ~ 1e-5 for its truncation and then amplifies that rounding 1e5-fold."""
    steps = [
        (f(theta + h * e) - f(theta - h * e), f(theta + 2 * h * e) - f(theta - 2 * h * e)) for e in np.eye(theta.size)
    ]
    return np.array([(8 * one - two) / (12 * h) for one, two in steps])


# ----------------------------------------------------------------------------------------------------------
# log_marginal_likelihood and theta_
# ----------------------------------------------------------------------------------------------------------
def test_lml_matches_sklearn_value_and_gradient():
    """At the initial hyperparameters (constant mean 0 in standardised units, scikit-learn's normalize_y model),
    value and gradient at random theta equal scikit-learn's, whose theta is [log constant, log lengthscales in X's
    units, log noise]."""
    rng, seed = fresh_rng()
    X, y, _ = _data(rng)
    gp = _gp(max_iter=0).fit(X, y)
    kernel = ConstantKernel(1.0) * RBF(np.ones(3)) + WhiteKernel(1.0)
    sk = GaussianProcessRegressor(kernel, normalize_y=True, optimizer=None, alpha=0.0).fit(X, y)  # no nugget
    for _ in range(3):
        theta = gp.theta_ + rng.normal(0, 0.5, 5)
        value, grad = gp.log_marginal_likelihood(theta, eval_gradient=True)
        theta_sk = np.concatenate([[theta[3]], theta[:3] + np.log(X.std(0)), [theta[4]]])
        value_sk, grad_sk = sk.log_marginal_likelihood(theta_sk, eval_gradient=True)
        assert value == pytest.approx(value_sk, rel=1e-9), f"seed {seed}"
        np.testing.assert_allclose(grad[[3, 0, 1, 2, 4]], grad_sk, rtol=1e-7, atol=1e-8, err_msg=f"seed {seed}")
        assert gp.log_marginal_likelihood(theta) == value


@pytest.mark.parametrize("ard", [True, False])
def test_lml_gradient_by_finite_differences(ard):
    rng, seed = fresh_rng()
    X, y, _ = _data(rng, n=30)
    gp = _gp(max_iter=5, ard=ard).fit(X, y)
    assert gp.theta_.shape == ((3 if ard else 1) + 2,)
    theta = gp.theta_ + rng.normal(0, 0.3, gp.theta_.size)
    value, grad = gp.log_marginal_likelihood(theta, eval_gradient=True)
    fd = _central_differences(gp.log_marginal_likelihood, theta)
    # over 360 draws (noise down to 1e-6 among them) the worst error was 8% of this bound
    np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-8 * max(abs(value), 1.0), err_msg=f"seed {seed}")


def test_theta_is_the_fitted_hyperparameters():
    rng, seed = fresh_rng()
    X, y, _ = _data(rng)
    gp = _gp(max_iter=1000).fit(X * 7.0, y * 3.0 - 5.0)
    assert gp.converged_, f"seed {seed}"
    theta = gp.theta_
    np.testing.assert_allclose(np.exp(theta[:3]) * gp.x_std_, gp.lengthscale_, rtol=1e-12)
    np.testing.assert_allclose(np.exp(theta[3]) * gp.y_std_**2, gp.outputscale_, rtol=1e-12)
    np.testing.assert_allclose(np.exp(theta[4]) * gp.y_std_**2, gp.noise_, rtol=1e-12)
    assert gp.log_marginal_likelihood() == gp.log_marginal_likelihood_value_ == gp.log_marginal_likelihood_
    assert gp.log_marginal_likelihood(theta) == pytest.approx(gp.log_marginal_likelihood_value_, rel=1e-12, abs=1e-9)
    # the fit maximised it inside the box of the fit (standardised data: lengthscale, outputscale and noise bounds
    # times 1): small steps away from the fitted theta that stay in the box do not raise it (beyond ftol)
    lower = np.log([LENGTHSCALE_BOUNDS[0]] * 3 + [OUTPUTSCALE_BOUNDS[0], NOISE_FLOORS["cholesky"]])
    upper = np.log([LENGTHSCALE_BOUNDS[1]] * 3 + [OUTPUTSCALE_BOUNDS[1], NOISE_CEILING])
    for e in np.eye(5):
        for step in (-1e-2 * e, 1e-2 * e):
            if np.all(theta + step >= lower) and np.all(theta + step <= upper):
                value = gp.log_marginal_likelihood(theta + step)
                assert value <= gp.log_marginal_likelihood_value_ + 1e-6, f"seed {seed}, step {step}"


def test_lml_arguments_are_checked():
    rng, _ = fresh_rng()
    X, y, _ = _data(rng, n=20)
    gp = _gp(max_iter=0).fit(X, y)
    with pytest.raises(ValueError, match="eval_gradient=True needs a theta, got theta=None"):
        gp.log_marginal_likelihood(eval_gradient=True)
    with pytest.raises(ValueError, match=r"theta has shape \(4,\); expected \(5,\)"):
        gp.log_marginal_likelihood(np.zeros(4))
    with pytest.raises(ValueError, match="theta must be finite"):
        gp.log_marginal_likelihood(np.array([0.0, 0.0, 0.0, np.nan, 0.0]))
    with pytest.raises(AttributeError):  # NotFittedError is an AttributeError: hasattr(ExactGP(), "theta_") is False
        _ = ExactGP().theta_
    assert not hasattr(ExactGP(), "log_marginal_likelihood_value_")
    value = gp.log_marginal_likelihood(gp.theta_)
    assert gp.log_marginal_likelihood(gp.theta_, clone_kernel=False) == value  # the fit is never modified
    assert gp.log_marginal_likelihood(gp.theta_) == value


@pytest.mark.parametrize("device", DEVICES)
def test_lml_gradient_on_device_matches_float64_cpu(device):
    """On the GPU the gradient flows through the fused backward of rbf_covariance; it matches the CPU's."""
    rng, seed = fresh_rng()
    X, y, _ = _data(rng, n=200, d=4)
    gp = _gp(max_iter=3, device=device).fit(X, y)
    theta = gp.theta_ + rng.normal(0, 0.3, 6)
    value, grad = gp.log_marginal_likelihood(theta, eval_gradient=True)
    ref = _gp(max_iter=3).fit(X, y)
    np.testing.assert_allclose(ref.theta_, gp.theta_, rtol=1e-9, atol=1e-9, err_msg=f"seed {seed}")
    value_cpu, grad_cpu = ref.log_marginal_likelihood(theta, eval_gradient=True)
    assert value == pytest.approx(value_cpu, rel=1e-10), f"seed {seed}"
    np.testing.assert_allclose(grad, grad_cpu, rtol=1e-8, atol=1e-8 * abs(value_cpu), err_msg=f"seed {seed}")


# ----------------------------------------------------------------------------------------------------------
# sample_y
# ----------------------------------------------------------------------------------------------------------
def _assert_moments(samples, mean, cov, msg):
    """Sample mean and covariance of draws (m, N) against the distribution's, each entry within 5 standard
    errors: sd / sqrt(N) for a mean, sqrt((C_ii C_jj + C_ij^2) / N) for a covariance entry (Gaussian draws)."""
    n = samples.shape[-1]
    sd = np.sqrt(np.diag(cov))
    np.testing.assert_array_less(np.abs(samples.mean(-1) - mean), 5 * sd / np.sqrt(n), err_msg=msg)
    se = np.sqrt((np.outer(sd**2, sd**2) + cov**2) / n)
    np.testing.assert_array_less(np.abs(np.cov(samples) - cov), 5 * se, err_msg=msg)


def _assert_output_samples(gp, Xt, rng, seed):
    """sample_y of a fit of two outputs on the four points Xt: shape (4, 2, N), and each output's moments those
    of predict(return_cov=True)."""
    mean, cov = gp.predict(Xt, return_cov=True)
    samples = gp.sample_y(Xt, n_samples=20000, random_state=int(rng.integers(2**31)))
    assert samples.shape == (4, 2, 20000)
    for j in range(2):
        _assert_moments(samples[:, j], mean[:, j], cov[..., j], f"seed {seed}, output {j}")


@pytest.mark.parametrize("include_noise", [True, False])
def test_sample_y_moments_match_predict(include_noise):
    rng, seed = fresh_rng()
    X, y, Xt = _data(rng, n=30, n_test=5)
    Xt[1] = Xt[0] + 1e-3  # nearby points: a nearly singular latent covariance
    gp = _gp(max_iter=10).fit(X, y)
    mean, cov = gp.predict(Xt, return_cov=True, include_noise=include_noise)
    samples = gp.sample_y(Xt, n_samples=20000, random_state=int(rng.integers(2**31)), include_noise=include_noise)
    assert samples.shape == (5, 20000) and samples.dtype == np.float64
    _assert_moments(samples, mean, cov, f"seed {seed}")


def test_sample_y_shapes_seeds_and_types():
    rng, _ = fresh_rng()
    X, y, Xt = _data(rng, n=20, n_test=4)
    gp = _gp(max_iter=3).fit(X, y)
    assert gp.sample_y(Xt).shape == (4, 1)
    np.testing.assert_array_equal(gp.sample_y(Xt, 3, random_state=7), gp.sample_y(Xt, 3, random_state=7))
    assert not np.array_equal(gp.sample_y(Xt, 3, random_state=7), gp.sample_y(Xt, 3, random_state=8))
    draws = gp.sample_y(torch.from_numpy(Xt).float(), 3, random_state=7)
    assert torch.is_tensor(draws) and draws.dtype == torch.float32 and draws.shape == (4, 3)
    np.testing.assert_allclose(draws.numpy(), gp.sample_y(Xt, 3, random_state=7), rtol=1e-5, atol=1e-4)
    for bad in (0, 2.5, True, "3"):
        with pytest.raises(ValueError, match=f"invalid n_samples={bad!r}; expected an int >= 1"):
            gp.sample_y(Xt, bad)


# ----------------------------------------------------------------------------------------------------------
# several outputs: y of shape (n, k)
# ----------------------------------------------------------------------------------------------------------
def _outputs(rng, X, k):
    """k targets on different scales and offsets, each a smooth function of X plus noise."""
    Z = (X - X.mean(0)) / X.std(0)
    cols = [np.sin(Z @ rng.normal(size=X.shape[1])) + 0.1 * rng.normal(size=len(X)) for _ in range(k)]
    return np.stack(cols, 1) * rng.uniform(0.1, 10.0, k) + rng.normal(0, 10, k)


def test_fit_of_repeated_and_rescaled_columns_is_the_fit_of_one():
    """[y, y, 3 y + 1]: each output standardised on its own makes the three identical in standardised units, so the
    fit is that of y (same hyperparameters, same steps), the log likelihood three times y's, and each column's
    predictions those of y in its units. Equal up to rounding: the summed objective rounds differently from y's,
    and over some 40 L-BFGS-B steps that moved log(noise) by 4.7e-7 on one draw (seed 3683317603), where the
    likelihood is flat in it; the bounds on the hyperparameters and on what they set allow 20 times that."""
    rng, seed = fresh_rng()
    X, y, Xt = _data(rng)
    msg = f"seed {seed}"
    a = _gp().fit(X, y)
    b = _gp().fit(X, np.stack([y, y, 3.0 * y + 1.0], 1))
    assert b.n_iter_ == a.n_iter_, msg
    np.testing.assert_allclose(b.theta_, a.theta_, rtol=0, atol=1e-5, err_msg=msg)
    assert b.log_marginal_likelihood_ == pytest.approx(3 * a.log_marginal_likelihood_, rel=1e-9), msg
    np.testing.assert_allclose(b.y_std_, [a.y_std_, a.y_std_, 3 * a.y_std_], rtol=1e-12)
    np.testing.assert_allclose(b.outputscale_, a.outputscale_ * np.array([1.0, 1.0, 9.0]), rtol=1e-5)
    np.testing.assert_allclose(b.noise_, a.noise_ * np.array([1.0, 1.0, 9.0]), rtol=1e-5)
    np.testing.assert_allclose(b.constant_mean_, np.array([1.0, 1.0, 3.0]) * a.constant_mean_ + [0, 0, 1], rtol=1e-5)
    ma, sa = a.predict(Xt, return_std=True)
    mb, sb = b.predict(Xt, return_std=True)
    assert mb.shape == sb.shape == (7, 3)
    scale, shift = np.array([1.0, 1.0, 3.0]), np.array([0.0, 0.0, 1.0])
    np.testing.assert_allclose(mb, ma[:, None] * scale + shift, rtol=1e-5, atol=1e-5 * a.y_std_, err_msg=msg)
    np.testing.assert_allclose(sb, sa[:, None] * scale, rtol=1e-5, err_msg=msg)
    _, ca = a.predict(Xt, return_cov=True)
    mc, cb = b.predict(Xt, return_cov=True)
    assert cb.shape == (7, 7, 3)
    np.testing.assert_allclose(mc, mb, rtol=1e-12)
    np.testing.assert_allclose(cb, ca[..., None] * scale**2, rtol=1e-5, atol=1e-7 * a.y_std_**2, err_msg=msg)
    assert b.score(Xt, mb) == 1.0


@pytest.mark.parametrize("ard", [True, False])
def test_fixed_hyperparameters_match_sklearn_multioutput(ard):
    """At fixed hyperparameters, means, stds, covariances and the summed log likelihood equal those of
    scikit-learn's GaussianProcessRegressor with normalize_y=True on the same (n, k) targets."""
    rng, seed = fresh_rng()
    X, _, Xt = _data(rng)
    Y = _outputs(rng, X, 3)
    ls = X.std(0) * rng.uniform(0.5, 2.0, 3) if ard else float(rng.uniform(0.5, 2.0))
    os_, noise = float(rng.uniform(0.5, 2.0)), float(rng.uniform(0.01, 0.2))  # fractions of each output's variance
    gp = _gp(max_iter=0, ard=ard, dtype="float64", lengthscale_init=ls, outputscale_init=os_, noise_init=noise)
    gp.fit(X, Y)
    ls_x = ls if ard else ls * X.std(0)  # ard=False: a standardised lengthscale, X's std in each feature
    kernel = ConstantKernel(os_, "fixed") * RBF(ls_x, "fixed") + WhiteKernel(noise, "fixed")
    # alpha=0: scikit-learn's default adds 1e-10 to the diagonal, which at noise 0.01 moves the log likelihood by
    # a few 1e-9 of itself; gpfast's model has no such nugget
    sk = GaussianProcessRegressor(kernel, normalize_y=True, optimizer=None, alpha=0.0).fit(X, Y)
    msg = f"seed {seed}"
    if ard:  # scikit-learn's isotropic RBF cannot express one standardised lengthscale on unequal columns
        m_sk, s_sk = sk.predict(Xt, return_std=True)
        m, s = gp.predict(Xt, return_std=True)
        np.testing.assert_allclose(m, m_sk, rtol=1e-8, atol=1e-8 * Y.std(0).max(), err_msg=msg)
        np.testing.assert_allclose(s, s_sk, rtol=1e-8, err_msg=msg)
        _, c_sk = sk.predict(Xt, return_cov=True)
        _, c = gp.predict(Xt, return_cov=True)
        assert c.shape == c_sk.shape == (7, 7, 3)
        np.testing.assert_allclose(c, c_sk, rtol=1e-8, atol=1e-8 * Y.var(0).max(), err_msg=msg)
        assert gp.log_marginal_likelihood_ == pytest.approx(sk.log_marginal_likelihood_value_, rel=1e-9), msg
    np.testing.assert_allclose(gp.outputscale_, os_ * Y.var(0), rtol=1e-9)
    np.testing.assert_allclose(gp.noise_, noise * Y.var(0), rtol=1e-9)
    np.testing.assert_allclose(gp.constant_mean_, Y.mean(0), rtol=1e-12)


def test_optimised_fit_matches_sklearn_multioutput():
    """An optimised fit on (n, k) targets against scikit-learn's. gpfast's model is scikit-learn's (normalize_y,
    a shared kernel, likelihoods summed) plus a constant mean in standardised units, which moves its optimum (by up
    to ~6% of std(y) in the predictions on such data), so the comparison is in two parts: (1) gpfast's optimum is at
    least scikit-learn's (a mean of 0 is one of its models; both optimisers stop at a relative ftol of 2.2e-9);
    (2) scikit-learn given gpfast's fitted hyperparameters and mean predicts what gpfast predicts."""
    rng, seed = fresh_rng()
    X, _, Xt = _data(rng, n=60)
    Y = _outputs(rng, X, 3)
    gp = _gp().fit(X, Y)
    kernel = ConstantKernel(1.0, (1e-4, 1e4)) * RBF(X.std(0), (1e-2, 1e5)) + WhiteKernel(0.1, (1e-4, 1e2))
    sk = GaussianProcessRegressor(kernel, normalize_y=True, n_restarts_optimizer=2, random_state=0).fit(X, Y)
    msg = f"seed {seed}: gpfast theta {gp.theta_}, scikit-learn's {sk.kernel_}"
    assert gp.converged_, msg
    assert gp.log_marginal_likelihood_ >= sk.log_marginal_likelihood_value_ - 1e-6 * abs(gp.log_marginal_likelihood_)
    theta = gp.theta_
    fixed = ConstantKernel(np.exp(theta[3]), "fixed") * RBF(np.exp(theta[:3]) * gp.x_std_, "fixed")
    fixed = fixed + WhiteKernel(np.exp(theta[4]), "fixed")
    c = (gp.constant_mean_ - gp.y_mean_) / gp.y_std_  # the fitted mean, standardised: the same for every output
    sk_at = GaussianProcessRegressor(fixed, optimizer=None).fit(X, (Y - gp.y_mean_) / gp.y_std_ - c)
    assert gp.log_marginal_likelihood_ == pytest.approx(sk_at.log_marginal_likelihood_value_, rel=1e-9), msg
    m_sk, s_sk = sk_at.predict(Xt, return_std=True)
    m, s = gp.predict(Xt, return_std=True)
    np.testing.assert_allclose(m, (m_sk + c) * gp.y_std_ + gp.y_mean_, rtol=1e-8, atol=1e-8 * Y.std(0).max())
    np.testing.assert_allclose(s, s_sk * gp.y_std_, rtol=1e-8, err_msg=msg)


def test_multioutput_lml_gradient_and_samples():
    rng, seed = fresh_rng()
    X, _, Xt = _data(rng, n=30, n_test=4)
    Y = _outputs(rng, X, 2)
    gp = _gp(max_iter=10).fit(X, Y)
    assert gp.log_marginal_likelihood(gp.theta_) == pytest.approx(gp.log_marginal_likelihood_, rel=1e-12)
    theta = gp.theta_ + rng.normal(0, 0.3, 5)
    value, grad = gp.log_marginal_likelihood(theta, eval_gradient=True)
    fd = _central_differences(gp.log_marginal_likelihood, theta)
    np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-8 * max(abs(value), 1.0), err_msg=f"seed {seed}")
    _assert_output_samples(gp, Xt, rng, seed)
    t = gp.sample_y(torch.from_numpy(Xt), 5, random_state=3)
    assert torch.is_tensor(t) and t.shape == (4, 2, 5)


def test_multioutput_with_torch_targets_and_one_column():
    rng, _ = fresh_rng()
    X, y, Xt = _data(rng, n=25, n_test=3)
    Y = np.stack([y, -y], 1)
    a = _gp(max_iter=5).fit(X, Y)
    b = _gp(max_iter=5).fit(torch.from_numpy(X), torch.from_numpy(Y))
    np.testing.assert_array_equal(b.predict(Xt), a.predict(Xt))
    mt, st = b.predict(torch.from_numpy(Xt), return_std=True)
    assert torch.is_tensor(mt) and mt.shape == st.shape == (3, 2)


@pytest.mark.parametrize(
    "params, match",
    [
        (dict(solver="cg", optimizer="lbfgs"), r"y has 2 outputs .* engine only, .*optimizer='lbfgs'"),
        (dict(solver="cg", cg={"trainer": "gpytorch"}), r"y has 2 outputs .* gives them to GPyTorch's loop"),
    ],
)
def test_multioutput_outside_the_engine_is_a_clear_error(params, match):
    rng, _ = fresh_rng()
    X, y, _ = _data(rng, n=20)
    gp = _gp(**params)
    if "cg" in params:
        assert not gp.__sklearn_tags__().target_tags.multi_output
    with pytest.raises(ValueError, match=match):
        gp.fit(X, np.stack([y, y], 1))
    assert not hasattr(gp, "model_")


def test_auto_trains_several_outputs_as_one_above_the_training_cap(monkeypatch):
    """Above the "auto" rule's training cap several outputs train by gpfast's engine, as one output does, and
    predict exactly."""
    import gpfast.estimator.solver as solver_module

    monkeypatch.setitem(solver_module.AUTO_TRAIN_CHOLESKY_MAX_N, "cpu", 10)
    rng, _ = fresh_rng()
    X, y, _ = _data(rng, n=20)
    gp = ExactGP(device="cpu", max_iter=3).fit(X, np.stack([y, y], 1))
    assert (gp.solver_, gp.train_solver_, gp.trainer_) == ("cholesky", "cg", "gpfast")


def _engine_model(X: torch.Tensor, Y: torch.Tensor):
    """ExactGPModel on X (n, d) with targets Y (n,) or (k, n), at fixed hyperparameters, float64."""
    import gpytorch

    from gpfast.models import ExactGPModel

    lik = gpytorch.likelihoods.GaussianLikelihood()
    model = ExactGPModel(X, Y, lik).double()
    lik.noise = 0.05
    model.covar_module.base_kernel.lengthscale = torch.linspace(0.7, 1.4, X.shape[1], dtype=torch.float64)
    model.covar_module.outputscale = 1.2
    return model


def test_engine_step_of_several_outputs_is_the_mean_of_single_steps():
    """One engine step on k outputs gives the mean of the k single-output steps' losses and gradients (the same
    probes, drawn from the same seed): data-fit terms averaged, the log-determinant counted once per point."""
    from gpfast.train import CGSettings, Engine

    rng, seed = fresh_rng()
    n, d, k = 150, 3, 3
    X = torch.from_numpy(rng.normal(size=(n, d)))
    Y = torch.from_numpy(rng.normal(size=(k, n))) + torch.sin(X @ torch.from_numpy(rng.normal(size=(d, k)))).T
    settings = CGSettings(cg_tolerance=1e-11, max_cg_iterations=1000, product="stored", cg_check_every=1)

    def step(targets):
        model = _engine_model(X, targets)
        engine = Engine(settings)
        torch.manual_seed(seed)
        loss = float(engine.objective(model)())
        grads = [p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]
        return loss, torch.cat(grads), engine.record

    loss, grad, rec = step(Y)
    singles = [step(Y[j]) for j in range(k)]
    msg = f"seed {seed}"
    assert loss == pytest.approx(np.mean([s[0] for s in singles]), rel=1e-9), msg
    torch.testing.assert_close(grad, torch.stack([s[1] for s in singles]).mean(0), rtol=1e-7, atol=1e-9, msg=msg)
    assert rec.data_fit[0] == pytest.approx(np.mean([s[2].data_fit[0] for s in singles]), rel=1e-9), msg
    assert rec.log_det_estimate[0] == pytest.approx(singles[0][2].log_det_estimate[0], rel=1e-9), msg


def test_cg_fit_of_repeated_columns_is_the_fit_of_one():
    """solver="cg": a fit of [y, y] takes the engine steps of a fit of y (the loss is per point and output) and
    predicts what it predicts, for both outputs."""
    rng, seed = fresh_rng()
    X, y, Xt = _data(rng, n=60)
    kw = dict(solver="cg", max_iter=15, random_state=int(rng.integers(2**31)), dtype="float64")
    one = _gp(**kw).fit(X, y)
    two = _gp(**kw).fit(X, np.stack([y, y], 1))
    assert two.trainer_ == one.trainer_ == "gpfast" and two.n_iter_ == one.n_iter_
    np.testing.assert_allclose(two.history_, one.history_, rtol=1e-9, err_msg=f"seed {seed}")
    np.testing.assert_allclose(two.theta_, one.theta_, rtol=1e-8, atol=1e-10, err_msg=f"seed {seed}")
    m1, s1 = one.predict(Xt, return_std=True)
    m2, s2 = two.predict(Xt, return_std=True)
    for j in range(2):
        np.testing.assert_allclose(m2[:, j], m1, atol=1e-6 * y.std(), err_msg=f"seed {seed}")
        np.testing.assert_allclose(s2[:, j], s1, rtol=1e-8, err_msg=f"seed {seed}")


def test_cg_predictions_of_several_outputs_match_cholesky():
    """The CG posterior of k = 3 outputs at the Cholesky fit's hyperparameters: means within 0.5% of std(y_j) and
    stds within 2% of the exact ones (the CG posterior certifies 1e-5 std(y) and 1% of each variance)."""
    rng, seed = fresh_rng()
    X, _, Xt = _data(rng, n=80, n_test=9)
    Y = _outputs(rng, X, 3)
    init = dict(noise_init=0.05, outputscale_init=1.0, lengthscale_init=X.std(0), max_iter=0)
    exact = _gp(**init).fit(X, Y)
    cg = _gp(solver="cg", **init).fit(X, Y)
    assert cg.solver_ == "cg" and exact.solver_ == "cholesky"
    np.testing.assert_allclose(cg.theta_, exact.theta_, rtol=1e-6)  # the CG model holds them in float32
    me, se = exact.predict(Xt, return_std=True)
    mc, sc = cg.predict(Xt, return_std=True)
    assert mc.shape == sc.shape == (9, 3)
    assert (np.abs(mc - me) < 5e-3 * Y.std(0)).all(), f"seed {seed}"
    np.testing.assert_allclose(sc, se, rtol=2e-2, err_msg=f"seed {seed}")
    _, cov = cg.predict(Xt, return_cov=True)
    assert cov.shape == (9, 9, 3)
    np.testing.assert_allclose(np.sqrt(np.diagonal(cov, axis1=0, axis2=1)).T, sc, rtol=2e-2, err_msg=f"seed {seed}")


def test_save_load_with_several_outputs(tmp_path):
    rng, _ = fresh_rng()
    X, _, Xt = _data(rng, n=25, n_test=5)
    Y = _outputs(rng, X, 3)
    gp = _gp(max_iter=5).fit(X, Y)
    gp.save(tmp_path / "gp.pt")
    back = ExactGP.load(tmp_path / "gp.pt")
    for a, b in zip(gp.predict(Xt, return_cov=True), back.predict(Xt, return_cov=True)):
        np.testing.assert_array_equal(a, b)
    for name in ("y_mean_", "y_std_", "outputscale_", "noise_", "constant_mean_", "theta_"):
        np.testing.assert_array_equal(getattr(back, name), getattr(gp, name), err_msg=name)
    assert back.log_marginal_likelihood(gp.theta_) == gp.log_marginal_likelihood(gp.theta_)


# ----------------------------------------------------------------------------------------------------------
# independent_outputs=True: one GP per output, trained together
# ----------------------------------------------------------------------------------------------------------
def test_independent_outputs_equal_single_fits():
    """Each output makes the runs of its own single fit (none held back or pushed on by the others): the first run,
    and the low-noise run where that one ends at a low noise. A single run takes the same L-BFGS steps and
    predicts what the single fit predicts, to rounding (the issue's bar is 1% of std(y)). A low-noise run goes
    towards the noise floor, where the loss is flat to its rounding and the two paths, whose evaluations differ
    by rounding, can end apart: there the first runs agree and the batched fit is never worse than its first."""
    rng, seed = fresh_rng()
    X, _, Xt = _data(rng, n=40)
    Y = _outputs(rng, X, 3)
    Y[:, 1] = 0.3 * np.cos(3 * X[:, 0] / X[:, 0].std()) + 0.05 * rng.normal(size=40)  # a faster-varying output
    gp = _gp(independent_outputs=True).fit(X, Y)
    m, s = gp.predict(Xt, return_std=True)
    _, c = gp.predict(Xt, return_cov=True)
    assert m.shape == s.shape == (7, 3) and c.shape == (7, 7, 3)
    assert gp.theta_.shape == (3, 5) and gp.lengthscale_.shape == (3, 3)
    for j in range(3):
        one = _gp().fit(X, Y[:, j])
        msg = f"seed {seed}, output {j}"
        runs = gp.restart_losses_[j]
        assert len(runs) == len(one.restart_losses_), msg
        assert runs[0] == pytest.approx(one.restart_losses_[0], rel=1e-7), msg
        np.testing.assert_allclose(np.sqrt(np.diagonal(c[..., j])), s[:, j], rtol=1e-10, err_msg=msg)
        if len(runs) == 2:
            assert min(runs) <= runs[0] and gp.history_[j][-1] == pytest.approx(min(runs), rel=1e-12), msg
            continue
        assert gp.n_iter_[j] == one.n_iter_ and gp.converged_[j] == one.converged_, msg
        m1, s1 = one.predict(Xt, return_std=True)
        # the same steps from evaluations that differ by rounding (batched, and not through GPyTorch's softplus
        # parameters): 1e-4 of std(y) leaves room for a flat direction of the likelihood, 100 times inside the bar
        np.testing.assert_allclose(m[:, j], m1, atol=1e-4 * Y[:, j].std(), err_msg=msg)
        np.testing.assert_allclose(s[:, j], s1, rtol=1e-4, err_msg=msg)
        np.testing.assert_allclose(gp.lengthscale_[j], one.lengthscale_, rtol=1e-3, err_msg=msg)
        for name in ("outputscale_", "noise_", "constant_mean_"):
            assert getattr(gp, name)[j] == pytest.approx(getattr(one, name), rel=1e-3, abs=1e-6), msg
    kept = sum(min(runs) for runs in gp.restart_losses_)  # each output's loss per point at its kept run
    assert gp.log_marginal_likelihood_ == pytest.approx(-40 * kept, rel=1e-9), f"seed {seed}"
    assert gp.log_marginal_likelihood(gp.theta_) == pytest.approx(gp.log_marginal_likelihood_, rel=1e-10)


def test_independent_outputs_reach_the_noise_floor_of_single_fits():
    """On noise-free outputs each output's noise goes below 1e-4 x var(y) (GPyTorch's default floor) to the single
    fit's float64 Cholesky floor, and each output's kept log likelihood is its single fit's. Each output is a sine
    of a unit-norm projection of the standardised inputs, which 40 points resolve: over 250 draws the single fit's
    noise was at most 1.2e-6 x var(y). (With a projection of N(0, I) weights about one draw in 60 had a frequency
    near 3, and its fits kept a noise of 6e-4 x var(y), the misfit of too few points rather than a floor.)"""
    rng, seed = fresh_rng()
    X, _, _ = _data(rng, n=40)
    Z = (X - X.mean(0)) / X.std(0)
    W = rng.normal(size=(3, 2))
    Y = np.sin(Z @ (W / np.linalg.norm(W, axis=0))) * rng.uniform(0.5, 5, 2)
    gp = _gp(independent_outputs=True).fit(X, Y)
    for j in range(2):
        one = _gp().fit(X, Y[:, j])
        msg = f"seed {seed}, output {j}"
        assert gp.noise_[j] < 1e-4 * Y[:, j].var() and one.noise_ < 1e-4 * Y[:, j].var(), msg
        assert min(gp.restart_losses_[j]) == pytest.approx(min(one.restart_losses_), rel=1e-6, abs=1e-6), msg


def test_independent_outputs_lml_gradient_samples_and_pickle():
    import pickle

    rng, seed = fresh_rng()
    X, _, Xt = _data(rng, n=25, n_test=4)
    Y = _outputs(rng, X, 2)
    gp = _gp(independent_outputs=True, max_iter=5, ard=False).fit(X, Y)
    assert gp.theta_.shape == (2, 3) and gp.lengthscale_.shape == (2, 3)
    theta = gp.theta_ + rng.normal(0, 0.3, gp.theta_.shape)
    value, grad = gp.log_marginal_likelihood(theta, eval_gradient=True)
    assert grad.shape == (2, 3)
    flat = lambda t: gp.log_marginal_likelihood(t.reshape(2, 3))  # noqa: E731
    fd = _central_differences(flat, theta.ravel()).reshape(2, 3)
    np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-8 * max(abs(value), 1.0), err_msg=f"seed {seed}")
    _assert_output_samples(gp, Xt, rng, seed)
    back = pickle.loads(pickle.dumps(gp))
    np.testing.assert_array_equal(back.predict(Xt), gp.predict(Xt))
    shared = gp.set_params(independent_outputs=False).fit(X, Y)  # a refit leaves nothing of the independent fit
    assert shared.theta_.shape == (3,) and shared.model_ is not None


@pytest.mark.parametrize(
    "params, match",
    [
        (dict(n_restarts=2), r"does not take n_restarts=2"),
        (dict(optimizer="adam"), r"does not take optimizer='adam'"),
        (dict(independent_outputs="yes"), r"invalid independent_outputs='yes'; expected True or False"),
    ],
)
def test_independent_outputs_arguments_are_checked(params, match):
    rng, _ = fresh_rng()
    X, y, _ = _data(rng, n=20)
    gp = _gp(**{"independent_outputs": True, **params})
    with pytest.raises(ValueError, match=match):
        gp.fit(X, np.stack([y, -y], 1))
    assert not hasattr(gp, "model_")


def test_independent_outputs_above_the_cholesky_cap_equal_their_single_fits(monkeypatch):
    """Above the cap, each output trained by its own engine in the batch equals its single fit with solver='cg' on
    that column alone and the same seed: predictions within 1% of std(y_j), and the same number of Adam steps,
    which differ between the outputs (each stops on its own test)."""
    import gpfast.estimator.solver as solver_module

    monkeypatch.setitem(solver_module.AUTO_CHOLESKY_MAX_N, "cpu", 100)
    rng, seed = fresh_rng()
    X, _, Xt = _data(rng, n=300, n_test=20)
    Y = _outputs(rng, X, 3)
    gp = _gp(solver="auto", independent_outputs=True, random_state=seed).fit(X, Y)
    assert (gp.solver_, gp.trainer_, gp.optimizer_, gp.log_marginal_likelihood_method_) == (
        "cg",
        "gpfast",
        "adam",
        "cg_estimate",
    )
    mean, std = gp.predict(Xt, return_std=True)
    assert mean.shape == std.shape == (20, 3) and gp.theta_.shape == (3, 5)
    for j in range(3):
        single = _gp(solver="cg", random_state=seed).fit(X, Y[:, j])
        m, s = single.predict(Xt, return_std=True)
        scale = Y[:, j].std()
        assert np.abs(mean[:, j] - m).max() < 0.01 * scale, f"output {j}, seed {seed}"
        assert np.abs(std[:, j] - s).max() < 0.01 * scale, f"output {j}, seed {seed}"
        assert gp.n_iter_[j] == single.n_iter_ and gp.converged_[j] == single.converged_, f"output {j}, seed {seed}"
        assert len(gp.cg_iterations_[j]) == single.n_iter_


def test_independent_outputs_stop_on_their_own_test(monkeypatch):
    """An output that converges leaves the batch: beside an output of high frequency and little noise, each takes
    its single fit's steps (count and losses), neither held back nor pushed on by the other."""
    rng, seed = fresh_rng()
    X, y, Xt = _data(rng, n=300)
    Y = np.stack([y, np.sin(8 * (X[:, 0] - X[:, 0].mean()) / X[:, 0].std()) + 0.01 * rng.normal(size=300)], 1)
    gp = _gp(solver="cg", independent_outputs=True, random_state=seed, max_iter=300).fit(X, Y)
    for j in range(2):
        single = _gp(solver="cg", random_state=seed, max_iter=300).fit(X, Y[:, j])
        assert gp.n_iter_[j] == single.n_iter_ and gp.history_[j] == pytest.approx(single.history_, rel=1e-4), (
            f"output {j}, seed {seed}"
        )


def test_independent_outputs_on_the_engine_save_and_load(tmp_path):
    """A fit trained by the engine saves its rows of theta and loads with the same CG predictions."""
    rng, seed = fresh_rng()
    X, _, Xt = _data(rng, n=120, n_test=5)
    gp = _gp(solver="cg", independent_outputs=True, random_state=seed, max_iter=15).fit(X, _outputs(rng, X, 2))
    gp.save(tmp_path / "gp.pt")
    back = ExactGP.load(tmp_path / "gp.pt")
    assert back.solver_ == "cg" and back.model_ is None
    for a, b in zip(gp.predict(Xt, return_std=True), back.predict(Xt, return_std=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(back.theta_, gp.theta_)


@pytest.mark.parametrize(
    "params, match",
    [
        (dict(optimizer="lbfgs"), r"gpfast's engine under Adam; it does not take optimizer='lbfgs'"),
        (dict(cg={"trainer": "gpytorch"}), r"does not take cg trainer='gpytorch'"),
        (dict(n_restarts=1), r"does not take n_restarts=1"),
    ],
)
def test_independent_outputs_on_the_engine_refuse_what_they_do_not_support(params, match):
    rng, _ = fresh_rng()
    X, y, _ = _data(rng, n=30)
    with pytest.raises(ValueError, match=match):
        _gp(solver="cg", independent_outputs=True, **params).fit(X, np.stack([y, -y], 1))


def test_independent_outputs_with_one_output_is_an_ordinary_fit():
    rng, _ = fresh_rng()
    X, y, Xt = _data(rng, n=20)
    a = _gp(max_iter=5).fit(X, y)
    b = _gp(max_iter=5, independent_outputs=True).fit(X, y)
    np.testing.assert_array_equal(b.predict(Xt), a.predict(Xt))


def test_independent_outputs_save_and_load(tmp_path):
    """A saved fit with independent_outputs=True loads with the same predictions, likelihood and attributes."""
    rng, seed = fresh_rng()
    X, _, Xt = _data(rng, n=25, n_test=5)
    Y = _outputs(rng, X, 3)
    gp = _gp(independent_outputs=True, max_iter=4).fit(X, Y)
    gp.save(tmp_path / "gp.pt")
    back = ExactGP.load(tmp_path / "gp.pt")
    assert back.model_ is None and back.independent_outputs is True
    for a, b in zip(gp.predict(Xt, return_cov=True), back.predict(Xt, return_cov=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"seed {seed}")
    for name in ("theta_", "lengthscale_", "outputscale_", "noise_", "constant_mean_", "y_mean_", "y_std_"):
        np.testing.assert_array_equal(getattr(back, name), getattr(gp, name), err_msg=name)
    for name in ("n_iter_", "converged_", "history_", "log_marginal_likelihood_"):
        assert getattr(back, name) == getattr(gp, name), name
    theta = gp.theta_ + 0.1
    assert back.log_marginal_likelihood(theta) == gp.log_marginal_likelihood(theta)


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("independent_theta", torch.zeros(3, 5, dtype=torch.float64), r"independent_theta must be a tensor of shape"),
        ("independent_theta", torch.full((2, 6), float("nan")), "independent_theta must hold finite floats"),
        ("n_iter_", [2], "history_ and n_iter_ must be lists of 2 entries"),
        ("n_iter_", lambda s: [s["n_iter_"][0], 99], r"n_iter_\[1\] = 99 but history_\[1\] has \d+ entries"),
        (
            "model_state_dict",
            {"x": torch.zeros(1)},
            "a fit with independent_outputs=True has no GPyTorch model, but the file holds",
        ),
        ("params", "shared", "it holds independent_theta .* but params has no such setting"),
    ],
)
def test_independent_outputs_inconsistent_files(tmp_path, key, value, expected):
    from gpfast.estimator.persistence import read_state, write_state

    rng, _ = fresh_rng()
    X, _, _ = _data(rng, n=15)
    gp = _gp(independent_outputs=True, max_iter=2).fit(X, _outputs(rng, X, 2))
    gp.save(tmp_path / "gp.pt")
    _, state = read_state(tmp_path / "gp.pt")
    if key == "params":
        state["params"] = {**state["params"], "independent_outputs": False}
    else:
        state[key] = value(state) if callable(value) else value
    write_state(state, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=f"cannot load .*bad.pt.*: its contents are inconsistent: {expected}"):
        ExactGP.load(tmp_path / "bad.pt")


def test_interrupted_engine_fit_of_several_outputs_resumes_bit_for_bit(monkeypatch, tmp_path):
    """The engine's state of several outputs (k data columns beside the probes) goes into the checkpoint and back:
    a fit stopped after its second checkpoint resumes to the uninterrupted fit, bit for bit on the CPU."""
    from test_checkpoint import ENGINE, _fit, _interrupted

    rng, seed = fresh_rng()
    X, y, Xt = _data(rng, n=80)
    Y = np.stack([y, np.cos(X[:, 0]) + 0.1 * rng.normal(size=80)], 1)
    path = tmp_path / "fit.ckpt"
    _interrupted(monkeypatch, path, X, Y, 2, **ENGINE)
    resumed = _fit(X, Y, checkpoint=(path, 2), **ENGINE)
    plain = _fit(X, Y, **ENGINE)
    assert resumed.trainer_ == "gpfast" and not path.exists()
    for name in ("history_", "restart_losses_", "n_iter_", "cg_iterations_", "history_data_fit_"):
        assert getattr(resumed, name) == getattr(plain, name), f"{name}, seed {seed}"
    np.testing.assert_array_equal(resumed.theta_, plain.theta_)
    np.testing.assert_array_equal(resumed.predict(Xt), plain.predict(Xt))


def test_several_outputs_above_the_exact_cap_report_the_cg_estimate(monkeypatch):
    """Where no exact factorisation is allowed, the log marginal likelihood of several outputs is GPyTorch's CG
    estimate summed over them, and predictions come from the CG posterior."""
    import gpfast.estimator.solver as solver_module

    monkeypatch.setitem(solver_module.AUTO_CHOLESKY_MAX_N, "cpu", 10)
    rng, seed = fresh_rng()
    X, y, Xt = _data(rng, n=60)
    gp = _gp(solver="cg", max_iter=2, dtype="float64").fit(X, np.stack([y, np.cos(X[:, 0])], 1))
    assert (gp.solver_, gp.trainer_, gp.log_marginal_likelihood_method_) == ("cg", "gpfast", "cg_estimate")
    assert np.isfinite(gp.log_marginal_likelihood_), f"seed {seed}"
    m, s = gp.predict(Xt, return_std=True)
    assert m.shape == s.shape == (7, 2) and np.isfinite(m).all() and (s > 0).all()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_independent_outputs_unstandardised_equal_single_fits(seed):
    """With standardize=False, outputs of std 1, 1000 and 0.001 each predict as their own single fit does (within 1%
    of std(y_j) in the mean and 1% in the std): each output trains in its own units' box, as the single fit does.
    Measured worst case over these seeds: 0.59% (the scale-1000 output's mean; the optimisers differ in the mean's
    scaling, not in the optimum). With one unit box for all outputs, the scale-1000 output was 2 std(y) off."""
    import warnings

    rng = np.random.default_rng(seed)
    X = rng.normal(size=(150, 3))
    f = np.sin(X[:, 0]) + 0.5 * X[:, 1]
    scales = [1.0, 1000.0, 0.001]
    Y = np.stack([s * (f + 0.1 * rng.normal(size=150)) for s in scales], 1)
    Xt = rng.normal(size=(50, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # noise-floor and convergence notes of the tiny output: the same in both
        both = ExactGP(independent_outputs=True, standardize=False, random_state=0).fit(X, Y)
        mean, std = both.predict(Xt, return_std=True)
        for j in range(3):
            alone = ExactGP(standardize=False, random_state=0).fit(X, Y[:, j])
            m, s = alone.predict(Xt, return_std=True)
            assert np.abs(mean[:, j] - m).max() <= 0.01 * Y[:, j].std(), j
            assert np.abs(std[:, j] / s - 1).max() <= 0.01, j
