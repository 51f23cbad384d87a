"""Run every CUDA kernel path once on small odd shapes, for compute-sanitizer (memcheck, racecheck).

Covers: the covariance forward's kernels, by default and each forced through the private op
``_rbf_covariance_kernel`` (row streaming by differences and by the norm expansion, with and without vector stores,
the tiled kernel, and the tensor-core kernel with its sweep variants); K @ V in every right-hand-side bucket (1, 8,
12, 16, 32, several chunks), with column splits, and each of its kernels forced through ``_rbf_matmul_kernel`` (the
CUDA-core kernel, the tensor-core kernel and its variants, and for K(x, x) the symmetric kernels);
both backward ops with and without point gradients (the row passes, and the float64 dense fallback for d > 32 or
t > 32), and each tensor-core (lengthscale, outputscale) kernel forced through ``_rbf_matmul_backward_kernel``
(4 and 8 warps, K(x1, x2), K(x, x) with each pair once and, ``_nosym``, every ordered pair, in every feature and
weight bucket); the covariance backward's kernels forced through ``_rbf_covariance_backward_kernel`` and the
backward from the forward's K (``_rbf_covariance_backward_from_k``);
the stored-K product (``dense_matmul``) for t = 1..16 with a strided K, and with a float16 K
(``_dense_matmul_half``); the pivoted Cholesky's block steps (``_pivot_select``, ``_pivot_block``);
``stored_backward``'s tensor-core kernels, the engine's symmetric forward and its product reading half of a
symmetric K (``symmetric_matmul`` at each super-tile). Usage:
``python -m experiments.sanitize_ops [--only matmul|kvsym|backward|forward|stored|symmetric|pivot|half]`` (or
``python experiments/sanitize_ops.py``) under ``compute-sanitizer --tool memcheck|racecheck``; ``--only matmul``
runs the K @ V kernels alone, ``--only kvsym`` the symmetric K(x, x) @ V kernels alone, ``--only backward`` the
covariance backward's kernels, ``--only forward`` the covariance forward's, ``--only stored`` stored_backward's,
the symmetric forward and the symmetric product, ``--only symmetric`` the symmetric product alone, ``--only pivot``
the pivoted Cholesky's steps alone, ``--only half`` the float16-K product alone.
"""

import torch

from gpfast import ops


def _inputs(B, n, m, d, dev, dtype):
    """Random canonical inputs (x1 (B, n, d), x2 (B, m, d), lengthscale (B, d), outputscale (B,))."""
    x1 = torch.randn(B, n, d, device=dev, dtype=dtype)
    x2 = torch.randn(B, m, d, device=dev, dtype=dtype)
    return x1, x2, torch.rand(B, d, device=dev, dtype=dtype) + 0.5, torch.rand(B, device=dev, dtype=dtype) + 0.5


def run_covariance_forward(dev, dtype):
    """(B, n, m, d) with m % 4 != 0 (scalar stores) and m % 4 == 0 (vector stores); the tensor-core kernels for
    float32 with 8 < d <= 32 on ragged rows, columns and features, odd m among them."""
    for B, n, m, d in [(2, 37, 1027, 3), (1, 65, 1100, 8), (1, 33, 300, 16), (1, 20, 257, 29), (1, 9, 64, 40),
                       (2, 150, 333, 12), (1, 300, 130, 21)]:  # fmt: skip
        x1, x2, l, s = _inputs(B, n, m, d, dev, dtype)
        torch.ops.gpfast.rbf_covariance(x1, x2, l, s)
        tc = dtype == torch.float32 and 8 < d <= 32
        kernels = (
            ["tile"] if d > 32 else [k for k in ops.COVARIANCE_KERNELS if tc or k not in ops.COVARIANCE_TC_KERNELS]
        )
        for kernel in kernels:
            torch.ops.gpfast._rbf_covariance_kernel(x1, x2, l, s, kernel)
    torch.cuda.synchronize()


def run_all():
    torch.manual_seed(0)
    dev = "cuda"
    for dtype in (torch.float32, torch.float64):
        run_covariance_forward(dev, dtype)
        # K @ V: every right-hand-side bucket, and few rows against many columns (column splits)
        for B, n, m, d, t in [
            (2, 67, 131, 3, 1),
            (1, 130, 70, 8, 11),
            (1, 33, 300, 16, 12),
            (1, 40, 45, 29, 16),
            (1, 20, 30, 5, 17),
            (1, 9, 2000, 8, 8),
            (1, 25, 40, 32, 33),
            (1, 7, 9, 40, 3),
        ]:
            x1 = torch.randn(B, n, d, device=dev, dtype=dtype)
            x2 = torch.randn(B, m, d, device=dev, dtype=dtype)
            v = torch.randn(B, m, t, device=dev, dtype=dtype)
            ops.rbf_matmul(x1, x2, torch.rand(d, device=dev, dtype=dtype) + 0.5, 1.2, v)
        # the stored-K product: every t up to 16, odd row and column counts, a row stride wider than n
        for rows, n, t in [(37, 1027, 1), (130, 70, 11), (65, 300, 12), (9, 2001, 16), (3, 5, 7)]:
            K = torch.randn(rows, n + 3, device=dev, dtype=dtype)[:, :n]
            ops.dense_matmul(K, torch.randn(n, t, device=dev, dtype=dtype))
            ops.dense_matmul(K.contiguous(), torch.randn(n, device=dev, dtype=dtype))
        # both backward ops, with and without point gradients
        for B, n, m, d, t in [
            (2, 67, 131, 3, 1),
            (1, 130, 70, 8, 11),
            (1, 33, 300, 16, 16),
            (1, 40, 45, 29, 33),
            (1, 20, 30, 40, 5),
            (1, 300, 37, 32, 12),
            (2, 19, 1027, 9, 2),
        ]:
            x1, x2, l, s = _inputs(B, n, m, d, dev, dtype)
            v = torch.randn(B, m, t, device=dev, dtype=dtype)
            w = torch.randn(B, n, m, device=dev, dtype=dtype)
            g = torch.randn(B, n, t, device=dev, dtype=dtype)
            for x_grads in (True, False):
                torch.ops.gpfast.rbf_covariance_backward(w, x1, x2, l, s, x_grads)
                torch.ops.gpfast.rbf_matmul_backward(g, x1, x2, l, s, v, x_grads)
    run_covariance_backward(dev)
    run_bilinear_backward(dev)
    run_stored_backward(dev)
    run_matmul_kernels(dev)
    run_pivot_steps(dev)
    run_half_product(dev)
    torch.cuda.synchronize()


def run_half_product(dev):
    """The stored-K product with a float16 K (the preconditioner's factor kept in 16 bits): every t bucket, rows and
    columns ragged, row strides a multiple of 8 values (16-byte loads) and not (scalar loads)."""
    for rows, n, t in [(37, 1027, 1), (130, 70, 11), (65, 300, 12), (9, 2001, 16), (3, 5, 7), (200, 5000, 2)]:
        for K in (torch.randn(rows, n, device=dev).half(), torch.randn(rows, n + 8, device=dev).half()[:, :n],
                  torch.randn(rows, n + 3, device=dev).half()[:, :n]):  # fmt: skip
            torch.ops.gpfast._dense_matmul_half(K, torch.randn(n, t, device=dev))


def run_pivot_steps(dev):
    """The pivoted Cholesky's block steps: the pivots at every candidate count up to the kernel's 64, with rank
    left and exhausted, from rows wider than the candidates; the selection on one block and on many (the last
    block's merge of every block's list), with and without a previous block's columns, and with ties."""
    as64 = dict(device=dev, dtype=torch.float64)
    for c, b, rank in [(1, 1, 1), (7, 3, 7), (32, 16, 32), (33, 16, 5), (64, 32, 64)]:
        A = torch.randn(c, rank, **as64)
        cand = torch.randperm(c + 5, device=dev)[:c]
        rows = torch.randn(c, c + 5, **as64)
        rows[:, cand] = A @ A.t()
        d = torch.rand(c + 5, **as64)
        d[cand] = rows[:, cand].diagonal()
        torch.ops.gpfast._pivot_block(rows, cand, d, torch.tensor(1e-10, **as64), b)
    for n, r in [(1, 0), (100, 16), (5000, 0), (70_001, 32)]:
        d = torch.rand(n, **as64).round(decimals=2)  # ties
        cand = torch.arange(min(n, 64), device=dev)
        piv = torch.arange(min(r, n), device=dev)
        torch.ops.gpfast._pivot_select(d, torch.randn(r, n, **as64) * 0.1, cand, piv, min(n, 64))


def run_covariance_backward(dev):
    """The covariance backward's kernels forced through ``_rbf_covariance_backward_kernel`` on float32 inputs, and
    the backward from the forward's K, with and without point gradients: every feature bucket, rows ragged against
    the 128- and 64-row blocks and 16-row chunks, columns against the 32-column tiles, 16-column runs and the
    one-pass kernel's strips, and split over blocks."""
    for B, n, m, d in [
        (1, 40, 3000, 4),
        (2, 700, 50, 16),
        (2, 67, 131, 3),
        (1, 130, 70, 8),
        (1, 33, 300, 16),
        (1, 40, 45, 29),
        (1, 300, 37, 32),
        (2, 19, 1027, 9),
        (1, 1, 1, 1),
    ]:
        x1, x2, l, s = _inputs(B, n, m, d, dev, torch.float32)
        w = torch.randn(B, n, m, device=dev)
        K = torch.ops.gpfast.rbf_covariance(x1, x2, l, s)
        for x_grads in (True, False):
            for kernel in ("rows64", "onepass32") if d <= 16 else ("rows64",):  # one pass: d <= 16
                torch.ops.gpfast._rbf_covariance_backward_kernel(w, x1, x2, l, s, x_grads, kernel)
            # from the forward's K: K and the weights read along rows, then down columns (x_grads)
            torch.ops.gpfast._rbf_covariance_backward_from_k(w, K, x1, x2, l, s, x_grads)
    torch.cuda.synchronize()


def run_bilinear_backward(dev):
    """The tensor-core (lengthscale, outputscale) kernels: rows ragged against 64- and 128-row blocks, columns
    ragged against the column tile and split over blocks, d in each feature bucket (8, 16, 24, 32), and weights
    (t, or 2t for K(x, x) with t <= 20) in each bucket up to 40."""
    kernels = ("bilinear4", "bilinear8", "bilinear4_nosym", "bilinear8_nosym")
    for B, n, m, d, t in [
        (1, 1, 1, 1, 1),
        (2, 67, 131, 3, 9),
        (1, 130, 700, 9, 17),
        (1, 300, 37, 20, 21),
        (1, 129, 2000, 32, 32),
    ]:
        x1, x2, l, s = _inputs(B, n, m, d, dev, torch.float32)
        v1, v2 = torch.randn(B, n, t, device=dev), torch.randn(B, m, t, device=dev)
        g = torch.randn(B, n, t, device=dev)
        for kernel in kernels:
            torch.ops.gpfast._rbf_matmul_backward_kernel(g, x1, x2, l, s, v2, kernel)
            torch.ops.gpfast._rbf_matmul_backward_kernel(g, x1, x1, l, s, v1, kernel)


def run_stored_backward(dev):
    """The engine's work on a stored K: stored_backward's tensor-core kernels (4 and 8 warps; K(x, x) each pair
    once and every ordered pair, K(x1, x2)): rows ragged against 64- and 128-row blocks, columns against the
    32-column tiles and split over blocks, K with padded rows (an odd pitch: one column a load) and without, every
    feature and weight bucket; and the symmetric forward."""
    for n, m, d, t, pad in [(1, 1, 1, 1, 0), (67, 131, 3, 9, 3), (130, 700, 9, 17, 0), (300, 37, 20, 20, 1),
                            (129, 2000, 32, 40, 2)]:  # fmt: skip
        x1, x2 = torch.randn(n, d, device=dev), torch.randn(m, d, device=dev)
        l, s = torch.rand(d, device=dev) + 0.5, torch.tensor(1.2, device=dev)
        g, v, v1 = torch.randn(n, t, device=dev), torch.randn(m, t, device=dev), torch.randn(n, t, device=dev)
        K = ops.rbf_covariance(x1, torch.cat([x2, x2[-1:].expand(pad, -1)]), l, s)[:, :m]
        Kx = ops.rbf_covariance(x1, torch.cat([x1, x1[-1:].expand(pad, -1)]), l, s)[:, :n]
        for kernel in ("tc4", "tc8", "tc4_nosym", "tc8_nosym"):
            torch.ops.gpfast.stored_backward(K, x1, x2, l, s, g, v, kernel)
            if 2 * t <= 40 or "nosym" in kernel:
                torch.ops.gpfast.stored_backward(Kx, x1, x1, l, s, g, v1, kernel)
    # the engine's symmetric forward into padded rows: each pair once (17 <= d <= 32; the mirror's full and partial
    # runs, an odd pitch), rows written directly (d <= 16), the tiled kernel's copy (n < 1024)
    for n, d, pad in [(1100, 20, 0), (1061, 27, 3), (1030, 32, 1), (1100, 9, 4), (500, 20, 2)]:
        x = torch.randn(n, d, device=dev)
        ops._rbf_covariance_symmetric(x, torch.rand(d, device=dev) + 0.5, torch.tensor(1.1, device=dev), n + pad)
    run_symmetric_product(dev)
    torch.cuda.synchronize()


def run_symmetric_product(dev):
    """The product reading half of a symmetric K at each super-tile: n ragged against the super-tiles and the
    16-byte chunks (the copies' zero fill), one super-tile only, t = 1, 11 and 16, padded rows."""
    for n, t, pad in [(1000, 11, 0), (1301, 1, 3), (2053, 16, 3), (600, 5, 0)]:
        x = torch.randn(n, 4, device=dev)
        K = ops.rbf_covariance(x, torch.cat([x, x[-1:].expand(pad, -1)]), torch.full((4,), 0.8, device=dev), 1.0)
        V = torch.randn(n, t, device=dev)
        for block, stages in ((256, 0), (256, 5), (512, 0), (1024, 0)):
            ops._symmetric_matmul_block(K[:, :n], V, block, stages)


def run_matmul_kernels(dev):
    """The K @ V kernels forced one by one: the tensor-core kernel in each feature and right-hand-side bucket
    (d/8 and t/8 rounded up, 1..4), rows ragged against its 128-row blocks and columns against its 64- and
    32-column tiles and split over blocks; the CUDA-core kernel and the tensor-core variants (d <= 8, t <= 16); then
    run_kv_symmetric."""
    for B, n, m, d, t in [
        (1, 1, 1, 1, 1),
        (2, 67, 131, 3, 9),
        (1, 130, 700, 9, 17),
        (1, 45, 1031, 20, 32),
        (1, 300, 37, 32, 24),
        (1, 9, 3000, 16, 5),
    ]:
        x1, x2, l, s = _inputs(B, n, m, d, dev, torch.float32)
        v = torch.randn(B, m, t, device=dev)
        kernels = ops.MATMUL_KERNELS if d <= 8 and t <= 16 else ("cuda_cores", "tc")
        for kernel in kernels:
            torch.ops.gpfast._rbf_matmul_kernel(x1, x2, l, s, v, kernel)
    run_kv_symmetric(dev)


def run_kv_symmetric(dev):
    """The symmetric K(x, x) @ V kernels: several super-tiles ragged against the bands, one super-tile, one point,
    a batch."""
    for B, n, d, t in [(1, 1300, 8, 16), (2, 300, 3, 9), (1, 1, 5, 1)]:
        x, _, l, s = _inputs(B, n, 1, d, dev, torch.float32)
        v = torch.randn(B, n, t, device=dev)
        for kernel in ops.MATMUL_SYMMETRIC_KERNELS:
            torch.ops.gpfast._rbf_matmul_kernel(x, x, l, s, v, kernel)
    torch.cuda.synchronize()


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--only", "matmul"]:  # the K @ V kernels alone: a short run for a change to them
        run_matmul_kernels("cuda")
        print("sanitize_ops: the K @ V kernels ran")
    elif sys.argv[1:] == ["--only", "kvsym"]:  # the symmetric K(x, x) @ V kernels alone
        run_kv_symmetric("cuda")
        print("sanitize_ops: the symmetric K @ V kernels ran")
    elif sys.argv[1:] == ["--only", "backward"]:  # the covariance backward's row passes alone
        run_covariance_backward("cuda")
        print("sanitize_ops: the covariance backward's kernels ran")
    elif sys.argv[1:] == ["--only", "stored"]:  # the engine's kernels on a stored K alone
        run_stored_backward("cuda")
        print("sanitize_ops: stored_backward's kernels, the symmetric forward and the symmetric product ran")
    elif sys.argv[1:] == ["--only", "symmetric"]:  # the half-read product alone (racecheck is slow on its smem)
        run_symmetric_product("cuda")
        torch.cuda.synchronize()
        print("sanitize_ops: the symmetric product ran")
    elif sys.argv[1:] == ["--only", "pivot"]:  # the pivoted Cholesky's block steps alone
        run_pivot_steps("cuda")
        torch.cuda.synchronize()
        print("sanitize_ops: the pivoted Cholesky's block steps ran")
    elif sys.argv[1:] == ["--only", "half"]:  # the stored-K product with a float16 K alone
        run_half_product("cuda")
        torch.cuda.synchronize()
        print("sanitize_ops: the float16-K product ran")
    elif sys.argv[1:] == ["--only", "forward"]:  # the covariance forward's kernels alone
        for dtype in (torch.float32, torch.float64):
            run_covariance_forward("cuda", dtype)
        print("sanitize_ops: the covariance forward's kernels ran")
    else:
        run_all()
        print("sanitize_ops: all kernels ran")
