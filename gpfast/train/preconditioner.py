"""The engine's preconditioner: a rank-k pivoted Cholesky factor of K, applied to K + noise I by Woodbury.

``P = L L^T + noise I`` with L (n, k) from the greedy pivoted Cholesky of K (Harbrecht et al. 2012; the
preconditioner of Gardner et al. 2018 and GPyTorch). The pivots are taken in blocks: one fused evaluation of the
candidate rows (:meth:`~gpfast.train.product.CovarianceProduct.kernel_rows`, O(n d) each) per block, and an
(n, m) x (m,) product per pivot, so a build is O(n k^2) with no n x n matrix and no host synchronisation. The
factor is kept in float64.

Between builds the outputscale and the noise change exactly without a rebuild: L is rescaled by sqrt(s / s_build)
and the Woodbury factor is redone for the current noise (:meth:`Preconditioner.set_scales`; O(k^3) in the training
steps' form, O(n k^2) in the folded form below; the training engine makes this update only once the scales have
moved, ``CGSettings.rescale_change``):

    C = noise I_k + L^T L = R R^T (Cholesky, k x k, float64),   Q = L R^{-T} (n, k),
    P^{-1} v = (v - Q Q^T v) / noise,   log|P| = (n - k) log(noise) + 2 sum(log diag R).

Q Q^T has eigenvalues in [0, 1), so the apply is stable in float32. Probes with covariance exactly P are
``L w_1 + sqrt(noise) w_2`` (w_1 (k,), w_2 (n,) standard normal), which makes P^{-1} z their natural partner in
the Hutchinson estimate and their preconditioned Lanczos coefficients a stochastic-Lanczos log-determinant
(:mod:`gpfast.train.logdet`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from gpfast import ops

__all__ = ["BuildGraph", "Preconditioner", "gram", "pivoted_cholesky"]

#: Row blocks of :func:`gram` (1: one GEMM of the whole product), and the rank from which it uses them.
GRAM_BLOCKS = 4
GRAM_BLOCKS_FROM = 1600


def pivoted_cholesky(
    kernel_rows: Callable[[torch.Tensor], torch.Tensor],
    diagonal: torch.Tensor,
    rank: int,
    rel_floor: float = 1e-8,
    block: int = 16,
) -> torch.Tensor:
    """Greedy pivoted Cholesky: L (n, rank), float64, with K ~= L L^T, built on the device in blocks.

    kernel_rows(index) returns the rows ``K[index, :]`` (len(index), n) as a new tensor (in float64 the build
    updates it in place); diagonal is K's diagonal (n,). Each block
    evaluates the rows of the ``2 * block`` points with the largest remaining diagonal in one call and takes
    ``block`` pivots among them greedily (each the candidate with the largest remaining diagonal), so a build makes
    about ``rank / block`` row evaluations instead of ``rank``. The greedy rule is the unblocked one restricted to
    the candidates: a pivot can only differ from it when more than ``block`` of the top ``2 * block`` diagonals
    collapse inside one block. A pivot whose remaining diagonal is below ``rel_floor * max(diagonal)`` (K's rank is
    exhausted) gives a zero column instead of a division by a vanishing pivot.

    ``block`` may be up to 32 (the op takes at most 64 candidates). On an H200 at keggdirected's 43,945 points a
    rank-3200 build at 32 took 48 ms op by op and 46 ms as a graph replay, against 75 and 68 ms at 16 (the float64
    GEMMs of the candidates' residual rows run better at 64 rows than at 32), rank 100 0.93 ms against 1.17 ms, and
    tr(K - L L^T) was no larger at any rank there (experiments/bench_preconditioner.py); the training engine builds
    with 32 (:attr:`gpfast.CGSettings.pivot_block`, where its fits are measured). This function's default stays 16
    for the CG posterior's one build a fit, where 32 has not been measured: larger blocks give the order of ties
    among equal diagonals more say (over 150 orders of the points of a CPU test problem the trace error varied by
    up to 28% at 32 against 11% at 16).

    The pivots of a block depend only on the candidates' c x c residual covariance, so one call of the op
    ``_pivot_block`` takes them all (a single thread block on a GPU) and returns the b x b factor G of the pivots
    (G = C[piv, :], lower triangular) with its inverse; the block's columns over all n points then come from
    products with that inverse, refined once: ``L_b^T = G^{-1} R[piv, :]``. One call of ``_pivot_select`` updates
    the remaining diagonal by the block's columns and picks the next block's candidates (the ``2 * block`` largest
    remaining diagonals, the smaller index first among equals). A block is 14 kernel launches, none of them per
    pivot, and nothing is read back to the host.
    """
    n = diagonal.shape[0]
    rank = min(rank, n)
    L = torch.zeros(n, rank, dtype=torch.float64, device=diagonal.device)
    d = diagonal.to(torch.float64).clone()
    floor = rel_floor * d.max()
    no_pivots = torch.empty(0, dtype=torch.long, device=d.device)
    Lb, cand, piv = d.new_empty(0, n), no_pivots, no_pivots  # the first block updates nothing
    m = 0
    while m < rank:
        b = min(block, rank - m)
        # d -= the previous block's columns squared, its pivots zeroed; this block's candidates
        cand = torch.ops.gpfast._pivot_select(d, Lb, cand, piv, min(2 * b, n))
        rows = kernel_rows(cand).to(torch.float64)  # (c, n)
        if m:  # the candidates' rows of the residual K - L L^T after the previous blocks: one GEMM, in place (the
            # out-of-place addmm copies its input first, a device copy a block)
            rows.addmm_(L.index_select(0, cand)[:, :m], L[:, :m].t(), alpha=-1.0)
        # G^{-1} has a zero diagonal at a pivot below the floor, so its column is zero, as in the unblocked rule
        piv, G, G_inv = torch.ops.gpfast._pivot_block(rows, cand, d, floor, b)
        # L_b^T = G^{-1} R[piv, :] as products with G's b x b inverse, not torch's triangular solve, which took 24 s
        # a block with n = 1M right-hand sides on an H200 (the product: 0.07 s; a whole rank-1024 build at 200k took
        # 0.07 s). A refinement step (a residual and a second product) for G near singular, where the product alone
        # is less accurate
        Rb = rows.index_select(0, piv)  # (b, n)
        Lb = G_inv @ Rb
        Lb.addmm_(G_inv, Rb.addmm_(G, Lb, alpha=-1.0))  # Rb is not needed after its residual
        L[:, m : m + b] = Lb.t()
        m += b
    return L


def gram(L: torch.Tensor, blocks: int | None = None) -> torch.Tensor:
    """``L^T L`` (k, k) for L (n, k), from its upper triangle by blocks (then exactly symmetric).

    Why: the product's two triangles are equal, so one GEMM of the whole does twice the work needed, and at the
    engine's ranks it is a large part of a rebuild (k = 3200 on 44k points: 0.9 TFLOP in float64). Here the rows
    are cut into ``blocks`` blocks, and row block a is one GEMM with the columns from its diagonal block on:
    ``(blocks + 1) / (2 blocks)`` of the work (5/8 at 4) in ``blocks`` GEMMs, each at least ``k / blocks`` square.
    The lower triangle is then the upper's transpose. On an H100 at 44,000 points, 4 blocks took 11.6 ms against
    17.1 for one GEMM at k = 3200 and 3.2 against 4.3 ms at k = 1600 (8 blocks: 11.6 and 3.8;
    experiments/bench_cholesky.py). By default (``blocks`` None) the blocks are used from rank
    :data:`GRAM_BLOCKS_FROM` on, where they were measured; below it the product is one GEMM. A given ``blocks`` is
    capped so that a block keeps at least 64 columns. An L that requires grad (with grad enabled) gets the one
    GEMM, which autograd can follow through.
    """
    k = L.shape[1]
    if blocks is None:
        blocks = GRAM_BLOCKS if k >= GRAM_BLOCKS_FROM else 1
    q = max(1, min(blocks, k // 64))
    if q == 1 or (L.requires_grad and torch.is_grad_enabled()):
        return L.t() @ L
    edges = [k * a // q for a in range(q + 1)]
    G = L.new_empty(k, k)
    for a in range(q):
        lo, hi = edges[a], edges[a + 1]
        torch.mm(L[:, lo:hi].t(), L[:, lo:], out=G[lo:hi, lo:])
    # below the diagonal blocks nothing was written; within them both triangles were, and only the upper is kept
    G.triu_()
    return G.add_(G.triu(1).t())


def _inverse_by_trsm(R: torch.Tensor) -> torch.Tensor:
    """C^-1 = R^-T R^-1 from C's lower Cholesky factor R by one triangular solve against the identity and one GEMM."""
    R_inv = torch.linalg.solve_triangular(R, torch.eye(R.shape[0], dtype=R.dtype, device=R.device), upper=False)
    return R_inv.t() @ R_inv


class BuildGraph:
    """:func:`pivoted_cholesky` of an RBF kernel on fixed points at a fixed rank, captured once as one CUDA graph and
    replayed for new hyperparameters.

    Why: a greedy build of rank k is 14 kernel launches a block of pivots from a Python loop (2,800 at rank 3,200
    in blocks of 16, 1,400 in the engine's blocks of 32), so on a GPU the host sets much of its time, and the
    engine rebuilds at an unchanged rank whenever a lengthscale moves. A replay launches them all at once: the same
    kernels in the same order on the same shapes (the pivots are chosen on the device, so nothing in the build
    depends on the host), hence the same factor as a build op by op.

    Parameters
    ----------
    kernel_rows : callable
        ``kernel_rows(index, lengthscale=, outputscale=)``, the rows ``K[index, :]`` at the given hyperparameters
        (:meth:`gpfast.train.product.CovarianceProduct.kernel_rows`).
    n, rank : int
        Points and the factor's rank.
    lengthscale, outputscale : torch.Tensor
        Hyperparameters of the same shapes, dtype and device as later calls' (their values are not used).
    dtype : torch.dtype
        The working dtype of K's diagonal (as in an op-by-op build).
    graphs : :class:`~gpfast.train.cg.CUDAGraphs`
        The engine's capture stream; the build gets a memory pool of its own (:meth:`CUDAGraphs.capture_alone`),
        whose factor stays valid until the next replay.
    block : int, default=16
        Pivots per evaluation of candidate rows (:func:`pivoted_cholesky`).
    """

    def __init__(self, kernel_rows, n: int, rank: int, lengthscale, outputscale, dtype: torch.dtype, graphs,
                 block: int = 16):  # fmt: skip
        self.n, self.rank, self.graphs = n, rank, graphs
        # the inputs the captured kernels read: each call copies its hyperparameters into them
        self.lengthscale = lengthscale.detach().clone()
        self.outputscale = outputscale.detach().clone()
        rows = functools.partial(kernel_rows, lengthscale=self.lengthscale, outputscale=self.outputscale)
        self.L: torch.Tensor | None = None

        def build() -> None:  # everything that reads the hyperparameters inside the capture
            self.L = pivoted_cholesky(rows, self.outputscale.to(dtype).expand(n), rank, block=block)

        with graphs.stream():
            self.graph = graphs.capture_alone(build)

    def __call__(self, lengthscale, outputscale) -> torch.Tensor:
        """The factor (n, rank), float64, at these hyperparameters: the tensor that the next call overwrites."""
        with self.graphs.stream():
            self.lengthscale.copy_(lengthscale)
            self.outputscale.copy_(outputscale)
            self.graph.replay()
        return self.L


class Preconditioner:
    """``P = (s / s_build) L L^T + noise I`` with its Woodbury inverse, log-determinant and probe sampler.

    The scales may stay on the device as 0-dim tensors: nothing here reads them back to the host.

    Parameters
    ----------
    L : torch.Tensor of shape (n, k)
        float64 pivoted Cholesky factor of K at outputscale ``s_build``; k = 0 gives P = noise I.
    s_build : float or 0-dim torch.Tensor
        The outputscale that ``L`` was built at.
    dtype : torch.dtype
        The working dtype of the vectors it is applied to.
    fold : bool, default=False
        How :meth:`set_scales` prepares P^{-1}. False (training steps, whose scales change every step): a k x k
        float64 ``M = c C^{-1}`` per call, O(k^3), applied by GEMMs through L. True (predictions, one call):
        ``Q = sqrt(c) L R^{-T}`` (n, k) from C's Cholesky factor R by a triangular solve, O(n k^2), applied as
        ``(V - Q Q^T V) / noise``: backward stable, where forming C^{-1} (condition numbers of 1e7 and more) costs
        digits that the CG posterior's certified variance bounds cannot spare (on the H200 such an interval missed
        the float64 Cholesky variance by 3% of its width), and, rounded to float32, tripled its covariance error.
    storage : {"float32", "float16"}, default="float32"
        How the unfolded form keeps the factor for :meth:`solve` (:attr:`gpfast.CGSettings.preconditioner_storage`).
        "float16" (with a float32 ``dtype``; otherwise ignored): ``F = L / sqrt(s_build)`` rounded to float16
        (entries at most 1), and P built from ``sqrt(s_build) F`` (the gram, the log-determinant, the sampler);
        :meth:`solve` reads F (on a GPU in float16, by gpfast's stored-product kernel; on the CPU in the working
        dtype) with ``M`` scaled by s_build to match. ``L`` is then None: no float64 copy is kept.
    """

    def __init__(self, L: torch.Tensor, s_build, dtype: torch.dtype, fold: bool = False, storage: str = "float32"):
        if storage not in ("float32", "float16"):
            raise ValueError(f"Preconditioner: storage must be 'float32' or 'float16', got {storage!r}")
        # float32 iterations only: a float64 solve keeps its factor in float64
        self.half = storage == "float16" and not fold and L.shape[1] > 0 and dtype == torch.float32
        self.s_build = torch.as_tensor(s_build, dtype=torch.float64, device=L.device)
        self.fold = fold
        if self.half:
            # the factor as stored, F = L / sqrt(s_build) in float16 (|L_ij| <= sqrt(K_ii) = sqrt(s_build), so its
            # entries are at most 1 up to the build's rounding); P is built from it: gram = s_build F^T F, and the
            # sampler reads F. No float64 copy is kept (it would outweigh the saving): L is None.
            F = (L / self.s_build.sqrt()).to(torch.float16)
            self.L = None
            self.gram = gram(F.to(torch.float64)).mul_(self.s_build)
            if L.is_cuda:  # rows padded to 16 bytes (8 values), so that L W takes the kernel's 16-byte loads
                k = L.shape[1]
                self.L_work = F.new_empty(L.shape[0], k + (-k) % 8)[:, :k]
                self.L_work.copy_(F)
            else:  # on the CPU the rounded values in the working dtype: the same P
                self.L_work = F.to(dtype)
        else:
            self.L = L
            self.gram = gram(L)  # (k, k) float64
            self.L_work = None if fold else L.to(dtype)  # the factor the per-iteration products read
        # On CUDA also its transpose, rows padded to 16 bytes, so that both of an iteration's products with the
        # factor (L^T V, then L W) are gpfast's bandwidth kernel (ops.dense_matmul) on row-major rows: cuBLAS's
        # GEMMs for them took 0.50 ms an iteration together (H200, protein at rank 3200), twice the time of reading
        # the 527 MB factor twice. The copy costs as many bytes again per point and unit of rank (4, or 2 in float16).
        self.L_work_t = None
        if self.L_work is not None and L.is_cuda and L.shape[1] > 0:
            n = L.shape[0]
            pad = (-n) % (16 // self.L_work.element_size())
            self.L_work_t = self.L_work.new_empty(L.shape[1], n + pad)[:, :n]
            self.L_work_t.copy_(self.L_work.t())
        # set by set_scales: what solve reads (Q with fold, M without), written in place after the first call
        self.noise = self.M = self.Q = None
        self.dtype = dtype
        self.n, self.k = L.shape

    def set_scales(self, outputscale, noise) -> None:
        """Woodbury factor for the current outputscale and noise (floats or 0-dim tensors; float64): O(k^3), or
        O(n k^2) with ``fold``. ``log_det`` is then a 0-dim float64 tensor on L's device. ``noise`` and ``M`` are
        updated in place after the first call: whoever holds them sees the new values.

        With ``c = s / s_build`` and ``C = c L^T L + noise I`` (k, k), ``P^{-1} = (I - c L C^{-1} L^T) / noise``.
        Unfolded, only the k x k matrix changes with the scales, so a step costs O(k^3) here whatever n is; the
        folded n x k form costs a triangular solve over all n rows at every change (in float64 about 16 ms at
        n = 41k, k = 3200 on an H200), which a high rank would pay at every training step.
        """
        as64 = dict(dtype=torch.float64, device=self.gram.device)
        c = torch.as_tensor(outputscale, **as64) / self.s_build
        noise64 = torch.as_tensor(noise, **as64)
        # What solve reads keeps its address (the noise and M written in place once they exist), so that a CG graph
        # kept from step to step (gpfast.train.cg.KeptIteration) replays after new scales instead of capturing
        # again. The first noise is a copy: with float64 scales ``to`` would hand back the caller's tensor.
        if self.noise is None:
            self.noise = noise64.to(self.dtype, copy=True)
        else:
            self.noise.copy_(noise64)
        self.scale = c.sqrt()
        if self.k == 0:
            self.log_det = self.n * noise64.log()
            return
        C = c * self.gram + noise64 * torch.eye(self.k, **as64)
        R, _ = torch.linalg.cholesky_ex(C)  # no error check: that would wait for the device
        if self.fold:
            self.Q = torch.linalg.solve_triangular(R, self.scale * self.L.t(), upper=False).t().to(self.dtype)
        else:
            # once per update, applied by GEMMs: C's factor by two triangular solves in every iteration instead took
            # the rank-3200 steps on protein from 89 to 140 ms on the H200 (17 right-hand sides run far below the
            # GEMM rate). C^-1 = R^-T R^-1 from one triangular solve against the identity and one GEMM: at k = 3200
            # on the H200 5.6 ms with the Cholesky against 6.9 ms for torch.cholesky_inverse (cuSOLVER's potri, some
            # 120 small kernels), equal to 7e-15 of the largest element (experiments/bench_preconditioner.py)
            inverse = _inverse_by_trsm(R)
            # with the factor stored as F = L / sqrt(s_build), L M L^T = F (s_build M) F^T: c s_build is the
            # current outputscale
            cm = c * self.s_build if self.half else c
            if self.M is None:
                self.M = cm * inverse
            else:
                torch.mul(inverse, cm, out=self.M)
        self.log_det = (self.n - self.k) * noise64.log() + 2.0 * R.diagonal().log().sum()

    def graph_reads(self) -> tuple:
        """The tensors :meth:`solve` reads besides its argument, None where absent (for
        :class:`gpfast.train.cg.KeptIteration`); which of them exist also fixes which branch of it runs."""
        return self.noise, self.M, self.Q, self.L_work, self.L_work_t

    def solve(self, V: torch.Tensor) -> torch.Tensor:
        """P^{-1} V for V (n, t)."""
        if self.k == 0:
            return V / self.noise
        if self.fold:
            return (V - self.Q @ (self.Q.t() @ V)) / self.noise
        # the k x t middle in float64: M's entries reach c / noise
        if self.L_work_t is None:
            W = self.M @ (self.L_work.t() @ V).to(torch.float64)
            return (V - self.L_work @ W.to(self.dtype)) / self.noise
        if self.half:  # F in float16, V and W in float32
            W = self.M @ torch.ops.gpfast._dense_matmul_half(self.L_work_t, V).to(torch.float64)
            return (V - torch.ops.gpfast._dense_matmul_half(self.L_work, W.to(self.dtype))) / self.noise
        W = self.M @ ops.dense_matmul(self.L_work_t, V).to(torch.float64)
        return (V - ops.dense_matmul(self.L_work, W.to(self.dtype))) / self.noise

    def sample(self, W1: torch.Tensor, W2: torch.Tensor) -> torch.Tensor:
        """Probes with covariance P from standard normal W1 (k, s) and W2 (n, s): ``L W1 + sqrt(noise) W2``."""
        Z = W2 * self.noise.sqrt()
        if self.k and self.half:  # L = sqrt(s_build) F, F as stored (widened for this once-a-draw product)
            root = self.s_build.sqrt()
            Z = Z + (self.scale * root * (self.L_work.to(torch.float64) @ W1.to(torch.float64))).to(self.dtype)
        elif self.k:
            Z = Z + (self.scale * (self.L @ W1.to(torch.float64))).to(self.dtype)
        return Z
