"""Thin scripts that produce the published tables and plots; run each as a module from the repository root, e.g.
``python -m experiments.bench_ops``. Results go to :data:`RESULTS`, each file naming its machine, date and
commit."""

import ast
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def cg_fields(pairs: list[str], option: str) -> dict:
    """``["field=value", ...]`` from the command line as a dict of :class:`gpfast.CGSettings` fields, each value
    read as a Python literal (a number, True, None) where it is one and kept as a string otherwise."""
    fields = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"{option} takes FIELD=VALUE pairs, got {pair!r}")
        try:
            fields[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            fields[key] = value
    return fields
