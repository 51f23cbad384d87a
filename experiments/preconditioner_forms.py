"""Which preconditioner form takes CG furthest on a UCI set: the engine's low-rank one against a diagonal correction,
block-Jacobi and their sum.

    python -m experiments.preconditioner_forms --dataset protein --data-dir .data/uci --subset 8000 --steps 20 \\
        --ranks 500 1000 --blocks 512 1024 --device cpu
    python -m experiments.preconditioner_forms --synthetic 400 3 --ranks 20 --blocks 64 --device cpu

Why: protein's engine steps take 25-30 CG iterations where the other sets take 3-13, and its rank-3200 pivoted
Cholesky leaves most of K's diagonal unexplained, the sign of a kernel whose correlations are short next to the
spacing of the pivots. Forms built for that regime might need fewer iterations at the same cost per iteration.

On ``--subset`` random training points (seeded), gpfast's engine first takes ``--steps`` Adam steps (lr 0.1) from
GPyTorch's initial hyperparameters, so the comparison is made where the engine's trajectory goes, not at the
initial values (``--theta`` gives the hyperparameters instead: log lengthscales, log outputscale, log noise). Then,
with K formed in float64, preconditioned CG solves ``(K + noise I) X = [y, 8 standard normal columns]`` from zero
to ``--tol`` on the largest relative residual (the engine's tolerance), and the table gives its iterations for

- ``none``;
- ``low-rank k``: ``P = L L^T + noise I``, L the rank-k greedy pivoted Cholesky (32 pivots a block), the engine's form;
- ``low-rank k + diagonal``: ``P = L L^T + diag(K - L L^T) + noise I``, the residual's diagonal (FITC's correction);
- ``block-Jacobi B``: P the diagonal blocks of ``K + noise I`` over a kd-tree partition of the points in
  lengthscale units into blocks of at most B (split at the median of the widest coordinate);
- ``low-rank k + blocks B``: ``P = L L^T + blockdiag(K - L L^T) + noise I`` (partially independent conditional),
  by Woodbury through the blocks' Cholesky inverses;
- with ``--stored float16`` (or ``bfloat16``), ``low-rank k, L in float16``: the engine's form with its factor
  rounded to that type (scaled by 1 / sqrt(s) first, so that its entries are at most 1) and the Woodbury matrix
  formed from the rounded factor, so that P is exactly ``L16 L16^T + noise I``. Why: each CG iteration reads the
  n x k factor twice, 15% of what the stored-K product reads on protein at rank 3200 and 24% on pol at 1600; stored
  in 16 bits it would read half as much, if the rounded factor preconditions as well.

Every form has an exact log-determinant and sampler, so each could serve the engine's stochastic estimates; the table
compares only how far each takes CG. Writes ``<stem>.{md,json}`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from experiments import RESULTS
from gpfast.bench.compare import default_init
from gpfast.bench.report import md_table
from gpfast.bench.timing import git_rev, machine, today
from gpfast.train.preconditioner import pivoted_cholesky

PROBES = 8


def _data(args) -> tuple[str, np.ndarray, np.ndarray]:
    if args.synthetic:
        n, d = args.synthetic
        rng = np.random.default_rng(args.seed)
        X = rng.standard_normal((n, d))
        y = np.sin(X @ rng.standard_normal(d)) + 0.1 * rng.standard_normal(n)
        return f"synthetic-{n}-{d}", X, y
    from gpfast.datasets.uci import load_uci

    data = load_uci(args.dataset, split=0, data_dir=args.data_dir)
    X, y = np.asarray(data.X_train, dtype=np.float64), np.asarray(data.y_train, dtype=np.float64).reshape(-1)
    if args.subset and args.subset < X.shape[0]:
        keep = np.random.default_rng(args.seed).choice(X.shape[0], args.subset, replace=False)
        X, y = X[keep], y[keep]
    return args.dataset, X, y


def _hyperparameters(args, X, y) -> np.ndarray:
    """log([lengthscales, outputscale, noise]) where the engine's Adam steps reach, or ``--theta``."""
    if args.theta is not None:
        theta = np.asarray(json.loads(args.theta), dtype=np.float64)
        if theta.shape != (X.shape[1] + 2,):
            raise SystemExit(f"--theta has {theta.size} values; expected {X.shape[1] + 2} (d log lengthscales, "
                             "log outputscale, log noise)")  # fmt: skip
        return theta
    from gpfast import ExactGP

    init = default_init(X.shape[1])
    gp = ExactGP(
        solver="cg", optimizer="adam", max_iter=args.steps, tol=0.0, lr=0.1, standardize=False, device=args.device,
        random_state=args.seed, lengthscale_init=np.asarray(init["init_lengthscale"]),
        outputscale_init=init["init_outputscale"], noise_init=init["init_noise"],
    )  # fmt: skip
    return np.asarray(gp.fit(X, y).theta_, dtype=np.float64)


def kd_blocks(Z: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Index blocks of at most ``size`` points: halves at the median of the widest coordinate of Z, recursively."""
    if size < 1:
        raise ValueError(f"kd_blocks: size must be at least 1, got {size}")
    out, todo = [], [torch.arange(Z.shape[0], device=Z.device)]
    while todo:
        ix = todo.pop()
        if len(ix) <= size:
            out.append(ix)
            continue
        z = Z[ix]
        widest = int((z.max(0).values - z.min(0).values).argmax())
        order = ix[torch.argsort(z[:, widest])]
        todo += [order[len(order) // 2 :], order[: len(order) // 2]]
    return out


def pcg_iterations(A, B: torch.Tensor, solve, tol: float, max_iter: int) -> int:
    """Preconditioned CG on all columns of B from zero: the iterations until every relative residual is below tol
    (max_iter if never)."""
    X, R = torch.zeros_like(B), B.clone()
    Zr = solve(R)
    P, rz, b_norm = Zr.clone(), (R * Zr).sum(0), B.norm(dim=0)
    for it in range(1, max_iter + 1):
        AP = A(P)
        alpha = rz / (P * AP).sum(0)
        X += alpha * P
        R -= alpha * AP
        if float((R.norm(dim=0) / b_norm).max()) < tol:
            return it
        Zr = solve(R)
        rz_new = (R * Zr).sum(0)
        P = Zr + rz_new / rz * P
        rz = rz_new
    return max_iter


class _Blocks:
    """Block-diagonal inverse: the Cholesky inverse of each diagonal block of a matrix, applied block by block."""

    def __init__(self, blocks, block_of):
        self.blocks = blocks
        self.inv = [torch.cholesky_inverse(torch.linalg.cholesky(block_of(b))) for b in blocks]

    def __call__(self, V: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(V)
        for b, inv in zip(self.blocks, self.inv):
            out[b] = inv @ V[b]
        return out


def _woodbury(L: torch.Tensor, solve_d):
    """V -> (L L^T + D)^{-1} V from V -> D^{-1} V."""
    DL = solve_d(L)
    C_inv = torch.linalg.inv(torch.eye(L.shape[1], dtype=L.dtype, device=L.device) + L.t() @ DL)
    return lambda V: solve_d(V) - DL @ (C_inv @ (DL.t() @ V))


def _eye(m: int, like: torch.Tensor) -> torch.Tensor:
    return torch.eye(m, dtype=like.dtype, device=like.device)


# The forms' P^{-1}, each named by its P (the table's forms; K (n, n), L (n, k) with K ~ L L^T, blocks a partition
# of the points as index tensors):
def low_rank(K, noise, L):
    """``P = L L^T + noise I``: the engine's form."""
    return _woodbury(L, lambda V: V / noise)


def low_rank_diagonal(K, noise, L):
    """``P = L L^T + diag(K - L L^T) + noise I``: FITC's correction."""
    d_inv = 1.0 / ((K.diagonal() - (L * L).sum(1)).clamp_min(0) + noise)
    return _woodbury(L, lambda V: d_inv[:, None] * V)


def block_jacobi(K, noise, blocks):
    """``P = blockdiag(K + noise I)`` over the blocks."""
    return _Blocks(blocks, lambda ix: K[ix][:, ix] + noise * _eye(len(ix), K))


def low_rank_blocks(K, noise, L, blocks):
    """``P = L L^T + blockdiag(K - L L^T) + noise I`` (partially independent conditional)."""
    return _woodbury(L, _Blocks(blocks, lambda ix: K[ix][:, ix] - L[ix] @ L[ix].t() + noise * _eye(len(ix), K)))


def rounded(L: torch.Tensor, dtype: torch.dtype, s: float) -> torch.Tensor:
    """L rounded to ``dtype`` as it would be stored (scaled by 1 / sqrt(s), so its entries are at most 1 in magnitude:
    |L_ij| <= sqrt(K_ii) = sqrt(s)), returned in L's dtype and scale."""
    r = s**0.5
    return (L / r).to(dtype).to(L.dtype) * r


def run(args) -> dict:
    name, Xn, yn = _data(args)
    t0 = time.perf_counter()
    theta = _hyperparameters(args, Xn, yn)
    fit_s = time.perf_counter() - t0
    dev = torch.device(args.device)
    X = torch.as_tensor(Xn, dtype=torch.float64, device=dev)
    y = torch.as_tensor(yn, dtype=torch.float64, device=dev)
    n, d = X.shape
    lengthscale = torch.as_tensor(np.exp(theta[:d]), device=dev)
    s, noise = float(np.exp(theta[d])), float(np.exp(theta[d + 1]))
    Z = X / lengthscale
    sq = (Z * Z).sum(1)
    K = torch.empty(n, n, dtype=torch.float64, device=dev)
    for i in range(0, n, 4096):  # by row blocks: the whole expression at once would hold several n x n temporaries
        blk = (sq[i : i + 4096, None] + sq[None, :] - 2 * Z[i : i + 4096] @ Z.t()).clamp_min_(0)
        torch.exp(blk.mul_(-0.5), out=K[i : i + 4096]).mul_(s)
    K.diagonal().fill_(s)

    def A(V):
        return K @ V + noise * V

    g = torch.Generator(device=dev).manual_seed(args.seed)
    B = torch.cat([y[:, None], torch.randn(n, PROBES, dtype=torch.float64, device=dev, generator=g)], 1)
    rows = []

    def add(form, solve, rank=None, block=None, **extra):
        t = time.perf_counter()
        its = pcg_iterations(A, B, solve, args.tol, args.max_iter)
        rows.append(dict(form=form, rank=rank, block=block, iterations=its, seconds=time.perf_counter() - t, **extra))
        print(f"  {form}: {its} iterations", flush=True)

    off_diagonal = float(K.sum() - s * n)
    partitions = {b: kd_blocks(Z, b) for b in args.blocks}  # the same for every rank
    add("none", lambda V: V)
    for b, blocks in partitions.items():
        held = sum(float(K[ix][:, ix].sum()) - s * len(ix) for ix in blocks) / off_diagonal
        add(f"block-Jacobi {b}", block_jacobi(K, noise, blocks), block=b, off_diagonal_share_in_blocks=held)
    for k in args.ranks:
        k = min(k, n)
        L = pivoted_cholesky(
            lambda ix: K[ix].clone(), torch.full((n,), s, dtype=torch.float64, device=dev), k, block=32
        )
        residual = (s - (L * L).sum(1)).clamp_min(0)
        quantiles = torch.quantile(residual / s, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64, device=dev))
        unexplained = dict(residual_over_s_q10_q50_q90=[round(float(v), 4) for v in quantiles])
        add(f"low-rank {k}", low_rank(K, noise, L), rank=k, **unexplained)
        for kind in args.stored:
            add(f"low-rank {k}, L in {kind}", low_rank(K, noise, rounded(L, getattr(torch, kind), s)), rank=k)
        add(f"low-rank {k} + diagonal", low_rank_diagonal(K, noise, L), rank=k)
        for b in args.blocks:
            add(f"low-rank {k} + blocks {b}", low_rank_blocks(K, noise, L, partitions[b]), rank=k, block=b)
    return dict(
        dataset=name, n=n, d=d, theta=[float(v) for v in theta], noise_over_outputscale=noise / s,
        hyperparameters="--theta" if args.theta is not None else f"engine, {args.steps} Adam steps (lr 0.1)",
        fit_s=fit_s, tol=args.tol, probes=PROBES, rows=rows,
    )  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="protein")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--synthetic", type=int, nargs=2, metavar=("N", "D"), default=None)
    ap.add_argument("--subset", type=int, default=8000, help="random training points (default 8000; 0: all)")
    ap.add_argument("--steps", type=int, default=20, help="the engine's Adam steps before the comparison")
    ap.add_argument("--theta", default=None, help="JSON list: log lengthscales, log outputscale, log noise")
    ap.add_argument("--ranks", type=int, nargs="+", default=[500, 1000])
    ap.add_argument("--blocks", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--stored", nargs="*", default=[], choices=["float16", "bfloat16"],
                    help="also the low-rank form with its factor rounded to these types")  # fmt: skip
    ap.add_argument("--tol", type=float, default=0.01)
    ap.add_argument("--max-iter", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--stem", default="preconditioner_forms")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = run(args)
    res.update(machine=machine(torch.device(args.device)), date=today(), commit=git_rev())
    (out / f"{args.stem}.json").write_text(json.dumps(res, indent=1))
    table = md_table(
        ["form", "CG iterations", "residual diag / s (10%, 50%, 90%)", "K's off-diagonal mass in the blocks"],
        [
            [
                r["form"],
                r["iterations"],
                ", ".join(f"{v:.3f}" for v in r.get("residual_over_s_q10_q50_q90", [])) or "-",
                f"{r['off_diagonal_share_in_blocks']:.2f}" if "off_diagonal_share_in_blocks" in r else "-",
            ]
            for r in res["rows"]
        ],
    )  # fmt: skip
    (out / f"{args.stem}.md").write_text(
        f"# Preconditioner forms on {res['dataset']} (n = {res['n']}, d = {res['d']})\n\n"
        f"Machine: {res['machine']}. Date: {res['date']}. Commit: {res['commit']}. Hyperparameters: "
        f"{res['hyperparameters']}; theta (log lengthscales, log outputscale, log noise) = "
        f"{[round(v, 3) for v in res['theta']]}, noise / outputscale {res['noise_over_outputscale']:.3g}. "
        f"Preconditioned CG from zero on y and {PROBES} standard normal columns, float64, until every relative "
        f"residual is below {res['tol']} (at most {args.max_iter} iterations).\n\n{table}\n"
    )
    print((out / f"{args.stem}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
