"""The training of :class:`gpfast.ExactGP`: an optimiser (:mod:`~gpfast.estimator.optimize`) on the negative
marginal log likelihood, computed by an objective: the exact float64 one of the ``"cholesky"`` solver
(:mod:`~gpfast.estimator.exact_objective`), GPyTorch's (CG with ``"cg"``), or any other with the same contract."""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import gpytorch
import numpy as np
import torch
from linear_operator.utils.errors import NotPSDError
from tqdm.auto import tqdm

from gpfast.estimator.exact_objective import cholesky_objective
from gpfast.estimator.hyperparameters import HyperparameterSpace
from gpfast.estimator.optimize import minimize_adam, minimize_lbfgs
from gpfast.models import ExactGPModel

__all__ = [
    "CGSettings",
    "Objective",
    "TrainResult",
    "default_objective",
    "gpytorch_objective",
    "mll_estimate",
    "solver_settings",
    "train",
]

#: A training objective: called with no arguments, it sets ``.grad`` of every trainable parameter of the model to
#: the gradient of the loss (the negative marginal log likelihood per data point, or an estimate of it) and
#: returns the loss as a 0-dim tensor. It zeroes the old gradients itself, so it can serve as an L-BFGS closure.
#: It may carry a ``postfix`` attribute: a function returning a dict of extra progress-bar fields.
Objective = Callable[[], torch.Tensor]


@dataclass(frozen=True)
class CGSettings:
    """GPyTorch's conjugate-gradient settings used by the ``"cg"`` solver."""

    tolerance: float  # training
    eval_tolerance: float  # prediction
    max_iterations: int
    preconditioner_size: int


def solver_settings(solver: str | None, cg: CGSettings | None) -> contextlib.ExitStack:
    """GPyTorch settings that make it solve by dense Cholesky (``"cholesky"``) or by CG (``"cg"``); ``None`` keeps
    GPyTorch's own defaults (Cholesky up to n = 800, CG above)."""
    stack = contextlib.ExitStack()
    if solver is None:
        pass
    elif solver == "cholesky":
        stack.enter_context(gpytorch.settings.max_cholesky_size(2**62))
    else:
        stack.enter_context(gpytorch.settings.max_cholesky_size(0))
        stack.enter_context(gpytorch.settings.cg_tolerance(float(cg.tolerance)))
        stack.enter_context(gpytorch.settings.eval_cg_tolerance(float(cg.eval_tolerance)))
        stack.enter_context(gpytorch.settings.max_cg_iterations(int(cg.max_iterations)))
        stack.enter_context(gpytorch.settings.max_preconditioner_size(int(cg.preconditioner_size)))
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
class TrainResult:
    """What :func:`train` did: the loss per step (``history``), the steps taken, whether the optimiser's stopping
    rule was met (``converged``, with scipy's or our ``message``), and the final loss and log hyperparameters."""

    history: list[float]
    n_iter: int
    converged: bool
    message: str
    loss: float
    theta: np.ndarray


def default_objective(solver: str | None) -> Callable[[ExactGPModel], Objective]:
    """The exact float64 Cholesky objective for ``solver="cholesky"``, GPyTorch's marginal likelihood otherwise."""
    return cholesky_objective if solver == "cholesky" else gpytorch_objective


def train(
    model: ExactGPModel,
    n_steps: int,
    solver: str | None,
    cg: CGSettings | None,
    optimizer: str,
    lr: float,
    tol,
    dtype: torch.dtype,
    desc: str,
    verbose: bool,
    objective: Callable[[ExactGPModel], Objective] | None = None,
    space: HyperparameterSpace | None = None,
    recorder=None,
) -> TrainResult:
    """Minimise the negative marginal log likelihood per data point over the model's hyperparameters, from their
    current values, with ``optimizer`` ``"lbfgs"`` (L-BFGS-B) or ``"adam"`` (projected Adam, learning rate
    ``lr``) for at most ``n_steps`` iterations, in log space inside ``space``'s bounds (``None``: unbounded); see
    :mod:`~gpfast.estimator.optimize` for the stopping rules (``tol=None``: each one's default; ``tol=0`` with Adam
    runs every step). ``objective(model)`` builds the loss-and-gradient closure (default
    :func:`default_objective` of ``solver``), evaluated under :func:`solver_settings`. The model ends at the
    returned hyperparameters. Raises NotPSDError / FloatingPointError (TrainingDivergedError) with advice when a
    step fails. ``recorder``: a :class:`gpfast.estimator.checkpoint.RunLog` that replays and logs the objective's
    evaluations and is told of each step (for checkpoints)."""
    space = space or HyperparameterSpace.unbounded(model)
    theta0 = space.get(model)
    if n_steps <= 0:
        return TrainResult([], 0, False, "max_iter=0", math.nan, theta0)
    model.train()
    model.likelihood.train()
    closure = (objective or default_objective(solver))(model)
    n = model.train_targets.shape[-1]
    calls = [0]

    def fun(theta: np.ndarray) -> tuple[float, np.ndarray]:
        space.set(model, theta)
        try:
            loss = closure()
        except NotPSDError as exc:
            raise NotPSDError(
                f"ExactGP: the training covariance stopped being numerically positive definite at evaluation "
                f"{calls[0]} ({desc}, dtype={dtype}): {exc}. Try dtype='float64', solver='cholesky', or a "
                f"smaller lr. The estimator was not modified."
            ) from exc
        calls[0] += 1
        return float(loss.detach()), space.gradient(model)

    if recorder is not None:
        fun = recorder.wrap(fun)
    # disable=None: tqdm draws the bar only when stderr is a terminal, so that a log file gets no bars
    bar = tqdm(total=n_steps, desc=desc, disable=None if verbose else True, leave=False, file=sys.stderr)

    def on_step(loss: float) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", **getattr(closure, "postfix", dict)())
        if recorder is not None:
            recorder.step()

    try:
        with solver_settings(solver, cg):
            if optimizer == "lbfgs":
                res = minimize_lbfgs(fun, theta0, space, n, n_steps, tol, desc, on_step)
            else:
                res = minimize_adam(fun, theta0, space, n_steps, lr, tol, desc, on_step)
    finally:
        bar.close()
    space.set(model, res.theta)
    return TrainResult(res.history, res.n_iter, res.converged, res.message, res.loss, res.theta)


def mll_estimate(model: ExactGPModel, cg: CGSettings) -> float:
    """GPyTorch's (CG/Lanczos) estimate of the marginal log likelihood per data point at the current
    hyperparameters."""
    likelihood = model.likelihood
    model.train()
    likelihood.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    try:
        with torch.no_grad(), solver_settings("cg", cg):
            value = float(mll(model(model.train_inputs[0]), model.train_targets))
    finally:
        model.eval()
        likelihood.eval()
    return value
