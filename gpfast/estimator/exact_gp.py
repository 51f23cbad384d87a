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
the solver rule (:mod:`~gpfast.estimator.solver`), the training loop (:mod:`~gpfast.estimator.training`),
prediction (:mod:`~gpfast.estimator.prediction`) and save files (:mod:`~gpfast.estimator.persistence`).
"""

from __future__ import annotations

import contextlib
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
from gpfast.estimator import solver as _solver
from gpfast.estimator.hyperparameters import (
    LENGTHSCALE_BOUNDS,
    OUTPUTSCALE_BOUNDS,
    HyperparameterSpace,
    noise_constraint,
    noise_floor_notes,
)
from gpfast.estimator.inputs import validate_X, validate_y
from gpfast.estimator.restarts import best_of_restarts, first_run_space, low_noise_start, starting_points
from gpfast.estimator.training import CGSettings, gpytorch_objective, mll_estimate, train
from gpfast.models import ExactGPModel, ExactPosterior
from gpfast.standardize import column_stats
from gpfast.train import Engine
from gpfast.train import settings as _trainer

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
        stay exact. The choices are stored in ``solver_`` and ``train_solver_``.
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
        run with the best marginal likelihood is kept (``restart_losses_`` has each run's final loss). Besides
        these, when the training steps use the Cholesky solver and the first run ends with a noise below ``1e-2 x
        var(y)``, a second run starts from the same point at a noise of ``1e-6 x var(y)``: data with little noise
        can have a better optimum at lower noise than the one reached from the default start, whose run keeps the
        noise above ``1e-4 x var(y)`` (:mod:`gpfast.estimator.restarts`).
    ard : bool, default=True
        One lengthscale per feature (automatic relevance determination) or a single shared one.
    noise_init, outputscale_init : float or None, default=None
        Initial noise variance and kernel output scale, in the units of ``y`` squared. ``None``: GPyTorch's
        initialisation (``softplus(0) ~= 0.693`` in standardised units). The fit keeps them within bounds
        (:mod:`gpfast.estimator.hyperparameters`): outputscale ``[1e-4, 1e6]`` and noise ``[floor, 1e2]`` times
        the variance of y; initial values outside are moved to the nearest bound, with a warning. The noise floor
        follows the path that takes the training steps: ``1e-8`` with the float64 Cholesky objective (small data:
        noise-free data, such as a deterministic simulator's output, are then fitted as nearly interpolated, as
        scikit-learn's ``WhiteKernel`` with its floor of ``1e-5`` does), ``1e-4`` with CG in float32 and ``1e-6``
        with CG in float64. A CG fit that ends at its floor warns once and names the way to a lower one
        (``dtype="float64"``, or ``solver="cholesky"`` where it fits). The floor is also the lower bound of
        ``likelihood_``'s noise constraint.
    lengthscale_init : float, array of shape (n_features,) or None, default=None
        Initial lengthscale(s) in the units of ``X`` (``ard=True``). With ``ard=False`` the single lengthscale
        acts on the standardised inputs, so it must be a float in standardised units. ``None``: each feature's
        standard deviation (1 in standardised units, scikit-learn's default). Fitted lengthscales stay within
        ``[1e-2, 1e3]`` times each feature's standard deviation.
    standardize : bool, default=True
        Centre and scale X's columns and y with the training statistics (:mod:`gpfast.standardize`) before
        fitting. ``False`` fits the data as given (for data already standardised, as ``gpfast.datasets`` returns
        them); the initial values are then in those units.
    pretrain_subset : int or None, default=None
        Wang et al. (2019) schedule: first train ``pretrain_iter`` steps on a random subset of this many
        points, then ``max_iter`` steps on all the data. ``None`` (or a subset >= n) skips pretraining.
    pretrain_iter : int, default=10
        Steps on the subset when ``pretrain_subset`` is set.
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
        group (launch with ``torchrun``, call :func:`gpfast.kernels.distributed.init`). Training and prediction
        then use the matrix-free CG solver; every rank ends with the same model. ``device=None`` means this
        rank's GPU (or the CPU with the gloo backend).

    trainer : {"auto", "gpfast", "gpytorch"}, default="auto"
        Who takes the training steps. ``"auto"``: gpfast's training engine (:mod:`gpfast.train`: warm-started,
        truncated preconditioned CG and Hutchinson gradients from one fused backward, no Lanczos) whenever the
        steps use CG under Adam (under L-BFGS, GPyTorch's: see :func:`gpfast.train.settings.train_solver`), and
        gpfast's exact float64 objective when they use a dense Cholesky. ``"gpfast"``: the
        engine for every step (CG steps even where the solver rule would train with a Cholesky). ``"gpytorch"``:
        GPyTorch's marginal likelihood when the steps use CG (mBCG and stochastic Lanczos, with ``cg_tolerance``,
        ``max_cg_iterations`` and ``preconditioner_size``), for comparisons. Who trained is stored in
        ``trainer_``.
    trainer_options : dict or None, default=None
        Settings of gpfast's engine, keys of :class:`gpfast.train.EngineSettings` (``num_probes``,
        ``cg_tolerance``, ``max_cg_iterations``, ``preconditioner_rank``, ``rebuild_every``,
        ``rebuild_lengthscale_change``, ``resample_every``, ``warm_start``, ``product``, ``memory_fraction``; the
        defaults and the measurements behind them are documented there); ``None`` keeps its defaults. The
        GPyTorch parameters above (``cg_tolerance`` etc.) do not apply to the engine's training steps.
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
        Final training loss of each run: the first start, the low-noise start when it was made, then the
        ``n_restarts`` random ones.
    trainer_ : {"gpfast", "exact", "gpytorch"}
        Who took the training steps on the full data: gpfast's engine, the exact float64 Cholesky objective
        (:mod:`~gpfast.estimator.exact_objective`), or GPyTorch's marginal likelihood (see ``trainer``).
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
        pretrain_subset: int | None = None,
        pretrain_iter: int = 10,
        device=None,
        dtype="float32",
        random_state=None,
        verbose: bool = False,
        cg_tolerance: float = 1.0,
        eval_cg_tolerance: float = 0.01,
        max_cg_iterations: int = 1000,
        preconditioner_size: int = 15,
        distributed: bool = False,
        trainer: str = "auto",
        trainer_options: dict | None = None,
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
        self.pretrain_subset = pretrain_subset
        self.pretrain_iter = pretrain_iter
        self.device = device
        self.dtype = dtype
        self.random_state = random_state
        self.verbose = verbose
        self.cg_tolerance = cg_tolerance
        self.eval_cg_tolerance = eval_cg_tolerance
        self.max_cg_iterations = max_cg_iterations
        self.preconditioner_size = preconditioner_size
        self.distributed = distributed
        self.trainer = trainer
        self.trainer_options = trainer_options
        self.checkpoint = checkpoint
        self.checkpoint_every = checkpoint_every

    # ------------------------------------------------------------------------------------------------------
    # fit
    # ------------------------------------------------------------------------------------------------------
    def fit(self, X, y):
        """Standardise the data, train the hyperparameters, and (Cholesky solver) factor the covariance.

        ``X``: (n, d) numpy array, array-like or torch tensor; ``y``: (n,) or (n, 1). Every argument is
        validated before any fitted attribute changes: a failed ``fit`` leaves a previous fit intact.
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
        trainer, engine_settings = _trainer.resolve(self.trainer, self.trainer_options, self.solver)
        Xt, _ = validate_X(self, X, reset=True)
        n, d = Xt.shape
        yt = validate_y(y, n)
        if n < 2:
            raise ValueError(
                f"X has n_samples = {n} ({n} sample(s)), but ExactGP needs at least 2 samples to fit a GP."
            )
        x_mean, x_std, y_mean, y_std = self._statistics(Xt, yt, n)
        inits = _params.initial_values(self, d, x_std.cpu(), y_std)
        device, dtype = settings.device, settings.dtype
        free = _solver.free_memory_bytes(device)
        choice = _solver.choose_solver(n, device, free, self.solver, settings.distributed)
        train_solver, _ = _trainer.train_solver(trainer, choice.train_solver)
        optimizer = _params.resolve_optimizer(settings.optimizer, train_solver)
        train_solver, trainer_used = _trainer.train_solver(trainer, choice.train_solver, optimizer)
        # The exact objective is float64 whatever dtype says: L-BFGS's line search needs the loss to that precision.
        train_dtype = torch.float64 if train_solver == "cholesky" else dtype
        subset = self._subset_size(n)
        cg = self._cg_settings()

        msg = (
            f"gpfast.ExactGP: n={n}, d={d}, solver={choice.solver} ({choice.reason}), training with "
            f"{optimizer} on {train_solver} ({trainer_used}), device={device}, dtype={dtype}"
        )
        logger.info(msg)
        if self.verbose:
            print(msg, file=sys.stderr)

        ckpt = None
        if self.checkpoint is not None:
            fp = _checkpoint.fingerprint(self, settings.seed, Xt, yt)
            ckpt = _checkpoint.Checkpoint.open(self.checkpoint, self.checkpoint_every, fp, device)
            if ckpt.resumed:
                logger.info("gpfast.ExactGP: resuming from the checkpoint %s", self.checkpoint)
        Xs = ((Xt - x_mean) / x_std).to(device)
        ys = ((yt - y_mean) / y_std).to(device)
        with self._seeded(settings.seed, device, fork=ckpt is not None):
            y_var = float(ys.var(unbiased=False))
            likelihood = gpytorch.likelihoods.GaussianLikelihood(
                noise_constraint=noise_constraint(train_solver, train_dtype, y_var)
            )
            Xd, yd = Xs.to(train_dtype), ys.to(train_dtype)
            model = ExactGPModel(Xd, yd, likelihood, ard=bool(self.ard), distributed=settings.distributed)
            model = model.to(device=device, dtype=train_dtype)
            space = HyperparameterSpace.for_data(model, column_stats(Xs).std.cpu(), y_var)
            theta0 = space.initial(inits["lengthscale"], inits["outputscale"], inits["noise"])
            if self.max_iter > 0 or subset is not None or "noise" in space.outside(theta0):
                theta0 = self._clipped(space, theta0)
            sub_idx = None
            if subset is not None:
                gen = torch.Generator().manual_seed(settings.seed) if settings.seed is not None else None
                sub_idx = torch.randperm(n, generator=gen)[:subset].to(device)
                sub_solver, sub_trainer = _trainer.train_solver(
                    trainer,
                    self.solver
                    if self.solver != "auto"
                    else _solver.choose_solver(subset, device, free, "auto", settings.distributed).train_solver,
                    optimizer,
                )
            train_kw = dict(
                cg=cg,
                optimizer=optimizer,
                lr=self.lr,
                tol=self.tol,
                dtype=dtype,
                verbose=bool(self.verbose),
                space=space,
                checkpoint=ckpt,
            )

            def run(theta, first=False):
                train_kw["space"] = first_run_space(space, train_solver) if first else space
                space.set(model, theta)
                pre = None
                if sub_idx is not None:
                    model.set_train_data(inputs=Xd[sub_idx], targets=yd[sub_idx], strict=False)
                    pre, _ = self._train_with(
                        sub_trainer,
                        engine_settings,
                        free,
                        model,
                        self.pretrain_iter,
                        sub_solver,
                        desc=f"gpfast pretrain ({subset} pts, {sub_solver})",
                        **train_kw,
                    )
                    model.set_train_data(inputs=Xd, targets=yd, strict=False)
                full, record = self._train_with(
                    trainer_used,
                    engine_settings,
                    free,
                    model,
                    self.max_iter,
                    train_solver,
                    desc=f"gpfast fit ({optimizer}, {train_solver}, {trainer_used})",
                    **train_kw,
                )
                return pre, full, record

            starts = starting_points(space, theta0, self.n_restarts if self.max_iter > 0 else 0, settings.seed)

            def low_noise(r):
                return low_noise_start(space, theta0, r[1].theta, train_solver) if self.max_iter > 0 else None

            (pre, result, record), restart_losses = best_of_restarts(starts, run, lambda r: r[1].loss, low_noise)
            if ckpt is not None:
                ckpt.close()
            space.set(model, result.theta)
            if train_dtype != dtype:
                model = model.to(dtype)
                model.set_train_data(inputs=Xs.to(dtype), targets=ys.to(dtype), strict=False)
            model.eval()
            likelihood.eval()
            posterior = None
            if choice.exact_feasible:
                posterior = prediction.exact_posterior(Xs, ys, prediction.hyperparameters_float64(model))
                lml, lml_method = float(posterior.log_marginal_likelihood()), "cholesky"
                if choice.solver != "cholesky":
                    posterior = None
            else:
                lml, lml_method = n * mll_estimate(model, cg), "cg_estimate"
        if self.max_iter > 0:
            notes = noise_floor_notes(space, result.theta, train_solver, train_dtype, choice.exact_feasible, Xs, ys)
            self._warn_about_fit(optimizer, result, space, y_constant=bool((ys == 0).all()), floor_notes=notes)
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
            likelihood_=likelihood,
            solver_=choice.solver,
            train_solver_=train_solver,
            trainer_=trainer_used,
            optimizer_=optimizer,
            history_=result.history,
            pretrain_history_=pre.history if pre is not None else [],
            n_iter_=result.n_iter,
            converged_=result.converged,
            restart_losses_=restart_losses,
            log_marginal_likelihood_=lml,
            log_marginal_likelihood_method_=lml_method,
            _posterior=posterior,
            **_trainer.fitted_attributes(record),
        )

    @staticmethod
    def _train_with(trainer_used, engine_settings, free, model, n_steps, solver, checkpoint=None, **train_kw):
        """:func:`~gpfast.estimator.training.train` with the objective of ``trainer_used``: gpfast's engine
        (returning its record too), the exact float64 objective (the default for ``"cholesky"``), or GPyTorch's.
        With a ``checkpoint``, a run it holds as finished is not run again, and one under way resumes."""
        log = checkpoint.next_run() if checkpoint is not None else None
        if log is not None and log.done is not None:
            result, record = log.done
            train_kw["space"].set(model, result.theta)
            return result, record
        record = None
        if trainer_used == "gpfast":
            engine = Engine(engine_settings, free)
            if log is not None:
                if log.engine_state is not None:
                    engine.load_state_dict(log.engine_state)
                log.objective_state = engine.state_dict
            result = train(model, n_steps, solver, objective=engine.objective, recorder=log, **train_kw)
            record = engine.finish()
        else:
            objective = gpytorch_objective if trainer_used == "gpytorch" else None
            result = train(model, n_steps, solver, objective=objective, recorder=log, **train_kw)
        if checkpoint is not None:
            checkpoint.finish_run(log, result, record)
        return result, record

    def _clipped(self, space: HyperparameterSpace, theta0):
        """theta0 moved into the bounds, with a warning naming what was moved."""
        outside = space.outside(theta0)
        if outside:
            warnings.warn(
                f"ExactGP: the initial {', '.join(outside)} lie outside the bounds of the fit (see "
                f"gpfast.estimator.hyperparameters: lengthscales {LENGTHSCALE_BOUNDS} x each feature's std, "
                f"outputscale {OUTPUTSCALE_BOUNDS} and noise {space.noise_bounds} x var(y)); starting from the nearest "
                f"bound instead.",
                UserWarning,
                stacklevel=4,
            )
        return space.clip(theta0)

    def _warn_about_fit(
        self, optimizer: str, result, space: HyperparameterSpace, y_constant: bool, floor_notes=()
    ) -> None:
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
        for note in () if y_constant else floor_notes:
            warnings.warn(note, UserWarning, stacklevel=4)

    def _statistics(self, Xt: torch.Tensor, yt: torch.Tensor, n: int):
        """(x_mean, x_std, y_mean, y_std) by the one standardisation rule, with a warning for constant columns."""
        d = Xt.shape[1]
        if not self.standardize:
            zeros = torch.zeros(d, dtype=torch.float64, device=Xt.device)
            return zeros, torch.ones_like(zeros), 0.0, 1.0
        xs = column_stats(Xt)
        const_cols = torch.nonzero(xs.constant).reshape(-1).tolist()
        if const_cols:
            warnings.warn(
                f"X has constant column(s) at index {const_cols} (zero variance over the {n} training points); "
                f"they carry no information for fitting and are only centred (std set to 1).",
                UserWarning,
                stacklevel=4,
            )
        ys = column_stats(yt)
        if bool(ys.constant[0]):
            warnings.warn(
                f"y is constant (all {n} values equal {float(yt[0])!r}): the fit can only learn that constant; "
                f"y is centred but not scaled.",
                UserWarning,
                stacklevel=4,
            )
        return xs.mean, xs.std, float(ys.mean[0]), float(ys.std[0])

    def _subset_size(self, n: int) -> int | None:
        subset = self.pretrain_subset
        if subset is not None and subset >= n:
            warnings.warn(
                f"pretrain_subset={subset} >= n_samples={n}: skipping the subset pretraining.",
                UserWarning,
                stacklevel=4,
            )
            return None
        return subset

    def _cg_settings(self) -> CGSettings:
        return CGSettings(
            float(self.cg_tolerance),
            float(self.eval_cg_tolerance),
            int(self.max_cg_iterations),
            int(self.preconditioner_size),
        )

    @staticmethod
    def _seeded(seed: int | None, device: torch.device, fork: bool = False):
        """Seed torch's generators inside ``fork_rng`` (the global ones are left alone), or do nothing (with
        ``fork``: fork without seeding, as a resumed fit sets the generators' state)."""
        if seed is None and not fork:
            return contextlib.nullcontext()
        devices = list(range(torch.cuda.device_count())) if device.type == "cuda" else []
        stack = contextlib.ExitStack()
        stack.enter_context(torch.random.fork_rng(devices=devices))
        if seed is not None:
            torch.manual_seed(seed)  # also seeds every CUDA device
        return stack

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
            dtype = self.model_.covar_module.raw_outputscale.dtype
            res = prediction.predict_cg(self.model_, Xs, dtype, self._cg_settings(), **flags)
        if not (return_std or return_cov):
            return info.out(res * self.y_std_ + self.y_mean_)
        mean, second = res
        mean = mean * self.y_std_ + self.y_mean_
        if return_std:
            return info.out(mean), info.out(second.clamp(min=0).sqrt() * self.y_std_)
        return info.out(mean), info.out(second * self.y_std_**2)

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
        state.pop("_posterior", None)  # an n x n float64 factor: rebuilt on the first predict after unpickling
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if "model_" in state:
            self._posterior = None

    def save(self, path) -> None:
        """Save the fitted estimator to ``path`` (see :mod:`gpfast.estimator.persistence` for the format)."""
        persistence.save(self, path)

    @classmethod
    def load(cls, path, device=None) -> ExactGP:
        """Rebuild an estimator saved with :meth:`save`; predictions are identical to the saved one's.

        ``device``: where to put it (default: the saved ``device`` parameter; a CUDA estimator loads on the CPU,
        with a warning, when CUDA is unavailable).
        """
        return persistence.load(cls, path, device)

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.allow_nan = False
        tags.input_tags.sparse = False
        return tags
