"""Saving and loading a fitted :class:`gpfast.ExactGP`: files that say what is wrong with them.

The bytes of the file (a checksummed header, a payload of plain types and tensors that loading never runs code
from, and the older formats 0 and 1) are :mod:`gpfast.estimator.file_format`'s. The payload holds the estimator's
parameters, its model's state dicts, and every fitted attribute: those of the first formats in entries of their
own, every other one by name in ``fitted`` (plain values) and ``fitted_arrays`` (numeric arrays), so that a file
keeps whatever ``fit`` records.

After reading, :func:`load` checks the contents against each other (entries present and of the right types,
shapes and counts agreeing with ``n_features_in_`` and the training set, the model's state-dict keys and shapes,
finite values) before building anything. Every problem with a file raises one ``ValueError`` whose message
starts ``cannot load '<path>':`` and says what is wrong (empty, truncated, corrupt, not a gpfast file, written in
format N, inconsistent contents).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

import gpytorch
import numpy as np
import torch
from sklearn.utils.validation import check_is_fitted

from gpfast._version import __version__
from gpfast.estimator.file_format import (
    FORMAT,
    FORMAT_VERSION,
    HEADER_SIZE,
    SIGNATURE,
    file_error,
    read_state,
    write_state,
)
from gpfast.estimator.params import resolve, upgrade_params
from gpfast.estimator.outputs import model_targets
from gpfast.estimator.prediction import hyperparameters_float64
from gpfast.models import ExactGPModel

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "SIGNATURE",
    "fitted_attributes",
    "load",
    "plain_params",
    "read_state",
    "save",
    "write_state",
]

_SOLVERS = ("cholesky", "cg")
_REQUIRED = (
    "params",
    "n_features_in_",
    "device_",
    "x_mean_",
    "x_std_",
    "y_mean_",
    "y_std_",
    "X_train_",
    "y_train_",
    "model_state_dict",
    "likelihood_state_dict",
    "solver_",
    "history_",
    "n_iter_",
    "log_marginal_likelihood_",
    "log_marginal_likelihood_method_",
)


#: Fitted attributes with entries of their own in the file (tensors, the model, and those of format 0 and 1).
_OWN_ENTRIES = frozenset(
    (*_REQUIRED, "feature_names_in_", "train_solver_", "pretrain_history_", "model_", "likelihood_")
)
#: Fitted attributes that files written before the ``fitted`` entry lack; loading such a file sets them to None.
_NOT_IN_OLD_FILES = (
    "trainer_",
    "optimizer_",
    "converged_",
    "restart_losses_",
    "cg_iterations_",
    "cg_residuals_",
    "history_data_fit_",
    "history_log_det_estimate_",
    "step_seconds_",
    "fit_seconds_",
)


def _bad(path, what: str) -> ValueError:
    return file_error(path, what)


# ------------------------------------------------------------------------------------------------------------
# writing
# ------------------------------------------------------------------------------------------------------------


def plain_params(est) -> dict[str, Any]:
    """``est.get_params()`` in plain types (dtypes, devices and paths as strings, arrays as lists), as files hold
    them."""
    params = est.get_params(deep=False)
    if isinstance(params.get("dtype"), (type, np.dtype)):
        params["dtype"] = str(np.dtype(params["dtype"]))
    if isinstance(params.get("dtype"), torch.dtype):
        params["dtype"] = str(params["dtype"]).replace("torch.", "")
    if params.get("lengthscale_init") is not None:
        params["lengthscale_init"] = np.asarray(params["lengthscale_init"], dtype=np.float64).tolist()
    if isinstance(params.get("random_state"), np.random.RandomState):
        params["random_state"] = None
    if isinstance(params.get("device"), torch.device):
        params["device"] = str(params["device"])
    if isinstance(params.get("checkpoint"), os.PathLike):
        params["checkpoint"] = os.fspath(params["checkpoint"])
    if isinstance(params.get("checkpoint"), (tuple, list)):  # (path, every)
        params["checkpoint"] = tuple(os.fspath(v) if isinstance(v, os.PathLike) else v for v in params["checkpoint"])
    if dataclasses.is_dataclass(params.get("cg")):
        params["cg"] = dataclasses.asdict(params["cg"])  # a CGSettings, as plain types
    return params


def _is_plain(v) -> bool:
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    if isinstance(v, dict):
        return all(isinstance(k, str) and _is_plain(x) for k, x in v.items())
    return isinstance(v, list) and all(_is_plain(x) for x in v)


def fitted_attributes(est) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Every fitted attribute (public, name ending in ``_``) of ``est`` without an entry of its own in the file:
    ``(plain, arrays)``, the plain values (None, bool, int, float, str, lists and str-keyed dicts of these; numpy
    scalars and tuples as their Python equals) and the numpy arrays as CPU tensors. TypeError for a value of any
    other type, which a file could not give back."""
    plain, arrays = {}, {}
    for name, value in vars(est).items():
        if not name.endswith("_") or name.startswith("_") or name in _OWN_ENTRIES:
            continue
        if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
            arrays[name] = torch.from_numpy(value.copy())
            continue
        if isinstance(value, (np.generic, tuple)):
            value = value.item() if isinstance(value, np.generic) else list(value)
        if isinstance(value, list):
            value = [v.item() if isinstance(v, np.generic) else v for v in value]
        if not _is_plain(value):
            raise TypeError(
                f"ExactGP.save: the fitted attribute {name} is a {type(value).__name__}; a gpfast file holds plain "
                f"values (None, bool, int, float, str, lists and str-keyed dicts of these) and numeric arrays only."
            )
        plain[name] = value
    return plain, arrays


def save(est, path) -> None:
    """Write the fitted estimator ``est`` to ``path`` (a file name or a binary file object), everything on the CPU.

    A file name is written atomically: a temporary file in the same folder, renamed over ``path`` once complete,
    so that an interrupted save never leaves a half-written model (or destroys the previous one). Missing parent
    folders are created.
    """
    check_is_fitted(est)

    def cpu(t):
        return t.detach().cpu()

    state = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "gpfast_version": __version__,
        "params": plain_params(est),
        "n_features_in_": int(est.n_features_in_),
        "feature_names_in_": [str(c) for c in est.feature_names_in_] if hasattr(est, "feature_names_in_") else None,
        "device_": str(est.device_),
        "x_mean_": torch.from_numpy(np.asarray(est.x_mean_, dtype=np.float64)),
        "x_std_": torch.from_numpy(np.asarray(est.x_std_, dtype=np.float64)),
        "y_mean_": _target_stat(est.y_mean_),
        "y_std_": _target_stat(est.y_std_),
        "X_train_": cpu(est.X_train_),
        "y_train_": cpu(est.y_train_),
        "solver_": est.solver_,
        "train_solver_": est.train_solver_,
        "pretrain_history_": [float(v) for v in est.pretrain_history_],
        "log_marginal_likelihood_": float(est.log_marginal_likelihood_),
        "log_marginal_likelihood_method_": est.log_marginal_likelihood_method_,
    }
    state.update(_model_entries(est))
    # every other fitted attribute, by name: the file keeps what fit recorded, whatever that grows to
    state["fitted"], state["fitted_arrays"] = fitted_attributes(est)
    write_state(state, path)


def _model_entries(est) -> dict[str, Any]:
    """The entries that hold what was trained: the GPyTorch model's state dicts, its dtype and the run's history;
    or, for a fit with ``independent_outputs=True`` (no GPyTorch model), ``independent_theta`` (k, p + 3) (the rows
    of :class:`~gpfast.estimator.hyperparameters.HyperparameterSpace`, standardised units) with empty state dicts,
    and a history and iteration count per output."""
    theta = getattr(est, "_independent_theta", None)
    if theta is not None:
        return {
            "independent_theta": torch.from_numpy(np.asarray(theta, dtype=np.float64).copy()),
            "model_state_dict": {},
            "likelihood_state_dict": {},
            "history_": [[float(v) for v in h] for h in est.history_],
            "n_iter_": [int(v) for v in est.n_iter_],
        }
    return {
        "dtype_": str(est.model_.covar_module.raw_outputscale.dtype).replace("torch.", ""),
        "model_state_dict": {k: v.detach().cpu() for k, v in est.model_.state_dict().items()},
        "likelihood_state_dict": {k: v.detach().cpu() for k, v in est.likelihood_.state_dict().items()},
        "history_": [float(v) for v in est.history_],
        "n_iter_": int(est.n_iter_),
    }


def _target_stat(v):
    """y_mean_ or y_std_ for the file: a float for one output, a float64 tensor (k,) for several."""
    return float(v) if np.ndim(v) == 0 else torch.from_numpy(np.asarray(v, dtype=np.float64))


def _target_stat_loaded(v):
    """y_mean_ or y_std_ from the file as ``fit`` sets it: a float, or a float64 array (k,) for several outputs."""
    return float(v) if _is_float(v) else v.to(torch.float64).numpy()


# ------------------------------------------------------------------------------------------------------------
# consistency
# ------------------------------------------------------------------------------------------------------------


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_float(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_state(path, state: dict, param_names) -> None:
    """Raise ValueError naming the first way in which the entries of ``state`` disagree with each other."""

    def bad(what):
        return _bad(path, f"its contents are inconsistent: {what}.")

    missing = [k for k in _REQUIRED if k not in state]
    if missing:
        raise bad(f"missing entr{'y' if len(missing) == 1 else 'ies'} {', '.join(map(repr, missing))}")
    params = state["params"]
    if not isinstance(params, dict) or not all(isinstance(k, str) for k in params):
        raise bad(f"'params' must be a dict of argument names, got {type(params).__name__}")
    unknown = sorted(set(params) - set(param_names))
    if unknown:
        raise bad(f"'params' has unknown argument(s) {unknown}; ExactGP takes {sorted(param_names)}")
    d = state["n_features_in_"]
    if not _is_int(d) or d < 1:
        raise bad(f"n_features_in_ must be an int >= 1, got {d!r}")
    X, y = state["X_train_"], state["y_train_"]
    for name, t in (("X_train_", X), ("y_train_", y), ("x_mean_", state["x_mean_"]), ("x_std_", state["x_std_"])):
        if not torch.is_tensor(t) or not t.is_floating_point():
            raise bad(f"{name} must be a floating-point tensor, got {_kind(t)}")
    if X.dim() != 2 or X.shape[1] != d or X.shape[0] < 1:
        raise bad(f"X_train_ has shape {tuple(X.shape)}; expected (n, {d}) with n >= 1 (n_features_in_ = {d})")
    n = X.shape[0]
    k = 1 if y.dim() == 1 else y.shape[-1]
    if y.dim() not in (1, 2) or y.shape[0] != n or (y.dim() == 2 and k < 2):
        raise bad(
            f"y_train_ has shape {tuple(y.shape)}; expected ({n},) or ({n}, k) for k >= 2 outputs, one row per row "
            f"of X_train_"
        )
    for name in ("x_mean_", "x_std_"):
        if tuple(state[name].shape) != (d,):
            raise bad(f"{name} has shape {tuple(state[name].shape)}; expected ({d},) (n_features_in_ = {d})")
    if not bool((state["x_std_"] > 0).all()):
        raise bad("x_std_ has a value <= 0; standard deviations are positive")
    if not _is_float(state["log_marginal_likelihood_"]):
        raise bad(f"log_marginal_likelihood_ must be a float, got {_kind(state['log_marginal_likelihood_'])}")
    for name in ("y_mean_", "y_std_"):
        v = state[name]
        if y.dim() == 1 and not _is_float(v):
            raise bad(f"{name} must be a float, got {_kind(v)}")
        if y.dim() == 2 and not (torch.is_tensor(v) and v.is_floating_point() and tuple(v.shape) == (k,)):
            raise bad(f"{name} must be a float tensor of shape ({k},), one value per output, got {_kind(v)}")
    y_std = torch.as_tensor(state["y_std_"], dtype=torch.float64)
    if not bool((torch.isfinite(y_std) & (y_std > 0)).all()):
        raise bad(f"y_std_ must be a positive finite float (one per output), got {_kind(state['y_std_'])}")
    names = state.get("feature_names_in_")
    if names is not None and (
        not isinstance(names, list) or len(names) != d or not all(isinstance(c, str) for c in names)
    ):
        raise bad(f"feature_names_in_ must be None or a list of {d} strings, got {_kind(names)}")
    for key in ("model_state_dict", "likelihood_state_dict"):
        sd = state[key]
        if not isinstance(sd, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in sd.items()):
            raise bad(f"{key} must be a dict of names to tensors, got {_kind(sd)}")
    for key in ("solver_", "train_solver_"):
        if key in state and state[key] not in _SOLVERS:
            raise bad(f"{key} must be one of {_SOLVERS}, got {state[key]!r}")
    key = "pretrain_history_"
    if key in state and (not isinstance(state[key], list) or not all(_is_float(v) for v in state[key])):
        raise bad(f"{key} must be a list of floats, got {_kind(state[key])}")
    if "independent_theta" in state:
        _check_independent(state, params, bad)
    else:
        _check_run(state["history_"], state["n_iter_"], "", bad)
    _check_fitted(state, bad)
    method = state["log_marginal_likelihood_method_"]
    if not isinstance(method, str):
        raise bad(f"log_marginal_likelihood_method_ must be a string, got {_kind(method)}")
    for name, value in _tensors(state):
        if "_constraint." in name:  # a constraint's bound may be infinite (GreaterThan's upper bound is inf)
            if bool(torch.isnan(value).any()):
                raise bad(f"{name} holds NaN values")
        elif not bool(torch.isfinite(value).all()):
            raise bad(f"{name} holds NaN or infinite values")
    if not bool(torch.isfinite(torch.as_tensor(state["y_mean_"], dtype=torch.float64)).all()):
        raise bad(f"y_mean_ must be finite, got {_kind(state['y_mean_'])}")


def _check_run(history, n_iter, which: str, bad) -> None:
    """One optimiser run's ``history_`` (a list of floats, one per step) and ``n_iter_`` agree; ``which`` names
    the output in messages."""
    if not isinstance(history, list) or not all(_is_float(v) for v in history):
        raise bad(f"history_{which} must be a list of floats, got {_kind(history)}")
    if not _is_int(n_iter) or n_iter != len(history):
        raise bad(f"n_iter_{which} = {n_iter!r} but history_{which} has {len(history)} entries (one per step)")


def _check_independent(state: dict, params: dict, bad) -> None:
    """The entries of a fit with ``independent_outputs=True``: theta (k, p + 3) for the k outputs of y_train_ and
    p lengthscales (d with ARD, else 1), finite; no GPyTorch model; a history and iteration count per output."""
    theta, y, d = state["independent_theta"], state["y_train_"], state["n_features_in_"]
    if not params.get("independent_outputs", False):
        raise bad("it holds independent_theta (a fit with independent_outputs=True) but params has no such setting")
    k = y.shape[-1] if y.dim() == 2 else 1
    p = d if params.get("ard", True) else 1
    if y.dim() != 2 or not torch.is_tensor(theta) or tuple(theta.shape) != (k, p + 3):
        raise bad(
            f"independent_theta must be a tensor of shape ({k}, {p + 3}), one row of {p} log lengthscale(s), log "
            f"outputscale, log noise and mean per output of y_train_ {tuple(y.shape)}, got {_kind(theta)}"
        )
    if not (theta.is_floating_point() and bool(torch.isfinite(theta).all())):
        raise bad(f"independent_theta must hold finite floats, got {_kind(theta)}")
    if state["model_state_dict"] or state["likelihood_state_dict"]:
        raise bad("a fit with independent_outputs=True has no GPyTorch model, but the file holds its state dicts")
    history, n_iter = state["history_"], state["n_iter_"]
    if not isinstance(history, list) or not isinstance(n_iter, list) or not len(history) == len(n_iter) == k:
        raise bad(f"history_ and n_iter_ must be lists of {k} entries (one per output), got {_kind(history)}")
    for j in range(k):
        _check_run(history[j], n_iter[j], f"[{j}]", bad)


def _check_fitted(state: dict, bad) -> None:
    """The ``fitted`` entries (absent in older files): attribute names to plain values, and to tensors."""
    for key, ok, what in (
        ("fitted", _is_plain, "plain values (None, bool, int, float, str, lists and str-keyed dicts of these)"),
        ("fitted_arrays", torch.is_tensor, "tensors"),
    ):
        entry = state.get(key, {})
        if not isinstance(entry, dict):
            raise bad(f"{key} must be a dict of fitted attribute names to {what}, got {_kind(entry)}")
        for name, value in entry.items():
            if not (isinstance(name, str) and name.isidentifier() and name.endswith("_") and name[0] != "_"):
                raise bad(f"{key} has the entry {name!r}, not the name of a fitted attribute (ending in '_')")
            if name in _OWN_ENTRIES:
                raise bad(f"{key} has the entry {name!r}, which the file holds in an entry of its own")
            if not ok(value):
                raise bad(f"{key}[{name!r}] must be one of {what}, got {_kind(value)}")


def _kind(v) -> str:
    if torch.is_tensor(v):
        return f"a {v.dtype} tensor of shape {tuple(v.shape)}"
    return f"{type(v).__name__} {v!r}"[:80]


def _tensors(state: dict):
    for name in ("X_train_", "y_train_", "x_mean_", "x_std_"):
        yield name, state[name]
    for key in ("model_state_dict", "likelihood_state_dict"):
        for k, v in state[key].items():
            yield f"{key}[{k!r}]", v


def _check_state_dict(path, key: str, saved: dict, module: torch.nn.Module) -> None:
    """The saved state dict has exactly the keys and shapes of the freshly built module's."""
    expected = module.state_dict()
    missing, unexpected = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    if missing or unexpected:
        raise _bad(
            path,
            f"its contents are inconsistent: {key} lacks {missing} and has unexpected {unexpected} "
            f"(for ard={getattr(module, 'ard', '?')}).",
        )
    for k, v in saved.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise _bad(
                path,
                f"its contents are inconsistent: {key}[{k!r}] has shape {tuple(v.shape)}; the model "
                f"expects {tuple(expected[k].shape)}.",
            )


# ------------------------------------------------------------------------------------------------------------
# load
# ------------------------------------------------------------------------------------------------------------


def load(cls, path, device=None):
    """Rebuild an estimator of class ``cls`` saved with :func:`save`; predictions equal the saved one's. Never runs
    code from the file.

    Parameters
    ----------
    cls : type
        :class:`gpfast.ExactGP` or a subclass.
    path : str, path or binary file object
    device : str, torch.device or None, default=None
        Where to put it. None: the saved ``device`` parameter (a CUDA estimator loads on the CPU, with a warning,
        when CUDA is unavailable).

    Returns
    -------
    cls
        The fitted estimator.

    Raises
    ------
    ValueError
        Naming the file and what is wrong with it, for any damaged, foreign, newer or inconsistent file.
    """
    _, state = read_state(path)
    if isinstance(state.get("params"), dict):
        state["params"] = upgrade_params(state["params"])
    _check_state(path, state, cls().get_params(deep=False))
    params = dict(state["params"])
    if params.get("distributed"):
        import torch.distributed as tdist

        if not tdist.is_initialized():  # a model fitted under torchrun, loaded in a single process
            params["distributed"] = False
    try:
        saved_device = torch.device(state["device_"])
    except (RuntimeError, TypeError, ValueError):
        raise _bad(path, f"its contents are inconsistent: device_ = {state['device_']!r} is not a device.") from None
    if device is not None:
        params["device"] = str(device)
    elif saved_device.type == "cuda" and not torch.cuda.is_available():
        warnings.warn(f"{str(path)!r} was fitted on {saved_device}; CUDA is unavailable, loading on the CPU.")
        params["device"] = "cpu"
    est = cls(**params)
    try:
        settings = resolve(est)
    except ValueError as exc:
        if device is not None and "device" in str(exc):
            raise  # the caller's device argument, not the file, is at fault
        raise _bad(path, f"its contents are inconsistent: its parameters are invalid ({exc})") from None
    dtype_ = state.get("dtype_")
    if dtype_ is not None and dtype_ != str(settings.dtype).replace("torch.", ""):
        raise _bad(
            path, f"its contents are inconsistent: dtype_ = {dtype_!r} but params['dtype'] = {params.get('dtype')!r}."
        )
    device_ = settings.device
    X_train = state["X_train_"].to(device=device_, dtype=torch.float64)
    y_train = state["y_train_"].to(device=device_, dtype=torch.float64)
    if "independent_theta" in state:  # no GPyTorch model: the posterior is factored again on the first predict
        est.__setstate__(_fitted(state, device_, X_train, y_train, None))
        est._independent_theta = state["independent_theta"].to(torch.float64).numpy().copy()
        return est
    model = _model(path, state, settings, X_train, y_train)
    est.__setstate__(_fitted(state, device_, X_train, y_train, model))  # as unpickling does
    if "fitted" not in state:  # the hyperparameters in the units of X and y, derived as fit derives them
        est._set_hyperparameter_attributes(hyperparameters_float64(model))
    return est


def _model(path, state: dict, settings, X_train: torch.Tensor, y_train: torch.Tensor) -> ExactGPModel:
    """The GPyTorch model of a checked ``state``, in eval mode, on the device and in the dtype of ``settings``."""
    likelihood = gpytorch.likelihoods.GaussianLikelihood()
    model = ExactGPModel(
        X_train.to(settings.dtype),
        model_targets(y_train).to(settings.dtype),
        likelihood,
        ard=bool(state["params"].get("ard", True)),
        distributed=settings.distributed,
    )
    model = model.to(device=settings.device, dtype=settings.dtype)  # before loading, so float64 values are not rounded
    _check_state_dict(path, "model_state_dict", state["model_state_dict"], model)
    _check_state_dict(path, "likelihood_state_dict", state["likelihood_state_dict"], likelihood)
    model.load_state_dict(state["model_state_dict"])
    likelihood.load_state_dict(state["likelihood_state_dict"])
    model.eval()
    likelihood.eval()
    return model


def _fitted(state: dict, device_: torch.device, X_train: torch.Tensor, y_train: torch.Tensor, model) -> dict:
    """The fitted attributes of a checked ``state``, with the training data and model already rebuilt on
    ``device_``; attributes that files written before the ``fitted`` entry lack are None."""
    fitted = dict(
        n_features_in_=int(state["n_features_in_"]),
        device_=device_,
        X_train_=X_train,
        y_train_=y_train,
        x_mean_=state["x_mean_"].to(torch.float64).numpy(),
        x_std_=state["x_std_"].to(torch.float64).numpy(),
        y_mean_=_target_stat_loaded(state["y_mean_"]),
        y_std_=_target_stat_loaded(state["y_std_"]),
        model_=model,
        likelihood_=model.likelihood if model is not None else None,
        solver_=state["solver_"],
        train_solver_=state.get("train_solver_", state["solver_"]),
        history_=list(state["history_"]),
        pretrain_history_=list(state.get("pretrain_history_", [])),
        n_iter_=state["n_iter_"],
        log_marginal_likelihood_=float(state["log_marginal_likelihood_"]),
        log_marginal_likelihood_method_=state["log_marginal_likelihood_method_"],
    )
    if state.get("feature_names_in_") is not None:
        fitted["feature_names_in_"] = np.asarray(state["feature_names_in_"], dtype=object)
    if "fitted" in state:
        fitted.update(state["fitted"])
        fitted.update({k: v.numpy().copy() for k, v in state.get("fitted_arrays", {}).items()})
    else:  # written before every fitted attribute was kept: those it lacks are unknown
        fitted.update(dict.fromkeys(_NOT_IN_OLD_FILES))
    return fitted
