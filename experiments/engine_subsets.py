"""Does gpfast's training engine lose accuracy against GPyTorch's loop? A CPU study on subsets of a UCI set.

    python -m experiments.engine_subsets --dataset kin40k --data-dir .data/uci --sizes 4000 12000 --caps 15 40

For each size n (the first n training rows of split 0; the first ``--n-test`` test rows), 50 Adam steps (lr 0.1)
from GPyTorch's default initial hyperparameters with
- (a) GPyTorch's textbook loop (``gpfast.bench.compare.gpytorch_adam``, stock ``RBFKernel``, float32), and
- (c) ``gpfast.ExactGP`` with the training engine (``solver='cg'``, float32) at each CG iteration cap in ``--caps``.

Both are then scored the same way: the exact float64 Cholesky posterior at the fitted hyperparameters (test RMSE
and NLL in standardised units), so that only training differs. For (c) the script also records, at every step
after the first, the relative 2-norm residual of CG's warm start and whether that start was better than a zero
start in CG's own energy norm (``x0^T (b + r0) > 0`` for every column, ``r0 = b - A x0``). Writes
``<stem>.{md,json}`` in ``--out`` (default experiments/results).
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import numpy as np
import torch

import gpfast.train.engine as engine_module
from experiments import RESULTS
from gpfast import ExactGP, ops
from gpfast.bench.compare import default_init, gpytorch_adam, gpytorch_model
from gpfast.bench.report import md_table
from gpfast.bench.timing import git_rev, machine, today
from gpfast.datasets.uci import load_uci
from gpfast.metrics import gaussian_nll, rmse
from gpfast.models import ExactPosterior


def exact_scores(X, y, Xt, yt, lengthscale, outputscale, noise, mean) -> tuple[float, float]:
    """Test RMSE and NLL of the exact float64 posterior (:class:`ExactPosterior`) at the given hyperparameters."""
    X, Xt = torch.as_tensor(X, dtype=torch.float64), torch.as_tensor(Xt, dtype=torch.float64)
    l = torch.as_tensor(np.asarray(lengthscale, dtype=np.float64).reshape(-1))
    post = ExactPosterior(ops.rbf_covariance(X, X, l, outputscale), torch.as_tensor(y), noise, mean, overwrite=True)
    k_ss = torch.full((len(Xt),), float(outputscale), dtype=torch.float64)
    mu, var = post.predict(ops.rbf_covariance(X, Xt, l, outputscale), k_ss, return_var=True, include_noise=True)
    return rmse(mu.numpy(), yt), gaussian_nll(mu.numpy(), var.numpy(), yt)


def run_gpytorch(X, y, init, iters, lr):
    torch.manual_seed(0)
    x_t, y_t = torch.as_tensor(X, dtype=torch.float32), torch.as_tensor(y, dtype=torch.float32)
    model = gpytorch_model(x_t, y_t, "gpytorch", init, "cpu")
    t0 = time.perf_counter()
    gpytorch_adam(model, iters, lr)
    seconds = time.perf_counter() - t0
    cov = model.covar_module
    with torch.no_grad():
        hyper = (
            cov.base_kernel.lengthscale.double().reshape(-1).numpy(),
            float(cov.outputscale),
            float(model.likelihood.noise),
            float(model.mean_module.constant),
        )
    return hyper, seconds, {}


def run_engine(X, y, init, iters, lr, cap):
    starts: list[tuple[float, bool]] = []
    pcg = engine_module.pcg

    def traced(matmul, B, precond, x0=None, warm=None, *args, **kw):
        if x0 is not None and warm is None:  # a fully warm step: measure its start (one extra product)
            R = B - matmul(x0)
            rel = float((torch.linalg.vector_norm(R, dim=0) / torch.linalg.vector_norm(B, dim=0)).max())
            starts.append((rel, bool(((x0 * (B + R)).sum(0) > 0).all())))
        return pcg(matmul, B, precond, x0, warm, *args, **kw)

    engine_module.pcg = traced
    try:
        gp = ExactGP(
            max_iter=iters,
            lr=lr,
            optimizer="adam",
            tol=0.0,
            device="cpu",
            random_state=0,
            standardize=False,
            solver="cg",
            dtype="float32",
            lengthscale_init=np.asarray(init["init_lengthscale"], dtype=np.float64),
            outputscale_init=init["init_outputscale"],
            noise_init=init["init_noise"],
            cg={"max_cg_iterations": cap},
        )
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gp.fit(X, y)
        seconds = time.perf_counter() - t0
    finally:
        engine_module.pcg = pcg
    hyper = (gp.lengthscale_, gp.outputscale_, gp.noise_, gp.constant_mean_)
    extra = {
        "cg_residual_last": float(gp.cg_residuals_[-1]),
        "cg_residual_max": float(max(gp.cg_residuals_)),
        "warm_start_residual_max": max(r for r, _ in starts) if starts else None,
        "warm_start_better_than_zero": all(b for _, b in starts),
    }
    return hyper, seconds, extra


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="kin40k")
    ap.add_argument("--data-dir", default=None, help="folder of the UCI sets (default: gpfast.datasets' search order)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[4000, 12000])
    ap.add_argument("--caps", type=int, nargs="+", default=[15, 40])
    ap.add_argument("--n-test", type=int, default=2000)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--stem", default=None)
    args = ap.parse_args(argv)
    ds = load_uci(args.dataset, 0, data_dir=args.data_dir)
    Xt, yt = ds.X_test[: args.n_test], ds.y_test[: args.n_test]
    init = default_init(ds.X_train.shape[1])
    rows = []
    for n in args.sizes:
        X, y = ds.X_train[:n], ds.y_train[:n]
        runs = [("(a) GPyTorch loop", lambda: run_gpytorch(X, y, init, args.iters, args.lr))]
        runs += [
            (f"(c) engine, CG cap {cap}", lambda cap=cap: run_engine(X, y, init, args.iters, args.lr, cap))
            for cap in args.caps
        ]
        for label, fn in runs:
            hyper, seconds, extra = fn()
            rmse, nll = exact_scores(X, y, Xt, yt, *hyper)
            rows.append({"n": n, "row": label, "train_s": seconds, "rmse_std": rmse, "nll_std": nll,
                         "noise": hyper[2], **extra})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    table = md_table(
        [
            "n",
            "row",
            "train s",
            "test RMSE",
            "test NLL",
            "noise",
            "CG residual: last / max",
            "warm start: max residual",
            "warm start better than zero (energy norm)",
        ],  # fmt: skip
        [
            [
                r["n"],
                r["row"],
                f"{r['train_s']:.1f}",
                f"{r['rmse_std']:.4f}",
                f"{r['nll_std']:.3f}",
                f"{r['noise']:.2e}",
                f"{r['cg_residual_last']:.2g} / {r['cg_residual_max']:.2g}" if "cg_residual_last" in r else "-",
                f"{r['warm_start_residual_max']:.2g}" if r.get("warm_start_residual_max") is not None else "-",
                {True: "every step", False: "NOT every step"}.get(r.get("warm_start_better_than_zero"), "-"),
            ]
            for r in rows
        ],
    )
    stem = args.stem or f"engine_subsets_{args.dataset}"
    info = {"machine": machine(), "date": today(), "commit": git_rev(), "dataset": args.dataset,
            "iters": args.iters, "lr": args.lr, "n_test": len(yt)}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps({**info, "rows": rows}, indent=2, default=float))
    text = (
        f"# gpfast's training engine against GPyTorch's loop on subsets of {args.dataset} (CPU)\n\n"
        f"Machine: {info['machine']}. Date: {info['date']}. Commit: {info['commit']}. {args.iters} Adam steps "
        f"(lr {args.lr}) from GPyTorch's default hyperparameters, float32 training; the first n training rows and "
        f"the first {len(yt)} test rows of split 0; both rows scored by the exact float64 posterior at their "
        "fitted hyperparameters (standardised units). CG residuals: the engine's relative 2-norm residual measure "
        "(the one its ConvergenceWarning names). (c)'s train s includes the warm-start check's extra product per "
        "step.\n\n" + table + "\n"
    )
    (args.out / f"{stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
