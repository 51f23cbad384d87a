"""Tests of gpfast.estimator.batched_line_search: Moré-Thuente's search vectorised over rows makes, for each row,
the trial steps of MINPACK-2's dcsrch (scipy's translation, the search inside scipy's L-BFGS-B)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import fresh_rng
from gpfast.estimator.batched_line_search import StrongWolfeSearch

dcsrch = pytest.importorskip("scipy.optimize._dcsrch")


def _functions(rng, k):
    """k one-dimensional functions phi(t) and their derivatives, with phi'(0) < 0: quartics whose minimiser lies
    anywhere from 1e-3 to 1e3, and Moré and Thuente's six test functions (their section 6: a smooth one, a steep
    one, one with 20 wiggles, and three flat ones of different conditioning)."""
    scale = 10.0 ** rng.uniform(-3, 3, k)
    c = rng.uniform(0.1, 2.0, (k, 3))
    kinds = np.arange(k) % 7

    def phi(rows, t):
        u, a, kind = t / scale[rows], c[rows], kinds[rows]
        fs = [a[:, 0] * u**4 - a[:, 1] * u**3 * 0.5 + a[:, 2] * u**2 - 2.0 * u, -t / (t * t + 2.0)]
        gs = [(4 * a[:, 0] * u**3 - 1.5 * a[:, 1] * u**2 + 2 * a[:, 2] * u - 2.0) / scale[rows]]
        gs.append((t * t - 2.0) / (t * t + 2.0) ** 2)
        b = t + 0.004
        fs.append(b**5 - 2 * b**4)
        gs.append(5 * b**4 - 8 * b**3)
        beta, wiggles = 0.01, 39
        inner = np.abs(t - 1) < beta
        fs.append(
            np.where(inner, (t - 1) ** 2 / (2 * beta) + beta / 2, np.abs(t - 1))
            + 2 * (1 - beta) / (wiggles * np.pi) * np.sin(wiggles * np.pi * t / 2)
        )
        gs.append(np.where(inner, (t - 1) / beta, np.sign(t - 1)) + (1 - beta) * np.cos(wiggles * np.pi * t / 2))
        for b1, b2 in ((0.001, 0.001), (0.01, 0.001), (0.001, 0.01)):
            g1, g2 = np.sqrt(1 + b1 * b1) - b1, np.sqrt(1 + b2 * b2) - b2
            fs.append(g1 * np.sqrt((1 - t) ** 2 + b2 * b2) + g2 * np.sqrt(t * t + b1 * b1))
            gs.append(g1 * (t - 1) / np.sqrt((1 - t) ** 2 + b2 * b2) + g2 * t / np.sqrt(t * t + b1 * b1))
        return np.choose(kind, fs), np.choose(kind, gs)

    return phi


def test_the_trial_steps_are_dcsrch_s():
    """From first steps spread over six decades (so that rows extrapolate, bracket and interpolate), with and
    without a cap on the step, every row's trials and the step it ends at are those of scipy's dcsrch, to rounding,
    while the rows end at different trials."""
    rng, seed = fresh_rng()
    k = 64
    phi = _functions(rng, k)
    stp0 = 10.0 ** rng.uniform(-3, 3, k)
    stpmax = np.where(np.arange(k) % 3 == 0, 2.0 * stp0, 1e10)
    rows = np.arange(k)
    f0, g0 = phi(rows, np.zeros(k))
    search = StrongWolfeSearch(k)
    search.start(rows, stp0, f0, g0, stpmax)
    trials = [[] for _ in range(k)]
    running = rows.copy()
    for _ in range(50):
        if running.size == 0:
            break
        stp = search.stp[running].copy()
        for j, t in zip(running, stp):
            trials[j].append(t)
        f, g = phi(running, stp)
        running = running[~search.update(running, f, g)]
    assert running.size == 0, f"seed {seed}"
    assert len({len(t) for t in trials}) > 2, f"seed {seed}: the rows should end at different trials"
    for j in range(k):
        ref = dcsrch.DCSRCH(None, None, 1e-3, 0.9, 0.1, 0.0, stpmax[j])
        stp, task = stp0[j], b"START"
        stp, _, _, task = ref._iterate(stp, f0[j], g0[j], task)
        expected = []
        while task[:2] == b"FG" and len(expected) < 50:
            expected.append(stp)
            f, g = phi(np.array([j]), np.array([stp]))
            stp, _, _, task = ref._iterate(stp, f[0], g[0], task)
        np.testing.assert_allclose(trials[j], expected, rtol=1e-10, err_msg=f"seed {seed}, row {j}")
