"""ExecuTorch's XNNPACK probes: the kernels an ExecuTorch bundle's CPU methods run, each lowered
as export lowers the bundles and timed in this process (int4 and fp32 linears, the per-operator
and per-call dispatch, nodes that are not matmuls, attention, the portable kernels)."""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from edgemtp.devices.calibrate.measure import (
    GEMM_CALLS,
    RESIDENT_LINEARS,
    RESOLUTION_US,
    STREAM_LINEARS,
    Call,
    attention_rates,
    gemm_rates,
    interleaved_medians,
    median_seconds,
    ns_per_element,
    stream_rate,
    timings,
)


def xnnpack_program(module: torch.nn.Module, *inputs: torch.Tensor) -> Any:
    """`module` lowered to XNNPACK as export lowers the bundles, loaded for this process."""
    from executorch.extension.pybindings import portable_lib

    from edgemtp.export.executorch_program import (
        backend_config,
        export_method,
        lower_programs,
        xnnpack_partitioner,
    )

    edge = lower_programs(
        {"forward": export_method(module, inputs)}, lambda: [xnnpack_partitioner()]
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "calibrate.pte"
        path.write_bytes(edge.to_executorch(backend_config()).buffer)
        return portable_lib._load_for_executorch(str(path))


def forward_calls(program: Any, inputs: tuple[torch.Tensor, ...], times: int) -> Call:
    """A call that runs `program` on `inputs` `times` times in a row."""
    return lambda: [program.forward(inputs) for _ in range(times)]


def call_seconds(program: Any, x: torch.Tensor, calls: int, repeat: int = 5) -> float:
    """Seconds per call of `program` on `x`: `calls` calls in a row, median of `repeat`."""
    return median_seconds(forward_calls(program, (x,), calls), repeat) / calls


def int4_linear(n_in: int, n_out: int) -> torch.nn.Module:
    """An int4 linear as export writes one (lowered to XNNPACK's 8da4w), random weights."""
    from edgemtp.export.int4 import Int4Linear

    codes = torch.randint(-8, 8, (n_out, n_in), dtype=torch.int8)
    scales = torch.rand(n_out, n_in // 32) * 0.01 + 0.001
    return Int4Linear(codes, scales, torch.zeros_like(scales, dtype=torch.int8), 32)


def int4_weight_bytes(n_in: int, n_out: int) -> float:
    """Bytes an int4 linear's weights take: 4-bit codes and a bf16 scale per 32."""
    return n_in * n_out / 2 + n_in * n_out / 32 * 2


def int4_chain(n: int, count: int = RESIDENT_LINEARS) -> torch.nn.Module:
    """`count` int4 linears of n x n, one after another, each with its own weights."""
    return torch.nn.Sequential(*(int4_linear(n, n) for _ in range(count)))


class Repeat(torch.nn.Module):
    """`layer` applied `times` over: programs that differ by a known count of one operator."""

    def __init__(self, layer: torch.nn.Module, times: int):
        super().__init__()
        self.layer, self.times = layer, times

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.times):
            x = self.layer(x)
        return x


class Scale(torch.nn.Module):
    """A row times a weight vector: one XNNPACK elementwise node."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def memory_bandwidth(
    n: int = 8192, rows: int = 1, linears: int = STREAM_LINEARS
) -> tuple[float, float]:
    """(median, best) GB/s the runtime's int4 linears stream weights at: `rows` rows (one: every
    decode step; a few: a verify) through a chain of `linears` XNNPACK 8da4w linears of n x n
    (default 8 x (32 MiB codes + 4 MiB bf16 scales): 288 MiB, past what one core streams from
    its caches, where one such linear alone is not on a host with a large last-level cache).
    The runtime's own kernel, as a decode step streams its weights: a plain array sum reads
    slower than XNNPACK's GEMV."""
    program = xnnpack_program(int4_chain(n, linears), torch.randn(rows, n))
    weight_bytes = linears * int4_weight_bytes(n, n)
    times = timings(lambda: program.forward((torch.randn(rows, n),)), 9)
    return weight_bytes / statistics.median(times) / 1e9, weight_bytes / min(times) / 1e9


def matmul_tops(dtype: str, n: int = 1024, rows: int = 256) -> float:
    """T(FL)OPS of the runtime's GEMM for `dtype`: "fp32" an fp32 XNNPACK linear, "fp16"
    torch's CPU fp16 GEMM (ExecuTorch's CPU programs have no fp16 path); int8: `int8_gemm`."""
    flops = 2 * rows * n * n
    if dtype == "fp16":
        a, b = torch.randn(rows, n, dtype=torch.float16), torch.randn(n, n, dtype=torch.float16)
        return flops / median_seconds(lambda: a @ b, 3) / 1e12
    x, module = torch.randn(rows, n), torch.nn.Linear(n, n, bias=False)
    return flops / call_seconds(xnnpack_program(module, x), x, 3) / 1e12


def int8_gemm(quick: bool = False) -> tuple[float, float]:
    """`gemm_rates` of XNNPACK's 8da4w linear (int8 activations x int4 weights, as the Q4_0
    bundles compute)."""

    def make(rows: int, side: int) -> Call:
        x = torch.randn(rows, side)
        return forward_calls(xnnpack_program(int4_linear(side, side), x), (x,), GEMM_CALLS)

    return gemm_rates(make, quick)


def linear_chain(ops: int) -> torch.nn.Module:
    """`ops` applications of one 64 x 64 linear, one XNNPACK operator each."""
    return Repeat(torch.nn.Linear(64, 64), ops)


NODE_WIDTH = 1536  # a row of E2B's hidden size


def executorch_node_us(calls: int = 2000) -> float:
    """µs per XNNPACK node that is not a matmul (a decode step's norms, activations, adds,
    reshapes: most of its nodes): chains of 1 and 201 multiplies on one row of E2B's hidden
    size, (t201 - t1) / 200, interleaved. Cheaper than a matmul node's `dispatch_us`: XNNPACK
    runs them on the calling thread, not through its pool."""
    x = torch.zeros(1, NODE_WIDTH)
    programs = [xnnpack_program(Repeat(Scale(NODE_WIDTH), n), x) for n in (1, 201)]
    t1, t201 = interleaved_medians([forward_calls(p, (x,), calls) for p in programs], 5)
    return max((t201 - t1) / calls / 200 * 1e6, RESOLUTION_US)


class ElementwiseMix(torch.nn.Module):
    """`length` XNNPACK nodes of what a decoder layer runs between its linears, in turn: a
    scale, a residual add, the activation's tanh, a square (the norm's)."""

    def __init__(self, length: int, width: int):
        super().__init__()
        self.length, self.weight = length, torch.nn.Parameter(torch.full((width,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.length):
            kind = i % 4
            if kind == 0:
                x = x * self.weight
            elif kind == 1:
                x = x + self.weight
            elif kind == 2:
                x = torch.tanh(x)
            else:
                x = x * x
        return x


def executorch_ns_per_element(quick: bool = False) -> float:
    """ns per element XNNPACK's nodes other than matmuls write: `ElementwiseMix` of 24 nodes on
    64 rows of 1536 less on 8 rows, interleaved; dispatch cancels. A prefill chunk's norms,
    activations, adds and copies write 128 rows each."""
    width, many, few, length = (256, 16, 2, 8) if quick else (NODE_WIDTH, 64, 8, 24)

    def make(rows: int) -> Call:
        x = torch.zeros(rows, width)
        program = xnnpack_program(ElementwiseMix(length, width), x)
        return lambda: program.forward((x,))

    return ns_per_element(make, many, few, length * width, 5 if quick else 50)


def resident_bandwidth(n: int, rows: int, fixed_us: float, calls: int = 20) -> float:
    """GB/s XNNPACK 8da4w linears stream their weights at when they stay in the cache: a chain
    of `RESIDENT_LINEARS` linears of n x n called over and over, less `fixed_us` per call (the
    program call and each linear's launches, which the simulator prices apart)."""
    program = xnnpack_program(int4_chain(n), torch.randn(rows, n))
    weight_bytes = RESIDENT_LINEARS * int4_weight_bytes(n, n)
    seconds = call_seconds(program, torch.randn(rows, n), calls, 9)
    return stream_rate(weight_bytes, seconds, fixed_us * 1e-6)


def executorch_dispatch_us(calls: int = 2000) -> tuple[float, float]:
    """(µs per XNNPACK operator, µs per program call) from chains of 1 and 201 linears of
    64 x 64 on one row: 8 k multiply-adds each, so what is left is an operator's fixed cost
    (setup, thread-pool dispatch). Linears, not tiny adds: XNNPACK runs those on the calling
    thread, where a model's GEMMs go through the thread pool."""
    x = torch.zeros(1, 64)
    per_call = {n: call_seconds(xnnpack_program(linear_chain(n), x), x, calls) for n in (1, 201)}
    return (per_call[201] - per_call[1]) / 200 * 1e6, per_call[1] * 1e6


class SegmentAttention(torch.nn.Module):
    """Attention as the exported methods compute it (`runtime.kernels.ops.segment_attention`,
    one KV head): scores against the cache and the call's own rows apart, the additive mask,
    softmax, and each segment's probabilities times its values."""

    def forward(self, q, k_cache, k_rows, v_cache, v_rows, mask):  # type: ignore[no-untyped-def]
        from edgemtp.runtime.kernels.ops import segment_attention

        group = q.shape[1] // mask.shape[0]
        return segment_attention(q, (k_cache, k_rows), (v_cache, v_rows), mask, group)


def executorch_attention(quick: bool = False) -> tuple[float, float, float]:
    """`attention_rates` of XNNPACK: `SegmentAttention` lowered as the bundles are."""

    def make(inputs: tuple[torch.Tensor, ...]) -> Call:
        program = xnnpack_program(SegmentAttention(), *inputs)
        return lambda: program.forward(inputs)

    return attention_rates(make, quick)


class SlotBookkeeping(torch.nn.Module):
    """The cache's slot positions updated as the exported methods update them
    (`StaticCache.write`): comparisons and selections over [slots, rows], which no delegate
    takes and ExecuTorch's portable kernels run element by element."""

    def forward(self, kept: torch.Tensor, slot: torch.Tensor, positions: torch.Tensor):  # type: ignore[no-untyped-def]
        hit = torch.arange(kept.shape[0])[:, None] == slot[None, :]
        written = torch.where(hit, positions[None, :], -2).amax(1)
        return torch.where(hit.any(1), written, kept)


def portable_ns_per_element(quick: bool = False) -> float:
    """ns per element a portable kernel writes: `SlotBookkeeping` over 4096 slots for 64 and
    for 8 rows, interleaved; the difference is two [slots, rows] passes (== and where) over 56
    more rows, the fixed costs cancel."""
    slots, many, few = (256, 32, 4) if quick else (4096, 64, 8)

    def make(rows: int) -> Call:
        inputs = (torch.full((slots,), -1), torch.arange(rows) % slots, torch.arange(rows))
        program = xnnpack_program(SlotBookkeeping(), *inputs)
        return lambda: program.forward(inputs)

    return ns_per_element(make, many, few, 2 * slots, 5 if quick else 25)
