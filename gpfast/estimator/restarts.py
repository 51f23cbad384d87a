"""Restarts of :class:`gpfast.ExactGP`'s optimiser (scikit-learn's ``n_restarts_optimizer``): the marginal
likelihood of a GP can have several local optima (typically one that explains the data as signal and one that
explains it as noise), so the fit can be run again from random starting points and the best kept."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np

from gpfast.estimator.hyperparameters import HyperparameterSpace

__all__ = ["best_of_restarts", "starting_points"]

R = TypeVar("R")


def starting_points(space: HyperparameterSpace, theta0: np.ndarray, n_restarts: int, seed: int | None) -> list:
    """``theta0`` (the user's or the default start) then ``n_restarts`` random starts drawn by
    :meth:`HyperparameterSpace.random` from ``numpy.random.default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    return [np.asarray(theta0, dtype=np.float64)] + [space.random(rng) for _ in range(int(n_restarts))]


def best_of_restarts(starts: list, run: Callable[[np.ndarray], R], loss: Callable[[R], float]) -> tuple[R, list]:
    """Run ``run(theta)`` from each start; return the result with the lowest ``loss`` (the first on ties) and the
    loss of every run, in order."""
    best, losses = None, []
    for theta in starts:
        result = run(theta)
        losses.append(float(loss(result)))
        if best is None or losses[-1] < float(loss(best)):
            best = result
    return best, losses
