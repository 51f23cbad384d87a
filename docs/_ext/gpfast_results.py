"""Sphinx directives that show published results straight from their JSON files in ``experiments/results/``.

``.. results-source:: bench_ops.json bench_matmul.json`` renders one line per file: the machine, date and commit
recorded in the file (or the per-row sources of a derived table). ``.. results-table:: FILE`` with
``:columns: a, b, c`` renders the file's rows as a table. The pages thus never restate a number, a date or a
commit by hand, and cannot drift from the files.
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


def _rows(name: str, key: str) -> list:
    data = json.loads((RESULTS / name).read_text())
    if isinstance(data, list):
        return data
    if key in data:
        return data[key]
    raise ValueError(f"{RESULTS / name} has no {key!r}; expected a list or a dict with that key")


_MISSING = object()


def _get(row: dict, column: str):
    """``row[column]``, where ``a.b`` reads ``row["a"]["b"]`` (tables that nest one dict per method)."""
    value = row
    for part in column.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class ResultsTable(SphinxDirective):
    required_arguments = 1
    option_spec = {
        "columns": lambda arg: [c.strip() for c in arg.split(",") if c.strip()],
        "key": lambda arg: arg.strip(),
    }

    def run(self):
        name = self.arguments[0]
        self.env.note_dependency(str(RESULTS / name))
        rows = _rows(name, self.options.get("key", "rows"))
        columns = self.options.get("columns") or list(rows[0])
        missing = [c for c in columns if all(_get(r, c) is _MISSING for r in rows)]
        if missing:
            raise self.error(f"results-table: {name} has no column(s) {missing}; it has {sorted(rows[0])}")
        table = nodes.table()
        group = nodes.tgroup(cols=len(columns))
        table += group
        group += [nodes.colspec(colwidth=1) for _ in columns]
        head = nodes.thead()
        head += self._row(columns)
        body = nodes.tbody()
        for r in rows:
            body += self._row([_cell(None if _get(r, c) is _MISSING else _get(r, c)) for c in columns])
        group += head
        group += body
        return [table]

    @staticmethod
    def _row(cells):
        row = nodes.row()
        for text in cells:
            entry = nodes.entry()
            entry += nodes.paragraph(text=text)
            row += entry
        return row


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
    app.add_directive("results-table", ResultsTable)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
