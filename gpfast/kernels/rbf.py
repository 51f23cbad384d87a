"""GPyTorch kernels on the fused op: drop-ins for ``gpytorch.kernels.RBFKernel`` and ``ScaleKernel(RBFKernel())``."""

from __future__ import annotations

import os

import torch
from gpytorch.kernels import Kernel, ScaleKernel

from gpfast import ops
from gpfast.kernels.operator import DenseRBFOperator, RBFLinearOperator

#: Above this many covariance entries (n * m per batch) the kernels return a matrix-free
#: :class:`RBFLinearOperator` instead of a stored :class:`DenseRBFOperator`. 2**32 entries is 16 GiB in float32
#: (65,536 points square). Below it, storing K and streaming it through CG is the faster: in GPyTorch's loop, 50 Adam
#: steps took 7.0 / 5.9 / 10.4 s stored against 7.6 / 9.1 / 28.0 s matrix-free on kin40k, protein and keggdirected
#: (36,000-43,945 points; one H100, one call, experiments/results/h100_2026-12-05_session26), at a third of stock
#: GPyTorch's peak memory (10-25 GB against its 30-76 GB up to keggundirected's 57,248 points). Above it, memory rules.
#: With the default threshold K is also matrix-free where storing it (every batch member) would take more than
#: :data:`STORED_MEMORY_SHARE` of the device's memory.
MATRIX_FREE_THRESHOLD = 2**32

#: The largest share of its device's total memory (a GPU's, or the host's for the CPU) that the kernels' stored K may
#: take when no ``matrix_free_threshold`` is given. GPyTorch's loop peaked at about twice K's size with the stored
#: operator (25 GB for keggundirected's 13 GB K on an H100), so a quarter keeps that peak within half the device and
#: a smaller GPU goes matrix-free where a fixed count would run it out of memory.
STORED_MEMORY_SHARE = 0.25

_device_memory: dict[str, int | None] = {}


def _total_memory(device: torch.device) -> int | None:
    """The device's total memory in bytes (the host's physical memory for the CPU), None if unknown; cached."""
    key = str(device)
    if key not in _device_memory:
        try:
            if device.type == "cuda":
                _device_memory[key] = torch.cuda.get_device_properties(device).total_memory
            elif device.type == "cpu":
                _device_memory[key] = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            else:
                _device_memory[key] = None
        except (AttributeError, ValueError, OSError, RuntimeError):
            _device_memory[key] = None
    return _device_memory[key]


def _use_operator(x1: torch.Tensor, x2: torch.Tensor, threshold: int | None, batch_shape: torch.Size) -> bool:
    """Whether K (the kernel's ``batch_shape`` broadcast with the points') is returned matrix-free."""
    entries = x1.shape[-2] * x2.shape[-2]
    if threshold is not None:
        return entries > threshold
    if entries > MATRIX_FREE_THRESHOLD:
        return True
    total = _total_memory(x1.device)
    if total is None:
        return False
    try:
        members = torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2], batch_shape).numel()
    except RuntimeError:  # shapes that do not broadcast: the covariance op raises its own error, naming them
        return False
    return members * entries * x1.element_size() > STORED_MEMORY_SHARE * total


def _stored(x1, x2, lengthscale, outputscale):
    """K as a :class:`DenseRBFOperator`, holding it with its points and hyperparameters."""
    if not torch.is_tensor(outputscale):
        outputscale = torch.ones((), dtype=x1.dtype, device=x1.device)
    return DenseRBFOperator.from_points(x1, x2, lengthscale, outputscale)


def _last_dim_as_batch(x1, x2, lengthscale):
    # (..., n, d) -> (..., d, n, 1), lengthscale folded into the points as GPyTorch does for this mode
    z1 = x1.div(lengthscale).transpose(-1, -2).unsqueeze(-1)
    z2 = x2.div(lengthscale).transpose(-1, -2).unsqueeze(-1)
    return z1, z2


class RBFKernel(Kernel):
    r"""RBF (squared-exponential) kernel, ``k(x1, x2) = exp(-0.5 (x1 - x2)^T Theta^{-2} (x1 - x2))``, fused.

    Same constructor arguments and behaviour as :class:`gpytorch.kernels.RBFKernel` (``ard_num_dims``,
    ``batch_shape``, ``active_dims``, ``lengthscale_prior``, ``lengthscale_constraint``, ``eps``), and the same
    state_dict. Covariances come from :func:`gpfast.ops.rbf_covariance`; gradients reach the lengthscale and, when
    they require grad, the inputs. The covariance is returned as a :class:`DenseRBFOperator`, a dense operator whose
    CUDA products run on gpfast's stored-K kernel and whose marginal-likelihood derivative comes from the stored K
    (one float32 matrix on CUDA) or forms no n x n matrix (the CPU). For ``n * m`` above ``matrix_free_threshold``
    it is a matrix-free :class:`RBFLinearOperator`; by default (None) above :data:`MATRIX_FREE_THRESHOLD`, or where
    the stored K would take more than :data:`STORED_MEMORY_SHARE` of the device's memory.

    x1: (..., n, d), x2: (..., m, d) -> (..., n, m) (or (..., n) with ``diag=True``).
    """

    has_lengthscale = True

    def __init__(self, *args, matrix_free_threshold: int | None = None, distributed: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.matrix_free_threshold = matrix_free_threshold
        self.distributed = distributed

    def forward(self, x1, x2, diag: bool = False, last_dim_is_batch: bool = False, **params):
        lengthscale = self.lengthscale
        if last_dim_is_batch:
            z1, z2 = _last_dim_as_batch(x1, x2, lengthscale)
            return ops.rbf_covariance(z1, z2, 1.0, 1.0, diag=diag, check_values=False)
        if not diag and (self.distributed or _use_operator(x1, x2, self.matrix_free_threshold, self.batch_shape)):
            ones = torch.ones((), dtype=x1.dtype, device=x1.device)
            return RBFLinearOperator(x1, x2, lengthscale, ones, distributed=self.distributed)
        if diag:
            return ops.rbf_covariance(x1, x2, lengthscale, 1.0, diag=True, check_values=False)
        return _stored(x1, x2, lengthscale, 1.0)


class ScaleRBFKernel(ScaleKernel):
    r"""``ScaleKernel(RBFKernel(...))`` with the outputscale folded into the fused op (one pass over K, not two).

    It is a :class:`gpytorch.kernels.ScaleKernel` whose ``base_kernel`` is :class:`RBFKernel`, so its state_dict
    is interchangeable with GPyTorch's ``ScaleKernel(RBFKernel(...))`` of the same configuration. Arguments are
    those of both: ``ard_num_dims``, ``batch_shape``, ``active_dims``, ``lengthscale_prior``,
    ``lengthscale_constraint``, ``eps``, ``outputscale_prior``, ``outputscale_constraint``,
    ``matrix_free_threshold``, and ``distributed`` (always matrix-free, rows split over the ranks of
    ``torch.distributed``; see :mod:`gpfast.kernels.distributed`).
    """

    def __init__(
        self,
        ard_num_dims=None,
        batch_shape=None,
        active_dims=None,
        lengthscale_prior=None,
        lengthscale_constraint=None,
        eps: float = 1e-6,
        outputscale_prior=None,
        outputscale_constraint=None,
        matrix_free_threshold: int | None = None,
        distributed: bool = False,
        **kwargs,
    ):
        base = RBFKernel(
            ard_num_dims=ard_num_dims,
            batch_shape=batch_shape,
            active_dims=active_dims,
            lengthscale_prior=lengthscale_prior,
            lengthscale_constraint=lengthscale_constraint,
            eps=eps,
            matrix_free_threshold=matrix_free_threshold,
            distributed=distributed,
        )
        super().__init__(
            base, outputscale_prior=outputscale_prior, outputscale_constraint=outputscale_constraint, **kwargs
        )

    def forward(self, x1, x2, last_dim_is_batch: bool = False, diag: bool = False, **params):
        if last_dim_is_batch:  # rare mode: the plain composition
            return super().forward(x1, x2, last_dim_is_batch=True, diag=diag, **params)
        lengthscale, outputscale = self.base_kernel.lengthscale, self.outputscale
        base = self.base_kernel
        if not diag and (base.distributed or _use_operator(x1, x2, base.matrix_free_threshold, self.batch_shape)):
            return RBFLinearOperator(x1, x2, lengthscale, outputscale, distributed=base.distributed)
        if diag:
            return ops.rbf_covariance(x1, x2, lengthscale, outputscale, diag=True, check_values=False)
        return _stored(x1, x2, lengthscale, outputscale)
