"""Find the C++/CUDA sources, JIT-build them with ninja on first use, load them once.

The build is cached by :mod:`torch.utils.cpp_extension` (in ``$GPFAST_BUILD_DIR`` or
``~/.cache/gpfast/build/<torch version>``) and rebuilt only when a source or a flag changes. CPU sources are
always built; CUDA sources too when torch has CUDA and ``nvcc`` is found, for the architecture of the GPUs
present (override with ``TORCH_CUDA_ARCH_LIST``, e.g. ``9.0``).
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
_lock = threading.Lock()
_loaded: dict[str, object] = {}


class BuildError(RuntimeError):
    """The extension failed to compile or load; the message carries the compiler's output."""


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


def build_dir() -> Path:
    root = os.environ.get("GPFAST_BUILD_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "gpfast" / "build"
    tag = torch.__version__.replace("+", "_") + ("_cu" if cuda_build_possible() else "_cpu")
    path = base / tag
    path.mkdir(parents=True, exist_ok=True)
    return path


def _arch_list() -> str:
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    return ";".join(f"{major}.{minor}" for major, minor in caps)


def load(verbose: bool = False) -> None:
    """Build (if needed) and load the compiled ops; safe to call many times."""
    with_cuda = cuda_build_possible()
    name = "gpfast_C_cuda" if with_cuda else "gpfast_C_cpu"
    if name in _loaded:
        return
    with _lock:
        if name in _loaded:
            return
        from torch.utils.cpp_extension import load as cpp_load

        # -fno-trapping-math lets the CPU kernels' selects (exp's underflow cut-off) become vector blends; no
        # result changes, since nothing here unmasks floating-point traps
        cflags = ["-O3", "-std=c++17", "-fopenmp", "-fno-trapping-math"]
        # no -std for nvcc: torch adds the standard its headers need (C++20 in torch 2.13, warnings under C++17)
        cuda_flags = ["-O3", "--use_fast_math", "-lineinfo"] + (["-Xptxas=-v"] if verbose else [])
        if with_cuda:
            os.environ["TORCH_CUDA_ARCH_LIST"] = _arch_list()
        try:
            cpp_load(
                name=name,
                sources=_sources(with_cuda),
                extra_cflags=cflags,
                extra_cuda_cflags=cuda_flags if with_cuda else None,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir()),
                is_python_module=False,
                verbose=verbose,
            )
        except Exception as exc:  # torch raises RuntimeError/subprocess errors with the compiler's output inside
            raise BuildError(
                f"gpfast could not build its compiled ops ({'CPU+CUDA' if with_cuda else 'CPU'}) in {build_dir()}.\n"
                f"Sources: {', '.join(Path(s).name for s in _sources(with_cuda))}.\n"
                "The compiler said:\n"
                f"{exc}\n"
                "Check that a C++17 compiler (and nvcc for CUDA) is installed, or rerun with "
                "`python -m gpfast.build --verbose` to see the full build log."
            ) from exc
        _loaded[name] = True


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m gpfast.build", description="Prebuild gpfast's compiled ops.")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's commands and output")
    args = parser.parse_args(argv)
    load(verbose=args.verbose)
    print(f"gpfast ops built and loaded ({'CPU+CUDA' if cuda_build_possible() else 'CPU only'}) from {build_dir()}")
    return 0
