"""Time per training iteration and peak GPU memory against n, gpfast vs stock GPyTorch.

Synthetic data (gpfast.datasets.synthetic, d=8). One iteration = one Adam step of an exact GP on
ExactMarginalLogLikelihood with GPyTorch's default settings (CG + stochastic Lanczos quadrature above 800
points, pivoted-Cholesky preconditioner of rank 15), float32. The only difference between the two rows is the
kernel: ``gpfast.kernels.ScaleRBFKernel`` (K stored up to ``gpfast.kernels.MATRIX_FREE_THRESHOLD`` entries,
matrix-free above) vs ``ScaleKernel(RBFKernel())``.
Median of ``--reps`` iterations after one warm-up iteration. Writes experiments/results/scaling.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import gpytorch
import torch

from experiments import RESULTS
from gpfast.bench.report import md_table, write_results
from gpfast.bench.timing import git_rev, machine, today
from gpfast.datasets import synthetic
from gpfast.bench.compare import gpytorch_adam
from gpfast.models import ExactGPModel


def iteration_time(which: str, n: int, d: int, reps: int):
    X, y = synthetic(n, d, seed=0)
    x, yt = torch.as_tensor(X, device="cuda"), torch.as_tensor(y, device="cuda")
    # the same model as rows (a) and (b) of `gpfast compare`; only the kernel differs
    lik = gpytorch.likelihoods.GaussianLikelihood()
    model = ExactGPModel(x, yt, lik, kernel="gpytorch" if which == "gpytorch" else "gpfast").cuda()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gpytorch_adam(model, 1, 0.1)  # one step of GPyTorch's loop (a fresh Adam: its state does not change the time)
        torch.cuda.synchronize()
        if i:  # the first one is warm-up
            times.append(time.perf_counter() - t0)
    return statistics.median(times), torch.cuda.max_memory_allocated() / 1e9


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10000, 20000, 40000, 100000, 200000])
    parser.add_argument("--gpytorch-max", type=int, default=60000, help="largest n tried with stock GPyTorch")
    parser.add_argument("--d", type=int, default=8)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the rows of experiments/results/scaling.json for sizes not run now (each row "
        "names its machine, date and commit)",
    )
    parser.add_argument("--plot-only", action="store_true", help="run nothing: redraw scaling.png from the JSON")
    args = parser.parse_args(argv)
    rows = []
    if args.plot_only:
        old = json.loads((RESULTS / "scaling.json").read_text())
        plot([{"machine": old.get("machine"), "date": old.get("date"), **r} for r in old["rows"]])
        return
    if args.keep and (RESULTS / "scaling.json").exists():
        old = json.loads((RESULTS / "scaling.json").read_text())
        meta = {k: old.get(k) for k in ("machine", "date", "commit")}
        rows = [{**meta, **r} for r in old["rows"] if r["n"] not in args.sizes]
    for n in args.sizes:
        for which in ("gpfast", "gpytorch"):
            row = {"n": n, "kernel": which, "machine": machine(), "date": today(), "commit": git_rev()}
            if which == "gpytorch" and n > args.gpytorch_max:
                row.update(s_per_iter="not run", peak_gb="not run")
            else:
                try:
                    row["s_per_iter"], row["peak_gb"] = iteration_time(which, n, args.d, args.reps)
                except torch.OutOfMemoryError:
                    row.update(s_per_iter="OOM", peak_gb="OOM")
            torch.cuda.empty_cache()
            rows.append(row)
            print(row, flush=True)
    rows.sort(key=lambda r: (r["n"], r["kernel"]))
    table = md_table(
        ["n", "kernel", "s / iteration", "peak GPU GB", "date", "commit"],
        [[r["n"], r["kernel"], r["s_per_iter"], r["peak_gb"], r.get("date"), r.get("commit")] for r in rows],
    )
    print(write_results(RESULTS, "scaling", "Exact-GP training iteration vs n (synthetic, d=8, float32)", table, rows))
    plot(rows)


def plot(rows: list[dict]) -> None:
    """scaling.png from the rows, plus the one-GPU training iterations of bench_distributed.json (1M, 2M) as
    their own series: those are single iterations timed without a warm-up iteration, by another script."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for which, style in (("gpfast", "o-"), ("gpytorch", "s--")):
        pts = [
            (r["n"], r["s_per_iter"], r["peak_gb"])
            for r in rows
            if r["kernel"] == which and isinstance(r["s_per_iter"], float)
        ]
        if pts:
            ax[0].loglog([p[0] for p in pts], [p[1] for p in pts], style, label=which)
            ax[1].loglog([p[0] for p in pts], [p[2] for p in pts], style, label=which)
        oom = [r["n"] for r in rows if r["kernel"] == which and r["s_per_iter"] == "OOM"]
        for i, n in enumerate(oom):
            ax[0].axvline(n, color="gray", ls=":", label=f"{which} out of memory" if i == 0 else None)
    dates = {str(r.get("date")) for r in rows}
    dist = RESULTS / "bench_distributed.json"
    if dist.exists():
        one_gpu = [r for r in json.loads(dist.read_text()) if r.get("gpus") == 1 and "train_iter_s" in r]
        pts = sorted(
            (r["n"], r["train_iter_s"], r.get("train_peak_gb_max_rank", r.get("train_peak_gb"))) for r in one_gpu
        )
        dates |= {str(r.get("date")) for r in one_gpu}
        if pts:
            label = "gpfast, 1 iteration without warm-up (bench_distributed.py, 1 GPU)"
            ax[0].loglog([p[0] for p in pts], [p[1] for p in pts], "D", color="C0", mfc="none", label=label)
            ax[1].loglog([p[0] for p in pts], [p[2] for p in pts], "D", color="C0", mfc="none", label=label)
    ax[0].set_xlabel("n")
    ax[0].set_ylabel("seconds per training iteration")
    ax[1].set_xlabel("n")
    ax[1].set_ylabel("peak GPU memory (GB)")
    ax[0].legend(fontsize=7, loc="upper left")  # the memory panel uses the same markers
    machines = sorted({str(r.get("machine")) for r in rows})
    fig.suptitle(
        f"Exact-GP training iteration, synthetic d=8, float32 - {'; '.join(machines)}, {', '.join(sorted(dates))}",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(RESULTS / "scaling.png", dpi=110)


if __name__ == "__main__":
    main()
