"""Validation of :class:`gpfast.ExactGP`'s constructor arguments, done at ``fit`` (scikit-learn's rule:
``__init__`` only stores), and the pointers from removed argument names to their places. Nothing here modifies
the estimator."""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from sklearn.utils import check_random_state

from gpfast.train.settings import CGSettings

__all__ = [
    "CHECKPOINT_EVERY",
    "MAX_RESTARTS",
    "OPTIMIZERS",
    "REMOVED_ARGUMENTS",
    "Settings",
    "checkpoint_schedule",
    "initial_values",
    "removed_arguments",
    "resolve",
]

#: ``optimizer`` values; ``"auto"`` is L-BFGS on the exact (Cholesky) objective and Adam on the CG estimate.
OPTIMIZERS = ("auto", "lbfgs", "adam")

#: Upper bound of ``n_restarts``: each restart is a whole fit, so a larger number is a typo rather than a plan (a
#: million restarts of even a small fit would run for days).
MAX_RESTARTS = 1000

#: Optimiser steps between checkpoint writes when ``checkpoint`` is a bare path: each write holds the engine's probes
#: and warm starts (85 MB at n = 1M in float32), so writing every step would cost more time than it saves.
CHECKPOINT_EVERY = 10

#: Arguments that ExactGP no longer takes, and where their settings live now.
REMOVED_ARGUMENTS = {
    "cg_tolerance": (
        "cg={'cg_tolerance': ...} sets the training steps' tolerance (gpfast's engine); GPyTorch's own training "
        "loop follows gpytorch.settings.cg_tolerance"
    ),
    "eval_cg_tolerance": "cg={'predict_cg_tolerance': ...}",
    "max_cg_iterations": "cg={'max_cg_iterations': ...} (training steps) or cg={'predict_max_cg_iterations': ...}",
    "preconditioner_size": (
        "cg={'preconditioner_rank': ...} (training steps) or cg={'predict_preconditioner_rank': ...}"
    ),
    "trainer_options": "cg={...} (a dict of gpfast.CGSettings fields, or a gpfast.CGSettings)",
    "trainer": "cg={'trainer': ...}",
    "pretrain_subset": "pretrain=(n_points, n_steps)",
    "pretrain_iter": "pretrain=(n_points, n_steps)",
    "checkpoint_every": "checkpoint=(path, every)",
}

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "single": torch.float32,
    "float64": torch.float64,
    "double": torch.float64,
}


@dataclass(frozen=True)
class Settings:
    """The estimator's arguments, checked and resolved to what the fit uses."""

    optimizer: str
    dtype: torch.dtype
    device: torch.device
    distributed: bool
    seed: int | None
    cg: CGSettings
    pretrain_n: int | None
    pretrain_steps: int
    checkpoint: tuple[str | os.PathLike, int] | None


def describe(value: Any) -> str:
    """``repr(value)``, cut to 80 characters for error messages."""
    r = repr(value)
    return r if len(r) <= 80 else r[:77] + "..."


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(float(v))


def upgrade_params(params: dict) -> dict:
    """The arguments of an estimator saved by an earlier version, in today's names.

    Parameters
    ----------
    params : dict
        ``get_params()`` as saved; keys that are not argument names of an earlier version pass through.

    Returns
    -------
    dict
        The same settings: ``trainer`` and ``trainer_options`` join ``cg`` (None when every field keeps its
        default), ``pretrain_subset`` with ``pretrain_iter`` become ``pretrain``, and ``checkpoint_every`` joins
        ``checkpoint`` as ``(path, every)`` (dropped when it kept its default). GPyTorch's CG arguments
        (``cg_tolerance``, ``eval_cg_tolerance``, ``max_cg_iterations``, ``preconditioner_size``) are dropped: a
        loaded model predicts by the certified CG posterior, under ``cg``'s ``predict_*`` defaults.
    """
    old = dict(params)
    if not any(name in old for name in REMOVED_ARGUMENTS):
        return old
    every = old.pop("checkpoint_every", CHECKPOINT_EVERY)
    if old.get("checkpoint") is not None and every != CHECKPOINT_EVERY:
        old["checkpoint"] = (old["checkpoint"], every)
    cg = dict(old.pop("trainer_options", None) or {})
    if "trainer" in old:
        cg["trainer"] = old.pop("trainer")
    # GPyTorch's CG arguments governed its training loop and its prediction, which the certified CG posterior
    # replaced; their values (a residual tolerance, a rank-15 preconditioner) mean nothing to it
    for name in ("cg_tolerance", "eval_cg_tolerance", "max_cg_iterations", "preconditioner_size"):
        old.pop(name, None)
    defaults = CGSettings()
    cg = {k: v for k, v in cg.items() if getattr(defaults, k, None) != v}
    old.setdefault("cg", cg or None)
    subset, steps = old.pop("pretrain_subset", None), old.pop("pretrain_iter", 10)
    old.setdefault("pretrain", None if subset is None else (subset, steps))
    return old


def removed_arguments(names) -> ValueError:
    """The error of ``set_params`` for arguments that ExactGP no longer takes, saying where their settings live.

    Parameters
    ----------
    names : iterable of str
        Keys of :data:`REMOVED_ARGUMENTS`.

    Returns
    -------
    ValueError
        scikit-learn's error type for unknown parameter names.
    """
    where = "; ".join(f"instead of {name}=..., use {REMOVED_ARGUMENTS[name]}" for name in sorted(names))
    return ValueError(f"ExactGP no longer takes {', '.join(sorted(names))}: {where}.")


def checkpoint_schedule(value) -> tuple[str | os.PathLike, int] | None:
    """ExactGP's ``checkpoint`` argument as ``(path, every)``.

    Parameters
    ----------
    value : str, os.PathLike, (path, int) or None
        A file path (written every :data:`CHECKPOINT_EVERY` optimiser steps), a pair ``(path, every)``, or None.

    Returns
    -------
    (str or os.PathLike, int) or None
        The file and the optimiser steps between writes; None without checkpoints.

    Raises
    ------
    ValueError
        For any other value, naming it and what is expected.
    """
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        return value, CHECKPOINT_EVERY
    if (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and isinstance(value[0], (str, os.PathLike))
        and _is_int(value[1])
        and value[1] >= 1
    ):
        return value[0], int(value[1])
    raise ValueError(
        f"ExactGP: invalid checkpoint={describe(value)}; expected None, a file path, or (path, every) with every an "
        f"int >= 1 (optimiser steps between writes)."
    )


def resolve(est) -> Settings:
    """Check every argument of an estimator and resolve what the fit uses.

    Parameters
    ----------
    est : gpfast.ExactGP

    Returns
    -------
    Settings

    Raises
    ------
    ValueError
        Naming the first argument whose value is invalid, with the value seen and what is expected.
    """

    def bad(name, expected):
        return ValueError(f"ExactGP: invalid {name}={describe(getattr(est, name))}; expected {expected}.")

    if not isinstance(est.solver, str) or est.solver not in ("auto", "cholesky", "cg"):
        raise bad("solver", "one of 'auto', 'cholesky', 'cg'")
    if not isinstance(est.optimizer, str) or est.optimizer.lower() not in OPTIMIZERS:
        raise bad("optimizer", "one of " + ", ".join(repr(o) for o in OPTIMIZERS))
    if not _is_real(est.lr) or est.lr <= 0:
        raise bad("lr", "a positive float")
    if not _is_int(est.max_iter) or est.max_iter < 0:
        raise bad("max_iter", "an int >= 0")
    if not _is_int(est.n_restarts) or not 0 <= est.n_restarts <= MAX_RESTARTS:
        raise bad("n_restarts", f"an int >= 0 and at most {MAX_RESTARTS} (each restart is a whole fit)")
    if est.tol is not None and (not _is_real(est.tol) or est.tol < 0):
        raise bad("tol", "None or a float >= 0")
    for name in ("ard", "standardize"):
        if getattr(est, name) not in (True, False):
            raise bad(name, "True or False")
    for name in ("noise_init", "outputscale_init"):
        v = getattr(est, name)
        if v is not None and (not _is_real(v) or v <= 0):
            raise bad(name, "None or a positive float")
    pretrain = est.pretrain
    if pretrain is not None and not (
        isinstance(pretrain, (tuple, list))
        and len(pretrain) == 2
        and _is_int(pretrain[0])
        and pretrain[0] >= 2
        and _is_int(pretrain[1])
        and pretrain[1] >= 0
    ):
        raise bad("pretrain", "None or a pair (n_points, n_steps) of ints, n_points >= 2 and n_steps >= 0")
    try:
        cg = CGSettings.from_value(est.cg)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"ExactGP: invalid cg={describe(est.cg)}: {exc}") from None
    if cg.trainer == "gpfast" and est.solver == "cholesky":
        raise ValueError(
            "ExactGP: cg trainer='gpfast' takes CG training steps; got solver='cholesky' (use solver='auto' or "
            "'cg', or trainer='auto')."
        )
    if est.verbose not in (True, False, 0, 1):
        raise bad("verbose", "True or False")
    checkpoint = checkpoint_schedule(est.checkpoint)
    if checkpoint is not None and est.distributed:
        raise ValueError("ExactGP: checkpoint is not supported with distributed=True; set checkpoint=None.")
    return Settings(
        optimizer=est.optimizer.lower(),
        dtype=_resolve_dtype(est.dtype, bad),
        device=_resolve_device(est, bad),
        distributed=bool(est.distributed),
        seed=_resolve_seed(est.random_state, bad),
        cg=cg,
        pretrain_n=int(pretrain[0]) if pretrain is not None else None,
        pretrain_steps=int(pretrain[1]) if pretrain is not None else 0,
        checkpoint=checkpoint,
    )


def _resolve_dtype(dt, bad) -> torch.dtype:
    if isinstance(dt, torch.dtype) and dt in (torch.float32, torch.float64):
        return dt
    if isinstance(dt, str) and dt.lower().replace("torch.", "") in _DTYPES:
        return _DTYPES[dt.lower().replace("torch.", "")]
    if isinstance(dt, (type, np.dtype)) and np.dtype(dt) in (np.float32, np.float64):
        return torch.float32 if np.dtype(dt) == np.float32 else torch.float64
    raise bad("dtype", "'float32', 'float64', torch.float32 or torch.float64")


def _resolve_device(est, bad) -> torch.device:
    if not isinstance(est.distributed, (bool, np.bool_)):
        raise bad("distributed", "True or False")
    if est.distributed:
        import torch.distributed as tdist

        if not (tdist.is_available() and tdist.is_initialized()):
            raise ValueError(
                "ExactGP: distributed=True needs an initialised torch.distributed process group: launch with "
                "`torchrun --nproc-per-node=K ...` and call gpfast.kernels.distributed.init() first."
            )
        if est.solver == "cholesky":
            raise ValueError(
                "ExactGP: distributed=True runs the matrix-free CG solver; got solver='cholesky' (use 'auto' or 'cg')."
            )
        if est.device is None:
            nccl = tdist.get_backend() == "nccl"
            return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    if est.device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(est.device)
    except (RuntimeError, TypeError, ValueError):
        raise bad("device", "None, 'cpu', 'cuda', 'cuda:<index>' or a torch.device") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"ExactGP: device={describe(est.device)} but CUDA is not available; use device='cpu' or device=None."
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.index >= torch.cuda.device_count():
            raise bad("device", f"a CUDA index below {torch.cuda.device_count()}")
    return device


def _resolve_seed(rs, bad) -> int | None:
    if rs is None:
        return None
    if _is_int(rs):
        if rs < 0:
            raise bad("random_state", "None, an int >= 0 or a numpy RandomState")
        return int(rs)
    if isinstance(rs, np.random.RandomState):
        return int(check_random_state(rs).randint(0, 2**31 - 1))
    raise bad("random_state", "None, an int >= 0 or a numpy RandomState")


def initial_values(est, d: int, x_std: torch.Tensor, y_std: float) -> dict[str, torch.Tensor | None]:
    """The user's initial hyperparameters in standardised units.

    Parameters
    ----------
    est : gpfast.ExactGP
    d : int
        Features.
    x_std : torch.Tensor of shape (d,)
        The inputs' standard deviations (float64, CPU).
    y_std : float
        The target's standard deviation.

    Returns
    -------
    dict
        ``"noise"``, ``"outputscale"`` (0-dim) and ``"lengthscale"`` ((1, d) or (1, 1)): float64 CPU tensors,
        None where not given.

    Raises
    ------
    ValueError
        For a lengthscale_init of the wrong size or sign.
    """
    out: dict[str, torch.Tensor | None] = {"noise": None, "outputscale": None, "lengthscale": None}
    if est.noise_init is not None:
        # below the training path's floor, the fit moves it up with a warning (fitting.clipped_start)
        v = float(est.noise_init) / y_std**2
        out["noise"] = torch.tensor(v, dtype=torch.float64)
    if est.outputscale_init is not None:
        out["outputscale"] = torch.tensor(float(est.outputscale_init) / y_std**2, dtype=torch.float64)
    if est.lengthscale_init is not None:
        try:
            ls = np.asarray(est.lengthscale_init, dtype=np.float64)
        except (TypeError, ValueError):
            ls = np.array([np.nan])
        if not est.ard:
            if ls.size != 1 or not np.isfinite(ls).all() or ls.item() <= 0:
                raise ValueError(
                    f"ExactGP: invalid lengthscale_init={describe(est.lengthscale_init)}; with ard=False expected a "
                    f"single positive float (in standardised input units)."
                )
            out["lengthscale"] = torch.tensor(ls.item(), dtype=torch.float64).reshape(1, 1)
        else:
            if ls.ndim > 1 or ls.size not in (1, d) or not np.isfinite(ls).all() or (ls <= 0).any():
                raise ValueError(
                    f"ExactGP: invalid lengthscale_init={describe(est.lengthscale_init)}; expected a positive float "
                    f"or an array of {d} positive floats (one per feature, in the units of X)."
                )
            ls_t = torch.from_numpy(np.broadcast_to(ls.reshape(-1), (d,)).copy())
            out["lengthscale"] = (ls_t / x_std).reshape(1, d)
    return out


def refuse_unsupported(unsupported: dict, message) -> None:
    """Raise ValueError for the first entry ``name: (value, allowed)`` of ``unsupported`` whose value is not among
    ``allowed``, with the text ``message(name, value, expected)`` (expected: the allowed values, joined by "or")."""
    for name, (value, allowed) in unsupported.items():
        if value not in allowed:
            raise ValueError(message(name, value, " or ".join(map(repr, allowed))))


def one_run_settings(est) -> dict:
    """The estimator's arguments that the fits of several independent outputs take only at their defaults (no
    restarts, pretraining, checkpoints or several GPUs), as ``name: (value, allowed)`` for
    :func:`refuse_unsupported`."""
    return {
        "n_restarts": (est.n_restarts, (0,)),
        "pretrain": (est.pretrain, (None,)),
        "checkpoint": (est.checkpoint, (None,)),
        "distributed": (est.distributed, (False,)),
    }
