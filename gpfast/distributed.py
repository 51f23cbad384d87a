"""Exact GPs over several processes (GPUs) with ``torch.distributed``.

Every rank keeps all of x (n x d is small) and computes its own block of rows of ``K @ V``; the blocks are
combined with one all-gather, so a product moves O(n t) numbers between ranks, never O(n^2). The gradients that
GPyTorch's marginal likelihood needs (:meth:`DistributedRBFLinearOperator._bilinear_derivative`) are each rank's
row-block contribution, summed with an all-reduce. CG, stochastic Lanczos quadrature and the optimiser then see
identical numbers on every rank and take identical steps (seed every rank the same).

Launch with ``torchrun --nproc-per-node=K ...`` (NCCL on GPUs, gloo on CPUs), call :func:`init` once, and use
``ScaleRBFKernel(..., distributed=True)``, :class:`gpfast.models.ExactGPModel` with ``distributed=True`` or
``gpfast.ExactGP(distributed=True)``. Keep ``NCCL_NVLS_ENABLE=0`` on machines where NVLink multicast must stay off.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from gpfast import ops
from gpfast.kernels.operator import RBFLinearOperator

__all__ = ["init", "is_active", "rank", "world_size", "row_range", "DistributedRBFLinearOperator"]


def init(backend: str | None = None) -> torch.device:
    """Initialise the default process group from torchrun's environment; return this rank's device.

    ``backend`` defaults to NCCL when CUDA is available, else gloo. Sets the CUDA device to ``LOCAL_RANK``.
    """
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(f"gpfast.distributed.init: environment variables {missing} are not set; launch with "
                               "`torchrun --nproc-per-node=K ...` (or call torch.distributed.init_process_group)")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend)
    if dist.get_backend() == "nccl":
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def is_active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_active() else 0


def world_size() -> int:
    return dist.get_world_size() if is_active() else 1


def row_range(n: int, r: int | None = None, k: int | None = None) -> tuple[int, int]:
    """Rows [begin, end) of an n-row matrix owned by rank r of k (contiguous, as even as possible)."""
    r = rank() if r is None else r
    k = world_size() if k is None else k
    chunk = -(-n // k)
    return min(n, r * chunk), min(n, (r + 1) * chunk)


def _all_gather_rows(local: torch.Tensor, n: int) -> torch.Tensor:
    """Concatenate every rank's row block (..., rows_r, t) into (..., n, t)."""
    k = world_size()
    chunk = -(-n // k)
    pad = chunk - local.shape[-2]
    if pad:
        local = torch.cat([local, local.new_zeros(*local.shape[:-2], pad, local.shape[-1])], dim=-2)
    parts = [torch.empty_like(local) for _ in range(k)]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts, dim=-2)[..., :n, :]


class DistributedRBFLinearOperator(RBFLinearOperator):
    """:class:`gpfast.kernels.RBFLinearOperator` whose products and gradients are split by rows over the ranks.

    Outside an active process group of more than one rank it behaves exactly like its parent.
    """

    def _transpose_nonbatch(self) -> "DistributedRBFLinearOperator":
        return DistributedRBFLinearOperator(self.x2, self.x1, self.lengthscale, self.outputscale)

    def _matmul(self, rhs: torch.Tensor) -> torch.Tensor:
        if not is_active():
            return super()._matmul(rhs)
        n = self.x1.shape[-2]
        r0, r1 = row_range(n)
        local = ops.rbf_matmul(self.x1[..., r0:r1, :], self.x2, self.lengthscale, self.outputscale, rhs,
                               check_values=False)
        vector = rhs.dim() == 1
        out = _all_gather_rows(local.unsqueeze(-1) if vector else local, n)
        return out.squeeze(-1) if vector else out

    def _t_matmul(self, rhs: torch.Tensor) -> torch.Tensor:
        return self._transpose_nonbatch()._matmul(rhs)

    def _bilinear_derivative(self, left_vecs: torch.Tensor, right_vecs: torch.Tensor):
        if not is_active():
            return super()._bilinear_derivative(left_vecs, right_vecs)
        args = (self.x1, self.x2, self.lengthscale, self.outputscale)
        wanted = [a.requires_grad for a in args]
        if not any(wanted):
            return (None,) * 4
        n = self.x1.shape[-2]
        r0, r1 = row_range(n)
        with torch.enable_grad():
            leaves = [a.detach().requires_grad_(w) for a, w in zip(args, wanted)]
            out = ops.rbf_matmul(leaves[0][..., r0:r1, :], *leaves[1:], right_vecs, check_values=False)
            targets = [x for x, w in zip(leaves, wanted) if w]
            grads = torch.autograd.grad(out, targets, left_vecs[..., r0:r1, :], allow_unused=True)
        summed = []
        for g, t in zip(grads, targets):
            g = torch.zeros_like(t) if g is None else g.contiguous()
            dist.all_reduce(g)  # every rank's row block adds its share
            summed.append(g)
        it = iter(summed)
        return tuple(next(it) if w else None for w in wanted)

    def _expand_batch(self, batch_shape) -> "DistributedRBFLinearOperator":
        e = super()._expand_batch(batch_shape)
        return DistributedRBFLinearOperator(e.x1, e.x2, e.lengthscale, e.outputscale)
