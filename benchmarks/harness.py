"""What the benchmark scripts share: the host's description, result files, plots, call timing.

The scripts run as `python benchmarks/SCRIPT.py`, which puts this folder on `sys.path`, so they
import this module as `from harness import ...` (`peers/run.py` adds this folder itself). Nothing
here imports torch or matplotlib until a function needs it: some scripts only drive subprocesses.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
EDGEMTP = [sys.executable, "-m", "edgemtp.cli"]  # the CLI of the Python running the script
GIB = 2**30

SHARED_HOST = "shared 2-core machine (other agents' work may run beside it)"
# What most results record under "machine"; a script that has always recorded other entries
# passes its own `fields` so that its result keeps its keys.
MACHINE_FIELDS = (
    "cpu",
    "cores",
    "memory_gib",
    "available_gib_at_start",
    "loadavg_at_start",
    "os",
    "python",
    "torch",
    "executorch",
    "onnxruntime",
    "threads",
    "note",
)


def log(message: str) -> None:
    """A progress line on stderr with the time of day (stdout carries the report)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- the host -----------------------------------------------------------------------------------


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (where it has none, e.g. on ARM: the platform's)."""
    return next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0]) * 1024
    return out


def machine(
    threads: int | None = None, fields: Sequence[str] = MACHINE_FIELDS, note: str = SHARED_HOST
) -> dict[str, Any]:
    """This host as a result records it: `fields` in that order, from cpu, cores (this process
    may use), memory_gib, available_gib_at_start, swap_gib, loadavg_at_start, os, python, torch,
    executorch, onnxruntime, threads and note. Each is read only when asked for (torch is
    imported only for "torch")."""
    from importlib.metadata import version

    def torch_version() -> str:
        import torch

        return torch.__version__

    probes: dict[str, Callable[[], Any]] = {
        "cpu": cpu_name,
        "cores": lambda: len(os.sched_getaffinity(0)),
        "memory_gib": lambda: round(meminfo()["MemTotal"] / GIB, 1),
        "available_gib_at_start": lambda: round(meminfo()["MemAvailable"] / GIB, 1),
        "swap_gib": lambda: round(meminfo().get("SwapTotal", 0) / GIB, 1),
        "loadavg_at_start": os.getloadavg,
        "os": lambda: f"Linux {platform.release()}",
        "python": platform.python_version,
        "torch": torch_version,
        "executorch": lambda: version("executorch"),
        "onnxruntime": lambda: version("onnxruntime"),
        "threads": lambda: threads,
        "note": lambda: note,
    }
    return {field: probes[field]() for field in fields}


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# --- timing -------------------------------------------------------------------------------------


def ms_per_call(call: Callable[[], object], calls: int, warmup: int = 0) -> float:
    """Mean wall-clock ms of one call over `calls` calls back to back, after `warmup` untimed
    ones (first calls pay for page faults and lazy setup)."""
    for _ in range(warmup):
        call()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e3


# --- results ------------------------------------------------------------------------------------


def command_line(script: str) -> str:
    """This run as a line to paste: `python benchmarks/SCRIPT ARGS`, quoted for the shell."""
    return "python " + shlex.join([f"benchmarks/{script}", *sys.argv[1:]])


def write_json(path: Path, data: Any, indent: int = 1) -> None:
    path.write_text(json.dumps(data, indent=indent) + "\n")


def write_report(stem: Path, report: str, plot: Callable[[Path], None] | None = None) -> None:
    """STEM.md and, given `plot` (called with the PNG's path), STEM.png. Suffixes are appended,
    never substituted: a stem may hold a dot (`export_e2b_s0.1`)."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{stem}.md").write_text(report)
    if plot is not None:
        plot(Path(f"{stem}.png"))


def write_results(
    stem: Path, result: Any, report: str, plot: Callable[[Path], None] | None = None
) -> None:
    """STEM.json (the result, indented by one), then STEM.md and STEM.png as `write_report`."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    write_json(Path(f"{stem}.json"), result)
    write_report(stem, report, plot)


# --- plots --------------------------------------------------------------------------------------


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend: the scripts write PNG files and open no window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path | str, dpi: int = 110) -> None:
    """Lay the figure out, write it and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
