"""Tests of gpfast.train.batched.BatchedEngine (CPU): each output's objective takes the steps of its own engine
alone, whatever the other outputs do between its steps, and an output that leaves the batch is finished at once."""

from __future__ import annotations

import gpytorch
import numpy as np
import pytest
import torch

from gpfast.models import ExactGPModel
from gpfast.train import Engine
from gpfast.train.batched import BatchedEngine
from gpfast.train.settings import CGSettings

F64 = torch.float64
# few probes and a loose tolerance: the tests compare runs with each other, not with the exact likelihood
SETTINGS = dict(product="stored", num_probes=4, cg_tolerance=1e-4)


def _models(seed: int, k: int, n: int = 150, d: int = 2):
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=gen, dtype=F64)
    models = []
    for j in range(k):
        y = torch.sin((j + 1) * X[:, 0]) + 0.1 * torch.randn(n, generator=gen, dtype=F64)
        model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood()).to(F64)
        model.likelihood.noise = 0.1 * (j + 1)
        models.append(model)
    return models


def _losses_and_grads(closure, model, steps):
    out = []
    for _ in range(steps):
        loss = closure()
        out.append([float(loss)] + [float(p.grad.sum()) for p in model.parameters() if p.grad is not None])
        with torch.no_grad():  # a fixed move between steps, the same in every run
            model.covar_module.raw_outputscale.sub_(0.05)
    return np.array(out)


def test_each_output_takes_its_single_engines_steps():
    """Output j's closure, stepped between other outputs' steps (which draw probes from torch's generator),
    gives the losses and gradients of an Engine on model j alone from the same generator state."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    steps = 4
    torch.manual_seed(seed)
    batch = BatchedEngine(3, CGSettings(**SETTINGS, resample_every=2))
    models = _models(seed, 3)
    closures = batch.objectives(models)
    batched = [[] for _ in models]
    for _ in range(steps):  # interleaved, output 1 twice per round, so the streams would mix if shared
        for j in (0, 1, 1, 2):
            batched[j].append(_losses_and_grads(closures[j], models[j], 1)[0])
    records = batch.finish()
    for j in range(3):
        torch.manual_seed(seed)
        alone = _models(seed, 3)[j]
        engine = Engine(CGSettings(**SETTINGS, resample_every=2))
        expected = _losses_and_grads(engine.objective(alone), alone, len(batched[j]))
        engine.finish()
        np.testing.assert_allclose(np.array(batched[j]), expected, rtol=1e-12, atol=0, err_msg=f"output {j}, {seed}")
        assert len(records[j].cg_iterations) == len(batched[j])


def test_an_output_that_leaves_the_batch_is_finished_at_once():
    """finish_output releases that output's stored covariance while the others keep theirs, and finish returns
    the same record for it."""
    batch = BatchedEngine(2, CGSettings(**SETTINGS))
    models = _models(0, 2)
    closures = batch.objectives(models)
    for c in closures:
        c()
    first = batch.finish_output(0)
    assert batch.engines[0].product.K is None and batch.engines[1].product.K is not None
    closures[1]()
    records = batch.finish()
    assert records[0] is first and len(records[1].cg_iterations) == 2


def test_one_model_per_output_is_required():
    with pytest.raises(ValueError, match="expected 2 models, one per output, got 1"):
        BatchedEngine(2, CGSettings(**SETTINGS)).objectives(_models(0, 1))
    with pytest.raises(ValueError, match="n_outputs must be at least 1, got 0"):
        BatchedEngine(0)
