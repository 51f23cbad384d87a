"""The ops on a K already in memory: ``dense_matmul`` (K @ V), ``symmetric_matmul`` (K @ V reading half of a symmetric
K) and ``stored_backward`` (the lengthscale and outputscale gradients of sum(G * (K @ V))), the training engine's work
with a stored K. Part of :mod:`gpfast.ops`, which re-exports them; a module of their own only for size.
"""

from __future__ import annotations

import torch

from gpfast.ops import _CUDA_OPS, _FLOATS, _LOAD_ERROR, _as_param, _check_lengthscale_positive, _ensure_loaded

__all__ = ["dense_matmul", "stored_backward", "symmetric_matmul"]

if _LOAD_ERROR is None:  # the overloads themselves, as in gpfast.ops: dense_matmul runs in every CG product
    _dense_op = torch.ops.gpfast.dense_matmul.default
    _stored_bwd_op = torch.ops.gpfast.stored_backward.default
    _sym_op = torch.ops.gpfast.symmetric_matmul.default
    _cov_sym_op = torch.ops.gpfast._rbf_covariance_symmetric.default


def _check_product(K, V, square: bool) -> None:
    """The argument checks of dense_matmul and symmetric_matmul, naming the argument, what it is and what it must be."""
    _ensure_loaded()
    for name, a in (("K", K), ("V", V)):
        if not isinstance(a, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(a).__name__}")
        if a.dtype not in _FLOATS:
            raise TypeError(f"{name} must be float32 or float64, got dtype {a.dtype}")
    if K.dim() != 2 or (square and K.shape[0] != K.shape[1]):
        want = "(n, n), square" if square else "(rows, n)"
        raise ValueError(f"K must have shape {want}, got shape {tuple(K.shape)}")
    if V.dim() not in (1, 2):
        raise ValueError(f"V must have shape (n, t) or (n,), got shape {tuple(V.shape)}")
    if V.dtype != K.dtype:
        raise TypeError(f"V has dtype {V.dtype} but K has {K.dtype}; pass them in one dtype")
    if V.device != K.device:
        raise ValueError(f"V is on {V.device} but K is on {K.device}; put them on one device")
    if V.shape[0] != K.shape[1]:
        raise ValueError(f"V must have n={K.shape[1]} rows (K's column count), got shape {tuple(V.shape)}")
    if K.is_cuda and not _CUDA_OPS:
        raise RuntimeError("K is a CUDA tensor but gpfast's CUDA ops cannot be built here; use K @ V")


def dense_matmul(K: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """``K @ V`` for a stored matrix K (rows, n) and a few right-hand sides V (n, t) or (n,): the training engine's
    stored-K product.

    float32 or float64, one dtype and one device. On CUDA, for t <= 16 and K with column stride 1 (row-major, any
    row stride), a bandwidth kernel of gpfast's own reads K once with 16-byte loads (aiming at 80% of the H200's
    4.27 TB/s); otherwise cuBLAS. On the CPU, ``torch.mm``.
    Results are bitwise repeatable. Differentiable in both inputs (dense gradients).
    """
    _check_product(K, V, square=False)
    if V.dim() == 1:
        return _dense_op(K, V.unsqueeze(1)).squeeze(1)
    return _dense_op(K, V)


#: The super-tiles of :func:`_symmetric_matmul_block`: 0 the op's choice, -1 dense_matmul's full-matrix kernel.
SYMMETRIC_BLOCKS = (0, -1, 256, 512, 1024)


@torch.no_grad()
def symmetric_matmul(K: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """``K @ V`` for a symmetric stored K (n, n), such as K(x, x), and a few right-hand sides V (n, t) or (n,): on
    CUDA it reads only half of K.

    On CUDA, for float32, t <= 16 and K's rows 16-byte aligned (column stride 1, a row stride that is a multiple of
    4, as the training engine's padded rows are) and n >= 4096, a tensor-core kernel reads only K's blocks on and
    above the diagonal (super-tiles of 512 rows) and uses each block for both its row and its column
    products, in 3xTF32 (about float32's accuracy; sums past a super-tile in double). K is therefore *taken* as
    symmetric: an asymmetric K gives the product of a matrix made of its upper blocks. Other inputs go to
    :func:`dense_matmul`; on the CPU, ``torch.mm``. Results are bitwise repeatable. Not differentiable (it runs
    without autograd). On an H200 it is latency-bound: no faster than :func:`dense_matmul` at 11 columns (57,248
    points: 3.37 against 3.34 ms), 1.2x faster at 16 (3.44 against 4.18), so the training engine uses it for more
    than 12 columns only (``experiments/results/h200_2026-12-03_session13``).
    """
    return _symmetric_matmul(K, V, 0)


@torch.no_grad()
def _symmetric_matmul_block(K: torch.Tensor, V: torch.Tensor, block: int, stages: int = 0) -> torch.Tensor:
    """:func:`symmetric_matmul` with a given super-tile (:data:`SYMMETRIC_BLOCKS`) and copies in flight (0: the
    super-tile's default; 5 also at 256), for tests and benchmarks; a positive block refuses inputs its kernel does not
    take instead of handing them on."""
    if block not in SYMMETRIC_BLOCKS:
        raise ValueError(f"block must be one of {SYMMETRIC_BLOCKS}, got {block!r}")
    return _symmetric_matmul(K, V, block, stages)


def _symmetric_matmul(K, V, block: int, stages: int = 0) -> torch.Tensor:
    _check_product(K, V, square=True)
    if V.dim() == 1:
        return _sym_op(K, V.unsqueeze(1), block, stages).squeeze(1)
    return _sym_op(K, V, block, stages)


#: The kernels of :func:`_stored_backward_kernel`: the op's own choice, the float64 reference (any device), and on
#: CUDA the tensor-core kernel with 4 or 8 warps a block, each pair of K(x, x) once or every ordered pair.
STORED_BACKWARD_KERNELS = ("auto", "reference", "tc4", "tc8", "tc4_nosym", "tc8_nosym")


def _stored_backward(K, x1, x2, lengthscale, outputscale, G, V, kernel: str, check_values: bool):
    _ensure_loaded()
    if kernel not in STORED_BACKWARD_KERNELS:
        raise ValueError(f"stored_backward: kernel must be one of {STORED_BACKWARD_KERNELS}, got {kernel!r}")
    for name, a in (("K", K), ("x1", x1), ("x2", x2), ("G", G), ("V", V)):
        if not isinstance(a, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(a).__name__}")
        if a.dtype != K.dtype or a.device != K.device:
            raise TypeError(
                f"{name} is {a.dtype} on {a.device} but K is {K.dtype} on {K.device}; pass one dtype, one device"
            )
    if K.dtype not in _FLOATS:
        raise TypeError(f"K must be float32 or float64, got dtype {K.dtype}")
    if K.dim() != 2:
        raise ValueError(f"K must have shape (n, m), got shape {tuple(K.shape)}")
    n, m = K.shape
    if x1.dim() != 2 or x1.shape[0] != n:
        raise ValueError(f"x1 must have shape (n, d) with n={n} (K's rows), got shape {tuple(x1.shape)}")
    d = x1.shape[1]
    if x2.shape != (m, d):
        raise ValueError(f"x2 must have shape (m, d) = ({m}, {d}), got shape {tuple(x2.shape)}")
    vector = G.dim() == 1
    Gm, Vm = (G.unsqueeze(1), V.unsqueeze(1)) if vector else (G, V)
    if Gm.dim() != 2 or Gm.shape[0] != n:
        raise ValueError(f"G must have shape (n, t) or (n,) with n={n}, got shape {tuple(G.shape)}")
    if Vm.shape != (m, Gm.shape[1]):
        want = f"({m},)" if vector else f"({m}, {Gm.shape[1]})"
        raise ValueError(f"V must have shape {want} (x2's rows, G's columns), got shape {tuple(V.shape)}")
    ls = _as_param(lengthscale, "lengthscale", K)
    s = _as_param(outputscale, "outputscale", K)
    if ls.numel() not in (1, d):
        raise ValueError(f"lengthscale must have 1 or d={d} elements, got shape {tuple(ls.shape)}")
    if s.numel() != 1:
        raise ValueError(f"outputscale must have one element, got shape {tuple(s.shape)}")
    if check_values:
        _check_lengthscale_positive(ls)
    if K.is_cuda and not _CUDA_OPS:
        raise RuntimeError("K is a CUDA tensor but gpfast's CUDA ops cannot be built here")
    if kernel.startswith("tc"):
        t = Gm.shape[1]
        if not K.is_cuda or K.dtype != torch.float32 or not 1 <= d <= 32 or t > 40 or (K.stride(1) != 1 and m > 1):
            raise ValueError(
                f"stored_backward: the kernel {kernel!r} takes a float32 CUDA K with column stride 1, 1 <= d <= 32 "
                f"and t <= 40, got {K.dtype} on {K.device}, strides {K.stride()}, d={d}, t={t}"
            )
    gl, gs = _stored_bwd_op(K, x1, x2, ls.reshape(-1).expand(d), s.reshape(()), Gm, Vm, kernel)
    return gl.sum().reshape(ls.shape) if ls.numel() == 1 else gl.reshape(ls.shape), gs.reshape(s.shape)


@torch.no_grad()
def stored_backward(K, x1, x2, lengthscale, outputscale, G, V, *, check_values: bool = True):
    """Gradients of ``sum(G * (K @ V))`` for the lengthscale and the outputscale, where K (n, m) is the RBF
    covariance ``rbf_covariance(x1, x2, lengthscale, outputscale)`` already in memory: the training engine's
    backward with a stored K, which recomputes no exponential.

    Parameters
    ----------
    K : torch.Tensor of shape (n, m)
        The covariance at these hyperparameters (noise-free), float32 or float64, any row stride.
    x1, x2 : torch.Tensor of shape (n, d) and (m, d)
        The points of K's rows and columns.
    lengthscale : float or torch.Tensor with 1 or d elements
    outputscale : float or torch.Tensor with 1 element
    G, V : torch.Tensor of shape (n, t) and (m, t), or (n,) and (m,)
    check_values : bool, default=True
        Check that the lengthscale is positive (a device read on CUDA).

    Returns
    -------
    (glengthscale, goutputscale), each of its input's shape (0-dim for a float).

    Notes
    -----
    With M = (G V^T) o K and z = x / l, ``d/dl_k = sum_ij M_ij (z_ik - z_jk)^2 / l_k`` and ``d/ds = sum(M) / s``.
    On CUDA, float32 with d <= 32 and t <= 40 runs a tensor-core kernel (weights in 3xTF32, everything after
    them in float64; for K(x, x), x1 and x2 one tensor, each pair once, t <= 20); other cases, and the CPU, take
    float64 ATen operations. The result is the gradient for the K given, its rounding included; for K(x, x) the
    kernel reads each pair once, from the block upper triangle, so K is taken as symmetric (a forward's K_ij and
    K_ji can differ in their last bits).
    """
    return _stored_backward(K, x1, x2, lengthscale, outputscale, G, V, "auto", check_values)


@torch.no_grad()
def _stored_backward_kernel(K, x1, x2, lengthscale, outputscale, G, V, kernel: str):
    """:func:`stored_backward` by a named kernel (``STORED_BACKWARD_KERNELS``), for tests and benchmarks."""
    return _stored_backward(K, x1, x2, lengthscale, outputscale, G, V, kernel, True)


@torch.no_grad()
def _rbf_covariance_symmetric(x: torch.Tensor, lengthscale: torch.Tensor, outputscale: torch.Tensor, pitch: int):
    """K(x, x) for x (n, d) on CUDA in the first n columns of an (n, pitch) buffer (the rest unwritten), for the
    training engine's stored K with rows padded to 16 bytes: lengthscale (d,) or (1,), outputscale 0-dim, of x's
    dtype and device. For float32 with 17 <= d <= 32 each pair is computed once and mirrored."""
    _ensure_loaded()
    if not (isinstance(x, torch.Tensor) and x.is_cuda and x.dim() == 2 and x.dtype in _FLOATS):
        what = f"{x.dtype} of shape {tuple(x.shape)} on {x.device}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"_rbf_covariance_symmetric: x must be a float32 or float64 CUDA tensor (n, d), got {what}")
    n, d = x.shape
    if not isinstance(pitch, int) or pitch < n:
        raise ValueError(f"_rbf_covariance_symmetric: pitch must be an int >= n = {n}, got {pitch!r}")
    ls = lengthscale.reshape(-1).expand(d).to(x.dtype)
    return _cov_sym_op(x, ls, outputscale.reshape(()).to(x.dtype), pitch)
