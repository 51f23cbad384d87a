"""Argument types and checks of the ``gpfast`` command line (:mod:`gpfast.cli`): each refuses a bad value, file or
folder, and a bad combination of ``fit``'s options, before any work starts, with a message naming the option, the
value seen and the value expected."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path

PROG = "gpfast"

__all__ = [
    "Parser",
    "UsageError",
    "check_fit_args",
    "device",
    "input_file",
    "int_at_least",
    "not_an_input",
    "output_file",
    "output_folder",
    "positive_float",
    "split_index",
]


class UsageError(Exception):
    """Something wrong with what the user gave (an argument, a file it names, that file's contents): reported
    as ``gpfast: error: <message>`` with exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse's parser, reporting errors as ``gpfast: error: ...`` for every subcommand (argparse's own
    prefix would be ``gpfast fit: error:``); the usage line above still names the subcommand."""

    def error(self, message):
        self.print_usage(sys.stderr)
        self.exit(2, f"{PROG}: error: {message}\n")


def int_at_least(low: int):
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


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def split_index(text: str) -> int:
    from gpfast.datasets import N_SPLITS

    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value < N_SPLITS:
        raise argparse.ArgumentTypeError(f"must be one of the {N_SPLITS} fixed splits 0..{N_SPLITS - 1}, got {text!r}")
    return value


def device(text: str) -> str:
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


def input_file(path: str, option: str) -> Path:
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


def output_file(path: str, option: str) -> Path:
    """The file an output goes to, its folder created when missing."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise UsageError(f"{option} {path}: is a folder; give a file name")
    if p.exists() and not os.access(p, os.W_OK):
        raise UsageError(f"{option} {path}: exists and is not writable (permission denied)")
    _make_folder(p.parent, option, path)
    return p


def not_an_input(out: Path, option: str, inputs: dict[str, Path | None]) -> None:
    """Refuse an output that would overwrite one of the command's own input files."""
    for name, p in inputs.items():
        if p is not None and out.resolve() == Path(p).resolve():
            raise UsageError(f"{option} {out} is also the {name} file; writing it would destroy the input")


def output_folder(path: str, option: str) -> Path:
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise UsageError(f"{option} {path}: exists and is not a folder")
    _make_folder(p, option, path)
    return p


def check_fit_args(args) -> None:
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
        repeated = sorted({c for c in args.target if args.target.count(c) > 1})
        if repeated:
            parser.error(f"--target names the column(s) {', '.join(map(repr, repeated))} more than once")
        args.csv = input_file(args.csv, "--csv")
    if args.independent_outputs and (args.target is None or len(args.target) < 2):
        parser.error("--independent-outputs applies only with several --target columns (--csv)")
    if args.distributed and args.solver == "cholesky":
        parser.error("--distributed runs the matrix-free CG solver: use --solver auto or cg")
    if args.checkpoint_every is not None and args.checkpoint is None:
        parser.error("--checkpoint-every applies only with --checkpoint")
    if args.checkpoint and args.distributed:
        parser.error("--checkpoint is not supported with --distributed")
    outputs = ("out", "save", "checkpoint")
    for option in outputs:
        if getattr(args, option):
            setattr(args, option, output_file(getattr(args, option), f"--{option}"))
    for i, a in enumerate(outputs):
        for b in outputs[i + 1 :]:
            if getattr(args, a) and getattr(args, b) and getattr(args, a).resolve() == getattr(args, b).resolve():
                parser.error(f"--{a} and --{b} name the same file")
    for option in outputs:
        if getattr(args, option):
            not_an_input(getattr(args, option), f"--{option}", {"--csv": args.csv if args.csv else None})
    defaults = {"d": 8, "test": 10000, "split": 0, "pretrain_iter": 10}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
