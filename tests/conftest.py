import numpy as np
import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

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


def fresh_rng():
    """A fresh random generator each run and its seed, which goes in assertion messages so a failure can be
    replayed."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    return np.random.default_rng(seed), seed
