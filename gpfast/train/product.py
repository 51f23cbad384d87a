"""Products with the training covariance ``K̂ = K(x, x) + noise * I`` for the training engine.

Two ways, one interface (:class:`CovarianceProduct`):

* ``"stored"``: K (this rank's rows of it) is formed once per training step by the fused forward
  (:func:`gpfast.ops.rbf_covariance`) and every CG product streams it (on CUDA with at most 16 columns by gpfast's
  own bandwidth kernel, :func:`gpfast.ops.dense_matmul`; otherwise a cuBLAS GEMM, see :func:`default_layout`).
  K is n x n in the training dtype (float32 by default), so this is chosen only when it fits the memory budget
  (:func:`choose_product`). On one GPU with more than 12 columns the product reads only half of K
  (:func:`gpfast.ops.symmetric_matmul`, :attr:`CovarianceProduct.symmetric_product`).
* ``"matrix_free"``: every product is :func:`gpfast.ops.rbf_matmul` (O(n) memory, K recomputed in each product).

The gradient the engine needs (:meth:`CovarianceProduct.backward`) comes from the stored K
(:func:`gpfast.ops.stored_backward`, no exponential recomputed) or from the points (the fused K @ V backward,
:func:`gpfast.ops.rbf_matmul_backward`, which recomputes K): :attr:`CovarianceProduct.backward_from` says which.

With ``distributed=True`` inside a process group of several ranks, each rank owns a block of rows
(:func:`gpfast.kernels.distributed.row_range`): it stores or recomputes only those rows, products are gathered
over the ranks (O(n t) numbers moved) and the backward's lengthscale/outputscale gradients are summed over them.
Every rank then sees identical numbers and takes identical steps, as with the distributed operator.
"""

from __future__ import annotations

import torch

from gpfast import ops
from gpfast.kernels import distributed as _dist

__all__ = [
    "BACKWARDS",
    "KERNEL_MAX_RHS",
    "PRODUCTS",
    "STORED_LAYOUT",
    "STORED_LAYOUTS",
    "CovarianceProduct",
    "choose_product",
    "default_layout",
    "stored_matmul",
]

PRODUCTS = ("auto", "stored", "matrix_free")
#: Where the gradient reads K from: :class:`gpfast.train.CGSettings`' ``backward``.
BACKWARDS = ("auto", "stored", "points")


def _mm(K: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    return K @ V


def _vtk(K: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    # (V^T K)^T = K V for a symmetric K: the (t, n) x (n, n) GEMM, K as the right operand
    return (V.t().contiguous() @ K).t()


def _kernel(K: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    # gpfast's own bandwidth kernel for a stored K and t <= 16 (cuBLAS beyond; torch.mm on the CPU)
    return ops.dense_matmul(K, V)


#: How a stored block of K multiplies the right-hand sides (all give K @ V; ``vtk`` needs the whole symmetric K
#: and is replaced by ``mm`` on a row block). ``kernel`` is :func:`gpfast.ops.dense_matmul`.
#: ``experiments/bench_stored_product.py`` times these and other cuBLAS layouts on the H200.
STORED_LAYOUTS = {"kernel": _kernel, "mm": _mm, "vtk": _vtk}
#: The cuBLAS layout the engine uses where the kernel does not apply (the CPU, or more than
#: :data:`KERNEL_MAX_RHS` columns): ``vtk``, the fastest cuBLAS layout on the H200 on 2026-11-30 (n = 36k,
#: 11 columns: 2.19 ms, 56% of 4.27 TB/s; ``mm`` 2.96 ms, 41%; commit c585a14,
#: experiments/results/bench_stored_product.md).
STORED_LAYOUT = "vtk"
#: On CUDA, products with at most this many columns use the ``kernel`` layout by default (its compiled buckets).
KERNEL_MAX_RHS = 16


def default_layout(K: torch.Tensor, V: torch.Tensor) -> str:
    """The engine's layout for this product: ``kernel`` on CUDA with at most :data:`KERNEL_MAX_RHS` columns, else
    :data:`STORED_LAYOUT`."""
    t = V.shape[1] if V.dim() == 2 else 1
    return "kernel" if K.is_cuda and t <= KERNEL_MAX_RHS else STORED_LAYOUT


def _own(kept: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    """``value`` copied into ``kept`` when it has value's shape, dtype and device, else into a new tensor."""
    same = kept is not None and (kept.shape, kept.dtype, kept.device) == (value.shape, value.dtype, value.device)
    return kept.copy_(value) if same else value.detach().clone()


def stored_matmul(K: torch.Tensor, V: torch.Tensor, layout: str | None = None) -> torch.Tensor:
    """``K @ V`` for a stored (rows, n) block of K and V (n, t), by ``layout`` (default :func:`default_layout`)."""
    layout = layout or default_layout(K, V)
    if layout == "vtk" and K.shape[0] != K.shape[1]:
        layout = "mm"
    return STORED_LAYOUTS[layout](K, V)


def choose_product(
    rows: int, n: int, dtype: torch.dtype, free_memory: int, requested: str = "auto", memory_fraction: float = 0.5
) -> tuple[str, str]:
    """``("stored" | "matrix_free", reason)``: store this rank's ``rows`` x ``n`` block of K in ``dtype`` when it
    takes at most ``memory_fraction`` of ``free_memory`` bytes (the device's free memory at the start of the fit);
    ``requested`` other than ``"auto"`` is obeyed."""
    need = rows * n * torch.empty((), dtype=dtype).element_size()
    budget = int(memory_fraction * free_memory)
    if requested != "auto":
        return requested, f"requested (K would take {need / 1e9:.3g} GB, budget {budget / 1e9:.3g} GB)"
    if need <= budget:
        return "stored", f"K takes {need / 1e9:.3g} GB <= budget {budget / 1e9:.3g} GB"
    return "matrix_free", f"K would take {need / 1e9:.3g} GB > budget {budget / 1e9:.3g} GB"


class CovarianceProduct:
    """``K̂ @ V`` for the training points at the hyperparameters last given to :meth:`update`. Counts the products
    it computes in :attr:`products`.

    Parameters
    ----------
    x : torch.Tensor of shape (n, d)
        The training points.
    mode : {"stored", "matrix_free"}
        Keep K in memory or recompute it in every product (module docstring).
    distributed : bool, default=False
        Split the rows over the ranks of an active process group.
    """

    def __init__(self, x: torch.Tensor, mode: str, distributed: bool = False):
        if mode not in ("stored", "matrix_free"):
            raise ValueError(f"product mode must be 'stored' or 'matrix_free', got {mode!r}")
        self.x = x.contiguous()
        self.n = x.shape[0]
        self.mode = mode
        self.split = _dist.row_range(self.n) if distributed and _dist.is_active() else None
        r0, r1 = self.split or (0, self.n)
        self.rows = slice(r0, r1)
        self.x_local = self.x[r0:r1]
        self.K: torch.Tensor | None = None
        self._noise = self._ls = self._s = None
        self.products = 0
        #: "stored" (the gradient from the stored K, in stored mode) or "points" (from the points)
        self.backward_from = "points"
        #: On one GPU, form the stored K(x, x) into its padded rows directly
        #: (:func:`gpfast.ops._rbf_covariance_symmetric`: for float32 with 17 <= d <= 32 each pair once, mirrored)
        #: instead of K(x, padded columns). H200, in the engine: keggundirected's K in 10.4 against 12.9 ms,
        #: keggdirected's 5.8 against 6.2 (2026-12-03).
        self.symmetric_forward = True
        #: On one GPU, whether the products read half of K (:func:`gpfast.ops.symmetric_matmul`: its blocks on and
        #: above the diagonal, each used for its rows and its columns) instead of all of it
        #: (:func:`gpfast.ops.dense_matmul`). None: for more than 12 columns only. Why: on the H200 (2026-12-03,
        #: experiments/results/h200_2026-12-03_session13) the half read is bound by latency, not by the
        #: bandwidth (8 warps an SM, 46% of the issue slots used), and takes the same time for 11 columns as the
        #: full read (keggundirected 3.37 against 3.34 ms), but 1.2x less for 16 (3.44 against 4.18 ms; the full
        #: read's FMA units are then the limit).
        self.symmetric_product: bool | None = None
        self.x_cols = self._padded_columns()

    def _padded_columns(self) -> torch.Tensor:
        """The points that K's columns are formed from. On CUDA K's rows are padded to a multiple of 16 bytes, so
        that ops.dense_matmul reads every row with 16-byte loads whatever n is; K is then the (rows, n) view of a
        (rows, n + pad) block whose extra columns (copies of the last point) nobody reads. Made for either mode
        (n x d numbers), because the engine settles the mode after construction."""
        if not self.x.is_cuda:
            return self.x
        pad = (-self.n) % (16 // self.x.element_size())
        return torch.cat([self.x, self.x[-1:].expand(pad, -1)]) if pad else self.x

    def update(self, lengthscale: torch.Tensor, outputscale: torch.Tensor, noise: torch.Tensor) -> None:
        """Set the hyperparameters (0-dim outputscale and noise, lengthscale (d,) or (1,)); in stored mode, form
        this rank's rows of K anew (the old block is released first, so the allocator reuses its memory)."""
        self.lengthscale, self.outputscale, self.noise = lengthscale, outputscale, noise
        # the products read the hyperparameters from tensors of their own, which keep their addresses from step to
        # step, so that a CG graph kept across steps (gpfast.train.cg.KeptIteration) reads each step's values
        self._noise, self._ls, self._s = (_own(self._noise, noise), _own(self._ls, lengthscale),
                                          _own(self._s, outputscale))  # fmt: skip
        if self.mode == "stored":
            self.K = None
            if self.symmetric_forward and self.x.is_cuda and self.split is None:
                K = ops._rbf_covariance_symmetric(self.x, lengthscale, outputscale, self.x_cols.shape[0])
            else:
                K = ops.rbf_covariance(self.x_local, self.x_cols, lengthscale, outputscale, check_values=False)
            self.K = K[:, : self.n] if K.shape[1] != self.n else K

    def release(self) -> None:
        """Drop the stored K (the engine calls this when training ends)."""
        self.K = None

    def matmul(self, V: torch.Tensor) -> torch.Tensor:
        """``(K + noise I) @ V`` for V (n, t); the whole (n, t) result on every rank."""
        self.products += 1
        if self.mode == "stored":
            half = self.symmetric_product
            half = V.shape[1] > 12 if half is None else half
            whole = self.split is None and self.K.is_cuda and half
            local = ops.symmetric_matmul(self.K, V) if whole else stored_matmul(self.K, V)
        else:
            local = ops.rbf_matmul(self.x_local, self.x, self._ls, self._s, V, check_values=False)
        local = local.addcmul_(V[self.rows], self._noise)  # one kernel, no (n, t) temporary
        return local if self.split is None else _dist.all_gather_rows(local, self.n)

    def graph_reads(self) -> tuple:
        """The tensors :meth:`matmul` reads besides its argument (for :class:`gpfast.train.cg.KeptIteration`)."""
        if self.mode == "stored":
            return (self.K, self._noise)
        return (self.x_local, self.x, self._ls, self._s, self._noise)

    def kernel_rows(self, index: torch.Tensor, lengthscale=None, outputscale=None) -> torch.Tensor:
        """Rows ``K[index, :]`` (len(index), n) of the noise-free kernel, by the fused forward (every rank
        computes the same rows), at the last :meth:`update`'s hyperparameters unless others are given."""
        ls = self.lengthscale if lengthscale is None else lengthscale
        s = self.outputscale if outputscale is None else outputscale
        return ops.rbf_covariance(self.x.index_select(0, index), self.x, ls, s, check_values=False)

    def backward(self, G: torch.Tensor, V: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradients of ``sum(G * (K @ V))`` for the lengthscale (its shape) and the outputscale (0-dim), from the
        stored K or from the points (:attr:`backward_from`; summed over the ranks when split)."""
        if self.mode == "stored" and self.backward_from == "stored":
            # x_local is a view of x when the rows are not split, so the op sees K(x, x) and takes each pair once
            gl, gs = ops.stored_backward(
                self.K, self.x_local, self.x, self.lengthscale, self.outputscale, G[self.rows], V, check_values=False
            )
        else:
            _, _, gl, gs = ops.rbf_matmul_backward(
                G[self.rows], self.x_local, self.x, self.lengthscale, self.outputscale, V, x_grads=False
            )
        if self.split is not None:
            gl, gs = _dist.all_reduce_sum(gl), _dist.all_reduce_sum(gs)
        return gl, gs
