"""gpfast's own training engine for the exact GP: warm-started, truncated preconditioned CG on [y - mean, probes],
a pivoted-Cholesky preconditioner applied by Woodbury, and Hutchinson gradients from one fused backward.

:class:`Engine` plugs into :func:`gpfast.estimator.training.train` as its ``objective``; :class:`gpfast.ExactGP`
uses it whenever it trains with CG (``trainer="auto"``). The parts, one file each: :mod:`.product` (products with
the training covariance, stored or matrix-free, row-split over ranks), :mod:`.preconditioner`, :mod:`.cg`,
:mod:`.gradient`, :mod:`.logdet`, :mod:`.settings` (defaults and the trainer rule) and :mod:`.engine`.
"""

from gpfast.train.engine import Engine, EngineRecord
from gpfast.train.settings import TRAINERS, EngineSettings

__all__ = ["TRAINERS", "Engine", "EngineRecord", "EngineSettings"]
