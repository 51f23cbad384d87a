"""Resumable fits of :class:`gpfast.ExactGP`: ``ExactGP(checkpoint=PATH)`` or ``ExactGP(checkpoint=(PATH, k))``.

A fit is a sequence of optimiser *runs* (for each start of :mod:`~gpfast.estimator.restarts`: the pretraining on
a subset when asked for, then the run on all the data). The checkpoint file holds:

* ``fingerprint``: the SHA-256 of the training data (X and y as float64 bytes, with their shapes) and the
  estimator's settings (``get_params()`` without ``checkpoint`` and ``verbose``, which do not change the result;
  ``random_state`` as the resolved seed). A fit resumes only when both match, and otherwise
  raises ``ValueError`` naming the file and what differs.
* ``done``: the result of every finished run (its loss history, steps, stopping message, final hyperparameters,
  and the engine's per-step records), so that a resumed fit skips them.
* ``current``: the run under way: its index, every objective evaluation so far (hyperparameters in, loss and
  gradient out, float64), and the objective's state after the last of them (for gpfast's engine,
  :meth:`gpfast.train.Engine.state_dict`: the generators' state the probes were drawn from (they are drawn
  again on resume), the warm-start solutions, the hyperparameters the
  preconditioner was built at, the log-determinant's path integral and the EngineRecord).
* ``rng``: torch's CPU generator (and the device's, on CUDA) after the last evaluation.

**The optimiser's state is its inputs.** Both optimisers are deterministic functions, in float64 on the CPU, of the
sequence of (loss, gradient) values they are given. A resumed run therefore *replays* the logged evaluations
(checking that the optimiser asks for the very same hyperparameters, bit for bit) and so rebuilds Adam's moments
and step count, or L-BFGS-B's memory and line search (which ``scipy.optimize.minimize`` cannot otherwise resume),
exactly; then it restores the objective's state and the generators and evaluates live from there. A resumed fit
thus takes the same steps as one never interrupted: bit for bit on the CPU (tests/test_checkpoint.py), and on a
GPU up to the floating-point nondeterminism of its reductions, well within the CG tolerance.

A checkpoint is written every ``k`` optimiser steps (default
:data:`~gpfast.estimator.params.CHECKPOINT_EVERY`; never while replaying) and at the end of each
run, with :func:`gpfast.estimator.file_format.write_state`: the format-2 header with a SHA-256 over the contents,
written to a temporary file in the same folder and renamed over the old one, so that a kill during a write leaves
the previous checkpoint. A damaged or truncated file raises ``ValueError`` saying so. The file is deleted when the
fit succeeds (a failed fit keeps it, to resume from). Not supported with ``distributed=True``.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from gpfast._version import __version__
from gpfast.estimator import file_format, persistence
from gpfast.estimator.fitting import FitResult
from gpfast.estimator.params import Settings
from gpfast.train.engine import EngineRecord
from gpfast.train.state import generator_state, set_generator_state

__all__ = ["CHECKPOINT_FORMAT", "Checkpoint", "RunLog", "fingerprint", "open_for_fit"]

#: Resuming is reported under the estimator's logger, where its other fit messages go.
_logger = logging.getLogger("gpfast.estimator.exact_gp")

#: The ``format`` entry of a checkpoint's payload (a fitted model's is ``file_format.FORMAT``).
CHECKPOINT_FORMAT = "gpfast.ExactGP.checkpoint"
#: Parameters that do not change the fit's result, left out of the settings fingerprint.
IGNORED_PARAMS = ("checkpoint", "verbose")


def fingerprint(est, seed: int | None, X: torch.Tensor, y: torch.Tensor) -> dict:
    """What a checkpoint must match: SHA-256 of X (n, d) and y (n,) as float64 bytes, and the settings."""
    digest = hashlib.sha256()
    for t in (X, y):
        a = t.detach().to(torch.float64).cpu().contiguous().numpy()
        digest.update(repr(a.shape).encode())
        digest.update(a.tobytes())
    settings = {k: v for k, v in persistence.plain_params(est).items() if k not in IGNORED_PARAMS}
    settings["random_state"] = seed
    return {"data_sha256": digest.hexdigest(), "n": int(X.shape[0]), "d": int(X.shape[1]), "settings": settings}


def _describe_mismatch(saved: dict, now: dict) -> str:
    if (saved.get("n"), saved.get("d"), saved.get("data_sha256")) != (now["n"], now["d"], now["data_sha256"]):
        if (saved.get("n"), saved.get("d")) != (now["n"], now["d"]):
            return f"it is for other data: {saved.get('n')} x {saved.get('d')} points, now {now['n']} x {now['d']}"
        return (
            f"it is for other data: the same shape ({now['n']} x {now['d']}) but other values (SHA-256 of X and y "
            f"{str(saved.get('data_sha256'))[:16]}..., now {now['data_sha256'][:16]}...)"
        )
    old, new = saved.get("settings", {}), now["settings"]
    diffs = [
        f"{k}={old.get(k)!r} there, {new.get(k)!r} now" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)
    ]
    return "it was written with other settings: " + "; ".join(diffs)


def _result_dict(result: FitResult) -> dict:
    return {
        "history": [float(v) for v in result.history],
        "n_iter": int(result.n_iter),
        "converged": bool(result.converged),
        "message": str(result.message),
        "loss": float(result.loss),
        "theta": torch.from_numpy(np.asarray(result.theta, dtype=np.float64).copy()),
    }


def _result_from(d: dict) -> FitResult:
    return FitResult(
        list(d["history"]), d["n_iter"], d["converged"], d["message"], d["loss"], d["theta"].numpy().copy()
    )


class Checkpoint:
    """The checkpoint file of one fit: use :meth:`open`; :meth:`next_run` for each optimiser run in order, then
    :meth:`close` after the last and :meth:`remove` once the fit has succeeded."""

    def __init__(self, path: Path, every: int, fp: dict, device: torch.device):
        self.path, self.every, self.fingerprint, self.device = path, int(every), fp, device
        self.done: list[dict] = []
        self.current: dict | None = None
        self.pending_rng: dict | None = None  # restored before the first live evaluation after a resume
        self.resumed = False
        self._started = 0
        self._live: RunLog | None = None

    @classmethod
    def open(cls, path, every: int, fp: dict, device: torch.device) -> Checkpoint:
        """A fresh checkpoint at ``path``, or the one there when its fingerprint matches ``fp``."""
        path = Path(os.fspath(path)).expanduser()
        ckpt = cls(path, every, fp, device)
        if not path.exists():
            return ckpt
        state = ckpt._read()
        if state["fingerprint"] != fp:
            why = _describe_mismatch(state["fingerprint"], fp)
            raise ValueError(
                f"ExactGP: cannot resume from the checkpoint {str(path)!r}: {why}. Delete the file (or pass another "
                f"checkpoint path) to start this fit afresh."
            )
        ckpt.done, ckpt.current, ckpt.pending_rng, ckpt.resumed = state["done"], state["current"], state["rng"], True
        return ckpt

    def _read(self) -> dict:
        where = str(self.path)
        try:
            _, state = file_format.read_state(self.path, format=CHECKPOINT_FORMAT)
        except ValueError as exc:
            what = str(exc).removeprefix(f"cannot load {where!r}: ")
            damaged = "truncated" in what or "corrupt" in what
            advice = "Delete it to start the fit afresh." if damaged else "Pass another checkpoint path."
            raise ValueError(f"ExactGP: cannot resume from the checkpoint {where!r}: {what} {advice}") from None
        missing = [k for k in ("fingerprint", "done", "current", "rng") if k not in state]
        current = state.get("current")
        if not missing and current is not None and current.get("index") != len(state["done"]):
            missing = [f"current run {current.get('index')} after {len(state['done'])} finished ones"]
        if missing:
            raise ValueError(
                f"ExactGP: cannot resume from the checkpoint {where!r}: its contents are inconsistent ({missing}). "
                f"Delete it to start the fit afresh."
            )
        return state

    # -- runs ---------------------------------------------------------------------------------------------------
    def next_run(self) -> RunLog:
        """The log of the next optimiser run: finished already (``.done`` set), under way, or new."""
        i = self._started
        self._started += 1
        if i < len(self.done):
            d = self.done[i]
            record = EngineRecord(**d["record"]) if d["record"] is not None else None
            return RunLog(self, i, done=(_result_from(d["result"]), record))
        saved = self.current if self.current is not None and self.current["index"] == i else None
        self._live = RunLog(self, i, saved=saved)
        return self._live

    def finish_run(self, log: RunLog, result: FitResult, record: EngineRecord | None) -> None:
        self.done.append({"result": _result_dict(result), "record": asdict(record) if record is not None else None})
        self.current, self._live = None, None
        self.write()

    def close(self) -> None:
        """After the last run: put the generators where an uninterrupted fit has them (when no evaluation after a
        resume did so), for what follows the training (GPyTorch's CG estimate of the likelihood draws probes)."""
        self.restore_rng()

    def restore_rng(self) -> None:
        if self.pending_rng is not None:
            set_generator_state(self.pending_rng, self.device)
            self.pending_rng = None

    def write(self) -> None:
        state = {
            "format": CHECKPOINT_FORMAT,
            "format_version": file_format.FORMAT_VERSION,
            "gpfast_version": __version__,
            "fingerprint": self.fingerprint,
            "done": self.done,
            "current": self._live.state_dict() if self._live is not None else self.current,
            "rng": self.pending_rng if self.pending_rng is not None else generator_state(self.device),
        }
        file_format.write_state(state, self.path)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


class RunLog:
    """One optimiser run's evaluations, replayed from a checkpoint and then logged live; the ``recorder`` of
    :func:`gpfast.estimator.fitting.fit_hyperparameters`. ``done``: (FitResult, EngineRecord or None) of a
    finished run."""

    def __init__(self, ckpt: Checkpoint, index: int, done=None, saved: dict | None = None):
        self.ckpt, self.index, self.done = ckpt, index, done
        self.engine_state = saved["engine"] if saved else None
        self.thetas = [t.numpy().copy() for t in saved["theta"]] if saved else []
        self.losses = saved["loss"].tolist() if saved else []
        self.grads = [g.numpy().copy() for g in saved["grad"]] if saved else []
        self.n_logged = len(self.losses)
        self.pos = 0  # evaluations asked for so far
        self.steps = 0
        self.fresh = False  # a live evaluation since the last write
        self.objective_state = None  # () -> the objective's state dict (the engine's), set by the caller

    def wrap(self, fun):
        """``fun(theta) -> (loss, grad)`` that answers the logged evaluations from the log and the rest live."""

        def logged(theta: np.ndarray):
            i, self.pos = self.pos, self.pos + 1
            if i < self.n_logged:
                if np.asarray(theta, dtype=np.float64).tobytes() != self.thetas[i].tobytes():
                    raise ValueError(
                        f"ExactGP: cannot resume from the checkpoint {str(self.ckpt.path)!r}: replaying run "
                        f"{self.index}, the optimiser asked at evaluation {i} for hyperparameters "
                        f"{np.asarray(theta).tolist()}, the checkpoint has {self.thetas[i].tolist()} (written by "
                        f"another version of gpfast or scipy?). Delete it to start the fit afresh."
                    )
                return self.losses[i], self.grads[i].copy()
            self.ckpt.restore_rng()
            loss, grad = fun(theta)
            self.thetas.append(np.array(theta, dtype=np.float64))
            self.losses.append(float(loss))
            self.grads.append(np.array(grad, dtype=np.float64))
            self.fresh = True
            return loss, grad

        return logged

    def step(self) -> None:
        """An optimiser step ended: write the checkpoint every ``every`` steps, once the replay is over."""
        self.steps += 1
        if self.fresh and self.steps % self.ckpt.every == 0:
            self.ckpt.write()
            self.fresh = False

    def state_dict(self) -> dict:
        p = len(self.thetas[0]) if self.thetas else 0
        return {
            "index": self.index,
            "steps": self.steps,
            "theta": torch.tensor(np.array(self.thetas), dtype=torch.float64).reshape(len(self.thetas), p),
            "loss": torch.tensor(self.losses, dtype=torch.float64),
            "grad": torch.tensor(np.array(self.grads), dtype=torch.float64).reshape(len(self.grads), p),
            "engine": self.objective_state() if self.objective_state is not None else None,
        }


def open_for_fit(est, settings: Settings, X: torch.Tensor, y: torch.Tensor) -> Checkpoint | None:
    """The :class:`Checkpoint` of ``est.fit`` on X and y (resumed when one was left), or None without
    ``est.checkpoint`` (``settings``: ``est``'s resolved arguments)."""
    if settings.checkpoint is None:
        return None
    path, every = settings.checkpoint
    ckpt = Checkpoint.open(path, every, fingerprint(est, settings.seed, X, y), settings.device)
    if ckpt.resumed:
        _logger.info("gpfast.ExactGP: resuming from the checkpoint %s", path)
    return ckpt
