"""`edgemtp devices calibrate`: measure this machine and write its device profile.

What is measured (each a median of several runs, with the threads the runtime would use):
- sustained memory bandwidth: summing a 512 MiB float32 array (read-only streaming, as a decode
  step reads its weights); the best run is kept as the profile's peak, since the bus's
  theoretical peak is not known here;
- peak matmul throughput per dtype: torch's CPU GEMMs (fp32 and fp16 `mm`, int8 `_int_mm`) at
  1024^3 (fp16 512^3) — what this host's libraries reach, not the silicon's datasheet;
- dispatch cost per operator: ExecuTorch programs of one and of 201 chained XNNPACK linears of
  64 x 64 on one row, run in this process: (t201 - t1) / 200;
- power: RAPL, where readable, while idle and while the fp32 GEMM runs; elsewhere the profile
  says it is an estimate and why.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from edgemtp.runtime.probes import physical_memory

Say = Callable[[str], None]
SOURCE = "measured: edgemtp devices calibrate"


def _median_seconds(run: Callable[[], object], repeat: int) -> list[float]:
    run()  # warm-up: page faults, thread pools, lazy initialisation
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return times


def memory_bandwidth(repeat: int = 7, floats: int = 2**27) -> tuple[float, float]:
    """(median, best) GB/s of streaming reads (default 512 MiB: far past any cache)."""
    data = torch.ones(floats)
    times = _median_seconds(lambda: data.sum(), repeat)
    return data.nbytes / statistics.median(times) / 1e9, data.nbytes / min(times) / 1e9


def matmul_tops(dtype: str, n: int = 1024, repeat: int = 5) -> float:
    """Median T(FL)OPS of an n^3 GEMM in `dtype` ("fp32", "fp16", "int8")."""
    if dtype == "int8":
        a = torch.randint(-128, 127, (n, n), dtype=torch.int8)
        b = torch.randint(-128, 127, (n, n), dtype=torch.int8)
        run: Callable[[], object] = lambda: torch._int_mm(a, b)  # noqa: E731
    else:
        kind = {"fp32": torch.float32, "fp16": torch.float16}[dtype]
        a, b = torch.randn(n, n, dtype=kind), torch.randn(n, n, dtype=kind)
        run = lambda: a @ b  # noqa: E731
    return 2 * n**3 / statistics.median(_median_seconds(run, repeat)) / 1e12


def _chain_program(ops: int, folder: Path) -> Path:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    class Chain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(ops):
                x = self.linear(x)
            return x

    exported = torch.export.export(Chain(), (torch.zeros(1, 64),))
    program = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()])
    path = folder / f"chain{ops}.pte"
    path.write_bytes(program.to_executorch().buffer)
    return path


def executorch_dispatch_us(threads: int, calls: int = 2000) -> tuple[float, float]:
    """(µs per XNNPACK operator, µs per program call) from chains of 1 and 201 linears of
    64 x 64 on one row: 8 k multiply-adds each, so what is left is an operator's fixed cost
    (setup, thread-pool dispatch). A chain of tiny adds would say 0.1 µs: XNNPACK runs those
    on one thread, where a model's GEMMs go through the thread pool."""
    from executorch.extension.pybindings import portable_lib

    portable_lib._unsafe_reset_threadpool(threads)
    with tempfile.TemporaryDirectory() as tmp:
        modules = {n: portable_lib._load_for_executorch(str(_chain_program(n, Path(tmp))))
                   for n in (1, 201)}  # fmt: skip
        x = (torch.zeros(1, 64),)
        per_call = {}
        for n, module in modules.items():
            times = _median_seconds(lambda m=module: [m.forward(x) for _ in range(calls)], 5)
            per_call[n] = statistics.median(times) / calls
    return (per_call[201] - per_call[1]) / 200 * 1e6, per_call[1] * 1e6


def measured_power(seconds: float = 3.0) -> tuple[float, float] | str:
    """(idle W, W while the fp32 GEMM runs) from a cumulative energy counter, or why not."""
    from edgemtp.runtime.probes import detect

    reader = detect()
    why = reader.available()
    if why is not None:
        return why
    a = torch.randn(1024, 1024)

    def watts(work: Callable[[], object] | None) -> float:
        first = reader.sample()
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            work() if work else time.sleep(0.05)
        last = reader.sample()
        if first.energy_j is None or last.energy_j is None or not last.cumulative:
            raise RuntimeError("not a cumulative energy counter")
        return (last.energy_j - first.energy_j) / (last.t - first.t)

    try:
        return watts(None), watts(lambda: a @ a)
    except RuntimeError as err:
        return f"{reader.name}: {err}"


def _entry(value: float, source: str, note: str) -> str:
    return f"{{ value = {value:.6g}, source = {json.dumps(source)}, note = {json.dumps(note)} }}"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibrate(threads: int, say: Say, quick: bool = False) -> str:
    """Measure this machine; its profile as TOML text (`quick`: small sizes, for tests)."""
    when = time.strftime("%Y-%m-%d")
    src = f"{SOURCE} ({when})"
    torch.set_num_threads(threads)
    say("memory bandwidth (512 MiB reads)")
    bw, best = memory_bandwidth(floats=2**22 if quick else 2**27)
    tops = {}
    for dtype in ("int8", "fp16", "fp32"):
        say(f"{dtype} GEMM throughput")
        n = 128 if quick else 512 if dtype == "fp16" else 1024  # fp16 GEMMs are slow on x86
        tops[dtype] = matmul_tops(dtype, n)
    say("ExecuTorch dispatch (chains of 1 and 201 small XNNPACK linears)")
    per_op, per_call = executorch_dispatch_us(threads, 50 if quick else 2000)
    say("power")
    power = measured_power(0.2 if quick else 3.0)
    ram = physical_memory() / 1e9
    lines = [
        f"# This machine, measured by `edgemtp devices calibrate --threads {threads}` on {when}.",
        "# Numbers marked measured come from the runs named in their notes.",
        "",
        f"name = {json.dumps('This host (' + (platform.node() or 'unnamed') + ')')}",
        f"soc = {json.dumps(f'{_cpu_name()}, {os.cpu_count()} logical CPUs')}",
        'memory = "unknown type (measured bandwidth below)"',
        f"ram_gb = {_entry(ram, src, 'physical memory from sysconf (SC_PHYS_PAGES x page size)')}",
        'battery_wh = "mains"',
    ]
    if isinstance(power, str):
        reason = power
        idle = _entry(
            10.0, "estimate", f"no power reading here ({reason}); 10 W: a server or desktop "
            "platform's idle share, generic"
        )  # fmt: skip
        active = _entry(
            8.0 * threads, "estimate", f"no power reading here ({reason}); 8 W per busy core "
            f"x {threads} threads, a generic figure for x86 server cores"
        )  # fmt: skip
    else:
        idle_w, busy_w = power
        idle = _entry(idle_w, src, "RAPL energy counter over 3 s idle")
        active = _entry(
            max(busy_w - idle_w, 0.1), src, f"RAPL over 3 s of fp32 GEMM on {threads} threads "
            f"({busy_w:.1f} W) minus idle ({idle_w:.1f} W)"
        )  # fmt: skip
    lines += [
        f"idle_w = {idle}",
        "",
        "[delegates.cpu]",
        f'unit = "{threads} threads of {_cpu_name()}"',
        'dispatch_unit = "kernel"',
        f"threads = {_entry(threads, src, 'the threads every measurement here ran with')}",
        "memory_bandwidth_gbs = "
        + _entry(bw, src, "median of 7 timed sums of a 512 MiB float32 array (streaming reads)"),
        "peak_memory_bandwidth_gbs = "
        + _entry(
            max(best, bw), src, "the best of the same 7 runs (this host's bus peak is unknown)"
        ),
        "dispatch_us = "
        + _entry(
            max(per_op, 0.01),
            src,
            f"ExecuTorch, per XNNPACK operator: programs of 1 and 201 "
            f"chained adds on 64 floats, (t201 - t1) / 200; a program call costs {per_call:.1f} us",
        ),  # fmt: skip
        f"active_w = {active}",
        "",
        "[delegates.cpu.peak_tops]",
    ]
    notes = {
        "int8": "torch._int_mm, 1024^3 int8 GEMM, median of 5",
        "fp16": "torch.mm in float16, 512^3, median of 5 (no fast fp16 path on most x86 CPUs)",
        "fp32": "torch.mm in float32, 1024^3, median of 5",
    }
    for dtype, value in tops.items():
        lines.append(f"{dtype} = {_entry(value, src, notes[dtype])}")
    return "\n".join(lines) + "\n"
