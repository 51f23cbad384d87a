"""Pure-PyTorch versions of every gpfast op: the test oracle, and nothing else.

They follow the formula literally (differences, not the expanded ``|a|^2 + |b|^2 - 2ab`` form), so that
they are the most accurate float computation of the same function; run them in float64 for a reference.
"""

from __future__ import annotations

import torch


def rbf_covariance(x1, x2, lengthscale, outputscale, diag: bool = False):
    """``outputscale * exp(-0.5 * sum_d ((x1 - x2) / lengthscale)^2)``.

    x1: (..., n, d), x2: (..., m, d), lengthscale: broadcastable to (..., 1, d), outputscale: broadcastable to
    the batch shape (...). Returns (..., n, m), or (..., n) with ``diag=True`` (n == m, paired rows).
    """
    lengthscale = torch.as_tensor(lengthscale, dtype=x1.dtype, device=x1.device)
    outputscale = torch.as_tensor(outputscale, dtype=x1.dtype, device=x1.device)
    z1 = x1 / lengthscale
    z2 = x2 / lengthscale
    if diag:
        sq = (z1 - z2).pow(2).sum(-1)
        return outputscale.unsqueeze(-1) * torch.exp(-0.5 * sq)
    sq = (z1.unsqueeze(-2) - z2.unsqueeze(-3)).pow(2).sum(-1)
    return outputscale.unsqueeze(-1).unsqueeze(-1) * torch.exp(-0.5 * sq)


def rbf_matmul(x1, x2, lengthscale, outputscale, v):
    """``rbf_covariance(x1, x2, lengthscale, outputscale) @ v`` for v: (..., m, t), formed densely."""
    return rbf_covariance(x1, x2, lengthscale, outputscale) @ v
