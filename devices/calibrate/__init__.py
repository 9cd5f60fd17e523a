"""`edgemtp devices calibrate`: measure this machine and write its device profile.

What is measured (each a median of several runs, with the threads the runtime would use):
- sustained memory bandwidth: one row through XNNPACK int4 linears of 288 MiB in all (past the
  caches: one linear of 32 MiB is not, where the last level holds hundreds), as a decode step
  streams its weights (the runtime's own kernel: a plain array sum reads slower than XNNPACK's
  GEMV); the best run is kept as the profile's peak, the bus's theoretical peak is unknown here;
- peak matmul throughput per dtype: the runtime's GEMMs — XNNPACK 8da4w (int8 x int4) and fp32
  linears on 256 rows; fp16 through torch (ExecuTorch's CPU programs have none); the int8 one
  on a wide and a narrow square linear, solved for its FLOP rate and a time per activation
  element (a narrow linear's input quantization and output weigh more per FLOP);
- dispatch cost per operator: ExecuTorch programs of one and of 201 chained XNNPACK linears of
  64 x 64 on one row, run in this process: (t201 - t1) / 200; and a program call's own cost;
  the same with multiplies for the nodes that are not matmuls (a fifth to a quarter of that),
  and the time per element those write (a decoder layer's mix on 64 rows against 8);
- weights that stay in the cache: half the last-level cache (sysfs) as what a model may take,
  and the rate eight small int4 linears (1024 x 1024) stream at when called over and over,
  their fixed costs taken out (XNNPACK and ONNX Runtime, one row and four);
- the streaming linears on four rows (a verify's), where kernels may take another path;
- ONNX Runtime apart (`[delegates.cpu.backends.onnx]`): its MatMulNBits as ONNX cpu bundles
  export it (int8 activations) on one, four and 256 rows (two widths), its cost per node (a
  decoder layer's mix of nodes between its linears) and per call, and a small MatMulNBits'
  fixed cost beyond its bytes and its launch;
- attention as the bundles compute it (XNNPACK and ONNX Runtime): its matmuls' FLOP rate, the
  time per attention score beyond them (mask, softmax, copies) and the rate K/V stream at;
- ExecuTorch's portable kernels (what no delegate takes: the cache's slot bookkeeping, masks):
  time per element they write;
- edgemtp's own host time per program call and per logit (decoding beside a stand-in program);
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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from edgemtp.runtime.probes import physical_memory

Say = Callable[[str], None]
SOURCE = "measured: edgemtp devices calibrate"
VERIFY_PROBE_ROWS = 4  # a verify of 3 drafts
# The least a fitted per-call or per-operator overhead is written as: a difference of two
# timings can come out at or under zero when the overhead is below the machine's noise, and a
# profile takes positive numbers only.
RESOLUTION_US = 0.01


def _median_seconds(run: Callable[[], object], repeat: int) -> list[float]:
    run()  # warm-up: page faults, thread pools, lazy initialisation
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return times


def _interleaved_medians(calls: Sequence[Callable[[], object]], rounds: int) -> list[float]:
    """Median seconds of each call, timed in turn round after round (so that the host's drift
    falls on all of them alike)."""
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(rounds):
        for call, out in zip(calls, times, strict=True):
            out += _median_seconds(call, 1)[:1]
    return [statistics.median(t) for t in times]


def _xnnpack_program(module: torch.nn.Module, *inputs: torch.Tensor) -> Any:
    """`module` lowered to XNNPACK as export lowers the bundles, loaded for this process."""
    from executorch.extension.pybindings import portable_lib

    from edgemtp.export.lower import (
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


def _int4_linear(n_in: int, n_out: int) -> torch.nn.Module:
    from edgemtp.export.executorch import Int4Linear

    codes = torch.randint(-8, 8, (n_out, n_in), dtype=torch.int8)
    scales = torch.rand(n_out, n_in // 32) * 0.01 + 0.001
    return Int4Linear(codes, scales, torch.zeros_like(scales, dtype=torch.int8), 32)


RESIDENT_LINEARS = 8  # small linears, as a small model's layers hold
STREAM_LINEARS = 8  # linears of 8192 x 8192 in the streaming probe: 288 MiB of weights


class Int4Chain(torch.nn.Module):
    """`count` int4 linears of n x n, one after another, each with its own weights."""

    def __init__(self, n: int, count: int = RESIDENT_LINEARS):
        super().__init__()
        self.linears = torch.nn.ModuleList(_int4_linear(n, n) for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for linear in self.linears:
            x = linear(x)
        return x


def _call_seconds(program: Any, x: torch.Tensor, calls: int, repeat: int = 5) -> float:
    times = _median_seconds(lambda: [program.forward((x,)) for _ in range(calls)], repeat)
    return statistics.median(times) / calls


def memory_bandwidth(
    n: int = 8192, rows: int = 1, linears: int = STREAM_LINEARS
) -> tuple[float, float]:
    """(median, best) GB/s the runtime's int4 linears stream weights at: `rows` rows (one: every
    decode step; a few: a verify) through a chain of `linears` XNNPACK 8da4w linears of n x n
    (default 8 x (32 MiB codes + 4 MiB bf16 scales): 288 MiB, past what one core streams from
    its caches). One such linear alone is not past them on a host with a large last-level
    cache: on one whose sysfs says 480 MiB, one core read 26 GB/s from 18 MiB, 16.5 from 72 MiB
    and 14.5-15 from 142-576 MiB."""
    program = _xnnpack_program(Int4Chain(n, linears), torch.randn(rows, n))
    weight_bytes = linears * (n * n / 2 + n * n / 32 * 2)
    times = _median_seconds(lambda: program.forward((torch.randn(rows, n),)), 9)
    return weight_bytes / statistics.median(times) / 1e9, weight_bytes / min(times) / 1e9


def matmul_tops(dtype: str, n: int = 1024, rows: int = 256) -> float:
    """T(FL)OPS of the runtime's GEMM for `dtype`: "fp32" an fp32 XNNPACK linear, "fp16"
    torch's CPU fp16 GEMM (ExecuTorch's CPU programs have no fp16 path); int8: `int8_gemm`."""
    flops = 2 * rows * n * n
    if dtype == "fp16":
        a, b = torch.randn(rows, n, dtype=torch.float16), torch.randn(n, n, dtype=torch.float16)
        return flops / statistics.median(_median_seconds(lambda: a @ b, 3)) / 1e12
    x, module = torch.randn(rows, n), torch.nn.Linear(n, n, bias=False)
    return flops / _call_seconds(_xnnpack_program(module, x), x, 3) / 1e12


# (rows, side) of the two square int8 GEMMs the linear model is solved from: a wide one and a
# narrow one (E2B's hidden size is 1536, the embedded model's 256)
GEMM_SHAPES = ((256, 1024), (256, 256))
GEMM_QUICK = ((8, 128), (8, 32))


def int8_gemm(quick: bool = False) -> tuple[float, float]:
    """`fit_gemm` of XNNPACK's 8da4w linear (int8 activations x int4 weights, as the Q4_0
    bundles compute) on `GEMM_SHAPES`, timed interleaved."""
    shapes = GEMM_QUICK if quick else GEMM_SHAPES
    calls = []
    for rows, side in shapes:
        x = torch.randn(rows, side)
        program = _xnnpack_program(_int4_linear(side, side), x)
        calls.append(lambda p=program, x=x: [p.forward((x,)) for _ in range(3)])
    seconds = _interleaved_medians(calls, 5 if quick else 15)
    return fit_gemm(shapes, [t / 3 for t in seconds])


def fit_gemm(shapes: Sequence[tuple[int, int]], seconds: Sequence[float]) -> tuple[float, float]:
    """(TOPS, ns per activation element) of a GEMM priced as `devices.simulator.call_terms`
    does, 2 x rows x k x n FLOPs at the peak plus rows x (k + n) elements read and written,
    solved from two square shapes' times. The narrow one's surplus beyond the wide one's
    FLOP rate is its elements' time; none where it has none (the peak is then the wide one's
    rate)."""
    flops = [2 * rows * side * side for rows, side in shapes]
    elements = [rows * 2 * side for rows, side in shapes]
    det = flops[0] * elements[1] - flops[1] * elements[0]
    per_flop = (seconds[0] * elements[1] - seconds[1] * elements[0]) / det
    per_element = (flops[0] * seconds[1] - flops[1] * seconds[0]) / det
    if per_element <= 0 or per_flop <= 0:
        return flops[0] / seconds[0] / 1e12, 0.0
    return 1 / per_flop / 1e12, per_element * 1e9


def linear_chain(ops: int) -> torch.nn.Module:
    """`ops` applications of one 64 x 64 linear, one XNNPACK operator each."""

    class Chain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(ops):
                x = self.linear(x)
            return x

    return Chain()


class MultiplyChain(torch.nn.Module):
    """`ops` multiplies of a row by a weight vector, one XNNPACK elementwise node each."""

    def __init__(self, ops: int, width: int):
        super().__init__()
        self.ops, self.weight = ops, torch.nn.Parameter(torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.ops):
            x = x * self.weight
        return x


NODE_WIDTH = 1536  # a row of E2B's hidden size


def executorch_node_us(calls: int = 2000) -> float:
    """µs per XNNPACK node that is not a matmul (a decode step's norms, activations, adds,
    reshapes: 70 % of its nodes): chains of 1 and 201 multiplies on one row of E2B's hidden
    size, (t201 - t1) / 200, interleaved: 0.25-0.32 µs here, a fifth to a quarter of a matmul
    node's `dispatch_us` (XNNPACK runs them on the calling thread, not through its pool)."""
    x = torch.zeros(1, NODE_WIDTH)
    programs = [_xnnpack_program(MultiplyChain(n, NODE_WIDTH), x) for n in (1, 201)]
    t1, t201 = _interleaved_medians(
        [lambda p=p: [p.forward((x,)) for _ in range(calls)] for p in programs], 5
    )
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
    calls = []
    for rows in (many, few):
        x = torch.zeros(rows, width)
        program = _xnnpack_program(ElementwiseMix(length, width), x)
        calls.append(lambda p=program, x=x: p.forward((x,)))
    t_many, t_few = _interleaved_medians(calls, 5 if quick else 50)
    return max((t_many - t_few) / (length * (many - few) * width) * 1e9, 1e-3)


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
    while n > 128 and RESIDENT_LINEARS * n * n * (0.5 + 2 / 32) > limit_mb * 2**20 / 4:
        n //= 2
    return n


def _rate(weight_bytes: float, seconds: float, fixed_s: float) -> float:
    """GB/s of weight bytes read in `seconds`, less the kernels' fixed costs where they leave
    most of the time (the simulator adds those apart)."""
    streaming = seconds - fixed_s if seconds - fixed_s > 0.2 * seconds else seconds
    return weight_bytes / streaming / 1e9


def resident_bandwidth(n: int, rows: int, fixed_us: float, calls: int = 20) -> float:
    """GB/s XNNPACK 8da4w linears stream their weights at when they stay in the cache: a chain
    of `RESIDENT_LINEARS` linears of n x n called over and over, less `fixed_us` per call (the
    program call and each linear's launches, which the simulator prices apart)."""
    program = _xnnpack_program(Int4Chain(n), torch.randn(rows, n))
    weight_bytes = RESIDENT_LINEARS * (n * n / 2 + n * n / 32 * 2)
    seconds = _call_seconds(program, torch.randn(rows, n), calls, 9)
    return _rate(weight_bytes, seconds, fixed_us * 1e-6)


def executorch_dispatch_us(threads: int, calls: int = 2000) -> tuple[float, float]:
    """(µs per XNNPACK operator, µs per program call) from chains of 1 and 201 linears of
    64 x 64 on one row: 8 k multiply-adds each, so what is left is an operator's fixed cost
    (setup, thread-pool dispatch). A chain of tiny adds would say 0.1 µs: XNNPACK runs those
    on one thread, where a model's GEMMs go through the thread pool."""
    x = torch.zeros(1, 64)
    per_call = {n: _call_seconds(_xnnpack_program(linear_chain(n), x), x, calls) for n in (1, 201)}
    return (per_call[201] - per_call[1]) / 200 * 1e6, per_call[1] * 1e6


class SegmentAttention(torch.nn.Module):
    """Attention as the exported methods compute it (`exportable.segment_attention`, one KV
    head): scores against the cache and the call's own rows apart, the additive mask, softmax,
    and each segment's probabilities times its values."""

    def forward(self, q, k_cache, k_rows, v_cache, v_rows, mask):  # type: ignore[no-untyped-def]
        from edgemtp.export.exportable import segment_attention

        group = q.shape[1] // mask.shape[0]
        return segment_attention(q, (k_cache, k_rows), (v_cache, v_rows), mask, group)


# (heads, rows, cache keys, head dim): two prefill chunks over a short cache, alike but for the
# head dim (score-bound: their difference is the matmuls' FLOP rate), and a decode step over a
# long cache (K/V-bound)
ATTENTION_SHAPES = ((8, 64, 1024, 32), (8, 64, 1024, 128), (8, 1, 4096, 256))
ATTENTION_QUICK = ((2, 16, 128, 16), (2, 16, 128, 64), (2, 1, 512, 64))


def attention_inputs(heads: int, rows: int, keys: int, dim: int) -> tuple[torch.Tensor, ...]:
    """Queries scaled so that the scores are N(0, 1), as a trained model's are about: unscaled,
    a head dim of 512 gives scores of std 23 and a softmax full of denormal floats."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads * rows, dim, generator=g) * dim**-0.5
    cache = [torch.randn(1, n, dim, generator=g) for n in (keys, rows, keys, rows)]
    return (q, cache[0], cache[1], cache[2], cache[3], torch.zeros(rows, keys + rows))


def attention_rates(
    make: Callable[[tuple[torch.Tensor, ...]], Callable[[], object]], quick: bool = False
) -> tuple[float, float, float]:
    """(TFLOPS of the matmuls, ns per score, GB/s the K/V stream at) of a runtime's attention,
    from `make(inputs)` (a call of `SegmentAttention` on those inputs) timed on the three
    `ATTENTION_SHAPES`, interleaved (median of each)."""
    shapes = ATTENTION_QUICK if quick else ATTENTION_SHAPES
    calls = [make(attention_inputs(*shape)) for shape in shapes]
    return fit_attention(shapes, _interleaved_medians(calls, 5 if quick else 25))


def fit_attention(
    shapes: Sequence[tuple[int, int, int, int]], seconds: Sequence[float]
) -> tuple[float, float, float]:
    """The attention model `devices.simulator.call_terms` prices, solved for its three rates:
    the two score-bound shapes differ only in FLOPs, which gives the matmuls' rate; the rest of
    the first is its scores' time; what the K/V-bound third takes beyond its scores streams
    its K/V (fixed call costs are ignored: each shape takes a millisecond or more)."""
    scores = [h * r * (k + r) for h, r, k, _ in shapes]
    flops = [4 * n * d for n, (*_, d) in zip(scores, shapes, strict=True)]
    tops = (flops[1] - flops[0]) / max(seconds[1] - seconds[0], 1e-9) / 1e12
    ns_per_score = max(seconds[0] - flops[0] / (tops * 1e12), 1e-12 * scores[0]) / scores[0] * 1e9
    _, rows, keys, dim = shapes[2]
    streaming = max(seconds[2] - scores[2] * ns_per_score * 1e-9, flops[2] / (tops * 1e12))
    return tops, ns_per_score, 2 * (keys + rows) * dim * 4 / streaming / 1e9


def executorch_attention(quick: bool = False) -> tuple[float, float, float]:
    """`attention_rates` of XNNPACK: `SegmentAttention` lowered as the bundles are."""

    def make(inputs: tuple[torch.Tensor, ...]) -> Callable[[], object]:
        program = _xnnpack_program(SegmentAttention(), *inputs)
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
    calls = []
    for rows in (many, few):
        inputs = (torch.full((slots,), -1), torch.arange(rows) % slots, torch.arange(rows))
        program = _xnnpack_program(SlotBookkeeping(), *inputs)
        calls.append(lambda p=program, x=inputs: p.forward(x))
    t_many, t_few = _interleaved_medians(calls, 5 if quick else 25)
    return max((t_many - t_few) / (2 * slots * (many - few)) * 1e9, 1e-3)


# --- ONNX Runtime: the kernels an ONNX bundle's CPU methods run -----------------------------------


def _ort_session(graph: Any, threads: int) -> Any:
    """`graph` in an ONNX Runtime CPU session set up as `export.onnx.OnnxRunner` sets its own."""
    import onnx
    import onnxruntime as ort

    model = onnx.helper.make_model(
        graph,
        opset_imports=[
            onnx.helper.make_opsetid("", 17),
            onnx.helper.make_opsetid("com.microsoft", 1),
        ],
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _nbits_linear(k: int, n: int, rows: int, threads: int, count: int = 1) -> tuple[Any, float]:
    """(session, weight bytes of one) of `count` independent MatMulNBits [rows, k] x [k, n]
    (inputs x0.., outputs y0.., weights of their own), 4-bit, blocks of 32, fp32 scales, int8
    activations (accuracy level 4): the node an ONNX cpu bundle's 4-bit linears become with
    export's default `--activations int8`."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    from edgemtp.export.onnx import INT8_ACCURACY_LEVEL

    rng = np.random.default_rng(0)
    nodes, inputs, outputs, weights = [], [], [], []
    for i in range(count):
        codes = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
        scales = (rng.random((n, k // 32), dtype=np.float32) * 0.01).astype(np.float32)
        weights += [onnx.numpy_helper.from_array(codes, f"B{i}"),
                    onnx.numpy_helper.from_array(scales, f"scales{i}")]  # fmt: skip
        nodes.append(helper.make_node(
            "MatMulNBits", [f"x{i}", f"B{i}", f"scales{i}"], [f"y{i}"], domain="com.microsoft",
            K=k, N=n, bits=4, block_size=32, accuracy_level=INT8_ACCURACY_LEVEL,
        ))  # fmt: skip
        inputs.append(helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [rows, k]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [rows, n]))
    graph = helper.make_graph(nodes, "nbits", inputs, outputs, weights)
    return _ort_session(graph, threads), codes.nbytes + scales.nbytes


def onnx_attention(threads: int, quick: bool = False) -> tuple[float, float, float]:
    """`attention_rates` of ONNX Runtime: `SegmentAttention` as the ONNX exporter writes it
    (MatMul against each segment's transposed keys, Concat, the additive mask, Softmax, Slice
    and MatMul per segment, summed)."""
    import numpy as np
    from onnx import TensorProto, helper

    from edgemtp.export.onnx import flush_denormals

    names = ("q", "k_cache", "k_rows", "v_cache", "v_rows", "mask")

    def graph(heads: int, rows: int, keys: int, dim: int) -> Any:
        def tensor(name: str, shape: list[int]) -> Any:
            return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)

        def ints(name: str, values: list[int]) -> Any:
            return helper.make_tensor(name, TensorProto.INT64, [len(values)], values)

        node = helper.make_node
        nodes = [
            node("Transpose", ["k_cache"], ["kt_cache"], perm=[0, 2, 1]),
            node("Transpose", ["k_rows"], ["kt_rows"], perm=[0, 2, 1]),
            node("MatMul", ["q", "kt_cache"], ["s_cache"]),
            node("MatMul", ["q", "kt_rows"], ["s_rows"]),
            node("Concat", ["s_cache", "s_rows"], ["s"], axis=-1),
            node("Reshape", ["s", "by_head"], ["s4"]),
            node("Add", ["s4", "mask"], ["masked"]),
            node("Softmax", ["masked"], ["p4"], axis=-1),
            node("Reshape", ["p4", "flat"], ["p"]),
            node("Slice", ["p", "zero", "keys", "last"], ["p_cache"]),
            node("Slice", ["p", "keys", "end", "last"], ["p_rows"]),
            node("MatMul", ["p_cache", "v_cache"], ["o_cache"]),
            node("MatMul", ["p_rows", "v_rows"], ["o_rows"]),
            node("Add", ["o_cache", "o_rows"], ["out"]),
        ]
        consts = [ints("by_head", [1, heads, rows, keys + rows]),
                  ints("flat", [1, heads * rows, keys + rows]), ints("zero", [0]),
                  ints("keys", [keys]), ints("end", [keys + rows]), ints("last", [2])]  # fmt: skip
        shapes = ([1, heads * rows, dim], [1, keys, dim], [1, rows, dim], [1, keys, dim],
                  [1, rows, dim], [rows, keys + rows])  # fmt: skip
        inputs = [tensor(n, shape) for n, shape in zip(names, shapes, strict=True)]
        out = [tensor("out", [1, heads * rows, dim])]
        return helper.make_graph(nodes, "attention", inputs, out, consts)

    def make(inputs: tuple[torch.Tensor, ...]) -> Callable[[], object]:
        heads_rows, dim = inputs[0].shape[1:]
        rows, keys = inputs[5].shape[0], inputs[1].shape[1]
        session = _ort_session(graph(heads_rows // rows, rows, keys, dim), threads)
        feed = {n: np.ascontiguousarray(x.numpy()) for n, x in zip(names, inputs, strict=True)}

        def call() -> object:
            with flush_denormals():  # as OnnxRunner runs the bundles
                return session.run(None, feed)

        return call

    return attention_rates(make, quick)


def onnx_ns_per_element(threads: int, quick: bool = False) -> float:
    """ns per element ONNX Runtime's non-matmul nodes write: a chain of 24 nodes (Mul, Add,
    SimplifiedLayerNormalization, Gelu in turn, what a decoder layer runs between its linears)
    on 64 rows of 1024 less the same chain on 8 rows, interleaved; dispatch cancels."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    width, many, few, length = (256, 16, 2, 8) if quick else (1024, 64, 8, 24)
    kinds = ("Mul", "Add", "SimplifiedLayerNormalization", "Gelu")

    def session(rows: int) -> Any:
        scale = numpy_helper.from_array(np.full(width, 0.5, dtype=np.float32), "w")
        nodes = []
        for i in range(length):
            kind, x, y = kinds[i % len(kinds)], f"h{i}", f"h{i + 1}"
            if kind in ("Mul", "Add"):
                nodes.append(helper.make_node(kind, [x, "w"], [y]))
            elif kind == "Gelu":
                nodes.append(helper.make_node(kind, [x], [y], domain="com.microsoft"))
            else:
                nodes.append(helper.make_node(kind, [x, "w"], [y], axis=-1, epsilon=1e-6))
        graph = helper.make_graph(
            nodes, "elementwise",
            [helper.make_tensor_value_info("h0", TensorProto.FLOAT, [rows, width])],
            [helper.make_tensor_value_info(f"h{length}", TensorProto.FLOAT, [rows, width])],
            [scale],
        )  # fmt: skip
        return _ort_session(graph, threads)

    calls = []
    for rows in (many, few):
        s, x = session(rows), np.ones((rows, width), dtype=np.float32)
        calls.append(lambda s=s, x=x: s.run(None, {"h0": x}))
    t_many, t_few = _interleaved_medians(calls, 5 if quick else 50)
    return max((t_many - t_few) / (length * (many - few) * width) * 1e9, 1e-3)


# What a decoder layer runs between its linears, in ONNX: views, a transposed copy, a split and
# its concat (rotary halves), scaling, residual adds, norms, the activation, masking, negation.
DECODER_NODE_MIX = (
    "Reshape", "Transpose", "Reshape", "Split", "Mul", "Add",
    "SimplifiedLayerNormalization", "Gelu", "Where", "Neg",
)  # fmt: skip


def _onnx_node_chain(repeats: int, width: int, threads: int) -> tuple[Any, int]:
    """(session, nodes) of `DECODER_NODE_MIX` repeated `repeats` times on one row of `width`
    (Split's halves are concatenated back in swapped order, as rotary embedding does)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    consts = {
        "scale": np.full(width, 0.5, dtype=np.float32),
        "by_head": np.array([1, 4, width // 4]),
        "flat": np.array([1, width]),
        "halves": np.array([width // 2, width // 2]),
        "even": (np.arange(width) % 2 == 0).reshape(1, width),
    }
    nodes, x = [], "h0"
    for i, kind in enumerate(DECODER_NODE_MIX * repeats):
        y = f"h{i + 1}"
        if kind == "Reshape":
            shape = "flat" if nodes and nodes[-1].op_type == "Transpose" else "by_head"
            nodes.append(helper.make_node(kind, [x, shape], [y]))
        elif kind == "Transpose":
            nodes.append(helper.make_node(kind, [x], [y], perm=[0, 2, 1]))
        elif kind == "Split":
            nodes.append(helper.make_node(kind, [x, "halves"], [y + "a", y + "b"], axis=-1))
            nodes.append(helper.make_node("Concat", [y + "b", y + "a"], [y], axis=-1))
        elif kind in ("Mul", "Add"):
            nodes.append(helper.make_node(kind, [x, "scale"], [y]))
        elif kind == "SimplifiedLayerNormalization":
            nodes.append(helper.make_node(kind, [x, "scale"], [y], axis=-1, epsilon=1e-6))
        elif kind == "Gelu":
            nodes.append(helper.make_node(kind, [x], [y], domain="com.microsoft"))
        elif kind == "Where":
            nodes.append(helper.make_node(kind, ["even", x, "scale"], [y]))
        else:
            nodes.append(helper.make_node(kind, [x], [y]))
        x = y
    graph = helper.make_graph(
        nodes, "decoder_nodes",
        [helper.make_tensor_value_info("h0", TensorProto.FLOAT, [1, width])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, width])],
        [numpy_helper.from_array(v, k) for k, v in consts.items()],
    )  # fmt: skip
    return _ort_session(graph, threads), len(nodes)


# (k, n, count): one row through this many independent MatMulNBits of an E2B x0.25 layer's
# shape (295 MB in all: past the caches, as the streaming probe)
NARROW_GEMV = (384, 2048, 600)


def onnx_kernels(
    threads: int, quick: bool = False, limit_mb: float | None = None
) -> dict[str, float]:
    """ONNX Runtime's MatMulNBits GEMV bandwidth (one row, past the caches; and, given the
    cache's `limit_mb`, with weights that stay in it, on one and four rows), its throughput on
    256 rows, its cost per call and per node (chains of `DECODER_NODE_MIX` on one row of 64,
    1 and 20 times over), and the fixed cost of one MatMulNBits beyond its bytes and its launch
    (64 independent 64 x 64 linears on one row against one: their bytes stream in under a
    microsecond, the rest is the kernel's own setup), and what a narrow one on one row takes
    beyond its bytes at the probe's rate, its launch and that setup, per element it reads or
    writes (`NARROW_GEMV`: ~9 GB/s where the 8192 x 8192 probe streams 11)."""
    import numpy as np

    k = n = 1024 if quick else 8192
    bandwidth = {}
    for rows in (1, VERIFY_PROBE_ROWS):  # past the caches, as memory_bandwidth's probe
        session, weight_bytes = _nbits_linear(k, n, rows, threads, STREAM_LINEARS)
        x = np.random.default_rng(1).standard_normal((rows, k), dtype=np.float32)
        feed = {f"x{i}": x for i in range(STREAM_LINEARS)}
        times = _median_seconds(lambda s=session, f=feed: s.run(None, f), 9)
        bandwidth[rows] = STREAM_LINEARS * weight_bytes / statistics.median(times) / 1e9
    shapes = GEMM_QUICK if quick else GEMM_SHAPES
    gemms = []
    for rows, side in shapes:
        session, _ = _nbits_linear(side, side, rows, threads)
        x = np.random.default_rng(2).standard_normal((rows, side), dtype=np.float32)
        gemms.append(lambda s=session, x=x: [s.run(None, {"x0": x}) for _ in range(3)])
    seconds = _interleaved_medians(gemms, 5 if quick else 15)
    tops, ns_per_linear_element = fit_gemm(shapes, [t / 3 for t in seconds])

    calls = 20 if quick else 200
    chains = [_onnx_node_chain(repeats, 64, threads) for repeats in (1, 20)]
    feed = {"h0": np.ones((1, 64), dtype=np.float32)}
    rounds = 5 if quick else 9
    per_call = _interleaved_medians(
        [lambda s=s: [s.run(None, feed) for _ in range(calls)] for s, _ in chains], rounds
    )
    (_, few), (_, many) = chains
    per_node = (per_call[1] - per_call[0]) / calls / (many - few)

    linears = 8 if quick else 64
    sessions = [_nbits_linear(64, 64, 1, threads, count) for count in (1, linears)]
    inputs = [{f"x{i}": np.ones((1, 64), np.float32) for i in range(c)} for c in (1, linears)]
    per_call_linears = _interleaved_medians(
        [lambda s=s, f=f: [s.run(None, f) for _ in range(calls // 4)]
         for (s, _), f in zip(sessions, inputs, strict=True)],
        rounds,
    )  # fmt: skip
    per_linear = (per_call_linears[1] - per_call_linears[0]) / (calls // 4) / (linears - 1)
    streaming = sessions[0][1] / (bandwidth[1] * 1e9)
    linear_us = max((per_linear - streaming - per_node) * 1e6, RESOLUTION_US)
    call_us = max((per_call[0] / calls - few * per_node) * 1e6, RESOLUTION_US)
    k, n, count = (64, 256, 8) if quick else NARROW_GEMV
    session, weight_bytes = _nbits_linear(k, n, 1, threads, count)
    x = np.random.default_rng(1).standard_normal((1, k), dtype=np.float32)
    feed = {f"x{i}": x for i in range(count)}
    seconds = statistics.median(_median_seconds(lambda: session.run(None, feed), 9)) / count
    beyond = seconds - weight_bytes / (bandwidth[1] * 1e9) - per_node - linear_us * 1e-6
    gemv_ns = max(beyond, 0.0) / (k + n) * 1e9
    resident = {}
    if limit_mb is not None:
        side, count = resident_size(limit_mb, quick), RESIDENT_LINEARS
        fixed_s = (call_us + count * (per_node * 1e6 + linear_us)) * 1e-6
        for rows in (1, VERIFY_PROBE_ROWS):
            session, weight_bytes = _nbits_linear(side, side, rows, threads, count)
            x = np.random.default_rng(1).standard_normal((rows, side), dtype=np.float32)
            feed = {f"x{i}": x for i in range(count)}
            times = _median_seconds(
                lambda s=session, f=feed: [s.run(None, f) for _ in range(20)], 9
            )
            seconds = statistics.median(times) / 20
            resident[rows] = _rate(count * weight_bytes, seconds, fixed_s)
    return {
        "memory_bandwidth_gbs": bandwidth[1],
        "verify_bandwidth_gbs": bandwidth[VERIFY_PROBE_ROWS],
        "int8_tops": tops,
        "ns_per_linear_element": ns_per_linear_element,
        "dispatch_us": max(per_node * 1e6, RESOLUTION_US),
        "call_us": call_us,
        "linear_us": linear_us,
        "ns_per_gemv_element": gemv_ns,
        **(
            {
                "resident_bandwidth_gbs": resident[1],
                "resident_verify_bandwidth_gbs": resident[VERIFY_PROBE_ROWS],
            }
            if resident
            else {}
        ),
    }


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


def _gemm_note(kernel: str, quick: bool, peak: bool = False) -> str:
    (rows, wide), (_, narrow) = GEMM_QUICK if quick else GEMM_SHAPES
    rounds = 5 if quick else 15
    shapes = (
        f"{wide} x {wide} and {narrow} x {narrow} on {rows} rows, medians of {rounds} interleaved"
    )
    if peak:
        return f"the FLOP rate solved with ns_per_linear_element from {shapes}"
    return (f"{kernel}: time per activation element (rows x (inputs + outputs)) beside the "
            f"FLOPs at the int8 peak, solved with it from {shapes}")  # fmt: skip


def _linear_element_line(ns: float, src: str, kernel: str, quick: bool) -> list[str]:
    """The profile's `ns_per_linear_element` line; none (free) where the narrow linear was
    no slower per FLOP than the wide one."""
    return [f"ns_per_linear_element = {_entry(ns, src, _gemm_note(kernel, quick))}"] if ns else []


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


class StandInProgram:
    """A runner whose every method runs `work` (a model-sized memory stream) and returns zeros
    of that method's output shapes (as `StaticBackend` reads them): decoding through it times
    edgemtp's host side as it runs between real program calls, caches cleared by each."""

    def __init__(
        self, shapes: Any, hidden: int, vocab: int, candidates: int, work: Callable[[], object]
    ):
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


GEMV_NOTE = (
    f"ONNX Runtime MatMulNBits on one row: what {NARROW_GEMV[2]} independent linears of "
    f"{NARROW_GEMV[0]} inputs and {NARROW_GEMV[1]} outputs (295 MB, past the caches) take beyond "
    "their bytes at memory_bandwidth_gbs, dispatch_us and linear_us, per element each reads or "
    "writes, median of 9"
)
HOST_ROW_NOTE = (
    "edgemtp's Python host per row a call carries beyond its first (table gathers, input "
    "copies): a 512-token prefill through the same StaticBackend (8 calls of 64 rows), its time "
    "outside the program less 8 x host_call_us, per row beyond each call's first, median of 15"
)


def host_costs(quick: bool = False) -> tuple[float, float, float]:
    """(us per program call, ns per logit, us per row beyond a call's first) of edgemtp's own
    host side: greedy decoding of the embedded model's shapes (Q4_0 token and int8 per-layer
    tables, as bundles store them) through `StaticBackend` over a `StandInProgram` that streams
    32 MiB of int4 weights per call, and numpy's argmax over a Gemma 4 logit row. A step's time
    outside the program less its argmax is the per-call cost; a 512-token prefill's (8 calls of
    64 rows: table gathers, input copies) less 8 such calls, per row beyond each call's first,
    the per-row cost. (Timed alone, with warm caches, the host side takes about half as long
    as beside a model.)"""
    from edgemtp.export.static import StaticShapes
    from edgemtp.model.checkpoint import target_config
    from edgemtp.model.gemma4 import TokenTables
    from edgemtp.quantize.q4_0 import pack_q4_0, quantize_q4_0
    from edgemtp.quantize.tables import Int8Rows, Q4_0Rows, quantize_int8_rows
    from edgemtp.runtime.backends import StaticBackend
    from edgemtp.runtime.demo import TARGET
    from edgemtp.runtime.generate import FixedDepth, decode
    from edgemtp.runtime.sampling import argmax_rows

    row = torch.randn(1, 262_144, generator=torch.Generator().manual_seed(0))
    argmax_s = min(_median_seconds(lambda: argmax_rows(row), 5 if quick else 50))
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
    n = 1024 if quick else 8192
    weights = _xnnpack_program(_int4_linear(n, n), torch.randn(1, n))
    x = torch.randn(1, n)
    program = StandInProgram(
        shapes, cfg.hidden_size, cfg.vocab_size, 1, lambda: weights.forward((x,))
    )
    backend = StaticBackend(program, tables, cfg, name="stand-in")
    steps = 30 if quick else 300
    result = decode(backend, list(range(3, 19)), steps, policy=FixedDepth(0))
    per_step = statistics.median(
        s.seconds["total"] - s.seconds["target"] for s in result.steps if s.kind == "decode"
    )
    per_call_us = max((per_step - cfg.vocab_size * ns_per_logit * 1e-9) * 1e6, RESOLUTION_US)

    prompt = [3 + i % (cfg.vocab_size - 3) for i in range(8 * shapes.chunk)]
    outside = []
    for _ in range(3 if quick else 15):
        backend.meter.seconds.clear()
        start = time.perf_counter()
        backend.prefill(prompt, 0)
        outside.append(time.perf_counter() - start - backend.meter.seconds["target"])
    rows = len(prompt) - 8
    per_row_us = max(statistics.median(outside) * 1e6 - 8 * per_call_us, 0.0) / rows
    return per_call_us, ns_per_logit, per_row_us


def _attention_lines(rates: tuple[float, float, float], src: str, runtime: str) -> list[str]:
    tops, ns_per_score, bandwidth = rates
    shapes = ", ".join("x".join(map(str, s)) for s in ATTENTION_SHAPES)
    how = (f"{runtime} running attention as the bundles export it (SegmentAttention), timed "
           f"interleaved on (heads x rows x cache keys x head dim) {shapes}")  # fmt: skip
    return [
        "attention_tops = "
        + _entry(tops, src, f"{how}: FLOPs between the first two / their time difference"),
        "ns_per_score = "
        + _entry(ns_per_score, src, f"{how}: the first's time beyond its FLOPs, per score"),
        "attention_bandwidth_gbs = "
        + _entry(bandwidth, src, f"{how}: K/V bytes of the third / its time beyond its scores"),
    ]


def _resident_mb_line(limit_mb: float, src: str) -> str:
    return "resident_mb = " + _entry(
        limit_mb,
        src,
        f"half the last-level cache ({2 * limit_mb:.0f} MiB, sysfs), an estimate of what a "
        "model's weights and K/V may take and still be there at the next call",
    )


def _resident_lines(resident: dict[int, float], side: int, src: str, kernel: str) -> list[str]:
    """Profile lines of the resident rates measured on `kernel` of side x side."""
    return [
        f"{key} = " + _entry(resident[rows], src, f"weight bytes / time of {rows} row(s) "
        f"through {RESIDENT_LINEARS} {kernel} of {side} x {side} called 20 times in a row "
        "(their weights stay in the cache), less the call's and each linear's fixed costs "
        "(priced apart), median of 9")
        for key, rows in (("resident_bandwidth_gbs", 1),
                          ("resident_verify_bandwidth_gbs", VERIFY_PROBE_ROWS))
        if rows in resident
    ]  # fmt: skip


def calibrate(threads: int, say: Say, quick: bool = False) -> str:
    """Measure this machine; its profile as TOML text (`quick`: small sizes, for tests)."""
    when = time.strftime("%Y-%m-%d")
    src = f"{SOURCE} ({when})"
    from executorch.extension.pybindings import portable_lib

    torch.set_num_threads(threads)
    portable_lib._unsafe_reset_threadpool(threads)
    say("memory bandwidth (one row through 288 MiB of int4 XNNPACK linears)")
    size = 1024 if quick else 8192
    bw, best = memory_bandwidth(size)
    verify_bw, _ = memory_bandwidth(size, rows=VERIFY_PROBE_ROWS)
    say("int8 GEMM throughput (a wide and a narrow linear)")
    tops = {}
    tops["int8"], linear_ns = int8_gemm(quick)
    for dtype in ("fp16", "fp32"):
        say(f"{dtype} GEMM throughput")
        tops[dtype] = matmul_tops(dtype, *((128, 8) if quick else (1024, 256)))
    say("ExecuTorch dispatch (chains of 1 and 201 small XNNPACK linears, and multiplies)")
    per_op, per_call = executorch_dispatch_us(threads, 50 if quick else 2000)
    node_us = executorch_node_us(50 if quick else 2000)
    node_ns = executorch_ns_per_element(quick)
    limit_mb = resident_mb()
    resident: dict[int, float] = {}
    side = resident_size(limit_mb, quick) if limit_mb is not None else 0
    if limit_mb is not None:
        say(f"weights that stay in the cache ({2 * limit_mb:.0f} MiB last level)")
        fixed_us = per_call + RESIDENT_LINEARS * (per_op + node_us)
        resident = {
            rows: resident_bandwidth(side, rows, fixed_us) for rows in (1, VERIFY_PROBE_ROWS)
        }
    say("ONNX Runtime's kernels (MatMulNBits, per-node dispatch)")
    ort = onnx_kernels(threads, quick, limit_mb)
    say("attention (masked softmax between batched matmuls), XNNPACK and ONNX Runtime")
    attention = executorch_attention(quick)
    say("ExecuTorch's portable kernels (the cache's slot bookkeeping)")
    portable_ns = portable_ns_per_element(quick)
    ort_attention = onnx_attention(threads, quick)
    ort_elements = onnx_ns_per_element(threads, quick)
    say("edgemtp's host side (decoding beside a stand-in program)")
    host_call_us, host_ns_per_logit, host_row_us = host_costs(quick)
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
        + _entry(
            bw,
            src,
            "weight bytes / time of one row through a chain of "
            f"{STREAM_LINEARS} XNNPACK int4 (8da4w) linears of 8192 x 8192 (each 32 MiB codes "
            "+ 4 MiB bf16 scales), median of 9",
        ),
        "peak_memory_bandwidth_gbs = "
        + _entry(
            max(best, bw), src, "the best of the same 9 runs (this host's bus peak is unknown)"
        ),
        "verify_bandwidth_gbs = "
        + _entry(
            verify_bw,
            src,
            f"the same linear on {VERIFY_PROBE_ROWS} rows (a verify of "
            f"{VERIFY_PROBE_ROWS - 1} drafts), median of 9",
        ),
        "dispatch_us = "
        + _entry(
            max(per_op, RESOLUTION_US),
            src,
            f"ExecuTorch, per XNNPACK operator: programs of 1 and 201 "
            f"chained 64x64 linears on one row, (t201 - t1) / 200; a program call costs "
            f"{per_call:.1f} us",
        ),  # fmt: skip
        "node_us = "
        + _entry(
            node_us,
            src,
            f"ExecuTorch, per XNNPACK node that is not a matmul: programs of 1 and 201 chained "
            f"multiplies on one row of {NODE_WIDTH}, (t201 - t1) / 200, median of 5 interleaved",
        ),
        "ns_per_element = "
        + _entry(
            node_ns,
            src,
            "ExecuTorch, XNNPACK nodes other than matmuls: a chain of 24 (multiply, add, tanh, "
            f"square in turn) on 64 rows of {NODE_WIDTH} less on 8 rows, per element written, "
            "median of 50 interleaved",
        ),
        *([_resident_mb_line(limit_mb, src)] if limit_mb is not None else []),
        *_resident_lines(resident, side, src, "XNNPACK 8da4w linears"),
        "host_call_us = "
        + _entry(
            host_call_us,
            src,
            "edgemtp's Python host per program call: greedy decoding of the embedded model's "
            "shapes through StaticBackend over a program that costs nothing, median step less "
            "its argmax",
        ),
        "host_ns_per_logit = "
        + _entry(host_ns_per_logit, src, "numpy argmax over a 262144-logit row, best median"),
        *([f"host_us_per_row = {_entry(host_row_us, src, HOST_ROW_NOTE)}"] if host_row_us else []),
        "call_us = "
        + _entry(
            max(per_call - per_op, RESOLUTION_US),
            src,
            "ExecuTorch program call less its one operator",
        ),
        *_linear_element_line(linear_ns, src, "XNNPACK 8da4w linears", quick),
        *_attention_lines(attention, src, "XNNPACK"),
        "ns_per_portable_element = "
        + _entry(
            portable_ns,
            src,
            "ExecuTorch portable kernels: the cache's slot bookkeeping "
            "(SlotBookkeeping, == and where over [slots, rows]) on 4096 slots x 64 rows "
            "less x 8 rows, per element written, median of 25 interleaved",
        ),
        f"active_w = {active}",
        "",
        "[delegates.cpu.peak_tops]",
    ]
    notes = {
        "int8": "XNNPACK 8da4w linears (int8 x int4, as Q4_0 bundles compute): "
        + _gemm_note("", quick, peak=True),
        "fp16": "torch.mm in float16, 256 x 1024 x 1024, median of 3 (ExecuTorch's CPU "
        "programs have no fp16 path)",
        "fp32": "XNNPACK fp32 linear 1024 x 1024 on 256 rows, median of 3 x 3 calls",
    }
    for dtype, value in tops.items():
        lines.append(f"{dtype} = {_entry(value, src, notes[dtype])}")
    gemv = f"{STREAM_LINEARS} x {'32 MiB' if not quick else '0.5 MiB'}"
    lines += [
        "",
        "[delegates.cpu.backends.onnx]",
        "memory_bandwidth_gbs = "
        + _entry(ort["memory_bandwidth_gbs"], src, f"weight bytes / time of one row through an "
                 f"ONNX Runtime MatMulNBits ({gemv} of 4-bit codes, fp32 scales), median of 9"),
        "verify_bandwidth_gbs = "
        + _entry(ort["verify_bandwidth_gbs"], src, f"the same MatMulNBits on "
                 f"{VERIFY_PROBE_ROWS} rows (ONNX Runtime takes another path above one row)"),
        "dispatch_us = "
        + _entry(ort["dispatch_us"], src, "ONNX Runtime, per node: sessions running a "
                 f"decoder layer's node mix ({', '.join(DECODER_NODE_MIX)}, Split with its "
                 "Concat) on one row of 64, 1 and 20 times over, time difference / node "
                 "difference, median of interleaved rounds"),
        "call_us = "
        + _entry(ort["call_us"], src, "ONNX Runtime session.run of the one-mix session, less "
                 "its nodes"),
        "linear_us = "
        + _entry(ort["linear_us"], src, "ONNX Runtime MatMulNBits beyond its weight bytes (at "
                 "memory_bandwidth_gbs) and its launch (dispatch_us): sessions of 64 and 1 "
                 "independent 64 x 64 linears on one row, per linear, median of interleaved "
                 "rounds"),
        *_resident_lines({r: ort[k] for r, k in ((1, "resident_bandwidth_gbs"),
                         (VERIFY_PROBE_ROWS, "resident_verify_bandwidth_gbs")) if k in ort},
                         side, src, "ONNX Runtime MatMulNBits nodes"),
        *_attention_lines(ort_attention, src, "ONNX Runtime"),
        *_linear_element_line(ort["ns_per_linear_element"], src,
                              "ONNX Runtime MatMulNBits (int8 activations)", quick),
        *([f"ns_per_gemv_element = {_entry(ort['ns_per_gemv_element'], src, GEMV_NOTE)}"]
          if ort["ns_per_gemv_element"] else []),
        "ns_per_element = "
        + _entry(ort_elements, src, "ONNX Runtime's non-matmul nodes: a chain of 24 (Mul, Add, "
                 "SimplifiedLayerNormalization, Gelu) on 64 x 1024 less on 8 x 1024, per "
                 "element written, median of 50 interleaved"),
        "",
        "[delegates.cpu.backends.onnx.peak_tops]",
        "int8 = "
        + _entry(ort["int8_tops"], src, "MatMulNBits with int8 activations (accuracy level 4, "
                 "as ONNX cpu bundles export by default): " + _gemm_note("", quick, peak=True)),
    ]  # fmt: skip
    return "\n".join(lines) + "\n"
