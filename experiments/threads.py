"""Small CPU fits on one torch thread against the default count: the measurement behind
``gpfast.estimator.fitting.ONE_THREAD_MAX_N``.

    python -m experiments.threads                    # yacht and synthetic n = 600, 1500 (d = 6), 3 repeats

Each fit is a default ``ExactGP(device="cpu")`` (synthetic sets: ``max_iter=30``) after a one-step warm-up, timed
once per repeat in a fresh child process per thread count, with the fit's own thread rule switched off
(``ONE_THREAD_MAX_N = 0``) so that the count asked for is the count used. Writes ``threads_cpu.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from experiments import RESULTS
from gpfast.bench.report import md_table, write_results

CHILD = """
import json, sys, time, warnings
import torch
import gpfast
from gpfast import datasets
from gpfast.estimator import fitting
warnings.simplefilter("ignore")
threads, name, n, reps = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
fitting.ONE_THREAD_MAX_N = 0
if name == "yacht":
    d = datasets.load_uci("yacht", split=0)
    X, y, kw = d.X_train, d.y_train, {}
else:
    X, y = datasets.synthetic(n, 6, seed=0)
    kw = {"max_iter": 30}
gpfast.ExactGP(max_iter=1, device="cpu").fit(X[:50], y[:50])
times = []
for _ in range(reps):
    t0 = time.perf_counter()
    gpfast.ExactGP(device="cpu", **kw).fit(X, y)
    times.append(time.perf_counter() - t0)
print(json.dumps({"n": int(X.shape[0]), "times": times}))
"""


def measure(threads: int, name: str, n: int, reps: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(threads), name, str(n), str(reps)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="the default count to compare with one thread")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    rows = []
    for name, n in (("yacht", 0), ("synthetic", 600), ("synthetic", 1500)):
        one, many = measure(1, name, n, args.reps), measure(args.threads, name, n, args.reps)
        rows.append({"set": name, "n": one["n"], "one_thread_s": one["times"], "threads_s": many["times"]})
        print(rows[-1], flush=True)
    table = md_table(
        ["set", "n", "1 thread, s", f"{args.threads} threads, s"],
        [
            [
                r["set"],
                r["n"],
                ", ".join(f"{t:.2f}" for t in r["one_thread_s"]),
                ", ".join(f"{t:.2f}" for t in r["threads_s"]),
            ]
            for r in rows
        ],
    )
    print(write_results(args.out, "threads_cpu", "Small CPU fits: one torch thread against the default", table, rows))


if __name__ == "__main__":
    main()
