"""A box-constrained L-BFGS over many independent problems at once: row j of ``theta`` (k, p) minimises its own
loss, and every round evaluates the rows still running in one batched call.

Why not one scipy L-BFGS-B per row: scipy's optimiser is sequential code driven from Python, so k of them stepping
together need a thread each (:mod:`~gpfast.estimator.lockstep`), and the threads' hand-offs cost about 0.6 ms per
output-evaluation on the CPU. For 1,000 outputs and ~50 rounds that is ~30 s of overhead, against tens of ms for
the batched evaluations on a GPU. Here the optimiser's own arithmetic is numpy over all rows, ~k x m x p flops a
round, so the rounds cost what their evaluations cost.

The method, per row, is L-BFGS-B's (Byrd, Lu, Nocedal & Zhu 1995; version 3.0's subspace step, Morales & Nocedal
2011), so that a row takes the steps of a single fit's :func:`~gpfast.estimator.optimize.minimize_lbfgs`:

* **Direction.** The generalised Cauchy point (the first minimiser of the quadratic model along the projected
  gradient path), then the model's minimiser over the variables it leaves free, projected into the box. The model's
  matrix B is the BFGS matrix of the row's last ``memory`` pairs (s, y) from B0 = (y'y / s'y) I, formed densely:
  p x p is small, and one batched solve serves every row. A direction that is not one of descent drops the row's
  memory (steepest descent).
* **Step.** Moré-Thuente's strong-Wolfe search (:class:`~gpfast.estimator.batched_line_search.StrongWolfeSearch`,
  L-BFGS-B's constants) along the straight line, never beyond the box (the largest feasible step caps it, and caps
  the first iteration's at the full gradient step), from t = 1, or t = 1 / ||d|| on the first iteration as
  L-BFGS-B starts. A search that takes :data:`MAX_TRIALS` trials drops the row's memory and starts again by
  steepest descent, and without memory the row stops (L-BFGS-B's "ABNORMAL"). A pair with
  ``s'y <= eps (-g's)`` is not stored.
* **Stopping**, the tests of :func:`~gpfast.estimator.optimize.minimize_lbfgs` on the total loss ``n x`` the
  per-point one: converged when ``(f_old - f) <= ftol max(|f_old|, |f|, 1)`` (``ftol = tol``, or
  :data:`~gpfast.estimator.optimize.LBFGS_FTOL`), or when the largest entry of ``clip(x - g) - x`` is at most
  :data:`~gpfast.estimator.optimize.LBFGS_GTOL` (L-BFGS-B's projected gradient); an abnormal stop counts as
  converged when :func:`~gpfast.estimator.optimize.descent_left` (the rows that stopped so probed together, after
  the loop) bounds what the steepest-descent line still offers by :data:`~gpfast.estimator.optimize.LBFGS_FLAT_NATS`;
  stopped after ``max_iter`` steps or ``max(15000, 4 max_iter)`` evaluations. A row that stops leaves the batch.

Its arithmetic differs from scipy's by rounding (dense B against the compact form: the same steps, the losses equal
to ~1e-7 relative after 30 steps, on the tests' problems), and where a projected step would return to the direction
just searched (a descent direction only to rounding) it takes L-BFGS-B's cut step, where scipy's takes the
projection and can stall. Where rounding tips two paths apart on a
likelihood with several optima, the starts of :mod:`~gpfast.estimator.restarts` handle them as in a single fit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from gpfast.estimator.batched_line_search import StrongWolfeSearch
from gpfast.estimator.hyperparameters import HyperparameterSpace
from gpfast.estimator.optimize import (
    LBFGS_FLAT_NATS,
    LBFGS_FTOL,
    LBFGS_GTOL,
    OptimizeResult,
    _checked,
    abnormal_message,
    descent_left,
)

__all__ = ["MAX_TRIALS", "MEMORY", "STEP_CAP", "minimize_batched_lbfgs"]

#: Pairs (s, y) kept per row (scipy's default ``maxcor``).
MEMORY = 10
#: Trials of one line search before the row gives up on its direction (L-BFGS-B's).
MAX_TRIALS = 20
#: The largest step of a search along a direction with no bound in the way (L-BFGS-B's).
STEP_CAP = 1e10

#: evaluate(rows, thetas) -> (loss per data point (len(rows),), gradient (len(rows), p)), float64.
BatchedLoss = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


@dataclass
class _Rows:
    """The state of every row: the iterate, its total loss and gradient, the memory (oldest pair first, unused
    slots zero), the direction and its line search, and the counters and outcome."""

    x: np.ndarray  # (k, p)
    f: np.ndarray  # (k,)
    g: np.ndarray  # (k, p)
    S: np.ndarray  # (k, m, p)
    Y: np.ndarray  # (k, m, p)
    d: np.ndarray  # (k, p)
    search: StrongWolfeSearch
    trials: np.ndarray  # (k,) int, of the current line search
    n_iter: np.ndarray  # (k,) int
    n_eval: np.ndarray  # (k,) int
    running: np.ndarray  # (k,) bool
    converged: np.ndarray  # (k,) bool
    abnormal: np.ndarray  # (k,) bool: stopped by its line search, flat or not judged after the loop
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
    st = _Rows(
        x=x, f=f, g=g, S=np.zeros((k, memory, p)), Y=np.zeros((k, memory, p)), d=np.zeros((k, p)),
        search=StrongWolfeSearch(k), trials=np.zeros(k, dtype=int), n_iter=np.zeros(k, dtype=int),
        n_eval=np.ones(k, dtype=int), running=np.ones(k, dtype=bool), converged=np.zeros(k, dtype=bool),
        abnormal=np.zeros(k, dtype=bool), messages=[""] * k, history=[[] for _ in range(k)],
    )  # fmt: skip
    if max_iter <= 0:
        st.running[:] = False
        st.messages = ["max_iter=0"] * k
    else:
        _stop_on_gradient(st, np.arange(k), space)
    max_eval = max(15000, 4 * int(max_iter))
    _new_directions(st, np.flatnonzero(st.running), space)
    while st.running.any():
        _round(st, evaluate, space, n, labels, ftol, int(max_iter), max_eval)
    _judge_abnormal(st, evaluate, space, n, labels)
    return [
        OptimizeResult(st.x[j].copy(), float(st.f[j] / n), st.history[j], int(st.n_iter[j]), bool(st.converged[j]),
                       st.messages[j])
        for j in range(k)
    ]  # fmt: skip


def _round(st: _Rows, evaluate: BatchedLoss, space, n: int, labels: list, ftol: float, max_iter: int, max_eval: int):
    """One trial step of every running row, evaluated in one call; each row's search ends (the row moves), goes on,
    or gives up, and the rows' stopping tests are applied."""
    rows = np.flatnonzero(st.running)
    trial = np.clip(st.x[rows] + st.search.stp[rows, None] * st.d[rows], space.lower, space.upper)
    f_t, g_t = _evaluate(evaluate, rows, trial, n, labels, st.n_iter[rows])
    st.n_eval[rows] += 1
    st.trials[rows] += 1
    take = st.search.update(rows, f_t, np.einsum("rp,rp->r", g_t, st.d[rows]))
    _accept(st, rows[take], trial[take], f_t[take], g_t[take], n, ftol, max_iter, space)
    _give_up(st, rows[~take & (st.trials[rows] >= MAX_TRIALS)], space)
    out_of_evals = rows[st.running[rows] & (st.n_eval[rows] >= max_eval)]
    st.running[out_of_evals] = False
    for j in out_of_evals:
        st.messages[j] = "STOP: TOTAL NO. OF F,G EVALUATIONS EXCEEDS LIMIT"
    moved = rows[take]
    _new_directions(st, moved[st.running[moved]], space)


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
    """L-BFGS-B's search directions of ``rows`` (:func:`_directions`), and the start of their line searches."""
    if rows.size == 0:
        return
    x, g = st.x[rows], st.g[rows]
    d = _directions(x, g, st.S[rows], st.Y[rows], space)
    # a direction that is not one of descent (memory built elsewhere in the box): steepest descent, memory dropped
    uphill = ~(np.einsum("rp,rp->r", g, d) < 0)
    if uphill.any():
        st.S[rows[uphill]] = 0.0
        st.Y[rows[uphill]] = 0.0
        d[uphill] = np.clip(x[uphill] - g[uphill], space.lower, space.upper) - x[uphill]
    st.d[rows] = d
    cap = _largest_step(x, d, space)
    first = st.n_iter[rows] == 0
    bounded = np.isfinite(space.lower) | np.isfinite(space.upper)
    # L-BFGS-B's first iteration: the search goes no further than the gradient step, and starts at a step of unit
    # length unless every variable has both bounds
    if bounded.any():
        cap = np.where(first, 1.0, cap)
    boxed = bool(np.all(np.isfinite(space.lower) & np.isfinite(space.upper)))
    norm = np.linalg.norm(d, axis=1)
    stp = np.where(first & (not boxed), 1.0 / np.maximum(norm, np.finfo(float).tiny), 1.0)
    st.search.start(rows, np.minimum(stp, cap), st.f[rows], np.einsum("rp,rp->r", g, d), cap)
    st.trials[rows] = 0


def _directions(x, g, S, Y, space: HyperparameterSpace) -> np.ndarray:
    """Each row's step (r, p) to L-BFGS-B's next trial point: the subspace minimiser of the quadratic model
    ``g's + s'Bs / 2`` over the variables left free at the generalised Cauchy point (:func:`_cauchy_points`), the
    others at the Cauchy point's values; projected into the box, or, where the projection is not a descent
    direction, cut where the step from the Cauchy point leaves the box (L-BFGS-B 3.0's rule; here also where it is
    one only to rounding). Without memory (B = I) the step is the Cauchy point's, ``clip(x - g) - x``."""
    has = Y.any(axis=(1, 2))
    B = np.broadcast_to(np.eye(x.shape[1]), (x.shape[0],) + (x.shape[1],) * 2).copy()
    if has.any():
        B[has] = _bfgs_matrices(S[has], Y[has])
    xcp, fixed = _cauchy_points(x, g, B, space)
    d = xcp - x
    if not has.any():
        return d
    x, g, B, xcp, fixed = x[has], g[has], B[has], xcp[has], fixed[has]
    eye = np.eye(x.shape[1], dtype=bool)
    A = np.where(fixed[:, :, None] | fixed[:, None, :], np.where(eye, 1.0, 0.0), B)
    # B_FF (y_F - x_F) = -g_F - B_FA (xcp_A - x_A): the model's minimiser with the fixed variables at the Cauchy point
    rhs = -g - np.einsum("rij,rj->ri", B, np.where(fixed, xcp - x, 0.0))
    y = np.where(fixed, xcp, x + np.linalg.solve(A, np.where(fixed, 0.0, rhs)[..., None])[..., 0])
    projected = np.clip(y, space.lower, space.upper)
    # L-BFGS-B takes the projection where g'(projected - x) <= 0; a cosine within rounding of 0 (a projection back
    # onto the direction just searched) would stall the row, and there the cut step is taken instead
    scale = np.linalg.norm(g, axis=1) * np.linalg.norm(projected - x, axis=1)
    descent = np.einsum("rp,rp->r", g, projected - x) <= -np.sqrt(np.finfo(float).eps) * scale
    du = y - xcp
    cut = xcp + np.minimum(_largest_step(xcp, du, space), 1.0)[:, None] * du
    d[has] = np.where(descent[:, None], projected, np.clip(cut, space.lower, space.upper)) - x
    return d


def _cauchy_points(x, g, B, space: HyperparameterSpace):
    """L-BFGS-B's generalised Cauchy points (Byrd et al. 1995, Alg. CP): the first minimiser of the quadratic model
    along the projected steepest-descent path ``clip(x - t g)``, for rows x, g (r, p) and model matrices B (r, p, p).
    The path is followed from breakpoint to breakpoint (where a variable reaches its bound and stops), the
    breakpoints of all rows in step. Returns the points (r, p) and which variables they hold at a bound."""
    r, p = x.shape
    with np.errstate(divide="ignore", invalid="ignore"):
        tb = np.where(g < 0, (x - space.upper) / g, np.where(g > 0, (x - space.lower) / g, np.inf))
    tb = np.nan_to_num(tb, nan=np.inf)
    bound = np.where(g < 0, space.upper, space.lower) + np.zeros((r, p))
    fixed = tb <= 0
    d = np.where(fixed, 0.0, -g)
    z = np.where(fixed, bound - x, 0.0)
    t = np.zeros(r)
    searching = np.ones(r, dtype=bool)
    order = np.argsort(tb, axis=1)
    rows = np.arange(r)
    for j in range(p + 1):
        nxt = tb[rows, order[:, j]] if j < p else np.full(r, np.inf)
        Bd = np.einsum("rij,rj->ri", B, d)
        f1 = np.einsum("rp,rp->r", g, d) + np.einsum("rp,rp->r", z, Bd)
        f2 = np.einsum("rp,rp->r", d, Bd)
        with np.errstate(divide="ignore", invalid="ignore"):
            dt_min = np.where(f2 > 0, -f1 / f2, np.inf)
        span = np.maximum(nxt - t, 0.0)
        stop = searching & ((f1 >= 0) | (dt_min < span) | ~np.isfinite(nxt))
        move = stop & (f1 < 0) & np.isfinite(dt_min)
        z = np.where(move[:, None], z + np.where(move, np.maximum(dt_min, 0.0), 0.0)[:, None] * d, z)
        searching &= ~stop
        if j == p or not searching.any():
            break
        # the rows still on the path move to their next breakpoint, where its variable stops at its bound
        z = np.where(searching[:, None], z + span[:, None] * d, z)
        t = np.where(searching, nxt, t)
        hit = np.zeros((r, p), dtype=bool)
        hit[rows, order[:, j]] = searching & ~fixed[rows, order[:, j]]
        z = np.where(hit, bound - x, z)
        d = np.where(hit, 0.0, d)
        fixed |= hit
    return np.clip(x + z, space.lower, space.upper), fixed


def _bfgs_matrices(S: np.ndarray, Y: np.ndarray) -> np.ndarray:
    """The BFGS matrices (r, p, p) of the pairs S, Y (r, m, p), oldest first (zero slots skipped), from B0 =
    (y'y / s'y) I of the newest pair: the matrix of L-BFGS-B's compact representation."""
    sy = np.einsum("rmp,rmp->rm", S, Y)
    yy = np.einsum("rmp,rmp->rm", Y, Y)
    valid = sy > 0
    newest = S.shape[1] - 1 - np.argmax(valid[:, ::-1], axis=1)
    rows = np.arange(S.shape[0])
    theta = np.where(valid.any(1), yy[rows, newest] / np.where(valid.any(1), sy[rows, newest], 1.0), 1.0)
    B = theta[:, None, None] * np.eye(S.shape[2])
    for i in range(S.shape[1]):
        # B += y y' / s'y - (B s)(B s)' / s'Bs on the rows whose slot i holds a pair, as rank-one terms of unit
        # vectors scaled by square roots (no division per entry); all rows once memories are full
        has = np.flatnonzero(valid[:, i])
        if has.size == 0:
            continue
        every = has.size == B.shape[0]
        s, y, sy_i = (S[:, i], Y[:, i], sy[:, i]) if every else (S[has, i], Y[has, i], sy[has, i])
        Bh = B if every else B[has]
        Bs = (Bh @ s[:, :, None])[:, :, 0]
        sBs = np.einsum("ri,ri->r", s, Bs)
        good = sBs > 0
        Bs *= np.sqrt(good / np.where(good, sBs, 1.0))[:, None]
        y = y * np.sqrt(good / sy_i)[:, None]
        Bh += y[:, :, None] * y[:, None, :] - Bs[:, :, None] * Bs[:, None, :]
        if not every:
            B[has] = Bh
    return B


def _largest_step(x: np.ndarray, d: np.ndarray, space: HyperparameterSpace) -> np.ndarray:
    """The largest t with ``x + t d`` (r, p) inside the box for each row, at most :data:`STEP_CAP`."""
    with np.errstate(divide="ignore", invalid="ignore"):
        to_bound = np.where(d < 0, (space.lower - x) / d, np.where(d > 0, (space.upper - x) / d, np.inf))
    return np.minimum(np.nan_to_num(to_bound, nan=np.inf).min(1, initial=np.inf), STEP_CAP)


def _accept(st: _Rows, rows, x_new, f_new, g_new, n: int, ftol: float, max_iter: int, space) -> None:
    """Moves ``rows`` to their accepted trial points, stores their pairs and applies the stopping tests."""
    if rows.size == 0:
        return
    s, y = x_new - st.x[rows], g_new - st.g[rows]
    sy = np.einsum("rp,rp->r", s, y)
    keep = sy > np.finfo(float).eps * -np.einsum("rp,rp->r", st.g[rows], s)
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


def _give_up(st: _Rows, rows, space: HyperparameterSpace) -> None:
    """The ``rows`` whose line search has used :data:`MAX_TRIALS` trials stay where they are: those with memory start
    again by steepest descent; the others stop abnormally (judged flat or not by :func:`_judge_abnormal`)."""
    with_memory = rows[st.Y[rows].any(axis=(1, 2))]
    st.S[with_memory] = 0.0
    st.Y[with_memory] = 0.0
    _new_directions(st, with_memory, space)
    for j in np.setdiff1d(rows, with_memory):
        st.running[j] = False
        st.abnormal[j] = True


def _judge_abnormal(st: _Rows, evaluate: BatchedLoss, space: HyperparameterSpace, n: int, labels: list) -> None:
    """The rows that stopped abnormally count as converged where the loss is flat along their steepest-descent
    lines, as a single fit's abnormal stop; their lines are probed together, one call per step."""
    rows = np.flatnonzero(st.abnormal)
    if not rows.size:
        return

    def grad_at(active, thetas):
        return _evaluate(evaluate, rows[active], thetas, n, labels, st.n_iter[rows[active]])[1]

    left = descent_left(grad_at, st.x[rows], st.g[rows], space)
    for j, value in zip(rows, left):
        st.converged[j] = value <= LBFGS_FLAT_NATS
        st.messages[j] = abnormal_message(float(value))
