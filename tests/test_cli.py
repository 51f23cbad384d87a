"""The ``gpfast`` command line and :func:`gpfast.bench.compare.compare` (fast, CPU)."""

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from gpfast.cli import main

REPO = Path(__file__).resolve().parents[1]


def test_compare_yacht_writes_outputs(tmp_path, capsys):
    rc = main(["compare", "--dataset", "yacht", "--iters", "3", "--device", "cpu", "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    stem = tmp_path / "compare_yacht_split0"
    for ext in (".csv", ".json", ".png"):
        assert stem.with_suffix(ext).is_file(), ext
    assert stem.with_suffix(".png").stat().st_size > 1000

    data = json.loads(stem.with_suffix(".json").read_text())
    rows = data["rows"]
    assert [r["row"] for r in rows] == ["gpytorch", "gpytorch+gpfast", "gpfast"]
    assert data["machine"] and data["date"]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["n_train"] == 278 and r["d"] == 6 and r["iters"] == 3
        for key in ("rmse_std", "rmse_orig", "nll_std", "nll_orig", "train_s", "predict_s", "s_per_iter"):
            assert math.isfinite(r[key]), (r["row"], key)
        assert 0 < r["rmse_std"] < 2
        assert r["mem_kind"]
    # the three rows started from the same hyperparameters (GPyTorch's defaults)
    first = rows[0]
    assert len(first["init_lengthscale"]) == 6
    for r in rows[1:]:
        assert r["init_lengthscale"] == pytest.approx(first["init_lengthscale"], rel=1e-6)
        for key in ("init_outputscale", "init_noise", "init_mean"):
            assert r[key] == pytest.approx(first[key], rel=1e-6, abs=1e-7), (r["row"], key)
    # same data, same start, same steps: the three fits agree closely
    rmses = [r["rmse_std"] for r in rows]
    assert max(rmses) - min(rmses) < 1e-3

    with open(stem.with_suffix(".csv")) as f:
        csv_rows = list(csv.DictReader(f))
    assert len(csv_rows) == 3 and all(math.isfinite(float(r["rmse_std"])) for r in csv_rows)

    out = capsys.readouterr().out
    assert "RMSE std" in out and "gpytorch+gpfast" in out


def test_unknown_dataset_exit_code_2(tmp_path, capsys):
    rc = main(["compare", "--dataset", "no_such_set", "--out", str(tmp_path), "--quiet"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "no_such_set" in err and "yacht" in err and "kin40k" in err
    assert "Traceback" not in err
    assert not list(tmp_path.iterdir())


def test_bad_split_exit_code_2(tmp_path, capsys):
    rc = main(["compare", "--dataset", "yacht", "--split", "99", "--out", str(tmp_path), "--quiet"])
    assert rc == 2
    assert "split" in capsys.readouterr().err


def test_datasets_lists_shipped(capsys):
    assert main(["datasets"]) == 0
    out = capsys.readouterr().out
    for name in ("yacht", "energy", "concrete"):
        assert name in out


def test_python_m_gpfast_help():
    res = subprocess.run([sys.executable, "-m", "gpfast", "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    assert "compare" in res.stdout and "datasets" in res.stdout and "build" in res.stdout
