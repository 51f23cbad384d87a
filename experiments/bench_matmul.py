"""Matrix-free K @ V on the GPU: time, accuracy and memory at n = m = 40k, 200k, 1M (d=8, t=16).

Floors: exact float32 on the CUDA cores, (2d + 2t) flops per pair at 67 TFLOP/s; the exponentials,
16 per SM per clock on the H200 (132 SMs, 1.98 GHz). Accuracy is measured on 256 random rows against a float64
computation of the same rows. With ``--backward``, forward+backward is timed twice: with every gradient (x, lengthscale,
outputscale, v: the backward's two row passes and K^T G), and with the hyperparameters' only, as the training engine
needs them (one row pass: the gradient mask skips the points' passes). ``--cases N:T ...`` picks (n, t) pairs
instead of the product of --sizes and --t. Writes experiments/results/STEM.{md,json}.

``--kernels K ...`` times instead each named kernel of the private op ``_rbf_matmul_kernel`` (``cuda_cores``, the
tensor-core ``tc`` and its variants; ``gpfast.ops.MATMUL_KERNELS``; and the symmetric ones,
``gpfast.ops.MATMUL_SYMMETRIC_KERNELS``) on every case, with its error on the same 256 rows, beside the tensor cores'
floor: 3xTF32 is three TF32 MMAs per product, so 3 * 2 * (8 ceil(d / 8) + 8 ceil(t / 8)) flops a pair (the cross
term and P V) at the H200's 356 TFLOP/s (measured on the project's GPU machine). The floors are those of computing
every ordered pair; the symmetric kernels compute each pair once, so their own floors are lower (the exponential's
half; the MMAs' (ceil(d / 8) + 2 ceil(t / 8)) / (2 ceil(d / 8) + 2 ceil(t / 8)), 5/6 at d <= 8 and t = 16, since
the cross term is formed once and P V twice). Writes
experiments/results/STEM_kernels.{md,json}.
"""

from __future__ import annotations

import argparse

import torch

from experiments import RESULTS
from gpfast import _reference, ops
from gpfast.bench.report import md_table, write_results
from gpfast.bench.timing import EXP_RATE, cuda_time_ms

FP32_RATE = 67e12
TF32_RATE = 356e12  # the H200's dense TF32 MMA rate as measured on the project's GPU machine (its notes)


def _problem(n, d, t):
    """Random points (n, d), lengthscales, outputscale and right-hand sides (n, t) on the GPU."""
    dev = "cuda"
    return (
        torch.randn(n, d, device=dev),
        torch.rand(d, device=dev) + 0.5,
        torch.tensor(1.3, device=dev),
        torch.randn(n, t, device=dev),
    )


def bench(n, d, t, reps, with_backward, with_gpytorch=True):
    dev = "cuda"
    x, l, s, v = _problem(n, d, t)
    pairs = n * n
    row = {"n": n, "d": d, "t": t, "flop_floor_s": (2 * d + 2 * t) * pairs / FP32_RATE, "exp_floor_s": pairs / EXP_RATE}
    torch.cuda.reset_peak_memory_stats()
    out = ops.rbf_matmul(x, x, l, s, v, check_values=False)
    row["gpfast_s"] = cuda_time_ms(lambda: ops.rbf_matmul(x, x, l, s, v, check_values=False), warmup=1, reps=reps) / 1e3
    row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    rows_idx = torch.randperm(n, device=dev)[:256]
    want = _reference.rbf_covariance(x[rows_idx].double(), x.double(), l.double(), s.double()) @ v.double()
    row["rel_err"] = ((out[rows_idx].double() - want).norm() / want.norm()).item()
    plain = _reference.rbf_covariance(x[rows_idx], x, l, s) @ v
    row["plain_fp32_rel_err"] = ((plain.double() - want).norm() / want.norm()).item()
    # the alternative for many right-hand sides: K formed one block of rows at a time by the fused forward,
    # multiplied by cuBLAS (float32, TF32 off as in torch's default), memory rows x n
    block = max(1, (1 << 26) // n)

    def blocked_dense():
        return torch.cat(
            [ops.rbf_covariance(x[i : i + block], x, l, s, check_values=False) @ v for i in range(0, n, block)]
        )

    if 2 * pairs * t <= 2e14:  # about 4 s per product on the H200's CUDA cores
        row["blocked_dense_s"] = cuda_time_ms(blocked_dense, warmup=1, reps=reps) / 1e3
    else:
        row["blocked_dense_s"] = "not run (too long)"
    if with_backward:
        xa, la, sa, va = (a.clone().requires_grad_() for a in (x, l, s, v))
        G = torch.randn(n, t, device=dev)

        def fb(wrt):
            def step():
                o = ops.rbf_matmul(xa, xa, la, sa, va, check_values=False)
                torch.autograd.grad(o, wrt, G)

            return step

        row["gpfast_fwd_bwd_s"] = cuda_time_ms(fb((xa, la, sa, va)), warmup=1, reps=max(1, reps // 2)) / 1e3
        xa.requires_grad_(False)
        va.requires_grad_(False)
        row["gpfast_fwd_bwd_theta_s"] = cuda_time_ms(fb((la, sa)), warmup=1, reps=max(1, reps // 2)) / 1e3
    if with_gpytorch and n <= 60000:  # dense GPyTorch: form K, then K @ V
        import gpytorch

        k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=d)).to(dev)
        try:
            row["gpytorch_dense_s"] = cuda_time_ms(lambda: k(x, x).to_dense() @ v, warmup=1, reps=reps) / 1e3
        except torch.OutOfMemoryError:
            row["gpytorch_dense_s"] = "OOM"
        torch.cuda.empty_cache()
    elif with_gpytorch:
        row["gpytorch_dense_s"] = f"OOM (K alone needs {4 * pairs / 1e9:.0f} GB)"
    return row


def bench_kernels(n, d, t, reps, kernels):
    """One row per kernel of ``_rbf_matmul_kernel`` at n = m, K(x, x) @ V: median time and error on 256 rows."""
    dev = "cuda"
    x, l, s, v = _problem(n, d, t)
    pairs = n * n
    tc_flops = 3 * 2 * (8 * -(-d // 8) + 8 * -(-t // 8))
    floors = {"tf32x3_floor_s": tc_flops * pairs / TF32_RATE, "exp_floor_s": pairs / EXP_RATE}
    rows_idx = torch.randperm(n, device=dev)[:256]
    want = _reference.rbf_covariance(x[rows_idx].double(), x.double(), l.double(), s.double()) @ v.double()
    plain = _reference.rbf_covariance(x[rows_idx], x, l, s) @ v
    plain_err = ((plain.double() - want).norm() / want.norm()).item()
    out_rows = []
    for kernel in kernels:
        row = {"n": n, "d": d, "t": t, "kernel": kernel, **floors, "plain_fp32_rel_err": plain_err}
        try:
            out = ops._rbf_matmul_kernel(x, x, l, s, v, kernel)
        except ValueError as err:  # a variant's shape limits
            row["time_s"] = f"not run ({err})"
            out_rows.append(row)
            continue
        row["rel_err"] = ((out[rows_idx].double() - want).norm() / want.norm()).item()
        row["time_s"] = cuda_time_ms(lambda k=kernel: ops._rbf_matmul_kernel(x, x, l, s, v, k), 1, reps) / 1e3
        row["x_floor"] = row["time_s"] / max(floors.values())
        out_rows.append(row)
        print(row, flush=True)
    return out_rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[40000, 200000, 1000000])
    parser.add_argument("--d", type=int, default=8)
    parser.add_argument("--t", type=int, nargs="+", default=[16], help="right-hand sides (several: a sweep)")
    parser.add_argument("--stem", default="bench_matmul", help="results file name (experiments/results/STEM.md)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--backward", action="store_true", help="also time forward+backward")
    parser.add_argument("--cases", nargs="+", help="N:T pairs (instead of the product of --sizes and --t)")
    parser.add_argument("--no-gpytorch", action="store_true", help="leave out dense GPyTorch")
    parser.add_argument(
        "--kernels",
        nargs="+",
        choices=ops.MATMUL_KERNELS + ops.MATMUL_SYMMETRIC_KERNELS,
        help="time these kernels instead",
    )
    args = parser.parse_args(argv)
    if args.cases:
        cases = [tuple(int(v) for v in c.split(":")) for c in args.cases]
    else:
        cases = [(n, t) for n in args.sizes for t in args.t]
    if args.kernels:
        rows = [r for n, t in cases for r in bench_kernels(n, args.d, t, args.reps if n < 500000 else 3, args.kernels)]
        cols = ["n", "d", "t", "kernel", "time_s", "tf32x3_floor_s", "exp_floor_s", "x_floor", "rel_err"]
        cols.append("plain_fp32_rel_err")
        heads = ["n", "d", "t", "kernel", "K@V (s)", "3xTF32 floor (s)", "exp floor (s)", "x larger floor"]
        heads += ["rel. err vs fp64", "plain fp32 rel. err"]
        table = md_table(heads, [[r.get(c, "–") for c in cols] for r in rows])
        title = "Matrix-free K @ V: each kernel of _rbf_matmul_kernel"
        print(write_results(RESULTS, f"{args.stem}_kernels", title, table, rows))
        return
    rows = []
    for n, t in cases:
        rows.append(bench(n, args.d, t, args.reps if n < 500000 else 3, args.backward, not args.no_gpytorch))
        print(rows[-1], flush=True)
    cols = [
        "n",
        "d",
        "t",
        "gpfast_s",
        "gpfast_fwd_bwd_s",
        "gpfast_fwd_bwd_theta_s",
        "blocked_dense_s",
        "flop_floor_s",
        "exp_floor_s",
        "gpytorch_dense_s",
        "rel_err",
        "plain_fp32_rel_err",
        "peak_gb",
    ]
    table = md_table(
        [
            "n",
            "d",
            "t",
            "gpfast K@V (s)",
            "gpfast fwd+bwd, all gradients (s)",
            "gpfast fwd+bwd, l and s only (s)",
            "row blocks of K @ V, cuBLAS (s)",
            "fp32 CUDA-core floor (s)",
            "exp floor (s)",
            "GPyTorch dense K, K@V (s)",
            "rel. err vs fp64",
            "plain fp32 rel. err",
            "peak GB",
        ],
        [[r.get(c, "–") for c in cols] for r in rows],
    )
    print(write_results(RESULTS, args.stem, "Matrix-free K @ V (fused, never stores K)", table, rows))


if __name__ == "__main__":
    main()
