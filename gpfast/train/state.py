"""What the training engine carries from step to step (:class:`_State`): the preconditioner and its rules for
rebuilding and rescaling, the warm starts, the probes, the accuracy rule's rank and cap, and the log-determinant's
path integral; all of it checkpointable, so that a resumed fit continues exactly."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from gpfast.kernels import distributed as _dist
from gpfast.train.cg import CUDAGraphs, KeptIteration
from gpfast.train.checks import estimate_count, solve_rate
from gpfast.train.costs import rebuild_iterations
from gpfast.train.preconditioner import BuildGraph, Preconditioner, pivoted_cholesky
from gpfast.train.product import CovarianceProduct
from gpfast.train.settings import CGSettings

#: The second-moment decay of Adam's estimate of the squared gradients, which scales the engine's at-risk test:
#: the default of Adam (gpfast.estimator.optimize.Adam, as torch.optim.Adam), the optimiser the engine serves.
ADAM_BETA2 = 0.999


class _State:
    """What one run carries from step to step: everything a resumable fit has to checkpoint besides the model, the
    optimiser and the EngineRecord. The probes Z (or the RNG state they were drawn from, with ``drawn_at``) and the
    warm starts x are the engine's only large state (n x (1 + s) each); the preconditioner is a deterministic
    function of the hyperparameters at its build (``build_hyper``, at step ``built_at``, rank ``rank``), so
    rebuilding it from them on resume gives the same factor; g, hyper, data_fit and log_det carry the
    log-determinant's path integral; ``estimate`` places the next solve's convergence checks; ``rebuild_next`` is
    the lengthscale rule's verdict on the last step, and ``rank`` and ``cap`` the preconditioner rank and CG cap
    that the accuracy rule (:meth:`after_step`) has reached; ``scales_at`` the outputscale and noise the
    preconditioner last took (:meth:`track_scales`), which a resume gives it again."""

    def __init__(self, settings: CGSettings | None = None):
        settings = settings or CGSettings()
        self.s = 0  # the number of probes
        self.pc: Preconditioner | None = None
        self.built_at = 0
        self.l_build: list[float] | None = None  # the lengthscales at the build (host)
        self.Z: torch.Tensor | None = None  # the Hutchinson probes
        self.z_rng: dict | None = None  # the generators' state they were drawn from
        self.drawn_at = 0
        self.x: torch.Tensor | None = None  # the last solutions (warm starts)
        self.build_hyper: tuple | None = None  # (lengthscale, outputscale, noise) given to the product at the build
        self.g = self.hyper = None  # host lists: the last gradient per point and hyperparameters
        self.data_fit = self.log_det = 0.0
        self.rank, self.cap = settings.preconditioner_rank, settings.max_cg_iterations
        self.block = settings.pivot_block  # pivots per block of the preconditioner's build
        self.storage = settings.preconditioner_storage  # how the CG iterations keep the factor
        self.rank_top = settings.max_preconditioner_rank  # the accuracy rule's rank limit (set by the engine)
        self.rebuild_next = False
        self.its_since_build = 0  # CG iterations of the steps since the last build, its own step's included
        self.scales_at: list[float] | None = None  # (outputscale, noise) of the preconditioner's last update (host)
        self.rescale_next = False
        self.estimate: int | None = None  # the next solve's expected CG iterations
        self.rate: float | None = None  # the convergence measure's factor per iteration in the last warm solves
        self.postfix: dict = {}
        self.graphs: CUDAGraphs | None = None  # set by the engine on a single GPU
        self.build_graph: BuildGraph | None = None  # the preconditioner's build as a graph, with graphs
        self.kept: KeptIteration | None = None  # the CG iteration kept across steps (CGSettings.cuda_graph_reuse)
        self.eager_rank: int | None = None  # the rank of the last build made op by op
        self.B: torch.Tensor | None = None  # the last step's right-hand sides [r, Z], for the final re-solve
        self.g2: list | None = None  # Adam's moving average of the squared gradients per point (host list)
        self.g2_steps = 0

    _LISTS = ("l_build", "g", "hyper", "g2", "scales_at")
    _NUMBERS = ("s", "built_at", "drawn_at", "data_fit", "log_det", "rank", "cap", "rebuild_next", "rescale_next",
                "estimate", "rate", "g2_steps", "its_since_build")  # fmt: skip

    def rebuild_due(self, cfg: CGSettings, step: int, product: CovarianceProduct, columns: int) -> bool:
        """Whether this step rebuilds the preconditioner (solving ``columns`` right-hand sides): always for the
        first build and for a new rank (the accuracy rule); when the lengthscale rule or ``rebuild_every`` asks,
        only once the CG iterations since the last build have cost ``cfg.rebuild_cost_share`` of a build
        (:mod:`gpfast.train.costs`)."""
        if self.pc is None or self.pc.k != min(self.rank, product.n):
            return True
        if not (self.rebuild_next or step - self.built_at >= cfg.rebuild_every):
            return False
        if cfg.rebuild_cost_share == 0:
            return True
        # the first rank's rows (the largest block), so that every rank of a split product takes the same decision
        rows = -(-product.n // _dist.world_size()) if product.split is not None else product.n
        cost = rebuild_iterations(product.n, rows, self.pc.k, self.block, columns, product.x.shape[1],
                                  product.mode == "stored", product.x.device.type,
                                  2 if self.pc.half and product.x.is_cuda else 4)  # fmt: skip
        return self.its_since_build >= cfg.rebuild_cost_share * cost

    def build(self, product: CovarianceProduct, outputscale: torch.Tensor, dtype: torch.dtype) -> None:
        """Rebuild the preconditioner at the product's current hyperparameters (no host read).

        With CUDA graphs, the second build at a rank is captured (:class:`BuildGraph`) and the later ones at that
        rank replay it. The first runs op by op, so that a rank built once (the doublings of the accuracy rule)
        costs no capture, and on the capture stream, so that every lazy initialisation there (cuBLAS workspaces,
        kernel attributes) happens outside a capture, as for the solves' graphs."""
        n = product.n
        self.build_hyper = (product.lengthscale, outputscale, product.noise)
        rank = min(self.rank, n)
        ls = product.lengthscale
        if self.graphs is not None and self.build_graph is not None and self.build_graph.rank == rank:
            L = self.build_graph(ls, outputscale)
        elif self.graphs is not None and self.eager_rank == rank:
            self.build_graph = BuildGraph(product.kernel_rows, n, rank, ls, outputscale, dtype, self.graphs,
                                          block=self.block)  # fmt: skip
            L = self.build_graph(ls, outputscale)
        else:
            self.build_graph = None  # a graph of another rank: its factor is dropped with it
            with self.graphs.stream() if self.graphs is not None else contextlib.nullcontext():
                L = pivoted_cholesky(product.kernel_rows, outputscale.to(dtype).expand(n), rank, block=self.block)
            self.eager_rank = rank
        self.pc = Preconditioner(L, outputscale, dtype, storage=self.storage)

    def track_scales(self, cfg: CGSettings, scales: list, updated: bool) -> None:
        """The rescaling rule, from the step's (outputscale, noise) on the host: record them when the step
        ``updated`` the preconditioner, and update it at the next step once either has moved by more than
        ``rescale_change`` in log since."""
        if updated:
            self.scales_at = list(scales)
        self.rescale_next = _log_change(scales, self.scales_at) > cfg.rescale_change

    def track_second_moment(self, g: list) -> None:
        """Fold the step's gradient (per point) into the moving average of its squares that Adam keeps
        (``v = beta2 v + (1 - beta2) g^2``, :data:`ADAM_BETA2`), the scale of :data:`STEP_ERROR_LIMIT`."""
        sq = np.square(np.asarray(g, dtype=np.float64))
        prev = np.zeros_like(sq) if self.g2 is None else np.asarray(self.g2)
        self.g2 = (ADAM_BETA2 * prev + (1.0 - ADAM_BETA2) * sq).tolist()
        self.g2_steps += 1

    def after_step(self, cfg: CGSettings, rebuilt: bool, lengthscale: list, result, checks, res: float, warm: bool):
        """Host bookkeeping from the step's one read: the lengthscale rule for the next rebuild and the places of
        the next convergence checks (from the solve's ``result``, a :class:`~gpfast.train.cg.CGResult`, its final
        measure ``res``, and whether it started from the last step's solutions)."""
        if rebuilt:
            self.l_build = list(lengthscale)
        self.its_since_build = result.iterations + (0 if rebuilt else self.its_since_build)
        self.rebuild_next = _log_change(lengthscale, self.l_build) > cfg.rebuild_lengthscale_change
        points = [(i, r) for i, r in result.checked if 0 < i < result.iterations] + [(result.iterations, res)]
        if warm:
            self.rate = solve_rate(points) or self.rate
        rate = self.rate if warm else None
        ran_out = result.iterations >= self.cap
        self.estimate = estimate_count(result.iterations, checks, cfg.cg_tolerance, points, rate, ran_out)
        if res > cfg.cg_tolerance:  # the accuracy rule: a missed solve gets more help at the next step
            top = min(self.rank_top, self.x.shape[0])
            if 0 < self.rank < top:
                self.rank = min(2 * self.rank, top)
                self.rebuild_next = True
            elif self.cap < cfg.cg_iteration_limit:
                self.cap = min(math.ceil(1.5 * self.cap), cfg.cg_iteration_limit)

    def state_dict(self) -> dict:
        """Plain types and CPU tensors; the preconditioner is kept as the hyperparameters it was built at."""

        def cpu(t):
            return None if t is None else t.detach().cpu().clone()

        out = {k: None if getattr(self, k) is None else torch.tensor(getattr(self, k), dtype=torch.float64)
               for k in self._LISTS}  # fmt: skip
        out["x"] = cpu(self.x)
        out.update({k: getattr(self, k) for k in self._NUMBERS})
        out["build_hyper"] = None if self.build_hyper is None else [cpu(t) for t in self.build_hyper]
        out["z_rng"] = self.z_rng  # the probes are drawn again from it: half the size of a checkpoint at s = 10
        return out

    def load(self, saved: dict, product: CovarianceProduct, X: torch.Tensor) -> None:
        """Restore :meth:`state_dict`'s output for training inputs X, rebuilding the preconditioner by the
        same pivoted Cholesky, at the same hyperparameters and rank, as the step that built it."""
        if int(saved["s"]) != self.s:
            raise ValueError(f"the saved engine state has {saved['s']} probes; these settings give {self.s}")
        for k in self._NUMBERS:
            setattr(self, k, saved.get(k, getattr(self, k)))
        for k in self._LISTS:
            setattr(self, k, None if saved.get(k) is None else torch.as_tensor(saved[k]).tolist())
        if saved["x"] is not None:
            self.x = saved["x"].to(device=X.device, dtype=X.dtype)
        if saved["z_rng"] is not None:  # the draw of _step, from the generators' state before it
            self.z_rng = saved["z_rng"]
            devices = [X.device] if X.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                set_generator_state(self.z_rng, X.device)
                self.Z = _rademacher(X.shape[0], self.s, X, False)
        if saved["build_hyper"] is not None:
            ls, s, noise = (t.to(X.device) for t in saved["build_hyper"])
            product.update(ls, s, noise)
            self.build(product, s.reshape(()), X.dtype)
            if self.scales_at is not None:  # the update the uninterrupted run's preconditioner last had
                self.pc.set_scales(*(torch.tensor(v, dtype=X.dtype, device=X.device) for v in self.scales_at))


def _log_change(values: list, since: list) -> float:
    """The largest |log(value / then)| over paired positive values (infinite if any is not positive): how far
    hyperparameters have moved since a build or an update, as the rebuild and rescale rules measure it."""
    if not all(a > 0 and b > 0 for a, b in zip(values, since)):
        return math.inf
    return max(abs(math.log(a / b)) for a, b in zip(values, since))


def generator_state(device: torch.device) -> dict:
    """torch's CPU generator state, and the CUDA device's when ``device`` is one (for checkpoints)."""
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_generator_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


def _rademacher(n: int, s: int, like: torch.Tensor, broadcast: bool) -> torch.Tensor:
    """(n, s) random signs in like's dtype and device (rank 0's on every rank when ``broadcast``)."""
    Z = torch.randint(0, 2, (n, s), device=like.device).to(like.dtype).mul_(2).sub_(1)
    if broadcast:
        torch.distributed.broadcast(Z, 0)
    return Z
