"""The training engine's settings: defaults (with the measurements behind them), checks, and the trainer rule.

:class:`gpfast.ExactGP` takes ``trainer`` (:data:`TRAINERS`) and ``trainer_options`` (a dict of
:class:`EngineSettings` fields); :func:`resolve` checks both before a fit changes anything.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields, replace

from gpfast.train.product import PRODUCTS

__all__ = ["TRAINERS", "EngineSettings", "fitted_attributes", "resolve", "train_solver"]

#: ``"auto"``: gpfast's engine whenever the training steps use CG, GPyTorch's exact loop when they use a dense
#: Cholesky. ``"gpfast"``: the engine for every training step (the steps are then CG steps even where the solver
#: rule would train with a Cholesky). ``"gpytorch"``: GPyTorch's loop (mBCG and Lanczos under CG), as before the
#: engine existed, for comparisons.
TRAINERS = ("auto", "gpfast", "gpytorch")


@dataclass(frozen=True)
class EngineSettings:
    """Settings of :class:`gpfast.train.Engine` (the keys of ``ExactGP(trainer_options=...)``).

    num_probes : int, default 10
        Hutchinson probe vectors (GPyTorch's ``num_trace_samples`` default). One solve of 1 + num_probes columns
        per step.
    cg_tolerance : float, default 0.01
        CG stops once every column's relative residual ``|b - K̂ x| / |b|`` is at most this.
    max_cg_iterations : int, default 15
        CG iteration cap per step (the truncated, warm-started regime: later steps start from the previous
        solutions, so the accuracy builds up over the steps).
    preconditioner_rank : int, default 50
        Rank k of the pivoted-Cholesky preconditioner (0: none, P = noise I).
    rebuild_every : int, default 10
        The preconditioner is rebuilt every this many steps ...
    rebuild_lengthscale_change : float, default 0.2
        ... or sooner, once some lengthscale has changed by more than this in log (about 22%) since the build.
        The outputscale and noise are tracked exactly by the Woodbury form and never force a rebuild. The probes
        do not depend on the preconditioner, so a rebuild costs no warm start.
    resample_every : int or None, default None
        The Rademacher probes are drawn anew every this many steps (their solves then start cold); None keeps one
        draw for the whole fit.
    warm_start : bool, default True
        Start each step's solves from the previous step's solutions (False: from zero, for comparisons).
    product : {"auto", "stored", "matrix_free"}, default "auto"
        Products with a stored K (rebuilt by the fused forward each step) or matrix-free; ``"auto"`` stores K
        when it takes at most ``memory_fraction`` of the device's free memory.
    memory_fraction : float, default 0.5
        Share of the free memory (at the start of the fit) that a stored K may take.
    """

    num_probes: int = 10
    cg_tolerance: float = 0.01
    max_cg_iterations: int = 15
    preconditioner_rank: int = 50
    rebuild_every: int = 10
    rebuild_lengthscale_change: float = 0.2
    resample_every: int | None = None
    warm_start: bool = True
    product: str = "auto"
    memory_fraction: float = 0.5

    @classmethod
    def from_options(cls, options: dict | None) -> EngineSettings:
        """Settings from a ``trainer_options`` dict (unknown keys and bad values raise ValueError)."""
        if options is None:
            return cls()
        if not isinstance(options, dict):
            raise ValueError(
                f"ExactGP: invalid trainer_options={options!r}; expected None or a dict with keys "
                f"{[f.name for f in fields(cls)]}."
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"ExactGP: unknown trainer_options key(s) {unknown}; known keys: {sorted(known)}.")
        settings = replace(cls(), **options)
        settings.check()
        return settings

    def check(self) -> None:
        def bad(name, expected):
            return ValueError(
                f"ExactGP: invalid trainer_options['{name}']={getattr(self, name)!r}; expected {expected}."
            )

        def is_int(v):
            return isinstance(v, numbers.Integral) and not isinstance(v, bool)

        def is_real(v):
            return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(float(v))

        for name, low in (
            ("num_probes", 1),
            ("max_cg_iterations", 1),
            ("preconditioner_rank", 0),
            ("rebuild_every", 1),
        ):
            if not is_int(getattr(self, name)) or getattr(self, name) < low:
                raise bad(name, f"an int >= {low}")
        if not is_real(self.cg_tolerance) or self.cg_tolerance <= 0:
            raise bad("cg_tolerance", "a positive float")
        if not is_real(self.rebuild_lengthscale_change) or self.rebuild_lengthscale_change <= 0:
            raise bad("rebuild_lengthscale_change", "a positive float")
        if self.resample_every is not None and (not is_int(self.resample_every) or self.resample_every < 1):
            raise bad("resample_every", "None or an int >= 1")
        if self.warm_start not in (True, False):
            raise bad("warm_start", "True or False")
        if self.product not in PRODUCTS:
            raise bad("product", f"one of {PRODUCTS}")
        if not is_real(self.memory_fraction) or not 0 < self.memory_fraction <= 1:
            raise bad("memory_fraction", "a float in (0, 1]")


def resolve(trainer, options, solver: str) -> tuple[str, EngineSettings]:
    """Check ``trainer`` and ``trainer_options`` of an ExactGP whose ``solver`` parameter is ``solver``."""
    if not isinstance(trainer, str) or trainer not in TRAINERS:
        raise ValueError(f"ExactGP: invalid trainer={trainer!r}; expected one of {TRAINERS}.")
    if trainer == "gpfast" and solver == "cholesky":
        raise ValueError(
            "ExactGP: trainer='gpfast' takes CG training steps; got solver='cholesky' (use solver='auto' "
            "or 'cg', or trainer='auto')."
        )
    return trainer, EngineSettings.from_options(options)


def train_solver(trainer: str, rule_train_solver: str) -> tuple[str, str]:
    """``(train_solver, trainer_used)``: how the training steps are taken, given the solver rule's choice."""
    if trainer == "gpytorch":
        return rule_train_solver, "gpytorch"
    if trainer == "gpfast" or rule_train_solver == "cg":
        return "cg", "gpfast"
    return rule_train_solver, "gpytorch"


def fitted_attributes(record) -> dict:
    """The estimator's fitted attributes from an engine run's :class:`~gpfast.train.EngineRecord` (None: the
    engine did not train)."""
    if record is None:
        return dict(
            cg_iterations_=None,
            cg_residuals_=None,
            history_data_fit_=None,
            history_log_det_estimate_=None,
            step_seconds_=None,
        )
    return dict(
        cg_iterations_=list(record.cg_iterations),
        cg_residuals_=list(record.cg_residuals),
        history_data_fit_=list(record.data_fit),
        history_log_det_estimate_=list(record.log_det_estimate),
        step_seconds_=list(record.step_seconds),
    )
