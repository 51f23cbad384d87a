"""The hyperparameter fit of :class:`gpfast.ExactGP`: an optimiser (:mod:`~gpfast.estimator.optimize`) on the
negative marginal log likelihood, computed by an objective: gpfast's engine (:class:`gpfast.train.Engine`), the
exact float64 one (:mod:`~gpfast.estimator.exact_objective`), GPyTorch's, or any other with the same contract."""

from __future__ import annotations

import contextlib
import math
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import gpytorch
import numpy as np
import torch
from linear_operator.utils.errors import NotPSDError
from sklearn.exceptions import ConvergenceWarning
from tqdm.auto import tqdm

from gpfast.estimator.exact_objective import cholesky_objective
from gpfast.estimator import prediction
from gpfast.estimator.hyperparameters import (
    LENGTHSCALE_BOUNDS,
    OUTPUTSCALE_BOUNDS,
    HyperparameterSpace,
    noise_constraint,
    noise_floor_notes,
)
from gpfast.estimator.optimize import minimize_adam, minimize_lbfgs
from gpfast.estimator.outputs import model_targets
from gpfast.estimator.restarts import best_of_restarts, first_run_space, low_noise_start
from gpfast.estimator.solver import FitPlan, RunPlan
from gpfast.models import ExactGPModel
from gpfast.standardize import column_stats
from gpfast.train import Engine

__all__ = [
    "FitResult",
    "Objective",
    "PhaseClock",
    "default_objective",
    "engine_attributes",
    "fit_hyperparameters",
    "gpytorch_objective",
    "loss_and_gradient",
    "mll_estimate",
    "run_plan",
    "seeded",
    "solver_settings",
]

#: A training objective: called with no arguments, it sets ``.grad`` of every trainable parameter of the model to
#: the gradient of the loss (the negative marginal log likelihood per data point, or an estimate of it) and
#: returns the loss as a 0-dim tensor. It zeroes the old gradients itself, so it can serve as an L-BFGS closure.
#: It may carry a ``postfix`` attribute: a function returning a dict of extra progress-bar fields, and a ``natural``
#: one: ``natural(values) -> (loss, gradient)`` at the hyperparameters ``values`` = (lengthscales, outputscale,
#: noise, mean) without the model's parameters, the gradient per data point with respect to those values, both on
#: the host in float64. The optimisers then call that instead, sparing each step the writes into the model, the
#: constraints' transforms and the autograd pass back through them (a dozen small device operations and a read
#: each on a GPU).
Objective = Callable[[], torch.Tensor]


class PhaseClock:
    """Wall seconds of a fit's phases (``seconds``, by name, in order), the device synchronised at each boundary so
    that the kernels a phase queued count in it: a benchmark can then tell the training steps from the set-up
    around them and the factorisation after them. One synchronisation a phase."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = {}
        self._sync()
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        """End ``phase`` now: its time is that since the clock started or the last phase ended."""
        self._sync()
        now = time.perf_counter()
        self.seconds[phase] = now - self._last
        self._last = now

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def solver_settings(solver: str | None) -> contextlib.ExitStack:
    """GPyTorch settings that make it solve by dense Cholesky or by CG (GPyTorch's CG settings are left as the
    caller has them, as GPyTorch's training loop and its estimate of the log marginal likelihood use them).

    Parameters
    ----------
    solver : {"cholesky", "cg"} or None
        ``None`` keeps GPyTorch's own rule (Cholesky up to n = 800, CG above).

    Returns
    -------
    contextlib.ExitStack
        The settings, entered; leave it (``with``) to restore the caller's.
    """
    stack = contextlib.ExitStack()
    if solver == "cholesky":
        stack.enter_context(gpytorch.settings.max_cholesky_size(2**62))
    elif solver == "cg":
        stack.enter_context(gpytorch.settings.max_cholesky_size(0))
    return stack


def gpytorch_objective(model: ExactGPModel) -> Objective:
    """The negative of GPyTorch's ``ExactMarginalLogLikelihood`` (per data point), differentiated by autograd; it
    solves as the surrounding :func:`solver_settings` say."""
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    X, y = model.train_inputs[0], model.train_targets

    def closure() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        loss = -mll(model(X), y)
        loss.backward()
        return loss

    return closure


@dataclass
class FitResult:
    """What :func:`fit_hyperparameters` did.

    Attributes
    ----------
    history : list of float
        The loss at each step.
    n_iter : int
        Steps taken.
    converged : bool
        The optimiser's stopping rule was met.
    message : str
        scipy's or :mod:`~gpfast.estimator.optimize`'s reason for stopping.
    loss : float
        The final loss.
    theta : numpy.ndarray
        The final log hyperparameters (:class:`~gpfast.estimator.hyperparameters.HyperparameterSpace` layout).
    """

    history: list[float]
    n_iter: int
    converged: bool
    message: str
    loss: float
    theta: np.ndarray


def default_objective(solver: str | None) -> Callable[[ExactGPModel], Objective]:
    """The objective factory of a solver: the exact float64 Cholesky objective for ``"cholesky"``, GPyTorch's
    marginal likelihood otherwise."""
    return cholesky_objective if solver == "cholesky" else gpytorch_objective


def fit_hyperparameters(
    model: ExactGPModel,
    n_steps: int,
    solver: str | None,
    optimizer: str,
    lr: float,
    tol,
    dtype: torch.dtype,
    desc: str,
    verbose: bool,
    objective: Callable[[ExactGPModel], Objective] | None = None,
    space: HyperparameterSpace | None = None,
    recorder=None,
) -> FitResult:
    """Minimise the negative marginal log likelihood per data point over the model's hyperparameters.

    The optimiser starts from the model's current values and works in log space inside ``space``'s bounds; see
    :mod:`~gpfast.estimator.optimize` for the stopping rules. The model ends at the returned hyperparameters.

    Parameters
    ----------
    model : gpfast.models.ExactGPModel
        With its training data set.
    n_steps : int
        At most this many optimiser iterations (0 returns at once).
    solver : {"cholesky", "cg"} or None
        How GPyTorch solves while the objective runs (:func:`solver_settings`).
    optimizer : {"lbfgs", "adam"}
        L-BFGS-B, or projected Adam.
    lr, tol : float, float or None
        Adam's learning rate; the optimiser's stopping tolerance (None: its default; 0 with Adam runs every step).
    dtype, desc : torch.dtype, str
        The model's dtype and the run's name, for the progress bar (``desc``) and errors (both).
    verbose : bool
        Show a progress bar on stderr (only when it is a terminal, so that a log file gets no bars).
    objective : callable or None, default=None
        ``objective(model)`` builds the :data:`Objective`; None: :func:`default_objective` of ``solver``.
    space : HyperparameterSpace or None, default=None
        The bounds (None: unbounded).
    recorder : gpfast.estimator.checkpoint.RunLog or None, default=None
        Replays and logs the objective's evaluations and is told of each step (for checkpoints).

    Returns
    -------
    FitResult

    Raises
    ------
    NotPSDError, FloatingPointError (TrainingDivergedError)
        With advice, when a step fails.
    """
    space = space or HyperparameterSpace.unbounded(model)
    theta0 = space.get(model)
    if n_steps <= 0:
        return FitResult([], 0, False, "max_iter=0", math.nan, theta0)
    model.train()
    model.likelihood.train()
    closure = (objective or default_objective(solver))(model)
    n = model.train_targets.shape[-1]
    fun = loss_and_gradient(closure, model, space, f"{desc}, dtype={dtype}")
    fun = recorder.wrap(fun) if recorder is not None else fun
    # disable=None: tqdm draws the bar only when stderr is a terminal, so that a log file gets no bars
    bar = tqdm(total=n_steps, desc=desc, disable=None if verbose else True, leave=False, file=sys.stderr)

    def on_step(loss: float) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", **getattr(closure, "postfix", dict)())
        if recorder is not None:
            recorder.step()

    try:
        with solver_settings(solver):
            if optimizer == "lbfgs":
                res = minimize_lbfgs(fun, theta0, space, n, n_steps, tol, desc, on_step)
            else:
                res = minimize_adam(fun, theta0, space, n_steps, lr, tol, desc, on_step)
    finally:
        bar.close()
    space.set(model, res.theta)
    return FitResult(res.history, res.n_iter, res.converged, res.message, res.loss, res.theta)


def loss_and_gradient(closure: Objective, model: ExactGPModel, space: HyperparameterSpace, where: str):
    """``fun(theta) -> (loss, gradient)`` in the log hyperparameters of ``space`` for the optimisers, from the
    closure (by its ``natural`` path when it has one, :data:`Objective`); a covariance that stops being positive
    definite raises NotPSDError with advice, naming ``where`` it happened."""
    calls = [0]
    natural = getattr(closure, "natural", None)
    k = space.n_lengthscales

    def fun(theta: np.ndarray) -> tuple[float, np.ndarray]:
        try:
            if natural is not None:  # theta = log of the values but the mean's: no constraint chain, no autograd
                theta = np.asarray(theta, dtype=np.float64)
                values = np.concatenate([np.exp(theta[: k + 2]), theta[k + 2 :]])
                loss, grad = natural(values)
                calls[0] += 1
                return float(loss), grad * np.concatenate([values[: k + 2], np.ones(theta.size - k - 2)])
            space.set(model, theta)
            loss = closure()
        except NotPSDError as exc:
            raise NotPSDError(
                f"ExactGP: the training covariance stopped being numerically positive definite at evaluation "
                f"{calls[0]} ({where}): {exc}. Try dtype='float64', solver='cholesky', or a smaller lr. The "
                f"estimator was not modified."
            ) from exc
        calls[0] += 1
        return float(loss.detach()), space.gradient(model)

    return fun


def mll_estimate(model: ExactGPModel) -> float:
    """GPyTorch's CG/Lanczos estimate of the marginal log likelihood per data point at the current hyperparameters,
    under the caller's GPyTorch settings; targets (k, n) of k outputs give the sum of their k estimates."""
    likelihood = model.likelihood
    model.train()
    likelihood.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    try:
        with torch.no_grad(), solver_settings("cg"):
            value = float(mll(model(model.train_inputs[0]), model.train_targets).sum())
    finally:
        model.eval()
        likelihood.eval()
    return value


def run_plan(plan: FitPlan, model: ExactGPModel, space: HyperparameterSpace, starts: list, X, y, **kw):
    """Every optimiser run of a fit as ``plan`` says (pretraining, then all the data) from each starting point.

    Parameters
    ----------
    plan : FitPlan
    model : ExactGPModel
        Built in ``plan.train_dtype`` on the training data.
    space : HyperparameterSpace
    starts : list of numpy.ndarray
        Log hyperparameters to start from (:func:`~gpfast.estimator.restarts.starting_points`).
    X, y : torch.Tensor of shape (n, d) and (n,) or (n, k)
        The standardised training data.
    **kw
        ``max_iter``, ``pretrain_steps``, ``seed`` (draws the pretraining subset), ``free`` (bytes free on the
        device), ``checkpoint`` (a :class:`~gpfast.estimator.checkpoint.Checkpoint` or None), and ``lr``, ``tol``,
        ``verbose`` for :func:`fit_hyperparameters`.

    Returns
    -------
    pretrain, result : FitResult or None, FitResult
        The best run's results on the subset (None without pretraining) and on all the data. The first run keeps
        the noise above :func:`~gpfast.estimator.restarts.first_run_space`'s floor; when it ends at a low noise
        on the exact path, the low-noise start (:func:`~gpfast.estimator.restarts.low_noise_start`) runs second.
    record : gpfast.train.EngineRecord or None
        Its engine record, when the engine took the steps on all the data.
    restart_losses : list of float
        The final loss of the run from each start (the low-noise start's second when it was made).
    """
    max_iter, pretrain_steps, seed = kw.pop("max_iter"), kw.pop("pretrain_steps"), kw.pop("seed")
    sub_idx = None
    if plan.pretrain is not None:
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        sub_idx = torch.randperm(X.shape[0], generator=gen)[: plan.pretrain.n].to(X.device)
    Xd, yd = X.to(plan.train_dtype), model_targets(y).to(plan.train_dtype)
    kw.update(optimizer=plan.optimizer, dtype=plan.dtype)

    def run(theta, first=False):
        kw["space"] = first_run_space(space, plan.full.train_solver) if first else space
        space.set(model, theta)
        pre = None
        if sub_idx is not None:
            model.set_train_data(inputs=Xd[sub_idx], targets=yd[..., sub_idx], strict=False)
            desc = f"gpfast pretrain ({plan.pretrain.n} pts, {plan.pretrain.train_solver})"
            pre, _ = _run(plan.pretrain, model, pretrain_steps, desc=desc, **kw)
            model.set_train_data(inputs=Xd, targets=yd, strict=False)
        desc = f"gpfast fit ({plan.optimizer}, {plan.full.train_solver}, {plan.full.trainer})"
        result, record = _run(plan.full, model, max_iter, desc=desc, **kw)
        return pre, result, record

    def low_noise(r):
        return (
            low_noise_start(space, starts[0], r[1].theta, plan.full.train_solver, X.shape[0]) if max_iter > 0 else None
        )

    with one_thread_if_small(X):
        (pre, result, record), restart_losses = best_of_restarts(starts, run, lambda r: r[1].loss, low_noise)
    return pre, result, record, restart_losses


#: CPU fits of at most this many points run on one torch thread. On the 2-core CI box, quiet, 2026-12-01
#: (``experiments/threads.py``, default fits on the exact path): yacht (n=278) 0.50-0.76 s on one thread against
#: 2.5-3.0 s on two; synthetic n=600, d=6: 1.4-1.7 against 2.8-3.7 s; n=1500: 13.8-16.0 against 13.2-14.9 s.
#: Small problems are made of many small operations, whose threads cost more to wake and join than they save.
ONE_THREAD_MAX_N = 1000


@contextlib.contextmanager
def one_thread_if_small(X: torch.Tensor):
    """Run the body on one torch thread when X is a CPU tensor of at most :data:`ONE_THREAD_MAX_N` rows; the
    caller's thread count is restored after."""
    before = torch.get_num_threads()
    small = X.device.type == "cpu" and X.shape[0] <= ONE_THREAD_MAX_N and before > 1
    if small:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if small:
            torch.set_num_threads(before)


def _run(run_plan: RunPlan, model: ExactGPModel, n_steps: int, free: int, checkpoint=None, **fit_kw):
    """One optimiser run with the objective of ``run_plan.trainer``: ``(result, engine record or None)``. With a
    ``checkpoint``, a run it holds as finished is not run again, and one under way resumes."""
    log = checkpoint.next_run() if checkpoint is not None else None
    if log is not None and log.done is not None:
        result, record = log.done
        fit_kw["space"].set(model, result.theta)
        return result, record
    record = None
    solver = run_plan.train_solver
    if run_plan.trainer == "gpfast":
        engine = Engine(run_plan.cg, free)
        if log is not None:
            if log.engine_state is not None:
                engine.load_state_dict(log.engine_state)
            log.objective_state = engine.state_dict
        result = fit_hyperparameters(model, n_steps, solver, objective=engine.objective, recorder=log, **fit_kw)
        # Adam evaluates once more after its last step, for the loss where it stops; that gradient moves nothing
        record = engine.finish(n_steps if fit_kw["optimizer"] == "adam" else None)
    else:
        objective = gpytorch_objective if run_plan.trainer == "gpytorch" else None
        result = fit_hyperparameters(model, n_steps, solver, objective=objective, recorder=log, **fit_kw)
    if checkpoint is not None:
        checkpoint.finish_run(log, result, record)
    return result, record


def engine_attributes(record) -> dict:
    """The estimator's fitted attributes from an engine run's :class:`~gpfast.train.EngineRecord` (None: the
    engine did not train: every one None)."""
    if record is None:
        names = ("cg_iterations_", "cg_residuals_", "history_data_fit_", "history_log_det_estimate_", "step_seconds_")
        return dict.fromkeys(names)
    return dict(
        cg_iterations_=list(record.cg_iterations),
        cg_residuals_=list(record.cg_residuals),
        history_data_fit_=list(record.data_fit),
        history_log_det_estimate_=list(record.log_det_estimate),
        step_seconds_=list(record.step_seconds),
    )


def seeded(seed: int | None, device: torch.device, fork: bool = False) -> contextlib.AbstractContextManager:
    """Seed torch's generators inside ``fork_rng``, so that the caller's are left alone, or do nothing.

    Parameters
    ----------
    seed : int or None
        None: leave the generators as they are.
    device : torch.device
        With CUDA, every CUDA device's generator is forked too.
    fork : bool, default=False
        Fork even without a seed (a resumed fit sets the generators' state itself).
    """
    if seed is None and not fork:
        return contextlib.nullcontext()
    devices = list(range(torch.cuda.device_count())) if device.type == "cuda" else []
    stack = contextlib.ExitStack()
    stack.enter_context(torch.random.fork_rng(devices=devices))
    if seed is not None:
        torch.manual_seed(seed)  # also seeds every CUDA device
    return stack


def clipped_start(space: HyperparameterSpace, theta0: np.ndarray) -> np.ndarray:
    """theta0 moved into the bounds, with a warning (for the caller of ``ExactGP.fit``) naming what was moved."""
    outside = space.outside(theta0)
    if outside:
        warnings.warn(
            f"ExactGP: the initial {', '.join(outside)} lie outside the bounds of the fit (see "
            f"gpfast.estimator.hyperparameters: lengthscales {LENGTHSCALE_BOUNDS} x each feature's std, "
            f"outputscale {OUTPUTSCALE_BOUNDS} and noise {space.noise_bounds} x var(y)); starting from the nearest "
            f"bound instead.",
            UserWarning,
            stacklevel=5,
        )
    return space.clip(theta0)


def warn_about_fit(plan: FitPlan, result: FitResult, space: HyperparameterSpace, X, y, max_iter, tol) -> None:
    """A ConvergenceWarning when the optimiser stopped short, a UserWarning when the fitted hyperparameters sit
    where the data say little, and one for each note of :func:`~gpfast.estimator.hyperparameters.noise_floor_notes`
    when the noise ended at its floor (for the caller of ``ExactGP.fit``; X (n, d) and y (n,) or (n, k) are the
    standardised training data)."""
    optimizer, y_constant = plan.optimizer, bool((y == 0).all())
    if not result.converged and tol != 0:  # tol=0 asks for all max_iter steps
        warnings.warn(
            f"ExactGP: the optimiser ({optimizer}) stopped after {result.n_iter} iterations without converging "
            f"({result.message}); the hyperparameters may be short of the marginal-likelihood optimum. Raise "
            f"max_iter (now {max_iter}; it is a cap, not a plan), or set tol.",
            ConvergenceWarning,
            stacklevel=4,
        )
    problems = [] if y_constant else space.diagnose(result.theta)
    if problems:
        warnings.warn(
            "ExactGP: " + "; ".join(problems) + ". Check the data, try n_restarts > 0, or other initial values.",
            UserWarning,
            stacklevel=4,
        )
    if y_constant:
        return
    notes = noise_floor_notes(space, result.theta, plan.full.train_solver, plan.train_dtype, plan.exact_feasible, X, y)
    for note in notes:
        warnings.warn(note, UserWarning, stacklevel=4)


def fitted_log_marginal_likelihood(model: ExactGPModel, X: torch.Tensor, y: torch.Tensor, plan: FitPlan):
    """``(value, method, posterior)`` at the fitted hyperparameters: exact by a float64 Cholesky whenever the plan
    allows one (the posterior is kept for predictions when the solver is ``"cholesky"``), else GPyTorch's CG
    estimate. ``y`` (n,) or (n, k): several outputs give the sum of their likelihoods."""
    if not plan.exact_feasible:
        return X.shape[0] * mll_estimate(model), "cg_estimate", None
    posterior = prediction.exact_posterior(X, y, prediction.hyperparameters_float64(model))
    lml = float(posterior.log_marginal_likelihood())
    return lml, "cholesky", posterior if plan.solver == "cholesky" else None


def initial_model(X: torch.Tensor, y: torch.Tensor, plan: FitPlan, inits: dict, ard: bool, distributed: bool):
    """The model on the standardised data X (n, d) and y (n,) or (n, k) in ``plan.train_dtype``, its hyperparameter
    space and the starting point from ``inits`` (:func:`gpfast.estimator.params.initial_values`), not yet clipped."""
    # with several outputs, the variance of all their values: the mean of their variances when each is centred
    y_var = float(y.var(unbiased=False))
    noise = noise_constraint(plan.full.train_solver, plan.train_dtype, y_var)
    likelihood = gpytorch.likelihoods.GaussianLikelihood(noise_constraint=noise)
    Xd, yd = X.to(plan.train_dtype), model_targets(y).to(plan.train_dtype)
    model = ExactGPModel(Xd, yd, likelihood, ard=ard, distributed=distributed)
    model = model.to(device=X.device, dtype=plan.train_dtype)
    space = HyperparameterSpace.for_data(model, column_stats(X).std.cpu(), y_var)
    return model, space, space.initial(inits["lengthscale"], inits["outputscale"], inits["noise"])
