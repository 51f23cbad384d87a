"""The stored-K product of gpfast's training engine: K (n x n, float32) times 11 columns, by each layout of
:data:`gpfast.train.product.STORED_LAYOUTS` and the other cuBLAS layouts below, against the H200's copy bandwidth
(4.27 TB/s; the target is 80% of it). Reading K once is the floor: 4 n^2 bytes per product.

    python -m experiments.bench_stored_product --n 36000 --t 11

Prints each layout's time, bandwidth and share of 4.27 TB/s, its error against float64 on 256 rows, whether a second
call is bitwise equal, and the fastest one; ``kernel`` is gpfast's own (:func:`gpfast.ops.dense_matmul`, the engine's
default on CUDA for t <= 16), also timed on rows that are not 16-byte aligned (its scalar-load variant). Writes
experiments/results/bench_stored_product.{md,json}.

``--batch K``: instead, K different stored covariances (K x n x n) times their own t columns, as K independent GPs
on the same inputs need at each step: one engine product per output in a loop (what
:class:`gpfast.train.batched.BatchedEngine` runs) against one batched cuBLAS call (``torch.bmm``). Both read the
same K n^2 floats; the question is whether one call reads them faster than K calls.
"""

from __future__ import annotations

import argparse

import torch

from experiments import RESULTS
from gpfast import ops
from gpfast.bench.report import md_table, write_results
from gpfast.bench.timing import COPY_BW, time_ms
from gpfast.train.product import STORED_LAYOUTS, stored_matmul


def _mm_vt(K: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    # V column-major (its transpose contiguous): cuBLAS sees a (t, n) row-major operand
    return K @ V.t().contiguous().t()


def _linear(K: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    # (V^T K^T)^T: GEMM with K as the transposed operand, output (t, rows) with the long dimension contiguous
    return torch.nn.functional.linear(V.t().contiguous(), K).t()


def _pad(t: int):
    def mm_padded(K: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
        extra = -V.shape[1] % t
        return (K @ torch.nn.functional.pad(V, (0, extra)))[:, : V.shape[1]] if extra else K @ V

    return mm_padded


#: Layouts the engine does not use, timed beside its own for comparison.
OTHER_LAYOUTS = {"mm_vt": _mm_vt, "linear": _linear, "mm_pad12": _pad(12), "mm_pad16": _pad(16)}


def product(K: torch.Tensor, V: torch.Tensor, name: str) -> torch.Tensor:
    """K @ V by the named layout: the engine's (:func:`stored_matmul`) or one of :data:`OTHER_LAYOUTS`."""
    return OTHER_LAYOUTS[name](K, V) if name in OTHER_LAYOUTS else stored_matmul(K, V, name)


def bench(n: int, t: int, reps: int, device: str, unaligned: bool = True) -> list[dict]:
    x = torch.randn(n, 8, device=device)
    K = ops.rbf_covariance(x, x, torch.full((8,), 1.5, device=device), 1.0)  # symmetric, as the engine's
    V = torch.randn(n, t, device=device)
    idx = torch.randperm(n, device=device)[:256]
    want = K[idx].double() @ V.double()  # 256 rows in float64
    floor_bytes = 4 * n * n + 2 * 4 * n * t
    cases = [(name, K) for name in (*STORED_LAYOUTS, *OTHER_LAYOUTS)]
    if unaligned and device == "cuda":  # the kernel's scalar-load variant: rows not 16-byte aligned (ld = n + 1)
        Ku = torch.empty(n, n + 1, device=device)[:, :n]
        Ku.copy_(K)
        cases.append(("kernel, rows not 16-byte aligned", Ku))
    rows = []
    for label, KK in cases:
        name = label.split(",")[0]
        out = product(KK, V, name)
        err = float((out[idx].double() - want).norm() / want.norm())
        repeat = bool(torch.equal(out, product(KK, V, name)))
        ms = time_ms(lambda name=name, KK=KK: product(KK, V, name), device, reps, warmup=2)
        bw = floor_bytes / (ms / 1e3)
        rows.append(
            {
                "layout": label,
                "n": n,
                "t": t,
                "ms": ms,
                "floor_ms": 1e3 * floor_bytes / COPY_BW,
                "TB_per_s": bw / 1e12,
                "share_of_4.27TBps": bw / COPY_BW,
                "rel_err": err,
                "bitwise_repeatable": repeat,
            }
        )
        print(rows[-1], flush=True)
    return rows


def batch_rows(n: int, t: int, k: int, reps: int, device: str) -> list[dict]:
    """K products of n x n stored covariances with (n, t) blocks: a loop of the engine's product against torch.bmm."""
    x = torch.randn(n, 8, device=device)
    Ks = torch.empty(k, n, n, device=device)
    for j in range(k):  # each output its own lengthscale, as independent GPs have
        Ks[j] = ops.rbf_covariance(x, x, torch.full((8,), 1.0 + 0.1 * j, device=device), 1.0)
    V = torch.randn(k, n, t, device=device)
    floor_bytes = k * (4 * n * n + 2 * 4 * n * t)

    def loop():
        return torch.stack([stored_matmul(Ks[j], V[j]) for j in range(k)])

    def batched():
        return torch.bmm(Ks, V)

    want = torch.stack([Ks[j, :64].double() @ V[j].double() for j in range(k)])
    rows = []
    for label, fn in (("loop of engine products", loop), ("torch.bmm", batched)):
        err = float((fn()[:, :64].double() - want).norm() / want.norm())
        ms = time_ms(fn, device, reps, warmup=2)
        bw = floor_bytes / (ms / 1e3)
        rows.append({"layout": f"{label}, batch {k}", "n": n, "t": t, "ms": ms, "floor_ms": 1e3 * floor_bytes / COPY_BW,
                     "TB_per_s": bw / 1e12, "share_of_4.27TBps": bw / COPY_BW, "rel_err": err,
                     "bitwise_repeatable": bool(torch.equal(fn(), fn()))})  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=36000)
    ap.add_argument("--t", type=int, default=11)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=0, help="K outputs: a loop of products against torch.bmm")
    ap.add_argument("--stem", default="bench_stored_product")
    ap.add_argument("--out", default=str(RESULTS), help="output folder (default experiments/results)")
    args = ap.parse_args(argv)
    if args.batch:
        rows = batch_rows(args.n, args.t, args.batch, args.reps, args.device)
    else:
        rows = bench(args.n, args.t, args.reps, args.device)
    best = min(rows, key=lambda r: r["ms"])
    cublas = min((r for r in rows if not r["layout"].startswith("kernel")), key=lambda r: r["ms"])
    table = md_table(
        [
            "layout",
            "n",
            "t",
            "ms",
            "floor ms (4 n^2 B, every output's, at 4.27 TB/s)" if args.batch else "floor ms (4 n^2 B at 4.27 TB/s)",
            "TB/s",
            "share of 4.27 TB/s",
            "rel. err vs fp64 (64 rows per output)" if args.batch else "rel. err vs fp64 (256 rows)",
            "repeatable",
        ],
        [
            [
                r["layout"],
                r["n"],
                r["t"],
                f"{r['ms']:.3f}",
                f"{r['floor_ms']:.3f}",
                f"{r['TB_per_s']:.2f}",
                f"{100 * r['share_of_4.27TBps']:.0f}%",
                f"{r['rel_err']:.2e}",
                "yes" if r["bitwise_repeatable"] else "no",
            ]
            for r in rows
        ],
    )
    what = f"{args.batch} outputs' " if args.batch else ""
    header = f"Stored-K product, {what}{args.t} columns at n = {args.n}"
    print(write_results(args.out, args.stem, header, table, rows, best=best["layout"]))
    if args.batch:
        return
    print(
        f"fastest layout: {best['layout']} ({best['ms']:.3f} ms, {100 * best['share_of_4.27TBps']:.0f}% of 4.27 "
        f"TB/s; target 80%); fastest cuBLAS layout: {cublas['layout']} ({cublas['ms']:.3f} ms)"
    )


if __name__ == "__main__":
    main()
