"""The host itself: its last-level cache (how large a model may be and stay in it), its CPU's
name, edgemtp's own time per program call, per logit and per row on it, and its power draw
where an energy counter is readable."""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from edgemtp.devices.calibrate.measure import RESIDENT_LINEARS, RESOLUTION_US, Call, timings
from edgemtp.devices.calibrate.xnnpack import int4_linear, int4_weight_bytes, xnnpack_program


def resident_mb() -> float | None:
    """Half the last-level cache, from sysfs (None where unreadable): what a model's weights
    and K/V may take and still be found in it at the next call (an estimate: the rest holds
    activations, other methods and other processes' data)."""
    best: tuple[int, float] | None = None
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 2**-10, "M": 1.0, "G": 2**10}
        if kind == "Instruction" or not size or size[-1] not in units:
            continue
        mb = float(size[:-1]) * units[size[-1]]
        if best is None or level > best[0]:
            best = (level, mb)
    return best[1] / 2 if best else None


def resident_size(limit_mb: float, quick: bool = False) -> int:
    """Side of the square int4 linears of the resident probe: `RESIDENT_LINEARS` of them take
    at most a quarter of `limit_mb` (at most 1024 each: 4.5 MiB in all; 256 when `quick`), so
    that they stay in the cache between calls."""
    n = 256 if quick else 1024
    while n > 128 and RESIDENT_LINEARS * int4_weight_bytes(n, n) > limit_mb * 2**20 / 4:
        n //= 2
    return n


def measured_power(seconds: float = 3.0) -> tuple[float, float] | str:
    """(idle W, W while the fp32 GEMM runs) from a cumulative energy counter, or why not."""
    from edgemtp.runtime.probes import detect

    reader = detect()
    why = reader.available()
    if why is not None:
        return why
    a = torch.randn(1024, 1024)

    def watts(work: Call | None) -> float:
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


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class StandInProgram:
    """A runner whose every method runs `work` (a model-sized memory stream) and returns zeros
    of that method's output shapes (as `StaticBackend` reads them): decoding through it times
    edgemtp's host side as it runs between real program calls, caches cleared by each."""

    def __init__(self, shapes: Any, hidden: int, vocab: int, candidates: int, work: Call):
        self.shapes, self.work = shapes, work
        zeros = torch.zeros
        self.outputs: dict[str, tuple[torch.Tensor, ...]] = {
            "prefill_intermediate": (zeros(1, dtype=torch.long),),
            "prefill_final": (zeros(hidden), zeros(vocab)),
            "draft_step": (zeros(hidden), torch.arange(candidates), zeros(candidates)),
        }
        for depth in range(shapes.max_draft + 1):
            self.outputs[f"verify_{depth}"] = (zeros(depth + 1, vocab), zeros(depth + 1, hidden))
        self.methods = dict.fromkeys(self.outputs)

    def call(self, method: str, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.work()
        return self.outputs[method]


@dataclass(frozen=True)
class HostCosts:
    """edgemtp's own host side per program call (beside a program that streams past the cache,
    and beside one whose data stays in it), per logit it chooses from, per row beyond a call's
    first."""

    call_us: float
    resident_call_us: float
    ns_per_logit: float
    row_us: float


def host_costs(quick: bool = False) -> HostCosts:
    """edgemtp's own host side: greedy decoding of the embedded model's shapes (Q4_0 token and
    int8 per-layer tables, as bundles store them) through `StaticBackend` over a
    `StandInProgram` that streams 32 MiB of int4 weights per call (past the cache, as a large
    model's calls clear it) and over one that streams a 64 x 64 linear (a small model's: the
    host finds its own data in the cache), in turn in 5 rounds so that the host's drift falls
    on both alike; and numpy's argmax over a Gemma 4 logit row. A step's time outside the
    program less its argmax is the per-call cost; a 512-token prefill's (8 calls of 64 rows:
    table gathers, input copies) beside the streaming program, less 8 such calls, per row
    beyond each call's first, the per-row cost."""
    from edgemtp.model.checkpoint import target_config
    from edgemtp.model.embedded import TARGET
    from edgemtp.model.static import StaticShapes
    from edgemtp.model.tables import TokenTables
    from edgemtp.quantize.q4_0 import pack_q4_0, quantize_q4_0
    from edgemtp.quantize.tables import Int8Rows, Q4_0Rows, quantize_int8_rows
    from edgemtp.runtime.backends import StaticBackend
    from edgemtp.runtime.generate import FixedDepth, decode
    from edgemtp.runtime.sampling import argmax_rows

    row = torch.randn(1, 262_144, generator=torch.Generator().manual_seed(0))
    argmax_s = min(timings(lambda: argmax_rows(row), 5 if quick else 50))
    ns_per_logit = argmax_s / row.shape[1] * 1e9

    cfg = target_config(json.loads((TARGET / "config.json").read_text()), str(TARGET))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    ple = torch.randn(
        cfg.vocab_size_per_layer_input,
        cfg.num_layers * cfg.hidden_size_per_layer_input,
        generator=g,
    )
    tables = TokenTables(
        Q4_0Rows(pack_q4_0(quantize_q4_0(tokens)), cfg.hidden_size),
        Int8Rows(*quantize_int8_rows(ple)),
        cfg.num_layers,
        cfg.hidden_size_per_layer_input,
    )
    shapes = StaticShapes(max_context=512, max_draft=0, chunk=64)

    def backend(n: int) -> StaticBackend:
        weights, x = xnnpack_program(int4_linear(n, n), torch.randn(1, n)), torch.randn(1, n)
        program = StandInProgram(
            shapes, cfg.hidden_size, cfg.vocab_size, 1, lambda: weights.forward((x,))
        )
        return StaticBackend(program, tables, cfg, name="stand-in")

    streaming, resident = backend(1024 if quick else 8192), backend(64)
    steps: dict[StaticBackend, list[float]] = {streaming: [], resident: []}
    for _ in range(5):
        for b, outside in steps.items():
            result = decode(b, list(range(3, 19)), 6 if quick else 60, policy=FixedDepth(0))
            outside += [s.seconds["total"] - s.seconds["target"] for s in result.steps
                        if s.kind == "decode"]  # fmt: skip
    argmax_us = cfg.vocab_size * ns_per_logit * 1e-3
    call_us, resident_us = (
        max(statistics.median(steps[b]) * 1e6 - argmax_us, RESOLUTION_US)
        for b in (streaming, resident)
    )

    prompt = [3 + i % (cfg.vocab_size - 3) for i in range(8 * shapes.chunk)]
    outside = []
    for _ in range(3 if quick else 15):
        streaming.meter.seconds.clear()
        start = time.perf_counter()
        streaming.prefill(prompt, 0)
        outside.append(time.perf_counter() - start - streaming.meter.seconds["target"])
    rows = len(prompt) - 8
    row_us = max(statistics.median(outside) * 1e6 - 8 * call_us, 0.0) / rows
    return HostCosts(call_us, resident_us, ns_per_logit, row_us)
