"""The training engine's product with its stored K(x, x), reading half of K (:func:`gpfast.ops.symmetric_matmul`,
at each super-tile size) against reading all of it (:func:`gpfast.ops.dense_matmul`), at the UCI sets' sizes.

    python -m experiments.bench_symmetric_product [--sizes 13500 57248] [--t 11 16]

K is formed as the engine stores it (``ops._rbf_covariance_symmetric`` into rows padded to 16 bytes, d = 8). Per
(n, t, kernel): the median time by CUDA events, the bytes that kernel must move at least (K's read part, V, the
output, and the symmetric kernel's partial sums written and read back), that floor's time at the H200's 4.27 TB/s
and how far above it the kernel is; the speed-up over dense_matmul; the error against float64 on 256 rows (relative,
and the largest |error| / (|K| |V|) over them); whether a second call is bitwise equal. Writes
experiments/results/bench_symmetric_product.{md,json} (``--out``, ``--stem``).
"""

from __future__ import annotations

import argparse

import torch

from experiments import RESULTS
from gpfast import ops
from gpfast.bench.report import md_table, write_results
from gpfast.bench.timing import COPY_BW, time_ms

#: The seven UCI sets' training sizes (the first split): pol, elevators, bike, kin40k, protein, keggdirected,
#: keggundirected.
UCI_SIZES = (13500, 14940, 15642, 36000, 41157, 43945, 57248)


def floor_bytes(n: int, t: int, block: int) -> int:
    """Bytes a product must move at least: the part of K it reads, V and the output, and for the symmetric kernel its
    partial sums (ns x ns slots of block x t floats, written once and read once)."""
    vectors = 2 * 4 * n * t
    if block <= 0:
        return 4 * n * n + vectors
    ns = -(-n // block)
    rows = [min(block, n - a * block) for a in range(ns)]
    upper = sum(rows[a] * rows[b] for a in range(ns) for b in range(a, ns))
    return 4 * upper + vectors + 2 * 4 * ns * ns * block * t


def bench(n: int, t: int, blocks, reps: int) -> list[dict]:
    """Rows for each kernel in ``blocks``: (block, stages) pairs, block -1 for dense_matmul, stages 0 the default."""
    x = torch.randn(n, 8, device="cuda")
    ls, s = torch.full((8,), 1.5, device="cuda"), torch.tensor(1.0, device="cuda")
    pitch = n + (-n) % 4
    K = ops._rbf_covariance_symmetric(x, ls, s, pitch)[:, :n]
    V = torch.randn(n, t, device="cuda")
    idx = torch.randperm(n, device="cuda")[:256]
    Kr = K[idx].double()
    want = Kr @ V.double()
    scale = Kr.abs() @ V.double().abs()
    rows, dense_ms = [], None
    for block, stages in blocks:
        label = "dense_matmul (all of K)" if block == -1 else f"symmetric_matmul, super-tile {block}"
        label += f", {stages} stages" if stages else ""
        if block == -1:
            run = lambda: ops.dense_matmul(K, V)  # noqa: E731
        else:
            run = lambda b=block, st=stages: ops._symmetric_matmul_block(K, V, b, st)  # noqa: E731
        out = run()
        err = (out[idx].double() - want).abs()
        ms = time_ms(run, "cuda", reps, warmup=3)
        dense_ms = ms if block == -1 else dense_ms
        fb = floor_bytes(n, t, block)
        floor_ms = 1e3 * fb / COPY_BW
        rows.append({"kernel": label, "block": block, "stages": stages, "n": n, "t": t, "ms": ms, "floor_ms": floor_ms,
                     "over_floor": ms / floor_ms, "full_read_TB_per_s": 4 * n * n / (ms / 1e3) / 1e12,
                     "speedup_vs_dense": (dense_ms / ms) if dense_ms else float("nan"),
                     "rel_err": float(err.norm() / want.norm()), "max_err_over_abs": float((err / scale).max()),
                     "bitwise_repeatable": bool(torch.equal(out, run()))})  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=list(UCI_SIZES))
    ap.add_argument("--t", type=int, nargs="+", default=[11, 16])
    ap.add_argument("--blocks", nargs="+", default=["-1", "256", "256:5", "512", "1024"],
                    help="super-tiles, each BLOCK or BLOCK:STAGES (copies in flight); -1: dense_matmul")  # fmt: skip
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--stem", default="bench_symmetric_product")
    ap.add_argument("--out", default=str(RESULTS), help="output folder (default experiments/results)")
    args = ap.parse_args(argv)
    blocks = [tuple(int(v) for v in (b.split(":") + ["0"])[:2]) for b in args.blocks]
    if (-1, 0) in blocks:  # the speed-ups are over dense_matmul: time it first
        blocks = [(-1, 0)] + [b for b in blocks if b != (-1, 0)]
    rows = [r for n in args.sizes for t in args.t for r in bench(n, t, blocks, args.reps)]
    table = md_table(
        ["kernel", "n", "t", "ms", "floor ms (its bytes at 4.27 TB/s)", "x floor", "all-of-K TB/s equivalent",
         "speed-up vs dense", "rel. err vs fp64 (256 rows)", "max |err| / (|K| |V|)", "repeatable"],
        [[r["kernel"], r["n"], r["t"], f"{r['ms']:.3f}", f"{r['floor_ms']:.3f}", f"{r['over_floor']:.2f}",
          f"{r['full_read_TB_per_s']:.2f}", f"{r['speedup_vs_dense']:.2f}", f"{r['rel_err']:.2e}",
          f"{r['max_err_over_abs']:.2e}", "yes" if r["bitwise_repeatable"] else "no"] for r in rows],
    )  # fmt: skip
    header = "Stored product with K(x, x): half of K read (symmetric_matmul) against all of it (dense_matmul)"
    print(write_results(args.out, args.stem, header, table, rows))


if __name__ == "__main__":
    main()
