"""Matrix-free K @ V on the GPU: time, accuracy and memory at n = m = 40k, 200k, 1M (d=8, t=16).

Floors: exact float32 on the CUDA cores, (2d + 2t) flops per pair at 67 TFLOP/s; the exponentials,
16 per SM per clock on the H200 (132 SMs, 1.98 GHz). Accuracy is measured on 256 random rows against a float64
computation of the same rows. With ``--backward``, forward+backward is timed twice: with every gradient (x, lengthscale,
outputscale, v: the backward's two row passes and K^T G), and with the hyperparameters' only, as the training engine
needs them (one row pass: the gradient mask skips the points' passes). ``--cases N:T ...`` picks (n, t) pairs
instead of the product of --sizes and --t. Writes experiments/results/STEM.{md,json}.
"""

from __future__ import annotations

import argparse

import torch

from experiments import RESULTS
from gpfast import _reference, ops
from gpfast.bench.report import md_table, write_results
from gpfast.bench.timing import EXP_RATE, cuda_time_ms

FP32_RATE = 67e12


def bench(n, d, t, reps, with_backward, with_gpytorch=True):
    dev = "cuda"
    x = torch.randn(n, d, device=dev)
    l = torch.rand(d, device=dev) + 0.5
    s = torch.tensor(1.3, device=dev)
    v = torch.randn(n, t, device=dev)
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
    args = parser.parse_args(argv)
    if args.cases:
        cases = [tuple(int(v) for v in c.split(":")) for c in args.cases]
    else:
        cases = [(n, t) for n in args.sizes for t in args.t]
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
