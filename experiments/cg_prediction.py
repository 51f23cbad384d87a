"""CG-path predictions against the exact float64 Cholesky ones, and their cost at scale.

    python -m experiments.cg_prediction --agree 100000 --scale 1000000 --device cuda

``--agree N``: at N synthetic points (d=8) and well-fitted high signal-to-noise hyperparameters (the data's own
lengthscale, outputscale 1, noise 0.01, so the training covariance's condition number is about N / 0.01), the
mean and standard deviation of y at test points, at training points and far from the data, by
:class:`gpfast.models.CGPosterior` (float32 solves, float64 refinement) and by the float64 Cholesky
(factored in place, one matrix of 8 N^2 bytes). Reports the largest mean difference in std(y), the largest
relative std difference, the smallest std against the noise std, each method's time, and the certified bounds.

``--scale N``: the CG posterior alone at N points: the set-up (preconditioner and the solve for the mean
weights), the means of ``--test`` points, and the variances of a sample of ``--sample`` of them with their
certified error; the time for the variances of all ``--test`` points is that sample's time scaled up, and is
labelled so.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from experiments import RESULTS
from gpfast import datasets
from gpfast.bench.report import md_table, write_results
from gpfast.bench.timing import sync
from gpfast.models import CGPosterior
from gpfast.ops import rbf_covariance

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


def scale(n: int, d: int, m: int, sample: int, device: str) -> dict:
    dev = torch.device(device)
    X, y, Xt, ls = _data(n, d, m, dev)
    post, t_setup = _timed(lambda: CGPosterior(X, y, ls, OUTPUTSCALE, NOISE, 0.0, dtype=torch.float32))
    it_setup = post.iterations
    mean, t_mean = _timed(lambda: post.predict(Xt))
    (_, var), t_var = _timed(lambda: post.predict(Xt[:sample], return_var=True, include_noise=True))
    return {
        "n": n,
        "d": d,
        "device": str(dev),
        "setup_s": t_setup,
        "setup_cg_iterations": it_setup,
        "mean_points": m,
        "mean_s": t_mean,
        "mean_error_bound": post.mean_error,
        "variance_sample": sample,
        "variance_sample_s": t_var,
        "variance_cg_iterations": post.iterations - it_setup,
        "variance_all_s_scaled": t_var * m / sample,
        "max_certified_rel_var_error": float((post.variance_error / var).max()),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agree", type=int, nargs="*", default=[], metavar="N", help="sizes for the Cholesky check")
    ap.add_argument("--scale", type=int, nargs="*", default=[], metavar="N", help="sizes for the cost at scale")
    ap.add_argument("--d", type=int, default=8)
    ap.add_argument("--test", type=int, default=10_000, help="test points (--scale)")
    ap.add_argument("--points", type=int, default=500, help="test and training points each (--agree)")
    ap.add_argument("--sample", type=int, default=64, help="points whose variances are solved at --scale")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--stem", default="cg_prediction")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    agree = []
    for n in args.agree:
        agree.append(agreement(n, args.d, min(args.points, n), args.device))
        print(agree[-1], flush=True)
    scaled = []
    for n in args.scale:
        scaled.append(scale(n, args.d, args.test, args.sample, args.device))
        print(scaled[-1], flush=True)
    parts = []
    if agree:
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
        parts.append(
            md_table(
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
        )
    if scaled:
        parts.append(
            md_table(
                [
                    "n",
                    "set-up s",
                    "means of test points, s",
                    "variances of a sample, s",
                    "variances of all, s (scaled)",
                    "mean error bound",
                    "certified rel var error",
                ],
                [
                    [
                        r["n"],
                        f"{r['setup_s']:.1f}",
                        f"{r['mean_s']:.2f} ({r['mean_points']})",
                        f"{r['variance_sample_s']:.1f} ({r['variance_sample']})",
                        f"{r['variance_all_s_scaled']:.0f}",
                        f"{r['mean_error_bound']:.1e}",
                        f"{r['max_certified_rel_var_error']:.1e}",
                    ]
                    for r in scaled
                ],
            )
        )
    print(
        write_results(
            args.out,
            args.stem,
            f"CG-path prediction (synthetic, d = {args.d}, noise {NOISE}, outputscale {OUTPUTSCALE})",
            "\n\n".join(parts),
            agree + scaled,
        )
    )


if __name__ == "__main__":
    main()
