"""The build cache of gpfast._build: its key, one build across processes, failures that leave nothing, pruning.

Most tests drive the cache with a stand-in compile step (a function writing a small file) and a stand-in source
folder; the two marked slow compile the real library, twice, in subprocesses.
"""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gpfast import _build

KEY = "0123456789abcdef"
BUILD_PY = Path(_build.__file__)


def _make_csrc(folder: Path) -> Path:
    """A stand-in source tree with one file of each kind that enters the key."""
    for rel, text in {
        "ops.cpp": "// ops\n",
        "common.h": "// common\n",
        "cpu/rbf.cpp": "// rbf\n",
        "cuda/rbf.cu": "// cu\n",
        "cuda/kernels.cuh": "// cuh\n",
    }.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)
    return folder


def _config(**changes):
    config = {
        "torch": "2.13.0+cpu",
        "torch_cuda": None,
        "with_cuda": False,
        "cuda_arch": None,
        "cflags": ["-O3"],
        "cuda_cflags": None,
        "ldflags": ["-fopenmp"],
        "machine": "x86_64",
    }
    config.update(changes)
    return config


def _stand_in_compile(calls: list):
    def compile_into(folder: Path) -> Path:
        calls.append(folder)
        assert folder.is_dir() and not any(folder.iterdir())  # a fresh private folder
        (folder / "scratch.o").write_text("object file")
        (folder / "lib_v1.so").write_text("library")
        return folder / "lib_v1.so"

    return compile_into


# ---------------------------------------------------------------------------------------------------------------
# The key
# ---------------------------------------------------------------------------------------------------------------


def test_key_ignores_location_times_and_other_files(tmp_path):
    a = _make_csrc(tmp_path / "a")
    key = _build.cache_key(_config(), a)
    assert re.fullmatch(r"[0-9a-f]{16}", key)
    b = tmp_path / "elsewhere" / "b"
    shutil.copytree(a, b)
    for path in b.rglob("*"):
        os.utime(path, (1_000_000, 1_000_000))
    (b / "README.md").write_text("notes")
    (b / "cpu" / "rbf.o").write_bytes(b"\0\1")
    (b / "build.ninja").write_text("rule cc")
    assert _build.cache_key(_config(), b) == key


@pytest.mark.parametrize("rel", ["ops.cpp", "common.h", "cpu/rbf.cpp", "cuda/rbf.cu", "cuda/kernels.cuh"])
def test_key_changes_with_any_source(tmp_path, rel):
    csrc = _make_csrc(tmp_path)
    key = _build.cache_key(_config(), csrc)
    with open(csrc / rel, "a") as f:
        f.write("// a comment\n")
    assert _build.cache_key(_config(), csrc) != key


def test_key_changes_when_a_source_is_added_or_renamed(tmp_path):
    csrc = _make_csrc(tmp_path)
    key = _build.cache_key(_config(), csrc)
    (csrc / "cpu" / "extra.h").write_text("")
    with_extra = _build.cache_key(_config(), csrc)
    assert with_extra != key
    (csrc / "cpu" / "extra.h").rename(csrc / "cpu" / "other.h")
    assert _build.cache_key(_config(), csrc) not in (key, with_extra)
    (csrc / "cpu" / "other.h").unlink()
    assert _build.cache_key(_config(), csrc) == key


@pytest.mark.parametrize(
    "change",
    [
        {"torch": "2.14.0+cpu"},
        {"torch_cuda": "12.8"},
        {"with_cuda": True},
        {"cuda_arch": "9.0"},
        {"cflags": ["-O2"]},
        {"cflags": ["-O3", "-march=native"]},
        {"cuda_cflags": ["-O3"]},
        {"ldflags": []},
        {"machine": "aarch64"},
    ],
)
def test_key_changes_with_flags_and_versions(tmp_path, change):
    csrc = _make_csrc(tmp_path)
    assert _build.cache_key(_config(**change), csrc) != _build.cache_key(_config(), csrc)


def test_config_holds_the_versions_and_flags():
    cflags, cuda_flags, ldflags = _build._compiler_flags(verbose=False)
    cpu = _build._build_config(with_cuda=False)
    assert cpu["torch"] == torch.__version__ and cpu["torch_cuda"] == torch.version.cuda
    assert cpu["with_cuda"] is False and cpu["cuda_arch"] is None and cpu["cuda_cflags"] is None
    assert cpu["cflags"] == cflags and cpu["ldflags"] == ldflags and "-fopenmp" in cflags
    # --verbose changes no key: CUDA builds always ask ptxas for its report (so that a verbose prebuild and the
    # build a later import wants are the same build), and a CPU build has no ptxas
    assert _build._build_config(with_cuda=False, verbose=True) == cpu
    assert "-Xptxas=-v" in cuda_flags and _build._compiler_flags(verbose=True) == (cflags, cuda_flags, ldflags)


def test_every_source_enters_the_key():
    names = {p.relative_to(_build.CSRC).as_posix() for p in _build._source_files(_build.CSRC)}
    on_disk = {
        p.relative_to(_build.CSRC).as_posix()
        for p in _build.CSRC.rglob("*")
        if p.suffix in (".cpp", ".cu", ".cuh", ".h")
    }
    assert names == on_disk
    assert {"ops.cpp", "common.h", "cpu/rbf.cpp", "cuda/covariance_tile.cuh", "cuda/dispatch.h"} <= names
    built = {Path(s).relative_to(_build.CSRC).as_posix() for s in _build._sources(with_cuda=True)}
    assert built <= names


def test_cache_root_and_build_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("GPFAST_BUILD_DIR", str(tmp_path / "cache"))
    assert _build.cache_root() == tmp_path / "cache"
    assert _build.build_dir().parent == tmp_path / "cache"
    assert _build.build_dir().name == _build.cache_key(_build._build_config(_build.cuda_build_possible()))
    assert not (tmp_path / "cache").exists()  # asking where is no reason to create anything
    monkeypatch.delenv("GPFAST_BUILD_DIR")
    assert _build.cache_root() == Path.home() / ".cache" / "gpfast" / "build"


# ---------------------------------------------------------------------------------------------------------------
# One build, under a lock, into a private folder
# ---------------------------------------------------------------------------------------------------------------


def test_builds_once_then_reuses(tmp_path, capfd):
    calls = []
    path, built = _build._build_once(tmp_path, KEY, "lib.so", _stand_in_compile(calls), "stand-in", "no time")
    assert (path, built) == (tmp_path / KEY / "lib.so", True)
    assert path.read_text() == "library" and (tmp_path / KEY / "scratch.o").is_file()
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "gpfast: compiling the stand-in ops" in err and "no time" in err and KEY in err
    assert _build._build_once(tmp_path, KEY, "lib.so", _stand_in_compile(calls), "stand-in", "") == (path, False)
    assert len(calls) == 1 and capfd.readouterr().err == ""
    assert not list(tmp_path.glob(".*tmp*"))


def test_failed_build_leaves_nothing(tmp_path):
    def broken(folder: Path) -> Path:
        (folder / "half.o").write_text("half")
        raise RuntimeError("error: expected ';'")

    with pytest.raises(RuntimeError, match="expected"):
        _build._build_once(tmp_path, KEY, "lib.so", broken, "stand-in", "")
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{KEY}.lock"]
    calls = []
    path, built = _build._build_once(tmp_path, KEY, "lib.so", _stand_in_compile(calls), "stand-in", "")
    assert built and path.is_file()


def test_leftovers_of_a_killed_build_are_cleared(tmp_path):
    # A build killed mid-way: its private folder, with torch's baton file still in it, and (made by hand) an entry
    # without its library. Neither blocks nor poisons the next build.
    stale = tmp_path / f".{KEY}.tmp-999-dead"
    stale.mkdir()
    (stale / "lock").write_text("")
    (tmp_path / KEY).mkdir()
    (tmp_path / KEY / "junk").write_text("")
    calls = []
    _, built = _build._build_once(tmp_path, KEY, "lib.so", _stand_in_compile(calls), "stand-in", "")
    assert built and len(calls) == 1
    assert not stale.exists() and not (tmp_path / KEY / "junk").exists()


def test_lock_held_elsewhere_times_out_with_its_name(tmp_path, monkeypatch, capfd):
    from filelock import FileLock

    monkeypatch.setattr(_build, "_LOCK_TIMEOUT_S", 0.3)
    lock_file = tmp_path / f"{KEY}.lock"
    # Another open of the lock file conflicts with ours as another process's would (flock locks open files).
    with FileLock(str(lock_file)), pytest.raises(_build.BuildError, match=re.escape(str(lock_file))):
        _build._build_once(tmp_path, KEY, "lib.so", _stand_in_compile([]), "stand-in", "")
    assert "waiting for another process" in capfd.readouterr().err
    assert not (tmp_path / KEY).exists()


_CONCURRENT = """
import importlib.util, sys, time
from pathlib import Path
spec = importlib.util.spec_from_file_location("gpfast_build_under_test", sys.argv[1])
build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build)
root, me, n = Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])

def compile_into(folder):
    with open(root / "compiles.txt", "a") as f:
        f.write(f"{me}\\n")
    time.sleep(1.5)
    (folder / "lib.so").write_text(f"built by {me}")
    return folder / "lib.so"

# Start together: every process signs in, then waits for all the others.
(root / f"ready-{me}").touch()
while len(list(root.glob("ready-*"))) < n:
    time.sleep(0.01)
path, built = build._build_once(root, "0123456789abcdef", "lib.so", compile_into, "stand-in", "1.5 s")
print(path, built, path.read_text())
"""


def test_processes_building_at_once_build_once(tmp_path):
    n = 2
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CONCURRENT, str(BUILD_PY), str(tmp_path), str(i), str(n)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(n)
    ]
    results = [p.communicate(timeout=120) + (p.returncode,) for p in procs]
    for out, err, rc in results:
        assert rc == 0, err
    compiles = (tmp_path / "compiles.txt").read_text().split()
    assert len(compiles) == 1
    lines = [out.split() for out, _, _ in results]
    assert {line[0] for line in lines} == {str(tmp_path / KEY / "lib.so")}
    assert sorted(line[1] for line in lines) == ["False"] * (n - 1) + ["True"]
    assert {line[-1] for line in lines} == {compiles[0]}
    assert sum("waiting for another process" in err for _, err, _ in results) >= 1
    assert sum("gpfast: compiling the stand-in ops" in err for _, err, _ in results) == 1
    assert not list(tmp_path.glob(".*tmp*"))


# ---------------------------------------------------------------------------------------------------------------
# load() and prune()
# ---------------------------------------------------------------------------------------------------------------


def test_load_is_idempotent_and_cheap():
    _build.load()
    (library,) = _build._loaded.values()
    assert library.is_file() and library.parent.parent == _build.cache_root()
    assert library.parent == _build.build_dir()
    assert hasattr(torch.ops.gpfast, "rbf_covariance")
    start = time.perf_counter()
    for _ in range(1000):
        _build.load()
    assert time.perf_counter() - start < 0.5  # about 1 us a call; the bound is for slow shared machines


def test_compile_error_is_a_build_error_and_leaves_nothing(tmp_path, monkeypatch):
    csrc = tmp_path / "csrc"
    (csrc / "cpu").mkdir(parents=True)
    (csrc / "ops.cpp").write_text("this is not C++;\n")
    (csrc / "cpu" / "rbf.cpp").write_text("int f() { return 0; }\n")
    monkeypatch.setattr(_build, "CSRC", csrc)
    monkeypatch.setattr(_build, "_loaded", {})
    monkeypatch.setenv("GPFAST_BUILD_DIR", str(tmp_path / "cache"))
    with pytest.raises(_build.BuildError) as info:
        _build.load()
    msg = str(info.value)
    assert "this is not C++" in msg or "ops.cpp" in msg
    assert str(tmp_path / "cache") in msg and "--verbose" in msg
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [f"{_build.build_dir().name}.lock"]


def test_prune_keeps_recent_current_and_locked_entries(tmp_path, monkeypatch, capsys):
    _build.load()  # from the real cache, before it moves: main() below must find the library loaded
    monkeypatch.setenv("GPFAST_BUILD_DIR", str(tmp_path))
    current = _build.build_dir().name
    old = time.time() - 40 * 86400
    names = {"current": current, "old": "a" * 16, "recent": "b" * 16, "locked": "c" * 16}
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "gpfast_C_cpu.so").write_text("")
        (tmp_path / name / "last-used").touch()
    for label in ("current", "old", "locked"):
        os.utime(tmp_path / names[label] / "last-used", (old, old))
        os.utime(tmp_path / names[label], (old, old))
    (tmp_path / "2.13.0_cpu_cpu").mkdir()  # an old-style folder: left alone
    os.utime(tmp_path / "2.13.0_cpu_cpu", (old, old))
    from filelock import FileLock

    with FileLock(str(tmp_path / f"{names['locked']}.lock")):
        assert _build.prune(30) == [tmp_path / names["old"]]
    left = {p.name for p in tmp_path.iterdir() if p.is_dir()}
    assert left == {current, names["recent"], names["locked"], "2.13.0_cpu_cpu"}
    with pytest.raises(ValueError, match="days"):
        _build.prune(-1)

    assert _build.main(["--prune", "0"]) == 0
    out = capsys.readouterr().out
    assert "pruned 2 cached build(s)" in out and names["recent"] in out and names["locked"] in out
    assert {p.name for p in tmp_path.iterdir() if p.is_dir()} == {current, "2.13.0_cpu_cpu"}


# ---------------------------------------------------------------------------------------------------------------
# The real library: two checkouts, and processes importing at once into an empty cache
# ---------------------------------------------------------------------------------------------------------------

_USE_OPS = """
import sys, torch
from pathlib import Path
from gpfast import _build, ops
assert _build.CSRC.parents[1] == Path.cwd(), (_build.CSRC, Path.cwd())  # this checkout, not the installed one
x = torch.randn(1, 5, 3, dtype=torch.float64)
l, s = torch.full((1, 3), 0.7, dtype=torch.float64), torch.full((1,), 2.0, dtype=torch.float64)
K = ops.rbf_covariance(x, x, l, s)
ref = s * torch.exp(-0.5 * torch.cdist(x / l, x / l) ** 2)
assert torch.allclose(K, ref, rtol=1e-10, atol=1e-12), (K, ref)
(library,) = _build._loaded.values()
print(library)
"""


def _checkout(folder: Path, comment: str | None = None) -> Path:
    shutil.copytree(BUILD_PY.parent, folder / "gpfast", ignore=shutil.ignore_patterns("__pycache__", "data"))
    if comment is not None:
        with open(folder / "gpfast" / "csrc" / "cpu" / "rbf.cpp", "a") as f:
            f.write(f"// {comment}\n")
    return folder


def _start(checkout: Path, cache: Path) -> subprocess.Popen:
    env = {**os.environ, "GPFAST_BUILD_DIR": str(cache), "PYTHONPATH": str(checkout)}
    return subprocess.Popen(
        [sys.executable, "-c", _USE_OPS],
        cwd=checkout,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen) -> tuple[Path, bool]:
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err
    return Path(out.strip().splitlines()[-1]), "gpfast: compiling" in err


@pytest.mark.slow
def test_two_checkouts_each_build_once_and_concurrent_imports_share_one_build(tmp_path):
    """Two copies of the package differing by a comment, used in turn: two builds in all. The first two
    processes start at once on an empty cache: one builds, the other waits for it and loads its library."""
    cache = tmp_path / "cache"
    a = _checkout(tmp_path / "a")
    b = _checkout(tmp_path / "b", comment="checkout b")

    first = [_start(a, cache), _start(a, cache)]
    (lib_a, built_0), (lib_a2, built_1) = (_finish(p) for p in first)
    assert lib_a == lib_a2 and [built_0, built_1].count(True) == 1
    # identical sources, wherever they sit, share one entry: this process's own checkout lands on the same key
    assert lib_a.parent.name == _build.build_dir().name

    lib_b, built = _finish(_start(b, cache))
    assert built and lib_b.parent != lib_a.parent
    for checkout, lib in ((a, lib_a), (b, lib_b)):
        assert _finish(_start(checkout, cache)) == (lib, False)

    assert sorted(p.name for p in cache.iterdir() if p.is_dir()) == sorted([lib_a.parent.name, lib_b.parent.name])
    assert not list(cache.glob(".*tmp*"))
    assert {p.name for p in lib_a.parent.iterdir()} == {lib_a.name, "build-info.json", "last-used"}
