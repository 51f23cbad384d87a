"""Where an engine step's time goes: step time against its product floor, launches, syncs and host reads per step,
and the split into products, backward, preconditioner and the rest, from torch.profiler.

    python -m experiments.step_anatomy --device cuda                      # the seven UCI sets, whole training sets
    python -m experiments.step_anatomy --device cpu --synthetic 600 4     # a small CPU run (the test does this)

Per set: float32 training inputs on the device, gpfast's model at GPyTorch's initial hyperparameters, the engine
with its defaults (K stored when it fits half the free memory), ``--warmup`` Adam steps (lr 0.1; default 20) to
leave the cold first solve and the accuracy rule's growth of the preconditioner rank behind (with 3, the steps
measured still built rank-3200 factors op by op and took 3x the median step of a 50-step fit on pol), then
``--steps`` profiled steps (the engine's objective plus the Adam update, both as ``ExactGP.fit`` runs them: the
objective's natural path at the hyperparameters on the host, and gpfast's Adam there). Columns:

- rank / cap: the preconditioner rank and CG cap that the engine's accuracy rule had reached;
- step ms: wall time per step, the median of the timed steps, unprofiled (CG iterations and pivot blocks replayed
  as CUDA graphs on a GPU, as the engine's defaults do; "graphed" the share of steps whose CG ran so);
- floor ms: the passes over a stored float32 K that a step needs at the device's bandwidth (``--bandwidth``, default
  the H200's 4.27 TB/s; on the CPU the bandwidth of one measured ``K @ V``): the step's products, the K rebuild and
  one backward read;
- launches, syncs, memcpys per step: CUDA runtime calls in profiled steps with the same settings
  (``cudaLaunchKernel`` and friends, and ``cudaGraphLaunch``, one per replay;
  ``cudaStreamSynchronize``/``cudaDeviceSynchronize``; ``cudaMemcpyAsync``), none on the CPU;
- launches by part (listed under the table): the same profiled steps' launches by the innermost of the products,
  backward and preconditioner ranges around each one ("rest" outside them), and the outermost operators that
  launch most, which name where the rest comes from;
- host reads per step: tensor values handed to Python inside the engine step (``.item()``, ``.tolist()``,
  ``float()``, ``bool()``, ``.cpu()``...), counted in separate unprofiled steps;
- the split: device time (CPU time on the CPU) inside the engine's products (K rebuild and K̂ V), its fused
  backward, its preconditioner (builds, applies, rescaling) and the rest of the step, as shares of the step, from
  further profiled steps run op by op (kernels replayed inside a CUDA graph cannot be told apart by range). On a
  GPU it is the sum of the kernels and copies that the profiler ties to the operators launching them, each under
  the innermost part above its operator; the spans that profiler ranges also leave on the device's timeline are
  not kernels and are left out. "device ms" is that sum per step, so that step ms minus device ms is time the GPU
  waited on the host;
- busy / profiled ms (on a GPU): in the profiled steps with the settings' CUDA graphs, the device's busy time a
  step (the union of its kernels' and copies' spans) and the profiled step's wall time; under the table, what the
  device waited for in the rest (:func:`device_idle`);
- kernels (listed under the table): the kernels with the most device time per step in those steps, with their
  part and calls per step.

``--forward KERNEL`` runs the engine with its covariance forward forced to one kernel of the private op
(``gpfast.ops.COVARIANCE_KERNELS``, whatever the shape), to compare a kernel's effect on whole steps.

Writes ``<stem>.{md,json}`` in ``--out`` (default experiments/results).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import json
import time
from pathlib import Path

import gpytorch
import numpy as np
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from experiments import RESULTS
from gpfast import datasets, ops
from gpfast.bench.compare import default_init
from gpfast.bench.report import md_table
from gpfast.bench.timing import git_rev, machine, today
from gpfast.datasets.uci import load_uci
from gpfast.estimator.fitting import loss_and_gradient
from gpfast.estimator.hyperparameters import HyperparameterSpace
from gpfast.estimator.optimize import Adam
from gpfast.estimator.solver import free_memory_bytes
from gpfast.models import ExactGPModel
from gpfast.train import Engine, CGSettings
from gpfast.train import state as state_module
from gpfast.train import preconditioner as pc_module

UCI7 = ["pol", "elevators", "bike", "kin40k", "protein", "keggdirected", "keggundirected"]
PARTS = ("products", "backward", "preconditioner")
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")
LAUNCH = (
    "cudaGraphLaunch",  # one launch for all the kernels of a captured graph
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaLaunchCooperativeKernel",
)
#: Runtime calls that give the device work besides launches (copies and fills).
ISSUE = ("cudaMemcpyAsync", "cudaMemcpy", "cudaMemsetAsync")
SYNC = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


@contextlib.contextmanager
def forward_kernel(kernel: str | None):
    """Inside, :func:`gpfast.ops.rbf_covariance` forms K (not its diagonal) by the named kernel of the private op
    whatever the shape; ``None`` changes nothing. No autograd: the engine forms K without it."""
    if kernel is None:
        yield
        return
    real = ops.rbf_covariance

    def forced(x1, x2, lengthscale, outputscale=1.0, diag=False, *, check_values=True):
        if diag:
            return real(x1, x2, lengthscale, outputscale, diag, check_values=check_values)
        return ops._rbf_covariance_kernel(x1, x2, lengthscale, outputscale, kernel, check_values=check_values)

    ops.rbf_covariance = forced
    try:
        yield
    finally:
        ops.rbf_covariance = real


def _labelled(fn, label):
    def inner(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)

    return inner


@contextlib.contextmanager
def labels(engine):
    """Profiler ranges around the engine's products, backward and preconditioner work (patched on its objects)."""
    prod = engine.product
    saved = {name: getattr(prod, name) for name in ("matmul", "update", "backward")}
    prod.matmul = _labelled(saved["matmul"], "anatomy::products")
    prod.update = _labelled(saved["update"], "anatomy::products")
    prod.backward = _labelled(saved["backward"], "anatomy::backward")
    cls = pc_module.Preconditioner
    methods = {(cls, name): getattr(cls, name) for name in ("solve", "set_scales", "sample")}
    methods.update(
        {(pc_module.BuildGraph, name): getattr(pc_module.BuildGraph, name) for name in ("__init__", "__call__")}
    )
    build = state_module.pivoted_cholesky
    try:
        for (owner, name), fn in methods.items():
            setattr(owner, name, _labelled(fn, "anatomy::preconditioner"))
        state_module.pivoted_cholesky = _labelled(build, "anatomy::preconditioner")
        yield
    finally:
        for (owner, name), fn in methods.items():
            setattr(owner, name, fn)
        state_module.pivoted_cholesky = build
        for name, fn in saved.items():
            setattr(prod, name, fn)


@contextlib.contextmanager
def count_host_reads(seen: list):
    """Record the name of every tensor-to-Python read while inside."""
    real = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counted(name):
        def inner(self, *args, **kwargs):
            seen.append(name)
            return real[name](self, *args, **kwargs)

        return inner

    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, counted(name))
        yield
    finally:
        for name, fn in real.items():
            setattr(torch.Tensor, name, fn)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bandwidth(K: torch.Tensor, device) -> float:
    """Bytes per second of one measured ``K @ V`` (11 columns) on this device (the CPU's floor)."""
    V = torch.randn(K.shape[1], 11, dtype=K.dtype, device=device)
    K @ V
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(3):
        K @ V
    _sync(device)
    return 3 * K.numel() * K.element_size() / (time.perf_counter() - t0)


def anatomy(name, X, y, device, steps, warmup, bw, options, symmetric_forward=True, symmetric_product=None) -> dict:
    X = torch.as_tensor(X, dtype=torch.float32, device=device)
    y = torch.as_tensor(y, dtype=torch.float32, device=device)
    n, d = X.shape
    torch.manual_seed(0)
    model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood()).to(device)
    init = default_init(d)
    with torch.no_grad():
        model.covar_module.base_kernel.lengthscale = torch.tensor(init["init_lengthscale"], device=device)
    engine = Engine(CGSettings(**options), free_memory=free_memory_bytes(device))
    closure = engine.objective(model)
    engine.product.symmetric_forward = symmetric_forward
    engine.product.symmetric_product = symmetric_product
    model.train()
    step = adam_steps(closure, model)
    for _ in range(warmup):
        step()
    reads = []
    for _ in range(2):
        seen = []
        with count_host_reads(seen):
            step()
        reads.append(len(seen))
    first = len(engine.record.cg_iterations)
    walls = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        walls.append(time.perf_counter() - t0)
    wall = float(np.median(walls))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with labels(engine), profile(activities=activities) as prof:  # the runtime calls, CUDA graphs as the settings say
        graphed_ms = 1e3 * _steps(step, steps, device)
    counts = _runtime_counts(prof, steps)
    counts.update(launch_sources(prof.events(), LAUNCH, steps))
    if device.type == "cuda":
        counts.update(device_idle(prof.events()), profiled_ms=graphed_ms)
    graphs, engine._state.graphs = engine._state.graphs, None  # kernels replayed in a graph escape the labels
    with labels(engine), profile(activities=activities) as prof:
        profiled = _steps(step, steps, device)
    engine._state.graphs = graphs
    shares = _split(prof, device, steps)
    rec = engine.record
    products = float(np.mean(rec.products[first:]))
    if bw is None:
        bw = bandwidth(engine.product.K, device) if engine.product.K is not None else float("nan")
    floor = (products + 2) * n * n * 4 / bw
    row = {"set": name, "n": n, "d": d, "product": rec.product, "step_ms": 1e3 * wall,
           "step_ms_max": 1e3 * max(walls), "floor_ms": 1e3 * floor,
           "cg_iterations": float(np.mean(rec.cg_iterations[first:])), "products": products,
           "host_reads": max(reads), "rank": engine._state.rank, "cap": engine._state.cap,
           "graphed": float(np.mean(rec.graphed[first:])), "op_by_op_profiled_ms": 1e3 * profiled}  # fmt: skip
    row.update(counts)  # runtime calls from the steps with the settings' CUDA graphs
    row.update(shares)  # the split, device times and kernels from the steps run op by op
    engine.finish()
    return row


def _part_and_operator(e):
    """The innermost labelled part above event ``e`` (``None`` outside them) and the outermost operator (``aten::``,
    ``gpfast::``, ...) above it, or ``e``'s own name where there is none."""
    part, outer = None, e.name
    p = getattr(e, "cpu_parent", None)
    while p is not None:
        if p.name.startswith("anatomy::"):
            if part is None and p.name != "anatomy::step":
                part = p.name.split("::", 1)[1]
        elif "::" in p.name:
            outer = p.name
        p = getattr(p, "cpu_parent", None)
    return part, outer


def _kernel_name(name: str, width: int = 72) -> str:
    """A kernel's name without its return type and arguments, cut to ``width`` characters."""
    name = name.removeprefix("void ").split("(", 1)[0]
    return name if len(name) <= width else name[: width - 3] + "..."


def device_split(events, steps, top=12) -> dict:
    """Device time per step (ms) from the kernels and copies that the profiler ties to the operators that launched
    them (``FunctionEvent.kernels``): ``device_ms`` in all, ``device_ms_<part>`` under each part (the innermost
    labelled range above the operator, "rest" outside them) and ``kernels``, the ``top`` kernels with the most
    time (``[part, name, ms per step, calls per step]``). The spans of profiler ranges (record_function, the
    optimiser's own) on the device's timeline come tied to their ranges like kernels; they are left out, being no
    work of the device's."""
    ranges = _range_names(events)
    by_part, time, calls = collections.Counter(), collections.Counter(), collections.Counter()
    for e in events:
        kernels = getattr(e, "kernels", None)
        if not kernels or e.name in ranges:
            continue
        part = _part_and_operator(e)[0] or "rest"
        for k in kernels:
            if k.name in ranges:
                continue
            key = (part, _kernel_name(k.name))
            by_part[part] += k.duration
            time[key] += k.duration
            calls[key] += 1
    out = {"device_ms": sum(by_part.values()) / 1e3 / steps}
    out.update({f"device_ms_{p}": by_part[p] / 1e3 / steps for p in (*PARTS, "rest")})
    out["kernels"] = [[part, name, us / 1e3 / steps, calls[(part, name)] / steps]
                      for (part, name), us in time.most_common(top)]  # fmt: skip
    return out


def _range_names(events) -> set:
    """Names of the profiler ranges (record_function, the optimiser's own), whose spans on the device's timeline are
    no work of the device's."""
    return {e.name for e in events if getattr(e, "is_user_annotation", False) or e.name.startswith("anatomy::")}


def device_idle(events, top=8) -> dict:
    """How long the device waited inside each step (the ``anatomy::step`` ranges): ``busy_ms`` a step, the union
    of its kernels' and copies' spans on the device's timeline (a replayed graph's kernels each with its own span),
    and ``idle_ms`` the rest of the step's wall time. ``waits`` names the ``top`` largest sources of that wait, per
    step (``[part, operator, ms]``): each gap goes to the last launch (kernel, graph or copy, :data:`LAUNCH` and
    :data:`ISSUE`) the host made before the gap ended, by that launch's innermost labelled part and outermost
    operator (as in :func:`launch_sources`): the work the device waited for was that launch's. The gap after a
    step's last kernel goes to "after the last kernel". By time rather than by the profiler's correlation ids,
    which leave a replayed graph's kernels without their launch."""
    ranges = _range_names(events)
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    steps = sorted((e for e in cpu if e.name == "anatomy::step"), key=lambda e: e.time_range.start)
    issued = sorted((e for e in cpu if e.name in LAUNCH or e.name in ISSUE), key=lambda e: e.time_range.start)
    starts = [e.time_range.start for e in issued]
    work = sorted(((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type != DeviceType.CPU and e.name not in ranges))  # fmt: skip
    waits, wall = collections.Counter(), 0.0
    for st in steps:
        a, b = st.time_range.start, st.time_range.end
        wall += b - a
        cursor = a
        for start, end in work:
            if end <= a or start >= b:
                continue
            if start > cursor:
                i = bisect.bisect_right(starts, start) - 1
                part, op = _part_and_operator(issued[i]) if i >= 0 else (None, "(no launch before it)")
                waits[(part or "rest", op)] += start - cursor
            cursor = max(cursor, min(end, b))
        if b > cursor:
            waits[("rest", "after the last kernel")] += b - cursor
    n = max(len(steps), 1)
    idle = sum(waits.values())
    return {"busy_ms": (wall - idle) / 1e3 / n, "idle_ms": idle / 1e3 / n,
            "waits": [[part, op, us / 1e3 / n] for (part, op), us in waits.most_common(top)]}  # fmt: skip


def launch_sources(events, names, steps, top=10) -> dict:
    """Where the events named ``names`` (the launches) come from, per step: ``launches_<part>`` for each part's
    profiler range (the innermost one around the launch; "rest" outside them) and ``launch_ops``, the ``top``
    outermost operators that launch most (``[name, per step]``; a launch outside any operator, such as a graph
    replay's, under its own name)."""
    parts, ops = collections.Counter(), collections.Counter()
    for e in events:
        if e.name not in names:
            continue
        part, outer = _part_and_operator(e)
        parts[part or "rest"] += 1
        ops[outer] += 1
    out = {f"launches_{p}": parts[p] / steps for p in (*PARTS, "rest")}
    out["launch_ops"] = [[name, c / steps] for name, c in ops.most_common(top)]
    return out


def adam_steps(closure, model):
    """A function that takes one Adam step (lr 0.1) as ``ExactGP.fit`` takes it: the closure's natural path at the
    log hyperparameters on the host, then gpfast's Adam there (no bounds: the steps stay far from them)."""
    space = HyperparameterSpace.unbounded(model)
    fun = loss_and_gradient(closure, model, space, "step_anatomy")
    opt, theta = Adam(space.size, 0.1), [space.get(model)]

    def step() -> None:
        _, grad = fun(theta[0])
        theta[0] = opt.step(theta[0], grad)

    return step


def _steps(step, steps, device) -> float:
    """Seconds per step of ``steps`` steps, each in the profiler range ``anatomy::step``."""
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        with record_function("anatomy::step"):
            step()
    _sync(device)
    return (time.perf_counter() - t0) / steps


def _runtime_counts(prof, steps) -> dict:
    """CUDA runtime calls per step: launches (a graph replay one), syncs and memcpys."""
    by_name = {e.key: e for e in prof.key_averages()}

    def count(names):
        return sum(by_name[k].count for k in names if k in by_name) / steps

    return {"launches": count(LAUNCH), "syncs": count(SYNC), "memcpys": count(("cudaMemcpyAsync", "cudaMemcpy"))}


def _split(prof, device, steps) -> dict:
    """The step's shares by part (``<part>_share``): of the kernels' device time on a GPU (with
    :func:`device_split`'s totals and kernels), of the parts' CPU time on the CPU."""
    if device.type == "cuda":
        out = device_split(prof.events(), steps)
        total = out["device_ms"]
        out.update({f"{p}_share": out[f"device_ms_{p}"] / total if total else float("nan") for p in (*PARTS, "rest")})
        return out
    by_name = {e.key: e for e in prof.key_averages()}

    def cpu_us(key):
        e = by_name.get(key)
        return 0.0 if e is None else float(e.cpu_time_total)

    total = cpu_us("anatomy::step") or sum(cpu_us(f"anatomy::{p}") for p in PARTS)
    out = {f"{p}_share": cpu_us(f"anatomy::{p}") / total if total else float("nan") for p in PARTS}
    out["rest_share"] = max(0.0, 1.0 - sum(out[f"{p}_share"] for p in PARTS))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", nargs="+", default=UCI7)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--max-n", type=int, default=None, help="use the first max-n training rows of each set")
    ap.add_argument("--synthetic", type=int, nargs=2, metavar=("N", "D"), default=None, help="synthetic data instead")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--bandwidth", type=float, default=None, help="bytes/s for the floor (default: 4.27e12 on CUDA)")
    ap.add_argument("--options", default="{}", help="json of CGSettings fields")
    ap.add_argument("--forward", choices=ops.COVARIANCE_KERNELS, default=None,
                    help="form K by this kernel of the private op whatever the shape (CUDA)")  # fmt: skip
    ap.add_argument(
        "--forward-layout",
        choices=("symmetric", "padded"),
        default="symmetric",
        help="the stored K(x, x) by the symmetric forward (the engine's default: each pair once for float32 at "
        "17 <= d <= 32) or as K(x, padded columns)",
    )
    ap.add_argument(
        "--product-layout",
        choices=("auto", "symmetric", "full"),
        default="auto",
        help="the stored products as the engine chooses (half of K read for more than 12 columns), always by "
        "ops.symmetric_matmul (half of K read) or always by ops.dense_matmul (all of K read)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--stem", default="step_anatomy")
    ap.add_argument("--rows-from", type=Path, default=None, help="run nothing: the table of the rows that an earlier "
                    "run printed to this log (one whose time limit cut it before the table); give that run's "
                    "--machine, --commit and --date")  # fmt: skip
    ap.add_argument("--machine", default=None, help="with --rows-from: the machine the rows were measured on")
    ap.add_argument("--commit", default=None, help="with --rows-from: the commit they were measured at")
    ap.add_argument("--date", default=None, help="with --rows-from: the date they were measured on")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.forward is not None and device.type != "cuda":
        ap.error(f"--forward names a CUDA kernel; the device is {device.type}")
    if args.rows_from is not None:
        if not (args.machine and args.commit and args.date):
            ap.error("--rows-from needs the measuring run's --machine, --commit and --date")
        lines = args.rows_from.read_text().splitlines()
        write(args, [json.loads(line) for line in lines if line.startswith('{"set"')], device)
        return
    bw = args.bandwidth or (4.27e12 if device.type == "cuda" else None)
    options = json.loads(args.options)
    if args.synthetic:
        n, d = args.synthetic
        data = datasets.synthetic_split(n, 1, d, noise=0.1, seed=0)
        sets = [(f"synthetic-{n}-{d}", data.X_train, data.y_train)]
    else:
        sets = []
        for name in args.datasets:
            ds = load_uci(name, 0, data_dir=args.data_dir)
            sets.append((name, ds.X_train[: args.max_n], ds.y_train[: args.max_n]))
    rows = []
    for name, X, y in sets:
        with forward_kernel(args.forward):
            sym_fwd = args.forward_layout == "symmetric"
            sym_prod = {"auto": None, "symmetric": True, "full": False}[args.product_layout]
            rows.append(anatomy(name, X, y, device, args.steps, args.warmup, bw, options, sym_fwd, sym_prod))
        print(json.dumps(rows[-1]), flush=True)
    write(args, rows, device)


def write(args, rows, device) -> None:
    table = md_table(
        [
            "set",
            "n",
            "d",
            "product",
            "rank / cap",
            "step ms",
            "device ms",
            "busy / profiled ms",
            "floor ms",
            "step / floor",
            "CG it",
            "products",
            "launches",
            "syncs",
            "memcpys",
            "host reads",
            "graphed",
            "products %",
            "backward %",
            "precond %",
            "rest %",
        ],  # fmt: skip
        [
            [
                r["set"],
                r["n"],
                r["d"],
                r["product"],
                f"{r['rank']} / {r['cap']}",
                f"{r['step_ms']:.1f}",
                f"{r['device_ms']:.1f}" if "device_ms" in r else "-",
                f"{r['busy_ms']:.1f} / {r['profiled_ms']:.1f}" if "busy_ms" in r else "-",
                f"{r['floor_ms']:.2f}",
                f"{r['step_ms'] / r['floor_ms']:.1f}",
                f"{r['cg_iterations']:.1f}",
                f"{r['products']:.1f}",
                f"{r['launches']:.0f}",
                f"{r['syncs']:.0f}",
                f"{r['memcpys']:.0f}",
                r["host_reads"],
                f"{r['graphed']:.0%}",
            ]
            + [f"{100 * r[f'{p}_share']:.0f}" for p in (*PARTS, "rest")]  # fmt: skip
            for r in rows
        ],
    )
    sources = "\n".join(
        f"- {r['set']}: "
        + ", ".join(f"{p} {r[f'launches_{p}']:.0f}" for p in (*PARTS, "rest"))
        + "; most: "
        + ", ".join(f"{name} {c:.0f}" for name, c in r["launch_ops"])
        for r in rows
    )
    kernels = "\n".join(
        f"- {r['set']}: "
        + "; ".join(f"{name} ({part}) {ms:.2f} ms, {calls:.0f} calls" for part, name, ms, calls in r["kernels"])
        for r in rows
        if r.get("kernels")
    )
    waits = "\n".join(
        f"- {r['set']}: busy {r['busy_ms']:.1f} of {r['profiled_ms']:.1f} ms; waits: "
        + "; ".join(f"{op} ({part}) {ms:.2f} ms" for part, op, ms in r["waits"])
        for r in rows
        if r.get("waits")
    )
    info = {"machine": args.machine or machine(device), "date": args.date or today(),
            "commit": args.commit or git_rev(), "device": str(device), "steps": args.steps,
            "warmup": args.warmup, "forward": args.forward,
            "forward_layout": args.forward_layout, "product_layout": args.product_layout}  # fmt: skip
    if args.rows_from is not None:
        info["rows_from"] = str(args.rows_from)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.stem}.json").write_text(json.dumps({**info, "rows": rows}, indent=2))
    text = (
        f"# Anatomy of a training-engine step ({device.type})\n\n"
        f"Machine: {info['machine']}. Date: {info['date']}. Commit: {info['commit']}. Engine defaults"
        + (f" with K formed by the forward kernel {info['forward']!r}" if info.get("forward") else "")
        + (" with K(x, x) formed as K(x, padded columns)" if info.get("forward_layout") == "padded" else "")
        + (" with products reading all of K (dense_matmul)" if info.get("product_layout") == "full" else "")
        + (" with products reading half of K (symmetric_matmul)" if info.get("product_layout") == "symmetric" else "")
        + ", float32, "
        f"{args.warmup} Adam steps (lr 0.1) from GPyTorch's initial hyperparameters, then {args.steps} timed steps "
        f"(unprofiled: step ms, their median), {args.steps} profiled steps with the same settings (launches, syncs "
        f"and memcpys: CUDA runtime calls per step, a graph replay one launch) and {args.steps} profiled steps op by "
        "op (the split: device time, CPU time on the CPU, as a share of the step); host reads are tensor values "
        "handed to Python inside the engine step; graphed: the share of steps whose CG iterations were CUDA-graph "
        "replays; device ms: the time of the kernels and copies a step in the steps run op by op (on a GPU; step "
        "ms less device ms is time the GPU waited on the host, less what the profiler adds). "
        "The floor is (products + 2) passes over a float32 K at the bandwidth "
        f"({'4.27 TB/s' if device.type == 'cuda' and args.bandwidth is None else 'measured K @ V'})."
        + (
            f" Rows read from the log of a run cut by its time limit ({info['rows_from']})."
            if "rows_from" in info
            else ""
        )
        + "\n\n"
        + table
        + "\n"
        "\nLaunches a step by part (the innermost part's profiler range around each launch, in the profiled steps "
        "with the settings' CUDA graphs) and the outermost operators that launch most (a launch outside any "
        "operator, such as a graph replay, under its own name):\n\n"
        + sources
        + "\n"
        + (
            "\nThe device's waits a step, in the profiled steps with the settings' CUDA graphs (busy: the union of "
            "its kernels' and copies' spans inside the step; each gap goes to the host's last launch before it ended, "
            "by that launch's part and outermost operator, and the gap after the step's last kernel to 'after the "
            "last kernel'; "
            "the profiler's own host time lengthens the gaps, so they bound what the host costs):\n\n" + waits + "\n"
            if waits
            else ""
        )
        + (
            "\nThe kernels with the most device time a step (their part; the steps run op by op):\n\n" + kernels + "\n"
            if kernels
            else ""
        )
    )
    (args.out / f"{args.stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
