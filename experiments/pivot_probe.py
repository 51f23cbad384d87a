"""The pivoted Cholesky's operations one at a time at a given size, each timed on its own.

    python -m experiments.pivot_probe --n 1000000 --op all          # every operation, one after another
    python -m experiments.pivot_probe --n 1000000 --op trsm         # one of them (run each in its own process,
                                                                    # under a timeout, to find one that hangs)

At 1M points the CG posterior's set-up (a rank-1024 pivoted Cholesky in float64) did not end in 258 s on an H200,
where at 200k it takes 0.8 s. One block of :func:`gpfast.train.preconditioner.pivoted_cholesky` is a handful of
library calls on (n,)-, (c, n)- and (n, rank)-shaped tensors; this script runs each of them at the block's real
shapes (c = 32 candidates, b = 16 pivots, the last block's m = rank - 16 columns before it) with the device
synchronised around it, so the one whose time does not grow linearly with n shows itself. It also times the
alternatives the set-up could use instead (the block's triangular solve as a product with G's inverse), the whole
pivoted Cholesky at growing ranks, and the folded factor. On the H200 (2026-12-02) the triangular solve was the
one: 24 s at 1M against 0.065 s for the product with the inverse, which the set-up has used since.

Each operation's line is printed as soon as it ends; with ``CUDA_LAUNCH_BLOCKING=1`` and ``--watchdog`` seconds,
a Python stack is printed every that many seconds, so a run cut by its timeout still names the call it was in.
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
import time

import torch

from gpfast import ops  # noqa: F401  (registers torch.ops.gpfast._pivot_block and _pivot_select)
from gpfast.bench.timing import sync
from gpfast.train.preconditioner import Preconditioner, pivoted_cholesky
from gpfast.train.product import CovarianceProduct

# what each operation reads, made (and printed) before it is timed
INPUTS = {
    "select": ["diag", "Lb", "cand", "block"],
    "rows": ["prod", "cand"],
    "gemm": ["rows", "L"],
    "pivot": ["rows", "cand", "diag"],
    "trsm": ["G_rhs"],
    "trsm_inverse": ["G_rhs"],
    "assign": ["L", "Lb"],
    "fold": ["L"],
}
OPS = ("select", "rows", "gemm", "pivot", "trsm", "trsm_inverse", "assign", "chol16", "chol128", "chol1024", "fold")


def _timed(dev: torch.device, fn):
    sync(dev)
    t0 = time.perf_counter()
    out = fn()
    sync(dev)
    return out, time.perf_counter() - t0


def probe(n: int, d: int, rank: int, op: str, device: str) -> list[tuple[str, float]]:
    """Run ``op`` (or every one of :data:`OPS` for ``"all"``) at n points; returns (name, seconds) pairs."""
    dev = torch.device(device)
    torch.manual_seed(0)
    b, c, m = 16, 32, max(rank - 16, 0)
    as64 = dict(dtype=torch.float64, device=dev)
    none = (torch.empty(0, dtype=torch.long, device=dev),) * 2
    memo: dict = {}

    def need(key):  # each input made on first use, so that an operation's run makes only what it reads
        if key not in memo:
            memo[key] = make[key]()
        return memo[key]

    def product():
        prod = CovarianceProduct(torch.rand(n, d, **as64) * 4.0, "matrix_free")
        prod.update(torch.full((d,), 1.5, **as64), torch.tensor(1.0, **as64), torch.tensor(0.01, **as64))
        return prod

    def block():
        return torch.ops.gpfast._pivot_block(need("rows"), need("cand"), need("diag"), 1e-8 * need("diag").max(), b)

    def g_rhs():
        piv, G, _ = need("block")
        return G, need("rows").index_select(0, piv)

    def select():  # the diagonal's update by a block's columns and the next candidates, on a copy
        return torch.ops.gpfast._pivot_select(need("diag").clone(), need("Lb"), need("cand"), need("block")[0], c)

    make = {
        "prod": product,
        "diag": lambda: torch.rand(n, **as64),
        "cand": lambda: torch.ops.gpfast._pivot_select(need("diag").clone(), torch.empty(0, n, **as64), *none, c),
        "rows": lambda: need("prod").kernel_rows(need("cand")),
        "L": lambda: torch.randn(n, rank, **as64) * 1e-3,
        "block": block,
        "G_rhs": g_rhs,
        "Lb": lambda: torch.linalg.solve_triangular(*need("G_rhs"), upper=False),
    }
    eye = torch.eye(b, **as64)
    chol = lambda k: pivoted_cholesky(need("prod").kernel_rows, torch.ones(n, **as64), k)  # noqa: E731
    work = {
        "select": select,
        "rows": lambda: need("prod").kernel_rows(need("cand")),
        "gemm": lambda: need("rows") - need("L").index_select(0, need("cand"))[:, :m] @ need("L")[:, :m].t(),
        "pivot": block,
        "trsm": lambda: torch.linalg.solve_triangular(*need("G_rhs"), upper=False),
        "trsm_inverse": lambda: torch.linalg.solve_triangular(need("G_rhs")[0], eye, upper=False) @ need("G_rhs")[1],
        "assign": lambda: (need("L")[:, m : m + b].copy_(need("Lb").t()), (need("Lb") ** 2).sum(0)),
        "chol16": lambda: chol(16),
        "chol128": lambda: chol(128),
        "chol1024": lambda: chol(rank),
        "fold": lambda: Preconditioner(need("L"), 1.0, torch.float64, fold=True).set_scales(1.0, 0.01),
    }
    out = []
    for name in OPS if op == "all" else (op,):
        # the inputs first, untimed, each printed: a run that hangs in making them says so
        for key in INPUTS.get(name, ["prod"]):
            if key not in memo:
                _, t = _timed(dev, lambda: need(key))
                print(f"n={n} (input {key}: {t:.4f} s)", flush=True)
        _, t = _timed(dev, work[name])
        print(f"n={n} {name}: {t:.4f} s", flush=True)
        out.append((name, t))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--d", type=int, default=8)
    ap.add_argument("--rank", type=int, default=1024)
    ap.add_argument("--op", default="all", choices=("all",) + OPS)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--watchdog", type=float, default=0.0, help="print the Python stack every this many seconds")
    args = ap.parse_args(argv)
    if args.watchdog > 0:
        faulthandler.dump_traceback_later(args.watchdog, repeat=True, file=sys.stdout)
    probe(args.n, args.d, args.rank, args.op, args.device)


if __name__ == "__main__":
    main()
