"""The matrix-free symmetric K(x, x) @ V kernel's index arithmetic (csrc/cuda/matmul_symmetric.cuh), emulated lane
by lane on the CPU (experiments/kv_symmetric_emulation.py), against K @ V in float64 on fresh random inputs: the
emulation's arithmetic is exact, so anything beyond float64's rounding is an indexing error. The kernel itself runs
in tests/test_cuda_kernels.py on a GPU."""

import numpy as np
import pytest

from experiments.kv_symmetric_emulation import emulate, super_pair


def dense(x, ls, s, V):
    K = s * np.exp(-0.5 * (((x[:, None, :] - x[None, :, :]) / ls) ** 2).sum(-1))
    return K @ V, np.abs(K).sum(1).max() * np.abs(V).max()


# (n, d, t, S): several super-tiles with n ragged against them, the bands and the 64-column tiles; one super-tile;
# one point; a last band of one row; t = 1 and 11 (right-hand sides past t are zero in the fragments)
CASES = [(700, 5, 16, 256), (1100, 8, 11, 512), (129, 3, 1, 256), (1, 2, 4, 256), (300, 8, 16, 1024)]


@pytest.mark.parametrize("n, d, t, S", CASES)
def test_emulation_matches_dense_product(n, d, t, S):
    rng = np.random.default_rng()
    x = rng.standard_normal((n, d)) * 1.5 + 3.0  # off the origin: the kernel centres the points
    ls = rng.uniform(0.5, 2.0, d)
    V = rng.standard_normal((n, t))
    got, steps = emulate(x, ls, 1.3, V, S)
    want, scale = dense(x, ls, 1.3, V)
    # exact arithmetic: float64's rounding over at most n terms a sum
    assert np.abs(got - want).max() <= 1e-13 * scale
    if n > 2 * 128:
        assert steps["both"] > 0 and steps["rows"] > 0


def test_super_tile_pairs_cover_the_upper_triangle_once_diagonal_last():
    for supers in (1, 2, 7, 40):
        pairs = [super_pair(k, supers) for k in range(supers * (supers + 1) // 2)]
        assert sorted(pairs) == [(a, c) for a in range(supers) for c in range(a, supers)]
        assert all(a == c for a, c in pairs[-supers:])
