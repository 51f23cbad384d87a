"""Does the training engine reach the same fit as Adam with exact gradients? A study on subsets of UCI sets.

    python -m experiments.engine_accuracy --datasets kin40k pol --sizes 4000 --data-dir /path/to/uci
    python -m experiments.engine_accuracy --device cuda --sizes 0 --n-test 0 --datasets pol elevators bike \
        kin40k protein keggdirected keggundirected                      # the whole sets, on a GPU

For each set and size n (the first n training rows of split 0, the first ``--n-test`` test rows), the same 50 Adam
steps (lr 0.1, from GPyTorch's default hyperparameters) are taken twice:

- (x) with exact gradients: ``ExactGP(solver="cholesky", optimizer="adam")``, the float64 Cholesky objective;
- (c) with gpfast's training engine (``trainer="gpfast"``, float32), once per ``--variant`` (``label=json`` of
  the fields of ``gpfast.CGSettings``; default: the engine's defaults).

Both are scored by the exact float64 posterior at their fitted hyperparameters (test RMSE and NLL, standardised
units). The bounds checked in the table: RMSE(c) <= 1.01 RMSE(x) and NLL(c) <= NLL(x) + 0.01. The engine rows also
show the mean step time, CG iterations per step, the last step's CG residual and whether the fit warned.
Writes ``<stem>.{md,json}`` in ``--out`` (default experiments/results).
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import numpy as np

import torch

from experiments import RESULTS
from gpfast import ExactGP, ops
from gpfast.bench.compare import default_init
from gpfast.bench.report import md_table
from gpfast.bench.timing import git_rev, machine, today
from gpfast.datasets.uci import load_uci
from gpfast.metrics import gaussian_nll, rmse
from gpfast.models import ExactPosterior

RMSE_RATIO, NLL_EXCESS = 1.01, 0.01


def smooth4(n: int = 1700, n_train: int = 1200, seed: int = 0):
    """The CPU test's problem (tests/test_train.py): a smooth 4-feature function with noise std 0.05, whose fit ends
    at a small noise and an ill-conditioned K̂; returns (X_train, y_train, X_test, y_test)."""
    rng = np.random.default_rng(seed)
    X = rng.uniform(-2, 2, size=(n, 4))
    y = np.sin(1.5 * X[:, 0]) * np.cos(X[:, 1]) + 0.5 * X[:, 2] ** 2 - 0.3 * X[:, 3] + 0.05 * rng.normal(size=n)
    return X[:n_train], y[:n_train], X[n_train:], y[n_train:]


def exact_scores(X, y, Xt, yt, hyper, device) -> tuple[float, float]:
    """Test RMSE and NLL of the exact float64 posterior (:class:`ExactPosterior`) at hyperparameters ``hyper``
    (lengthscale, outputscale, noise, mean), computed on ``device``."""
    lengthscale, outputscale, noise, mean = hyper
    X, Xt = (torch.as_tensor(a, dtype=torch.float64, device=device) for a in (X, Xt))
    ls = torch.as_tensor(np.asarray(lengthscale, dtype=np.float64).reshape(-1), device=device)
    yy = torch.as_tensor(y, dtype=torch.float64, device=device)
    post = ExactPosterior(ops.rbf_covariance(X, X, ls, outputscale), yy, noise, mean, overwrite=True)
    k_ss = torch.full((len(Xt),), float(outputscale), dtype=torch.float64, device=device)
    mu, var = post.predict(ops.rbf_covariance(X, Xt, ls, outputscale), k_ss, return_var=True, include_noise=True)
    return rmse(mu.cpu().numpy(), yt), gaussian_nll(mu.cpu().numpy(), var.cpu().numpy(), yt)


def fit(X, y, init, iters, lr, exact, options=None, device="cpu"):
    """One 50-step Adam fit; returns the fitted hyperparameters and the run's figures."""
    gp = ExactGP(
        max_iter=iters,
        lr=lr,
        optimizer="adam",
        tol=0.0,
        device=device,
        random_state=0,
        standardize=False,
        solver="cholesky" if exact else "cg",
        dtype="float64" if exact else "float32",
        lengthscale_init=np.asarray(init["init_lengthscale"], dtype=np.float64),
        outputscale_init=init["init_outputscale"],
        noise_init=init["init_noise"],
        cg=None if exact else {**(options or {}), "trainer": "gpfast"},
    )
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gp.fit(X, y)
    seconds = time.perf_counter() - t0
    hyper = (gp.lengthscale_, gp.outputscale_, gp.noise_, gp.constant_mean_)
    extra = {"train_s": seconds, "noise": float(gp.noise_)}
    if not exact:
        extra.update(
            step_ms=1e3 * float(np.mean(gp.step_seconds_)),
            cg_iterations=float(np.mean(gp.cg_iterations_)),
            cg_residual_last=float(gp.cg_residuals_[-1]),
            warned=any("CG" in str(w.message) for w in caught),
        )
    return hyper, extra


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", nargs="+", default=["kin40k"], help="UCI names, or smooth4 (the CPU test's problem)")
    ap.add_argument("--data-dir", default=None, help="folder of the UCI sets (default: gpfast.datasets' search order)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[4000], help="training rows (0: the whole set)")
    ap.add_argument("--variant", action="append", default=None, help="label=json of gpfast.CGSettings fields")
    ap.add_argument("--n-test", type=int, default=2000, help="the first n-test test rows (0: all)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--stem", default="engine_accuracy")
    ap.add_argument("--reuse-exact", type=Path, default=None,
                    help="JSON lines (or a results .json) whose (x) rows stand in for this run's (x) fits")  # fmt: skip
    args = ap.parse_args(argv)
    variants = [v.split("=", 1) for v in (args.variant or ["defaults={}"])]
    rows = []
    for name in args.datasets:
        if name == "smooth4":  # synthetic, not a UCI set
            ds = argparse.Namespace(**dict(zip(("X_train", "y_train", "X_test", "y_test"), smooth4())))
        else:
            ds = load_uci(name, 0, data_dir=args.data_dir)
        Xt, yt = ds.X_test[: args.n_test or None], ds.y_test[: args.n_test or None]
        init = default_init(ds.X_train.shape[1])
        for n in args.sizes:
            X, y = ds.X_train[: n or None], ds.y_train[: n or None]
            runs = [("(x) exact gradients", True, None)]
            runs += [(f"(c) engine, {label}", False, json.loads(opts) or None) for label, opts in variants]
            ref = None
            for label, exact, options in runs:
                reused = _reused(args.reuse_exact, name, len(y)) if exact else None
                if reused is not None:
                    rows.append(reused)
                    ref = (reused["rmse_std"], reused["nll_std"])
                    continue
                hyper, extra = fit(X, y, init, args.iters, args.lr, exact, options, args.device)
                rmse, nll = exact_scores(X, y, Xt, yt, hyper, args.device)
                ref = ref or (rmse, nll)
                row = {"dataset": name, "n": len(y), "row": label, "options": options, "rmse_std": rmse,
                       "nll_std": nll, "rmse_ratio": rmse / ref[0], "nll_excess": nll - ref[1], **extra}  # fmt: skip
                row["within"] = row["rmse_ratio"] <= RMSE_RATIO and row["nll_excess"] <= NLL_EXCESS
                rows.append(row)
                print(json.dumps(row, default=str), flush=True)
    write(args, rows)


def _reused(path, name, n):
    """The (x) row for ``name`` at ``n`` points from an earlier run's output (the exact path does not depend on the
    engine), marked as reused; None when absent."""
    if path is None:
        return None
    text = path.read_text()
    rows = json.loads(text)["rows"] if text.lstrip().startswith("{\n") else []
    rows += [json.loads(line) for line in text.splitlines() if line.startswith('{"dataset"')]
    for r in rows:
        if r["dataset"] == name and r["n"] == n and r["row"].startswith("(x)"):
            return {**r, "row": f"{r['row']} (from {path.name})"}
    return None


def write(args, rows) -> None:
    def opt(r, key, fmt):
        return format(r[key], fmt) if key in r else "-"

    table = md_table(
        [
            "set",
            "n",
            "row",
            "train s",
            "step ms",
            "CG it/step",
            "last CG res",
            "warned",
            "test RMSE",
            "RMSE ratio",
            "test NLL",
            "NLL excess",
            "within bounds",
        ],  # fmt: skip
        [
            [
                r["dataset"],
                r["n"],
                r["row"],
                f"{r['train_s']:.1f}",
                opt(r, "step_ms", ".0f"),
                opt(r, "cg_iterations", ".1f"),
                opt(r, "cg_residual_last", ".2g"),
                {True: "yes", False: "no"}.get(r.get("warned"), "-"),
                f"{r['rmse_std']:.4f}",
                f"{r['rmse_ratio']:.4f}",
                f"{r['nll_std']:.4f}",
                f"{r['nll_excess']:+.4f}",
                "yes" if r["within"] else "NO",
            ]  # fmt: skip
            for r in rows
        ],
    )
    info = {"machine": machine(args.device), "date": today(), "commit": git_rev(), "iters": args.iters, "lr": args.lr}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.stem}.json").write_text(json.dumps({**info, "rows": rows}, indent=2, default=str))
    text = (
        f"# gpfast's training engine against Adam with exact gradients on UCI sets ({args.device})\n\n"
        f"Machine: {info['machine']}. Date: {info['date']}. Commit: {info['commit']}. {args.iters} Adam steps "
        f"(lr {args.lr}) from GPyTorch's default hyperparameters; (x) float64 Cholesky gradients, (c) the engine in "
        "float32; the first n training rows and the first test rows of split 0 (n in the table: all the rows used); "
        "train s and step ms are wall times (on a shared CPU they say little); both scored by the exact float64 "
        f"posterior at their fitted hyperparameters (standardised units). Bounds: RMSE ratio <= {RMSE_RATIO}, NLL "
        f"excess <= {NLL_EXCESS}.\n\n" + table + "\n"
    )
    (args.out / f"{args.stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
