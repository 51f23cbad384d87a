"""The million-point fit: ``gpfast.ExactGP`` on 1M synthetic points (d = 8), 50 Adam steps with the
training engine, then predictions at 10k test points, in calls of at most a few minutes each.

    python -m experiments.fit1m --state .ckpt/fit1m --out OUTDIR      # call again until it prints "fit1m: done"

Every call resumes where the last one stopped, from files in ``--state`` (a git-ignored folder):

1. ``fit.ckpt``: the fit's checkpoint (``ExactGP(checkpoint=(..., 1))``, a write every step; about 45 MB at 1M points),
   until the 50 steps are taken; then ``train.pt``: the fitted hyperparameters and standardisation, the loss,
   CG iterations and wall time of every step.
2. ``mean.pt``: the predictive mean's solve ``alpha = K̂^-1 (y - c)`` by gpfast's PCG (rank-100 pivoted-Cholesky
   preconditioner, ``CGSettings.predict_cg_tolerance`` 0.01), in rounds of ``--cg-round`` iterations, each
   warm-started from the last round's solution and saved.
3. ``var.pt``: predictive variances from a rank-``--lanczos`` Lanczos decomposition of K̂ (GPyTorch's LOVE idea,
   Pleiss et al. 2018: ``var(x*) = s + noise - k*^T Q T^-1 Q^T k*``, the Krylov space started from
   ``K(X, X*) 1``). ``k*^T Q T^-1 Q^T k*`` is a Galerkin projection of ``k*^T K̂^-1 k*``, never larger, so these
   variances are upper bounds of the exact ones (and the NLL, if anything, pessimistic).
4. Test RMSE and NLL (standardised units), written with the per-step times and the totals to
   ``OUTDIR/fit1m.{md,json}``.

``ExactGP.predict`` itself is not used at this size: its CG predictions solve for every test point's variance.
Times: the result gives each engine step's wall time and their sum (the training proper); ``calls.json`` has each
call's phases and wall time up to its last completed phase (a call cut by ``timeout`` records no time for the
phase it was in: the stage's log has the clock times).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import warnings
from pathlib import Path

import torch

from experiments import RESULTS
from gpfast import datasets, ops
from gpfast.bench.report import md_table, write_results
from gpfast.estimator import ExactGP
from gpfast.estimator.prediction import hyperparameters_float64
from gpfast.metrics import regression_metrics
from gpfast.train.cg import pcg
from gpfast.train.preconditioner import Preconditioner, pivoted_cholesky
from gpfast.train.product import CovarianceProduct


def _save(obj, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".part")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(args, data, device, state: Path) -> dict:
    gp = ExactGP(
        solver="cg",
        optimizer="adam",
        tol=0,
        lr=args.lr,
        max_iter=args.iters,
        random_state=args.seed,
        device=str(device),
        dtype="float32",
        checkpoint=(state / "fit.ckpt", 1),
        verbose=not args.quiet,
    )
    gp.fit(data.X_train, data.y_train)
    hyp = {k: v.cpu() for k, v in hyperparameters_float64(gp.model_).items()}
    out = {
        "hyp": hyp,
        "x_mean": torch.as_tensor(gp.x_mean_),
        "x_std": torch.as_tensor(gp.x_std_),
        "y_mean": gp.y_mean_,
        "y_std": gp.y_std_,
        "history": gp.history_,
        "step_s": gp.step_seconds_,
        "cg_iterations": gp.cg_iterations_,
        "cg_residuals": gp.cg_residuals_,
        "n_iter": gp.n_iter_,
        "noise": gp.noise_,
        "outputscale": gp.outputscale_,
        "lengthscale": gp.lengthscale_.tolist(),
    }
    _save(out, state / "train.pt")
    return out


def _problem(data, tr, device):
    """Standardised float32 training inputs, residual y - c, test inputs, and the product at the fitted values."""
    f32 = torch.float32
    xm, xs = tr["x_mean"].to(device), tr["x_std"].to(device)
    X = ((torch.as_tensor(data.X_train, device=device).double() - xm) / xs).to(f32)
    Xt = ((torch.as_tensor(data.X_test, device=device).double() - xm) / xs).to(f32)
    y = (torch.as_tensor(data.y_train, device=device).double() - tr["y_mean"]) / tr["y_std"]
    h = tr["hyp"]
    ls = h["lengthscale"].reshape(-1).to(device, f32)
    s, noise = h["outputscale"].to(device, f32), h["noise"].to(device, f32)
    r = (y - float(h["mean"])).to(f32)
    product = CovarianceProduct(X, "matrix_free")
    product.update(ls, s, noise)
    return X, Xt, r, ls, s, noise, product


def solve_mean(args, data, tr, device, state: Path) -> dict:
    X, Xt, r, ls, s, noise, product = _problem(data, tr, device)
    path = state / "mean.pt"
    saved = torch.load(path) if path.exists() else {"x": None, "iterations": 0, "rel_residual": math.inf}
    s_host, noise_host = float(tr["hyp"]["outputscale"]), float(tr["hyp"]["noise"])
    diag = torch.full((X.shape[0],), s_host, dtype=X.dtype, device=device)
    pc = Preconditioner(pivoted_cholesky(product.kernel_rows, diag, args.rank), s_host, X.dtype)
    pc.set_scales(s_host, noise_host)
    B = r.unsqueeze(1)
    while saved["rel_residual"] > args.cg_tol and saved["iterations"] < args.cg_max:
        x0 = saved["x"].to(device).unsqueeze(1) if saved["x"] is not None else None
        res = pcg(product.matmul, B, pc.solve, x0, None, args.cg_tol, args.cg_round)
        saved = {
            "x": res.x[:, 0].cpu(),
            "iterations": saved["iterations"] + res.iterations,
            "rel_residual": float(res.rel_residual.max()),
        }
        _save(saved, path)
        print(f"mean solve: {saved['iterations']} PCG iterations, relative residual {saved['rel_residual']:.2e}")
    alpha = saved["x"].to(device)
    mean = float(tr["hyp"]["mean"]) + ops.rbf_matmul(Xt, X, ls, s, alpha.unsqueeze(1), check_values=False)[:, 0]
    return {**saved, "mean": mean.double().cpu()}


def lanczos_variance(args, data, tr, device) -> tuple[torch.Tensor, int]:
    """Predictive variances (standardised units, noise included) from a rank-k Lanczos decomposition of K̂."""
    X, Xt, _, ls, s, noise, product = _problem(data, tr, device)
    n, k = X.shape[0], args.lanczos
    ones = torch.ones(Xt.shape[0], 1, dtype=X.dtype, device=device)
    q = ops.rbf_matmul(X, Xt, ls, s, ones, check_values=False)[:, 0]
    q = q / q.norm()
    Q = torch.zeros(n, k, dtype=X.dtype, device=device)
    alphas, betas = [], []
    for j in range(k):
        Q[:, j] = q
        v = product.matmul(q.unsqueeze(1))[:, 0]
        alphas.append(float(q.dot(v)))
        for _ in range(2):  # full reorthogonalisation, twice (float32)
            v = v - Q[:, : j + 1] @ (Q[:, : j + 1].t() @ v)
        beta = float(v.norm())
        if j + 1 == k or beta < 1e-6 * abs(alphas[-1]):
            Q = Q[:, : j + 1]
            break
        betas.append(beta)
        q = v / beta
    m = Q.shape[1]
    T = torch.diag(torch.tensor(alphas[:m], dtype=torch.float64))
    if m > 1:
        off = torch.tensor(betas[: m - 1], dtype=torch.float64)
        T += torch.diag(off, 1) + torch.diag(off, -1)
    R = torch.linalg.cholesky(T).to(device)
    KQ = ops.rbf_matmul(Xt, X, ls, s, Q, check_values=False).double()  # (n*, m) = k*^T Q
    W = torch.linalg.solve_triangular(R, KQ.t(), upper=False)  # R^-1 Q^T k*
    reduction = (W * W).sum(0)
    print(f"Lanczos: rank {m}")
    return (float(s) + float(noise) - reduction).clamp_min(0).cpu(), m


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--d", type=int, default=8)
    ap.add_argument("--test", type=int, default=10_000)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rank", type=int, default=100, help="preconditioner rank of the mean's solve")
    ap.add_argument("--cg-tol", type=float, default=0.01)
    ap.add_argument("--cg-round", type=int, default=100, help="PCG iterations between saves of the mean's solve")
    ap.add_argument("--cg-max", type=int, default=2000)
    ap.add_argument("--lanczos", type=int, default=100, help="rank of the variances' Lanczos decomposition")
    ap.add_argument("--state", default=".ckpt/fit1m", help="folder of the resumable state (git-ignored)")
    ap.add_argument("--stem", default="fit1m")
    ap.add_argument("--out", default=str(RESULTS), help="output folder (default experiments/results)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    state = Path(args.state)
    state.mkdir(parents=True, exist_ok=True)
    calls_path = state / "calls.json"
    calls = json.loads(calls_path.read_text()) if calls_path.exists() else []
    t_call = time.perf_counter()
    call = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "phases": []}
    calls.append(call)

    def note(phase):
        call["phases"].append(phase)
        call["wall_s"] = time.perf_counter() - t_call
        calls_path.write_text(json.dumps(calls, indent=1))

    device = torch.device(args.device)
    warnings.filterwarnings("ignore", message=".*CG did not reach its tolerance.*")
    data = datasets.synthetic_split(args.n, args.test, args.d, noise=0.1, seed=args.seed)
    note("data")
    if (state / "train.pt").exists():
        tr = torch.load(state / "train.pt", weights_only=False)
    else:
        resumed = (state / "fit.ckpt").exists()
        print(f"fit1m: training ({'resuming from ' + str(state / 'fit.ckpt') if resumed else 'from the start'})")
        tr = train(args, data, device, state)
        note("train")
    print(f"fit1m: trained, {tr['n_iter']} steps, engine time {sum(tr['step_s']):.1f} s")
    if (state / "pred.pt").exists():
        pred = torch.load(state / "pred.pt")
    else:
        _sync(device)
        t0 = time.perf_counter()
        mean = solve_mean(args, data, tr, device, state)
        note("mean")
        var, rank = lanczos_variance(args, data, tr, device)
        _sync(device)
        pred = {**mean, "var": var, "lanczos_rank": rank, "predict_s_last_call": time.perf_counter() - t0}
        _save(pred, state / "pred.pt")
        note("variance")
    y_test = (torch.as_tensor(data.y_test).double() - tr["y_mean"]) / tr["y_std"]
    scores = regression_metrics(pred["mean"].numpy(), pred["var"].numpy(), y_test.numpy())
    call["wall_s"] = time.perf_counter() - t_call
    calls_path.write_text(json.dumps(calls, indent=1))
    row = {
        "n": args.n,
        "d": args.d,
        "n_test": args.test,
        "steps": tr["n_iter"],
        "device": str(device),
        "step_s": tr["step_s"],
        "train_steps_total_s": float(sum(tr["step_s"])),
        "calls": len(calls),
        "calls_wall_s_of_completed_phases": float(sum(c.get("wall_s", 0.0) for c in calls)),
        "predict_cg_iterations": pred["iterations"],
        "predict_cg_rel_residual": pred["rel_residual"],
        "lanczos_rank": pred["lanczos_rank"],
        "rmse_std": scores["rmse_std"],
        "nll_std": scores["nll_std"],
        "final_loss": tr["history"][-1],
        "history": tr["history"],
        "cg_iterations": tr["cg_iterations"],
        "noise": tr["noise"],
        "outputscale": tr["outputscale"],
        "lengthscale": tr["lengthscale"],
    }
    table = md_table(
        ["n", "d", "steps", "train (s, sum of steps)", "median step (s)", "calls", "test RMSE", "test NLL"],
        [
            [
                row["n"],
                row["d"],
                row["steps"],
                f"{row['train_steps_total_s']:.1f}",
                f"{sorted(row['step_s'])[len(row['step_s']) // 2]:.2f}",
                row["calls"],
                f"{row['rmse_std']:.4f}",
                f"{row['nll_std']:.4f}",
            ]
        ],
    )
    text = write_results(
        args.out,
        args.stem,
        f"gpfast.ExactGP on {args.n} synthetic points (d = {args.d}): {args.iters} Adam steps with the engine, "
        f"resumable calls, then {args.test} test points (mean by PCG to {args.cg_tol}, variance by rank-"
        f"{row['lanczos_rank']} Lanczos: an upper bound)",
        table,
        [row],
    )
    print(text)
    print("fit1m: done")


if __name__ == "__main__":
    main()
