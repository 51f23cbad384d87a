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
outputscale ``[1e-4, 1e4] x var(y)``      at the lower bound the signal has collapsed: predictions are the mean
noise       ``[1e-4, 1e2] x var(y)``      the floor is GPyTorch's ``GaussianLikelihood`` constraint (1e-4, in
                                          the model's units); it keeps float64 Cholesky factors well conditioned
=========== ============================ =====================================================================

The constant mean is unbounded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from gpfast.models import ExactGPModel

__all__ = [
    "DEFAULT_INIT",
    "DEFAULT_LENGTHSCALE_INIT",
    "LENGTHSCALE_BOUNDS",
    "NOISE_BOUNDS",
    "OUTPUTSCALE_BOUNDS",
    "HyperparameterSpace",
]

#: Lengthscale bounds, relative to each input column's standard deviation.
LENGTHSCALE_BOUNDS = (1e-2, 1e3)
#: Outputscale bounds, relative to the variance of the target.
OUTPUTSCALE_BOUNDS = (1e-4, 1e4)
#: Noise bounds, relative to the variance of the target; the lower one is also at least the likelihood's own
#: constraint (GaussianLikelihood: 1e-4).
NOISE_BOUNDS = (1e-4, 1e2)
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
        floor = float(model.likelihood.noise_covar.raw_noise_constraint.lower_bound) * (1 + _ABOVE_CONSTRAINT)
        noise_lo = max(NOISE_BOUNDS[0] * y_var, floor)
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
                    math.log(max(NOISE_BOUNDS[1] * y_var, 10 * noise_lo)),
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
            out.append(f"the noise ended at its upper bound ({NOISE_BOUNDS[1]:g} x var(y))")
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
