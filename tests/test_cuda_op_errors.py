"""The CUDA ops' own argument checks raise a RuntimeError that names the value seen and the value expected.

Each case runs in a Python process of its own (conftest.assert_raises_in_a_subprocess): on the GPU machine a failed
check in a CUDA launcher whose message streamed an integer or a shape ended the interpreter with a segmentation fault
instead of raising. The checks now turn numbers into text first (GPF_CHECK in gpfast/csrc/common.h); these cases
cover each kind of message: integers, shapes, and numbers given as text.
"""

from __future__ import annotations

import pytest
from conftest import HAS_CUDA, assert_raises_in_a_subprocess

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="no GPU")]

# name: (the call, with c(*shape) a random float32 CUDA tensor; the message it must raise)
CASES = {
    # the stored-K products' shape check: a shape and two integers
    "dense_matmul_rows": (
        "gp.dense_matmul(c(4, 5), c(4, 2))",
        "dense_matmul: K is [4, 5] but V has 4 rows (need 5)",
    ),
    "dense_matmul_half_rows": (
        "gp._dense_matmul_half(c(7, 9).half(), c(8, 3))",
        "_dense_matmul_half: K is [7, 9] but V has 8 rows (need 9)",
    ),
    # the canonical points' checks, shared by every point op
    "covariance_features": (
        "gp.rbf_covariance(c(1, 5, 3), c(1, 6, 4), c(1, 3), c(1))",
        "rbf_covariance: x1 has d=3 features but x2 has d=4",
    ),
    "matmul_rhs_shape": (
        "gp.rbf_matmul(c(1, 5, 3), c(1, 6, 3), c(1, 3), c(1), c(1, 7, 2))",
        "rbf_matmul: v must be (B, m, t) with (B, m) = (1, 6), got [1, 7, 2]",
    ),
    "stored_backward_rows": (
        "gp.stored_backward(c(5, 6), c(4, 3), c(6, 3), c(3), c(), c(5, 2), c(6, 2))",
        "stored_backward: x1 must be (n, d) with n = 5 (K's rows), got [4, 3]",
    ),
    # the private backward op's limits on d and t, which the Python wrapper also checks
    "matmul_backward_limits": (
        "gp._rbf_matmul_backward_kernel(c(1, 10, 33), c(1, 10, 3), c(1, 12, 3), c(1, 3), c(1), c(1, 12, 33), 'rows')",
        "_rbf_matmul_backward_kernel: the fused kernels take d <= 32 and t <= 32, got d=3 and t=33",
    ),
    "matmul_backward_features": (
        "gp._rbf_matmul_backward_kernel(c(1, 10, 2), c(1, 10, 33), c(1, 12, 33), c(1, 33), c(1), c(1, 12, 2),"
        " 'bilinear4')",
        "_rbf_matmul_backward_kernel: the fused kernels take d <= 32 and t <= 32, got d=33 and t=2",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_cuda_op_check_raises(name):
    expression, message = CASES[name]
    call = (
        "def call():\n"
        "    ops._ensure_loaded()\n"
        "    gp = torch.ops.gpfast\n"
        "    def c(*shape):\n"
        "        return torch.randn(shape, device='cuda')\n"
        f"    {expression}\n"
    )
    assert_raises_in_a_subprocess(call, "", message)
