"""symmetric_matmul (K @ V for a symmetric stored K, reading only its blocks on and above the diagonal on CUDA): the
kernel's index arithmetic emulated lane by lane on the CPU (experiments/symmetric_matmul_emulation.py) against
float64, the wrapper and its errors, and on a GPU the kernel at every super-tile against float64 on fresh random
inputs, with K's padding and the outputs poisoned.

Error rule for the CUDA kernel (float32, 3xTF32), per output element, relative to sum_j |K_ij| |V_jc|: the split
leaves at most 2^-21 of each operand (hi rounded half up to TF32, lo read by the tensor cores truncated to TF32), so
a product term is off by at most 2^-19 relative; every accumulation after that is a float32 rounding of at most
2^-22 of the running sum's terms (a tensor core may truncate), and the longest chain is a band's row sums over a
super-tile, 3 S / 8 MMAs, plus 16 more roundings (warp sums, the slot, the final float32). The bound
2^-19 + 2^-22 (3 S / 8 + 16) holds on every draw; a super-tile lost or read twice is an error of order 1 / ns.
"""

import numpy as np
import pytest
import torch
from conftest import poison_allocator, rel_err

from experiments.symmetric_matmul_emulation import emulate
from gpfast import ops
from gpfast.train.product import CovarianceProduct

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")


def bound(S: int) -> float:
    return 2.0**-19 + 2.0**-22 * (3 * S / 8 + 16)


def rbf(x: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * ((x[:, None, :] - x[None, :, :]) ** 2).sum(-1))


# ------------------------------------------------------------------------------ CPU: the kernel's indices, emulated


@pytest.mark.parametrize(
    "n, t, S, grid, stages",
    [(700, 11, 256, 4, 0), (700, 7, 256, 3, 5), (201, 5, 256, 1, 0), (1301, 1, 512, 7, 0), (1030, 16, 1024, 2, 0),
     (513, 3, 512, 3, 0)],
)  # fmt: skip
def test_emulated_kernel_is_the_product(n, t, S, grid, stages):
    # exact arithmetic: a difference from K @ V beyond rounding is an index in the copies, the swizzle, the
    # fragments, the partial sums' slots or the order of the super-tiles; the emulation reads only the upper blocks
    rng = np.random.default_rng()
    K = rbf(rng.standard_normal((n, 3)))
    V = rng.standard_normal((n, t))
    got = emulate(K, V, S, grid, stages=stages)
    want = K @ V
    assert np.isfinite(got).all(), "a slot of the partial sums was never written"
    assert np.max(np.abs(got - want) / (np.abs(K) @ np.abs(V))) < 1e-13


def test_emulated_rounding_is_within_the_cuda_bound():
    rng = np.random.default_rng()
    n, t, S = 600, 11, 256
    K = rbf(rng.standard_normal((n, 4))).astype(np.float32).astype(np.float64)
    V = rng.standard_normal((n, t)).astype(np.float32).astype(np.float64)
    got = emulate(K, V, S, 3, tf32=True)
    assert np.max(np.abs(got - K @ V) / (np.abs(K) @ np.abs(V))) <= bound(S)


def test_emulation_reads_only_the_upper_blocks():
    # the blocks below the super-tile diagonal are never read: poisoning them changes nothing
    rng = np.random.default_rng()
    n, S = 600, 256
    K = rbf(rng.standard_normal((n, 3)))
    V = rng.standard_normal((n, 2))
    Kp = K.copy()
    blocks = np.arange(n) // S
    Kp[blocks[:, None] > blocks[None, :]] = np.nan
    got = emulate(Kp, V, S, 2)
    assert np.max(np.abs(got - K @ V) / (np.abs(K) @ np.abs(V))) < 1e-13


# ---------------------------------------------------------------------------------------------- CPU: the wrapper


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_is_the_product(dtype):
    x = torch.randn(40, 3, dtype=dtype)
    K = ops.rbf_covariance(x, x, 1.0, 1.0)
    V = torch.randn(40, 3, dtype=dtype)
    assert torch.equal(ops.symmetric_matmul(K, V), K @ V)
    assert torch.equal(ops.symmetric_matmul(K, V[:, 0]), K @ V[:, 0])
    for block in ops.SYMMETRIC_BLOCKS:
        assert torch.equal(ops._symmetric_matmul_block(K, V, block), K @ V)


def test_errors_name_the_argument():
    K, V = torch.randn(5, 5), torch.randn(5, 2)
    with pytest.raises(TypeError, match="K must be a torch.Tensor"):
        ops.symmetric_matmul(K.numpy(), V)
    with pytest.raises(TypeError, match="float32 or float64"):
        ops.symmetric_matmul(K, V.int())
    with pytest.raises(ValueError, match=r"K must have shape \(n, n\), square, got shape \(5, 4\)"):
        ops.symmetric_matmul(K[:, :4], V[:4])
    with pytest.raises(ValueError, match="n=5 rows"):
        ops.symmetric_matmul(K, V[:4])
    with pytest.raises(TypeError, match="one dtype"):
        ops.symmetric_matmul(K, V.double())
    with pytest.raises(ValueError, match=r"block must be one of \(0, -1, 256, 512, 1024\), got 128"):
        ops._symmetric_matmul_block(K, V, 128)
    with pytest.raises(RuntimeError, match="block must be 0"):  # the op's own checks
        torch.ops.gpfast.symmetric_matmul(K, V, 7)
    with pytest.raises(RuntimeError, match="stages must be 0 .. 5, got 9"):
        torch.ops.gpfast.symmetric_matmul(K, V, 0, 9)


# ---------------------------------------------------------------------------------------------------- CUDA kernel


def _padded_k(n: int, d: int, pad: int, poison: bool = True):
    x = torch.randn(n, d, device="cuda")
    ls = torch.rand(d, device="cuda") + 0.7
    buf = torch.full((n, n + pad), float("nan") if poison else 0.0, device="cuda")
    buf[:, :n] = ops.rbf_covariance(x, x, ls, 1.3)
    return buf[:, :n]


def check(out, K, V, S):
    want = K.double() @ V.double()
    scale = K.double().abs() @ V.double().abs()
    assert out.shape == want.shape and out.dtype == torch.float32
    assert torch.isfinite(out).all(), "an output element was never written, or K's padding was read"
    worst = float(((out.double() - want).abs() / scale).max())
    assert worst <= bound(S), f"error {worst:.3e} / (|K||V|) against the bound {bound(S):.3e}"


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("S, stages", [(256, 0), (256, 5), (512, 0), (1024, 0)])
@pytest.mark.parametrize("n, pad", [(1000, 0), (2053, 3), (4100, 4), (5121, 7)])
@pytest.mark.parametrize("t", [1, 5, 11, 16])
def test_cuda_kernel_matches_float64(S, stages, n, pad, t):
    K = _padded_k(n, 6, pad + (-(n + pad)) % 4)
    V = torch.randn(n, t, device="cuda")
    ns = -(-n // S)
    poison_allocator("cuda", 4 * (ns * ns * S * t + n * t))
    check(ops._symmetric_matmul_block(K, V, S, stages), K, V, S)


@pytest.mark.cuda
@cuda
def test_cuda_kernel_reads_only_the_upper_blocks_and_repeats():
    n, S = 3000, 512
    K = _padded_k(n, 5, (-n) % 4, poison=False)
    V = torch.randn(n, 11, device="cuda")
    Kp = K.clone()
    blocks = torch.arange(n, device="cuda") // S
    Kp[blocks[:, None] > blocks[None, :]] = float("nan")
    out = ops._symmetric_matmul_block(Kp, V, S)
    check(out, K, V, S)
    assert torch.equal(out, ops._symmetric_matmul_block(Kp, V, S))


@pytest.mark.cuda
@cuda
def test_cuda_auto_and_fallbacks():
    n = 5000
    K = _padded_k(n, 4, (-n) % 4)
    V = torch.randn(n, 11, device="cuda")
    check(ops.symmetric_matmul(K, V), K, V, 512)
    # rows not 16-byte aligned, float64, more than 16 columns: dense_matmul; a named super-tile refuses them
    Ku = torch.empty(n, n + 1, device="cuda")[:, :n]
    Ku.copy_(K)
    assert rel_err(ops.symmetric_matmul(Ku, V), K.double() @ V.double()) < 1e-5
    with pytest.raises(RuntimeError, match=r"block 512 takes a float32 K.*strides \(5001, 1\)"):
        ops._symmetric_matmul_block(Ku, V, 512)
    with pytest.raises(RuntimeError, match="stages must be"):
        ops._symmetric_matmul_block(K, V, 512, 5)
    K64, V64 = K.double(), V.double()
    assert rel_err(ops.symmetric_matmul(K64, V64), K64 @ V64) < 1e-12
    W = torch.randn(n, 20, device="cuda")
    assert rel_err(ops.symmetric_matmul(K, W), K.double() @ W.double()) < 1e-5


@pytest.mark.cuda
@cuda
def test_engine_product_reading_half_matches_the_full_read():
    n, d = 6000, 9
    X = torch.randn(n, d, device="cuda")
    ls, s = torch.rand(d, device="cuda") + 1.0, torch.tensor(1.2, device="cuda")
    noise = torch.tensor(0.05, device="cuda")
    V = torch.randn(n, 11, device="cuda")
    out = []
    for half in (False, True):
        p = CovarianceProduct(X, "stored")
        p.symmetric_product = half
        p.update(ls, s, noise)
        out.append(p.matmul(V))
    want = (p.K.double() @ V.double()) + noise.double() * V.double()
    assert rel_err(out[0], want) < 1e-5 and rel_err(out[1], want) < 1e-5
