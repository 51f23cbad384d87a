"""Saving and loading a fitted :class:`gpfast.ExactGP`.

A file is a ``torch.save`` dict of plain types and CPU tensors (no pickled classes: it loads with
``torch.load(..., weights_only=True)``), with ``format = "gpfast.ExactGP"`` and an integer ``format_version``.
Format 1 is written by gpfast 0.2; format 0 is gpfast 0.1.0's layout, which had a string ``version`` entry and
no ``format_version``: it still loads.
"""

from __future__ import annotations

import warnings
from typing import Any

import gpytorch
import numpy as np
import torch
from sklearn.utils.validation import check_is_fitted

from gpfast._version import __version__
from gpfast.estimator.params import resolve
from gpfast.estimator.prediction import hyperparameters_float64
from gpfast.models import ExactGPModel

__all__ = ["FORMAT", "FORMAT_VERSION", "load", "save"]

FORMAT = "gpfast.ExactGP"
#: The save-file layout this gpfast writes; it reads every version up to this one.
FORMAT_VERSION = 1
_LEGACY_VERSIONS = {"0.1.0": 0}  # gpfast versions that wrote files before format_version existed


def _params(est) -> dict[str, Any]:
    params = est.get_params(deep=False)
    if isinstance(params.get("dtype"), (type, np.dtype)):
        params["dtype"] = str(np.dtype(params["dtype"]))
    if params.get("lengthscale_init") is not None:
        params["lengthscale_init"] = np.asarray(params["lengthscale_init"], dtype=np.float64).tolist()
    if isinstance(params.get("random_state"), np.random.RandomState):
        params["random_state"] = None
    if isinstance(params.get("device"), torch.device):
        params["device"] = str(params["device"])
    return params


def save(est, path) -> None:
    """Write the fitted estimator ``est`` to ``path`` (everything on the CPU)."""
    check_is_fitted(est)

    def cpu(t):
        return t.detach().cpu()

    state = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "gpfast_version": __version__,
        "params": _params(est),
        "n_features_in_": int(est.n_features_in_),
        "feature_names_in_": [str(c) for c in est.feature_names_in_] if hasattr(est, "feature_names_in_") else None,
        "device_": str(est.device_),
        "dtype_": str(est.model_.covar_module.raw_outputscale.dtype).replace("torch.", ""),
        "x_mean_": torch.from_numpy(np.asarray(est.x_mean_, dtype=np.float64)),
        "x_std_": torch.from_numpy(np.asarray(est.x_std_, dtype=np.float64)),
        "y_mean_": float(est.y_mean_),
        "y_std_": float(est.y_std_),
        "X_train_": cpu(est.X_train_),
        "y_train_": cpu(est.y_train_),
        "model_state_dict": {k: cpu(v) for k, v in est.model_.state_dict().items()},
        "likelihood_state_dict": {k: cpu(v) for k, v in est.likelihood_.state_dict().items()},
        "solver_": est.solver_,
        "train_solver_": est.train_solver_,
        "history_": [float(v) for v in est.history_],
        "pretrain_history_": [float(v) for v in est.pretrain_history_],
        "n_iter_": int(est.n_iter_),
        "log_marginal_likelihood_": float(est.log_marginal_likelihood_),
        "log_marginal_likelihood_method_": est.log_marginal_likelihood_method_,
    }
    torch.save(state, path)


def _format_version(state, path) -> int:
    if "format_version" in state:
        v = state["format_version"]
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"{path!r}: format_version must be an int >= 0, got {v!r}")
        if v > FORMAT_VERSION:
            raise ValueError(
                f"{path!r} was written in gpfast file format {v} (by gpfast {state.get('gpfast_version', '?')}); "
                f"this gpfast ({__version__}) reads formats 0 to {FORMAT_VERSION}: upgrade gpfast to load it."
            )
        return v
    version = state.get("version")
    if version is None:
        raise ValueError(f"{path!r} has no 'format_version' (or legacy 'version') entry; cannot tell how to read it.")
    if version not in _LEGACY_VERSIONS:
        raise ValueError(
            f"{path!r} was saved by gpfast version {version!r}, which this gpfast ({__version__}) cannot read; "
            f"readable versions: {sorted(_LEGACY_VERSIONS)} and files with a format_version up to {FORMAT_VERSION}."
        )
    return _LEGACY_VERSIONS[version]


def load(cls, path, device=None):
    """Rebuild an estimator of class ``cls`` saved with :func:`save`; predictions equal the saved one's.

    ``device``: where to put it (default: the saved ``device`` parameter; a CUDA estimator loads on the CPU, with a
    warning, when CUDA is unavailable).
    """
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path!r} is not a gpfast.ExactGP file (no format={FORMAT!r} entry).")
    _format_version(state, path)
    params = dict(state["params"])
    if params.get("distributed"):
        import torch.distributed as tdist

        if not tdist.is_initialized():  # a model fitted under torchrun, loaded in a single process
            params["distributed"] = False
    saved_device = torch.device(state["device_"])
    if device is not None:
        params["device"] = str(device)
    elif saved_device.type == "cuda" and not torch.cuda.is_available():
        warnings.warn(f"{path!r} was fitted on {saved_device}; CUDA is unavailable, loading on the CPU.")
        params["device"] = "cpu"
    est = cls(**params)
    settings = resolve(est)
    device_, dtype = settings.device, settings.dtype
    X_train = state["X_train_"].to(device_)
    y_train = state["y_train_"].to(device_)
    likelihood = gpytorch.likelihoods.GaussianLikelihood()
    model = ExactGPModel(X_train.to(dtype), y_train.to(dtype), likelihood, ard=bool(params["ard"]),
                         distributed=settings.distributed)
    model = model.to(device=device_, dtype=dtype)  # before loading, so float64 values are not rounded
    model.load_state_dict(state["model_state_dict"])
    likelihood.load_state_dict(state["likelihood_state_dict"])
    model.eval()
    likelihood.eval()

    if state.get("feature_names_in_") is not None:
        est.feature_names_in_ = np.asarray(state["feature_names_in_"], dtype=object)
    est.n_features_in_ = int(state["n_features_in_"])
    est.device_ = device_
    est.X_train_ = X_train
    est.y_train_ = y_train
    est.x_mean_ = state["x_mean_"].numpy()
    est.x_std_ = state["x_std_"].numpy()
    est.y_mean_ = float(state["y_mean_"])
    est.y_std_ = float(state["y_std_"])
    est.model_ = model
    est.likelihood_ = likelihood
    est.solver_ = state["solver_"]
    est.train_solver_ = state.get("train_solver_", state["solver_"])
    est.history_ = list(state["history_"])
    est.pretrain_history_ = list(state.get("pretrain_history_", []))
    est.n_iter_ = int(state["n_iter_"])
    est.log_marginal_likelihood_ = float(state["log_marginal_likelihood_"])
    est.log_marginal_likelihood_method_ = state["log_marginal_likelihood_method_"]
    est._posterior = None
    est._set_hyperparameter_attributes(hyperparameters_float64(model))
    return est
