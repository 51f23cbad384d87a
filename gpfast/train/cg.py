"""Batched preconditioned conjugate gradients with warm starts, a relative-residual tolerance and a cap.

Every column of B is its own CG run (Saad, Iterative Methods, Alg. 9.1), but all columns share each product with
A, so a step of the engine costs one product of K̂ with an (n, 1 + s) block per iteration. The solve stops when
the relative residuals ``|b - A x| / |b|`` of the columns, summarised by ``measure`` (default: the largest), are at
most ``tol``, or after ``max_iter`` iterations. Reading that number on the host makes a GPU wait for the device, so
``check_at`` can name the few iterations at which it is read; in between the iterations go on unchecked (a column
that has converged is frozen on the device and costs nothing but its share of the product). A column
is frozen (its step size set to zero) once it has converged far below ``tol`` or when its curvature ``p^T A p``
is not positive (a numerically indefinite K̂ in float32), so finished columns cannot break down while the others
go on.

Columns started from x0 = 0 also yield their Lanczos tridiagonal matrices from the CG coefficients (Saad, Sec.
6.7.3), which :mod:`gpfast.train.logdet` turns into a stochastic-Lanczos log-determinant.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["CGResult", "CUDAGraphs", "pcg"]


@dataclass
class CGResult:
    """What :func:`pcg` returns.

    x: (n, t) solutions; residual: (n, t) the recursively updated ``b - A x``; rel_residual: (t,) its column norms
    over ``|b|``; iterations: CG iterations (products with A inside the loop); products: all products with A
    (iterations, plus one for the initial residual when a warm start was given); alphas, betas: per iteration,
    the (t,) step and direction coefficients (zero for frozen columns), for the Lanczos matrices; broke_down:
    columns frozen for non-positive curvature; graphed: the iterations after the first were CUDA-graph replays;
    checked: (iteration, measure) at each host read of the convergence measure, in order (those reads are the
    only places the measure is known before the end; the caller can place its next checks from them).
    """

    x: torch.Tensor
    residual: torch.Tensor
    rel_residual: torch.Tensor
    iterations: int
    products: int
    alphas: list[torch.Tensor]
    betas: list[torch.Tensor]
    broke_down: torch.Tensor
    graphed: bool = False
    checked: list[tuple[int, float]] = field(default_factory=list)


def pcg(
    matmul: Callable[[torch.Tensor], torch.Tensor],
    B: torch.Tensor,
    precond: Callable[[torch.Tensor], torch.Tensor],
    x0: torch.Tensor | None = None,
    warm: Sequence[int] | None = None,
    tol: float = 0.01,
    max_iter: int = 15,
    freeze_rtol: float | None = None,
    measure: Callable[[torch.Tensor], torch.Tensor] | None = None,
    check_at: Sequence[int] | None = None,
    graph: CUDAGraphs | None = None,
    after_miss: Callable[[int, float], int] | None = None,
) -> CGResult:
    """Solve ``A X = B`` column by column with preconditioner ``precond`` (applies P^{-1}).

    Parameters
    ----------
    matmul, precond : callable
        ``V -> A V`` and ``V -> P^{-1} V`` for V (n, t). With ``graph``, both must be capturable in a CUDA graph
        (no host reads, no synchronisation).
    B : Tensor (n, t)
        Right-hand sides.
    x0 : Tensor (n, t) or None
        Initial guesses, or None for zeros.
    warm : sequence of int or None
        The columns of x0 that are not zero (only those enter the initial-residual product; default all when x0
        is given).
    tol, max_iter : float, int
        Tolerance on ``measure`` of the relative residuals, and the iteration cap.
    freeze_rtol : float or None
        Relative residual below which a column stops updating (default ``1e-3 * tol``, at least 100 machine
        epsilons).
    measure : callable or None
        Maps the (t,) relative residuals to the 0-dim number compared with ``tol`` (default: their maximum).
    check_at : sequence of int or None
        The iteration counts (0: the start) after which that number is read on the host to stop early (default:
        every one, 0 to max_iter - 1; an empty list runs max_iter iterations with no host read).
    graph : CUDAGraphs or None
        On CUDA, run the first iteration op by op and replay the others as one captured CUDA graph each
        (:class:`CUDAGraphs`): the same arithmetic, one launch per iteration instead of ~25.
    after_miss : callable or None
        When the first read that finds the measure above ``tol`` is at iteration i with value r,
        ``after_miss(i, r)`` names the one iteration to read next, in place of the later ``check_at`` entries (the
        caller's estimate of where the solve will converge; one at or past ``max_iter`` leaves no read), or None
        to keep them. It is asked once, so a solve reads at most once more after that miss.

    Returns
    -------
    CGResult
    """
    measure = measure or (lambda rel: rel.max())
    eps = torch.finfo(B.dtype).eps
    freeze = max(1e-3 * tol, 100 * eps) if freeze_rtol is None else freeze_rtol
    b_norm = torch.linalg.vector_norm(B, dim=0).clamp_min(torch.finfo(B.dtype).tiny)
    products = 0
    X = torch.zeros_like(B) if x0 is None else x0.clone()
    R = B.clone()
    if x0 is not None:
        cols = list(range(B.shape[1])) if warm is None else list(warm)
        if cols:
            idx = torch.tensor(cols, device=B.device)
            R[:, cols] -= matmul(X.index_select(1, idx))
            products += 1
    rel = torch.linalg.vector_norm(R, dim=0) / b_norm
    broke = torch.zeros(B.shape[1], dtype=torch.bool, device=B.device)
    checks = set(range(max_iter)) if check_at is None else set(check_at)
    reads = _Reads(checks, lambda: float(measure(rel)), tol, after_miss)
    if max_iter <= 0 or (0 in checks and reads.converged(0)):
        return CGResult(X, R, rel, 0, products, [], [], broke, False, reads.checked)
    it = _Iteration(matmul, precond, X, R, rel, b_norm, broke, freeze, max_iter)
    iterations, graphed = _run(it, graph if max_iter > 1 else None, max_iter, reads.converged, checks)
    products += iterations
    it.betas[iterations - 1].zero_()  # the Lanczos matrix ends with the last step
    alphas = list(it.alphas[:iterations].unbind(0))
    betas = list(it.betas[:iterations].unbind(0))
    return CGResult(X, R, rel, iterations, products, alphas, betas, broke, graphed, reads.checked)


class _Reads:
    """A solve's host reads of its convergence measure: where they happen (``checks``, the set the loop tests),
    what they saw (``checked``), and the one change of plan after the first missed read (``after_miss``)."""

    def __init__(self, checks: set, value: Callable[[], float], tol: float, after_miss):
        self.checks, self.value, self.tol, self.after_miss = checks, value, tol, after_miss
        self.checked: list[tuple[int, float]] = []

    def converged(self, iterations: int) -> bool:
        value = self.value()  # the host read
        self.checked.append((iterations, value))
        if value <= self.tol:
            return True
        if self.after_miss is not None:  # asked once: it names the one read left
            later, self.after_miss = self.after_miss(iterations, value), None
            if later is not None:
                self.checks.difference_update([c for c in self.checks if c > iterations])
                self.checks.add(later)
        return False


def _run(it: _Iteration, graph: CUDAGraphs | None, max_iter: int, converged, checks) -> tuple[int, bool]:
    """Iterate until ``max_iter`` or until ``converged(iterations)`` at a check; with ``graph``, the first iteration
    runs op by op and the others replay its capture. Returns (iterations, whether any replayed)."""
    with graph.stream() if graph is not None else contextlib.nullcontext():
        replay = None
        iterations = 0
        while True:
            if replay is None:
                it.step()
            else:
                replay.replay()
            iterations += 1
            if iterations == max_iter or (iterations in checks and converged(iterations)):
                return iterations, replay is not None
            if graph is not None and replay is None:
                replay = graph.capture(it.step)


class _Iteration:
    """One PCG iteration for every column, in place on the solve's tensors, so that the same code runs op by op
    and as a captured CUDA graph (whose replays read and write the same addresses). It also forms the next search
    direction, which the last iteration does not need: one preconditioner apply more per solve, in exchange for an
    iteration whose shapes never change."""

    def __init__(self, matmul, precond, X, R, rel, b_norm, broke, freeze, max_iter):
        self.matmul, self.precond = matmul, precond
        self.X, self.R, self.rel, self.b_norm, self.broke, self.freeze = X, R, rel, b_norm, broke, freeze
        t = X.shape[1]
        self.active = rel > freeze
        Zp = precond(R)
        self.P = Zp.clone()
        self.rz = (R * Zp).sum(0)
        self.alphas = X.new_zeros(max_iter, t)
        self.betas = X.new_zeros(max_iter, t)
        self.count = torch.zeros(1, dtype=torch.long, device=X.device)  # the iteration's row of alphas and betas

    def step(self) -> None:
        P, active = self.P, self.active
        AP = self.matmul(P)
        pAp = (P * AP).sum(0)
        self.broke |= active & ~(pAp > 0)
        active &= pAp > 0
        alpha = torch.where(active, self.rz / torch.where(active, pAp, 1.0), 0.0)
        self.X.addcmul_(P, alpha)
        self.R.addcmul_(AP, alpha, value=-1.0)
        torch.div(torch.linalg.vector_norm(self.R, dim=0), self.b_norm, out=self.rel)
        self.alphas.index_copy_(0, self.count, alpha.unsqueeze(0))
        active &= self.rel > self.freeze
        Zp = self.precond(self.R)
        rz_new = (self.R * Zp).sum(0)
        beta = torch.where(active, rz_new / torch.where(active, self.rz, 1.0), 0.0)
        self.betas.index_copy_(0, self.count, beta.unsqueeze(0))
        torch.addcmul(Zp, P, beta, out=P)  # Zp + P * beta elementwise: each entry reads P before writing it
        torch.where(active, rz_new, self.rz, out=self.rz)
        self.count += 1


class CUDAGraphs:
    """Captures of CG iterations on one CUDA device, sharing one memory pool so that the graphs of successive solves
    reuse the same memory.

    Why: a PCG iteration is ~25 small kernels around one product; launched one by one from Python, their launch
    cost exceeds the product's time at the training engine's sizes (n ~ 10^4). One graph replay launches them all
    at once. A solve captures its iteration afresh (its tensors are new each time), after running the first
    iteration op by op on the same side stream, which makes every lazy initialisation (cuBLAS workspaces, kernel
    attributes, allocator blocks) happen outside the capture.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(device=device)
        # The newest graph, kept alive: the caching allocator releases a pool once no graph uses it, and refuses a
        # later capture into a released pool (an internal assertion in torch 2.11), so one graph must always hold it.
        self._newest: torch.cuda.CUDAGraph | None = None

    @contextlib.contextmanager
    def stream(self):
        """Run the block on the capture stream, ordered after (and before) the current stream's work."""
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            yield
        current.wait_stream(self._stream)

    def capture(self, fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """``fn`` captured (not run) on the capture stream; replay it to run it."""
        g = self._capture(fn, self.pool)
        self._newest = g
        return g

    def capture_alone(self, fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """``fn`` captured in a memory pool of its own, released with the graph and the tensors it made: for a
        graph whose outputs outlive many solves (the preconditioner's build), which must not share memory with the
        solves' graphs, whose replays would overwrite it."""
        return self._capture(fn, torch.cuda.graph_pool_handle())

    @staticmethod
    def _capture(fn: Callable[[], None], pool) -> torch.cuda.CUDAGraph:
        g = torch.cuda.CUDAGraph()
        g.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            fn()
        finally:
            g.capture_end()
        return g
