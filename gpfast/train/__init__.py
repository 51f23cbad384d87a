"""gpfast's own training engine for the exact GP: warm-started, truncated preconditioned CG on [y - mean, probes],
a pivoted-Cholesky preconditioner applied by Woodbury, and Hutchinson gradients from one fused backward.

:class:`Engine` plugs into :func:`gpfast.estimator.fitting.fit_hyperparameters` as its objective. The parts, one
file each: :mod:`.product` (products with the training covariance, stored or matrix-free, row-split over ranks),
:mod:`.preconditioner`, :mod:`.costs` (when a rebuild pays), :mod:`.cg`, :mod:`.checks` (where a solve reads
its convergence on the host), :mod:`.gradient`, :mod:`.logdet`, :mod:`.settings` (:class:`CGSettings`, the
settings of every CG solve, with the measurements behind the defaults) and :mod:`.engine`.
"""

from gpfast.train.engine import Engine, EngineRecord
from gpfast.train.settings import TRAINERS, CGSettings

__all__ = ["TRAINERS", "CGSettings", "Engine", "EngineRecord"]
