"""The ``gpfast`` command line and :func:`gpfast.bench.compare.compare` (fast, CPU)."""

import csv
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gpfast import ExactGP
from gpfast.cli import main

REPO = Path(__file__).resolve().parents[1]
# `python -m gpfast` in another folder imports this checkout's gpfast, not another installed one
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


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
    # same data, same start, same loop: GPyTorch with either kernel fits the same (row (c) takes its steps in log
    # space with gpfast's own optimiser, so after 3 steps it is elsewhere)
    assert abs(rows[0]["rmse_std"] - rows[1]["rmse_std"]) < 1e-3

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
    res = subprocess.run(
        [sys.executable, "-m", "gpfast", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    assert "compare" in res.stdout and "datasets" in res.stdout and "build" in res.stdout


def test_version_help_datasets_download_need_no_compiled_ops(tmp_path):
    """The answers that need no GP (--version, --help, datasets, download of a shipped set) neither build nor load
    the C++ ops: an empty build folder stays empty and neither gpfast.ops nor the library is loaded."""
    build = tmp_path / "build"
    build.mkdir()
    code = (
        "import sys, torch; from gpfast.cli import main; "
        f"codes = [main(a) for a in (['--version'], ['--help'], ['datasets'], "
        f"['download', 'yacht', '--data-dir', {str(tmp_path / 'data')!r}, '--quiet'])]; "
        "mods = sorted(m for m in sys.modules if m in ('gpfast.ops', 'gpfast._build', 'gpfast.kernels')); "
        "libs = sorted(p for p in torch.ops.loaded_libraries if 'gpfast' in str(p)); "
        "print('RESULT', codes, mods, libs)"
    )
    env = {**ENV, "GPFAST_BUILD_DIR": str(build)}
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-1] == "RESULT [0, 0, 0, 0] [] []", res.stdout[-2000:]
    res = subprocess.run(
        [sys.executable, "-m", "gpfast", "--version"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert res.returncode == 0 and res.stdout.startswith("gpfast "), res.stderr
    assert not list(build.iterdir())


def test_version(capsys):
    from gpfast import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith(f"gpfast {__version__} (torch ")


# ----------------------------------------------------------------------------------------------------------
# every error case: `gpfast: error: ...`, exit status 2, no traceback, nothing written, before any work
# ----------------------------------------------------------------------------------------------------------
def _usage_error(argv, capsys, expected: str) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, (argv, err)
    assert "gpfast: error: " in err and expected in err, err
    assert "Traceback" not in err
    return err


@pytest.fixture
def files(tmp_path):
    """A plain file, a folder, a text file posing as a model, and paths under a file (never creatable)."""
    afile = tmp_path / "afile"
    afile.write_text("not a folder\n")
    fake_model = tmp_path / "fake.gpfast"
    fake_model.write_text("hello\n")
    return {
        "file": str(afile),
        "dir": str(tmp_path),
        "under_file": str(afile / "x.json"),
        "model": str(fake_model),
        "tmp": tmp_path,
    }


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")

ERROR_CASES = [
    pytest.param(
        ["fit", "--synthetic", "100", "--device", "cuda"], "CUDA is not available", marks=NO_CUDA, id="fit-device-cuda"
    ),
    pytest.param(
        ["fit", "--synthetic", "100", "--device", "tpu"], "expected cpu, cuda or cuda:<index>", id="fit-device-tpu"
    ),
    pytest.param(["fit", "--synthetic", "0"], "--synthetic: must be an integer >= 2, got 0", id="synthetic-0"),
    pytest.param(["fit", "--synthetic", "1"], "--synthetic: must be an integer >= 2, got 1", id="synthetic-1"),
    pytest.param(
        ["fit", "--dataset", "yacht", "--iters", "-3"], "--iters: must be an integer >= 0, got -3", id="iters-neg"
    ),
    pytest.param(["fit", "--dataset", "yacht", "--iters", "x"], "--iters: expected an integer", id="iters-x"),
    pytest.param(["fit", "--synthetic", "100", "--d", "0"], "--d: must be an integer >= 1, got 0", id="d-0"),
    pytest.param(["fit", "--synthetic", "100", "--test", "0"], "--test: must be an integer >= 1, got 0", id="test-0"),
    pytest.param(["fit", "--dataset", "yacht", "--lr", "-1"], "--lr: must be a positive number", id="fit-lr"),
    pytest.param(["fit", "--dataset", "yacht", "--lr", "nan"], "--lr: must be a positive number", id="fit-lr-nan"),
    pytest.param(
        ["fit", "--dataset", "yacht", "--split", "10"], "--split: must be one of the 10 fixed splits", id="split"
    ),
    pytest.param(["fit", "--dataset", "yacht", "--seed", "-1"], "--seed: must be an integer >= 0", id="seed"),
    pytest.param(
        ["fit", "--dataset", "yacht", "--pretrain-subset", "1"],
        "--pretrain-subset: must be an integer",
        id="pretrain-subset",
    ),
    pytest.param(
        ["fit", "--dataset", "yacht", "--pretrain-iter", "3"],
        "--pretrain-iter applies only with",
        id="pretrain-iter-alone",
    ),
    pytest.param(["fit", "--dataset", "yacht", "--d", "3"], "--d applies only with --synthetic", id="d-with-dataset"),
    pytest.param(
        ["fit", "--synthetic", "50", "--split", "1"], "--split applies only with --dataset", id="split-with-synthetic"
    ),
    pytest.param(
        ["fit", "--dataset", "yacht", "--target", "y"], "--target applies only with --csv", id="target-without-csv"
    ),
    pytest.param(["fit", "--dataset", "yacht", "--synthetic", "10"], "not allowed with argument", id="two-sources"),
    pytest.param(["fit"], "one of the arguments --csv --dataset --synthetic is required", id="no-source"),
    pytest.param(["fit", "--dataset", "no_such_set"], "unknown dataset 'no_such_set'", id="unknown-dataset"),
    pytest.param(
        ["fit", "--synthetic", "50", "--distributed", "--solver", "cholesky"],
        "--distributed runs the matrix-free CG solver",
        id="distributed-cholesky",
    ),
    pytest.param(
        ["fit", "--dataset", "yacht", "--out", "{under_file}"], "cannot create the folder", id="out-under-file"
    ),
    pytest.param(["fit", "--dataset", "yacht", "--out", "{dir}"], "is a folder; give a file name", id="out-is-dir"),
    pytest.param(["fit", "--dataset", "yacht", "--save", "{under_file}"], "--save", id="save-under-file"),
    pytest.param(["fit", "--csv", "{dir}/missing.csv", "--target", "y"], "missing.csv: no such file", id="csv-missing"),
    pytest.param(["fit", "--csv", "{file}"], "--csv needs --target COLUMN", id="csv-no-target"),
    pytest.param(
        ["fit", "--csv", "{file}", "--target", "y", "z", "y"],
        "--target names the column(s) 'y' more than once",
        id="csv-target-twice",
    ),
    pytest.param(
        ["fit", "--csv", "{file}", "--target", "y", "--independent-outputs"],
        "--independent-outputs applies only with several --target columns",
        id="independent-one-target",
    ),
    pytest.param(
        ["fit", "--synthetic", "50", "--independent-outputs"],
        "--independent-outputs applies only with several --target columns",
        id="independent-synthetic",
    ),
    pytest.param(
        ["compare", "--dataset", "yacht", "--lr", "-1", "--out", "{dir}/new"],
        "--lr: must be a positive",
        id="compare-lr",
    ),
    pytest.param(
        ["compare", "--dataset", "yacht", "--iters", "0", "--out", "{dir}/new"],
        "--iters: must be an integer >= 1",
        id="compare-iters",
    ),
    pytest.param(
        ["compare", "--dataset", "yacht", "--device", "cuda", "--out", "{dir}/new"],
        "CUDA is not available",
        marks=NO_CUDA,
        id="compare-cuda",
    ),
    pytest.param(["compare", "--dataset", "yacht", "--out", "{file}"], "exists and is not a folder", id="compare-out"),
    pytest.param(
        ["predict", "--model", "{dir}/none.gpfast", "--csv", "{file}"],
        "none.gpfast: no such file",
        id="predict-no-model",
    ),
    pytest.param(
        ["predict", "--model", "{model}", "--csv", "{file}"],
        "not a gpfast model file: it is a text file",
        id="predict-text-model",
    ),
    pytest.param(["predict", "--model", "{model}", "--csv", "{dir}"], "--csv", id="predict-csv-is-dir"),
    pytest.param(
        ["predict", "--model", "{model}", "--csv", "{file}", "--out", "{under_file}"],
        "cannot create the folder",
        id="predict-out",
    ),
    pytest.param(
        ["predict", "--model", "{model}", "--csv", "{file}", "--out", "{file}"],
        "--out {file} is also the --csv file",
        id="predict-out-is-csv",
    ),
    pytest.param(
        ["fit", "--csv", "{file}", "--target", "y", "--save", "{file}"],
        "--save {file} is also the --csv",
        id="fit-save-is-csv",
    ),
    pytest.param(["download", "no_such_set"], "unknown dataset name(s) 'no_such_set'", id="download-unknown"),
    pytest.param(["download", "yacht", "--data-dir", "{file}"], "exists and is not a folder", id="download-dir"),
    pytest.param(["download"], "the following arguments are required: NAME", id="download-no-name"),
    pytest.param([], "the following arguments are required: COMMAND", id="no-command"),
]


@pytest.mark.parametrize("argv, expected", ERROR_CASES)
def test_usage_errors_exit_2_without_traceback(argv, expected, files, capsys):
    before = sorted(files["tmp"].rglob("*"))
    _usage_error([a.format(**files) for a in argv], capsys, expected.format(**files))
    assert sorted(files["tmp"].rglob("*")) == before  # nothing written, no folder created


@pytest.mark.parametrize(
    "argv",
    [
        ["fit", "--synthetic", "1"],
        ["fit", "--synthetic", "100", "--device", "cuda"],
        ["compare", "--dataset", "yacht", "--lr", "-1"],
    ],
    ids=["synthetic-1", "cuda", "lr"],
)
def test_usage_errors_in_a_real_process(argv, tmp_path):
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    res = subprocess.run(
        [sys.executable, "-m", "gpfast", *argv, *(["--out", str(tmp_path / "o")] if "compare" in argv else [])],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines()[-1].startswith("gpfast: error: ") and "Traceback" not in res.stderr
    assert not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------------------------------------
# fitting a CSV file, then predicting, matches the Python API
# ----------------------------------------------------------------------------------------------------------
def _write_csv(path, header, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return str(path)


def _cell(v) -> str:
    return repr(float(v))  # the shortest text that reads back to the same float64


def _table(seed=0, n=40):
    rng = np.random.default_rng(seed)
    X = rng.uniform(0, 10, (n, 3)) * [1.0, 0.1, 100.0]
    y = np.sin(X[:, 0]) + 5 * X[:, 1] + 0.01 * X[:, 2] + 0.1 * rng.standard_normal(n) + 50
    return X, y


FIT_ARGS = ["--iters", "8", "--seed", "3", "--device", "cpu", "--quiet"]


def test_csv_fit_then_predict_matches_the_python_api(tmp_path, capsys):
    X, y = _table()
    Xt, _ = _table(seed=1, n=7)
    train = _write_csv(
        tmp_path / "train.csv",
        ["name", "a", "b", "price", "c"],
        [[f"house {i}", *map(_cell, x[:2]), _cell(t), _cell(x[2])] for i, (x, t) in enumerate(zip(X, y))],
    )
    # new rows: the inputs in another order, no target, an extra text column
    new = _write_csv(
        tmp_path / "new.csv", ["c", "note", "a", "b"], [[_cell(x[2]), "?", _cell(x[0]), _cell(x[1])] for x in Xt]
    )
    model, out, pred = tmp_path / "models" / "m.gpfast", tmp_path / "res" / "fit.json", tmp_path / "pred" / "p.csv"
    rc = main(
        [
            "fit",
            "--csv",
            train,
            "--target",
            "price",
            "--features",
            "a",
            "b",
            "c",
            *FIT_ARGS,
            "--save",
            str(model),
            "--out",
            str(out),
        ]
    )
    assert rc == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["n_train"] == 40 and result["d"] == 3 and result["features"] == ["a", "b", "c"]
    assert result["startup_s"] > 0 and result["train_s"] > 0 and "rmse_std" not in result
    capsys.readouterr()
    assert main(["predict", "--model", str(model), "--csv", new, "--out", str(pred)]) == 0
    assert "7 row(s)" in capsys.readouterr().err
    with open(pred) as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["mean", "std"] and len(rows) == 8
    mean, std = np.array(rows[1:], dtype=np.float64).T

    gp = ExactGP(max_iter=8, random_state=3, device="cpu", verbose=False).fit(X, y)
    m_ref, s_ref = gp.predict(Xt, return_std=True)
    np.testing.assert_allclose(mean, m_ref, rtol=1e-12)
    np.testing.assert_allclose(std, s_ref, rtol=1e-12)
    assert result["final_loss"] == pytest.approx(gp.history_[-1], rel=1e-12)
    assert result["noise"] == pytest.approx(gp.noise_, rel=1e-12)

    # the saved model is the Python API's too, with its column names
    loaded = ExactGP.load(model)
    assert list(loaded.feature_names_in_) == ["a", "b", "c"]
    # to stdout, the same numbers
    assert main(["predict", "--model", str(model), "--csv", new, "--quiet"]) == 0
    assert capsys.readouterr().out == pred.read_text()


@pytest.mark.parametrize("independent", [False, True])
def test_csv_fit_of_several_targets_then_predict_per_output(tmp_path, capsys, independent):
    """``--target A B C`` fits y of shape (n, 3) as the Python API does (shared or independent hyperparameters),
    saves it, and ``gpfast predict`` writes mean_<target>,std_<target> for each output."""
    X, y = _table()
    Xt, _ = _table(seed=1, n=5)
    Y = np.stack([y, np.cos(X[:, 0]) + 0.1 * X[:, 2], -2.0 * y], 1)
    rows = [[*map(_cell, x), *map(_cell, t)] for x, t in zip(X, Y)]
    train = _write_csv(tmp_path / "train.csv", ["a", "b", "c", "p", "q", "r"], rows)
    new = _write_csv(tmp_path / "new.csv", ["a", "b", "c"], [list(map(_cell, x)) for x in Xt])
    model, out, pred = tmp_path / "m.gpfast", tmp_path / "fit.json", tmp_path / "p.csv"
    flag = ["--independent-outputs"] if independent else []
    argv = ["fit", "--csv", train, "--target", "p", "q", "r", *flag, *FIT_ARGS, "--save", str(model), "--out", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["features"] == ["a", "b", "c"] and result["target"] == ["p", "q", "r"]
    assert result["data"] == f"{train} (targets ['p', 'q', 'r'])"
    gp = ExactGP(max_iter=8, random_state=3, device="cpu", verbose=False, independent_outputs=independent).fit(X, Y)
    assert result["noise"] == pytest.approx(gp.noise_.tolist(), rel=1e-12)
    assert result["n_iter"] == gp.n_iter_  # a count per output with independent outputs
    capsys.readouterr()
    assert main(["predict", "--model", str(model), "--csv", new, "--out", str(pred), "--quiet"]) == 0
    with open(pred) as f:
        table = list(csv.reader(f))
    assert table[0] == ["mean_p", "std_p", "mean_q", "std_q", "mean_r", "std_r"] and len(table) == 6
    values = np.array(table[1:], dtype=np.float64)
    m_ref, s_ref = gp.predict(Xt, return_std=True)
    np.testing.assert_allclose(values[:, 0::2], m_ref, rtol=1e-12)
    np.testing.assert_allclose(values[:, 1::2], s_ref, rtol=1e-12)


def test_csv_every_other_column_is_an_input_by_default(tmp_path, capsys):
    X, y = _table(n=12)
    train = _write_csv(tmp_path / "t.csv", ["y", "x0", "x1", "x2"], [[_cell(t), *map(_cell, x)] for x, t in zip(X, y)])
    assert main(["fit", "--csv", train, "--target", "y", "--iters", "2", "--device", "cpu", "--quiet"]) == 0
    assert "['x0', 'x1', 'x2']" in capsys.readouterr().out


def test_predict_with_a_model_saved_from_arrays_needs_features(tmp_path, capsys):
    X, y = _table(n=12)
    gp = ExactGP(max_iter=2, device="cpu", verbose=False).fit(X, y)
    gp.save(tmp_path / "m.gpfast")
    new = _write_csv(tmp_path / "n.csv", ["p", "q", "r", "target"], [[*map(_cell, x), "0"] for x in X[:3]])
    _usage_error(
        ["predict", "--model", str(tmp_path / "m.gpfast"), "--csv", new],
        capsys,
        "takes 3 input(s) and does not know their names",
    )
    rc = main(["predict", "--model", str(tmp_path / "m.gpfast"), "--csv", new, "--features", "p", "q", "r"])
    assert rc == 0
    mean = np.array([r[0] for r in list(csv.reader(io.StringIO(capsys.readouterr().out)))[1:]], dtype=float)
    np.testing.assert_allclose(mean, gp.predict(X[:3]), rtol=1e-12)


CSV_CASES = [
    (
        "a,b,y\n1,2,3\n4,5,6\n",
        ["--target", "price"],
        "no target column 'price' in its header; its columns are 'a', 'b', 'y'",
    ),
    ("a,b,y\n1,2,3\n4,oops,6\n", ["--target", "y"], "column 'b' holds 'oops' on line 3, which is not a number"),
    ("a,b,y\n1,2,3\n4,,6\n", ["--target", "y"], "column 'b' is empty on line 3 (a missing value)"),
    ("a,b,y\n1,2,3\n4,nan,6\n", ["--target", "y"], "column 'b' holds 'nan' on line 3, which is not a finite number"),
    ("a,b,y\n1,2,3\n4,5,x\n", ["--target", "y"], "column 'y' holds 'x' on line 3"),
    ("id,a,y\nr1,1,3\nr2,4,6\n", ["--target", "y"], "column 'id' holds no numbers (line 2: 'r1')"),
    ("a,b,y\n1,2,3\n", ["--target", "y"], "has 1 data row(s); fitting a GP needs at least 2"),
    ("a,b,y\n", ["--target", "y"], "has 0 data row(s)"),
    ("", ["--target", "y"], "is empty: expected a header row"),
    ("a,b,y\n1,2,3\n4,5\n", ["--target", "y"], "line 3: 2 field(s), but the header has 3 columns"),
    ("a,a,y\n1,2,3\n4,5,6\n", ["--target", "y"], "column name(s) 'a' appear more than once"),
    ("a,,y\n1,2,3\n4,5,6\n", ["--target", "y"], "empty column name(s) at position(s) [2]"),
    ("a;b;y\n1;2;3\n4;5;6\n", ["--target", "y"], "a single column holding semicolons; gpfast reads comma-separated"),
    ("y\n1\n2\n", ["--target", "y"], "no input columns: its only column is the target 'y'"),
    ("y,z\n1,2\n2,3\n", ["--target", "y", "z"], "no input columns: its only columns are the targets ['y', 'z']"),
    ("a,y\n1,2\n2,3\n", ["--target", "y", "z"], "no target column 'z' in its header"),
    ("a,y,z\n1,2,3\n2,3,4\n", ["--target", "y", "z", "--features", "a", "z"], "the target column 'z' is also named"),
    ("a,b,y\n1,2,3\n4,5,6\n", ["--target", "y", "--features", "a", "z"], "no feature column 'z'"),
    ("a,b,y\n1,2,3\n4,5,6\n", ["--target", "y", "--features", "a", "y"], "the target column 'y' is also named"),
]


@pytest.mark.parametrize("text, args, expected", CSV_CASES)
def test_csv_errors(tmp_path, capsys, text, args, expected):
    path = tmp_path / "t.csv"
    path.write_text(text)
    err = _usage_error(
        [
            "fit",
            "--csv",
            str(path),
            *args,
            "--iters",
            "1",
            "--device",
            "cpu",
            "--quiet",
            "--save",
            str(tmp_path / "m.gpfast"),
        ],
        capsys,
        expected,
    )
    assert str(path) in err
    assert not (tmp_path / "m.gpfast").exists()


def test_csv_quotes_bom_and_blank_lines(tmp_path, capsys):
    path = tmp_path / "t.csv"
    path.write_bytes('\ufeff"a, first",b,y\n\n1,2,3\n4,5,6\n7,8,10\n'.encode())
    assert main(["fit", "--csv", str(path), "--target", "y", "--iters", "1", "--device", "cpu", "--quiet"]) == 0
    assert "['a, first', 'b']" in capsys.readouterr().out


def test_predict_errors(tmp_path, capsys):
    X, y = _table(n=12)
    train = _write_csv(tmp_path / "t.csv", ["a", "b", "c", "y"], [[*map(_cell, x), _cell(t)] for x, t in zip(X, y)])
    model = tmp_path / "m.gpfast"
    assert (
        main(
            ["fit", "--csv", train, "--target", "y", "--iters", "1", "--device", "cpu", "--quiet", "--save", str(model)]
        )
        == 0
    )
    new = _write_csv(tmp_path / "n.csv", ["a", "c"], [["1", "2"]])
    _usage_error(["predict", "--model", str(model), "--csv", new], capsys, "no model input column 'b'")
    new = _write_csv(tmp_path / "n.csv", ["a", "b", "c"], [])
    _usage_error(["predict", "--model", str(model), "--csv", new], capsys, "has a header but no data rows")
    new = _write_csv(tmp_path / "n.csv", ["a", "b", "c"], [["1", "x", "2"]])
    _usage_error(["predict", "--model", str(model), "--csv", new], capsys, "column 'b' holds 'x' on line 2")
    _usage_error(
        ["predict", "--model", str(model), "--csv", new, "--features", "c", "b", "a"],
        capsys,
        "reads them by name; leave --features out",
    )
    damaged = bytearray(model.read_bytes())
    damaged[-10] ^= 1
    model.write_bytes(bytes(damaged))
    _usage_error(["predict", "--model", str(model), "--csv", new], capsys, "the file is corrupt")


# ----------------------------------------------------------------------------------------------------------
# fit on synthetic data: output folders created, times without start-up
# ----------------------------------------------------------------------------------------------------------
def test_fit_synthetic_creates_the_output_folder(tmp_path, capsys):
    out = tmp_path / "new" / "deeper" / "fit.json"
    rc = main(
        [
            "fit",
            "--synthetic",
            "60",
            "--d",
            "2",
            "--test",
            "10",
            "--iters",
            "2",
            "--device",
            "cpu",
            "--quiet",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["n_train"] == 60 and result["n_test"] == 10 and result["d"] == 2
    for key in ("startup_s", "train_s", "predict_s", "rmse_std", "nll_std"):
        assert math.isfinite(result[key]), key
    assert "train_s and predict_s exclude it" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------------------
# download, from a local copy (no network)
# ----------------------------------------------------------------------------------------------------------
@pytest.fixture
def local_source(monkeypatch):
    """gpfast.datasets.download fetching from the copies shipped in the package (file://)."""
    import functools

    from gpfast import datasets

    base = (REPO / "gpfast" / "data").as_uri()
    monkeypatch.setattr(datasets, "download", functools.partial(datasets.download, base_url=base))
    return base


def test_download_into_data_dir(tmp_path, capsys, local_source):
    target = tmp_path / "uci"
    assert main(["download", "yacht", "energy", "--data-dir", str(target), "--quiet"]) == 0
    for name in ("yacht", "energy"):
        assert (target / name / "data.csv.gz").is_file() and (target / name / "test_mask.csv.gz").is_file()
    assert str(target) in capsys.readouterr().out


def test_failed_download_exits_1_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    import functools

    from gpfast import datasets

    monkeypatch.setattr(
        datasets, "download", functools.partial(datasets.download, base_url=(tmp_path / "empty").as_uri())
    )
    target = tmp_path / "uci"
    assert main(["download", "yacht", "--data-dir", str(target), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("gpfast: error: download failed:") and "Traceback" not in err
    assert not target.exists()


def test_predict_into_a_closed_pipe_exits_quietly(tmp_path):
    """`gpfast predict ... | head`: the reader leaves early; no BrokenPipeError traceback, the shell's SIGPIPE
    status."""
    X, y = _table(n=20)
    model = tmp_path / "m.gpfast"
    ExactGP(max_iter=2, random_state=0, device="cpu").fit(X, y).save(model)
    Xt, _ = _table(seed=1, n=5000)  # far more than a pipe buffers, so the writer meets the closed end
    new = _write_csv(tmp_path / "new.csv", ["x0", "x1", "x2"], [[*map(_cell, x)] for x in Xt])
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpfast",
            "predict",
            "--model",
            str(model),
            "--csv",
            new,
            "--features",
            "x0",
            "x1",
            "x2",
        ],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout.readline() == b"mean,std\n"
    proc.stdout.close()  # as `head -1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err


@pytest.mark.slow
def test_csv_fit_then_predict_in_real_processes(tmp_path):
    """The same round trip through `python -m gpfast` processes: the saved file is all that passes between them."""
    X, y = _table(n=20)
    train = _write_csv(tmp_path / "train.csv", ["a", "b", "c", "y"], [[*map(_cell, x), _cell(t)] for x, t in zip(X, y)])
    model = tmp_path / "m.gpfast"

    def run(*argv):
        res = subprocess.run(
            [sys.executable, "-m", "gpfast", *argv], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300
        )
        assert res.returncode == 0, res.stderr
        return res.stdout

    run("fit", "--csv", train, "--target", "y", *FIT_ARGS, "--save", str(model))
    out = run("predict", "--model", str(model), "--csv", train, "--quiet")
    mean, std = np.array([r for r in csv.reader(io.StringIO(out))][1:], dtype=np.float64).T
    m_ref, s_ref = (
        ExactGP(max_iter=8, random_state=3, device="cpu", verbose=False).fit(X, y).predict(X, return_std=True)
    )
    np.testing.assert_allclose(mean, m_ref, rtol=1e-12)
    np.testing.assert_allclose(std, s_ref, rtol=1e-12)


# ----------------------------------------------------------------------------------------------------------
# progress bars: on a terminal only, so that logs hold no bars
# ----------------------------------------------------------------------------------------------------------
def _fit_and_adam_verbose():
    from gpfast.bench.compare import gpytorch_adam
    from gpfast.models import ExactGPModel

    X, y = _table(n=20)
    ExactGP(max_iter=3, tol=0.0, optimizer="adam", verbose=True, device="cpu", random_state=0).fit(X, y)
    Xs = torch.as_tensor((X - X.mean(0)) / X.std(0), dtype=torch.float32)
    ys = torch.as_tensor((y - y.mean()) / y.std(), dtype=torch.float32)
    import gpytorch

    model = ExactGPModel(Xs, ys, gpytorch.likelihoods.GaussianLikelihood(), kernel="gpytorch")
    gpytorch_adam(model, 3, 0.1, "adam steps", verbose=True)


def test_no_progress_bars_when_stderr_is_not_a_terminal(capfd):
    _fit_and_adam_verbose()
    err = capfd.readouterr().err
    assert "gpfast.ExactGP: n=20" in err  # verbose still says what it does
    assert "\r" not in err and "it/s" not in err and "adam steps" not in err, err


def test_progress_bars_on_a_terminal(monkeypatch):
    import fcntl
    import struct
    import termios

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new pty is 0 columns wide
    os.set_blocking(master, False)
    with open(slave, "w") as tty:
        monkeypatch.setattr(sys, "stderr", tty)
        _fit_and_adam_verbose()
        tty.flush()
        shown = b""
        try:
            while chunk := os.read(master, 1 << 16):
                shown += chunk
        except BlockingIOError:
            pass
    os.close(master)
    assert b"gpfast fit" in shown and b"adam steps" in shown and b"\r" in shown


# ----------------------------------------------------------------------------------------------------------
# fit trains to convergence by default; warnings speak of the command line's options
# ----------------------------------------------------------------------------------------------------------
def test_fit_trains_to_convergence_by_default(tmp_path, capsys):
    X, y = _table()
    train = _write_csv(tmp_path / "train.csv", ["a", "b", "c", "y"], [[*map(_cell, x), _cell(t)] for x, t in zip(X, y)])
    out = tmp_path / "fit.json"
    assert main(["fit", "--csv", train, "--target", "y", "--device", "cpu", "--quiet", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["iters"] == ExactGP().max_iter  # the Python API's cap
    assert result["converged"] and 0 < result["n_iter"] < result["iters"]
    assert "Raise" not in capsys.readouterr().err


def test_fit_warnings_name_the_option_and_no_source_line(tmp_path, capsys):
    X, y = _table()
    train = _write_csv(tmp_path / "train.csv", ["a", "b", "c", "y"], [[*map(_cell, x), _cell(t)] for x, t in zip(X, y)])
    assert main(["fit", "--csv", train, "--target", "y", "--iters", "2", "--device", "cpu", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "gpfast: warning: ExactGP: the optimiser (lbfgs) stopped after 2 iterations" in err, err
    assert "Raise --iters (now 2; it is a cap, not a plan), or set --tol." in err, err
    assert "max_iter" not in err and ".py:" not in err and "warnings.warn" not in err, err


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Raise max_iter (now 50), or set tol.", "Raise --iters (now 50), or set --tol."),
        (
            "Try dtype='float64', solver='cholesky', or a smaller lr.",
            "Try --dtype float64, --solver cholesky, or a smaller --lr.",
        ),
        ("pretrain_subset=5000 >= n_samples=100: skipping", "--pretrain-subset 5000 >= n_samples=100: skipping"),
        ("the solver and the optimiser", "the solver and the optimiser"),  # words, not arguments, stay
    ],
)
def test_messages_in_option_words(text, expected):
    from gpfast.cli import in_option_words

    assert in_option_words(text) == expected
