"""Training time of row c before and after a change, from repeated ``uci_table`` runs, with the host's spikes removed.

    python -m experiments.step_repeats --before b1.json b2.json --after a1.json a2.json --stem NAME --out DIR

Each file is a ``uci_table --rows gpfast`` result (its ``step_ms``: the engine's wall time per Adam step). A single
step can take 10-40 ms longer than usual in one run and not in another (a host or GPU hiccup: on an H100 such spikes
hit the same code in one run and missed it in the next), which on the small UCI sets moves the training time by as
much as a change to the kernels does. So for each set and version the table gives every run's training time and
sum of steps, and the sum over steps of each step's *minimum* across the repeats: a spike only counts if it
happened in every run. The runs of one version must have taken the same steps (same CG iterations and rebuilds),
which the script checks by their CG iterations per step, and both versions need as many runs (a minimum over more
runs is smaller by itself); a failed run (no steps) leaves its version a run short, which is refused.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from experiments import RESULTS
from gpfast.bench.report import md_table, write_results


def _runs(paths: list[str]) -> dict[str, list[dict]]:
    """dataset -> its row c (one per file), in the order given. A file with two of a set's rows (several splits) is
    refused: its rows are not repeats of one another."""
    by_set: dict[str, list[dict]] = {}
    for p in paths:
        seen = set()
        for r in json.loads(Path(p).read_text())["rows"]:
            if r.get("row") != "gpfast" or not r.get("step_ms"):
                continue  # other rows, and a failed run's (no steps)
            if r["dataset"] in seen:
                raise ValueError(f"{p} has more than one row c of {r['dataset']} (several splits?)")
            seen.add(r["dataset"])
            by_set.setdefault(r["dataset"], []).append(r)
    return by_set


def minima_sum(runs: list[dict]) -> float:
    """Sum over steps of the smallest time each step took across ``runs`` (ms). Refuses runs of different steps."""
    steps = [r["step_ms"] for r in runs]
    if len({len(s) for s in steps}) != 1:
        raise ValueError(f"runs of {runs[0]['dataset']} have different step counts: {[len(s) for s in steps]}")
    if any(not r.get("cg_iterations") for r in runs):
        raise ValueError(f"runs of {runs[0]['dataset']} have no CG iterations: cannot check they took the same steps")
    its = {tuple(r["cg_iterations"]) for r in runs}
    if len(its) != 1:
        raise ValueError(f"runs of {runs[0]['dataset']} took different CG iterations, so not the same steps")
    return float(sum(min(v) for v in zip(*steps)))


def compare(before: list[str], after: list[str]) -> list[dict]:
    b, a = _runs(before), _runs(after)
    rows = []
    for ds in [d for d in b if d in a]:
        if len(b[ds]) != len(a[ds]):  # a minimum over more runs is smaller by itself
            raise ValueError(f"{ds}: {len(b[ds])} runs before against {len(a[ds])} after; the minima need as many")
        mb, ma = minima_sum(b[ds]), minima_sum(a[ds])
        rows.append(
            {
                "dataset": ds,
                "before_train_s": [r["train_s"] for r in b[ds]],
                "after_train_s": [r["train_s"] for r in a[ds]],
                "before_steps_ms": [float(sum(r["step_ms"])) for r in b[ds]],
                "after_steps_ms": [float(sum(r["step_ms"])) for r in a[ds]],
                "before_minima_ms": mb,
                "after_minima_ms": ma,
                "change": ma / mb - 1.0,
            }
        )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", nargs="+", required=True, help="uci_table JSON files of the tree before")
    ap.add_argument("--after", nargs="+", required=True, help="uci_table JSON files of the tree after")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--stem", default="step_repeats")
    args = ap.parse_args(argv)
    rows = compare(args.before, args.after)
    if not rows:
        raise SystemExit("step_repeats: no data set has row c in both --before and --after")
    src, old = (json.loads(Path(f[0]).read_text()) for f in (args.after, args.before))

    def runs(v):
        return ", ".join(f"{x:.3g}" for x in v)

    table = md_table(
        ["set", "train s before", "train s after", "sum of steps ms before", "sum of steps ms after",
         "per-step minima ms before", "after", "change"],
        [[r["dataset"], runs(r["before_train_s"]), runs(r["after_train_s"]), runs(r["before_steps_ms"]),
          runs(r["after_steps_ms"]), r["before_minima_ms"], r["after_minima_ms"], f"{100 * r['change']:+.1f}%"]
         for r in rows],
    )  # fmt: skip
    header = "Row c's training before and after, repeated runs"
    note = (
        f"Runs measured on: {src.get('machine')}, {src.get('date')}; commits {old.get('commit')} (before) and "
        f"{src.get('commit')} (after); this table computed from their files. "
        "Per-step minima: the sum over steps of each step's smallest time across a version's runs."
    )
    print(write_results(Path(args.out), args.stem, header, note + "\n\n" + table, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
