"""The preconditioner's blocked pivoted Cholesky: the op that takes a block's pivots (``_pivot_block``, CPU and
CUDA) and the factor built from it, against the greedy rule applied one pivot at a time."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICES, poison_allocator, rel_err
from gpfast import _reference as ref
from gpfast.train.preconditioner import gram, pivoted_cholesky

F64 = torch.float64


def _greedy_reference(K: torch.Tensor, rank: int, rel_floor: float = 1e-8, block: int = 16) -> torch.Tensor:
    """The blocked greedy rule step by step on a dense K: each block's candidates are the 2 * block largest
    remaining diagonals (the smaller index first among equals), each pivot the candidate with the largest remaining
    diagonal (first on ties), its column the residual row over the square root of that diagonal (zero below the
    floor)."""
    n = K.shape[0]
    L = torch.zeros(n, rank, dtype=F64)
    d = K.diagonal().clone()
    floor = rel_floor * float(d.max())
    m = 0
    while m < rank:
        b = min(block, rank - m)
        cand = torch.sort(d, descending=True, stable=True).indices[: min(2 * b, n)]  # the smaller index on ties
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
    kernel rows and the GEMMs round differently, and a near tie among the remaining diagonals can then take
    another pivot (every diagonal equals the outputscale at the first block), so there the factor must be as good,
    not the same: its trace error
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


def _candidates(c, rank, seed, device, extra=7):
    """Residual rows (c, n) whose candidate columns hold an SPD S of the given rank, the candidates' columns
    (scattered among n = c + extra columns) and a diagonal (n,) that agrees with S on them."""
    gen = torch.Generator().manual_seed(seed)
    A = torch.randn(c, rank, generator=gen, dtype=F64)
    S = A @ A.t()
    n = c + extra
    cand = torch.randperm(n, generator=gen)[:c]
    rows = torch.randn(c, n, generator=gen, dtype=F64)
    rows[:, cand] = S
    d = torch.rand(n, generator=gen, dtype=F64)
    d[cand] = S.diagonal()
    return rows.to(device), cand.to(device), d.to(device), S


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("c, b, rank", [(32, 16, 32), (64, 32, 64), (10, 10, 4), (1, 1, 1), (33, 16, 5)])
def test_pivot_block_op(device, c, b, rank):
    """The pivots factor the candidates' S on their span: G G^T = S[piv, piv] for the pivots above the floor;
    those below it (S of rank 4 gives 4 pivots, then zero columns) have a unit row in G and a zero row and column
    in G^{-1}; G^{-1} inverts G elsewhere. The CUDA kernel takes the CPU's steps bit for bit (both by fused
    multiply-adds in the same order)."""
    rows, cand, d, S = _candidates(c, rank, seed=c + b, device=device)
    floor = torch.tensor(1e-10, dtype=F64, device=device)
    piv, G, G_inv = torch.ops.gpfast._pivot_block(rows, cand, d, floor, b)
    assert piv.shape == (b,) and G.shape == (b, b) and G_inv.shape == (b, b)
    assert len(set(piv.tolist())) == b  # no candidate twice
    piv, G, G_inv = piv.cpu(), G.cpu(), G_inv.cpu()
    ok = G_inv.diagonal() != 0
    assert int(ok.sum()) == min(b, rank)
    assert torch.equal(G, G.tril()) and torch.equal(G_inv, G_inv.tril())
    assert torch.equal(G[~ok], torch.eye(b, dtype=F64)[~ok])
    assert not bool(G_inv[~ok].any()) and not bool(G_inv[:, ~ok].any())
    taken = piv[ok]
    Sp = S.index_select(0, taken).index_select(1, taken)
    Gk = G[ok][:, ok]
    assert rel_err(Gk @ Gk.t(), Sp) < 1e-12
    eye = torch.eye(b, dtype=F64)
    assert float((G_inv @ G - eye)[ok][:, ok].abs().max()) < 1e-10 * float(torch.linalg.cond(Gk))
    # the greedy rule: the first pivot is the candidate with the largest diagonal
    assert int(piv[0]) == int(torch.argmax(S.diagonal()))
    if device == "cuda":
        cpu = torch.ops.gpfast._pivot_block(rows.cpu(), cand.cpu(), d.cpu(), floor.cpu(), b)
        assert torch.equal(cpu[0], piv) and torch.equal(cpu[1], G) and torch.equal(cpu[2], G_inv)


def _select_reference(d, Lb, drop, c):
    """The selection's rule in torch: the update (summed in another order, so to rounding) and the c largest by
    a stable descending sort (the smaller index first among equals)."""
    new = (d - (Lb * Lb).sum(0)).clamp_min(0.0)
    new[drop] = 0.0
    return new, torch.sort(new, descending=True, stable=True).indices[:c]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "n, r, c", [(1, 0, 1), (40, 0, 32), (100, 16, 32), (5000, 32, 64), (70_001, 16, 33), (3000, 50, 40)]
)
@pytest.mark.parametrize("ties", [False, True])
def test_pivot_select_op(device, n, r, c, ties):
    """d is updated in place to max(d - sum Lb^2, 0) with the previous block's pivots zeroed, and the candidates
    are the c largest of the updated d, the smaller index first among equals (rounded diagonals make many ties;
    70,001 points take many thread blocks and the last block's merge on a GPU; r = 50 rows of Lb take the GPU's
    update two chunks of 32). The CUDA op gives the CPU op's
    bits: the same update by fused multiply-adds in the same order, and one total order."""
    gen = torch.Generator().manual_seed(n + r + c + ties)
    d = torch.rand(n, generator=gen, dtype=F64) + 0.5
    if ties:
        d = d.round(decimals=1)
    Lb = torch.randn(r, n, generator=gen, dtype=F64) * 0.2
    cand = torch.randperm(n, generator=gen)[:c]
    piv = torch.randperm(c, generator=gen)[: min(r, c)]
    want_d, want = _select_reference(d, Lb, cand[piv], c)
    got_d = d.to(device)
    got = torch.ops.gpfast._pivot_select(got_d, Lb.to(device), cand.to(device), piv.to(device), c)
    assert rel_err(got_d.cpu(), want_d) < 1e-14 and bool((got_d >= 0).all())
    assert torch.equal(got.cpu(), torch.sort(got_d.cpu(), descending=True, stable=True).indices[:c])
    if r == 0 or ties:  # the reference's own rounding is exact here (no sums, or ties kept apart by 0.1)
        assert torch.equal(got.cpu(), want)
    if device == "cuda":
        cpu_d = d.clone()
        cpu = torch.ops.gpfast._pivot_select(cpu_d, Lb, cand, piv, c)
        assert torch.equal(cpu_d, got_d.cpu()) and torch.equal(cpu, got.cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_pivot_select_op_clamps_the_first_blocks_diagonal(device):
    """With no previous block (r = 0, no pivots) the op still clamps d to max(d, 0), a NaN to 0, so a negative or
    NaN diagonal entry is never a candidate ahead of a positive one; the CUDA op gives the CPU op's bits."""
    d = torch.tensor([0.5, -1.0, float("nan"), 2.0, 0.0, 1.5], dtype=F64)
    no = torch.empty(0, dtype=torch.long)
    got_d = d.to(device)
    got = torch.ops.gpfast._pivot_select(got_d, torch.empty(0, 6, dtype=F64, device=device), no.to(device),
                                         no.to(device), 4)  # fmt: skip
    assert torch.equal(got_d.cpu(), torch.tensor([0.5, 0.0, 0.0, 2.0, 0.0, 1.5], dtype=F64))
    assert got.tolist() == [3, 5, 0, 1]  # then the zeros by index
    if device == "cuda":
        cpu_d = d.clone()
        assert torch.equal(torch.ops.gpfast._pivot_select(cpu_d, torch.empty(0, 6, dtype=F64), no, no, 4), got.cpu())


def _block_args():
    rows, cand, d, _ = _candidates(6, 6, seed=1, device="cpu")
    return rows, cand, d, torch.tensor(0.0, dtype=F64)


@pytest.mark.parametrize(
    "change, match",
    [
        (
            lambda a: (torch.zeros(65, 70, dtype=F64), torch.arange(65), torch.ones(70, dtype=F64), a[3], 3),
            "candidates c = rows.size\\(0\\) must be in \\[1, 64\\], got 65",
        ),
        (lambda a: (*a, 7), "pivots b must be in \\[1, min\\(c=6, 32\\)\\], got 7"),
        (lambda a: (a[0].float(), *a[1:], 2), "rows must be float64, got Float"),
        (lambda a: (a[0], a[1], a[2][:-1], a[3], 2), "d must be \\(n,\\) = \\(13,\\), got \\[12\\]"),
        (lambda a: (a[0], a[1].int(), a[2], a[3], 2), "cand must be a 1-d int64 tensor, got Int"),
        (lambda a: (a[0], a[1][:-1], a[2], a[3], 2), "cand must be \\(c,\\) = \\(6,\\)"),
        (lambda a: (a[0], a[1] + 13, a[2], a[3], 2), "cand must index the n=13 columns"),
    ],
)
def test_pivot_block_op_checks_its_arguments(change, match):
    with pytest.raises(RuntimeError, match=match):
        torch.ops.gpfast._pivot_block(*change(_block_args()))


def _select_args(n=20):
    return torch.rand(n, dtype=F64), torch.zeros(2, n, dtype=F64), torch.arange(4), torch.tensor([0, 3])


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda d, Lb, cand, piv: (d, Lb, cand, piv, 21), "candidates c must be in \\[1, min\\(n=20, 64\\)\\], got 21"),
        (lambda d, Lb, cand, piv: (d, Lb, cand, piv, 0), "candidates c must be in"),
        (lambda d, Lb, cand, piv: (d[::2], Lb[:, ::2], cand, piv, 4), "d must be a contiguous 1-d tensor"),
        (lambda d, Lb, cand, piv: (d, Lb[:, 1:], cand, piv, 4), "Lb must be \\(r, n\\) with n = 20"),
        (lambda d, Lb, cand, piv: (d.float(), Lb, cand, piv, 4), "d must be float64, got Float"),
        (lambda d, Lb, cand, piv: (d, Lb, cand, piv.float(), 4), "piv must be a 1-d int64 tensor, got Float"),
        (lambda d, Lb, cand, piv: (d, Lb, cand, piv + 3, 4), "piv\\[1\\] must index cand.*got piv 6"),
    ],
)
def test_pivot_select_op_checks_its_arguments(change, match):
    with pytest.raises(RuntimeError, match=match):
        torch.ops.gpfast._pivot_select(*change(*_select_args()))


def test_pivot_ops_opcheck():
    rows, cand, d, _ = _candidates(12, 12, seed=3, device="cpu")
    torch.library.opcheck(torch.ops.gpfast._pivot_block.default, (rows, cand, d, torch.tensor(1e-10, dtype=F64), 6))
    d, Lb, cand, piv = _select_args()
    torch.library.opcheck(torch.ops.gpfast._pivot_select.default, (d, Lb, cand, piv, 5))


def _select_network(keys):
    """The CUDA selection's network (cuda/pivot_block.cuh, select_best) on 2048 (value, index) keys, step for step:
    each warp's 256 slots sorted in bitonic runs of 64 and merged into one run, then the eight runs merged."""

    def better(x, y):
        return x[0] > y[0] or (x[0] == y[0] and x[1] < y[1])

    def exchange(a, b, desc):
        if better(keys[b], keys[a]) if desc else better(keys[a], keys[b]):
            keys[a], keys[b] = keys[b], keys[a]

    def merge_level(base, level, size):
        span = 64 << level
        for u in range(size // (2 * span) * 64):
            a, b = base + (u >> 6) * 2 * span + (u & 63), base + (u >> 6) * 2 * span + span + 63 - (u & 63)
            if better(keys[b], keys[a]):
                keys[a] = keys[b]
        for j in (32, 16, 8, 4, 2, 1):
            for u in range(size // (2 * span) * 32):
                t = u & 31
                a = base + (u >> 5) * 2 * span + 2 * (t & ~(j - 1)) + (t & (j - 1))
                exchange(a, a + j, True)

    for base in range(0, 2048, 256):
        for k in (2, 4, 8, 16, 32, 64):
            j = k >> 1
            while j:
                for t in range(128):
                    a = base + 2 * (t & ~(j - 1)) + (t & (j - 1))
                    exchange(a, a + j, k == 64 or (a & k) == 0)
                j >>= 1
        merge_level(base, 0, 256)
        merge_level(base, 1, 256)
    for level in (2, 3, 4):
        merge_level(0, level, 2048)
    return keys[:64]


@pytest.mark.parametrize("real, decimals", [(2048, 1), (2048, 9), (100, 3), (64, 2), (1, 9)])
def test_selection_network_keeps_the_best_64_in_order(real, decimals):
    """The index arithmetic of the CUDA selection's network: the best 64 of 2048 keys, best first, the smaller index
    first among equal values, with empty slots (-inf, INT_MAX) where a round has fewer points."""
    gen = torch.Generator().manual_seed(real + decimals)
    values = torch.rand(real, generator=gen, dtype=F64).round(decimals=decimals).tolist()
    keys = [(v, i) for i, v in enumerate(values)] + [(float("-inf"), 2**31 - 1)] * (2048 - real)
    order = torch.randperm(2048, generator=gen).tolist()
    got = _select_network([keys[i] for i in order])
    assert got == sorted(keys, key=lambda k: (-k[0], k[1]))[:64]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "n, k, blocks", [(300, 257, 4), (50, 640, 4), (200, 512, 8), (100, 300, 3), (40, 63, 4), (9, 0, 4)]
)
def test_gram_by_blocks_is_the_whole_product(device, n, k, blocks):
    """L^T L from the upper triangle's blocks: on small integers (every product and sum exact in float64) equal to
    the exact gram element for element, so that a block written wrong or not at all shows; on fresh normal draws
    within the GEMM error bound n eps |L|^T |L| of the float64 product; exactly symmetric in both."""
    L_int = torch.randint(-8, 9, (n, k), dtype=F64).to(device)
    exact = (L_int.t().cpu().to(torch.int64) @ L_int.cpu().to(torch.int64)).to(F64)
    poison_allocator(device, 8 * k * k)
    G = gram(L_int, blocks).cpu()
    assert torch.equal(G, exact)
    L = torch.randn(n, k, dtype=F64).to(device)
    G = gram(L, blocks)
    assert torch.equal(G, G.t())
    bound = n * torch.finfo(F64).eps * (L.abs().t() @ L.abs())
    assert bool(((G - L.t() @ L).abs() <= bound).all())


def test_gram_uses_blocks_from_its_rank_on(monkeypatch):
    """By default one GEMM below GRAM_BLOCKS_FROM (bit for bit L^T L) and GRAM_BLOCKS row blocks from it on (one
    torch.mm a block, exact on small integers); an L that requires grad gets the one GEMM and its gradient."""
    import gpfast.train.preconditioner as pre

    monkeypatch.setattr(pre, "GRAM_BLOCKS_FROM", 256)
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda *a, **k: calls.append(1) or real_mm(*a, **k))
    L = torch.randn(100, 255, dtype=F64)
    assert torch.equal(pre.gram(L), L.t() @ L) and not calls
    L_int = torch.randint(-8, 9, (100, 256), dtype=F64)
    exact = (L_int.t().to(torch.int64) @ L_int.to(torch.int64)).to(F64)
    assert torch.equal(pre.gram(L_int), exact) and len(calls) == pre.GRAM_BLOCKS
    L_grad = L_int.clone().requires_grad_()  # autograd gets the one GEMM, which it can follow
    pre.gram(L_grad).sum().backward()
    assert len(calls) == pre.GRAM_BLOCKS and torch.equal(L_grad.grad, 2 * L_int @ torch.ones(256, 256, dtype=F64))
