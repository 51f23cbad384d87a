"""The CUDA kernels one by one (csrc/cuda): every forward kernel, the K @ V buckets and the backward row passes,
against the float64 reference on fresh random inputs, with poisoned outputs, ragged sizes, data far from the origin,
duplicated points and extreme lengthscales.

Error rules (``rel_err`` is the norm-wise relative error against float64):
- differences (float64 everywhere, float32 forwards with d <= 8): at most 2x the plain float32 formula's error,
  as in test_ops;
- the norm expansion (float32 forwards with d > 8: row streaming and the tensor-core kernel, forced here through
  the private op _rbf_covariance_kernel, and K @ V in float32): at most max(2x plain float32, 1e-6). Its rounding
  grows with |y|^2 rather than with the squared distance; an emulation on the test distribution found 2-6e-7
  against 1-3e-7 for plain float32 (csrc/cuda/covariance_forward.cuh);
- gradients: at most 4x the plain formula's error + 1e-6, as in test_ops. The backward sums in float64, so the
  outputscale and lengthscale gradients (single sums of n m terms of either sign) must pass on every draw; so must
  the tensor-core (lengthscale, outputscale) backward that float32 takes without point gradients (weights 3xTF32,
  the exponent, M Z and the sums in double; the private op _rbf_matmul_backward_kernel picks it). K @ V's
  outputscale gradient sums weights W = G V^T formed in float32 (or 3xTF32), whose rounding no kernel avoids: where
  that sum cancels, its bound adds a term for the rounding's size over the sum (outputscale_error_scale).
"""

import math

import pytest
import torch
from conftest import assert_raises_in_a_subprocess, poison_allocator, rel_err
from test_ops import grads_of, rand_inputs

from gpfast import _reference as ref
from gpfast import ops

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")]

DTYPES = [torch.float32, torch.float64]


def reference64(x1, x2, l, s):
    return ref.rbf_covariance(x1.double(), x2.double(), l.double(), s.double())


def forced_covariance(x1, x2, l, s, kernel):
    """rbf_covariance with the named forward kernel (FWD_KERNELS) whatever the shape."""
    return ops._rbf_covariance_kernel(x1, x2, l, s, kernel)


def covariance(x1, x2, l, s, variant):
    poison_allocator("cuda", x1.element_size() * x1.shape[-2] * x2.shape[-2] * max(1, math.prod(x1.shape[:-2])) * 2)
    K = ops.rbf_covariance(x1, x2, l, s) if variant == "auto" else forced_covariance(x1, x2, l, s, variant)
    assert torch.isfinite(K).all(), "an output element was never written (poisoned memory showed through)"
    return K


def forward_bound(variant, dtype, d, plain_err):
    if dtype == torch.float64:
        return 1e-13
    if variant in ("expand", *TC_KERNELS) or (variant == "auto" and d > 8):
        return max(2 * plain_err, 1e-6)
    return 2 * plain_err + 1e-7


# ------------------------------------------------------------------------------------------------- covariance forward

TC_KERNELS = ops.COVARIANCE_TC_KERNELS  # the tensor-core forward and its sweep variants: float32, 8 < d <= 32
FWD_KERNELS = ops.COVARIANCE_KERNELS


def skip_unless_applies(variant, dtype, d):
    if variant in TC_KERNELS and (dtype != torch.float32 or not 8 < d <= 32):
        pytest.skip("the tensor-core forward takes float32 with 8 < d <= 32")


FWD_SHAPES = [  # (batch, n, m, d): ragged rows and columns around the kernels' blocks (32 rows, 1024 columns)
    ((), 33, 1023, 3),
    ((), 65, 1024, 8),
    ((3,), 47, 1025, 5),
    ((), 100, 2049, 9),
    ((2,), 31, 1030, 16),
    ((), 129, 1027, 17),
    ((), 90, 1100, 26),  # float32's 28-feature bucket (17..24 take 24, 25..28 take 28)
    ((), 40, 3001, 29),
    ((), 70, 2048, 32),
    ((), 5, 1026, 1),
]


@pytest.mark.parametrize("variant", ["auto", *FWD_KERNELS])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", FWD_SHAPES)
@pytest.mark.parametrize("shift", [0.0, 10.0])
def test_forward_variants_match_float64(variant, dtype, shape, shift):
    batch, n, m, d = shape
    skip_unless_applies(variant, dtype, d)
    x1, x2, l, s = rand_inputs(batch, n, m, d, "cuda", dtype)
    x1, x2 = x1 + shift, x2 + shift
    K = covariance(x1, x2, l, s, variant)
    K64 = reference64(x1, x2, l, s)
    plain = rel_err(ref.rbf_covariance(x1, x2, l, s), K64)
    assert rel_err(K, K64) <= forward_bound(variant, dtype, d, plain)
    assert (K <= s.reshape(*batch, 1, 1)).all()


@pytest.mark.parametrize("variant", ["auto", *FWD_KERNELS])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [2, 8, 16, 21, 27, 29])
def test_diagonal_exact_duplicates_and_bound(variant, dtype, d):
    """K(x, x) = s bit for bit, also for rows of x2 that duplicate rows of x1, and K <= s: on data far from the
    origin, with near duplicates (the expansion's recomputed pairs)."""
    skip_unless_applies(variant, dtype, d)
    n = 1500
    x = torch.randn(n, d, device="cuda", dtype=dtype) * 3 + 10
    x[1::3] = x[::3][: x[1::3].shape[0]] + 1e-3 * torch.randn_like(x[1::3])
    l = (torch.rand(d, device="cuda", dtype=dtype) + 0.5) * max(1.0, (d / 8) ** 0.5)
    s = torch.tensor(1.7, device="cuda", dtype=dtype)
    K = covariance(x, x, l, s, variant)
    assert torch.equal(K.diagonal(), torch.full((n,), 1.7, device="cuda", dtype=dtype))
    assert (K <= s).all()
    # x2 = some rows of x1, shuffled, plus fresh points: the duplicated pairs are exactly s as well
    idx = torch.randperm(n, device="cuda")[:700]
    x2 = torch.cat([x[idx], torch.randn(400, d, device="cuda", dtype=dtype) * 3 + 10])
    K2 = covariance(x, x2, l, s, variant)
    assert torch.equal(K2[idx, torch.arange(700, device="cuda")], torch.full((700,), 1.7, device="cuda", dtype=dtype))
    # near duplicates (distance ~1e-3 / l): as accurate as the float32 rounding of the points allows
    pairs = K.diagonal(1)[::3]
    want = reference64(x, x, l, s).diagonal(1)[::3]
    assert bool((pairs > 1.0).all())
    assert rel_err(pairs, want) < (1e-12 if dtype == torch.float64 else 2e-6)


@pytest.mark.parametrize("variant", ["diff", "expand", "tc"])
@pytest.mark.parametrize("ls", [0.01, 0.05, 10.0, 300.0])
def test_forward_extreme_lengthscales(variant, ls):
    x1, x2, _, s = rand_inputs((), 200, 1500, 12, "cuda")
    l = torch.full((12,), ls, device="cuda")
    K = covariance(x1, x2, l, s, variant)
    K64 = reference64(x1, x2, l, s)
    plain = rel_err(ref.rbf_covariance(x1, x2, l, s), K64)
    assert rel_err(K, K64) <= forward_bound(variant, torch.float32, 12, plain)
    assert (K <= s).all() and (K >= 0).all()


@pytest.mark.parametrize("variant", ["expand", "tc"])
def test_forward_64bit_indexing_expansion(variant):
    n = 46400  # n * n > 2^31
    x = torch.randn(n, 16, device="cuda")
    l = torch.rand(16, device="cuda") + 1.0
    poison_allocator("cuda", 4 * n * n)
    K = forced_covariance(x, x, l, torch.tensor(1.5, device="cuda"), variant)
    rows = torch.tensor([0, 1, n // 2, n - 2, n - 1], device="cuda")
    want = reference64(x[rows], x, l, torch.tensor(1.5))
    assert rel_err(K[rows], want) < 2e-6
    assert torch.isfinite(K[-3:]).all() and torch.isfinite(K[:, -3:]).all()
    assert (K.diagonal() == 1.5).all()
    del K


@pytest.mark.parametrize("d", [9, 16, 17, 20, 27, 32])
def test_forward_default_kernel_for_float32(d):
    """Float32 with 8 < d <= 32 takes the norm expansion by default from 1024 columns on, bit for bit, and the tiled
    kernel below that; the tensor-core kernel only by name."""
    for n, m in ((40, 700), (300, 2100)):
        x1, x2, l, s = rand_inputs((2,), n, m, d, "cuda")
        kernel = "expand" if m >= 1024 else "tile"
        assert torch.equal(ops.rbf_covariance(x1, x2, l, s), forced_covariance(x1, x2, l, s, kernel))
    if 24 < d < 32:  # the 28-feature bucket adds exact zeros over blocks of the same columns: the 32 bucket's bits
        x1, x2, l, s = rand_inputs((), 70, 1500, d, "cuda")
        pad = torch.zeros(70, 32 - d, device="cuda"), torch.zeros(1500, 32 - d, device="cuda")
        l32 = torch.cat([l, torch.ones(1, 32 - d, device="cuda")], -1)
        K32 = ops.rbf_covariance(torch.cat([x1, pad[0]], 1), torch.cat([x2, pad[1]], 1), l32, s)
        assert torch.equal(ops.rbf_covariance(x1, x2, l, s), K32)


@pytest.mark.parametrize(
    "args, message",
    [
        ("'tc', dtype=torch.float64", "take float32 points, got Double"),
        ("'tc', d=8", "take 8 < d <= 32, got d=8"),
        ("'tc_w4', d=33", "need d <= 32, got d=33"),
        ("'tensor'", "kernel must be 'tile', 'diff', 'expand', 'tc'"),
    ],
)
def test_covariance_kernel_op_checks_in_a_subprocess(args, message):
    """The C++ op's own argument checks for the named forward kernels, each in a process of its own: a failing check
    must raise, not end the interpreter."""
    call = (
        "def call(kernel, dtype=torch.float32, d=12):\n"
        "    x = torch.randn(1, 50, d, device='cuda', dtype=dtype)\n"
        "    l, s = torch.ones(1, d, device='cuda', dtype=dtype), torch.ones(1, device='cuda', dtype=dtype)\n"
        "    ops._ensure_loaded()\n"
        "    torch.ops.gpfast._rbf_covariance_kernel(x, x, l, s, kernel)\n"
    )
    assert_raises_in_a_subprocess(call, args, message)


# ------------------------------------------------------------------------------------------------------------ K @ V

KV_T = [1, 8, 11, 12, 16, 17, 32, 33]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", KV_T)
@pytest.mark.parametrize("shape", [((), 130, 257, 3), ((2,), 257, 70, 8), ((), 70, 1000, 16), ((), 33, 300, 29)])
def test_matmul_buckets_match_float64(dtype, t, shape):
    batch, n, m, d = shape
    x1, x2, l, s = rand_inputs(batch, n, m, d, "cuda", dtype)
    x1, x2 = x1 + 10, x2 + 10  # far from the origin: the kernels centre the points
    v = torch.randn(*batch, m, t, device="cuda", dtype=dtype)
    poison_allocator("cuda", 8 * n * t * 64 * 4)
    out = ops.rbf_matmul(x1, x2, l, s, v)
    assert out.shape == (*batch, n, t) and torch.isfinite(out).all()
    want = ref.rbf_matmul(x1.double(), x2.double(), l.double(), s.double(), v.double())
    if dtype == torch.float64:
        assert rel_err(out, want) < 1e-12
    else:
        plain = ref.rbf_matmul(x1, x2, l, s, v)
        assert rel_err(out, want) <= 2 * rel_err(plain, want) + 1e-6
    assert torch.equal(out, ops.rbf_matmul(x1, x2, l, s, v))  # deterministic


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_column_splits_and_diagonal(dtype):
    """Few rows and many columns (the columns split over blocks, partial products summed), and the self-kernel's
    diagonal read back through one-hot right-hand sides: exactly s."""
    n, m, d, t = 40, 30000, 8, 12
    x = torch.randn(m, d, device="cuda", dtype=dtype)
    l = torch.rand(d, device="cuda", dtype=dtype) + 0.5
    v = torch.randn(m, t, device="cuda", dtype=dtype)
    out = ops.rbf_matmul(x[:n], x, l, 1.3, v)
    # the reference's outputscale in float64: torch.tensor(1.3) is float32, 3.7e-8 away from the op's 1.3
    want = ref.rbf_matmul(x[:n].double(), x.double(), l.double(), torch.tensor(1.3, dtype=torch.float64), v.double())
    plain = ref.rbf_matmul(x[:n], x, l, torch.tensor(1.3, dtype=dtype), v)
    assert rel_err(out, want) <= (1e-12 if dtype == torch.float64 else 2 * rel_err(plain, want) + 1e-6)
    onehot = torch.zeros(m, t, device="cuda", dtype=dtype)
    onehot[torch.arange(t), torch.arange(t)] = 1
    diag = ops.rbf_matmul(x, x, l, 1.3, onehot)[torch.arange(t), torch.arange(t)]
    assert torch.equal(diag, torch.full((t,), 1.3, device="cuda", dtype=dtype))


@pytest.mark.parametrize("ls", [0.05, 0.3, 10.0])
def test_matmul_large_against_float64_rows(ls):
    n, d, t = 20000, 8, 11
    x = torch.randn(n, d, device="cuda")
    v = torch.randn(n, t, device="cuda")
    l = torch.full((d,), ls, device="cuda")
    out = ops.rbf_matmul(x, x, l, 1.0, v)
    rows = torch.randperm(n, device="cuda")[:256]
    want = reference64(x[rows], x, l, torch.tensor(1.0)) @ v.double()
    plain = ref.rbf_covariance(x[rows], x, l, torch.tensor(1.0, device="cuda")) @ v
    assert rel_err(out[rows], want) <= 2 * rel_err(plain, want) + 1e-6


# The tensor-core K @ V (float32's default for d <= 8, 9 <= t <= 16 and 10^10 pairs or more; every bucket when
# forced) and its sweep variants, each forced through the private op, against the CUDA-core kernel's rule: at most
# 2x plain float32 + 1e-6 against float64. The rule cannot tell whether the sums across tiles are compensated (at
# these sizes their rounding is small); test_matmul_tensor_cores_long_sums does.
KV_SHAPES_VARIANTS = [((), 130, 257, 3, 11), ((2,), 257, 70, 8, 16), ((), 333, 1000, 8, 1), ((), 17, 45, 5, 9)]
KV_SHAPES_WIDE = [((), 70, 1000, 16, 24), ((), 33, 300, 29, 32), ((3,), 100, 130, 20, 17), ((), 200, 64, 32, 8)]


def poison_partials(batch, n, m, t):
    """NaN in freed blocks of exactly the size of every partial-product buffer (splits, B, n, t) the op may
    allocate, two of each: the caching allocator gives an allocation a free block of its own size first, and these
    buffers are far smaller than what poison_allocator fills (a different pool)."""
    B = math.prod(batch)
    bufs = [torch.full((k * B * n * t,), float("nan"), device="cuda") for _ in range(2) for k in range(1, m // 32 + 2)]
    del bufs


def forced_matmul_case(kernel, shape):
    batch, n, m, d, t = shape
    x1, x2, l, s = rand_inputs(batch, n, m, d, "cuda", torch.float32)
    x1, x2 = x1 + 10, x2 + 10  # far from the origin: the kernels centre the points
    v = torch.randn(*batch, m, t, device="cuda")
    poison_partials(batch, n, m, t)
    out = ops._rbf_matmul_kernel(x1, x2, l, s, v, kernel)
    assert out.shape == (*batch, n, t) and torch.isfinite(out).all(), "an output element was never written"
    want = ref.rbf_matmul(x1.double(), x2.double(), l.double(), s.double(), v.double())
    plain = ref.rbf_matmul(x1, x2, l, s, v)
    assert rel_err(out, want) <= 2 * rel_err(plain, want) + 1e-6
    assert torch.equal(out, ops._rbf_matmul_kernel(x1, x2, l, s, v, kernel))  # deterministic


@pytest.mark.parametrize("kernel", ops.MATMUL_KERNELS)
@pytest.mark.parametrize("shape", KV_SHAPES_VARIANTS)
def test_matmul_kernels_match_float64(kernel, shape):
    forced_matmul_case(kernel, shape)


@pytest.mark.parametrize("kernel", ["tc", "cuda_cores"])
@pytest.mark.parametrize("shape", KV_SHAPES_WIDE)
def test_matmul_kernels_wide_match_float64(kernel, shape):
    forced_matmul_case(kernel, shape)


@pytest.mark.parametrize("kernel", ops.MATMUL_KERNELS + ops.MATMUL_SYMMETRIC_KERNELS)
def test_matmul_kernels_self_diagonal_and_duplicates(kernel):
    """K(x, x) read back through one-hot right-hand sides: exactly s on the diagonal and at exact duplicates (near
    pairs recomputed by differences), every entry against float64."""
    m, d, t = 30000, 8, 12
    x = torch.randn(m, d, device="cuda")
    x[5000:5100] = x[:100]  # exact duplicates away from the diagonal
    l = torch.rand(d, device="cuda") + 0.5
    onehot = torch.zeros(m, t, device="cuda")
    onehot[torch.arange(t), torch.arange(t)] = 1
    s = torch.tensor(1.3, device="cuda")
    out = ops._rbf_matmul_kernel(x, x, l, s, onehot, kernel)
    assert torch.equal(out[torch.arange(t), torch.arange(t)], torch.full((t,), 1.3, device="cuda"))
    assert torch.equal(out[5000 + torch.arange(t), torch.arange(t)], torch.full((t,), 1.3, device="cuda"))
    want = reference64(x, x[:t], l, torch.tensor(1.3, dtype=torch.float64))
    plain = ref.rbf_covariance(x, x[:t], l, s)
    assert rel_err(out, want) <= 2 * rel_err(plain, want) + 1e-6


@pytest.mark.parametrize("kernel", ops.MATMUL_KERNELS + ops.MATMUL_SYMMETRIC_KERNELS)
def test_matmul_kernels_far_rows(kernel):
    """Row blocks with and without points far from the centre (|z|^2 of some thousands in log2 units, where the near
    test's threshold 2 tau |z_i|^2 is large): through one-hot right-hand sides, exactly s on the diagonal in both
    kinds of block; with random right-hand sides, every entry against float64 (which also catches an error that
    raises e, which the one-hot check cannot: the recomputation hides it there)."""
    m, d, t = 3000, 8, 16
    x = torch.randn(m, d, device="cuda")
    far = torch.arange(700, m, 300, device="cuda")  # one far row in some blocks of 128 rows; the first five none
    x[far] += 40
    l = torch.rand(d, device="cuda") + 0.5
    s = torch.tensor(1.3, device="cuda")
    cols = torch.cat([torch.arange(8, device="cuda"), far[:8]])  # near the centre and far
    onehot = torch.zeros(m, t, device="cuda")
    onehot[cols, torch.arange(t, device="cuda")] = 1
    out = ops._rbf_matmul_kernel(x, x, l, s, onehot, kernel)
    assert torch.equal(out[cols, torch.arange(t, device="cuda")], torch.full((t,), 1.3, device="cuda"))
    v = torch.randn(m, t, device="cuda")
    out = ops._rbf_matmul_kernel(x, x, l, s, v, kernel)
    want = ref.rbf_matmul(x.double(), x.double(), l.double(), s.double(), v.double())
    plain = ref.rbf_matmul(x, x, l, s, v)
    assert rel_err(out, want) <= 2 * rel_err(plain, want) + 1e-6


@pytest.mark.parametrize("ls", [0.05, 0.3, 10.0])
def test_matmul_tensor_cores_large_against_cuda_cores_rule(ls):
    """n = 20,000, each point scaled by 3, through the tensor-core and the CUDA-core kernels, both within the rule on
    256 rows, at a short, a medium and a long lengthscale."""
    n, d, t = 20000, 8, 16
    x = torch.randn(n, d, device="cuda") * 3
    v = torch.randn(n, t, device="cuda")
    l = torch.full((d,), ls, device="cuda")
    rows = torch.randperm(n, device="cuda")[:256]
    want = reference64(x[rows], x, l, torch.tensor(1.0)) @ v.double()
    plain = ref.rbf_covariance(x[rows], x, l, torch.tensor(1.0, device="cuda")) @ v
    for kernel in ("tc", "cuda_cores"):
        out = ops._rbf_matmul_kernel(x, x, l, 1.0, v, kernel)
        assert rel_err(out[rows], want) <= 2 * rel_err(plain, want) + 1e-6, kernel


def test_matmul_default_kernel_by_size():
    """float32 products of at least 10^10 pairs with d <= 8 and 9 <= t <= 16 get the tensor-core kernel, the rest
    the CUDA-core kernel, bit for bit what the private op gives when it names them."""
    l = torch.rand(8, device="cuda") + 0.5
    for n, t, kernel in ((100_000, 11, "tc"), (99_999, 11, "cuda_cores"), (100_000, 8, "cuda_cores")):
        x, v = torch.randn(n, 8, device="cuda"), torch.randn(n, t, device="cuda")
        got = ops.rbf_matmul(x, x, l, 1.3, v)
        assert torch.equal(got, ops._rbf_matmul_kernel(x, x, l, 1.3, v, kernel)), (n, t, kernel)


def test_matmul_tensor_cores_long_sums():
    """10^6 columns in one row block's range (40,000 rows fill the GPU without column splits): the sums across
    tiles are compensated, so the kernel's error on 256 rows stays near float32's rounding. Measured on the H200 at
    10^6 points: 4.7e-7 and 9.6e-7 on two draws (plain float32 1.5e-6 and 7.9e-7 on the same draws, so plain's is
    no bound on every draw); uncompensated, 3.1e-6. The bound, 2e-6, is twice the worst compensated draw seen and
    below the uncompensated sums' error."""
    m, n, d, t = 1_000_000, 40_000, 8, 16
    x = torch.randn(m, d, device="cuda")
    l = torch.rand(d, device="cuda") + 0.5
    v = torch.randn(m, t, device="cuda")
    s = torch.tensor(1.3, device="cuda")
    out = ops._rbf_matmul_kernel(x[:n], x, l, s, v, "tc")
    rows = torch.randperm(n, device="cuda")[:256]
    want = torch.cat([reference64(x[r], x, l, s) @ v.double() for r in rows.split(32)])
    assert rel_err(out[rows], want) <= 2e-6


# The symmetric K(x, x) @ V kernels (each pair once for both products; x1 and x2 one tensor): several super-tiles
# with n ragged against them and the 128-row bands, a batch, one super-tile, one point, t = 1, 9, 11 and 16.
KV_SYM_SHAPES = [((), 3000, 8, 16), ((2,), 1300, 3, 11), ((), 129, 5, 1), ((), 1, 8, 4), ((), 5000, 7, 9)]


@pytest.mark.parametrize("kernel", ops.MATMUL_SYMMETRIC_KERNELS)
@pytest.mark.parametrize("shape", KV_SYM_SHAPES)
def test_matmul_symmetric_kernels_match_float64(kernel, shape):
    batch, n, d, t = shape
    x, _, l, s = rand_inputs(batch, n, 1, d, "cuda", torch.float32)
    x = x + 10  # far from the origin: the kernels centre the points
    v = torch.randn(*batch, n, t, device="cuda")
    out = ops._rbf_matmul_kernel(x, x, l, s, v, kernel)
    assert out.shape == (*batch, n, t) and torch.isfinite(out).all()
    want = ref.rbf_matmul(x.double(), x.double(), l.double(), s.double(), v.double())
    plain = ref.rbf_matmul(x, x, l, s, v)
    assert rel_err(out, want) <= 2 * rel_err(plain, want) + 1e-6


def test_matmul_symmetric_kernels_long_sums():
    """200,000 points: each output's sums span 196 super-tiles of 1024 (391 of 512), Kahan-compensated in float32
    within a super-tile and added in float64 across them, so the error on 256 rows stays at the bound of the
    non-symmetric kernel's long sums (test_matmul_tensor_cores_long_sums)."""
    n, d, t = 200_000, 8, 16
    x = torch.randn(n, d, device="cuda")
    l = torch.rand(d, device="cuda") + 0.5
    v = torch.randn(n, t, device="cuda")
    s = torch.tensor(1.3, device="cuda")
    rows = torch.randperm(n, device="cuda")[:256]
    want = torch.cat([reference64(x[r], x, l, s) @ v.double() for r in rows.split(32)])
    for kernel in ops.MATMUL_SYMMETRIC_KERNELS:
        out = ops._rbf_matmul_kernel(x, x, l, s, v, kernel)
        assert rel_err(out[rows], want) <= 2e-6, kernel


def test_matmul_symmetric_kernels_need_one_tensor():
    x, l, v = torch.randn(50, 3, device="cuda"), torch.ones(3, device="cuda"), torch.randn(50, 2, device="cuda")
    with pytest.raises(ValueError, match="pass one tensor as x1 and x2"):
        ops._rbf_matmul_kernel(x, x.clone(), l, 1.0, v, "tc_sym")


@pytest.mark.parametrize(
    "args, message",
    [
        ("'tensor'", "kernel must be 'cuda_cores', 'tc'"),
        ("'tc', dtype=torch.float64", "take float32 points, got x1 of dtype Double"),
        ("'tc_vsplit', d=9", "takes d <= 8 and t <= 16, got d=9 and t=4"),
        ("'tc', t=33", "takes d <= 32 and t <= 32, got d=8 and t=33"),
        ("'tc_sym', other=True", "x1 and x2 must be the same tensor"),
    ],
)
def test_matmul_kernel_op_checks_in_a_subprocess(args, message):
    """The C++ op's own argument checks (the Python wrapper's are passed by calling the op directly), each in a
    process of its own: a failing check must raise, not end the interpreter."""
    call = (
        "def call(kernel, dtype=torch.float32, d=8, t=4, other=False):\n"
        "    x = torch.randn(1, 50, d, device='cuda', dtype=dtype)\n"
        "    l, s = torch.ones(1, d, device='cuda', dtype=dtype), torch.ones(1, device='cuda', dtype=dtype)\n"
        "    v = torch.randn(1, 50, t, device='cuda', dtype=dtype)\n"
        "    ops._ensure_loaded()\n"
        "    torch.ops.gpfast._rbf_matmul_kernel(x, x.clone() if other else x, l, s, v, kernel)\n"
    )
    assert_raises_in_a_subprocess(call, args, message)


def test_matmul_kernel_argument_errors():
    x = torch.randn(50, 8, device="cuda")
    v = torch.randn(50, 4, device="cuda")
    with pytest.raises(ValueError, match="kernel must be one of"):
        ops._rbf_matmul_kernel(x, x, 1.0, 1.0, v, "tensor")
    with pytest.raises(ValueError, match=r"takes d <= 8 and t <= 16, got d=9 and t=4"):
        ops._rbf_matmul_kernel(
            torch.randn(50, 9, device="cuda"), torch.randn(50, 9, device="cuda"), 1.0, 1.0, v, "tc_occ3"
        )
    with pytest.raises(ValueError, match=r"takes d <= 32 and t <= 32, got d=8 and t=33"):
        ops._rbf_matmul_kernel(x, x, 1.0, 1.0, torch.randn(50, 33, device="cuda"), "tc")
    with pytest.raises(ValueError, match="tensor-core kernels take float32, got torch.float64"):
        ops._rbf_matmul_kernel(x.double(), x.double(), 1.0, 1.0, v.double(), "tc")


# -------------------------------------------------------------------------------------------------------- backward


def cov_grads(x1, x2, l, s, w, x_grads=True):
    return torch.ops.gpfast.rbf_covariance_backward(w, x1, x2, l, s, x_grads)


def canonical(batch, n, m, d, dtype, shift=0.0):
    x1, x2, l, s = rand_inputs(batch, n, m, d, "cuda", dtype)
    B = math.prod(batch)
    return (x1.reshape(B, n, d) + shift, x2.reshape(B, m, d) + shift, l.reshape(B, d), s.reshape(B))


BWD_SHAPES = [  # (batch, n, m, d): ragged against 256-row blocks and 32-column tiles, every feature bucket
    ((), 70, 90, 29),
    ((3,), 97, 301, 3),
    ((), 200, 1100, 8),
    ((), 150, 260, 16),
    ((), 257, 33, 9),
    ((2,), 31, 4000, 32),
    ((), 64, 64, 40),  # dense float64 fallback
    ((), 1, 1, 1),
]


@pytest.mark.parametrize("shift", [0.0, 10.0])
@pytest.mark.parametrize("shape", BWD_SHAPES)
def test_covariance_backward_float32_vs_float64(shape, shift):
    batch, n, m, d = shape
    for draw in range(3):  # the outputscale gradient's check must hold on every draw
        x1, x2, l, s = canonical(batch, n, m, d, torch.float32, shift)
        w = torch.randn(x1.shape[0], n, m, device="cuda")
        poison_allocator("cuda", 8 * (n + m) * 32 * 64)
        l3 = l[:, None]  # (B, 1, d): the wrappers' lengthscale shape
        got = grads_of(lambda *a: ops.rbf_covariance(*a), (x1, x2, l3, s), w)
        want = grads_of(ref.rbf_covariance, [t.double() for t in (x1, x2, l3, s)], w.double())
        plain = grads_of(ref.rbf_covariance, (x1, x2, l3, s), w)
        for name, g, r, p in zip(("x1", "x2", "lengthscale", "outputscale"), got, want, plain):
            assert torch.isfinite(g).all(), name
            assert rel_err(g, r) <= 4 * rel_err(p, r) + 1e-6, (name, draw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", BWD_SHAPES)
def test_covariance_backward_mask_and_determinism(dtype, shape):
    """x_grads=False: (0,) point gradients and the same lengthscale and outputscale gradients as x_grads=True
    (computed differently: directly, and through the expansion identity); repeated calls agree bit for bit."""
    batch, n, m, d = shape
    x1, x2, l, s = canonical(batch, n, m, d, dtype)
    w = torch.randn(x1.shape[0], n, m, device="cuda", dtype=dtype)
    full = cov_grads(x1, x2, l, s, w, True)
    masked = cov_grads(x1, x2, l, s, w, False)
    assert full[0].shape == x1.shape and full[1].shape == x2.shape
    assert masked[0].shape == (0,) and masked[1].shape == (0,)
    assert masked[0].dtype == dtype and masked[0].device == x1.device
    if d <= 16:  # the same kernel forms L and S with or without the points' gradients
        assert torch.equal(masked[2], full[2]) and torch.equal(masked[3], full[3])
    # d > 16 with points: L by the identity, whose terms z A exceed L by up to sqrt(n + m) / |sum| (random signs)
    tol = 1e-10 if dtype == torch.float64 else 1e-6
    assert rel_err(masked[2], full[2]) < tol and rel_err(masked[3], full[3]) < tol
    again = cov_grads(x1, x2, l, s, w, True)
    for a, b in zip(full, again):
        assert torch.equal(a, b)


@pytest.mark.parametrize("t", KV_T)
@pytest.mark.parametrize(
    "shape", [((), 600, 900, 8), ((2,), 130, 70, 3), ((), 90, 300, 20), ((), 257, 40, 32), ((), 64, 80, 40)]
)
def test_matmul_backward_float32_vs_float64(t, shape):
    batch, n, m, d = shape
    for draw in range(2):
        x1, x2, l, s = canonical(batch, n, m, d, torch.float32, shift=10.0)
        v = torch.randn(x1.shape[0], m, t, device="cuda")
        w = torch.randn(x1.shape[0], n, t, device="cuda")
        l3 = l[:, None]
        got = grads_of(lambda *a: ops.rbf_matmul(*a), (x1, x2, l3, s, v), w)
        want = grads_of(ref.rbf_matmul, [a.double() for a in (x1, x2, l3, s, v)], w.double())
        plain = grads_of(ref.rbf_matmul, (x1, x2, l3, s, v), w)
        slack = outputscale_slack(w, x1, x2, l3, v, want[3])
        for name, g, r, p in zip(("x1", "x2", "lengthscale", "outputscale", "v"), got, want, plain):
            extra = slack if name == "outputscale" else 0.0
            assert rel_err(g, r) <= 4 * rel_err(p, r) + 1e-6 + extra, (name, draw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", KV_T)
def test_matmul_backward_mask_and_determinism(dtype, t):
    x1, x2, l, s = canonical((2,), 300, 700, 9, dtype)
    v = torch.randn(2, 700, t, device="cuda", dtype=dtype)
    g = torch.randn(2, 300, t, device="cuda", dtype=dtype)
    full = torch.ops.gpfast.rbf_matmul_backward(g, x1, x2, l, s, v, True)
    masked = torch.ops.gpfast.rbf_matmul_backward(g, x1, x2, l, s, v, False)
    assert masked[0].shape == (0,) and masked[1].shape == (0,)
    # float64, d = 9: the same kernel forms L and S with or without the points' gradients
    if t <= 32 and dtype == torch.float64:
        assert torch.equal(masked[2], full[2]) and torch.equal(masked[3], full[3])
    if dtype == torch.float64 or t > 32:
        assert rel_err(masked[2], full[2]) < 1e-10 and rel_err(masked[3], full[3]) < 1e-10
    else:  # float32 without the points' gradients takes the tensor-core kernel, which rounds differently from the
        # row pass (2e-6 apart in the outputscale gradient on the H200): each is held to the accuracy rule against
        # float64 instead, batch entry by batch entry, with the outputscale's term for a cancelling sum (one H200
        # draw: 3.8e-6, 7.5x plain float32's error)
        for b in range(2):
            args = (g[b], x1[b], x2[b], l[b], s[b], v[b])
            want = theta_grads_blocked(*(a.double() for a in args))
            plain = theta_grads_blocked(*args)
            slack = outputscale_slack(g[b : b + 1], x1[b : b + 1], x2[b : b + 1], l[b : b + 1], v[b : b + 1], want[1])
            for got, name in ((masked, "tensor cores"), (full, "row pass")):
                for a, r, p, extra in zip((got[2][b], got[3][b]), want, plain, (0.0, slack)):
                    assert rel_err(a, r) <= 4 * rel_err(p, r) + 1e-6 + extra, (name, b)
    again = torch.ops.gpfast.rbf_matmul_backward(g, x1, x2, l, s, v, True)
    for a, b in zip(full, again):
        assert torch.equal(a, b)


@pytest.mark.parametrize("ls", [0.05, 0.3, 100.0])  # 0.05: K ~ 0 but for the nearest pairs
def test_backward_extreme_lengthscales(ls):
    x1, x2, _, s = canonical((), 300, 2000, 8, torch.float32)
    l = torch.full_like(x1[:, 0, :], ls)
    w = torch.randn(1, 300, 2000, device="cuda")
    got = cov_grads(x1, x2, l, s, w)
    want = grads_of(ref.rbf_covariance, [t.double() for t in (x1, x2, l[:, None], s)], w.double())
    plain = grads_of(ref.rbf_covariance, (x1, x2, l[:, None], s), w)
    want[2], plain[2] = want[2][:, 0], plain[2][:, 0]
    for name, g, r, p in zip(("x1", "x2", "lengthscale", "outputscale"), got, want, plain):
        if r.abs().max() == 0:
            assert g.abs().max() == 0, name
            continue
        assert rel_err(g, r) <= 4 * rel_err(p, r) + 1e-6, name


@pytest.mark.parametrize("d", [29, 13, 8])  # the float64 row passes, the float32 one pass
def test_outputscale_gradient_on_many_draws(d):
    """The check that failed before (test_ops' shape (70, 90, 29)): the outputscale gradient is a single sum of
    6300 terms of either sign, so its relative error has no bound unless the terms are nearly exact."""
    for _ in range(40):
        x1, x2, l, s = canonical((), 70, 90, d, torch.float32)
        w = torch.randn(1, 70, 90, device="cuda")
        got = cov_grads(x1, x2, l, s, w)[3]
        want = grads_of(ref.rbf_covariance, [t.double() for t in (x1, x2, l[:, None], s)], w.double())[3]
        plain = grads_of(ref.rbf_covariance, (x1, x2, l[:, None], s), w)[3]
        assert rel_err(got, want) <= 4 * rel_err(plain, want) + 1e-6


# ------------------------------------------------------------------ the covariance backward's two row passes by name


def named_cov_grads(kernel, x1, x2, l, s, w, x_grads=True):
    return torch.ops.gpfast._rbf_covariance_backward_kernel(w, x1, x2, l, s, x_grads, kernel)


@pytest.mark.parametrize("kernel", ops.COVARIANCE_BACKWARD_KERNELS)
@pytest.mark.parametrize("shift", [0.0, 10.0])
@pytest.mark.parametrize("shape", [s for s in BWD_SHAPES if s[3] <= 32] + [((), 40, 3000, 4), ((2,), 700, 50, 16)])
def test_named_covariance_backward_vs_float64(kernel, shape, shift):
    """Each kernel on float32 inputs, with and without the point gradients, within the accuracy rule against
    float64 on fresh draws, its partial buffers poisoned (the one-pass kernel: d <= 16, in every bucket, with many
    column strips and many row blocks)."""
    batch, n, m, d = shape
    if kernel == "onepass32" and d > 16:
        pytest.skip("the one-pass kernel takes d <= 16")
    for draw in range(2):
        x1, x2, l, s = canonical(batch, n, m, d, torch.float32, shift)
        w = torch.randn(x1.shape[0], n, m, device="cuda")
        l3 = l[:, None]
        want = grads_of(ref.rbf_covariance, [t.double() for t in (x1, x2, l3, s)], w.double())
        plain = grads_of(ref.rbf_covariance, (x1, x2, l3, s), w)
        want[2], plain[2] = want[2][:, 0], plain[2][:, 0]
        for x_grads in (True, False):
            poison_allocator("cuda", 8 * (n + m) * 32 * 64)
            got = named_cov_grads(kernel, x1, x2, l, s, w, x_grads)
            pairs = zip(("x1", "x2", "lengthscale", "outputscale"), got, want, plain)
            for name, g, r, p in pairs if x_grads else list(pairs)[2:]:
                assert torch.isfinite(g).all(), (kernel, name)
                assert rel_err(g, r) <= 4 * rel_err(p, r) + 1e-6, (kernel, name, draw, x_grads)


@pytest.mark.parametrize("d", [3, 8, 16, 17, 29])
def test_float32_backward_defaults(d):
    """float32 gets the one-pass kernel by default for d <= 16 and the float64 row passes beyond (bit for bit),
    float64 the float64 row passes."""
    x1, x2, l, s = canonical((2,), 150, 260, d, torch.float32)
    w = torch.randn(2, 150, 260, device="cuda")
    for x_grads in (True, False):
        want = named_cov_grads("onepass32" if d <= 16 else "rows64", x1, x2, l, s, w, x_grads)
        for a, b in zip(cov_grads(x1, x2, l, s, w, x_grads), want):
            assert torch.equal(a, b)
    args64 = [t.double() for t in (x1, x2, l, s)]
    for a, b in zip(cov_grads(*args64, w.double()), named_cov_grads("rows64", *args64, w.double())):
        assert torch.equal(a, b)


def test_float32_backward_far_apart_points():
    """Kernel values below float32's normal range (2^-126 = 1.2e-38): lengthscale 0.03 and two pairs placed at
    K = 1e-40 and 1e-42, every other pair below 1e-45. The plain float32 formula keeps them as denormals; the one-pass
    kernel forms its float32 weights scaled up, so it must keep them too (flushed to zero, every gradient would be
    off by 100%), and to more digits than the plain formula's denormals."""
    for _ in range(3):
        x1, x2, _, s = canonical((), 300, 2000, 8, torch.float32)
        l = torch.full_like(x1[:, 0, :], 0.03)
        for row, k in ((0, 1e-40), (1, 1e-42)):  # x2[row] at the distance that gives K = s k from x1[row]
            u = torch.randn(8, device="cuda")
            x2[0, row] = x1[0, row] + u / u.norm() * 0.03 * math.sqrt(-2 * math.log(k))
        w = torch.randn(1, 300, 2000, device="cuda")
        got = named_cov_grads("onepass32", x1, x2, l, s, w)
        want = grads_of(ref.rbf_covariance, [t.double() for t in (x1, x2, l[:, None], s)], w.double())
        plain = grads_of(ref.rbf_covariance, (x1, x2, l[:, None], s), w)
        want[2], plain[2] = want[2][:, 0], plain[2][:, 0]
        for name, g, r, p in zip(("x1", "x2", "lengthscale", "outputscale"), got, want, plain):
            assert r.abs().max() > 0, name
            assert rel_err(g, r) <= 4 * rel_err(p, r) + 1e-6, name


def test_float32_backward_large_weights():
    """Weights of 1e25 (the scaled-up weights' headroom ends near 1e28): finite and within the rule."""
    x1, x2, l, s = canonical((), 200, 1100, 8, torch.float32)
    w = torch.randn(1, 200, 1100, device="cuda") * 1e25
    got = named_cov_grads("onepass32", x1, x2, l, s, w)
    want = grads_of(ref.rbf_covariance, [t.double() for t in (x1, x2, l[:, None], s)], w.double())
    plain = grads_of(ref.rbf_covariance, (x1, x2, l[:, None], s), w)
    want[2], plain[2] = want[2][:, 0], plain[2][:, 0]
    for name, g, r, p in zip(("x1", "x2", "lengthscale", "outputscale"), got, want, plain):
        assert torch.isfinite(g).all(), name
        assert rel_err(g, r) <= 4 * rel_err(p, r) + 1e-6, name


def test_onepass_backward_refuses_float64():
    x1, x2, l, s = canonical((), 20, 30, 3, torch.float64)
    w = torch.randn(1, 20, 30, device="cuda", dtype=torch.float64)
    with pytest.raises(RuntimeError, match="'onepass32' takes float32, got Double"):
        named_cov_grads("onepass32", x1, x2, l, s, w)
    with pytest.raises(RuntimeError, match="kernel must be 'rows64' or 'onepass32', got 'rows16'"):
        named_cov_grads("rows16", x1.float(), x2.float(), l.float(), s.float(), w.float())


# ------------------------------------------------------------------ the tensor-core (lengthscale, outputscale) backward

BILINEAR = ["bilinear4", "bilinear8"]
BILINEAR_ALL = [*BILINEAR, "bilinear4_nosym", "bilinear8_nosym"]


def kernel_theta_grads(kernel, g, x1, x2, l, s, v):
    """The lengthscale and outputscale gradients by the named kernel, on poisoned memory."""
    poison_allocator("cuda", 2**26)  # beyond the per-block partial sums of every shape here
    gl, gs = ops._rbf_matmul_backward_kernel(g, x1, x2, l, s, v, kernel)
    assert torch.isfinite(gl).all() and torch.isfinite(gs).all(), "poisoned memory showed through"
    return gl, gs


def theta_grads_blocked(g, x1, x2, l, s, v, rows=128, w=None):
    """The lengthscale (d,) and outputscale () gradients of sum(g * (K(x1, x2) v)) from their definition, in the
    inputs' dtype, block by block (no n x m x d tensor): with W = g v^T (or w, given) and z = x / l,
    d/ds = sum_ij W_ij K_ij / s and d/dl = sum_ij W_ij K_ij (z_i - z_j)^2 / l."""
    z1, z2 = x1 / l, x2 / l
    gl, gs = torch.zeros_like(l), torch.zeros_like(s)
    for i in range(0, x1.shape[0], rows):
        diff2 = (z1[i : i + rows, None, :] - z2[None]).pow(2)
        Wb = g[i : i + rows] @ v.T if w is None else w[i : i + rows]
        WK = Wb * torch.exp(-0.5 * diff2.sum(-1))  # W K / s
        gs += WK.sum()
        gl += s * (WK[..., None] * diff2).sum((0, 1)) / l
    return gl, gs


def outputscale_error_scale(g, x1, x2, l, v, rows=128):
    """sqrt(sum_ij (K_ij / s)^2 sum_k g_ik^2 v_jk^2) in float64, for one batch entry: the size of the rounding error
    that weights W_ij = g_i . v_j formed in float32 (each about 2^-24 sqrt(t) of its terms, independently) put into
    the outputscale gradient sum_ij W_ij K_ij / s. Where that sum cancels, far below this size, every float32 way of
    forming it (the plain formula, the row pass, tensor cores) has a relative error of about this size over |sum|,
    each with its own sign: "4x plain" cannot hold on every draw there, so the rule adds 2^-18 sqrt(t) of it
    (experiments/bilinear_rule_probe.py)."""
    g, x1, x2, l, v = (a.double() for a in (g, x1, x2, l, v))
    z1, z2, v2 = x1 / l, x2 / l, v * v
    total = torch.zeros((), dtype=torch.float64, device=g.device)
    for i in range(0, x1.shape[0], rows):
        q = (z1[i : i + rows, None, :] - z2[None]).pow(2).sum(-1)
        total += (torch.exp(-q) * (g[i : i + rows] ** 2 @ v2.T)).sum()
    return total.sqrt()


def outputscale_slack(g, x1, x2, l, v, want):
    """The rule's added term for the outputscale gradient (outputscale_error_scale), norm-wise over batch entries, as
    a share of |want|: batched inputs (B, ., .) with l (B, 1, d) or (B, d)."""
    B = x1.shape[0]
    scale = torch.stack([outputscale_error_scale(g[b], x1[b], x2[b], l[b].reshape(-1), v[b]) for b in range(B)])
    return 2**-18 * v.shape[-1] ** 0.5 * (scale.norm() / want.double().norm()).item()


@pytest.mark.parametrize("kernel", BILINEAR)
@pytest.mark.parametrize("t", [1, 11, 17])
@pytest.mark.parametrize("d", [1, 3, 8, 20, 26, 32])
@pytest.mark.parametrize("shape", [((), 129, 1000), ((2,), 70, 90), ((), 300, 33)])  # rows: 64- and 128-row blocks
def test_bilinear_backward_matches_float64(kernel, t, d, shape):
    """Against float64 on every draw (near the origin and shifted by 10), within the accuracy rule; and in
    agreement with the row pass (float64 sums) within the same bound."""
    torch.manual_seed(1000 * d + t)
    batch, n, m = shape
    for draw in range(3):
        x1, x2, l, s = rand_inputs(batch, n, m, d, "cuda")
        x1, x2 = x1 + 10.0 * (draw % 2), x2 + 10.0 * (draw % 2)
        v = torch.randn(*batch, m, t, device="cuda")
        g = torch.randn(*batch, n, t, device="cuda")
        got = kernel_theta_grads(kernel, g, x1, x2, l, s, v)
        rows = kernel_theta_grads("rows", g, x1, x2, l, s, v)
        want = grads_of(ref.rbf_matmul, [a.double() for a in (x1, x2, l, s, v)], g.double())[2:4]
        plain = grads_of(ref.rbf_matmul, (x1, x2, l, s, v), g)[2:4]
        for name, a, r, p, o in zip(("lengthscale", "outputscale"), got, want, plain, rows):
            bound = 4 * rel_err(p, r) + 1e-6
            assert a.shape == r.shape and a.dtype == torch.float32, name
            assert rel_err(a, r) <= bound, (name, draw)
            assert rel_err(a, o) <= bound, (name, draw)


@pytest.mark.parametrize("kernel", BILINEAR)
@pytest.mark.parametrize("d", [8, 20])
@pytest.mark.parametrize("ls", [0.05, 0.3, 10.0, 100.0])  # 0.05: K ~ 0 but for the nearest pairs; 100: K ~ s
def test_bilinear_backward_extreme_lengthscales(kernel, d, ls):
    torch.manual_seed(d)
    x1, x2, _, s = rand_inputs((), 300, 2000, d, "cuda")
    l = torch.full((1, d), ls, device="cuda")
    v = torch.randn(2000, 17, device="cuda")
    g = torch.randn(300, 17, device="cuda")
    got = kernel_theta_grads(kernel, g, x1, x2, l, s, v)
    want = grads_of(ref.rbf_matmul, [a.double() for a in (x1, x2, l, s, v)], g.double())[2:4]
    plain = grads_of(ref.rbf_matmul, (x1, x2, l, s, v), g)[2:4]
    for name, a, r, p in zip(("lengthscale", "outputscale"), got, want, plain):
        if r.abs().max() < 1e-30:
            assert a.abs().max() < 1e-30, name
            continue
        assert rel_err(a, r) <= 4 * rel_err(p, r) + 1e-6, name


@pytest.mark.parametrize("kernel", BILINEAR_ALL)
@pytest.mark.parametrize("t", [1, 11, 17, 21])  # 21: more than 20 columns, every ordered pair
@pytest.mark.parametrize("d", [3, 20, 32])
@pytest.mark.parametrize("n", [1, 33, 129, 700])  # within one block, and ragged against 64- and 128-row blocks
def test_bilinear_backward_self_kernel(kernel, t, d, n):
    """K(x, x), the engine's case, where each pair is taken once with the weights of both orders (and the diagonal
    tile halved), against float64 and against the row pass, with x far from the origin and duplicated points."""
    torch.manual_seed(100 * d + t)
    x, _, l, s = rand_inputs((), n, 1, d, "cuda")
    x = x + 10.0
    x[1::4] = x[::4][: x[1::4].shape[0]]  # exact duplicates off the diagonal
    v, g = torch.randn(n, t, device="cuda"), torch.randn(n, t, device="cuda")
    got = kernel_theta_grads(kernel, g, x, x, l, s, v)
    rows = kernel_theta_grads("rows", g, x, x, l, s, v)
    want = grads_of(lambda a, c, e, f: ref.rbf_matmul(a, a, c, e, f), [a.double() for a in (x, l, s, v)], g.double())
    plain = grads_of(lambda a, c, e, f: ref.rbf_matmul(a, a, c, e, f), (x, l, s, v), g)
    for name, a, r, p, o in zip(("lengthscale", "outputscale"), got, want[1:3], plain[1:3], rows):
        bound = 4 * rel_err(p, r) + 1e-6
        assert rel_err(a, r) <= bound, name
        assert rel_err(a, o) <= bound, name


@pytest.mark.parametrize("kernel", BILINEAR_ALL)
@pytest.mark.parametrize("d", [9, 20])
def test_bilinear_backward_large_self_kernel(kernel, d):
    """The engine's case: K(x, x) (duplicates on the diagonal) at n = 12,000, columns split over blocks; against the
    definition in float64 and in float32 (the plain formula), block by block."""
    torch.manual_seed(d)
    n, t = 12000, 17
    x = torch.randn(n, d, device="cuda") + 3.0
    l = (torch.rand(d, device="cuda") + 0.5) * max(1.0, (d / 8) ** 0.5)
    s = torch.tensor(1.3, device="cuda")
    v, g = torch.randn(n, t, device="cuda"), torch.randn(n, t, device="cuda")
    got = kernel_theta_grads(kernel, g, x, x, l, s, v)
    want = theta_grads_blocked(*(a.double() for a in (g, x, x, l, s, v)))
    plain = theta_grads_blocked(g, x, x, l, s, v)
    for name, a, r, p in zip(("lengthscale", "outputscale"), got, want, plain):
        assert rel_err(a, r) <= 4 * rel_err(p, r) + 1e-6, name


def test_bilinear_backward_is_the_default_and_deterministic():
    """float32 without point gradients takes the tensor-core kernel (4 warps), bit for bit and call after call;
    float64 and the point gradients keep the row pass."""
    torch.manual_seed(0)
    x1, x2, l, s = canonical((2,), 300, 700, 20, torch.float32)
    v = torch.randn(2, 700, 17, device="cuda")
    g = torch.randn(2, 300, 17, device="cuda")
    op = torch.ops.gpfast.rbf_matmul_backward
    masked = op(g, x1, x2, l, s, v, False)
    forced = torch.ops.gpfast._rbf_matmul_backward_kernel(g, x1, x2, l, s, v, "bilinear4")
    assert masked[0].shape == (0,) and masked[1].shape == (0,)
    assert torch.equal(masked[2], forced[0]) and torch.equal(masked[3], forced[1])
    again = op(g, x1, x2, l, s, v, False)
    assert torch.equal(masked[2], again[2]) and torch.equal(masked[3], again[3])
    args64 = [a.double() for a in (g, x1, x2, l, s, v)]
    rows64 = torch.ops.gpfast._rbf_matmul_backward_kernel(*args64, "rows")
    full64 = op(*args64, False)
    assert torch.equal(full64[2], rows64[0]) and torch.equal(full64[3], rows64[1])


def test_bilinear_backward_kernel_errors():
    x1, x2, l, s = canonical((), 10, 12, 3, torch.float32)
    v, g = torch.randn(1, 12, 2, device="cuda"), torch.randn(1, 10, 2, device="cuda")
    with pytest.raises(RuntimeError, match="'bilinear4_nosym' or 'bilinear8_nosym', got 'tc'"):
        torch.ops.gpfast._rbf_matmul_backward_kernel(g, x1, x2, l, s, v, "tc")
    with pytest.raises(RuntimeError, match="takes float32, got Double"):
        torch.ops.gpfast._rbf_matmul_backward_kernel(*(a.double() for a in (g, x1, x2, l, s, v)), "bilinear4")
    with pytest.raises(RuntimeError, match="got 'rows_nosym'"):
        torch.ops.gpfast._rbf_matmul_backward_kernel(g, x1, x2, l, s, v, "rows_nosym")
    # any CUDA tensor sends the call to the CUDA kernel: a tensor on the CPU must be refused before any pointer use
    for kernel in ("rows", "bilinear4", "bilinear8_nosym"):
        with pytest.raises(RuntimeError, match="grad must be on x1's device cuda:0, got cpu"):
            torch.ops.gpfast._rbf_matmul_backward_kernel(g.cpu(), x1, x2, l, s, v, kernel)
        with pytest.raises(RuntimeError, match="x1 must be a CUDA tensor .* got x1 on cpu"):
            torch.ops.gpfast._rbf_matmul_backward_kernel(g, x1.cpu(), x2, l, s, v, kernel)
        with pytest.raises(RuntimeError, match="v must be on x1's device cuda:0, got cpu"):
            torch.ops.gpfast._rbf_matmul_backward_kernel(g, x1, x2, l, s, v.cpu(), kernel)
        with pytest.raises(RuntimeError, match="runs on CUDA tensors only, got x1 on cpu"):
            torch.ops.gpfast._rbf_matmul_backward_kernel(*(a.cpu() for a in (g, x1, x2, l, s, v)), kernel)
        with pytest.raises(RuntimeError, match="grad must be float32 or float64, got Half"):
            torch.ops.gpfast._rbf_matmul_backward_kernel(g.half(), x1, x2, l, s, v, kernel)
    with pytest.raises(RuntimeError, match="grad must be on x1's device cuda:0, got cpu"):
        torch.ops.gpfast.rbf_matmul_backward(g.cpu(), x1, x2, l, s, v, False)


@pytest.mark.parametrize("kernel", ["rows", *BILINEAR_ALL])
def test_bilinear_backward_kernel_layouts_and_empty(kernel):
    """Strided inputs give the contiguous inputs' gradients bit for bit; a zero size gives zero gradients."""
    torch.manual_seed(1)
    x1, x2, l, s = canonical((2,), 70, 90, 9, torch.float32)
    v, g = torch.randn(2, 90, 5, device="cuda"), torch.randn(2, 70, 5, device="cuda")
    want = torch.ops.gpfast._rbf_matmul_backward_kernel(g, x1, x2, l, s, v, kernel)
    strided = [a.transpose(-1, -2).contiguous().transpose(-1, -2) for a in (g, x1, x2, v)]
    got = torch.ops.gpfast._rbf_matmul_backward_kernel(strided[0], strided[1], strided[2], l, s, strided[3], kernel)
    assert not strided[1].is_contiguous()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for n, m, t in [(0, 90, 5), (70, 0, 5), (70, 90, 0)]:
        e1, e2 = x1[:, :n], x2[:, :m]
        gl, gs = torch.ops.gpfast._rbf_matmul_backward_kernel(g[:, :n, :t], e1, e2, l, s, v[:, :m, :t], kernel)
        assert gl.shape == l.shape and gs.shape == s.shape
        assert not gl.any() and not gs.any()
