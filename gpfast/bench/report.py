"""Report writers for benchmark rows: one plain-text table, one Markdown table, one CSV and one JSON writer, and
the bar chart of a comparison. Plots need matplotlib (the ``bench`` extra)."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

from gpfast.bench.timing import git_rev, machine, today

__all__ = [
    "CSV_FIELDS",
    "TABLE_COLUMNS",
    "format_table",
    "md_table",
    "plot_rows",
    "write_comparison",
    "write_csv",
    "write_results",
]

# (column title, key, format)
TABLE_COLUMNS = (
    ("row", "row", "{}"),
    ("solver", "solver", "{}"),
    ("train s", "train_s", "{:.3f}"),
    ("s/iter", "s_per_iter", "{:.4f}"),
    ("predict s", "predict_s", "{:.3f}"),
    ("RMSE std", "rmse_std", "{:.4f}"),
    ("RMSE orig", "rmse_orig", "{:.4g}"),
    ("NLL std", "nll_std", "{:.4f}"),
    ("NLL orig", "nll_orig", "{:.4f}"),
    ("peak mem", "peak_mem_bytes", None),
    ("status", "status", "{}"),
)

CSV_FIELDS = (
    "dataset", "split", "row", "status", "solver", "train_solver", "n_train", "n_test", "d", "iters", "lr", "seed",
    "device", "dtype", "train_s", "s_per_iter", "predict_s", "total_s", "rmse_std", "rmse_orig", "nll_std", "nll_orig",
    "peak_mem_bytes", "mem_kind", "final_loss", "init_lengthscale", "init_outputscale", "init_noise", "init_mean",
    "machine", "date",
)  # fmt: skip


def _fmt_bytes(n) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def format_table(rows: Sequence[dict]) -> str:
    """A plain-text table of comparison rows (:data:`TABLE_COLUMNS`)."""
    header = [c[0] for c in TABLE_COLUMNS]
    body = []
    for r in rows:
        line = []
        for _title, key, fmt in TABLE_COLUMNS:
            v = r.get(key)
            if key == "peak_mem_bytes":
                line.append(_fmt_bytes(v))
            elif v is None or (isinstance(v, float) and math.isnan(v)):
                line.append("-")
            else:
                line.append(fmt.format(v))
        body.append(line)
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.ljust(w) for v, w in zip(b, widths)) for b in body]
    return "\n".join(out)


def md_table(columns: Sequence[str], rows: Iterable[Sequence]) -> str:
    """A Markdown table; floats with 4 significant digits."""

    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def write_csv(rows: Sequence[dict], path: Path, fields: Sequence[str] | None = None) -> None:
    """Rows as CSV: the given ``fields`` (others dropped), or every key that occurs; lists written as JSON."""
    fields = list(fields) if fields is not None else list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (json.dumps(v) if isinstance(v, (list, tuple)) else v) for k, v in r.items()})


def write_results(results_dir: Path, stem: str, header: str, table_md: str, rows: list, **meta) -> str:
    """``<stem>.json`` (machine, date, commit, ``meta``, rows) and ``<stem>.md`` (header, the same facts, the
    table) in ``results_dir``; returns the Markdown text."""
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    info = {"machine": machine(), "date": today(), "commit": git_rev(), **meta}
    (results_dir / f"{stem}.json").write_text(json.dumps({**info, "rows": rows}, indent=2, default=str))
    text = f"# {header}\n\nMachine: {info['machine']}. Date: {info['date']}. Commit: {info['commit']}.\n\n{table_md}\n"
    (results_dir / f"{stem}.md").write_text(text)
    return text


def plot_rows(rows: Sequence[dict], path: Path, title: str) -> None:
    """Bar charts of train + predict time, RMSE and NLL (standardised units) per comparison row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["row"] for r in rows]
    x = list(range(len(rows)))

    def val(r, k):
        v = r.get(k)
        return float(v) if isinstance(v, (int, float)) and v is not None and math.isfinite(v) else 0.0

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    train = [val(r, "train_s") for r in rows]
    pred = [val(r, "predict_s") for r in rows]
    axes[0].bar(x, train, label="train")
    axes[0].bar(x, pred, bottom=train, label="predict")
    axes[0].set_ylabel("seconds")
    axes[0].set_title("time (train + predict)")
    axes[0].legend()
    axes[1].bar(x, [val(r, "rmse_std") for r in rows], color="tab:green")
    axes[1].set_title("test RMSE (standardised)")
    axes[2].bar(x, [val(r, "nll_std") for r in rows], color="tab:red")
    axes[2].set_title("test NLL (standardised)")
    for ax in axes:
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=15)
    for i, r in enumerate(rows):
        if r.get("status") != "ok":
            for ax in axes:
                ax.text(i, 0, str(r.get("status"))[:12], ha="center", va="bottom", color="black", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_comparison(rows: Sequence[dict], stem: Path, meta: dict, title: str) -> str:
    """The outputs of ``gpfast compare``: ``<stem>.json`` (``meta`` and the rows), ``<stem>.csv``
    (:data:`CSV_FIELDS`) and the plot ``<stem>.png`` (:func:`plot_rows`, skipped without matplotlib). Returns a
    line naming what was written."""
    stem = Path(stem)
    stem.with_suffix(".json").write_text(json.dumps({**meta, "rows": list(rows)}, indent=2, default=str))
    write_csv(rows, stem.with_suffix(".csv"), CSV_FIELDS)
    try:
        plot_rows(rows, stem.with_suffix(".png"), title)
    except ImportError:
        return f"{stem}.csv, {stem}.json (no plot: matplotlib is missing; pip install 'gpfast[bench]')"
    return f"{stem}.csv, {stem}.json, {stem}.png"
