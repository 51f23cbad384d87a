"""Several independent GPs on the same inputs, trained together by gpfast's engine: one GP per output, each with
its own hyperparameters, products, preconditioner, probes and warm starts.

:class:`BatchedEngine` keeps one :class:`~gpfast.train.engine.Engine` per output and hands out one objective per
output; the caller's optimisers step them together and drop an output from the batch when its own stopping test
is met. Each output's probes come from a random stream of its own, forked from the generators' state when the
batch starts, so that output ``j`` draws exactly what a single fit of ``j`` alone would draw from the same seed:
its fit is the single fit, step for step, whatever the others do and whenever they stop.

Why one engine per output rather than one solve of the batch: every step of an output is a function of that
output's own state (its preconditioner's rank and rebuilds, its CG cap, the convergence checks placed by its last
count, the probes it redraws), and the engine's accuracy rule changes that state from the output's own residuals.
Sharing a solve would couple those rules across outputs and make an output's fit depend on the batch it was fitted
in; keeping them apart is what makes each output equal its own single fit.
"""

from __future__ import annotations

import torch

from gpfast.train.engine import Engine, EngineRecord
from gpfast.train.state import generator_state, set_generator_state
from gpfast.train.settings import CGSettings

__all__ = ["BatchedEngine"]


class BatchedEngine:
    """One :class:`~gpfast.train.engine.Engine` per output (module docstring).

    Parameters
    ----------
    n_outputs : int
        k, the number of GPs.
    settings : CGSettings or None, default=None
        The settings of every output's engine (None: the defaults).
    free_memory : int or None, default=None
        Bytes free on the device for each output's stored covariance (the caller divides the device's free memory
        among the outputs that train at once); required unless ``settings.product`` is explicit.
    """

    def __init__(self, n_outputs: int, settings: CGSettings | None = None, free_memory: int | None = None):
        if n_outputs < 1:
            raise ValueError(f"BatchedEngine: n_outputs must be at least 1, got {n_outputs}")
        self.engines = [Engine(settings, free_memory) for _ in range(n_outputs)]
        self.records: list[EngineRecord | None] = [None] * n_outputs
        self._streams: list[dict] | None = None
        self._device: torch.device | None = None

    def objectives(self, models: list) -> list:
        """The k objectives, one per model (a :class:`gpfast.models.ExactGPModel` on the shared inputs with its
        output's targets (n,)), each a closure as :meth:`Engine.objective` returns. Every output's random stream
        starts at the generators' state of this call."""
        if len(models) != len(self.engines):
            raise ValueError(f"BatchedEngine: expected {len(self.engines)} models, one per output, got {len(models)}")
        self._device = models[0].train_inputs[0].device
        start = generator_state(self._device)
        self._streams = [start for _ in models]
        return [self._in_own_stream(j, engine.objective(m)) for j, (engine, m) in enumerate(zip(self.engines, models))]

    def _in_own_stream(self, j: int, closure):
        devices = [self._device] if self._device.type == "cuda" else []

        def own(fn):
            def in_stream(*args):
                with torch.random.fork_rng(devices=devices):
                    set_generator_state(self._streams[j], self._device)
                    out = fn(*args)
                    self._streams[j] = generator_state(self._device)
                return out

            return in_stream

        step = own(closure)
        step.postfix, step.natural = closure.postfix, own(closure.natural)
        return step

    def finish_output(self, j: int, steps: int | None = None) -> EngineRecord:
        """End output j's run when it leaves the batch (:meth:`Engine.finish`, with the optimiser's step limit
        ``steps``: release its stored K at once, so that the outputs still training have the memory, and warn when
        its last step's solve missed and put the fit at risk); returns its record."""
        if self.records[j] is None:
            self.records[j] = self.engines[j].finish(steps)
        return self.records[j]

    def finish(self, steps: int | None = None) -> list[EngineRecord]:
        """End the run of every output still in the batch (:meth:`finish_output`) and return the k records."""
        return [self.finish_output(j, steps) for j in range(len(self.engines))]
