"""What the exact UCI row (``ExactGP(solver="cholesky")`` under Adam, as ``gpfast.bench.compare`` runs it) does on
one data set, step by step: the time of each evaluation of the exact objective, the jitter its factorisation
needed (a retry costs another factorisation), and how many optimiser runs the fit made (the exact path adds a
low-noise run when the first ends at a small noise).

    python -m experiments.exact_row_probe --dataset keggdirected --iters 3 --data-dir .data/uci --device cuda

Prints one line per evaluation and a summary; writes nothing.
"""

from __future__ import annotations

import argparse
import time

import torch

import gpfast.estimator.exact_objective as exact_objective
from gpfast.bench import compare
from gpfast.bench.timing import sync
from gpfast.datasets import load_uci


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="keggdirected")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    data = load_uci(args.dataset, split=0, data_dir=args.data_dir)
    dev = torch.device(args.device)
    X, y = torch.as_tensor(data.X_train).to(dev), torch.as_tensor(data.y_train).to(dev)
    Xt = torch.as_tensor(data.X_test).to(dev)
    plain = exact_objective.robust_cholesky
    seen = {"jitters": [], "t": time.perf_counter(), "evals": 0}

    def counted(A, *a, **k):
        L, jitter = plain(A, *a, **k)
        sync(dev)
        now = time.perf_counter()
        seen["evals"] += 1
        seen["jitters"].append(jitter)
        print(f"evaluation {seen['evals']}: factorised {now - seen['t']:.2f} s after the last, jitter {jitter:.3g}",
              flush=True)  # fmt: skip
        seen["t"] = now
        return L, jitter

    exact_objective.robust_cholesky = counted
    init = compare.default_init(X.shape[1])
    t0 = time.perf_counter()
    info, train_s, _, _, _ = compare._run_gpfast_row(
        X, y, Xt, args.iters, 0.1, 0, args.device, False, init, solver="cholesky"
    )
    print(
        f"{args.dataset}: n={X.shape[0]}, d={X.shape[1]}: {seen['evals']} evaluations of the exact objective for "
        f"{args.iters} Adam steps ({seen['evals'] / (args.iters + 1):.1f} runs' worth), train {train_s:.1f} s, "
        f"whole {time.perf_counter() - t0:.1f} s, evaluations with jitter: {sum(j > 0 for j in seen['jitters'])}",
        flush=True,
    )


if __name__ == "__main__":
    main()
