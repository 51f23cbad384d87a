"""The training engine's gradient kernel: the (lengthscale, outputscale) backward of K @ V with no point gradients,
by each CUDA kernel, against one stored-K product of the same n.

    python -m experiments.bench_bilinear [--reps 20] [--t 17]

At the UCI shapes (n, d) of the engine's benchmarks, with t right-hand sides (1 solve + probes), times (median of
CUDA events after warm-up) each kernel of the private op ``_rbf_matmul_backward_kernel``: ``rows`` (the row pass,
float64 exponent and sums) and the tensor-core kernel with 4 and 8 warps a block, each pair of K(x, x) once or
(``_nosym``) every ordered pair; and ``dense_matmul`` (the
engine's stored product, K read once) at min(t, 16) columns, the bandwidth kernel's widest bucket. Each kernel's
error is the relative error of the lengthscale gradient (norm-wise) and of the outputscale gradient against the
same op in float64 (float64 inputs take the row pass, float64 throughout). Writes
experiments/results/bench_bilinear.{md,json}.
"""

from __future__ import annotations

import argparse

import torch

from experiments import RESULTS
from gpfast import ops
from gpfast.bench.report import md_table, write_results
from gpfast.bench.timing import cuda_time_ms

UCI_SHAPES = [(13500, 26), (14940, 18), (15642, 17), (36000, 8), (41157, 9), (43945, 20)]
KERNELS = ("rows", "bilinear4", "bilinear8", "bilinear4_nosym", "bilinear8_nosym")


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


def bench_shape(n: int, d: int, t: int, reps: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(n * 100 + d)
    x = torch.randn(n, d, device="cuda", generator=gen)
    l = (torch.rand(d, device="cuda", generator=gen) * 1.5 + 0.5) * max(1.0, (d / 8) ** 0.5)
    s = torch.tensor(1.3, device="cuda")
    G = torch.randn(n, t, device="cuda", generator=gen)
    V = torch.randn(n, t, device="cuda", generator=gen)
    want_l, want_s = ops.rbf_matmul_backward(G.double(), *(a.double() for a in (x, x, l, s, V)), x_grads=False)[2:]
    row = {"n": n, "d": d, "t": t}
    for kernel in KERNELS:
        gl, gs = ops._rbf_matmul_backward_kernel(G, x, x, l, s, V, kernel)
        row[f"{kernel}_err_l"], row[f"{kernel}_err_s"] = rel(gl, want_l), rel(gs, want_s)
        row[f"{kernel}_ms"] = cuda_time_ms(
            lambda k=kernel: ops._rbf_matmul_backward_kernel(G, x, x, l, s, V, k), reps=reps
        )
    row["product_ms"] = time_stored_product(x, l, s, V[:, : min(t, 16)].contiguous(), reps)
    torch.cuda.empty_cache()  # K (n x n) is gone
    return row


def time_stored_product(x, l, s, V, reps: int) -> float:
    """One stored-K product K @ V (K n x n, float32), the engine's per-iteration work, by ``dense_matmul``."""
    K = ops.rbf_covariance(x, x, l, s)
    return cuda_time_ms(lambda: ops.dense_matmul(K, V), reps=reps)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--t", type=int, default=17, help="right-hand sides: 1 solve + probes")
    args = parser.parse_args(argv)
    rows = []
    for n, d in UCI_SHAPES:
        rows.append(bench_shape(n, d, args.t, args.reps))
        print(rows[-1], flush=True)
    best = [min(KERNELS[1:], key=lambda k: r[f"{k}_ms"]) for r in rows]
    table = md_table(
        ["n", "d", "stored product", *KERNELS, "best", "best / product", *(f"{k} err l / s" for k in KERNELS)],
        [
            [
                r["n"],
                r["d"],
                r["product_ms"],
                *(r[f"{k}_ms"] for k in KERNELS),
                k,
                f"{r[f'{k}_ms'] / r['product_ms']:.2f}",
                *(f"{r[f'{kk}_err_l']:.1e} / {r[f'{kk}_err_s']:.1e}" for kk in KERNELS),
            ]
            for r, k in zip(rows, best)
        ],
    )
    notes = (
        f"\nTimes in ms (median of {args.reps} CUDA-event timings after warm-up), t = {args.t} right-hand sides; the"
        f" stored product reads K (n x n, float32) once for {min(args.t, 16)} columns (`dense_matmul`). Errors:"
        " relative error of the lengthscale gradient (norm-wise) / of the outputscale gradient against the float64"
        " op. bilinear4/8: the tensor-core kernel (weights 3xTF32, exponent, M Z and sums in double) with 4 or 8"
        " warps a block, taking each pair of K(x, x) once with the weights of both orders; _nosym: every ordered"
        " pair.\n"
    )
    title = "The (lengthscale, outputscale) backward of K @ V: row pass against tensor cores"
    print(write_results(RESULTS, "bench_bilinear", title, table + "\n" + notes, rows, t=args.t, reps=args.reps))


if __name__ == "__main__":
    main()
