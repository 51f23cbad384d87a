"""The covariance backward from a given K (``_rbf_covariance_backward_from_k``, the named variant "from_k"): the
float64 formula against autograd on every device, and the CUDA kernel against that formula on the same K.

The kernel forms M = grad o K and every sum in double, as the formula does, so on the same K the two differ by
the final rounding to float32 (and the expanded form's cancellation, 2^-53 of its terms): 2^-22 norm-wise bounds
that on every draw. Against float64 with K recomputed in float64 the variant is only as accurate as the float32 K
it is given, which on about 1 draw in 130 puts the outputscale's gradient over the accuracy rule
(experiments/backward_f32_probe.py): autograd therefore recomputes the exponentials instead.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import DEVICES, poison_allocator, rel_err
from test_ops import grads_of, rand_inputs

from gpfast import _reference as ref
from gpfast import ops

NAMES = ("x1", "x2", "lengthscale", "outputscale")
SHAPES = [  # (batch, n, m, d): ragged against 64-row blocks and 32-column tiles, every feature bucket, d > 32
    ((), 70, 90, 29),
    ((3,), 97, 301, 3),
    ((), 200, 1100, 8),
    ((), 150, 261, 16),
    ((), 257, 33, 9),
    ((2,), 31, 4000, 32),
    ((), 65, 64, 21),
    ((), 64, 64, 40),
    ((), 1, 1, 1),
]
no_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")


def canonical(batch, n, m, d, device, dtype=torch.float32, shift=0.0):
    x1, x2, l, s = rand_inputs(batch, n, m, d, device, dtype)
    B = math.prod(batch)
    return x1.reshape(B, n, d) + shift, x2.reshape(B, m, d) + shift, l.reshape(B, d), s.reshape(B)


def from_k(grad, K, x1, x2, l, s, x_grads=True, kernel="auto"):
    return torch.ops.gpfast._rbf_covariance_backward_from_k(grad, K, x1, x2, l, s, x_grads, kernel)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES[:5] + SHAPES[7:])
def test_formula_matches_autograd_in_float64(device, shape):
    """The float64 formula from an exact K against autograd through the definition: to rounding."""
    batch, n, m, d = shape
    x1, x2, l, s = canonical(batch, n, m, d, device, torch.float64, shift=3.0)
    w = torch.randn(x1.shape[0], n, m, device=device, dtype=torch.float64)
    want = grads_of(ref.rbf_covariance, (x1, x2, l[:, None], s), w)
    want[2] = want[2][:, 0]
    K = ref.rbf_covariance(x1, x2, l[:, None], s)
    for kernel in ("auto", "reference"):
        got = from_k(w, K, x1, x2, l, s, True, kernel)
        for name, g, r in zip(NAMES, got, want):
            assert g.shape == r.shape and g.dtype == torch.float64, name
            assert rel_err(g, r) < 1e-12, (name, kernel)
        masked = from_k(w, K, x1, x2, l, s, False, kernel)
        assert masked[0].shape == (0,) and masked[1].shape == (0,)
        assert rel_err(masked[2], got[2]) < 1e-14 and rel_err(masked[3], got[3]) < 1e-14


def test_checks_name_the_argument():
    """On the CPU: on the H200 a C++ check that raises inside a CUDA op ends the process (the callers check first)."""
    x1, x2, l, s = canonical((), 5, 6, 3, "cpu")
    K = torch.ones(1, 5, 6)
    with pytest.raises(RuntimeError, match=r"K must be \(B, n, m\) = \(1, 5, 6\), got \[1, 6, 5\]"):
        from_k(K, K.transpose(1, 2), x1, x2, l, s)
    with pytest.raises(RuntimeError, match=r"grad must be \(B, n, m\)"):
        from_k(K[:, :4], K, x1, x2, l, s)
    with pytest.raises(RuntimeError, match="K must share x1's dtype"):
        from_k(K, K.double(), x1, x2, l, s)
    with pytest.raises(RuntimeError, match="kernel must be 'auto' or 'reference', got 'tc'"):
        from_k(K, K, x1, x2, l, s, True, "tc")


@pytest.mark.parametrize("device", DEVICES)
def test_named_from_k_variants_agree(device):
    """_rbf_covariance_backward_kernel's "from_k" and "from_k_reference" (the forward's K, then each backward)."""
    x1, x2, l, s = canonical((2,), 40, 70, 6, device)
    w = torch.randn(2, 40, 70, device=device)
    a = ops._rbf_covariance_backward_kernel(w, x1, x2, l[:, None], s, "from_k")
    b = ops._rbf_covariance_backward_kernel(w, x1, x2, l[:, None], s, "from_k_reference")
    for name, g, r in zip(NAMES, a, b):
        assert g.shape == r.shape, name
        assert rel_err(g, r) <= 2**-22, name


@pytest.mark.cuda
@no_gpu
@pytest.mark.parametrize("shift", [0.0, 10.0])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("x_grads", [True, False])
def test_kernel_matches_its_float64_formula(shape, shift, x_grads):
    batch, n, m, d = shape
    x1, x2, l, s = canonical(batch, n, m, d, "cuda", shift=shift)
    K = torch.ops.gpfast.rbf_covariance(x1, x2, l, s)
    w = torch.randn_like(K)
    want = from_k(w, K, x1, x2, l, s, x_grads, "reference")
    poison_allocator("cuda", 8 * (n + m) * 32 * 64 * x1.shape[0])
    got = from_k(w, K, x1, x2, l, s, x_grads)
    for name, g, r in zip(NAMES, got, want):
        assert g.shape == r.shape and g.dtype == torch.float32, name
        assert torch.isfinite(g).all(), (name, "poisoned memory showed through")
        if r.numel():
            assert rel_err(g, r) <= 2**-22, name


@pytest.mark.cuda
@no_gpu
@pytest.mark.parametrize("shape", SHAPES[:7])
def test_kernel_mask_and_determinism(shape):
    """Without the points' gradients pass 1 alone runs: the same lengthscale and outputscale gradients bit for bit;
    and a repeated call gives the same bits."""
    batch, n, m, d = shape
    x1, x2, l, s = canonical(batch, n, m, d, "cuda")
    K = torch.ops.gpfast.rbf_covariance(x1, x2, l, s)
    w = torch.randn_like(K)
    full, masked, again = from_k(w, K, x1, x2, l, s), from_k(w, K, x1, x2, l, s, False), from_k(w, K, x1, x2, l, s)
    assert masked[0].shape == (0,) and masked[1].shape == (0,)
    assert torch.equal(masked[2], full[2]) and torch.equal(masked[3], full[3])
    for a, b in zip(full, again):
        assert torch.equal(a, b)
