"""The ``gpfast`` command line: argparse subcommands only (the work is done by the modules they call).

Examples::

    gpfast --version
    gpfast compare --dataset yacht --iters 50 --device cpu
    gpfast fit --csv houses.csv --target price --save houses.gpfast
    gpfast fit --csv sensors.csv --target s1 s2 s3 --independent-outputs --save sensors.gpfast
    gpfast predict --model houses.gpfast --csv new_houses.csv --out predictions.csv
    gpfast fit --synthetic 100000 --d 8 --device cuda --out fit.json
    gpfast datasets
    gpfast download pol kin40k --data-dir ~/uci
    gpfast build --verbose

This module parses and dispatches: the subcommands' work is in :mod:`gpfast.cli_commands`. Every subcommand checks
its arguments, the files they name and the folders it will write to before any work starts
(:mod:`gpfast.cli_checks`). Wrong usage or input (arguments, files, their contents) ends with
``gpfast: error: ...`` on stderr and exit status 2, with no traceback; a failure during the work (a download that
breaks, a failed benchmark row) with status 1. Warnings print as ``gpfast: warning: ...``, naming this command
line's options. ``--version``, ``--help``, ``datasets`` and ``download`` need no compiled code.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import warnings

from gpfast import cli_commands as commands
from gpfast.cli_checks import PROG, Parser, UsageError, device, int_at_least, positive_float, split_index

# The estimator's arguments, as warnings name them, and the options that set them here.
_OPTIONS = {
    "max_iter": "--iters",
    "tol": "--tol",
    "lr": "--lr",
    "pretrain_iter": "--pretrain-iter",
    "pretrain_subset": "--pretrain-subset",
    "dtype": "--dtype",
    "solver": "--solver",
    "optimizer": "--optimizer",
}
_ASSIGNED = re.compile(r"\b(" + "|".join(_OPTIONS) + r")=(?:'([^']*)'|([\w.+-]+))")
_NAMED = re.compile(r"\b(max_iter|tol|lr|pretrain_iter|pretrain_subset)\b")  # names no sentence uses otherwise


def _error(msg: str) -> None:
    print(f"{PROG}: error: {msg}", file=sys.stderr)


def in_option_words(text: str) -> str:
    """A message of the Python API in this command line's words: ``max_iter`` -> ``--iters``,
    ``dtype='float64'`` -> ``--dtype float64``."""
    text = _ASSIGNED.sub(
        lambda m: f"{_OPTIONS[m.group(1)]} {m.group(2) if m.group(2) is not None else m.group(3)}", text
    )
    return _NAMED.sub(lambda m: _OPTIONS[m.group(1)], text)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as ``gpfast: warning: ...``: a user of the command line has no use for gpfast's source lines."""
    print(f"{PROG}: warning: {in_option_words(str(message))}", file=sys.stderr if file is None else file)


def _version_text() -> str:
    import platform

    import torch

    from gpfast._version import __version__

    cuda = f", CUDA {torch.version.cuda}" if torch.version.cuda else ""
    return f"{PROG} {__version__} (torch {torch.__version__}{cuda}, Python {platform.python_version()})"


# ------------------------------------------------------------------------------------------------------------
# the parser: one function per subcommand
# ------------------------------------------------------------------------------------------------------------
_NONNEG, _POSITIVE = int_at_least(0), int_at_least(1)
_DATA_DIR_HELP = "folder holding <name>/data.csv.gz (default $GPFAST_DATA, else the user cache)"


#: Each subcommand's line in ``gpfast --help`` and the paragraph that opens its own ``--help``.
_ABOUT = {
    "compare": (
        "stock GPyTorch vs GPyTorch+gpfast kernel vs gpfast.ExactGP on one split",
        "Train and evaluate stock GPyTorch, GPyTorch with gpfast's kernel, and gpfast.ExactGP on the "
        "same split with the same initial hyperparameters. Times exclude start-up (a warm-up run goes first).",
    ),
    "fit": (
        "fit gpfast.ExactGP on a CSV file, a UCI split or synthetic data (torchrun for several GPUs)",
        "Fit gpfast.ExactGP and report the train (and, for a UCI split or synthetic data, predict) "
        "time, RMSE, NLL (standardised) and peak GPU memory. Times exclude start-up (loading the compiled ops "
        "and a one-step warm-up fit, reported as startup_s). For several GPUs: torchrun --nproc-per-node=K -m "
        "gpfast fit --distributed ...",
    ),
    "predict": (
        "predict with a saved model on a CSV file; writes mean and std as CSV",
        "Predict with a model saved by `gpfast fit --save` (or ExactGP.save) at the rows of a CSV file "
        "and write one row per input row with the predictive mean and std (of a new noisy observation, in the "
        "target's units; a model of several targets writes mean_<target> and std_<target> for each). The model's "
        "input columns are read by name; other columns, such as the target, may be there or not.",
    ),
    "datasets": ("list the data sets available and where they are from", None),
    "download": (
        "download UCI data sets (checked against pinned SHA-256 sums)",
        "Download UCI sets from the uci_datasets collection into DIR/<name>/ (the sets shipped with "
        "gpfast are copied from the package). A failed download leaves nothing behind.",
    ),
    "build": ("compile (JIT) and load gpfast's ops", None),
}


def _command(sub, name: str, run) -> argparse.ArgumentParser:
    """The parser of subcommand ``name`` (its texts from :data:`_ABOUT`), which calls ``run(args)``; ``args.parser``
    is this parser, whose ``error`` the checks after parsing call."""
    summary, description = _ABOUT[name]
    p = sub.add_parser(name, help=summary, description=description)
    p.set_defaults(func=run, parser=p)
    return p


def _add_common(p, device_default, device_help, quiet_help="no progress bars") -> None:
    p.add_argument("--device", type=device, metavar="DEVICE", default=device_default, help=device_help)
    p.add_argument("--quiet", action="store_true", help=quiet_help)


def _add_compare(sub) -> None:
    p = _command(sub, "compare", commands.cmd_compare)
    p.add_argument("--dataset", required=True, metavar="NAME", help="UCI set name, e.g. yacht, pol, kin40k")
    p.add_argument("--split", type=split_index, default=0, metavar="K", help="fixed train/test split, 0..9 (default 0)")
    p.add_argument("--iters", type=_POSITIVE, default=50, metavar="N", help="Adam steps for every row (default 50)")
    p.add_argument("--lr", type=positive_float, default=0.1, metavar="LR", help="Adam learning rate (default 0.1)")
    p.add_argument("--data-dir", default=None, metavar="DIR", help=_DATA_DIR_HELP)
    p.add_argument(
        "--out",
        default="./gpfast-results",
        metavar="DIR",
        help="output folder, created if missing (default ./gpfast-results)",
    )
    p.add_argument("--seed", type=_NONNEG, default=0, metavar="SEED", help="random seed (default 0)")
    _add_common(p, "cpu", "cpu, cuda or cuda:<index> (default cpu)")


def _add_fit_data(p) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--csv", metavar="FILE", help="your own table: comma-separated, a header row of column names")
    src.add_argument("--dataset", metavar="NAME", help="UCI set name")
    src.add_argument("--synthetic", type=int_at_least(2), metavar="N", help="N synthetic training points")
    p.add_argument(
        "--target",
        nargs="+",
        metavar="COLUMN",
        help="with --csv: the column(s) to predict; several share the hyperparameters (scikit-learn's semantics)",
    )
    p.add_argument(
        "--independent-outputs",
        action="store_true",
        help="with several --target columns: one GP per column, each with its own hyperparameters, trained together",
    )
    p.add_argument(
        "--features",
        nargs="+",
        metavar="COLUMN",
        help="with --csv: the input columns (default: every column but the target)",
    )
    p.add_argument(
        "--d", type=_POSITIVE, default=None, metavar="D", help="with --synthetic: input features (default 8)"
    )
    p.add_argument(
        "--test", type=_POSITIVE, default=None, metavar="M", help="with --synthetic: test points (default 10000)"
    )
    p.add_argument(
        "--split", type=split_index, default=None, metavar="K", help="with --dataset: UCI split, 0..9 (default 0)"
    )
    p.add_argument("--data-dir", default=None, metavar="DIR", help=f"with --dataset: {_DATA_DIR_HELP}")


def _add_fit_training(p) -> None:
    p.add_argument(
        "--iters",
        type=_NONNEG,
        default=None,
        metavar="N",
        help="cap on the optimiser's steps on the full data (default: ExactGP's, 1000; the fit stops earlier when "
        "it converges, as in the Python API)",
    )
    p.add_argument("--lr", type=positive_float, default=0.1, metavar="LR", help="Adam learning rate (default 0.1)")
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
        "--dtype", default="float32", choices=["float32", "float64"], help="training precision (default float32)"
    )
    p.add_argument(
        "--pretrain-subset",
        type=int_at_least(2),
        default=None,
        metavar="M",
        help="Wang et al. schedule: first train on a random subset of M points",
    )
    p.add_argument("--pretrain-iter", type=_NONNEG, default=None, metavar="N", help="steps on the subset (default 10)")
    p.add_argument("--distributed", action="store_true", help="split products over torch.distributed ranks")
    p.add_argument("--seed", type=_NONNEG, default=0, metavar="SEED", help="random seed (default 0)")


def _add_fit(sub) -> None:
    p = _command(sub, "fit", commands.cmd_fit)
    _add_fit_data(p)
    _add_fit_training(p)
    p.add_argument(
        "--checkpoint",
        default=None,
        metavar="FILE",
        help="resumable fit: write the training state here every --checkpoint-every steps, resume from it when it "
        "exists (same data and settings), delete it when the fit succeeds",
    )
    p.add_argument(
        "--checkpoint-every", type=_POSITIVE, default=None, metavar="K", help="steps between checkpoints (default 10)"
    )
    p.add_argument("--out", default=None, metavar="FILE", help="write the result as JSON here (folder created)")
    p.add_argument("--save", default=None, metavar="MODEL", help="save the fitted model here, for gpfast predict")
    _add_common(p, None, "cpu, cuda or cuda:<index> (default: cuda when available)")


def _add_predict(sub) -> None:
    p = _command(sub, "predict", commands.cmd_predict)
    p.add_argument("--model", required=True, metavar="FILE", help="a saved model")
    p.add_argument("--csv", required=True, metavar="FILE", help="comma-separated, a header row of column names")
    p.add_argument("--out", default=None, metavar="FILE", help="write here (default: stdout; folder created)")
    p.add_argument(
        "--features",
        nargs="+",
        metavar="COLUMN",
        help="the input columns, in order, for a model saved without column names",
    )
    _add_common(
        p,
        None,
        "cpu, cuda or cuda:<index> (default: the model's, or the CPU when it has no GPU)",
        "no summary line on stderr",
    )


def _add_data_commands(sub) -> None:
    p = _command(sub, "datasets", commands.cmd_datasets)
    p.add_argument("--data-dir", default=None, metavar="DIR", help=_DATA_DIR_HELP)
    p = _command(sub, "download", commands.cmd_download)
    p.add_argument("names", nargs="+", metavar="NAME", help="set name(s), e.g. pol kin40k (see gpfast datasets)")
    p.add_argument(
        "--data-dir", default=None, metavar="DIR", help="where to put them (default $GPFAST_DATA, else the user cache)"
    )
    p.add_argument("--overwrite", action="store_true", help="fetch again even when present and intact")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, description="Exact GP regression on gpfast's fused RBF kernel.")
    parser.add_argument("--version", action="version", version=_version_text())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    _add_compare(sub)
    _add_fit(sub)
    _add_predict(sub)
    _add_data_commands(sub)
    p = _command(sub, "build", commands.cmd_build)
    p.add_argument("--verbose", action="store_true", help="show the compiler's commands and output")
    return parser


# ------------------------------------------------------------------------------------------------------------
# entry point
# ------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Run the command line on ``argv`` (default ``sys.argv[1:]``) and return the exit status (0 ok, 1 the work
    failed, 2 wrong usage or input, 141 stdout closed by its reader); ``--help`` and ``--version`` print and
    return 0."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error already printed by Parser.error
        return exc.code if isinstance(exc.code, int) else 0
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        try:
            code = args.func(args)
            sys.stdout.flush()  # here, not at exit, so that a reader gone away (`| head`) is caught below
            return code
        except SystemExit as exc:  # a combination of options refused by parser.error after parsing
            return exc.code if isinstance(exc.code, int) else 0
        except UsageError as exc:
            _error(str(exc))
            return 2
        except BrokenPipeError:
            return _reader_gone()


def _reader_gone() -> int:
    """The reader of stdout closed it (``gpfast predict ... | head``): stop quietly, as ``yes | head`` does.

    stdout now points at /dev/null, so that the interpreter's own flush at exit does not fail again with a
    traceback; the status is the shell's for a process ended by SIGPIPE (128 + 13).
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout has no file descriptor (replaced by a test's capture)
        pass
    finally:
        os.close(devnull)
    return 128 + signal.SIGPIPE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
