"""CPU timings of gpfast's ops against plain PyTorch and GPyTorch on the same machine.

Wall time by ``time.perf_counter``, median of ``--reps`` runs after one warm-up run, in float32 with the threads
torch uses by default. Columns:

- ``gpfast``: ``gpfast.ops.rbf_covariance`` (forward), or forward plus the backward for x1, lengthscale and
  outputscale given a random grad_K; ``bwd`` alone is ``gpfast.ops.rbf_covariance_backward`` for all four inputs,
  ``bwd masked`` the same with ``x_grads=False`` (lengthscale and outputscale only);
- ``torch``: the float32 formula of ``gpfast._reference`` (the op's pure-PyTorch reference) in eager mode;
- ``GPyTorch``: ``ScaleKernel(RBFKernel(ard_num_dims=d))(x1, x2).to_dense()`` (and its backward);
- for K@V: ``rbf_matmul`` (never stores K) against forming K with the op and multiplying, its forward plus
  backward, and ``rbf_matmul_backward`` alone, as the training engine calls it (all four gradients, or masked).

A second table, by ``torch.utils.benchmark`` (median of blocked runs), gives the host overhead per call at a tiny
shape: the Python wrapper against the raw ``torch.ops.gpfast`` call on canonical tensors.

Writes experiments/results/bench_cpu.{md,json} and bench_cpu_overhead.{md,json} (``--stem`` to change), naming the
machine, date and commit. The header gives the 1-minute load average at the start: other work on the machine slows
every column alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch.utils import benchmark

from experiments import RESULTS
from gpfast.bench.report import md_table, write_results

from gpfast import _reference, ops

COV_SHAPES = [(16, 512, 128, 8), (1, 4000, 4000, 8), (1, 4000, 4000, 32)]
MATMUL_SHAPES = [(8000, 8, 16), (8000, 8, 1)]


def wall_ms(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def covariance_row(B, n, m, d, reps):
    import gpytorch

    g = torch.Generator().manual_seed(0)
    x1, x2 = torch.randn(B, n, d, generator=g), torch.randn(B, m, d, generator=g)
    l, s = torch.rand(B, 1, d, generator=g) + 0.5, torch.rand(B, generator=g) + 0.5
    G = torch.randn(B, n, m, generator=g)

    def fwd_bwd(f):
        a, ll, ss = x1.clone().requires_grad_(), l.clone().requires_grad_(), s.clone().requires_grad_()
        torch.autograd.grad(f(a, ll, ss), (a, ll, ss), G)

    kern = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=d))
    if B > 1:
        kern = gpytorch.kernels.ScaleKernel(
            gpytorch.kernels.RBFKernel(ard_num_dims=d, batch_shape=torch.Size([B])), batch_shape=torch.Size([B])
        )

    def gpy_fwd_bwd():
        a = x1.clone().requires_grad_()
        torch.autograd.grad(kern(a, x2).to_dense(), [a, *kern.parameters()], G)

    with torch.no_grad():
        op = wall_ms(lambda: ops.rbf_covariance(x1, x2, l, s), reps)
        eager = wall_ms(lambda: _reference.rbf_covariance(x1, x2, l, s), reps)
        gpy = wall_ms(lambda: kern(x1, x2).to_dense(), reps)
    bwd = wall_ms(lambda: ops.rbf_covariance_backward(G, x1, x2, l, s), reps)
    bwd_masked = wall_ms(lambda: ops.rbf_covariance_backward(G, x1, x2, l, s, x_grads=False), reps)
    return {
        "shape": f"({B},{n},{m},{d})",
        "fwd_gpfast_ms": op,
        "fwd_torch_ms": eager,
        "fwd_gpytorch_ms": gpy,
        "bwd_gpfast_ms": bwd,
        "bwd_masked_gpfast_ms": bwd_masked,
        "fwd_bwd_gpfast_ms": wall_ms(lambda: fwd_bwd(lambda a, ll, ss: ops.rbf_covariance(a, x2, ll, ss)), reps),
        "fwd_bwd_torch_ms": wall_ms(lambda: fwd_bwd(lambda a, ll, ss: _reference.rbf_covariance(a, x2, ll, ss)), reps),
        "fwd_bwd_gpytorch_ms": wall_ms(gpy_fwd_bwd, reps),
    }


def matmul_row(n, d, t, reps):
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(n, d, generator=g), torch.randn(n, t, generator=g)
    l, s = torch.rand(1, d, generator=g) + 0.5, torch.tensor(1.3)
    G = torch.randn(n, t, generator=g)

    def fwd_bwd():
        a, ll, ss, vv = (u.clone().requires_grad_() for u in (x, l, s, v))
        torch.autograd.grad(ops.rbf_matmul(a, x, ll, ss, vv), (a, ll, ss, vv), G)

    with torch.no_grad():
        mf = wall_ms(lambda: ops.rbf_matmul(x, x, l, s, v), reps)
        dense = wall_ms(lambda: ops.rbf_covariance(x, x, l, s) @ v, reps)
    return {
        "n": n,
        "d": d,
        "t": t,
        "matmul_gpfast_ms": mf,
        "dense_K_then_matmul_ms": dense,
        "matmul_fwd_bwd_gpfast_ms": wall_ms(fwd_bwd, reps),
        "matmul_bwd_gpfast_ms": wall_ms(lambda: ops.rbf_matmul_backward(G, x, x, l, s, v), reps),
        "matmul_bwd_masked_gpfast_ms": wall_ms(lambda: ops.rbf_matmul_backward(G, x, x, l, s, v, x_grads=False), reps),
    }


def overhead_rows(min_run_time: float):
    """Microseconds per call at n = m = 8, d = 2, t = 3 (float32, no autograd): wrapper and raw op."""
    g = torch.Generator().manual_seed(0)
    x1, x2, v = torch.randn(8, 2, generator=g), torch.randn(8, 2, generator=g), torch.randn(8, 3, generator=g)
    l, s = torch.rand(1, 2, generator=g) + 0.5, torch.tensor(1.3)
    x1c, x2c, lc, sc, vc = x1[None], x2[None], l.reshape(1, 2), s.reshape(1), v[None]
    cov, mm = torch.ops.gpfast.rbf_covariance, torch.ops.gpfast.rbf_matmul
    cases = {
        "rbf_covariance": (
            "cov(x1c, x2c, lc, sc)",
            "ops.rbf_covariance(x1, x2, l, s)",
            "ops.rbf_covariance(x1, x2, l, s, check_values=False)",
        ),
        "rbf_matmul": (
            "mm(x1c, x2c, lc, sc, vc)",
            "ops.rbf_matmul(x1, x2, l, s, v)",
            "ops.rbf_matmul(x1, x2, l, s, v, check_values=False)",
        ),
    }
    names = {**globals(), **locals()}

    def us(stmt):
        with torch.no_grad():
            return 1e6 * benchmark.Timer(stmt, globals=names).blocked_autorange(min_run_time=min_run_time).median

    rows = []
    for op, (raw, wrapped, unchecked) in cases.items():
        raw_us, wrapped_us, unchecked_us = us(raw), us(wrapped), us(unchecked)
        rows.append(
            {
                "op": op,
                "raw_op_us": raw_us,
                "wrapper_us": wrapped_us,
                "wrapper_unchecked_us": unchecked_us,
                "overhead_us": wrapped_us - raw_us,
                "overhead_unchecked_us": unchecked_us - raw_us,
            }
        )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--cov-shapes", default=None, help="B,n,m,d;B,n,m,d;... (default: the built-in list)")
    parser.add_argument("--matmul-shapes", default=None, help="n,d,t;n,d,t;... (default: the built-in list)")
    parser.add_argument("--stem", default="bench_cpu")
    parser.add_argument("--overhead-time", type=float, default=1.0, help="seconds per overhead measurement")
    args = parser.parse_args(argv)
    cov = [tuple(map(int, s.split(","))) for s in args.cov_shapes.split(";")] if args.cov_shapes else COV_SHAPES
    mm = [tuple(map(int, s.split(","))) for s in args.matmul_shapes.split(";")] if args.matmul_shapes else MATMUL_SHAPES
    load = os.getloadavg()[0]
    rows = [covariance_row(*shape, args.reps) for shape in cov]
    mrows = [matmul_row(*shape, args.reps) for shape in mm]
    table = md_table(
        [
            "shape (B,n,m,d)",
            "gpfast fwd",
            "torch fwd",
            "GPyTorch fwd",
            "gpfast fwd+bwd",
            "torch fwd+bwd",
            "GPyTorch fwd+bwd",
            "gpfast bwd",
            "gpfast bwd masked",
        ],
        [
            [
                r["shape"],
                r["fwd_gpfast_ms"],
                r["fwd_torch_ms"],
                r["fwd_gpytorch_ms"],
                r["fwd_bwd_gpfast_ms"],
                r["fwd_bwd_torch_ms"],
                r["fwd_bwd_gpytorch_ms"],
                r["bwd_gpfast_ms"],
                r["bwd_masked_gpfast_ms"],
            ]
            for r in rows
        ],
    )
    table += "\n\n" + md_table(
        [
            "n",
            "d",
            "t",
            "rbf_matmul",
            "K then K@V",
            "rbf_matmul fwd+bwd",
            "rbf_matmul_backward",
            "rbf_matmul_backward masked",
        ],
        [
            [
                r["n"],
                r["d"],
                r["t"],
                r["matmul_gpfast_ms"],
                r["dense_K_then_matmul_ms"],
                r["matmul_fwd_bwd_gpfast_ms"],
                r["matmul_bwd_gpfast_ms"],
                r["matmul_bwd_masked_gpfast_ms"],
            ]
            for r in mrows
        ],
    )
    header = (
        f"CPU op timings, float32, {torch.get_num_threads()} threads: median ms of {args.reps} runs after a "
        f"warm-up (time.perf_counter); load average {load:.2f} at the start"
    )
    print(write_results(RESULTS, args.stem, header, table, [*rows, *mrows]))
    orows = overhead_rows(args.overhead_time)
    otable = md_table(
        [
            "op",
            "raw torch.ops call",
            "wrapper",
            "wrapper, check_values=False",
            "overhead",
            "overhead, check_values=False",
        ],
        [
            [
                r["op"],
                r["raw_op_us"],
                r["wrapper_us"],
                r["wrapper_unchecked_us"],
                r["overhead_us"],
                r["overhead_unchecked_us"],
            ]
            for r in orows
        ],
    )
    oheader = (
        f"CPU host overhead per call, us (torch.utils.benchmark median), n = m = 8, d = 2, t = 3, float32, no "
        f"autograd; load average {os.getloadavg()[0]:.2f}"
    )
    print(write_results(RESULTS, f"{args.stem}_overhead", oheader, otable, orows))


if __name__ == "__main__":
    main()
