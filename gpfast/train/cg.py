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

__all__ = ["CGResult", "CUDAGraphs", "KeptIteration", "pcg"]


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
    kept: KeptIteration | None = None,
    reads: Sequence[torch.Tensor | None] = (),
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
    kept, reads : KeptIteration or None, sequence of Tensor or None
        Solve in kept tensors and (with ``graph``) replay the kept graph while ``reads``, every tensor that
        ``matmul`` and ``precond`` read besides their argument (None for one absent), are where they were at its
        capture (:class:`KeptIteration`). The result's tensors are then the kept ones, which the next solve overwrites.

    Returns
    -------
    CGResult
    """
    measure = measure or (lambda rel: rel.max())
    freeze = max(1e-3 * tol, 100 * torch.finfo(B.dtype).eps) if freeze_rtol is None else freeze_rtol
    it = kept.iteration(B, max_iter, freeze) if kept is not None and max_iter > 0 else None
    X, R, rel, b_norm, broke = _start(B, x0, it)
    cols = [] if x0 is None else list(range(B.shape[1])) if warm is None else list(warm)
    if cols:  # the warm columns' initial residual
        _subtract_product(R, X, cols, matmul)
    products = 1 if cols else 0
    torch.div(torch.linalg.vector_norm(R, dim=0), b_norm, out=rel)
    checks = set(range(max_iter)) if check_at is None else set(check_at)
    host = _Reads(checks, lambda: float(measure(rel)), tol, after_miss)
    if max_iter <= 0 or (0 in checks and host.converged(0)):
        return CGResult(X, R, rel, 0, products, [], [], broke, False, host.checked)
    if it is None:
        it = _Iteration(matmul, precond, X, R, rel, b_norm, broke, freeze, max_iter)
        graph = graph if max_iter > 1 else None
        iterations, graphed = _run(it, graph, max_iter, host.converged, checks)
    else:
        iterations, graphed = kept.run(it, matmul, precond, graph, reads, max_iter, host.converged, checks)
    it.betas[iterations - 1].zero_()  # the Lanczos matrix ends with the last step
    alphas, betas = list(it.alphas[:iterations].unbind(0)), list(it.betas[:iterations].unbind(0))
    return CGResult(X, R, rel, iterations, products + iterations, alphas, betas, broke, graphed, host.checked)


def _subtract_product(R: torch.Tensor, X: torch.Tensor, cols: list[int], matmul) -> None:
    """``R[:, cols] -= matmul(X[:, cols])`` in place. All columns, or the first few (the engine's warm starts), are
    slices, so no index goes to the device: a list index is a host-to-device copy from pageable memory, which torch
    makes synchronously, so on a GPU each one waited for every kernel queued before it, in the middle of a step."""
    c = len(cols)
    if cols == list(range(c)):
        R[:, :c] -= matmul(X[:, :c].contiguous())  # all columns: X itself, no copy
        return
    index = torch.tensor(cols, device=R.device)
    R.index_copy_(1, index, R.index_select(1, index) - matmul(X.index_select(1, index)))


def _start(B: torch.Tensor, x0: torch.Tensor | None, it: _Iteration | None) -> tuple:
    """A solve's (X, R, rel, b_norm, broke) before the warm start's product: new tensors, or the kept iteration's
    ``it`` overwritten with the same values (x0 may be a view of its X)."""
    tiny = torch.finfo(B.dtype).tiny
    if it is None:
        X = torch.zeros_like(B) if x0 is None else x0.clone()
        broke = torch.zeros(B.shape[1], dtype=torch.bool, device=B.device)
        return X, B.clone(), X.new_empty(B.shape[1]), torch.linalg.vector_norm(B, dim=0).clamp_min(tiny), broke
    torch.linalg.vector_norm(B, dim=0, out=it.b_norm).clamp_min_(tiny)
    if x0 is None:
        it.X.zero_()
    else:
        it.X.copy_(x0)
    it.R.copy_(B)
    it.broke.zero_()
    return it.X, it.R, it.rel, it.b_norm, it.broke


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
        self.active = torch.empty(t, dtype=torch.bool, device=X.device)
        self.P = torch.empty_like(R)
        self.rz = X.new_empty(t)
        self.alphas = X.new_empty(max_iter, t)
        self.betas = X.new_empty(max_iter, t)
        self.count = torch.zeros(1, dtype=torch.long, device=X.device)  # the iteration's row of alphas and betas
        self.restart()

    def restart(self) -> None:
        """Start from the current X and R (and rel): the first direction, and the coefficients' row count back to
        zero (each iteration writes its row, and a solve reads only the rows its iterations wrote)."""
        torch.gt(self.rel, self.freeze, out=self.active)
        Zp = self.precond(self.R)
        self.P.copy_(Zp)
        torch.sum(self.R * Zp, 0, out=self.rz)
        self.count.zero_()

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


def _addresses(tensors: Sequence[torch.Tensor | None]) -> tuple:
    """What a captured graph baked in of these tensors: address, shape, strides and dtype (None for an absent one)."""
    return tuple(None if t is None else (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device) for t in tensors)


class KeptIteration:
    """A CG iteration's tensors, and on CUDA its captured graph, kept from solve to solve of one shape.

    Why: :func:`pcg` with a graph alone captures each solve's iteration afresh, because its tensors are new each
    time, and pays the capture, the graph's instantiation and its first upload once a solve, with the first
    iteration run op by op. Kept, a solve of the same (n, t) and cap writes its start into the same tensors, and
    when every tensor that the product and the preconditioner read is where it was at the capture (same address,
    shape, strides: the caller lists them as ``reads``), it replays the kept graph from the first iteration on.
    Otherwise (a rebuilt preconditioner, a stored K allocated elsewhere) it runs the first iteration op by op and
    captures again. Without a graph (the CPU) it only keeps the tensors.
    """

    def __init__(self):
        self._it: _Iteration | None = None
        self._key: tuple | None = None
        self._graph = None
        self._addresses: tuple | None = None
        self.captures = 0  # graphs captured so far (a benchmark's and a test's count)

    def iteration(self, B: torch.Tensor, max_iter: int, freeze: float) -> _Iteration:
        """The kept iteration for right-hand sides like B (new tensors, and no graph, for another shape or cap)."""
        key = (tuple(B.shape), B.dtype, B.device, max_iter, freeze)
        if key != self._key:
            self._key, self._graph, self._addresses = key, None, None
            t = B.shape[1]
            zeros = torch.zeros_like(B)
            ones = B.new_ones(t)
            broke = torch.zeros(t, dtype=torch.bool, device=B.device)
            self._it = _Iteration(lambda V: V, lambda V: V, zeros, zeros.clone(), ones, ones.clone(), broke, freeze,
                                  max_iter)  # fmt: skip
        return self._it

    def run(self, it: _Iteration, matmul, precond, graph: CUDAGraphs | None, reads, max_iter: int, converged, checks):
        """:func:`_run` on the kept iteration from the start written into its tensors, replaying the kept graph when
        the ``reads`` are where they were at its capture."""
        it.matmul, it.precond = matmul, precond  # for the iterations run op by op
        it.restart()
        addresses = _addresses(reads)
        if graph is None:
            return _run(it, None, max_iter, converged, checks)
        with graph.stream():
            if self._graph is None or addresses != self._addresses:
                self._graph = None  # released before the new capture, so that the pool can reuse its memory
                it.step()
                iterations = 1
                if iterations == max_iter or (iterations in checks and converged(iterations)):
                    return iterations, False
                self._graph, self._addresses = graph.capture(it.step), addresses
                self.captures += 1
            else:
                iterations = 0
            while True:
                self._graph.replay()
                iterations += 1
                if iterations == max_iter or (iterations in checks and converged(iterations)):
                    return iterations, True


class CUDAGraphs:
    """Captures of CG iterations on one CUDA device, sharing one memory pool so that the graphs of successive solves
    reuse the same memory.

    Why: a PCG iteration is ~25 small kernels around one product; launched one by one from Python, their launch
    cost exceeds the product's time at the training engine's sizes (n ~ 10^4). One graph replay launches them all
    at once. A capture follows a first iteration run op by op on the same side stream, which makes every lazy
    initialisation (cuBLAS workspaces, kernel attributes, allocator blocks) happen outside it: once a solve when the
    solve's tensors are new, once in many solves with a :class:`KeptIteration` (the engine's default).
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
