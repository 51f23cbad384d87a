"""The benchmark harness behind ``gpfast compare`` and the ``experiments/`` scripts: the comparison rows
(:mod:`~gpfast.bench.compare`), timing and memory measurement (:mod:`~gpfast.bench.timing`) and the report
writers (:mod:`~gpfast.bench.report`). Plots need the ``bench`` extra (matplotlib)."""
