"""Where the training engine reads a solve's convergence measure on the host.

On a GPU each read makes the host wait for the device, so a step's solve reads at most twice: first where the
last warm solve's measure crossed the tolerance (:func:`estimate_count`, from that solve's own reads and its end),
then, if that read misses, where the solves' rate per iteration says the tolerance will be met
(:func:`read_after_miss`). Cold solves (the first step, or new probes) are no guide to the warm ones after them and
keep simpler rules (a third of the cap; one fewer after a met first read).
"""

from __future__ import annotations

import math

__all__ = ["AFTER_MISS_MARGIN", "checks_for", "estimate_count", "read_after_miss", "solve_rate"]


def checks_for(estimate: int | None, cap: int, every: int | None) -> list[int]:
    """The CG iterations after which the solve reads its convergence measure on the host (each read makes a GPU
    wait). ``every``: every that many iterations. None: two reads at most, at the estimated count q and a little
    after it, min(q + max(2, q / 3), (q + cap) / 2); the engine moves the second to where the solves' rate puts
    the crossing once the first has missed (:func:`read_after_miss`). With no estimate (a cold start, a redraw of the
    probes, or a solve that missed the tolerance at the cap) q is a third of the cap."""
    if every is not None:
        return list(range(every, cap, every))
    q = max(1, cap // 3) if estimate is None or estimate >= cap else max(1, estimate)
    return sorted({q, min(q + max(2, math.ceil(q / 3)), (q + cap) // 2)} & set(range(1, cap)))


def solve_rate(points: list[tuple[int, float]]) -> float | None:
    """The convergence measure's factor per iteration between the solve's last two known points (its host reads
    and its end), if it fell between them."""
    if len(points) < 2:
        return None
    (i, r), (j, q) = points[-2], points[-1]
    if j <= i or not (0 < q < r):
        return None
    return (q / r) ** (1.0 / (j - i))


def _crossing(points: list[tuple[int, float]], tol: float, rate: float | None) -> float | None:
    """Where the convergence measure fell to ``tol``, from the solve's known points (iteration, measure): on the
    straight line through the log measures either side of the first point at or below ``tol`` (CG's residual
    falls about geometrically over a few iterations), or, when already the first point is there, back along
    ``rate`` from it. None: the solve missed, or there is nothing to place the crossing by."""
    for k, (j, q) in enumerate(points):
        if q <= tol:
            if k > 0:
                i, r = points[k - 1]
                return i + (j - i) * math.log(r / tol) / math.log(r / q) if q > 0 else i + 1.0
            if rate is not None and q > 0:
                return j - math.log(tol / q) / math.log(1.0 / rate)
            return None
    return None


def estimate_count(iterations: int, checks: list[int], tol: float, points, rate: float | None, ran_out: bool) -> int:
    """The next solve's expected count. For a warm-started solve (``rate`` given: the factor per iteration of its
    convergence measure, or of the last solve that showed one) it is where this solve's measure crossed ``tol``
    (:func:`_crossing`, from its host reads ``points`` and its end): a solve that ran to the cap but ended below
    ``tol`` met it somewhere between its last check and the cap, and one that met it at a check met it a little
    before. Taking the cap as the count instead put the next checks at a third of the cap, where such a solve
    again had not converged, so it ran to the cap step after step (protein on the H200: 35 iterations a step at a
    cap of 35, final residual 0.002 against the tolerance 0.01); taking one fewer after a met check let the count
    fall by one a step (protein: 35, 33, 32, ... 20 over the fit).

    A cold solve (the first step, or new probes; ``rate`` None) is no guide to the warm ones after it, which need
    far fewer iterations (800 points, no preconditioner: ~48 against ~20): converged at the first check, the next
    estimate is one fewer; at the second, just after the first; otherwise the count itself, so that the next
    checks go to a third of the cap. ``ran_out``: the solve ran to its cap (so the next count is below it)."""
    crossing = _crossing(points, tol, rate) if rate is not None else None
    if crossing is not None:
        return max(1, min(math.ceil(crossing - 1e-9), iterations - 1 if ran_out else iterations))
    if checks and iterations == checks[0]:
        return iterations - 1
    if len(checks) > 1 and iterations == checks[1]:
        return checks[0] + 1
    return iterations


#: After a missed check the engine reads next where the measure should cross the tolerance at the last solves'
#: rate, with this margin on the iterations still needed (and one more): reading too early costs the rest of the
#: solve up to the cap (no more reads are left), too late only the iterations past the crossing.
AFTER_MISS_MARGIN = 1.25


def read_after_miss(rate: float | None, tol: float, every: int | None = None):
    """For :func:`~gpfast.train.cg.pcg`: the iteration of the next read after a read found the measure at r > tol
    at iteration i, from the last warm solves' ``rate``. None (keep the fixed checks): no rate (a cold solve), or
    reads asked for every ``every`` iterations."""
    if every is not None or rate is None or not 0 < rate < 1:
        return None

    def next_read(i: int, r: float) -> int | None:
        if not math.isfinite(r):  # the step's one read names a non-finite gradient or measure; keep the checks
            return None
        return i + 1 + math.ceil(AFTER_MISS_MARGIN * math.log(r / tol) / math.log(1.0 / rate))

    return next_read
