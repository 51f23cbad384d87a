"""stored_backward: the lengthscale and outputscale gradients of sum(G * (K V)) from a K already in memory.

On the CPU (and for the shapes the CUDA kernel does not take) it is float64 ATen arithmetic, checked here against
autograd through the float64 covariance. On CUDA the tensor-core kernel is checked against that float64 reference on
the same float32 K, with a bound from its arithmetic: the weights W = G V^T are 3xTF32 products summed in float32
(at most t = 40 terms: about 40 * 2^-24 + 3 * 2^-22 = 3.1e-6 of sum_t |G_it V_jt|), and everything after them is in
float64, so each gradient is within 1e-5 of the same sum with |W| in place of W.
"""

import pytest
import torch
from conftest import rel_err

from gpfast import ops
from gpfast.train.product import CovarianceProduct

F64 = torch.float64
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")


def autograd_grads(x1, x2, l, s, G, V):
    l, s = l.detach().clone().requires_grad_(), s.detach().clone().requires_grad_()
    K = ops.rbf_covariance(x1, x2, l, s)
    (G * (K @ V)).sum().backward()
    return l.grad, s.grad


def abs_scale(K, x1, x2, l, s, G, V):
    """The gradients' sums with every weight |W_ij| replaced by (|G| |V|^T)_ij, in float64: the scale of the
    rounding of W."""
    K, x1, x2, l, s = (a.double().cpu() for a in (K, x1, x2, l, s))
    A = (G.double().abs().cpu() @ V.double().abs().cpu().t()) * K
    mu = x1.mean(0)
    z1, z2 = (x1 - mu) / l, (x2 - mu) / l
    # sum_ij A_ij (z_ik - z_jk)^2, expanded (float64, centred: its cancellation is far below the bounds' 1e-5)
    L = A.sum(1) @ z1**2 + A.sum(0) @ z2**2 - 2 * (z1 * (A @ z2)).sum(0)
    return L / l, A.sum() / s


@pytest.mark.parametrize("shape", [(50, 70, 3, 4), (40, 40, 5, 17), (1, 9, 2, 1), (33, 64, 12, 3)])
def test_reference_matches_autograd(shape):
    n, m, d, t = shape
    x1, x2 = torch.randn(n, d, dtype=F64), torch.randn(m, d, dtype=F64) + 0.3
    l, s = torch.rand(d, dtype=F64) + 0.5, torch.tensor(1.7, dtype=F64)
    G, V = torch.randn(n, t, dtype=F64), torch.randn(m, t, dtype=F64)
    K = ops.rbf_covariance(x1, x2, l, s)
    want_l, want_s = autograd_grads(x1, x2, l, s, G, V)
    gl, gs = ops.stored_backward(K, x1, x2, l, s, G, V)
    scale_l, scale_s = abs_scale(K, x1, x2, l, s, G, V)
    assert gl.shape == (d,) and gs.shape == ()
    assert ((gl - want_l).abs() <= 1e-12 * scale_l).all() and abs(gs - want_s) <= 1e-12 * scale_s
    # a shared lengthscale (one element): the sum over the features, in its shape; a float outputscale: 0-dim
    l1 = torch.tensor([0.8], dtype=F64)
    K1 = ops.rbf_covariance(x1, x2, l1, 1.3)
    gl1, gs1 = ops.stored_backward(K1, x1, x2, l1, 1.3, G, V)
    want_l1, want_s1 = autograd_grads(x1, x2, l1, torch.tensor(1.3, dtype=F64), G, V)
    assert gl1.shape == (1,) and gs1.shape == ()
    assert rel_err(gl1, want_l1) < 1e-10 and rel_err(gs1, want_s1) < 1e-10


def test_reference_reads_strided_rows_and_vectors():
    # K as the engine keeps it: the (n, n) view of a block with padded rows; G and V as vectors
    n, d = 37, 4
    x = torch.randn(n, d, dtype=F64)
    l, s = torch.rand(d, dtype=F64) + 0.5, torch.tensor(0.9, dtype=F64)
    block = ops.rbf_covariance(x, torch.cat([x, x[-1:].expand(3, -1)]), l, s)
    K = block[:, :n]
    assert K.stride(0) == n + 3
    g, v = torch.randn(n, dtype=F64), torch.randn(n, dtype=F64)
    got = ops.stored_backward(K, x, x, l, s, g, v)
    want = ops.stored_backward(K.contiguous(), x, x, l, s, g[:, None], v[:, None])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_float32_inputs_give_float32_gradients():
    n, d, t = 60, 6, 5
    x = torch.randn(n, d)
    l, s = torch.rand(d) + 0.5, torch.tensor(1.1)
    G, V = torch.randn(n, t), torch.randn(n, t)
    K = ops.rbf_covariance(x, x, l, s)
    gl, gs = ops.stored_backward(K, x, x, l, s, G, V)
    assert gl.dtype == gs.dtype == torch.float32
    want_l, want_s = ops.stored_backward(*(a.double() for a in (K, x, x, l, s, G, V)))
    scale_l, scale_s = abs_scale(K, x, x, l, s, G, V)
    # the float64 sums are rounded to float32 once
    assert ((gl.double() - want_l).abs() <= 2**-23 * want_l.abs() + 1e-12 * scale_l).all()
    assert abs(gs.double() - want_s) <= 2**-23 * abs(want_s) + 1e-12 * scale_s


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(K=torch.zeros(5, 6, 1)), "K must have shape (n, m), got shape (5, 6, 1)"),
        (dict(x1=torch.zeros(4, 3)), "x1 must have shape (n, d) with n=5 (K's rows), got shape (4, 3)"),
        (dict(x2=torch.zeros(6, 2)), "x2 must have shape (m, d) = (6, 3), got shape (6, 2)"),
        (dict(G=torch.zeros(4, 2)), "G must have shape (n, t) or (n,) with n=5, got shape (4, 2)"),
        (dict(V=torch.zeros(6, 3)), "V must have shape (6, 2) (x2's rows, G's columns), got shape (6, 3)"),
        (dict(lengthscale=torch.ones(2)), "lengthscale must have 1 or d=3 elements, got shape (2,)"),
        (dict(lengthscale=-torch.ones(3)), "lengthscale"),
        (dict(outputscale=torch.ones(2)), "outputscale must have one element, got shape (2,)"),
        (dict(V=torch.zeros(6, 2, dtype=F64)), "V is torch.float64 on cpu but K is torch.float32 on cpu"),
        (dict(K=torch.zeros(5, 6, dtype=torch.int32)), "K must be float32 or float64, got dtype torch.int32"),
    ],
)
def test_argument_errors_name_the_argument_and_the_values(change, message):
    args = dict(K=torch.zeros(5, 6), x1=torch.zeros(5, 3), x2=torch.zeros(6, 3), lengthscale=torch.ones(3),
                outputscale=torch.tensor(1.0), G=torch.zeros(5, 2), V=torch.zeros(6, 2))  # fmt: skip
    args.update(change)
    if args["K"].dtype == torch.int32:
        args.update({k: args[k].int() for k in ("x1", "x2", "G", "V")})
    with pytest.raises((ValueError, TypeError)) as info:
        ops.stored_backward(**args)
    assert message in str(info.value)


def test_named_kernels_are_checked():
    K, x = torch.zeros(5, 5), torch.zeros(5, 3)
    with pytest.raises(ValueError, match="kernel must be one of"):
        ops._stored_backward_kernel(K, x, x, torch.ones(3), 1.0, x, x, "bilinear4")
    with pytest.raises(ValueError, match="takes a float32 CUDA K"):
        ops._stored_backward_kernel(K, x, x, torch.ones(3), 1.0, x, x, "tc4")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, cuda])])
def test_product_backward_from_stored_k_matches_the_points(device):
    # the engine's two sources of the gradient: the same objective up to the rounding of K (float64 here)
    n, d, t = 300, 4, 9
    kw = dict(dtype=F64, device=device)
    X = torch.randn(n, d, **kw)
    ls, s, noise = torch.rand(d, **kw) + 0.5, torch.tensor(1.2, **kw), torch.tensor(0.1, **kw)
    G, V = torch.randn(n, t, **kw), torch.randn(n, t, **kw)
    out = {}
    for source in ("stored", "points"):
        p = CovarianceProduct(X, "stored")
        p.backward_from = source
        p.update(ls, s, noise)
        out[source] = p.backward(G, V)
    for a, b in zip(out["stored"], out["points"]):
        assert rel_err(a, b) < 1e-10


# ------------------------------------------------------------------------------------------------------------ CUDA

STORED_SHAPES = [  # (n, m, d, t, same points, padded rows): ragged around the 64-row blocks and 32-column tiles
    (200, 200, 3, 17, True, True),
    (129, 129, 8, 1, True, False),
    (300, 300, 20, 17, True, True),
    (77, 77, 27, 20, True, False),
    (257, 257, 32, 11, True, True),
    (100, 301, 9, 17, False, False),
    (65, 97, 16, 40, False, True),
    (33, 1, 1, 3, False, False),
    (1, 45, 24, 8, False, False),
]


def stored_case(n, m, d, t, same, padded, shift=0.0):
    dev = "cuda"
    x1 = torch.randn(n, d, device=dev) + shift
    x2 = x1 if same else torch.randn(m, d, device=dev) + shift
    l = (torch.rand(d, device=dev) + 0.5) * max(1.0, (d / 8) ** 0.5)
    s = torch.tensor(1.3, device=dev)
    G, V = torch.randn(n, t, device=dev), torch.randn(m, t, device=dev)
    if padded:  # rows 3 columns longer than m: for even m an odd pitch, which takes one column a load
        K = ops.rbf_covariance(x1, torch.cat([x2, x2[-1:].expand(3, -1)]), l, s)[:, :m]
    else:
        K = ops.rbf_covariance(x1, x2, l, s)
    return K, x1, x2, l, s, G, V


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("kernel", ["tc4", "tc8", "tc4_nosym", "tc8_nosym"])
@pytest.mark.parametrize("shape", STORED_SHAPES)
@pytest.mark.parametrize("shift", [0.0, 10.0])
def test_stored_kernels_match_float64_on_the_same_k(kernel, shape, shift):
    n, m, d, t, same, padded = shape
    if same and 2 * t > 40 and "nosym" not in kernel:
        pytest.skip("each pair once takes t <= 20")
    case = stored_case(n, m, d, t, same, padded, shift)
    K, x1, x2, l, s, G, V = case
    got_l, got_s = ops._stored_backward_kernel(*case, kernel)
    want_l, want_s = ops.stored_backward(*(a.double().cpu() for a in case))
    scale_l, scale_s = abs_scale(*case)
    err_l = (got_l.double().cpu() - want_l).abs()
    assert torch.isfinite(got_l).all() and torch.isfinite(got_s)
    assert (err_l <= 1e-5 * scale_l + 2**-23 * want_l.abs()).all(), (err_l / scale_l).max()
    assert abs(got_s.double().cpu() - want_s) <= 1e-5 * scale_s + 2**-23 * abs(want_s)


@pytest.mark.cuda
@cuda
def test_stored_auto_takes_the_kernel_or_the_reference():
    # auto: the kernel where it applies, the float64 reference elsewhere (float64 K, d > 32, t > 40, a K whose
    # columns are strided); either way within the bound of the kernel test
    cases = [
        stored_case(150, 150, 6, 17, True, True),
        stored_case(150, 150, 40, 5, True, False),
        stored_case(90, 120, 4, 45, False, False),
        tuple(a.double() for a in stored_case(80, 80, 5, 7, True, False)),
    ]
    K, x1, x2, l, s, G, V = stored_case(70, 50, 3, 4, False, False)
    cases.append((ops.rbf_covariance(x2, x1, l, s).t(), x1, x2, l, s, G, V))  # column stride 70
    for case in cases:
        got_l, got_s = ops.stored_backward(*case)
        want_l, want_s = ops.stored_backward(*(a.double().cpu() for a in case))
        scale_l, scale_s = abs_scale(*case)
        assert ((got_l.double().cpu() - want_l).abs() <= 1e-5 * scale_l + 2**-23 * want_l.abs()).all()
        assert abs(got_s.double().cpu() - want_s) <= 1e-5 * scale_s + 2**-23 * abs(want_s)


@pytest.mark.cuda
@cuda
def test_stored_kernel_repeats_bit_for_bit_and_matches_the_points_backward():
    # the engine's case: K(x, x) with padded rows, t = 17; the same bits on every call, and the gradient of the
    # points' backward (which recomputes K in double) within the float32 rounding of the stored K
    K, x, _, l, s, G, V = stored_case(3000, 3000, 20, 17, True, True)
    first = ops.stored_backward(K, x, x, l, s, G, V)
    again = ops.stored_backward(K, x, x, l, s, G, V)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    points = ops.rbf_matmul_backward(G, x, x, l, s, V, x_grads=False)[2:]
    scale_l, scale_s = abs_scale(K, x, x, l, s, G, V)
    assert ((first[0] - points[0]).abs().cpu().double() <= 1e-5 * scale_l).all()
    assert abs(float(first[1] - points[1])) <= 1e-5 * float(scale_s)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("d", [3, 12, 17, 20, 26, 27, 32])
@pytest.mark.parametrize("n, pad", [(1100, 0), (2100, 3), (3000, 4), (1000, 1)])
def test_symmetric_forward_fills_the_padded_rows(d, n, pad, dtype):
    # the engine's stored K(x, x) in an (n, n + pad) buffer: each pair once and mirrored for float32 at 17 <= d <= 32,
    # rows written directly otherwise (d <= 16, float64), the tiled kernel's K copied below 1024 points; every element
    # of the first n columns written (poisoned memory), within the forward's rule against float64
    from conftest import poison_allocator
    from test_cuda_kernels import forward_bound, reference64

    from gpfast import _reference as ref

    x = torch.randn(n, d, device="cuda", dtype=dtype) * 0.8
    x[n // 2 :: 7] = x[: len(range(n // 2, n, 7))]  # duplicates, as in the kegg sets
    l = (torch.rand(d, device="cuda", dtype=dtype) + 0.5) * max(1.0, (d / 8) ** 0.5)
    s = torch.tensor(1.3, device="cuda", dtype=dtype)
    poison_allocator("cuda", 2 * x.element_size() * n * (n + pad))
    buf = ops._rbf_covariance_symmetric(x, l, s, n + pad)
    assert buf.shape == (n, n + pad)
    K = buf[:, :n]
    assert torch.isfinite(K).all(), "an element of K was never written (poisoned memory showed through)"
    want = reference64(x, x, l, s)
    plain = rel_err(ref.rbf_covariance(x, x, l, s), want)
    assert rel_err(K, want) <= forward_bound("expand", dtype, d, plain)
    assert torch.equal(K.diagonal(), s.expand(n))  # K(x, x) = s exactly on the diagonal


@pytest.mark.cuda
@cuda
def test_product_with_the_symmetric_forward_matches_the_default():
    n, d = 2500, 20
    X = torch.randn(n, d, device="cuda")
    ls, s = torch.rand(d, device="cuda") + 1.0, torch.tensor(1.2, device="cuda")
    noise = torch.tensor(0.1, device="cuda")
    V = torch.randn(n, 9, device="cuda")
    out = []
    for symmetric in (False, True):
        p = CovarianceProduct(X, "stored")
        p.symmetric_forward = symmetric
        p.update(ls, s, noise)
        out.append((p.K.clone(), p.matmul(V)))
    assert rel_err(out[1][0], out[0][0]) < 2e-6 and rel_err(out[1][1], out[0][1]) < 2e-6
