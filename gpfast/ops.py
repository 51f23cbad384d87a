"""The Python face of gpfast's compiled ops.

``rbf_covariance`` and ``rbf_matmul`` check and broadcast their arguments, then call the custom ops
``torch.ops.gpfast.*`` (schemas in ``csrc/ops.cpp``; CPU and CUDA kernels in ``csrc/cpu`` and ``csrc/cuda``).
This module registers their fake (meta) implementations, for ``torch.compile``, and their autograd formulas.
The compiled library is built and loaded on the first call (see :mod:`gpfast._build`).
"""

from __future__ import annotations

import math
from numbers import Real

import torch

from gpfast import _build

__all__ = ["rbf_covariance", "rbf_matmul"]

_registered = False


def _ensure_loaded() -> None:
    global _registered
    if _registered:
        return
    _build.load()
    _register_python_parts()
    _registered = True


def _register_python_parts() -> None:
    ops = torch.ops.gpfast

    @torch.library.register_fake("gpfast::rbf_covariance")
    def _cov_fake(x1, x2, lengthscale, outputscale):
        return x1.new_empty(x1.shape[0], x1.shape[1], x2.shape[1])

    @torch.library.register_fake("gpfast::rbf_covariance_backward")
    def _cov_bwd_fake(grad, x1, x2, lengthscale, outputscale, x_grads=True):
        return _bwd_fake(x1, x2, lengthscale, outputscale, x_grads)

    @torch.library.register_fake("gpfast::rbf_matmul")
    def _mm_fake(x1, x2, lengthscale, outputscale, v):
        return x1.new_empty(x1.shape[0], x1.shape[1], v.shape[2])

    @torch.library.register_fake("gpfast::rbf_matmul_backward")
    def _mm_bwd_fake(grad, x1, x2, lengthscale, outputscale, v, x_grads=True):
        return _bwd_fake(x1, x2, lengthscale, outputscale, x_grads)

    def _cov_setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def _cov_backward(ctx, grad):
        x1, x2, lengthscale, outputscale = ctx.saved_tensors
        need = ctx.needs_input_grad
        grads = ops.rbf_covariance_backward(grad, x1, x2, lengthscale, outputscale, need[0] or need[1])
        return tuple(g if wanted else None for g, wanted in zip(grads, need))

    torch.library.register_autograd("gpfast::rbf_covariance", _cov_backward, setup_context=_cov_setup)

    def _mm_setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def _mm_backward(ctx, grad):
        x1, x2, lengthscale, outputscale, v = ctx.saved_tensors
        need = ctx.needs_input_grad
        gx1 = gx2 = gl = gs = gv = None
        if any(need[:4]):
            gx1, gx2, gl, gs = (g if wanted else None for g, wanted in zip(
                ops.rbf_matmul_backward(grad, x1, x2, lengthscale, outputscale, v, need[0] or need[1]), need))
        if need[4]:
            gv = ops.rbf_matmul(x2, x1, lengthscale, outputscale, grad)  # K(x1, x2)^T G = K(x2, x1) G
        return gx1, gx2, gl, gs, gv

    torch.library.register_autograd("gpfast::rbf_matmul", _mm_backward, setup_context=_mm_setup)


def _bwd_fake(x1, x2, lengthscale, outputscale, x_grads):
    gx1, gx2 = (torch.empty_like(x1), torch.empty_like(x2)) if x_grads else (x1.new_empty(0), x1.new_empty(0))
    return gx1, gx2, torch.empty_like(lengthscale), torch.empty_like(outputscale)


# --------------------------------------------------------------------------------------------------------------
# argument checks and broadcasting: one place for the shape rules of both ops


def _as_param(value, name: str, like: torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {value.dtype}")
        if value.dtype != like.dtype:
            raise TypeError(f"{name} has dtype {value.dtype} but x1 has {like.dtype}; pass them in one dtype")
        if value.device != like.device:
            raise ValueError(f"{name} is on {value.device} but x1 is on {like.device}; put them on one device")
        return value
    if isinstance(value, Real) and not isinstance(value, bool):
        return torch.tensor(float(value), dtype=like.dtype, device=like.device)
    raise TypeError(f"{name} must be a tensor or a real number, got {type(value).__name__}")


def _check_points(x1, x2) -> None:
    for name, x in (("x1", x1), ("x2", x2)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape (..., n, d), got {type(x).__name__}")
        if x.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{name} must be float32 or float64, got dtype {x.dtype}")
        if x.dim() < 2:
            raise ValueError(f"{name} must have shape (..., n, d) with at least 2 dims, got shape {tuple(x.shape)}")
    if x2.dtype != x1.dtype:
        raise TypeError(f"x2 has dtype {x2.dtype} but x1 has {x1.dtype}; pass them in one dtype")
    if x2.device != x1.device:
        raise ValueError(f"x2 is on {x2.device} but x1 is on {x1.device}; put them on one device")
    if x1.shape[-1] != x2.shape[-1]:
        raise ValueError(f"x1 has d={x1.shape[-1]} features (shape {tuple(x1.shape)}) but x2 has d={x2.shape[-1]} "
                         f"(shape {tuple(x2.shape)}); the last dims must match")
    if x1.is_cuda and not _build.cuda_build_possible():
        raise RuntimeError("x1 is a CUDA tensor but gpfast's CUDA ops cannot be built here (torch without CUDA, "
                           "or no nvcc found); move the inputs to the CPU or install the CUDA toolkit")


def broadcast_shapes(*shapes) -> torch.Size:
    """``torch.broadcast_shapes`` for plain integer shapes, without its cost: in torch 2.13 it goes through
    ``torch._refs`` and takes about 70 us a call on the CPU, more than the whole op at small sizes. Under
    ``torch.compile`` (symbolic shapes) it defers to torch. Raises RuntimeError when the shapes do not broadcast."""
    if torch.compiler.is_compiling() or not all(type(v) is int for shape in shapes for v in shape):
        return torch.broadcast_shapes(*shapes)  # symbolic sizes
    ndim = max((len(s) for s in shapes), default=0)
    out = [1] * ndim
    for shape in shapes:
        offset = ndim - len(shape)
        for i, size in enumerate(shape):
            have = out[offset + i]
            if size == have or size == 1:
                continue
            if have != 1:
                raise RuntimeError(f"shape {tuple(shape)} does not broadcast to {tuple(out)}")
            out[offset + i] = size
    return torch.Size(out)


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _canonicalize(x1, x2, lengthscale, outputscale, check_values: bool):
    """Broadcast to the ops' canonical (B, n, d), (B, m, d), (B, d), (B,) and return the batch shape."""
    _check_points(x1, x2)
    d = x1.shape[-1]
    lengthscale = _as_param(lengthscale, "lengthscale", x1)
    outputscale = _as_param(outputscale, "outputscale", x1)
    if lengthscale.dim() >= 1 and lengthscale.shape[-1] not in (1, d):
        raise ValueError(f"lengthscale must be broadcastable to (..., 1, d) with d={d}: its last dim must be 1 "
                         f"(shared) or {d} (ARD), got shape {tuple(lengthscale.shape)}")
    if lengthscale.dim() >= 2 and lengthscale.shape[-2] != 1:
        raise ValueError(f"lengthscale must be broadcastable to (..., 1, d): its second-to-last dim must be 1, got "
                         f"shape {tuple(lengthscale.shape)}")
    l_batch = lengthscale.shape[:-2] if lengthscale.dim() >= 2 else torch.Size()
    try:
        batch = broadcast_shapes(x1.shape[:-2], x2.shape[:-2], l_batch, outputscale.shape)
    except RuntimeError:
        raise ValueError(f"batch shapes do not broadcast: x1 {tuple(x1.shape[:-2])}, x2 {tuple(x2.shape[:-2])}, "
                         f"lengthscale {tuple(l_batch)}, outputscale {tuple(outputscale.shape)}") from None
    if check_values and not torch.compiler.is_compiling() and not _capturing(lengthscale):
        if lengthscale.numel() and not bool((lengthscale > 0).all()):
            raise ValueError(f"lengthscale must be positive, got min {lengthscale.min().item():.6g} "
                             f"(shape {tuple(lengthscale.shape)})")
    B = math.prod(batch)
    n, m = x1.shape[-2], x2.shape[-2]
    x1c = x1.expand(*batch, n, d).reshape(B, n, d)
    x2c = x2.expand(*batch, m, d).reshape(B, m, d)
    lc = lengthscale.reshape(*l_batch, 1, -1).expand(*batch, 1, d).reshape(B, d)
    sc = outputscale.expand(batch).reshape(B)
    return x1c, x2c, lc, sc, batch


def rbf_covariance(x1, x2, lengthscale, outputscale=1.0, diag: bool = False, *, check_values: bool = True):
    """RBF covariance ``K = outputscale * exp(-0.5 * sum_d ((x1 - x2) / lengthscale)^2)``, fused.

    Parameters
    ----------
    x1 : Tensor (..., n, d)
    x2 : Tensor (..., m, d)
        float32 or float64, same dtype and device; batch dims broadcast.
    lengthscale : Tensor or float, broadcastable to (..., 1, d)
        One shared lengthscale (last dim 1) or one per feature (ARD, last dim d); must be positive.
    outputscale : Tensor or float, broadcastable to the batch shape (...)
    diag : bool
        Return ``K(x1_i, x2_i)`` for paired rows, shape (..., n) (needs n == m), as GPyTorch's ``diag=True``.
    check_values : bool
        Check that the lengthscale is positive (one device sync on CUDA; skipped under ``torch.compile`` and CUDA
        graph capture). Callers that constrain it positive, like :class:`gpfast.kernels.RBFKernel`, turn it off.

    Returns
    -------
    Tensor (..., n, m), or (..., n) when ``diag``; differentiable in all four inputs.
    """
    _ensure_loaded()
    x1c, x2c, lc, sc, batch = _canonicalize(x1, x2, lengthscale, outputscale, check_values)
    n, m = x1c.shape[1], x2c.shape[1]
    if diag:
        if n != m:
            raise ValueError(f"diag=True needs x1 and x2 with the same number of rows, got n={n} and m={m}")
        return torch.ops.gpfast.rbf_covariance_diag(x1c, x2c, lc, sc).reshape(*batch, n)
    return torch.ops.gpfast.rbf_covariance(x1c, x2c, lc, sc).reshape(*batch, n, m)


def rbf_matmul(x1, x2, lengthscale, outputscale, v, *, check_values: bool = True):
    """``rbf_covariance(x1, x2, lengthscale, outputscale) @ v`` without ever storing the covariance.

    x1 (..., n, d), x2 (..., m, d), lengthscale and outputscale as in :func:`rbf_covariance`, v (..., m, t) or (m,).
    Returns (..., n, t) (or (..., n) for a vector v); differentiable in all five inputs, with matrix-free
    gradients.
    """
    _ensure_loaded()
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"v must be a torch.Tensor of shape (..., m, t), got {type(v).__name__}")
    vector = v.dim() == 1
    if vector:
        v = v.unsqueeze(-1)
    x1c, x2c, lc, sc, batch = _canonicalize(x1, x2, lengthscale, outputscale, check_values)
    m = x2c.shape[1]
    if v.dtype != x1c.dtype:
        raise TypeError(f"v has dtype {v.dtype} but x1 has {x1c.dtype}; pass them in one dtype")
    if v.device != x1c.device:
        raise ValueError(f"v is on {v.device} but x1 is on {x1c.device}; put them on one device")
    if v.shape[-2] != m:
        raise ValueError(f"v must have m={m} rows (x2's row count), got shape {tuple(v.shape)}")
    try:
        batch = broadcast_shapes(batch, v.shape[:-2])
    except RuntimeError:
        raise ValueError(f"v's batch shape {tuple(v.shape[:-2])} does not broadcast with {tuple(batch)}") from None
    B = math.prod(batch)
    if B != x1c.shape[0]:  # v carries extra batch dims: broadcast the points too
        x1c, x2c, lc, sc, _ = _canonicalize(x1.expand(*batch, *x1.shape[-2:]), x2, lengthscale, outputscale, False)
    t = v.shape[-1]
    vc = v.expand(*batch, m, t).reshape(B, m, t)
    out = torch.ops.gpfast.rbf_matmul(x1c, x2c, lc, sc, vc).reshape(*batch, x1c.shape[1], t)
    return out.squeeze(-1) if vector else out
