"""The one standardisation rule, used by the estimator, the data sets and the benchmark harness.

Every input column and the target are centred on their training mean and divided by their training standard
deviation (population std, ``ddof=0``, computed in float64 in two passes over blocks of rows). A column is
*constant* only when all its values are equal; it is then only centred (its std is taken as 1), since it carries
no information and dividing by zero would not make sense. Any column with a positive spread, however small, is
scaled by it, so data on any scale (1e-15 or 1e15) standardise to the same numbers.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

__all__ = ["ColumnStats", "column_stats"]

_BLOCK_ROWS = 1 << 16  # rows per block, so no full float64 copy of a large float32 array is made


class ColumnStats(NamedTuple):
    """Per-column statistics of an (n, d) array, float64 tensors of shape (d,) on the array's device."""

    mean: torch.Tensor
    std: torch.Tensor  # 1 where the column is constant
    constant: torch.Tensor  # bool: all values of the column are equal


def column_stats(A) -> ColumnStats:
    """Mean and standard deviation of each column of ``A`` (n, d) (numpy array or torch tensor), float64.

    Raises ValueError for an empty ``A``.
    """
    if isinstance(A, np.ndarray):
        A = torch.from_numpy(np.ascontiguousarray(A))
    if A.dim() == 1:
        A = A.unsqueeze(-1)
    n = A.shape[0]
    if n == 0:
        raise ValueError("cannot standardise with an empty training set (0 rows)")
    total = torch.zeros(A.shape[1], dtype=torch.float64, device=A.device)
    lo = A[0].to(torch.float64).clone()
    hi = lo.clone()
    for i in range(0, n, _BLOCK_ROWS):
        block = A[i : i + _BLOCK_ROWS].to(torch.float64)
        total += block.sum(0)
        lo = torch.minimum(lo, block.amin(0))
        hi = torch.maximum(hi, block.amax(0))
    mean = total / n
    sq = torch.zeros_like(mean)
    for i in range(0, n, _BLOCK_ROWS):
        block = A[i : i + _BLOCK_ROWS].to(torch.float64) - mean
        sq += (block * block).sum(0)
    std = (sq / n).sqrt()
    constant = hi == lo
    std = torch.where(constant | ~(std > 0), torch.ones_like(std), std)
    return ColumnStats(mean, std, constant)
