"""Tests of gpfast.estimator.batched_lbfgs: many box-constrained problems minimised together, each to its own
minimiser, each stopping on its own test, and failing as a single fit fails."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest
from scipy.optimize import minimize

from conftest import fresh_rng
from gpfast.estimator.batched_lbfgs import minimize_batched_lbfgs
from gpfast.estimator.optimize import LBFGS_FTOL, LBFGS_GTOL


class _box(NamedTuple):
    """A box of any dimension (what the optimiser reads of a HyperparameterSpace)."""

    lower: np.ndarray
    upper: np.ndarray


def _kkt_quadratics(rng, k, p):
    """k convex quadratics on the box [-1, 1]^p whose minimiser x* is known: f(x) = 0.5 (x - x*)' A (x - x*) +
    g*'(x - x*), A symmetric positive definite (condition number up to 1e3), g* = 0 on x*'s free entries and pointing
    into the box on the entries at a bound, so that x* satisfies the box's KKT conditions."""
    x_star = rng.uniform(-0.9, 0.9, (k, p))
    side = rng.integers(-1, 2, (k, p))  # -1: at the lower bound, 1: at the upper, 0: free
    x_star = np.where(side == 0, x_star, side.astype(float))
    g_star = -side * rng.uniform(0.5, 2.0, (k, p))  # at the lower bound the loss rises into the box
    Q, _ = np.linalg.qr(rng.normal(size=(k, p, p)))
    A = Q @ (np.logspace(0, 3, p)[None, :, None] * Q.mT)

    def evaluate(rows, thetas):
        r = thetas - x_star[rows]
        Ar = np.einsum("rij,rj->ri", A[rows], r)
        return 0.5 * np.einsum("ri,ri->r", r, Ar) + np.einsum("ri,ri->r", g_star[rows], r), Ar + g_star[rows]

    return evaluate, x_star, A


def test_quadratics_reach_their_known_constrained_minimisers():
    """From random starts, the rows reach their own x*, some of whose entries are at a bound, and stop on the
    projected-gradient test (the loss is exact, so the relative-decrease test is switched off with tol=0). As in
    scipy's L-BFGS-B, a row can stall where its projected steps keep returning to one edge of the box and a step
    then makes no decrease (1 row in 1,600 of these draws): such a row stops, converged by tol=0's test, short of
    x*; at least 90% of the rows must reach it, and every row's loss falls at each step."""
    rng, seed = fresh_rng()
    k, p = 40, 6
    evaluate, x_star, A = _kkt_quadratics(rng, k, p)
    space = _box(-np.ones(p), np.ones(p))
    res = minimize_batched_lbfgs(evaluate, rng.uniform(-1, 1, (k, p)), space, 1, 1000, tol=0.0)
    reached = [j for j, r in enumerate(res) if "PROJECTED GRADIENT" in r.message]
    assert len(reached) >= 0.9 * k, f"seed {seed}: {len(reached)} of {k} rows reached x*"
    for j, r in enumerate(res):
        msg = f"seed {seed}, row {j}: {r.message}"
        assert r.converged, msg
        if j in reached:  # the projected gradient is at most LBFGS_GTOL: x within LBFGS_GTOL / (eigenvalue 1) of x*
            np.testing.assert_allclose(r.theta, x_star[j], atol=10 * LBFGS_GTOL, err_msg=msg)
        assert np.all((r.theta >= -1) & (r.theta <= 1)), msg
        assert len(r.history) == r.n_iter and r.history[-1] == r.loss, msg
        assert all(b <= a for a, b in zip(r.history, r.history[1:])), msg


def _rosenbrock(rows, thetas):
    a, b = thetas[:, 0], thetas[:, 1]
    f = (1 - a) ** 2 + 100 * (b - a * a) ** 2
    return f, np.stack([-2 * (1 - a) - 400 * a * (b - a * a), 200 * (b - a * a)], 1)


def test_rosenbrock_rows_stop_on_their_own_test_and_are_not_held_back():
    """Rows of Rosenbrock's function from different starts need different numbers of steps. Each row takes exactly
    the steps it takes when minimised alone, is evaluated only while it runs, and reaches the minimiser: (1, 1)
    inside the box, and (a, 0.8) on the face b = 0.8 where the box cuts it off (a solves the 1-D condition
    -2 (1 - a) - 400 a (0.8 - a^2) = 0 there), as scipy's L-BFGS-B finds."""
    rng, seed = fresh_rng()
    k = 12
    starts = np.column_stack([rng.uniform(-2, 2, k), rng.uniform(-2, 2, k)])
    for upper_b, expected in ((2.0, np.array([1.0, 1.0])), (0.8, None)):
        space = _box(np.array([-2.0, -2.0]), np.array([2.0, upper_b]))
        if expected is None:
            expected = minimize(
                lambda x: tuple(v[0] for v in _rosenbrock(None, x[None])), [0.9, 0.8], jac=True, method="L-BFGS-B",
                bounds=[(-2, 2), (-2, upper_b)], options={"ftol": 0, "gtol": 1e-12},
            ).x  # fmt: skip
        calls = np.zeros(k, dtype=int)

        def counted(rows, thetas):
            calls[rows] += 1
            return _rosenbrock(rows, thetas)

        together = minimize_batched_lbfgs(counted, starts, space, 1, 1000, tol=0.0)
        reached = 0
        assert len({r.n_iter for r in together}) > 3, f"seed {seed}: the rows should stop at different steps"
        for j, r in enumerate(together):
            msg = f"seed {seed}, box b <= {upper_b}, row {j}: {r.message}"
            alone_calls = [0]

            def counted_alone(rows, thetas):
                alone_calls[0] += 1
                return _rosenbrock(rows, thetas)

            alone = minimize_batched_lbfgs(counted_alone, starts[j : j + 1], space, 1, 1000, tol=0.0)[0]
            assert r.n_iter == alone.n_iter and r.converged and alone.converged, msg
            np.testing.assert_allclose(r.history, alone.history, rtol=1e-12, atol=1e-300, err_msg=msg)
            assert calls[j] == alone_calls[0], msg  # not evaluated after it stopped
            if "PROJECTED GRADIENT" in r.message:  # not a row stalled at an edge (see the quadratics' test)
                reached += 1
                np.testing.assert_allclose(r.theta, expected, atol=1e-4, err_msg=msg)
        assert reached >= 0.75 * k, f"seed {seed}, box b <= {upper_b}: {reached} of {k} rows reached the minimiser"


def test_a_row_that_stops_leaves_the_batch():
    """A row that starts at its minimiser stops before any step (converged, n_iter 0) and is never evaluated again,
    while the others go on."""
    rng, seed = fresh_rng()
    evaluate, x_star, _ = _kkt_quadratics(rng, 3, 4)
    seen = []

    def logged(rows, thetas):
        seen.append(list(rows))
        return evaluate(rows, thetas)

    starts = np.stack([x_star[0], rng.uniform(-1, 1, 4), rng.uniform(-1, 1, 4)])
    res = minimize_batched_lbfgs(logged, starts, _box(-np.ones(4), np.ones(4)), 1, 1000, tol=0.0)
    assert res[0].converged and res[0].n_iter == 0 and res[0].history == [], f"seed {seed}"
    assert seen[0] == [0, 1, 2] and all(0 not in rows for rows in seen[1:]), f"seed {seed}"
    assert min(res[1].n_iter, res[2].n_iter) > 0, f"seed {seed}"


def test_stopping_rules_of_the_single_fit():
    """max_iter caps the steps (not converged, scipy's message); max_iter=0 returns the clipped starts; the
    relative-decrease test stops a row whose loss no longer falls by ``tol`` of itself."""
    rng, seed = fresh_rng()
    space = _box(np.array([-2.0, -2.0]), np.array([2.0, 2.0]))
    starts = np.array([[-1.5, 2.0], [3.0, -3.0]])
    capped = minimize_batched_lbfgs(_rosenbrock, starts, space, 1, 3, tol=0.0)
    for r in capped:
        assert r.n_iter == 3 and not r.converged and "ITERATIONS REACHED LIMIT" in r.message
    none = minimize_batched_lbfgs(_rosenbrock, starts, space, 1, 0)
    np.testing.assert_array_equal(none[1].theta, [2.0, -2.0])
    assert none[1].loss == _rosenbrock(None, np.array([[2.0, -2.0]]))[0][0] and none[1].message == "max_iter=0"
    loose = minimize_batched_lbfgs(_rosenbrock, starts, space, 1, 1000, tol=1e-3)
    tight = minimize_batched_lbfgs(_rosenbrock, starts, space, 1, 1000, tol=0.0)
    for a, b in zip(loose, tight):
        assert a.converged and "RELATIVE REDUCTION" in a.message and a.n_iter < b.n_iter, a.message
        last, before = a.history[-1], a.history[-2]
        assert before - last <= 1e-3 * max(abs(before), abs(last), 1.0)


def test_a_non_finite_row_raises_as_a_single_fit():
    """A loss or gradient that becomes non-finite on one row raises the single fit's FloatingPointError, naming the
    row (by its label), the step and the point; an error raised by the evaluation propagates."""
    rng, seed = fresh_rng()
    evaluate, _, _ = _kkt_quadratics(rng, 3, 4)

    def poisoned(rows, thetas):
        loss, grad = evaluate(rows, thetas)
        loss = np.where((rows == 1) & (thetas[:, 0] > 0.5), np.nan, loss)
        return loss, grad

    starts = np.zeros((3, 4))
    starts[1, 0] = 0.9
    space = _box(-np.ones(4), np.ones(4))
    with pytest.raises(FloatingPointError, match=r"became nan at step 0 \(L-BFGS-B, output 7\) with log hyperp"):
        minimize_batched_lbfgs(poisoned, starts, space, 1, 100, labels=[5, 7, 9])

    def failing(rows, thetas):
        raise np.linalg.LinAlgError("not positive definite")

    with pytest.raises(np.linalg.LinAlgError, match="not positive definite"):
        minimize_batched_lbfgs(failing, starts, space, 1, 100)
    with pytest.raises(ValueError, match=r"labels has 2 entries; expected one per row \(3\)"):
        minimize_batched_lbfgs(evaluate, starts, space, 1, 100, labels=[1, 2])


def test_the_total_loss_decides_the_tests():
    """The tests apply to n times the per-point loss, as in a single fit: with the per-point loss scaled down by n,
    the rows take the steps of n = 1 on the unscaled loss, and report the per-point loss. (n a power of two, so that
    the scaling is exact and the two runs make the same decisions.)"""
    rng, seed = fresh_rng()
    evaluate, _, _ = _kkt_quadratics(rng, 4, 3)
    n = 256.0

    def per_point(rows, thetas):
        loss, grad = evaluate(rows, thetas)
        return loss / n, grad / n

    space = _box(-np.ones(3), np.ones(3))
    starts = rng.uniform(-1, 1, (4, 3))
    a = minimize_batched_lbfgs(per_point, starts, space, n, 1000)
    b = minimize_batched_lbfgs(evaluate, starts, space, 1, 1000)
    for ra, rb in zip(a, b):
        assert ra.n_iter == rb.n_iter and ra.message == rb.message, f"seed {seed}"
        np.testing.assert_array_equal(ra.theta, rb.theta, err_msg=f"seed {seed}")
        assert ra.loss * n == rb.loss and ra.history == [v / n for v in rb.history], f"seed {seed}"


def test_the_steps_of_scipys_lbfgsb():
    """Where scipy's L-BFGS-B is the single fit's optimiser, each row takes its steps: on quadratics with active
    bounds (6-D) and on Rosenbrock's function cut by the box, from random starts, with the single fit's tolerances,
    the loss after each step equals scipy's to rounding (1e-5 relative: the two differ in the last digits from the
    first step, and an ill-conditioned quadratic or Rosenbrock's valley grows that to ~1e-7 over 30 steps) and the
    rows stop after as many steps (give or take the last, where a relative decrease within rounding of ftol can be
    judged either way). All 1,600 rows of 40 draws did; the bar is 90% of the rows, for draws where rounding tips
    a row of either into the stall described above while the other goes on."""
    rng, seed = fresh_rng()
    k = 16
    evaluate, _, _ = _kkt_quadratics(rng, k, 6)
    cases = [
        (evaluate, _box(-np.ones(6), np.ones(6)), rng.uniform(-1, 1, (k, 6))),
        (_rosenbrock, _box(np.array([-2.0, -2.0]), np.array([2.0, 0.8])), rng.uniform(-2, 0.8, (k, 2))),
    ]
    differ = 0
    for fun, box, starts in cases:
        rows = minimize_batched_lbfgs(fun, starts, box, 1, 1000)
        for j, r in enumerate(rows):
            history = []

            def one(x, j=j):
                f, g = fun(np.array([j]), x[None])
                return f[0], g[0]

            ref = minimize(
                one, starts[j], jac=True, method="L-BFGS-B", bounds=list(zip(box.lower, box.upper)),
                callback=lambda xk, one=one, history=history: history.append(one(xk)[0]),
                options={"ftol": LBFGS_FTOL, "gtol": LBFGS_GTOL, "maxiter": 1000},
            )  # fmt: skip
            assert r.converged, f"seed {seed}, {fun.__name__}, row {j}: {r.message}"
            m = min(r.n_iter, ref.nit)
            same = abs(r.n_iter - ref.nit) <= 1 and np.allclose(
                r.history[:m], history[:m], rtol=1e-5, atol=1e-9 * abs(history[0])
            )
            differ += 0 if same else 1
    assert differ <= 0.1 * 2 * k, f"seed {seed}: {differ} of {2 * k} rows took other steps than scipy's"
