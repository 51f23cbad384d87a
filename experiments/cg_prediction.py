"""CG-path predictions against the exact float64 Cholesky ones, and their cost at scale.

    python -m experiments.cg_prediction --agree 100000 --scale 1000000 --device cuda

``--agree N``: at N synthetic points (d=8) and well-fitted high signal-to-noise hyperparameters (the data's own
lengthscale, outputscale 1, noise 0.01, so the training covariance's condition number is about N / 0.01), the
mean and standard deviation of y at test points, at training points and far from the data, by
:class:`gpfast.models.CGPosterior` (float32 solves, float64 refinement) and by the float64 Cholesky
(factored in place, one matrix of 8 N^2 bytes). Reports the largest mean difference in std(y), the largest
relative std difference, the smallest std against the noise std, each method's time, and the certified bounds.

``--scale N``: the whole CG pipeline for all ``--test`` points at N: the set-up (preconditioner and the solve for
the mean weights), the means, and the variances (the bounds that need no solve, then CG for the rest until
``--variance-budget`` seconds of the call are spent), with the distribution of the certified half-widths and the
number of points whose standard deviation they certify to within 2%.

``--pieces N``: the parts of the cost model at N where the whole pipeline does not fit in one run: the
preconditioner, one product for 1, 16 and a chunk of columns (float32) and for 1 column (float64), the first
``--cg-iters`` iterations of the mean-weight solve (their convergence rate, and the iterations it predicts for a
mean error of ``--mean-atol``), and the bounds that need no solve for ``--test`` points.
"""

from __future__ import annotations

import argparse
import math
import time
import warnings

import torch

from experiments import RESULTS
from gpfast import datasets
from gpfast.bench.report import md_table, write_results
from gpfast.bench.timing import sync
from gpfast.models import CGPosterior, CGPredictionWarning
from gpfast.ops import rbf_covariance
from gpfast.train.preconditioner import Preconditioner, pivoted_cholesky
from gpfast.train.product import CovarianceProduct

NOISE = 0.01
OUTPUTSCALE = 1.0


def _data(n: int, d: int, m: int, device: torch.device):
    data = datasets.synthetic_split(n, m, d, noise=math.sqrt(NOISE), seed=0)
    X = torch.as_tensor(data.X_train, dtype=torch.float64, device=device)
    y = torch.as_tensor(data.y_train, dtype=torch.float64, device=device).reshape(-1)
    Xt = torch.as_tensor(data.X_test, dtype=torch.float64, device=device)
    ls = torch.full((d,), 1.5, dtype=torch.float64, device=device)
    return X, y, Xt, ls


def _timed(fn):
    sync_dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    sync(sync_dev)
    t0 = time.perf_counter()
    out = fn()
    sync(sync_dev)
    return out, time.perf_counter() - t0


def _cholesky_in_place(A: torch.Tensor, block: int = 4096) -> torch.Tensor:
    """Lower Cholesky factor of A (n, n) written over A (right-looking, by blocks of columns), so that the
    reference at n = 100k needs one 80 GB matrix rather than the two of ``torch.linalg.cholesky``."""
    n = A.shape[0]
    for k in range(0, n, block):
        e = min(k + block, n)
        L11 = torch.linalg.cholesky(A[k:e, k:e])
        A[k:e, k:e] = L11
        if e < n:
            A[e:, k:e] = torch.linalg.solve_triangular(L11.T, A[e:, k:e], upper=True, left=False)
            A21 = A[e:, k:e]
            A[e:, e:].addmm_(A21, A21.T, alpha=-1.0)  # both triangles: twice the flops, no extra n x n memory
    return A.tril_()


def _reference(X, y, ls, points: dict) -> dict:
    """Float64 Cholesky predictions (mean, variance of y) at each set of points."""
    A = rbf_covariance(X, X, ls, OUTPUTSCALE)
    A.diagonal().add_(NOISE)
    L = _cholesky_in_place(A)
    # two triangular solves: torch.cholesky_solve would copy the 80 GB factor first
    z = torch.linalg.solve_triangular(L, y.reshape(-1, 1), upper=False)
    alpha = torch.linalg.solve_triangular(L.mT, z, upper=True).reshape(-1)
    out = {}
    for name, P in points.items():
        K_star = rbf_covariance(X, P, ls, OUTPUTSCALE)
        V = torch.linalg.solve_triangular(L, K_star, upper=False)
        out[name] = (K_star.T @ alpha, (OUTPUTSCALE - V.pow(2).sum(0)).clamp_min(0) + NOISE)
    return out


def agreement(n: int, d: int, m: int, device: str) -> dict:
    dev = torch.device(device)
    X, y, Xt, ls = _data(n, d, m, dev)
    g = torch.Generator(device="cpu").manual_seed(1)
    train_pts = X[torch.randperm(n, generator=g)[:m].to(dev)]
    far = Xt[: max(m // 10, 1)] + 10.0
    points = {"test": Xt, "train": train_pts, "far": far}
    ref, t_exact = _timed(lambda: _reference(X, y, ls, points))
    print(f"n={n}: float64 Cholesky reference {t_exact:.1f} s", flush=True)
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the 8 n^2 bytes of the factor go back before the CG posterior stores K
    post, t_setup = _timed(lambda: CGPosterior(X, y, ls, OUTPUTSCALE, NOISE, 0.0, dtype=torch.float32))
    print(f"n={n}: CG posterior set-up {t_setup:.1f} s ({post.iterations} CG iterations)", flush=True)
    row = {"n": n, "d": d, "device": str(dev), "exact_s": t_exact, "cg_setup_s": t_setup, "noise_std": NOISE**0.5}
    for name, P in points.items():
        (mean, var), t = _timed(lambda P=P: post.predict(P, return_var=True, include_noise=True))
        mean_ex, var_ex = ref[name]
        row[name] = {
            "points": P.shape[0],
            "cg_predict_s": t,
            "max_mean_diff_std_y": float((mean - mean_ex).abs().max()) / float(y.std()),
            "max_rel_std_diff": float(((var / var_ex).sqrt() - 1).abs().max()),
            "min_std": float(var.min().sqrt()),
            "bound_holds": bool(
                ((var - var_ex).abs() <= post.variance_error + 1e-8).all()
            ),  # + the reference's rounding
            "max_certified_rel_var_error": float((post.variance_error / var).max()),
        }
        print(f"n={n}: {name} {row[name]}", flush=True)
    row["cg_iterations"] = post.iterations
    row["mean_error_bound"] = post.mean_error
    return row


def _interval_stats(var: torch.Tensor, err: torch.Tensor, rtol: float) -> dict:
    """Certified half-widths relative to the variance of y, and what they allow for the standard deviation (the
    true std lies in [sqrt(var - err), sqrt(var + err)]; the lower end is the farther one)."""
    rel = (err / var).clamp_min(0)
    std_rel = 1 - (1 - rel).clamp_min(0).sqrt()
    q = torch.quantile(rel.cpu(), torch.tensor([0.5, 0.99], dtype=rel.dtype))
    return {
        "rel_var_halfwidth_median": float(q[0]),
        "rel_var_halfwidth_p99": float(q[1]),
        "rel_var_halfwidth_max": float(rel.max()),
        "points_certified_rtol": int((rel <= rtol).sum()),
        "points_std_within_2pct": int((std_rel <= 0.02).sum()),
        "min_std": float(var.min().sqrt()),
    }


def scale(n: int, d: int, m: int, device: str, budget: float | None, mean_atol: float, quick_first: bool, local: int):
    """The whole pipeline for all m test points: set-up, means, variances (CG within ``budget`` seconds)."""
    dev = torch.device(device)
    X, y, Xt, ls = _data(n, d, m, dev)
    post, t_setup = _timed(
        lambda: CGPosterior(
            X, y, ls, OUTPUTSCALE, NOISE, 0.0, dtype=torch.float32, mean_atol=mean_atol, local_points=local
        )
    )
    it_setup = post.iterations
    print(f"n={n}: set-up {t_setup:.1f} s ({it_setup} CG iterations), chunk {post._chunk()} points", flush=True)
    mean, t_mean = _timed(lambda: post.predict(Xt))
    row = {"n": n, "d": d, "device": str(dev), "test_points": m, "setup_s": t_setup}
    row.update(setup_cg_iterations=it_setup, mean_atol=mean_atol, mean_error_bound=post.mean_error, mean_s=t_mean)
    row.update(chunk_points=post._chunk(), variance_budget_s=budget, local_points=local)
    if quick_first:  # the bounds that need no solve, alone: what they certify and what they cost
        post.variance_budget = 0.0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CGPredictionWarning)
            (_, var), t_quick = _timed(lambda: post.predict(Xt, return_var=True, include_noise=True))
        row.update(quick_bounds_s=t_quick, quick=_interval_stats(var, post.variance_error, post.variance_rtol))
        print(f"n={n}: quick bounds {t_quick:.1f} s {row['quick']}", flush=True)
    post.variance_budget = budget
    it0 = post.iterations
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CGPredictionWarning)
        (_, var), t_var = _timed(lambda: post.predict(Xt, return_var=True, include_noise=True))
    row.update(variance_s=t_var, variance_cg_iterations=post.iterations - it0, total_s=t_setup + t_var)
    row.update(final=_interval_stats(var, post.variance_error, post.variance_rtol), warned=bool(caught))
    print(f"n={n}: means and variances {t_var:.1f} s {row['final']}", flush=True)
    return row


def _setup_parts(X: torch.Tensor, ls: torch.Tensor, n: int, rank: int = 1024) -> None:
    """The CG posterior's set-up taken apart and printed part by part (the float64 product, the pivoted Cholesky,
    the folded factor, its scales), so that a set-up too slow to end in a call still shows which part holds it (at
    1M points on the H200 that was the pivoted Cholesky: see experiments/pivot_probe.py)."""
    x64 = X.to(torch.float64).contiguous()
    s64 = torch.tensor(OUTPUTSCALE, dtype=torch.float64, device=X.device)
    exact, t = _timed(lambda: CovarianceProduct(x64, "matrix_free"))
    exact.update(ls, s64, torch.tensor(NOISE, dtype=torch.float64, device=X.device))
    print(f"n={n}: set-up part: float64 product {t:.2f} s", flush=True)
    diagonal = torch.full((n,), OUTPUTSCALE, dtype=torch.float64, device=X.device)
    L, t = _timed(lambda: pivoted_cholesky(exact.kernel_rows, diagonal, min(rank, n)))
    print(f"n={n}: set-up part: pivoted Cholesky of rank {L.shape[1]} {t:.2f} s", flush=True)
    pc, t = _timed(lambda: Preconditioner(L, OUTPUTSCALE, torch.float64, fold=True))
    print(f"n={n}: set-up part: folded factor {t:.2f} s", flush=True)
    _, t = _timed(lambda: pc.set_scales(OUTPUTSCALE, NOISE))
    print(f"n={n}: set-up part: set_scales {t:.2f} s", flush=True)


def pieces(n: int, d: int, m: int, device: str, iters: int, mean_atol: float) -> dict:
    """The parts of the cost model at n, without the solves that would not fit in one call: the preconditioner,
    one product of each kind, the convergence rate of the first ``iters`` CG iterations of the mean-weight solve
    (and the iterations it predicts for ``mean_atol``), and the bounds that need no solve for m test points."""
    dev = torch.device(device)
    X, y, Xt, ls = _data(n, d, m, dev)
    # a mean tolerance nothing misses: the set-up is the preconditioner alone
    print(f"n={n}: data ready", flush=True)  # each part is printed as it ends: a cut run still says how far it got
    _setup_parts(X, ls, n)
    post, t_pre = _timed(lambda: CGPosterior(X, y, ls, OUTPUTSCALE, NOISE, 0.0, mean_atol=1e30, chunk_bytes=None))
    print(f"n={n}: preconditioner {t_pre:.2f} s", flush=True)
    c = min(post._chunk(), m)  # the pipeline never takes more test points at once than there are
    g = torch.Generator(device="cpu").manual_seed(2)
    V = torch.randn(n, c, generator=g, dtype=torch.float64).to(dev)
    row = {"n": n, "d": d, "device": str(dev), "preconditioner_s": t_pre, "chunk_points": c}
    V1, V16, Vc = V[:, :1].contiguous(), V[:, :16].float().contiguous(), V.float()
    post.work.matmul(V1.float())  # the first call of each kind pays for set-up, not work
    for key, fn in (
        ("product_t1_s", lambda: post.work.matmul(V1.float())),
        ("product_t16_s", lambda: post.work.matmul(V16)),
        ("product_chunk_s", lambda: post.work.matmul(Vc)),
        ("product_float64_t1_s", lambda: post.exact.matmul(V1)),
    ):
        row[key] = _timed(fn)[1]
        print(f"n={n}: {key} {row[key]:.3f}", flush=True)
    r = y.reshape(-1, 1) - post.mean
    gap0 = float(_dot_p(post, r))
    post.max_iter = iters
    D, t_cg = _timed(lambda: post._inner(r, torch.zeros(1, dtype=torch.float64, device=dev)))
    gap = float(_dot_p(post, r - post.exact.matmul(D)))
    rate = (gap / gap0) ** (1 / iters)
    target = mean_atol**2 / OUTPUTSCALE
    row.update(cg_iters=iters, mean_atol=mean_atol, cg_s=t_cg, gap_ratio=gap / gap0, rate_per_iter=rate)
    row["predicted_alpha_iters"] = math.log(target / gap0) / math.log(rate) if rate < 1 else float("inf")
    print(f"n={n}: alpha solve {row}", flush=True)
    post.variance_budget = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CGPredictionWarning)
        (_, var), t_quick = _timed(lambda: post.predict(Xt, return_var=True, include_noise=True))
    row.update(quick_bounds_s=t_quick, quick=_interval_stats(var, post.variance_error, post.variance_rtol))
    return row


def _dot_p(post: CGPosterior, R: torch.Tensor) -> torch.Tensor:
    return (R * post.precond64.solve(R)).sum()


def _agree_table(agree: list) -> str:
    rows = []
    for r in agree:
        for name in ("test", "train", "far"):
            p = r[name]
            rows.append(
                [
                    r["n"],
                    f"{name} ({p['points']})",
                    f"{p['max_mean_diff_std_y']:.1e}",
                    f"{p['max_rel_std_diff']:.1e}",
                    f"{p['min_std']:.4f} / {r['noise_std']:.4f}",
                    f"{p['max_certified_rel_var_error']:.1e}",
                    p["bound_holds"],
                    f"{r['exact_s']:.1f}",
                    f"{r['cg_setup_s']:.1f} + {p['cg_predict_s']:.1f}",
                ]
            )
    return md_table(
        [
            "n",
            "points",
            "max |mean diff| / std(y)",
            "max rel std diff",
            "min std / noise std",
            "certified rel var error",
            "bound holds",
            "Cholesky s (all)",
            "CG s (set-up + these)",
        ],
        rows,
    )


def _scale_table(scaled: list) -> str:
    rows = []
    for r in scaled:
        f = r["final"]
        rows.append(
            [
                r["n"],
                r["test_points"],
                f"{r['setup_s']:.1f} ({r['setup_cg_iterations']})",
                f"{r['mean_s']:.2f}",
                f"{r['variance_s']:.1f} ({r['variance_cg_iterations']})",
                f"{r['total_s']:.1f}",
                "none" if r["variance_budget_s"] is None else f"{r['variance_budget_s']:g}",
                f"{r['mean_error_bound']:.1e}",
                f"{f['rel_var_halfwidth_median']:.1e} / {f['rel_var_halfwidth_p99']:.1e} / "
                f"{f['rel_var_halfwidth_max']:.1e}",
                f"{f['points_certified_rtol']} / {f['points_std_within_2pct']}",
                "-" if "quick" not in r else f"{r['quick']['points_certified_rtol']} ({r['quick_bounds_s']:.1f} s)",
            ]
        )
    head = ["n", "test points", "set-up s (CG its)", "means s", "means + variances s (CG its)", "total s"]
    head += ["variance budget s", "mean error bound", "rel var half-width median / 99% / max"]
    head += ["certified to 1% var / std within 2%", "certified by the bounds alone (s)"]
    return md_table(head, rows)


def _pieces_table(rows: list) -> str:
    head = ["n", "preconditioner s", "K@v s (t=1 / 16 / chunk)", "float64 K@v s", "chunk"]
    head += ["CG its timed", "CG s", "rate per it", "predicted its (mean error)", "bounds alone: s, certified"]
    out = [
        [
            r["n"],
            f"{r['preconditioner_s']:.1f}",
            f"{r['product_t1_s']:.3f} / {r['product_t16_s']:.3f} / {r['product_chunk_s']:.3f}",
            f"{r['product_float64_t1_s']:.3f}",
            r["chunk_points"],
            r["cg_iters"],
            f"{r['cg_s']:.1f}",
            f"{r['rate_per_iter']:.4f}",
            f"{r['predicted_alpha_iters']:.0f} ({r['mean_atol']:g})",
            f"{r['quick_bounds_s']:.1f}, {r['quick']['points_certified_rtol']}",
        ]
        for r in rows
    ]
    return md_table(head, out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agree", type=int, nargs="*", default=[], metavar="N", help="sizes for the Cholesky check")
    ap.add_argument("--scale", type=int, nargs="*", default=[], metavar="N", help="sizes for the whole pipeline")
    ap.add_argument("--pieces", type=int, nargs="*", default=[], metavar="N", help="sizes for the cost model parts")
    ap.add_argument("--d", type=int, default=8)
    ap.add_argument("--test", type=int, default=10_000, help="test points (--scale, --pieces)")
    ap.add_argument("--points", type=int, default=500, help="test and training points each (--agree)")
    ap.add_argument("--variance-budget", type=float, default=None, help="seconds of CG for the variances")
    ap.add_argument("--mean-atol", type=float, default=1e-3, help="certified mean error, in std(y)")
    ap.add_argument("--local-points", type=int, default=512, help="nearest points of the bounds with no solve")
    ap.add_argument("--quick-first", action="store_true", help="also time the bounds that need no solve alone")
    ap.add_argument("--cg-iters", type=int, default=50, help="CG iterations timed by --pieces")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--stem", default="cg_prediction")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    agree = [agreement(n, args.d, min(args.points, n), args.device) for n in args.agree]
    scaled = [
        scale(
            n, args.d, args.test, args.device, args.variance_budget, args.mean_atol, args.quick_first, args.local_points
        )
        for n in args.scale
    ]
    parted = [pieces(n, args.d, args.test, args.device, args.cg_iters, args.mean_atol) for n in args.pieces]
    for r in agree + scaled + parted:
        print(r, flush=True)
    parts = [_agree_table(agree)] if agree else []
    parts += [_scale_table(scaled)] if scaled else []
    parts += [_pieces_table(parted)] if parted else []
    print(
        write_results(
            args.out,
            args.stem,
            f"CG-path prediction (synthetic, d = {args.d}, noise {NOISE}, outputscale {OUTPUTSCALE})",
            "\n\n".join(parts),
            agree + scaled + parted,
        )
    )


if __name__ == "__main__":
    main()
