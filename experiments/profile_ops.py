"""One call of an op between cudaProfilerStart/Stop, for Nsight Compute (``ncu --profile-from-start off``).

    ncu --profile-from-start off --clock-control none --set basic python -m experiments.profile_ops --op cov_bwd

``--op cov_bwd [--bwd-kernel K]``: rbf_covariance_backward at n = m = 16384, d = 8, float32, all gradients, by
default or by the named kernel of ``_rbf_covariance_backward_kernel``; ``--op cov_fwd [--fwd-kernel K]``:
rbf_covariance at (4, 8192, 8192, 32), float32, by default or by the named kernel of ``_rbf_covariance_kernel``;
``--op dense_matmul``: the stored-K product at n = 36000, t = 11; ``--op kv --kernel K``: K(x, x) @ V by the named
kernel of ``_rbf_matmul_kernel`` at n = 200,000, d = 8, t = 16; ``--op pivot``: the preconditioner's pivoted
Cholesky (blocks of 32 pivots from 64 candidates, float64) at rank 1600 on n = 13,500 points, d = 26 (pol's shape; an
RBF kernel on Gaussian points), whose ``_pivot_select`` and ``_pivot_block`` kernels ncu's ``--kernel-name`` picks
out. Inputs are built and the op run once (build, load, warm-up) before the profiled call.
"""

from __future__ import annotations

import argparse

import torch

from gpfast import ops
from gpfast.train.preconditioner import pivoted_cholesky


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", choices=["cov_bwd", "cov_fwd", "dense_matmul", "kv", "pivot"], default="cov_bwd")
    ap.add_argument("--n", type=int, default=None)
    ap.add_argument("--kernel", choices=ops.MATMUL_KERNELS, default="tc", help="--op kv: the kernel")
    ap.add_argument(
        "--bwd-kernel", choices=ops.COVARIANCE_BACKWARD_KERNELS, default=None, help="--op cov_bwd: a named kernel"
    )
    ap.add_argument("--fwd-kernel", choices=ops.COVARIANCE_KERNELS, default=None, help="--op cov_fwd: a named kernel")
    args = ap.parse_args(argv)
    dev = "cuda"
    if args.op == "cov_bwd":
        n, d = args.n or 16384, 8
        x1, x2 = torch.randn(1, n, d, device=dev), torch.randn(1, n, d, device=dev)
        l, s = torch.rand(1, d, device=dev) + 0.5, torch.rand(1, device=dev) + 0.5
        G = torch.randn(1, n, n, device=dev)

        def call():
            if args.bwd_kernel is None:
                return torch.ops.gpfast.rbf_covariance_backward(G, x1, x2, l, s, True)
            return torch.ops.gpfast._rbf_covariance_backward_kernel(G, x1, x2, l, s, True, args.bwd_kernel)
    elif args.op == "cov_fwd":
        n, d = args.n or 8192, 32
        x = torch.randn(4, n, d, device=dev)
        l, s = torch.rand(4, d, device=dev) + 2.0, torch.rand(4, device=dev) + 0.5

        def call():
            if args.fwd_kernel is None:
                return torch.ops.gpfast.rbf_covariance(x, x, l, s)
            return torch.ops.gpfast._rbf_covariance_kernel(x, x, l, s, args.fwd_kernel)
    elif args.op == "kv":
        n, t = args.n or 200000, 16
        x, V = torch.randn(n, 8, device=dev), torch.randn(n, t, device=dev)
        l = torch.rand(8, device=dev) + 0.5

        def call():
            return ops._rbf_matmul_kernel(x, x, l, 1.3, V, args.kernel)
    elif args.op == "pivot":
        n, d = args.n or 13500, 26
        x = torch.randn(n, d, device=dev)
        l = torch.full((d,), 4.0, device=dev)
        diag = torch.ones(n, dtype=torch.float64, device=dev)

        def call():
            return pivoted_cholesky(lambda idx: ops.rbf_covariance(x[idx], x, l, 1.0).double(), diag, 1600, block=32)
    else:
        n, t = args.n or 36000, 11
        x = torch.randn(n, 8, device=dev)
        K = ops.rbf_covariance(x, x, torch.full((8,), 1.5, device=dev), 1.0)
        V = torch.randn(n, t, device=dev)

        def call():
            return ops.dense_matmul(K, V)

    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled one {args.op} call at n = {n}")


if __name__ == "__main__":
    main()
