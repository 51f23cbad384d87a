"""What a CG fit costs the host around the engine's steps: ``ExactGP(solver="cg", optimizer="adam")`` on small
synthetic problems, where a step's arithmetic is small and the host's work shows, by two paths of the optimiser to
the engine:

- ``natural`` (the default): the hyperparameters' values go to the engine's ``closure.natural`` and the gradient
  comes back with respect to them, on the host;
- ``model``: theta written into the model's raw parameters through their constraints, the gradient set as their
  ``.grad`` by autograd back through the constraints and read from there (the path of any objective without
  ``natural``, forced here by hiding it).

Columns: the fit's training seconds (``fit_seconds_["train"]``), the engine steps' own seconds
(``sum(step_seconds_)``), the time outside them per evaluation, and each path's training time per evaluation.
The median of ``--reps`` fits each, alternating the paths so that load on the box hits both alike, after one
warm-up fit of each. ``first fit``: in a fresh Python process, the first fit's training time outside its steps
(where a process pays its one-time imports), and what constructing torch.optim.Adam costs there.

    python -m experiments.fit_overhead [--n 300 1000 3000] [--iters 50] [--reps 5]

Writes experiments/results/fit_overhead_cpu.{md,json}, naming the machine, date and commit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

import numpy as np

from experiments import RESULTS
from gpfast.bench.report import md_table, write_results

_FIRST_FIT = """
import json, sys, time
import numpy as np
import gpfast
gpfast.ExactGP
n, iters = int(sys.argv[1]), int(sys.argv[2])
rng = np.random.default_rng(0)
X = rng.standard_normal((n, 8)); y = np.sin(X).sum(1) + 0.1 * rng.standard_normal(n)
gp = gpfast.ExactGP(solver="cg", optimizer="adam", max_iter=iters, tol=0, random_state=0).fit(X, y)
import torch
t0 = time.perf_counter(); torch.optim.Adam([torch.zeros(1, requires_grad=True)]); adam = time.perf_counter() - t0
print(json.dumps({"outside": gp.fit_seconds_["train"] - sum(gp.step_seconds_), "adam": adam}))
"""


def _data(n: int):
    rng = np.random.default_rng(n)
    X = rng.standard_normal((n, 8))
    return X, np.sin(X).sum(1) + 0.1 * rng.standard_normal(n)


def _fit(X, y, iters: int, path: str) -> tuple[float, float, int]:
    from gpfast import ExactGP
    from gpfast.train import engine as engine_module

    real = engine_module.Engine.objective

    def without_natural(self, model):
        closure = real(self, model)
        del closure.natural
        return closure

    if path == "model":
        engine_module.Engine.objective = without_natural
    try:
        gp = ExactGP(solver="cg", optimizer="adam", max_iter=iters, tol=0, random_state=0).fit(X, y)
    finally:
        engine_module.Engine.objective = real
    return gp.fit_seconds_["train"], float(sum(gp.step_seconds_)), len(gp.step_seconds_)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[300, 1000, 3000])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--stem", default="fit_overhead_cpu")
    args = parser.parse_args(argv)
    rows = []
    for n in args.n:
        X, y = _data(n)
        runs = {"natural": [], "model": []}
        for path in runs:
            _fit(X, y, args.iters, path)  # warm-up
        for _ in range(args.reps):
            for path in runs:
                runs[path].append(_fit(X, y, args.iters, path))
        first = json.loads(
            subprocess.run([sys.executable, "-c", _FIRST_FIT, str(n), str(args.iters)], check=True,
                           capture_output=True, text=True).stdout.strip().splitlines()[-1]
        )  # fmt: skip
        for path, fits in runs.items():
            train = statistics.median(f[0] for f in fits)
            steps = statistics.median(f[1] for f in fits)
            evals = fits[0][2]
            rows.append({"n": n, "path": path, "evaluations": evals, "train_s": train, "steps_s": steps,
                         "outside_ms_per_eval": 1e3 * (train - steps) / evals, "train_ms_per_eval": 1e3 * train / evals,
                         "first_fit_outside_s": first["outside"] if path == "natural" else float("nan"),
                         "torch_adam_first_s": first["adam"] if path == "natural" else float("nan")})  # fmt: skip
    cols = ["n", "path", "evaluations", "train_s", "steps_s", "outside_ms_per_eval", "train_ms_per_eval",
            "first_fit_outside_s", "torch_adam_first_s"]  # fmt: skip
    table = md_table(cols, [[r[c] for c in cols] for r in rows])
    text = write_results(args.out, args.stem, "A CG fit's host cost around the engine's steps (cpu)", table, rows,
                         iters=args.iters, reps=args.reps)  # fmt: skip
    print(text)


if __name__ == "__main__":
    main()
