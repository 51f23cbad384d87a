"""Where a step of GPyTorch's own training loop goes, with GPyTorch's kernel (row a) and with gpfast's (row b).

    python -m experiments.gpytorch_step --data-dir .data/uci --device cuda                  # pol, elevators, bike
    python -m experiments.gpytorch_step --device cpu --synthetic 1500 4 --steps 2           # a small CPU run

Per set: the textbook loop of :func:`gpfast.bench.compare.gpytorch_adam` (``-ExactMarginalLogLikelihood``,
``torch.optim.Adam`` at lr 0.1, GPyTorch's default settings) on the standardised training set, float32, from
GPyTorch's initial hyperparameters, for each kernel in turn: ``--warmup`` steps, ``--steps`` timed steps (wall
time, the device synchronised after each; their median), then the same number of steps under torch.profiler.
Columns per kernel: the median step, the device time a step (the kernels and copies the profiler saw), and that
time split by the operator that launched it: the covariance's forward and backward (gpfast's ops, or for
GPyTorch's kernel the ATen operators of its autograd graph, which the profiler cannot tell from the rest and so
count under "rest"), the products with K (``aten::mm``/``aten::matmul``/``aten::bmm``/``gpfast::dense_matmul``),
gpfast's derivative for the marginal likelihood (``stored_backward`` from the stored K on CUDA, the matrix-free
``rbf_matmul_backward`` elsewhere), and the rest. The operators that launched the most device time a step are listed
under the table. A profiled step runs longer than a timed one; the split is of device time, not of the step.

Writes ``<stem>.{md,json}`` in ``--out`` (default experiments/results), naming the machine, the date and the commit.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from pathlib import Path

import gpytorch
import torch
from torch.autograd import DeviceType

from experiments import RESULTS
from gpfast.bench.compare import _inputs, default_init, gpytorch_model
from gpfast.bench.report import md_table
from gpfast.bench.timing import git_rev, machine, sync, today

#: Operators whose device time counts as each part (the outermost such operator above a kernel names its part).
PARTS = {
    "covariance": ("gpfast::rbf_covariance", "gpfast::rbf_covariance_backward"),
    "derivative": ("gpfast::stored_backward", "gpfast::rbf_matmul_backward"),
    "products": ("aten::mm", "aten::matmul", "aten::bmm", "gpfast::dense_matmul", "aten::addmm", "aten::baddbmm"),
}


def _steps(model, count, device):
    """``count`` steps of GPyTorch's loop; the wall time of each, the device synchronised."""
    model.train()
    model.likelihood.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x, y = model.train_inputs[0], model.train_targets
    times = []
    for _ in range(count):
        sync(device)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = -mll(model(x), y)
        loss.backward()
        opt.step()
        loss.item()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def _part(stack: list[str]) -> str:
    for name in stack:  # outermost first
        for part, ops in PARTS.items():
            if name in ops:
                return part
    return "rest"


def _device_split(prof, steps: int, on_gpu: bool):
    """Device time a step by part, and the operators that launched the most device time a step, in ms."""
    events = prof.events()
    parts: dict[str, float] = collections.defaultdict(float)
    outer: dict[str, float] = collections.defaultdict(float)
    for e in events:
        if on_gpu:
            kernels = [k for k in e.kernels] if e.device_type == DeviceType.CPU else []
            us = sum(k.duration for k in kernels)
        else:
            us = e.self_cpu_time_total if e.device_type == DeviceType.CPU else 0.0
        if us <= 0:
            continue
        stack, node = [], e
        while node is not None:
            stack.append(node.name)
            node = node.cpu_parent
        stack.reverse()
        parts[_part(stack)] += us / 1000 / steps
        # torch.library's autograd wrapper runs an op's forward inside a range named after its backward node
        name = e.cpu_parent.name if e.name.startswith("GeneratedBackwardFor") and e.cpu_parent else e.name
        outer[name] += us / 1000 / steps
    top = sorted(outer.items(), key=lambda kv: -kv[1])[:8]
    return dict(parts), top


def run(X, y, device, kernels, warmup, steps):
    init = default_init(X.shape[1])
    rows = []
    for kernel in kernels:
        model = gpytorch_model(X, y, kernel, init, device)
        _steps(model, warmup, device)
        times = _steps(model, steps, device)
        on_gpu = device.type == "cuda"
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
        with torch.profiler.profile(activities=acts) as prof:
            _steps(model, steps, device)
        parts, top = _device_split(prof, steps, on_gpu)
        rows.append(
            {
                "kernel": kernel,
                "step_ms": 1000 * statistics.median(times),
                "device_ms": sum(parts.values()),
                **{f"{p}_ms": parts.get(p, 0.0) for p in (*PARTS, "rest")},
                "top": [[name, ms] for name, ms in top],
            }
        )
        del model
        if on_gpu:
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--datasets", nargs="+", default=["pol", "elevators", "bike"])
    ap.add_argument("--synthetic", nargs=2, type=int, metavar=("N", "D"), help="synthetic data instead of UCI sets")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kernels", nargs="+", default=["gpytorch", "gpfast"])
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--stem", default="gpytorch_step")
    args = ap.parse_args(argv)

    dev = torch.device(args.device)
    table = []
    if args.synthetic:
        n, d = args.synthetic
        g = torch.Generator().manual_seed(0)
        X = torch.randn(n, d, generator=g)
        y = torch.sin(2 * X[:, 0]) + 0.3 * X[:, 1:].sum(1) + 0.1 * torch.randn(n, generator=g)
        sets = [(f"synthetic{n}x{d}", X.to(dev), y.to(dev))]
    else:
        sets = []
        for name in args.datasets:
            _, _, X, y, _, _ = _inputs(name, 0, args.data_dir, args.device)
            sets.append((name, X, y))
    for name, X, y in sets:
        for r in run(X, y, dev, args.kernels, args.warmup, args.steps):
            table.append({"dataset": name, "n": X.shape[0], "d": X.shape[1], **r})
            print(f"{name} {r['kernel']}: step {r['step_ms']:.2f} ms, device {r['device_ms']:.2f} ms", flush=True)

    head = f"Machine: {machine(dev)}. Date: {today()}. Commit: {git_rev()}."
    cols = ["dataset", "n", "d", "kernel", "step_ms", "device_ms", "covariance_ms", "derivative_ms", "products_ms",
            "rest_ms"]  # fmt: skip
    lines = [
        "# A step of GPyTorch's training loop with GPyTorch's kernel and with gpfast's",
        "",
        head + f" {args.warmup} warm-up steps, then {args.steps} timed steps (their median) and {args.steps} "
        "profiled steps (the split of device time a step, by the outermost operator: gpfast's covariance ops, "
        "its marginal-likelihood derivative, products with K, the rest; GPyTorch's own kernel's autograd falls "
        "under rest).",
        "",
        md_table(cols, [[r[c] for c in cols] for r in table]),
        "",
        "Operators that launched the most device time a step (ms):",
        "",
    ]
    for r in table:
        lines.append(f"- {r['dataset']} {r['kernel']}: " + ", ".join(f"{n} {ms:.2f}" for n, ms in r["top"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.stem}.md").write_text("\n".join(lines) + "\n")
    meta = {"machine": machine(dev), "date": today(), "commit": git_rev(), "warmup": args.warmup, "steps": args.steps}
    (out / f"{args.stem}.json").write_text(json.dumps({**meta, "rows": table}, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
