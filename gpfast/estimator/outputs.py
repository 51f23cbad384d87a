"""Several outputs in one :class:`gpfast.ExactGP`, with scikit-learn's semantics for a target ``y`` of shape (n, k).

* The k outputs share one set of hyperparameters (lengthscales, outputscale, noise and constant mean, in
  standardised units); the fit maximises the sum of their log marginal likelihoods, which one float64 Cholesky
  factorisation of the shared covariance gives for all of them (:mod:`~gpfast.estimator.exact_objective`). The
  training loss is that sum divided by ``k n``: a fit of ``[y, y]`` takes the steps a fit of ``y`` takes.
* Each output is standardised on its own (``y_mean_``, ``y_std_`` of shape (k,)), so in the original units each
  has its own outputscale, noise and mean (``outputscale_``, ``noise_``, ``constant_mean_`` of shape (k,)), and
  ``noise_init`` and ``outputscale_init`` are read as fractions of each output's variance.
* The GPyTorch model holds the targets as (k, n), GPyTorch's layout for a batch of targets under one kernel.
* Predictions: means and standard deviations (m, k); covariances (m, m, k), one per output, as scikit-learn returns
  them. The posterior covariance in standardised units is shared, so each output's is a scaled copy.
* Both solvers fit several outputs, by the rule that picks them for one. gpfast's training engine solves the k
  data columns and its probes in one batched PCG (the data-fit term and its gradient averaged over the outputs,
  the log-determinant shared), and the CG posterior solves the k mean columns with one shared variance. GPyTorch's
  CG loop (``cg={"trainer": "gpytorch"}``, or the ``"auto"`` trainer under L-BFGS) and ``distributed=True`` take
  one output: a fit that would use them raises ValueError saying what to change.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from gpfast.standardize import column_stats
from gpfast.train.settings import CGSettings

__all__ = [
    "check_distributed",
    "check_trainer",
    "hyperparameter_attributes",
    "init_scale",
    "model_targets",
    "multi_output_tag",
    "n_outputs",
    "target_statistics",
    "to_original_units",
]


def n_outputs(y: torch.Tensor) -> int:
    """Number of outputs of a validated target: 1 for (n,), k for (n, k)."""
    return 1 if y.dim() == 1 else int(y.shape[1])


def model_targets(y: torch.Tensor) -> torch.Tensor:
    """The targets as the GPyTorch model holds them: (n,), or (k, n) for several outputs."""
    return y if y.dim() == 1 else y.T.contiguous()


def target_statistics(y: torch.Tensor, standardize: bool):
    """``(y_mean, y_std)`` of a validated target by the one standardisation rule (:mod:`gpfast.standardize`): floats
    for one output, float64 arrays (k,) for several; 0 and 1 without ``standardize``. Warns for constant outputs,
    which are only centred."""
    k = n_outputs(y)
    if not standardize:
        return (0.0, 1.0) if y.dim() == 1 else (np.zeros(k), np.ones(k))
    stats = column_stats(y)
    constant = torch.nonzero(stats.constant).reshape(-1).tolist()
    if constant and y.dim() == 1:
        warnings.warn(
            f"y is constant (all {y.shape[0]} values equal {float(y[0])!r}): the fit can only learn that constant; "
            f"y is centred but not scaled.",
            UserWarning,
            stacklevel=5,
        )
    elif constant:
        warnings.warn(
            f"y has constant output(s) at column index {constant} (all {y.shape[0]} values equal): they are only "
            f"centred, not scaled, and the fit can only learn their constants.",
            UserWarning,
            stacklevel=5,
        )
    if y.dim() == 1:
        return float(stats.mean[0]), float(stats.std[0])
    return stats.mean.cpu().numpy(), stats.std.cpu().numpy()


def init_scale(y_std) -> float:
    """The std that converts ``noise_init`` and ``outputscale_init`` to standardised units: y's for one output, 1
    (fractions of each output's variance) for several."""
    return float(y_std) if np.ndim(y_std) == 0 else 1.0


def check_distributed(k: int, distributed: bool) -> None:
    """ValueError for several outputs with ``distributed=True`` (its row split carries one output)."""
    if k > 1 and distributed:
        raise ValueError(
            f"ExactGP: y has {k} outputs, but distributed=True fits one output; fit the outputs one at a time, or "
            f"on one device (distributed=False)."
        )


def check_trainer(trainer: str, k: int, optimizer: str) -> None:
    """ValueError when several outputs would be trained by GPyTorch's CG loop, which takes one output."""
    if k > 1 and trainer == "gpytorch":
        raise ValueError(
            f"ExactGP: y has {k} outputs and their CG training steps are taken by gpfast's engine only, but this "
            f"fit gives them to GPyTorch's loop (optimizer={optimizer!r} with CG training). Use optimizer='adam' "
            f"(or 'auto'), cg={{'trainer': 'gpfast'}}, or solver='cholesky' where it fits."
        )


def hyperparameter_attributes(hyp: dict[str, torch.Tensor], x_std, y_mean, y_std) -> dict:
    """``lengthscale_`` (d,), ``outputscale_``, ``noise_`` and ``constant_mean_`` in the units of X and y from the
    float64 hyperparameters ``hyp`` in standardised units: floats for one output, arrays (k,) for several (each
    output's standardisation applied to the shared values)."""
    ls = hyp["lengthscale"].detach().cpu().reshape(-1)
    return dict(
        lengthscale_=(ls * torch.as_tensor(x_std, dtype=torch.float64)).numpy(),  # (1,) broadcasts when ard=False
        outputscale_=float(hyp["outputscale"]) * y_std**2,
        noise_=float(hyp["noise"]) * y_std**2,
        constant_mean_=float(hyp["mean"]) * y_std + y_mean,
    )


def multi_output_tag(est) -> bool:
    """scikit-learn's ``multi_output`` target tag of ``est``: several outputs are fitted but by GPyTorch's CG loop
    and over distributed ranks."""
    try:
        trainer = CGSettings.from_value(est.cg).trainer
    except ValueError:  # a bad cg is reported by fit; tags never raise
        trainer = None
    return trainer != "gpytorch" and not est.distributed


def to_original_units(res, y_mean, y_std, return_std: bool, return_cov: bool):
    """A standardised prediction (mean (m,) or (m, k); variance (m,) or covariance (m, m) shared by the outputs, or
    one per output, (m, k) or (m, m, k)) in the units of y: ``mean``, ``(mean, std)`` or ``(mean, cov)`` with std
    (m,) or (m, k) and cov (m, m) or (m, m, k), float64 tensors."""
    mean = res if not (return_std or return_cov) else res[0]
    scale = torch.as_tensor(y_std, dtype=torch.float64, device=mean.device)
    mean = mean * scale + torch.as_tensor(y_mean, dtype=torch.float64, device=mean.device)
    if not (return_std or return_cov):
        return mean
    second = res[1]
    if return_std:
        std = second.clamp(min=0).sqrt()
        return mean, (std * scale if scale.dim() == 0 or std.dim() == 2 else std[:, None] * scale)
    return mean, (second * scale**2 if scale.dim() == 0 or second.dim() == 3 else second[..., None] * scale**2)
