"""Resumable fits (gpfast.estimator.checkpoint): a fit killed partway and resumed equals the
uninterrupted one bit for bit on the CPU; checkpoints of other data or settings, and damaged ones, are refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
from sklearn.base import clone

from conftest import HAS_CUDA
from gpfast import ExactGP
from gpfast.cli import main as cli_main
from gpfast.estimator import checkpoint as ckpt_module
from gpfast.estimator import file_format

ROOT = Path(__file__).resolve().parents[1]

ENGINE = dict(
    solver="cg",
    dtype="float64",
    optimizer="adam",
    tol=0,
    max_iter=12,
    n_restarts=1,
    pretrain=(60, 3),
    cg={"rebuild_every": 3, "resample_every": 4, "max_cg_iterations": 8},
)
# the preconditioner rescaled only at its rebuilds: a resume must give it the update it last had, not the current one
ENGINE_STALE = {**ENGINE, "cg": {**ENGINE["cg"], "rebuild_every": 5, "rescale_change": 50.0}}
# rebuilds asked for at every step but deferred by their cost: a resume must keep the iterations since the build
ENGINE_DEFERRED = {**ENGINE, "cg": {**ENGINE["cg"], "rebuild_every": 1, "rebuild_cost_share": 2.0}}
EXACT_LBFGS = dict(solver="cholesky", max_iter=30)
EXACT_ADAM = dict(solver="cholesky", optimizer="adam", tol=0, max_iter=10)
GPYTORCH_LBFGS = dict(solver="cg", dtype="float64", optimizer="lbfgs", cg={"trainer": "gpytorch"}, max_iter=5)
COMMON = dict(random_state=3, device="cpu")


def _data(n=150, d=3, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    y = np.sin(2 * X[:, 0]) + 0.5 * X[:, 1] * X[:, 2] + 0.1 * rng.normal(size=n)
    return X, y


def _fit(X, y, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ExactGP(**{**COMMON, **kw}).fit(X, y)


def _assert_same_fit(a: ExactGP, b: ExactGP, X) -> None:
    for name in (
        "history_",
        "pretrain_history_",
        "restart_losses_",
        "n_iter_",
        "converged_",
        "outputscale_",
        "noise_",
        "constant_mean_",
        "log_marginal_likelihood_",
        "cg_iterations_",
        "cg_residuals_",
        "history_data_fit_",
        "history_log_det_estimate_",
    ):
        assert getattr(a, name) == getattr(b, name), name
    np.testing.assert_array_equal(a.lengthscale_, b.lengthscale_)
    np.testing.assert_array_equal(a.predict(X[:20]), b.predict(X[:20]))


class _Stop(Exception):
    pass


def _interrupted(monkeypatch, path, X, y, after_writes: int, **kw) -> None:
    """Fit with a checkpoint and stop (by an exception) right after the given number of checkpoint writes."""
    write, count = ckpt_module.Checkpoint.write, [0]

    def stopping_write(self):
        write(self)
        count[0] += 1
        if count[0] == after_writes:
            raise _Stop

    monkeypatch.setattr(ckpt_module.Checkpoint, "write", stopping_write)
    with pytest.raises(_Stop):
        _fit(X, y, checkpoint=(path, 2), **kw)
    monkeypatch.setattr(ckpt_module.Checkpoint, "write", write)
    assert Path(path).exists()


# ------------------------------------------------------------------------------------------------------------
# a killed fit resumes to the uninterrupted one
# ------------------------------------------------------------------------------------------------------------

_CHILD = """
import sys, time, warnings
import numpy as np
from gpfast import ExactGP
from gpfast.estimator import checkpoint as C
warnings.simplefilter("ignore")
path, after, kw = sys.argv[1], int(sys.argv[2]), eval(sys.argv[3])
rng = np.random.default_rng(0)
X = rng.normal(size=(150, 3))
y = np.sin(2 * X[:, 0]) + 0.5 * X[:, 1] * X[:, 2] + 0.1 * rng.normal(size=150)
write, count = C.Checkpoint.write, [0]
def announced_write(self):
    write(self)
    count[0] += 1
    print("wrote", count[0], flush=True)
    if count[0] == after:
        time.sleep(600)  # the parent kills us here, after a complete checkpoint
C.Checkpoint.write = announced_write
ExactGP(checkpoint=(path, 2), **kw).fit(X, y)
print("finished", flush=True)
"""


def _kill_after_writes(path: Path, after: int, kw: dict) -> None:
    """Run the fit in a subprocess and kill it with SIGKILL once it has written ``after`` checkpoints."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    errors = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty child cannot block on it
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(path), str(after), repr({**COMMON, **kw})],
        stdout=subprocess.PIPE,
        stderr=errors,
        text=True,
        env=env,
    )
    watchdog = threading.Timer(300, proc.kill)  # a child stuck before its announcement is killed, not waited on
    watchdog.start()
    try:
        announced = False
        for line in proc.stdout:  # ends when the child exits: a child that dies early fails the test, never hangs it
            assert "finished" not in line, "the fit ended before it could be killed"
            if line.strip() == f"wrote {after}":
                announced = True
                break
        if not announced:
            proc.wait(60)
            errors.seek(0)
            pytest.fail(f"the child exited with {proc.returncode} before writing {after} checkpoints:\n{errors.read()}")
        assert path.exists()  # written and renamed before the announcement
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
        watchdog.cancel()
        proc.stdout.close()
        errors.close()


@pytest.mark.parametrize(
    "kw, after",
    [
        pytest.param(ENGINE, 3, id="engine-cg-adam-restarts-pretrain"),
        pytest.param(EXACT_LBFGS, 2, id="exact-lbfgs"),
        pytest.param(EXACT_ADAM, 3, id="exact-adam", marks=pytest.mark.slow),
    ],
)
def test_fit_killed_by_a_signal_resumes_to_the_uninterrupted_fit(tmp_path, kw, after):
    X, y = _data()
    path = tmp_path / "fit.ckpt"
    _kill_after_writes(path, after, kw)
    _, state = file_format.read_state(path, format=ckpt_module.CHECKPOINT_FORMAT)
    assert state["current"] is not None and len(state["current"]["loss"]) > 0  # killed inside a run
    resumed = _fit(X, y, checkpoint=(path, 2), **kw)
    assert not path.exists()  # removed once the fit succeeded
    _assert_same_fit(resumed, _fit(X, y, **kw), X)


@pytest.mark.parametrize("after", [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(5, marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "kw",
    [ENGINE, ENGINE_STALE, ENGINE_DEFERRED, EXACT_LBFGS, pytest.param(GPYTORCH_LBFGS, marks=pytest.mark.slow)],
    ids=["engine", "engine-stale-scales", "engine-deferred-rebuilds", "exact-lbfgs", "gpytorch-lbfgs"],
)
def test_interrupted_fit_resumes_bit_for_bit(monkeypatch, tmp_path, kw, after):
    X, y = _data()
    path = tmp_path / "fit.ckpt"
    if after == 5 and kw is GPYTORCH_LBFGS:
        pytest.skip("that fit writes fewer checkpoints")
    _interrupted(monkeypatch, path, X, y, after, **kw)
    resumed = _fit(X, y, checkpoint=(path, 2), **kw)
    _assert_same_fit(resumed, _fit(X, y, **kw), X)
    assert not path.exists()


def test_checkpointed_fit_equals_a_plain_one_and_leaves_no_file(tmp_path):
    X, y = _data()
    path = tmp_path / "sub" / "fit.ckpt"
    path.parent.mkdir()
    gp = _fit(X, y, checkpoint=(path, 1), **ENGINE)
    _assert_same_fit(gp, _fit(X, y, **ENGINE), X)
    assert list(path.parent.iterdir()) == []  # no checkpoint, no temporary files


# ------------------------------------------------------------------------------------------------------------
# refusals
# ------------------------------------------------------------------------------------------------------------


@pytest.fixture
def written(monkeypatch, tmp_path):
    X, y = _data()
    path = tmp_path / "fit.ckpt"
    _interrupted(monkeypatch, path, X, y, 1, **ENGINE)
    return X, y, path


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda X, y: (X + 1e-9, y, {}), r"other data: the same shape \(150 x 3\) but other values"),
        (lambda X, y: (X[:100], y[:100], {}), r"other data: 150 x 3 points, now 100 x 3"),
        (lambda X, y: (X, -y, {}), "other data"),
        (lambda X, y: (X, y, {"lr": 0.05}), r"other settings: lr=0.1 there, 0.05 now"),
        (lambda X, y: (X, y, {"random_state": 4}), r"random_state=3 there, 4 now"),
        (lambda X, y: (X, y, {"cg": {"rebuild_every": 5}}), r"cg="),
    ],
)
def test_checkpoint_of_other_data_or_settings_is_refused_and_the_previous_fit_kept(written, change, match):
    X, y, path = written
    X2, y2, params = change(X, y)
    gp = _fit(X[:50], y[:50], max_iter=2)
    before = (gp.history_, gp.noise_, gp.n_features_in_)
    gp.set_params(**{**ENGINE, **params, "checkpoint": (path, 2)})
    with pytest.raises(ValueError, match=match) as info:
        gp.fit(X2, y2)
    assert str(path) in str(info.value) and "cannot resume from the checkpoint" in str(info.value)
    assert (gp.history_, gp.noise_, gp.n_features_in_) == before
    assert path.exists()  # a refused checkpoint is left alone


@pytest.mark.slow
def test_verbose_and_the_steps_between_checkpoints_do_not_count_as_other_settings(written):
    X, y, path = written
    gp = _fit(X, y, checkpoint=(path, 5), verbose=False, **ENGINE)
    _assert_same_fit(gp, _fit(X, y, **ENGINE), X)


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda b: b[: len(b) // 2], r"truncated: its header announces \d+ bytes .* only \d+ follow"),
        (lambda b: b[:30], r"truncated: 30 bytes, shorter than the 52-byte header"),
        (lambda b: b[:1000] + bytes([b[1000] ^ 1]) + b[1001:], r"corrupt: the SHA-256 of its contents"),
        (lambda b: b"", r"empty"),
    ],
)
def test_damaged_checkpoint_gives_a_clear_error(written, damage, match):
    X, y, path = written
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match=match) as info:
        _fit(X, y, checkpoint=path, **ENGINE)
    assert f"cannot resume from the checkpoint {str(path)!r}" in str(info.value)
    assert "Delete it to start the fit afresh" in str(info.value) or "empty" in str(info.value)


def test_a_model_file_is_not_taken_for_a_checkpoint(tmp_path):
    X, y = _data()
    model = tmp_path / "model.gpfast"
    _fit(X, y, max_iter=2).save(model)
    with pytest.raises(ValueError, match=r"not a gpfast.ExactGP.checkpoint state .*Pass another checkpoint path"):
        _fit(X, y, checkpoint=model, **ENGINE)
    ExactGP.load(model)  # untouched


def test_a_failed_write_keeps_the_previous_checkpoint(monkeypatch, written):
    X, y, path = written
    before = path.read_bytes()

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(file_format.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        _fit(X, y, checkpoint=(path, 2), **ENGINE)
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # the temporary file was removed


@pytest.mark.parametrize(
    "params, match",
    [
        ({"checkpoint": ("fit.ckpt", 0)}, r"invalid checkpoint=\('fit.ckpt', 0\); expected .* every an int >= 1"),
        ({"checkpoint": ("fit.ckpt", 2.0)}, r"invalid checkpoint=\('fit.ckpt', 2.0\)"),
        ({"checkpoint": ("fit.ckpt", 2, 3)}, r"invalid checkpoint="),
        ({"checkpoint": 3}, "checkpoint"),
    ],
)
def test_bad_checkpoint_arguments(params, match):
    X, y = _data(30)
    with pytest.raises(ValueError, match=match):
        ExactGP(**params).fit(X, y)


def test_checkpoint_every_is_part_of_checkpoint_now(tmp_path):
    with pytest.raises(ValueError, match=r"instead of checkpoint_every=\.\.\., use checkpoint=\(path, every\)"):
        ExactGP().set_params(checkpoint_every=2)
    with pytest.raises(TypeError, match="checkpoint_every"):
        ExactGP(checkpoint_every=2)
    gp = clone(ExactGP(checkpoint=(tmp_path / "fit.ckpt", 3)))
    assert gp.get_params()["checkpoint"] == (tmp_path / "fit.ckpt", 3)


# ------------------------------------------------------------------------------------------------------------
# the command line
# ------------------------------------------------------------------------------------------------------------

CLI = ["fit", "--synthetic", "300", "--d", "3", "--test", "50", "--iters", "8", "--optimizer", "adam", "--tol", "0"]
CLI += ["--solver", "cg", "--dtype", "float64", "--device", "cpu", "--quiet"]


def test_cli_fit_resumes_from_a_checkpoint(monkeypatch, tmp_path, capsys):
    path = tmp_path / "cli.ckpt"
    write, count = ckpt_module.Checkpoint.write, [0]

    def stopping_write(self):
        write(self)
        count[0] += 1
        if count[0] == 2:
            raise _Stop

    monkeypatch.setattr(ckpt_module.Checkpoint, "write", stopping_write)
    with pytest.raises(_Stop):
        cli_main([*CLI, "--checkpoint", str(path), "--checkpoint-every", "2"])
    monkeypatch.setattr(ckpt_module.Checkpoint, "write", write)
    assert path.exists()
    capsys.readouterr()
    assert cli_main([*CLI, "--checkpoint", str(path), "--out", str(tmp_path / "a.json")]) == 0
    assert not path.exists()
    assert cli_main([*CLI, "--out", str(tmp_path / "b.json")]) == 0
    a, b = (json.loads((tmp_path / f"{k}.json").read_text()) for k in "ab")
    assert a["resumed"] is True and "resumed" not in b
    for key in ("final_loss", "rmse_std", "nll_std", "noise", "outputscale", "log_marginal_likelihood"):
        assert a[key] == b[key], key


def test_cli_checkpoint_usage_errors(tmp_path, capsys):
    assert cli_main([*CLI, "--checkpoint-every", "2"]) == 2
    assert "--checkpoint-every applies only with --checkpoint" in capsys.readouterr().err
    out = tmp_path / "x.json"
    assert cli_main([*CLI, "--checkpoint", str(out), "--out", str(out)]) == 2
    assert "name the same file" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no GPU")
def test_interrupted_cuda_fit_resumes_within_the_cg_tolerance(monkeypatch, tmp_path):
    """On a GPU, in float32: the resumed fit takes the same steps up to the device's floating-point
    nondeterminism (typically bit for bit: the same kernels on the same inputs)."""
    X, y = _data(3000, 8)
    kw = dict(ENGINE, dtype="float32", device="cuda", n_restarts=0, pretrain=None, max_iter=10)
    path = tmp_path / "fit.ckpt"
    _interrupted(monkeypatch, path, X, y, 2, **kw)
    resumed, plain = _fit(X, y, checkpoint=(path, 2), **kw), _fit(X, y, **kw)
    np.testing.assert_allclose(resumed.history_, plain.history_, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(resumed.lengthscale_, plain.lengthscale_, rtol=1e-3)
    np.testing.assert_allclose([resumed.noise_, resumed.outputscale_], [plain.noise_, plain.outputscale_], rtol=1e-3)
    assert resumed.cg_iterations_[:4] == plain.cg_iterations_[:4]  # before the interruption: the log itself
