"""``gpfast.ExactGP`` and the parts it delegates to (one idea per module)."""

from gpfast.estimator.exact_gp import ExactGP

__all__ = ["ExactGP"]
