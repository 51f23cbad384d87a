"""The RBF covariance as a :class:`linear_operator.LinearOperator`: matrix-free (``RBFLinearOperator``) or stored with
the points it came from (``DenseRBFOperator``)."""

from __future__ import annotations

import torch
from linear_operator.operators import DenseLinearOperator, LinearOperator

from gpfast import ops
from gpfast.kernels import distributed as _dist


def _all_zero(rhs: torch.Tensor) -> bool:
    """True for a right-hand side of zeros (one device sync; never under torch.compile or CUDA graph capture)."""
    if torch.compiler.is_compiling() or (rhs.is_cuda and torch.cuda.is_current_stream_capturing()):
        return False
    return rhs.numel() == 0 or not bool(rhs.any())


class RBFLinearOperator(LinearOperator):
    r"""``K = outputscale * exp(-0.5 |(x1_i - x2_j) / lengthscale|^2)`` without ever storing K.

    Products (:meth:`_matmul`, :meth:`_t_matmul`) go through :func:`gpfast.ops.rbf_matmul` (a right-hand side of
    zeros, as CG's first product with a zero initial guess, costs nothing) and the derivative needed by GPyTorch's
    marginal likelihood (:meth:`_bilinear_derivative`) through its fused matrix-free backward alone, so CG,
    stochastic Lanczos quadrature and prediction run in O(n) memory. Single entries and rows
    (:meth:`_get_indices`, used by the pivoted-Cholesky preconditioner) and the diagonal cost O(d) per entry.

    With ``distributed=True``, inside a process group of several ranks, each rank computes only its block of rows
    (:func:`gpfast.kernels.distributed.row_range`) of every product and gradient, and the blocks are combined
    over the ranks; outside one it behaves exactly as with ``distributed=False``.

    x1: (..., n, d), x2: (..., m, d), lengthscale: (..., 1, d or 1), outputscale: batch shape (...).
    """

    def __init__(
        self,
        x1: torch.Tensor,
        x2: torch.Tensor,
        lengthscale: torch.Tensor,
        outputscale: torch.Tensor,
        distributed: bool = False,
    ):
        super().__init__(x1, x2, lengthscale, outputscale, distributed=distributed)
        self.x1, self.x2, self.lengthscale, self.outputscale = x1, x2, lengthscale, outputscale
        self.distributed = bool(distributed)

    def _rows(self) -> tuple[int, int] | None:
        """This rank's rows [r0, r1) of K, or None when every row is computed here."""
        if not (self.distributed and _dist.is_active()):
            return None
        return _dist.row_range(self.x1.shape[-2])

    def _size(self) -> torch.Size:
        l_batch = self.lengthscale.shape[:-2] if self.lengthscale.dim() >= 2 else torch.Size()
        batch = ops.broadcast_shapes(self.x1.shape[:-2], self.x2.shape[:-2], l_batch, self.outputscale.shape)
        return torch.Size((*batch, self.x1.shape[-2], self.x2.shape[-2]))

    def _matmul(self, rhs: torch.Tensor) -> torch.Tensor:
        if _all_zero(rhs):  # CG's first product is often with a zero initial guess
            if rhs.dim() == 1:
                return rhs.new_zeros(*self.batch_shape, self.x1.shape[-2])
            batch = ops.broadcast_shapes(self.batch_shape, rhs.shape[:-2])
            return rhs.new_zeros(*batch, self.x1.shape[-2], rhs.shape[-1])
        rows = self._rows()
        if rows is None:
            return ops.rbf_matmul(self.x1, self.x2, self.lengthscale, self.outputscale, rhs, check_values=False)
        r0, r1 = rows
        x1 = self.x1[..., r0:r1, :]
        local = ops.rbf_matmul(x1, self.x2, self.lengthscale, self.outputscale, rhs, check_values=False)
        vector = rhs.dim() == 1
        out = _dist.all_gather_rows(local.unsqueeze(-1) if vector else local, self.x1.shape[-2])
        return out.squeeze(-1) if vector else out

    def _t_matmul(self, rhs: torch.Tensor) -> torch.Tensor:
        return self._transpose_nonbatch()._matmul(rhs)

    def _transpose_nonbatch(self) -> RBFLinearOperator:
        return RBFLinearOperator(self.x2, self.x1, self.lengthscale, self.outputscale, distributed=self.distributed)

    def _bilinear_derivative(self, left_vecs: torch.Tensor, right_vecs: torch.Tensor):
        """Gradients of ``sum(left_vecs * (K @ right_vecs))`` for each representation tensor (None if it needs
        none), from the fused K @ V backward alone (no forward product), with the point gradients computed only
        when x1 or x2 needs them. With a row split, each rank reduces its rows and the ranks' shares are summed."""
        args = (self.x1, self.x2, self.lengthscale, self.outputscale)
        wanted = [a.requires_grad for a in args]
        if not any(wanted):
            return (None,) * 4
        rows = self._rows()
        left, x1 = left_vecs, self.x1.detach()
        if rows is not None:
            left, x1 = left_vecs[..., rows[0] : rows[1], :], x1[..., rows[0] : rows[1], :]
        x_grads = wanted[0] or wanted[1]
        grads = list(
            ops.rbf_matmul_backward(
                left,
                x1,
                self.x2.detach(),
                self.lengthscale.detach(),
                self.outputscale.detach(),
                right_vecs,
                x_grads=x_grads,
            )
        )
        if rows is not None:
            if wanted[0]:  # this rank's rows of the x1 gradient, zero elsewhere: the sum over ranks fills them in
                full = grads[0].new_zeros(*grads[0].shape[:-2], self.x1.shape[-2], grads[0].shape[-1])
                full[..., rows[0] : rows[1], :] = grads[0]
                grads[0] = full
            grads = [None if g is None or not w else _dist.all_reduce_sum(g) for g, w in zip(grads, wanted)]
        return tuple(g if w else None for g, w in zip(grads, wanted))

    def _diagonal(self) -> torch.Tensor:
        if self.x1.shape[-2] == self.x2.shape[-2] and (self.x1 is self.x2 or torch.equal(self.x1, self.x2)):
            return self.outputscale.unsqueeze(-1).expand(*self.shape[:-1]).clone()  # K(x, x) = outputscale
        return ops.rbf_covariance(
            self.x1, self.x2, self.lengthscale, self.outputscale, diag=True, check_values=False
        ).expand(*self.shape[:-1])

    def _get_indices(self, row_index, col_index, *batch_indices) -> torch.Tensor:
        # paired evaluation, O(d) an entry: z = x / l for every batch member, flattened to rows and gathered by
        # index_select, whose backward (index_add_) takes repeated indices in its stride. Advanced indexing of the
        # expanded points and hyperparameters accumulates through index_put instead, which for the hyperparameters
        # (every entry's index into a few batch members) took 17 ms a call on the CPU in linear_operator's
        # pivoted-Cholesky backward (90,000 entries, a batch of 3, n = 2000)
        batch = self.shape[:-2]
        final = ops.broadcast_shapes(*(i.shape for i in batch_indices), row_index.shape, col_index.shape)
        d = self.x1.shape[-1]
        ls = self.lengthscale if self.lengthscale.dim() >= 2 else self.lengthscale.reshape(1, -1)
        z1 = (self.x1 / ls).expand(*batch, self.x1.shape[-2], d).reshape(-1, d)
        z2 = (self.x2 / ls).expand(*batch, self.x2.shape[-2], d).reshape(-1, d)
        member = torch.zeros((), dtype=torch.long, device=row_index.device)
        for size, index in zip(batch, batch_indices):  # the linear index of each entry's batch member
            member = member * size + index
        rows = (member * self.x1.shape[-2] + row_index).expand(final).reshape(-1)
        cols = (member * self.x2.shape[-2] + col_index).expand(final).reshape(-1)
        diff = z1.index_select(0, rows) - z2.index_select(0, cols)
        s = self.outputscale.expand(batch).reshape(-1).index_select(0, member.expand(final).reshape(-1))
        return (s * torch.exp(-0.5 * diff.pow(2).sum(-1))).reshape(final)

    def _expand_batch(self, batch_shape) -> RBFLinearOperator:
        return RBFLinearOperator(
            self.x1.expand(*batch_shape, *self.x1.shape[-2:]),
            self.x2.expand(*batch_shape, *self.x2.shape[-2:]),
            self.lengthscale.expand(*batch_shape, *self.lengthscale.shape[-2:]),
            self.outputscale.expand(batch_shape),
            distributed=self.distributed,
        )

    def to_dense(self) -> torch.Tensor:
        return ops.rbf_covariance(self.x1, self.x2, self.lengthscale, self.outputscale, check_values=False)


class _StoredK:
    """K and the tensors it was computed from: an argument of :class:`DenseRBFOperator` that is not a tensor, so
    that it stays out of the operator's representation (whose gradients come from its derivative alone)."""

    __slots__ = ("K", "sources", "grad_state")

    def __init__(self, K: torch.Tensor, sources: tuple):
        self.K, self.sources = K, sources
        self.grad_state = tuple(a.requires_grad for a in sources)

    def valid_for(self, sources: tuple) -> bool:
        """K is these tensors' covariance, with the autograd history that they call for now."""
        if not all(a is b for a, b in zip(self.sources, sources)):
            return False
        state = tuple(a.requires_grad for a in sources)
        return state == self.grad_state and (self.K.requires_grad or not any(state) or not torch.is_grad_enabled())


class DenseRBFOperator(DenseLinearOperator):
    r"""The RBF covariance K (stored) of ``x1`` and ``x2``: what the kernels return below ``matrix_free_threshold``,
    so that GPyTorch's CG products and marginal-likelihood derivative run on gpfast's kernels.

    It is a :class:`linear_operator.operators.DenseLinearOperator` whose ``tensor`` is K from
    :func:`gpfast.ops.rbf_covariance`, so everything that reads the matrix (``to_dense``, indexing, Cholesky, products
    with other kernels) behaves, and differentiates, as for a plain tensor. Its representation is the points and
    hyperparameters (as for :class:`RBFLinearOperator`), and two methods change:

    - :meth:`_matmul`: on CUDA, :func:`gpfast.ops.dense_matmul`, which reads K at nearly the copy bandwidth for up to 16
      right-hand sides, where ``torch.matmul`` on a few columns reads it at about half of that (41% of the H200's
      bandwidth at 36,000 points and 11 columns, against 87%: ``experiments/results/bench_stored_product.md``).
    - :meth:`_bilinear_derivative`, the gradient of ``sum(left_vecs * (K @ right_vecs))`` that GPyTorch's CG-based
      marginal likelihood asks for, which for a dense tensor forms the n x n matrix ``left_vecs @ right_vecs^T``
      and runs the covariance's backward over it (recomputing every exponential in double). For one float32
      matrix on CUDA: the lengthscale and outputscale gradients straight from the stored K by
      :func:`gpfast.ops.stored_backward` (each pair of K(x, x) read once; no exponential recomputed; like
      GPyTorch's own dense path, the gradient for the K given, its float32 rounding included). On the CPU:
      :class:`RBFLinearOperator`'s, the fused matrix-free backward, which forms no n x n matrix. Otherwise (a batch,
      float64 or points that require grad on CUDA) the dense tensor's arithmetic, by the covariance's backward op.

    Indexing and batch reshaping return a plain DenseLinearOperator of the result. K is computed once (by the
    kernels, or at first use) and recomputed only when the operator's tensors are not the ones it came from (a
    clone, or the copies linear_operator's functions rebuild it from in their backward) or now require gradients
    it was computed without; single entries and the diagonal of such an operator come from the points instead.

    x1: (..., n, d), x2: (..., m, d), lengthscale: (..., 1, d or 1), outputscale: batch shape (...), as for
    :func:`gpfast.ops.rbf_covariance`; K has their broadcast batch shape.
    """

    def __init__(
        self,
        x1: torch.Tensor,
        x2: torch.Tensor,
        lengthscale: torch.Tensor,
        outputscale: torch.Tensor,
        stored: _StoredK | None = None,
    ):
        LinearOperator.__init__(self, x1, x2, lengthscale, outputscale, stored=stored)
        self.x1, self.x2, self.lengthscale, self.outputscale = x1, x2, lengthscale, outputscale
        self._stored = stored

    @classmethod
    def from_points(cls, x1, x2, lengthscale, outputscale) -> DenseRBFOperator:
        """The operator with K computed now (under the current grad mode)."""
        K = ops.rbf_covariance(x1, x2, lengthscale, outputscale, check_values=False)
        return cls(x1, x2, lengthscale, outputscale, stored=_StoredK(K, (x1, x2, lengthscale, outputscale)))

    def _check_args(self, x1, x2, lengthscale, outputscale, stored=None):
        if not all(torch.is_tensor(a) for a in (x1, x2, lengthscale, outputscale)):
            return "DenseRBFOperator takes tensors x1, x2, lengthscale and outputscale"
        if x1.dim() < 2 or x2.dim() < 2 or x1.shape[-1] != x2.shape[-1]:
            return (
                f"DenseRBFOperator takes x1 (..., n, d) and x2 (..., m, d), got shapes {tuple(x1.shape)} and "
                f"{tuple(x2.shape)}"
            )
        return None

    def _sources(self) -> tuple:
        return self.x1, self.x2, self.lengthscale, self.outputscale

    def _valid(self) -> bool:
        return self._stored is not None and self._stored.valid_for(self._sources())

    @property
    def tensor(self) -> torch.Tensor:
        if not self._valid():
            K = ops.rbf_covariance(*self._sources(), check_values=False)
            self._stored = _StoredK(K, self._sources())
        return self._stored.K

    def _get_indices(self, row_index, col_index, *batch_indices) -> torch.Tensor:
        # An operator rebuilt from new tensors (linear_operator's pivoted-Cholesky backward rebuilds one from
        # detached copies to differentiate a few of its rows) computes the entries from the points, O(d) each,
        # rather than all of K again
        if self._valid():
            return super()._get_indices(row_index, col_index, *batch_indices)
        return RBFLinearOperator(*self._sources())._get_indices(row_index, col_index, *batch_indices)

    def _diagonal(self) -> torch.Tensor:
        if self._valid():
            return super()._diagonal()
        return RBFLinearOperator(*self._sources())._diagonal()

    def _size(self) -> torch.Size:
        return RBFLinearOperator._size(self)

    def _plain(self) -> DenseLinearOperator:
        return DenseLinearOperator(self.tensor)

    def _same_kind(self, *tensors: torch.Tensor) -> bool:
        """The stored-K kernels apply: every tensor in the points' dtype and on their device."""
        x = self.x1
        return all(a.dtype == x.dtype and a.device == x.device for a in (*self._sources()[1:], *tensors))

    def _matmul(self, rhs: torch.Tensor) -> torch.Tensor:
        K = self.tensor
        if K.is_cuda and K.dim() == 2 and rhs.dim() in (1, 2) and self._same_kind(rhs):
            return ops.dense_matmul(K, rhs)
        return torch.matmul(K, rhs)

    def _bilinear_derivative(self, left_vecs: torch.Tensor, right_vecs: torch.Tensor):
        x1, x2, l, s = self._sources()
        if not any(a.requires_grad for a in (x1, x2, l, s)):
            return (None,) * 4
        if self._from_stored_k(left_vecs, right_vecs):
            return self._stored_derivative(left_vecs, right_vecs)
        if not x1.is_cuda:
            return RBFLinearOperator(x1, x2, l, s)._bilinear_derivative(left_vecs, right_vecs)
        # on CUDA, the arithmetic of a dense tensor's derivative, whose speed there is measured: G = left @ right^T,
        # then the covariance's backward over it (each gradient in its argument's shape, summed over broadcast dims)
        G = left_vecs.matmul(right_vecs.mT) if left_vecs.dim() > 1 else torch.outer(left_vecs, right_vecs)
        G = G.to(x1.dtype)
        x_grads = x1.requires_grad or x2.requires_grad
        grads = ops.rbf_covariance_backward(G, x1.detach(), x2.detach(), l.detach(), s.detach(), x_grads=x_grads)
        return tuple(g if a.requires_grad else None for g, a in zip(grads, (x1, x2, l, s)))

    def _from_stored_k(self, left_vecs: torch.Tensor, right_vecs: torch.Tensor) -> bool:
        """stored_backward's tensor-core kernel takes this derivative: float32 on CUDA, d <= 32, at most 20 vector
        pairs (K(x, x) takes each pair once with 2 t weights, at most 40), one matrix, K already computed for these
        tensors and no point gradients wanted. On the CPU the matrix-free fused backward is the faster: it took
        11 ms at n = 3,000, d = 8, 11 vectors, against 22 ms for the covariance backward over ``left @ right^T``
        and 68 ms for stored_backward's float64 ATen form (this project's 2-core CI box)."""
        if self.x1.requires_grad or self.x2.requires_grad or not self._valid():
            return False
        if self.x1.dim() != 2 or self.x2.dim() != 2 or self.outputscale.numel() != 1:
            return False
        if self.lengthscale.numel() not in (1, self.x1.shape[-1]):
            return False
        K = self._stored.K
        vectors = left_vecs.dim() == right_vecs.dim() and left_vecs.dim() in (1, 2)
        t = left_vecs.shape[-1] if left_vecs.dim() == 2 else 1
        return (
            vectors
            and K.is_cuda
            and K.dtype == torch.float32
            and K.stride(-1) == 1
            and 1 <= self.x1.shape[-1] <= 32
            and t <= 20
            and self._same_kind(left_vecs, right_vecs)
        )

    def _stored_derivative(self, left_vecs: torch.Tensor, right_vecs: torch.Tensor):
        """The lengthscale and outputscale gradients of ``sum(left_vecs * (K @ right_vecs))`` from the stored K by
        :func:`gpfast.ops.stored_backward` (none for the points)."""
        x1, x2, l, s = self._sources()
        with torch.no_grad():
            gl, gs = ops.stored_backward(
                self.tensor.detach(), x1, x2, l.detach(), s.detach(), left_vecs, right_vecs, check_values=False
            )
        return None, None, gl if l.requires_grad else None, gs if s.requires_grad else None

    def _transpose_nonbatch(self) -> DenseRBFOperator:
        K = self.tensor
        stored = _StoredK(K.mT, (self.x2, self.x1, self.lengthscale, self.outputscale))
        return DenseRBFOperator(self.x2, self.x1, self.lengthscale, self.outputscale, stored=stored)

    def _expand_batch(self, batch_shape) -> DenseLinearOperator:
        return self._plain()._expand_batch(batch_shape)

    def _getitem(self, row_index, col_index, *batch_indices) -> LinearOperator:
        return self._plain()._getitem(row_index, col_index, *batch_indices)

    def _prod_batch(self, dim: int) -> LinearOperator:
        return self._plain()._prod_batch(dim)

    def _sum_batch(self, dim: int) -> LinearOperator:
        return self._plain()._sum_batch(dim)

    def _unsqueeze_batch(self, dim: int) -> LinearOperator:
        return self._plain()._unsqueeze_batch(dim)

    def _permute_batch(self, *dims: int) -> LinearOperator:
        return self._plain()._permute_batch(*dims)
