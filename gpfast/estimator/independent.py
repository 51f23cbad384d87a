"""Many independent GPs on the same inputs, trained together: one exact GP per output, each with its own
hyperparameters, for small n. With ``solver="cg"``, and with ``solver="auto"`` above the Cholesky cap or where the
k factorisations do not fit (:func:`engine_trains`), gpfast's engine trains them instead
(:mod:`~gpfast.estimator.independent_cg`).

* **Objective.** For outputs ``j`` the covariances ``K_j`` (k, n, n) come from one call of the fused op with a batch
  of lengthscales and outputscales (:func:`gpfast.ops.rbf_covariance`, differentiable), and the k exact negative
  log likelihoods from one batched float64 Cholesky (Rasmussen & Williams 2006, Alg. 2.1), with the closed-form
  gradient of :mod:`~gpfast.estimator.exact_objective` for each (eq. 5.9).
* **Optimiser.** :func:`~gpfast.estimator.batched_lbfgs.minimize_batched_lbfgs`: one box-constrained L-BFGS per
  output, vectorised over the outputs, with the stopping tests of a single fit's L-BFGS-B
  (:func:`~gpfast.estimator.optimize.minimize_lbfgs`); each round evaluates every output still running in one
  batched call. An output that has converged leaves the batch: none is held back, or pushed on, by the others.
  (One scipy L-BFGS-B per output in a thread of its own, :func:`~gpfast.estimator.lockstep.minimize_lockstep`,
  spends ~0.6 ms of hand-offs per output-evaluation: ~30 s for a thousand outputs, against tens of ms of GPU
  work.) It takes the steps of the single fit's scipy L-BFGS-B, to rounding. As in a single fit on the exact
  path, the first run keeps the noise above the first run's floor, and the outputs that
  end it at a low noise run again from the low-noise start (:mod:`~gpfast.estimator.restarts`), keeping the better.
* **Posterior.** :class:`IndependentPosterior` factors the k matrices once (batched) and predicts every output.
"""

from __future__ import annotations

import math
import warnings

import gpytorch
import numpy as np
import torch
from linear_operator.utils.errors import NotPSDError
from sklearn.exceptions import ConvergenceWarning

from gpfast import ops
from gpfast.estimator import params as _params
from gpfast.estimator import independent_cg
from gpfast.estimator import solver as _solver
from gpfast.estimator.batched_lbfgs import minimize_batched_lbfgs
from gpfast.estimator.fitting import clipped_start, engine_attributes
from gpfast.estimator.hyperparameters import HyperparameterSpace, noise_constraint, theta_array
from gpfast.estimator.inputs import standardized, validate_training
from gpfast.estimator.restarts import first_run_space, low_noise_start
from gpfast.models import ExactGPModel
from gpfast.standardize import column_stats

__all__ = ["IndependentPosterior", "batched_loss", "check_settings", "fit", "fit_estimator"]

#: Float64 (n, n) matrices per output that the batched fit needs in memory (covariance, factor, inverse).
_MATRICES_PER_OUTPUT = 3


class _BatchedGaussianNLL(torch.autograd.Function):
    """nll_j(K_j, noise_j, r_j) for a batch: K (k, n, n) noise-free covariances, noise (k,), r (k, n); returns (k,)."""

    @staticmethod
    def forward(ctx, K: torch.Tensor, noise: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        n = r.shape[-1]
        A = K.clone()
        A.diagonal(dim1=-2, dim2=-1).add_(noise[:, None])
        L, info = torch.linalg.cholesky_ex(A)
        bad = torch.nonzero(info).reshape(-1).tolist()
        if bad:
            raise NotPSDError(
                f"the {n}x{n} training covariance of output(s) {bad} is not positive definite in float64 "
                f"(noise {noise[bad].tolist()})"
            )
        alpha = torch.cholesky_solve(r.unsqueeze(-1), L).squeeze(-1)
        log_det = L.diagonal(dim1=-2, dim2=-1).log().sum(-1)
        nll = 0.5 * (r * alpha).sum(-1) + log_det + 0.5 * n * math.log(2 * math.pi)
        ctx.save_for_backward(L, alpha)
        return nll

    @staticmethod
    def backward(ctx, grad):
        L, alpha = ctx.saved_tensors
        W = torch.cholesky_inverse(L)
        W.sub_(alpha.unsqueeze(-1) * alpha.unsqueeze(-2)).mul_(0.5 * grad[:, None, None])
        return W, W.diagonal(dim1=-2, dim2=-1).sum(-1), grad[:, None] * alpha


def _unpack(theta: torch.Tensor, n_lengthscales: int):
    """(lengthscale (k, 1, p), outputscale (k,), noise (k,), mean (k,)) from theta rows
    ``[log lengthscale (p), log outputscale, log noise, mean]`` (the layout of HyperparameterSpace)."""
    p = n_lengthscales
    v = theta[:, : p + 2].exp()
    return v[:, :p].unsqueeze(1), v[:, p], v[:, p + 1], theta[:, p + 2]


def batched_loss(X: torch.Tensor, Y: torch.Tensor, theta: np.ndarray, n_lengthscales: int):
    """Negative log marginal likelihood per data point of each output and its gradient in theta.

    Parameters
    ----------
    X : (n, d) float64 tensor
    Y : (k, n) float64 tensor, the outputs to evaluate (on X's device)
    theta : (k, p + 3) float64 array, rows in the layout of :class:`HyperparameterSpace`
    n_lengthscales : int
        p: d with ARD, else 1.

    Returns
    -------
    (loss (k,), grad (k, p + 3)) float64 numpy arrays.
    """
    t = torch.as_tensor(theta, dtype=torch.float64, device=X.device).clone().requires_grad_(True)
    with torch.enable_grad():
        lengthscale, outputscale, noise, mean = _unpack(t, n_lengthscales)
        K = ops.rbf_covariance(X, X, lengthscale, outputscale, check_values=False)
        nll = _BatchedGaussianNLL.apply(K, noise, Y - mean[:, None]) / X.shape[0]
        (grad,) = torch.autograd.grad(nll.sum(), t)
    return nll.detach().cpu().numpy(), grad.cpu().numpy()


class IndependentPosterior:
    """Exact posteriors of k independent GPs on the same standardised inputs ``X`` (n, d) with targets ``Y``
    (k, n) and hyperparameters ``theta`` (k, p + 3): ``K_j + noise_j I = L_j L_j^T``, factored once (batched)."""

    def __init__(self, X: torch.Tensor, Y: torch.Tensor, theta: np.ndarray, n_lengthscales: int):
        t = torch.as_tensor(theta, dtype=torch.float64, device=X.device)
        self.lengthscale, self.outputscale, self.noise, self.mean = _unpack(t, n_lengthscales)
        self.X = X
        A = ops.rbf_covariance(X, X, self.lengthscale, self.outputscale, check_values=False)
        A.diagonal(dim1=-2, dim2=-1).add_(self.noise[:, None])
        self.L = torch.linalg.cholesky(A)
        self._r = Y - self.mean[:, None]
        self.alpha = torch.cholesky_solve(self._r.unsqueeze(-1), self.L).squeeze(-1)

    def log_marginal_likelihood(self) -> torch.Tensor:
        """Each output's exact log marginal likelihood, (k,)."""
        n = self.X.shape[0]
        log_det = self.L.diagonal(dim1=-2, dim2=-1).log().sum(-1)
        return -0.5 * (self._r * self.alpha).sum(-1) - log_det - 0.5 * n * math.log(2 * math.pi)

    def predict(self, Xt: torch.Tensor, return_std: bool, return_cov: bool, include_noise: bool):
        """Means (m, k) and variances (m, k) or covariances (m, m, k) at standardised inputs Xt (m, d), float64."""
        Ks = ops.rbf_covariance(self.X, Xt, self.lengthscale, self.outputscale, check_values=False)  # (k, n, m)
        mean = (Ks.mT @ self.alpha.unsqueeze(-1)).squeeze(-1) + self.mean[:, None]  # (k, m)
        if not (return_std or return_cov):
            return mean.T
        V = torch.linalg.solve_triangular(self.L, Ks, upper=False)
        if return_cov:
            Kss = ops.rbf_covariance(Xt, Xt, self.lengthscale, self.outputscale, check_values=False)
            cov = Kss - V.mT @ V
            cov = 0.5 * (cov + cov.mT)
            if include_noise:
                cov.diagonal(dim1=-2, dim2=-1).add_(self.noise[:, None])
            return mean.T, cov.permute(1, 2, 0)
        var = (self.outputscale[:, None] - V.pow(2).sum(-2)).clamp(min=0)
        if include_noise:
            var = var + self.noise[:, None]
        return mean.T, var.T


def engine_trains(est, settings: _params.Settings, k: int, n: int) -> bool:
    """Whether the k outputs of ``est``'s fit at n points train by gpfast's engine
    (:mod:`~gpfast.estimator.independent_cg`) rather than by batched Cholesky: with ``solver="cg"``, and with
    ``solver="auto"`` above the Cholesky cap of the device or where the k factorisations do not fit in memory."""
    if est.solver != "auto":
        return est.solver == "cg"
    cap = _solver.AUTO_CHOLESKY_MAX_N.get(settings.device.type, _solver.AUTO_CHOLESKY_MAX_N["cpu"])
    return n > cap or _MATRICES_PER_OUTPUT * k * 8 * n * n > _solver.free_memory_bytes(settings.device)


def check_settings(est, settings: _params.Settings, k: int, n: int) -> None:
    """ValueError naming the first argument of ``est`` that the batched fit of ``k`` outputs does not take, or the
    memory it lacks (``settings``: ``est``'s resolved arguments)."""
    unsupported = {
        "solver": (est.solver, ("auto", "cholesky")),
        "optimizer": (est.optimizer, ("auto", "lbfgs")),
        "cg trainer": (settings.cg.trainer, ("auto",)),
        **_params.one_run_settings(est),
    }
    _params.refuse_unsupported(
        unsupported,
        lambda name, value, expected: (
            f"ExactGP: independent_outputs=True trains every output by L-BFGS on its exact likelihood in one "
            f"batch; it does not take {name}={value!r} (expected {expected})."
        ),
    )
    need = _MATRICES_PER_OUTPUT * k * 8 * n * n
    free = _solver.free_memory_bytes(settings.device)
    if need > free:
        raise ValueError(
            f"ExactGP: independent_outputs=True with {k} outputs and n={n} needs about {need / 1e9:.3g} GB for the "
            f"batched float64 factorisations, but {free / 1e9:.3g} GB is free on {settings.device}; fit fewer "
            f"outputs at a time, or fit them with shared hyperparameters (independent_outputs=False)."
        )


def fit_estimator(est, X, y) -> dict:
    """Everything ``ExactGP.fit`` does with ``independent_outputs=True``: validate, standardise, check, train;
    returns the fitted attributes. A y of one output is an ordinary fit."""
    settings = _params.resolve(est)
    Xt, yt = validate_training(est, X, y)
    if yt.dim() == 1:
        return est._fit(X, y)
    n, d = Xt.shape
    if engine_trains(est, settings, yt.shape[1], n):
        fitted = independent_cg.fit_estimator(est, settings, Xt, yt)
        theta = fitted["_independent_theta"]
        return {**fitted, **hyperparameter_attributes(theta, fitted["x_std_"], fitted["y_mean_"], fitted["y_std_"])}
    check_settings(est, settings, yt.shape[1], n)
    data = standardized(Xt, yt, bool(est.standardize), settings.device)
    # standardised initial values: fractions of each output's variance
    inits = _params.initial_values(est, d, torch.from_numpy(data.x_std), 1.0)
    fitted = fit(est, data.X, data.y, inits, None if est.standardize else column_stats(data.y).std.cpu().numpy())
    return dict(
        **data.attributes(),
        model_=None,
        likelihood_=None,
        solver_="cholesky",
        train_solver_="cholesky",
        trainer_="exact",
        optimizer_="lbfgs",
        product_=None,
        pretrain_history_=[],
        _cg_posterior=None,
        fit_seconds_=None,
        **engine_attributes(None),  # the engine's records: it did not train
        **fitted,
        **hyperparameter_attributes(fitted["_independent_theta"], data.x_std, data.y_mean, data.y_std),
    )


def fit(est, Xs: torch.Tensor, Ys: torch.Tensor, inits: dict, scales: np.ndarray | None = None) -> dict:
    """Train one GP per output of the standardised ``Ys`` (n, k) at standardised inputs ``Xs`` (n, d), float64 on
    the fit's device, from the initial values ``inits`` (standardised, as :func:`gpfast.estimator.params.
    initial_values` gives them). Returns the fitted attributes that depend on the training.

    ``scales`` (k,): targets that are not standardised (``standardize=False``) train as ``Ys[:, j] / scales[j]``,
    and the fitted outputscale, noise and mean are scaled back. A single fit on such a target takes its box and its
    default start from the target's own variance; one box for all outputs (the unit one) would hold an output of
    std 1000 far from its optimum (its predictions were 2 std(y) from its single fit's)."""
    n, d = Xs.shape
    k = Ys.shape[1]
    raw = Ys.T.contiguous()
    scale = torch.ones(k, dtype=Ys.dtype, device=Ys.device) if scales is None else torch.as_tensor(scales).to(Ys)
    targets = raw / scale[:, None]
    # one GPyTorch model gives the box of the single fit for every output: the noise floor is the float64 Cholesky
    # path's, as in a single fit (GPyTorch's default constraint would hold the noise at 1e-4 x var(y))
    likelihood = gpytorch.likelihoods.GaussianLikelihood(
        noise_constraint=noise_constraint("cholesky", torch.float64, 1.0)
    )
    probe = ExactGPModel(Xs, targets[0], likelihood, ard=bool(est.ard))
    space = HyperparameterSpace.for_data(probe, column_stats(Xs).std.cpu(), 1.0)
    p = space.n_lengthscales
    theta0 = space.initial(inits["lengthscale"], inits["outputscale"], inits["noise"])
    if est.max_iter > 0:
        theta0 = clipped_start(space, theta0)

    def evaluate(rows, thetas):
        index = torch.as_tensor(np.asarray(rows, dtype=np.int64), device=targets.device)
        return batched_loss(Xs, targets[index], thetas, p)

    restart_losses: list = []
    if est.max_iter > 0:
        runs, restart_losses = _train(evaluate, theta0, space, n, k, int(est.max_iter), est.tol)
        theta = np.stack([r.theta for r in runs])
        stopped = [j for j, r in enumerate(runs) if not r.converged]
        if stopped and est.tol != 0:
            warnings.warn(
                f"ExactGP: the optimiser (lbfgs) stopped without converging on output(s) {stopped} after "
                f"max_iter={est.max_iter} iterations; their hyperparameters may be short of the optimum. Raise "
                f"max_iter, or set tol.",
                ConvergenceWarning,
                stacklevel=4,
            )
    else:
        runs, theta = [], np.tile(theta0, (k, 1))
    log_scale = np.log(scale.cpu().numpy())
    theta = theta.copy()
    theta[:, p : p + 2] += 2 * log_scale[:, None]  # outputscale and noise: variances
    theta[:, p + 2] *= np.exp(log_scale)  # the mean: in y's units
    posterior = IndependentPosterior(Xs, raw, theta, p)
    lml = posterior.log_marginal_likelihood()
    # the per-point losses of y / scale are those of y less log(scale)
    restart_losses = [[v + float(log_scale[j]) for v in losses] for j, losses in enumerate(restart_losses)]
    return dict(
        _posterior=posterior,
        _independent_theta=theta,
        history_=[[v + float(log_scale[j]) for v in r.history] for j, r in enumerate(runs)],
        n_iter_=[r.n_iter for r in runs],
        converged_=[r.converged for r in runs],
        restart_losses_=restart_losses,
        log_marginal_likelihood_=float(lml.sum()),
        log_marginal_likelihood_method_="cholesky",
        _messages=[r.message for r in runs],
    )


def _train(evaluate, theta0: np.ndarray, space: HyperparameterSpace, n: int, k: int, max_iter: int, tol):
    """Each output's runs as a single fit's on the exact path (:func:`gpfast.estimator.fitting.run_plan`): the first
    from ``theta0`` inside the first run's box, then, for the outputs whose first run ended at a low noise, one from
    the low-noise start in the whole box (:mod:`gpfast.estimator.restarts`), all outputs of a run together. Each
    output keeps its better run (the first on ties). Returns the k kept runs and each output's final losses, in
    the order of its runs."""
    first_space = first_run_space(space, "cholesky")
    runs = minimize_batched_lbfgs(evaluate, np.tile(theta0, (k, 1)), first_space, n, max_iter, tol)
    losses = [[float(r.loss)] for r in runs]
    starts = {j: low_noise_start(space, theta0, r.theta, "cholesky", n) for j, r in enumerate(runs)}
    again = [j for j, start in starts.items() if start is not None]
    if again:

        def evaluate_again(rows, thetas):
            return evaluate([again[i] for i in rows], thetas)

        second = minimize_batched_lbfgs(
            evaluate_again, np.stack([starts[j] for j in again]), space, n, max_iter, tol, labels=again
        )
        for j, r in zip(again, second):
            losses[j].append(float(r.loss))
            if r.loss < runs[j].loss:
                runs[j] = r
    return runs, losses


def log_marginal_likelihood(X, Y, theta_fitted: np.ndarray, n_lengthscales: int, theta, eval_gradient: bool):
    """The sum over the outputs of the exact log marginal likelihoods at ``theta`` (k, p + 2): rows
    ``log([lengthscale(s), outputscale, noise])`` in standardised units, each output's mean at its fitted value;
    with ``eval_gradient`` also its gradient (k, p + 2)."""
    k, size = theta_fitted.shape[0], n_lengthscales + 2
    arr = theta_array(theta, (k, size), "a row of log lengthscale(s), log outputscale and log noise per output")
    full = np.concatenate([arr, theta_fitted[:, -1:]], 1)
    n = X.shape[0]
    try:
        loss, grad = batched_loss(X, Y.T.contiguous(), full, n_lengthscales)
    except NotPSDError:
        return (-np.inf, np.zeros_like(arr)) if eval_gradient else -np.inf
    value = -float(n * loss.sum())
    return (value, -n * grad[:, :size]) if eval_gradient else value


def hyperparameter_attributes(theta: np.ndarray, x_std: np.ndarray, y_mean: np.ndarray, y_std: np.ndarray) -> dict:
    """``lengthscale_`` (k, d), ``outputscale_``, ``noise_`` and ``constant_mean_`` (k,) in the units of X and of
    each output, from the fitted rows of theta (k, p + 3) in standardised units."""
    p = theta.shape[1] - 3
    return dict(
        lengthscale_=np.exp(theta[:, :p]) * x_std,  # (k, 1) broadcasts to (k, d) without ARD
        outputscale_=np.exp(theta[:, p]) * y_std**2,
        noise_=np.exp(theta[:, p + 1]) * y_std**2,
        constant_mean_=theta[:, p + 2] * y_std + y_mean,
    )


def posterior_of(est) -> IndependentPosterior:
    """The fitted estimator's posterior, factored again when unpickling has dropped it."""
    if getattr(est, "_posterior", None) is None and est.solver_ == "cg":
        settings = _params.resolve(est)
        theta = est._independent_theta
        y = est.y_train_
        est._posterior = independent_cg.IndependentCGPosterior(est.X_train_, y, theta, settings.dtype, settings.cg)
    elif getattr(est, "_posterior", None) is None:
        theta = est._independent_theta
        est._posterior = IndependentPosterior(est.X_train_, est.y_train_.T.contiguous(), theta, theta.shape[1] - 3)
    return est._posterior
