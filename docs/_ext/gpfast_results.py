"""A Sphinx directive that states where a published result comes from, read from its JSON file at build time.

``.. results-source:: bench_ops.json bench_matmul.json`` renders one line per file: the machine, date and commit
recorded in ``experiments/results/<file>`` (or the per-row sources of a derived table), so that the benchmarks
page never restates them by hand and cannot drift from the files.
"""

import json
from pathlib import Path

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

RESULTS = Path(__file__).resolve().parents[2] / "experiments" / "results"
_SOURCE_KEYS = ("a_from", "b_from", "c_from")


def describe(name: str) -> str:
    """One sentence on the provenance of ``experiments/results/<name>``."""
    path = RESULTS / name
    data = json.loads(path.read_text())
    if isinstance(data, dict) and "date" in data:
        commit = data.get("commit") or "not recorded"
        machine = data.get("machine") or "not recorded"
        return f"{name}: {machine}; date {data['date']}; commit {commit}."
    rows = data.get("rows", []) if isinstance(data, dict) else data
    sources = sorted({str(r[k]) for r in rows for k in _SOURCE_KEYS if r.get(k)})
    if sources:
        return f"{name}: built from " + "; ".join(sources) + "."
    raise ValueError(f"{path} names no date and no source rows; expected a 'date' key or rows with *_from keys")


class ResultsSource(SphinxDirective):
    required_arguments = 1
    optional_arguments = 10

    def run(self):
        items = nodes.bullet_list()
        for name in self.arguments:
            self.env.note_dependency(str(RESULTS / name))
            para = nodes.paragraph(text=describe(name))
            items += nodes.list_item("", para)
        return [items]


def setup(app):
    app.add_directive("results-source", ResultsSource)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
