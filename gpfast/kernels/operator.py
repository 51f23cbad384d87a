"""``RBFLinearOperator``: the RBF covariance as a matrix-free :class:`linear_operator.LinearOperator`."""

from __future__ import annotations

import torch
from linear_operator.operators import LinearOperator

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
        batch = self.shape[:-2]
        x1 = self.x1.expand(*batch, *self.x1.shape[-2:])
        x2 = self.x2.expand(*batch, *self.x2.shape[-2:])
        final = ops.broadcast_shapes(*(i.shape for i in batch_indices), row_index.shape, col_index.shape)
        a = x1[(*batch_indices, row_index)].expand(*final, x1.shape[-1])
        b = x2[(*batch_indices, col_index)].expand(*final, x2.shape[-1])
        if batch:
            ls = self.lengthscale.expand(*batch, 1, self.lengthscale.shape[-1])[(*batch_indices,)]
        else:
            ls = self.lengthscale.reshape(1, -1)
        s = self.outputscale.expand(batch)[(*batch_indices,)] if batch else self.outputscale
        # paired evaluation: one entry per index, O(d) each
        ls = ls.reshape(*ls.shape[:-2], *([1] * (len(final) - len(ls.shape[:-2]))), ls.shape[-1])
        z = (a - b) / ls
        return s.reshape(*s.shape, *([1] * (len(final) - s.dim()))) * torch.exp(-0.5 * z.pow(2).sum(-1))

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
