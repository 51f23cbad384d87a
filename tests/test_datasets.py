"""Tests of gpfast.datasets: finding, loading, standardising, synthetic data and (offline) download."""

import gzip
import hashlib
import http.server
import inspect
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from gpfast import datasets as D
from gpfast.datasets import downloads
from gpfast.datasets import synthetic_data

SHARED_UCI = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "uci"
needs_shared = pytest.mark.skipif(not (SHARED_UCI / "pol" / "data.csv.gz").is_file(), reason=f"no {SHARED_UCI}")


@pytest.fixture
def no_data_env(monkeypatch, tmp_path):
    """No GPFAST_DATA and an empty cache folder: only the shipped copies are reachable."""
    monkeypatch.delenv("GPFAST_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


def _raw(folder: Path):
    data = np.loadtxt(folder / "data.csv.gz", delimiter=",", ndmin=2)
    mask = np.loadtxt(folder / "test_mask.csv.gz", delimiter=",", ndmin=2)
    return data, mask


def _write_set(folder: Path, data: np.ndarray, mask: np.ndarray) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with gzip.open(folder / "data.csv.gz", "wt") as f:
        np.savetxt(f, data, delimiter=",", fmt="%.10g")
    with gzip.open(folder / "test_mask.csv.gz", "wt") as f:
        np.savetxt(f, mask, delimiter=",", fmt="%d")


# ---------------------------------------------------------------------------------------------------------------
# Finding the data
# ---------------------------------------------------------------------------------------------------------------


def test_names():
    assert set(D.SHIPPED) <= set(D.UCI_NAMES)
    assert {"pol", "elevators", "bike", "kin40k", "protein", "keggdirected", "keggundirected"} <= set(D.UCI_NAMES)
    assert set(D.LARGE_UCI_NAMES) <= set(D.UCI_NAMES)
    assert len(set(D.UCI_NAMES)) == len(D.UCI_NAMES)


def test_resolve_data_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("GPFAST_DATA", raising=False)
    assert D.resolve_data_dir() == tmp_path / "xdg" / "gpfast" / "uci"
    monkeypatch.setenv("GPFAST_DATA", str(tmp_path / "env"))
    assert D.resolve_data_dir() == tmp_path / "env"
    assert D.resolve_data_dir(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("GPFAST_DATA")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert D.resolve_data_dir() == Path.home() / ".cache" / "gpfast" / "uci"


@pytest.mark.parametrize("name", D.SHIPPED)
def test_shipped_sets_load_offline(no_data_env, name):
    folder = D.find_dataset(name)
    assert folder.parent.name == "data" and folder.parent.parent.name == "gpfast"
    ds = D.load_uci(name)
    rows, d = D.UCI_SIZES[name]
    assert ds.n_train + ds.n_test == rows
    assert ds.d == d
    assert name in D.available()


def test_data_dir_wins_over_shipped(no_data_env, tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    data = rng.standard_normal((20, 3))
    mask = np.zeros((20, 10))
    mask[:2] = 1
    _write_set(tmp_path / "mine" / "yacht", data, mask)
    ds = D.load_uci("yacht", data_dir=tmp_path / "mine", standardize=False)
    assert ds.n_train == 18 and ds.n_test == 2 and ds.d == 2
    np.testing.assert_allclose(ds.X_test, data[:2, :2])
    # The same through the environment variable, and through a parent folder holding uci/<name>.
    _write_set(tmp_path / "parent" / "uci" / "custom", data, mask)
    monkeypatch.setenv("GPFAST_DATA", str(tmp_path / "parent"))
    assert D.find_dataset("custom") == tmp_path / "parent" / "uci" / "custom"
    assert D.load_uci("custom").n_test == 2  # a name outside UCI_NAMES loads when present on disk


@needs_shared
@pytest.mark.parametrize("name", ["pol", "yacht"])
def test_load_from_shared_dir(no_data_env, name):
    ds = D.load_uci(name, split=3, data_dir=SHARED_UCI)
    assert D.find_dataset(name, SHARED_UCI) == SHARED_UCI / name
    assert ds.n_train + ds.n_test == D.UCI_SIZES[name][0]
    assert ds.d == D.UCI_SIZES[name][1]


def test_missing_file_message_lists_folders(no_data_env, tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        D.find_dataset("pol", data_dir=tmp_path / "nowhere")
    msg = str(info.value)
    assert "'pol'" in msg
    assert str(tmp_path / "nowhere" / "pol") in msg
    assert str(D.SHIPPED_DIR / "pol") in msg
    assert "--data-dir" in msg and "GPFAST_DATA" in msg and "download(" in msg
    assert f"`gpfast download pol --data-dir {tmp_path / 'nowhere'}`" in msg


def test_missing_file_message_names_the_command_and_no_doubled_folder(no_data_env):
    with pytest.raises(FileNotFoundError) as info:
        D.find_dataset("pol")  # in the user cache, a folder called uci
    msg = str(info.value)
    assert "`gpfast download pol`" in msg
    assert D.resolve_data_dir().name == "uci" and "uci/uci" not in msg, msg


def test_unknown_name(no_data_env):
    with pytest.raises(ValueError, match=r"known names: .*yacht"):
        D.load_uci("no_such_set")
    with pytest.raises(ValueError):
        D.find_dataset("../yacht")


# ---------------------------------------------------------------------------------------------------------------
# Splits and standardisation
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split", [0, 7, 9])
def test_split_matches_mask(no_data_env, split):
    data, mask = _raw(D.find_dataset("energy"))
    ds = D.load_uci("energy", split=split, standardize=False)
    test = mask[:, split] == 1
    assert ds.n_test == test.sum() and ds.n_train == (~test).sum()
    assert ds.n_train + ds.n_test == len(data)
    assert 0.05 < ds.n_test / len(data) < 0.15
    np.testing.assert_array_equal(ds.X_test, data[test, :-1])
    np.testing.assert_array_equal(ds.y_test, data[test, -1])
    np.testing.assert_array_equal(ds.X_train, data[~test, :-1])
    np.testing.assert_array_equal(ds.y_train, data[~test, -1])
    assert ds.y_train.ndim == 1 and ds.y_test.ndim == 1
    assert ds.y_mean == 0.0 and ds.y_std == 1.0


def test_splits_differ(no_data_env):
    a, b = D.load_uci("yacht", split=0), D.load_uci("yacht", split=1)
    assert not np.array_equal(a.y_test, b.y_test)


def test_standardisation_uses_train_stats(no_data_env):
    raw = D.load_uci("concrete", split=2, standardize=False)
    ds = D.load_uci("concrete", split=2)
    np.testing.assert_allclose(ds.X_train.mean(0), 0, atol=1e-10)
    np.testing.assert_allclose(ds.X_train.std(0), 1, atol=1e-10)
    assert abs(ds.y_train.mean()) < 1e-10 and abs(ds.y_train.std() - 1) < 1e-10
    np.testing.assert_allclose(ds.x_mean, raw.X_train.mean(0))
    np.testing.assert_allclose(ds.x_std, raw.X_train.std(0))
    np.testing.assert_allclose(ds.X_test, (raw.X_test - raw.X_train.mean(0)) / raw.X_train.std(0), atol=1e-10)
    np.testing.assert_allclose(ds.y_test, (raw.y_test - raw.y_train.mean()) / raw.y_train.std(), atol=1e-10)
    np.testing.assert_allclose(ds.standardize_x(raw.X_test), ds.X_test, atol=1e-10)


def test_unstandardize_round_trip(no_data_env):
    raw = D.load_uci("yacht", split=4, standardize=False)
    ds = D.load_uci("yacht", split=4)
    np.testing.assert_allclose(ds.unstandardize_y(ds.y_test), raw.y_test, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ds.unstandardize_y(ds.y_train), raw.y_train, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ds.unstandardize_std(np.ones(3)), raw.y_train.std() * np.ones(3))


def test_constant_column_and_dtype(no_data_env, tmp_path):
    rng = np.random.default_rng(1)
    data = rng.standard_normal((30, 4))
    data[:, 1] = 3.7  # constant input column
    mask = np.zeros((30, 10))
    mask[::10] = 1
    _write_set(tmp_path / "const", data, mask)
    ds = D.load_uci("const", data_dir=tmp_path, dtype=np.float32)
    assert ds.x_std[1] == 1.0
    assert np.all(np.isfinite(ds.X_train)) and np.all(np.isfinite(ds.X_test))
    assert ds.X_train.dtype == ds.y_train.dtype == ds.X_test.dtype == ds.y_test.dtype == np.float32


def test_frozen_and_repr(no_data_env):
    ds = D.load_uci("yacht")
    with pytest.raises(AttributeError):
        ds.split = 3
    assert "yacht" in repr(ds) and "n_train=" in repr(ds)


@pytest.mark.parametrize("bad", [10, -1, 100])
def test_split_out_of_range(no_data_env, bad):
    with pytest.raises(ValueError) as info:
        D.load_uci("yacht", split=bad)
    msg = str(info.value)
    assert "split" in msg and re.search(rf"got {re.escape(str(bad))}\b", msg) and "0..9" in msg


def test_split_wrong_type(no_data_env):
    with pytest.raises(TypeError, match="split"):
        D.load_uci("yacht", split=1.5)


def test_bad_mask_shape(tmp_path):
    _write_set(tmp_path / "bad", np.ones((5, 3)), np.zeros((4, 10)))
    with pytest.raises(ValueError, match="test_mask"):
        D.load_uci("bad", data_dir=tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# Synthetic data
# ---------------------------------------------------------------------------------------------------------------


def test_synthetic_shape_dtype_determinism():
    X, y = D.synthetic(1000, 5, noise=0.1, seed=3)
    assert X.shape == (1000, 5) and y.shape == (1000,)
    assert X.dtype == np.float32 and y.dtype == np.float32
    X2, y2 = D.synthetic(1000, 5, noise=0.1, seed=3)
    np.testing.assert_array_equal(X, X2)
    np.testing.assert_array_equal(y, y2)
    X3, y3 = D.synthetic(1000, 5, noise=0.1, seed=4)
    assert not np.allclose(X, X3) and not np.allclose(y, y3)
    X64, y64 = D.synthetic(10, 2, dtype=np.float64)
    assert X64.dtype == y64.dtype == np.float64


def test_synthetic_nested_sizes():
    # Bigger than one generation block, so the prefix property is checked across blocks.
    Xs, ys = D.synthetic(100, 3, seed=7)
    Xl, yl = D.synthetic(70_000, 3, seed=7)
    np.testing.assert_array_equal(Xs, Xl[:100])
    np.testing.assert_array_equal(ys, yl[:100])


def test_synthetic_statistics():
    X, y = D.synthetic(50_000, 4, noise=0.0, seed=0, dtype=np.float64)
    assert abs(X.mean()) < 0.02 and abs(X.std() - 1) < 0.02
    assert abs(y.mean()) < 0.1 and 0.8 < y.var() < 1.2  # Var f = 1 by construction
    _, y_noisy = D.synthetic(50_000, 4, noise=0.5, seed=0, dtype=np.float64)
    np.testing.assert_allclose(np.std(y_noisy - y), 0.5, rtol=0.05)
    # Smooth: a small step in x moves f(x) by little (f has lengthscale ~1.5 and std 1).
    X0, f0 = D.synthetic(2000, 4, noise=0.0, seed=0, dtype=np.float64)
    W, b, a, c = synthetic_data._synthetic_function(4, 1.5, np.random.SeedSequence(0).spawn(3)[0])
    f = np.sin(X0 @ W.T + b) @ a - c
    np.testing.assert_allclose(f, f0, atol=1e-12)
    f_step = np.sin((X0 + 0.01) @ W.T + b) @ a - c
    assert np.max(np.abs(f_step - f)) < 0.1


def test_synthetic_split():
    ds = D.synthetic_split(500, 100, 3, noise=0.1, seed=2)
    assert (ds.n_train, ds.n_test, ds.d) == (500, 100, 3)
    assert ds.X_train.dtype == np.float32
    np.testing.assert_allclose(ds.X_train.mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(ds.X_train.std(0), 1, atol=1e-5)
    X, y = D.synthetic(600, 3, noise=0.1, seed=2)
    np.testing.assert_allclose(ds.X_test, (X[500:] - ds.x_mean) / ds.x_std, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ds.unstandardize_y(ds.y_test), y[500:], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Download (offline: a local HTTP server, or file:// URLs, serving copies of the shipped sets)
# ---------------------------------------------------------------------------------------------------------------

SHIPPED_DIR = D.SHIPPED_DIR


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _files(folder: Path) -> set[str]:
    """Every file and folder below ``folder``, hidden ones included: what a download left behind."""
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*")} if folder.exists() else set()


def _mirror(tmp_path: Path, names) -> Path:
    src = tmp_path / "mirror"
    for name in names:
        shutil.copytree(SHIPPED_DIR / name, src / name)
    return src


@pytest.fixture
def server(tmp_path):
    """An HTTP server on localhost serving ``tmp_path/mirror``; ``.requests`` lists the paths asked for."""
    root = tmp_path / "mirror"
    root.mkdir(exist_ok=True)
    requests = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, format, *args):
            requests.append(self.path)

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.requests = requests
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def test_pins_cover_every_default_file_and_match_the_shipped_copies():
    pins = downloads._pinned_sha256()
    for name in D.UCI_NAMES:
        assert f"{name}/test_mask.csv.gz" in pins, name
        if name not in D.LARGE_UCI_NAMES:
            assert f"{name}/data.csv.gz" in pins, name
    assert all(re.fullmatch(r"[0-9a-f]{64}", h) for h in pins.values())
    for name in D.SHIPPED:
        for f in ("data.csv.gz", "test_mask.csv.gz"):
            assert pins[f"{name}/{f}"] == _sha256(SHIPPED_DIR / name / f)


@needs_shared
def test_pins_match_the_shared_copies():
    pins = downloads._pinned_sha256()
    present = [rel for rel in pins if (SHARED_UCI / rel).is_file()]
    assert len(present) >= 2 * (len(D.UCI_NAMES) - len(D.LARGE_UCI_NAMES))
    for rel in present:
        assert _sha256(SHARED_UCI / rel) == pins[rel], rel


def test_download_over_http(no_data_env, tmp_path, server):
    _mirror(tmp_path, ["yacht", "energy"])
    data_dir = D.download(tmp_path / "dl", names=["yacht", "energy"], base_url=server.url, progress=False)
    assert data_dir == tmp_path / "dl"
    expected = {"yacht", "energy"} | {f"{n}/{f}" for n in ("yacht", "energy") for f in (D.DATA_FILE, D.MASK_FILE)}
    assert _files(data_dir) == expected  # nothing else: no temporary files or folders
    for rel in expected - {"yacht", "energy"}:
        assert (data_dir / rel).read_bytes() == (SHIPPED_DIR / rel).read_bytes()
        (data_dir / "probe").touch()
        assert (data_dir / rel).stat().st_mode & 0o777 == (data_dir / "probe").stat().st_mode & 0o777  # not 0600
        (data_dir / "probe").unlink()
    assert D.find_dataset("yacht", data_dir) == data_dir / "yacht"
    ds = D.load_uci("energy", data_dir=data_dir)
    assert ds.n_train + ds.n_test == D.UCI_SIZES["energy"][0]

    # Present files that match their checksum are not fetched again; overwrite=True fetches them anyway.
    server.requests.clear()
    D.download(data_dir=data_dir, names="yacht", base_url=server.url, progress=False)
    assert server.requests == []
    D.download(data_dir=data_dir, names="yacht", base_url=server.url, progress=False, overwrite=True)
    assert sorted(server.requests) == ["/yacht/data.csv.gz", "/yacht/test_mask.csv.gz"]
    # A damaged local file is replaced.
    (data_dir / "yacht" / D.DATA_FILE).write_bytes(b"damaged")
    server.requests.clear()
    D.download(data_dir=data_dir, names="yacht", base_url=server.url, progress=False)
    assert server.requests == ["/yacht/data.csv.gz"]
    assert (data_dir / "yacht" / D.DATA_FILE).read_bytes() == (SHIPPED_DIR / "yacht" / D.DATA_FILE).read_bytes()


def test_download_file_url(no_data_env, tmp_path):
    base = _mirror(tmp_path, ["yacht"]).as_uri()
    data_dir = D.download(tmp_path / "dl", names=["yacht"], base_url=base, progress=False)
    assert _files(data_dir) == {"yacht", "yacht/data.csv.gz", "yacht/test_mask.csv.gz"}
    with pytest.raises(FileNotFoundError, match="base_url"):
        D.download(tmp_path / "dl", names=["energy"], base_url=base, progress=False)
    assert _files(data_dir) == {"yacht", "yacht/data.csv.gz", "yacht/test_mask.csv.gz"}


def test_download_default_data_dir_and_progress(no_data_env, tmp_path, monkeypatch, server, capsys):
    _mirror(tmp_path, ["yacht", "energy"])
    monkeypatch.setenv("GPFAST_DATA", str(tmp_path / "env"))
    assert D.download(names="yacht", base_url=server.url + "/", progress=True) == tmp_path / "env"
    assert (tmp_path / "env" / "yacht" / "data.csv.gz").is_file()
    assert D.find_dataset("yacht") == tmp_path / "env" / "yacht"
    assert capsys.readouterr().err == ""  # stderr is no terminal here: no bar in a log
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    D.download(names="energy", base_url=server.url + "/", progress=True)
    assert "energy/data.csv.gz" in capsys.readouterr().err  # on a terminal, the progress bar names the file


def test_download_of_a_shipped_set_copies_the_package_files(no_data_env, tmp_path, monkeypatch):
    import requests

    def no_network(*args, **kwargs):
        raise AssertionError("download went to the network for a set that ships with the package")

    monkeypatch.setattr(requests, "get", no_network)
    monkeypatch.setattr(requests.Session, "request", no_network)
    data_dir = D.download(tmp_path / "dl", names=["yacht", "concrete"], progress=False)
    for name in ("yacht", "concrete"):
        for fname in (D.DATA_FILE, D.MASK_FILE):
            assert (data_dir / name / fname).read_bytes() == (D.SHIPPED_DIR / name / fname).read_bytes()


def test_dest_is_a_deprecated_alias_of_data_dir(no_data_env, tmp_path, server):
    _mirror(tmp_path, ["yacht"])
    with pytest.warns(FutureWarning, match="data_dir"):
        out = D.download(dest=tmp_path / "dl", names=["yacht"], base_url=server.url, progress=False)
    assert out == tmp_path / "dl" and (out / "yacht" / D.DATA_FILE).is_file()
    with pytest.raises(TypeError, match="data_dir"):
        D.download(tmp_path / "a", dest=tmp_path / "b", names=["yacht"], base_url=server.url, progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert next(iter(inspect.signature(D.download).parameters)) == "data_dir"


def test_checksum_mismatch_names_the_file_and_leaves_nothing(no_data_env, tmp_path, server):
    mirror = _mirror(tmp_path, ["yacht"])
    # Another gzip file (as if changed upstream, or a wrong mirror); the mask is fine and arrives first.
    with gzip.open(mirror / "yacht" / D.DATA_FILE, "wt") as f:
        f.write("1,2,3\n")
    seen = _sha256(mirror / "yacht" / D.DATA_FILE)
    expected = downloads._pinned_sha256()["yacht/data.csv.gz"]
    target = tmp_path / "new" / "dl"
    with pytest.raises(ValueError) as info:
        D.download(target, names=["yacht"], base_url=server.url, progress=False)
    msg = str(info.value)
    assert "yacht/data.csv.gz" in msg and f"expected {expected}" in msg and f"got {seen}" in msg
    assert not (tmp_path / "new").exists()  # no empty folder, not even the parent it created
    # Into a folder that exists and holds a good copy: overwrite fails and leaves both files as they were.
    good = tmp_path / "good"
    shutil.copytree(SHIPPED_DIR / "yacht", good / "yacht")
    before = _files(good)
    with pytest.raises(ValueError, match="SHA-256"):
        D.download(good, names=["yacht"], base_url=server.url, progress=False, overwrite=True)
    assert _files(good) == before
    for f in (D.DATA_FILE, D.MASK_FILE):
        assert (good / "yacht" / f).read_bytes() == (SHIPPED_DIR / "yacht" / f).read_bytes()


def test_download_errors(no_data_env, tmp_path, server):
    _mirror(tmp_path, ["yacht"])
    with pytest.raises(ValueError, match="unknown"):
        D.download(tmp_path / "dl", names=["nope"], base_url=server.url, progress=False)
    with pytest.raises(FileNotFoundError, match="404"):
        D.download(tmp_path / "dl", names=["energy"], base_url=server.url, progress=False)
    assert not (tmp_path / "dl").exists()
    # A Git LFS pointer (or an HTML page) in place of the file: refused by its checksum, nothing left in place.
    (tmp_path / "mirror" / "pol").mkdir()
    (tmp_path / "mirror" / "pol" / "test_mask.csv.gz").write_text("version https://git-lfs.github.com/spec/v1\n")
    with pytest.raises(ValueError, match="pol/test_mask.csv.gz"):
        D.download(tmp_path / "dl", names=["pol"], base_url=server.url, progress=False)
    assert not (tmp_path / "dl").exists()


def test_unpinned_file_downloads_with_a_warning(no_data_env, tmp_path, server, monkeypatch):
    _mirror(tmp_path, ["yacht"])
    pins = downloads._pinned_sha256()
    del pins["yacht/data.csv.gz"]
    monkeypatch.setattr(downloads, "_pinned_sha256", lambda: pins)
    with pytest.warns(UserWarning, match="yacht/data.csv.gz has no pinned SHA-256"):
        D.download(tmp_path / "dl", names=["yacht"], base_url=server.url, progress=False)
    assert (tmp_path / "dl" / "yacht" / D.DATA_FILE).is_file()


def test_download_offline_message(no_data_env, tmp_path):
    # A port nothing listens on: connection refused, as when offline; never touches the network.
    with pytest.raises(ConnectionError, match="offline"):
        D.download(tmp_path / "dl", names=["yacht"], base_url="http://127.0.0.1:9", progress=False, timeout=5)
    assert not (tmp_path / "dl").exists()


def test_pooch_is_imported_only_by_download(monkeypatch, tmp_path):
    code = "import sys, gpfast, gpfast.datasets; assert 'pooch' not in sys.modules, 'pooch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)
    monkeypatch.setitem(sys.modules, "pooch", None)  # as where pooch is not installed
    with pytest.raises(ImportError, match="pip install pooch"):
        D.download(tmp_path / "dl", names=["yacht"], progress=False)
    assert not (tmp_path / "dl").exists()
