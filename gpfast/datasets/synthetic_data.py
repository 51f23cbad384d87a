"""Synthetic regression data of any size, drawn from a smooth random function (for scaling past the UCI
sets)."""

from __future__ import annotations

import numpy as np

from gpfast.datasets.uci import _CHUNK_ROWS, Dataset, _make_dataset


def _synthetic_function(d: int, lengthscale: float, seed_seq: np.random.SeedSequence):
    """Parameters of f(x) = (sum_k a_k sin(w_k . x + b_k) - mu) / sigma, with E f = 0 and Var f = 1 for x ~ N(0, I)."""
    rng = np.random.default_rng(seed_seq)
    K = max(d, 16)
    W = rng.standard_normal((K, d)) / lengthscale
    b = rng.uniform(0.0, 2.0 * np.pi, K)
    a = rng.standard_normal(K)
    # Exact moments under x ~ N(0, I): for g ~ N(m, s^2), E cos g = cos(m) exp(-s^2 / 2).
    sq = np.sum(W * W, axis=1)
    m = np.exp(-0.5 * sq) * np.sin(b)  # E sin(w_k . x + b_k)
    diff = np.sum((W[:, None, :] - W[None, :, :]) ** 2, axis=-1)
    summ = np.sum((W[:, None, :] + W[None, :, :]) ** 2, axis=-1)
    second = 0.5 * (
        np.exp(-0.5 * diff) * np.cos(b[:, None] - b[None, :]) - np.exp(-0.5 * summ) * np.cos(b[:, None] + b[None, :])
    )
    cov = second - np.outer(m, m)
    mu = float(a @ m)
    sigma = float(np.sqrt(max(a @ cov @ a, 1e-12)))
    return W, b, a / sigma, mu / sigma


def synthetic(
    n: int,
    d: int,
    noise: float = 0.1,
    seed: int = 0,
    dtype=np.float32,
    lengthscale: float = 1.5,
) -> tuple[np.ndarray, np.ndarray]:
    """Draw a synthetic regression set of any size.

    ``X ~ N(0, I)`` and ``y = f(X) + noise * eps`` with ``eps ~ N(0, 1)``, where ``f`` is a smooth random function,
    a sum of ``max(d, 16)`` random Fourier features ``a_k sin(w_k . x + b_k)`` with ``w_k ~ N(0, I / lengthscale^2)``,
    shifted and scaled so that ``E f = 0`` and ``Var f = 1`` exactly (over ``x ~ N(0, I)``). The same ``seed`` gives
    the same ``f`` for every ``n``, and the first ``m`` rows for ``n`` are the rows for ``m < n`` (nested sizes).

    Generated in blocks of rows: memory is the output (``n * (d + 1)`` values of ``dtype``) plus a small block.

    Parameters
    ----------
    n : int
        Number of rows.
    d : int
        Number of input columns.
    noise : float, default 0.1
        Std of the Gaussian observation noise (the signal has std 1).
    seed : int, default 0
        Seed; the result is deterministic given ``(n, d, noise, seed, lengthscale)``.
    dtype : numpy dtype, default numpy.float32
        Dtype of the returned arrays (the draws are made in float64 and rounded).
    lengthscale : float, default 1.5
        Lengthscale of the random function; smaller is wigglier.

    Returns
    -------
    X : numpy.ndarray, shape (n, d)
    y : numpy.ndarray, shape (n,)
    """
    n, d = int(n), int(d)
    if n < 0 or d < 1:
        raise ValueError(f"synthetic needs n >= 0 and d >= 1, got n={n}, d={d}")
    if noise < 0:
        raise ValueError(f"noise must be >= 0, got {noise}")
    if lengthscale <= 0:
        raise ValueError(f"lengthscale must be > 0, got {lengthscale}")
    ss_f, ss_x, ss_eps = np.random.SeedSequence(seed).spawn(3)
    W, b, a, c = _synthetic_function(d, lengthscale, ss_f)
    rng_x, rng_eps = np.random.default_rng(ss_x), np.random.default_rng(ss_eps)
    X = np.empty((n, d), dtype=dtype)
    y = np.empty(n, dtype=dtype)
    for i in range(0, n, _CHUNK_ROWS):
        rows = min(_CHUNK_ROWS, n - i)
        Xc = rng_x.standard_normal((rows, d))
        fc = np.sin(Xc @ W.T + b) @ a - c
        X[i : i + rows] = Xc
        y[i : i + rows] = fc + noise * rng_eps.standard_normal(rows)
    return X, y


def synthetic_split(
    n_train: int,
    n_test: int,
    d: int,
    noise: float = 0.1,
    seed: int = 0,
    dtype=np.float32,
    standardize: bool = True,
    lengthscale: float = 1.5,
) -> Dataset:
    """Synthetic train and test sets drawn from the same random function (see :func:`synthetic`).

    Parameters
    ----------
    n_train, n_test : int
        Numbers of training and test rows: the first ``n_train`` rows of ``synthetic(n_train + n_test, ...)`` train,
        the rest test.
    d : int
        Number of input columns.
    noise : float, default 0.1
        Std of the observation noise on both train and test targets.
    seed : int, default 0
        Seed.
    dtype : numpy dtype, default numpy.float32
        Dtype of the returned arrays.
    standardize : bool, default True
        Standardise with the training statistics, as :func:`load_uci` does.
    lengthscale : float, default 1.5
        Lengthscale of the random function.

    Returns
    -------
    Dataset
        With ``name="synthetic"`` and ``split=0``.
    """
    X, y = synthetic(n_train + n_test, d, noise=noise, seed=seed, dtype=dtype, lengthscale=lengthscale)
    return _make_dataset("synthetic", 0, X[:n_train], y[:n_train], X[n_train:], y[n_train:], standardize, dtype)
