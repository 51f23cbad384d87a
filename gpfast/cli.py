"""Command line: ``gpfast compare``, ``gpfast datasets``, ``gpfast build``.

Examples::

    gpfast compare --dataset yacht --iters 50 --device cpu
    python -m gpfast compare --dataset pol --data-dir ~/uci --device cuda --out results/
    gpfast datasets
    gpfast build --verbose
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PROG = "gpfast"

# ------------------------------------------------------------------------------------------------------------
# subcommands
# ------------------------------------------------------------------------------------------------------------


def _error(msg: str) -> int:
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    return 2


def cmd_compare(args) -> int:
    from gpfast import datasets
    from gpfast.bench.compare import compare
    from gpfast.bench.report import CSV_FIELDS, format_table, plot_rows, write_csv

    try:
        data = datasets.load_uci(args.dataset, split=args.split, data_dir=args.data_dir)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        return _error(str(exc))
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return _error(f"--device {args.device} but CUDA is not available; use --device cpu")
    if args.iters < 1:
        return _error(f"--iters must be >= 1, got {args.iters}")
    verbose = not args.quiet
    if verbose:
        print(f"{PROG} compare: {data!r}, {args.iters} Adam steps (lr {args.lr}), device {args.device}",
              file=sys.stderr)
    rows = compare(data, split=args.split, iters=args.iters, lr=args.lr, device=args.device, seed=args.seed,
                   verbose=verbose)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"compare_{args.dataset}_split{args.split}"
    meta = {"dataset": args.dataset, "split": args.split, "machine": rows[0]["machine"], "date": rows[0]["date"],
            "iters": args.iters, "lr": args.lr, "device": args.device, "seed": args.seed}
    stem.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=2, default=str))
    write_csv(rows, stem.with_suffix(".csv"), CSV_FIELDS)
    title = (f"{args.dataset} split {args.split} (n={data.n_train}, d={data.d}), {args.iters} Adam steps\n"
             f"{meta['machine']}, {meta['date'][:10]}")
    try:
        plot_rows(rows, stem.with_suffix(".png"), title)
        wrote = f"{stem}.csv, {stem}.json, {stem}.png"
    except ImportError:
        wrote = f"{stem}.csv, {stem}.json (no plot: matplotlib is missing; pip install 'gpfast[bench]')"
    print(f"{args.dataset} split {args.split}: n_train={data.n_train}, n_test={data.n_test}, d={data.d}; "
          f"{args.iters} Adam steps, lr {args.lr}, seed {args.seed}")
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
        print(f"known but not on disk (gpfast.datasets.download(names=[...]) fetches them): {', '.join(missing)}")
    return 0


def cmd_fit(args) -> int:
    """Fit gpfast.ExactGP on a UCI split or on synthetic data and report time, RMSE, NLL and memory.

    Under ``torchrun --nproc-per-node=K -m gpfast fit --distributed ...`` every rank computes its share of each
    covariance product; rank 0 prints and writes the result.
    """
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


def _fit_and_report(args, device, rank0: bool) -> int:
    import time

    import torch

    from gpfast import datasets
    from gpfast.estimator import ExactGP
    from gpfast.kernels import distributed
    from gpfast.metrics import regression_metrics

    if args.synthetic:
        data = datasets.synthetic_split(args.synthetic, args.test, args.d, noise=0.1, seed=args.seed)
    else:
        data = datasets.load_uci(args.dataset, split=args.split, data_dir=args.data_dir)
    gp = ExactGP(max_iter=args.iters, lr=args.lr, solver=args.solver, device=device, random_state=args.seed,
                 verbose=rank0 and not args.quiet, distributed=args.distributed,
                 pretrain_subset=args.pretrain_subset, pretrain_iter=args.pretrain_iter)
    on_cuda = str(device).startswith("cuda") or (device is None and torch.cuda.is_available())
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()

    def now():
        if on_cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    t0 = now()
    gp.fit(data.X_train, data.y_train)
    t1 = now()
    mean, std = gp.predict(data.X_test, return_std=True)
    t2 = now()
    scores = regression_metrics(mean, std**2, data.y_test)
    result = {
        "data": f"synthetic n={args.synthetic} d={args.d}" if args.synthetic else f"{args.dataset} split {args.split}",
        "n_train": int(data.n_train), "n_test": int(data.n_test), "d": int(data.d), "iters": args.iters,
        "solver": gp.solver_, "train_solver": getattr(gp, "train_solver_", gp.solver_),
        "ranks": distributed.world_size() if args.distributed else 1,
        "device": str(gp.device_), "train_s": t1 - t0, "s_per_iter": (t1 - t0) / max(gp.n_iter_, 1),
        "predict_s": t2 - t1, "rmse_std": scores["rmse_std"], "nll_std": scores["nll_std"],
        "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if on_cuda else None,
        "final_loss": gp.history_[-1] if gp.history_ else None,
    }
    if rank0:
        for k, v in result.items():
            print(f"{k:12s} {v:.4g}" if isinstance(v, float) else f"{k:12s} {v}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
    return 0


def cmd_build(args) -> int:
    from gpfast import _build

    argv = ["--verbose"] if args.verbose else []
    return int(_build.main(argv) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Exact GP regression on gpfast's fused RBF kernel.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("compare", help="stock GPyTorch vs GPyTorch+gpfast kernel vs gpfast.ExactGP on one split",
                       description="Train and evaluate stock GPyTorch, GPyTorch with gpfast's kernel, and "
                                   "gpfast.ExactGP on the same split with the same initial hyperparameters.")
    p.add_argument("--dataset", required=True, help="UCI set name, e.g. yacht, pol, kin40k")
    p.add_argument("--split", type=int, default=0, help="fixed train/test split, 0..9 (default 0)")
    p.add_argument("--iters", type=int, default=50, help="Adam steps for every row (default 50)")
    p.add_argument("--lr", type=float, default=0.1, help="Adam learning rate (default 0.1)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--data-dir", default=None, help="folder holding <name>/data.csv.gz (default $GPFAST_DATA)")
    p.add_argument("--out", default="./gpfast-results", help="output folder (default ./gpfast-results)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("fit", help="fit gpfast.ExactGP on a UCI split or synthetic data (torchrun for several GPUs)",
                       description="Fit gpfast.ExactGP and report train/predict time, RMSE, NLL (standardised) "
                                   "and peak GPU memory. For several GPUs: torchrun --nproc-per-node=K -m gpfast "
                                   "fit --distributed ...")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--dataset", help="UCI set name")
    src.add_argument("--synthetic", type=int, metavar="N", help="N synthetic training points")
    p.add_argument("--d", type=int, default=8, help="features of the synthetic data (default 8)")
    p.add_argument("--test", type=int, default=10000, help="synthetic test points (default 10000)")
    p.add_argument("--split", type=int, default=0, help="UCI split, 0..9 (default 0)")
    p.add_argument("--data-dir", default=None, help="folder holding <name>/data.csv.gz (default $GPFAST_DATA)")
    p.add_argument("--iters", type=int, default=50, help="optimiser steps on the full data (default 50)")
    p.add_argument("--lr", type=float, default=0.1, help="Adam learning rate (default 0.1)")
    p.add_argument("--solver", default="auto", choices=["auto", "cholesky", "cg"])
    p.add_argument("--pretrain-subset", type=int, default=None, help="Wang et al. schedule: pretrain on this many")
    p.add_argument("--pretrain-iter", type=int, default=10, help="steps on the subset (default 10)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--distributed", action="store_true", help="split products over torch.distributed ranks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the result as JSON here")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_fit)

    p = sub.add_parser("datasets", help="list the data sets available and where they are from")
    p.add_argument("--data-dir", default=None, help="folder holding <name>/data.csv.gz (default $GPFAST_DATA)")
    p.set_defaults(func=cmd_datasets)

    p = sub.add_parser("build", help="compile (JIT) and load gpfast's ops")
    p.add_argument("--verbose", action="store_true", help="show the compiler's commands and output")
    p.set_defaults(func=cmd_build)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
