"""K @ V split over GPUs with torch.distributed: ``torchrun --nproc-per-node=K -m experiments.bench_distributed``.

Each rank computes its block of rows of K(x, x) @ V (d=8, t=16) and the blocks are all-gathered, as
:class:`gpfast.distributed.DistributedRBFLinearOperator` does inside CG. Median wall time (CUDA-synchronised,
after one warm-up) on rank 0; results appended to experiments/results/bench_distributed.json.

With ``--train-iter`` it also times one training iteration (one Adam step on ExactMarginalLogLikelihood with
GPyTorch's default CG/SLQ settings, float32) of :class:`gpfast.models.ExactGPModel` with ``distributed=True`` on
synthetic data (``gpfast.datasets.synthetic``, d=8). At these sizes one iteration takes tens of seconds, so it is
timed once, with no warm-up iteration; the K @ V runs before it have already loaded every kernel.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from experiments import RESULTS
from gpfast.bench.timing import git_rev, machine, today
from gpfast.kernels import RBFLinearOperator, distributed


def train_iteration(n: int, device) -> dict:
    import gpytorch

    from gpfast.datasets import synthetic
    from gpfast.bench.compare import gpytorch_adam
    from gpfast.models import ExactGPModel

    X, y = synthetic(n, 8, seed=0)  # the same data on every rank
    x, yt = torch.as_tensor(X, device=device), torch.as_tensor(y, device=device)
    torch.manual_seed(0)  # the same probe vectors on every rank
    lik = gpytorch.likelihoods.GaussianLikelihood().to(device)
    model = ExactGPModel(x, yt, lik, distributed=True).to(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    torch.distributed.barrier()
    t0 = time.perf_counter()
    loss = gpytorch_adam(model, 1, 0.1)[0]  # one step of GPyTorch's loop
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    peak = torch.tensor(float(torch.cuda.max_memory_allocated()), device=device)
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)  # the largest over the ranks
    return {"train_iter_s": elapsed, "train_loss": loss, "train_peak_gb_max_rank": peak.item() / 1e9}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000000, 2000000])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--train-iter", action="store_true", help="also time one exact-GP training iteration")
    args = parser.parse_args(argv)
    device = distributed.init()
    k = distributed.world_size()
    for n in args.sizes:
        g = torch.Generator(device="cpu").manual_seed(0)  # the same data on every rank
        x = torch.randn(n, 8, generator=g).to(device)
        v = torch.randn(n, 16, generator=g).to(device)
        l, s = torch.full((1, 8), 1.0, device=device), torch.tensor(1.0, device=device)
        op = RBFLinearOperator(x, x, l, s, distributed=True)
        times = []
        for i in range(args.reps + 1):
            torch.cuda.synchronize()
            torch.distributed.barrier()
            t0 = time.perf_counter()
            out = op._matmul(v)
            torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
        row = {
            "n": n,
            "gpus": k,
            "kv_s": statistics.median(times),
            "machine": machine(),
            "date": today(),
            "commit": git_rev(),
            "checksum": float(out[:1000].double().sum()),
        }
        del op, out, v
        if args.train_iter:
            row.update(train_iteration(n, device))
        if distributed.rank() == 0:  # saved at once: a later, larger size may be stopped by a time limit
            print(row, flush=True)
            path = RESULTS / "bench_distributed.json"
            old = json.loads(path.read_text()) if path.exists() else []
            path.write_text(json.dumps(old + [row], indent=2))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
