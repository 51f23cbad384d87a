"""The Python face of gpfast's compiled ops.

``rbf_covariance`` and ``rbf_matmul`` check and broadcast their arguments, then call the custom ops
``torch.ops.gpfast.*`` (schemas in ``csrc/ops.cpp``; CPU and CUDA kernels in ``csrc/cpu`` and ``csrc/cuda``).
``rbf_covariance_backward`` and ``rbf_matmul_backward`` give the ops' gradients directly, without an autograd graph.
Importing this module builds (once, then from a cache; see :mod:`gpfast._build`) and loads the compiled library, and
registers the ops' fake (meta) implementations, for ``torch.compile``, and their autograd formulas.
"""

from __future__ import annotations

import math
import warnings
from numbers import Real

import torch

from gpfast import _build

__all__ = [
    "dense_matmul",
    "rbf_covariance",
    "rbf_covariance_backward",
    "rbf_matmul",
    "rbf_matmul_backward",
    "stored_backward",
    "symmetric_matmul",
]


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

    @torch.library.register_fake("gpfast::_pivot_block")
    def _pivot_block_fake(rows, cand, d, floor, b):
        return rows.new_empty(b, dtype=torch.long), rows.new_empty(b, b), rows.new_empty(b, b)

    @torch.library.register_fake("gpfast::_pivot_select")
    def _pivot_select_fake(d, Lb, cand, piv, c):
        return d.new_empty(c, dtype=torch.long)

    @torch.library.register_fake("gpfast::rbf_matmul_backward")
    def _mm_bwd_fake(grad, x1, x2, lengthscale, outputscale, v, x_grads=True):
        return _bwd_fake(x1, x2, lengthscale, outputscale, x_grads)

    @torch.library.register_fake("gpfast::_rbf_covariance_backward_from_k")
    def _cov_bwd_k_fake(grad, K, x1, x2, lengthscale, outputscale, x_grads=True, kernel="auto"):
        return _bwd_fake(x1, x2, lengthscale, outputscale, x_grads)

    def _cov_setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def _cov_backward(ctx, grad):
        # The exponentials are recomputed, not read from the forward's K: a gradient from the float32 K fails the
        # accuracy rule on the outputscale's sum on about 1 draw in 130 (experiments/backward_f32_probe.py,
        # kernel "from_k"), since K's own rounding enters each of its n m terms.
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
            grads = ops.rbf_matmul_backward(grad, x1, x2, lengthscale, outputscale, v, need[0] or need[1])
            gx1, gx2, gl, gs = (g if wanted else None for g, wanted in zip(grads, need))
        if need[4]:
            gv = ops.rbf_matmul(x2, x1, lengthscale, outputscale, grad)  # K(x1, x2)^T G = K(x2, x1) G
        return gx1, gx2, gl, gs, gv

    torch.library.register_autograd("gpfast::rbf_matmul", _mm_backward, setup_context=_mm_setup)


def _register_stored_parts() -> None:
    """The fakes of the ops on a stored K, and dense_matmul's autograd."""

    @torch.library.register_fake("gpfast::stored_backward")
    def _stored_bwd_fake(K, x1, x2, lengthscale, outputscale, G, V, kernel="auto"):
        return torch.empty_like(lengthscale), torch.empty_like(outputscale)

    @torch.library.register_fake("gpfast::_rbf_covariance_symmetric")
    def _cov_sym_fake(x, lengthscale, outputscale, pitch):
        return x.new_empty(x.shape[0], pitch)

    @torch.library.register_fake("gpfast::dense_matmul")
    def _dense_fake(K, V):
        return K.new_empty(K.shape[0], V.shape[1])

    @torch.library.register_fake("gpfast::_dense_matmul_half")
    def _dense_half_fake(K, V):
        return V.new_empty(K.shape[0], V.shape[1])

    @torch.library.register_fake("gpfast::symmetric_matmul")
    def _sym_fake(K, V, block=0, stages=0):
        return K.new_empty(K.shape[0], V.shape[1])

    def _dense_setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def _dense_backward(ctx, grad):
        K, V = ctx.saved_tensors
        need = ctx.needs_input_grad
        return (grad @ V.t() if need[0] else None), (K.t() @ grad if need[1] else None)

    torch.library.register_autograd("gpfast::dense_matmul", _dense_backward, setup_context=_dense_setup)


def _bwd_fake(x1, x2, lengthscale, outputscale, x_grads):
    gx1, gx2 = (torch.empty_like(x1), torch.empty_like(x2)) if x_grads else (x1.new_empty(0), x1.new_empty(0))
    return gx1, gx2, torch.empty_like(lengthscale), torch.empty_like(outputscale)


def _load() -> Exception | None:
    """Build and load the library and register its Python parts. A failed build is returned, not raised, and raised
    again by every call of an op: ``import gpfast`` and ``python -m gpfast.build --verbose`` keep working."""
    try:
        _build.load()
    except _build.BuildError as exc:
        warnings.warn(
            f"gpfast's compiled ops could not be built, so its ops will raise when called: {str(exc).splitlines()[0]}",
            RuntimeWarning,
            stacklevel=2,
        )
        return exc
    _register_python_parts()
    _register_stored_parts()
    return None


_LOAD_ERROR = _load()
_CUDA_OPS = _LOAD_ERROR is None and _build.cuda_build_possible()
if _LOAD_ERROR is None:  # the overloads themselves: calling them skips the packet's overload lookup (about 1 us)
    _cov_op = torch.ops.gpfast.rbf_covariance.default
    _cov_diag_op = torch.ops.gpfast.rbf_covariance_diag.default
    _cov_bwd_op = torch.ops.gpfast.rbf_covariance_backward.default
    _mm_op = torch.ops.gpfast.rbf_matmul.default
    _mm_bwd_op = torch.ops.gpfast.rbf_matmul_backward.default


def _ensure_loaded() -> None:
    if _LOAD_ERROR is not None:
        raise _build.BuildError(str(_LOAD_ERROR)) from _LOAD_ERROR


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
        raise ValueError(
            f"x1 has d={x1.shape[-1]} features (shape {tuple(x1.shape)}) but x2 has d={x2.shape[-1]} "
            f"(shape {tuple(x2.shape)}); the last dims must match"
        )
    if x1.is_cuda and not _CUDA_OPS:
        raise RuntimeError(
            "x1 is a CUDA tensor but gpfast's CUDA ops cannot be built here (torch without CUDA, "
            "or no nvcc found); move the inputs to the CPU or install the CUDA toolkit"
        )


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


def _check_lengthscale_positive(lengthscale: torch.Tensor) -> None:
    if torch.compiler.is_compiling() or _capturing(lengthscale):
        return
    low = lengthscale.min().item() if lengthscale.numel() else 1.0  # one reduction: NaN fails the test below too
    if not low > 0:
        raise ValueError(f"lengthscale must be positive, got min {low:.6g} (shape {tuple(lengthscale.shape)})")


def _canonicalize(x1, x2, lengthscale, outputscale, check_values: bool):
    """Broadcast to the ops' canonical (B, n, d), (B, m, d), (B, d), (B,) and return the batch shape."""
    _check_points(x1, x2)
    d = x1.shape[-1]
    lengthscale = _as_param(lengthscale, "lengthscale", x1)
    outputscale = _as_param(outputscale, "outputscale", x1)
    if lengthscale.dim() >= 1 and lengthscale.shape[-1] not in (1, d):
        raise ValueError(
            f"lengthscale must be broadcastable to (..., 1, d) with d={d}: its last dim must be 1 "
            f"(shared) or {d} (ARD), got shape {tuple(lengthscale.shape)}"
        )
    if lengthscale.dim() >= 2 and lengthscale.shape[-2] != 1:
        raise ValueError(
            f"lengthscale must be broadcastable to (..., 1, d): its second-to-last dim must be 1, got "
            f"shape {tuple(lengthscale.shape)}"
        )
    l_batch = lengthscale.shape[:-2] if lengthscale.dim() >= 2 else torch.Size()
    try:
        batch = broadcast_shapes(x1.shape[:-2], x2.shape[:-2], l_batch, outputscale.shape)
    except RuntimeError:
        raise ValueError(
            f"batch shapes do not broadcast: x1 {tuple(x1.shape[:-2])}, x2 {tuple(x2.shape[:-2])}, "
            f"lengthscale {tuple(l_batch)}, outputscale {tuple(outputscale.shape)}"
        ) from None
    if check_values:
        _check_lengthscale_positive(lengthscale)
    B = math.prod(batch)
    n, m = x1.shape[-2], x2.shape[-2]
    x1c = x1.expand(*batch, n, d).reshape(B, n, d)
    x2c = x2.expand(*batch, m, d).reshape(B, m, d)
    lc = lengthscale.reshape(*l_batch, 1, -1).expand(*batch, 1, d).reshape(B, d)
    sc = outputscale.expand(batch).reshape(B)
    return x1c, x2c, lc, sc, batch


def _canonicalize_matmul(x1, x2, lengthscale, outputscale, v, check_values: bool):
    """:func:`_canonicalize` for K @ v, with v's batch dims broadcast too: also returns v as (B, m, t) and whether it
    was a vector."""
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
    return x1c, x2c, lc, sc, vc, batch, vector


_FLOATS = (torch.float32, torch.float64)


def _fast_canonical(x1, x2, lengthscale, outputscale):
    """The canonical arguments by views alone when they are canonical up to the batch, else None (and the general
    path checks and broadcasts them). Fast: x1 (n, d), x2 (m, d), lengthscale (d,), (1, d), (1,) or (1, 1),
    outputscale a 0-dim tensor or a float; or x1 (B, n, d), x2 (B, m, d), lengthscale (B, 1, d) or (B, 1, 1),
    outputscale (B,); one float dtype and one device. At a tiny CPU shape the whole call drops from 51 to 21 us
    (rbf_covariance; the raw op alone takes 10)."""
    if not (isinstance(x1, torch.Tensor) and isinstance(x2, torch.Tensor) and isinstance(lengthscale, torch.Tensor)):
        return None
    dtype, device, ndim = x1.dtype, x1.device, x1.dim()
    if dtype not in _FLOATS or x2.dtype != dtype or lengthscale.dtype != dtype or x2.dim() != ndim:
        return None
    if x2.device != device or lengthscale.device != device or (x1.is_cuda and not _CUDA_OPS):
        return None
    d, lshape = x1.shape[-1], lengthscale.shape
    if x2.shape[-1] != d or lshape[-1:] not in ((d,), (1,)):  # lshape[-1:] is () for a 0-dim lengthscale
        return None
    if ndim == 2:
        if lengthscale.dim() == 2 and lshape[0] != 1 or lengthscale.dim() > 2:
            return None
        if isinstance(outputscale, torch.Tensor):
            if outputscale.dim() != 0 or outputscale.dtype != dtype or outputscale.device != device:
                return None
            sc = outputscale.view(1)
        elif type(outputscale) is float:
            sc = torch.full((1,), outputscale, dtype=dtype, device=device)
        else:
            return None
        x1c, x2c, lc = x1.unsqueeze(0), x2.unsqueeze(0), lengthscale.view(1, -1)
    elif ndim == 3:
        B = x1.shape[0]
        if x2.shape[0] != B or lengthscale.dim() != 3 or lshape[0] != B or lshape[1] != 1:
            return None
        if (
            not isinstance(outputscale, torch.Tensor)
            or outputscale.shape != (B,)
            or outputscale.dtype != dtype
            or outputscale.device != device
        ):
            return None
        x1c, x2c, lc, sc = x1, x2, lengthscale.reshape(B, -1), outputscale
    else:
        return None
    if lshape[-1] != d:
        lc = lc.expand(lc.shape[0], d)
    return x1c, x2c, lc, sc


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
    fast = _fast_canonical(x1, x2, lengthscale, outputscale)
    if fast is None:
        x1c, x2c, lc, sc, batch = _canonicalize(x1, x2, lengthscale, outputscale, check_values)
    else:
        x1c, x2c, lc, sc = fast
        batch = x1.shape[:-2]
        if check_values:
            _check_lengthscale_positive(lengthscale)
    n, m = x1c.shape[1], x2c.shape[1]
    if diag:
        if n != m:
            raise ValueError(f"diag=True needs x1 and x2 with the same number of rows, got n={n} and m={m}")
        out = _cov_diag_op(x1c, x2c, lc, sc)
        return out if fast is not None and len(batch) == 1 else out.reshape(*batch, n)
    out = _cov_op(x1c, x2c, lc, sc)
    return out if fast is not None and len(batch) == 1 else out.reshape(*batch, n, m)


def rbf_matmul(x1, x2, lengthscale, outputscale, v, *, check_values: bool = True):
    """``rbf_covariance(x1, x2, lengthscale, outputscale) @ v`` without ever storing the covariance.

    x1 (..., n, d), x2 (..., m, d), lengthscale and outputscale as in :func:`rbf_covariance`, v (..., m, t) or (m,).
    Returns (..., n, t) (or (..., n) for a vector v); differentiable in all five inputs, with matrix-free
    gradients.
    """
    _ensure_loaded()
    fast = _fast_canonical(x1, x2, lengthscale, outputscale)
    if fast is not None and isinstance(v, torch.Tensor) and v.dtype == x1.dtype and v.device == x1.device:
        x1c, x2c, lc, sc = fast
        m = x2c.shape[1]
        if x1.dim() == 2 and v.dim() == 2 and v.shape[0] == m:
            if check_values:
                _check_lengthscale_positive(lengthscale)
            return _mm_op(x1c, x2c, lc, sc, v.unsqueeze(0)).squeeze(0)
        if x1.dim() == 2 and v.dim() == 1 and v.shape[0] == m:
            if check_values:
                _check_lengthscale_positive(lengthscale)
            return _mm_op(x1c, x2c, lc, sc, v.view(1, m, 1)).view(x1c.shape[1])
        if x1.dim() == 3 and v.dim() == 3 and v.shape[0] == x1c.shape[0] and v.shape[1] == m:
            if check_values:
                _check_lengthscale_positive(lengthscale)
            return _mm_op(x1c, x2c, lc, sc, v)
    x1c, x2c, lc, sc, vc, batch, vector = _canonicalize_matmul(x1, x2, lengthscale, outputscale, v, check_values)
    out = _mm_op(x1c, x2c, lc, sc, vc).reshape(*batch, x1c.shape[1], vc.shape[2])
    return out.squeeze(-1) if vector else out


# --------------------------------------------------------------------------------------------------------------
# gradients without autograd, for gpfast's own training engine


def _param_shape(value) -> torch.Size:
    return value.shape if isinstance(value, torch.Tensor) else torch.Size()


def _lengthscale_grad(gl: torch.Tensor, lengthscale, batch) -> torch.Tensor:
    """(B, d) -> the shape of the lengthscale given, summed over the dims it was broadcast along."""
    shape = _param_shape(lengthscale)
    l_batch = shape[:-2] if len(shape) >= 2 else torch.Size()
    return gl.reshape(*batch, 1, gl.shape[-1]).sum_to_size(*l_batch, 1, shape[-1] if shape else 1).reshape(shape)


def _grads_to_inputs(grads, x1, x2, lengthscale, outputscale, batch, x_grads: bool):
    gx1, gx2, gl, gs = grads
    if x_grads:
        gx1 = gx1.reshape(*batch, *gx1.shape[1:]).sum_to_size(x1.shape)
        gx2 = gx2.reshape(*batch, *gx2.shape[1:]).sum_to_size(x2.shape)
    else:
        gx1 = gx2 = None
    return (
        gx1,
        gx2,
        _lengthscale_grad(gl, lengthscale, batch),
        gs.reshape(batch).sum_to_size(_param_shape(outputscale)),
    )


def _canonical_grad(grad, shape, like: torch.Tensor) -> torch.Tensor:
    """The incoming gradient broadcast to the op's output shape (*batch, rows, cols), flattened to (B, rows, cols)."""
    if not isinstance(grad, torch.Tensor):
        raise TypeError(f"grad must be a torch.Tensor of the output's shape {tuple(shape)}, got {type(grad).__name__}")
    if grad.dtype != like.dtype:
        raise TypeError(f"grad has dtype {grad.dtype} but x1 has {like.dtype}; pass them in one dtype")
    if grad.device != like.device:
        raise ValueError(f"grad is on {grad.device} but x1 is on {like.device}; put them on one device")
    try:
        if broadcast_shapes(grad.shape, shape) != shape:
            raise RuntimeError
    except RuntimeError:
        raise ValueError(
            f"grad must have the output's shape {tuple(shape)} (or broadcast to it), got shape {tuple(grad.shape)}"
        ) from None
    return grad.expand(shape).reshape(-1, *shape[-2:])


@torch.no_grad()
def rbf_covariance_backward(grad, x1, x2, lengthscale, outputscale, *, x_grads: bool = True):
    """Gradients of ``sum(grad * rbf_covariance(x1, x2, lengthscale, outputscale))``, without an autograd graph.

    Arguments as in :func:`rbf_covariance`, and grad (..., n, m) of the covariance's shape. Returns
    ``(gx1, gx2, glengthscale, goutputscale)``, each of its input's shape (summed over the dims it was broadcast
    along; a 0-dim tensor for a float). With ``x_grads=False`` only the lengthscale and outputscale gradients are
    computed (the gradient mask) and gx1, gx2 are None.
    """
    _ensure_loaded()
    x1c, x2c, lc, sc, batch = _canonicalize(x1, x2, lengthscale, outputscale, False)
    G = _canonical_grad(grad, torch.Size((*batch, x1c.shape[1], x2c.shape[1])), x1c)
    grads = _cov_bwd_op(G, x1c, x2c, lc, sc, x_grads)
    return _grads_to_inputs(grads, x1, x2, lengthscale, outputscale, batch, x_grads)


@torch.no_grad()
def rbf_matmul_backward(grad, x1, x2, lengthscale, outputscale, v, *, x_grads: bool = True):
    """Gradients of ``sum(grad * rbf_matmul(x1, x2, lengthscale, outputscale, v))`` for x1, x2, the lengthscale and
    the outputscale, without an autograd graph and without the forward product.

    Arguments as in :func:`rbf_matmul`, and grad (..., n, t) (or (..., n) for a vector v) of the product's shape.
    Returns ``(gx1, gx2, glengthscale, goutputscale)``, each of its input's shape (summed over the dims it was
    broadcast along; a 0-dim tensor for a float). With ``x_grads=False`` only the lengthscale and outputscale
    gradients are computed (the gradient mask: the pass for the point gradients does not run) and gx1, gx2 are None.
    (The gradient for v is ``rbf_matmul(x2, x1, lengthscale, outputscale, grad)``.)
    """
    _ensure_loaded()
    x1c, x2c, lc, sc, vc, batch, vector = _canonicalize_matmul(x1, x2, lengthscale, outputscale, v, False)
    if vector and isinstance(grad, torch.Tensor):
        grad = grad.unsqueeze(-1)
    G = _canonical_grad(grad, torch.Size((*batch, x1c.shape[1], vc.shape[2])), x1c)
    grads = _mm_bwd_op(G, x1c, x2c, lc, sc, vc, x_grads)
    return _grads_to_inputs(grads, x1, x2, lengthscale, outputscale, batch, x_grads)


# the ops on a stored K and the kernel variants live in modules of their own (the size of this one); they are part
# of this module's face
from gpfast._kernel_variants import (  # noqa: E402, F401
    COVARIANCE_BACKWARD_KERNELS,
    COVARIANCE_KERNELS,
    COVARIANCE_TC_KERNELS,
    FROM_K_KERNELS,
    MATMUL_KERNELS,
    MATMUL_SYMMETRIC_KERNELS,
    _rbf_covariance_backward_kernel,
    _rbf_covariance_kernel,
    _rbf_matmul_backward_kernel,
    _rbf_matmul_kernel,
)
from gpfast._stored_ops import (  # noqa: E402, F401
    STORED_BACKWARD_KERNELS,
    SYMMETRIC_BLOCKS,
    _rbf_covariance_symmetric,
    _stored_backward_kernel,
    _symmetric_matmul_block,
    dense_matmul,
    stored_backward,
    symmetric_matmul,
)
