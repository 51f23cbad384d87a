"""The two optimisers of :class:`gpfast.ExactGP`'s hyperparameters and when each says it has converged.

Both minimise a loss ``fun(theta) -> (loss, gradient)`` (the negative log marginal likelihood per data point) over
the log-space vector of :class:`~gpfast.estimator.hyperparameters.HyperparameterSpace`, inside its bounds.

* :func:`minimize_lbfgs`: scipy's L-BFGS-B (a strong-Wolfe line search, Moré-Thuente's ``dcsrch``, and exact box
  constraints), what scikit-learn's ``GaussianProcessRegressor`` runs. It needs a deterministic loss and gradient:
  the exact float64 Cholesky objective. It minimises the *total* loss (n times the per-point one) with
  scikit-learn's tolerances, so both stop at the same place: converged when the relative decrease of the loss in
  a step is below ``ftol`` (2.2e-9 by default, scipy's) or the largest projected gradient entry is below
  :data:`LBFGS_GTOL`. A stop where the line search finds no decrease counts as converged when
  :func:`descent_left` bounds what the steepest-descent line still offers by :data:`LBFGS_FLAT_NATS`.
* :func:`minimize_adam`: Adam with a projection onto the box after each step, for a stochastic loss (the CG
  estimate). Converged when the mean loss over the last :data:`ADAM_WINDOW` steps differs from the mean over the
  window before by less than ``tol`` (:data:`ADAM_TOL` by default) relative to ``max(|mean|, 1)``, or by less
  than :data:`NOISE_SE` standard errors of that difference (estimated from the spread within the two windows: a
  stochastic loss cannot show smaller progress), or the gradient's largest entry is below :data:`ADAM_GTOL`. It
  raises :class:`TrainingDivergedError` when the windowed loss rises more than ``max(|initial loss|, 1)`` above
  the initial loss (a learning rate too large).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from gpfast.estimator.hyperparameters import HyperparameterSpace
from gpfast.train.state import ADAM_BETA2

__all__ = [
    "ADAM_GTOL",
    "Adam",
    "ADAM_TOL",
    "ADAM_WINDOW",
    "LBFGS_FLAT_NATS",
    "LBFGS_FTOL",
    "LBFGS_GTOL",
    "NOISE_SE",
    "OptimizeResult",
    "TrainingDivergedError",
    "minimize_adam",
    "minimize_lbfgs",
]

#: L-BFGS-B's relative-decrease tolerance (scipy's and scikit-learn's default, ``factr = 1e7``).
LBFGS_FTOL = 1e7 * np.finfo(float).eps
#: L-BFGS-B's projected-gradient tolerance on the total loss (scipy's default).
LBFGS_GTOL = 1e-5
#: An L-BFGS-B line search that finds no decrease ("ABNORMAL") counts as converged when the total loss can fall by
#: at most this many nats along the steepest-descent line from the stop (bounded by :func:`descent_left`): the
#: log marginal likelihood is then as high as its rounding lets any step tell. It happens near the noise floor of
#: noise-free data, where the loss's rounding error (condition numbers of 1e10 and more) exceeds the decrease a step
#: can make; float32 noise-free Branin stopped with a projected gradient of 1.06 nats and ~1e-3 nats left on its
#: line, the loss there known to only ~0.04 nats. The gradient alone does not tell: the curvature along the line was
#: ~4000, so a gradient of 1 left ~1e-4 nats.
LBFGS_FLAT_NATS = 0.01
#: descent_left's first step and growth factor along the line (log-hyperparameter units): ~11 gradient evaluations
#: reach a step of 1, beyond which a step is no longer local.
_PROBE_FIRST, _PROBE_GROWTH, _PROBE_LAST = 1e-6, 4.0, 1.0
#: Adam: steps per window of the convergence test.
ADAM_WINDOW = 10
#: Adam: relative change of the windowed mean loss that counts as converged.
ADAM_TOL = 1e-4
#: Adam: the windowed change also counts as converged when below this many standard errors of itself (a stochastic
#: loss, whose noise hides any smaller progress).
NOISE_SE = 2.0
#: Adam: gradient (of the per-point loss) small enough to stop on, for a deterministic loss.
ADAM_GTOL = 1e-6

#: fun(theta) -> (loss per data point, d loss / d theta), float64.
LossFunction = Callable[[np.ndarray], tuple[float, np.ndarray]]


class TrainingDivergedError(FloatingPointError):
    """The training loss blew up (a learning rate too large for the problem)."""


@dataclass
class OptimizeResult:
    """Where an optimiser stopped: ``theta`` and its ``loss`` (per data point), the loss at each step
    (``history``), the number of steps, whether the stopping rule was met, and scipy's or our reason."""

    theta: np.ndarray
    loss: float
    history: list[float] = field(default_factory=list)
    n_iter: int = 0
    converged: bool = False
    message: str = ""


def _checked(fun: LossFunction, step_of: Callable[[], int], what: str) -> LossFunction:
    def checked(theta):
        loss, grad = fun(theta)
        if not (math.isfinite(loss) and np.isfinite(grad).all()):
            raise FloatingPointError(
                f"ExactGP: the training loss or its gradient became {loss} at step {step_of()} ({what}) with log "
                f"hyperparameters {np.round(theta, 3).tolist()}; try dtype='float64', solver='cholesky' or a "
                f"smaller lr. The estimator was not modified."
            )
        return loss, grad

    return checked


def minimize_lbfgs(
    fun: LossFunction,
    theta0: np.ndarray,
    space: HyperparameterSpace,
    n: int,
    max_iter: int,
    tol: float | None = None,
    what: str = "L-BFGS-B",
    on_step: Callable[[float], None] | None = None,
) -> OptimizeResult:
    """L-BFGS-B from ``theta0`` for at most ``max_iter`` iterations, on ``n`` times the per-point loss."""
    from scipy.optimize import minimize

    history: list[float] = []
    seen: dict[bytes, float] = {}
    checked = _checked(fun, lambda: len(history), what)

    def total(theta):
        loss, grad = checked(theta)
        seen[theta.tobytes()] = loss
        return n * loss, n * grad

    def callback(xk):
        history.append(seen.get(np.asarray(xk, dtype=np.float64).tobytes(), math.nan))
        if on_step is not None:
            on_step(history[-1])

    theta0 = space.clip(np.asarray(theta0, dtype=np.float64))
    if max_iter <= 0:
        loss, _ = checked(theta0)
        return OptimizeResult(theta0, loss, [], 0, False, "max_iter=0")
    bounds = [
        (None if not np.isfinite(lo) else lo, None if not np.isfinite(hi) else hi)
        for lo, hi in zip(space.lower, space.upper)
    ]
    res = minimize(
        total,
        theta0,
        jac=True,
        method="L-BFGS-B",
        bounds=bounds,
        callback=callback,
        options={
            "maxiter": int(max_iter),
            "ftol": LBFGS_FTOL if tol is None else float(tol),
            "gtol": LBFGS_GTOL,
            "maxfun": max(15000, 4 * int(max_iter)),
        },
    )
    theta = np.asarray(res.x, dtype=np.float64)
    loss = seen.get(theta.tobytes())
    if loss is None:
        loss, _ = checked(theta)
    message = res.message if isinstance(res.message, str) else res.message.decode()
    converged = res.status == 0
    if res.status == 2 and getattr(res, "jac", None) is not None:  # the line search found no decrease
        grad = np.asarray(res.jac, dtype=np.float64)[None]
        left = float(descent_left(lambda _, thetas: total(thetas[0])[1][None], theta[None], grad, space)[0])
        converged, message = left <= LBFGS_FLAT_NATS, abnormal_message(left)
    return OptimizeResult(theta, float(loss), history, int(res.nit), converged, message)


def abnormal_message(left: float) -> str:
    """The reason given for a stop where the line search found no decrease, with ``left`` from
    :func:`descent_left`."""
    if left <= LBFGS_FLAT_NATS:
        return (
            f"the line search found no decrease where the loss is flat to its rounding error (at most {left:.2g} "
            f"nats left along steepest descent <= {LBFGS_FLAT_NATS:g})"
        )
    bound = "no bound" if not math.isfinite(left) else f"a bound of {left:.2g}"
    return (
        f"ABNORMAL: the line search found no decrease, yet the steepest-descent line may offer more than "
        f"{LBFGS_FLAT_NATS:g} nats ({bound})"
    )


def descent_left(
    grad_at: Callable[[np.ndarray, np.ndarray], np.ndarray], theta: np.ndarray, grad: np.ndarray, space
) -> np.ndarray:
    """Upper bounds on how far each row's total loss can fall along its steepest-descent line inside the box.

    ``theta`` and ``grad`` are (r, p): the points and their total gradients; ``grad_at(rows, thetas)`` returns the
    total gradients (len(rows), p) at ``thetas`` for the row indices ``rows``. Along the unit direction ``d`` of
    the projected gradient it steps out geometrically and reads the slope ``g . d``: once the slope turns
    non-negative the line's minimum lies behind, and the fall to it is at most the sum over the intervals of the
    steeper end's slope times the interval's length (exact for a slope monotone on each interval; the gradient,
    unlike the loss, keeps its accuracy near a noise floor). A row whose slope stays negative up to a step of 1,
    or whose line meets the box first, gets inf: nothing is known to be flat.
    """
    theta, grad = np.atleast_2d(theta), np.atleast_2d(grad)
    g = np.stack([_projected(gr, th, space) for gr, th in zip(grad, theta)])
    norm = np.linalg.norm(g, axis=1)
    left = np.where(norm > 0, np.inf, 0.0)
    active = np.flatnonzero(norm > 0)
    d = -g / np.where(norm > 0, norm, 1.0)[:, None]
    fall, steep, prev = np.zeros(len(theta)), norm.copy(), np.zeros(len(theta))
    count = int(np.ceil(np.log(_PROBE_LAST / _PROBE_FIRST) / np.log(_PROBE_GROWTH)))
    for step in np.minimum(_PROBE_FIRST * _PROBE_GROWTH ** np.arange(count + 1), _PROBE_LAST):
        if not active.size:
            break
        trial = theta[active] + step * d[active]
        inside = ((trial >= space.lower) & (trial <= space.upper)).all(1)
        active = active[inside]
        if not active.size:
            break
        slope = np.einsum("rp,rp->r", np.asarray(grad_at(active, trial[inside]), dtype=np.float64), d[active])
        fall[active] += np.maximum(steep[active], np.maximum(-slope, 0.0)) * (step - prev[active])
        steep[active], prev[active] = np.maximum(-slope, 0.0), step
        done = slope >= 0
        left[active[done]] = fall[active[done]]
        active = active[~done]
    return left


def _projected(grad: np.ndarray, theta: np.ndarray, space: HyperparameterSpace) -> np.ndarray:
    """The gradient without its entries that point out of the box at a bound (L-BFGS-B's projected gradient)."""
    blocked = ((theta <= space.lower) & (grad > 0)) | ((theta >= space.upper) & (grad < 0))
    return np.where(blocked, 0.0, grad)


def minimize_adam(
    fun: LossFunction,
    theta0: np.ndarray,
    space: HyperparameterSpace,
    max_iter: int,
    lr: float,
    tol: float | None = None,
    what: str = "Adam",
    on_step: Callable[[float], None] | None = None,
) -> OptimizeResult:
    """Projected Adam from ``theta0`` for at most ``max_iter`` steps; ``tol=0`` runs them all."""
    tol = ADAM_TOL if tol is None else float(tol)
    theta = space.clip(np.asarray(theta0, dtype=np.float64))
    opt = Adam(theta.size, float(lr))
    history: list[float] = []
    checked = _checked(fun, lambda: len(history), what)
    converged, message = False, f"reached max_iter={max_iter}"
    W = ADAM_WINDOW
    for _ in range(max_iter):
        loss, grad = checked(theta)
        history.append(loss)
        if on_step is not None:
            on_step(loss)
        if len(history) >= W:
            recent = float(np.mean(history[-W:]))
            if recent > history[0] + max(abs(history[0]), 1.0):
                raise TrainingDivergedError(
                    f"ExactGP: the training loss blew up ({what}, lr={lr:g}): from {history[0]:.4g} at the start to "
                    f"a mean of {recent:.4g} over steps {len(history) - W}-{len(history) - 1}. Use a smaller lr "
                    f"(or the default optimizer). The estimator was not modified."
                )
            if tol > 0 and len(history) >= 2 * W:
                before = float(np.mean(history[-2 * W : -W]))
                change = abs(recent - before)
                # the standard error of that difference when the loss is a noisy estimate (CG); a loss still
                # falling steadily has a change several times this, so it does not stop early
                noise = NOISE_SE * math.sqrt((np.var(history[-W:]) + np.var(history[-2 * W : -W])) / (W - 1))
                if change < tol * max(abs(recent), 1.0):
                    converged, message = True, f"windowed relative change below tol={tol:g}"
                elif change < noise:
                    converged, message = True, f"windowed change within the loss's noise ({noise:.2g})"
        if float(np.max(np.abs(grad))) < ADAM_GTOL and tol > 0:
            converged, message = True, f"gradient below {ADAM_GTOL:g}"
        if converged:
            break
        theta = space.clip(opt.step(theta, np.asarray(grad, dtype=np.float64)))
    final = history[-1] if converged else checked(theta)[0]  # after max_iter steps: the loss where it stopped
    return OptimizeResult(theta.copy(), float(final), history, len(history), converged, message)


class Adam:
    """Adam (Kingma and Ba, 2015) on a float64 vector, with torch.optim.Adam's defaults (betas 0.9 and 0.999, eps
    1e-8 added to the root of the bias-corrected second moment) and formula.

    Written out in numpy because the vector is a few dozen numbers on the host: torch.optim.Adam costs several
    torch calls a step, and its first construction in a process imports torch._dynamo (about 1 s on a 2-core CPU,
    inside the first fit's training time).
    """

    def __init__(self, size: int, lr: float, betas: tuple[float, float] = (0.9, ADAM_BETA2), eps: float = 1e-8):
        self.lr, self.betas, self.eps = lr, betas, eps
        self.m, self.v, self.steps = np.zeros(size), np.zeros(size), 0

    def step(self, theta: np.ndarray, grad: np.ndarray) -> np.ndarray:
        """theta after one step along ``grad``, as a new array."""
        b1, b2 = self.betas
        self.steps += 1
        self.m = self.m + (1.0 - b1) * (grad - self.m)
        self.v = b2 * self.v + (1.0 - b2) * grad * grad
        denom = np.sqrt(self.v) / math.sqrt(1.0 - b2**self.steps) + self.eps
        return theta - self.lr / (1.0 - b1**self.steps) * self.m / denom
