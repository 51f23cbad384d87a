"""rbf_matmul (K @ V without storing K) and its matrix-free gradients against the dense float64 reference."""

import pytest
import torch
from torch.autograd import gradcheck

from conftest import DEVICES, poison_allocator, rel_err
from gpfast import _reference as ref
from gpfast import ops
from test_ops import grads_of, rand_inputs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [((), 1, 1, 1, 1), ((), 300, 257, 8, 11), ((2,), 70, 130, 3, 1),
                                   ((), 129, 64, 17, 16), ((), 50, 90, 30, 33), ((), 40, 61, 36, 5),
                                   ((3,), 200, 1500, 8, 70)])
def test_matmul_matches_dense_reference(device, dtype, shape):
    batch, n, m, d, t = shape
    x1, x2, l, s = rand_inputs(batch, n, m, d, device, dtype)
    v = torch.randn(*batch, m, t, device=device, dtype=dtype)
    poison_allocator(device, 8 * n * t * 64)
    out = ops.rbf_matmul(x1, x2, l, s, v)
    assert out.shape == (*batch, n, t)
    want = ref.rbf_matmul(x1.double(), x2.double(), l.double(), s.double(), v.double())
    if dtype == torch.float64:
        assert rel_err(out, want) < 1e-12
    else:
        plain = ref.rbf_matmul(x1, x2, l, s, v)
        assert rel_err(out, want) <= 2 * rel_err(plain, want) + 1e-6


@pytest.mark.parametrize("device", DEVICES)
def test_matmul_vector_and_lengthscales_in_gp_range(device):
    # standardised x and lengthscales from 0.05 to 10, as GP training meets them
    for ls in (0.05, 0.3, 1.0, 10.0):
        x = torch.randn(700, 8, device=device)
        v = torch.randn(700, device=device)
        out = ops.rbf_matmul(x, x, ls, 1.0, v)
        assert out.shape == (700,)
        want = ref.rbf_matmul(x.double(), x.double(), torch.tensor(ls), torch.tensor(1.0), v.double()[:, None])[:, 0]
        plain = ref.rbf_matmul(x, x, torch.tensor(ls), torch.tensor(1.0), v[:, None])[:, 0]
        assert rel_err(out, want) <= 2 * rel_err(plain, want) + 1e-6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d,t", [(2, 1), (5, 3), (9, 12), (34, 2), (4, 40)])
def test_matmul_gradcheck_float64(device, d, t):
    x1, x2, l, s = rand_inputs((2,), 6, 7, d, device, torch.float64)
    v = torch.randn(2, 7, t, device=device, dtype=torch.float64)
    inputs = [a.clone().requires_grad_() for a in (x1, x2, l, s, v)]
    assert gradcheck(lambda *a: ops.rbf_matmul(*a), inputs, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [((), 600, 900, 8, 11), ((2,), 130, 70, 3, 1), ((), 90, 300, 20, 16),
                                   ((), 64, 80, 40, 4), ((), 60, 70, 6, 40)])
def test_matmul_gradients_float32_vs_float64(device, shape):
    batch, n, m, d, t = shape
    x1, x2, l, s = rand_inputs(batch, n, m, d, device)
    v = torch.randn(*batch, m, t, device=device)
    w = torch.randn(*batch, n, t, device=device)
    got = grads_of(ops.rbf_matmul, (x1, x2, l, s, v), w)
    want = grads_of(ref.rbf_matmul, [a.double() for a in (x1, x2, l, s, v)], w.double())
    plain = grads_of(ref.rbf_matmul, (x1, x2, l, s, v), w)
    for name, g, r, p in zip(("x1", "x2", "lengthscale", "outputscale", "v"), got, want, plain):
        assert rel_err(g, r) <= 4 * rel_err(p, r) + 1e-6, name


@pytest.mark.parametrize("op", ["covariance", "matmul"])
def test_cpu_backward_fused_and_two_pass_agree(monkeypatch, op):
    """The CPU backward's one-pass form (column sums in per-chunk buffers) against its two-pass fallback."""
    x1, x2, l, s = rand_inputs((2,), 37, 23, 5, "cpu", torch.float64)
    v = torch.randn(2, 23, 3, dtype=torch.float64)

    def grads():
        inputs = [t.clone().requires_grad_() for t in (x1, x2, l, s)]
        out = ops.rbf_covariance(*inputs) if op == "covariance" else ops.rbf_matmul(*inputs, v)
        return torch.autograd.grad(out, inputs, torch.ones_like(out) + out.detach())

    fused = grads()
    monkeypatch.setenv("GPFAST_CPU_COLUMN_BUFFER_MB", "0")
    two_pass = grads()
    for a, b in zip(fused, two_pass):
        assert rel_err(a, b) < 1e-13
        assert b.abs().max() > 0


def _cpu_has_avx2_fma():
    try:
        flags = open("/proc/cpuinfo").read().split()
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags


@pytest.mark.skipif(not _cpu_has_avx2_fma(), reason="needs a CPU with AVX2 and FMA (else only one build runs)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_portable_and_avx2_builds_agree(monkeypatch, dtype):
    """The CPU kernels' AVX2+FMA build against their portable build (GPFAST_CPU_PORTABLE=1), on every op, with
    column counts past one block of 128 and right-hand-side counts on both sides of the 8-lane split."""
    x1, x2, l, s = rand_inputs((2,), 41, 300, 6, "cpu", dtype)

    def everything():
        out = []
        for t in (3, 19):
            v = torch.randn(2, 300, t, dtype=dtype, generator=torch.Generator().manual_seed(t))
            inputs = [a.clone().requires_grad_() for a in (x1, x2, l, s, v)]
            kv = ops.rbf_matmul(*inputs)
            out += [kv.detach(), *torch.autograd.grad(kv, inputs, torch.ones_like(kv) + kv.detach())]
        inputs = [a.clone().requires_grad_() for a in (x1, x2, l, s)]
        K = ops.rbf_covariance(*inputs)
        return out + [K.detach(), *torch.autograd.grad(K, inputs, torch.ones_like(K) + K.detach())]

    fast = everything()
    monkeypatch.setenv("GPFAST_CPU_PORTABLE", "1")
    portable = everything()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for a, b in zip(fast, portable):
        assert b.abs().max() > 0
        assert rel_err(a, b) < tol
