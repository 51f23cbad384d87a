"""K @ V and the covariance forward on tensor cores against the CUDA-core kernels: time and accuracy of every
variant in one run.

Kernels through the private ``ops._rbf_matmul_kernel``: ``cuda_core`` (what ``rbf_matmul`` runs) and the tensor-core
kernel ``tc`` with its variants (``_m2``: 2 instead of 4 row tiles per warp; ``_poly1``/``_poly2``: 1 or 2 of every
4 exponentials by polynomial on the FMA units instead of MUFU.EX2; ``_flush``: each 8 columns' products added to the
tile's sum by a float32 addition rather than on the tensor core's accumulator; ``_nosplit``: TF32 operands without
the 3xTF32 split, outside the accuracy rule, to show what the split costs). Each shape's points are drawn once; the
error is measured on 256 random rows against float64, next to the plain float32 formula's; "rule" says whether the
kernel meets the accuracy rule (at most 2x the plain formula's error + 1e-6). Times: CUDA events, medians, after a
warm-up (3 repetitions at n >= 500k, where one call takes about a second), including the sum of column splits. The
exp floor is one MUFU.EX2 per pair at 16 per SM and clock. Then the covariance forward (float32) by rbf_covariance's
default kernel and by each one named through ``_rbf_covariance_kernel`` ("expand", "diff", "tc"), against its store
floor (one write of K at the device's copy rate), error on 64 rows against float64 (rule: max(2x plain, 1e-6), the
norm expansion's). Writes experiments/results/STEM.{md,json}.
"""

from __future__ import annotations

import argparse

import torch

from experiments import RESULTS
from gpfast import _reference, ops
from gpfast.bench.report import md_table, write_results
from gpfast.bench.timing import COPY_BW, EXP_RATE, cuda_time_ms

VARIANTS = [
    "cuda_core",
    "tc",
    "tc_m2",
    "tc_poly1",
    "tc_poly2",
    "tc_m2_poly1",
    "tc_m2_poly2",
    "tc_flush",
    "tc_m2_flush",
    "tc_poly1_flush",
    "tc_nosplit",
]


def bench_shape(n, d, t, kernels, reps, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, d, device="cuda", generator=gen)
    l = torch.rand(d, device="cuda", generator=gen) + 0.5
    s = torch.tensor(1.3, device="cuda")
    v = torch.randn(n, t, device="cuda", generator=gen)
    rows = torch.randperm(n, device="cuda", generator=gen)[:256]
    want = _reference.rbf_covariance(x[rows].double(), x.double(), l.double(), s.double()) @ v.double()
    plain = _reference.rbf_covariance(x[rows], x, l, s) @ v
    plain_err = ((plain.double() - want).norm() / want.norm()).item()
    out_rows = []
    base = None
    for kernel in kernels:

        def call(kernel=kernel):
            return ops._rbf_matmul_kernel(x, x, l, s, v, kernel)

        out = call()
        err = ((out[rows].double() - want).norm() / want.norm()).item()
        del out
        sec = cuda_time_ms(call, warmup=1, reps=reps) / 1e3
        base = sec if kernel == "cuda_core" else base
        row = {
            "n": n,
            "d": d,
            "t": t,
            "kernel": kernel,
            "time_s": sec,
            "speedup": base / sec if base else "–",
            "exp_floor_s": n * n / EXP_RATE,
            "rel_err": err,
            "plain_fp32_rel_err": plain_err,
            "rule": "yes" if err <= 2 * plain_err + 1e-6 else "NO",
        }
        out_rows.append(row)
        print(row, flush=True)
    return out_rows


def bench_covariance(batch, n, d, reps, seed=0):
    """The covariance forward by each kernel at (batch, n, n, d): time, and error on 64 rows against float64."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(batch, n, d, device="cuda", generator=gen)
    l = (torch.rand(batch, d, device="cuda", generator=gen) + 0.5) * max(1.0, (d / 8) ** 0.5)
    s = torch.rand(batch, device="cuda", generator=gen) + 0.5
    rows = torch.randperm(n, device="cuda", generator=gen)[:64]
    want = _reference.rbf_covariance(x[:, rows].double(), x.double(), l[:, None].double(), s.double())
    plain = _reference.rbf_covariance(x[:, rows], x, l[:, None], s)
    plain_err = ((plain.double() - want).norm() / want.norm()).item()
    out_rows = []
    base = None
    for kernel in ("default", "expand", "diff", "tc"):

        def call(kernel=kernel):
            if kernel == "default":
                return ops.rbf_covariance(x, x, l[:, None], s, check_values=False)
            return torch.ops.gpfast._rbf_covariance_kernel(x, x, l, s, kernel)

        err = ((call()[:, rows].double() - want).norm() / want.norm()).item()
        sec = cuda_time_ms(call, warmup=2, reps=reps) / 1e3
        base = sec if kernel == "default" else base
        row = {
            "shape": f"({batch}, {n}, {n}, {d})",
            "kernel": kernel,
            "time_ms": sec * 1e3,
            "speedup": base / sec,
            "store_floor_ms": batch * n * n * 4 / COPY_BW * 1e3,
            "rel_err": err,
            "plain_fp32_rel_err": plain_err,
            "rule": "yes" if err <= max(2 * plain_err, 1e-6) else "NO",
        }
        out_rows.append(row)
        print(row, flush=True)
    return out_rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--cases",
        nargs="+",
        default=["1000000:8:16", "40000:8:16", "1000000:8:11"],
        help="N:D:T shapes (n = m); the variants run where d <= 8 and t in 9..16, the rest run tc only",
    )
    parser.add_argument("--kernels", nargs="+", default=VARIANTS)
    parser.add_argument(
        "--first-only",
        action="store_true",
        help="sweep the variants on the first case only; the other cases run cuda_core and tc",
    )
    parser.add_argument("--reps", type=int, default=10, help="repetitions below n = 500k (3 above)")
    parser.add_argument(
        "--cov-cases", nargs="+", default=["4:8192:32", "1:16384:8"], help="B:N:D shapes of the covariance forward"
    )
    parser.add_argument("--stem", default="bench_tensor_cores")
    args = parser.parse_args(argv)
    rows = []
    for k, case in enumerate(args.cases):
        n, d, t = (int(c) for c in case.split(":"))
        kernels = args.kernels
        if (args.first_only and k > 0) or not (d <= 8 and 9 <= t <= 16):
            kernels = [kn for kn in args.kernels if kn in ("cuda_core", "tc")]
        rows += bench_shape(n, d, t, kernels, args.reps if n < 500000 else 3)
    cols = ["n", "d", "t", "kernel", "time_s", "speedup", "exp_floor_s", "rel_err", "plain_fp32_rel_err", "rule"]
    head = [
        "n = m",
        "d",
        "t",
        "kernel",
        "time (s)",
        "speed-up vs cuda_core",
        "exp floor (s)",
        "rel. err vs fp64",
        "plain fp32 rel. err",
        "meets the rule",
    ]
    table = md_table(head, [[r[c] for c in cols] for r in rows])
    cov_rows = []
    for case in args.cov_cases:
        batch, n, d = (int(c) for c in case.split(":"))
        cov_rows += bench_covariance(batch, n, d, 20)
    cov_cols = ["shape", "kernel", "time_ms", "speedup", "store_floor_ms", "rel_err", "plain_fp32_rel_err", "rule"]
    cov_head = ["(B, n, m, d)", "kernel", "time (ms)", "speed-up vs default", "store floor (ms)", "rel. err vs fp64"]
    cov_head += ["plain fp32 rel. err", "meets the rule"]
    table += "\n## Covariance forward (float32), by kernel\n\n"
    table += md_table(cov_head, [[r[c] for c in cov_cols] for r in cov_rows])
    title = "K @ V and the covariance forward on tensor cores: variants against the CUDA-core kernels"
    print(write_results(RESULTS, args.stem, title, table, rows + cov_rows))


if __name__ == "__main__":
    main()
