"""The training loop of :class:`gpfast.ExactGP`: optimiser steps on GPyTorch's exact marginal likelihood."""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import gpytorch
import torch
from linear_operator.utils.errors import NotPSDError
from tqdm.auto import tqdm

from gpfast.models import ExactGPModel

__all__ = ["TOL_PATIENCE", "CGSettings", "Objective", "gpytorch_objective", "mll_estimate", "solver_settings", "train"]

#: A training objective: called with no arguments, it sets ``.grad`` of every trainable parameter of the model to
#: the gradient of the loss (the negative marginal log likelihood per data point, or an estimate of it) and
#: returns the loss as a 0-dim tensor. It zeroes the old gradients itself, so it can serve as an L-BFGS closure.
Objective = Callable[[], torch.Tensor]

#: Number of consecutive steps over which the relative loss change must stay below ``tol``.
TOL_PATIENCE = 5


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


def train(model: ExactGPModel, n_steps: int, solver: str | None, cg: CGSettings | None, optimizer: str,
          lr: float, tol, dtype: torch.dtype, desc: str, verbose: bool,
          objective: Callable[[ExactGPModel], Objective] | None = None) -> list[float]:
    """Take up to ``n_steps`` optimiser steps on the negative marginal log likelihood per data point; return the
    loss of each step. ``objective(model)`` builds the loss-and-gradient closure (default
    :func:`gpytorch_objective`). Stops early when ``tol`` is set and the relative change stays below it for
    :data:`TOL_PATIENCE` steps. Raises NotPSDError / FloatingPointError with advice when a step fails."""
    history: list[float] = []
    if n_steps <= 0:
        return history
    model.train()
    model.likelihood.train()
    params = [q for q in model.parameters() if q.requires_grad]  # includes the likelihood's
    if optimizer == "adam":
        opt = torch.optim.Adam(params, lr=float(lr))
    else:
        opt = torch.optim.LBFGS(params, lr=float(lr), max_iter=1, line_search_fn="strong_wolfe")
    closure = (objective or gpytorch_objective)(model)

    bar = tqdm(range(n_steps), desc=desc, disable=not verbose, leave=False, file=sys.stderr)
    try:
        with solver_settings(solver, cg):
            for i in bar:
                try:
                    if optimizer == "adam":
                        loss = closure()
                        opt.step()
                    else:
                        loss = opt.step(closure)
                except NotPSDError as exc:
                    raise NotPSDError(
                        f"ExactGP: the training covariance stopped being numerically positive definite at step {i} "
                        f"({desc}, dtype={dtype}): {exc}. Try dtype='float64', a smaller lr, or a larger "
                        f"noise_init. The estimator was not modified."
                    ) from exc
                value = float(loss.detach())
                if not math.isfinite(value):
                    raise FloatingPointError(
                        f"ExactGP: the training loss became {value} at step {i} ({desc}); try a smaller lr, "
                        f"dtype='float64', or solver='cholesky'. The estimator was not modified."
                    )
                history.append(value)
                bar.set_postfix(loss=f"{value:.4f}")
                if tol is not None and len(history) > TOL_PATIENCE:
                    recent = history[-TOL_PATIENCE - 1 :]
                    changes = [abs(b - a) / max(abs(a), 1.0) for a, b in zip(recent[:-1], recent[1:])]
                    if max(changes) < tol:
                        break
    finally:
        bar.close()
    return history


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
