"""Exact GPs over several processes (GPUs) with ``torch.distributed``: the row split of the covariance operator.

Every rank keeps all of x (n x d is small) and computes its own block of rows of ``K @ V``; the blocks are combined
with one all-gather, so a product moves O(n t) numbers between ranks, never O(n^2). The gradients that GPyTorch's
marginal likelihood needs are each rank's row-block contribution, summed with an all-reduce. CG, stochastic Lanczos
quadrature and the optimiser then see identical numbers on every rank and take identical steps (seed every rank
the same). :class:`gpfast.kernels.RBFLinearOperator` calls the helpers here when built with ``distributed=True``.

Launch with ``torchrun --nproc-per-node=K ...`` (NCCL on GPUs, gloo on CPUs), call :func:`init` once, and use
``ScaleRBFKernel(..., distributed=True)``, :class:`gpfast.models.ExactGPModel` with ``distributed=True`` or
``gpfast.ExactGP(distributed=True)``. Keep ``NCCL_NVLS_ENABLE=0`` on machines where NVLink multicast must stay off.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["all_gather_rows", "all_reduce_sum", "init", "is_active", "rank", "row_range", "world_size"]


def init(backend: str | None = None) -> torch.device:
    """Initialise the default process group from torchrun's environment; return this rank's device.

    ``backend`` defaults to NCCL when CUDA is available, else gloo. Sets the CUDA device to ``LOCAL_RANK``.
    """
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(
                f"gpfast.kernels.distributed.init: environment variables {missing} are not set; launch with "
                "`torchrun --nproc-per-node=K ...` (or call torch.distributed.init_process_group)"
            )
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend)
    if dist.get_backend() == "nccl":
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def is_active() -> bool:
    """True inside an initialised process group of more than one rank."""
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


def all_gather_rows(local: torch.Tensor, n: int) -> torch.Tensor:
    """Concatenate every rank's row block (..., rows_r, t) into (..., n, t)."""
    k = world_size()
    chunk = -(-n // k)
    pad = chunk - local.shape[-2]
    if pad:
        local = torch.cat([local, local.new_zeros(*local.shape[:-2], pad, local.shape[-1])], dim=-2)
    parts = [torch.empty_like(local) for _ in range(k)]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts, dim=-2)[..., :n, :]


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of ``t`` over the ranks (every rank's row block adds its share)."""
    t = t.contiguous()
    dist.all_reduce(t)
    return t
