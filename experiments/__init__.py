"""Thin scripts that produce the published tables and plots; run each as a module from the repository root, e.g.
``python -m experiments.bench_ops``. Results go to :data:`RESULTS`, each file naming its machine, date and
commit."""

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
