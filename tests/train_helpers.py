"""Diagnostics of the training engine's gradient that only the tests use: the last step's solves and gradient
(:func:`capture_gradient`), the data-fit gradient alone and each probe's trace estimate."""

import contextlib

import torch

from gpfast.train import engine as engine_module

from gpfast.train.gradient import NaturalGradient
from gpfast.train.product import CovarianceProduct


def data_fit_gradient(product: CovarianceProduct, alpha: torch.Tensor) -> NaturalGradient:
    """The gradient of the data-fit term ``1/2 r^T K̂^{-1} r`` alone (exact for an exact alpha): one backward."""
    gl, gs = product.backward(alpha.unsqueeze(1) * -0.5, alpha.unsqueeze(1))
    return NaturalGradient(gl, gs, -0.5 * alpha.dot(alpha), -alpha.sum())


def per_probe_traces(product: CovarianceProduct, U: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """Each probe's estimate of ``tr(K̂^{-1} dK̂/dtheta)`` for theta = (lengthscale..., outputscale, noise): (s, p).
    Their mean is the engine's trace estimate and their spread its Hutchinson standard error. Costs s backwards
    (a diagnostic, not used in training)."""
    rows = []
    for i in range(U.shape[1]):
        gl, gs = product.backward(U[:, i : i + 1], W[:, i : i + 1])
        rows.append(torch.cat([gl.reshape(-1), gs.reshape(1), U[:, i].dot(W[:, i]).reshape(1)]))
    return torch.stack(rows)


@contextlib.contextmanager
def capture_gradient():
    """Record the inputs and the result of the engine's gradient while inside: a dict whose keys ``product``,
    ``alpha`` (n,), ``U`` (n, s), ``Z`` (n, s) and ``gradient`` (NaturalGradient, total) hold the last step's."""
    seen: dict = {}
    real = engine_module.hutchinson_gradient

    def recording(product, alpha, U, W):
        seen.update(product=product, alpha=alpha, U=U, Z=W, gradient=real(product, alpha, U, W))
        return seen["gradient"]

    engine_module.hutchinson_gradient = recording
    try:
        yield seen
    finally:
        engine_module.hutchinson_gradient = real
