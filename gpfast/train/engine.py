"""gpfast's training engine: warm-started, truncated preconditioned CG and Hutchinson gradients for the exact GP.

One step (one call of the objective) for the model ``y ~ N(mean, K + noise I)``:

1. Products: K̂ = K + noise I for the current hyperparameters, stored or matrix-free (:mod:`.product`).
2. Preconditioner: P = L L^T + noise I, L a rank-k pivoted Cholesky of K (:mod:`.preconditioner`). It is rebuilt
   every ``rebuild_every`` steps, or sooner when a lengthscale has moved by more than
   ``rebuild_lengthscale_change`` in log since the build, once the CG iterations since the build have cost
   about as much as a rebuild (``rebuild_cost_share``, :mod:`.costs`); in between, it takes the current
   outputscale and noise (exactly, by its Woodbury form) at the step after one of them has moved by more than
   ``rescale_change`` in log.
3. Probes: s fixed Rademacher vectors (drawn anew every ``resample_every`` steps if set), independent of the
   preconditioner, so their solves stay good warm starts across rebuilds.
4. One batched PCG solve of [y - mean, z_1 ... z_s] (:mod:`.cg`), warm-started from the previous step's
   solutions (the data column always; the probe columns unless just redrawn), stopped at ``cg_tolerance`` or
   the cap. The first step adds s Gaussian probes with covariance P for the log-determinant. Convergence is read
   on the host at two iterations at most: where the last warm solve crossed the tolerance, then, after a miss,
   where the solves' rate per iteration says it will be met (:mod:`.checks`). Targets
   (k, n), k outputs under one kernel, give k data columns [r_1 ... r_k, z_1 ... z_s] in the same solve; the loss
   and its gradient are then per point and output (the data-fit terms averaged, the shared log-determinant once),
   so that k equal outputs train as one.
5. Gradient: one fused bilinear backward plus closed forms (:mod:`.gradient`), set as ``.grad`` of the model's raw
   parameters through their constraints, or, through the closure's ``natural`` (what gpfast's optimisers call),
   handed back on the host with respect to the hyperparameters' values. A non-finite gradient raises
   FloatingPointError.
6. Loss shown: the data-fit term 1/2 r^T K̂^{-1} r from the solve (``r^T x + x^T res``, whose error is second
   order in the CG error) plus a log-determinant *estimate*: stochastic Lanczos quadrature on the first step's
   P-distributed probes (:mod:`.logdet`), carried to later steps by integrating the estimated gradient along the
   path of the hyperparameters (trapezoid rule; the data-fit part of that integral is replaced by the exact
   difference). Measured drift after 50 steps on kin40k-3000: 0.006-0.011 per point against the exact value.
7. Accuracy rule: a solve that ends above ``cg_tolerance`` makes the next steps work harder, first by doubling
   the preconditioner rank (rebuilt at the next step, up to ``max_preconditioner_rank``), then by raising the cap
   by half (up to ``cg_iteration_limit``). Late in a fit the noise falls and K̂ grows ill-conditioned, so a fixed
   cap leaves the last, most consequential steps on inexact solves; a larger rank removes the top of the spectrum
   for O(n k) per iteration, far below a product's O(n^2) at the sizes where this matters, so it comes first.
   The ConvergenceWarning fires only when the result is at risk (:meth:`Engine.finish`): when the last solve
   missed, it is solved again to the tolerance (warm-started, up to ten times ``cg_iteration_limit``
   iterations, at least 400) and its gradient recomputed; the fit warns if even that solve misses, or if the
   re-solved gradient moves some hyperparameter's gradient by more than :data:`STEP_ERROR_LIMIT` of the root of
   Adam's second-moment estimate of it (the scale Adam divides by: the inexact solve then changed the last step's
   direction materially).
   Measured on 300 points after 16 steps (tests/test_train.py): a last residual of 0.027 against a tolerance of
   1e-6 moved it by 0.06 (no warning); a cap of 1 iteration with no preconditioner, by 155 (a warning).

A step hands numbers to the host three times at most (the two convergence checks and one read of the gradient,
the loss terms and the records together), so on a GPU it waits for the device only there. On one GPU the CG
iterations run as CUDA-graph replays (:class:`~gpfast.train.cg.CUDAGraphs`, ``CGSettings.cuda_graph``): one launch
each instead of ~25 small ones, the graph kept from step to step and captured again only when what it reads has
moved (a rebuild; ``CGSettings.cuda_graph_reuse``).

Why these defaults: :class:`~gpfast.train.settings.CGSettings`.
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from dataclasses import asdict, dataclass, field

import gpytorch
import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning

from gpfast.train.cg import CUDAGraphs, KeptIteration, pcg
from gpfast.train.checks import checks_for, read_after_miss
from gpfast.train.gradient import NaturalGradient, hutchinson_gradient
from gpfast.train.logdet import slq_log_det
from gpfast.train.preconditioner import Preconditioner
from gpfast.train.product import CovarianceProduct, choose_product
from gpfast.train.settings import CGSettings
from gpfast.train.state import ADAM_BETA2, _rademacher, _State, generator_state

__all__ = ["Engine", "EngineRecord"]

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


@dataclass
class EngineRecord:
    """Per-step records of one engine run (one entry per objective evaluation, which is one optimiser step for
    Adam; L-BFGS evaluates several times per step).

    cg_iterations, products: CG iterations and products with K̂ (iterations, plus the warm start's initial
    residual); cg_residuals: the residual that the tolerance is checked against at the end of the solve
    (the data columns' largest relative residual or the probe columns' mean one, whichever is larger);
    data_fit: 1/2 r^T K̂^{-1} r / n (averaged over the outputs); log_det_estimate: estimate of 1/2 log|K̂| / n
    (so that the loss is data_fit + log_det_estimate + 1/2 log(2 pi)); log_det_standard_error: the probes'
    standard error of the first step's stochastic-Lanczos value (the later values add the path integral's error);
    step_seconds: wall time of each step; rebuilt, resampled: the preconditioner was rebuilt / the probes were
    drawn anew at this step; graphed: the step's CG iterations after the first were CUDA-graph replays
    (:attr:`CGSettings.cuda_graph`); broke_down: some CG column met a non-positive curvature. product: "stored"
    or "matrix_free" and why; preconditioner_rank: k; num_probes: s; final_step_error: when the last solve missed
    its tolerance, the largest change that solving it to the tolerance made to a hyperparameter's gradient, in
    units of the root of Adam's second-moment estimate of that gradient (inf when even that solve missed; nan when
    the last solve met the tolerance).
    """

    product: str = ""
    product_reason: str = ""
    preconditioner_rank: int = 0
    num_probes: int = 0
    cg_iterations: list[int] = field(default_factory=list)
    products: list[int] = field(default_factory=list)
    cg_residuals: list[float] = field(default_factory=list)
    data_fit: list[float] = field(default_factory=list)
    log_det_estimate: list[float] = field(default_factory=list)
    log_det_standard_error: float = float("nan")
    step_seconds: list[float] = field(default_factory=list)
    rebuilt: list[bool] = field(default_factory=list)
    graphed: list[bool] = field(default_factory=list)
    resampled: list[bool] = field(default_factory=list)
    broke_down: bool = False
    final_step_error: float = float("nan")


def _parameters(model):
    """(lengthscale, outputscale, noise, mean) tensors of the model, differentiable in its raw parameters."""
    covar, lik = model.covar_module, model.likelihood
    ok = (
        isinstance(covar, gpytorch.kernels.ScaleKernel)
        and getattr(covar.base_kernel, "has_lengthscale", False)
        and type(covar.base_kernel).__name__ == "RBFKernel"
        and isinstance(model.mean_module, gpytorch.means.ConstantMean)
        and isinstance(lik, gpytorch.likelihoods.GaussianLikelihood)
        and not isinstance(lik, gpytorch.likelihoods.FixedNoiseGaussianLikelihood)
    )
    if not ok:
        raise TypeError(
            "gpfast's training engine handles ConstantMean + ScaleKernel(RBFKernel) + GaussianLikelihood "
            f"(gpfast.models.ExactGPModel), got mean {type(model.mean_module).__name__}, kernel "
            f"{type(covar).__name__}, likelihood {type(lik).__name__}; use CGSettings(trainer='gpytorch')."
        )
    if any(True for _ in model.named_priors()):
        raise TypeError(
            "gpfast's training engine does not add hyperparameter priors to the loss; the model has "
            "priors: use CGSettings(trainer='gpytorch')."
        )
    return covar.base_kernel.lengthscale, covar.outputscale, lik.noise, model.mean_module.constant


class Engine:
    """The training engine (module docstring). ``objective(model)`` is a :data:`gpfast.estimator.fitting.Objective`
    factory for :func:`gpfast.estimator.fitting.fit_hyperparameters`; :meth:`finish` ends the run (releases the
    stored K, warns when CG missed its tolerance at the end) and returns the :class:`EngineRecord`.

    settings: :class:`CGSettings` (default: its defaults); free_memory: bytes free on the device at the start
    (for the stored-K budget; required unless ``settings.product`` is explicit).
    """

    def __init__(self, settings: CGSettings | None = None, free_memory: int | None = None):
        self.settings = settings or CGSettings()
        self.free_memory = free_memory
        self.record = EngineRecord()
        self.product: CovarianceProduct | None = None
        self._state: _State | None = None
        self._restore: dict | None = None

    # ------------------------------------------------------------------------------------------------------------
    def objective(self, model):
        """The closure: sets ``.grad`` of the model's raw hyperparameters to the estimated gradient of the negative
        log marginal likelihood per data point and returns the loss (data fit + log-determinant estimate).

        Its attribute ``natural(values) -> (loss, gradient)`` takes the same step at ``values`` = (lengthscales...,
        outputscale, noise, mean) given on the host instead of the model's parameters, and returns the loss and the
        gradient per point with respect to those values as a float and a float64 array (a frozen parameter's entry
        zero). It leaves the model alone: one copy to the device and none of the constraints' operations or autograd
        a step (:data:`gpfast.estimator.fitting.Objective`)."""
        cfg = self.settings
        start = _parameters(model)  # type check before any work
        X, y = model.train_inputs[0], model.train_targets
        if X.dim() != 2 or y.dim() not in (1, 2) or y.shape[-1] != X.shape[0]:
            raise ValueError(
                f"gpfast's training engine needs train inputs (n, d) and targets (n,) or (k, n) (k outputs under "
                f"one kernel), got {tuple(X.shape)} and {tuple(y.shape)}"
            )
        n = X.shape[0]
        distributed = bool(getattr(model.covar_module.base_kernel, "distributed", False))
        product = CovarianceProduct(X.detach(), "matrix_free", distributed)
        rows = product.rows.stop - product.rows.start
        if cfg.product == "auto" and self.free_memory is None:
            raise ValueError("Engine(free_memory=...) is needed to choose the product (or set product explicitly)")
        mode, reason = choose_product(rows, n, X.dtype, self.free_memory or 0, cfg.product, cfg.memory_fraction)
        product.mode = mode
        from_k = mode == "stored" and (cfg.backward == "stored" or (cfg.backward == "auto" and X.is_cuda))
        product.backward_from = "stored" if from_k else "points"
        self.product = product
        # CUDA graphs on one GPU only: a split product gathers its rows over NCCL inside every product
        graphs = CUDAGraphs(X.device) if cfg.cuda_graph and X.is_cuda and product.split is None else None
        rec = self.record
        rec.product, rec.product_reason = mode, reason
        rec.preconditioner_rank = min(cfg.preconditioner_rank, n)
        state = _State(cfg)
        state.graphs = graphs
        state.kept = KeptIteration() if cfg.cuda_graph_reuse else None
        state.s = rec.num_probes = cfg.probes_for(n)
        state.rank_top = _rank_top(cfg, n, self.free_memory)
        if self._restore is not None:
            state.load(self._restore, product, X)
            self._restore = None
        self._state = state

        def closure() -> torch.Tensor:
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            tensors = _parameters(model)
            ls, s, noise, mu = (t.detach().reshape(-1) for t in tensors)
            loss, grad, _ = self._step(product, state, X, y, ls, s[0], noise[0], mu[0], t0)
            _set_grads(tensors, grad, n)
            return torch.tensor(loss, dtype=torch.float64)

        # a parameter the caller froze gets a zero gradient, as its .grad stays unset on the model's path
        trainable = np.repeat([t.requires_grad for t in start], [start[0].numel(), 1, 1, 1])

        # On a GPU the values go through a pinned buffer (a pageable copy waits for the device), rewritten once the
        # last copy from it is done: the event, done by that step's read unless the step raised before it.
        pinned = torch.empty(trainable.size, dtype=X.dtype, pin_memory=True) if X.is_cuda else None
        copied = torch.cuda.Event() if X.is_cuda else None

        def natural(values: np.ndarray) -> tuple[float, np.ndarray]:
            t0 = time.perf_counter()
            values = np.ascontiguousarray(values, dtype=np.float64)  # torch takes no negative strides
            if values.shape != trainable.shape:
                raise ValueError(f"natural: expected {trainable.size} values, got shape {values.shape}")
            if pinned is None:
                v = torch.tensor(values, dtype=X.dtype, device=X.device)  # one copy
            else:
                if not copied.query():
                    copied.synchronize()
                pinned.copy_(torch.tensor(values))  # a copy: values may be read-only
                v = pinned.to(X.device, non_blocking=True)
                copied.record()
            p = v.numel() - 3
            loss, _, g = self._step(product, state, X, y, v[:p], v[p], v[p + 1], v[p + 2], t0)
            return loss, np.where(trainable, g, 0.0)

        closure.postfix = lambda: state.postfix
        closure.natural = natural
        return closure

    def _step(self, product: CovarianceProduct, state: _State, X, y, ls, s, noise, mu, t0: float):
        """One objective evaluation at the hyperparameters ``ls`` (p,), ``s``, ``noise``, ``mu`` (0-dim), on the
        device in the working dtype: ``(loss, gradient, gradient on the host)``, the loss a float, the gradient a
        :class:`NaturalGradient` (of the summed loss) and on the host that gradient per point, float64, in the
        order (ls, s, noise, mu). It reads the device at most three times: twice inside CG (its convergence checks,
        :mod:`.checks`) and once at the end (the gradient, the loss terms and the records, one vector)."""
        cfg, rec = self.settings, self.record
        n, step = X.shape[0], len(rec.cg_iterations)
        product.update(ls, s, noise)
        k = 1 if y.dim() == 1 else y.shape[0]  # outputs: the first k columns of the solve
        rebuild = state.rebuild_due(cfg, step, product, k + state.s)
        if rebuild:
            state.build(product, s, X.dtype)
            state.built_at = step
        pc = state.pc
        rescale = rebuild or state.rescale_next or state.scales_at is None
        if rescale:  # the values it takes are read with the step's (below)
            pc.set_scales(s, noise)
        first = state.x is None
        resample = first or (cfg.resample_every is not None and step - state.drawn_at >= cfg.resample_every)
        if resample:
            state.z_rng = generator_state(X.device)
            state.Z = _rademacher(n, state.s, X, product.split is not None)
            state.drawn_at = step
        B, x0, warm = self._right_hand_sides(state, pc, (y - mu).reshape(k, n).T, first, resample)
        cap = state.cap
        estimate = None if (first or resample) else state.estimate
        checks = checks_for(estimate, cap, cfg.cg_check_every)
        measure = functools.partial(_measure, k=k)
        after_miss = read_after_miss(None if estimate is None else state.rate, cfg.cg_tolerance, cfg.cg_check_every)
        reads = product.graph_reads() + pc.graph_reads() if state.kept is not None else ()
        res = pcg(product.matmul, B, pc.solve, x0, warm, cfg.cg_tolerance, cap, measure=measure, check_at=checks,
                  graph=state.graphs, after_miss=after_miss, kept=state.kept, reads=reads)  # fmt: skip
        A, U, Z = res.x[:, :k], res.x[:, k : k + state.s], state.Z
        alpha = _data_solutions(res.x, k)
        grad = hutchinson_gradient(product, alpha, U, Z)
        data_fit_t = _data_fit_sum(B, A, res.residual, k)
        parts = [ls, s, noise, mu, grad.vector(), data_fit_t, res.rel_residual, res.broke_down]
        if first:  # the stochastic-Lanczos inputs ride along in the same read
            ZP = B[:, k + state.s :]
            parts += [torch.stack(res.alphas), torch.stack(res.betas), (ZP * pc.solve(ZP)).sum(0), pc.log_det]
        # the step's one read; cat promotes the dtypes itself (float32 values are exact as Python floats)
        host = torch.cat([t.reshape(-1) for t in parts]).tolist()
        t = B.shape[1]
        hyper, g_host, data_fit, max_res, broke, lanczos = _split_read(host, ls.numel() + 3, t, n, k)
        if res.checked and res.checked[-1][0] == res.iterations:  # the solve's own reading, which stopped it
            max_res = res.checked[-1][1]
        if not all(math.isfinite(v) for v in g_host + [data_fit, max_res]):
            raise FloatingPointError(_non_finite_message(step, hyper, g_host, max_res))
        if first:
            cols = list(range(k + state.s, t))
            it = res.iterations
            lanczos = np.asarray(lanczos, dtype=np.float64)
            alphas, betas = lanczos[: it * t].reshape(it, t), lanczos[it * t : 2 * it * t].reshape(it, t)
            norms, log_det_p = lanczos[2 * it * t : -1], float(lanczos[-1])
            log_det, se = slq_log_det(alphas, betas, cols, norms, log_det_p)
            log_det, rec.log_det_standard_error = 0.5 * log_det / n, 0.5 * se / n
        else:  # trapezoid rule on the loss, with the data-fit part of the integral replaced by the exact change
            dloss = 0.5 * float(np.dot(np.add(state.g, g_host), np.subtract(hyper, state.hyper)))
            log_det = state.log_det + dloss - (data_fit - state.data_fit)
        state.x, state.B = res.x[:, : k + state.s], B[:, : k + state.s]
        state.g, state.hyper, state.data_fit, state.log_det = g_host, hyper, data_fit, log_det
        state.track_second_moment(g_host)
        state.after_step(cfg, rebuild, hyper[: ls.numel()], res, checks, max_res, estimate is not None)
        state.track_scales(cfg, hyper[-3:-1], rescale)  # (outputscale, noise)

        rec.cg_iterations.append(res.iterations)
        rec.products.append(res.products)
        rec.cg_residuals.append(max_res)
        rec.data_fit.append(data_fit)
        rec.log_det_estimate.append(log_det)
        rec.step_seconds.append(time.perf_counter() - t0)  # the read above synchronised the device
        rec.rebuilt.append(bool(rebuild))
        rec.graphed.append(res.graphed)
        rec.resampled.append(bool(resample))
        rec.broke_down |= broke
        state.postfix = {"fit": f"{data_fit:.4f}", "logdet~": f"{log_det:.4f}", "cg": res.iterations,
                         "res": f"{max_res:.1e}"}  # fmt: skip
        return data_fit + log_det + _HALF_LOG_2PI, grad, np.asarray(g_host)

    def _right_hand_sides(self, state: _State, pc: Preconditioner, R: torch.Tensor, first: bool, resample: bool):
        """(B, x0, warm) of the step's solve: [R, Z] for the k data columns R (n, k) (and on the first step s probes
        with covariance P)."""
        n, dev, k = R.shape[0], R.device, R.shape[1]
        blocks = [R, state.Z]
        if first:  # Gaussian probes with covariance P, for the stochastic-Lanczos log-determinant
            W1 = torch.randn(pc.k, state.s, dtype=torch.float64, device=dev)
            W2 = torch.randn(n, state.s, dtype=R.dtype, device=dev)
            if self.product.split is not None:
                torch.distributed.broadcast(W1, 0)
                torch.distributed.broadcast(W2, 0)
            blocks.append(pc.sample(W1, W2))
        B = torch.cat(blocks, dim=1)
        if first or not self.settings.warm_start:
            return B, None, None
        if resample:
            x0 = torch.zeros_like(B)
            x0[:, :k] = state.x[:, :k]
            return B, x0, list(range(k))
        return B, state.x, None

    # ------------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The run's state after its last step, as plain types and CPU tensors (for a checkpoint): the
        EngineRecord and the step-to-step state of :class:`_State`. :meth:`load_state_dict` on a fresh engine,
        before :meth:`objective`, makes that engine continue exactly where this one stands."""
        return {"record": asdict(self.record), "state": self._state.state_dict() if self._state is not None else None}

    def load_state_dict(self, saved: dict) -> None:
        """Continue from :meth:`state_dict`'s output; call before :meth:`objective`."""
        self.record = EngineRecord(**saved["record"])
        self._restore = saved["state"]

    # ------------------------------------------------------------------------------------------------------------
    def _final_step_error(self) -> float:
        """Solve the last step's system again to ``cg_tolerance`` (warm-started from its solutions, up to ten times
        ``cg_iteration_limit`` iterations, at least :data:`_RESOLVE_MIN_ITERATIONS`), recompute its gradient with
        the same probes, and return the largest change of a hyperparameter's gradient in units of the root of
        Adam's second-moment estimate of it (:meth:`_State.track_second_moment`; inf if the solve misses again; nan
        if there is nothing to re-solve)."""
        cfg, state, product = self.settings, self._state, self.product
        if state.B is None or product is None or state.pc is None:
            return float("nan")
        limit = max(10 * cfg.cg_iteration_limit, _RESOLVE_MIN_ITERATIONS)
        k = state.B.shape[1] - state.s  # the data columns, one per output
        measure = functools.partial(_measure, k=k)
        res = pcg(product.matmul, state.B, state.pc.solve, state.x, None, cfg.cg_tolerance, limit,
                  measure=measure, check_at=range(10, limit, 10), graph=state.graphs)  # fmt: skip
        if float(measure(res.rel_residual)) > cfg.cg_tolerance:
            return float("inf")
        grad = hutchinson_gradient(product, _data_solutions(res.x, k), res.x[:, k:], state.Z)
        g = np.asarray((grad.vector() / product.n).tolist())
        scale = np.sqrt(np.asarray(state.g2) / (1.0 - ADAM_BETA2**state.g2_steps))
        return float(np.max(np.abs(g - np.asarray(state.g)) / np.maximum(scale, np.finfo(np.float64).tiny)))

    def finish(self, steps: int | None = None) -> EngineRecord:
        """End the run: release the stored K, warn when the last step's CG missed its tolerance and that put the
        result at risk (or CG broke down), and return the records.

        ``steps``: the optimiser's step limit, when it evaluates once more after its last step (Adam does, for the
        loss at the point it returns): the evaluations after the first ``steps`` move nothing, and the at-risk test
        is about the last of the first ``steps`` (default: the last evaluation). With Adam that is the last step's,
        or, when Adam stopped early, the evaluation that stopped it (whose gradient made the stopping test). When
        that solve met the tolerance, the fit is not at risk whatever a later evaluation did. When it missed, the
        test runs on the latest solve, which has the same cap, rank and preconditioner a step later
        (:meth:`_final_step_error`); if that one met the tolerance, the miss was marginal."""
        cfg, rec = self.settings, self.record
        state = self._state
        last = len(rec.cg_residuals) - 1 if steps is None else min(steps, len(rec.cg_residuals)) - 1
        at_risk = last >= 0 and rec.cg_residuals[last] > cfg.cg_tolerance
        if at_risk and state is not None and rec.cg_residuals[-1] > cfg.cg_tolerance:
            rec.final_step_error = self._final_step_error()
        if self.product is not None:
            self.product.release()
        if state is not None:
            state.graphs = state.build_graph = state.kept = None  # their graphs hold memory pools
        if rec.final_step_error > STEP_ERROR_LIMIT:  # nan (met, or nothing to re-solve) compares False
            missed = sum(r > cfg.cg_tolerance for r in rec.cg_residuals)
            warnings.warn(
                f"gpfast's training engine: CG did not reach its tolerance on the last training step: relative "
                f"residual {rec.cg_residuals[-1]:.3g} > cg_tolerance {cfg.cg_tolerance:g} after "
                f"max_cg_iterations={state.cap} with a rank-{min(state.rank, state.x.shape[0])} preconditioner "
                f"({missed} of {len(rec.cg_residuals)} steps missed it), so the last gradients rest on inexact solves: "
                f"{_step_error_text(rec.final_step_error)}. Raise cg_iteration_limit or max_preconditioner_rank of "
                f"the CGSettings (or loosen its cg_tolerance).",
                ConvergenceWarning,
                stacklevel=2,
            )
        if rec.broke_down:
            warnings.warn(
                "gpfast's training engine: CG met a non-positive curvature (the covariance is not numerically "
                "positive definite in this dtype); the affected solves were cut short. Use dtype='float64' or a "
                "larger noise_init.",
                ConvergenceWarning,
                stacklevel=2,
            )
        return rec


def _step_error_text(err: float) -> str:
    if math.isinf(err):
        return "solved again with ten times the iteration limit (at least 400), it still missed the tolerance"
    return (
        f"solved again to the tolerance, the last gradient moved by {err:.2f} of Adam's scale for it "
        f"(more than {STEP_ERROR_LIMIT:g})"
    )


#: The change of the last gradient that solving the last step's system to the tolerance may make before the fit
#: counts as at risk, in units of the square root of Adam's bias-corrected second-moment estimate of that gradient:
#: Adam divides each gradient by that number, so this is the share of a full step by which the inexact solve moved
#: the last step's direction.
STEP_ERROR_LIMIT = 0.25

#: The final re-solve may take ten times ``cg_iteration_limit`` iterations, and at least this many: it runs once
#: per fit, and a verdict of "at risk" should come from the problem, not from a small limit.
_RESOLVE_MIN_ITERATIONS = 400


#: Bytes per point and unit of preconditioner rank at a rebuild: the float64 factor being built, the float64 factor
#: it replaces and the working-dtype copy the products read, with its transpose (on CUDA).
_RANK_BYTES_PER_POINT = 28


def _rank_top(cfg: CGSettings, n: int, free_memory: int | None) -> int:
    """The accuracy rule's rank limit: ``max_preconditioner_rank``, lowered to the last rank of the rule's doublings
    (``preconditioner_rank`` times a power of two) within n / 8, and so that a rebuild's factors take at most a
    tenth of the free memory at the fit's start (the stored K may take half of it).

    Why n / 8: an iteration's two products with the n x k factor then read at most a quarter of what a product with the
    stored K reads, and a build costs O(n k^2) against the product's O(n^2). On an H200 (50 Adam steps, row c,
    2026-12-04, ``experiments/results/h200_2026-12-04_session18``, 32 pivots a block) the limit 1600 instead of 3200
    trained pol (13,500 points, where n / 4 allowed 3200) in 0.90 against 1.07 s, elevators in 0.81 against 0.88 and
    bike in 0.78 against 0.85, with the same test RMSE and NLL, while kin40k and protein (n / 8 above 3200) trained
    faster at 3200 (2.42 against 2.56 s, 4.90 against 5.12). A limit off the doublings would add a rebuild at a rank
    barely above the last one (1687 after 1600 for pol)."""
    start = min(cfg.preconditioner_rank, n)
    within = n // 8
    if start > 0:
        doubled = start
        while 2 * doubled <= within:
            doubled *= 2
        within = doubled
    top = min(cfg.max_preconditioner_rank, within)
    if free_memory:
        top = min(top, int(0.1 * free_memory) // (_RANK_BYTES_PER_POINT * max(n, 1)))
    return max(top, start)


def _non_finite_message(step: int, hyper: list, g: list, max_res: float) -> str:
    d = len(hyper) - 3
    names = [f"lengthscale[{i}]" for i in range(d)] + ["outputscale", "noise", "mean"]
    bad = [nm for nm, v in zip(names, g) if not math.isfinite(v)]
    return (
        f"ExactGP: gpfast's training engine got a non-finite gradient at step {step} (in {bad or 'the loss'}; "
        f"lengthscale {hyper[:d]}, outputscale {hyper[d]:.4g}, noise {hyper[d + 1]:.4g}, CG relative "
        f"residual {max_res:.3g}). Try dtype='float64', a smaller lr or a larger noise_init. The estimator "
        f"was not modified."
    )


def _data_fit_sum(B: torch.Tensor, A: torch.Tensor, residual: torch.Tensor, k: int) -> torch.Tensor:
    """``r^T x + x^T res`` summed over the k data columns (each r^T K̂^{-1} r to second order in the CG error), a
    0-dim tensor: the data-fit term's halving and average per point and output are taken on the host
    (:func:`_split_read`)."""
    if k == 1:
        return B[:, 0].dot(A[:, 0]) + A[:, 0].dot(residual[:, 0])
    return (B[:, :k] * A).sum() + (A * residual[:, :k]).sum()


def _split_read(host: list, p: int, t: int, n: int, k: int) -> tuple:
    """A step's read (p hyperparameters, their p gradient sums, the data-fit sum, the t relative residuals and the t
    breakdown flags, then what rides along) as (hyperparameters, gradient per point, data-fit term per point and
    output (so that the loss of k equal outputs is that of one), convergence measure, whether CG broke down, the
    rest): the divisions, the measure and the flags' ``any`` on the host rather than as small kernels."""
    end = 2 * p + 1  # where the residuals start
    gradient, data_fit = [g / n for g in host[p : 2 * p]], 0.5 * host[2 * p] / (n * k)
    measure = float(_measure(np.asarray(host[end : end + t]), k))
    return host[:p], gradient, data_fit, measure, any(host[end + t : end + 2 * t]), host[end + 2 * t :]


def _data_solutions(x: torch.Tensor, k: int) -> torch.Tensor:
    """The solutions of the k data columns of a solve: (n,) for one output (the gradient's one-output form),
    (n, k) for several."""
    return x[:, 0] if k == 1 else x[:, :k]


def _measure(rel, k: int = 1):
    """The residual compared with ``cg_tolerance``: the largest relative residual of the k data columns or the
    probe columns' mean one (as GPyTorch's mBCG averages over columns), whichever is larger. The data columns
    carry the data-fit term and its gradient; a probe's solve error only adds to the Hutchinson noise, which
    averages over probes. ``rel`` is a tensor (a 0-dim tensor back, no host read) or, read already, a numpy
    array."""
    data = rel[0] if k == 1 else rel[:k].max()
    if rel.shape[0] <= k:
        return data
    return (torch if isinstance(rel, torch.Tensor) else np).maximum(data, rel[k:].mean())


def _set_grads(tensors, grad: NaturalGradient, n: int) -> None:
    """Chain the natural gradient (per point) through the constraints to the raw parameters' ``.grad``."""
    ls_t, os_t, noise_t, mean_t = tensors
    outs, grads = [], []
    for t, g in ((ls_t, grad.lengthscale), (os_t, grad.outputscale), (noise_t, grad.noise), (mean_t, grad.mean)):
        if t.requires_grad:
            outs.append(t)
            grads.append((g / n).reshape(t.shape).to(t.dtype))
    if outs:
        torch.autograd.backward(outs, grads)
