"""Timing and reporting helpers shared by the experiment scripts."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
COPY_BW = 4.27e12  # bytes/s, device-to-device copy measured on the H200 (read + write), see the op issue
H200_SMS, H200_CLOCK = 132, 1.98e9
EXP_RATE = 16 * H200_SMS * H200_CLOCK  # exponentials per second on the SFUs


def cuda_time_ms(fn, warmup: int = 3, reps: int = 20) -> float:
    """Median wall time of ``fn()`` on the current stream, by CUDA events, after warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_time_ms(fn, calls_per_graph: int = 50, reps: int = 20) -> float:
    """GPU time per call of ``fn`` measured by replaying a CUDA graph of ``calls_per_graph`` calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls_per_graph):
            fn()
    return cuda_time_ms(g.replay, warmup=3, reps=reps) / calls_per_graph


def machine() -> str:
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        return f"{p.name} ({p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB), torch {torch.__version__}"
    return f"{cpu_name()} ({os.cpu_count()} cores visible), torch {torch.__version__}"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} CPU"


def today() -> str:
    return datetime.date.today().isoformat()


def git_rev() -> str:
    """The commit measured: ``GPFAST_COMMIT`` when set (the GPU machine gets a copy of the tree without .git)."""
    import os

    if os.environ.get("GPFAST_COMMIT"):
        return os.environ["GPFAST_COMMIT"]
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        return rev or "unknown (no git checkout)"
    except OSError:
        return "unknown"


def write_results(stem: str, header: str, table_md: str, rows: list[dict]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {"machine": machine(), "date": today(), "commit": git_rev()}
    (RESULTS / f"{stem}.json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    text = f"# {header}\n\nMachine: {meta['machine']}. Date: {meta['date']}. Commit: {meta['commit']}.\n\n{table_md}\n"
    (RESULTS / f"{stem}.md").write_text(text)
    print(text)


def md_table(columns: list[str], rows: list[list]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)
