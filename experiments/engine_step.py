"""Training steps of gpfast's engine on synthetic data of any size (up to the 1M-point, d=8 benchmark).

    python -m experiments.engine_step --n 1000000 --d 8 --steps 3

One untimed warm-up step (Adam, lr 0.1, GPyTorch's initial hyperparameters), then ``--steps`` timed steps: each
the engine's objective (products, CG, preconditioner upkeep, fused backward) plus the Adam update, with the device
synchronised. Prints and writes (experiments/results/engine_step.{md,json}) the median step time, and for each
step the CG iterations, the products with K̂ (CG iterations plus the warm start's initial residual; one fused
backward comes on top), the final CG residual and whether K was stored or matrix-free.
"""

from __future__ import annotations

import argparse
import statistics
import time

import gpytorch
import torch

from experiments import RESULTS, cg_fields
from gpfast import datasets
from gpfast.bench.report import md_table, write_results
from gpfast.bench.timing import sync
from gpfast.estimator.solver import free_memory_bytes
from gpfast.models import ExactGPModel
from gpfast.train import CGSettings, Engine


def run(n: int, d: int, steps: int, device: str, options: dict) -> dict:
    data = datasets.synthetic_split(n, 1, d, noise=0.1, seed=0)
    dev = torch.device(device)
    X = torch.as_tensor(data.X_train, dtype=torch.float32, device=dev)
    y = torch.as_tensor(data.y_train, dtype=torch.float32, device=dev).reshape(-1)
    torch.manual_seed(0)
    model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood()).to(dev)
    engine = Engine(CGSettings(**options), free_memory=free_memory_bytes(dev))
    closure = engine.objective(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model.train()
    times = []
    for i in range(steps + 1):
        sync(dev)
        t0 = time.perf_counter()
        loss = closure()
        opt.step()
        sync(dev)
        times.append(time.perf_counter() - t0)
        rec = engine.record
        print(
            f"step {i}{' (warm-up)' if i == 0 else ''}: {times[-1]:.2f} s, loss {float(loss):.4f}, CG iterations "
            f"{rec.cg_iterations[-1]}, products {rec.products[-1]} + 1 backward, residual "
            f"{rec.cg_residuals[-1]:.2e}, preconditioner rebuilt {rec.rebuilt[-1]}",
            flush=True,
        )
    # not engine.finish(): when the last step missed CG's tolerance it solves that step again to the tolerance to
    # judge the gradient, minutes at 10^6 points, and this benchmark of the step's time needs only the records
    rec = engine.record
    if engine.product is not None:
        engine.product.release()
    return {
        "n": n,
        "d": d,
        "device": str(dev),
        "product": rec.product,
        "product_reason": rec.product_reason,
        "preconditioner_rank": rec.preconditioner_rank,
        "step_s": times[1:],
        "median_step_s": statistics.median(times[1:]),
        "warmup_step_s": times[0],
        "cg_iterations": rec.cg_iterations,
        "products": rec.products,
        "cg_residuals": rec.cg_residuals,
        "settings": str(engine.settings),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--d", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up step")
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an CGSettings field, e.g. --option preconditioner_rank=100 (repeatable)",
    )
    ap.add_argument("--stem", default="engine_step")
    ap.add_argument("--out", default=str(RESULTS), help="output folder (default experiments/results)")
    args = ap.parse_args(argv)
    row = run(args.n, args.d, args.steps, args.device, cg_fields(args.option, "--option"))
    table = md_table(
        ["n", "d", "product", "median step (s)", "steps (s)", "CG iterations", "products / step", "final residuals"],
        [
            [
                row["n"],
                row["d"],
                row["product"],
                f"{row['median_step_s']:.3f}",
                ", ".join(f"{t:.3f}" for t in row["step_s"]),
                row["cg_iterations"][1:],
                row["products"][1:],
                ", ".join(f"{r:.1e}" for r in row["cg_residuals"][1:]),
            ]
        ],
    )
    print(
        write_results(
            args.out,
            args.stem,
            f"gpfast training engine: one step at n = {args.n}, d = {args.d} "
            f"(median of {args.steps} after a warm-up step)",
            table,
            [row],
        )
    )


if __name__ == "__main__":
    main()
