"""The CG iteration's column reductions, each as the engine writes it and as a GEMM's diagonal.

Each PCG iteration reduces its (n, t) columns three times: ``p^T A p`` and ``r^T z`` per column as
``(A * B).sum(0)``, and the residual norms as ``torch.linalg.vector_norm(R, dim=0)``. On a GPU each is a
column reduction of a row-major (n, t) matrix with t about 17: 42 calls a step on pol, at 14 us a call in
``step_anatomy``'s op-by-op kernel table. The question was whether one GEMM ``A^T B`` (t x t, 2 n t^2 flops,
nothing at these sizes) and its diagonal, or ``torch.linalg.vecdot``, would be faster. On an H100 (2026-12-05) as
graph replays they were not: ``(A * B).sum(0)`` took 8.9 us at 13,500 rows against 11.5 for the GEMM's diagonal
(the profiler's table adds its own overhead to each call), so the engine keeps torch's reductions.

Per (n, t) and variant: the time per call as a CUDA-graph replay (as inside the engine's kept graph, so without
launch overhead; wall clock per call on the CPU), and the largest relative error against the same reduction in
float64.

    python -m experiments.bench_cg_vectors                      # on a GPU
    python -m experiments.bench_cg_vectors --n 3000 --device cpu

Writes ``<stem>.{md,json}`` in ``--out`` (default experiments/results), naming the machine, date and commit.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from experiments import RESULTS
from gpfast.bench.report import md_table, write_results
from gpfast.bench.timing import graph_time_ms, time_ms

VARIANTS = {
    "dot: (A * B).sum(0)": lambda A, B: (A * B).sum(0),
    "dot: vecdot": lambda A, B: torch.linalg.vecdot(A, B, dim=0),
    "dot: mm(A^T, B).diagonal()": lambda A, B: torch.mm(A.t(), B).diagonal(),
    "norm: vector_norm(A, dim=0)": lambda A, B: torch.linalg.vector_norm(A, dim=0),
    "norm: mm(A^T, A).diagonal().sqrt()": lambda A, B: torch.mm(A.t(), A).diagonal().sqrt(),
}


def _reference(name: str, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    A, B = A.double(), B.double()
    return (A * B).sum(0) if name.startswith("dot") else A.pow(2).sum(0).sqrt()


def rows_for(n: int, t: int, reps: int, device) -> list[dict]:
    A = torch.randn(n, t, device=device)
    B = torch.randn(n, t, device=device) + 0.5 * A  # correlated, so that the sums do not cancel to nothing
    rows = []
    for name, fn in VARIANTS.items():
        if torch.device(device).type == "cuda":
            us = 1e3 * graph_time_ms(lambda fn=fn: fn(A, B), calls_per_graph=50, reps=reps)
        else:
            us = 1e3 * time_ms(lambda fn=fn: fn(A, B), device, reps=reps, warmup=2)
        ref = _reference(name, A, B)
        err = float(((fn(A, B).double() - ref).abs() / ref.abs()).max())
        rows.append({"n": n, "t": t, "variant": name, "us": us, "rel_err": err})
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[13500, 44000])
    ap.add_argument("--t", type=int, nargs="+", default=[17])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--stem", default="bench_cg_vectors")
    args = ap.parse_args(argv)
    rows = [r for n in args.n for t in args.t for r in rows_for(n, t, args.reps, args.device)]
    table = md_table(
        ["n", "t", "variant", "us a call", "max rel. error vs float64"],
        [[r["n"], r["t"], r["variant"], f"{r['us']:.1f}", f"{r['rel_err']:.1e}"] for r in rows],
    )
    how = "CUDA-graph replays of 50 calls, median of " if args.device != "cpu" else "wall clock, median of "
    text = write_results(
        args.out,
        args.stem,
        f"CG's column reductions ({args.device}), float32",
        how + f"{args.reps}.\n\n" + table,
        rows,
        device=args.device,
    )
    print(text)


if __name__ == "__main__":
    main()
