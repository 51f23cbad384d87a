"""Draws from a Gaussian predictive distribution, shaped as scikit-learn's ``GaussianProcessRegressor.sample_y``.

A covariance ``C = V diag(w) V^T`` (symmetric eigendecomposition, float64) gives draws ``mean + V sqrt(w) z`` with
``z`` standard normal. Unlike a Cholesky factor, this takes a covariance that is only positive *semi*-definite, as
the latent covariance at nearby test points is to rounding: eigenvalues below 0 count as 0. The standard normals
come from numpy's generator (scikit-learn's ``random_state``), so equal seeds give equal draws on every device.
"""

from __future__ import annotations

import numbers

import numpy as np
import torch

__all__ = ["check_n_samples", "sample_gaussian"]


def check_n_samples(n_samples) -> int:
    """``n_samples`` as an int >= 1, or ValueError naming the value seen."""
    if isinstance(n_samples, bool) or not isinstance(n_samples, numbers.Integral) or n_samples < 1:
        raise ValueError(f"ExactGP.sample_y: invalid n_samples={n_samples!r}; expected an int >= 1.")
    return int(n_samples)


def _factor(cov: torch.Tensor) -> torch.Tensor:
    """F (m, m) with ``F F^T = cov``, negative eigenvalues (rounding) taken as 0."""
    w, V = torch.linalg.eigh(0.5 * (cov + cov.T))
    return V * w.clamp(min=0).sqrt()


def sample_gaussian(mean, cov, n_samples: int, rng: np.random.RandomState):
    """Draws from ``N(mean, cov)`` for each output.

    Parameters
    ----------
    mean : numpy.ndarray or torch.Tensor of shape (m,) or (m, k)
    cov : numpy.ndarray or torch.Tensor of shape (m, m) or (m, m, k)
        One covariance per output (the last axis), as ``ExactGP.predict(return_cov=True)`` returns them.
    n_samples : int
    rng : numpy.random.RandomState

    Returns
    -------
    samples : array of shape (m, n_samples) or (m, k, n_samples), the type of ``mean`` (a tensor on its device and
        in its dtype).
    """
    is_torch = torch.is_tensor(mean)
    mean_t = torch.as_tensor(mean)
    device, dtype = mean_t.device, mean_t.dtype
    mean64 = mean_t.to(torch.float64)
    cov64 = torch.as_tensor(cov).to(device=device, dtype=torch.float64)
    single = mean64.dim() == 1
    if single:
        mean64, cov64 = mean64.unsqueeze(-1), cov64.unsqueeze(-1)
    m, k = mean64.shape
    out = torch.empty(m, k, n_samples, dtype=torch.float64, device=device)
    for j in range(k):
        z = torch.from_numpy(rng.standard_normal((m, n_samples))).to(device)
        out[:, j] = mean64[:, j, None] + _factor(cov64[..., j]) @ z
    if single:
        out = out[:, 0]
    if is_torch:
        return out.to(dtype)
    return out.cpu().numpy()
