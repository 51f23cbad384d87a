"""What a CG solve's CUDA graph costs the host: a solve of m iterations as the training engine runs it (the first
iteration op by op, then a fresh capture replayed m - 1 times) against the same solve replaying a graph captured
before (what keeping one graph across the steps of a fit would cost), and against all m iterations op by op.

    python -m experiments.cg_graph_cost --n 13500 36000 --iterations 8 24

The system is a stored float32 K (an RBF covariance of n Gaussian points in d = 8, plus noise 0.01) times
t = 1 + CGSettings().probes_for(n) columns, with a diagonal preconditioner, so that the iteration is the engine's
own (:class:`gpfast.train.cg._Iteration`: the product, about 25 small kernels of vector work, one preconditioner
apply) with a cheaper preconditioner than the engine's low-rank one. Times are wall milliseconds per solve from the
call to the device's end (synchronised: the host's capture, instantiation and launches count, as they do in a
training step), the median of ``--reps`` solves after warm-up. "capture overhead" is the engine's solve less the
replay-only solve: the host cost a persistent graph would save per step; "kept vs engine" the largest difference of
the two solves' solutions relative to the largest entry (the same arithmetic: it should be zero or rounding). Writes
experiments/results/cg_graph_cost.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from experiments import RESULTS
from gpfast import ops
from gpfast.bench.report import md_table, write_results
from gpfast.train.cg import CUDAGraphs, KeptIteration, pcg
from gpfast.train.product import stored_matmul
from gpfast.train.settings import CGSettings


def _wall_ms(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def measure(n: int, iterations: int, reps: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(n)
    X = torch.randn(n, 8, device="cuda", generator=gen)
    K = ops.rbf_covariance(X, X, torch.full((8,), 1.5, device="cuda"), 1.0)
    K.diagonal().add_(0.01)
    t = 1 + CGSettings().probes_for(n)
    B = torch.randn(n, t, device="cuda", generator=gen)
    scale = 1.0 / K.diagonal().unsqueeze(1)

    def matmul(V):
        return stored_matmul(K, V)

    def precond(R):
        return R * scale

    graphs = CUDAGraphs(torch.device("cuda"))
    check = []  # no host read inside the solve: the times are the iterations' and the graph's alone

    def engine_solve():
        return pcg(matmul, B, precond, tol=0.0, max_iter=iterations, check_at=check, graph=graphs)

    def op_by_op():
        pcg(matmul, B, precond, tol=0.0, max_iter=iterations, check_at=check)

    kept = KeptIteration()  # the engine's CGSettings(cuda_graph_reuse=True): captured once, then replayed

    def kept_solve():
        return pcg(matmul, B, precond, tol=0.0, max_iter=iterations, check_at=check, graph=graphs, kept=kept,
                   reads=(K, scale))  # fmt: skip

    engine = _wall_ms(engine_solve, reps)
    replay = _wall_ms(kept_solve, reps)
    plain = _wall_ms(op_by_op, reps)
    product = _wall_ms(lambda: matmul(B), reps)
    # the kept graph runs the engine's arithmetic: its solution against the engine solve's, relative to the largest
    x = engine_solve().x
    diff = float((kept_solve().x - x).abs().max() / x.abs().max())
    return {"n": n, "t": t, "iterations": iterations, "engine_ms": engine, "kept_graph_ms": replay,
            "kept_captures": kept.captures, "op_by_op_ms": plain, "capture_overhead_ms": engine - replay,
            "product_ms": product, "products_floor_ms": iterations * product, "kept_vs_engine": diff}  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[13500, 36000])
    parser.add_argument("--iterations", type=int, nargs="+", default=[8, 24])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--stem", default="cg_graph_cost")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("cg_graph_cost measures CUDA graphs: it needs a GPU")
    rows = [measure(n, m, args.reps) for n in args.n for m in args.iterations]
    cols = ["n", "t", "iterations", "engine_ms", "kept_graph_ms", "op_by_op_ms", "capture_overhead_ms",
            "product_ms", "products_floor_ms", "kept_vs_engine", "kept_captures"]  # fmt: skip
    table = md_table(cols, [[r[c] for c in cols] for r in rows])
    text = write_results(args.out, args.stem, "A CG solve's CUDA graph: captured per solve, kept, or none", table,
                         rows)  # fmt: skip
    print(text)


if __name__ == "__main__":
    main()
