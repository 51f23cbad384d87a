"""The fused ops against the float64 pure-PyTorch reference, on fresh random inputs each run."""

import subprocess
import sys

import pytest
import torch
from conftest import DEVICES, poison_allocator, rel_err
from torch.autograd import gradcheck

from gpfast import _reference as ref
from gpfast import ops


def rand_inputs(batch, n, m, d, device, dtype=torch.float32, ard=True, gen=None):
    """Standardised points and lengthscales in the range a GP fit reaches: 0.5-2, times sqrt(d / 8) for d > 8, so
    that typical squared distances stay O(10) and K is not 1e-12 everywhere. (With every entry that small the
    norm-wise error is set by a handful of entries and comparisons between float32 methods become a lottery.)"""
    x1 = torch.randn(*batch, n, d, device=device, dtype=dtype)
    x2 = torch.randn(*batch, m, d, device=device, dtype=dtype)
    widen = max(1.0, (d / 8) ** 0.5)
    l = (torch.rand(*batch, 1, d if ard else 1, device=device, dtype=dtype) * 1.5 + 0.5) * widen
    s = torch.rand(tuple(batch), device=device, dtype=dtype) + 0.5
    return x1, x2, l, s


def reference64(x1, x2, l, s, diag=False):
    return ref.rbf_covariance(x1.double(), x2.double(), l.double(), s.double(), diag=diag)


def float32_bound(device, plain_err):
    """FlashAttention's rule for a float32 result against the float64 oracle: at most twice the error of the plain
    float32 formula (plus 1e-7 for draws where that is nearly exact). On CUDA parametrizations only, the floor is
    1e-6: the CUDA kernels take distances by the norm expansion, which errs by 2-5e-7 on centred data
    however exact the plain formula happens to be; the CPU kernels take differences in double and keep the rule."""
    bound = 2 * plain_err + 1e-7
    return max(bound, 1e-6) if device == "cuda" else bound


SHAPES = [
    ((), 1, 1, 1),
    ((), 7, 5, 3),
    ((), 64, 64, 8),
    ((), 65, 130, 9),  # partial tiles, m not a multiple of 4
    ((2,), 33, 40, 17),
    ((2, 3), 20, 12, 2),
    ((16,), 512, 128, 8),  # the seed's shape
    ((), 100, 70, 40),  # wider than the fused kernels' 32-feature bucket
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES)
def test_covariance_matches_float64_reference(device, dtype, shape):
    batch, n, m, d = shape
    x1, x2, l, s = rand_inputs(batch, n, m, d, device, dtype)
    poison_allocator(device, x1.element_size() * n * m * max(1, len(batch) and batch[0]))
    K = ops.rbf_covariance(x1, x2, l, s)
    assert K.shape == (*batch, n, m) and K.dtype == dtype and K.device.type == device
    assert torch.isfinite(K).all()
    K64 = reference64(x1, x2, l, s)
    tol = 1e-13 if dtype == torch.float64 else 1e-5
    assert rel_err(K, K64) < tol
    if dtype == torch.float32:
        # no worse than the plain PyTorch formula in float32 (FlashAttention's rule: at most 2x its error)
        plain = ref.rbf_covariance(x1, x2, l, s)
        assert rel_err(K, K64) <= float32_bound(device, rel_err(plain, K64))


@pytest.mark.parametrize("device", DEVICES)
def test_covariance_shared_lengthscale_scalars_and_broadcast(device):
    x1 = torch.randn(1, 9, 4, device=device)
    x2 = torch.randn(3, 6, 4, device=device)
    K = ops.rbf_covariance(x1, x2, 0.7, 2.0)
    assert K.shape == (3, 9, 6)
    assert rel_err(K, reference64(x1.expand(3, 9, 4), x2, torch.tensor(0.7), torch.tensor(2.0))) < 1e-5
    l = torch.tensor([0.7], device=device)  # shape (1,): shared
    assert torch.allclose(ops.rbf_covariance(x1, x2, l, 2.0), K)


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_inputs(device):
    x1 = torch.randn(12, 30, device=device)[:, ::3].t()[:, :7]  # (10, 7) strided
    x2 = torch.randn(7, 20, device=device).t()  # (20, 7) transposed
    l = (torch.rand(14, device=device) + 0.5)[::2]
    assert not x1.is_contiguous() and not x2.is_contiguous() and not l.is_contiguous()
    K = ops.rbf_covariance(x1, x2, l, 1.3)
    assert rel_err(K, reference64(x1, x2, l, torch.tensor(1.3))) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_empty_sizes(device):
    for n, m in [(0, 5), (5, 0), (0, 0)]:
        K = ops.rbf_covariance(torch.randn(n, 3, device=device), torch.randn(m, 3, device=device), 1.0, 1.0)
        assert K.shape == (n, m)
    assert ops.rbf_covariance(
        torch.randn(0, 4, 3, device=device), torch.randn(0, 5, 3, device=device), 1.0, 1.0
    ).shape == (0, 4, 5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_diagonal_exact_and_distances_nonnegative(device, dtype):
    x = torch.randn(300, 6, device=device, dtype=dtype) * 50 + 1000  # far from the origin: cancellation-prone
    # near-duplicate pairs, so that off-diagonal entries are close to s (where a negative distance would show)
    x[1::2] = x[::2] + 1e-3 * torch.randn(150, 6, device=device, dtype=dtype)
    s = torch.tensor(1.7, device=device, dtype=dtype)
    l = torch.rand(6, device=device, dtype=dtype) + 0.1
    K = ops.rbf_covariance(x, x, l, s)
    assert torch.equal(K.diagonal(), torch.full((300,), 1.7, device=device, dtype=dtype))
    assert (K <= s).all()  # exp of a never-negative squared distance
    pairs = K.diagonal(1)[::2]  # K(x_2i, x_2i+1)
    assert bool((pairs > 1.0).all())  # the check above was not decided by zeros alone
    want = reference64(x, x, l, s).diagonal(1)[::2]
    # float32: z = x / l is rounded at |z| ~ 1e4 (ulp 1e-3) while the pairs differ by ~1e-2, so ~1e-5 is expected
    assert rel_err(pairs, want) < (1e-12 if dtype == torch.float64 else 1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_diag_mode(device, dtype):
    x1, x2, l, s = rand_inputs((3,), 11, 11, 5, device, dtype)
    kd = ops.rbf_covariance(x1, x2, l, s, diag=True)
    assert kd.shape == (3, 11)
    assert rel_err(kd, reference64(x1, x2, l, s, diag=True)) < (1e-12 if dtype == torch.float64 else 1e-6)
    with pytest.raises(ValueError, match="same number of rows"):
        ops.rbf_covariance(x1, x2[:, :4], l, s, diag=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [1, 3, 8, 12, 33])
def test_covariance_gradcheck_float64(device, d):
    x1, x2, l, s = rand_inputs((2,), 6, 5, d, device, torch.float64)
    inputs = [t.clone().requires_grad_() for t in (x1, x2, l, s)]
    assert gradcheck(lambda a, b, c, e: ops.rbf_covariance(a, b, c, e), inputs, eps=1e-6, atol=1e-7)
    # broadcast batch and a shared lengthscale: the reductions of the broadcast dims go through autograd.
    # The lengthscale grows with sqrt(d) so that K is not ~0 everywhere (a zero gradient would then pass).
    a = torch.randn(1, 4, d, dtype=torch.float64, device=device, requires_grad=True)
    b = torch.randn(3, 5, d, dtype=torch.float64, device=device, requires_grad=True)
    ls = torch.tensor([0.9 * max(1.0, d**0.5)], dtype=torch.float64, device=device, requires_grad=True)
    os_ = torch.tensor(1.4, dtype=torch.float64, device=device, requires_grad=True)
    with torch.no_grad():
        assert ops.rbf_covariance(a, b, ls, os_).max() > 1e-3
        assert ops.rbf_covariance(a, b[:, :4], ls, os_, diag=True).max() > 1e-3
    assert gradcheck(lambda *t: ops.rbf_covariance(*t), (a, b, ls, os_), eps=1e-6, atol=1e-7)
    assert gradcheck(lambda *t: ops.rbf_covariance(*t, diag=True), (a, b[:, :4], ls, os_), eps=1e-6, atol=1e-7)


def grads_of(fn, inputs, weight):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    (out * weight).sum().backward()
    return [t.grad for t in inputs]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "shape", [((), 200, 1100, 8), ((2,), 97, 301, 3), ((), 150, 260, 16), ((), 70, 90, 29), ((), 64, 64, 40)]
)
def test_covariance_gradients_float32_vs_float64(device, shape):
    batch, n, m, d = shape
    x1, x2, l, s = rand_inputs(batch, n, m, d, device)
    w = torch.randn(*batch, n, m, device=device)
    got = grads_of(ops.rbf_covariance, (x1, x2, l, s), w)
    want = grads_of(ref.rbf_covariance, [t.double() for t in (x1, x2, l, s)], w.double())
    plain = grads_of(ref.rbf_covariance, (x1, x2, l, s), w)
    for name, g, r, p in zip(("x1", "x2", "lengthscale", "outputscale"), got, want, plain):
        assert g.dtype == torch.float32
        assert rel_err(g, r) <= 4 * rel_err(p, r) + 1e-6, name


# ------------------------------------------------------------------------------------- accuracy where it is hardest


def sum_err(got, want, magnitude):
    """rel_err against the larger of the result and the magnitude of its terms (the same sums over |weights|): a
    gradient is a sum of signed terms, which on an unlucky draw cancels to almost nothing, and no float64 method, the
    oracle included, gets that remnant to a fixed relative accuracy. For float64 results on fresh draws."""
    got, want, magnitude = got.double(), want.double(), magnitude.double()
    return ((got - want).norm() / torch.maximum(want.norm(), magnitude.norm()).clamp_min(1e-300)).item()


def grads_and_plain(x1, x2, l, s, w, fn=None, ref_fn=None, extra=()):
    """(ours, float64 oracle, plain float32 formula) gradients of sum(w * op(...)) for float32 inputs."""
    fn, ref_fn = fn or ops.rbf_covariance, ref_fn or ref.rbf_covariance
    args = (x1, x2, l, s, *extra)
    return (grads_of(fn, args, w), grads_of(ref_fn, [a.double() for a in args], w.double()), grads_of(ref_fn, args, w))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [((), 150, 260, 8), ((2,), 65, 131, 5), ((), 70, 90, 33)])
def test_uncentred_data_and_duplicated_rows(device, dtype, shape):
    """Data shifted by +10, as raw features often are, with rows of x1 copied into x2: K is s exactly at the copies,
    never above s, and values and gradients keep their accuracy (the backward's expansion centres the data)."""
    batch, n, m, d = shape
    x1, x2, l, s = rand_inputs(batch, n, m, d, device, dtype)
    x1, x2 = x1 + 10, x2 + 10
    dup = torch.randperm(n, device=device)[: m // 3]
    x2[..., : m // 3, :] = x1[..., dup, :]
    poison_allocator(device, x1.element_size() * n * m * 2)
    K = ops.rbf_covariance(x1, x2, l, s)
    at_copies = K[..., dup, torch.arange(m // 3, device=device)]
    assert torch.equal(at_copies, s.unsqueeze(-1).expand_as(at_copies))
    assert (K <= s[..., None, None]).all()
    K64 = reference64(x1, x2, l, s)
    w = torch.randn(*batch, n, m, device=device, dtype=dtype)
    got, want, plain = grads_and_plain(x1, x2, l, s, w)
    if dtype == torch.float64:
        assert rel_err(K, K64) < 1e-13
        magnitude = grads_of(ref.rbf_covariance, (x1, x2, l, s), w.abs())
        for name, g, r, mg in zip(("x1", "x2", "lengthscale", "outputscale"), got, want, magnitude):
            assert sum_err(g, r, mg) < 1e-12, name
    else:
        assert rel_err(K, K64) <= float32_bound(device, rel_err(ref.rbf_covariance(x1, x2, l, s), K64))
        for name, g, r, p in zip(("x1", "x2", "lengthscale", "outputscale"), got, want, plain):
            assert rel_err(g, r) <= 4 * rel_err(p, r) + 1e-6, name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [1e-3, 1e-2, 1e2, 1e3])
def test_extreme_lengthscales(device, dtype, scale):
    """Lengthscales far from the data's spread of 1. Half of x2 sits within a lengthscale or so of x1's rows, so that
    small lengthscales still leave entries of K (and gradients) that are not zero."""
    n, m, d = 90, 140, 6
    x1 = torch.randn(n, d, device=device, dtype=dtype)
    x2 = torch.randn(m, d, device=device, dtype=dtype)
    near = min(scale, 1.0) * torch.randn(m // 2, d, device=device, dtype=dtype)
    x2[: m // 2] = x1[torch.randint(n, (m // 2,), device=device)] + near
    l = scale * (torch.rand(1, d, device=device, dtype=dtype) + 0.5)
    s = torch.rand((), device=device, dtype=dtype) + 0.5
    K = ops.rbf_covariance(x1, x2, l, s)
    K64 = reference64(x1, x2, l, s)
    assert K64.abs().max() > 0.1 * s
    w = torch.randn(n, m, device=device, dtype=dtype)
    got, want, plain = grads_and_plain(x1, x2, l, s, w)
    if dtype == torch.float64:
        # sums of the GEMM form cancel by up to (spread of z / distance of the pairs that matter)^2 = (1 / scale)^2 in
        # the lengthscale gradient: 1.5e-9 at 1e-3 (1e-15 at 1e3), far below float32's rounding
        tol = 1e-13 * (1 + scale**-2)
        assert rel_err(K, K64) < tol
        magnitude = grads_of(ref.rbf_covariance, (x1, x2, l, s), w.abs())
        for name, g, r, mg in zip(("x1", "x2", "lengthscale", "outputscale"), got, want, magnitude):
            assert sum_err(g, r, mg) < tol, name
    else:
        assert rel_err(K, K64) <= float32_bound(device, rel_err(ref.rbf_covariance(x1, x2, l, s), K64))
        for name, g, r, p in zip(("x1", "x2", "lengthscale", "outputscale"), got, want, plain):
            assert rel_err(g, r) <= 4 * rel_err(p, r) + 1e-6, name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "shape",
    [
        ((), 1, 1, 1),
        ((), 1, 300, 2),
        ((), 300, 1, 7),
        ((), 63, 129, 4),
        ((3,), 65, 127, 3),
        ((), 129, 257, 9),
        ((2,), 40, 70, 37),
    ],
)
def test_covariance_backward_ragged_tiles_float64(device, shape):
    """Sizes just off every tile and vector width, fresh float64 draws against the oracle's autograd."""
    batch, n, m, d = shape
    x1, x2, l, s = rand_inputs(batch, n, m, d, device, torch.float64)
    w = torch.randn(*batch, n, m, device=device, dtype=torch.float64)
    poison_allocator(device, 8 * (n + m) * d * 4)
    got = grads_of(ops.rbf_covariance, (x1, x2, l, s), w)
    want = grads_of(ref.rbf_covariance, (x1, x2, l, s), w)
    magnitude = grads_of(ref.rbf_covariance, (x1, x2, l, s), w.abs())
    for name, g, r, mg in zip(("x1", "x2", "lengthscale", "outputscale"), got, want, magnitude):
        assert torch.isfinite(g).all() and sum_err(g, r, mg) < 1e-12, name


# ------------------------------------------------------------------------- backward functions and the gradient mask

BROADCAST_CASES = [  # x1, x2, lengthscale, outputscale: shapes, or a float for a Python number
    ((5, 3), (4, 3), (3,), ()),
    ((2, 5, 3), (4, 3), (2, 1, 1), (2,)),
    ((1, 5, 3), (3, 4, 3), (1,), 1.7),
    ((5, 3), (4, 3), 0.8, 1.3),
    ((2, 3, 5, 2), (3, 4, 2), (3, 1, 2), (2, 1)),
]


def broadcast_case(case, device):
    x1s, x2s, ls, ss = BROADCAST_CASES[case]
    opts = {"device": device, "dtype": torch.float64}
    x1, x2 = torch.randn(x1s, **opts), torch.randn(x2s, **opts)
    l = (torch.rand(ls, **opts) + 0.5) * 1.5 if isinstance(ls, tuple) else ls
    s = torch.rand(ss, **opts) + 0.5 if isinstance(ss, tuple) else ss
    return x1, x2, l, s


def autograd_reference(fn, grad, x1, x2, l, s, *extra):
    """Gradients of sum(grad * fn(...)) by autograd through the float64 reference, numbers as 0-dim tensors."""
    leaves = [
        torch.as_tensor(a, dtype=torch.float64, device=x1.device).clone().requires_grad_() for a in (x1, x2, l, s)
    ]
    return torch.autograd.grad((fn(*leaves, *extra) * grad).sum(), leaves)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(len(BROADCAST_CASES)))
def test_covariance_backward_function(device, case):
    x1, x2, l, s = broadcast_case(case, device)
    grad = torch.randn_like(ref.rbf_covariance(x1, x2, l, s))
    want = autograd_reference(ref.rbf_covariance, grad, x1, x2, l, s)
    magnitude = autograd_reference(ref.rbf_covariance, grad.abs(), x1, x2, l, s)
    poison_allocator(device, 8 * grad.numel() * 4)
    got = ops.rbf_covariance_backward(grad, x1, x2, l, s)
    for name, g, r, mg in zip(("x1", "x2", "lengthscale", "outputscale"), got, want, magnitude):
        assert g.shape == r.shape and g.dtype == torch.float64, name
        assert sum_err(g, r, mg) < 1e-12, name
    masked = ops.rbf_covariance_backward(grad, x1, x2, l, s, x_grads=False)
    assert masked[0] is None and masked[1] is None
    for name, g, r, mg in zip(("lengthscale", "outputscale"), masked[2:], got[2:], magnitude[2:]):
        assert g.shape == r.shape and sum_err(g, r, mg) < 1e-13, name


def test_covariance_backward_function_errors():
    x, l = torch.randn(5, 3), torch.ones(3)
    with pytest.raises(ValueError, match=r"grad must have the output's shape \(5, 4\).*got shape \(5, 5\)"):
        ops.rbf_covariance_backward(torch.randn(5, 5), x, x[:4], l, 1.0)
    with pytest.raises(TypeError, match=r"grad has dtype torch.float64 but x1 has torch.float32"):
        ops.rbf_covariance_backward(torch.randn(5, 5, dtype=torch.float64), x, x, l, 1.0)
    with pytest.raises(ValueError, match=r"x1 has d=3 .* x2 has d=4"):
        ops.rbf_covariance_backward(torch.randn(5, 4), x, torch.randn(4, 4), l, 1.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("x_grads", [True, False])
def test_opcheck_backward_ops(device, x_grads):
    x1, x2, l, s = rand_inputs((2,), 9, 7, 3, device, torch.float64)
    args = (x1, x2, l.reshape(2, 3), s)
    torch.library.opcheck(
        torch.ops.gpfast.rbf_covariance_backward.default,
        (torch.randn(2, 9, 7, device=device, dtype=torch.float64), *args, x_grads),
    )
    v = torch.randn(2, 7, 4, device=device, dtype=torch.float64)
    torch.library.opcheck(
        torch.ops.gpfast.rbf_matmul_backward.default,
        (torch.randn(2, 9, 4, device=device, dtype=torch.float64), *args, v, x_grads),
    )
    masked = torch.ops.gpfast.rbf_covariance_backward(
        torch.randn(2, 9, 7, device=device, dtype=torch.float64), *args, x_grads
    )
    assert [tuple(g.shape) for g in masked] == ([(2, 9, 3), (2, 7, 3)] if x_grads else [(0,), (0,)]) + [(2, 3), (2,)]


def test_ops_registered_at_import():
    """A fresh process sees torch.ops.gpfast.* right after ``import gpfast.ops``, the backward ops with their
    mask (``import gpfast`` alone loads nothing compiled)."""
    code = (
        "import gpfast.ops, torch; ops = torch.ops.gpfast; ops.rbf_covariance.default; ops.rbf_matmul.default; "
        "args = ops.rbf_matmul_backward.default._schema.arguments; "
        "assert (args[-1].name, args[-1].default_value) == ('x_grads', True), args; "
        "args = ops.rbf_covariance_backward.default._schema.arguments; "
        "assert (args[-1].name, args[-1].default_value) == ('x_grads', True), args"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr


def test_opcheck_cpu():
    x1, x2, l, s = rand_inputs((2,), 5, 4, 3, "cpu", torch.float64)
    args = (x1, x2, l.reshape(2, 3), s)
    torch.library.opcheck(torch.ops.gpfast.rbf_covariance.default, [t.requires_grad_() for t in args])
    v = torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True)
    args = [t.detach().requires_grad_() for t in args]
    torch.library.opcheck(torch.ops.gpfast.rbf_matmul.default, [*args, v])


@pytest.mark.parametrize("kernel", ["rows", "bilinear4", "bilinear8_nosym"])
def test_backward_kernel_op_refuses_cpu_tensors(kernel):
    """The private op that forces one CUDA backward kernel has no CPU kernel: on CPU tensors it says so."""
    x1, x2, l, s = rand_inputs((), 6, 5, 3, "cpu")
    v, g = torch.randn(5, 2), torch.randn(6, 2)
    with pytest.raises(RuntimeError, match=f"the kernel '{kernel}' runs on CUDA tensors only, got x1 on cpu"):
        ops._rbf_matmul_backward_kernel(g, x1, x2, l, s, v, kernel)


@pytest.mark.parametrize("kernel", ops.COVARIANCE_BACKWARD_KERNELS)
def test_covariance_backward_kernel_op_refuses_cpu_tensors(kernel):
    """The private op that forces one CUDA covariance backward has no CPU kernel: on CPU tensors it says so."""
    x1, x2, l, s = rand_inputs((), 6, 5, 3, "cpu")
    with pytest.raises(RuntimeError, match=f"the kernel '{kernel}' runs on CUDA tensors only, got x1 on cpu"):
        ops._rbf_covariance_backward_kernel(torch.randn(6, 5), x1, x2, l, s, kernel)


@pytest.mark.parametrize(
    "kernel, dtype, d, match",
    [
        ("rows16", torch.float32, 3, "kernel must be one of"),
        ("onepass32", torch.float64, 3, "'onepass32' takes float32"),
        ("onepass32", torch.float32, 17, "'onepass32' takes d <= 16, got d=17"),
    ],
)
def test_covariance_backward_kernel_wrapper_checks(kernel, dtype, d, match):
    x1, x2, l, s = rand_inputs((), 6, 5, d, "cpu", dtype)
    with pytest.raises(ValueError, match=match):
        ops._rbf_covariance_backward_kernel(torch.randn(6, 5, dtype=dtype), x1, x2, l, s, kernel)


@pytest.mark.parametrize("kernel", ["cuda_cores", "tc", "tc_isplit"])
def test_matmul_kernel_op_refuses_cpu_tensors(kernel):
    """The private op that forces one CUDA K @ V kernel has no CPU kernel: on CPU tensors it says so."""
    x1, x2, l, s = rand_inputs((), 6, 5, 3, "cpu")
    with pytest.raises(RuntimeError, match=f"the kernel '{kernel}' runs on CUDA tensors only, got x1 on cpu"):
        ops._rbf_matmul_kernel(x1, x2, l, s, torch.randn(5, 2), kernel)


@pytest.mark.parametrize(
    "kernel, d, t, match",
    [
        ("tc", 33, 2, "takes d <= 32 and t <= 32, got d=33 and t=2"),
        ("tc", 3, 33, "takes d <= 32 and t <= 32, got d=3 and t=33"),
        ("tc_vsplit", 9, 2, "takes d <= 8 and t <= 16, got d=9 and t=2"),
        ("tc_isplit", 3, 17, "takes d <= 8 and t <= 16, got d=3 and t=17"),
        ("cuda_cores", 33, 2, "takes d <= 32, got d=33 and t=2"),
        ("mma", 3, 2, "kernel must be one of"),
    ],
)
def test_matmul_kernel_wrapper_checks_the_kernel_limits(kernel, d, t, match):
    """The wrapper names each kernel's limits before the op is called."""
    x1, x2, l, s = rand_inputs((), 6, 5, d, "cpu")
    with pytest.raises(ValueError, match=match):
        ops._rbf_matmul_kernel(x1, x2, l, s, torch.randn(5, t), kernel)


@pytest.mark.parametrize("d, t", [(3, 33), (33, 2)])
def test_backward_kernel_wrapper_checks_the_kernel_limits(d, t):
    """The wrapper refuses d > 32 or t > 32 before the op, with a ValueError (the op's own check raises a
    RuntimeError: test_cuda_op_errors)."""
    x1, x2, l, s = rand_inputs((), 6, 5, d, "cpu")
    v, g = torch.randn(5, t), torch.randn(6, t)
    with pytest.raises(ValueError, match=f"take d <= 32 and t <= 32, got d={d} and t={t}"):
        ops._rbf_matmul_backward_kernel(g, x1, x2, l, s, v, "rows")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_opcheck_cuda():
    x1, x2, l, s = rand_inputs((2,), 70, 40, 5, "cuda", torch.float64)
    args = [t.requires_grad_() for t in (x1, x2, l.reshape(2, 5), s)]
    torch.library.opcheck(torch.ops.gpfast.rbf_covariance.default, args)
    v = torch.randn(2, 40, 3, dtype=torch.float64, device="cuda", requires_grad=True)
    torch.library.opcheck(torch.ops.gpfast.rbf_matmul.default, [*[a.detach().requires_grad_() for a in args], v])


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device):
    x1, x2, l, s = rand_inputs((), 33, 21, 4, device)
    ops.rbf_covariance(x1, x2, l, s)  # build and load outside the traced region

    def f(a, b, ls, os_, v):
        K = ops.rbf_covariance(a, b, ls, os_, check_values=False)
        return (K * K).sum() + ops.rbf_matmul(a, b, ls, os_, v, check_values=False).sum()

    v = torch.randn(21, 3, device=device)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    inputs = [t.clone().requires_grad_() for t in (x1, x2, l, s, v)]
    out = compiled(*inputs)
    out.backward()
    eager_inputs = [t.clone().requires_grad_() for t in (x1, x2, l, s, v)]
    expect = f(*eager_inputs)
    expect.backward()
    assert torch.allclose(out, expect, rtol=1e-5)
    for a, b in zip(inputs, eager_inputs):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------- errors


def test_errors_name_the_argument():
    x = torch.randn(5, 3)
    with pytest.raises(ValueError, match=r"x1 has d=3 .* x2 has d=4"):
        ops.rbf_covariance(x, torch.randn(4, 4), 1.0, 1.0)
    with pytest.raises(TypeError, match=r"x2 has dtype torch.float64 but x1 has torch.float32"):
        ops.rbf_covariance(x, x.double(), 1.0, 1.0)
    with pytest.raises(TypeError, match=r"x1 must be float32 or float64, got dtype torch.int64"):
        ops.rbf_covariance(torch.ones(5, 3, dtype=torch.long), x, 1.0, 1.0)
    with pytest.raises(TypeError, match=r"lengthscale has dtype torch.float64"):
        ops.rbf_covariance(x, x, torch.ones(3, dtype=torch.float64), 1.0)
    with pytest.raises(TypeError, match=r"lengthscale must be a floating-point tensor"):
        ops.rbf_covariance(x, x, torch.ones(3, dtype=torch.long), 1.0)
    with pytest.raises(ValueError, match=r"last dim must be 1 \(shared\) or 3 \(ARD\), got shape \(2,\)"):
        ops.rbf_covariance(x, x, torch.ones(2), 1.0)
    with pytest.raises(ValueError, match=r"second-to-last dim must be 1"):
        ops.rbf_covariance(x, x, torch.ones(5, 3), 1.0)
    with pytest.raises(ValueError, match=r"lengthscale must be positive, got min -0.5"):
        ops.rbf_covariance(x, x, torch.tensor([1.0, -0.5, 2.0]), 1.0)
    with pytest.raises(ValueError, match=r"lengthscale must be positive, got min 0"):
        ops.rbf_covariance(x, x, 0.0, 1.0)
    with pytest.raises(ValueError, match=r"x1 must have shape \(..., n, d\)"):
        ops.rbf_covariance(torch.randn(5), x, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"batch shapes do not broadcast"):
        ops.rbf_covariance(torch.randn(2, 5, 3), torch.randn(3, 5, 3), 1.0, 1.0)
    with pytest.raises(TypeError, match=r"x1 must be a torch.Tensor"):
        ops.rbf_covariance([[1.0]], x, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"v must have m=5 rows"):
        ops.rbf_matmul(x, x, 1.0, 1.0, torch.randn(4, 2))
    with pytest.raises(TypeError, match=r"v has dtype torch.float64"):
        ops.rbf_matmul(x, x, 1.0, 1.0, torch.randn(5, 2, dtype=torch.float64))
    # the registered op itself checks too (for callers that skip the Python wrapper)
    with pytest.raises(RuntimeError, match=r"x1 has d=3 features but x2 has d=4"):
        torch.ops.gpfast.rbf_covariance(x[None], torch.randn(1, 4, 4), torch.ones(1, 3), torch.ones(1))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_mixed_devices_error():
    with pytest.raises(ValueError, match=r"x2 is on cpu but x1 is on cuda"):
        ops.rbf_covariance(torch.randn(3, 2, device="cuda"), torch.randn(3, 2), 1.0, 1.0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_64bit_indexing_cuda():
    n = 46400  # n * n > 2^31
    x = torch.randn(n, 2, device="cuda")
    l = torch.tensor([0.8, 1.3], device="cuda")
    poison_allocator("cuda", 4 * n * n)
    K = ops.rbf_covariance(x, x, l, 1.5)
    rows = torch.tensor([0, 1, n // 2, n - 2, n - 1], device="cuda")
    want = reference64(x[rows], x, l, torch.tensor(1.5))
    assert rel_err(K[rows], want) < 1e-5
    assert torch.isfinite(K[-3:]).all() and torch.isfinite(K[:, -3:]).all()
    assert (K.diagonal() == 1.5).all()
    del K


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "shape", [((), 300, 1100, 8), ((2,), 70, 1030, 16), ((), 50, 2001, 29), ((), 33, 1500, 3), ((), 65, 130, 5)]
)
def test_tile_forward_kernel(dtype, shape):
    """The tiled forward kernel, run through the private op on shapes that would otherwise stream rows, and on one
    it serves by default (130 columns)."""
    batch, n, m, d = shape
    x1, x2, l, s = rand_inputs(batch, n, m, d, "cuda", dtype)
    x1c, x2c, lc, sc, _ = ops._canonicalize(x1, x2, l, s, True)
    poison_allocator("cuda", x1.element_size() * n * m * 2)
    K = torch.ops.gpfast._rbf_covariance_kernel(x1c, x2c, lc, sc, "tile").reshape(*batch, n, m)
    K64 = reference64(x1, x2, l, s)
    if dtype == torch.float64:
        assert rel_err(K, K64) < 1e-13
    else:
        assert rel_err(K, K64) <= float32_bound("cuda", rel_err(ref.rbf_covariance(x1, x2, l, s), K64))


def test_broadcast_shapes_matches_torch():
    """The wrapper's fast broadcast agrees with torch.broadcast_shapes, failures included."""
    import random

    rng = random.Random(torch.seed())
    for _ in range(500):
        shapes = [
            tuple(rng.choice([0, 1, 1, 2, 3]) for _ in range(rng.randint(0, 3))) for _ in range(rng.randint(1, 4))
        ]
        try:
            want = torch.broadcast_shapes(*shapes)
        except RuntimeError:
            with pytest.raises(RuntimeError):
                ops.broadcast_shapes(*shapes)
            continue
        assert ops.broadcast_shapes(*shapes) == want, shapes
