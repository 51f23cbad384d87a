"""How a fit of :class:`gpfast.ExactGP` runs: the one rule that decides it (:func:`plan_fit`), the solver rule
under it (:func:`choose_solver`), and the memory probe they rest on.

The solver, which makes the predictions and the reported log marginal likelihood:

* ``"cholesky"``: an exact float64 Cholesky factorisation of the n x n training covariance
  (:class:`gpfast.models.ExactPosterior`); training steps with the exact float64 objective
  (:mod:`gpfast.estimator.exact_objective`), under L-BFGS by default.
* ``"cg"``: matrix-free training and prediction with conjugate gradients (memory O(n) with gpfast's kernel);
  training steps by gpfast's engine (:mod:`gpfast.train`) under Adam, by GPyTorch's loop under L-BFGS.
* ``"auto"``: ``"cholesky"`` when :data:`CHOLESKY_WORKSPACE_FACTOR` float64 n x n matrices fit in the free memory
  of the device and ``n <= AUTO_CHOLESKY_MAX_N[device type]``, else ``"cg"``. The training steps use the dense
  Cholesky only up to ``AUTO_TRAIN_CHOLESKY_MAX_N[device type]`` and CG above it (faster per step); prediction
  and the reported log marginal likelihood stay exact (float64 Cholesky) whenever the first rule allows it.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, replace

import torch

from gpfast.estimator.outputs import check_distributed, check_trainer
from gpfast.kernels import distributed as _dist
from gpfast.train.product import choose_product
from gpfast.train.settings import CGSettings

__all__ = [
    "AUTO_CHOLESKY_MAX_N",
    "AUTO_TRAIN_CHOLESKY_MAX_N",
    "CHOLESKY_WORKSPACE_FACTOR",
    "FitPlan",
    "RunPlan",
    "SolverChoice",
    "choose_solver",
    "free_memory_bytes",
    "plan_fit",
]

#: With ``solver="auto"``, the largest n for which the Cholesky solver is chosen (on top of the memory rule).
AUTO_CHOLESKY_MAX_N: dict[str, int] = {"cuda": 100_000, "cpu": 10_000}
#: With ``solver="auto"``, training steps use the dense Cholesky only up to this n, and CG above it: on an H200
#: CG steps on the fused kernel were ~5x faster at n = 13.5k-15.6k (pol, elevators, bike, 2026-11-29: 13.8 s vs
#: 2.6 s for 50 steps on pol), while prediction still uses the exact float64 Cholesky. On the 2-core CPU box
#: (2026-11-30, ``experiments/step_cost.py``, d=8): an exact float64 step (Cholesky + its inverse, n^3 flops) cost
#: 1.55 s at n=3000 against 0.58 s for a CG step on gpfast's kernel and 0.71 s for GPyTorch's own loop; whole
#: default fits took 35 s (exact, L-BFGS) against 14 s (CG, Adam) at n=2000, while at n=1353 (airfoil) the exact
#: fit was the faster one (18 s against 26 s, and a higher likelihood: -275 against -340). 1500 lies between.
AUTO_TRAIN_CHOLESKY_MAX_N: dict[str, int] = {"cuda": 4_096, "cpu": 1_500}
#: The Cholesky solver needs about this many float64 n x n matrices of free memory (matrix, factor, workspace).
CHOLESKY_WORKSPACE_FACTOR = 3


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3g} GB"


@dataclass(frozen=True)
class SolverChoice:
    """The outcome of :func:`choose_solver`."""

    solver: str  # how predictions are made: "cholesky" or "cg"
    train_solver: str  # how training steps are taken: "cholesky" or "cg"
    exact_feasible: bool  # an exact float64 Cholesky of the n x n covariance is allowed (memory and cap)
    reason: str  # one line for the log


def choose_solver(
    n: int, device: torch.device, free_memory: int, requested: str = "auto", distributed: bool = False
) -> SolverChoice:
    """The solver rule of the module docstring.

    Parameters
    ----------
    n : int
        Training points.
    device : torch.device
    free_memory : int
        Bytes free on ``device``.
    requested : {"auto", "cholesky", "cg"}, default="auto"
    distributed : bool, default=False
        Forces CG.

    Returns
    -------
    SolverChoice

    Raises
    ------
    ValueError
        When ``"cholesky"`` is requested and does not fit in memory.
    """
    device = torch.device(device)
    matrix = 8 * n * n
    need = CHOLESKY_WORKSPACE_FACTOR * matrix
    fits = need <= free_memory
    cap = AUTO_CHOLESKY_MAX_N.get(device.type, AUTO_CHOLESKY_MAX_N["cpu"])
    train_cap = AUTO_TRAIN_CHOLESKY_MAX_N.get(device.type, AUTO_TRAIN_CHOLESKY_MAX_N["cpu"])
    exact = fits and n <= cap
    if requested == "cholesky":
        if not fits:
            raise ValueError(
                f"ExactGP: n={n} is too large for solver='cholesky' on {device}: a float64 n x n matrix needs "
                f"{_gb(matrix)} (about {_gb(need)} with the factor and workspace) but only {_gb(free_memory)} is "
                f"free. Use solver='cg' (matrix-free, O(n) memory) or solver='auto'."
            )
        return SolverChoice("cholesky", "cholesky", True, f"requested; {_gb(need)} needed, {_gb(free_memory)} free")
    if requested == "cg" or distributed:
        why = "requested" if requested == "cg" else "distributed over the ranks of torch.distributed"
        return SolverChoice("cg", "cg", exact, why)
    solver = "cholesky" if exact else "cg"
    train_solver = "cholesky" if (exact and n <= train_cap) else "cg"
    why = (
        f"auto: n={n} {'<=' if n <= cap else '>'} {cap}, {CHOLESKY_WORKSPACE_FACTOR} float64 n x n matrices "
        f"need {_gb(need)}, {_gb(free_memory)} free on {device}"
    )
    return SolverChoice(solver, train_solver, exact, why)


@dataclass(frozen=True)
class RunPlan:
    """How the steps of one optimiser run are taken (the full data, or the pretraining subset).

    Attributes
    ----------
    n : int
        Training points of the run.
    train_solver : {"cholesky", "cg"}
        How the steps solve.
    trainer : {"gpfast", "exact", "gpytorch"}
        Who computes the loss and its gradient: gpfast's engine, the exact float64 Cholesky objective, or
        GPyTorch's marginal likelihood.
    cg : CGSettings
        The settings the engine runs with; with ``trainer == "gpfast"`` its ``product`` is decided
        (``"stored"`` or ``"matrix_free"``).
    """

    n: int
    train_solver: str
    trainer: str
    cg: CGSettings

    @property
    def product(self) -> str | None:
        """``"stored"`` or ``"matrix_free"`` when the engine trains, else None."""
        return self.cg.product if self.trainer == "gpfast" else None


@dataclass(frozen=True)
class FitPlan:
    """Everything :func:`plan_fit` decides about a fit.

    Attributes
    ----------
    solver : {"cholesky", "cg"}
        How predictions and the log marginal likelihood are computed.
    exact_feasible : bool
        An exact float64 Cholesky of the n x n covariance is allowed (memory and cap), whatever the solver.
    optimizer : {"lbfgs", "adam"}
        The optimiser of every run.
    dtype : torch.dtype
        Of the fitted model: CG training and prediction.
    train_dtype : torch.dtype
        Of the model while it trains: float64 when the full data trains with the exact objective, whose line
        searches need the loss to that precision; else ``dtype``.
    full : RunPlan
        The steps on all the data.
    pretrain : RunPlan or None
        The steps on the pretraining subset, if any.
    reason : str
        One line for the log.
    """

    solver: str
    exact_feasible: bool
    optimizer: str
    dtype: torch.dtype
    train_dtype: torch.dtype
    full: RunPlan
    pretrain: RunPlan | None
    reason: str

    def describe(self) -> str:
        """One line for the log: the solver and why, and what trains in which dtype."""
        return (
            f"solver={self.solver} ({self.reason}), training with {self.optimizer} on {self.full.train_solver} "
            f"({self.full.trainer}) in {str(self.train_dtype).replace('torch.', '')}, "
            f"model dtype={str(self.dtype).replace('torch.', '')}"
        )


def plan_fit(
    n: int,
    pretrain_n: int | None,
    device: torch.device,
    free_memory: int,
    dtype: torch.dtype,
    solver: str = "auto",
    optimizer: str = "auto",
    cg: CGSettings | None = None,
    distributed: bool = False,
    n_outputs: int = 1,
) -> FitPlan:
    """Decide how a fit runs: solver, optimiser, dtype, and who takes the steps on what products.

    The training steps solve as the solver rule says (:func:`choose_solver`), or by CG wherever
    ``cg.trainer == "gpfast"``. ``optimizer="auto"`` is L-BFGS when the full data train with a Cholesky (a
    deterministic loss for its line searches) and Adam with CG (a stochastic estimate). The CG steps go to gpfast's
    engine under Adam and to GPyTorch's loop under L-BFGS: a line search compares losses at nearby points, and the
    engine's, from warm-started truncated solves and a carried log-determinant estimate, depend on the path as well
    as the point (on yacht, L-BFGS on the engine's loss went uphill; on GPyTorch's it converges). The optimiser and
    dtype of the full data serve the pretraining subset too.

    Parameters
    ----------
    n : int
        Training points.
    pretrain_n : int or None
        Points of the pretraining subset (None: no pretraining).
    device : torch.device
    free_memory : int
        Bytes free on ``device`` at the start of the fit.
    dtype : torch.dtype
        The precision asked for (CG training and prediction).
    solver : {"auto", "cholesky", "cg"}, default="auto"
    optimizer : {"auto", "lbfgs", "adam"}, default="auto"
    cg : CGSettings or None, default=None
        None: the defaults.
    distributed : bool, default=False
        The products are split over the ranks of ``torch.distributed`` (forces CG).
    n_outputs : int, default=1
        Columns of y, fitted by the same rule (:mod:`~gpfast.estimator.outputs`); ValueError where several would
        be trained by GPyTorch's CG loop or split over distributed ranks.

    Returns
    -------
    FitPlan

    Raises
    ------
    ValueError
        When ``solver="cholesky"`` does not fit in memory.
    """
    cg = cg or CGSettings()
    check_distributed(n_outputs, distributed)
    choice = choose_solver(n, device, free_memory, solver, distributed)
    train_solver = "cg" if cg.trainer == "gpfast" else choice.train_solver
    if optimizer == "auto":
        optimizer = "lbfgs" if train_solver == "cholesky" else "adam"
    train_dtype = torch.float64 if train_solver == "cholesky" else dtype

    def run(m: int, rule_train_solver: str) -> RunPlan:
        steps = "cg" if cg.trainer == "gpfast" else rule_train_solver
        if steps == "cholesky":
            return RunPlan(m, "cholesky", "exact", cg)
        if cg.trainer == "gpytorch" or (cg.trainer == "auto" and optimizer == "lbfgs"):
            return RunPlan(m, "cg", "gpytorch", cg)
        r0, r1 = _dist.row_range(m) if distributed and _dist.is_active() else (0, m)
        product, _ = choose_product(r1 - r0, m, train_dtype, free_memory, cg.product, cg.memory_fraction)
        return RunPlan(m, "cg", "gpfast", replace(cg, product=product))

    full = run(n, choice.train_solver)
    check_trainer(full.trainer, n_outputs, optimizer)
    pretrain = None
    if pretrain_n is not None:
        pretrain = run(pretrain_n, choose_solver(pretrain_n, device, free_memory, solver, distributed).train_solver)
        check_trainer(pretrain.trainer, n_outputs, optimizer)
    return FitPlan(choice.solver, choice.exact_feasible, optimizer, dtype, train_dtype, full, pretrain, choice.reason)


def pretrain_points(pretrain, pretrain_n: int | None, n: int) -> int | None:
    """The pretraining subset's size for ``n`` training points: None (with a warning for the caller of
    ``ExactGP.fit``) when ``pretrain`` asks for at least n."""
    if pretrain_n is not None and pretrain_n >= n:
        warnings.warn(
            f"pretrain={pretrain!r}: its {pretrain_n} points >= n_samples={n}: skipping the subset pretraining.",
            UserWarning,
            stacklevel=5,
        )
        return None
    return pretrain_n


def free_memory_bytes(device: torch.device) -> int:
    """Free memory on a device.

    Parameters
    ----------
    device : torch.device

    Returns
    -------
    int
        Bytes. CUDA: ``torch.cuda.mem_get_info`` plus memory the caching allocator holds but does not use. CPU:
        ``/proc/meminfo`` ``MemAvailable``, capped by a cgroup limit, falling back to ``os.sysconf``.
    """
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        reusable = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + max(reusable, 0))
    candidates = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    candidates.append(int(line.split()[1]) * 1024)
                    break
    except OSError:
        pass
    try:  # cgroup v2, then v1
        for limit_file, usage_file in (
            ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
            ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
        ):
            if os.path.exists(limit_file) and os.path.exists(usage_file):
                with open(limit_file) as f:
                    limit = f.read().strip()
                with open(usage_file) as f:
                    usage = int(f.read().strip())
                if limit.isdigit() and int(limit) < 2**60:
                    candidates.append(max(int(limit) - usage, 0))
                break
    except (OSError, ValueError):
        pass
    if not candidates:
        try:
            candidates.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):  # pragma: no cover
            candidates.append(8 * 2**30)
    return int(min(candidates))
