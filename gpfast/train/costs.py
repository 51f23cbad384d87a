"""When a preconditioner rebuild pays: a model of what a rebuild and a CG iteration cost, in seconds.

The engine rebuilds its pivoted-Cholesky preconditioner when the lengthscales have moved (or it has aged), but a
rebuild at a high rank can cost far more than the iterations it saves. On an H200, pol (13,500 points) at rank
3200 spent about 80 ms on each replayed rebuild, one every three steps, beside 11-18 ms for a whole step without
one, and with rebuilds that frequent the iterations barely moved (4-8 a step). So a rebuild that the
lengthscale or age rule asks for waits until the CG iterations since the last build have cost about as much as a
build (:attr:`gpfast.CGSettings.rebuild_cost_share`): whatever the rebuilds buy, they then take at most about that
share of the time the solves take. The preconditioner goes stale for longer in between (on the same fit the
iterations then grew from 6 to 35 a step before a rebuild), and the fit still trained in 2.15 s against 2.37
(H200, 2026-12-03, experiments/results/h200_2026-12-03_session8). A rebuild that the accuracy rule asks for (a new
rank) never waits.

The model counts the bytes each part moves through memory, its floating-point operations and its kernel
launches, at rates typical of the device kind. It only has to rank a rebuild against iterations to within a
factor of two or so, and it must not depend on timings, so that a fit stays deterministic: the same data and
settings take the same steps on every run. The GPU's rates are the H200's (``experiments/bench_preconditioner.py``,
2026-12-03: a replayed build of rank 100, 400 and 3200 at 43,945 points took 1.17, 4.68 and 67.6 ms, and of rank
3200 at pol's 13,500 34.0 ms; this model gives 1.0, 3.9, 54.5 and 33.4); the CPU's are this project's 2-core CI
box's order of magnitude.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["CPU_RATES", "GPU_RATES", "DeviceRates", "build_seconds", "iteration_seconds", "rebuild_iterations"]


@dataclass(frozen=True)
class DeviceRates:
    """Typical rates of a device kind: memory bytes per second, float operations per second and seconds per
    kernel launch (or, on the CPU, per small torch operation)."""

    bytes_per_s: float
    flops_per_s: float
    launch_s: float


#: The GPU: an H200's copy bandwidth and float32 rate as measured there, and about 8 us per kernel of a replayed
#: graph (a rank-100 build, 7 blocks of 15 kernels each, took 1.17 ms at 43,945 points, mostly that).
GPU_RATES = DeviceRates(bytes_per_s=4.27e12, flops_per_s=5.1e13, launch_s=8e-6)
CPU_RATES = DeviceRates(bytes_per_s=1e10, flops_per_s=5e10, launch_s=5e-6)

#: Kernels of one CG iteration (the product, the preconditioner's apply and the vector updates) and of one block
#: of a build (:func:`gpfast.train.preconditioner.pivoted_cholesky`). A block is 14 launches; the model counts 15
#: because its small serial kernels, the selection and the pivots, each take longer than a launch: at 15 it gave
#: 0.81-0.98 of the replays measured on an H200 (2026-12-03, with 15 launches a block then). The selection and the
#: pivots now take 30 + 26 + 6 us a block at pol's shape on an H100 (62 + 50 in the form the count was fitted to);
#: the count is not refitted.
ITERATION_KERNELS = 25
BUILD_BLOCK_KERNELS = 15


def rates_for(device_type: str) -> DeviceRates:
    """The rates of ``"cuda"`` or any other device type (the CPU's)."""
    return GPU_RATES if device_type == "cuda" else CPU_RATES


def iteration_seconds(n: int, rows: int, rank: int, columns: int, d: int, stored: bool, rates: DeviceRates,
                      factor_bytes: float = 4.0) -> float:  # fmt: skip
    """One CG iteration on ``columns`` right-hand sides: a product with this rank's ``rows`` x n block of K (stored
    in float32 and streamed, or recomputed with d features), the preconditioner's apply (two passes over the
    n x rank factor, ``factor_bytes`` an entry: 4 in float32, 2 in float16) and the vector updates (about twenty
    passes over the n x columns block)."""
    if stored:
        product = max(4.0 * rows * n / rates.bytes_per_s, 2.0 * rows * n * columns / rates.flops_per_s)
    else:
        product = 2.0 * rows * n * (d + columns) / rates.flops_per_s
    apply = (2.0 * factor_bytes * n * rank + 8.0 * rank * columns) / rates.bytes_per_s
    vectors = 80.0 * n * columns / rates.bytes_per_s
    return product + apply + vectors + ITERATION_KERNELS * rates.launch_s


def build_seconds(n: int, rank: int, block: int, d: int, rates: DeviceRates) -> float:
    """One pivoted-Cholesky build of ``rank`` in blocks of ``block`` pivots: per block, the candidates' residual
    rows (a float64 GEMM that reads the factor built so far, 8 n m bytes after m pivots, about balanced between
    bandwidth and the float64 tensor rate), the candidates' kernel rows (2 block x n x d) and some 120 bytes a
    point and pivot of other traffic, plus the block's kernel launches."""
    rank = min(rank, n)
    if rank <= 0:
        return 0.0
    blocks = math.ceil(rank / block)
    factor_reads = 4.0 * n * rank * rank / block  # sum over the blocks of 8 n m, m = 0, block, 2 block, ...
    traffic = factor_reads + 120.0 * n * rank
    rows = 2.0 * (2 * block) * n * d * blocks
    return traffic / rates.bytes_per_s + rows / rates.flops_per_s + blocks * BUILD_BLOCK_KERNELS * rates.launch_s


def rebuild_iterations(n: int, rows: int, rank: int, block: int, columns: int, d: int, stored: bool,
                       device_type: str, factor_bytes: float = 4.0) -> float:  # fmt: skip
    """A build's cost in CG iterations at the same rank (the model above, on the device type's rates)."""
    rates = rates_for(device_type)
    iteration = iteration_seconds(n, rows, rank, columns, d, stored, rates, factor_bytes)
    return build_seconds(n, rank, block, d, rates) / iteration
