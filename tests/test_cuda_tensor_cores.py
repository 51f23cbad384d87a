"""The tensor-core K @ V (csrc/cuda/matmul_tc.cuh, reached through the private ``ops._rbf_matmul_kernel``) against
float64 on fresh seeded draws: ragged n and m, every feature and right-hand-side bucket, poisoned outputs, points far
from the origin, exact and near duplicates, extreme lengthscales, column splits and batches.

Error rule, as for the CUDA-core K @ V (test_cuda_kernels.py): the norm-wise relative error against float64 is at
most 2x the plain float32 formula's + 1e-6. The kernel's distances are the norm expansion with its cross term on
tensor cores, split 3xTF32 so that it keeps about float32's 24 bits; P @ V is split the same way.
"""

import math

import pytest
import torch
from conftest import poison_allocator, rel_err

from gpfast import _reference as ref
from gpfast import ops

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")]

SPLIT_VARIANTS = [
    "tc",
    "tc_m2",
    "tc_poly1",
    "tc_poly2",
    "tc_m2_poly1",
    "tc_m2_poly2",
    "tc_flush",
    "tc_m2_flush",
    "tc_poly1_flush",
]


def draw(batch, n, m, d, t, seed, shift=0.0, ls=None):
    """Standard normal points (shifted), lengthscales 0.5-2 (times sqrt(d / 8) for d > 8, so that K is not
    negligible everywhere) or all equal to ``ls``, outputscales 0.5-1.5, normal right-hand sides."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    x1, x2 = randn(*batch, n, d) + shift, randn(*batch, m, d) + shift
    if ls is None:
        l = (torch.rand(*batch, 1, d, device="cuda", generator=gen) * 1.5 + 0.5) * max(1.0, (d / 8) ** 0.5)
    else:
        l = torch.full((*batch, 1, d), float(ls), device="cuda")
    s = torch.rand(tuple(batch), device="cuda", generator=gen) + 0.5
    return x1, x2, l, s, randn(*batch, m, t)


def tensor_core(x1, x2, l, s, v, kernel="tc"):
    n, t = x1.shape[-2], v.shape[-1]
    poison_allocator("cuda", 4 * n * t * max(1, math.prod(x1.shape[:-2])) * 64)
    out = ops._rbf_matmul_kernel(x1, x2, l, s, v, kernel)
    assert torch.isfinite(out).all(), "an output element was never written (poisoned memory showed through)"
    return out


def errors(out, x1, x2, l, s, v, rows=None):
    """(error of out, error of the plain float32 formula) against float64, on ``rows`` of the output (all if None)."""
    r1 = x1 if rows is None else x1[..., rows, :]
    got = out if rows is None else out[..., rows, :]
    want = ref.rbf_matmul(r1.double(), x2.double(), l.double(), s.double(), v.double())
    plain = ref.rbf_matmul(r1, x2, l, s, v)
    return rel_err(got, want), rel_err(plain, want)


@pytest.mark.parametrize("d", [1, 3, 8, 17, 32])
@pytest.mark.parametrize("t", [1, 11, 16, 40])
@pytest.mark.parametrize("shift", [0.0, 10.0])
def test_buckets_match_float64(d, t, shift):
    x1, x2, l, s, v = draw((), 333, 1999, d, t, seed=100 * d + t, shift=shift)
    out = tensor_core(x1, x2, l, s, v)
    err, plain = errors(out, x1, x2, l, s, v)
    assert err <= 2 * plain + 1e-6, (err, plain)
    assert torch.equal(out, ops._rbf_matmul_kernel(x1, x2, l, s, v, "tc"))  # deterministic


@pytest.mark.parametrize("kernel", SPLIT_VARIANTS)
@pytest.mark.parametrize("seed", [1, 2])
def test_variants_match_float64(kernel, seed):
    x1, x2, l, s, v = draw((), 517, 4099, 8, 16, seed=seed, shift=3.0)
    err, plain = errors(tensor_core(x1, x2, l, s, v, kernel), x1, x2, l, s, v)
    assert err <= 2 * plain + 1e-6, (kernel, err, plain)


def test_without_split_is_tf32_accurate_only():
    """The variant without the split keeps TF32's 11 bits: within 1e-2 of float64, and worse than the split."""
    x1, x2, l, s, v = draw((), 300, 3000, 8, 16, seed=5)
    rough, _ = errors(tensor_core(x1, x2, l, s, v, "tc_nosplit"), x1, x2, l, s, v)
    split, _ = errors(tensor_core(x1, x2, l, s, v, "tc"), x1, x2, l, s, v)
    assert rough < 1e-2
    assert split < rough / 10


def test_batches_and_column_splits():
    """Few rows and many columns: the launcher splits the columns across blocks and sums the partial products."""
    x1, x2, l, s, v = draw((3,), 40, 30011, 5, 11, seed=7)
    err, plain = errors(tensor_core(x1, x2, l, s, v), x1, x2, l, s, v)
    assert err <= 2 * plain + 1e-6


def test_matches_cuda_core_kernel_bound():
    """The CUDA-core kernel, named explicitly, is rbf_matmul's; both meet the rule on one draw."""
    x1, x2, l, s, v = draw((), 1000, 5000, 8, 16, seed=11)
    core = ops._rbf_matmul_kernel(x1, x2, l, s, v, "cuda_core")
    assert torch.equal(core, ops.rbf_matmul(x1, x2, l, s, v))
    err_tc, plain = errors(tensor_core(x1, x2, l, s, v), x1, x2, l, s, v)
    err_core, _ = errors(core, x1, x2, l, s, v)
    assert max(err_tc, err_core) <= 2 * plain + 1e-6, (err_tc, err_core, plain)


@pytest.mark.parametrize("d", [3, 8, 32])
@pytest.mark.parametrize("shift", [0.0, 100.0])
def test_exact_and_near_duplicates(d, shift):
    """K(x, x) = s exactly, also for rows of x1 repeated in x2 at other positions; near duplicates as accurate as the
    float32 rounding of the points allows."""
    n, t = 500, 16
    gen = torch.Generator(device="cuda").manual_seed(d)
    x = torch.randn(n, d, device="cuda", generator=gen) + shift
    l = torch.rand(d, device="cuda", generator=gen) + 0.5
    s = torch.tensor(1.7, device="cuda")
    idx = torch.randperm(n, device="cuda", generator=gen)[:t]
    x2 = torch.cat([x[idx], torch.randn(300, d, device="cuda", generator=gen) + shift])
    onehot = torch.zeros(x2.shape[0], t, device="cuda")
    onehot[torch.arange(t), torch.arange(t)] = 1.0  # column c of the output is column c of K: K(x1, x[idx[c]])
    out = tensor_core(x, x2, l, s, onehot)
    assert torch.equal(out[idx, torch.arange(t, device="cuda")], torch.full((t,), 1.7, device="cuda"))
    assert (out <= 1.7).all()
    near = x + 1e-3 * torch.randn(n, d, device="cuda", generator=gen)
    v = torch.randn(n, t, device="cuda", generator=gen)
    err, plain = errors(tensor_core(x, near, l, s, v), x, near, l, s, v)
    assert err <= 2 * plain + 1e-6


@pytest.mark.parametrize("ls", [0.01, 0.05, 10.0, 300.0])
def test_extreme_lengthscales(ls):
    x1, x2, l, s, v = draw((), 200, 3001, 8, 11, seed=int(ls * 100), ls=ls)
    err, plain = errors(tensor_core(x1, x2, l, s, v), x1, x2, l, s, v)
    assert err <= 2 * plain + 1e-6, (err, plain)


def test_large_against_float64_rows():
    """m = 40000 columns: the two-level sums keep the running float32 sum's error at the plain formula's."""
    x1, x2, l, s, v = draw((), 40000, 40000, 8, 16, seed=13)
    out = tensor_core(x1, x2, l, s, v)
    rows = torch.randperm(40000, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))[:256]
    err, plain = errors(out, x1, x2, l, s, v, rows)
    assert err <= 2 * plain + 1e-6, (err, plain)


def test_errors_name_the_argument():
    x1, x2, l, s, v = draw((), 10, 20, 3, 2, seed=0)
    with pytest.raises(RuntimeError, match="kernel must be 'cuda_core' or 'tc"):
        ops._rbf_matmul_kernel(x1, x2, l, s, v, "fast")
    with pytest.raises(RuntimeError, match="unknown part '_m3'"):
        ops._rbf_matmul_kernel(x1, x2, l, s, v, "tc_m3")
    with pytest.raises(RuntimeError, match="float32 only, got Double"):
        ops._rbf_matmul_kernel(x1.double(), x2.double(), l.double(), s.double(), v.double(), "tc")
    x1, x2, l, s, v = draw((), 10, 20, 33, 2, seed=0)
    with pytest.raises(RuntimeError, match="needs d <= 32, got d=33"):
        ops._rbf_matmul_kernel(x1, x2, l, s, v, "tc")
    x1, x2, l, s, v = draw((), 10, 20, 12, 2, seed=0)
    with pytest.raises(RuntimeError, match="not compiled for 16 features"):
        ops._rbf_matmul_kernel(x1, x2, l, s, v, "tc_poly1")


# ------------------------------------------------------------------------------------- covariance forward, "tc"


def tc_covariance(x1, x2, l, s):
    """rbf_covariance by the tensor-core forward (private op), over poisoned memory."""
    x1c, x2c, lc, sc, batch = ops._canonicalize(x1, x2, l, s, True)
    poison_allocator("cuda", 4 * x1c.shape[0] * x1c.shape[1] * x2c.shape[1] * 2)
    K = torch.ops.gpfast._rbf_covariance_kernel(x1c, x2c, lc, sc, "tc").reshape(*batch, x1.shape[-2], x2.shape[-2])
    assert torch.isfinite(K).all(), "an output element was never written (poisoned memory showed through)"
    return K


COV_SHAPES = [
    ((), 33, 1023, 3),
    ((3,), 47, 1025, 5),
    ((), 100, 2049, 9),
    ((2,), 31, 130, 16),
    ((), 129, 1027, 17),
    ((), 40, 3001, 29),
    ((), 70, 2048, 32),
    ((), 5, 1026, 1),
    ((), 300, 7, 8),
]


@pytest.mark.parametrize("shape", COV_SHAPES)
@pytest.mark.parametrize("shift", [0.0, 10.0])
def test_covariance_matches_float64(shape, shift):
    """At most max(2x the plain float32 formula's error, 1e-6), the norm expansion's rule in test_cuda_kernels."""
    batch, n, m, d = shape
    x1, x2, l, s, _ = draw(batch, n, m, d, 1, seed=n + m + d, shift=shift)
    K = tc_covariance(x1, x2, l, s)
    K64 = ref.rbf_covariance(x1.double(), x2.double(), l.double(), s.double())
    plain = rel_err(ref.rbf_covariance(x1, x2, l, s), K64)
    assert rel_err(K, K64) <= max(2 * plain, 1e-6), (rel_err(K, K64), plain)
    assert torch.equal(K, tc_covariance(x1, x2, l, s))  # deterministic


@pytest.mark.parametrize("d", [3, 8, 32])
def test_covariance_exact_diagonal_and_duplicates(d):
    gen = torch.Generator(device="cuda").manual_seed(d)
    x = torch.randn(600, d, device="cuda", generator=gen) + 5.0
    l = torch.rand(d, device="cuda", generator=gen) + 0.5
    s = torch.tensor(1.7, device="cuda")
    K = tc_covariance(x, x, l, s)
    assert torch.equal(K.diagonal(), torch.full((600,), 1.7, device="cuda"))
    assert (K <= 1.7).all()
    idx = torch.randperm(600, device="cuda", generator=gen)[:200]
    x2 = torch.cat([x[idx], torch.randn(100, d, device="cuda", generator=gen)])
    K2 = tc_covariance(x, x2, l, s)
    assert torch.equal(K2[idx, torch.arange(200, device="cuda")], torch.full((200,), 1.7, device="cuda"))


@pytest.mark.parametrize("ls", [0.01, 0.05, 10.0, 300.0])
def test_covariance_extreme_lengthscales(ls):
    x1, x2, l, s, _ = draw((), 200, 1500, 12, 1, seed=3, ls=ls)
    K = tc_covariance(x1, x2, l, s)
    K64 = ref.rbf_covariance(x1.double(), x2.double(), l.double(), s.double())
    plain = rel_err(ref.rbf_covariance(x1, x2, l, s), K64)
    assert rel_err(K, K64) <= max(2 * plain, 1e-6)


def test_covariance_errors_name_the_argument():
    x1, x2, l, s, _ = draw((), 10, 20, 33, 1, seed=0)
    x1c, x2c, lc, sc, _ = ops._canonicalize(x1, x2, l, s, True)
    with pytest.raises(RuntimeError, match="needs float32 and d <= 32, got Float and d=33"):
        torch.ops.gpfast._rbf_covariance_kernel(x1c, x2c, lc, sc, "tc")
    with pytest.raises(RuntimeError, match="'tile', 'diff', 'expand' or 'tc', got 'tensor'"):
        torch.ops.gpfast._rbf_covariance_kernel(x1c, x2c, lc, sc, "tensor")
