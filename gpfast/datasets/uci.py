"""One fixed train/test split of a UCI set (:class:`Dataset`), loaded and standardised with the training rows'
statistics (:mod:`gpfast.standardize`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpfast.datasets.catalog import _EXTRA_PARTS, DATA_FILE, MASK_FILE, N_SPLITS, find_dataset
from gpfast.standardize import column_stats

_CHUNK_ROWS = 1 << 16  # rows per block when generating or standardising large arrays


@dataclass(frozen=True, eq=False, repr=False)
class Dataset:
    """One train/test split of a regression data set.

    Attributes
    ----------
    name : str
        Name of the set (``"yacht"``, ``"synthetic"``, ...).
    split : int
        Index of the train/test split, in ``0 .. N_SPLITS - 1``.
    X_train : numpy.ndarray, shape (n_train, d)
        Training inputs (standardised with the training statistics unless loaded with ``standardize=False``).
    y_train : numpy.ndarray, shape (n_train,)
        Training targets.
    X_test : numpy.ndarray, shape (n_test, d)
        Test inputs, transformed with the *training* statistics.
    y_test : numpy.ndarray, shape (n_test,)
        Test targets, transformed with the *training* statistics.
    x_mean, x_std : numpy.ndarray, shape (d,)
        Per-column statistics that were applied: ``X = (X_raw - x_mean) / x_std``. The std of a constant column is
        set to 1. Zeros and ones when the data were not standardised.
    y_mean, y_std : float
        Target statistics that were applied: ``y = (y_raw - y_mean) / y_std``. 0 and 1 when not standardised.
    """

    name: str
    split: int
    X_train: np.ndarray
    y_train: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray
    x_mean: np.ndarray
    x_std: np.ndarray
    y_mean: float
    y_std: float

    @property
    def n_train(self) -> int:
        """Number of training rows."""
        return int(self.X_train.shape[0])

    @property
    def n_test(self) -> int:
        """Number of test rows."""
        return int(self.X_test.shape[0])

    @property
    def d(self) -> int:
        """Number of input columns."""
        return int(self.X_train.shape[1])

    def standardize_x(self, X: np.ndarray) -> np.ndarray:
        """Transform raw inputs with the training statistics.

        Parameters
        ----------
        X : array_like, shape (m, d)
            Inputs on the original scale.

        Returns
        -------
        numpy.ndarray, shape (m, d)
            ``(X - x_mean) / x_std``, in the dtype of ``X_train``.
        """
        X = np.asarray(X)
        return ((X - self.x_mean) / self.x_std).astype(self.X_train.dtype, copy=False)

    def unstandardize_y(self, y: np.ndarray) -> np.ndarray:
        """Map targets (or predictive means) back to the original scale.

        Parameters
        ----------
        y : array_like, shape (m,) or any shape
            Values on the standardised scale.

        Returns
        -------
        numpy.ndarray, same shape as ``y``
            ``y * y_std + y_mean``.
        """
        return np.asarray(y) * self.y_std + self.y_mean

    def unstandardize_std(self, std: np.ndarray) -> np.ndarray:
        """Map predictive standard deviations (or RMSEs) back to the original scale.

        Parameters
        ----------
        std : array_like, any shape
            Standard deviations on the standardised scale.

        Returns
        -------
        numpy.ndarray, same shape as ``std``
            ``std * y_std`` (a variance scales by ``y_std ** 2``).
        """
        return np.asarray(std) * self.y_std

    def __repr__(self) -> str:
        return (
            f"Dataset(name={self.name!r}, split={self.split}, n_train={self.n_train}, n_test={self.n_test}, "
            f"d={self.d}, dtype={self.X_train.dtype})"
        )


def _check_split(split: int) -> int:
    if isinstance(split, bool) or not isinstance(split, (int, np.integer)):
        raise TypeError(f"split must be an integer in 0..{N_SPLITS - 1}, got {split!r} of type {type(split).__name__}")
    if not 0 <= split < N_SPLITS:
        raise ValueError(f"split must be in 0..{N_SPLITS - 1} (there are {N_SPLITS} fixed splits), got {split}")
    return int(split)


def _read_csv(path: Path, dtype) -> np.ndarray:
    return np.loadtxt(path, delimiter=",", dtype=dtype, ndmin=2)


def _standardize_inplace(A: np.ndarray, mean: np.ndarray, std: np.ndarray) -> None:
    m = mean.astype(A.dtype)
    s = std.astype(A.dtype)
    for i in range(0, A.shape[0], _CHUNK_ROWS):
        block = A[i : i + _CHUNK_ROWS]
        block -= m
        block /= s


def _make_dataset(name: str, split: int, X_train, y_train, X_test, y_test, standardize: bool, dtype) -> Dataset:
    """Cast to ``dtype`` and (optionally) standardise with training statistics; inputs may be modified in place."""
    dtype = np.dtype(dtype)
    X_train = np.ascontiguousarray(X_train, dtype=dtype)
    X_test = np.ascontiguousarray(X_test, dtype=dtype)
    Y = np.ascontiguousarray(np.asarray(y_train).reshape(-1, 1), dtype=dtype)
    Yt = np.ascontiguousarray(np.asarray(y_test).reshape(-1, 1), dtype=dtype)
    d = X_train.shape[1]
    if standardize:
        x_mean, x_std = (t.numpy() for t in column_stats(X_train)[:2])
        y_mean, y_std = (t.numpy() for t in column_stats(Y)[:2])
        for A, (m, s) in (
            (X_train, (x_mean, x_std)),
            (X_test, (x_mean, x_std)),
            (Y, (y_mean, y_std)),
            (Yt, (y_mean, y_std)),
        ):
            _standardize_inplace(A, m, s)
    else:
        x_mean, x_std = np.zeros(d), np.ones(d)
        y_mean, y_std = np.zeros(1), np.ones(1)
    return Dataset(
        name=name,
        split=split,
        X_train=X_train,
        y_train=Y.reshape(-1),
        X_test=X_test,
        y_test=Yt.reshape(-1),
        x_mean=x_mean.astype(dtype),
        x_std=x_std.astype(dtype),
        y_mean=float(y_mean[0]),
        y_std=float(y_std[0]),
    )


def load_uci(
    name: str,
    split: int = 0,
    data_dir: str | os.PathLike | None = None,
    standardize: bool = True,
    dtype=np.float64,
) -> Dataset:
    """Load one fixed train/test split of a UCI regression set.

    Parameters
    ----------
    name : str
        Name of the set, one of :data:`UCI_NAMES` (or any folder name present in the data folder).
    split : int, default 0
        Which of the ten fixed splits, ``0 <= split <= 9``. Test rows are those with a 1 in column ``split`` of
        ``test_mask.csv.gz``.
    data_dir : str or os.PathLike, optional
        Folder holding ``<name>/data.csv.gz``; see :func:`find_dataset` for the search order.
    standardize : bool, default True
        Shift and scale every input column and the target to zero mean and unit std using the *training* rows'
        statistics only (the test rows use the same statistics). The std of a constant column is taken as 1.
    dtype : numpy dtype, default numpy.float64
        Dtype of the returned arrays (statistics are computed in float64).

    Returns
    -------
    Dataset
        ``X_train`` (n_train, d), ``y_train`` (n_train,), ``X_test`` (n_test, d), ``y_test`` (n_test,) and the
        statistics applied.

    Raises
    ------
    TypeError, ValueError
        Bad ``split``, unknown ``name``, or malformed files.
    FileNotFoundError
        The set is not found anywhere (see :func:`find_dataset`) or its ``test_mask.csv.gz`` is missing.
    """
    split = _check_split(split)
    folder = find_dataset(name, data_dir)
    data = _read_csv(folder / DATA_FILE, np.float64)
    for extra in _EXTRA_PARTS.get(name, ()):
        if (folder / extra).is_file():
            data = np.concatenate([data, _read_csv(folder / extra, np.float64)], axis=0)
    mask_path = folder / MASK_FILE
    if not mask_path.is_file():
        raise FileNotFoundError(f"dataset {name!r}: {mask_path} is missing (found {folder / DATA_FILE})")
    mask = _read_csv(mask_path, np.float64)
    if data.shape[1] < 2:
        raise ValueError(f"{folder / DATA_FILE}: expected at least 2 columns (inputs then target), got {data.shape[1]}")
    if mask.shape != (data.shape[0], N_SPLITS):
        raise ValueError(
            f"{mask_path}: expected shape ({data.shape[0]}, {N_SPLITS}) to match {DATA_FILE}, got {mask.shape}"
        )
    test = mask[:, split] == 1
    X, y = data[:, :-1], data[:, -1]
    return _make_dataset(name, split, X[~test], y[~test], X[test], y[test], standardize, dtype)
