"""The ``gpfast`` command line: argparse subcommands only (the work is done by the modules they call).

Examples::

    gpfast --version
    gpfast compare --dataset yacht --iters 50 --device cpu
    gpfast fit --csv houses.csv --target price --save houses.gpfast
    gpfast predict --model houses.gpfast --csv new_houses.csv --out predictions.csv
    gpfast fit --synthetic 100000 --d 8 --device cuda --out fit.json
    gpfast datasets
    gpfast download pol kin40k --data-dir ~/uci
    gpfast build --verbose

Every subcommand checks its arguments, the files they name and the folders it will write to before any work
starts. Wrong usage or input (arguments, files, their contents) ends with ``gpfast: error: ...`` on stderr and
exit status 2, with no traceback; a failure during the work (a download that breaks, a failed benchmark row)
with status 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
import warnings
from pathlib import Path

PROG = "gpfast"

# ------------------------------------------------------------------------------------------------------------
# errors and argument types
# ------------------------------------------------------------------------------------------------------------


class UsageError(Exception):
    """Something wrong with what the user gave (an argument, a file it names, that file's contents): reported
    as ``gpfast: error: <message>`` with exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser, reporting errors as ``gpfast: error: ...`` for every subcommand (argparse's own
    prefix would be ``gpfast fit: error:``); the usage line above still names the subcommand."""

    def error(self, message):
        self.print_usage(sys.stderr)
        self.exit(2, f"{PROG}: error: {message}\n")


def _error(msg: str) -> None:
    print(f"{PROG}: error: {msg}", file=sys.stderr)


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _split(text: str) -> int:
    from gpfast.datasets import N_SPLITS

    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value < N_SPLITS:
        raise argparse.ArgumentTypeError(f"must be one of the {N_SPLITS} fixed splits 0..{N_SPLITS - 1}, got {text!r}")
    return value


def _device(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:<index>``, refused at once when that device does not exist here."""
    name = text.strip().lower()
    if name == "cpu":
        return name
    match = re.fullmatch(r"cuda(?::(\d+))?", name)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:<index>, got {text!r}")
    import torch

    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise argparse.ArgumentTypeError(f"{text!r} but CUDA is not available ({why}); use --device cpu")
    if match.group(1) is not None and int(match.group(1)) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(
            f"{text!r} but there are {torch.cuda.device_count()} GPU(s), cuda:0..cuda:{torch.cuda.device_count() - 1}"
        )
    return name


def _version_text() -> str:
    import platform

    import torch

    from gpfast._version import __version__

    cuda = f", CUDA {torch.version.cuda}" if torch.version.cuda else ""
    return f"{PROG} {__version__} (torch {torch.__version__}{cuda}, Python {platform.python_version()})"


# ------------------------------------------------------------------------------------------------------------
# files and folders named by arguments, checked before any work
# ------------------------------------------------------------------------------------------------------------


def _input_file(path: str, option: str) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise UsageError(f"{option} {path}: no such file")
    if not p.is_file():
        raise UsageError(f"{option} {path}: not a file")
    if not os.access(p, os.R_OK):
        raise UsageError(f"{option} {path}: not readable (permission denied)")
    return p


def _make_folder(folder: Path, option: str, path: str) -> None:
    """Create ``folder`` (and its parents) for an output of ``option``, or raise UsageError saying why not."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{option} {path}: cannot create the folder {folder}: {exc.strerror or exc}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path}: cannot write in the folder {folder} (permission denied)")


def _output_file(path: str, option: str) -> Path:
    """The file an output goes to, its folder created when missing."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise UsageError(f"{option} {path}: is a folder; give a file name")
    if p.exists() and not os.access(p, os.W_OK):
        raise UsageError(f"{option} {path}: exists and is not writable (permission denied)")
    _make_folder(p.parent, option, path)
    return p


def _not_an_input(out: Path, option: str, inputs: dict[str, Path | None]) -> None:
    """Refuse an output that would overwrite one of the command's own input files."""
    for name, p in inputs.items():
        if p is not None and out.resolve() == Path(p).resolve():
            raise UsageError(f"{option} {out} is also the {name} file; writing it would destroy the input")


def _output_folder(path: str, option: str) -> Path:
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise UsageError(f"{option} {path}: exists and is not a folder")
    _make_folder(p, option, path)
    return p


# ------------------------------------------------------------------------------------------------------------
# subcommands
# ------------------------------------------------------------------------------------------------------------


def cmd_compare(args) -> int:
    from gpfast import datasets
    from gpfast.bench.compare import compare
    from gpfast.bench.report import CSV_FIELDS, format_table, plot_rows, write_csv

    try:
        data = datasets.load_uci(args.dataset, split=args.split, data_dir=args.data_dir)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        raise UsageError(str(exc)) from None
    out = _output_folder(args.out, "--out")
    verbose = not args.quiet
    if verbose:
        print(
            f"{PROG} compare: {data!r}, {args.iters} Adam steps (lr {args.lr}), device {args.device}",
            file=sys.stderr,
        )
    rows = compare(
        data, split=args.split, iters=args.iters, lr=args.lr, device=args.device, seed=args.seed, verbose=verbose
    )
    stem = out / f"compare_{args.dataset}_split{args.split}"
    meta = {
        "dataset": args.dataset,
        "split": args.split,
        "machine": rows[0]["machine"],
        "date": rows[0]["date"],
        "iters": args.iters,
        "lr": args.lr,
        "device": args.device,
        "seed": args.seed,
    }
    stem.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=2, default=str))
    write_csv(rows, stem.with_suffix(".csv"), CSV_FIELDS)
    title = (
        f"{args.dataset} split {args.split} (n={data.n_train}, d={data.d}), {args.iters} Adam steps\n"
        f"{meta['machine']}, {meta['date'][:10]}"
    )
    try:
        plot_rows(rows, stem.with_suffix(".png"), title)
        wrote = f"{stem}.csv, {stem}.json, {stem}.png"
    except ImportError:
        wrote = f"{stem}.csv, {stem}.json (no plot: matplotlib is missing; pip install 'gpfast[bench]')"
    print(
        f"{args.dataset} split {args.split}: n_train={data.n_train}, n_test={data.n_test}, d={data.d}; "
        f"{args.iters} Adam steps, lr {args.lr}, seed {args.seed} (times exclude start-up: a warm-up run first)"
    )
    print(f"machine: {meta['machine']}; date: {meta['date']}; memory: {rows[0].get('mem_kind')}")
    print(format_table(rows))
    print(f"wrote {wrote}")
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


def cmd_datasets(args) -> int:
    from gpfast import datasets

    root = datasets.resolve_data_dir(args.data_dir)
    avail = datasets.available(args.data_dir)
    print(f"data folder: {root} (from --data-dir, else ${datasets.ENV_VAR}, else the user cache)")
    print(f"shipped with the package: {', '.join(datasets.SHIPPED)}")
    if avail:
        print("available now:")
        for name in avail:
            try:
                where = datasets.find_dataset(name, args.data_dir)
            except (ValueError, FileNotFoundError):  # pragma: no cover
                where = "?"
            size = datasets.UCI_SIZES.get(name)
            extra = f" ({size[0]} rows, {size[1]} inputs)" if size else ""
            print(f"  {name:16s}{extra}  {where}")
    missing = [n for n in datasets.UCI_NAMES if n not in avail]
    if missing:
        print(f"known but not on disk (`{PROG} download NAME ...` fetches them): {', '.join(missing)}")
    return 0


def cmd_download(args) -> int:
    from gpfast import datasets

    unknown = [n for n in args.names if n not in datasets.UCI_SIZES]
    if unknown:
        raise UsageError(
            f"unknown dataset name(s) {', '.join(map(repr, unknown))}; known names: {', '.join(datasets.UCI_NAMES)}"
        )
    root = datasets.resolve_data_dir(args.data_dir)
    if root.exists() and not root.is_dir():
        raise UsageError(f"--data-dir {root}: exists and is not a folder")
    existing = next(p for p in (root, *root.parents) if p.exists())  # download creates the rest, or nothing
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"--data-dir {root}: cannot write in {existing} (permission denied)")
    try:
        where = datasets.download(
            names=args.names, data_dir=args.data_dir, progress=not args.quiet, overwrite=args.overwrite
        )
    except (ConnectionError, FileNotFoundError, ValueError, OSError, ImportError) as exc:
        _error(f"download failed: {exc}")
        return 1
    print(f"{', '.join(args.names)}: in {where} (use --data-dir {where} or ${datasets.ENV_VAR}={where})")
    return 0


def _check_fit_args(args) -> None:
    """The checks of ``fit`` that argparse's types cannot make: which options go together, and the files."""
    parser = args.parser
    source = "--csv" if args.csv else "--synthetic" if args.synthetic else "--dataset"
    only = {
        "--target": (args.target, "--csv"),
        "--features": (args.features, "--csv"),
        "--d": (args.d, "--synthetic"),
        "--test": (args.test, "--synthetic"),
        "--split": (args.split, "--dataset"),
        "--data-dir": (args.data_dir, "--dataset"),
    }
    for option, (value, needs) in only.items():
        if value is not None and needs != source:
            parser.error(f"{option} applies only with {needs}")
    if args.pretrain_iter is not None and args.pretrain_subset is None:
        parser.error("--pretrain-iter applies only with --pretrain-subset")
    if args.csv:
        if args.target is None:
            parser.error("--csv needs --target COLUMN: the column to predict")
        args.csv = _input_file(args.csv, "--csv")
    if args.distributed and args.solver == "cholesky":
        parser.error("--distributed runs the matrix-free CG solver: use --solver auto or cg")
    if args.checkpoint_every is not None and args.checkpoint is None:
        parser.error("--checkpoint-every applies only with --checkpoint")
    if args.checkpoint and args.distributed:
        parser.error("--checkpoint is not supported with --distributed")
    outputs = ("out", "save", "checkpoint")
    for option in outputs:
        if getattr(args, option):
            setattr(args, option, _output_file(getattr(args, option), f"--{option}"))
    for i, a in enumerate(outputs):
        for b in outputs[i + 1 :]:
            if getattr(args, a) and getattr(args, b) and getattr(args, a).resolve() == getattr(args, b).resolve():
                parser.error(f"--{a} and --{b} name the same file")
    for option in outputs:
        if getattr(args, option):
            _not_an_input(getattr(args, option), f"--{option}", {"--csv": args.csv if args.csv else None})
    defaults = {"d": 8, "test": 10000, "split": 0, "pretrain_iter": 10, "checkpoint_every": 10}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def cmd_fit(args) -> int:
    """Fit gpfast.ExactGP on a UCI split, synthetic data or a CSV file and report time, RMSE, NLL and memory.

    Under ``torchrun --nproc-per-node=K -m gpfast fit --distributed ...`` every rank computes its share of each
    covariance product; rank 0 prints and writes the result.
    """
    _check_fit_args(args)
    if not args.distributed:
        return _fit_and_report(args, args.device, rank0=True)
    import torch.distributed as dist

    from gpfast.kernels import distributed

    owns_group = not dist.is_initialized()
    # --device cpu keeps a distributed run on the CPUs (gloo) even where GPUs exist
    dev = distributed.init("gloo" if str(args.device).startswith("cpu") else None)
    try:
        code = _fit_and_report(args, str(dev), rank0=distributed.rank() == 0)
        if owns_group:
            dist.barrier()  # no rank tears down while another is still in a collective
        return code
    finally:
        # Tear the group down before the interpreter exits: leaving gloo's worker threads to static destructors
        # aborted both ranks now and then in CI ("terminate called without an active exception").
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


def _fit_data(args):
    """(X_train, y_train, X_test or None, y_test or None, description, feature names or None)."""
    from gpfast import datasets

    if args.csv:
        from gpfast.csv_table import read_csv_table

        try:
            table = read_csv_table(args.csv)
            names = table.features(target=args.target, features=args.features)
            if table.n_rows < 2:
                raise ValueError(f"{args.csv} has {table.n_rows} data row(s); fitting a GP needs at least 2.")
            hint = "fix or drop those rows, or leave the column out with --features"
            X, y = table.numeric(names, hint), table.numeric([args.target], "fix or drop those rows")[:, 0]
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        return X, y, None, None, f"{args.csv} (target {args.target!r})", names
    if args.synthetic:
        data = datasets.synthetic_split(args.synthetic, args.test, args.d, noise=0.1, seed=args.seed)
        return data.X_train, data.y_train, data.X_test, data.y_test, f"synthetic n={args.synthetic} d={args.d}", None
    try:
        data = datasets.load_uci(args.dataset, split=args.split, data_dir=args.data_dir)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        raise UsageError(str(exc)) from None
    return data.X_train, data.y_train, data.X_test, data.y_test, f"{args.dataset} split {args.split}", None


def _warm_up(make_gp, X, y, solvers) -> None:
    """Fit one step on at most 64 points and predict, untimed, with each solver the timed fit may use, so that
    one-off costs (loading the compiled ops, lazy imports and first calls, allocator start-up) stay out of the
    reported times, as in ``gpfast compare``."""
    n = min(64, X.shape[0])
    for solver in solvers:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # e.g. a column constant on the first rows: not the user's fit
                gp = make_gp(solver=solver, max_iter=1, pretrain=None, verbose=False).fit(X[:n], y[:n])
                gp.predict(X[: min(n, 8)], return_std=True)
        except Exception:  # the timed fit reports any problem
            pass


def _fit_and_report(args, device, rank0: bool) -> int:
    import numpy as np
    import torch

    from gpfast.estimator import ExactGP
    from gpfast.kernels import distributed
    from gpfast.metrics import regression_metrics

    X, y, X_test, y_test, description, names = _fit_data(args)

    def make_gp(**override):
        kw = dict(
            max_iter=args.iters,
            lr=args.lr,
            solver=args.solver,
            dtype=args.dtype,
            device=device,
            random_state=args.seed,
            verbose=rank0 and not args.quiet,
            distributed=args.distributed,
            pretrain=(args.pretrain_subset, args.pretrain_iter) if args.pretrain_subset is not None else None,
            optimizer=args.optimizer,
            tol=args.tol,
        )
        return ExactGP(**{**kw, **override})

    on_cuda = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()

    def now():
        if on_cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    t_start = now()
    solvers = [args.solver] if args.solver != "auto" else (["cg"] if args.distributed else ["cholesky", "cg"])
    _warm_up(make_gp, X, y, solvers)
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    gp = make_gp(checkpoint=args.checkpoint, checkpoint_every=args.checkpoint_every)
    resumed = args.checkpoint is not None and args.checkpoint.exists()
    t0 = now()
    try:
        gp.fit(X, y)
    except ValueError as exc:  # the data or a combination of settings ExactGP refuses
        raise UsageError(str(exc)) from None
    t1 = now()
    result = {
        "data": description,
        "n_train": int(X.shape[0]),
        "d": int(X.shape[1]),
        "iters": args.iters,
        "solver": gp.solver_,
        "train_solver": gp.train_solver_,
        "ranks": distributed.world_size() if args.distributed else 1,
        "device": str(gp.device_),
        "startup_s": t0 - t_start,
        "train_s": t1 - t0,
        "s_per_iter": (t1 - t0) / max(gp.n_iter_, 1),
    }
    if args.checkpoint is not None:
        # train_s covers this call only; the engine's step times cover every step, resumed or not
        result["resumed"] = resumed
    if gp.step_seconds_ is not None:
        result["step_s_total"] = float(sum(gp.step_seconds_))
    if X_test is not None:
        mean, std = gp.predict(X_test, return_std=True)
        t2 = now()
        scores = regression_metrics(mean, std**2, y_test)
        result.update(
            n_test=int(X_test.shape[0]), predict_s=t2 - t1, rmse_std=scores["rmse_std"], nll_std=scores["nll_std"]
        )
    result.update(
        peak_gb=torch.cuda.max_memory_allocated() / 1e9 if on_cuda else None,
        final_loss=gp.history_[-1] if gp.history_ else None,
        log_marginal_likelihood=gp.log_marginal_likelihood_,
        noise=gp.noise_,
        outputscale=gp.outputscale_,
    )
    if names is not None:
        gp.feature_names_in_ = np.asarray(names, dtype=object)  # so that `gpfast predict` finds them by name
        result["features"] = list(names)
        result["target"] = args.target
    if not rank0:
        return 0
    for k, v in result.items():
        print(f"{k:24s} {v:.4g}" if isinstance(v, float) else f"{k:24s} {v}")
    print("(startup_s: loading the ops and a one-step warm-up fit; train_s and predict_s exclude it)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")
    if args.save:
        gp.save(args.save)
        print(f"saved the model to {args.save} (`{PROG} predict --model {args.save} --csv FILE` predicts with it)")
    return 0


def cmd_predict(args) -> int:
    from gpfast.csv_table import read_csv_table, write_predictions
    from gpfast.estimator import ExactGP

    model = _input_file(args.model, "--model")
    csv_path = _input_file(args.csv, "--csv")
    out = _output_file(args.out, "--out") if args.out else None
    if out is not None:
        _not_an_input(out, "--out", {"--csv": csv_path, "--model": model})
    try:
        gp = ExactGP.load(model, device=args.device)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        table = read_csv_table(csv_path)
        if hasattr(gp, "feature_names_in_"):
            names = [str(c) for c in gp.feature_names_in_]
            if args.features is not None and list(args.features) != names:
                raise ValueError(
                    f"--features {' '.join(args.features)}: the model was fitted on the columns "
                    f"{', '.join(names)} (in that order) and reads them by name; leave --features out."
                )
            table.check_columns(names, "model input column")
        else:
            names = table.features(features=args.features)
            if len(names) != gp.n_features_in_:
                raise ValueError(
                    f"the model takes {gp.n_features_in_} input(s) and does not know their names (it was fitted "
                    f"from an array), but {csv_path} has {len(names)} column(s) to use: name the model's inputs, in "
                    f"order, with --features."
                )
        if table.n_rows < 1:
            raise ValueError(f"{csv_path} has a header but no data rows.")
        X = table.numeric(names)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    t0 = time.perf_counter()
    with warnings.catch_warnings():  # the columns were matched by name above; the array has none
        warnings.filterwarnings("ignore", message="X does not have valid feature names")
        mean, std = gp.predict(X, return_std=True)
    seconds = time.perf_counter() - t0
    if out is None:
        write_predictions(sys.stdout, mean, std)
    else:
        with open(out, "w", newline="") as f:
            write_predictions(f, mean, std)
    if not args.quiet:
        where = out if out is not None else "stdout"
        print(
            f"{PROG} predict: {len(mean)} row(s), mean and std of {model} (inputs {', '.join(names)}) on "
            f"{gp.device_} in {seconds:.3g} s -> {where}",
            file=sys.stderr,
        )
    return 0


def cmd_build(args) -> int:
    from gpfast import _build

    argv = ["--verbose"] if args.verbose else []
    return int(_build.main(argv) or 0)


# ------------------------------------------------------------------------------------------------------------
# the parser
# ------------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    nonneg, positive = _int_at_least(0), _int_at_least(1)
    parser = _Parser(prog=PROG, description="Exact GP regression on gpfast's fused RBF kernel.")
    parser.add_argument("--version", action="version", version=_version_text())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    data_dir_help = "folder holding <name>/data.csv.gz (default $GPFAST_DATA, else the user cache)"

    p = sub.add_parser(
        "compare",
        help="stock GPyTorch vs GPyTorch+gpfast kernel vs gpfast.ExactGP on one split",
        description="Train and evaluate stock GPyTorch, GPyTorch with gpfast's kernel, and gpfast.ExactGP on the "
        "same split with the same initial hyperparameters. Times exclude start-up (a warm-up run goes first).",
    )
    p.add_argument("--dataset", required=True, metavar="NAME", help="UCI set name, e.g. yacht, pol, kin40k")
    p.add_argument("--split", type=_split, default=0, metavar="K", help="fixed train/test split, 0..9 (default 0)")
    p.add_argument("--iters", type=positive, default=50, metavar="N", help="Adam steps for every row (default 50)")
    p.add_argument("--lr", type=_positive_float, default=0.1, metavar="LR", help="Adam learning rate (default 0.1)")
    p.add_argument(
        "--device", type=_device, metavar="DEVICE", default="cpu", help="cpu, cuda or cuda:<index> (default cpu)"
    )
    p.add_argument("--data-dir", default=None, metavar="DIR", help=data_dir_help)
    p.add_argument(
        "--out",
        default="./gpfast-results",
        metavar="DIR",
        help="output folder, created if missing (default ./gpfast-results)",
    )
    p.add_argument("--seed", type=nonneg, default=0, metavar="SEED", help="random seed (default 0)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_compare, parser=p)

    p = sub.add_parser(
        "fit",
        help="fit gpfast.ExactGP on a CSV file, a UCI split or synthetic data (torchrun for several GPUs)",
        description="Fit gpfast.ExactGP and report the train (and, for a UCI split or synthetic data, predict) "
        "time, RMSE, NLL (standardised) and peak GPU memory. Times exclude start-up (loading the compiled ops "
        "and a one-step warm-up fit, reported as startup_s). For several GPUs: torchrun --nproc-per-node=K -m "
        "gpfast fit --distributed ...",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--csv", metavar="FILE", help="your own table: comma-separated, a header row of column names")
    src.add_argument("--dataset", metavar="NAME", help="UCI set name")
    src.add_argument("--synthetic", type=_int_at_least(2), metavar="N", help="N synthetic training points")
    p.add_argument("--target", metavar="COLUMN", help="with --csv: the column to predict")
    p.add_argument(
        "--features",
        nargs="+",
        metavar="COLUMN",
        help="with --csv: the input columns (default: every column but the target)",
    )
    p.add_argument("--d", type=positive, default=None, metavar="D", help="with --synthetic: input features (default 8)")
    p.add_argument(
        "--test", type=positive, default=None, metavar="M", help="with --synthetic: test points (default 10000)"
    )
    p.add_argument(
        "--split", type=_split, default=None, metavar="K", help="with --dataset: UCI split, 0..9 (default 0)"
    )
    p.add_argument("--data-dir", default=None, metavar="DIR", help=f"with --dataset: {data_dir_help}")
    p.add_argument(
        "--iters", type=nonneg, default=50, metavar="N", help="optimiser steps on the full data (default 50)"
    )
    p.add_argument("--lr", type=_positive_float, default=0.1, metavar="LR", help="Adam learning rate (default 0.1)")
    p.add_argument("--solver", default="auto", choices=["auto", "cholesky", "cg"], help="(default auto)")
    p.add_argument(
        "--optimizer",
        default="auto",
        choices=["auto", "lbfgs", "adam"],
        help="(default auto: L-BFGS on the exact objective, Adam on CG)",
    )
    p.add_argument(
        "--tol",
        type=float,
        default=None,
        metavar="TOL",
        help="the optimiser's stopping tolerance (default: its own; 0 with Adam takes all --iters steps)",
    )
    p.add_argument(
        "--checkpoint",
        default=None,
        metavar="FILE",
        help="resumable fit: write the training state here every --checkpoint-every steps, resume from it when it "
        "exists (same data and settings), delete it when the fit succeeds",
    )
    p.add_argument(
        "--checkpoint-every", type=positive, default=None, metavar="K", help="steps between checkpoints (default 10)"
    )
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "float64"], help="training precision (default float32)"
    )
    p.add_argument(
        "--pretrain-subset",
        type=_int_at_least(2),
        default=None,
        metavar="M",
        help="Wang et al. schedule: first train on a random subset of M points",
    )
    p.add_argument("--pretrain-iter", type=nonneg, default=None, metavar="N", help="steps on the subset (default 10)")
    p.add_argument(
        "--device",
        type=_device,
        metavar="DEVICE",
        default=None,
        help="cpu, cuda or cuda:<index> (default: cuda when available)",
    )
    p.add_argument("--distributed", action="store_true", help="split products over torch.distributed ranks")
    p.add_argument("--seed", type=nonneg, default=0, metavar="SEED", help="random seed (default 0)")
    p.add_argument("--out", default=None, metavar="FILE", help="write the result as JSON here (folder created)")
    p.add_argument("--save", default=None, metavar="MODEL", help="save the fitted model here, for gpfast predict")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_fit, parser=p)

    p = sub.add_parser(
        "predict",
        help="predict with a saved model on a CSV file; writes mean and std as CSV",
        description="Predict with a model saved by `gpfast fit --save` (or ExactGP.save) at the rows of a CSV file "
        "and write one row per input row with the predictive mean and std (of a new noisy observation, in the "
        "target's units). The model's input columns are read by name; other columns, such as the target, may be "
        "there or not.",
    )
    p.add_argument("--model", required=True, metavar="FILE", help="a saved model")
    p.add_argument("--csv", required=True, metavar="FILE", help="comma-separated, a header row of column names")
    p.add_argument("--out", default=None, metavar="FILE", help="write here (default: stdout; folder created)")
    p.add_argument(
        "--features",
        nargs="+",
        metavar="COLUMN",
        help="the input columns, in order, for a model saved without column names",
    )
    p.add_argument(
        "--device",
        type=_device,
        default=None,
        help="cpu, cuda or cuda:<index> (default: the model's, or the CPU when it has no GPU)",
    )
    p.add_argument("--quiet", action="store_true", help="no summary line on stderr")
    p.set_defaults(func=cmd_predict, parser=p)

    p = sub.add_parser("datasets", help="list the data sets available and where they are from")
    p.add_argument("--data-dir", default=None, metavar="DIR", help=data_dir_help)
    p.set_defaults(func=cmd_datasets, parser=p)

    p = sub.add_parser(
        "download",
        help="download UCI data sets (checked against pinned SHA-256 sums)",
        description="Download UCI sets from the uci_datasets collection into DIR/<name>/. A failed download "
        "leaves nothing behind.",
    )
    p.add_argument("names", nargs="+", metavar="NAME", help="set name(s), e.g. pol kin40k (see gpfast datasets)")
    p.add_argument(
        "--data-dir", default=None, metavar="DIR", help="where to put them (default $GPFAST_DATA, else the user cache)"
    )
    p.add_argument("--overwrite", action="store_true", help="fetch again even when present and intact")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_download, parser=p)

    p = sub.add_parser("build", help="compile (JIT) and load gpfast's ops")
    p.add_argument("--verbose", action="store_true", help="show the compiler's commands and output")
    p.set_defaults(func=cmd_build, parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line on ``argv`` (default ``sys.argv[1:]``) and return the exit status (0 ok, 1 the work
    failed, 2 wrong usage or input); ``--help`` and ``--version`` print and return 0."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error already printed by _Parser.error
        return exc.code if isinstance(exc.code, int) else 0
    try:
        return args.func(args)
    except SystemExit as exc:  # a combination of options refused by parser.error after parsing
        return exc.code if isinstance(exc.code, int) else 0
    except UsageError as exc:
        _error(str(exc))
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
