"""The speed-up scorecard: gpfast.ExactGP (row c) against stock GPyTorch (row a), from tables already written.

    python -m experiments.uci_speedup --a experiments/results/uci_table.json ... --c run/uci_*_c.md ... \
        --stem uci_speedup

Runs nothing. Reads the rows of earlier ``experiments.uci_table`` runs, from their JSON files or, where only the
Markdown table survived, from that table, and writes ``<stem>.{md,json,png}`` (the plot needs the [bench] extra):
per set, (a)'s and (c)'s training seconds per step, (c)'s engine ms per step, the training and end-to-end (train +
predict) speed-ups, and the RMSE and NLL differences, each against the project's targets (training >= 5x; end to end
>= 10x on kin40k, protein and the kegg sets, >= 4x on the others; RMSE within 2% of (a), NLL within 0.02 of (a),
or better). Each row names the files, dates and commits its numbers come from, since the two rows may come from
different runs.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from experiments import RESULTS
from gpfast.bench.report import md_table

BIG = ("kin40k", "protein", "keggdirected", "keggundirected")
MD_KEYS = {  # uci_table's Markdown column -> its JSON summary key
    "n": "n_train",
    "train s": "train_s",
    "s/iter": "s_per_iter",
    "ms/step": "ms_per_step",
    "predict s": "predict_s",
    "RMSE (std)": "rmse_std",
    "NLL (std)": "nll_std",
}


def _number(text: str):
    try:
        return float(text.split("±")[0])
    except ValueError:
        return None


def read_rows(path: Path, row: str) -> dict[str, dict]:
    """dataset -> that row's record (train_s, s_per_iter, predict_s, rmse_std, nll_std, ...) in one results file."""
    text = path.read_text()
    if path.suffix == ".json":
        blob = json.loads(text)
        out = {}
        for r in blob.get("summary") or blob["rows"]:
            if r["row"] == row and r.get("status") == "ok":
                date = blob.get("date") or r.get("date")
                out[r["dataset"]] = {**r, "source": path.name, "date": date, "commit": blob.get("commit")}
        return out
    date = re.search(r"Date: ([0-9-]+)", text)
    commit = re.search(r"Commit: ([0-9a-zA-Z]+)", text)
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| dataset |"))
    cols = [c.strip() for c in lines[head].strip("|").split("|")]
    out = {}
    for line in lines[head + 2 :]:
        if not line.startswith("|"):
            break
        cells = dict(zip(cols, (c.strip() for c in line.strip("|").split("|"))))
        if cells["row"] != row or cells["status"] != "ok":
            continue
        rec = {key: _number(cells[col]) for col, key in MD_KEYS.items() if col in cells}
        out[cells["dataset"]] = {
            **rec,
            "source": path.name,
            "date": date.group(1) if date else None,
            "commit": commit.group(1) if commit else None,
        }
    return out


def scorecard(a: dict[str, dict], c: dict[str, dict]) -> list[dict]:
    rows = []
    for name in [n for n in c if n in a]:
        ra, rc = a[name], c[name]
        total_a, total_c = ra["train_s"] + ra["predict_s"], rc["train_s"] + rc["predict_s"]
        e2e_target = 10.0 if name in BIG else 4.0
        rmse_rel = rc["rmse_std"] / ra["rmse_std"] - 1
        nll_diff = rc["nll_std"] - ra["nll_std"]
        rows.append(
            {
                "dataset": name,
                "a_ms_per_iter": 1e3 * ra["s_per_iter"],
                "c_ms_per_iter": 1e3 * rc["s_per_iter"],
                "c_engine_ms_per_step": rc.get("ms_per_step"),
                "train_speedup": ra["train_s"] / rc["train_s"],
                "step_speedup": None if not rc.get("ms_per_step") else 1e3 * ra["s_per_iter"] / rc["ms_per_step"],
                "e2e_speedup": total_a / total_c,
                "e2e_target": e2e_target,
                "rmse_a": ra["rmse_std"],
                "rmse_c": rc["rmse_std"],
                "rmse_rel_diff": rmse_rel,
                "nll_a": ra["nll_std"],
                "nll_c": rc["nll_std"],
                "nll_diff": nll_diff,
                "accuracy_met": rmse_rel <= 0.02 and nll_diff <= 0.02,
                "a_from": f"{ra['source']} ({ra['date']}, {ra['commit']})",
                "c_from": f"{rc['source']} ({rc['date']}, {rc['commit']})",
            }
        )
    return rows


def to_markdown(rows: list[dict]) -> str:
    def mark(ok: bool) -> str:
        return "met" if ok else "MISSED"

    head = [
        "set",
        "(a) ms/iter",
        "(c) ms/iter",
        "(c) engine ms/step",
        "train x (target 5)",
        "per-step x",
        "e2e x (target)",
        "RMSE a / c (diff)",
        "NLL a / c (diff)",
        "accuracy",
        "(a) from",
        "(c) from",
    ]
    body = []
    for r in rows:
        step = "-" if r["step_speedup"] is None else f"{r['step_speedup']:.1f}"
        body.append(
            [
                r["dataset"],
                f"{r['a_ms_per_iter']:.1f}",
                f"{r['c_ms_per_iter']:.1f}",
                "-" if r["c_engine_ms_per_step"] is None else f"{r['c_engine_ms_per_step']:.1f}",
                f"{r['train_speedup']:.2f} {mark(r['train_speedup'] >= 5)}",
                step,
                f"{r['e2e_speedup']:.1f} ({r['e2e_target']:.0f}) {mark(r['e2e_speedup'] >= r['e2e_target'])}",
                f"{r['rmse_a']:.3f} / {r['rmse_c']:.3f} ({100 * r['rmse_rel_diff']:+.1f}%)",
                f"{r['nll_a']:.3f} / {r['nll_c']:.3f} ({r['nll_diff']:+.3f})",
                mark(r["accuracy_met"]),
                r["a_from"],
                r["c_from"],
            ]
        )
    return md_table(head, body)


def plot(rows: list[dict], path: Path) -> bool:
    """Two panels: ms per training step of (a) and of (c)'s engine, and test RMSE of both; False without
    matplotlib (the [bench] extra)."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["dataset"] for r in rows]
    x = list(range(len(rows)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    step_c = [r["c_engine_ms_per_step"] or r["c_ms_per_iter"] for r in rows]
    ax1.bar([i - 0.2 for i in x], [r["a_ms_per_iter"] for r in rows], 0.4, label="(a) stock GPyTorch")
    ax1.bar([i + 0.2 for i in x], step_c, 0.4, label="(c) gpfast.ExactGP, engine step")
    for i, r in enumerate(rows):
        if r["step_speedup"]:
            ax1.annotate(f"{r['step_speedup']:.1f}x", (i + 0.2, step_c[i]), ha="center", va="bottom", fontsize=8)
    ax1.set_ylabel("ms per training step")
    ax1.set_title("training step (lower is better)")
    ax1.legend()
    ax2.bar([i - 0.2 for i in x], [r["rmse_a"] for r in rows], 0.4, label="(a)")
    ax2.bar([i + 0.2 for i in x], [r["rmse_c"] for r in rows], 0.4, label="(c)")
    ax2.set_ylabel("test RMSE (standardised)")
    ax2.set_title("accuracy after 50 steps (lower is better)")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.set_xticks(x, names, rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", nargs="+", required=True, type=Path, help="uci_table results (.json or .md) with row (a)")
    ap.add_argument("--c", nargs="+", required=True, type=Path, help="uci_table results (.json or .md) with row (c)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--stem", default="uci_speedup")
    args = ap.parse_args(argv)
    a: dict[str, dict] = {}
    c: dict[str, dict] = {}
    for files, row, into in ((args.a, "gpytorch", a), (args.c, "gpfast", c)):
        for f in files:  # a set found in several files is taken from the last
            into.update(read_rows(f, row))
    rows = scorecard(a, c)
    if not rows:
        raise SystemExit(f"no set has both rows: (a) has {sorted(a)}, (c) has {sorted(c)}")
    missing = sorted(set(c) - set(a))
    text = (
        "# gpfast.ExactGP (row c) vs stock GPyTorch (row a): the speed-up targets\n\n"
        "50 Adam steps (lr 0.1), split 0, float32, same initial hyperparameters; both rows measured on the H200 "
        "by experiments.uci_table, possibly in different runs (see the last two columns). 'ms/iter' is training "
        "seconds over 50 (setup included); '(c) engine ms/step' is the engine's median step; 'per-step x' is (a) "
        "ms/iter over it; 'e2e' is train + predict. Accuracy: RMSE within 2% and NLL within 0.02 of (a), or better "
        "(standardised units).\n\n" + to_markdown(rows) + "\n"
    )
    if missing:
        text += f"\nNo row (a) for {', '.join(missing)}: its row (c) is in the (c) files but has no baseline here.\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.stem}.md").write_text(text)
    (args.out / f"{args.stem}.json").write_text(json.dumps({"rows": rows, "no_baseline": missing}, indent=2))
    plot(rows, args.out / f"{args.stem}.png")
    print(text)


if __name__ == "__main__":
    main()
