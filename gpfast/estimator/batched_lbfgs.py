"""A box-constrained L-BFGS over many independent problems at once: row j of ``theta`` (k, p) minimises its own
loss, and every round evaluates the rows still running in one batched call.

Why not one scipy L-BFGS-B per row: scipy's optimiser is sequential Python around Fortran, so k of them stepping
together need a thread each (:mod:`~gpfast.estimator.lockstep`), and the threads' hand-offs cost about 0.6 ms per
output-evaluation on the CPU. For 1,000 outputs and ~50 rounds that is ~30 s of overhead, against tens of ms for
the batched evaluations on a GPU. Here the optimiser's own arithmetic is numpy over all rows, ~k x m x p flops a
round (microseconds to a millisecond), so the rounds cost what their evaluations cost.

The method, per row (Nocedal & Wright 2006, Alg. 7.4 and eq. 7.20; projections as in Bertsekas 1982):

* **Direction.** Variables at a bound whose gradient points out of the box are held; on the others, the two-loop
  recursion over the row's last ``memory`` pairs (s, y) with H0 = (s'y / y'y) I of the newest pair. A direction
  that is not one of descent resets the row's memory (steepest descent).
* **Step.** Along the projected path ``clip(x + t d)``, from t = 1 (t = 1 / ||d|| on a step without memory, as
  scipy starts), backtracking by safeguarded quadratic interpolation until the Armijo condition
  ``f(x_t) <= f(x) + c1 g'(x_t - x)`` holds. Each round tries one step of every running row; a row that fails
  :data:`MAX_BACKTRACKS` times drops its memory and tries again, and without memory it stops (scipy's
  "ABNORMAL"). A pair with s'y <= 0 (possible without a curvature condition) is not stored.
* **Stopping**, the tests of :func:`~gpfast.estimator.optimize.minimize_lbfgs` on the total loss ``n x`` the
  per-point one: converged when ``(f_old - f) <= ftol max(|f_old|, |f|, 1)`` (``ftol = tol``, or
  :data:`~gpfast.estimator.optimize.LBFGS_FTOL`), or when the largest entry of ``clip(x - g) - x`` is at most
  :data:`~gpfast.estimator.optimize.LBFGS_GTOL` (scipy's projected gradient); an abnormal stop counts as converged
  when the largest projected gradient entry is below :data:`~gpfast.estimator.optimize.LBFGS_FLAT_GTOL`; stopped
  after ``max_iter`` steps or ``max(15000, 4 max_iter)`` evaluations. A row that stops leaves the batch.

Its steps are not scipy's (no Cauchy point, no Moré-Thuente search), so a row reaches the optimum scipy reaches by
another path; where the likelihood has several optima, the starts of :mod:`~gpfast.estimator.restarts` decide, as
in a single fit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from gpfast.estimator.hyperparameters import HyperparameterSpace
from gpfast.estimator.optimize import (
    LBFGS_FLAT_GTOL,
    LBFGS_FTOL,
    LBFGS_GTOL,
    OptimizeResult,
    _checked,
    _projected,
)

__all__ = ["ARMIJO_C1", "MAX_TRIALS", "MEMORY", "WOLFE_C2", "minimize_batched_lbfgs"]

#: Pairs (s, y) kept per row (scipy's default ``maxcor``).
MEMORY = 10
#: The Armijo condition's fraction of the predicted decrease (scipy's ``ftol`` of its line search).
ARMIJO_C1 = 1e-3
#: The weak Wolfe curvature condition's fraction of the initial slope (scipy's ``gtol`` of its line search).
WOLFE_C2 = 0.9
#: Trial steps of one line search before the row takes its best point or gives up on its direction.
MAX_TRIALS = 30

#: evaluate(rows, thetas) -> (loss per data point (len(rows),), gradient (len(rows), p)), float64.
BatchedLoss = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


@dataclass
class _Rows:
    """The state of every row: the iterate, its total loss and gradient, the memory (oldest pair first, unused
    slots zero), the direction, trial step and bracket of its line search (with the point at ``lo``), and the
    counters and outcome."""

    x: np.ndarray  # (k, p)
    f: np.ndarray  # (k,)
    g: np.ndarray  # (k, p)
    S: np.ndarray  # (k, m, p)
    Y: np.ndarray  # (k, m, p)
    d: np.ndarray  # (k, p)
    t: np.ndarray  # (k,)
    lo: np.ndarray  # (k,)
    hi: np.ndarray  # (k,)
    x_lo: np.ndarray  # (k, p)
    f_lo: np.ndarray  # (k,)
    g_lo: np.ndarray  # (k, p)
    trials: np.ndarray  # (k,) int
    n_iter: np.ndarray  # (k,) int
    n_eval: np.ndarray  # (k,) int
    running: np.ndarray  # (k,) bool
    converged: np.ndarray  # (k,) bool
    messages: list
    history: list


def minimize_batched_lbfgs(
    evaluate: BatchedLoss,
    theta0: np.ndarray,
    space: HyperparameterSpace,
    n: int,
    max_iter: int,
    tol: float | None = None,
    labels: Sequence | None = None,
    memory: int = MEMORY,
) -> list[OptimizeResult]:
    """Minimise each row's loss from its row of ``theta0`` inside ``space``'s box, all rows together.

    Parameters
    ----------
    evaluate : callable
        ``evaluate(rows, thetas)``: the indices (into ``theta0``) of the rows to evaluate, int array (r,), and
        their points (r, p); returns each row's loss per data point (r,) and its gradient (r, p), float64. A
        non-finite value raises FloatingPointError naming the row (as a single fit does); what ``evaluate``
        raises propagates.
    theta0 : (k, p) float64 array
        The starts, clipped into the box.
    space : HyperparameterSpace
        The box: its ``lower`` and ``upper`` (p,) float64 arrays are all that is read (-inf / inf: unbounded).
    n : int
        The number of data points: the tests apply to ``n`` times the per-point loss, as in a single fit.
    max_iter : int
        Steps per row at most; 0 evaluates the starts and returns them.
    tol : float or None, default=None
        The relative-decrease tolerance ``ftol`` (None: :data:`~gpfast.estimator.optimize.LBFGS_FTOL`).
    labels : sequence of length k or None, default=None
        Each row's name in errors and messages (None: its index).
    memory : int, default=MEMORY
        Pairs (s, y) kept per row.

    Returns
    -------
    list of k :class:`~gpfast.estimator.optimize.OptimizeResult`
        Per row: ``theta`` (p,), ``loss`` per data point, ``history`` (the loss per point after each step),
        ``n_iter``, ``converged`` and ``message``.
    """
    theta0 = np.atleast_2d(np.asarray(theta0, dtype=np.float64))
    k, p = theta0.shape
    labels = list(range(k)) if labels is None else list(labels)
    if len(labels) != k:
        raise ValueError(f"minimize_batched_lbfgs: labels has {len(labels)} entries; expected one per row ({k})")
    ftol = LBFGS_FTOL if tol is None else float(tol)
    x = np.clip(theta0, space.lower, space.upper)
    f, g = _evaluate(evaluate, np.arange(k), x, n, labels, np.zeros(k, dtype=int))
    zeros, zero_rows = np.zeros(k), np.zeros((k, p))
    st = _Rows(
        x=x, f=f, g=g, S=np.zeros((k, memory, p)), Y=np.zeros((k, memory, p)), d=zero_rows.copy(), t=zeros.copy(),
        lo=zeros.copy(), hi=np.full(k, np.inf), x_lo=zero_rows.copy(), f_lo=zeros.copy(), g_lo=zero_rows.copy(),
        trials=np.zeros(k, dtype=int), n_iter=np.zeros(k, dtype=int), n_eval=np.ones(k, dtype=int),
        running=np.ones(k, dtype=bool), converged=np.zeros(k, dtype=bool), messages=[""] * k,
        history=[[] for _ in range(k)],
    )  # fmt: skip
    if max_iter <= 0:
        st.running[:] = False
        st.messages = ["max_iter=0"] * k
    else:
        _stop_on_gradient(st, np.arange(k), space)
    max_eval = max(15000, 4 * int(max_iter))
    _new_directions(st, np.flatnonzero(st.running), space)
    while st.running.any():
        rows = np.flatnonzero(st.running)
        trial = np.clip(st.x[rows] + st.t[rows, None] * st.d[rows], space.lower, space.upper)
        f_t, g_t = _evaluate(evaluate, rows, trial, n, labels, st.n_iter[rows])
        st.n_eval[rows] += 1
        predicted = np.einsum("rp,rp->r", st.g[rows], trial - st.x[rows])
        ok = (predicted < 0) & (f_t <= st.f[rows] + ARMIJO_C1 * predicted)
        take = _search(st, rows, trial, f_t, g_t, ok, space)
        _accept(st, rows[take], trial[take], f_t[take], g_t[take], n, ftol, int(max_iter), space)
        at_lo = _give_up(st, rows[~take], space)
        _accept(st, at_lo, st.x_lo[at_lo], st.f_lo[at_lo], st.g_lo[at_lo], n, ftol, int(max_iter), space)
        moved = np.concatenate([rows[take], at_lo])
        out_of_evals = rows[st.running[rows] & (st.n_eval[rows] >= max_eval)]
        st.running[out_of_evals] = False
        for j in out_of_evals:
            st.messages[j] = "STOP: TOTAL NO. OF F,G EVALUATIONS EXCEEDS LIMIT"
        _new_directions(st, moved[st.running[moved]], space)
    return [
        OptimizeResult(st.x[j].copy(), float(st.f[j] / n), st.history[j], int(st.n_iter[j]), bool(st.converged[j]),
                       st.messages[j])
        for j in range(k)
    ]  # fmt: skip


def _evaluate(evaluate: BatchedLoss, rows, thetas, n: int, labels: list, steps: np.ndarray):
    """The total losses (r,) and gradients (r, p) of ``rows`` at ``thetas``; a non-finite one raises the single
    fit's FloatingPointError for the first such row."""
    loss, grad = evaluate(rows, thetas)
    loss = np.asarray(loss, dtype=np.float64).reshape(len(rows))
    grad = np.asarray(grad, dtype=np.float64).reshape(thetas.shape)
    bad = np.flatnonzero(~(np.isfinite(loss) & np.isfinite(grad).all(1)))
    if bad.size:
        i = int(bad[0])
        # the single fit's check raises its message for this row's values
        _checked(lambda _: (float(loss[i]), grad[i]), lambda: int(steps[i]), f"L-BFGS-B, output {labels[rows[i]]}")(
            thetas[i]
        )
    return n * loss, n * grad


def _stop_on_gradient(st: _Rows, rows: np.ndarray, space: HyperparameterSpace) -> None:
    """Stops (converged) the ``rows`` whose projected gradient (scipy's: ``clip(x - g) - x``) is within
    :data:`LBFGS_GTOL`."""
    step = np.clip(st.x[rows] - st.g[rows], space.lower, space.upper) - st.x[rows]
    small = rows[np.abs(step).max(1, initial=0.0) <= LBFGS_GTOL]
    st.running[small] = False
    st.converged[small] = True
    for j in small:
        st.messages[j] = "CONVERGENCE: NORM OF PROJECTED GRADIENT <= PGTOL"


def _new_directions(st: _Rows, rows: np.ndarray, space: HyperparameterSpace) -> None:
    """The L-BFGS directions of ``rows`` on their free variables, with their first trial steps."""
    if rows.size == 0:
        return
    x, g = st.x[rows], st.g[rows]
    free = ~(((x <= space.lower) & (g > 0)) | ((x >= space.upper) & (g < 0)))
    d = -_two_loop(g * free, st.S[rows] * free[:, None, :], st.Y[rows] * free[:, None, :]) * free
    slope = np.einsum("rp,rp->r", g, d)
    # a direction that is not one of descent (memory built elsewhere in the box): steepest descent, memory dropped
    uphill = ~(slope < 0)
    if uphill.any():
        st.S[rows[uphill]] = 0.0
        st.Y[rows[uphill]] = 0.0
        d[uphill] = -(g * free)[uphill]
    st.d[rows] = d
    empty = ~st.Y[rows].any(axis=(1, 2))
    norm = np.linalg.norm(d, axis=1)
    st.t[rows] = np.where(empty & (norm > 0), 1.0 / np.maximum(norm, 1e-300), 1.0)
    st.t[rows] = np.minimum(st.t[rows], 1.0)
    st.lo[rows], st.hi[rows], st.trials[rows] = 0.0, np.inf, 0


def _two_loop(q: np.ndarray, S: np.ndarray, Y: np.ndarray) -> np.ndarray:
    """H q for each row by the two-loop recursion over its pairs S, Y (r, m, p), newest last; a zero pair (an
    unused slot) is skipped by its rho = 0. H0 = (s'y / y'y) I of the newest pair (I without pairs)."""
    sy = np.einsum("rmp,rmp->rm", S, Y)
    yy = np.einsum("rmp,rmp->rm", Y, Y)
    rho = np.where(sy > 0, 1.0 / np.where(sy > 0, sy, 1.0), 0.0)
    q = q.copy()
    alpha = np.zeros(sy.shape)
    for i in reversed(range(S.shape[1])):
        alpha[:, i] = rho[:, i] * np.einsum("rp,rp->r", S[:, i], q)
        q -= alpha[:, i, None] * Y[:, i]
    gamma = np.ones(q.shape[0])
    for i in range(S.shape[1]):  # the newest stored pair's scaling
        has = sy[:, i] > 0
        gamma = np.where(has, sy[:, i] / np.where(has, yy[:, i], 1.0), gamma)
    r = gamma[:, None] * q
    for i in range(S.shape[1]):
        beta = rho[:, i] * np.einsum("rp,rp->r", Y[:, i], r)
        r += S[:, i] * (alpha[:, i] - beta)[:, None]
    return r


def _accept(st: _Rows, rows, x_new, f_new, g_new, n: int, ftol: float, max_iter: int, space) -> None:
    """Moves ``rows`` to their accepted trial points, stores their pairs and applies the stopping tests."""
    if rows.size == 0:
        return
    s, y = x_new - st.x[rows], g_new - st.g[rows]
    sy, yy = np.einsum("rp,rp->r", s, y), np.einsum("rp,rp->r", y, y)
    keep = sy > np.finfo(float).eps * yy
    kept = rows[keep]
    st.S[kept] = np.roll(st.S[kept], -1, axis=1)
    st.Y[kept] = np.roll(st.Y[kept], -1, axis=1)
    st.S[kept, -1], st.Y[kept, -1] = s[keep], y[keep]
    f_old = st.f[rows]
    st.x[rows], st.f[rows], st.g[rows] = x_new, f_new, g_new
    st.n_iter[rows] += 1
    for j, value in zip(rows, f_new):
        st.history[j].append(float(value / n))
    _stop_on_gradient(st, rows, space)
    flat = rows[st.running[rows] & (f_old - f_new <= ftol * np.maximum(np.maximum(abs(f_old), abs(f_new)), 1.0))]
    st.running[flat] = False
    st.converged[flat] = True
    for j in flat:
        st.messages[j] = "CONVERGENCE: RELATIVE REDUCTION OF F <= FACTR*EPSMCH"
    capped = rows[st.running[rows] & (st.n_iter[rows] >= max_iter)]
    st.running[capped] = False
    for j in capped:
        st.messages[j] = "STOP: TOTAL NO. OF ITERATIONS REACHED LIMIT"


def _search(st: _Rows, rows, trial, f_t, g_t, ok, space: HyperparameterSpace) -> np.ndarray:
    """One step of the bracketing line search of ``rows`` after their trials ``trial`` (r, p) with total losses
    ``f_t`` and gradients ``g_t``, whose Armijo test is ``ok``: returns, per row, whether it takes ``trial``. A row
    takes it when the weak Wolfe curvature condition ``g_t'(x_t - x) >= c2 g'(x_t - x)`` also holds, or when a
    longer step would move nowhere (every moving variable clipped). Otherwise the bracket [lo, hi] of t shrinks
    (Armijo failed: hi = t) or grows (curvature failed: lo = t, its point kept): t goes to the minimiser of the
    quadratic through f(0), its slope and f(t) within [0.1 t, 0.5 t] while lo = 0, else the bracket's midpoint,
    or 4 t while hi is infinite. After :data:`MAX_TRIALS` trials a row takes its point at lo if it has one."""
    t, x = st.t[rows], st.x[rows]
    step = trial - x
    predicted = np.einsum("rp,rp->r", st.g[rows], step)
    curved = np.einsum("rp,rp->r", g_t, step) >= WOLFE_C2 * predicted
    stuck = (np.clip(x + 2 * t[:, None] * st.d[rows], space.lower, space.upper) == trial).all(1)
    take = ok & (curved | stuck)
    longer = ok & ~take
    st.lo[rows[longer]] = t[longer]
    st.x_lo[rows[longer]], st.f_lo[rows[longer]], st.g_lo[rows[longer]] = trial[longer], f_t[longer], g_t[longer]
    st.hi[rows[~ok]] = t[~ok]
    lo, hi = st.lo[rows], st.hi[rows]
    slope = np.minimum(predicted, 0.0) / t
    curvature = f_t - st.f[rows] - slope * t
    with np.errstate(divide="ignore", invalid="ignore"):
        quad = np.nan_to_num(np.where(curvature > 0, -slope * t * t / (2 * curvature), 0.0), nan=0.0)
    st.t[rows] = np.where(
        np.isinf(hi),
        4 * t,
        np.where(lo > 0, 0.5 * (lo + np.where(np.isinf(hi), 0, hi)), np.clip(quad, 0.1 * t, 0.5 * t)),
    )
    st.trials[rows] += 1
    return take


def _give_up(st: _Rows, rows, space: HyperparameterSpace) -> np.ndarray:
    """The ``rows`` whose line search has used :data:`MAX_TRIALS` trials without taking one: those with a point at
    lo are returned (to take it); those with memory start again by steepest descent; the others stop,
    flat-converged when their projected gradient is within :data:`LBFGS_FLAT_GTOL` (as a single fit's abnormal
    stop)."""
    exhausted = rows[st.trials[rows] >= MAX_TRIALS]
    at_lo = exhausted[st.lo[exhausted] > 0]
    exhausted = np.setdiff1d(exhausted, at_lo)
    with_memory = exhausted[st.Y[exhausted].any(axis=(1, 2))]
    st.S[with_memory] = 0.0
    st.Y[with_memory] = 0.0
    _new_directions(st, with_memory, space)
    for j in np.setdiff1d(exhausted, with_memory):
        st.running[j] = False
        largest = float(np.abs(_projected(st.g[j], st.x[j], space)).max(initial=0.0))
        st.converged[j] = largest <= LBFGS_FLAT_GTOL
        st.messages[j] = (
            f"the line search found no decrease where the loss is flat to its rounding error (largest projected "
            f"gradient {largest:.2g} <= {LBFGS_FLAT_GTOL:g})"
            if st.converged[j]
            else "ABNORMAL_TERMINATION_IN_LNSRCH"
        )
    return at_lo
