"""The preconditioner's blocked pivoted Cholesky: the op that takes a block's pivots (``_pivot_block``, CPU and
CUDA) and the factor built from it, against the greedy rule applied one pivot at a time."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICES, rel_err
from gpfast import _reference as ref
from gpfast.train.preconditioner import pivoted_cholesky

F64 = torch.float64


def _greedy_reference(K: torch.Tensor, rank: int, rel_floor: float = 1e-8, block: int = 16) -> torch.Tensor:
    """The blocked greedy rule step by step on a dense K: each block's candidates are the 2 * block largest
    remaining diagonals, each pivot the candidate with the largest remaining diagonal (first on ties), its column
    the residual row over the square root of that diagonal (zero below the floor)."""
    n = K.shape[0]
    L = torch.zeros(n, rank, dtype=F64)
    d = K.diagonal().clone()
    floor = rel_floor * float(d.max())
    m = 0
    while m < rank:
        b = min(block, rank - m)
        cand = torch.topk(d, min(2 * b, n)).indices
        for _ in range(b):
            i = int(cand[int(torch.argmax(d[cand]))])
            row = K[i] - L[:, :m] @ L[i, :m]
            col = row / d[i].sqrt() if d[i] > floor else torch.zeros(n, dtype=F64)
            L[:, m] = col
            d = (d - col * col).clamp_min(0.0)
            d[i] = 0.0
            m += 1
    return L


def _kernel_problem(n, d, lengthscale, device, seed):
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=gen, dtype=F64).to(device)
    ls, s = torch.full((d,), lengthscale, dtype=F64, device=device), torch.tensor(1.3, dtype=F64, device=device)

    def rows(index):
        return ref.rbf_covariance(X.index_select(0, index), X, ls, s)

    return rows, ref.rbf_covariance(X, X, ls, s).cpu(), torch.full((n,), 1.3, dtype=F64, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n, d, lengthscale, rank", [(500, 3, 0.8, 100), (300, 2, 3.0, 200), (257, 6, 1.5, 37)])
def test_blocked_build_follows_the_greedy_rule(device, n, d, lengthscale, rank):
    """On the CPU, the same pivots and columns as the step-by-step rule, also where K's numerical rank (smooth, 2
    features, lengthscale 3) runs out before the requested rank and the remaining columns are zero. On a GPU the
    order of torch.topk among equal diagonals differs from the CPU's (every diagonal equals the outputscale at the
    first block, so the first pivot is a tie), so there the factor must be as good, not the same: its trace error
    tr(K - L L^T) within 20% of the rule's (or both at rounding level), and K - L L^T >= 0. Bound from the worst of
    150 random orders of the points on the CPU with the default 16 pivots a block: 1.109 at (500, 3), 1.112 at
    (257, 6), 0 at rounding level at (300, 2)."""
    rows, K, diag = _kernel_problem(n, d, lengthscale, device, seed=n + d)
    got = pivoted_cholesky(rows, diag, rank).cpu()
    want = _greedy_reference(K, rank)
    if device == "cpu":
        assert rel_err(got, want) < 1e-8
    else:
        trace_got, trace_want = (float((K - L @ L.t()).diagonal().sum()) for L in (got, want))
        assert trace_got <= 1.2 * trace_want + 1e-8 * n, (trace_got, trace_want)
    assert float(torch.linalg.eigvalsh(K - got @ got.t()).min()) > -1e-9  # an exact partial Cholesky


def _spd(c, rank, seed, device):
    gen = torch.Generator().manual_seed(seed)
    A = torch.randn(c, rank, generator=gen, dtype=F64)
    S = A @ A.t()
    return S.to(device), S.diagonal().clone().to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("c, b, rank", [(32, 16, 32), (64, 32, 64), (10, 10, 4), (1, 1, 1)])
def test_pivot_block_op(device, c, b, rank):
    S, d = _spd(c, rank, seed=c + b, device=device)
    floor = torch.tensor(1e-10, dtype=F64, device=device)
    piv, C, ok = torch.ops.gpfast._pivot_block(S, d, floor, b)
    assert piv.shape == (b,) and C.shape == (c, b) and ok.shape == (b,)
    assert len(set(piv.tolist())) == b  # no candidate twice
    assert int(ok.sum()) == min(b, rank)  # S of rank 4 gives 4 pivots above the floor, then zero columns
    good = ok.bool()
    assert not bool(C[:, ~good].any())
    # the taken columns factor S on their pivots' span: S - C C^T is zero on the pivots' rows and columns
    resid = S - C @ C.t()
    taken = piv[good]
    assert float(resid.index_select(0, taken).abs().max()) < 1e-10 * float(S.abs().max())
    if device == "cuda":  # the kernel takes the CPU's steps while S has rank left; after that (ok = 0) the
        # remaining diagonals are rounding noise, whose order the GPU's fused multiply-adds may change
        cpu = torch.ops.gpfast._pivot_block(S.cpu(), d.cpu(), floor.cpu(), b)
        keep = good.cpu()
        assert torch.equal(cpu[2], ok.cpu()) and torch.equal(cpu[0][keep], piv.cpu()[keep])
        assert rel_err(cpu[1][:, keep], C.cpu()[:, keep]) < 1e-12


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.eye(65, dtype=F64), torch.ones(65, dtype=F64), torch.tensor(0.0, dtype=F64), 3), "candidates c"),
        ((torch.eye(4, dtype=F64), torch.ones(4, dtype=F64), torch.tensor(0.0, dtype=F64), 5), "pivots b"),
        ((torch.eye(4), torch.ones(4), torch.tensor(0.0), 2), "float64"),
        ((torch.eye(4, dtype=F64), torch.ones(3, dtype=F64), torch.tensor(0.0, dtype=F64), 2), "d must be"),
    ],
)
def test_pivot_block_op_checks_its_arguments(args, match):
    with pytest.raises(RuntimeError, match=match):
        torch.ops.gpfast._pivot_block(*args)


def test_pivot_block_opcheck():
    S, d = _spd(12, 12, seed=3, device="cpu")
    torch.library.opcheck(torch.ops.gpfast._pivot_block.default, (S, d, torch.tensor(1e-10, dtype=F64), 6))
