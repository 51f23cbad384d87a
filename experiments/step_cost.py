"""Where a training step's time goes on the CPU, and what each way of taking a step costs (a Cholesky step by
GPyTorch's autograd took 1.11 s at n=3000, d=8, against 0.38 s for GPyTorch's own loop).

Rows, each one step (loss and gradient) on the same synthetic data:

- ``gpytorch loop``: the textbook GPyTorch loop (stock ``ScaleKernel(RBFKernel)``, float32, GPyTorch's default
  settings: above n = 800 that is CG with 10 probe vectors and Lanczos, a stochastic estimate) and an Adam step;
- ``gpytorch autograd cholesky``: a Cholesky step by GPyTorch's autograd (gpfast kernel, float32, GPyTorch's
  ExactMarginalLogLikelihood by autograd through a dense Cholesky), the alternative to ExactGP's;
- ``gpfast exact float64``: ExactGP's Cholesky step (:mod:`gpfast.estimator.exact_objective`: one float64
  Cholesky, ``cholesky_inverse`` and the fused kernel's backward), and its parts;
- ``gpytorch cg (gpfast kernel)``: GPyTorch's CG objective on gpfast's kernel, float32 (ExactGP's ``"cg"`` step).

Timed with ``torch.utils.benchmark`` (median of ``--reps`` runs after a warm-up), rows interleaved round by round
so that load from other jobs on the box hits all of them alike.

    python -m experiments.step_cost [--n 3000] [--d 8] [--threads T]

Writes experiments/results/step_cost.{md,json} (``--stem``), naming the machine, date and commit.
"""

from __future__ import annotations

import argparse
import statistics

import gpytorch
import torch
from torch.utils.benchmark import Timer

from experiments import RESULTS
from gpfast import ops
from gpfast.bench.report import md_table, write_results
from gpfast.estimator.exact_objective import cholesky_objective
from gpfast.estimator.fitting import gpytorch_objective, solver_settings
from gpfast.models import ExactGPModel


def _data(n: int, d: int):
    g = torch.Generator().manual_seed(0)
    X = torch.rand(n, d, generator=g, dtype=torch.float64) * 2 - 1
    y = torch.sin(3 * X[:, 0]) + X[:, 1:].sum(-1) * 0.3 + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    return X, (y - y.mean()) / y.std()


def _model(X, y, dtype, kernel="gpfast"):
    model = ExactGPModel(X.to(dtype), y.to(dtype), gpytorch.likelihoods.GaussianLikelihood(), kernel=kernel)
    model = model.to(dtype)
    model.train()
    model.likelihood.train()
    return model


def steps(n: int, d: int) -> dict:
    """name -> a zero-argument function taking one step (or one part of a step)."""
    X, y = _data(n, d)
    big = 2**62

    gpy = _model(X, y, torch.float32, kernel="gpytorch")
    gpy_closure = gpytorch_objective(gpy)
    opt = torch.optim.Adam(gpy.parameters(), lr=0.1)

    def gpytorch_loop():
        gpy_closure()
        opt.step()

    autograd = _model(X, y, torch.float32)
    autograd_closure = gpytorch_objective(autograd)

    def autograd_cholesky():
        with gpytorch.settings.max_cholesky_size(big):
            autograd_closure()

    cg = _model(X, y, torch.float32)
    cg_closure = gpytorch_objective(cg)

    def cg_step():
        with solver_settings("cg"):  # GPyTorch's CG under its own default settings
            cg_closure()

    exact = _model(X, y, torch.float64)
    exact_closure = cholesky_objective(exact)
    ls = torch.full((1, d), 0.7, dtype=torch.float64, requires_grad=True)
    K = ops.rbf_covariance(X, X, ls, torch.tensor(1.0, dtype=torch.float64))
    A = K.detach().clone()
    A.diagonal().add_(0.01)
    L = torch.linalg.cholesky(A)
    W = torch.randn(n, n, dtype=torch.float64)

    return {
        "gpytorch loop (float32, CG above n=800, Adam step)": gpytorch_loop,
        "gpytorch autograd cholesky (float32)": autograd_cholesky,
        "gpytorch cg (gpfast kernel, float32)": cg_step,
        "gpfast exact float64": exact_closure,
        "  part: K = rbf_covariance, float64": lambda: ops.rbf_covariance(X, X, ls.detach(), 1.0),
        "  part: cholesky, float64": lambda: torch.linalg.cholesky_ex(A),
        "  part: cholesky_inverse, float64": lambda: torch.cholesky_inverse(L),
        "  part: rbf_covariance backward, float64": lambda: torch.autograd.grad(K, ls, W, retain_graph=True),
    }


def fits(n: int, d: int) -> list[dict]:
    """Whole default fits on the same data, training by the exact Cholesky objective (L-BFGS) and by CG (Adam):
    time, iterations, loss evaluations per second and the exact log marginal likelihood reached."""
    import time
    import warnings

    from gpfast import ExactGP

    X, y = _data(n, d)
    rows = []
    for solver in ("cholesky", "cg"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.perf_counter()
            gp = ExactGP(solver=solver, device="cpu", random_state=0).fit(X.numpy(), y.numpy())
            seconds = time.perf_counter() - t0
        # the exact LML of the CG fit too (its own attribute is exact when n allows a Cholesky, as here)
        rows.append(
            {
                "fit": f"ExactGP(solver={solver!r}): {gp.optimizer_}",
                "fit_s": seconds,
                "n_iter": gp.n_iter_,
                "converged": gp.converged_,
                "lml": gp.log_marginal_likelihood_,
                "lml_method": gp.log_marginal_likelihood_method_,
            }
        )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--d", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--stem", default="step_cost")
    parser.add_argument("--fit", action="store_true", help="also time whole default fits by both solvers")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    fns = steps(args.n, args.d)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(args.reps):
        for name, fn in fns.items():
            times[name].append(Timer(stmt="fn()", globals={"fn": fn}).timeit(1).median)
    rows = [{"step": k, "median_s": statistics.median(v), "min_s": min(v)} for k, v in times.items()]
    table = md_table(
        ["step (n=%d, d=%d)" % (args.n, args.d), "median s", "min s"],
        [[r["step"], r["median_s"], r["min_s"]] for r in rows],
    )
    header = (
        f"CPU cost of one training step, n={args.n}, d={args.d}, {torch.get_num_threads()} threads: median of "
        f"{args.reps} interleaved runs (torch.utils.benchmark)"
    )
    fit_rows = fits(args.n, args.d) if args.fit else []
    if fit_rows:
        table += "\n\n" + md_table(
            ["whole fit", "s", "iterations", "converged", "log marginal likelihood"],
            [[r["fit"], r["fit_s"], r["n_iter"], r["converged"], r["lml"]] for r in fit_rows],
        )
    print(write_results(RESULTS, args.stem, header, table, rows + fit_rows, n=args.n, d=args.d))


if __name__ == "__main__":
    main()
