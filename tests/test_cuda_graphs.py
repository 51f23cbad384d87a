"""CUDA-graph replays of CG iterations give the arithmetic of the op-by-op runs. On the CPU a stand-in whose
"replay" calls the captured function again checks the control flow around the captures (which iterations run op by
op, which replay, what the results hold); on a GPU the real graphs are compared with op-by-op runs."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import HAS_CUDA, rel_err
from gpfast import ExactGP
from gpfast import _reference as ref
from gpfast.train import CGSettings
from gpfast.train.cg import CUDAGraphs, KeptIteration, pcg
from gpfast.train.state import _State
from gpfast.train.preconditioner import BuildGraph, Preconditioner, pivoted_cholesky
from gpfast.train.product import CovarianceProduct

F64 = torch.float64
CUDA = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="no GPU")]


class _ReplayByCall:
    """CUDAGraphs' interface on any device: capture returns an object whose replay runs the function again."""

    def __init__(self):
        self.captures = self.replays = 0

    @contextlib.contextmanager
    def stream(self):
        yield

    def capture_alone(self, fn):
        return self.capture(fn)

    def capture(self, fn):
        self.captures += 1
        owner = self

        class _Replay:
            def replay(self):
                owner.replays += 1
                fn()

        return _Replay()


def _system(device, dtype, n=300, t=5, seed=None):
    """(product, preconditioner, B): K̂ = K + noise I of an RBF kernel at high signal-to-noise (CG needs tens of
    iterations), its rank-20 pivoted-Cholesky preconditioner and right-hand sides."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())) if seed is None else seed)
    X = torch.randn(n, 3, generator=gen, dtype=F64).to(device=device, dtype=dtype)
    kw = dict(device=device, dtype=dtype)
    ls, s, noise = torch.tensor([0.7, 1.1, 0.9], **kw), torch.tensor(1.5, **kw), torch.tensor(1e-3, **kw)
    prod = CovarianceProduct(X, "stored")
    prod.update(ls, s, noise)
    L = pivoted_cholesky(prod.kernel_rows, torch.full((n,), 1.5, dtype=F64, device=device), 20)
    pc = Preconditioner(L, s, dtype)
    pc.set_scales(s, noise)
    B = torch.randn(n, t, generator=gen, dtype=F64).to(**kw)
    return prod, pc, B


def _same_solve(a, b, tol):
    assert a.iterations == b.iterations and a.products == b.products
    for x, y in ((a.x, b.x), (a.residual, b.residual), (a.rel_residual, b.rel_residual)):
        assert rel_err(x, y) <= tol
    assert rel_err(torch.stack(a.alphas), torch.stack(b.alphas)) <= tol
    assert rel_err(torch.stack(a.betas), torch.stack(b.betas)) <= tol
    assert torch.equal(a.broke_down, b.broke_down)


@pytest.mark.parametrize("checks", [None, [5, 9], []])
def test_replayed_pcg_matches_op_by_op(checks):
    prod, pc, B = _system("cpu", F64)
    x0 = torch.randn_like(B)
    plain = pcg(prod.matmul, B, pc.solve, x0, None, 1e-6, 40, check_at=checks)
    fake = _ReplayByCall()
    replayed = pcg(prod.matmul, B, pc.solve, x0, None, 1e-6, 40, check_at=checks, graph=fake)
    _same_solve(plain, replayed, 0.0)  # the same operations in the same order
    assert replayed.graphed and not plain.graphed
    assert fake.captures == 1 and fake.replays == replayed.iterations - 1  # the first iteration runs op by op
    assert float(replayed.betas[-1].abs().max()) == 0.0  # the Lanczos matrix ends with the last step
    one = pcg(prod.matmul, B, pc.solve, tol=1e-6, max_iter=1, graph=_ReplayByCall())
    assert one.iterations == 1 and not one.graphed  # nothing to replay


def test_cuda_graph_setting_is_checked():
    with pytest.raises(ValueError, match="cuda_graph"):
        CGSettings(cuda_graph="yes")
    with pytest.raises(ValueError, match="cuda_graph_reuse"):
        CGSettings(cuda_graph_reuse="yes")


def _kept_solves(device, dtype, graphs):
    """Four solves of one shape through one KeptIteration, each against a plain solve of the same system: a cold
    one, a warm one from the kept solution itself (its tensors are the next solve's), one after the preconditioner
    took new scales (written into its tensors: a replay), and one after the product took new hyperparameters."""
    prod, pc, B = _system(device, dtype)
    kept = KeptIteration()
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    x0 = None
    out = []
    for i in range(4):
        if i == 2:
            pc.set_scales(torch.tensor(1.2, dtype=dtype, device=device), torch.tensor(2e-3, dtype=dtype, device=device))
        if i == 3:
            ls = torch.tensor([0.8, 1.0, 1.0], dtype=dtype, device=device)
            prod.update(
                ls, torch.tensor(1.4, dtype=dtype, device=device), torch.tensor(1.5e-3, dtype=dtype, device=device)
            )
        B = torch.randn(B.shape, generator=gen, dtype=F64).to(device=device, dtype=dtype)
        plain = pcg(prod.matmul, B, pc.solve, None if x0 is None else x0.clone(), None, 1e-6, 60, check_at=[10, 20])
        reads = prod.graph_reads() + pc.graph_reads()
        before = kept.captures
        res = pcg(prod.matmul, B, pc.solve, x0, None, 1e-6, 60, check_at=[10, 20], graph=graphs, kept=kept,
                  reads=reads)  # fmt: skip
        x0 = res.x  # the kept solution: the next solve copies its start from the tensor it overwrites
        out.append((plain, _snapshot(res), kept.captures - before))  # the next solve overwrites res's tensors
    return out


def _snapshot(res):
    """A CGResult whose tensors are copies (a kept solve's are the next one's)."""
    return replace(res, x=res.x.clone(), residual=res.residual.clone(), rel_residual=res.rel_residual.clone(),
                   alphas=[a.clone() for a in res.alphas], betas=[b.clone() for b in res.betas],
                   broke_down=res.broke_down.clone())  # fmt: skip


def test_kept_iteration_replays_while_its_reads_stay():
    """On the CPU with the stand-in graphs: each kept solve does what a plain one does, the first captures, the
    second replays from its first iteration (no capture), and so does the third after new preconditioner scales."""
    fake = _ReplayByCall()
    solves = _kept_solves("cpu", F64, fake)
    for plain, res, _ in solves:
        _same_solve(plain, res, 0.0)
        assert res.graphed
    assert [c for *_, c in solves][:3] == [1, 0, 0]
    assert fake.replays == sum(r.iterations for _, r, _ in solves) - sum(c for *_, c in solves)
    # without graphs (the CPU engine's way) the kept tensors alone, the same solves
    for plain, res, captured in _kept_solves("cpu", F64, None):
        _same_solve(plain, res, 0.0)
        assert captured == 0 and not res.graphed


@pytest.mark.parametrize("dtype, tol", [(F64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_kept_cuda_graph_matches_op_by_op(device, dtype, tol):
    """Real graphs kept across solves: a replay without capture reads the new right-hand sides and warm start, and
    a rescaled preconditioner's new values in its own tensors, and the product's new K and noise are read (captured
    again if K moved, replayed from its own noise tensor if not)."""
    graphs = CUDAGraphs(torch.device(device))
    solves = _kept_solves(device, dtype, graphs)
    for plain, res, _ in solves:
        _same_solve(plain, res, tol)
        assert res.graphed
    assert [c for *_, c in solves][:3] == [1, 0, 0]


@pytest.mark.parametrize("dtype, tol", [(F64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_cuda_graph_pcg_matches_op_by_op(device, dtype, tol):
    prod, pc, B = _system(device, dtype)
    x0 = torch.randn_like(B)
    x0[:, [1, 3, 4]] = 0  # warm starts in columns 0 and 2 only, as the solves are told
    graphs = CUDAGraphs(B.device)
    for _ in range(3):  # later solves capture into the memory pool of the earlier ones
        plain = pcg(prod.matmul, B, pc.solve, x0, [0, 2], 1e-5, 60, check_at=[10, 20, 30])
        replayed = pcg(prod.matmul, B, pc.solve, x0, [0, 2], 1e-5, 60, check_at=[10, 20, 30], graph=graphs)
        assert replayed.graphed
        _same_solve(plain, replayed, tol)
    if dtype == F64:  # the solve is right, not only repeatable: its true residual, from a dense float64 K
        A = ref.rbf_covariance(prod.x, prod.x, prod.lengthscale, prod.outputscale) + 1e-3 * torch.eye(
            B.shape[0], device=device, dtype=F64
        )
        true = (B - A @ replayed.x).norm(dim=0) / B.norm(dim=0)
        assert rel_err(true, replayed.rel_residual) < 1e-6


@pytest.mark.filterwarnings("ignore:gpfast's training engine. CG did not reach")
@pytest.mark.parametrize(
    "n, steps, extra",
    [(1500, 12, {}), (1200, 8, {"rebuild_every": 1})],  # the second rebuilds at every step: most builds replay
    ids=["default", "replayed-builds"],
)
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_cuda_graph_engine_takes_the_same_steps(device, n, steps, extra):
    """The engine with CUDA graphs (CG iterations, and the preconditioner's builds at an unchanged rank) takes the
    steps of the engine without them."""
    rng = np.random.default_rng(int(torch.randint(0, 2**31 - 1, ())))
    X = rng.normal(size=(n, 4))
    y = np.sin(2 * X[:, 0]) + 0.3 * X[:, 1] * X[:, 2] + 0.05 * rng.normal(size=n)
    fits = [
        ExactGP(solver="cg", dtype="float64", max_iter=steps, verbose=False, random_state=0, device=device,
                cg={"cuda_graph": g, "cuda_graph_reuse": reuse, "num_probes": 10, **extra}).fit(X, y)
        for g, reuse in ((False, False), (True, False), (True, True))
    ]  # fmt: skip
    for other in fits[1:]:
        assert fits[0].cg_iterations_ == other.cg_iterations_
        assert np.allclose(fits[0].history_, other.history_, rtol=1e-9, atol=0)
        assert rel_err(torch.as_tensor(fits[0].lengthscale_), torch.as_tensor(other.lengthscale_)) < 1e-8


@pytest.mark.parametrize("product", ["stored", "matrix_free"])
def test_the_engine_takes_the_same_steps_with_its_cg_tensors_kept(product):
    """On the CPU, cuda_graph_reuse keeps the solve's tensors from step to step (warm starts read from the tensors
    the next solve overwrites, rebuilds and resampled probes included): the same arithmetic, bit for bit."""
    rng = np.random.default_rng(int(torch.randint(0, 2**31 - 1, ())))
    X = rng.normal(size=(700, 3))
    y = np.sin(2 * X[:, 0]) + 0.3 * X[:, 1] * X[:, 2] + 0.05 * rng.normal(size=700)
    fits = [
        ExactGP(solver="cg", max_iter=12, tol=0, verbose=False, random_state=0,
                cg={"cuda_graph_reuse": reuse, "rebuild_every": 3, "resample_every": 5, "product": product}).fit(X, y)
        for reuse in (False, True)
    ]  # fmt: skip
    assert fits[0].cg_iterations_ == fits[1].cg_iterations_
    assert fits[0].history_ == fits[1].history_
    assert fits[0].cg_residuals_ == fits[1].cg_residuals_


def _build_problem(device, dtype, n=400, seed=None):
    """A product on fresh random points and three fresh hyperparameter draws (lengthscale (3,), outputscale)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())) if seed is None else seed)
    kw = dict(device=device, dtype=dtype)
    X = torch.randn(n, 3, generator=gen, dtype=F64).to(**kw)
    prod = CovarianceProduct(X, "stored")
    draws = [(torch.exp(torch.randn(3, generator=gen, dtype=F64) * 0.3).to(**kw),
              torch.exp(torch.randn((), generator=gen, dtype=F64) * 0.5).to(**kw)) for _ in range(3)]  # fmt: skip
    return prod, draws


def _eager(prod, ls, s, rank, dtype, block=16):
    return pivoted_cholesky(lambda i: prod.kernel_rows(i, ls, s), s.to(dtype).expand(prod.n), rank, block=block)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_build_graph_replays_the_op_by_op_build(device, dtype):
    """A build captured at one set of hyperparameters and replayed at others gives the op-by-op factor at those:
    every read of the hyperparameters goes through the graph's inputs. On the CPU the stand-in's replay runs the
    captured function again; on a GPU the replay writes the whole factor (poisoned with NaN before it)."""
    prod, draws = _build_problem(device, dtype)
    graphs = _ReplayByCall() if device == "cpu" else CUDAGraphs(torch.device(device))
    with graphs.stream():  # as the engine does: the first build op by op on the capture stream
        _eager(prod, *draws[0], 120, dtype)
    bg = BuildGraph(prod.kernel_rows, prod.n, 120, draws[0][0], draws[0][1], dtype, graphs)
    for ls, s in draws[1:] + draws[:1]:
        if bg.L is not None:
            bg.L.fill_(float("nan"))
        got = bg(ls, s)
        want = _eager(prod, ls, s, 120, dtype)
        assert got.shape == want.shape == (prod.n, 120) and got.dtype == F64
        assert bool(torch.isfinite(got).all())
        assert rel_err(got, want) == 0.0  # the same kernels in the same order: bit for bit


def test_engine_captures_the_second_build_at_a_rank_and_replays_the_later_ones():
    """The build policy with the CPU stand-in: op by op at a new rank, captured at the second build at that rank,
    replayed after; a new rank drops the graph and builds op by op again. Each factor equals the op-by-op build at
    its hyperparameters."""
    prod, draws = _build_problem("cpu", F64)
    state = _State(CGSettings(preconditioner_rank=40))
    state.graphs = fake = _ReplayByCall()
    # (rank, captures, replays, graphed) after each build
    plan = [(40, 0, 0, 0), (40, 1, 1, 1), (40, 1, 2, 1), (80, 1, 2, 0), (80, 2, 3, 1), (40, 2, 3, 0), (40, 3, 4, 1)]
    for step, (rank, captures, replays, graphed) in enumerate(plan):
        ls, s = draws[step % 3]
        prod.update(ls, s, torch.tensor(0.1, dtype=F64))
        state.rank = rank
        state.build(prod, s, F64)
        assert (fake.captures, fake.replays) == (captures, replays), step
        assert state.pc.k == rank and rel_err(state.pc.L, _eager(prod, ls, s, rank, F64, state.block)) == 0.0
        assert (state.build_graph is not None) == bool(graphed)


@pytest.mark.parametrize("block", [1, 32])
def test_engine_builds_with_the_settings_pivot_block(block):
    """CGSettings.pivot_block reaches the build, op by op and captured (the CPU stand-in), and is checked."""
    prod, draws = _build_problem("cpu", F64)
    state = _State(CGSettings(preconditioner_rank=70, pivot_block=block))
    state.graphs = _ReplayByCall()
    for ls, s in draws[:2]:  # op by op, then captured and replayed
        prod.update(ls, s, torch.tensor(0.1, dtype=F64))
        state.build(prod, s, F64)
        want = pivoted_cholesky(lambda i: prod.kernel_rows(i, ls, s), s.expand(prod.n), 70, block=block)
        assert rel_err(state.pc.L, want) == 0.0
    assert state.build_graph is not None
    for bad in (0, 33, 2.0):
        with pytest.raises(ValueError, match="pivot_block"):
            CGSettings(pivot_block=bad)
