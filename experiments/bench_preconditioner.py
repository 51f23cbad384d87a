"""The training engine's preconditioner part by part: its build op by op, captured and replayed as a CUDA graph, and
the per-step work at each rank.

    python -m experiments.bench_preconditioner --dataset keggdirected --data-dir .data/uci   # on a GPU
    python -m experiments.bench_preconditioner --synthetic 2000 4 --ranks 50 100 --device cpu

Per (rank, block): the pivoted Cholesky (:func:`gpfast.train.preconditioner.pivoted_cholesky`, ``block`` pivots per
evaluation of candidate rows) on the set's float32 training points at GPyTorch's initial hyperparameters, timed

- op by op (what the engine's first build at a rank costs);
- captured as one CUDA graph (:class:`~gpfast.train.preconditioner.BuildGraph`, host wall time of the capture, once)
  and replayed (what the engine's later builds at that rank cost), with the replay's largest difference from an op-by-op
  build at other hyperparameters (lengthscales x 1.1, outputscale x 0.9), relative to the factor's largest element:
  0 when the replay computes exactly what the ops do;
- the factor's quality, tr(K - L L^T) / tr(K);
- per step, whatever the block: ``set_scales`` (the k x k Cholesky and the inverse that the iterations apply, as
  torch's ``cholesky_inverse`` and as a triangular solve against the identity and one GEMM) and one application of
  P^{-1} to ``--columns`` columns (the engine's 1 + 16 probes).

With ``--kernels N`` (GPU), one op-by-op build at the largest rank and the first block size is also profiled, and
the N kernels that took the most device time are listed under the table (what a replay spends its time on).

Times are medians by CUDA events after warm-up (wall clock on the CPU). Writes ``<stem>.{md,json}`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from experiments import RESULTS
from gpfast import datasets
from gpfast.bench.compare import default_init
from gpfast.bench.report import md_table
from gpfast.bench.timing import git_rev, machine, sync, time_ms, today
from gpfast.datasets.uci import load_uci
from gpfast.train.cg import CUDAGraphs
from gpfast.train import preconditioner
from gpfast.train.preconditioner import BuildGraph, Preconditioner, pivoted_cholesky
from gpfast.train.product import CovarianceProduct


def _inverse_by_trsm(C: torch.Tensor) -> torch.Tensor:
    """C^{-1} as the engine's preconditioner forms it: a triangular solve of C's Cholesky factor against the
    identity and one GEMM."""
    R, _ = torch.linalg.cholesky_ex(C)
    return preconditioner._inverse_by_trsm(R)


def _inverse_by_potri(C: torch.Tensor) -> torch.Tensor:
    R, _ = torch.linalg.cholesky_ex(C)
    return torch.cholesky_inverse(R)


def case(X, rank, block, columns, reps, device) -> dict:
    """One (rank, block) row at the points X (n, d), float32 on ``device``."""
    n, d = X.shape
    init = default_init(d)
    ls = torch.tensor(init["init_lengthscale"], dtype=X.dtype, device=device)
    s = torch.tensor(init["init_outputscale"], dtype=X.dtype, device=device)
    noise = torch.tensor(init["init_noise"], dtype=X.dtype, device=device)
    prod = CovarianceProduct(X, "matrix_free")
    rank = min(rank, n)

    def eager(lengthscale, outputscale):
        rows = lambda i: prod.kernel_rows(i, lengthscale, outputscale)  # noqa: E731
        return pivoted_cholesky(rows, outputscale.expand(n), rank, block=block)

    row = {"n": n, "d": d, "rank": rank, "block": block}
    row["eager_ms"] = time_ms(lambda: eager(ls, s), device, reps=max(1, reps // 3))
    L = eager(ls, s)
    row["trace_error"] = float(1.0 - (L * L).sum() / (n * s.double()))
    row["capture_ms"] = row["replay_ms"] = row["replay_vs_eager"] = float("nan")
    if device.type == "cuda":
        graphs = CUDAGraphs(device)
        with graphs.stream():  # the engine's first build at a rank runs op by op on the capture stream
            eager(ls, s)
        sync(device)
        t0 = time.perf_counter()
        bg = BuildGraph(prod.kernel_rows, n, rank, ls, s, X.dtype, graphs, block=block)
        sync(device)
        row["capture_ms"] = 1e3 * (time.perf_counter() - t0)
        row["replay_ms"] = time_ms(lambda: bg(ls, s), device, reps=reps)
        ls2, s2 = ls * 1.1, s * 0.9
        got, want = bg(ls2, s2).clone(), eager(ls2, s2)
        row["replay_vs_eager"] = float((got - want).abs().max() / want.abs().max())
        del bg, graphs
    pc = Preconditioner(L, s, X.dtype)
    C = pc.gram + float(noise) * torch.eye(rank, dtype=torch.float64, device=device)
    row["inverse_potri_ms"] = time_ms(lambda: _inverse_by_potri(C), device, reps=reps)
    row["inverse_trsm_ms"] = time_ms(lambda: _inverse_by_trsm(C), device, reps=reps)
    M_potri, M_trsm = _inverse_by_potri(C), _inverse_by_trsm(C)
    row["inverse_trsm_vs_potri"] = float((M_trsm - M_potri).abs().max() / M_potri.abs().max())
    pc.set_scales(s, noise)
    V = torch.randn(n, columns, dtype=X.dtype, device=device)
    row["apply_ms"] = time_ms(lambda: pc.solve(V), device, reps=reps)
    return row


def top_kernels(X, rank, block, count, device) -> list[list]:
    """The ``count`` kernels with the most device time in one op-by-op build: ``[name, ms, calls]``."""
    from torch.profiler import ProfilerActivity, profile

    n, d = X.shape
    init = default_init(d)
    ls = torch.tensor(init["init_lengthscale"], dtype=X.dtype, device=device)
    s = torch.tensor(init["init_outputscale"], dtype=X.dtype, device=device)
    prod = CovarianceProduct(X, "matrix_free")
    rows = lambda i: prod.kernel_rows(i, ls, s)  # noqa: E731
    pivoted_cholesky(rows, s.expand(n), min(rank, n), block=block)  # warm-up
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        pivoted_cholesky(rows, s.expand(n), min(rank, n), block=block)
        sync(device)
    kernels = [e for e in prof.key_averages() if float(getattr(e, "self_device_time_total", 0.0)) > 0]
    kernels.sort(key=lambda e: -float(e.self_device_time_total))
    return [[e.key[:90], float(e.self_device_time_total) / 1e3, e.count] for e in kernels[:count]]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="keggdirected")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--synthetic", type=int, nargs=2, metavar=("N", "D"), default=None, help="synthetic data instead")
    ap.add_argument("--ranks", type=int, nargs="+", default=[100, 400, 3200])
    ap.add_argument("--blocks", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--columns", type=int, default=17)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--kernels", type=int, default=0, help="list this many kernels of one build (GPU)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--stem", default="bench_preconditioner")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.synthetic:
        n, d = args.synthetic
        name, X = f"synthetic-{n}-{d}", datasets.synthetic_split(n, 1, d, noise=0.1, seed=0).X_train
    else:
        name, X = args.dataset, load_uci(args.dataset, 0, data_dir=args.data_dir).X_train
    X = torch.as_tensor(X, dtype=torch.float32, device=device)
    rows = []
    for rank in args.ranks:
        for block in args.blocks:
            rows.append({"set": name, **case(X, rank, block, args.columns, args.reps, device)})
            print(json.dumps(rows[-1]), flush=True)
    kernels = []
    if args.kernels and device.type == "cuda":
        kernels = top_kernels(X, max(args.ranks), args.blocks[0], args.kernels, device)
    write(args, rows, device, kernels)


def write(args, rows, device, kernels=()) -> None:
    def ms(v):
        return "–" if v != v else f"{v:.2f}"

    table = md_table(
        ["set", "n", "d", "rank", "block", "op by op ms", "capture ms", "replay ms", "replay vs op by op",
         "tr(K - LL^T) / tr(K)", "C^-1 potri ms", "C^-1 trsm+GEMM ms", "trsm vs potri", "P^-1 V ms"],
        [[r["set"], r["n"], r["d"], r["rank"], r["block"], ms(r["eager_ms"]), ms(r["capture_ms"]), ms(r["replay_ms"]),
          "–" if r["replay_vs_eager"] != r["replay_vs_eager"] else f"{r['replay_vs_eager']:.1e}",
          f"{r['trace_error']:.2e}", ms(r["inverse_potri_ms"]), ms(r["inverse_trsm_ms"]),
          f"{r['inverse_trsm_vs_potri']:.1e}", ms(r["apply_ms"])] for r in rows],
    )  # fmt: skip
    info = {"machine": machine(device), "date": today(), "commit": git_rev(), "device": str(device),
            "columns": args.columns, "reps": args.reps}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.stem}.json").write_text(json.dumps({**info, "rows": rows, "kernels": list(kernels)}, indent=2))
    text = (
        f"# The engine's preconditioner part by part ({device.type})\n\n"
        f"Machine: {info['machine']}. Date: {info['date']}. Commit: {info['commit']}. float32 points at GPyTorch's "
        "initial hyperparameters; the factor in float64. Op by op: a whole build launched from Python; capture: "
        "host time to capture it as one CUDA graph (once per rank in the engine); replay: the graph at new inputs "
        "(replay vs op by op: largest difference from an op-by-op build at other hyperparameters, relative to the "
        "factor's largest element). Per step at that rank: C^-1 (k x k, float64) by torch's cholesky_inverse and by "
        f"a triangular solve against the identity and one GEMM, and one P^-1 V on {args.columns} columns. Medians "
        f"({'CUDA events' if device.type == 'cuda' else 'wall clock'}) in ms.\n\n" + table + "\n"
    )
    if kernels:
        text += (
            f"\nThe kernels with the most device time in one op-by-op build (rank {max(args.ranks)}, "
            f"{args.blocks[0]} pivots a block; torch.profiler):\n\n"
            + md_table(["kernel", "ms", "calls"], [[k, f"{ms:.2f}", c] for k, ms, c in kernels])
            + "\n"
        )
    (args.out / f"{args.stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
