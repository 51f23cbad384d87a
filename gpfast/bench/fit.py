"""One timed fit of :class:`gpfast.ExactGP`, as ``gpfast fit`` reports it: the start-up (loading the compiled ops,
an untimed warm-up) kept apart from the train and predict times, the test metrics, and the peak GPU memory.

Example::

    from gpfast.bench.fit import timed_fit
    gp, result = timed_fit({"device": "cpu", "random_state": 0}, X, y, X_test, y_test)
    result["train_s"], result["rmse_std"]
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from gpfast.bench.timing import WARM_UP_POINTS, warm_up

__all__ = ["timed_fit"]


def _fit_and_predict(params: dict, X, y) -> None:
    from gpfast.estimator import ExactGP

    gp = ExactGP(**params).fit(X, y)
    gp.predict(X[: min(len(X), 8)], return_std=True)


def _warm_up_solvers(params: dict) -> list[str]:
    """The solvers the timed fit may use: one warm-up each, as ``"auto"`` may train with one and predict with the
    other."""
    solver = params.get("solver", "auto")
    if solver != "auto":
        return [solver]
    return ["cg"] if params.get("distributed") else ["cholesky", "cg"]


def timed_fit(params: dict, X, y, X_test=None, y_test=None):
    """Fit ``ExactGP(**params)`` on (X, y), timed, after an untimed warm-up; predict and score on the test set.

    Parameters
    ----------
    params : dict
        Arguments of :class:`gpfast.ExactGP`. The warm-up fits one step on at most
        :data:`~gpfast.bench.timing.WARM_UP_POINTS` points with each solver the fit may use, quietly, without
        pretraining or a checkpoint.
    X, y : array of shape (n, d) and (n,)
        Training data.
    X_test, y_test : array of shape (m, d) and (m,), or None
        Test data; without them no prediction is timed or scored.

    Returns
    -------
    gp : gpfast.ExactGP
        The fitted estimator.
    result : dict
        ``n_train``, ``d``, ``iters`` (the cap ``max_iter``), ``n_iter``, ``converged``, ``solver``,
        ``train_solver``, ``ranks``, ``device``, ``startup_s`` (start-up and warm-up), ``train_s``, ``s_per_iter``,
        for gpfast's engine ``step_s_total`` (every step, resumed ones included), with test data ``n_test``,
        ``predict_s``, ``rmse_std`` and ``nll_std`` (:mod:`gpfast.metrics`, standardised units), with a checkpoint
        ``resumed``, then ``peak_gb`` (CUDA; None on the CPU), ``final_loss``, ``log_marginal_likelihood``, ``noise``
        and ``outputscale``. Times in seconds, wall clock, the GPU synchronised before each reading.
    """
    from gpfast.estimator import ExactGP
    from gpfast.metrics import regression_metrics

    device = params.get("device")
    on_cuda = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()

    def now() -> float:
        if on_cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    t_start = now()
    n = min(WARM_UP_POINTS, X.shape[0])
    small = {**params, "max_iter": 1, "pretrain": None, "verbose": False, "checkpoint": None}
    warm_up(partial(_fit_and_predict, {**small, "solver": s}, X[:n], y[:n]) for s in _warm_up_solvers(params))
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    gp = ExactGP(**params)
    checkpoint = params.get("checkpoint")
    if isinstance(checkpoint, (tuple, list)):  # (path, every)
        checkpoint = checkpoint[0]
    resumed = checkpoint is not None and Path(checkpoint).exists()
    t0 = now()
    gp.fit(X, y)
    t1 = now()
    result = _fit_result(gp, X, params, t_start, t0, t1)
    if X_test is not None:
        mean, std = gp.predict(X_test, return_std=True)
        t2 = now()
        scores = regression_metrics(mean, std**2, y_test)
        result.update(
            n_test=int(X_test.shape[0]), predict_s=t2 - t1, rmse_std=scores["rmse_std"], nll_std=scores["nll_std"]
        )
    if checkpoint is not None:
        result["resumed"] = resumed  # train_s covers this call only; step_s_total every step, resumed or not
    result.update(
        peak_gb=torch.cuda.max_memory_allocated() / 1e9 if on_cuda else None,
        final_loss=_final_loss(gp.history_),
        log_marginal_likelihood=gp.log_marginal_likelihood_,
        noise=gp.noise_,
        outputscale=gp.outputscale_,
    )
    return gp, result


def _final_loss(history: list):
    """The last training loss, or a list of each output's for a fit with independent outputs (a history each)."""
    if history and isinstance(history[0], list):
        return [h[-1] if h else None for h in history]
    return history[-1] if history else None


def _fit_result(gp, X, params: dict, t_start: float, t0: float, t1: float) -> dict:
    from gpfast.kernels import distributed

    result = {
        "n_train": int(X.shape[0]),
        "d": int(X.shape[1]),
        "iters": gp.max_iter,
        "n_iter": gp.n_iter_,
        "converged": gp.converged_,
        "solver": gp.solver_,
        "train_solver": gp.train_solver_,
        "ranks": distributed.world_size() if params.get("distributed") else 1,
        "device": str(gp.device_),
        "startup_s": t0 - t_start,
        "train_s": t1 - t0,
        "s_per_iter": (t1 - t0) / max(max(np.atleast_1d(gp.n_iter_)), 1),  # independent outputs: the longest run
    }
    if gp.step_seconds_ is not None:
        result["step_s_total"] = float(sum(gp.step_seconds_))
    return result
