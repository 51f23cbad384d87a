"""rbf_matmul (K @ V without storing K) and its matrix-free gradients against the dense float64 reference."""

from pathlib import Path

import pytest
import torch
from conftest import DEVICES, poison_allocator, rel_err
from test_ops import BROADCAST_CASES, autograd_reference, broadcast_case, grads_of, rand_inputs, sum_err
from torch.autograd import gradcheck

from gpfast import _reference as ref
from gpfast import ops


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "shape",
    [
        ((), 1, 1, 1, 1),
        ((), 300, 257, 8, 11),
        ((2,), 70, 130, 3, 1),
        ((), 129, 64, 17, 16),
        ((), 50, 90, 30, 33),
        ((), 40, 61, 36, 5),
        ((3,), 200, 1500, 8, 70),
    ],
)
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
@pytest.mark.parametrize(
    "shape",
    [((), 600, 900, 8, 11), ((2,), 130, 70, 3, 1), ((), 90, 300, 20, 16), ((), 64, 80, 40, 4), ((), 60, 70, 6, 40)],
)
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


def cpu_path(op, args, x_grads=True, portable=False, column_buffer_mb=256):
    """A CPU op through the private op that names its path: the portable build instead of AVX2+FMA, and the column
    buffers' budget of the one-pass backward (0: the two-pass form). args are canonical: (B, n, d), (B, m, d),
    (B, d), (B,) and (B, m, t), in the op's schema order. Returns the list of outputs."""
    return torch.ops.gpfast._rbf_cpu_path(op, list(args), x_grads, portable, column_buffer_mb)


def canonical_inputs(batch, n, m, d, dtype):
    x1, x2, l, s = rand_inputs(batch, n, m, d, "cpu", dtype)
    return ops._canonicalize(x1, x2, l, s, True)[:4]


@pytest.mark.parametrize("op", ["covariance", "matmul"])
def test_cpu_backward_fused_and_two_pass_agree(op):
    """The CPU backward's one-pass form (column sums in per-chunk buffers) against its two-pass fallback."""
    x1, x2, l, s = canonical_inputs((2,), 37, 23, 5, torch.float64)
    v = torch.randn(2, 23, 3, dtype=torch.float64)
    args = (x1, x2, l, s) if op == "covariance" else (x1, x2, l, s, v)
    out = cpu_path(f"rbf_{op}", args)[0]
    grad = torch.ones_like(out) + out
    fused = cpu_path(f"rbf_{op}_backward", (grad, *args))
    two_pass = cpu_path(f"rbf_{op}_backward", (grad, *args), column_buffer_mb=0)
    for a, b in zip(fused, two_pass):
        assert rel_err(a, b) < 1e-13
        assert b.abs().max() > 0


def _cpu_has_avx2_fma():
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags


@pytest.mark.skipif(not _cpu_has_avx2_fma(), reason="needs a CPU with AVX2 and FMA (else only one build runs)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_portable_and_avx2_builds_agree(dtype):
    """The CPU kernels' AVX2+FMA build against their portable build, on every op (K @ V's v-gradient is K @ V with
    the point sets swapped), with column counts past one block of 128 and right-hand-side counts on both sides of
    the 8-lane split."""
    x1, x2, l, s = canonical_inputs((2,), 41, 300, 6, dtype)

    def everything(portable):
        out = []
        for t in (3, 19):
            v = torch.randn(2, 300, t, dtype=dtype, generator=torch.Generator().manual_seed(t))
            kv = cpu_path("rbf_matmul", (x1, x2, l, s, v), portable=portable)[0]
            grad = torch.ones_like(kv) + kv
            out += [kv, *cpu_path("rbf_matmul_backward", (grad, x1, x2, l, s, v), portable=portable)]
            out += cpu_path("rbf_matmul", (x2, x1, l, s, grad), portable=portable)
        K = cpu_path("rbf_covariance", (x1, x2, l, s), portable=portable)[0]
        grad = torch.ones_like(K) + K
        return out + [K, *cpu_path("rbf_covariance_backward", (grad, x1, x2, l, s), portable=portable)]

    fast = everything(False)
    portable = everything(True)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for a, b in zip(fast, portable):
        assert b.abs().max() > 0
        assert rel_err(a, b) < tol


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("t", [1, 8, 11, 16, 17, 32])
def test_matmul_rhs_counts_ragged(device, dtype, t):
    """Right-hand-side counts on both sides of every vector and bucket width, sizes just off the tiles: the product
    and its gradients (v's included) against the float64 oracle on fresh draws."""
    x1, x2, l, s = rand_inputs((2,), 67, 131, 5, device, dtype)
    v = torch.randn(2, 131, t, device=device, dtype=dtype)
    w = torch.randn(2, 67, t, device=device, dtype=dtype)
    poison_allocator(device, 8 * 131 * 67 * t)
    out = ops.rbf_matmul(x1, x2, l, s, v)
    args = (x1, x2, l, s, v)
    want = ref.rbf_matmul(*(a.double() for a in args))
    got_g = grads_of(ops.rbf_matmul, args, w)
    want_g = grads_of(ref.rbf_matmul, [a.double() for a in args], w.double())
    names = ("x1", "x2", "lengthscale", "outputscale", "v")
    if dtype == torch.float64:
        # against the magnitudes of the terms: the same sums with |v| and |w|
        absolute = (x1, x2, l, s, v.abs())
        assert sum_err(out, want, ref.rbf_matmul(*absolute)) < 1e-12
        for name, g, r, mg in zip(names, got_g, want_g, grads_of(ref.rbf_matmul, absolute, w.abs())):
            assert sum_err(g, r, mg) < 1e-12, name
    else:
        assert rel_err(out, want) <= 2 * rel_err(ref.rbf_matmul(*args), want) + 1e-6
        plain_g = grads_of(ref.rbf_matmul, args, w)
        for name, g, r, p in zip(names, got_g, want_g, plain_g):
            assert rel_err(g, r) <= 4 * rel_err(p, r) + 1e-6, name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(len(BROADCAST_CASES)))
@pytest.mark.parametrize("rhs", ["matrix", "vector", "extra batch"])
def test_matmul_backward_function(device, case, rhs):
    x1, x2, l, s = broadcast_case(case, device)
    batch, m = ref.rbf_covariance(x1, x2, l, s).shape[:-2], x2.shape[-2]
    shape = {"matrix": (m, 3), "vector": (m,), "extra batch": (4, *[1] * len(batch), m, 2)}[rhs]
    v = torch.randn(shape, device=device, dtype=torch.float64)

    def product(a, b, c, e, rhs=v):
        return ref.rbf_matmul(a, b, c, e, rhs[..., None])[..., 0] if v.dim() == 1 else ref.rbf_matmul(a, b, c, e, rhs)

    grad = torch.randn_like(product(x1, x2, torch.as_tensor(l), torch.as_tensor(s)))
    want = autograd_reference(product, grad, x1, x2, l, s)
    magnitude = autograd_reference(lambda *a: product(*a, rhs=v.abs()), grad.abs(), x1, x2, l, s)
    poison_allocator(device, 8 * grad.numel() * 4)
    got = ops.rbf_matmul_backward(grad, x1, x2, l, s, v)
    for name, g, r, mg in zip(("x1", "x2", "lengthscale", "outputscale"), got, want, magnitude):
        assert g.shape == r.shape and g.dtype == torch.float64, name
        assert sum_err(g, r, mg) < 1e-12, name
    masked = ops.rbf_matmul_backward(grad, x1, x2, l, s, v, x_grads=False)
    assert masked[0] is None and masked[1] is None
    for name, g, r, mg in zip(("lengthscale", "outputscale"), masked[2:], got[2:], magnitude[2:]):
        assert g.shape == r.shape and sum_err(g, r, mg) < 1e-13, name


def test_autograd_asks_only_for_needed_gradients(monkeypatch):
    """The autograd formulas pass the gradient mask: with no point gradient wanted, x_grads is False."""
    seen = []
    real = torch.ops.gpfast.rbf_matmul_backward

    class Spy:
        def __call__(self, *args):
            seen.append(args[-1])
            return real(*args)

    monkeypatch.setattr(torch.ops.gpfast, "rbf_matmul_backward", Spy())
    x1, x2, l, s = rand_inputs((), 20, 30, 3, "cpu", torch.float64)
    v = torch.randn(30, 2, dtype=torch.float64)
    for wanted in ([l, s], [x1, l], [x2]):
        for a in wanted:
            a.requires_grad_()
        grads = torch.autograd.grad(ops.rbf_matmul(x1, x2, l, s, v).sum(), wanted)
        assert all(g is not None and g.shape == a.shape for g, a in zip(grads, wanted))
        for a in wanted:
            a.requires_grad_(False)
    assert seen == [False, True, True]


@pytest.mark.parametrize("op", ["covariance", "matmul"])
@pytest.mark.parametrize("two_pass", [False, True])
def test_cpu_backward_independent_of_threads(op, two_pass):
    """Bit-identical CPU gradients with 1, 2 and 3 threads, in the one-pass and the two-pass form, masked or not."""
    x1, x2, l, s = canonical_inputs((2,), 301, 203, 6, torch.float32)
    v = torch.randn(2, 203, 5)
    grad = torch.randn(2, 301, 5 if op == "matmul" else 203)
    args = (grad, x1, x2, l, s, v) if op == "matmul" else (grad, x1, x2, l, s)

    def run():
        full = cpu_path(f"rbf_{op}_backward", args, True, column_buffer_mb=0 if two_pass else 256)
        masked = cpu_path(f"rbf_{op}_backward", args, False, column_buffer_mb=0 if two_pass else 256)
        return full + masked[2:]  # without x_grads, the point gradients are empty stand-ins

    threads = torch.get_num_threads()
    try:
        results = []
        for n_threads in (1, 2, 3):
            torch.set_num_threads(n_threads)
            results.append(run())
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
    assert torch.equal(results[0][2], results[0][4]) and torch.equal(results[0][3], results[0][5])  # mask: same l, s


def test_cpu_rows_independent_of_the_other_rows():
    """A row of x1 gets the same result bit for bit whichever other rows of x1 come with it: gpfast.distributed splits
    x1's rows over ranks and compares with one process at 1e-12, through CG runs that amplify any difference."""
    x1, x2, l, s = rand_inputs((), 300, 200, 7, "cpu", torch.float32)
    v, grad = torch.randn(200, 3), torch.randn(300, 3)
    K, Kv = ops.rbf_covariance(x1, x2, l, s), ops.rbf_matmul(x1, x2, l, s, v)
    gx1 = ops.rbf_matmul_backward(grad, x1, x2, l, s, v)[0]
    for a, b in [(0, 1), (37, 161), (161, 300)]:
        assert torch.equal(ops.rbf_covariance(x1[a:b], x2, l, s), K[a:b])
        assert torch.equal(ops.rbf_matmul(x1[a:b], x2, l, s, v), Kv[a:b])
        assert torch.equal(ops.rbf_matmul_backward(grad[a:b], x1[a:b], x2, l, s, v)[0], gx1[a:b])
