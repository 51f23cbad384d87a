"""The fused K @ V backward as a function: gradients of ``sum(grad * (K(x1, x2) @ v))``, no forward product.

:func:`rbf_matmul_backward` is :func:`gpfast.ops.rbf_matmul_backward` where that public wrapper exists (branch
``cpu-kernels``, issue 14); until it lands here, the same signature on the compiled op
``torch.ops.gpfast.rbf_matmul_backward`` with the shapes brought to its canonical form and the gradients summed
back to the shapes of the arguments. The matrix-free operator (:class:`gpfast.kernels.RBFLinearOperator`) and the
training engine (:mod:`gpfast.train`) both call it, so the switch to the wrapper happens in this one place.
"""

from __future__ import annotations

import math

import torch

from gpfast import ops

__all__ = ["rbf_matmul_backward"]


def rbf_matmul_backward(grad, x1, x2, lengthscale, outputscale, v, *, x_grads: bool = True):
    """Gradients ``(gx1, gx2, gl, gs)`` of ``sum(grad * (rbf_covariance(x1, x2, l, s) @ v))``.

    x1 (..., n, d), x2 (..., m, d), lengthscale broadcastable to (..., 1, d), outputscale to (...), v (..., m, t)
    or (m,), grad (..., n, t) or (n,). Each gradient has the shape of its argument (batch dims summed where the
    argument was broadcast); with ``x_grads=False`` the point gradients are not wanted and come back as None.
    """
    public = getattr(ops, "rbf_matmul_backward", None)
    if public is not None:
        return public(grad, x1, x2, lengthscale, outputscale, v, x_grads=x_grads)
    ops._ensure_loaded()
    if v.dim() == 1:
        v, grad = v.unsqueeze(-1), grad.unsqueeze(-1)
    lengthscale = ops._as_param(lengthscale, "lengthscale", x1)
    outputscale = ops._as_param(outputscale, "outputscale", x1)
    x1c, x2c, lc, sc, batch = ops._canonicalize(x1, x2, lengthscale, outputscale, False)
    batch = ops.broadcast_shapes(batch, v.shape[:-2], grad.shape[:-2])
    B, n, m, d, t = math.prod(batch), x1.shape[-2], x2.shape[-2], x1.shape[-1], v.shape[-1]
    if B != x1c.shape[0]:  # v or grad carry extra batch dims: broadcast the points too
        x1c, x2c, lc, sc, _ = ops._canonicalize(
            x1.expand(*batch, n, d), x2.expand(*batch, m, d), lengthscale, outputscale, False
        )
    gc = grad.expand(*batch, n, t).reshape(B, n, t)
    vc = v.expand(*batch, m, t).reshape(B, m, t)
    gx1, gx2, gl, gs = torch.ops.gpfast.rbf_matmul_backward(gc, x1c, x2c, lc, sc, vc)
    gl = gl.reshape(*batch, 1, d)
    if lengthscale.dim() < 2:  # (d,), (1,) or a scalar: no row dim of its own
        gl = gl.reshape(*batch, d)
    gl = gl.sum_to_size(lengthscale.shape) if lengthscale.dim() else gl.sum()
    gs = gs.reshape(batch).sum_to_size(outputscale.shape) if outputscale.dim() else gs.sum()
    if not x_grads:
        return None, None, gl, gs
    return (gx1.reshape(*batch, n, d).sum_to_size(x1.shape), gx2.reshape(*batch, m, d).sum_to_size(x2.shape), gl, gs)
