"""UCI table: stock GPyTorch vs GPyTorch + gpfast kernel vs gpfast.ExactGP on the Wang et al. (2019) sets.

    python -m experiments.uci_table --data-dir ~/uci --device cuda --splits 0 1 2 --iters 50

Writes ``experiments/results/uci_table.{md,json,csv,png}`` (machine and date in each). Rows of
:func:`gpfast.compare.compare`: (a) ``gpytorch``, (b) ``gpytorch+gpfast``, (c) ``gpfast``; speed-ups are
(a)/(c) end to end (train + predict), (a)/(c) and (a)/(b) on training; row (c) also reports gpfast's training
engine's median ms per step and mean CG iterations per step. Metrics are means over the splits run (with the
standard deviation when there are several).

Published exact-GP results (Wang et al., "Exact Gaussian Processes on a Million Data Points", NeurIPS 2019,
Table 1) are NOT copied here: they could not be verified when this script was written, so the table says
"see paper" instead of quoting possibly wrong numbers. Fill ``PUBLISHED`` with (rmse, nll) pairs taken from the
paper to have them printed beside ours. Note the paper trains differently (Adam with pretraining on a subset,
then fine-tuning, and its own preprocessing), so compare with care.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from experiments import RESULTS, cg_fields
from gpfast.bench.compare import REFERENCE_ROWS, ROWS, compare
from gpfast.bench.report import md_table, write_csv
from gpfast.bench.timing import git_rev, machine, today

DATASETS = ("pol", "elevators", "bike", "kin40k", "protein", "keggdirected", "keggundirected")

#: name -> (RMSE, NLL) of the exact GP in Wang et al. (2019), Table 1; None = "see paper" (not verified here).
PUBLISHED: dict[str, tuple[float, float] | None] = {name: None for name in DATASETS}
PAPER = "Wang et al. 2019, Table 1"


def _mean_sd(values):
    vals = [v for v in values if isinstance(v, (int, float))]
    if not vals:
        return None, None
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else None)


def _fmt(m, sd, digits=3):
    if m is None:
        return "-"
    return f"{m:.{digits}f}" if sd is None else f"{m:.{digits}f} ± {sd:.{digits}f}"


def summarise(all_rows: list[dict], datasets) -> list[dict]:
    """One summary record per (dataset, row) over the splits run, plus speed-ups."""
    out = []
    for name in datasets:
        per = {r: [x for x in all_rows if x["dataset"] == name and x["row"] == r] for r in ROWS + REFERENCE_ROWS}
        if not any(per.values()):
            continue
        stats = {}
        for r, xs in per.items():
            if not xs:  # a row not run (--rows), or not in the merged files
                continue
            ok = [x for x in xs if x.get("status") == "ok"]
            s = {
                "row": r,
                "splits": len(xs),
                "ok": len(ok),
                "status": "ok" if xs and len(ok) == len(xs) else ",".join(sorted({str(x["status"]) for x in xs})),
            }
            for k in (
                "train_s",
                "predict_s",
                "total_s",
                "s_per_iter",
                "rmse_std",
                "rmse_orig",
                "nll_std",
                "nll_orig",
                "peak_mem_bytes",
                "cg_iterations_mean",
                "ms_per_step",
                "outside_steps_s",
                "prepare_s",
                "train_around_steps_s",
                "posterior_s",
            ):
                s[k], s[k + "_sd"] = _mean_sd([x.get(k) for x in ok])
            s["solver"] = ok[0].get("solver") if ok else None
            if ok and ok[0].get("train_solver") not in (None, s["solver"]):
                s["solver"] = f"train {ok[0]['train_solver']}, predict {s['solver']}"
            s["mem_kind"] = xs[0].get("mem_kind") if xs else None
            s["n_train"] = xs[0]["n_train"] if xs else None
            s["d"] = xs[0]["d"] if xs else None
            stats[r] = s
        a, b, c = (stats.get(r, {}) for r in ROWS)
        e2e = a.get("total_s") / c["total_s"] if a.get("total_s") and c.get("total_s") else None
        tr = a.get("train_s") / b["train_s"] if a.get("train_s") and b.get("train_s") else None
        tr_c = a.get("train_s") / c["train_s"] if a.get("train_s") and c.get("train_s") else None
        pub = PUBLISHED.get(name)
        ex = stats.get("exact", {})
        # the engine's accuracy against the same Adam steps with exact gradients: RMSE ratio, NLL difference
        vs_exact = (
            (c["rmse_std"] / ex["rmse_std"], c["nll_std"] - ex["nll_std"])
            if c.get("rmse_std") is not None and ex.get("rmse_std")
            else None
        )
        for r, s in stats.items():
            out.append(
                {
                    "dataset": name,
                    **s,
                    "speedup_a_over_c_end_to_end": e2e,
                    "speedup_a_over_b_train": tr,
                    "speedup_a_over_c_train": tr_c,
                    "c_vs_exact": vs_exact if r == "gpfast" else None,
                    "published_rmse": pub[0] if pub else "see paper",
                    "published_nll": pub[1] if pub else "see paper",
                }
            )
    return out


def merge_rows(files) -> tuple[list[dict], list[str], list[str]]:
    """Rows of several runs' JSON files, each (dataset, split, row) once (the last file wins), with the files'
    commits and notes on what the merged rows mix. Runs of different iters, lr, seed or device are refused."""
    keyed: dict = {}
    commits: list[str] = []
    for f in files:
        blob = json.loads(Path(f).read_text())
        commits.append(str(blob.get("commit", "unknown")))
        for r in blob["rows"]:
            keyed[(r["dataset"], r["split"], r["row"])] = {**r, "commit": r.get("commit", commits[-1])}
    rows = list(keyed.values())
    if not rows:
        raise SystemExit(f"--merge: no rows in {list(files)}")
    for key in ("iters", "lr", "seed", "device"):
        vals = {str(r.get(key)) for r in rows}
        if len(vals) != 1:
            raise SystemExit(f"--merge: the files mix runs with different {key} {sorted(vals)}; expected one")
    notes = []
    for name in dict.fromkeys(r["dataset"] for r in rows):
        mine = [r for r in rows if r["dataset"] == name]
        for key in ("machine", "commit"):
            vals = sorted({str(r.get(key)) for r in mine})
            if len(vals) > 1:
                notes.append(f"{name}: its rows come from runs on different {key}s ({', '.join(vals)})")
    return rows, list(dict.fromkeys(commits)), notes


def to_markdown(summary: list[dict]) -> str:
    cols = [
        "dataset",
        "n",
        "d",
        "row",
        "solver",
        "train s",
        "s/iter",
        "ms/step",
        "CG it/step",
        "predict s",
        "RMSE (std)",
        "NLL (std)",
        "RMSE (orig)",
        "NLL (orig)",
        "peak mem MiB",
        "(a)/(c) e2e",
        "(a)/(c) train",
        "(a)/(b) train",
        "(c) vs exact: RMSE ratio, NLL diff",
        f"RMSE [{PAPER}]",
        f"NLL [{PAPER}]",
        "status",
        "outside steps s",
        "prepare / around steps / posterior s",
    ]
    rows = []
    for s in summary:
        mem = s.get("peak_mem_bytes")
        rows.append(
            [
                s["dataset"],
                s["n_train"],
                s["d"],
                s["row"],
                s.get("solver") or "-",
                _fmt(s["train_s"], s["train_s_sd"], 2),
                _fmt(s["s_per_iter"], None, 4),
                _fmt(s["ms_per_step"], None, 1),
                _fmt(s["cg_iterations_mean"], None, 1),
                _fmt(s["predict_s"], None, 3),
                _fmt(s["rmse_std"], s["rmse_std_sd"]),
                _fmt(s["nll_std"], s["nll_std_sd"]),
                _fmt(s["rmse_orig"], s["rmse_orig_sd"], 4),
                _fmt(s["nll_orig"], s["nll_orig_sd"]),
                "-" if mem is None else f"{mem / 2**20:.0f}",
                "-" if s["speedup_a_over_c_end_to_end"] is None else f"{s['speedup_a_over_c_end_to_end']:.2f}x",
                "-" if s.get("speedup_a_over_c_train") is None else f"{s['speedup_a_over_c_train']:.2f}x",
                "-" if s["speedup_a_over_b_train"] is None else f"{s['speedup_a_over_b_train']:.2f}x",
                "-" if not s.get("c_vs_exact") else f"{s['c_vs_exact'][0]:.3f}, {s['c_vs_exact'][1]:+.3f}",
                s["published_rmse"],
                s["published_nll"],
                s["status"],
                _fmt(s.get("outside_steps_s"), None, 2),
                _phases(s),
            ]
        )
    return md_table(cols, rows)


def _phases(s: dict) -> str:
    """Row c's time outside its steps by phase (ExactGP.fit_seconds_), or "-" for rows that do not record it."""
    keys = ("prepare_s", "train_around_steps_s", "posterior_s")
    if any(s.get(k) is None for k in keys):
        return "-"
    return " / ".join(f"{s[k]:.3f}" for k in keys)


def plot(summary: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = sorted({s["dataset"] for s in summary}, key=lambda n: [s["dataset"] for s in summary].index(n))
    x = np.arange(len(names))
    w = 0.27
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for i, r in enumerate(ROWS):
        get = {s["dataset"]: s for s in summary if s["row"] == r}
        for ax, key in zip(axes, ("total_s", "rmse_std", "nll_std")):
            vals = [get[n][key] if n in get and get[n][key] is not None else np.nan for n in names]
            ax.bar(x + (i - 1) * w, vals, w, label=r)
    axes[0].set_yscale("log")
    for ax, t in zip(axes, ("train + predict time (s, log)", "test RMSE (standardised)", "test NLL (standardised)")):
        ax.set_title(t)
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=20)
    axes[0].legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--splits", type=int, nargs="+", default=[0])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--datasets", nargs="+", default=list(DATASETS))
    ap.add_argument("--out", default=str(RESULTS), help="output folder (default experiments/results)")
    ap.add_argument("--stem", default="uci_table")
    ap.add_argument(
        "--rows",
        nargs="+",
        default=list(ROWS),
        choices=list(ROWS + REFERENCE_ROWS),
        help="a subset of the rows (for example to spread one set's rows over two GPUs; --merge joins the files)",
    )
    ap.add_argument(
        "--cg",
        nargs="+",
        default=[],
        metavar="FIELD=VALUE",
        help="gpfast.CGSettings fields for rows gpfast and exact, e.g. max_preconditioner_rank=1600 (recorded in the "
        "rows and named under the table)",
    )
    ap.add_argument(
        "--predict",
        nargs="*",
        default=None,
        choices=list(ROWS + REFERENCE_ROWS),
        help="the rows that predict after training (default: every row run); the others are timed for their "
        "training only, with '-' for their prediction and metrics (stock GPyTorch's prediction takes minutes on the "
        "larger sets)",
    )
    ap.add_argument(
        "--matrix-free-threshold",
        type=int,
        default=None,
        metavar="ENTRIES",
        help="row gpytorch+gpfast: the kernels' matrix-free threshold in covariance entries instead of "
        "gpfast.kernels.MATRIX_FREE_THRESHOLD (named under the table)",
    )
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--note", action="append", default=[], help="a line of text added under the table (repeatable)")
    ap.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="JSON",
        help="run nothing: build the table from the rows of earlier runs' JSON files (for example "
        "sets run in separate GPU sessions); a row (dataset, split, row) found in several files "
        "is taken from the last of them on the command line",
    )
    args = ap.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    all_rows: list[dict] = []
    notes: list[str] = []
    cg = cg_fields(args.cg, "--cg")
    if args.predict is not None and set(args.predict) - set(args.rows):
        ap.error(f"--predict names rows {sorted(set(args.predict) - set(args.rows))} that --rows does not run")
    if args.matrix_free_threshold is not None:
        import gpfast.kernels.rbf

        gpfast.kernels.rbf.MATRIX_FREE_THRESHOLD = args.matrix_free_threshold
        gpfast.kernels.rbf.STORED_MEMORY_SHARE = float("inf")  # the threshold alone decides, as the note says
        notes.append(
            f"Row gpytorch+gpfast's matrix-free threshold: {args.matrix_free_threshold} covariance entries (K stored "
            "below it)."
        )
    if cg:
        notes.append("Row gpfast's CG settings (gpfast.CGSettings, the rest default): " + ", ".join(args.cg) + ".")
    if args.merge:
        all_rows, commits, notes = merge_rows(args.merge)
        present = {r["dataset"] for r in all_rows}
        args.datasets = [d for d in DATASETS if d in present] + sorted(present - set(DATASETS))
        args.splits = sorted({r["split"] for r in all_rows})
        args.iters, args.lr, args.seed = (all_rows[0][k] for k in ("iters", "lr", "seed"))
        args.device = all_rows[0]["device"]
    for name in [] if args.merge else args.datasets:
        for split in args.splits:
            print(f"== {name} split {split}", file=sys.stderr, flush=True)
            try:
                rows = compare(
                    name,
                    split=split,
                    iters=args.iters,
                    lr=args.lr,
                    device=args.device,
                    data_dir=args.data_dir,
                    seed=args.seed,
                    cg=cg,
                    rows=args.rows,
                    predict=args.predict,
                    verbose=not args.quiet,
                )
            except (ValueError, FileNotFoundError, TypeError) as exc:
                print(f"   skipped: {exc}", file=sys.stderr)
                continue
            for r in rows:
                engine = (
                    f", {r['ms_per_step']:.1f} ms/step, {r['cg_iterations_mean']:.1f} CG it/step"
                    if r.get("ms_per_step") is not None
                    else ""
                )
                print(
                    f"   {r['row']:16s} {r['status']:4s} train {r['train_s']} s, RMSE {r['rmse_std']}{engine}",
                    file=sys.stderr,
                )
            for r in rows:  # which GPU(s) the run saw, since runs may share a machine side by side
                r["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES", "all")
            all_rows += rows
            # keep partial results if a later set fails or the job is killed
            (out / f"{args.stem}.json").write_text(
                json.dumps({"commit": git_rev(), "partial": True, "rows": all_rows}, indent=2, default=str)
            )

    mach, date = machine(args.device), today()
    if args.merge:  # the machine and dates the rows were measured on, not this one
        mach = "; ".join(sorted({str(r.get("machine")) for r in all_rows}))
        date = ", ".join(sorted({str(r.get("date", ""))[:10] for r in all_rows}))
    unpredicted = sorted({r["row"] for r in all_rows if r.get("predicted") is False and r.get("status") == "ok"})
    if unpredicted:  # from the rows themselves, so that a merged table says it too
        notes.append("Timed for training only, with no prediction (so no metrics or end-to-end time): "
                     + ", ".join(unpredicted) + ".")  # fmt: skip
    summary = summarise(all_rows, args.datasets)
    commit = ", ".join(commits) if args.merge else git_rev()
    meta = {
        "machine": mach,
        "date": date,
        "commit": commit,
        "iters": args.iters,
        "lr": args.lr,
        "splits": args.splits,
        "device": args.device,
        "seed": args.seed,
        "published": f"{PAPER}: 'see paper' where not verified",
    }
    (out / f"{args.stem}.json").write_text(
        json.dumps({**meta, "summary": summary, "rows": all_rows}, indent=2, default=str)
    )
    if all_rows:
        write_csv(all_rows, out / f"{args.stem}.csv")
    table = to_markdown(summary)
    text = (
        f"# UCI: stock GPyTorch (a) vs GPyTorch + gpfast kernel (b) vs gpfast.ExactGP (c)\n\n"
        f"Machine: {mach}. Date: {date}. Commit: {meta['commit']}. {args.iters} Adam steps (lr {args.lr}), "
        f"float32, splits {args.splits}, same initial hyperparameters for every row. Peak memory: "
        f"{summary[0]['mem_kind'] if summary else '-'}. Speed-ups: (a)/(c) end to end (train + predict), "
        f"(a)/(c) and (a)/(b) training only; ms/step (median) and CG it/step: gpfast's training engine (row c); "
        f"outside steps s: row c's training time outside its engine steps (set-up, final re-solve, posterior), "
        f"and its split by ExactGP.fit_seconds_: before the training, the training's own time around the steps "
        f"(the engine's set-up and last re-solve), and the posterior (the factorisation and the fitted LML). "
        f"Published columns: {PAPER} (exact GP), 'see paper' where the numbers could not be verified.\n\n"
        f"{table}\n"
    )
    extra = notes + args.note
    if extra:
        text += "\nNotes:\n\n" + "".join(f"- {line}\n" for line in extra)
    (out / f"{args.stem}.md").write_text(text)
    if summary:
        plot(summary, out / f"{args.stem}.png", f"UCI, {args.iters} Adam steps, splits {args.splits}\n{mach}, {date}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
