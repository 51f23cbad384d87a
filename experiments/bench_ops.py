"""Micro-benchmark of the fused covariance op against eager PyTorch, torch.compile and GPyTorch.

Run on a GPU: ``python -m experiments.bench_ops``. Times are medians of CUDA-event timings after warm-up;
``floor`` is the larger of the bytes the forward must move (inputs read once, K written once) over the 4.27 TB/s
copy bandwidth measured on the H200 and its n m exponentials at 16 per SM per clock. The forward is timed with the
kernel each shape gets by default and with each one forced through the private op ``_rbf_covariance_kernel`` (the
row-streaming kernel by differences and by the norm expansion, the tiled kernel, and for float32 with 8 < d <= 32
the tensor-core kernel and its sweep variants), each with its error against float64 on the first 256 rows of the
first batch (norm-wise; ``plain`` is the plain float32 formula's); forward+backward with all four
gradients and with the hyperparameters' only (the points need no gradient: the gradient mask skips their passes).
``--quick`` leaves out eager PyTorch and torch.compile; ``--bwd-op`` adds the backward op alone (all gradients, and
the hyperparameters' only), by default and with each kernel named (two row passes in float64 arithmetic,
``rows64``; one pass in float32 arithmetic, ``onepass32``, d <= 16; from the forward's K, ``from_k``, what autograd
runs for float32), with each one's error against the float64 op.
``--points clustered`` draws the points around 64 centres instead (spread 0.05, a tenth of them exact copies of
another point), which is what real sets such as keggdirected look like to the kernels: duplicate and near pairs in
most tiles, so the near-pair recomputation of the expansion and tensor-core kernels runs often (with Gaussian draws
it almost never does). ``--stem`` names the results, experiments/results/<stem>.{md,json} (default bench_ops).
"""

from __future__ import annotations

import argparse

import torch

from experiments import RESULTS
from gpfast import _reference, ops
from gpfast.bench.report import md_table, write_results
from gpfast.bench.timing import COPY_BW, EXP_RATE, cuda_time_ms, graph_time_ms

SHAPES = [(16, 512, 128, 8), (1, 16384, 16384, 8), (4, 8192, 8192, 32), (1, 40000, 40000, 8)]


def eager(x1, x2, l, s):
    return _reference.rbf_covariance(x1, x2, l, s)


def _rel(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


def run_or_oom(fn):
    try:
        return fn()
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return "OOM"


# the row-streaming kernel's two forms, the tiled kernel, the tensor-core kernel and its variants (8 < d <= 32)
FWD_KERNELS, TC_KERNELS = ops.COVARIANCE_KERNELS, ops.COVARIANCE_TC_KERNELS
ERR_ROWS = 256  # rows of the forward compared with float64


def bench_backward_op(row, x1, x2, l, s, G, reps):
    """The backward op alone (no forward, no autograd), all gradients and the hyperparameters' only: keys
    gpfast_bwd and gpfast_bwd_theta (the default kernel), bwd_<kernel> and bwd_<kernel>_theta for each named row
    pass, and err_<kernel>: its largest norm-wise relative error over the four gradients against the float64 op on
    the same inputs in float64."""
    B, n, d = x1.shape
    args = (G, x1, x2, l.reshape(B, d), s)
    op = torch.ops.gpfast.rbf_covariance_backward.default
    row["gpfast_bwd"] = cuda_time_ms(lambda: op(*args, True), reps=reps)
    row["gpfast_bwd_theta"] = cuda_time_ms(lambda: op(*args, False), reps=reps)
    want = op(*(a.double() for a in args), True)
    named = torch.ops.gpfast._rbf_covariance_backward_kernel.default
    K = torch.ops.gpfast.rbf_covariance(*args[1:])
    from_k = torch.ops.gpfast._rbf_covariance_backward_from_k.default
    for kernel in ("rows64", "onepass32", "from_k") if d <= 16 else ("rows64", "from_k"):
        if kernel == "from_k":  # the forward's K given: what autograd runs after the forward

            def run(x_grads, kernel=kernel):
                return from_k(G, K, *args[1:], x_grads)
        else:

            def run(x_grads, kernel=kernel):
                return named(*args, x_grads, kernel)

        row[f"bwd_{kernel}"] = cuda_time_ms(lambda run=run: run(True), reps=reps)
        row[f"bwd_{kernel}_theta"] = cuda_time_ms(lambda run=run: run(False), reps=reps)
        row[f"err_{kernel}"] = max(((g.double() - w).norm() / w.norm()).item() for g, w in zip(run(True), want))
    del want


def clustered_points(B, n, d, centres, dev, generator=None):
    """(B, n, d) points around ``centres`` (C, d): spread 0.05, and a tenth of the points exact copies of others."""
    pick = torch.randint(0, centres.shape[0], (B, n), device=dev, generator=generator)
    x = centres[pick] + 0.05 * torch.randn(B, n, d, device=dev, generator=generator)
    copies = torch.randint(0, n, (B, n // 10), device=dev, generator=generator)
    x[:, : n // 10] = torch.gather(x, 1, copies.unsqueeze(-1).expand(-1, -1, d))
    return x


def bench_shape(B, n, m, d, reps, quick=False, bwd_op=False, points="gaussian"):
    dev = "cuda"
    if points == "clustered":
        centres = torch.randn(64, d, device=dev)
        x1 = clustered_points(B, n, d, centres, dev)
        x2 = x1 if m == n else clustered_points(B, m, d, centres, dev)
    else:
        x1 = torch.randn(B, n, d, device=dev)
        x2 = torch.randn(B, m, d, device=dev)
    l = torch.rand(B, 1, d, device=dev) + 0.5
    s = torch.rand(B, device=dev) + 0.5
    G = torch.randn(B, n, m, device=dev)
    floor_ms = max((4 * B * n * m + 4 * B * (n + m) * d) / COPY_BW, B * n * m / EXP_RATE) * 1e3
    row = {"shape": f"({B},{n},{m},{d})" + (" clustered" if points == "clustered" else ""), "floor_ms": floor_ms}

    def fwd(fn):
        return lambda: fn(x1, x2, l, s)

    def fwd_bwd(fn, points=True):
        a, b = (t.clone().requires_grad_(points) for t in (x1, x2))
        c, e = (t.clone().requires_grad_() for t in (l, s))
        wrt = (a, b, c, e) if points else (c, e)

        def step():
            K = fn(a, b, c, e)
            torch.autograd.grad(K, wrt, G)

        return step

    def gpfast_op(a, b, c, e):
        return ops.rbf_covariance(a, b, c, e, check_values=False)

    row["gpfast_fwd"] = cuda_time_ms(fwd(gpfast_op), reps=reps)
    forced = torch.ops.gpfast._rbf_covariance_kernel.default
    l2 = l.reshape(B, d)
    r = min(ERR_ROWS, n)
    want = _reference.rbf_covariance(x1[0, :r].double(), x2[0].double(), l[0].double(), s[0].double())
    row["err_fwd_plain"] = _rel(_reference.rbf_covariance(x1[0, :r], x2[0], l[0], s[0]), want)
    row["err_fwd"] = _rel(gpfast_op(x1, x2, l, s)[0, :r], want)
    for kernel in FWD_KERNELS:  # each forward kernel, forced (the default picks one by shape)
        if kernel in TC_KERNELS and not 8 < d <= 32:
            continue
        row[f"gpfast_fwd_{kernel}"] = cuda_time_ms(lambda kernel=kernel: forced(x1, x2, l2, s, kernel), reps=reps)
        row[f"err_fwd_{kernel}"] = _rel(forced(x1, x2, l2, s, kernel)[0, :r], want)
    del want
    row["gpfast_fwd_bwd"] = cuda_time_ms(fwd_bwd(gpfast_op), reps=reps)
    row["gpfast_fwd_bwd_theta"] = cuda_time_ms(fwd_bwd(gpfast_op, points=False), reps=reps)
    if bwd_op:
        bench_backward_op(row, x1, x2, l, s, G, reps)
    if n * m * B <= 2**20:
        row["gpfast_fwd_graph"] = graph_time_ms(fwd(gpfast_op))
    if not quick:
        row["eager_fwd"] = run_or_oom(lambda: cuda_time_ms(fwd(eager), reps=reps))
        row["eager_fwd_bwd"] = run_or_oom(lambda: cuda_time_ms(fwd_bwd(eager), reps=reps))
        compiled = torch.compile(eager)
        row["compile_fwd"] = run_or_oom(lambda: cuda_time_ms(fwd(compiled), reps=reps))
        row["compile_fwd_bwd"] = run_or_oom(lambda: cuda_time_ms(fwd_bwd(compiled), reps=reps))
    import gpytorch

    k = gpytorch.kernels.ScaleKernel(
        gpytorch.kernels.RBFKernel(ard_num_dims=d, batch_shape=torch.Size([B])), batch_shape=torch.Size([B])
    ).to(dev)

    def gpy(a, b, c, e):  # the hyperparameters are the kernel's own; timing is what matters here
        return k(a, b).to_dense()

    row["gpytorch_fwd"] = run_or_oom(lambda: cuda_time_ms(fwd(gpy), reps=reps))

    def gpy_bwd():
        a, b = x1.clone().requires_grad_(), x2.clone()
        K = k(a, b).to_dense()
        torch.autograd.grad(K, [a, *k.parameters()], G)

    row["gpytorch_fwd_bwd"] = run_or_oom(lambda: cuda_time_ms(gpy_bwd, reps=reps))
    torch.cuda.empty_cache()
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="leave out eager PyTorch and torch.compile")
    parser.add_argument("--shapes", nargs="+", help="B,n,m,d shapes (default: the four target shapes)")
    parser.add_argument("--bwd-op", action="store_true", help="also time the backward op alone")
    parser.add_argument("--points", choices=["gaussian", "clustered"], default="gaussian", help="how points are drawn")
    parser.add_argument("--stem", default="bench_ops", help="results file name")
    args = parser.parse_args(argv)
    shapes = [tuple(int(v) for v in sh.split(",")) for sh in args.shapes] if args.shapes else SHAPES
    ops.rbf_covariance(torch.randn(2, 2, device="cuda"), torch.randn(2, 2, device="cuda"), 1.0, 1.0)
    rows = []
    for shape in shapes:
        rows.append(bench_shape(*shape, reps=args.reps, quick=args.quick, bwd_op=args.bwd_op, points=args.points))
        print(rows[-1], flush=True)
    cols = [
        "shape",
        "floor_ms",
        "gpfast_fwd",
        "gpfast_fwd_diff",
        "gpfast_fwd_expand",
        "gpfast_fwd_tile",
        "gpfast_fwd_tc",
        "gpfast_fwd_tc_mt2",
        "gpfast_fwd_tc_w4",
        "err_fwd_plain",
        "err_fwd",
        "err_fwd_expand",
        "err_fwd_tc",
        "gpfast_fwd_graph",
        "gpfast_fwd_bwd",
        "gpfast_fwd_bwd_theta",
        "gpfast_bwd",
        "gpfast_bwd_theta",
        "bwd_rows64",
        "bwd_onepass32",
        "bwd_from_k",
        "bwd_rows64_theta",
        "bwd_onepass32_theta",
        "bwd_from_k_theta",
        "err_rows64",
        "err_onepass32",
        "err_from_k",
        "eager_fwd",
        "eager_fwd_bwd",
        "compile_fwd",
        "compile_fwd_bwd",
        "gpytorch_fwd",
        "gpytorch_fwd_bwd",
    ]
    table = md_table(
        [
            "shape",
            "floor",
            "gpfast fwd",
            "fwd, differences",
            "fwd, norm expansion",
            "fwd, tiled",
            "fwd, tensor cores",
            "fwd, tc 2 row tiles",
            "fwd, tc 4 warps",
            "fwd error, plain float32",
            "fwd error, default",
            "fwd error, expansion",
            "fwd error, tensor cores",
            "gpfast fwd (graph replay)",
            "gpfast fwd+bwd",
            "gpfast fwd+bwd (l, s only)",
            "bwd op",
            "bwd op (l, s only)",
            "bwd, float64 passes",
            "bwd, float32 one pass",
            "bwd from K",
            "bwd (l, s), float64 pass",
            "bwd (l, s), float32 one pass",
            "bwd (l, s) from K",
            "error, float64 passes",
            "error, float32 one pass",
            "error, from K",
            "eager fwd",
            "eager fwd+bwd",
            "compile fwd",
            "compile fwd+bwd",
            "GPyTorch fwd",
            "GPyTorch fwd+bwd",
        ],
        [[r.get(c, "–") for c in cols] for r in rows],
    )
    extra = ["", "All times in ms (median of CUDA-event timings). fwd/floor and GPyTorch-fwd+bwd / gpfast-fwd+bwd:", ""]
    for r in rows:
        gb = r["gpytorch_fwd_bwd"]
        speed = f"{gb / r['gpfast_fwd_bwd']:.1f}x" if isinstance(gb, float) else "n/a"
        extra.append(
            f"- {r['shape']}: fwd at {r['gpfast_fwd'] / r['floor_ms']:.2f}x the floor; "
            f"fwd+bwd {speed} faster than GPyTorch"
        )
    title = "Fused RBF covariance op: forward and forward+backward" + (
        ", points around 64 centres with duplicates" if args.points == "clustered" else ""
    )
    print(write_results(RESULTS, args.stem, title, table + "\n" + "\n".join(extra), rows))


if __name__ == "__main__":
    main()
