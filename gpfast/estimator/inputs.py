"""Input handling for :class:`gpfast.ExactGP`: X and y as float64 tensors, checked, on scikit-learn's public
``validate_data`` for array-likes (feature names and counts included) and by hand for torch tensors, which stay
on their device."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch
from sklearn.exceptions import DataConversionWarning
from sklearn.utils.validation import check_array, validate_data

from gpfast.estimator.outputs import target_statistics
from gpfast.standardize import column_stats

__all__ = ["InputInfo", "TrainingData", "check_finite", "standardized", "validate_X", "validate_y"]


class InputInfo:
    """How the user passed X, so that outputs come back the same way (numpy, or torch on the same device)."""

    def __init__(self, is_torch: bool, device: torch.device | None = None, dtype: torch.dtype | None = None):
        self.is_torch = is_torch
        self.device = device
        self.dtype = dtype

    def out(self, t: torch.Tensor):
        if self.is_torch:
            dtype = self.dtype if (self.dtype is not None and self.dtype.is_floating_point) else torch.float64
            return t.detach().to(device=self.device, dtype=dtype)
        return t.detach().cpu().numpy()


def validate_X(estimator, X, reset: bool) -> tuple[torch.Tensor, InputInfo]:
    """X as a float64 (n, d) tensor (on the input's device for tensors, CPU otherwise), finite-checked.

    ``reset=True`` (fit) records ``n_features_in_`` and ``feature_names_in_`` on ``estimator``; ``reset=False``
    (predict) checks X against them.
    """
    if not torch.is_tensor(X):
        try:
            arr = validate_data(
                estimator,
                X,
                reset=reset,
                dtype=np.float64,
                ensure_2d=True,
                ensure_min_samples=1,
                ensure_all_finite=False,
            )
        except ValueError as exc:
            raise _not_numeric(X, "X") or exc from None
        Xt = torch.from_numpy(np.array(arr, dtype=np.float64, copy=True, order="C"))
        check_finite(Xt, "X")
        return Xt, InputInfo(False)
    info = InputInfo(True, X.device, X.dtype)
    if X.layout != torch.strided:
        raise TypeError(
            f"X is a sparse torch tensor (layout {X.layout}); ExactGP needs a dense tensor: call X.to_dense()."
        )
    if X.is_complex():
        raise ValueError(f"X is a complex tensor ({X.dtype}); ExactGP needs real values.")
    if X.dim() != 2:
        raise ValueError(
            f"Expected 2D array for X, got a {X.dim()}-D tensor of shape {tuple(X.shape)} instead; X must have "
            f"shape (n_samples, n_features). Reshape your data using X.reshape(-1, 1) if it has a single feature "
            f"or X.reshape(1, -1) if it contains a single sample."
        )
    if X.shape[1] < 1:
        raise ValueError(f"X has shape {tuple(X.shape)}: 0 feature(s), a minimum of 1 is required.")
    if reset:
        estimator.n_features_in_ = int(X.shape[1])
        if hasattr(estimator, "feature_names_in_"):
            del estimator.feature_names_in_
    elif X.shape[1] != estimator.n_features_in_:
        raise ValueError(
            f"X has {X.shape[1]} features, but {type(estimator).__name__} is expecting {estimator.n_features_in_} "
            f"features as input."
        )
    Xt = X.detach().to(torch.float64)
    check_finite(Xt, "X")
    return Xt, info


def validate_y(y, n: int) -> torch.Tensor:
    """y as a float64 tensor of shape (n,), or (n, k) for k >= 2 outputs, finite-checked; a column vector (n, 1) is
    one output, (n,), accepted with scikit-learn's warning."""
    if y is None:
        raise ValueError(
            "ExactGP requires y to be passed, but the target y is None; expected y of shape "
            "(n_samples,) or (n_samples, n_outputs)."
        )
    if torch.is_tensor(y):
        if y.is_complex():
            raise ValueError(f"y is a complex tensor ({y.dtype}); ExactGP needs real values.")
        yt = y.detach().to(torch.float64)
    else:
        try:
            arr = check_array(
                y, dtype=np.float64, ensure_2d=False, ensure_min_samples=1, input_name="y", ensure_all_finite=False
            )
        except ValueError as exc:
            raise _not_numeric(y, "y") or exc from None
        yt = torch.from_numpy(np.array(arr, dtype=np.float64, copy=True))
    if yt.dim() == 2 and yt.shape[1] == 1:
        warnings.warn(
            "A column-vector y was passed when a 1d array was expected. Please change the shape of y to "
            "(n_samples, ), for example using ravel().",
            DataConversionWarning,
            stacklevel=3,
        )
        yt = yt.reshape(-1)
    if yt.dim() not in (1, 2) or (yt.dim() == 2 and yt.shape[1] == 0):
        raise ValueError(
            f"y must have shape (n_samples,) or (n_samples, n_outputs) with n_outputs >= 1, got shape "
            f"{tuple(yt.shape)}."
        )
    check_finite(yt, "y")
    if yt.shape[0] != n:
        raise ValueError(
            f"X and y have inconsistent numbers of samples: X has {n} rows but y has {yt.shape[0]} "
            f"values; expected one target per row of X."
        )
    return yt


def validate_training(estimator, X, y) -> tuple[torch.Tensor, torch.Tensor]:
    """The training data of ``estimator.fit``: X (n, d) and y (n,) or (n, k) as float64 tensors, checked (at least
    two samples); records ``n_features_in_`` (and ``feature_names_in_``) on the estimator."""
    Xt, _ = validate_X(estimator, X, reset=True)
    n = Xt.shape[0]
    yt = validate_y(y, n)
    if n < 2:
        raise ValueError(f"X has n_samples = {n} ({n} sample(s)), but ExactGP needs at least 2 samples to fit a GP.")
    return Xt, yt


def _not_numeric(a, name: str) -> ValueError | None:
    """The error for the first cell of ``a`` that is not a number (numpy's own names only the value), or None."""
    try:
        cells = np.asarray(a, dtype=object)
    except ValueError:  # ragged: numpy's message says so
        return None
    columns = getattr(a, "columns", None)
    for index, value in np.ndenumerate(cells):
        if isinstance(value, (complex, np.complexfloating)):
            return None  # scikit-learn's own error says "Complex data not supported", as its checks expect
        try:
            float(value)
        except (TypeError, ValueError):
            where = f"row {index[0]}" if cells.ndim == 1 else f"row {index[0]}, column {index[-1]}"
            if columns is not None and cells.ndim == 2:
                where += f" ({columns[index[-1]]!r})"
            return ValueError(
                f"ExactGP: {name} holds {value!r} at {where}, which is not a number; ExactGP takes numbers only: "
                f"encode that column as numbers, or leave it out."
            )
    return None


def check_finite(t: torch.Tensor, name: str) -> None:
    """Raise ValueError naming the count and first index of NaN and infinite values in ``t``."""
    if t.numel() == 0 or bool(torch.isfinite(t).all()):
        return
    nan, inf = torch.isnan(t), torch.isinf(t)
    parts = []
    if bool(nan.any()):
        parts.append(f"{int(nan.sum())} NaN value(s) (first at index {_first_index(nan)})")
    if bool(inf.any()):
        parts.append(f"{int(inf.sum())} infinite value(s) (inf/-inf, first at index {_first_index(inf)})")
    raise ValueError(
        f"Input {name} contains " + " and ".join(parts) + "; ExactGP needs finite values: drop or impute them first."
    )


def _first_index(mask: torch.Tensor) -> tuple:
    return tuple(int(i) for i in torch.nonzero(mask)[0].tolist())


@dataclass(frozen=True)
class TrainingData:
    """A fit's training data in standardised units and the statistics that map them back, as :func:`standardized`
    gives them: ``X`` (n, d) and ``y`` (n,) or (n, k), float64 on ``device``; ``x_mean``, ``x_std`` float64 arrays
    (d,); ``y_mean``, ``y_std`` floats, or arrays (k,) for several outputs."""

    X: torch.Tensor
    y: torch.Tensor
    x_mean: np.ndarray
    x_std: np.ndarray
    y_mean: float | np.ndarray
    y_std: float | np.ndarray
    device: torch.device

    def attributes(self) -> dict:
        """The estimator's fitted attributes that hold them: ``X_train_``, ``y_train_``, ``x_mean_``, ``x_std_``,
        ``y_mean_``, ``y_std_`` and ``device_``."""
        names = ("X_train_", "y_train_", "x_mean_", "x_std_", "y_mean_", "y_std_", "device_")
        return dict(zip(names, (self.X, self.y, self.x_mean, self.x_std, self.y_mean, self.y_std, self.device)))


def standardized(X: torch.Tensor, y: torch.Tensor, standardize: bool, device: torch.device) -> TrainingData:
    """The training data standardised by the one rule (:mod:`gpfast.standardize`), on the fit's ``device``.

    Constant columns of X, and constant outputs of y, are centred but not scaled, with a warning (for the caller's
    caller: ``ExactGP.fit``).

    Parameters
    ----------
    X : torch.Tensor of shape (n, d)
    y : torch.Tensor of shape (n,) or (n, k)
        Validated, float64.
    standardize : bool
        False: the identity (means 0, standard deviations 1).
    device : torch.device
        Where the fit runs.

    Returns
    -------
    TrainingData
        ``y_mean``, ``y_std``: each output's own (:func:`gpfast.estimator.outputs.target_statistics`).
    """
    n, d = X.shape
    y_mean, y_std = target_statistics(y, standardize)
    if not standardize:
        x_mean = torch.zeros(d, dtype=torch.float64, device=X.device)
        return _training_data(X, y, x_mean, torch.ones_like(x_mean), y_mean, y_std, device)
    xs = column_stats(X)
    const_cols = torch.nonzero(xs.constant).reshape(-1).tolist()
    if const_cols:
        warnings.warn(
            f"X has constant column(s) at index {const_cols} (zero variance over the {n} training points); "
            f"they carry no information for fitting and are only centred (std set to 1).",
            UserWarning,
            stacklevel=4,
        )
    return _training_data(X, y, xs.mean, xs.std, y_mean, y_std, device)


def _training_data(X, y, x_mean, x_std, y_mean, y_std, device) -> TrainingData:
    y_center, y_scale = (torch.as_tensor(v, dtype=torch.float64, device=y.device) for v in (y_mean, y_std))
    Xs, ys = ((X - x_mean) / x_std).to(device), ((y - y_center) / y_scale).to(device)
    return TrainingData(Xs, ys, x_mean.cpu().numpy(), x_std.cpu().numpy(), y_mean, y_std, device)
