"""The training engine's gradient kernel: the (lengthscale, outputscale) backward of K @ V with no point gradients,
by each CUDA kernel, against one stored-K product of the same n.

    python -m experiments.bench_bilinear [--reps 20] [--t 17] [--shapes 43945,20 57248,27] [--stem bench_bilinear]

At the UCI shapes (n, d) of the engine's benchmarks, with t right-hand sides (1 solve + probes), times (median of
CUDA events after warm-up) each kernel of the private op ``_rbf_matmul_backward_kernel``: ``rows`` (the row pass,
float64 exponent and sums) and the tensor-core kernel with 4 and 8 warps a block, each pair of K(x, x) once or
(``_nosym``) every ordered pair; the kernels of ``stored_backward`` that read a stored float32 K instead of
recomputing it (``stored_tc4``, ``stored_tc8``, ``stored_tc4_nosym``: the engine's backward on a GPU); and
``dense_matmul`` (the engine's stored product, K read once) at min(t, 16) columns, the bandwidth kernel's widest
bucket. Each kernel's error is the relative error of the lengthscale gradient (norm-wise) and of the outputscale
gradient against the same op in float64 (float64 inputs take the row pass, float64 throughout); the stored kernels'
error includes the float32 rounding of the K they read, so they are also compared with ``stored_backward``'s float64
reference on the same float32 K (column "vs its K"). Writes <stem>.{md,json} in ``--out`` (default
experiments/results).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from experiments import RESULTS
from gpfast import ops
from gpfast.bench.report import md_table, write_results
from gpfast.bench.timing import cuda_time_ms

UCI_SHAPES = [(13500, 26), (14940, 18), (15642, 17), (36000, 8), (41157, 9), (43945, 20), (57248, 27)]
POINT_KERNELS = ("rows", "bilinear4", "bilinear8", "bilinear4_nosym", "bilinear8_nosym")
STORED_KERNELS = ("stored_tc4", "stored_tc8", "stored_tc4_nosym")
KERNELS = POINT_KERNELS + STORED_KERNELS


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
    for kernel in POINT_KERNELS:
        gl, gs = ops._rbf_matmul_backward_kernel(G, x, x, l, s, V, kernel)
        row[f"{kernel}_err_l"], row[f"{kernel}_err_s"] = rel(gl, want_l), rel(gs, want_s)
        row[f"{kernel}_ms"] = cuda_time_ms(
            lambda k=kernel: ops._rbf_matmul_backward_kernel(G, x, x, l, s, V, k), reps=reps
        )
    row.update(stored_rows(x, l, s, G, V, want_l, want_s, reps))
    torch.cuda.empty_cache()  # K (n x n) is gone
    return row


def stored_rows(x, l, s, G, V, want_l, want_s, reps: int) -> dict:
    """The kernels that read a stored K, and one stored product (``dense_matmul`` at min(t, 16) columns)."""
    K = ops.rbf_covariance(x, x, l, s)  # float32, as the engine stores it
    own_l, own_s = ops._stored_backward_kernel(K, x, x, l, s, G, V, "reference")
    row = {}
    for kernel in STORED_KERNELS:
        name = kernel.removeprefix("stored_")
        gl, gs = ops._stored_backward_kernel(K, x, x, l, s, G, V, name)
        row[f"{kernel}_err_l"], row[f"{kernel}_err_s"] = rel(gl, want_l), rel(gs, want_s)
        row[f"{kernel}_own_err_l"], row[f"{kernel}_own_err_s"] = rel(gl, own_l.double()), rel(gs, own_s.double())
        row[f"{kernel}_ms"] = cuda_time_ms(
            lambda k=name: ops._stored_backward_kernel(K, x, x, l, s, G, V, k), reps=reps
        )
    Vp = V[:, : min(G.shape[1], 16)].contiguous()
    row["product_ms"] = cuda_time_ms(lambda: ops.dense_matmul(K, Vp), reps=reps)
    return row


def parse_shape(text: str) -> tuple[int, int]:
    n, d = (int(v) for v in text.split(","))
    return n, d


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--t", type=int, default=17, help="right-hand sides: 1 solve + probes")
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=UCI_SHAPES, metavar="N,D")
    parser.add_argument("--stem", default="bench_bilinear")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rows = []
    for n, d in args.shapes:
        rows.append(bench_shape(n, d, args.t, args.reps))
        print(rows[-1], flush=True)
    best = [min(KERNELS[1:], key=lambda k: r[f"{k}_ms"]) for r in rows]
    table = md_table(
        [
            "n",
            "d",
            "stored product",
            *KERNELS,
            "best",
            "best / product",
            *(f"{k} err l / s" for k in KERNELS),
            *(f"{k} vs its K l / s" for k in STORED_KERNELS),
        ],
        [
            [
                r["n"],
                r["d"],
                r["product_ms"],
                *(r[f"{k}_ms"] for k in KERNELS),
                k,
                f"{r[f'{k}_ms'] / r['product_ms']:.2f}",
                *(f"{r[f'{kk}_err_l']:.1e} / {r[f'{kk}_err_s']:.1e}" for kk in KERNELS),
                *(f"{r[f'{kk}_own_err_l']:.1e} / {r[f'{kk}_own_err_s']:.1e}" for kk in STORED_KERNELS),
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
        " pair. stored_tc4/8: `stored_backward`'s tensor-core kernel reading the stored float32 K (weights 3xTF32,"
        " M, M Z and sums in double; no exponential), 4 or 8 warps a block; vs its K: against its float64 reference"
        " on the same float32 K.\n"
    )
    title = "The (lengthscale, outputscale) backward of K @ V: row pass, tensor cores, and from the stored K"
    print(write_results(args.out, args.stem, title, table + "\n" + notes, rows, t=args.t, reps=args.reps))


if __name__ == "__main__":
    main()
