"""gpfast: exact Gaussian-process regression on a fused CUDA RBF kernel.

Public API: :class:`gpfast.ExactGP` (scikit-learn-style estimator), :class:`gpfast.CGSettings` (the settings of
its conjugate-gradient solves), :mod:`gpfast.kernels` (GPyTorch kernels on the fused op), :mod:`gpfast.ops` (the
fused ops), :mod:`gpfast.models` and :mod:`gpfast.datasets`.

The names are handed out on first use (PEP 562), so that ``import gpfast`` and the command line's ``--version``,
``--help``, ``datasets`` and ``download`` neither compile nor load the C++ ops: that happens when something
that needs them is first touched (``gpfast.ExactGP``, ``gpfast.kernels``, ``import gpfast.ops``, ...).
"""

from importlib import import_module

from gpfast._version import __version__

__all__ = ["CGSettings", "ExactGP", "__version__", "datasets", "kernels", "models", "ops"]

# public name -> the module that defines it (a submodule is its own home)
_HOMES = {
    "CGSettings": "gpfast.train",
    "ExactGP": "gpfast.estimator",
    "datasets": "gpfast.datasets",
    "kernels": "gpfast.kernels",
    "models": "gpfast.models",
    "ops": "gpfast.ops",
}


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'gpfast' has no attribute {name!r}")
    module = import_module(home)
    value = module if home == f"gpfast.{name}" else getattr(module, name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
