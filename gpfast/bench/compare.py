"""Head-to-head comparison of stock GPyTorch, GPyTorch with gpfast's kernel, and ``gpfast.ExactGP``.

Rows (same standardised data and split, same initial hyperparameters, same number of Adam steps, same seed,
float32):

* ``"gpytorch"``: :class:`gpfast.models.ExactGPModel` with ``kernel="gpytorch"`` (stock ``ConstantMean`` +
  ``ScaleKernel(RBFKernel(ard_num_dims=d))``, ``GaussianLikelihood``), ``ExactMarginalLogLikelihood``, ``Adam``
  and GPyTorch's default settings; predictions ``likelihood(model(X_test))`` in eval mode (no ``fast_pred_var``).
* ``"gpytorch+gpfast"``: the same model and loop with only the kernel swapped for
  :class:`gpfast.kernels.ScaleRBFKernel` (``kernel="gpfast"``).
* ``"gpfast"``: :class:`gpfast.ExactGP` on the same (already standardised) data, ``standardize=False``.

Every row starts from the initial hyperparameters it is given (default: GPyTorch's, :func:`default_init`).

Example::

    from gpfast.bench.compare import compare
    rows = compare("yacht", iters=50, device="cpu")
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Sequence
from functools import partial

import gpytorch
import numpy as np
import torch
from tqdm.auto import tqdm

from gpfast.bench.timing import CUDA_WARM_UP_POINTS, WARM_UP_POINTS, PeakMemory, machine, now, sync, warm_up
from gpfast.estimator import ExactGP
from gpfast.metrics import regression_metrics
from gpfast.models import ExactGPModel

__all__ = ["REFERENCE_ROWS", "ROWS", "compare", "default_init", "gpytorch_adam", "gpytorch_model"]

ROWS: tuple[str, ...] = ("gpytorch", "gpytorch+gpfast", "gpfast")
#: Rows run only on request: ``"exact"`` is :class:`gpfast.ExactGP` taking the same Adam steps as row ``"gpfast"``
#: with exact gradients (float64 Cholesky of the marginal likelihood), the reference for the engine's accuracy.
REFERENCE_ROWS: tuple[str, ...] = ("exact",)
_KERNEL = {"gpytorch": "gpytorch", "gpytorch+gpfast": "gpfast"}


def default_init(d: int) -> dict[str, object]:
    """GPyTorch's default initial hyperparameters for d inputs (standardised units), read off a fresh model."""
    model = ExactGPModel(
        torch.zeros(2, d), torch.zeros(2), gpytorch.likelihoods.GaussianLikelihood(), kernel="gpytorch"
    )
    cov = model.covar_module
    return {
        "init_lengthscale": [float(v) for v in cov.base_kernel.lengthscale.detach().reshape(-1)],
        "init_outputscale": float(cov.outputscale.detach()),
        "init_noise": float(model.likelihood.noise.detach().reshape(-1)[0]),
        "init_mean": float(model.mean_module.constant.detach().reshape(-1)[0]),
    }


def gpytorch_model(X, y, kernel: str, init: dict, device) -> ExactGPModel:
    """Rows (a) and (b)'s model: :class:`gpfast.models.ExactGPModel` with ``kernel`` ("gpytorch" or "gpfast") and a
    Gaussian likelihood, float32 on ``device``, at the initial hyperparameters ``init`` (:func:`default_init`'s
    keys)."""
    model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood(), kernel=kernel)
    model = model.to(device=device, dtype=torch.float32)
    with torch.no_grad():
        model.covar_module.base_kernel.lengthscale = torch.tensor(init["init_lengthscale"], device=device)
        model.covar_module.outputscale = torch.tensor(init["init_outputscale"], device=device)
        model.likelihood.noise = torch.tensor(init["init_noise"], device=device)
        model.mean_module.constant.fill_(init["init_mean"])
    return model


def gpytorch_adam(model: ExactGPModel, iters: int, lr: float, desc: str = "", verbose: bool = False) -> list[float]:
    """GPyTorch's textbook training loop, as its tutorials write it: ``torch.optim.Adam`` over ``model.parameters()``
    (the raw, softplus-constrained hyperparameters) on ``-ExactMarginalLogLikelihood``, under GPyTorch's default
    settings, ``iters`` steps. Returns the loss of each step. Rows (a) and (b) and the scaling study train this
    way, so that they stand for GPyTorch as its users run it."""
    model.train()
    model.likelihood.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    opt = torch.optim.Adam(model.parameters(), lr=lr)  # the likelihood's parameters are part of the model's
    x, y = model.train_inputs[0], model.train_targets
    losses: list[float] = []
    # disable=None: tqdm draws the bar only when stderr is a terminal, so that a log file gets no bars
    bar = tqdm(range(iters), desc=desc, disable=None if verbose else True, leave=False, file=sys.stderr)
    for _ in bar:
        opt.zero_grad()
        loss = -mll(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    bar.close()
    return losses


def _run_gpytorch_row(name, X, y, Xt, iters, lr, seed, device, verbose, init):
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)
    model = gpytorch_model(X, y, _KERNEL[name], init, device)
    likelihood = model.likelihood

    sync(device)
    t0 = time.perf_counter()
    losses = gpytorch_adam(model, iters, lr, f"{name} fit", verbose)
    sync(device)
    train_s = time.perf_counter() - t0
    info = {"final_loss": losses[-1] if losses else float("nan"), "solver": "gpytorch defaults"}
    if Xt is None:
        return info, train_s, None, None, None

    t0 = time.perf_counter()
    model.eval()
    likelihood.eval()
    with torch.no_grad():
        pred = likelihood(model(Xt))
        mean, var = pred.mean, pred.variance
    sync(device)
    predict_s = time.perf_counter() - t0
    return info, train_s, predict_s, mean.double().cpu().numpy(), var.double().cpu().numpy()


def _run_gpfast_row(X, y, Xt, iters, lr, seed, device, verbose, init, solver="auto", cg=None):
    gp = ExactGP(
        solver=solver,
        cg=cg,
        max_iter=iters,
        lr=lr,
        optimizer="adam",
        tol=0.0,
        device=device,
        random_state=seed,
        verbose=verbose,
        standardize=False,
        lengthscale_init=np.asarray(init["init_lengthscale"], dtype=np.float64),
        outputscale_init=init["init_outputscale"],
        noise_init=init["init_noise"],
    )
    sync(device)
    t0 = time.perf_counter()
    gp.fit(X, y)
    sync(device)
    train_s = time.perf_counter() - t0
    predict_s = mean = var = None
    if Xt is not None:
        t0 = time.perf_counter()
        mean, std = gp.predict(Xt, return_std=True)
        sync(device)
        predict_s = time.perf_counter() - t0
        mean = torch.as_tensor(mean).double().cpu().numpy()
        var = torch.as_tensor(std).double().cpu().numpy() ** 2
    info = {
        "final_loss": gp.history_[-1] if gp.history_ else float("nan"),
        "solver": str(gp.solver_),
        "train_solver": str(gp.train_solver_),
        "trainer": getattr(gp, "trainer_", None),
    }
    steps = float(np.sum(gp.step_seconds_)) if getattr(gp, "step_seconds_", None) else 0.0
    if getattr(gp, "cg_iterations_", None):  # gpfast's training engine: per-step CG iterations and step times
        info.update(
            cg_iterations=list(gp.cg_iterations_),
            cg_iterations_mean=float(np.mean(gp.cg_iterations_)),
            cg_residual_final=float(gp.cg_residuals_[-1]),
            ms_per_step=1e3 * float(np.median(gp.step_seconds_)),
            step_ms=[round(1e3 * t, 3) for t in gp.step_seconds_],  # each step: the rebuilds show as the slow ones
            # the set-up, the final re-solve and the fitted posterior: the fit's time outside its engine steps
            outside_steps_s=train_s - steps,
        )
    if getattr(gp, "fit_seconds_", None):  # and where that time goes: before, around and after the steps
        phases = gp.fit_seconds_
        info.update(prepare_s=phases["prepare"], train_around_steps_s=phases["train"] - steps)
        info.update(posterior_s=phases["posterior"])
    return info, train_s, predict_s, mean, var


def _run_row(name, X, y, Xt, iters, lr, seed, device, verbose, init, cg=None):
    if name in ("gpfast", "exact"):
        solver = "cholesky" if name == "exact" else "auto"
        return _run_gpfast_row(X, y, Xt, iters, lr, seed, device, verbose, init, solver=solver, cg=cg)
    return _run_gpytorch_row(name, X, y, Xt, iters, lr, seed, device, verbose, init)


def _check_arguments(rows: Sequence[str], lr, predict: Sequence[str] | None) -> list[str]:
    """The rows that predict (all by default), after checking the arguments."""
    unknown = [r for r in rows if r not in ROWS + REFERENCE_ROWS]
    if unknown:
        raise ValueError(f"unknown row(s) {unknown}; known rows: {', '.join(ROWS + REFERENCE_ROWS)}")
    if not (isinstance(lr, (int, float)) and lr > 0):
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    predict = list(rows) if predict is None else list(predict)
    not_run = sorted(set(predict) - set(rows))
    if not_run:
        raise ValueError(f"predict names rows {not_run} that are not run; expected a subset of rows {list(rows)}")
    return predict


def compare(
    dataset,
    split: int = 0,
    iters: int = 50,
    lr: float = 0.1,
    device: str = "cpu",
    data_dir=None,
    seed: int = 0,
    rows: Sequence[str] = ROWS,
    verbose: bool = True,
    warmup: bool = True,
    init: dict[str, object] | None = None,
    cg: dict | None = None,
    predict: Sequence[str] | None = None,
) -> list[dict]:
    """Train and evaluate the rows of :data:`ROWS` on one split of a data set.

    Parameters
    ----------
    dataset : str or gpfast.datasets.Dataset
        Name for :func:`gpfast.datasets.load_uci` (standardised split), or an already loaded (standardised) split.
    split, data_dir :
        Passed to :func:`gpfast.datasets.load_uci`.
    iters, lr :
        Adam steps and learning rate, the same for every row.
    device : {"cpu", "cuda"}
    seed : int
        ``torch.manual_seed`` before each row (``random_state`` of ``ExactGP``).
    rows : sequence of str
        A subset of :data:`ROWS`.
    verbose : bool
        Progress bars and ``ExactGP``'s messages.
    warmup : bool
        Before the timed runs, run every row once, untimed, for one step on at most 64 training points (on a GPU
        two steps on at most :data:`~gpfast.bench.timing.CUDA_WARM_UP_POINTS`, the paths of larger fits), so that
        one-off costs (lazy imports, loading the compiled ops and the kernels and libraries of each path,
        allocator start-up) fall on no row (:func:`gpfast.bench.timing.warm_up`).
    init : dict or None
        The initial hyperparameters of every row, in standardised units (keys ``init_lengthscale`` (list of d),
        ``init_outputscale``, ``init_noise``, ``init_mean``); default :func:`default_init`.
    cg : dict or None
        :class:`gpfast.CGSettings` fields of rows gpfast and exact (``ExactGP(cg=...)``), kept as ``cg_settings``.
    predict : sequence of str or None
        The rows that predict after training (default all); the others are timed for their training only
        (``predicted`` False, no metrics): stock GPyTorch's prediction takes minutes on the larger sets.

    Returns
    -------
    list of dict
        One dict per row with the data set, the row name, ``train_s``, ``s_per_iter``, ``predict_s``, for a
        ``"gpfast"`` row trained by gpfast's engine also ``cg_iterations`` (per step), ``cg_iterations_mean``,
        ``cg_residual_final``, ``ms_per_step`` (median engine step) and ``step_ms`` (every step),
        ``total_s``, ``rmse_std``/``rmse_orig``, ``nll_std``/``nll_orig`` (:mod:`gpfast.metrics`, NLL of the
        Gaussian predictive with the noisy variance, per test point), ``peak_mem_bytes`` and ``mem_kind``, the
        initial hyperparameters, ``status`` (``"ok"``, ``"OOM"`` or ``"error: ..."``), the machine and date.
        Metrics of a failed row are ``None``.
    """
    predict = _check_arguments(rows, lr, predict)
    data, dev, X, y, Xt, y_test = _inputs(dataset, split, data_dir, device)
    init = default_init(X.shape[1]) if init is None else init
    common = dict(dataset=getattr(data, "name", str(dataset)), split=int(getattr(data, "split", split)))
    common.update(n_train=int(X.shape[0]), n_test=int(Xt.shape[0]), d=int(X.shape[1]))
    common.update(iters=int(iters), lr=float(lr), seed=int(seed), device=str(dev), dtype="float32")
    common.update(machine=machine(dev), date=now(), cg_settings=dict(cg or {}), **init)
    if warmup:
        _warm_up_rows(rows, X, y, Xt, lr, seed, dev, init, cg)

    results: list[dict] = []
    for name in rows:
        timed = _timed_row(name, X, y, Xt, y_test, data.y_std, iters, lr, seed, dev, verbose, init, cg, name in predict)
        results.append(dict(common, row=name, **timed))
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return results


def _warm_up_rows(rows, X, y, Xt, lr, seed, dev, init, cg) -> None:
    """Each row once, untimed, on the first points (:func:`gpfast.bench.timing.warm_up`). On a GPU, two steps at
    the larger size: the second is a warm-started step, as nearly all timed ones are."""
    nw, steps = (CUDA_WARM_UP_POINTS, 2) if dev.type == "cuda" else (WARM_UP_POINTS, 1)
    nw = min(nw, X.shape[0])
    warm_up(partial(_run_row, name, X[:nw], y[:nw], Xt[:nw], steps, lr, seed, dev, False, init, cg) for name in rows)


def _inputs(dataset, split, data_dir, device):
    """(data, device, X, y, X_test as float32 tensors on the device, y_test as float64 numpy)."""
    from gpfast import datasets

    data = datasets.load_uci(dataset, split=split, data_dir=data_dir) if isinstance(dataset, str) else dataset
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available; use --device cpu")

    def tensor(a):
        return torch.as_tensor(np.asarray(a), dtype=torch.float32, device=dev).contiguous()

    y_test = np.asarray(data.y_test, dtype=np.float64).reshape(-1)
    return data, dev, tensor(data.X_train), tensor(np.asarray(data.y_train).reshape(-1)), tensor(data.X_test), y_test


def _timed_row(name, X, y, Xt, y_test, y_std, iters, lr, seed, dev, verbose, init, cg=None, predict=True) -> dict:
    """One row's results, or its failure (out of memory, an error) without losing the other rows; without
    ``predict``, its training only."""
    try:
        with PeakMemory(dev) as mem:
            info, train_s, predict_s, mean, var = _run_row(
                name, X, y, Xt if predict else None, iters, lr, seed, dev, verbose, init, cg
            )
    except torch.OutOfMemoryError as exc:
        if verbose:
            print(f"{name}: out of memory ({str(exc).splitlines()[0]})", file=sys.stderr)
        return _failed("OOM", dev)
    except Exception as exc:  # one failing row should not lose the others
        if verbose:
            print(f"{name}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return _failed(f"error: {type(exc).__name__}: {exc}", dev)
    if predict:
        metrics = regression_metrics(mean, var, y_test, float(y_std))
    else:
        metrics = dict.fromkeys(("rmse_std", "rmse_orig", "nll_std", "nll_orig"))
    return dict(
        info,
        status="ok",
        predicted=predict,
        train_s=train_s,
        s_per_iter=train_s / iters if iters else float("nan"),
        predict_s=predict_s,
        total_s=train_s + predict_s if predict else None,
        **metrics,
        peak_mem_bytes=mem.peak,
        mem_kind=mem.kind,
    )


def _failed(status: str, dev: torch.device) -> dict:
    keys = (
        "train_s",
        "s_per_iter",
        "predict_s",
        "total_s",
        "rmse_std",
        "rmse_orig",
        "nll_std",
        "nll_orig",
        "peak_mem_bytes",
    )
    out = {k: None for k in keys}
    out.update(status=status, predicted=False)
    out["mem_kind"] = "cuda_max_allocated" if dev.type == "cuda" else "cpu_rss_peak_increase"
    return out
