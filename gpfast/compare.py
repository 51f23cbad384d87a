"""Head-to-head comparison of stock GPyTorch, GPyTorch with gpfast's kernel, and ``gpfast.ExactGP``.

Rows (same standardised data and split, same initial hyperparameters, same number of Adam steps, same seed,
float32):

* ``"gpytorch"``: stock GPyTorch ``ExactGP`` with ``ConstantMean`` + ``ScaleKernel(RBFKernel(ard_num_dims=d))``,
  ``GaussianLikelihood``, ``ExactMarginalLogLikelihood``, ``Adam`` and GPyTorch's default settings; predictions
  ``likelihood(model(X_test))`` in eval mode (no ``fast_pred_var``).
* ``"gpytorch+gpfast"``: the same model and loop with only the kernel swapped for
  :class:`gpfast.kernels.ScaleRBFKernel` (its state_dict is loaded from the first row's initial state).
* ``"gpfast"``: :class:`gpfast.estimator.ExactGP` with the same initial hyperparameters.

Example::

    from gpfast.compare import compare
    rows = compare("yacht", iters=50, device="cpu")
"""

from __future__ import annotations

import datetime
import gc
import math
import os
import platform
import resource
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

ROWS: tuple[str, ...] = ("gpytorch", "gpytorch+gpfast", "gpfast")

__all__ = ["compare", "ROWS", "machine_name"]


def machine_name(device: str = "cpu") -> str:
    """A short description of the machine the comparison ran on (GPU name on CUDA, else the CPU)."""
    if str(device).startswith("cuda") and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.device(device))
        return f"{p.name} ({p.total_memory / 2**30:.0f} GiB), torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu} ({os.cpu_count()} cores), torch {torch.__version__}"


# ------------------------------------------------------------------------------------------------------------
# memory measurement
# ------------------------------------------------------------------------------------------------------------


def _rss_bytes() -> Optional[int]:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class _PeakMemory:
    """Peak memory during a block: CUDA ``max_memory_allocated`` (after ``reset_peak_memory_stats``), or on the CPU
    the peak increase of the resident set size over its value at the start (sampled every 2 ms from
    ``/proc/self/statm``; where that is missing, the increase of ``getrusage``'s ``ru_maxrss``)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak: Optional[int] = None
        self.kind = ""

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.kind = "cuda_max_allocated"
            return self
        self._start = _rss_bytes()
        if self._start is not None:
            self.kind = "cpu_rss_peak_increase"
            self._max = self._start
            self._stop = threading.Event()

            def sample():
                while not self._stop.is_set():
                    r = _rss_bytes()
                    if r is not None and r > self._max:
                        self._max = r
                    self._stop.wait(0.002)

            self._thread = threading.Thread(target=sample, daemon=True)
            self._thread.start()
        else:
            self.kind = "cpu_maxrss_increase"
            self._start_ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = int(torch.cuda.max_memory_allocated(self.device))
        elif self.kind == "cpu_rss_peak_increase":
            self._stop.set()
            self._thread.join()
            r = _rss_bytes()
            if r is not None and r > self._max:
                self._max = r
            self.peak = int(self._max - self._start)
        else:
            self.peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self._start_ru)
        return False


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------------------------
# the GPyTorch rows
# ------------------------------------------------------------------------------------------------------------


def make_gpytorch_model(X, y, d: int, kernel: str):
    """The model of rows (a) and (b): ConstantMean + ScaleKernel(RBFKernel(ard)), with GPyTorch's kernel
    (``kernel="gpytorch"``) or gpfast's ``ScaleRBFKernel`` (any other value). Returns (model, likelihood)."""
    import gpytorch

    class _Model(gpytorch.models.ExactGP):
        def __init__(self, train_x, train_y, likelihood):
            super().__init__(train_x, train_y, likelihood)
            self.mean_module = gpytorch.means.ConstantMean()
            if kernel == "gpytorch":
                self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=d))
            else:
                from gpfast.kernels import ScaleRBFKernel

                self.covar_module = ScaleRBFKernel(ard_num_dims=d)

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    likelihood = gpytorch.likelihoods.GaussianLikelihood()
    return _Model(X, y, likelihood), likelihood


def _hyp_of(model, likelihood) -> Dict[str, object]:
    cov = model.covar_module
    return {
        "init_lengthscale": [float(v) for v in cov.base_kernel.lengthscale.detach().reshape(-1).cpu()],
        "init_outputscale": float(cov.outputscale.detach().cpu()),
        "init_noise": float(likelihood.noise.detach().reshape(-1)[0].cpu()),
        "init_mean": float(model.mean_module.constant.detach().reshape(-1)[0].cpu()),
    }


def _run_gpytorch_row(name, X, y, Xt, d, iters, lr, seed, device, verbose, init_state):
    import gpytorch
    from tqdm.auto import tqdm

    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)
    model, likelihood = make_gpytorch_model(X, y, d, name)
    model = model.to(device=device, dtype=torch.float32)
    likelihood = likelihood.to(device=device, dtype=torch.float32)
    if init_state is not None:
        model.load_state_dict(init_state)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    info = _hyp_of(model, likelihood)

    _sync(device)
    t0 = time.perf_counter()
    model.train()
    likelihood.train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)  # the likelihood's parameters are part of the model's
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    losses: List[float] = []
    bar = tqdm(range(iters), desc=f"{name} fit", disable=not verbose, leave=False, file=sys.stderr)
    for _ in bar:
        opt.zero_grad()
        loss = -mll(model(X), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    bar.close()
    _sync(device)
    train_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    model.eval()
    likelihood.eval()
    with torch.no_grad():
        pred = likelihood(model(Xt))
        mean, var = pred.mean, pred.variance
    _sync(device)
    predict_s = time.perf_counter() - t0
    info.update(final_loss=losses[-1] if losses else float("nan"), solver="gpytorch defaults")
    return info, state, train_s, predict_s, mean.double().cpu().numpy(), var.double().cpu().numpy()


def _run_gpfast_row(X, y, Xt, iters, lr, seed, device, verbose, init):
    from gpfast.estimator import ExactGP

    record: Dict[str, object] = {}

    class _RecordingExactGP(ExactGP):
        """ExactGP that records the hyperparameters its model actually starts from."""

        def _initialise(self, model, inits, dev, dtype):  # noqa: D401 - overrides a staticmethod
            ExactGP._initialise(model, inits, dev, dtype)
            record.update(_hyp_of(model, model.likelihood))

    # ExactGP re-standardises the (already standardised) data with its own (population) statistics, which are
    # 0 / 1 up to rounding; scale the initial values by them so that the model starts from exactly ``init``.
    Xd = X.double()
    x_std = Xd.std(0, unbiased=False).cpu().numpy()
    x_std[~(x_std > 1e-12)] = 1.0
    y_std = float(y.double().std(unbiased=False))
    kw = {}
    if init is not None:
        kw = dict(
            lengthscale_init=np.asarray(init["init_lengthscale"], dtype=np.float64) * x_std,
            outputscale_init=init["init_outputscale"] * y_std**2,
            noise_init=init["init_noise"] * y_std**2,
        )
    gp = _RecordingExactGP(max_iter=iters, lr=lr, device=device, random_state=seed, verbose=verbose, **kw)
    _sync(device)
    t0 = time.perf_counter()
    gp.fit(X, y)
    _sync(device)
    train_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    mean, std = gp.predict(Xt, return_std=True)
    _sync(device)
    predict_s = time.perf_counter() - t0
    mean = torch.as_tensor(mean).double().cpu().numpy()
    var = torch.as_tensor(std).double().cpu().numpy() ** 2
    info = dict(record)
    info.update(final_loss=gp.history_[-1] if gp.history_ else float("nan"), solver=str(gp.solver_),
                train_solver=str(getattr(gp, "train_solver_", gp.solver_)))
    return info, train_s, predict_s, mean, var


# ------------------------------------------------------------------------------------------------------------
# public entry point
# ------------------------------------------------------------------------------------------------------------


def _metrics(mean: np.ndarray, var: np.ndarray, y: np.ndarray, y_std: float) -> Dict[str, float]:
    var = np.maximum(var, 1e-12)
    err = mean - y
    rmse = float(np.sqrt(np.mean(err**2)))
    nll = float(np.mean(0.5 * np.log(2 * np.pi * var) + 0.5 * err**2 / var))
    return {
        "rmse_std": rmse,
        "rmse_orig": rmse * float(y_std),
        "nll_std": nll,
        "nll_orig": nll + math.log(float(y_std)),
    }


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
) -> List[dict]:
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
        Before the timed runs, run every row once, untimed, for one step on at most 64 training points, so that
        one-off costs (lazy imports, loading the compiled ops, allocator start-up) fall on no row.

    Returns
    -------
    list of dict
        One dict per row with the data set, the row name, ``train_s``, ``s_per_iter``, ``predict_s``,
        ``total_s``, ``rmse_std``/``rmse_orig``, ``nll_std``/``nll_orig`` (NLL of the Gaussian predictive with the
        noisy variance, per test point), ``peak_mem_bytes`` and ``mem_kind``, the initial hyperparameters
        (``init_lengthscale`` ...), ``status`` (``"ok"``, ``"OOM"`` or ``"error: ..."``), the machine and date.
        Metrics of a failed row are ``None``.
    """
    from gpfast import datasets as _ds

    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise ValueError(f"unknown row(s) {unknown}; known rows: {', '.join(ROWS)}")
    if isinstance(dataset, str):
        data = _ds.load_uci(dataset, split=split, data_dir=data_dir)
    else:
        data = dataset
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available; use --device cpu")

    X = torch.as_tensor(np.asarray(data.X_train), dtype=torch.float32, device=dev).contiguous()
    y = torch.as_tensor(np.asarray(data.y_train).reshape(-1), dtype=torch.float32, device=dev).contiguous()
    Xt = torch.as_tensor(np.asarray(data.X_test), dtype=torch.float32, device=dev).contiguous()
    y_test = np.asarray(data.y_test, dtype=np.float64).reshape(-1)
    y_std = float(data.y_std)
    d = X.shape[1]
    common = {
        "dataset": getattr(data, "name", str(dataset)),
        "split": int(getattr(data, "split", split)),
        "n_train": int(X.shape[0]),
        "n_test": int(Xt.shape[0]),
        "d": int(d),
        "iters": int(iters),
        "lr": float(lr),
        "seed": int(seed),
        "device": str(dev),
        "dtype": "float32",
        "machine": machine_name(str(dev)),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }

    # The shared initial state: GPyTorch's defaults, from the stock model (built even when its row is skipped).
    torch.manual_seed(seed)
    m0, l0 = make_gpytorch_model(X, y, d, "gpytorch")
    m0 = m0.to(device=dev, dtype=torch.float32)
    init_state = {k: v.detach().clone() for k, v in m0.state_dict().items()}
    init = _hyp_of(m0, l0.to(device=dev, dtype=torch.float32))
    del m0, l0

    if warmup:
        nw = min(64, X.shape[0])
        for name in rows:
            try:
                if name == "gpfast":
                    _run_gpfast_row(X[:nw], y[:nw], Xt[:nw], 1, lr, seed, dev, False, init)
                else:
                    _run_gpytorch_row(name, X[:nw], y[:nw], Xt[:nw], d, 1, lr, seed, dev, False,
                                      None if name == "gpytorch" else init_state)
            except Exception:  # the timed run reports the error
                pass
        gc.collect()

    results: List[dict] = []
    for name in rows:
        row = dict(common, row=name)
        mean = var = None
        try:
            with _PeakMemory(dev) as mem:
                if name == "gpfast":
                    info, train_s, predict_s, mean, var = _run_gpfast_row(
                        X, y, Xt, iters, lr, seed, dev, verbose, init
                    )
                else:
                    info, _state, train_s, predict_s, mean, var = _run_gpytorch_row(
                        name, X, y, Xt, d, iters, lr, seed, dev, verbose,
                        None if name == "gpytorch" else init_state,
                    )
            row.update(info)
            row.update(
                status="ok",
                train_s=train_s,
                s_per_iter=train_s / iters if iters else float("nan"),
                predict_s=predict_s,
                total_s=train_s + predict_s,
                **_metrics(mean, var, y_test, y_std),
                peak_mem_bytes=mem.peak,
                mem_kind=mem.kind,
            )
        except torch.OutOfMemoryError as exc:
            row.update(_failed("OOM", dev))
            if verbose:
                print(f"{name}: out of memory ({str(exc).splitlines()[0]})", file=sys.stderr)
        except Exception as exc:  # one failing row should not lose the others
            row.update(_failed(f"error: {type(exc).__name__}: {exc}", dev))
            if verbose:
                print(f"{name}: {type(exc).__name__}: {exc}", file=sys.stderr)
        results.append(row)
        mean = var = None
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return results


def _failed(status: str, dev: torch.device) -> dict:
    out = {k: None for k in ("train_s", "s_per_iter", "predict_s", "total_s", "rmse_std", "rmse_orig", "nll_std",
                             "nll_orig", "peak_mem_bytes")}
    out["status"] = status
    out["mem_kind"] = "cuda_max_allocated" if dev.type == "cuda" else "cpu_rss_peak_increase"
    return out
