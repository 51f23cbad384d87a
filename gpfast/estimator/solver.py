"""How :class:`gpfast.ExactGP` solves with the training covariance: the one rule for choosing, and the memory
probe it rests on.

* ``"cholesky"``: training with GPyTorch's exact marginal likelihood through a dense Cholesky factorisation, and
  prediction with an exact float64 Cholesky factorisation of the n x n training covariance
  (:class:`gpfast.models.ExactPosterior`).
* ``"cg"``: matrix-free training and prediction with conjugate gradients (memory O(n) with gpfast's kernel).
* ``"auto"``: ``"cholesky"`` when :data:`CHOLESKY_WORKSPACE_FACTOR` float64 n x n matrices fit in the free memory
  of the device and ``n <= AUTO_CHOLESKY_MAX_N[device type]``, else ``"cg"``. The training steps use the dense
  Cholesky only up to ``AUTO_TRAIN_CHOLESKY_MAX_N[device type]`` and CG above it (faster per step); prediction
  and the reported log marginal likelihood stay exact (float64 Cholesky) whenever the first rule allows it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = [
    "AUTO_CHOLESKY_MAX_N",
    "AUTO_TRAIN_CHOLESKY_MAX_N",
    "CHOLESKY_WORKSPACE_FACTOR",
    "SolverChoice",
    "choose_solver",
    "free_memory_bytes",
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
    """The solver rule (module docstring) for n training points on ``device`` with ``free_memory`` bytes free.

    ``requested`` is ``"auto"``, ``"cholesky"`` or ``"cg"``; ``distributed`` forces CG. Raises ValueError when
    ``"cholesky"`` is requested and does not fit in memory.
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


def free_memory_bytes(device: torch.device) -> int:
    """Free memory (bytes) on ``device``: CUDA from ``torch.cuda.mem_get_info`` (plus memory the caching
    allocator holds but does not use); CPU from ``/proc/meminfo`` ``MemAvailable``, capped by a cgroup limit,
    falling back to ``os.sysconf``."""
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
