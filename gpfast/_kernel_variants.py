"""The ops by a named kernel variant, for tests and benchmarks: ``_rbf_covariance_kernel``, ``_rbf_matmul_kernel``,
``_rbf_matmul_backward_kernel`` and ``_rbf_covariance_backward_kernel``. Part of :mod:`gpfast.ops`, which
re-exports them; a module of their own only for size.
"""

from __future__ import annotations

import torch

from gpfast.ops import _canonical_grad, _canonicalize, _canonicalize_matmul, _ensure_loaded, _grads_to_inputs


# The kernels of _rbf_covariance_kernel: row streaming by differences and by the norm expansion (d <= 32), the tiled
# one (any d), and the tensor-core one with the variants a sweep compares (float32, 8 < d <= 32).
COVARIANCE_TC_KERNELS = ("tc", "tc_mt2", "tc_w4")
COVARIANCE_KERNELS = ("diff", "expand", "tile", *COVARIANCE_TC_KERNELS)


@torch.no_grad()
def _rbf_covariance_kernel(x1, x2, lengthscale, outputscale, kernel: str, *, check_values: bool = True):
    """:func:`rbf_covariance` by a named CUDA kernel (``COVARIANCE_KERNELS``) whatever the shape, for tests and
    benchmarks. Arguments as in :func:`rbf_covariance` (the C++ op checks which kernels take which d and dtype);
    no autograd."""
    _ensure_loaded()
    if kernel not in COVARIANCE_KERNELS:
        raise ValueError(f"_rbf_covariance_kernel: kernel must be one of {COVARIANCE_KERNELS}, got {kernel!r}")
    x1c, x2c, lc, sc, batch = _canonicalize(x1, x2, lengthscale, outputscale, check_values)
    K = torch.ops.gpfast._rbf_covariance_kernel(x1c, x2c, lc, sc, kernel)
    return K.reshape(*batch, x1.shape[-2], x2.shape[-2])


# The kernels of _rbf_matmul_kernel: "cuda_cores", "tc" and the tensor-core variants a sweep compares (d <= 8, t <= 16;
# the default at d <= 8, 9 <= t <= 16 is "tc_bias_g2"'s instance, before it "tc_mt2w4b3"'s and "tc_isplit"'s).
MATMUL_KERNELS = (
    "cuda_cores", "tc", "tc_occ3", "tc_t32", "tc_vsplit", "tc_isplit", "tc_mt2", "tc_mt2w4", "tc_mt2w4b3", "tc_g2",
    "tc_mt2w4g2", "tc_bias", "tc_bias_g2", "tc_bias_g4", "tc_bias_g2b4",
)  # fmt: skip
# The kernels of _rbf_matmul_kernel for K(x, x) alone (x1 and x2 one tensor; d <= 8, t <= 16): each pair of points
# computed once and used for both of its products, with super-tiles of 1024 points and two blocks a multiprocessor,
# or of 512 points with three or two.
MATMUL_SYMMETRIC_KERNELS = ("tc_sym", "tc_sym512", "tc_sym512b2")


@torch.no_grad()
def _rbf_matmul_kernel(x1, x2, lengthscale, outputscale, v, kernel: str):
    """:func:`rbf_matmul` by a named CUDA kernel, for tests and benchmarks: ``"cuda_cores"`` (kv_fwd_kernel, any
    dtype), ``"tc"`` (tensor cores, float32, d <= 32 and t <= 32; what float32 gets by default at d <= 8, 9 <= t <= 16
    and at least 10^10 pairs), or a variant of it (``MATMUL_KERNELS``; d <= 8 and t <= 16), or for K(x, x) a
    symmetric one (``MATMUL_SYMMETRIC_KERNELS``; ``x1`` and ``x2`` the same tensor, d <= 8 and t <= 16). Arguments
    as in :func:`rbf_matmul`; no autograd.
    """
    _ensure_loaded()
    names = MATMUL_KERNELS + MATMUL_SYMMETRIC_KERNELS
    if kernel not in names:
        raise ValueError(f"_rbf_matmul_kernel: kernel must be one of {names}, got {kernel!r}")
    if kernel in MATMUL_SYMMETRIC_KERNELS and x1 is not x2:
        raise ValueError(
            f"_rbf_matmul_kernel: the kernel {kernel!r} computes K(x, x) @ v: pass one tensor as x1 and x2"
        )
    x1c, x2c, lc, sc, vc, batch, vector = _canonicalize_matmul(x1, x2, lengthscale, outputscale, v, False)
    d, t = x1c.shape[-1], vc.shape[-1]
    limit = {"cuda_cores": (32, None), "tc": (32, 32)}.get(kernel, (8, 16))
    if d > limit[0] or (limit[1] is not None and t > limit[1]):
        raise ValueError(
            f"_rbf_matmul_kernel: the kernel {kernel!r} takes d <= {limit[0]}"
            + (f" and t <= {limit[1]}" if limit[1] else "")
            + f", got d={d} and t={t}"
        )
    if kernel != "cuda_cores" and x1c.dtype != torch.float32:
        raise ValueError(f"_rbf_matmul_kernel: the tensor-core kernels take float32, got {x1c.dtype}")
    out = torch.ops.gpfast._rbf_matmul_kernel(x1c, x2c, lc, sc, vc, kernel).reshape(*batch, x1c.shape[1], t)
    return out.squeeze(-1) if vector else out


@torch.no_grad()
def _rbf_matmul_backward_kernel(grad, x1, x2, lengthscale, outputscale, v, kernel: str):
    """The lengthscale and outputscale gradients of :func:`rbf_matmul_backward` (``x_grads=False``) by a named CUDA
    kernel, for tests and benchmarks: ``"rows"`` (the float64 row pass), ``"bilinear4"`` or ``"bilinear8"``
    (tensor cores, float32 only, 4 or 8 warps a block; for K(x, x) each pair once, with the weights of both
    orders), or ``"bilinear4_nosym"`` and ``"bilinear8_nosym"`` (every ordered pair). Arguments as in
    :func:`rbf_matmul_backward` (d <= 32 and t <= 32); returns ``(glengthscale, goutputscale)``, each of its input's
    shape.
    """
    _ensure_loaded()
    x1c, x2c, lc, sc, vc, batch, vector = _canonicalize_matmul(x1, x2, lengthscale, outputscale, v, False)
    if vector and isinstance(grad, torch.Tensor):
        grad = grad.unsqueeze(-1)
    G = _canonical_grad(grad, torch.Size((*batch, x1c.shape[1], vc.shape[2])), x1c)
    d, t = x1c.shape[-1], vc.shape[-1]
    if d > 32 or t > 32:  # checked here first, so that the error is a ValueError as in the other wrappers
        raise ValueError(
            f"_rbf_matmul_backward_kernel: the fused kernels take d <= 32 and t <= 32, got d={d} and t={t}"
        )
    gl, gs = torch.ops.gpfast._rbf_matmul_backward_kernel(G, x1c, x2c, lc, sc, vc, kernel)
    _, _, gl, gs = _grads_to_inputs((None, None, gl, gs), x1, x2, lengthscale, outputscale, batch, False)
    return gl, gs


# The kernels of _rbf_covariance_backward_kernel.
# The C++ op's two ("rows64", "onepass32"), and the wrapper's two more from the forward's K (FROM_K_KERNELS).
COVARIANCE_BACKWARD_KERNELS = ("rows64", "onepass32")
FROM_K_KERNELS = ("from_k", "from_k_reference")


@torch.no_grad()
def _rbf_covariance_backward_kernel(grad, x1, x2, lengthscale, outputscale, kernel: str, *, x_grads: bool = True):
    """:func:`rbf_covariance_backward` by a named CUDA kernel, for tests and benchmarks: ``"rows64"`` (two row
    passes in float64 arithmetic, any dtype; the default for float64 and for d > 16) or ``"onepass32"`` (one pass
    over the pairs in float32 arithmetic where the accuracy rule allows it, the exponential and the outputscale's
    sum in float64; float32 with d <= 16, and its default there). d > 32 takes the dense float64 fall-back whichever
    is named. ``"from_k"`` and ``"from_k_reference"`` take the forward's K and the gradients from it (FP64 tensor
    cores, float32 with d <= 32; float64 ATen operations, any device), the exponentials not recomputed; only as
    accurate as that float32 K, they miss the accuracy rule on the outputscale on about 1 draw in 130 (H200, 14 of
    1,800). Arguments and results as in :func:`rbf_covariance_backward`.
    """
    _ensure_loaded()
    if kernel not in COVARIANCE_BACKWARD_KERNELS + FROM_K_KERNELS:
        raise ValueError(
            "_rbf_covariance_backward_kernel: kernel must be one of "
            f"{COVARIANCE_BACKWARD_KERNELS + FROM_K_KERNELS}, got {kernel!r}"
        )
    x1c, x2c, lc, sc, batch = _canonicalize(x1, x2, lengthscale, outputscale, False)
    if kernel == "onepass32" and x1c.dtype != torch.float32:
        raise ValueError(f"_rbf_covariance_backward_kernel: {kernel!r} takes float32, got {x1c.dtype}")
    if kernel == "onepass32" and x1c.shape[-1] > 16:
        raise ValueError(f"_rbf_covariance_backward_kernel: {kernel!r} takes d <= 16, got d={x1c.shape[-1]}")
    G = _canonical_grad(grad, torch.Size((*batch, x1c.shape[1], x2c.shape[1])), x1c)
    if kernel.startswith("from_k"):
        K = torch.ops.gpfast.rbf_covariance(x1c, x2c, lc, sc)
        name = "reference" if kernel == "from_k_reference" else "auto"
        grads = torch.ops.gpfast._rbf_covariance_backward_from_k(G, K, x1c, x2c, lc, sc, x_grads, name)
    else:
        grads = torch.ops.gpfast._rbf_covariance_backward_kernel(G, x1c, x2c, lc, sc, x_grads, kernel)
    return _grads_to_inputs(grads, x1, x2, lengthscale, outputscale, batch, x_grads)
