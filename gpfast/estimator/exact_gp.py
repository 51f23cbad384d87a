"""``gpfast.ExactGP``: a scikit-learn style estimator for exact GP regression on gpfast's fused RBF kernel.

Example::

    from gpfast import ExactGP

    gp = ExactGP().fit(X_train, y_train)                      # numpy or torch, on the GPU when there is one
    mean, std = gp.predict(X_test, return_std=True)            # std of the noisy target y, in y's units
    gp.score(X_test, y_test)                                   # R^2
    gp.save("gp.pt"); gp2 = ExactGP.load("gp.pt")

Model: ``y = f(x) + eps``, ``f ~ GP(c, s * exp(-0.5 |(x - x') / l|^2))``, ``eps ~ N(0, noise)``, fitted on
standardised data (:mod:`gpfast.standardize`: each input column and the target centred and scaled to unit
variance with the training statistics); the fitted hyperparameters are reported back in the original units
(``lengthscale_``, ``outputscale_``, ``noise_``, ``constant_mean_``). This class orchestrates; the parts live
beside it: argument checks (:mod:`~gpfast.estimator.params`), input handling (:mod:`~gpfast.estimator.inputs`),
how a fit runs (:mod:`~gpfast.estimator.solver`), the optimiser runs (:mod:`~gpfast.estimator.fitting`),
prediction (:mod:`~gpfast.estimator.prediction`) and save files (:mod:`~gpfast.estimator.persistence`).
"""

from __future__ import annotations

import logging
import sys
import warnings

import gpytorch
import numpy as np
import torch
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.metrics import r2_score
from sklearn.utils.validation import check_is_fitted

from sklearn.exceptions import ConvergenceWarning

from gpfast.estimator import checkpoint as _checkpoint
from gpfast.estimator import params as _params
from gpfast.estimator import persistence, prediction
from gpfast.estimator.hyperparameters import (
    LENGTHSCALE_BOUNDS,
    NOISE_BOUNDS,
    OUTPUTSCALE_BOUNDS,
    HyperparameterSpace,
)
from gpfast.estimator.inputs import standardization, validate_X, validate_y
from gpfast.estimator.restarts import starting_points
from gpfast.estimator import solver as _solver
from gpfast.estimator.solver import FitPlan, plan_fit
from gpfast.estimator.fitting import engine_attributes, mll_estimate, run_plan, seeded
from gpfast.models import ExactGPModel, ExactPosterior
from gpfast.standardize import column_stats
from gpfast.train import CGSettings

__all__ = ["ExactGP"]

logger = logging.getLogger(__name__)


class ExactGP(RegressorMixin, BaseEstimator):
    """Exact Gaussian-process regression with a scaled RBF kernel, scikit-learn style.

    Parameters
    ----------
    solver : {"auto", "cholesky", "cg"}, default="auto"
        Linear-algebra backend (see :mod:`gpfast.estimator.solver`). ``"auto"`` picks ``"cholesky"`` when three
        float64 n x n matrices fit in the device's free memory and ``n <= AUTO_CHOLESKY_MAX_N`` (100k on CUDA,
        10k on CPU), else ``"cg"``; it then trains with the exact objective up to ``AUTO_TRAIN_CHOLESKY_MAX_N`` (4096
        on CUDA, 1500 on CPU, where CG steps become the cheaper way to a fit) and with CG above, while predictions
        stay exact. One rule decides solver, training steps, optimiser and dtype
        (:func:`gpfast.estimator.solver.plan_fit`); the choices are stored in ``solver_``, ``train_solver_``,
        ``trainer_``, ``optimizer_`` and ``product_``.
    optimizer : {"auto", "lbfgs", "adam"}, default="auto"
        How the hyperparameters are fitted (:mod:`gpfast.estimator.optimize`), in log space inside the bounds of
        :mod:`gpfast.estimator.hyperparameters`. ``"lbfgs"``: scipy's L-BFGS-B (strong-Wolfe line search) with
        scikit-learn's tolerances, for a deterministic loss. ``"adam"``: Adam with a convergence test on the loss
        averaged over windows of 10 steps. ``"auto"``: L-BFGS when training with the ``"cholesky"`` solver (the
        exact float64 marginal likelihood), Adam with ``"cg"`` (a stochastic estimate). The choice is stored in
        ``optimizer_``.
    lr : float, default=0.1
        Adam's learning rate (L-BFGS takes no learning rate). One that makes the loss blow up raises
        FloatingPointError (TrainingDivergedError) and leaves the estimator unchanged.
    max_iter : int, default=1000
        Cap on the optimiser's iterations on the full data (L-BFGS iterations or Adam steps). Stopping there
        before the stopping rule is met gives a ``ConvergenceWarning`` and ``converged_ = False``. ``0`` keeps the
        initial hyperparameters.
    tol : float or None, default=None
        Stopping tolerance: L-BFGS's relative decrease of the loss per iteration (``ftol``, default 2.2e-9 as in
        scipy and scikit-learn); Adam's relative change of the windowed mean loss (default 1e-4; ``0`` runs all
        ``max_iter`` steps).
    n_restarts : int, default=0
        Further optimiser runs from random data-driven starting points (scikit-learn's ``n_restarts_optimizer``;
        see :meth:`gpfast.estimator.hyperparameters.HyperparameterSpace.random`), seeded by ``random_state``; the
        run with the best marginal likelihood is kept (``restart_losses_`` has each run's final loss). At most 1000.
    ard : bool, default=True
        One lengthscale per feature (automatic relevance determination) or a single shared one.
    noise_init, outputscale_init : float or None, default=None
        Initial noise variance and kernel output scale, in the units of ``y`` squared. ``None``: GPyTorch's
        initialisation (``softplus(0) ~= 0.693`` in standardised units). The fit keeps them within bounds
        (:mod:`gpfast.estimator.hyperparameters`: outputscale ``[1e-4, 1e4]`` and noise ``[1e-4, 1e2]`` times the
        variance of y, the noise floor being also GPyTorch's ``GaussianLikelihood`` constraint); initial values
        outside are moved to the nearest bound, with a warning.
    lengthscale_init : float, array of shape (n_features,) or None, default=None
        Initial lengthscale(s) in the units of ``X`` (``ard=True``). With ``ard=False`` the single lengthscale
        acts on the standardised inputs, so it must be a float in standardised units. ``None``: each feature's
        standard deviation (1 in standardised units, scikit-learn's default). Fitted lengthscales stay within
        ``[1e-2, 1e3]`` times each feature's standard deviation.
    standardize : bool, default=True
        Centre and scale X's columns and y with the training statistics (:mod:`gpfast.standardize`) before
        fitting. ``False`` fits the data as given (for data already standardised, as ``gpfast.datasets`` returns
        them); the initial values are then in those units.
    pretrain : (int, int) or None, default=None
        ``(n_points, n_steps)``: the schedule of Wang et al. (2019), first ``n_steps`` optimiser steps on a random
        subset of ``n_points`` points, then ``max_iter`` steps on all the data. ``None`` (or a subset >= n) skips
        pretraining.
    device : str, torch.device or None, default=None
        ``None`` picks ``"cuda"`` when available, else ``"cpu"``.
    dtype : {"float32", "float64"} or torch.dtype, default="float32"
        Precision of CG training and CG prediction, and of the stored model. Training with the Cholesky solver,
        the Cholesky predictions and the exact log marginal likelihood are always float64. (A string default
        keeps ``get_params`` to plain types.)
    random_state : int, RandomState instance or None, default=None
        Seeds torch (CPU and CUDA, inside ``torch.random.fork_rng`` so the global generators are left alone)
        for the subset draw and the CG probe vectors: equal seeds give identical ``history_``.
    verbose : bool, default=False
        Print the solver choice and show a tqdm progress bar with the loss (on stderr). Quiet by default.
    cg : gpfast.CGSettings, dict or None, default=None
        Settings of every conjugate-gradient solve (:class:`gpfast.CGSettings`, which documents each field and the
        measurements behind its default), or a dict of some of its fields; ``None``: the defaults. Its training
        fields (``cg_tolerance``, ``max_cg_iterations``, ``preconditioner_rank``, ``num_probes``, ...) drive gpfast's
        engine, its ``predict_*`` fields the predictions by CG, and its ``trainer`` who takes the CG training steps
        (``"auto"``: gpfast's engine under Adam, GPyTorch's loop under L-BFGS; ``"gpfast"``: the engine for every
        step; ``"gpytorch"``: GPyTorch's loop, under ``gpytorch.settings``, for comparisons).
    distributed : bool, default=False
        Split every covariance product by rows over the ranks of an initialised ``torch.distributed`` process
        group (launch with ``torchrun``, call :func:`gpfast.kernels.distributed.init`). Training and prediction
        then use the matrix-free CG solver; every rank ends with the same model. ``device=None`` means this
        rank's GPU (or the CPU with the gloo backend).
    checkpoint : str, path or None, default=None
        Make the fit resumable (:mod:`gpfast.estimator.checkpoint`): every ``checkpoint_every`` optimiser steps,
        and after each optimiser run, the whole training state goes to this file (atomically, with a checksum).
        A ``fit`` that finds the file there resumes from it when it was written for the same data and settings,
        and otherwise raises ValueError saying what differs; the resumed fit takes the same steps as an
        uninterrupted one (bit for bit on the CPU with a seed). The file is deleted when the fit succeeds.
        Not with ``distributed=True``.
    checkpoint_every : int, default=10
        Optimiser steps between checkpoints (each one writes the engine's probes and warm starts: about
        ``8 n (2 s + 1)`` bytes in float32, 85 MB at n = 1M).
    Attributes
    ----------
    X_train_, y_train_ : torch.Tensor
        Standardised training inputs (n, d) and targets (n,), float64, on ``device_``.
    x_mean_, x_std_ : numpy.ndarray of shape (n_features,)
        Input standardisation (std 1 for constant columns; 0 and 1 with ``standardize=False``).
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
    optimizer_ : {"lbfgs", "adam"}
        The optimiser that fitted the hyperparameters.
    history_ : list of float
        Training loss (negative marginal log likelihood per data point, standardised units) per iteration on the
        full data, of the run kept among the restarts; ``pretrain_history_`` the same on the subset.
    n_iter_ : int
        Iterations taken on the full data by the run kept.
    converged_ : bool
        The optimiser's stopping rule was met before ``max_iter`` (False when ``max_iter=0``).
    restart_losses_ : list of float
        Final training loss of each run: the first start, then the ``n_restarts`` random ones.
    trainer_ : {"gpfast", "exact", "gpytorch"}
        Who took the training steps on the full data: gpfast's engine, the exact float64 Cholesky objective
        (:mod:`~gpfast.estimator.exact_objective`), or GPyTorch's marginal likelihood (see ``cg``).
    product_ : {"stored", "matrix_free"} or None
        With ``trainer_ == "gpfast"``: whether the engine's products on the full data read a stored K or
        recomputed it (:class:`gpfast.CGSettings` ``product``); None otherwise.
    cg_iterations_, cg_residuals_ : list of int, list of float, or None
        With ``trainer_ == "gpfast"``: the engine's CG iterations and its final relative residual (the data
        column's or the probes' mean, whichever is larger) at each step (each objective evaluation: L-BFGS
        evaluates several times per step); None otherwise.
    history_data_fit_, history_log_det_estimate_ : list of float or None
        With ``trainer_ == "gpfast"``: the two parts of the loss at each evaluation, ``history_ = data_fit +
        log_det_estimate + log(2 pi) / 2``: the data-fit term ``(y - m)^T K^-1 (y - m) / (2n)`` from the solve
        (exact up to the CG residual) and an *estimate* of ``log|K| / (2n)`` (stochastic Lanczos quadrature on
        the first step, carried along by the estimated gradient); None otherwise.
    step_seconds_ : list of float or None
        With ``trainer_ == "gpfast"``: wall time of each engine step (products, solve and gradient; the device is
        synchronised at the end of each), for benchmarks; None otherwise.
    log_marginal_likelihood_ : float
        Log marginal likelihood of the standardised targets (total, not per point; comparable to
        scikit-learn's ``GaussianProcessRegressor(normalize_y=True).log_marginal_likelihood_value_``) at the
        fitted hyperparameters. Exact (float64 Cholesky) whenever the ``"auto"`` rule allows a Cholesky (memory
        and ``AUTO_CHOLESKY_MAX_N``), whichever solver trained; otherwise GPyTorch's stochastic CG/Lanczos
        estimate. ``log_marginal_likelihood_method_`` says which (``"cholesky"`` or ``"cg_estimate"``).
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
        optimizer: str = "auto",
        lr: float = 0.1,
        max_iter: int = 1000,
        tol: float | None = None,
        n_restarts: int = 0,
        ard: bool = True,
        noise_init: float | None = None,
        outputscale_init: float | None = None,
        lengthscale_init=None,
        standardize: bool = True,
        pretrain: tuple[int, int] | None = None,
        device=None,
        dtype="float32",
        random_state=None,
        verbose: bool = False,
        cg: CGSettings | dict | None = None,
        distributed: bool = False,
        checkpoint=None,
        checkpoint_every: int = 10,
    ):
        self.solver = solver
        self.optimizer = optimizer
        self.lr = lr
        self.max_iter = max_iter
        self.tol = tol
        self.n_restarts = n_restarts
        self.ard = ard
        self.noise_init = noise_init
        self.outputscale_init = outputscale_init
        self.lengthscale_init = lengthscale_init
        self.standardize = standardize
        self.pretrain = pretrain
        self.device = device
        self.dtype = dtype
        self.random_state = random_state
        self.verbose = verbose
        self.cg = cg
        self.distributed = distributed
        self.checkpoint = checkpoint
        self.checkpoint_every = checkpoint_every

    def set_params(self, **params):
        """Set parameters, as scikit-learn's ``set_params``; arguments of earlier versions raise ValueError saying
        where their settings went."""
        removed = set(params) & set(_params.REMOVED_ARGUMENTS)
        if removed:
            raise _params.removed_arguments(removed)
        return super().set_params(**params)

    # ------------------------------------------------------------------------------------------------------
    # fit
    # ------------------------------------------------------------------------------------------------------
    def fit(self, X, y):
        """Standardise the data, train the hyperparameters, and (Cholesky solver) factor the covariance.

        Every argument is validated before any fitted attribute changes: a failed ``fit`` leaves a previous fit
        intact.

        Parameters
        ----------
        X : array-like or torch.Tensor of shape (n_samples, n_features)
        y : array-like or torch.Tensor of shape (n_samples,) or (n_samples, 1)

        Returns
        -------
        self : ExactGP
        """
        input_attrs = {k: self.__dict__[k] for k in ("n_features_in_", "feature_names_in_") if k in self.__dict__}
        try:
            fitted = self._fit(X, y)
        except BaseException:
            for k in ("n_features_in_", "feature_names_in_"):  # validate_data records these up front
                self.__dict__.pop(k, None)
            self.__dict__.update(input_attrs)
            raise
        self.__dict__.update(fitted)
        self._set_hyperparameter_attributes(prediction.hyperparameters_float64(self.model_))
        return self

    def _fit(self, X, y) -> dict[str, object]:
        """Everything ``fit`` does, in locals; returns the fitted attributes."""
        settings = _params.resolve(self)
        Xt, yt = self._validated(X, y)
        x_mean, x_std, y_mean, y_std = standardization(Xt, yt, bool(self.standardize))
        inits = _params.initial_values(self, Xt.shape[1], x_std.cpu(), y_std)
        device, free = settings.device, _solver.free_memory_bytes(settings.device)  # looked up here: tests patch it
        plan = self._plan(settings, Xt.shape, free)
        ckpt = self._open_checkpoint(settings.seed, Xt, yt, device)
        Xs = ((Xt - x_mean) / x_std).to(device)
        ys = ((yt - y_mean) / y_std).to(device)
        with seeded(settings.seed, device, fork=ckpt is not None):
            model, space, theta0 = self._initial_model(Xs, ys, plan, settings, inits)
            starts = starting_points(space, theta0, self.n_restarts if self.max_iter > 0 else 0, settings.seed)
            options = dict(max_iter=self.max_iter, pretrain_steps=settings.pretrain_steps, seed=settings.seed)
            options.update(free=free, checkpoint=ckpt, lr=self.lr, tol=self.tol, verbose=bool(self.verbose))
            pre, result, record, restart_losses = run_plan(plan, model, space, starts, Xs, ys, **options)
            if ckpt is not None:
                ckpt.close()
            space.set(model, result.theta)
            if plan.train_dtype != plan.dtype:
                model = model.to(plan.dtype)
                model.set_train_data(inputs=Xs.to(plan.dtype), targets=ys.to(plan.dtype), strict=False)
            model.eval()
            model.likelihood.eval()
            lml, lml_method, posterior = self._log_marginal_likelihood(model, Xs, ys, plan)
        if self.max_iter > 0:
            self._warn_about_fit(plan.optimizer, result, space, y_constant=bool((ys == 0).all()))
        if ckpt is not None:
            ckpt.remove()
        return dict(
            device_=device,
            X_train_=Xs,
            y_train_=ys,
            x_mean_=x_mean.cpu().numpy(),
            x_std_=x_std.cpu().numpy(),
            y_mean_=y_mean,
            y_std_=y_std,
            model_=model,
            likelihood_=model.likelihood,
            solver_=plan.solver,
            train_solver_=plan.full.train_solver,
            trainer_=plan.full.trainer,
            optimizer_=plan.optimizer,
            product_=plan.full.product,
            history_=result.history,
            pretrain_history_=pre.history if pre is not None else [],
            n_iter_=result.n_iter,
            converged_=result.converged,
            restart_losses_=restart_losses,
            log_marginal_likelihood_=lml,
            log_marginal_likelihood_method_=lml_method,
            _posterior=posterior,
            # built here, not on the first predict, so that predict leaves the estimator unchanged
            _cg_posterior=prediction.cg_posterior_of(model, Xs, ys, plan.solver, settings.cg),
            **engine_attributes(record),
        )

    def _validated(self, X, y) -> tuple[torch.Tensor, torch.Tensor]:
        """X (n, d) and y (n,) as float64 tensors, checked (at least two samples)."""
        Xt, _ = validate_X(self, X, reset=True)
        n = Xt.shape[0]
        yt = validate_y(y, n)
        if n < 2:
            raise ValueError(
                f"X has n_samples = {n} ({n} sample(s)), but ExactGP needs at least 2 samples to fit a GP."
            )
        return Xt, yt

    def _plan(self, settings: _params.Settings, shape: tuple[int, int], free: int) -> FitPlan:
        """:func:`~gpfast.estimator.solver.plan_fit` for data of ``shape`` (n, d), logged (and printed when
        verbose)."""
        (n, d), device = shape, settings.device
        subset = self._subset_size(settings.pretrain_n, n)
        plan = plan_fit(
            n,
            subset,
            device,
            free,
            settings.dtype,
            self.solver,
            settings.optimizer,
            settings.cg,
            settings.distributed,
        )
        msg = (
            f"gpfast.ExactGP: n={n}, d={d}, solver={plan.solver} ({plan.reason}), training with {plan.optimizer} "
            f"on {plan.full.train_solver} ({plan.full.trainer}) in {str(plan.train_dtype).replace('torch.', '')}, "
            f"device={device}, model dtype={str(plan.dtype).replace('torch.', '')}"
        )
        logger.info(msg)
        if self.verbose:
            print(msg, file=sys.stderr)
        return plan

    def _open_checkpoint(self, seed: int | None, Xt: torch.Tensor, yt: torch.Tensor, device: torch.device):
        """The fit's :class:`~gpfast.estimator.checkpoint.Checkpoint` (resumed when one was left), or None."""
        if self.checkpoint is None:
            return None
        fp = _checkpoint.fingerprint(self, seed, Xt, yt)
        ckpt = _checkpoint.Checkpoint.open(self.checkpoint, self.checkpoint_every, fp, device)
        if ckpt.resumed:
            logger.info("gpfast.ExactGP: resuming from the checkpoint %s", self.checkpoint)
        return ckpt

    def _initial_model(self, Xs: torch.Tensor, ys: torch.Tensor, plan: FitPlan, settings: _params.Settings, inits):
        """The model in the training dtype, its hyperparameter space and the (clipped) starting point."""
        likelihood = gpytorch.likelihoods.GaussianLikelihood()
        Xd, yd = Xs.to(plan.train_dtype), ys.to(plan.train_dtype)
        model = ExactGPModel(Xd, yd, likelihood, ard=bool(self.ard), distributed=settings.distributed)
        model = model.to(device=Xs.device, dtype=plan.train_dtype)
        space = HyperparameterSpace.for_data(model, column_stats(Xs).std.cpu(), float(ys.var(unbiased=False)))
        theta0 = space.initial(inits["lengthscale"], inits["outputscale"], inits["noise"])
        if self.max_iter > 0 or plan.pretrain is not None:
            theta0 = self._clipped(space, theta0)
        return model, space, theta0

    @staticmethod
    def _log_marginal_likelihood(model, Xs: torch.Tensor, ys: torch.Tensor, plan: FitPlan):
        """``(value, method, posterior)``: exact by a float64 Cholesky whenever the plan allows one (the posterior
        is kept for predictions when the solver is ``"cholesky"``), else GPyTorch's CG estimate."""
        if not plan.exact_feasible:
            return Xs.shape[0] * mll_estimate(model), "cg_estimate", None
        posterior = prediction.exact_posterior(Xs, ys, prediction.hyperparameters_float64(model))
        lml = float(posterior.log_marginal_likelihood())
        return lml, "cholesky", posterior if plan.solver == "cholesky" else None

    def _clipped(self, space: HyperparameterSpace, theta0):
        """theta0 moved into the bounds, with a warning naming what was moved."""
        outside = space.outside(theta0)
        if outside:
            warnings.warn(
                f"ExactGP: the initial {', '.join(outside)} lie outside the bounds of the fit (see "
                f"gpfast.estimator.hyperparameters: lengthscales {LENGTHSCALE_BOUNDS} x each feature's std, "
                f"outputscale {OUTPUTSCALE_BOUNDS} and noise {NOISE_BOUNDS} x var(y)); starting from the nearest "
                f"bound instead.",
                UserWarning,
                stacklevel=5,
            )
        return space.clip(theta0)

    def _warn_about_fit(self, optimizer: str, result, space: HyperparameterSpace, y_constant: bool) -> None:
        if not result.converged and self.tol != 0:  # tol=0 asks for all max_iter steps
            warnings.warn(
                f"ExactGP: the optimiser ({optimizer}) stopped after {result.n_iter} iterations without converging "
                f"({result.message}); the hyperparameters may be short of the marginal-likelihood optimum. Raise "
                f"max_iter (now {self.max_iter}; it is a cap, not a plan), or set tol.",
                ConvergenceWarning,
                stacklevel=4,
            )
        problems = [] if y_constant else space.diagnose(result.theta)
        if problems:
            warnings.warn(
                "ExactGP: " + "; ".join(problems) + ". Check the data, try n_restarts > 0, or other initial values.",
                UserWarning,
                stacklevel=4,
            )

    def _subset_size(self, subset: int | None, n: int) -> int | None:
        if subset is not None and subset >= n:
            warnings.warn(
                f"pretrain={self.pretrain!r}: its {subset} points >= n_samples={n}: skipping the subset pretraining.",
                UserWarning,
                stacklevel=5,
            )
            return None
        return subset

    def _set_hyperparameter_attributes(self, hyp: dict[str, torch.Tensor]) -> None:
        x_std = torch.as_tensor(self.x_std_, dtype=torch.float64)
        ls = hyp["lengthscale"].detach().cpu().reshape(-1)
        self.lengthscale_ = (ls * x_std).numpy()  # (1,) broadcasts when ard=False
        self.outputscale_ = float(hyp["outputscale"]) * self.y_std_**2
        self.noise_ = float(hyp["noise"]) * self.y_std_**2
        self.constant_mean_ = float(hyp["mean"]) * self.y_std_ + self.y_mean_

    # ------------------------------------------------------------------------------------------------------
    # predict / score
    # ------------------------------------------------------------------------------------------------------
    def _get_posterior(self) -> ExactPosterior:
        if getattr(self, "_posterior", None) is None:
            hyp = prediction.hyperparameters_float64(self.model_)
            self._posterior = prediction.exact_posterior(self.X_train_, self.y_train_, hyp)
        return self._posterior

    def _get_cg_posterior(self):
        if getattr(self, "_cg_posterior", None) is None:  # after loading or unpickling
            cg = CGSettings.from_value(self.cg)
            self._cg_posterior = prediction.cg_posterior_of(self.model_, self.X_train_, self.y_train_, "cg", cg)
        return self._cg_posterior

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
        mean : numpy.ndarray or torch.Tensor of shape (n_test,)
            numpy float64 for numpy/array-like X; for a tensor X, a tensor on X's device in X's floating dtype.
        std : same type, of shape (n_test,)
            Only with ``return_std``.
        cov : same type, of shape (n_test, n_test)
            Only with ``return_cov``.

        Notes
        -----
        With ``solver_ == "cholesky"`` the posterior is exact in float64 (factorisation done once in
        ``fit``, test points processed in chunks); with ``"cg"`` every mean and variance is solved for by
        preconditioned CG in the training dtype with float64 refinement, and stopped on a certified bound of its
        own error (variances to ``cg.predict_cg_tolerance`` of themselves, means to 1e-5 std(y);
        :class:`gpfast.models.CGPosterior`, which warns when a bound cannot be met).
        """
        if return_std and return_cov:
            raise ValueError("ExactGP.predict: at most one of return_std and return_cov can be True, got both True.")
        check_is_fitted(self)
        Xt, info = validate_X(self, X, reset=False)
        x_mean = torch.as_tensor(self.x_mean_, dtype=torch.float64, device=Xt.device)
        x_std = torch.as_tensor(self.x_std_, dtype=torch.float64, device=Xt.device)
        Xs = ((Xt - x_mean) / x_std).to(self.device_)
        flags = dict(return_std=bool(return_std), return_cov=bool(return_cov), include_noise=bool(include_noise))
        if self.solver_ == "cholesky":
            hyp = prediction.hyperparameters_float64(self.model_)
            res = prediction.predict_exact(self._get_posterior(), self.X_train_, Xs, hyp, **flags)
        else:
            res = prediction.predict_cg(self._get_cg_posterior(), Xs, **flags)
        if not (return_std or return_cov):
            return info.out(res * self.y_std_ + self.y_mean_)
        mean, second = res
        mean = mean * self.y_std_ + self.y_mean_
        if return_std:
            return info.out(mean), info.out(second.clamp(min=0).sqrt() * self.y_std_)
        return info.out(mean), info.out(second * self.y_std_**2)

    def score(self, X, y, sample_weight=None) -> float:
        """Coefficient of determination R^2 of ``predict(X)`` against y.

        Parameters
        ----------
        X : array-like or torch.Tensor of shape (n_samples, n_features)
        y : array-like or torch.Tensor of shape (n_samples,) or (n_samples, 1)
        sample_weight : array-like or torch.Tensor of shape (n_samples,) or None, default=None

        Returns
        -------
        float
        """
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
        state.pop("_posterior", None)  # an n x n float64 factor: rebuilt on the first predict after unpickling
        state.pop("_cg_posterior", None)  # its preconditioner and solutions: rebuilt likewise
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if "model_" in state:
            self._posterior = None
            self._cg_posterior = None

    def save(self, path) -> None:
        """Save the fitted estimator (:mod:`gpfast.estimator.persistence` describes the format).

        Parameters
        ----------
        path : str, path or binary file object
        """
        persistence.save(self, path)

    @classmethod
    def load(cls, path, device=None) -> ExactGP:
        """Rebuild an estimator saved with :meth:`save`; predictions are identical to the saved one's.

        Parameters
        ----------
        path : str, path or binary file object
        device : str, torch.device or None, default=None
            Where to put it. None: the saved ``device`` parameter (a CUDA estimator loads on the CPU, with a
            warning, when CUDA is unavailable).

        Returns
        -------
        ExactGP
        """
        return persistence.load(cls, path, device)

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.allow_nan = False
        tags.input_tags.sparse = False
        return tags
