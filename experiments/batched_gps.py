"""Many GPs on the same inputs: one batched fit against loops of single fits.

    python -m experiments.batched_gps --device cuda     # 1,000 GPs on 500 points (d = 6); 20,000 points, 8 outputs
    python -m experiments.batched_gps --small           # CPU, a minute or two: 100 GPs on 200 points; 1,600 x 3

Three stages, on synthetic targets (each output a smooth random function of its own lengthscale, plus noise of
its own level; :func:`targets`):

1. **Independent GPs, batched.** ``ExactGP(independent_outputs=True)`` on ``k`` outputs at the same ``n`` inputs,
   fitted to convergence (each output's L-BFGS stops on its own test; ``max_iter`` 1000 is a cap).
2. **The loops it replaces**, each timed on a subset of the outputs and scaled linearly to all ``k`` (the table
   says which): single ``gpfast.ExactGP`` fits on the same device, one per output, and scikit-learn's
   ``MultiOutputRegressor(GaussianProcessRegressor)`` on the CPU with gpfast's model (``ConstantKernel() *
   RBF(np.ones(d)) + WhiteKernel()``, ``normalize_y=True``, no restarts). On the subset, the batched fit's
   predictions at test points are compared with the single fits' (largest difference over std(y_j)).
3. **Large n, several outputs.** ``n_large`` points and ``k_large`` outputs under one kernel (shared
   hyperparameters, scikit-learn's multi-output semantics), trained by gpfast's engine (``solver="auto"``: CG
   training above the training cap, with the k data columns in the engine's one batched solve; exact predictions),
   against single engine fits of the outputs on a subset, scaled. With k outputs, batching one solve can gain at
   most about k over the loop. Independent hyperparameters at this size (``independent_outputs=True`` above the
   Cholesky cap: one engine per output, stepped together, :class:`gpfast.train.batched.BatchedEngine`) are not in
   this table: their products are not batched, so they take about the loop's time.

Times are wall clock, after a warm-up fit of each kind on a few points (loading the compiled ops and first calls),
with the device synchronised. Writes experiments/results/batched_gps_<device>.{md,json} (``--stem`` to change),
naming the machine, date and commit.
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np
import torch

from experiments import RESULTS
from gpfast import ExactGP
from gpfast.bench.report import md_table, write_results
from gpfast.bench.timing import machine

#: Sizes of the full run and of ``--small``: inputs, outputs, outputs of each loop, and stage 3's inputs, outputs and
#: single fits.
FULL = dict(n=500, d=6, k=1000, loop=20, sk_loop=20, n_large=20000, k_large=8, large_loop=2)
SMALL = dict(n=200, d=6, k=100, loop=5, sk_loop=5, n_large=1600, k_large=3, large_loop=1)
N_TEST = 200


def targets(X: np.ndarray, k: int, seed: int) -> np.ndarray:
    """k synthetic outputs at X (n, d), (n, k) float64: output j is a sum of 32 random Fourier features with a
    lengthscale drawn from [0.7, 3] (in units of X's standard normal columns), scaled to unit variance over X, plus
    Gaussian noise of std drawn from [0.05, 0.3], then scaled by [0.1, 10] and shifted by N(0, 10^2)."""
    rng = np.random.default_rng(seed)
    m, d = 32, X.shape[1]
    ls = rng.uniform(0.7, 3.0, k)
    W = rng.normal(size=(k, m, d)) / ls[:, None, None]
    b = rng.uniform(0, 2 * np.pi, (k, m))
    a = rng.normal(size=(k, m))
    F = np.empty((X.shape[0], k))
    for j0 in range(0, k, 64):  # blocks of outputs: (n, 64, m) at a time
        j1 = min(j0 + 64, k)
        F[:, j0:j1] = np.einsum("njm,jm->nj", np.sin(np.einsum("nd,jmd->njm", X, W[j0:j1]) + b[j0:j1]), a[j0:j1])
    F = (F - F.mean(0)) / F.std(0)
    Y = F + rng.normal(size=F.shape) * rng.uniform(0.05, 0.3, k)
    return Y * rng.uniform(0.1, 10.0, k) + rng.normal(0, 10, k)


def _timed(fn, device: str):
    """(result, seconds) of fn() with the device synchronised before and after."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def _warm_up(device: str, d: int) -> None:
    """One tiny fit of each kind, untimed: the compiled ops' loading and first calls fall on none of the timed ones."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(64, d))
    Y = targets(X, 2, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ExactGP(device=device, independent_outputs=True, max_iter=2).fit(X, Y).predict(X[:4])
        ExactGP(device=device, max_iter=2).fit(X, Y[:, 0]).predict(X[:4])
        ExactGP(device=device, solver="cg", max_iter=2).fit(X, Y).predict(X[:4])


def _row(stage: str, method: str, device: str, shape: tuple[int, int], timed: int, seconds: float, fits=()) -> dict:
    """A result row: ``seconds`` for ``timed`` of the ``shape`` = (n, k) outputs, scaled linearly to all k, and
    the convergence of the ``fits`` (estimators; one with a list per output for independent outputs)."""
    (n, k), row = shape, dict(stage=stage, method=method, device=device)
    row.update(n=n, k=k, outputs_timed=timed, seconds=seconds, seconds_for_k=seconds * k / timed)
    if fits:
        n_iter = np.concatenate([np.atleast_1d(g.n_iter_) for g in fits])
        converged = np.concatenate([np.atleast_1d(g.converged_) for g in fits])
        row.update(converged=int(converged.sum()), n_iter_mean=float(n_iter.mean()), n_iter_max=int(n_iter.max()))
    return row


def _single_fits(X, Y, device: str, loop: int):
    """(single ExactGP fits of the first ``loop`` columns of Y, seconds)."""
    return _timed(lambda: [ExactGP(device=device).fit(X, Y[:, j]) for j in range(loop)], device)


def independent_stage(X, Y, Xt, device: str, loop: int, sk_loop: int) -> list[dict]:
    """Stages 1 and 2: the batched fit of every column of Y, and the loops on the first ``loop`` / ``sk_loop``."""
    gp, seconds = _timed(lambda: ExactGP(device=device, independent_outputs=True).fit(X, Y), device)
    rows = [_row("independent", "gpfast ExactGP(independent_outputs=True), batched", device, Y.shape, Y.shape[1],
                 seconds, [gp])]  # fmt: skip
    batched_mean = gp.predict(Xt)
    singles, seconds = _single_fits(X, Y, device, loop)
    rows.append(_row("independent", "loop of gpfast ExactGP fits", device, Y.shape, loop, seconds, singles))
    gaps = [np.abs(batched_mean[:, j] - g.predict(Xt)).max() / Y[:, j].std() for j, g in enumerate(singles)]
    rows[-1]["max_mean_gap_over_std"] = float(max(gaps))
    if sk_loop > 0:
        rows.append(_sklearn_loop(X, Y, sk_loop))
    return rows


def _sklearn_loop(X, Y, loop: int) -> dict:
    """scikit-learn's MultiOutputRegressor(GaussianProcessRegressor) with gpfast's model on the first ``loop``
    columns of Y, on the CPU."""
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel
    from sklearn.multioutput import MultiOutputRegressor

    kernel = ConstantKernel() * RBF(np.ones(X.shape[1])) + WhiteKernel()
    sk = MultiOutputRegressor(GaussianProcessRegressor(kernel, normalize_y=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its ConvergenceWarnings at the kernels' bounds
        _, seconds = _timed(lambda: sk.fit(X, Y[:, :loop]), "cpu")
    method = "scikit-learn MultiOutputRegressor(GaussianProcessRegressor)"
    return _row("independent", method, "cpu", Y.shape, loop, seconds)


def shared_stage(X, Y, device: str, loop: int) -> list[dict]:
    """Stage 3: the columns of Y under one kernel, trained by gpfast's engine, and single fits of the first
    ``loop`` columns."""
    gp, seconds = _timed(lambda: ExactGP(device=device).fit(X, Y), device)
    how = f"({gp.trainer_} trains, {gp.solver_} predicts)"
    rows = [_row("large n", f"gpfast ExactGP, shared hyperparameters {how}", device, Y.shape, Y.shape[1], seconds,
                 [gp])]  # fmt: skip
    singles, seconds = _single_fits(X, Y, device, loop)
    how = f"({singles[0].trainer_} trains, {singles[0].solver_} predicts)"
    rows.append(_row("large n", f"loop of gpfast ExactGP fits {how}", device, Y.shape, loop, seconds, singles))
    return rows


def table(rows: list[dict]) -> str:
    """The Markdown table: each loop's time for all k outputs, measured on a subset and scaled, and the batched
    fit's speed-up over it."""
    first = {}
    lines = []
    for r in rows:
        first.setdefault(r["stage"], r["seconds_for_k"])
        scaled = r["outputs_timed"] < r["k"]
        lines.append(
            [
                r["stage"],
                r["method"],
                r["device"],
                r["n"],
                r["k"],
                r["outputs_timed"],
                f"{r['seconds']:.3g}",
                f"{r['seconds_for_k']:.3g}" + (f" (x {r['k'] / r['outputs_timed']:.3g}, scaled)" if scaled else ""),
                f"{r['seconds_for_k'] / first[r['stage']]:.3g}",
                r.get("converged", ""),
                "" if "n_iter_mean" not in r else f"{r['n_iter_mean']:.1f} / {r['n_iter_max']}",
                f"{r['max_mean_gap_over_std']:.2g}" if "max_mean_gap_over_std" in r else "",
            ]
        )
    columns = ["stage", "method", "device", "n", "outputs k", "outputs timed", "time, s", "time for k, s",
               "time for k / first row's", "converged", "iterations mean / max", "max mean gap / std"]  # fmt: skip
    return md_table(columns, lines)


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu; scikit-learn always runs on the CPU)")
    ap.add_argument("--small", action="store_true", help=f"the CPU sizes {SMALL} instead of {FULL}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-sklearn", action="store_true", help="leave scikit-learn's loop out")
    ap.add_argument("--stem", default=None, help="results file stem (default batched_gps_<device>)")
    args = ap.parse_args(argv)
    sizes = dict(SMALL if args.small else FULL)
    if args.no_sklearn:
        sizes["sk_loop"] = 0
    device = args.device
    rng = np.random.default_rng(args.seed)
    X, Xt = rng.normal(size=(sizes["n"], sizes["d"])), rng.normal(size=(N_TEST, sizes["d"]))
    _warm_up(device, sizes["d"])
    rows = independent_stage(X, targets(X, sizes["k"], args.seed + 1), Xt, device, sizes["loop"], sizes["sk_loop"])
    for r in rows:
        print(r, flush=True)
    XL = rng.normal(size=(sizes["n_large"], sizes["d"]))
    large = shared_stage(XL, targets(XL, sizes["k_large"], args.seed + 2), device, sizes["large_loop"])
    for r in large:
        print(r, flush=True)
    rows += large
    stem = args.stem or f"batched_gps_{torch.device(device).type}"
    header = f"Many GPs on the same inputs: one batched fit against loops of single fits ({machine(device)})"
    notes = (
        "Loops timed on 'outputs timed' outputs and scaled linearly to k (marked 'scaled'). 'time for k / first "
        "row's': each row's time for all k outputs over its stage's first row's (the batched fit's). 'max mean "
        "gap / std': the largest difference between the batched fit's predicted means and the single fits' on the "
        "timed outputs, at 200 test points, over std(y_j). Synthetic targets (experiments/batched_gps.py: "
        f"targets), d = {sizes['d']}, fitted to convergence (max_iter 1000 as a cap)."
    )
    text = write_results(
        RESULTS, stem, header, f"{notes}\n\n{table(rows)}", rows, **sizes
    )  # an absolute stem: elsewhere
    print(text)
    return text


if __name__ == "__main__":
    main()
