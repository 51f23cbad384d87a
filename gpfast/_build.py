"""Find the C++/CUDA sources, JIT-build them with ninja on first use, load them once.

The compiled library is cached in ``$GPFAST_BUILD_DIR/<key>/`` (``~/.cache/gpfast/build/<key>/`` by default). The
key hashes everything that changes the binary: the contents (and relative paths) of every source under
``gpfast/csrc`` (``.cpp .cu .cuh .h``), the compiler and linker flags, torch's version, its CUDA version, whether
the CUDA ops are built and for which GPU architectures, and the machine type. Checkouts or versions with different
sources therefore each build once and never rebuild each other's library, while copies with the same sources share
one build.

A build runs under a file lock (``<key>.lock`` beside the entry) into a private temporary folder, which is renamed
to ``<key>`` once the library has compiled and loaded. So processes importing at once into an empty cache wait for
a single build; a build that fails or is killed leaves no entry behind (its temporary folder is removed by the next
builder, which also makes a stale ``lock`` baton of :mod:`torch.utils.cpp_extension` harmless: each build has its
own folder); and a cached entry is complete by construction, so loading it needs neither the lock nor ninja.

Entries are never deleted automatically; ``python -m gpfast.build --prune DAYS`` removes those no process has loaded
for ``DAYS`` days (see :func:`prune`).

CPU sources are always built; CUDA sources too when torch has CUDA and ``nvcc`` is found, for the architecture of
the GPUs present (override with ``TORCH_CUDA_ARCH_LIST``, e.g. ``9.0``).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import secrets
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCE_SUFFIXES = (".cpp", ".cu", ".cuh", ".h")
"""Files under ``csrc/`` whose contents go into the cache key."""

_lock = threading.Lock()
_loaded: dict[str, Path] = {}  # library name -> the file loaded in this process

_KEY_RE = re.compile(r"^[0-9a-f]{16}$")
_LAST_USED = "last-used"  # touched (at most hourly) whenever an entry is loaded; read by prune()
_INFO = "build-info.json"  # what an entry was built from, for a reader wondering what the folder is
_LOCK_TIMEOUT_S = 3600.0  # how long to wait for another process's build before giving up
_LIB_EXT = ".pyd" if sys.platform == "win32" else ".so"  # torch.utils.cpp_extension.LIB_EXT, without its import


class BuildError(RuntimeError):
    """The extension failed to compile or load; the message carries the compiler's output."""


def _compiler_flags(verbose: bool) -> tuple[list[str], list[str], list[str]]:
    """``(cflags, cuda_cflags, ldflags)``; every flag is part of the cache key."""
    # -fno-trapping-math lets the CPU kernels' selects (exp's underflow cut-off) become vector blends; no
    # result changes, since nothing here unmasks floating-point traps
    cflags = ["-O3", "-std=c++17", "-fopenmp", "-fno-trapping-math"]
    # no -std for nvcc: torch adds the standard its headers need (C++20 in torch 2.13, warnings under C++17).
    # -Xptxas=-v always: a --verbose build then shares the cache key and shows registers and spills per kernel.
    cuda_flags = ["-O3", "--use_fast_math", "-lineinfo", "-Xptxas=-v"]
    ldflags = ["-fopenmp"]
    return cflags, cuda_flags, ldflags


def _sources(with_cuda: bool) -> list[str]:
    srcs = [CSRC / "ops.cpp", *sorted((CSRC / "cpu").glob("*.cpp"))]
    if with_cuda:
        srcs += sorted((CSRC / "cuda").glob("*.cu"))
    return [str(s) for s in srcs]


def cuda_build_possible() -> bool:
    """True when this torch has CUDA, a GPU is visible and a CUDA compiler can be found."""
    if not (torch.version.cuda and torch.cuda.is_available()):
        return False
    from torch.utils.cpp_extension import CUDA_HOME

    return CUDA_HOME is not None or shutil.which("nvcc") is not None


def _arch_list() -> str:
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    return ";".join(f"{major}.{minor}" for major, minor in caps)


def _build_config(with_cuda: bool, verbose: bool = False) -> dict:
    """Everything besides the sources that goes into the cache key (JSON-serialisable)."""
    cflags, cuda_flags, ldflags = _compiler_flags(verbose)
    return {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "with_cuda": with_cuda,
        "cuda_arch": _arch_list() if with_cuda else None,
        "cflags": cflags,
        "cuda_cflags": cuda_flags if with_cuda else None,
        "ldflags": ldflags,
        "machine": platform.machine(),
    }


def _source_files(csrc: Path) -> list[Path]:
    return sorted(p for p in csrc.rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file())


def cache_key(config: dict, csrc: Path = CSRC) -> str:
    """16 hex digits of the SHA-256 of ``config`` and of every source file's relative path and contents.

    File times and the checkout's location do not enter, so identical sources anywhere share one build.
    """
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for path in _source_files(csrc):
        data = path.read_bytes()
        h.update(f"\0{path.relative_to(csrc).as_posix()}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:16]


def cache_root() -> Path:
    """``$GPFAST_BUILD_DIR``, else ``~/.cache/gpfast/build``: the folder holding one sub-folder per cache key."""
    root = os.environ.get("GPFAST_BUILD_DIR", "").strip()
    return Path(root).expanduser() if root else Path.home() / ".cache" / "gpfast" / "build"


def build_dir() -> Path:
    """Folder of the compiled library for these sources, flags and torch (it may not exist yet)."""
    return cache_root() / cache_key(_build_config(cuda_build_possible()))


def _touch_last_used(entry: Path) -> None:
    marker = entry / _LAST_USED
    try:
        if time.time() - marker.stat().st_mtime < 3600:
            return
    except OSError:
        pass
    try:
        marker.touch()
    except OSError:  # a read-only cache still loads
        pass


def _build_once(
    root: Path, key: str, filename: str, compile_into: Callable[[Path], Path], what: str, duration: str
) -> tuple[Path, bool]:
    """Return ``(root/key/filename, built)``, building it first when missing, once across processes.

    ``compile_into(folder)`` builds in the empty private ``folder`` and returns the path of the file it made; that
    folder becomes ``root/key`` once it returns. ``what`` ("CPU") and ``duration`` ("about 30 s") go into the one
    line printed to stderr before building (or while waiting for another process's build).
    """
    entry = root / key
    target = entry / filename
    if target.is_file():
        return target, False
    from filelock import FileLock, Timeout

    root.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(root / f"{key}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"gpfast: waiting for another process that is compiling the {what} ops into {entry}", file=sys.stderr)
        try:
            lock.acquire(timeout=_LOCK_TIMEOUT_S)
        except Timeout:
            raise BuildError(
                f"gave up after {_LOCK_TIMEOUT_S:g} s waiting for the build lock {lock.lock_file}; is another "
                "gpfast build stuck? Stop it, or build elsewhere with GPFAST_BUILD_DIR=/some/folder."
            ) from None
    try:
        if target.is_file():  # built by the process we waited for
            return target, False
        # Only the lock holder makes these, so any present are from builds that died: none is in use.
        for stale in root.glob(f".{key}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if entry.exists():  # an entry without its library was not made here (only complete folders are renamed in)
            shutil.rmtree(entry)
        print(
            f"gpfast: compiling the {what} ops into {entry} (first use of these sources; takes {duration})",
            file=sys.stderr,
            flush=True,
        )
        # Not tempfile.mkdtemp: its mode 0700 would hide a shared cache's entries from other users.
        tmp = root / f".{key}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            made = Path(compile_into(tmp))
            if made != tmp / filename:
                os.replace(made, tmp / filename)
            (tmp / _LAST_USED).touch()
            try:
                os.replace(tmp, entry)
            except OSError:
                if not target.is_file():
                    raise
                # Another builder got there first (possible only if prune() deleted the lock file meanwhile); its
                # library is as good as ours.
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename
        return target, True
    finally:
        lock.release()


def load(verbose: bool = False) -> None:
    """Build (if needed) and load the compiled ops; safe to call many times."""
    with_cuda = cuda_build_possible()
    name = "gpfast_C_cuda" if with_cuda else "gpfast_C_cpu"
    if name in _loaded:
        return
    with _lock:
        if name in _loaded:
            return
        config = _build_config(with_cuda, verbose)
        cflags, cuda_flags, ldflags = _compiler_flags(verbose)
        if with_cuda:
            os.environ["TORCH_CUDA_ARCH_LIST"] = config["cuda_arch"]
        what = "CPU+CUDA" if with_cuda else "CPU"
        duration = "a few minutes" if with_cuda else "about 30 s on 2 cores"
        sources = _sources(with_cuda)
        root = cache_root()
        key = cache_key(config)

        def compile_into(folder: Path) -> Path:
            from torch.utils.cpp_extension import load as cpp_load  # 0.3 s to import: only when building

            # torch's versioner renames the library name_v1, ... when one process builds twice; take what it made.
            cpp_load(
                name=name,
                sources=sources,
                extra_cflags=cflags,
                extra_cuda_cflags=cuda_flags if with_cuda else None,
                extra_ldflags=ldflags,
                build_directory=str(folder),
                is_python_module=False,
                verbose=verbose,
            )
            (made,) = folder.glob(f"{name}*{_LIB_EXT}")
            # Keep the library only: object files and ninja's files are of no use once it is built.
            for item in folder.iterdir():
                if item != made:
                    shutil.rmtree(item) if item.is_dir() else item.unlink()
            info = {"sources": [str(Path(s).relative_to(CSRC)) for s in sources], **config}
            (folder / _INFO).write_text(json.dumps(info, indent=1) + "\n")
            return made

        try:
            library, built = _build_once(root, key, name + _LIB_EXT, compile_into, what, duration)
            if not built:  # a fresh build was loaded by cpp_load already
                torch.ops.load_library(str(library))
        except BuildError:
            raise
        except Exception as exc:  # torch raises RuntimeError/subprocess errors with the compiler's output inside
            raise BuildError(
                f"gpfast could not build or load its compiled ops ({what}) in {root / key}.\n"
                f"Sources: {', '.join(Path(s).name for s in sources)}.\n"
                "The compiler said:\n"
                f"{exc}\n"
                "Check that a C++17 compiler (and nvcc for CUDA) is installed, or rerun with "
                "`python -m gpfast.build --verbose` to see the full build log. A cached library that no longer "
                f"loads can be deleted: rm -r {root / key}"
            ) from exc
        _touch_last_used(library.parent)
        _loaded[name] = library


def prune(days: float, root: Path | None = None) -> list[Path]:
    """Delete cache entries that no process has loaded for ``days`` days; return the folders deleted.

    Only folders named by a cache key are considered. The entry for this checkout's current sources is kept, and
    so is any entry whose build lock is held. Folders of gpfast versions before the hashed cache (named like
    ``2.13.0_cpu_cpu``) are left alone; delete them by hand.
    """
    if days < 0:
        raise ValueError(f"days must be >= 0, got {days}")
    root = cache_root() if root is None else Path(root)
    if not root.is_dir():
        return []
    from filelock import FileLock, Timeout

    keep = build_dir().name
    cutoff = time.time() - days * 86400.0
    removed = []
    for entry in sorted(root.iterdir()):
        if not (entry.is_dir() and _KEY_RE.match(entry.name)) or entry.name == keep:
            continue
        try:
            last = max(p.stat().st_mtime for p in (entry, entry / _LAST_USED) if p.exists())
        except (OSError, ValueError):  # deleted meanwhile
            continue
        if last > cutoff:
            continue
        lock = FileLock(str(root / f"{entry.name}.lock"))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            continue
        try:
            shutil.rmtree(entry)
            removed.append(entry)
        finally:
            lock.release()
        # A process that starts building this key after this point merely builds it again.
        Path(lock.lock_file).unlink(missing_ok=True)
    return removed


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m gpfast.build", description="Prebuild gpfast's compiled ops.")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's commands and output")
    parser.add_argument(
        "--prune",
        type=float,
        metavar="DAYS",
        help="also delete cached builds (of other sources or versions) that nothing has loaded for DAYS days",
    )
    args = parser.parse_args(argv)
    if args.prune is not None and args.prune < 0:
        parser.error(f"--prune takes a number of days >= 0, got {args.prune}")
    load(verbose=args.verbose)
    where = next(iter(_loaded.values())).parent
    print(f"gpfast ops built and loaded ({'CPU+CUDA' if cuda_build_possible() else 'CPU only'}) from {where}")
    if args.prune is not None:
        removed = prune(args.prune)
        print(f"pruned {len(removed)} cached build(s) unused for {args.prune:g} days from {cache_root()}")
        for entry in removed:
            print(f"  {entry}")
    return 0
