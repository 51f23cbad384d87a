"""Many independent GPs on the same inputs above the Cholesky cap: one GP per output, each with its own
hyperparameters, trained together by gpfast's engine (:class:`gpfast.train.batched.BatchedEngine`) under Adam, and
predicting through a CG posterior per output (:class:`gpfast.models.CGPosterior`).

Each output takes the steps of its own single fit (``ExactGP(solver="cg")`` on that column alone, same seed): the
same model, box and start, the engine's products, preconditioner and probes of its own, and its own projected Adam
(:func:`~gpfast.estimator.optimize.minimize_adam`) with its own stopping test. The outputs step in lockstep
(:func:`~gpfast.estimator.lockstep.minimize_lockstep`); an output whose test is met leaves the batch while the
others go on.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning

from gpfast.estimator import params as _params
from gpfast.estimator import prediction
from gpfast.estimator import solver as _solver
from gpfast.estimator.fitting import (
    loss_and_gradient,
    engine_attributes,
    fitted_log_marginal_likelihood,
    initial_model,
    clipped_start,
    one_thread_if_small,
    seeded,
    solver_settings,
)
from gpfast.estimator.inputs import standardized
from gpfast.estimator.lockstep import minimize_lockstep
from gpfast.estimator.optimize import OptimizeResult, minimize_adam
from gpfast.train.batched import BatchedEngine
from gpfast.train.settings import CGSettings

__all__ = ["IndependentCGPosterior", "check_settings", "fit_estimator"]


class IndependentCGPosterior:
    """CG posteriors of k independent GPs on the same standardised inputs ``X`` (n, d) with targets ``Y`` (n, k)
    and hyperparameters ``theta`` (k, p + 3) in the layout of
    :class:`~gpfast.estimator.hyperparameters.HyperparameterSpace`: one :class:`gpfast.models.CGPosterior` per
    output, solving in ``dtype`` under the ``predict_*`` fields of ``cg``."""

    def __init__(self, X: torch.Tensor, Y: torch.Tensor, theta: np.ndarray, dtype: torch.dtype, cg: CGSettings):
        p = theta.shape[1] - 3
        self.posteriors = []
        for j, row in enumerate(np.asarray(theta, dtype=np.float64)):
            t = torch.as_tensor(row, dtype=torch.float64, device=X.device)
            hyp = dict(
                lengthscale=t[:p].exp().reshape(1, p), outputscale=t[p].exp(), noise=t[p + 1].exp(), mean=t[p + 2]
            )
            self.posteriors.append(prediction.cg_posterior(X, Y[:, j], hyp, dtype, cg))

    def predict(self, Xt: torch.Tensor, return_std: bool, return_cov: bool, include_noise: bool):
        """Means (m, k) and variances (m, k) or covariances (m, m, k) at standardised inputs Xt (m, d), float64."""
        flags = dict(return_std=return_std, return_cov=return_cov, include_noise=include_noise)
        res = [prediction.predict_cg(post, Xt, **flags) for post in self.posteriors]
        if not (return_std or return_cov):
            return torch.stack(res, -1)
        return torch.stack([r[0] for r in res], -1), torch.stack([r[1] for r in res], -1)


def check_settings(est, settings: _params.Settings) -> None:
    """ValueError naming the first argument of ``est`` that the engine's fit of independent outputs does not take
    (``settings``: ``est``'s resolved arguments)."""
    unsupported = {
        "optimizer": (est.optimizer, ("auto", "adam")),
        "cg trainer": (settings.cg.trainer, ("auto", "gpfast")),
        **_params.one_run_settings(est),
    }
    _params.refuse_unsupported(
        unsupported,
        lambda name, value, expected: (
            f"ExactGP: independent_outputs=True with solver={est.solver!r} at this n trains every output by "
            f"gpfast's engine under Adam; it does not take {name}={value!r} (expected {expected}). Fit the outputs "
            f"one at a time for that setting, or with shared hyperparameters (independent_outputs=False)."
        ),
    )


def fit_estimator(est, settings: _params.Settings, Xt: torch.Tensor, yt: torch.Tensor) -> dict:
    """Everything ``ExactGP.fit`` does with ``independent_outputs=True`` on the engine's path, for validated data
    Xt (n, d) and yt (n, k), k > 1; returns the fitted attributes but the hyperparameters in the units of the data."""
    check_settings(est, settings)
    n, d = Xt.shape
    k = yt.shape[1]
    data = standardized(Xt, yt, bool(est.standardize), settings.device)
    # standardised initial values: fractions of each output's variance, as on the Cholesky path
    inits = _params.initial_values(est, d, torch.from_numpy(data.x_std), 1.0)
    free_each = _solver.free_memory_bytes(settings.device) // k  # every output's product is held at once
    plan = est._plan(settings, (n, d), free_each, 1)
    with seeded(settings.seed, settings.device):
        models, spaces, runs, records = _train(est, plan, data.X, data.y, inits, free_each)
        fits = []
        for j, (model, space, run) in enumerate(zip(models, spaces, runs)):
            space.set(model, run.theta)
            model.eval()
            model.likelihood.eval()
            fits.append(fitted_log_marginal_likelihood(model, data.X, data.y[:, j], plan))
    theta = np.stack([run.theta for run in runs])
    stopped = [j for j, run in enumerate(runs) if not run.converged]
    if est.max_iter > 0 and stopped and est.tol != 0:
        warnings.warn(
            f"ExactGP: the optimiser (adam) stopped without converging on output(s) {stopped} after "
            f"max_iter={est.max_iter} iterations; their hyperparameters may be short of the optimum. Raise max_iter, "
            f"or set tol.",
            ConvergenceWarning,
            stacklevel=4,
        )
    per_output = [engine_attributes(r) for r in records]
    return dict(
        **data.attributes(),
        model_=None,
        likelihood_=None,
        solver_=plan.solver,
        train_solver_="cg",
        trainer_="gpfast",
        optimizer_="adam",
        product_=plan.full.product,
        pretrain_history_=[],
        _cg_posterior=None,
        fit_seconds_=None,
        _posterior=IndependentCGPosterior(data.X, data.y, theta, plan.dtype, settings.cg),
        _independent_theta=theta,
        history_=[run.history for run in runs],
        n_iter_=[run.n_iter for run in runs],
        converged_=[run.converged for run in runs],
        restart_losses_=[[float(run.loss)] for run in runs],
        log_marginal_likelihood_=float(sum(f[0] for f in fits)),
        log_marginal_likelihood_method_=fits[0][1],
        _messages=[run.message for run in runs],
        **{name: [a[name] for a in per_output] for name in per_output[0]},
    )


def _train(est, plan: _solver.FitPlan, Xs: torch.Tensor, Ys: torch.Tensor, inits: dict, free_each: int):
    """Each output's model, box, Adam run and engine record, the runs in lockstep (module docstring)."""
    k, max_iter = Ys.shape[1], int(est.max_iter)
    models, spaces, starts = [], [], []
    for j in range(k):  # each output's model, box and start as its single fit builds them
        model, space, theta0 = initial_model(Xs, Ys[:, j], plan, inits, bool(est.ard), False)
        if max_iter > 0 or "noise" in space.outside(theta0):
            theta0 = clipped_start(space, theta0)
        space.set(model, theta0)
        model.train()
        model.likelihood.train()
        models.append(model)
        spaces.append(space)
        starts.append(space.get(model))
    if max_iter <= 0:
        runs = [OptimizeResult(s, float("nan"), [], 0, False, "max_iter=0") for s in starts]
        return models, spaces, runs, [None] * k
    batch = BatchedEngine(k, plan.full.cg, free_each)
    closures = batch.objectives(models)
    where = f"dtype={plan.dtype}"
    funs = [
        loss_and_gradient(c, m, s, f"output {j}, {where}") for j, (c, m, s) in enumerate(zip(closures, models, spaces))
    ]

    training = set(range(k))

    def evaluate(rows, thetas):
        for j in training - set(rows):  # every output still training waits in each round: these have stopped
            batch.finish_output(j, max_iter)  # Adam: as each single fit, the last step is at most the max_iter-th
        training.intersection_update(rows)
        out = [funs[j](theta) for j, theta in zip(rows, thetas)]
        return np.array([o[0] for o in out]), np.stack([o[1] for o in out])

    def minimize(fun, theta0, j):
        return minimize_adam(fun, theta0, spaces[j], max_iter, est.lr, est.tol, f"Adam, output {j}")

    with one_thread_if_small(Xs), solver_settings("cg"):
        try:
            runs = minimize_lockstep(evaluate, np.stack(starts), spaces[0], Xs.shape[0], max_iter, est.tol, minimize)
        finally:
            records = batch.finish(max_iter)
    return models, spaces, runs, records
