"""``gpfast.ExactGP``: a scikit-learn style estimator for exact GP regression on gpfast's fused RBF kernel.

Example::

    from gpfast import ExactGP

    gp = ExactGP(max_iter=50).fit(X_train, y_train)          # numpy or torch, on the GPU when there is one
    mean, std = gp.predict(X_test, return_std=True)            # std of the noisy target y, in y's units
    gp.score(X_test, y_test)                                   # R^2
    gp.save("gp.pt"); gp2 = ExactGP.load("gp.pt")

Model: ``y = f(x) + eps``, ``f ~ GP(c, s * exp(-0.5 |(x - x') / l|^2))``, ``eps ~ N(0, noise)``, fitted on
standardised data (each input column and the target are centred and scaled to unit variance with the training
statistics); the fitted hyperparameters are reported back in the original units (``lengthscale_``,
``outputscale_``, ``noise_``, ``constant_mean_``).

Solvers:

* ``"cholesky"``: training with GPyTorch's exact marginal likelihood through a dense Cholesky factorisation
  (``gpytorch.settings.max_cholesky_size`` huge), in ``dtype``; prediction with an exact float64 Cholesky
  factorisation of the n x n training covariance, computed once at the end of ``fit``
  (:class:`gpfast.models.CholeskyPredictor`).
* ``"cg"``: matrix-free training and prediction with GPyTorch's conjugate gradients / Lanczos (BBMM,
  Gardner et al. 2018; Wang et al. 2019), in ``dtype``; memory O(n) with gpfast's matrix-free kernel.
* ``"auto"``: ``"cholesky"`` when three float64 n x n matrices fit in the free memory of the device and
  ``n <= AUTO_CHOLESKY_MAX_N[device type]``, else ``"cg"``. The training steps use the dense Cholesky only up
  to ``AUTO_TRAIN_CHOLESKY_MAX_N[device type]`` and CG above it (faster per step); prediction and the reported
  log marginal likelihood stay exact (float64 Cholesky) whenever ``solver_ == "cholesky"``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import numbers
import os
import sys
import warnings
from typing import Any, Dict, Optional, Tuple

import gpytorch
import numpy as np
import torch
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.exceptions import DataConversionWarning
from sklearn.metrics import r2_score
from sklearn.utils import check_random_state
from sklearn.utils.validation import check_array, check_is_fitted
from tqdm.auto import tqdm

from linear_operator.utils.errors import NotPSDError

from gpfast.models.cholesky import CholeskyPredictor
from gpfast.models.exact_gp import ExactGPModel

from gpfast.ops import rbf_covariance

try:  # private helpers of scikit-learn (stable since 1.0); feature names are optional sugar
    from sklearn.utils.validation import _check_feature_names, _get_feature_names
except ImportError:  # pragma: no cover
    _check_feature_names = _get_feature_names = None

__all__ = ["ExactGP", "AUTO_CHOLESKY_MAX_N", "AUTO_TRAIN_CHOLESKY_MAX_N", "SAVE_FORMAT_VERSIONS"]

logger = logging.getLogger(__name__)

#: With ``solver="auto"``, the largest n for which the Cholesky solver is chosen (on top of the memory rule).
AUTO_CHOLESKY_MAX_N: Dict[str, int] = {"cuda": 100_000, "cpu": 10_000}
# With solver="auto", training steps use GPyTorch's dense Cholesky only up to this n; above it they use CG
# (BBMM) on the fused kernel, which on an H200 was ~5x faster per step at n = 13.5k-15.6k (pol, elevators, bike,
# 2026-11-29: 13.8 s vs 2.6 s for 50 steps on pol), while prediction still uses the exact float64 Cholesky
# whenever AUTO_CHOLESKY_MAX_N and the memory rule allow it.
AUTO_TRAIN_CHOLESKY_MAX_N: Dict[str, int] = {"cuda": 4_096, "cpu": 10_000}
_DEFAULT_AUTO_CHOLESKY_MAX_N = 10_000
#: The Cholesky solver needs about this many float64 n x n matrices of free memory (matrix, factor, workspace).
_CHOLESKY_WORKSPACE_FACTOR = 3
#: ``save`` files this version of gpfast can read.
SAVE_FORMAT_VERSIONS = ("0.1.0",)
_SAVE_FORMAT = "gpfast.ExactGP"
#: Number of consecutive iterations over which the relative loss change must stay below ``tol``.
_TOL_PATIENCE = 5
# GaussianLikelihood's default noise constraint is GreaterThan(1e-4) (in standardised units).
_MIN_NOISE = 1e-4
# Bytes of (chunk x n) temporaries allowed per prediction chunk with the CG solver.
_CG_CHUNK_BYTES = 256 * 2**20

_FINITE_KW = (
    "ensure_all_finite" if "ensure_all_finite" in inspect.signature(check_array).parameters else "force_all_finite"
)
_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "single": torch.float32,
    "float64": torch.float64,
    "double": torch.float64,
}


def _gpfast_version() -> str:
    try:
        import gpfast

        return str(getattr(gpfast, "__version__", "0.1.0"))
    except Exception:  # pragma: no cover
        return "0.1.0"


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3g} GB"


def free_memory_bytes(device: torch.device) -> int:
    """Free memory (bytes) on ``device``: CUDA from ``torch.cuda.mem_get_info`` (plus memory the caching
    allocator holds but does not use); CPU from ``/proc/meminfo`` ``MemAvailable``, capped by a cgroup limit,
    falling back to ``os.sysconf``."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        reusable = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + max(reusable, 0))
    candidates = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    candidates.append(int(line.split()[1]) * 1024)
                    break
    except OSError:
        pass
    try:  # cgroup v2, then v1
        for limit_file, usage_file in (
            ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
            ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
        ):
            if os.path.exists(limit_file) and os.path.exists(usage_file):
                with open(limit_file) as f:
                    limit = f.read().strip()
                with open(usage_file) as f:
                    usage = int(f.read().strip())
                if limit.isdigit() and int(limit) < 2**60:
                    candidates.append(max(int(limit) - usage, 0))
                break
    except (OSError, ValueError):
        pass
    if not candidates:
        try:
            candidates.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):  # pragma: no cover
            candidates.append(8 * 2**30)
    return int(min(candidates))


def _cholesky_bytes(n: int) -> int:
    return 8 * n * n


def _describe(value: Any) -> str:
    r = repr(value)
    return r if len(r) <= 80 else r[:77] + "..."


class _InputInfo:
    """How the user passed X, so that outputs come back the same way (numpy, or torch on the same device)."""

    def __init__(self, is_torch: bool, device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None):
        self.is_torch = is_torch
        self.device = device
        self.dtype = dtype

    def out(self, t: torch.Tensor):
        if self.is_torch:
            dtype = self.dtype if (self.dtype is not None and self.dtype.is_floating_point) else torch.float64
            return t.detach().to(device=self.device, dtype=dtype)
        return t.detach().cpu().numpy()


class ExactGP(RegressorMixin, BaseEstimator):
    """Exact Gaussian-process regression with a scaled RBF kernel, scikit-learn style.

    Parameters
    ----------
    solver : {"auto", "cholesky", "cg"}, default="auto"
        Linear-algebra backend (see the module docstring). ``"auto"`` picks ``"cholesky"`` when three float64
        n x n matrices fit in the device's free memory and ``n <= AUTO_CHOLESKY_MAX_N`` (20k on CUDA, 10k on
        CPU), else ``"cg"``. The choice is stored in ``solver_``.
    optimizer : {"adam", "lbfgs"}, default="adam"
        ``torch.optim.Adam``, or ``torch.optim.LBFGS`` (strong-Wolfe line search, one L-BFGS iteration per
        ``max_iter`` step, so each step costs a few loss evaluations).
    lr : float, default=0.1
        Learning rate (Adam), or initial step length (L-BFGS).
    max_iter : int, default=50
        Optimisation steps on the full data. ``0`` keeps the initial hyperparameters.
    tol : float or None, default=None
        Stop early once ``|loss_i - loss_{i-1}| / max(|loss_{i-1}|, 1) < tol`` for 5 consecutive iterations
        (relative change, absolute when the loss is below 1 in magnitude). ``None`` runs all ``max_iter``.
    ard : bool, default=True
        One lengthscale per feature (automatic relevance determination) or a single shared one.
    noise_init, outputscale_init : float or None, default=None
        Initial noise variance and kernel output scale, in the units of ``y`` squared. ``None`` keeps GPyTorch's
        initialisation (``softplus(0) ~= 0.693`` in standardised units). The noise is at least 1e-4 in
        standardised units (GPyTorch's ``GaussianLikelihood`` constraint).
    lengthscale_init : float, array of shape (n_features,) or None, default=None
        Initial lengthscale(s) in the units of ``X`` (``ard=True``). With ``ard=False`` the single lengthscale
        acts on the standardised inputs, so it must be a float in standardised units. ``None`` keeps
        GPyTorch's initialisation (0.693 in standardised units).
    pretrain_subset : int or None, default=None
        Wang et al. (2019) schedule: first train ``pretrain_iter`` steps on a random subset of this many
        points, then ``max_iter`` steps on all the data. ``None`` (or a subset >= n) skips pretraining.
    pretrain_iter : int, default=10
        Steps on the subset when ``pretrain_subset`` is set.
    device : str, torch.device or None, default=None
        ``None`` picks ``"cuda"`` when available, else ``"cpu"``.
    dtype : {"float32", "float64"} or torch.dtype, default="float32"
        Training (and CG prediction) precision. The Cholesky predictions and the exact log marginal
        likelihood are always computed in float64. (A string default keeps ``get_params`` to plain types.)
    random_state : int, RandomState instance or None, default=None
        Seeds torch (CPU and CUDA, inside ``torch.random.fork_rng`` so the global generators are left alone)
        for the subset draw and the CG probe vectors: equal seeds give identical ``history_``.
    verbose : bool, default=True
        Print the solver choice and show a tqdm progress bar with the loss.
    cg_tolerance : float, default=1.0
        CG residual tolerance during training (GPyTorch's default; the loss only needs rough solves).
    eval_cg_tolerance : float, default=0.01
        CG residual tolerance for predictions.
    max_cg_iterations : int, default=1000
        Maximum CG iterations.
    preconditioner_size : int, default=15
        Rank of the pivoted-Cholesky preconditioner used by CG (0 disables it). 15 is GPyTorch's default; Wang et
        al. (2019) used 100 for their largest sets, where fewer CG iterations pay for the costlier preconditioner.
    distributed : bool, default=False
        Split every covariance product by rows over the ranks of an initialised ``torch.distributed`` process
        group (launch with ``torchrun``, call :func:`gpfast.distributed.init`; see :mod:`gpfast.distributed`).
        Training and prediction then use the matrix-free CG solver; every rank ends with the same model.
        ``device=None`` means this rank's GPU (or the CPU with the gloo backend).

    Attributes
    ----------
    X_train_, y_train_ : torch.Tensor
        Standardised training inputs (n, d) and targets (n,), float64, on ``device_``.
    x_mean_, x_std_ : numpy.ndarray of shape (n_features,)
        Input standardisation (std 1 for constant columns).
    y_mean_, y_std_ : float
        Target standardisation.
    model_ : gpfast.models.ExactGPModel
        The trained GPyTorch model (in ``dtype``, on ``device_``, in eval mode).
    likelihood_ : gpytorch.likelihoods.GaussianLikelihood
    solver_ : {"cholesky", "cg"}
        How predictions are made (and, for explicit solvers, training too).
    train_solver_ : {"cholesky", "cg"}
        How the training steps were taken (differs from ``solver_`` only under ``solver="auto"``).
    device_ : torch.device
    history_ : list of float
        Training loss (negative marginal log likelihood per data point, standardised units) per step on the
        full data; ``pretrain_history_`` the same on the subset.
    n_iter_ : int
        Steps taken on the full data.
    log_marginal_likelihood_ : float
        Log marginal likelihood of the standardised targets (total, not per point; comparable to
        scikit-learn's ``GaussianProcessRegressor(normalize_y=True).log_marginal_likelihood_value_``) at the
        fitted hyperparameters. Exact (float64 Cholesky) with the Cholesky solver, and with the CG solver too
        when the ``"auto"`` rule would have allowed a Cholesky (memory and ``AUTO_CHOLESKY_MAX_N``); otherwise
        GPyTorch's stochastic CG/Lanczos estimate, evaluated once more after the last step.
        ``log_marginal_likelihood_method_`` says which
        (``"cholesky"`` or ``"cg_estimate"``).
    lengthscale_ : numpy.ndarray of shape (n_features,)
        Fitted lengthscales in the units of X (standardised lengthscale * ``x_std_``).
    outputscale_, noise_ : float
        Kernel variance and noise variance in the units of y squared.
    constant_mean_ : float
        Prior mean in the units of y.
    n_features_in_ : int
    feature_names_in_ : numpy.ndarray
        Only when X was a DataFrame with string column names.
    """

    def __init__(
        self,
        solver: str = "auto",
        optimizer: str = "adam",
        lr: float = 0.1,
        max_iter: int = 50,
        tol: Optional[float] = None,
        ard: bool = True,
        noise_init: Optional[float] = None,
        outputscale_init: Optional[float] = None,
        lengthscale_init=None,
        pretrain_subset: Optional[int] = None,
        pretrain_iter: int = 10,
        device=None,
        dtype="float32",
        random_state=None,
        verbose: bool = True,
        cg_tolerance: float = 1.0,
        eval_cg_tolerance: float = 0.01,
        max_cg_iterations: int = 1000,
        preconditioner_size: int = 15,
        distributed: bool = False,
    ):
        self.solver = solver
        self.optimizer = optimizer
        self.lr = lr
        self.max_iter = max_iter
        self.tol = tol
        self.ard = ard
        self.noise_init = noise_init
        self.outputscale_init = outputscale_init
        self.lengthscale_init = lengthscale_init
        self.pretrain_subset = pretrain_subset
        self.pretrain_iter = pretrain_iter
        self.device = device
        self.dtype = dtype
        self.random_state = random_state
        self.verbose = verbose
        self.cg_tolerance = cg_tolerance
        self.eval_cg_tolerance = eval_cg_tolerance
        self.distributed = distributed
        self.max_cg_iterations = max_cg_iterations
        self.preconditioner_size = preconditioner_size

    # ------------------------------------------------------------------------------------------------------
    # parameter and input validation (nothing here modifies self)
    # ------------------------------------------------------------------------------------------------------
    def _resolve_params(self) -> Dict[str, Any]:
        def bad(name, expected):
            return ValueError(f"ExactGP: invalid {name}={_describe(getattr(self, name))}; expected {expected}.")

        def is_int(v):
            return isinstance(v, numbers.Integral) and not isinstance(v, bool)

        def is_real(v):
            return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(float(v))

        p: Dict[str, Any] = {}
        if not isinstance(self.solver, str) or self.solver not in ("auto", "cholesky", "cg"):
            raise bad("solver", "one of 'auto', 'cholesky', 'cg'")
        if not isinstance(self.optimizer, str) or self.optimizer.lower() not in ("adam", "lbfgs"):
            raise bad("optimizer", "one of 'adam', 'lbfgs'")
        p["optimizer"] = self.optimizer.lower()
        if not is_real(self.lr) or self.lr <= 0:
            raise bad("lr", "a positive float")
        if not is_int(self.max_iter) or self.max_iter < 0:
            raise bad("max_iter", "an int >= 0")
        if self.tol is not None and (not is_real(self.tol) or self.tol < 0):
            raise bad("tol", "None or a float >= 0")
        if self.ard not in (True, False):
            raise bad("ard", "True or False")
        for name in ("noise_init", "outputscale_init"):
            v = getattr(self, name)
            if v is not None and (not is_real(v) or v <= 0):
                raise bad(name, "None or a positive float")
        if self.pretrain_subset is not None and (not is_int(self.pretrain_subset) or self.pretrain_subset < 2):
            raise bad("pretrain_subset", "None or an int >= 2")
        if not is_int(self.pretrain_iter) or self.pretrain_iter < 0:
            raise bad("pretrain_iter", "an int >= 0")
        if not is_real(self.cg_tolerance) or self.cg_tolerance <= 0:
            raise bad("cg_tolerance", "a positive float")
        if not is_real(self.eval_cg_tolerance) or self.eval_cg_tolerance <= 0:
            raise bad("eval_cg_tolerance", "a positive float")
        if not is_int(self.max_cg_iterations) or self.max_cg_iterations < 1:
            raise bad("max_cg_iterations", "an int >= 1")
        if not is_int(self.preconditioner_size) or self.preconditioner_size < 0:
            raise bad("preconditioner_size", "an int >= 0")
        if self.verbose not in (True, False, 0, 1):
            raise bad("verbose", "True or False")
        # dtype
        dt = self.dtype
        if isinstance(dt, torch.dtype) and dt in (torch.float32, torch.float64):
            p["dtype"] = dt
        elif isinstance(dt, str) and dt.lower().replace("torch.", "") in _DTYPES:
            p["dtype"] = _DTYPES[dt.lower().replace("torch.", "")]
        elif isinstance(dt, (type, np.dtype)) and np.dtype(dt) in (np.float32, np.float64):
            p["dtype"] = torch.float32 if np.dtype(dt) == np.float32 else torch.float64
        else:
            raise bad("dtype", "'float32', 'float64', torch.float32 or torch.float64")
        # device
        if not isinstance(self.distributed, (bool, np.bool_)):
            raise bad("distributed", "True or False")
        if self.distributed:
            import torch.distributed as tdist

            if not (tdist.is_available() and tdist.is_initialized()):
                raise ValueError(
                    "ExactGP: distributed=True needs an initialised torch.distributed process group: launch with "
                    "`torchrun --nproc-per-node=K ...` and call gpfast.distributed.init() first."
                )
            if self.solver == "cholesky":
                raise ValueError(
                    "ExactGP: distributed=True runs the matrix-free CG solver; got solver='cholesky' (use 'auto' "
                    "or 'cg')."
                )
        p["distributed"] = bool(self.distributed)
        if self.device is None and self.distributed:
            import torch.distributed as tdist

            nccl = tdist.get_backend() == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        elif self.device is None:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            try:
                device = torch.device(self.device)
            except (RuntimeError, TypeError, ValueError):
                raise bad("device", "None, 'cpu', 'cuda', 'cuda:<index>' or a torch.device") from None
            if device.type == "cuda":
                if not torch.cuda.is_available():
                    raise ValueError(
                        f"ExactGP: device={_describe(self.device)} but CUDA is not available; use device='cpu' "
                        f"or device=None."
                    )
                if device.index is None:
                    device = torch.device("cuda", torch.cuda.current_device())
                elif device.index >= torch.cuda.device_count():
                    raise bad("device", f"a CUDA index below {torch.cuda.device_count()}")
        p["device"] = device
        # random state -> an int seed or None
        rs = self.random_state
        if rs is None:
            p["seed"] = None
        elif is_int(rs):
            if rs < 0:
                raise bad("random_state", "None, an int >= 0 or a numpy RandomState")
            p["seed"] = int(rs)
        elif isinstance(rs, np.random.RandomState):
            p["seed"] = int(check_random_state(rs).randint(0, 2**31 - 1))
        else:
            raise bad("random_state", "None, an int >= 0 or a numpy RandomState")
        return p

    @staticmethod
    def _as_tensor_2d(X, name: str = "X") -> Tuple[torch.Tensor, _InputInfo]:
        """float64 (n, d) tensor (on the input's device for tensors, CPU otherwise), finite-checked."""
        if torch.is_tensor(X):
            info = _InputInfo(True, X.device, X.dtype)
            if X.layout != torch.strided:
                raise TypeError(
                    f"{name} is a sparse torch tensor (layout {X.layout}); ExactGP needs a dense tensor: "
                    f"call {name}.to_dense()."
                )
            if X.is_complex():
                raise ValueError(f"{name} is a complex tensor ({X.dtype}); ExactGP needs real values.")
            if X.dim() != 2:
                raise ValueError(
                    f"Expected 2D array for {name}, got a {X.dim()}-D tensor of shape {tuple(X.shape)} instead; "
                    f"{name} must have shape (n_samples, n_features). Reshape your data using "
                    f"{name}.reshape(-1, 1) if it has a single feature or {name}.reshape(1, -1) if it contains "
                    f"a single sample."
                )
            if X.shape[1] < 1:
                raise ValueError(f"{name} has shape {tuple(X.shape)}: 0 feature(s), a minimum of 1 is required.")
            Xt = X.detach().to(torch.float64)
        else:
            info = _InputInfo(False)
            arr = check_array(X, dtype=np.float64, ensure_2d=True, ensure_min_samples=1, input_name=name,
                              **{_FINITE_KW: False})
            Xt = torch.from_numpy(np.array(arr, dtype=np.float64, copy=True, order="C"))
        _check_finite(Xt, name)
        return Xt, info

    @staticmethod
    def _as_tensor_y(y, n: int) -> torch.Tensor:
        if y is None:
            raise ValueError(
                "ExactGP requires y to be passed, but the target y is None; expected y of shape (n_samples,) "
                "or (n_samples, 1)."
            )
        if torch.is_tensor(y):
            if y.is_complex():
                raise ValueError(f"y is a complex tensor ({y.dtype}); ExactGP needs real values.")
            yt = y.detach().to(torch.float64)
        else:
            arr = check_array(y, dtype=np.float64, ensure_2d=False, ensure_min_samples=1, input_name="y",
                              **{_FINITE_KW: False})
            yt = torch.from_numpy(np.array(arr, dtype=np.float64, copy=True))
        if yt.dim() == 2 and yt.shape[1] == 1:
            warnings.warn(
                "A column-vector y was passed when a 1d array was expected. Please change the shape of y to "
                "(n_samples, ), for example using ravel().",
                DataConversionWarning,
                stacklevel=3,
            )
            yt = yt.reshape(-1)
        if yt.dim() != 1:
            raise ValueError(
                f"y must have shape (n_samples,) or (n_samples, 1), got shape {tuple(yt.shape)}; ExactGP fits a "
                f"single output."
            )
        _check_finite(yt, "y")
        if yt.shape[0] != n:
            raise ValueError(
                f"X and y have inconsistent numbers of samples: X has {n} rows but y has {yt.shape[0]} values; "
                f"expected one target per row of X."
            )
        return yt

    def _check_init_values(self, d: int, x_std: torch.Tensor, y_std: float) -> Dict[str, Optional[torch.Tensor]]:
        """Initial hyperparameters in standardised units (float64 CPU tensors), validated."""
        out: Dict[str, Optional[torch.Tensor]] = {"noise": None, "outputscale": None, "lengthscale": None}
        if self.noise_init is not None:
            v = float(self.noise_init) / y_std**2
            if v <= _MIN_NOISE:
                warnings.warn(
                    f"noise_init={self.noise_init!r} is {v:.3g} in standardised units, at or below GPyTorch's "
                    f"lower bound {_MIN_NOISE}; using {1.01 * _MIN_NOISE:.3g} (standardised) instead.",
                    UserWarning,
                    stacklevel=3,
                )
                v = 1.01 * _MIN_NOISE
            out["noise"] = torch.tensor(v, dtype=torch.float64)
        if self.outputscale_init is not None:
            out["outputscale"] = torch.tensor(float(self.outputscale_init) / y_std**2, dtype=torch.float64)
        if self.lengthscale_init is not None:
            try:
                ls = np.asarray(self.lengthscale_init, dtype=np.float64)
            except (TypeError, ValueError):
                ls = np.array([np.nan])
            if not self.ard:
                if ls.size != 1 or not np.isfinite(ls).all() or ls.item() <= 0:
                    raise ValueError(
                        f"ExactGP: invalid lengthscale_init={_describe(self.lengthscale_init)}; with ard=False "
                        f"expected a single positive float (in standardised input units)."
                    )
                out["lengthscale"] = torch.tensor(ls.item(), dtype=torch.float64).reshape(1, 1)
            else:
                if ls.ndim > 1 or ls.size not in (1, d) or not np.isfinite(ls).all() or (ls <= 0).any():
                    raise ValueError(
                        f"ExactGP: invalid lengthscale_init={_describe(self.lengthscale_init)}; expected a positive "
                        f"float or an array of {d} positive floats (one per feature, in the units of X)."
                    )
                ls_t = torch.from_numpy(np.broadcast_to(ls.reshape(-1), (d,)).copy())
                out["lengthscale"] = (ls_t / x_std).reshape(1, d)
        return out

    # ------------------------------------------------------------------------------------------------------
    # fit
    # ------------------------------------------------------------------------------------------------------
    def fit(self, X, y):
        """Standardise the data, train the hyperparameters, and (Cholesky solver) factor the covariance.

        ``X``: (n, d) numpy array, array-like or torch tensor; ``y``: (n,) or (n, 1). Every argument is
        validated before any fitted attribute changes: a failed ``fit`` leaves a previous fit intact.
        """
        # ---- validate everything first --------------------------------------------------------------------
        p = self._resolve_params()
        Xt, _ = self._as_tensor_2d(X, "X")
        n, d = Xt.shape
        yt = self._as_tensor_y(y, n)
        if n < 2:
            raise ValueError(
                f"X has n_samples = {n} ({n} sample(s)), but ExactGP needs at least 2 samples to fit a GP."
            )
        feature_names = _get_feature_names(X) if (_get_feature_names is not None and not torch.is_tensor(X)) else None

        x_mean = Xt.mean(0)
        x_std = Xt.std(0, unbiased=False)
        const_cols = torch.nonzero(x_std <= 1e-12 * torch.clamp(x_mean.abs(), min=1.0)).reshape(-1).tolist()
        if const_cols:
            warnings.warn(
                f"X has constant column(s) at index {const_cols} (zero variance over the {n} training points); "
                f"they carry no information for fitting and are only centred (std set to 1).",
                UserWarning,
                stacklevel=2,
            )
            x_std[const_cols] = 1.0
        y_mean = float(yt.mean())
        y_std = float(yt.std(unbiased=False))
        if not y_std > 1e-12 * max(abs(y_mean), 1.0):
            y_std = 1.0
        inits = self._check_init_values(d, x_std.cpu(), y_std)

        device, dtype = p["device"], p["dtype"]
        free = free_memory_bytes(device)
        need = _cholesky_bytes(n)
        cap = AUTO_CHOLESKY_MAX_N.get(device.type, _DEFAULT_AUTO_CHOLESKY_MAX_N)
        cholesky_fits = _CHOLESKY_WORKSPACE_FACTOR * need <= free
        if self.solver == "cholesky":
            if not cholesky_fits:
                raise ValueError(
                    f"ExactGP: n={n} is too large for solver='cholesky' on {device}: a float64 n x n matrix needs "
                    f"{_gb(need)} (about {_gb(_CHOLESKY_WORKSPACE_FACTOR * need)} with the factor and workspace) "
                    f"but only {_gb(free)} is free. Use solver='cg' (matrix-free, O(n) memory) or solver='auto'."
                )
            solver = train_solver = "cholesky"
            why = f"requested; {_gb(_CHOLESKY_WORKSPACE_FACTOR * need)} needed, {_gb(free)} free"
        elif self.solver == "cg" or p["distributed"]:
            solver = train_solver = "cg"
            why = "requested" if self.solver == "cg" else "distributed over the ranks of torch.distributed"
        else:
            solver = "cholesky" if (cholesky_fits and n <= cap) else "cg"
            train_cap = AUTO_TRAIN_CHOLESKY_MAX_N.get(device.type, _DEFAULT_AUTO_CHOLESKY_MAX_N)
            train_solver = "cholesky" if (solver == "cholesky" and n <= train_cap) else "cg"
            why = (
                f"auto: n={n} {'<=' if n <= cap else '>'} {cap}, {_CHOLESKY_WORKSPACE_FACTOR} float64 n x n "
                f"matrices need {_gb(_CHOLESKY_WORKSPACE_FACTOR * need)}, {_gb(free)} free on {device}"
            )
        subset = self.pretrain_subset
        if subset is not None and subset >= n:
            warnings.warn(
                f"pretrain_subset={subset} >= n_samples={n}: skipping the subset pretraining.",
                UserWarning,
                stacklevel=2,
            )
            subset = None

        # ---- train (all in locals) ------------------------------------------------------------------------
        verbose = bool(self.verbose)
        msg = (f"gpfast.ExactGP: n={n}, d={d}, solver={solver} ({why}), training steps with {train_solver}, "
               f"device={device}, dtype={dtype}")
        logger.info(msg)
        if verbose:
            print(msg, file=sys.stderr)

        Xs = ((Xt - x_mean) / x_std).to(device)
        ys = ((yt - y_mean) / y_std).to(device)
        seed = p["seed"]
        if seed is None:
            rng_ctx = contextlib.nullcontext()
        else:
            devices = list(range(torch.cuda.device_count())) if device.type == "cuda" else []
            rng_ctx = torch.random.fork_rng(devices=devices)
        with rng_ctx:
            if seed is not None:
                torch.manual_seed(seed)  # also seeds every CUDA device
            likelihood = gpytorch.likelihoods.GaussianLikelihood()
            Xd, yd = Xs.to(dtype), ys.to(dtype)
            pretrain_history = []
            if subset is not None:
                gen = torch.Generator().manual_seed(seed) if seed is not None else None
                idx = torch.randperm(n, generator=gen)[:subset].to(device)
                model = ExactGPModel(Xd[idx], yd[idx], likelihood, ard=bool(self.ard), distributed=p["distributed"])
                model = model.to(device=device, dtype=dtype)
            else:
                model = ExactGPModel(Xd, yd, likelihood, ard=bool(self.ard), distributed=p["distributed"])
                model = model.to(device=device, dtype=dtype)
            self._initialise(model, inits, device, dtype)
            if subset is not None:
                sub_solver = solver
                if self.solver == "auto":
                    fits = _CHOLESKY_WORKSPACE_FACTOR * _cholesky_bytes(subset) <= free
                    sub_cap = AUTO_TRAIN_CHOLESKY_MAX_N.get(device.type, _DEFAULT_AUTO_CHOLESKY_MAX_N)
                    sub_solver = "cholesky" if (fits and subset <= sub_cap) else "cg"
                pretrain_history = self._train(
                    model, self.pretrain_iter, sub_solver, p, f"gpfast pretrain ({subset} pts, {sub_solver})"
                )
                model.set_train_data(inputs=Xd, targets=yd, strict=False)
            history = self._train(model, self.max_iter, train_solver, p, f"gpfast fit ({train_solver})")

            model.eval()
            likelihood.eval()
            hyp = _hyperparameters_float64(model)
            predictor = None
            lml_method = "cholesky"
            exact_feasible = solver == "cholesky" or (cholesky_fits and n <= cap)
            if exact_feasible:
                K = _kernel64(Xs, Xs, hyp)
                predictor = CholeskyPredictor(K, ys, hyp["noise"], hyp["mean"], overwrite=True)
                del K
                lml = float(predictor.log_marginal_likelihood())
                if solver != "cholesky":
                    predictor = None
            else:
                lml_method = "cg_estimate"
                lml = n * self._mll_estimate(model, p)

        # ---- commit ---------------------------------------------------------------------------------------
        for attr in ("feature_names_in_",):
            if hasattr(self, attr):
                delattr(self, attr)
        if feature_names is not None:
            self.feature_names_in_ = feature_names
        self.n_features_in_ = d
        self.device_ = device
        self.X_train_ = Xs
        self.y_train_ = ys
        self.x_mean_ = x_mean.cpu().numpy()
        self.x_std_ = x_std.cpu().numpy()
        self.y_mean_ = y_mean
        self.y_std_ = y_std
        self.model_ = model
        self.likelihood_ = likelihood
        self.solver_ = solver
        self.train_solver_ = train_solver
        self.history_ = history
        self.pretrain_history_ = pretrain_history
        self.n_iter_ = len(history)
        self.log_marginal_likelihood_ = lml
        self.log_marginal_likelihood_method_ = lml_method
        self._dtype = dtype
        self._settings = {k: p[k] for k in ("optimizer",)}
        self._predictor = predictor
        self._set_hyperparameter_attributes(hyp)
        return self

    @staticmethod
    def _initialise(model: ExactGPModel, inits, device, dtype) -> None:
        kw = dict(device=device, dtype=dtype)
        if inits["noise"] is not None:
            model.likelihood.noise = inits["noise"].to(**kw)
        if inits["outputscale"] is not None:
            model.covar_module.outputscale = inits["outputscale"].to(**kw)
        if inits["lengthscale"] is not None:
            model.covar_module.base_kernel.lengthscale = inits["lengthscale"].to(**kw)

    def _solver_context(self, solver: str, p=None) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if solver == "cholesky":
            stack.enter_context(gpytorch.settings.max_cholesky_size(2**62))
        else:
            stack.enter_context(gpytorch.settings.max_cholesky_size(0))
            stack.enter_context(gpytorch.settings.cg_tolerance(float(self.cg_tolerance)))
            stack.enter_context(gpytorch.settings.eval_cg_tolerance(float(self.eval_cg_tolerance)))
            stack.enter_context(gpytorch.settings.max_cg_iterations(int(self.max_cg_iterations)))
            stack.enter_context(gpytorch.settings.max_preconditioner_size(int(self.preconditioner_size)))
        return stack

    def _train(self, model: ExactGPModel, n_steps: int, solver: str, p, desc: str):
        history = []
        if n_steps <= 0:
            return history
        likelihood = model.likelihood
        model.train()
        likelihood.train()
        mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
        params = [q for q in model.parameters() if q.requires_grad]  # includes the likelihood's
        if p["optimizer"] == "adam":
            opt = torch.optim.Adam(params, lr=float(self.lr))
        else:
            opt = torch.optim.LBFGS(params, lr=float(self.lr), max_iter=1, line_search_fn="strong_wolfe")
        X, y = model.train_inputs[0], model.train_targets

        def closure():
            opt.zero_grad(set_to_none=True)
            loss = -mll(model(X), y)
            loss.backward()
            return loss

        bar = tqdm(range(n_steps), desc=desc, disable=not self.verbose, leave=False, file=sys.stderr)
        with self._solver_context(solver, p):
            for i in bar:
                try:
                    if p["optimizer"] == "adam":
                        loss = closure()
                        opt.step()
                    else:
                        loss = opt.step(closure)
                except NotPSDError as exc:
                    bar.close()
                    raise NotPSDError(
                        f"ExactGP: the training covariance stopped being numerically positive definite at step {i} "
                        f"({desc}, dtype={p['dtype']}): {exc}. Try dtype='float64', a smaller lr, or a larger "
                        f"noise_init. The estimator was not modified."
                    ) from exc
                value = float(loss.detach())
                if not math.isfinite(value):
                    bar.close()
                    raise FloatingPointError(
                        f"ExactGP: the training loss became {value} at step {i} ({desc}); try a smaller lr, "
                        f"dtype='float64', or solver='cholesky'. The estimator was not modified."
                    )
                history.append(value)
                bar.set_postfix(loss=f"{value:.4f}")
                if self.tol is not None and len(history) > _TOL_PATIENCE:
                    recent = history[-_TOL_PATIENCE - 1 :]
                    changes = [abs(b - a) / max(abs(a), 1.0) for a, b in zip(recent[:-1], recent[1:])]
                    if max(changes) < self.tol:
                        break
        bar.close()
        return history

    def _mll_estimate(self, model: ExactGPModel, p) -> float:
        """GPyTorch's (CG/Lanczos) estimate of the marginal log likelihood per data point at the current
        hyperparameters."""
        likelihood = model.likelihood
        model.train()
        likelihood.train()
        mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
        try:
            with torch.no_grad(), self._solver_context("cg", p):
                value = float(mll(model(model.train_inputs[0]), model.train_targets))
        finally:
            model.eval()
            likelihood.eval()
        return value

    def _set_hyperparameter_attributes(self, hyp: Dict[str, torch.Tensor]) -> None:
        x_std = torch.as_tensor(self.x_std_, dtype=torch.float64)
        ls = hyp["lengthscale"].detach().cpu().reshape(-1)
        self.lengthscale_ = (ls * x_std).numpy()  # (1,) broadcasts when ard=False
        self.outputscale_ = float(hyp["outputscale"]) * self.y_std_**2
        self.noise_ = float(hyp["noise"]) * self.y_std_**2
        self.constant_mean_ = float(hyp["mean"]) * self.y_std_ + self.y_mean_

    # ------------------------------------------------------------------------------------------------------
    # predict / score
    # ------------------------------------------------------------------------------------------------------
    def _validate_X_predict(self, X) -> Tuple[torch.Tensor, _InputInfo]:
        check_is_fitted(self)
        if _check_feature_names is not None and not torch.is_tensor(X):
            _check_feature_names(self, X, reset=False)
        Xt, info = self._as_tensor_2d(X, "X")
        if Xt.shape[1] != self.n_features_in_:
            raise ValueError(
                f"X has {Xt.shape[1]} features, but ExactGP is expecting {self.n_features_in_} features as input."
            )
        x_mean = torch.as_tensor(self.x_mean_, dtype=torch.float64, device=Xt.device)
        x_std = torch.as_tensor(self.x_std_, dtype=torch.float64, device=Xt.device)
        return ((Xt - x_mean) / x_std).to(self.device_), info

    def _get_predictor(self) -> CholeskyPredictor:
        pred = getattr(self, "_predictor", None)
        if pred is None:
            hyp = _hyperparameters_float64(self.model_)
            K = _kernel64(self.X_train_, self.X_train_, hyp)
            pred = CholeskyPredictor(K, self.y_train_, hyp["noise"], hyp["mean"], overwrite=True)
            self._predictor = pred
        return pred

    def predict(self, X, return_std: bool = False, return_cov: bool = False, include_noise: bool = True):
        """Posterior predictive mean (and std or covariance) at X, in the units of y.

        Parameters
        ----------
        X : (n_test, n_features) numpy array, array-like or torch tensor
        return_std : bool
            Also return the predictive standard deviation (n_test,).
        return_cov : bool
            Also return the predictive covariance (n_test, n_test). At most one of ``return_std`` and
            ``return_cov``.
        include_noise : bool, default=True
            ``True``: std/cov of a new noisy observation ``y* = f(x*) + eps`` (latent variance + ``noise_``),
            the quantity to compare with held-out targets (and to use in a predictive NLL). ``False``: of the
            latent function ``f(x*)`` only. (scikit-learn's ``GaussianProcessRegressor`` corresponds to
            ``True`` when its noise is a ``WhiteKernel`` and to ``False`` when it is ``alpha``.)

        Returns
        -------
        mean, or (mean, std), or (mean, cov): numpy float64 arrays for numpy/array-like X, torch tensors on X's
        device (in X's floating dtype) for a tensor X.

        With ``solver_ == "cholesky"`` the posterior is exact in float64 (factorisation done once in
        ``fit``, test points processed in chunks); with ``"cg"`` it is GPyTorch's prediction
        (``fast_pred_var`` off, so variances are solved for, not approximated) in the training dtype.
        """
        if return_std and return_cov:
            raise ValueError(
                "ExactGP.predict: at most one of return_std and return_cov can be True, got both True."
            )
        Xs, info = self._validate_X_predict(X)
        want_var = bool(return_std or return_cov)
        if self.solver_ == "cholesky":
            pred = self._get_predictor()
            hyp = _hyperparameters_float64(self.model_)
            res = pred.predict_from_kernel(
                lambda a, b: _kernel64(a, b, hyp),
                self.X_train_,
                Xs,
                prior_var=float(hyp["outputscale"]),
                return_var=bool(return_std),
                return_cov=bool(return_cov),
                include_noise=bool(include_noise),
            )
        else:
            res = self._predict_cg(Xs, bool(return_std), bool(return_cov), bool(include_noise))
        y_std, y_mean = self.y_std_, self.y_mean_
        if not want_var:
            return info.out(res * y_std + y_mean)
        mean, second = res
        mean = mean * y_std + y_mean
        if return_std:
            return info.out(mean), info.out(second.clamp(min=0).sqrt() * y_std)
        return info.out(mean), info.out(second * y_std**2)

    def _predict_cg(self, Xs: torch.Tensor, return_std: bool, return_cov: bool, include_noise: bool):
        model, likelihood = self.model_, self.likelihood_
        model.eval()
        likelihood.eval()
        Xd = Xs.to(self._dtype)
        n = self.X_train_.shape[0]
        step = max(1, _CG_CHUNK_BYTES // (4 * max(n, 1)))
        if return_cov:
            step = max(Xd.shape[0], 1)  # the full covariance needs all test points at once
        means, seconds = [], []
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            stack.enter_context(self._solver_context("cg"))
            stack.enter_context(gpytorch.settings.fast_pred_var(False))
            stack.enter_context(gpytorch.settings.skip_posterior_variances(not (return_std or return_cov)))
            stack.enter_context(warnings.catch_warnings())
            warnings.filterwarnings("ignore", message=".*input matches the stored training data.*")
            for s in range(0, Xd.shape[0], step):
                dist = model(Xd[s : s + step])
                if include_noise:
                    dist = likelihood(dist)
                means.append(dist.mean.to(torch.float64))
                if return_std:
                    seconds.append(dist.variance.to(torch.float64))
                elif return_cov:
                    seconds.append(dist.covariance_matrix.to(torch.float64))
        empty = torch.zeros(0, dtype=torch.float64, device=self.device_)
        mean = torch.cat(means) if means else empty
        if not (return_std or return_cov):
            return mean
        if return_cov:
            cov = seconds[0] if seconds else torch.zeros(0, 0, dtype=torch.float64, device=self.device_)
            return mean, cov
        return mean, (torch.cat(seconds) if seconds else empty)

    def score(self, X, y, sample_weight=None) -> float:
        """Coefficient of determination R^2 of ``predict(X)`` against y (numpy or torch inputs)."""
        y_pred = self.predict(X)
        if torch.is_tensor(y_pred):
            y_pred = y_pred.detach().cpu().to(torch.float64).numpy()
        if torch.is_tensor(y):
            y = y.detach().cpu().to(torch.float64).numpy()
        if torch.is_tensor(sample_weight):
            sample_weight = sample_weight.detach().cpu().numpy()
        y = np.asarray(y)
        if y.ndim == 2 and y.shape[1] == 1:
            y = y.reshape(-1)
        return float(r2_score(y, y_pred, sample_weight=sample_weight))

    # ------------------------------------------------------------------------------------------------------
    # persistence
    # ------------------------------------------------------------------------------------------------------
    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_predictor", None)  # an n x n float64 factor: rebuilt on the first predict after unpickling
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if "model_" in state:
            self._predictor = None

    def _save_params(self) -> Dict[str, Any]:
        params = self.get_params(deep=False)
        if isinstance(params.get("dtype"), (type, np.dtype)):
            params["dtype"] = str(np.dtype(params["dtype"]))
        if params.get("lengthscale_init") is not None:
            params["lengthscale_init"] = np.asarray(params["lengthscale_init"], dtype=np.float64).tolist()
        if isinstance(params.get("random_state"), np.random.RandomState):
            params["random_state"] = None
        if isinstance(params.get("device"), torch.device):
            params["device"] = str(params["device"])
        return params

    def save(self, path) -> None:
        """Save the fitted estimator to ``path`` with ``torch.save`` (everything on the CPU, no pickled
        classes: the file loads with ``torch.load(..., weights_only=True)``)."""
        check_is_fitted(self)
        cpu = lambda t: t.detach().cpu()  # noqa: E731
        state = {
            "format": _SAVE_FORMAT,
            "version": _gpfast_version(),
            "params": self._save_params(),
            "n_features_in_": int(self.n_features_in_),
            "feature_names_in_": (
                [str(c) for c in self.feature_names_in_] if hasattr(self, "feature_names_in_") else None
            ),
            "device_": str(self.device_),
            "dtype_": str(self._dtype).replace("torch.", ""),
            "x_mean_": torch.from_numpy(np.asarray(self.x_mean_, dtype=np.float64)),
            "x_std_": torch.from_numpy(np.asarray(self.x_std_, dtype=np.float64)),
            "y_mean_": float(self.y_mean_),
            "y_std_": float(self.y_std_),
            "X_train_": cpu(self.X_train_),
            "y_train_": cpu(self.y_train_),
            "model_state_dict": {k: cpu(v) for k, v in self.model_.state_dict().items()},
            "likelihood_state_dict": {k: cpu(v) for k, v in self.likelihood_.state_dict().items()},
            "solver_": self.solver_,
            "train_solver_": getattr(self, "train_solver_", self.solver_),
            "history_": [float(v) for v in self.history_],
            "pretrain_history_": [float(v) for v in self.pretrain_history_],
            "n_iter_": int(self.n_iter_),
            "log_marginal_likelihood_": float(self.log_marginal_likelihood_),
            "log_marginal_likelihood_method_": self.log_marginal_likelihood_method_,
        }
        torch.save(state, path)

    @classmethod
    def load(cls, path, device=None) -> "ExactGP":
        """Rebuild an estimator saved with :meth:`save`; predictions are identical to the saved one's.

        ``device``: where to put it (default: the saved ``device`` parameter; a CUDA estimator loads on the CPU,
        with a warning, when CUDA is unavailable).
        """
        state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or state.get("format") != _SAVE_FORMAT:
            raise ValueError(f"{path!r} is not a gpfast.ExactGP file (no format={_SAVE_FORMAT!r} entry).")
        version = state.get("version")
        if version is None:
            raise ValueError(f"{path!r} has no 'version' entry; cannot tell how to read it.")
        known = set(SAVE_FORMAT_VERSIONS) | {_gpfast_version()}
        if version not in known:
            raise ValueError(
                f"{path!r} was saved by gpfast version {version!r}, which this gpfast ({_gpfast_version()}) "
                f"cannot read; readable versions: {sorted(known)}."
            )
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
        p = est._resolve_params()
        device_, dtype = p["device"], p["dtype"]
        X_train = state["X_train_"].to(device_)
        y_train = state["y_train_"].to(device_)
        likelihood = gpytorch.likelihoods.GaussianLikelihood()
        model = ExactGPModel(X_train.to(dtype), y_train.to(dtype), likelihood, ard=bool(params["ard"]),
                             distributed=bool(params.get("distributed", False)))
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
        est._dtype = dtype
        est._settings = {"optimizer": p["optimizer"]}
        est._predictor = None
        est._set_hyperparameter_attributes(_hyperparameters_float64(model))
        return est

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.allow_nan = False
        tags.input_tags.sparse = False
        return tags


# ----------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------
def _check_finite(t: torch.Tensor, name: str) -> None:
    if t.numel() == 0 or bool(torch.isfinite(t).all()):
        return
    nan = torch.isnan(t)
    inf = torch.isinf(t)
    parts = []
    if bool(nan.any()):
        first = tuple(int(i) for i in torch.nonzero(nan)[0].tolist())
        parts.append(f"{int(nan.sum())} NaN value(s) (first at index {first})")
    if bool(inf.any()):
        first = tuple(int(i) for i in torch.nonzero(inf)[0].tolist())
        parts.append(f"{int(inf.sum())} infinite value(s) (inf/-inf, first at index {first})")
    raise ValueError(
        f"Input {name} contains " + " and ".join(parts) + "; ExactGP needs finite values: drop or impute them "
        "first."
    )


def _hyperparameters_float64(model: ExactGPModel) -> Dict[str, torch.Tensor]:
    """Hyperparameters in standardised units, computed in float64 from the raw parameters (so that the
    reported values and the float64 predictions agree exactly, whatever the training dtype)."""
    kern = model.covar_module
    base = kern.base_kernel
    lik = model.likelihood.noise_covar
    with torch.no_grad():
        ls = base.raw_lengthscale_constraint.transform(base.raw_lengthscale.detach().to(torch.float64))
        os_ = kern.raw_outputscale_constraint.transform(kern.raw_outputscale.detach().to(torch.float64))
        noise = lik.raw_noise_constraint.transform(lik.raw_noise.detach().to(torch.float64))
        mean = model.mean_module.constant.detach().to(torch.float64)
    return {
        "lengthscale": ls.reshape(1, -1),
        "outputscale": os_.reshape(()),
        "noise": noise.reshape(()),
        "mean": mean.reshape(()),
    }


def _kernel64(a: torch.Tensor, b: torch.Tensor, hyp: Dict[str, torch.Tensor]) -> torch.Tensor:
    """Noise-free prior covariance k(a, b) in float64 (standardised units)."""
    a = a.to(torch.float64)
    b = b.to(device=a.device, dtype=torch.float64)
    ls = hyp["lengthscale"].to(a.device)
    os_ = hyp["outputscale"].to(a.device)
    return rbf_covariance(a, b, ls, os_)
