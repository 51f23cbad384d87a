"""``gpfast.ExactGP``: a scikit-learn style estimator for exact GP regression on gpfast's fused RBF kernel.

Example::

    from gpfast import ExactGP

    gp = ExactGP().fit(X_train, y_train)                      # numpy or torch, on the GPU when there is one
    mean, std = gp.predict(X_test, return_std=True)            # std of the noisy target y, in y's units
    gp.score(X_test, y_test); gp.save("gp.pt")                # R^2; ExactGP.load("gp.pt") gives it back

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

import numpy as np
import torch
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.metrics import r2_score
from sklearn.utils import check_random_state
from sklearn.utils.validation import check_is_fitted

from gpfast.estimator import checkpoint as _checkpoint
from gpfast.estimator import independent as _independent
from gpfast.estimator import likelihood as _likelihood
from gpfast.estimator import outputs as _outputs
from gpfast.estimator import params as _params
from gpfast.estimator import sampling as _sampling
from gpfast.estimator import persistence, prediction
from gpfast.estimator.inputs import standardized, validate_training, validate_X
from gpfast.estimator.restarts import starting_points
from gpfast.estimator import solver as _solver
from gpfast.estimator.solver import FitPlan, plan_fit, pretrain_points
from gpfast.estimator.fitting import (
    PhaseClock,
    clipped_start,
    engine_attributes,
    fitted_log_marginal_likelihood,
    initial_model,
    run_plan,
    seeded,
    warn_about_fit,
)
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
        With the Cholesky solver, a first run ending below ``1e-2 x var(y)`` noise is followed by one from the
        same start at ``1e-6 x var(y)`` (:mod:`gpfast.estimator.restarts`).
    ard : bool, default=True
        One lengthscale per feature (automatic relevance determination) or a single shared one.
    noise_init, outputscale_init : float or None, default=None
        Initial noise variance and kernel output scale, in the units of ``y`` squared (with several outputs, as
        fractions of each output's variance: standardised units). ``None``: GPyTorch's initialisation
        (``softplus(0) ~= 0.693`` in standardised units). The fit keeps them within bounds
        (:mod:`gpfast.estimator.hyperparameters`): outputscale ``[1e-4, 1e6]`` and noise ``[floor, 1e2]`` times
        the variance of y, moving initial values outside to the nearest bound with a warning. The noise floor
        follows the training path: ``1e-8`` with the float64 Cholesky objective (noise-free data, such as a
        simulator's output, are fitted as nearly interpolated, as by scikit-learn's ``WhiteKernel``, floor
        ``1e-5``), ``1e-4`` with CG in float32, ``1e-6`` in float64; a CG fit that ends at its floor warns and names
        the way lower (``dtype="float64"``, or ``solver="cholesky"`` where it fits). ``likelihood_``'s noise
        constraint has the same floor.
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
    checkpoint : str, path, (path, int) or None, default=None
        Make the fit resumable (:mod:`gpfast.estimator.checkpoint`): every 10 optimiser steps (``(path, every)``:
        every ``every`` steps; each write holds the engine's probes and warm starts, about ``8 n (2 s + 1)`` bytes
        in float32, 85 MB at n = 1M), and after each optimiser run, the whole training state goes to the file
        (atomically, with a checksum).
        A ``fit`` that finds the file there resumes from it when it was written for the same data and settings,
        and otherwise raises ValueError saying what differs; the resumed fit takes the same steps as an
        uninterrupted one (bit for bit on the CPU with a seed). The file is deleted when the fit succeeds.
        Not with ``distributed=True``.
    independent_outputs : bool, default=False
        With y of shape (n, k): ``False`` fits one set of hyperparameters shared by the outputs (scikit-learn's
        semantics, :mod:`~gpfast.estimator.outputs`); ``True`` fits one GP per output, each with its own
        hyperparameters, trained together, each output stopping on its own test: below the Cholesky cap by
        batched float64 Cholesky factorisations and one L-BFGS per output (:mod:`~gpfast.estimator.independent`),
        above it (or with ``solver="cg"``) by one training engine and Adam per output
        (:mod:`~gpfast.estimator.independent_cg`). Then ``theta_`` is (k, n_lengthscales + 2), ``lengthscale_``
        (k, n_features), ``outputscale_``, ``noise_``, ``constant_mean_`` (k,), ``n_iter_``, ``converged_`` and
        ``history_`` lists with an entry per output, and ``model_`` None (:meth:`save` writes the rows of theta
        instead).

    Attributes
    ----------
    X_train_, y_train_ : torch.Tensor
        Standardised training inputs (n, d) and targets (n,) or (n, n_outputs), float64, on ``device_``.
    x_mean_, x_std_ : numpy.ndarray of shape (n_features,)
        Input standardisation (std 1 for constant columns; 0 and 1 with ``standardize=False``).
    y_mean_, y_std_ : float, or numpy.ndarray of shape (n_outputs,) when y had several outputs
        Target standardisation, of each output on its own.
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
        Final training loss of each run: the first start, the low-noise start when it was made, then the
        ``n_restarts`` random ones.
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
    fit_seconds_ : dict of str to float or None
        Wall time of the fit's phases (the device synchronised between them), for benchmarks: ``"prepare"``, up to
        the training; ``"train"``, ``step_seconds_`` and the engine's work around them; ``"posterior"``, what
        predictions use (the factorisation) and the fitted LML. None with ``independent_outputs=True``.
    log_marginal_likelihood_ : float
        Log marginal likelihood of the standardised targets (total, not per point; comparable to
        scikit-learn's ``GaussianProcessRegressor(normalize_y=True).log_marginal_likelihood_value_``) at the
        fitted hyperparameters. Exact (float64 Cholesky) whenever the ``"auto"`` rule allows a Cholesky (memory
        and ``AUTO_CHOLESKY_MAX_N``), whichever solver trained; otherwise GPyTorch's stochastic CG/Lanczos
        estimate. ``log_marginal_likelihood_method_`` says which (``"cholesky"`` or ``"cg_estimate"``).
        ``log_marginal_likelihood_value_`` is scikit-learn's name for it.
    theta_ : numpy.ndarray of shape (k + 2,)
        Fitted ``log([lengthscale(s), outputscale, noise])`` in standardised units (k = n_features with ARD, else
        1), the argument of :meth:`log_marginal_likelihood` (:mod:`gpfast.estimator.likelihood`).
    lengthscale_ : numpy.ndarray of shape (n_features,)
        Fitted lengthscales in the units of X (standardised lengthscale * ``x_std_``).
    outputscale_, noise_ : float
        Kernel variance and noise variance in the units of y squared (arrays of shape (n_outputs,) when y had
        several outputs: the shared standardised values times each output's variance).
    constant_mean_ : float
        Prior mean in the units of y (an array of shape (n_outputs,) when y had several outputs).
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
        independent_outputs: bool = False,
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
        self.independent_outputs = independent_outputs

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

        Every argument is validated first: a failed ``fit`` leaves a previous fit intact.

        Parameters
        ----------
        X : array-like or torch.Tensor of shape (n_samples, n_features)
        y : array-like or torch.Tensor of shape (n_samples,), (n_samples, 1) or (n_samples, n_outputs)
            Several outputs share the hyperparameters (:mod:`~gpfast.estimator.outputs`, either solver), or
            each has its own with ``independent_outputs=True``.

        Returns
        -------
        self : ExactGP
        """
        input_attrs = {k: self.__dict__[k] for k in ("n_features_in_", "feature_names_in_") if k in self.__dict__}
        try:
            if self.independent_outputs not in (True, False):
                raise ValueError(
                    f"ExactGP: invalid independent_outputs={self.independent_outputs!r}; expected True or False."
                )
            fitted = _independent.fit_estimator(self, X, y) if self.independent_outputs else self._fit(X, y)
        except BaseException:
            for k in ("n_features_in_", "feature_names_in_"):  # validate_data records these up front
                self.__dict__.pop(k, None)
            self.__dict__.update(input_attrs)
            raise
        self.__dict__.pop("_independent_theta", None)
        self.__dict__.update(fitted)
        if self.model_ is not None:
            self._set_hyperparameter_attributes(prediction.hyperparameters_float64(self.model_))
        return self

    def _fit(self, X, y) -> dict[str, object]:
        """Everything ``fit`` does, in locals; returns the fitted attributes."""
        settings = _params.resolve(self)
        clock = PhaseClock(settings.device)
        Xt, yt = validate_training(self, X, y)
        data = standardized(Xt, yt, bool(self.standardize), settings.device)
        inits = _params.initial_values(self, Xt.shape[1], torch.from_numpy(data.x_std), _outputs.init_scale(data.y_std))
        device, free = settings.device, _solver.free_memory_bytes(settings.device)  # looked up here: tests patch it
        plan = self._plan(settings, Xt.shape, free, _outputs.n_outputs(yt))
        ckpt = _checkpoint.open_for_fit(self, settings, Xt, yt)
        Xs, ys = data.X, data.y
        with seeded(settings.seed, device, fork=ckpt is not None):
            model, space, theta0 = initial_model(Xs, ys, plan, inits, bool(self.ard), settings.distributed)
            if self.max_iter > 0 or plan.pretrain is not None or "noise" in space.outside(theta0):
                theta0 = clipped_start(space, theta0)
            starts = starting_points(space, theta0, self.n_restarts if self.max_iter > 0 else 0, settings.seed)
            options = dict(max_iter=self.max_iter, pretrain_steps=settings.pretrain_steps, seed=settings.seed)
            options.update(free=free, checkpoint=ckpt, lr=self.lr, tol=self.tol, verbose=bool(self.verbose))
            clock.mark("prepare")
            pre, result, record, restart_losses = run_plan(plan, model, space, starts, Xs, ys, **options)
            clock.mark("train")
            if ckpt is not None:
                ckpt.close()
            space.set(model, result.theta)
            if plan.train_dtype != plan.dtype:
                model = model.to(plan.dtype)
                targets = _outputs.model_targets(ys).to(plan.dtype)
                model.set_train_data(inputs=Xs.to(plan.dtype), targets=targets, strict=False)
            model.eval()
            model.likelihood.eval()
            lml, lml_method, posterior = fitted_log_marginal_likelihood(model, Xs, ys, plan)
            # built here, not on the first predict, so that predict leaves the estimator unchanged
            cg_posterior = prediction.cg_posterior_of_fit(model, Xs, ys, plan.solver, settings.cg)
            clock.mark("posterior")
        if self.max_iter > 0:
            warn_about_fit(plan, result, space, Xs, ys, self.max_iter, self.tol)
        if ckpt is not None:
            ckpt.remove()
        return dict(
            **data.attributes(),
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
            _cg_posterior=cg_posterior,
            fit_seconds_=clock.seconds,
            **engine_attributes(record),
        )

    def _plan(self, settings: _params.Settings, shape: tuple[int, int], free: int, n_outputs: int = 1) -> FitPlan:
        """:func:`~gpfast.estimator.solver.plan_fit` for data of ``shape`` (n, d) and ``n_outputs`` columns of y,
        logged (and printed when verbose)."""
        (n, d), device = shape, settings.device
        subset = pretrain_points(self.pretrain, settings.pretrain_n, n)
        options = dict(optimizer=settings.optimizer, cg=settings.cg, distributed=settings.distributed)
        plan = plan_fit(n, subset, device, free, settings.dtype, self.solver, n_outputs=n_outputs, **options)
        msg = f"gpfast.ExactGP: n={n}, d={d}, {plan.describe()}, device={device}"
        logger.info(msg)
        if self.verbose:
            print(msg, file=sys.stderr)
        return plan

    def _set_hyperparameter_attributes(self, hyp: dict[str, torch.Tensor]) -> None:
        self.__dict__.update(_outputs.hyperparameter_attributes(hyp, self.x_std_, self.y_mean_, self.y_std_))

    # ------------------------------------------------------------------------------------------------------
    # predict / score
    # ------------------------------------------------------------------------------------------------------
    def predict(self, X, return_std: bool = False, return_cov: bool = False, include_noise: bool = True):
        """Posterior predictive mean (and std or covariance) at X, in the units of y.

        Parameters
        ----------
        X : (n_test, n_features) numpy array, array-like or torch tensor
        return_std : bool
            Also return the predictive standard deviation (n_test,), or (n_test, n_outputs) when y had several
            outputs (the mean is then (n_test, n_outputs) too).
        return_cov : bool
            Also return the predictive covariance (n_test, n_test), or (n_test, n_test, n_outputs) as scikit-learn
            returns it. At most one of ``return_std`` and ``return_cov``.
        include_noise : bool, default=True
            ``True``: std/cov of a new noisy observation ``y* = f(x*) + eps`` (latent variance + ``noise_``),
            the quantity to compare with held-out targets (and to use in a predictive NLL). ``False``: of the
            latent function ``f(x*)`` only. (scikit-learn's ``GaussianProcessRegressor`` corresponds to
            ``True`` when its noise is a ``WhiteKernel`` and to ``False`` when it is ``alpha``.)

        Returns
        -------
        mean : numpy.ndarray or torch.Tensor of shape (n_test,) or (n_test, n_outputs)
            numpy float64 for numpy/array-like X; for a tensor X, a tensor on X's device in X's floating dtype.
        std : same type, of the mean's shape
            Only with ``return_std``.
        cov : same type, of shape (n_test, n_test) or (n_test, n_test, n_outputs)
            Only with ``return_cov``.

        Notes
        -----
        With ``solver_ == "cholesky"`` the posterior is exact in float64 (factorisation done once in
        ``fit``, test points processed in chunks); with ``"cg"`` every mean and variance is solved for by
        preconditioned CG in the training dtype with float64 refinement, and stopped on a certified bound of its
        own error (variances to ``cg.predict_cg_tolerance`` of themselves, means to 1e-3 std(y);
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
        if getattr(self, "_independent_theta", None) is not None:
            res = _independent.posterior_of(self).predict(Xs, **flags)
        elif self.solver_ == "cholesky":
            hyp = prediction.hyperparameters_float64(self.model_)
            res = prediction.predict_exact(prediction.fitted_exact_posterior(self), self.X_train_, Xs, hyp, **flags)
        else:
            res = prediction.predict_cg(prediction.fitted_cg_posterior(self), Xs, **flags)
        res = _outputs.to_original_units(res, self.y_mean_, self.y_std_, bool(return_std), bool(return_cov))
        return tuple(info.out(t) for t in res) if isinstance(res, tuple) else info.out(res)

    def sample_y(self, X, n_samples: int = 1, random_state=None, include_noise: bool = True):
        """Draws from the predictive distribution at X, the one ``predict(X, return_cov=True)`` describes.

        Parameters
        ----------
        X : (n_test, n_features) numpy array, array-like or torch tensor
        n_samples : int, default=1
            Draws per test point.
        random_state : int, RandomState instance or None, default=None
            Seeds numpy's generator for the standard normals (scikit-learn's ``check_random_state``; its
            ``GaussianProcessRegressor`` defaults to 0, gpfast to fresh draws): equal seeds give equal draws, on
            any device.
        include_noise : bool, default=True
            Draws of noisy observations ``y*`` (``True``) or of the latent function ``f(x*)`` (``False``), as in
            :meth:`predict`.

        Returns
        -------
        y_samples : array of shape (n_test, n_samples), or (n_test, n_outputs, n_samples) when y had several
            outputs, in the units of y: numpy float64 for array-like X, a tensor on X's device for a tensor X.
        """
        n_samples = _sampling.check_n_samples(n_samples)
        rng = check_random_state(random_state)
        mean, cov = self.predict(X, return_cov=True, include_noise=include_noise)
        return _sampling.sample_gaussian(mean, cov, n_samples, rng)

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
    # log marginal likelihood, as scikit-learn's
    # ------------------------------------------------------------------------------------------------------
    @property
    def theta_(self) -> np.ndarray:
        """Fitted ``log([lengthscale(s), outputscale, noise])`` in standardised units, float64 of shape (k + 2,)
        (k = n_features with ARD, else 1), or a row per output with ``independent_outputs=True``; see
        :mod:`gpfast.estimator.likelihood`."""
        check_is_fitted(self)
        return _likelihood.estimator_theta(self)

    @property
    def log_marginal_likelihood_value_(self) -> float:
        """scikit-learn's name for ``log_marginal_likelihood_``: the log marginal likelihood at ``theta_``."""
        check_is_fitted(self)
        return self.log_marginal_likelihood_

    def log_marginal_likelihood(self, theta=None, eval_gradient: bool = False, clone_kernel: bool = True):
        """Exact log marginal likelihood of the standardised training targets at ``theta``, as scikit-learn's.

        Parameters
        ----------
        theta : array-like of shape (k + 2,) or None, default=None
            ``log([lengthscale(s), outputscale, noise])`` in standardised units, the layout of ``theta_`` (see
            :mod:`gpfast.estimator.likelihood`); the constant mean stays at its fitted value. ``None``: the
            fitted value, ``log_marginal_likelihood_value_``.
        eval_gradient : bool, default=False
            Also return the gradient with respect to theta (exact: float64 Cholesky, autograd through the fused
            covariance op). Needs a theta.
        clone_kernel : bool, default=True
            Accepted for scikit-learn's signature. The fitted model is never modified, whatever its value
            (scikit-learn's ``False`` writes theta into ``kernel_``, a side effect kept out of gpfast).

        Returns
        -------
        log_likelihood : float
            Summed over the outputs when y had several; ``-inf`` where the covariance is not positive definite.
        log_likelihood_gradient : numpy.ndarray of shape (k + 2,)
            Only with ``eval_gradient=True``.
        """
        check_is_fitted(self)
        return _likelihood.of_estimator(self, theta, bool(eval_gradient))

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
            Fits with several outputs, independent or not, are saved too.
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
        tags.target_tags.multi_output = _outputs.multi_output_tag(self)
        return tags
