"""Moré and Thuente's line search (MINPACK-2's ``dcsrch`` and ``dcstep``, the search of scipy's L-BFGS-B), vectorised
over rows: each row searches along its own direction with its own step, bracket and stage, and all rows are
updated by one set of array operations per round.

Moré, J. J. and Thuente, D. J. (1994), "Line search algorithms with guaranteed sufficient decrease", ACM TOMS 20(3).
The search finds a step ``stp`` with ``f(stp) <= f(0) + ftol stp f'(0)`` and ``|f'(stp)| <= gtol |f'(0)|`` (strong
Wolfe); it stops early with a warning where rounding, the bracket's width or the step's bounds prevent more. The
same constants as L-BFGS-B's (``ftol`` 1e-3, ``gtol`` 0.9, ``xtol`` 0.1) make the same trial steps, so that a fit
whose directions are L-BFGS-B's takes L-BFGS-B's steps.
"""

from __future__ import annotations

import numpy as np

__all__ = ["StrongWolfeSearch"]

_XTRAPL, _XTRAPU, _P66 = 1.1, 4.0, 0.66


class StrongWolfeSearch:
    """The state of ``k`` rows' line searches; a row's search runs from :meth:`start` until :meth:`update` says it
    has ended. ``stp`` (k,) is each row's current trial step."""

    def __init__(self, k: int, ftol: float = 1e-3, gtol: float = 0.9, xtol: float = 0.1):
        self.ftol, self.gtol, self.xtol = ftol, gtol, xtol
        names = ("stp", "stpmax", "finit", "ginit", "stx", "fx", "gx", "sty", "fy", "gy", "stmin", "stmax")
        for name in names + ("width", "width1"):
            setattr(self, name, np.zeros(k))
        self.brackt = np.zeros(k, dtype=bool)
        self.stage2 = np.zeros(k, dtype=bool)

    def start(self, rows: np.ndarray, stp: np.ndarray, f: np.ndarray, g: np.ndarray, stpmax: np.ndarray) -> None:
        """Begins the searches of ``rows`` at the first trial steps ``stp`` (0 < stp <= stpmax), from the loss ``f``
        and its (negative) derivative ``g`` along the direction at step 0."""
        self.stp[rows], self.stpmax[rows] = stp, stpmax
        self.brackt[rows], self.stage2[rows] = False, False
        self.finit[rows], self.ginit[rows] = f, g
        self.width[rows] = stpmax
        self.width1[rows] = 2 * stpmax
        self.stx[rows], self.fx[rows], self.gx[rows] = 0.0, f, g
        self.sty[rows], self.fy[rows], self.gy[rows] = 0.0, f, g
        self.stmin[rows], self.stmax[rows] = 0.0, stp + _XTRAPU * stp

    def update(self, rows: np.ndarray, f: np.ndarray, g: np.ndarray) -> np.ndarray:
        """Takes the loss ``f`` and derivative ``g`` at the rows' trial steps; returns, per row, whether its search
        has ended (converged or warned: the trial step is the one to take). The others get their next trial step
        in ``stp``."""
        stp, gtest = self.stp[rows], self.ftol * self.ginit[rows]
        ftest = self.finit[rows] + stp * gtest
        self.stage2[rows] |= (f <= ftest) & (g >= 0)
        brackt, stmin, stmax = self.brackt[rows], self.stmin[rows], self.stmax[rows]
        ended = (brackt & ((stp <= stmin) | (stp >= stmax))) | (brackt & (stmax - stmin <= self.xtol * stmax))
        ended |= (stp == self.stpmax[rows]) & (f <= ftest) & (g <= gtest)
        ended |= (stp == 0) & ((f > ftest) | (g >= gtest))
        ended |= (f <= ftest) & (np.abs(g) <= self.gtol * -self.ginit[rows])
        go = rows[~ended]
        if go.size:
            self._next_step(go, f[~ended], g[~ended])
        return ended

    def _next_step(self, rows: np.ndarray, f: np.ndarray, g: np.ndarray) -> None:
        stp, gtest = self.stp[rows], self.ftol * self.ginit[rows]
        ftest = self.finit[rows] + stp * gtest
        # in the first stage, a lower but not sufficiently lower value: step on the function less its Armijo line
        shift = np.where(~self.stage2[rows] & (f <= self.fx[rows]) & (f > ftest), gtest, 0.0)
        stx, sty = self.stx[rows], self.sty[rows]
        stx, fx, gx, sty, fy, gy, stp, brackt = _dcstep(
            stx, self.fx[rows] - stx * shift, self.gx[rows] - shift,
            sty, self.fy[rows] - sty * shift, self.gy[rows] - shift,
            stp, f - stp * shift, g - shift, self.brackt[rows], self.stmin[rows], self.stmax[rows],
        )  # fmt: skip
        self.stx[rows], self.fx[rows], self.gx[rows] = stx, fx + stx * shift, gx + shift
        self.sty[rows], self.fy[rows], self.gy[rows] = sty, fy + sty * shift, gy + shift
        self.brackt[rows] = brackt
        # a bracket that does not shrink enough: bisect it
        halve = brackt & (np.abs(sty - stx) >= _P66 * self.width1[rows])
        stp = np.where(halve, stx + 0.5 * (sty - stx), stp)
        self.width1[rows] = np.where(brackt, self.width[rows], self.width1[rows])
        self.width[rows] = np.where(brackt, np.abs(sty - stx), self.width[rows])
        stmin = np.where(brackt, np.minimum(stx, sty), stp + _XTRAPL * (stp - stx))
        stmax = np.where(brackt, np.maximum(stx, sty), stp + _XTRAPU * (stp - stx))
        self.stmin[rows], self.stmax[rows] = stmin, stmax
        stp = np.clip(stp, 0.0, self.stpmax[rows])
        stuck = brackt & ((stp <= stmin) | (stp >= stmax) | (stmax - stmin <= self.xtol * stmax))
        self.stp[rows] = np.where(stuck, stx, stp)


def _dcstep(stx, fx, dx, sty, fy, dy, stp, fp, dp, brackt, stpmin, stpmax):
    """MINPACK-2's ``dcstep`` on arrays: the safeguarded cubic or quadratic step from the interval's end ``stx``
    (the best step so far), its other end ``sty`` and the trial ``stp`` (values f and derivatives d of each), in its
    four cases (a higher value; derivatives of opposite sign; a smaller derivative of the same sign; a larger one).
    Returns the updated interval, the next step and whether the minimiser is bracketed."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        sgnd = dp * np.sign(dx)
        case1 = fp > fx
        case2 = ~case1 & (sgnd < 0)
        case3 = ~case1 & ~case2 & (np.abs(dp) < np.abs(dx))
        case4 = ~case1 & ~case2 & ~case3

        theta = 3.0 * (fx - fp) / (stp - stx) + dx + dp
        s = np.maximum(np.maximum(np.abs(theta), np.abs(dx)), np.abs(dp))
        root = (theta / s) ** 2 - (dx / s) * (dp / s)
        gamma = s * np.sqrt(np.where(case3, np.maximum(root, 0.0), root))
        gamma = np.where(case1, np.where(stp < stx, -gamma, gamma), np.where(stp > stx, -gamma, gamma))

        # case 1: the minimiser is bracketed; the cubic step if closer to stx than the quadratic, else between them
        c1 = stx + ((gamma - dx) + theta) / (((gamma - dx) + gamma) + dp) * (stp - stx)
        q1 = stx + ((dx / ((fx - fp) / (stp - stx) + dx)) / 2.0) * (stp - stx)
        f1 = np.where(np.abs(c1 - stx) <= np.abs(q1 - stx), c1, c1 + (q1 - c1) / 2.0)
        # case 2: bracketed; the cubic step if farther from stp than the secant step, else the secant step
        c2 = stp + ((gamma - dp) + theta) / (((gamma - dp) + gamma) + dx) * (stx - stp)
        secant = stp + (dp / (dp - dx)) * (stx - stp)
        f2 = np.where(np.abs(c2 - stp) > np.abs(secant - stp), c2, secant)
        # case 3: the cubic step only where it goes the right way, else the bound; safeguarded
        r3 = ((gamma - dp) + theta) / ((gamma + (dx - dp)) + gamma)
        c3 = np.where((r3 < 0) & (gamma != 0), stp + r3 * (stx - stp), np.where(stp > stx, stpmax, stpmin))
        near = np.where(np.abs(c3 - stp) < np.abs(secant - stp), c3, secant)
        near = np.where(
            stp > stx, np.minimum(stp + _P66 * (sty - stp), near), np.maximum(stp + _P66 * (sty - stp), near)
        )
        far = np.clip(np.where(np.abs(c3 - stp) > np.abs(secant - stp), c3, secant), stpmin, stpmax)
        f3 = np.where(brackt, near, far)
        # case 4: the cubic step towards sty if bracketed, else the bound
        theta4 = 3.0 * (fp - fy) / (sty - stp) + dy + dp
        s4 = np.maximum(np.maximum(np.abs(theta4), np.abs(dy)), np.abs(dp))
        gamma4 = s4 * np.sqrt((theta4 / s4) ** 2 - (dy / s4) * (dp / s4))
        gamma4 = np.where(stp > sty, -gamma4, gamma4)
        c4 = stp + ((gamma4 - dp) + theta4) / (((gamma4 - dp) + gamma4) + dy) * (sty - stp)
        f4 = np.where(brackt, c4, np.where(stp > stx, stpmax, stpmin))

    stpf = np.select([case1, case2, case3, case4], [f1, f2, f3, f4])
    brackt = brackt | case1 | case2
    # the interval: a higher value becomes its far end; a lower one its best end (the old best the far end when
    # the derivatives changed sign)
    to_y = case1 | (sgnd < 0)
    new_sty = np.where(case1, stp, np.where(to_y, stx, sty))
    new_fy = np.where(case1, fp, np.where(to_y, fx, fy))
    new_dy = np.where(case1, dp, np.where(to_y, dx, dy))
    new_stx, new_fx, new_dx = np.where(case1, stx, stp), np.where(case1, fx, fp), np.where(case1, dx, dp)
    return new_stx, new_fx, new_dx, new_sty, new_fy, new_dy, stpf, brackt
