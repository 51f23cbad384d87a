import subprocess
import sys

import numpy as np
import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

# On this project's CPU machines (torch 2.13.0+cpu, AVX-512) the first float64 torch.exp of a process came out with
# a relative error of 3.3e-9 (later calls 2.2e-16) in about 1 process in 20 that had imported gpytorch,
# linear_operator or sklearn before it; with one call made first, none in 200. The tests' float64 references go
# through torch.exp, so this call takes that first one, before any test module imports those packages.
torch.exp(torch.zeros(4096, dtype=torch.float64))

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="no GPU")])]


def poison_allocator(device: str, nbytes: int) -> None:
    """Fill freed device memory with NaN so that an output element the kernel never writes shows up.

    PyTorch's caching allocator hands the same block to the next allocation of a similar size.
    """
    if device == "cuda" and nbytes > 0:
        buf = torch.full((nbytes // 4 + 1024,), float("nan"), device=device)
        del buf


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def assert_raises_in_a_subprocess(call: str, args: str, message: str) -> None:
    """Run ``call(args)`` (``call`` the source of a function of that name, with torch and gpfast.ops imported) in
    a fresh interpreter: it must raise a RuntimeError whose message holds ``message``, not end the process (a
    failed check that crashes fails its one case instead of ending the test run)."""
    code = (
        f"import torch, gpfast.ops as ops\n{call}"
        f"try:\n    call({args})\nexcept RuntimeError as err:\n    print('raised:', err)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "raised:" in run.stdout and message in run.stdout, (run.stdout, run.stderr)


def fresh_rng():
    """A fresh random generator each run and its seed, which goes in assertion messages so a failure can be
    replayed."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    return np.random.default_rng(seed), seed
