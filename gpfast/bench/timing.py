"""Timing and memory measurement for benchmarks, and the names of the machine, date and commit measured."""

from __future__ import annotations

import datetime
import gc
import os
import platform
import resource
import statistics
import subprocess
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

__all__ = [
    "COPY_BW",
    "EXP_RATE",
    "CUDA_WARM_UP_POINTS",
    "WARM_UP_POINTS",
    "PeakMemory",
    "cpu_name",
    "cuda_time_ms",
    "git_rev",
    "graph_time_ms",
    "machine",
    "now",
    "sync",
    "time_ms",
    "today",
    "warm_up",
]

COPY_BW = 4.27e12  # bytes/s, device-to-device copy measured on the H200 (read + write), see the op issue
H200_SMS, H200_CLOCK = 132, 1.98e9
EXP_RATE = 16 * H200_SMS * H200_CLOCK  # exponentials per second on the SFUs


#: Training points of each untimed warm-up run (:func:`warm_up`).
WARM_UP_POINTS = 64

#: On a GPU, the warm-up of a benchmark whose fits are larger takes this many points: twice the size up to which
#: ``ExactGP`` trains by the exact objective there, so that it trains by the engine, with its stored K, the pivoted
#: Cholesky's blocks and the CUDA graphs, and factors by cuSOLVER, whose first calls in a process load kernels and
#: libraries. After a 64-point warm-up, pol, the first set of a UCI run, took 277 ms over its first step and the
#: six sets after it 19-124 ms (H200, 2026-12-03).
CUDA_WARM_UP_POINTS = 8192


def warm_up(runs: Iterable[Callable[[], object]]) -> None:
    """Call each of ``runs`` once, untimed, so that one-off costs (loading the compiled ops, lazy imports and first
    calls, allocator start-up) fall on no timed run. A run should be the timed one in small: one step on at most
    :data:`WARM_UP_POINTS` points. Its warnings and errors are dropped: the timed run meets and reports the same.
    """
    for run in runs:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # e.g. a column constant on the first rows: not the user's fit
                run()
        except Exception:  # the timed run reports any problem
            pass
    gc.collect()


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


def time_ms(fn, device, reps: int = 3, warmup: int = 1) -> float:
    """Median time of ``fn()`` in ms: by CUDA events on a CUDA ``device`` (:func:`cuda_time_ms`), by the wall clock
    on the CPU (after ``warmup`` calls)."""
    if torch.device(device).type == "cuda":
        return cuda_time_ms(fn, warmup=warmup, reps=reps)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
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


def sync(device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class PeakMemory:
    """Peak memory during a block: CUDA ``max_memory_allocated`` (after ``reset_peak_memory_stats``), or on the CPU
    the peak increase of the resident set size over its value at the start (sampled every 2 ms from
    ``/proc/self/statm``; where that is missing, the increase of ``getrusage``'s ``ru_maxrss``)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.peak: int | None = None
        self.kind = ""

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.kind = "cuda_max_allocated"
            return self
        self._start = _rss_bytes()
        if self._start is not None:
            self.kind = "cpu_rss_peak_increase"
            self._max = self._start
            self._stop = threading.Event()

            def sample():
                while not self._stop.is_set():
                    r = _rss_bytes()
                    if r is not None and r > self._max:
                        self._max = r
                    self._stop.wait(0.002)

            self._thread = threading.Thread(target=sample, daemon=True)
            self._thread.start()
        else:
            self.kind = "cpu_maxrss_increase"
            self._start_ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = int(torch.cuda.max_memory_allocated(self.device))
        elif self.kind == "cpu_rss_peak_increase":
            self._stop.set()
            self._thread.join()
            r = _rss_bytes()
            if r is not None and r > self._max:
                self._max = r
            self.peak = int(self._max - self._start)
        else:
            self.peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self._start_ru)
        return False


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} CPU"


def machine(device=None) -> str:
    """The machine measured: the GPU (name, SMs, memory) for a CUDA device (default: CUDA when available), else
    the CPU model and core count; with the torch version."""
    use_cuda = torch.cuda.is_available() if device is None else str(device).startswith("cuda")
    if use_cuda and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.device("cuda") if device is None else torch.device(device))
        return f"{p.name} ({p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB), torch {torch.__version__}"
    return f"{cpu_name()} ({os.cpu_count()} cores), torch {torch.__version__}"


def today() -> str:
    return datetime.date.today().isoformat()


def now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


def git_rev() -> str:
    """The commit measured: the ``COMMIT`` file at the repository root when there is one (experiments/run_h200.sh
    writes it from its ``--commit`` argument: the GPU machine's copy of the tree carries a .git whose HEAD is not the
    commit sent), else git's."""
    stamp = Path(__file__).resolve().parents[2] / "COMMIT"
    try:
        rev = stamp.read_text().strip()
        if rev:
            return rev
    except OSError:
        pass
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        return rev or "unknown"
    except OSError:
        return "unknown (no git checkout)"
