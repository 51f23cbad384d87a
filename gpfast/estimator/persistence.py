"""Saving and loading a fitted :class:`gpfast.ExactGP`: files that say what is wrong with them.

File format 2 (written by this gpfast) is a fixed 52-byte header followed by a payload:

======  =====  ================================================================================================
offset  bytes  content
======  =====  ================================================================================================
0       8      signature ``b"\\x89GPFAST\\n"`` (a high byte and a newline, as PNG's, so that text-mode transfers
               show up as damage)
8       4      format version, unsigned little-endian (2)
12      8      payload length in bytes, unsigned little-endian
20      32     SHA-256 of bytes 0-19 (signature, version, length) followed by the payload
52      ...    payload: a ``torch.save`` dict of plain types and CPU tensors, no pickled classes
======  =====  ================================================================================================

The checksum covers every byte but its own, and any change to it breaks the match, so a flipped bit anywhere is
caught before the payload is read. The payload is read with ``torch.load(..., weights_only=True)``, which
rebuilds tensors and plain containers only and never runs code from the file. Formats 0 (gpfast 0.1.0, a bare
``torch.save`` dict with a string ``version`` entry) and 1 (gpfast 0.2.0 before the header, an integer
``format_version`` entry) still load; they have no checksum, but their zip members' CRC-32s are checked.

After reading, :func:`load` checks the contents against each other (entries present and of the right types,
shapes and counts agreeing with ``n_features_in_`` and the training set, the model's state-dict keys and shapes,
finite values) before building anything. Every problem with a file raises one ``ValueError`` whose message
starts ``cannot load '<path>':`` and says what is wrong (empty, truncated, corrupt, not a gpfast file, written in
format N, inconsistent contents).
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import secrets
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Any

import gpytorch
import numpy as np
import torch
from sklearn.utils.validation import check_is_fitted

from gpfast._version import __version__
from gpfast.estimator.outputs import model_targets
from gpfast.estimator.params import resolve
from gpfast.estimator.prediction import hyperparameters_float64
from gpfast.models import ExactGPModel

__all__ = ["FORMAT", "FORMAT_VERSION", "HEADER_SIZE", "SIGNATURE", "load", "read_state", "save", "write_state"]

FORMAT = "gpfast.ExactGP"
#: The save-file layout this gpfast writes; it reads every version up to this one.
FORMAT_VERSION = 2
#: The first bytes of every file of format 2 or later.
SIGNATURE = b"\x89GPFAST\n"
_HEADER = struct.Struct("<8sIQ32s")  # signature, format version, payload length, SHA-256
_CHECKED = struct.Struct("<8sIQ")  # the header fields the checksum covers
HEADER_SIZE = _HEADER.size
_LEGACY_VERSIONS = {"0.1.0": 0}  # gpfast versions that wrote files before format_version existed
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


def _bad(path, what: str) -> ValueError:
    return ValueError(f"cannot load {str(path)!r}: {what}")


# ------------------------------------------------------------------------------------------------------------
# writing
# ------------------------------------------------------------------------------------------------------------


def _params(est) -> dict[str, Any]:
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
    if params.get("checkpoint") is not None:
        params["checkpoint"] = os.fspath(params["checkpoint"])
    return params


def save(est, path) -> None:
    """Write the fitted estimator ``est`` to ``path`` (a file name or a binary file object), everything on the CPU.

    A file name is written atomically: a temporary file in the same folder, renamed over ``path`` once complete,
    so that an interrupted save never leaves a half-written model (or destroys the previous one).
    """
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
        "y_mean_": _target_stat(est.y_mean_),
        "y_std_": _target_stat(est.y_std_),
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
    write_state(state, path)


def _target_stat(v):
    """y_mean_ or y_std_ for the file: a float for one output, a float64 tensor (k,) for several."""
    return float(v) if np.ndim(v) == 0 else torch.from_numpy(np.asarray(v, dtype=np.float64))


def write_state(state: dict, path, format_version: int = FORMAT_VERSION) -> None:
    """Write ``state`` (a dict of plain types and CPU tensors) as a headed, checksummed file (see the module
    docstring). ``format_version`` goes into the header; other values are for tests of newer files only."""
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getbuffer()
    head = _CHECKED.pack(SIGNATURE, format_version, len(payload))
    digest = hashlib.sha256(head)
    digest.update(payload)
    if hasattr(path, "write"):
        path.write(head + digest.digest())
        path.write(payload)
        return
    path = Path(path)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.part"
    # os.open with 0o666 leaves the mode to the umask, as for any file the user writes (mkstemp would give 0600)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(head + digest.digest())
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ------------------------------------------------------------------------------------------------------------
# reading: the bytes, then the state they hold
# ------------------------------------------------------------------------------------------------------------


def read_state(path, format: str = FORMAT) -> tuple[int, dict]:
    """The format version and the state dict of a gpfast file (checked for damage and type, not yet for
    consistency); ``path`` is a file name or a binary file object; ``format``: the payload's expected ``format``
    entry (a checkpoint's is :data:`gpfast.estimator.checkpoint.CHECKPOINT_FORMAT`, and only model files have
    the legacy formats 0 and 1). Raises ``ValueError`` for any bad file (``FileNotFoundError`` and other
    ``OSError`` when it cannot be read at all)."""
    data = path.read() if hasattr(path, "read") else Path(path).read_bytes()
    if not data:
        raise _bad(path, "the file is empty (0 bytes); a gpfast model file is never empty.")
    if data.startswith(SIGNATURE) or _near_signature(data):
        return _read_headed(path, data, format)
    if len(data) < len(SIGNATURE) and SIGNATURE.startswith(data):
        raise _bad(
            path,
            f"the file is truncated: {len(data)} bytes, shorter than the {HEADER_SIZE}-byte header of "
            f"a gpfast model file.",
        )
    if data.startswith(b"PK\x03\x04") and format == FORMAT:
        return _read_legacy(path, data)
    raise _bad(
        path,
        f"not a gpfast model file: it is {_describe_foreign(data)}. gpfast model files are written by "
        f"ExactGP.save and `gpfast fit --save`.",
    )


def _near_signature(data: bytes) -> bool:
    """The first 8 bytes are gpfast's signature with one or two bits flipped: damage, not a foreign file."""
    if len(data) < len(SIGNATURE):
        return False
    flipped = sum(bin(a ^ b).count("1") for a, b in zip(data[: len(SIGNATURE)], SIGNATURE))
    return flipped <= 2


def _read_headed(path, data: bytes, format: str = FORMAT) -> tuple[int, dict]:
    if len(data) < HEADER_SIZE:
        raise _bad(
            path,
            f"the file is truncated: {len(data)} bytes, shorter than the {HEADER_SIZE}-byte header of "
            f"a gpfast model file.",
        )
    signature, version, length, recorded = _HEADER.unpack_from(data)
    if signature != SIGNATURE:
        raise _bad(
            path,
            f"the file is corrupt: its first bytes {signature!r} are a damaged gpfast signature "
            f"(expected {SIGNATURE!r}).",
        )
    payload = memoryview(data)[HEADER_SIZE:]
    digest = hashlib.sha256(data[: _CHECKED.size])
    digest.update(payload)
    checksum_ok = digest.digest() == recorded
    if version > FORMAT_VERSION:
        if checksum_ok:
            raise _bad(
                path,
                f"it was written in gpfast file format {version}, by a newer gpfast; this gpfast "
                f"({__version__}) reads formats 0 to {FORMAT_VERSION}: upgrade gpfast to load it.",
            )
        raise _bad(
            path,
            f"the file is corrupt, or was written in a newer gpfast file format: its header says "
            f"format {version} and its SHA-256 checksum does not match; this gpfast ({__version__}) "
            f"reads formats 0 to {FORMAT_VERSION}.",
        )
    if len(payload) < length:
        raise _bad(
            path,
            f"the file is truncated: its header announces {length} bytes of data after the "
            f"{HEADER_SIZE}-byte header, but only {len(payload)} follow.",
        )
    if len(payload) > length:
        raise _bad(
            path, f"the file is corrupt: {len(payload)} bytes of data follow its header, which announces {length}."
        )
    if not checksum_ok:
        raise _bad(
            path,
            f"the file is corrupt: the SHA-256 of its contents is {digest.hexdigest()}, but its header "
            f"records {recorded.hex()} (damaged on disk or in transfer, or edited).",
        )
    if version < 2:
        raise _bad(path, f"the file is corrupt: its header says format {version}, but formats before 2 have no header.")
    state = _torch_load(path, payload)
    if not isinstance(state, dict) or state.get("format") != format:
        found = state.get("format") if isinstance(state, dict) else None
        raise _bad(path, f"its checksum matches but its data are not a {format} state (format {found!r}).")
    if state.get("format_version") != version:
        raise _bad(
            path,
            f"the file is corrupt: its header says format {version}, its data say {state.get('format_version')!r}.",
        )
    return version, state


def _read_legacy(path, data: bytes) -> tuple[int, dict]:
    """Formats 0 and 1: a bare ``torch.save`` zip archive."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            names = zf.namelist()
            if not any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
                raise _bad(
                    path,
                    f"not a gpfast model file: it is a zip archive (such as an .npz file) without a "
                    f"torch data.pkl member; its members: {_short_list(names)}.",
                )
            damaged = zf.testzip()
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, NotImplementedError) as exc:
        if isinstance(exc, ValueError) and str(exc).startswith("cannot load"):
            raise
        raise _bad(
            path,
            f"the file is truncated or corrupt: it starts as a zip archive (a gpfast file of format 0 "
            f"or 1) but cannot be read as one ({exc}).",
        ) from None
    if damaged is not None:
        raise _bad(path, f"the file is corrupt: member {damaged!r} of the zip archive fails its CRC-32 check.")
    state = _torch_load(path, data)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        kind = "a dict without" if isinstance(state, dict) else f"a {type(state).__name__}, not a dict with"
        raise _bad(path, f"not a gpfast model file: it is a torch file holding {kind} a format={FORMAT!r} entry.")
    return _legacy_version(path, state), state


def _torch_load(path, payload) -> Any:
    try:
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # weights_only refused a global: the file holds Python objects
        first = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
        raise _bad(
            path,
            f"not a gpfast model file: it is a torch file holding Python objects, which gpfast files "
            f"never contain (and which loading refuses to unpickle, as that could run code). {first}",
        ) from None
    except Exception as exc:  # torch reports a damaged archive in many ways (RuntimeError, EOFError, ...)
        raise _bad(
            path, f"the file is corrupt: its data cannot be read ({type(exc).__name__}: {str(exc).strip()[:200]})."
        ) from None


def _legacy_version(path, state: dict) -> int:
    if "format_version" in state:
        v = state["format_version"]
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise _bad(path, f"its format_version must be an int >= 0, got {v!r}.")
        if v > FORMAT_VERSION:
            raise _bad(
                path,
                f"it was written in gpfast file format {v} (by gpfast {state.get('gpfast_version', '?')}"
                f"); this gpfast ({__version__}) reads formats 0 to {FORMAT_VERSION}: upgrade gpfast "
                f"to load it.",
            )
        if v >= 2:
            raise _bad(
                path,
                f"the file is corrupt: its data say format {v}, but files of format 2 and later start "
                f"with a gpfast header, and this one does not.",
            )
        return v
    version = state.get("version")
    if version is None:
        raise _bad(path, "it has no 'format_version' (or legacy 'version') entry; cannot tell how to read it.")
    if version not in _LEGACY_VERSIONS:
        raise _bad(
            path,
            f"it was saved by gpfast version {version!r}, which this gpfast ({__version__}) cannot "
            f"read; readable versions: {sorted(_LEGACY_VERSIONS)} and files with a format_version up "
            f"to {FORMAT_VERSION}.",
        )
    return _LEGACY_VERSIONS[version]


def _short_list(names, limit: int = 5) -> str:
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _describe_foreign(data: bytes) -> str:
    """What a file that is not gpfast's looks like, from its first bytes."""
    head = data[:4096]
    if head.startswith(b"\x93NUMPY"):
        return "a NumPy .npy file"
    if head[:1] == b"\x80" and len(head) > 1 and 2 <= head[1] <= 5:
        if b"joblib" in head or b"NumpyArrayWrapper" in head:
            return "a joblib file (a Python pickle), which loading refuses to unpickle, as that could run code"
        return "a Python pickle file, which loading refuses to unpickle, as that could run code"
    if head.startswith(b"\x1f\x8b"):
        return "a gzip-compressed file"
    if head[:1] == b"\x78" and len(head) > 1 and (head[0] * 256 + head[1]) % 31 == 0:
        return "zlib-compressed data (such as a compressed joblib file)"
    if head.startswith(b"\x89HDF"):
        return "an HDF5 file"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and all(c.isprintable() or c in "\r\n\t" for c in text):
        first = text.splitlines()[0][:40] if text.strip() else ""
        return f"a text file (starting {first!r})"
    return f"an unrecognised binary file (first bytes {data[:8]!r})"


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
    for key in ("history_", "pretrain_history_"):
        if key in state and (not isinstance(state[key], list) or not all(_is_float(v) for v in state[key])):
            raise bad(f"{key} must be a list of floats, got {_kind(state[key])}")
    if not _is_int(state["n_iter_"]) or state["n_iter_"] != len(state["history_"]):
        raise bad(f"n_iter_ = {state['n_iter_']!r} but history_ has {len(state['history_'])} entries (one per step)")
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
    """Rebuild an estimator of class ``cls`` saved with :func:`save`; predictions equal the saved one's.

    ``device``: where to put it (default: the saved ``device`` parameter; a CUDA estimator loads on the CPU, with a
    warning, when CUDA is unavailable). Raises ``ValueError`` naming the file and what is wrong with it for any
    damaged, foreign, newer or inconsistent file; never runs code from the file.
    """
    _, state = read_state(path)
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
    device_, dtype = settings.device, settings.dtype
    X_train = state["X_train_"].to(device=device_, dtype=torch.float64)
    y_train = state["y_train_"].to(device=device_, dtype=torch.float64)
    likelihood = gpytorch.likelihoods.GaussianLikelihood()
    model = ExactGPModel(
        X_train.to(dtype),
        model_targets(y_train).to(dtype),
        likelihood,
        ard=bool(params.get("ard", True)),
        distributed=settings.distributed,
    )
    model = model.to(device=device_, dtype=dtype)  # before loading, so float64 values are not rounded
    _check_state_dict(path, "model_state_dict", state["model_state_dict"], model)
    _check_state_dict(path, "likelihood_state_dict", state["likelihood_state_dict"], likelihood)
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
    est.x_mean_ = state["x_mean_"].to(torch.float64).numpy()
    est.x_std_ = state["x_std_"].to(torch.float64).numpy()
    est.y_mean_, est.y_std_ = (
        float(v) if _is_float(v) else v.to(torch.float64).numpy() for v in (state["y_mean_"], state["y_std_"])
    )
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
