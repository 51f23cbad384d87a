"""What a new user meets first in the Python API: errors that name the argument, the value and what is expected,
and messages that say what the fit does (fast, CPU)."""

import re

import numpy as np
import pytest

from gpfast import ExactGP


def _data(n=20, d=2, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.uniform(-2, 2, (n, d))
    return X, np.sin(X[:, 0]) + 0.1 * rng.standard_normal(n)


@pytest.mark.parametrize("n_restarts", [10**6, 1001])
def test_n_restarts_is_bounded(n_restarts):
    X, y = _data()
    with pytest.raises(ValueError, match=rf"invalid n_restarts={n_restarts}; expected an int >= 0 and at most 1000"):
        ExactGP(n_restarts=n_restarts, device="cpu").fit(X, y)


def test_verbose_names_the_dtype_it_trains_in(capsys):
    X, y = _data()
    ExactGP(solver="cholesky", dtype="float32", max_iter=2, verbose=True, device="cpu").fit(X, y)
    err = capsys.readouterr().err
    # the exact objective trains in float64 whatever dtype says; the model is then kept in float32
    assert "training with lbfgs on cholesky (exact) in float64" in err and "model dtype=float32" in err, err
    assert "torch.float32" not in err, err


@pytest.mark.parametrize(
    "X, y, expected",
    [
        (
            np.array([[1.0, "a"], [2.0, "b"], [3.0, "c"]], dtype=object),
            [1.0, 2.0, 3.0],
            "ExactGP: X holds 'a' at row 0, column 1, which is not a number",
        ),
        ([[1.0, 2.0], [2.0, "n/a"], [3.0, 0.5]], [1.0, 2.0, 3.0], "X holds 'n/a' at row 1, column 1"),
        ([[1.0, 2.0], [2.0, 1.0], [3.0, 0.5]], [1.0, "two", 3.0], "ExactGP: y holds 'two' at row 1, which is not"),
    ],
)
def test_a_column_of_strings_is_named(X, y, expected):
    with pytest.raises(ValueError, match=re.escape(expected)) as info:
        ExactGP(device="cpu").fit(X, y)
    assert "could not convert" not in str(info.value)


def test_small_cpu_fits_run_on_one_thread_and_restore_the_count(monkeypatch):
    import torch

    from gpfast.estimator import fitting

    seen = []
    real = fitting.best_of_restarts

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(fitting, "best_of_restarts", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rng = np.random.default_rng(0)
        X = rng.normal(size=(40, 2))
        ExactGP(max_iter=2, device="cpu").fit(X, X[:, 0])
        assert seen == [1] and torch.get_num_threads() == 2
        monkeypatch.setattr(fitting, "ONE_THREAD_MAX_N", 10)
        ExactGP(max_iter=2, device="cpu").fit(X, X[:, 0])
        assert seen == [1, 2]
    finally:
        torch.set_num_threads(before)
