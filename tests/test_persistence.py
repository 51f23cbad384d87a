"""Save files (gpfast/estimator/persistence.py): round trips, old formats, and every kind of bad file raising one
ValueError that names the file and what is wrong (CPU, fast)."""

import io
import json
import os
import pickle
import re
import struct
import zipfile
from pathlib import Path

import joblib
import numpy as np
import pytest
import torch

from gpfast import ExactGP
from gpfast.estimator import persistence
from gpfast.estimator.persistence import FORMAT_VERSION, HEADER_SIZE, SIGNATURE, read_state, write_state

DATA = Path(__file__).resolve().parent / "data"


def _data(seed=0, n=12, d=2, n_test=5):
    rng = np.random.default_rng(seed)
    X = rng.uniform(-2, 2, (n, d)) * np.linspace(1, 3, d) + 5.0
    y = np.sin(X[:, 0]) + 0.1 * X[:, -1] + 0.05 * rng.standard_normal(n)
    Xt = rng.uniform(-2, 2, (n_test, d)) * np.linspace(1, 3, d) + 5.0
    return X, y, Xt


def _gp(**kw):
    return ExactGP(**{"max_iter": 3, "device": "cpu", "verbose": False, "random_state": 0, **kw})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A small fitted model, its file's bytes and its predictions."""
    X, y, Xt = _data()
    gp = _gp(solver="cholesky").fit(X, y)
    path = tmp_path_factory.mktemp("saved") / "gp.gpfast"
    gp.save(path)
    return gp, path.read_bytes(), Xt, gp.predict(Xt, return_std=True)


def _load_error(path) -> str:
    with pytest.raises(ValueError) as info:
        ExactGP.load(path)
    msg = str(info.value)
    assert msg.startswith(f"cannot load {str(path)!r}: "), msg
    return msg


# ----------------------------------------------------------------------------------------------------------
# round trips
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("solver, dtype", [("cholesky", "float32"), ("cg", "float32"), ("cholesky", torch.float64)])
def test_save_load_round_trip(tmp_path, solver, dtype):
    X, y, Xt = _data(n=40, d=3)
    gp = _gp(solver=solver, dtype=dtype, max_iter=5, lengthscale_init=X.std(0)).fit(X, y)
    m, s = gp.predict(Xt, return_std=True)
    path = tmp_path / "gp.pt"
    gp.save(path)
    gp2 = ExactGP.load(path)
    expected_params = {**gp.get_params(), "lengthscale_init": list(X.std(0))}
    if isinstance(dtype, torch.dtype):
        expected_params["dtype"] = "float64"
    assert gp2.get_params() == expected_params
    for attr in (
        "solver_",
        "history_",
        "n_iter_",
        "y_mean_",
        "y_std_",
        "noise_",
        "outputscale_",
        "constant_mean_",
        "log_marginal_likelihood_",
        "log_marginal_likelihood_method_",
        "n_features_in_",
    ):
        assert getattr(gp2, attr) == getattr(gp, attr), attr
    for attr in ("x_mean_", "x_std_", "lengthscale_"):
        np.testing.assert_array_equal(getattr(gp2, attr), getattr(gp, attr))
    assert torch.equal(gp2.X_train_, gp.X_train_) and torch.equal(gp2.y_train_, gp.y_train_)
    m2, s2 = gp2.predict(Xt, return_std=True)
    np.testing.assert_array_equal(m2, m)
    np.testing.assert_array_equal(s2, s)
    version, state = read_state(path)
    assert version == FORMAT_VERSION == state["format_version"] == 2
    assert state["gpfast_version"] and state["solver_"] == solver
    gp2.fit(X, y)  # a loaded estimator can be refitted


def _fitted(gp) -> dict:
    return {k: v for k, v in vars(gp).items() if k.endswith("_") and not k.startswith("_")}


@pytest.mark.parametrize("solver", ["cholesky", "cg"])
def test_save_load_keeps_every_fitted_attribute(tmp_path, solver):
    """Every attribute that fit sets comes back equal, the engine's records (cg) and the restarts' losses too."""
    X, y, _ = _data(n=40, d=3)
    gp = _gp(solver=solver, max_iter=4, n_restarts=1).fit(X, y)
    gp.save(tmp_path / "gp.gpfast")
    before, after = _fitted(gp), _fitted(ExactGP.load(tmp_path / "gp.gpfast"))
    assert sorted(after) == sorted(before)
    names = (
        "trainer_",
        "optimizer_",
        "converged_",
        "restart_losses_",
        "cg_iterations_",
        "step_seconds_",
        "fit_seconds_",
    )
    for name in names:
        assert name in before, name  # the documented attributes this test is about
    # the first start, the random one and, on the exact path, the low-noise start: the data's noise (0.05 ** 2) is
    # below 1e-2 x var(y), where the first run ends
    assert len(before["restart_losses_"]) == 2 + (solver == "cholesky")
    assert (before["cg_iterations_"] is None) == (solver == "cholesky")
    for name, value in before.items():
        if isinstance(value, torch.nn.Module):
            saved_sd, loaded_sd = value.state_dict(), after[name].state_dict()
            assert saved_sd.keys() == loaded_sd.keys(), name
            assert all(torch.equal(saved_sd[k], loaded_sd[k]) for k in saved_sd), name
        elif torch.is_tensor(value):
            assert torch.equal(after[name], value), name
        else:
            assert type(after[name]) is type(value), name
            np.testing.assert_equal(after[name], value, err_msg=name)


def test_file_layout_header_and_checksum(saved):
    import hashlib

    data = saved[1]
    signature, version, length, digest = struct.unpack_from("<8sIQ32s", data)
    assert signature == SIGNATURE == b"\x89GPFAST\n" and version == 2 and HEADER_SIZE == 52
    assert length == len(data) - HEADER_SIZE
    assert digest == hashlib.sha256(data[:20] + data[HEADER_SIZE:]).digest()
    state = torch.load(io.BytesIO(data[HEADER_SIZE:]), weights_only=True)  # the payload is plain torch data
    assert state["format"] == "gpfast.ExactGP"


def _saved_and_loaded(gp) -> ExactGP:
    buf = io.BytesIO()
    gp.save(buf)
    buf.seek(0)
    return ExactGP.load(buf)


def test_file_objects(saved):
    gp, _, Xt, (m, _) = saved
    np.testing.assert_array_equal(_saved_and_loaded(gp).predict(Xt), m)


@pytest.mark.filterwarnings("ignore:X does not have valid feature names")
def test_feature_names(tmp_path):
    """Without pandas, tests/test_cli.py keeps the round trip of the names that `gpfast fit --csv` records."""
    pd = pytest.importorskip("pandas")
    X, y, Xt = _data()
    gp = _gp().fit(pd.DataFrame(X, columns=["a", "b"]), y)
    gp2 = _saved_and_loaded(gp)
    assert list(gp2.feature_names_in_) == ["a", "b"]
    np.testing.assert_array_equal(gp2.predict(Xt), gp.predict(Xt))


def test_save_is_atomic_and_keeps_the_umask_mode(tmp_path, saved):
    gp = saved[0]
    path = tmp_path / "gp.pt"
    path.write_bytes(b"the previous model")
    gp.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["gp.pt"]  # no temporary file left
    mask = os.umask(0)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask
    assert [p.name for p in tmp_path.iterdir()] == ["gp.pt"]


def test_save_creates_missing_folders(tmp_path, saved):
    gp, _, Xt, (m, s) = saved
    path = tmp_path / "newdir" / "sub" / "m.gpfast"
    gp.save(path)
    assert [p.name for p in path.parent.iterdir()] == ["m.gpfast"]  # no temporary file left
    m2, s2 = ExactGP.load(path).predict(Xt, return_std=True)
    np.testing.assert_array_equal(m2, m)
    np.testing.assert_array_equal(s2, s)


@pytest.mark.parametrize("fmt", ["format0", "format1"])
def test_old_formats_still_load(fmt):
    """Files written by gpfast 0.1.0 (format 0) and by 0.2.0 before the header (format 1) load and predict as
    they did when saved."""
    meta = json.loads((DATA / "legacy_models.json").read_text())
    path = DATA / meta[fmt]["file"]
    assert read_state(path)[0] == int(fmt[-1])
    gp = ExactGP.load(path)
    m, s = gp.predict(np.asarray(meta["X_test"]), return_std=True)
    np.testing.assert_allclose(m, meta[fmt]["mean"], rtol=1e-12)
    np.testing.assert_allclose(s, meta[fmt]["std"], rtol=1e-12)
    # what these files never held is unknown (None), not missing
    assert all(getattr(gp, name) is None for name in ("trainer_", "optimizer_", "converged_", "restart_losses_"))
    assert gp.lengthscale_.shape == (2,) and gp.noise_ > 0


@pytest.mark.parametrize("every, expected", [(3, ("old.ckpt", 3)), (10, "old.ckpt")])
def test_files_with_the_removed_checkpoint_every_load(tmp_path, saved, every, expected):
    """Files written while ``checkpoint_every`` was an argument of its own load with it folded into
    ``checkpoint``."""
    gp, data, Xt, (m, s) = saved
    _, state = read_state(io.BytesIO(data))
    state["params"].update(checkpoint="old.ckpt", checkpoint_every=every)
    path = tmp_path / "gp.pt"
    write_state(state, path)
    gp2 = ExactGP.load(path)
    assert gp2.get_params() == {**gp.get_params(), "checkpoint": expected}
    m2, s2 = gp2.predict(Xt, return_std=True)
    np.testing.assert_array_equal(m2, m)
    np.testing.assert_array_equal(s2, s)


def test_checkpoint_with_its_interval_round_trips(tmp_path, saved):
    gp = pickle.loads(pickle.dumps(saved[0]))  # a copy: the fixture is shared
    path = tmp_path / "gp.pt"
    gp.set_params(checkpoint=(tmp_path / "fit.ckpt", 4)).save(path)
    assert ExactGP.load(path).get_params()["checkpoint"] == (str(tmp_path / "fit.ckpt"), 4)


def test_load_cuda_file_without_cuda_falls_back_to_cpu(tmp_path, saved):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    gp, data, Xt, _ = saved
    _, state = read_state(io.BytesIO(data))
    state["device_"] = "cuda:0"
    state["params"]["device"] = "cuda"
    path = tmp_path / "gp.pt"
    write_state(state, path)
    with pytest.warns(UserWarning, match="CUDA is unavailable, loading on the CPU"):
        gp2 = ExactGP.load(path)
    assert gp2.device_.type == "cpu" and gp2.device == "cpu"
    np.testing.assert_array_equal(gp2.predict(Xt), gp.predict(Xt))


# ----------------------------------------------------------------------------------------------------------
# damaged files
# ----------------------------------------------------------------------------------------------------------
def test_empty_file(tmp_path):
    path = tmp_path / "gp.pt"
    path.write_bytes(b"")
    assert "the file is empty (0 bytes)" in _load_error(path)


@pytest.mark.parametrize("keep", [1, 7, 8, 30, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 1, 1000, -1])
def test_truncated_file(tmp_path, saved, keep):
    data = saved[1]
    path = tmp_path / "gp.pt"
    path.write_bytes(data[:keep])
    assert "the file is truncated" in _load_error(path)


def test_truncated_old_format_file(tmp_path):
    data = (DATA / "model_format1_gpfast0.2.0.pt").read_bytes()
    path = tmp_path / "gp.pt"
    for keep in (4, 100, len(data) // 2, len(data) - 1):
        path.write_bytes(data[:keep])
        assert "truncated or corrupt" in _load_error(path), keep


def test_trailing_bytes_are_corrupt(tmp_path, saved):
    path = tmp_path / "gp.pt"
    path.write_bytes(saved[1] + b"\0")
    assert "the file is corrupt" in _load_error(path)


def _flip(data: bytes, pos: int, bit: int) -> bytes:
    b = bytearray(data)
    b[pos] ^= 1 << bit
    return bytes(b)


def _check_flips(data, positions, bits):
    """Load ``data`` with one bit flipped, for each position and bit; in memory (a file name in the message is
    checked by the other tests), so that thousands of cases take seconds."""
    failures = []
    for pos in positions:
        for bit in bits(pos):
            try:
                ExactGP.load(io.BytesIO(_flip(data, pos, bit)))
                failures.append((pos, bit, "loaded"))
            except ValueError as exc:
                if not re.match(r"cannot load .*: the file is (corrupt|truncated)", str(exc)):
                    failures.append((pos, bit, str(exc)))
    assert not failures, failures[:5]


def test_every_single_bit_flip_is_caught(saved):
    """Exhaustive: each of the 8 bits of each byte of a saved model, flipped one at a time, is caught and reported
    as damage (about 50,000 loads, in memory)."""
    data = saved[1]
    assert len(data) < 20_000
    _check_flips(data, range(len(data)), lambda pos: range(8))


def test_bit_flips_in_files_name_the_file(tmp_path, saved):
    data = saved[1]
    path = tmp_path / "gp.pt"
    for pos in (0, 9, 15, 25, HEADER_SIZE, len(data) // 2, len(data) - 1):
        path.write_bytes(_flip(data, pos, 3))
        assert re.search("the file is (corrupt|truncated)", _load_error(path)), pos


def test_bit_flips_in_an_old_format_file_are_caught_by_the_zip_checks(tmp_path):
    """Format 1 files have no checksum, but their members' CRC-32 covers the data: flips there are caught."""
    data = (DATA / "model_format1_gpfast0.2.0.pt").read_bytes()
    path = tmp_path / "gp.pt"
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith("data.pkl"))
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)  # the local header's own
    start = info.header_offset + 30 + name_len + extra_len
    for pos in range(start, start + info.compress_size, 7):
        path.write_bytes(_flip(data, pos, pos % 8))
        assert "corrupt" in _load_error(path)


# ----------------------------------------------------------------------------------------------------------
# not a gpfast file; newer formats
# ----------------------------------------------------------------------------------------------------------
class _RunsCode:
    """Unpickling this calls Path.touch on the marker: proof that code from the file ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _foreign_files(tmp_path):
    marker = tmp_path / "code_ran"
    arr = np.arange(6.0)
    files = {
        "text": (lambda p: p.write_text("x,y\n1,2\n"), "a text file"),
        "pickle": (lambda p: p.write_bytes(pickle.dumps({"a": arr})), "a Python pickle file"),
        "pickle_code": (lambda p: p.write_bytes(pickle.dumps(_RunsCode(marker))), "a Python pickle file"),
        "joblib": (lambda p: joblib.dump({"a": arr}, p), "a joblib file"),
        "joblib_compressed": (lambda p: joblib.dump({"a": arr}, p, compress=3), "zlib-compressed"),
        "npy": (lambda p: np.save(p, arr), "a NumPy .npy file"),
        "npz": (lambda p: np.savez(p, a=arr), "a zip archive (such as an .npz file)"),
        "torch_tensor": (lambda p: torch.save(torch.zeros(3), p), "torch file holding a Tensor"),
        "torch_dict": (lambda p: torch.save({"something": 1}, p), "a dict without a format='gpfast.ExactGP'"),
        "torch_code": (lambda p: torch.save({"x": _RunsCode(marker)}, p), "holding Python objects"),
        "binary": (lambda p: p.write_bytes(bytes(range(256))), "an unrecognised binary file"),
    }
    return marker, files


@pytest.mark.parametrize(
    "kind",
    [
        "text",
        "pickle",
        "pickle_code",
        "joblib",
        "joblib_compressed",
        "npy",
        "npz",
        "torch_tensor",
        "torch_dict",
        "torch_code",
        "binary",
    ],
)
def test_not_a_gpfast_file(tmp_path, kind):
    marker, files = _foreign_files(tmp_path)
    write, expected = files[kind]
    path = tmp_path / f"model_{kind}"
    write(path)
    path = next(tmp_path.glob(f"model_{kind}*"))  # np.save adds .npy, np.savez .npz
    msg = _load_error(path)
    assert expected in msg, msg
    if kind not in ("torch_code", "binary", "text"):
        assert "not a gpfast model file" in msg
    assert not marker.exists(), "loading ran code from the file"


def test_newer_format_versions(tmp_path, saved):
    _, state = read_state(io.BytesIO(saved[1]))
    path = tmp_path / "gp.pt"
    write_state({**state, "format_version": 3}, path, format_version=3)
    msg = _load_error(path)
    assert "written in gpfast file format 3, by a newer gpfast" in msg and f"formats 0 to {FORMAT_VERSION}" in msg
    # a bare torch file (the layout of formats 0 and 1) claiming a newer format
    torch.save({**state, "format_version": 99, "gpfast_version": "9.9"}, path)
    assert "written in gpfast file format 99 (by gpfast 9.9)" in _load_error(path)
    torch.save({**state, "format_version": 2}, path)
    assert "start with a gpfast header, and this one does not" in _load_error(path)
    del state["format_version"]
    torch.save({**state, "version": "99.0"}, path)  # the old layout, from an unknown gpfast
    assert re.search(r"saved by gpfast version '99.0'.*readable versions", _load_error(path))
    torch.save(state, path)
    assert "no 'format_version' (or legacy 'version') entry" in _load_error(path)


# ----------------------------------------------------------------------------------------------------------
# inconsistent contents (intact files whose entries disagree)
# ----------------------------------------------------------------------------------------------------------
def _edit(state, key, value):
    state = {**state, "model_state_dict": dict(state["model_state_dict"]), "params": dict(state["params"])}
    if key.startswith("model_state_dict."):
        sub = key.split(".", 1)[1]
        if value is None:
            del state["model_state_dict"][sub]
        else:
            state["model_state_dict"][sub] = value
    elif key.startswith("params."):
        state["params"][key.split(".", 1)[1]] = value
    elif value is None:
        del state[key]
    else:
        state[key] = value
    return state


LS = "covar_module.base_kernel.raw_lengthscale"


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("X_train_", torch.zeros(12, 3, dtype=torch.float64), r"X_train_ has shape \(12, 3\); expected \(n, 2\)"),
        ("X_train_", torch.zeros(12, dtype=torch.float64), r"X_train_ has shape \(12,\)"),
        ("X_train_", [[1.0, 2.0]], "X_train_ must be a floating-point tensor"),
        ("y_train_", torch.zeros(11, dtype=torch.float64), r"y_train_ has shape \(11,\); expected \(12,\)"),
        ("n_features_in_", 3, r"X_train_ has shape \(12, 2\); expected \(n, 3\)"),
        ("n_features_in_", "2", "n_features_in_ must be an int"),
        ("x_mean_", torch.zeros(3, dtype=torch.float64), r"x_mean_ has shape \(3,\); expected \(2,\)"),
        ("x_std_", torch.zeros(2, dtype=torch.float64), "x_std_ has a value <= 0"),
        ("y_std_", 0.0, "y_std_ must be a positive finite float"),
        ("y_mean_", float("nan"), "y_mean_ must be finite"),
        ("feature_names_in_", ["a"], "feature_names_in_ must be None or a list of 2 strings"),
        ("solver_", "magic", "solver_ must be one of"),
        ("n_iter_", 7, "n_iter_ = 7 but history_ has 3 entries"),
        ("history_", None, "missing entry 'history_'"),
        ("params", [1, 2], "'params' must be a dict"),
        ("params.no_such_argument", 1, r"unknown argument\(s\) \['no_such_argument'\]"),
        ("params.solver", "magic", r"its parameters are invalid \(ExactGP: invalid solver='magic'"),
        (
            "params.ard",
            False,
            r"model_state_dict\['covar_module.base_kernel.raw_lengthscale'\] has shape \(1, 2\); "
            r"the model expects \(1, 1\)",
        ),
        ("params.dtype", "float64", "dtype_ = 'float32' but params\\['dtype'\\] = 'float64'"),
        ("device_", "gpu please", "device_ = 'gpu please' is not a device"),
        (
            f"model_state_dict.{LS}",
            torch.zeros(1, 3),
            r"raw_lengthscale'\] has shape \(1, 3\); the model expects \(1, 2\)",
        ),
        (f"model_state_dict.{LS}", None, r"model_state_dict lacks \['covar_module.base_kernel.raw_lengthscale'\]"),
        ("model_state_dict.extra", torch.zeros(1), r"has unexpected \['extra'\]"),
        (f"model_state_dict.{LS}", torch.tensor([[float("nan"), 1.0]]), r"raw_lengthscale'\] holds NaN or infinite"),
        ("format_version", 1, "its header says format 2, its data say 1"),
        ("fitted", [1], "fitted must be a dict of fitted attribute names"),
        ("fitted", {"converged": True}, "fitted has the entry 'converged', not the name of a fitted attribute"),
        ("fitted", {"_posterior_": 1.0}, "fitted has the entry '_posterior_', not the name of a fitted attribute"),
        ("fitted", {"X_train_": [1.0]}, "fitted has the entry 'X_train_', which the file holds in an entry of its own"),
        ("fitted", {"converged_": torch.zeros(1)}, r"fitted\['converged_'\] must be one of plain values"),
        ("fitted_arrays", {"lengthscale_": [1.0, 2.0]}, r"fitted_arrays\['lengthscale_'\] must be one of tensors"),
    ],
)
def test_inconsistent_contents(tmp_path, saved, key, value, expected):
    _, state = read_state(io.BytesIO(saved[1]))
    path = tmp_path / "gp.pt"
    write_state(_edit(state, key, value), path)
    msg = _load_error(path)
    assert re.search(expected, msg), msg


def test_legacy_reader_accepts_what_the_writer_wrote(saved):
    """read_state gives back exactly the state that save wrote (a sanity check of the test helpers above)."""
    version, state = read_state(io.BytesIO(saved[1]))
    buf = io.BytesIO()
    write_state(state, buf)
    assert buf.getvalue()[:8] == SIGNATURE
    assert read_state(io.BytesIO(buf.getvalue()))[1].keys() == state.keys()
    assert persistence.FORMAT == state["format"]
