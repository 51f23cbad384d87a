"""dense_matmul (K @ V for a stored K and a few right-hand sides, the training engine's stored-K product): the Python
wrapper and its errors on the CPU, and the CUDA bandwidth kernel (csrc/cuda/dense_matmul.cuh) against float64 on fresh
random inputs: ragged rows and columns around its chunks (512..4096 columns) and row groups (32..64 rows), every t in
1..16, row strides that are not 16-byte aligned (the scalar-load variant), views and layouts it hands to cuBLAS,
poisoned outputs, bitwise repeatability.

Error rule for float32: at most 2x the error of cuBLAS's float32 product (TF32 off, torch's default) + 1e-7. Both
sum n products of float32 numbers; the kernel's order (per-lane runs of at most 4096 / 128 terms, a 32-lane tree,
then the chunks in double) is no worse than a GEMM's. float64: 1e-12.
"""

import pytest
import torch
from conftest import DEVICES, HAS_CUDA, poison_allocator, rel_err

from gpfast import ops
from gpfast.train import product


def check(out, K, V):
    want = K.double() @ V.double()
    assert out.shape == want.shape and out.dtype == K.dtype and out.device == K.device
    assert torch.isfinite(out).all(), "an output element was never written (poisoned memory showed through)"
    if K.dtype == torch.float64:
        assert rel_err(out, want) < 1e-12
    else:
        plain = K @ V
        assert rel_err(out, want) <= 2 * rel_err(plain, want) + 1e-7


# ---------------------------------------------------------------------------------------------- CPU: the wrapper


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dense_matmul_small_and_vector(device, dtype):
    K = torch.randn(7, 9, device=device, dtype=dtype)
    V = torch.randn(9, 3, device=device, dtype=dtype)
    check(ops.dense_matmul(K, V), K, V)
    v = torch.randn(9, device=device, dtype=dtype)
    out = ops.dense_matmul(K, v)
    assert out.shape == (7,)
    check(out[:, None], K, v[:, None])


def test_dense_matmul_errors():
    K, V = torch.randn(4, 5), torch.randn(5, 2)
    with pytest.raises(TypeError, match="K must be a torch.Tensor"):
        ops.dense_matmul(K.numpy(), V)
    with pytest.raises(TypeError, match="float32 or float64"):
        ops.dense_matmul(K.int(), V)
    with pytest.raises(TypeError, match="one dtype"):
        ops.dense_matmul(K, V.double())
    with pytest.raises(ValueError, match=r"K must have shape \(rows, n\)"):
        ops.dense_matmul(K[None], V)
    with pytest.raises(ValueError, match=r"V must have shape \(n, t\)"):
        ops.dense_matmul(K, V[None])
    with pytest.raises(ValueError, match="n=5 rows"):
        ops.dense_matmul(K, V[:4])
    with pytest.raises(RuntimeError, match="V must share K's dtype"):  # the op's own checks
        torch.ops.gpfast.dense_matmul(K, V.double())
    with pytest.raises(RuntimeError, match="V has 4 rows"):
        torch.ops.gpfast.dense_matmul(K, V[:4])


def test_dense_matmul_opcheck_and_gradients():
    K = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    V = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(torch.ops.gpfast.dense_matmul.default, (K, V))
    assert torch.autograd.gradcheck(ops.dense_matmul, (K, V))


def test_default_layout():
    K, V = torch.randn(8, 8), torch.randn(8, 11)
    assert product.default_layout(K, V) == product.STORED_LAYOUT  # the CPU: no kernel
    S = K + K.t()  # the default cuBLAS layout, vtk, is for the engine's symmetric K
    assert rel_err(product.stored_matmul(S, V), S.double() @ V.double()) < 1e-6
    assert rel_err(product.stored_matmul(K, V, "mm"), K.double() @ V.double()) < 1e-6


# ---------------------------------------------------------------------------------------------- CUDA: the kernel

SHAPES = [  # (rows, n): ragged around row groups (32-64 rows) and chunks (multiples of 128 / 64 columns, <= 4096)
    (1, 1),
    (1, 3),
    (5, 129),
    (33, 1001),
    (64, 4096),
    (65, 4097),
    (100, 5000),  # few row groups: many narrow chunks, partial sums added by dmm_sum_kernel
    (257, 9001),
    (1031, 777),
]


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("t", range(1, 17))
def test_cuda_dense_matmul_matches_float64(dtype, shape, t):
    rows, n = shape
    K = torch.randn(rows, n, device="cuda", dtype=dtype)
    V = torch.randn(n, t, device="cuda", dtype=dtype)
    poison_allocator("cuda", 8 * rows * t * 64)
    check(ops.dense_matmul(K, V), K, V)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_dense_matmul_covariance_repeatable(dtype):
    """A real (symmetric) covariance at a size with several chunks per row group; bitwise equal on a second call."""
    x = torch.randn(6000, 8, device="cuda", dtype=dtype)
    K = ops.rbf_covariance(x, x, torch.full((8,), 1.5, device="cuda", dtype=dtype), 1.3)
    V = torch.randn(6000, 11, device="cuda", dtype=dtype)
    poison_allocator("cuda", 8 * 6000 * 11 * 64)
    out = ops.dense_matmul(K, V)
    check(out, K, V)
    assert torch.equal(out, ops.dense_matmul(K, V))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("t", [1, 11, 16])
def test_cuda_dense_matmul_strides_and_views(dtype, t):
    """Views the kernel takes (row strides other than n, aligned or not, a start off 16 bytes, stride-0 rows) and
    ones it hands to cuBLAS (column stride other than 1); a non-contiguous V."""
    rows, n = 203, 1501
    big = torch.randn(rows + 1, n + 7, device="cuda", dtype=dtype)
    V = torch.randn(n, 2 * t, device="cuda", dtype=dtype)[:, ::2]  # non-contiguous
    views = {
        "ld aligned, n ragged": big[:rows, :n],  # ld = 1508: a multiple of 16 bytes, 16-byte loads
        "start off 16 bytes": big[1:, 1 : n + 1],  # scalar loads
        "ld not a multiple of 16 bytes": torch.randn(rows, 1503, device="cuda", dtype=dtype)[:, :n],
        "stride-0 rows": big[0, :n].expand(rows, n),
        "transposed (cuBLAS)": torch.randn(n, rows, device="cuda", dtype=dtype).t(),
    }
    for name, K in views.items():
        poison_allocator("cuda", 8 * rows * t * 64)
        out = ops.dense_matmul(K, V)
        try:
            check(out, K, V)
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from exc


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no GPU")
def test_cuda_dense_matmul_fallbacks_and_empty():
    K = torch.randn(300, 700, device="cuda")
    V = torch.randn(700, 20, device="cuda")
    check(ops.dense_matmul(K, V), K, V)  # t > 16: cuBLAS
    check(ops.dense_matmul(K.t().contiguous().t(), V[:, :11]), K, V[:, :11])  # column stride 300: cuBLAS
    assert ops.dense_matmul(K[:0], V).shape == (0, 20)
    assert ops.dense_matmul(K, V[:, :0]).shape == (300, 0)
    assert torch.equal(ops.dense_matmul(K[:, :0], V[:0, :5]), torch.zeros(300, 5, device="cuda"))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no GPU")
def test_cuda_stored_product_uses_the_kernel_and_aligned_rows():
    """The engine's stored K: on CUDA its rows are padded to 16 bytes (n = 1001 here), and the default layout is
    the kernel; it and the cuBLAS layout give K @ V."""
    x = torch.randn(1001, 5, device="cuda")
    p = product.CovarianceProduct(x, "stored")
    l, s, noise = (
        torch.full((5,), 1.2, device="cuda"),
        torch.tensor(1.1, device="cuda"),
        torch.tensor(0.1, device="cuda"),
    )
    p.update(l, s, noise)
    assert p.K.shape == (1001, 1001) and p.K.stride(0) % 4 == 0
    V = torch.randn(1001, 11, device="cuda")
    assert product.default_layout(p.K, V) == "kernel"
    want = ops.rbf_covariance(x.double(), x.double(), l.double(), s.double()) @ V.double() + 0.1 * V.double()
    assert rel_err(p.matmul(V), want) < 1e-5
    assert rel_err(product.stored_matmul(p.K, V, "vtk") + 0.1 * V, want) < 1e-5


# ------------------------------------------------------------------------- the float16 K (the preconditioner's factor)


def half_check(out, K, V):
    """K float16 @ V float32 against float64 (K's values are exact there): the float32 rule of a float32 K holding
    the same values."""
    assert out.dtype == torch.float32 and out.shape == (K.shape[0], V.shape[1]) and out.device == K.device
    assert torch.isfinite(out).all(), "an output element was never written (poisoned memory showed through)"
    want = K.double() @ V.double()
    plain = K.float() @ V
    assert rel_err(out, want) <= 2 * rel_err(plain, want) + 1e-7


@pytest.mark.parametrize("device", DEVICES)
def test_dense_matmul_half_small_and_errors(device):
    K = torch.randn(7, 9, device=device).half()
    V = torch.randn(9, 3, device=device)
    half_check(torch.ops.gpfast._dense_matmul_half(K, V), K, V)
    with pytest.raises(RuntimeError, match="_dense_matmul_half: K must be float16, got Float"):
        torch.ops.gpfast._dense_matmul_half(K.float(), V)
    with pytest.raises(RuntimeError, match="_dense_matmul_half: V must be float32, got Half"):
        torch.ops.gpfast._dense_matmul_half(K, V.half())
    with pytest.raises(RuntimeError, match="V has 8 rows"):
        torch.ops.gpfast._dense_matmul_half(K, V[:8])
    torch.library.opcheck(torch.ops.gpfast._dense_matmul_half.default, (K, V))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no GPU")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("t", [1, 2, 3, 5, 8, 11, 12, 16, 17])
def test_cuda_dense_matmul_half_matches_float64(shape, t):
    """Every right-hand-side bucket (17: two passes of the kernel), rows and columns ragged around the kernel's
    groups and its chunks of 256-column steps, poisoned outputs, bitwise repeatable."""
    rows, n = shape
    K = (torch.rand(rows, n, device="cuda") * 2 - 1).half()  # entries within 1, as the scaled factor's
    V = torch.randn(n, t, device="cuda")
    poison_allocator("cuda", 8 * rows * t * 64)
    out = torch.ops.gpfast._dense_matmul_half(K, V)
    half_check(out, K, V)
    assert torch.equal(out, torch.ops.gpfast._dense_matmul_half(K, V))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no GPU")
@pytest.mark.parametrize("t", [1, 11, 16])
def test_cuda_dense_matmul_half_strides(t):
    """Row strides of a multiple of 8 values (16-byte loads) and not (scalar loads), a start off 16 bytes alone,
    stride-0 rows, a non-contiguous V, and a column stride other than 1 (widened, then cuBLAS)."""
    rows, n = 203, 1501
    big = torch.randn(rows + 1, n + 7, device="cuda").half()  # ld 1508: not a multiple of 8
    pad = torch.randn(rows, 1504, device="cuda").half()  # ld 1504: a multiple of 8
    V = torch.randn(n, 2 * t, device="cuda")[:, ::2]  # non-contiguous
    views = {
        "ld a multiple of 8": pad[:, :n],
        "ld not a multiple of 8": big[:rows, :n],
        "start off 16 bytes, ld a multiple of 8": pad[:, 1 : n + 1],
        "stride-0 rows": pad[0, :n].expand(rows, n),
        "transposed (cuBLAS)": torch.randn(n, rows, device="cuda").half().t(),
    }
    for name, K in views.items():
        poison_allocator("cuda", 8 * rows * t * 64)
        try:
            half_check(torch.ops.gpfast._dense_matmul_half(K, V), K, V)
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from exc
