"""The hyperparameters of :class:`gpfast.ExactGP`'s model as one float64 vector, the box the fit keeps them in, and
what a fitted vector says about the fit.

The vector is ``theta = [log lengthscale (k), log outputscale, log noise, constant mean]`` (k = d with ARD, else 1),
as scikit-learn optimises its kernels: in log space the marginal likelihood is far better conditioned than in
GPyTorch's softplus ``raw_`` parameters. Reading and writing go through the model's own constraints, so the model
(and its ``state_dict``, which :mod:`~gpfast.estimator.persistence` saves) is an ordinary GPyTorch model.

The bounds, in the units of the data being fitted (standardised ones by default), scaled by each column's spread
(its standard deviation; 1 for a constant column) and by the target's variance:

=========== ============================ =====================================================================
lengthscale ``[1e-2, 1e3] x column std``  below: a kernel that only sees each point itself; above: the feature
                                          no longer matters (a fit may end there: that switches a feature off)
outputscale ``[1e-4, 1e6] x var(y)``      at the lower bound the signal has collapsed: predictions are the mean
noise       ``[floor, 1e2] x var(y)``     the floor follows the path that takes the training steps (below)
=========== ============================ =====================================================================

The noise floor (:data:`NOISE_FLOORS`) is as low as the training path's arithmetic can factor or solve with, so that
data from a deterministic function (a simulator, a noise-free objective) can be fitted as nearly interpolated:

=================== =============== ======================================================================
training path       floor x var(y)  why
=================== =============== ======================================================================
``"cholesky"``      ``1e-8``        float64: the condition number is at most about n x outputscale /
                                    noise (3e10 for n = 300 at an outputscale of var(y)), inside float64's
                                    1 / unit roundoff (9e15). Where rounding still breaks a factorisation
                                    (outputscales far above var(y), duplicated inputs) it is retried with a
                                    growing jitter (:func:`gpfast.models.exact_posterior.robust_cholesky`),
                                    which then counts as noise
``"cg"``, float64   ``1e-6``        CG's iterations grow with the square root of the condition number: 100x
                                    below float32's floor costs at most about 10x its iterations (this
                                    arithmetic is the whole reason; no measurement picked the value)
``"cg"``, float32   ``1e-4``        GPyTorch's default: even there the condition number exceeds float32's
                                    1 / unit roundoff (1.7e7) from n of about 1,700 at an outputscale of
                                    var(y), which the preconditioner has to absorb
=================== =============== ======================================================================

scikit-learn's ``WhiteKernel`` stops at ``1e-5`` (in the units of ``normalize_y=True``). The floor is also the lower
bound of the ``GaussianLikelihood``'s noise constraint (:func:`noise_constraint`), so the fitted ``model_`` keeps it
when trained further with GPyTorch. A CG fit that ends at its floor is told (:func:`noise_floor_notes`) how to
go lower: ``dtype="float64"``, or ``solver="cholesky"`` where the n x n matrix fits.

The constant mean is unbounded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch
from gpytorch.constraints import GreaterThan

from gpfast.models import ExactGPModel

__all__ = [
    "DEFAULT_INIT",
    "DEFAULT_LENGTHSCALE_INIT",
    "LENGTHSCALE_BOUNDS",
    "NOISE_CEILING",
    "NOISE_FLOORS",
    "OUTPUTSCALE_BOUNDS",
    "HyperparameterSpace",
    "noise_constraint",
    "noise_floor",
    "noise_floor_notes",
    "repeated_rows",
]

#: Lengthscale bounds, relative to each input column's standard deviation. Noise-free data with a weakly relevant
#: feature would take the upper one further out (OTL circuit, 6-D, 50 and 200 points: 2.4 and 12.5 nats more at
#: 5e4-1e5 x std), but at 1e5 the fits of energy ended in lower optima (split 4: 1009 against 1050; split 0: 1007
#: against 1013), the switched-off feature's lengthscale wandering along a flat direction.
LENGTHSCALE_BOUNDS = (1e-2, 1e3)
#: Outputscale bounds, relative to the variance of the target. Noise-free smooth functions that are nearly
#: polynomial along some direction want long lengthscales with a large outputscale: the optima of Branin (100 points)
#: and Friedman's first function (300 points, 5-D) lie at 1.4e5 and 6.4e4, 3.9 and 28 nats above a bound of 1e4.
OUTPUTSCALE_BOUNDS = (1e-4, 1e6)
#: Noise floors relative to the variance of the target, by training path: ``"cholesky"`` (always float64), and
#: ``"cg"`` in each dtype (module docstring).
NOISE_FLOORS = {"cholesky": 1e-8, ("cg", torch.float64): 1e-6, ("cg", torch.float32): 1e-4}
#: Upper noise bound, relative to the variance of the target.
NOISE_CEILING = 1e2
#: Default starting lengthscale, relative to the spread of each feature: scikit-learn's RBF default of 1. From
#: GPyTorch's 0.693 the fit ended in a worse local optimum on housing (log marginal likelihood -156 and -155 on
#: splits 0 and 1, against -131 and -135 from 1 x std, scikit-learn's optimum), with the same optimum on yacht,
#: energy, concrete and autompg.
DEFAULT_LENGTHSCALE_INIT = 1.0
#: Default starting outputscale and noise, relative to the variance of y: GPyTorch's softplus(0) = log 2 (starting
#: from scikit-learn's 1 and 1 ended lower on energy split 0: 986 against 1013).
DEFAULT_INIT = math.log(2.0)
#: A log-hyperparameter within this distance of a bound counts as being at it.
AT_BOUND_LOG = 1e-3
# Keeps the noise strictly above the likelihood's GreaterThan bound, where softplus^-1(noise - bound) is finite.
_ABOVE_CONSTRAINT = 1e-6


def noise_floor(train_solver: str, dtype: torch.dtype) -> float:
    """The noise floor, relative to var(y), of training steps taken with ``train_solver`` (``"cholesky"``, always
    float64, or ``"cg"``) in ``dtype`` (:data:`NOISE_FLOORS`)."""
    if train_solver == "cholesky":
        return NOISE_FLOORS["cholesky"]
    key = ("cg", torch.float64 if dtype == torch.float64 else torch.float32)
    return NOISE_FLOORS[key]


def noise_constraint(train_solver: str, dtype: torch.dtype, y_var: float) -> GreaterThan:
    """The ``GaussianLikelihood`` noise constraint for training steps taken with ``train_solver`` in ``dtype`` on
    targets of variance ``y_var``: ``noise >= noise_floor(...) x y_var`` (GPyTorch's default, 1e-4, would keep
    the float64 Cholesky path at the float32 floor)."""
    y_var = y_var if y_var > 0 and math.isfinite(y_var) else 1.0
    return GreaterThan(noise_floor(train_solver, dtype) * y_var)


def repeated_rows(X: torch.Tensor, y: torch.Tensor) -> int:
    """The number of rows of the training data (X (n, d), y (n,) or (n, k)) that repeat another row exactly,
    targets included (n minus the number of distinct rows)."""
    rows = torch.cat([X.reshape(X.shape[0], -1), y.reshape(X.shape[0], -1).to(X.dtype)], dim=1)
    return int(rows.shape[0] - torch.unique(rows, dim=0).shape[0])


def noise_floor_notes(
    space: HyperparameterSpace,
    theta: np.ndarray,
    train_solver: str,
    dtype: torch.dtype,
    cholesky_fits: bool,
    X: torch.Tensor,
    y: torch.Tensor,
) -> list[str]:
    """Warnings for a fit on ``X`` (n, d), ``y`` (n,) or (n, k) whose noise ended at its floor (none when it did not).

    * Rows repeated exactly (inputs and target): each copy adds ``-log(noise) / 2`` to the log marginal likelihood,
      which then rises without bound as the noise falls; the fit ends at the floor whatever the noise of the data.
    * A floor above the float64 Cholesky one (CG training), naming the ways to a lower one: ``dtype="float64"``
      (CG in float32) and ``solver="cholesky"`` (when ``cholesky_fits``: the n x n float64 matrix fits).
    """
    if not space.at_lower(theta)[space.n_lengthscales + 1]:
        return []
    floor = space.noise_bounds[0]
    notes = []
    copies = repeated_rows(X, y)
    if copies:
        notes.append(
            f"ExactGP: {copies} of the {X.shape[0]} training rows repeat another row exactly (inputs and target), and "
            f"the noise ended at its floor ({floor:g} x var(y)): with exact copies the marginal likelihood rises "
            f"without bound as the noise falls, so the fit interpolates the data whatever their noise. Remove the "
            f"copies unless they are independent measurements."
        )
    if train_solver != "cholesky":
        remedies = []
        if dtype != torch.float64:
            remedies.append(f"dtype='float64' (CG floor {NOISE_FLOORS[('cg', torch.float64)]:g} x var(y))")
        if cholesky_fits:
            remedies.append(f"solver='cholesky' (float64 Cholesky floor {NOISE_FLOORS['cholesky']:g} x var(y))")
        advice = "; for a lower floor use " + " or ".join(remedies) if remedies else ""
        notes.append(
            f"ExactGP: the noise ended at the floor of CG training in {str(dtype).replace('torch.', '')} "
            f"({floor:g} x var(y)): the data look less noisy than this path resolves, and the fit may be short of "
            f"the marginal-likelihood optimum{advice}."
        )
    return notes


@dataclass(frozen=True)
class HyperparameterSpace:
    """The vector ``theta`` of a model with ``n_lengthscales`` lengthscales, and its bounds ``lower``, ``upper``
    (float64 numpy arrays of the vector's length; -inf / inf for the mean). ``log_spread`` (n_lengthscales,) and
    ``log_y_var`` are the log reference scales the bounds were made from."""

    n_lengthscales: int
    lower: np.ndarray
    upper: np.ndarray
    log_spread: np.ndarray
    log_y_var: float

    @classmethod
    def for_data(cls, model: ExactGPModel, x_spread: torch.Tensor, y_var: float) -> HyperparameterSpace:
        """The box of the module docstring for a model fitted on inputs whose columns have standard deviations
        ``x_spread`` (d,) and targets of variance ``y_var`` (constant columns: pass 1)."""
        k = model.covar_module.base_kernel.raw_lengthscale.shape[-1]
        spread = x_spread.detach().cpu().to(torch.float64).reshape(-1).numpy()
        if k != spread.size:  # one shared lengthscale (ard=False): the typical spread
            spread = np.array([float(np.exp(np.log(spread).mean()))])
        y_var = y_var if y_var > 0 and math.isfinite(y_var) else 1.0
        # the likelihood's constraint was built for the training path (noise_constraint): its bound is the floor
        floor = float(model.likelihood.noise_covar.raw_noise_constraint.lower_bound)
        noise_lo = max(floor, NOISE_FLOORS["cholesky"] * y_var) * (1 + _ABOVE_CONSTRAINT)
        lower = np.concatenate(
            [
                np.log(LENGTHSCALE_BOUNDS[0] * spread),
                [math.log(OUTPUTSCALE_BOUNDS[0] * y_var), math.log(noise_lo), -np.inf],
            ]
        )
        upper = np.concatenate(
            [
                np.log(LENGTHSCALE_BOUNDS[1] * spread),
                [
                    math.log(OUTPUTSCALE_BOUNDS[1] * y_var),
                    math.log(max(NOISE_CEILING * y_var, 10 * noise_lo)),
                    np.inf,
                ],
            ]
        )
        return cls(k, lower, upper, np.log(spread), math.log(y_var))

    @classmethod
    def unbounded(cls, model: ExactGPModel) -> HyperparameterSpace:
        """No bounds but the likelihood's own noise constraint."""
        k = model.covar_module.base_kernel.raw_lengthscale.shape[-1]
        floor = float(model.likelihood.noise_covar.raw_noise_constraint.lower_bound) * (1 + _ABOVE_CONSTRAINT)
        lower = np.full(k + 3, -np.inf)
        lower[k + 1] = math.log(floor) if floor > 0 else -np.inf
        return cls(k, lower, np.full(k + 3, np.inf), np.zeros(k), 0.0)

    @property
    def size(self) -> int:
        return self.n_lengthscales + 3

    def with_noise_floor(self, relative: float) -> HyperparameterSpace:
        """The same box with the noise's lower bound raised to at least ``relative`` x var(y)."""
        k = self.n_lengthscales + 1
        lower = self.lower.copy()
        lower[k] = max(lower[k], self.log_y_var + math.log(relative))
        return replace(self, lower=lower)

    @property
    def noise_bounds(self) -> tuple[float, float]:
        """The noise's (lower, upper) bounds relative to var(y), rounded to 3 digits for messages."""
        k = self.n_lengthscales + 1
        return tuple(float(f"{math.exp(v - self.log_y_var):.3g}") for v in (self.lower[k], self.upper[k]))

    # -- reading and writing the model ------------------------------------------------------------------------
    @staticmethod
    def _parts(model: ExactGPModel):
        """(raw parameter, constraint) of lengthscale, outputscale, noise, and the mean's parameter."""
        kern = model.covar_module
        base = kern.base_kernel
        lik = model.likelihood.noise_covar
        return (
            (base.raw_lengthscale, base.raw_lengthscale_constraint),
            (kern.raw_outputscale, kern.raw_outputscale_constraint),
            (lik.raw_noise, lik.raw_noise_constraint),
            (model.mean_module.raw_constant, None),
        )

    def get(self, model: ExactGPModel) -> np.ndarray:
        """theta of the model's current hyperparameters, float64."""
        out = []
        with torch.no_grad():
            for raw, con in self._parts(model):
                v = raw.detach().to(torch.float64)
                out.append(v.reshape(-1) if con is None else con.transform(v).log().reshape(-1))
        return torch.cat(out).cpu().numpy()

    def set(self, model: ExactGPModel, theta: np.ndarray) -> None:
        """Write theta into the model's raw parameters (in their dtype and device)."""
        theta = torch.as_tensor(np.asarray(theta, dtype=np.float64))
        k = self.n_lengthscales
        pieces = (theta[:k], theta[k : k + 1], theta[k + 1 : k + 2], theta[k + 2 :])
        with torch.no_grad():
            for (raw, con), piece in zip(self._parts(model), pieces):
                piece = piece.to(raw.device)  # the constraint's bounds live on the model's device
                v = piece if con is None else con.inverse_transform(piece.exp())
                raw.copy_(v.reshape(raw.shape).to(raw))

    def gradient(self, model: ExactGPModel) -> np.ndarray:
        """d loss / d theta from the ``.grad`` of the model's raw parameters (an objective has just set them):
        for ``value = transform(raw)`` and ``theta = log(value)``, ``d/dtheta = d/draw * value / transform'(raw)``."""
        out = []
        for raw, con in self._parts(model):
            g = raw.grad
            g = torch.zeros_like(raw, dtype=torch.float64) if g is None else g.detach().to(torch.float64)
            if con is not None:  # on the model's device, where the constraint's bounds live
                r = raw.detach().to(torch.float64).requires_grad_(True)
                with torch.enable_grad():
                    value = con.transform(r)
                    (slope,) = torch.autograd.grad(value.sum(), r)
                g = g * value.detach() / slope
            out.append(g.reshape(-1).cpu())
        return torch.cat(out).numpy()

    def initial(self, lengthscale=None, outputscale=None, noise=None) -> np.ndarray:
        """theta of the starting hyperparameters: the values given (tensors or floats in the fitted units), and for
        those not given :data:`DEFAULT_LENGTHSCALE_INIT` times each feature's spread and :data:`DEFAULT_INIT` times
        var(y) (outputscale, noise)."""
        k = self.n_lengthscales
        ls = (
            math.log(DEFAULT_LENGTHSCALE_INIT) + self.log_spread
            if lengthscale is None
            else np.log(np.broadcast_to(np.asarray(lengthscale, dtype=np.float64).reshape(-1), (k,)))
        )
        log_init = math.log(DEFAULT_INIT) + self.log_y_var
        os_ = log_init if outputscale is None else math.log(float(outputscale))
        noise_ = max(log_init, self.lower[k + 1]) if noise is None else math.log(float(noise))
        return np.concatenate([ls, [os_, noise_, 0.0]])

    def outside(self, theta: np.ndarray) -> list[str]:
        """Names of the hyperparameters of theta outside the box."""
        bad = (theta < self.lower) | (theta > self.upper)
        k = self.n_lengthscales
        names = [f"lengthscale[{i}]" for i in range(k)] + ["outputscale", "noise", "mean"]
        return [name for name, b in zip(names, bad) if b]

    def clip(self, theta: np.ndarray) -> np.ndarray:
        return np.clip(theta, self.lower, self.upper)

    # -- reading a fitted vector ------------------------------------------------------------------------------
    def at_lower(self, theta: np.ndarray) -> np.ndarray:
        return theta <= self.lower + AT_BOUND_LOG

    def at_upper(self, theta: np.ndarray) -> np.ndarray:
        return theta >= self.upper - AT_BOUND_LOG

    def diagnose(self, theta: np.ndarray) -> list[str]:
        """Sentences about a fitted theta that deserve a warning (empty when the fit looks sane).

        Flagged: a lengthscale at its lower bound, every lengthscale at its upper bound (no dependence on X is
        left), the outputscale at either bound (at the lower one the signal has collapsed), the noise at its upper
        bound. Not flagged: some lengthscales at the upper bound (those features are switched off, a legitimate
        outcome of ARD) and the noise at its floor (data that look noise-free at that resolution).
        """
        k = self.n_lengthscales
        lo, hi = self.at_lower(theta), self.at_upper(theta)
        ls = np.exp(theta[:k])
        out = []
        idx = np.nonzero(lo[:k])[0].tolist()
        if idx:
            out.append(
                f"the lengthscale(s) of feature(s) {idx} ended at the lower bound "
                f"({LENGTHSCALE_BOUNDS[0]:g} x the feature's std; fitted values {ls[idx].tolist()} in the "
                f"fitted units): the model interpolates every training point on its own"
            )
        if hi[:k].all():
            out.append(
                f"every lengthscale ended at the upper bound ({LENGTHSCALE_BOUNDS[1]:g} x the feature's "
                f"std): the fit found no dependence on X and predicts a constant"
            )
        if lo[k]:
            out.append(
                f"the outputscale collapsed to its lower bound ({OUTPUTSCALE_BOUNDS[0]:g} x var(y)): the "
                f"fit explains y as noise around a constant and predicts a constant"
            )
        if hi[k]:
            out.append(f"the outputscale ended at its upper bound ({OUTPUTSCALE_BOUNDS[1]:g} x var(y))")
        if hi[k + 1]:
            out.append(f"the noise ended at its upper bound ({NOISE_CEILING:g} x var(y))")
        return out

    def random(self, rng: np.random.Generator) -> np.ndarray:
        """A data-driven random starting point (for restarts): each lengthscale ``std x 10**U(-1, 1)``, the
        outputscale ``var(y) x 10**U(-1, 0.5)``, the noise ``var(y) x 10**U(-3, -0.3)``, the mean 0; clipped into
        the box."""
        k = self.n_lengthscales
        ln10 = math.log(10.0)
        theta = np.concatenate(
            [
                self.log_spread + rng.uniform(-1.0, 1.0, k) * ln10,
                [self.log_y_var + rng.uniform(-1.0, 0.5) * ln10, self.log_y_var + rng.uniform(-3.0, -0.3) * ln10, 0.0],
            ]
        )
        return self.clip(theta)


def theta_array(theta, shape: tuple[int, ...], hint: str) -> np.ndarray:
    """``theta`` (log hyperparameters, as ``ExactGP.log_marginal_likelihood`` takes them) as a float64 array of
    ``shape``, or a ValueError naming the value seen and the shape expected (``hint`` says what the entries are)."""
    what = "ExactGP.log_marginal_likelihood: theta"
    try:
        arr = np.asarray(theta, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} must be an array of shape {shape}, got {theta!r}") from exc
    if arr.shape != shape:
        raise ValueError(f"{what} has shape {arr.shape}; expected {shape}: {hint} (see theta_).")
    if not np.isfinite(arr).all():
        raise ValueError(f"{what} must be finite, got {arr.tolist()}")
    return arr
