"""A user's own data as a CSV table, for ``gpfast fit --csv`` and ``gpfast predict``: numeric columns picked by
name from a file with a header row, and predictions written back as CSV.

The file is comma-separated (quotes as the :mod:`csv` module reads them, a UTF-8 byte-order mark skipped), with
one header row of distinct, non-empty column names; blank lines are skipped. Every value in a column that is used
must be a finite number; columns that are not used may hold anything. Each problem raises ``ValueError`` naming
the file, the line, the column and the value seen.

Example::

    table = read_csv_table("houses.csv")
    X = table.numeric(table.features(target="price"))     # (n_rows, n_features) float64
    y = table.numeric(["price"])[:, 0]
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

import numpy as np

__all__ = ["CSVTable", "read_csv_table", "read_model_inputs", "read_training_data", "write_predictions"]


@dataclass(frozen=True)
class CSVTable:
    """The cells of a CSV file, as read: ``columns`` (header names) and ``rows`` (lists of strings, with the file's
    line number of each row in ``lines``)."""

    path: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    lines: tuple[int, ...]

    @property
    def n_rows(self) -> int:
        return len(self.rows)

    def check_columns(self, names: Sequence[str], what: str = "column") -> None:
        """Raise ValueError listing the ``names`` that the header lacks."""
        missing = [c for c in names if c not in self.columns]
        if missing:
            raise ValueError(
                f"{self.path}: no {what}{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))} in its "
                f"header; its columns are {_names(self.columns)}."
            )

    def features(self, target: str | Sequence[str] | None = None, features: Sequence[str] | None = None) -> list[str]:
        """The input columns: ``features`` when given, else every column but the ``target`` column(s). Checked to
        exist, to be distinct and not to include a target."""
        targets = [] if target is None else [target] if isinstance(target, str) else list(target)
        if targets:
            self.check_columns(targets, "target column")
        if features is None:
            names = [c for c in self.columns if c not in targets]
        else:
            names = list(features)
            self.check_columns(names, "feature column")
            repeated = sorted({c for c in names if names.count(c) > 1})
            if repeated:
                raise ValueError(
                    f"{self.path}: feature column(s) {', '.join(map(repr, repeated))} named more than once."
                )
            both = [c for c in targets if c in names]
            if both:
                raise ValueError(f"{self.path}: the target column {both[0]!r} is also named as a feature.")
        if not names:
            only = f"column is the target {targets[0]!r}" if len(targets) == 1 else f"columns are the targets {targets}"
            raise ValueError(f"{self.path}: no input columns: its only {only}.")
        return names

    def numeric(self, names: Sequence[str], hint: str = "fix or drop those rows") -> np.ndarray:
        """The named columns as a float64 array of shape (n_rows, len(names)); ValueError at the first cell that
        is empty, not a number or not finite (with a count of all such cells, and ``hint`` on what to do)."""
        idx = [self.columns.index(c) for c in names]
        out = np.empty((self.n_rows, len(idx)), dtype=np.float64)
        bad = [0] * len(idx)
        first = None
        for r, row in enumerate(self.rows):
            for j, i in enumerate(idx):
                text = row[i].strip()
                try:
                    value = float(text)
                except ValueError:
                    value = None
                if value is None or not math.isfinite(value):
                    bad[j] += 1
                    if first is None:
                        first = (self.lines[r], j, text, value)
                    continue
                out[r, j] = value
        if first is not None:
            line, j, text, value = first
            column = names[j]
            if value is None and text and bad[j] == self.n_rows > 1:
                problem = f"holds no numbers (line {line}: {text!r})"
            elif text == "":
                problem = f"is empty on line {line} (a missing value)"
            elif value is None:
                problem = f"holds {text!r} on line {line}, which is not a number"
            else:
                problem = f"holds {text!r} on line {line}, which is not a finite number"
            others = sum(bad) - (bad[j] if problem.startswith("holds no numbers") else 1)
            more = f"; {others} more such cell(s) in the columns used" if others else ""
            raise ValueError(
                f"{self.path}: column {column!r} {problem}{more}. gpfast reads numeric columns only: {hint}."
            )
        return out


def _names(columns, limit: int = 12) -> str:
    shown = ", ".join(map(repr, columns[:limit]))
    return shown + (f" and {len(columns) - limit} more" if len(columns) > limit else "")


def read_csv_table(path) -> CSVTable:
    """Read a comma-separated file with a header row (see the module docstring); ValueError for a file that is
    empty, has no data rows, repeated or empty column names, or rows of the wrong length."""
    path = str(path)
    with open(path, newline="", encoding="utf-8-sig") as f:
        try:
            records = list(_rows(f))
        except (csv.Error, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: not a readable CSV text file ({exc}).") from None
    if not records:
        raise ValueError(f"{path} is empty: expected a header row of column names, then one row per sample.")
    header_line, header = records[0]
    columns = tuple(c.strip() for c in header)
    if len(columns) == 1:
        for sep, name in ((";", "semicolons"), ("\t", "tabs")):
            if sep in columns[0]:
                raise ValueError(
                    f"{path}: its header {header[0]!r} is a single column holding {name}; gpfast reads "
                    f"comma-separated files."
                )
    empty = [i + 1 for i, c in enumerate(columns) if not c]
    if empty:
        raise ValueError(
            f"{path}, line {header_line}: the header row has empty column name(s) at position(s) "
            f"{empty}; every column needs a name."
        )
    repeated = sorted({c for c in columns if columns.count(c) > 1})
    if repeated:
        raise ValueError(
            f"{path}, line {header_line}: column name(s) {', '.join(map(repr, repeated))} appear more "
            f"than once in the header."
        )
    rows, lines = [], []
    for line, row in records[1:]:
        if len(row) != len(columns):
            raise ValueError(f"{path}, line {line}: {len(row)} field(s), but the header has {len(columns)} columns.")
        rows.append(tuple(row))
        lines.append(line)
    return CSVTable(path, columns, tuple(rows), tuple(lines))


def read_training_data(
    path, target: str | Sequence[str], features: Sequence[str] | None = None
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """The training data of ``gpfast fit --csv``: X of shape (n_rows, d), y of shape (n_rows,) for one ``target``
    column (a name, or a list of one) or (n_rows, k) for k of them (float64), and the d input column names
    (``features``, else every column but the targets). ValueError for any problem, naming the file, line, column
    and value, and for fewer than 2 rows."""
    table = read_csv_table(path)
    names = table.features(target=target, features=features)
    if table.n_rows < 2:
        raise ValueError(f"{path} has {table.n_rows} data row(s); fitting a GP needs at least 2.")
    X = table.numeric(names, "fix or drop those rows, or leave the column out with --features")
    targets = [target] if isinstance(target, str) else list(target)
    y = table.numeric(targets, "fix or drop those rows")
    y = y[:, 0] if len(targets) == 1 else y
    return X, y, names


def read_model_inputs(
    path, feature_names: Sequence[str] | None, n_features: int, features: Sequence[str] | None = None
) -> tuple[np.ndarray, list[str]]:
    """The inputs of ``gpfast predict``: X of shape (n_rows, n_features) (float64) and its column names.

    A model that knows its ``feature_names`` reads them by name (in any order, other columns ignored; ``features``
    must then be None or the same names); one without takes ``features``, else every column, and their number must
    be ``n_features``. ValueError for any problem, and for a file without data rows."""
    table = read_csv_table(path)
    if feature_names is not None:
        names = [str(c) for c in feature_names]
        if features is not None and list(features) != names:
            raise ValueError(
                f"--features {' '.join(features)}: the model was fitted on the columns {', '.join(names)} (in that "
                f"order) and reads them by name; leave --features out."
            )
        table.check_columns(names, "model input column")
    else:
        names = table.features(features=features)
        if len(names) != n_features:
            raise ValueError(
                f"the model takes {n_features} input(s) and does not know their names (it was fitted from an "
                f"array), but {path} has {len(names)} column(s) to use: name the model's inputs, in order, with "
                f"--features."
            )
    if table.n_rows < 1:
        raise ValueError(f"{path} has a header but no data rows.")
    return table.numeric(names), names


def _rows(f: IO[str]):
    """(line number, fields) of every row but blank lines (a row of empty fields, ``,,``, is kept: it is a row of
    missing values)."""
    reader = csv.reader(f)
    start = 1
    for row in reader:
        if len(row) > 1 or (row and row[0].strip()):
            yield start, row
        start = reader.line_num + 1


def write_predictions(out: IO[str], mean: np.ndarray, std: np.ndarray, targets: Sequence[str] | None = None) -> None:
    """Write ``mean,std`` with a header, one row per prediction, each value in full precision (``repr``). Means and
    stds of shape (m, k), several outputs, give the columns ``mean_<name>,std_<name>`` for each of the k names in
    ``targets`` (default: the output's index)."""
    mean, std = np.asarray(mean, dtype=np.float64), np.asarray(std, dtype=np.float64)
    writer = csv.writer(out, lineterminator="\n")
    if mean.ndim == 1:
        writer.writerow(["mean", "std"])
        for m, s in zip(mean.tolist(), std.tolist()):
            writer.writerow([repr(m), repr(s)])
        return
    names = [str(t) for t in targets] if targets is not None else [str(j) for j in range(mean.shape[1])]
    writer.writerow([f"{kind}_{name}" for name in names for kind in ("mean", "std")])
    for m, s in zip(mean.tolist(), std.tolist()):
        writer.writerow([repr(v) for pair in zip(m, s) for v in pair])
