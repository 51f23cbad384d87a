"""The settings of every conjugate-gradient solve in gpfast, named and documented once: :class:`CGSettings`.

:class:`gpfast.train.Engine` reads the training fields; :class:`gpfast.ExactGP` takes the whole object as its
``cg`` argument and hands the prediction fields to its predictions. Nothing here knows the estimator.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields, replace

from gpfast.train.product import BACKWARDS, PRODUCTS

__all__ = ["PROBE_BUDGET", "TRAINERS", "CGSettings"]

#: With ``num_probes=None``, the probes number about PROBE_BUDGET / n (10 to 256): the Hutchinson estimate's relative
#: spread falls roughly like 1 / sqrt(n s), so small sets get the probes that large ones need not.
PROBE_BUDGET = 100_000

#: Values of :attr:`CGSettings.trainer`.
TRAINERS = ("auto", "gpfast", "gpytorch")

#: Values of :attr:`CGSettings.preconditioner_storage`.
STORAGES = ("float32", "float16")


@dataclass(frozen=True)
class CGSettings:
    """Settings of the conjugate-gradient solves: gpfast's training engine and predictions by CG.

    The training defaults come from 50-step Adam fits (lr 0.1, float32, the 2-core CPU box, 2026-11-30) against
    GPyTorch's exact (Cholesky) loop: kin40k (3,000-point subset of split 0; exact: test RMSE 0.1976, NLL -0.3074),
    concrete (0.2467, -0.0235) and yacht (0.2528, 0.8210), several seeds each. GPyTorch's own training loop
    (``trainer="gpytorch"``) and its estimate of the log marginal likelihood run under GPyTorch's settings
    (``gpytorch.settings.cg_tolerance`` and the like, GPyTorch's defaults unless the caller changes them), so that
    comparisons see GPyTorch as it ships. Every value is checked on construction (ValueError naming the field).

    Parameters
    ----------
    num_probes : int or None, default=None
        Hutchinson probes s; one solve of 1 + s columns per step. None: ``clip(ceil(PROBE_BUDGET / n), 10, 256)``,
        so 10 (GPyTorch's ``num_trace_samples``) from n = 10,000 on. With 10 probes the fitted NLL varied by
        +-0.12 over seeds on yacht (n = 277) and RMSE by up to 3% on concrete; with the rule (256 and 108 probes)
        concrete's RMSE stays within 0.3% and its NLL within 0.003 of the exact loop, yacht's RMSE within 0.4%
        and NLL -0.002 to +0.045 (4 seeds). On kin40k-3000, 10 probes already match the exact loop.
    cg_tolerance : float, default=0.01
        A training step's CG stops once the data column's relative residual ``|b - K̂ x| / |b|`` and the probe
        columns' mean one are at most this. 0.1 and 0.3 halve or third the iterations and keep kin40k-3000 and
        concrete on the exact loop's RMSE and NLL, but bias yacht's NLL by +0.07 and +0.17 (all seeds).
    max_cg_iterations : int, default=15
        CG iteration cap per training step: the truncated, warm-started regime. Late in a fit the cap binds
        (kin40k-3000: 15 from step ~25 on, final residual ~0.2-0.3) and the fit still matches the exact loop
        (RMSE 0.1973-0.1978, NLL -0.3064 to -0.3094); a cap of 30 took 50% more iterations for the same RMSE and
        NLL. The engine warns at the end of a fit whose last step missed the tolerance.
    preconditioner_rank : int, default=100
        Rank k of the training steps' pivoted-Cholesky preconditioner (0: none, P = noise I). 100 against 50: 6%
        fewer iterations on kin40k-3000 and 38% fewer on concrete, same fits; Wang et al. (2019) used 100.
    rebuild_every : int, default=10
        The preconditioner is rebuilt every this many steps ...
    rebuild_lengthscale_change : float, default=0.2
        ... or sooner, once some lengthscale has changed by more than this in log (about 22%) since the build
        (with Adam at lr 0.1 that is every 3-5 steps early in a fit). The outputscale and noise never force a
        rebuild (see ``rescale_change``). The probes do not depend on the preconditioner, so a rebuild costs no
        warm start.
    rebuild_cost_share : float, default=1.0
        A rebuild that the two rules above ask for waits until the CG iterations since the last build have cost at
        least this share of a build, by a model of both costs (:mod:`gpfast.train.costs`, which depends on the
        sizes and the device kind, never on timings, so fits stay deterministic); 0 rebuilds as soon as asked.
        Rebuilds for a new rank (the accuracy rule, ``max_preconditioner_rank``) never wait. Why: on an H200 at
        rank 3200 a rebuild cost pol (13,500 points) about 80 ms, one every three steps, beside 11-18 ms for a
        whole step without one, and its iterations barely moved (4-8 a step); with the rule its fit trained in
        2.15 s against 2.37, elevators 1.72 against 1.86, bike 1.11 against 1.28, the larger UCI sets within 3%,
        with the same test RMSE and NLL (one H200 call, 2026-12-03). At rank 100 a rebuild costs about one
        iteration, so there the rule changes nothing. Counting only the iterations that the preconditioner's
        ageing added (each step's beyond the fewest since the build) deferred rebuilds longer, and the staler
        preconditioner took more iterations and missed more solves, which raised the rank sooner: in one H200 call
        with all three, the seven sets' 50-step fits took 20.7 s in all by that count (faster only on pol and
        protein), 19.6 s by this rule and 19.6 s at 0, each set's RMSE and NLL the same to three digits (2026-12-04,
        ``experiments/results/h200_2026-12-04_session15``).
    pivot_block : int, default=32
        Pivots the preconditioner's build takes per evaluation of candidate rows (1 to 32; see
        :func:`gpfast.train.preconditioner.pivoted_cholesky`). 32 builds faster on a GPU than 16 (rank 3200
        replayed in 46 against 68 ms at 43,945 points and in 27 against 40 ms at pol's 13,500 on an H200) with no
        larger trace error there. In 50-step fits of the seven UCI sets (H200, 2026-12-04,
        ``experiments/results/h200_2026-12-04_session18``) every test RMSE and NLL matched 16's to three digits;
        at the rank limit those fits now reach (1600 on pol, elevators and bike) 32 trained them in 0.90, 0.81
        and 0.78 s against 1.02, 0.94 and 0.88, and at rank 3200 the four larger sets took 16.2 s against 16.1 in
        all. keggdirected trained slower at 32, in two calls (3.47 and 3.48 s against 3.01): as many rebuilds, but
        each added about 65 ms to its step against about 30 at 16, where the build's benchmark replays it faster
        at 32 (46 against 68 ms); not yet explained.
    preconditioner_storage : {"float32", "float16"}, default="float32"
        How the preconditioner's n x k factor is kept for the CG iterations of float32 training, which read it
        twice each (``L^T V``, then ``L W``); float64 training keeps its factor in float64 either way. "float16"
        rounds it to 16 bits (scaled by 1 / sqrt(s), so its entries are at most 1) and forms P from the rounded
        factor, so that P stays exactly ``L16 L16^T + noise I`` and positive definite; on a GPU the iterations
        then read it in float16, 2 bytes an entry instead of 4 (more than 16 right-hand sides, as at the first
        step, take a pass per 16), and no float64 copy is kept; on the CPU the rounded values are kept in float32
        (the same P). Why: the factor is 15% of what a stored-K product reads on protein at rank 3200 and 24% on
        pol at 1600, and its products took 12.5 of protein's 96 ms a step and 1.35 of pol's 10.5 on an H100
        (``experiments/results/h100_2026-12-05_session23/call2_e396882/step_anatomy.md``); on 8,000 points of
        protein and of pol a float16 factor took the same CG iterations as a float64 one at ranks 500 and 1000
        (CPU, ``experiments/results/preconditioner_forms_protein8000_stored.md`` and ``..._pol8000_stored.md``).
        Not the default: on an H100 row c on the seven UCI sets kept the same accuracy and CG iterations with it,
        but its steps moved by -1.7% (protein) to +4.1% (pol), because the float16 kernel is bound by widening
        and multiplying the values, not by reading them
        (``experiments/results/h100_2026-12-05_session24/call1_cb5b6e3``).
    rescale_change : float, default=0.1
        The preconditioner takes the current outputscale and noise (an exact update of its Woodbury form, O(k^3):
        5.6 ms at rank 3200 on an H200, more than all the products of a step on the smaller UCI sets) at every
        rebuild, and at the step after one whose outputscale or noise has moved by more than this in log (about
        10%) since its last update (the rule reads the values with the step's one read, so P can lag by a step
        more); 0 updates it at every step. Between updates P is an older but still positive definite
        preconditioner, and after the first step the loss and the gradient depend on P only through how far each
        solve gets: a solve that meets its tolerance gives the same answer to that tolerance, and one that misses
        it (the cap) can differ, to which the accuracy rule reacts as to any miss.
    resample_every : int or None, default=None
        The probes are drawn anew every this many steps (their solves then restart cold); None keeps one draw for
        the whole fit. Redrawing every 5 or 10 steps did not improve the fits above (yacht's NLL spread stayed,
        kin40k-3000 matched either way) and costs the probes' warm start (+3-7 iterations on each redraw step).
    warm_start : bool, default=True
        Start each step's solves from the previous step's solutions (False: from zero, for comparisons; cold solves
        took ~1.8x the iterations of warm ones in tests/test_train.py).
    product : {"auto", "stored", "matrix_free"}, default="auto"
        Products with a stored K (rebuilt by the fused forward each step) or matrix-free; ``"auto"`` stores K
        when it takes at most ``memory_fraction`` of the device's free memory.
    memory_fraction : float, default=0.5
        Share of the free memory (at the start of the fit) that a stored K may take; the rest stays for the
        solves, the preconditioner and the exact posterior that ``ExactGP`` factors after training (K is released
        before that).
    predict_cg_tolerance : float, default=0.01
        Predictions by CG (:class:`gpfast.models.CGPosterior`) certify every predictive variance to within this
        fraction of itself (0.01: 0.5% in the standard deviation); the means are certified to 1e-3 std(y).
    predict_max_cg_iterations : int, default=1000
        Iteration cap of each of their solves (they start from zero, so they need far more iterations than a
        warm-started training step); a variance left uncertified at the cap is reported with a warning.
    predict_preconditioner_rank : int, default=1024
        Rank of their pivoted-Cholesky preconditioner, built once per fit (0: none). It also makes the variance
        bound: ``A >= L L^T + noise I``. 1024 took a third of the iterations of 256 (synthetic d = 8, n = 3000).
    trainer : {"auto", "gpfast", "gpytorch"}, default="auto"
        Who takes the CG training steps (steps that solve by Cholesky use an exact objective). ``"auto"``: gpfast's
        engine under Adam, GPyTorch's loop under L-BFGS (whose line search needs a loss that depends on the point
        only, not on the path of warm starts). ``"gpfast"``: the engine for every training step, CG steps even where
        a Cholesky would train. ``"gpytorch"``: GPyTorch's loop (mBCG and stochastic Lanczos), for comparisons.
    cg_check_every : int or None, default None
        CG reads its convergence measure on the host (a wait for the device on a GPU) only after every this many
        iterations; None: at most twice per step, so that a step reads the device at most three times: first
        where the last warm solve's measure crossed the tolerance (read off its own reads and its end,
        :func:`gpfast.train.checks.estimate_count`), then, if that read misses, where the solves' rate per
        iteration says the tolerance will be met, with a 25% margin (:func:`gpfast.train.checks.read_after_miss`).
        H200, 50 Adam steps (row c at e8bf977): protein 24.3 CG iterations a step and 89.5 ms, where placing the
        first check at a third of the cap after a solve that ran to it kept its steps at their cap (30.6 iterations,
        106.8 ms); the same test RMSE and NLL. 1 stops each solve at the first iteration that meets the tolerance
        (tests that count iterations).
    max_preconditioner_rank : int, default 3200
        When a step's solve misses ``cg_tolerance``, the preconditioner rank doubles (from ``preconditioner_rank``) and
        the preconditioner is rebuilt at the next step, up to this rank (and to the last doubling within n / 8, and to
        what a tenth of the free memory holds, 28 bytes per point and unit of rank). H200, 50 Adam steps, one run at
        each limit (3200 / 800): median step pol 16.9 / 21.0 ms, elevators 17.7 / 14.5, bike 15.1 / 16.9, kin40k 38.0 /
        56.7, protein 106.8 / 98.6, keggdirected 44.4 / 64.7, keggundirected 75.8 / 94.0; CG iterations a step fell by
        17-73%; the same test RMSE and NLL; bike's default fit warned at 800 (its last gradient at risk) and no set at
        3200. The rebuilds at a high rank cost more than the saved iterations on pol, elevators, protein and
        keggundirected: training took 29.4 s on the seven sets at 3200 against 26.0 s at 800.
    cg_iteration_limit : int, default 40
        Once the rank is at its maximum and a solve still misses the tolerance, the CG cap grows by half (from
        ``max_cg_iterations``) up to this.
    cuda_graph : bool, default True
        On a GPU, replay each CG iteration after a solve's first as a captured CUDA graph
        (:class:`gpfast.train.cg.CUDAGraphs`): the same arithmetic with one launch instead of ~25 small ones, whose
        launch cost otherwise exceeds the products' time at n ~ 10^4. False runs them op by op (to profile single
        kernels). Not used on the CPU or when the rows are split over several GPUs.
    cuda_graph_reuse : bool, default True
        Keep the CG iteration's tensors and its graph from step to step (:class:`gpfast.train.cg.KeptIteration`):
        a solve of an unchanged shape and cap replays the graph from its first iteration, without a capture, as
        long as the stored K, the noise and the preconditioner's tensors are where they were at the capture (new
        scales are written into the preconditioner's tensors; a rebuild or a new K elsewhere captures again). The
        same arithmetic as without. On an H100 (2026-12-05, ``experiments/results/h100_2026-12-05_session20``) a
        13,500-point solve of 8 iterations took 3.15 against 4.00 ms (``experiments/cg_graph_cost.py``), the
        engine's step 8.4 against 9.7 ms on pol, 6.7 against 9.4 on elevators and 10.3 against 12.8 on bike
        (``experiments.step_anatomy``; the same on the four larger sets, within 2%), with 60-70 launches a step
        fewer, and row c trained the seven UCI sets in 19.66 against 19.92 s with the same test RMSE and NLL.
        False captures each solve afresh. On the CPU it only keeps the solve's tensors.
    backward : {"auto", "stored", "points"}, default "auto"
        Where the lengthscale and outputscale gradient reads K from. ``"stored"``: the stored K, when the product
        stores one (:func:`gpfast.ops.stored_backward`: no exponential recomputed, so about one read of K and the
        products with the weights); ``"points"``: K recomputed from the points by the fused K @ V backward
        (:func:`gpfast.ops.rbf_matmul_backward`), as with a matrix-free product. ``"auto"``: ``"stored"`` on a GPU,
        ``"points"`` on the CPU, where both are float64 sums and the points' form needs no n x n temporary. The two
        give the gradient of one objective up to the float32 rounding of the stored K.
    """

    num_probes: int | None = None
    cg_tolerance: float = 0.01
    max_cg_iterations: int = 15
    preconditioner_rank: int = 100
    rebuild_every: int = 10
    rebuild_lengthscale_change: float = 0.2
    rescale_change: float = 0.1
    rebuild_cost_share: float = 1.0
    pivot_block: int = 32
    preconditioner_storage: str = "float32"
    resample_every: int | None = None
    warm_start: bool = True
    product: str = "auto"
    memory_fraction: float = 0.5
    predict_cg_tolerance: float = 0.01
    predict_max_cg_iterations: int = 1000
    predict_preconditioner_rank: int = 1024
    trainer: str = "auto"
    cg_check_every: int | None = None
    max_preconditioner_rank: int = 3200
    cg_iteration_limit: int = 40
    cuda_graph: bool = True
    cuda_graph_reuse: bool = True
    backward: str = "auto"

    def __post_init__(self) -> None:
        self.check()

    def probes_for(self, n: int) -> int:
        """The number of probes for n training points.

        Parameters
        ----------
        n : int
            Training points.

        Returns
        -------
        int
            ``num_probes``, or by default ``clip(ceil(PROBE_BUDGET / n), 10, 256)``.
        """
        if self.num_probes is not None:
            return int(self.num_probes)
        return int(min(256, max(10, math.ceil(PROBE_BUDGET / n))))

    @classmethod
    def from_value(cls, value) -> CGSettings:
        """The settings that ``value`` stands for.

        Parameters
        ----------
        value : CGSettings, dict or None
            Settings, a dict of some of their fields (the others keep their defaults), or None for the defaults.

        Returns
        -------
        CGSettings

        Raises
        ------
        ValueError
            For another type, an unknown key or a bad value, naming it.
        """
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        known = [f.name for f in fields(cls)]
        if not isinstance(value, dict):
            raise ValueError(
                f"CGSettings: expected a CGSettings, a dict with keys from {known} or None, got {value!r}."
            )
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"CGSettings: unknown key(s) {unknown}; known keys: {known}.")
        return replace(cls(), **value)

    def check(self) -> None:
        """Raise ValueError naming the first field whose value is out of its range."""

        def bad(name, expected):
            return ValueError(f"CGSettings: invalid {name}={getattr(self, name)!r}; expected {expected}.")

        def is_int(v):
            return isinstance(v, numbers.Integral) and not isinstance(v, bool)

        def is_real(v):
            return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(float(v))

        if self.num_probes is not None and (not is_int(self.num_probes) or self.num_probes < 1):
            raise bad("num_probes", "None or an int >= 1")

        for name, low in (
            ("max_cg_iterations", 1),
            ("preconditioner_rank", 0),
            ("rebuild_every", 1),
            ("predict_max_cg_iterations", 1),
            ("predict_preconditioner_rank", 0),
        ):
            if not is_int(getattr(self, name)) or getattr(self, name) < low:
                raise bad(name, f"an int >= {low}")
        for name in ("cg_tolerance", "rebuild_lengthscale_change", "predict_cg_tolerance"):
            if not is_real(getattr(self, name)) or getattr(self, name) <= 0:
                raise bad(name, "a positive float")
        if not is_int(self.pivot_block) or not 1 <= self.pivot_block <= 32:
            raise bad("pivot_block", "an int from 1 to 32 (the pivot kernel takes at most 64 candidates)")
        if self.preconditioner_storage not in STORAGES:
            raise bad("preconditioner_storage", f"one of {STORAGES}")
        for name in ("rescale_change", "rebuild_cost_share"):
            if not is_real(getattr(self, name)) or getattr(self, name) < 0:
                raise bad(name, "a float >= 0")
        if self.resample_every is not None and (not is_int(self.resample_every) or self.resample_every < 1):
            raise bad("resample_every", "None or an int >= 1")
        for name in ("warm_start", "cuda_graph", "cuda_graph_reuse"):
            if getattr(self, name) not in (True, False):
                raise bad(name, "True or False")
        if self.product not in PRODUCTS:
            raise bad("product", f"one of {PRODUCTS}")
        if self.backward not in BACKWARDS:
            raise bad("backward", f"one of {BACKWARDS}")
        if not is_real(self.memory_fraction) or not 0 < self.memory_fraction <= 1:
            raise bad("memory_fraction", "a float in (0, 1]")
        if self.trainer not in TRAINERS:
            raise bad("trainer", f"one of {TRAINERS}")
        if self.cg_check_every is not None and (not is_int(self.cg_check_every) or self.cg_check_every < 1):
            raise bad("cg_check_every", "None or an int >= 1")
        for name, low in (("max_preconditioner_rank", 0), ("cg_iteration_limit", 1)):
            if not is_int(getattr(self, name)) or getattr(self, name) < low:
                raise bad(name, f"an int >= {low}")
