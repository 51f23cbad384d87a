"""Starting points of :class:`gpfast.ExactGP`'s optimiser: the default start, a second start at a low noise, and
random restarts (scikit-learn's ``n_restarts_optimizer``). The marginal likelihood of a GP can have several local
optima (typically one that explains the data as signal and one that explains more of it as noise), so the fit is
run from each start and the best kept.

The low-noise start. From the default start (noise ``log 2 x var(y)``) L-BFGS reaches the noise floor on noise-free
functions (Franke, Branin, Ishigami, Hartmann, Friedman, OTL circuit: 2-6-D, 100-500 points), but on data with a
little noise it can stop in a basin of higher noise: on yacht the start at :data:`LOW_NOISE_START` raised the log
marginal likelihood from a mean of 254.8 to 267.4 over the 5 splits (split 2: 239.5 to 265.1; scikit-learn's mean
260.7), while on energy it ended lower than the default start (split 0: 978 against 1013), hence a second run
rather than a new start. It is made only when it can matter and is affordable: when the training steps are the exact
float64 Cholesky objective (small data, whose floor resolves such noise levels), on at most
:data:`LOW_NOISE_MAX_N` points, and the first run ended below :data:`LOW_NOISE_TRIGGER` (clearly noisy data pay
nothing). The first run itself keeps the noise above
:data:`FIRST_RUN_NOISE_FLOOR` (float32 CG's floor), so that noisy data take the path they take with that floor, and
only the low-noise start explores below it: the fit is never worse than that first run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from gpfast.estimator.hyperparameters import HyperparameterSpace

__all__ = [
    "FIRST_RUN_NOISE_FLOOR",
    "LOW_NOISE_MAX_N",
    "LOW_NOISE_START",
    "LOW_NOISE_TRIGGER",
    "best_of_restarts",
    "first_run_space",
    "low_noise_start",
    "starting_points",
]

R = TypeVar("R")

#: The noise of the low-noise start, relative to var(y) (the lengthscales and outputscale are the first start's).
LOW_NOISE_START = 1e-6
#: The low-noise start is made when the first run ended with a noise below this, relative to var(y).
LOW_NOISE_TRIGGER = 1e-2
#: ... and on at most this many points. The evidence for the second run comes from a few hundred points (above),
#: while its cost is that of the whole fit: on the H200 an exact evaluation takes 0.3 s at 20,000 points and 3.2 s
#: at keggdirected's 43,945 (factorisation and inverse; experiments/results/bench_inverse.md, exact_row_probe), so
#: there a 50-step Adam fit of 3 minutes became one of 6 without the user asking.
LOW_NOISE_MAX_N = 20_000
#: On the exact path the first run keeps the noise above this (relative to var(y)) and only the low-noise start
#: goes below: with the floor of 1e-8 from the default start, energy's fits took other paths to lower optima
#: (splits 1, 2, 4: 939-971 against 1007-1050 with the floor at 1e-4 x var(y)).
FIRST_RUN_NOISE_FLOOR = 1e-4


def first_run_space(space: HyperparameterSpace, train_solver: str) -> HyperparameterSpace:
    """The box of the first run: the noise floor raised to :data:`FIRST_RUN_NOISE_FLOOR` on the exact path."""
    return space.with_noise_floor(FIRST_RUN_NOISE_FLOOR) if train_solver == "cholesky" else space


def starting_points(space: HyperparameterSpace, theta0: np.ndarray, n_restarts: int, seed: int | None) -> list:
    """``theta0`` (the user's or the default start) then ``n_restarts`` random starts drawn by
    :meth:`HyperparameterSpace.random` from ``numpy.random.default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    return [np.asarray(theta0, dtype=np.float64)] + [space.random(rng) for _ in range(int(n_restarts))]


def low_noise_start(
    space: HyperparameterSpace, theta0: np.ndarray, theta_end: np.ndarray, train_solver: str, n: int
) -> np.ndarray | None:
    """The low-noise start (module docstring): ``theta0`` with its noise at :data:`LOW_NOISE_START` x var(y)
    (clipped into the box), when the training steps use ``train_solver="cholesky"`` on ``n`` <=
    :data:`LOW_NOISE_MAX_N` points, the run from ``theta0`` ended at ``theta_end`` with a noise below
    :data:`LOW_NOISE_TRIGGER` x var(y), and ``theta0`` started above the low noise; None otherwise."""
    k = space.n_lengthscales + 1  # the noise's index in theta
    low = space.log_y_var + math.log(LOW_NOISE_START)
    trigger = space.log_y_var + math.log(LOW_NOISE_TRIGGER)
    if train_solver != "cholesky" or n > LOW_NOISE_MAX_N or theta_end[k] >= trigger or theta0[k] <= low:
        return None
    start = np.array(theta0, dtype=np.float64)
    start[k] = low
    return space.clip(start)


def best_of_restarts(
    starts: list,
    run: Callable[[np.ndarray, bool], R],
    loss: Callable[[R], float],
    follow_up: Callable[[R], np.ndarray | None] | None = None,
) -> tuple[R, list]:
    """Run ``run(theta, first)`` from each start (``first`` True for the first one); return the result with the
    lowest ``loss`` (the first on ties) and the loss of every run, in order. ``follow_up(result of the first run)``
    may return one more start, run second (the low-noise start)."""
    best, losses = None, []
    queue = list(starts)
    for i in range(len(starts) + 1):
        if not queue:
            break
        result = run(queue.pop(0), i == 0)
        losses.append(float(loss(result)))
        if best is None or losses[-1] < float(loss(best)):
            best = result
        if i == 0 and follow_up is not None:
            extra = follow_up(result)
            if extra is not None:
                queue.insert(0, extra)
    return best, losses
