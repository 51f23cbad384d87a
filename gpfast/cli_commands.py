"""What each ``gpfast`` subcommand does (:mod:`gpfast.cli` parses and dispatches here): load, call the library, print.

Each ``cmd_<name>(args)`` takes the parsed arguments and returns the exit status; a problem with the user's input
raises :class:`gpfast.cli_checks.UsageError`. The library is imported inside each command, so that the commands that
need no GP (``datasets``, ``download``) load no compiled code.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

from gpfast.cli_checks import PROG, UsageError, check_fit_args, input_file, not_an_input, output_file, output_folder

__all__ = ["cmd_build", "cmd_compare", "cmd_datasets", "cmd_download", "cmd_fit", "cmd_predict"]


def _error(msg: str) -> None:
    print(f"{PROG}: error: {msg}", file=sys.stderr)


def cmd_compare(args) -> int:
    from gpfast import datasets
    from gpfast.bench.compare import compare
    from gpfast.bench.report import format_table, write_comparison

    try:
        data = datasets.load_uci(args.dataset, split=args.split, data_dir=args.data_dir)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        raise UsageError(str(exc)) from None
    out = output_folder(args.out, "--out")
    steps = f"{args.iters} Adam steps"
    if not args.quiet:
        print(f"{PROG} compare: {data!r}, {steps} (lr {args.lr}), device {args.device}", file=sys.stderr)
    rows = compare(
        data, split=args.split, iters=args.iters, lr=args.lr, device=args.device, seed=args.seed, verbose=not args.quiet
    )
    meta = {"dataset": args.dataset, "split": args.split, "machine": rows[0]["machine"], "date": rows[0]["date"]}
    meta.update(iters=args.iters, lr=args.lr, device=args.device, seed=args.seed)
    title = f"{args.dataset} split {args.split} (n={data.n_train}, d={data.d}), {steps}\n{meta['machine']}, "
    wrote = write_comparison(rows, out / f"compare_{args.dataset}_split{args.split}", meta, title + meta["date"][:10])
    print(
        f"{args.dataset} split {args.split}: n_train={data.n_train}, n_test={data.n_test}, d={data.d}; "
        f"{steps}, lr {args.lr}, seed {args.seed} (times exclude start-up: a warm-up run first)"
    )
    print(f"machine: {meta['machine']}; date: {meta['date']}; memory: {rows[0].get('mem_kind')}")
    print(format_table(rows))
    print(f"wrote {wrote}")
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


def cmd_datasets(args) -> int:
    from gpfast import datasets

    avail = datasets.available(args.data_dir)
    where = f"(from --data-dir, else ${datasets.ENV_VAR}, else the user cache)"
    print(f"data folder: {datasets.resolve_data_dir(args.data_dir)} {where}")
    print(f"shipped with the package: {', '.join(datasets.SHIPPED)}")
    if avail:
        print("available now:")
        for name in avail:
            size = datasets.UCI_SIZES.get(name)
            extra = f" ({size[0]} rows, {size[1]} inputs)" if size else ""
            print(f"  {name:16s}{extra}  {datasets.find_dataset(name, args.data_dir)}")
    missing = [n for n in datasets.UCI_NAMES if n not in avail]
    if missing:
        print(f"known but not on disk (`{PROG} download NAME ...` fetches them): {', '.join(missing)}")
    return 0


def cmd_download(args) -> int:
    from gpfast import datasets

    unknown = [n for n in args.names if n not in datasets.UCI_SIZES]
    if unknown:
        known = ", ".join(datasets.UCI_NAMES)
        raise UsageError(f"unknown dataset name(s) {', '.join(map(repr, unknown))}; known names: {known}")
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


def cmd_fit(args) -> int:
    """Fit gpfast.ExactGP on a UCI split, synthetic data or a CSV file and report time, RMSE, NLL and memory.

    Under ``torchrun --nproc-per-node=K -m gpfast fit --distributed ...`` every rank computes its share of each
    covariance product; rank 0 prints and writes the result.
    """
    check_fit_args(args)
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
    from gpfast.csv_table import read_training_data

    try:
        if args.csv:
            X, y, names = read_training_data(args.csv, args.target, args.features)
            targets = args.target[0] if len(args.target) == 1 else args.target
            return X, y, None, None, f"{args.csv} (target{'s' if y.ndim == 2 else ''} {targets!r})", names
        if args.synthetic:
            data = datasets.synthetic_split(args.synthetic, args.test, args.d, noise=0.1, seed=args.seed)
            description = f"synthetic n={args.synthetic} d={args.d}"
        else:
            data = datasets.load_uci(args.dataset, split=args.split, data_dir=args.data_dir)
            description = f"{args.dataset} split {args.split}"
    except (ValueError, TypeError, FileNotFoundError) as exc:
        raise UsageError(str(exc)) from None
    return data.X_train, data.y_train, data.X_test, data.y_test, description, None


def _fit_and_report(args, device, rank0: bool) -> int:
    import numpy as np

    from gpfast.bench.fit import timed_fit

    X, y, X_test, y_test, description, names = _fit_data(args)
    params = dict(lr=args.lr, solver=args.solver, dtype=args.dtype, device=device, random_state=args.seed)
    params.update(verbose=rank0 and not args.quiet, distributed=args.distributed, optimizer=args.optimizer)
    pretrain = (args.pretrain_subset, args.pretrain_iter) if args.pretrain_subset is not None else None
    params.update(pretrain=pretrain, tol=args.tol)
    every = args.checkpoint_every
    params["checkpoint"] = args.checkpoint if args.checkpoint is None or every is None else (args.checkpoint, every)
    params.update(independent_outputs=args.independent_outputs)
    if args.iters is not None:  # else the estimator's own cap: train to convergence, as the Python API does
        params["max_iter"] = args.iters
    try:
        gp, result = timed_fit(params, X, y, X_test, y_test)
    except ValueError as exc:  # the data or a combination of settings ExactGP refuses
        raise UsageError(str(exc)) from None
    # several outputs give arrays (an entry per output): as lists, for the JSON file
    result = {"data": description, **{k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in result.items()}}
    if names is not None:
        gp.feature_names_in_ = np.asarray(names, dtype=object)  # so that `gpfast predict` finds them by name
        result.update(features=list(names), target=args.target[0] if len(args.target) == 1 else args.target)
        if len(args.target) > 1:
            gp.target_names_ = list(args.target)  # saved with the model: `gpfast predict` names its columns
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
    from gpfast.csv_table import read_model_inputs, write_predictions
    from gpfast.estimator import ExactGP

    model = input_file(args.model, "--model")
    csv_path = input_file(args.csv, "--csv")
    out = output_file(args.out, "--out") if args.out else None
    if out is not None:
        not_an_input(out, "--out", {"--csv": csv_path, "--model": model})
    try:
        gp = ExactGP.load(model, device=args.device)
        X, names = read_model_inputs(csv_path, getattr(gp, "feature_names_in_", None), gp.n_features_in_, args.features)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    t0 = time.perf_counter()
    with warnings.catch_warnings():  # the columns were matched by name above; the array has none
        warnings.filterwarnings("ignore", message="X does not have valid feature names")
        mean, std = gp.predict(X, return_std=True)
    seconds = time.perf_counter() - t0
    if out is None:
        write_predictions(sys.stdout, mean, std, getattr(gp, "target_names_", None))
    else:
        with open(out, "w", newline="") as f:
            write_predictions(f, mean, std, getattr(gp, "target_names_", None))
    if not args.quiet:
        print(
            f"{PROG} predict: {len(mean)} row(s), mean and std of {model} (inputs {', '.join(names)}) on "
            f"{gp.device_} in {seconds:.3g} s -> {out if out is not None else 'stdout'}",
            file=sys.stderr,
        )
    return 0


def cmd_build(args) -> int:
    from gpfast import _build

    return int(_build.main(["--verbose"] if args.verbose else []) or 0)
