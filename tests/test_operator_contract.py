"""RBFLinearOperator against linear_operator's own test suites (as the kernels are tested with GPyTorch's
BaseKernelTestCase): every LinearOperator method the suites exercise must agree with the dense matrix."""

import unittest

import torch
from linear_operator.test.linear_operator_test_case import LinearOperatorTestCase, RectangularLinearOperatorTestCase

from gpfast import _reference
from gpfast.kernels import RBFLinearOperator


def _inputs(n, m, batch, seed):
    g = torch.Generator().manual_seed(seed)
    f32 = dict(dtype=torch.float32)  # the suites draw their right-hand sides in the default dtype
    x1 = torch.randn(*batch, n, 3, generator=g, **f32)
    x2 = x1 if m is None else torch.randn(*batch, m, 3, generator=g, **f32)
    lengthscale = (0.4 + torch.rand(*batch, 1, 3, generator=g, **f32)).requires_grad_()
    outputscale = (0.5 + torch.rand(*batch, generator=g, **f32)).requires_grad_()
    return x1, x2, lengthscale, outputscale


def _dense(op):
    return _reference.rbf_covariance(op.x1, op.x2, op.lengthscale, op.outputscale)


class TestRectangularRBFOperator(RectangularLinearOperatorTestCase, unittest.TestCase):
    seed = 0

    def create_linear_op(self):
        return RBFLinearOperator(*_inputs(5, 4, (2, 3), seed=11))

    def evaluate_linear_op(self, linear_op):
        return _dense(linear_op)


class TestSquareRBFOperator(LinearOperatorTestCase, unittest.TestCase):
    """K(x, x) of 6 random points in 3 dimensions: symmetric positive definite, conditioned well enough for the
    suite's float32 solve, log-determinant and decomposition tests (with the points spread 1.5x wider, K nears
    the identity: its eigenvectors become ill-determined and its float32 logdet loses the suite's tolerance)."""

    seed = 0
    should_test_sample = True

    def create_linear_op(self):
        x1, _, lengthscale, outputscale = _inputs(6, None, (2,), seed=12)
        return RBFLinearOperator(x1, x1, lengthscale, outputscale)

    def evaluate_linear_op(self, linear_op):
        return _dense(linear_op)
