"""The profile `devices calibrate` writes: every measurement as a TOML entry with its value, its
source (measured, and when) and a note on how it was measured, so that a profile says where each
of its numbers came from; power falls back to a labelled estimate where no counter is readable."""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass

from edgemtp.devices.calibrate.host import cpu_name
from edgemtp.devices.calibrate.kernels import NARROW_Q4_0, NARROW_Q4_0_QUICK
from edgemtp.devices.calibrate.measure import (
    ATTENTION_SHAPES,
    GEMM_QUICK,
    GEMM_SHAPES,
    RESIDENT_LINEARS,
    RESOLUTION_US,
    STREAM_LINEARS,
    VERIFY_PROBE_ROWS,
)
from edgemtp.devices.calibrate.onnxruntime import DECODER_NODE_MIX, NARROW_GEMV
from edgemtp.devices.calibrate.xnnpack import NODE_WIDTH

SOURCE = "measured: edgemtp devices calibrate"


def _gemm_shapes(quick: bool) -> str:
    """How `gemm_rates` timed: its two shapes and rounds."""
    (rows, wide), (_, narrow) = GEMM_QUICK if quick else GEMM_SHAPES
    rounds = 5 if quick else 15
    return (
        f"{wide} x {wide} and {narrow} x {narrow} on {rows} rows, medians of {rounds} interleaved"
    )


def _peak_note(quick: bool) -> str:
    return f"the FLOP rate solved with ns_per_linear_element from {_gemm_shapes(quick)}"


def _linear_element_line(ns: float, src: str, kernel: str, quick: bool) -> list[str]:
    """The profile's `ns_per_linear_element` line; none (free) where the narrow linear was
    no slower per FLOP than the wide one."""
    note = (f"{kernel}: time per activation element (rows x (inputs + outputs)) beside the "
            f"FLOPs at the int8 peak, solved with it from {_gemm_shapes(quick)}")  # fmt: skip
    return [f"ns_per_linear_element = {_entry(ns, src, note)}"] if ns else []


def _entry(value: float, source: str, note: str) -> str:
    return f"{{ value = {value:.6g}, source = {json.dumps(source)}, note = {json.dumps(note)} }}"


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


@dataclass
class Measurements:
    """What `calibrate` measured, as the probes return it."""

    threads: int
    quick: bool
    when: str  # the date, YYYY-MM-DD
    ram_gb: float
    memory_bandwidth_gbs: float  # XNNPACK's streaming probe: the median run
    best_bandwidth_gbs: float  # and the best one
    verify_bandwidth_gbs: float
    peak_tops: dict[str, float]  # int8, fp16, fp32
    ns_per_linear_element: float
    dispatch_us: float  # per XNNPACK operator
    program_call_us: float  # a program of one operator, per call
    node_us: float
    ns_per_element: float
    resident_mb: float | None  # None: sysfs does not say the cache's size
    resident_side: int
    resident: dict[int, float]  # rows: GB/s with the weights in the cache
    onnx: dict[str, float]  # `onnx_kernels`
    kernels: dict[str, float]  # `kernel_rates`
    attention: tuple[float, float, float]
    ns_per_portable_element: float
    onnx_attention: tuple[float, float, float]
    onnx_ns_per_element: float
    host_call_us: float
    resident_host_call_us: float | None  # None: no cache size to price it by
    host_ns_per_logit: float
    host_us_per_row: float
    power: tuple[float, float] | str  # (idle W, busy W), or why there is no reading


def profile_toml(m: Measurements) -> str:
    """The device profile of these measurements, as TOML text."""
    src = f"{SOURCE} ({m.when})"
    lines = [
        f"# This machine, measured by `edgemtp devices calibrate --threads {m.threads}` on "
        f"{m.when}.",
        "# Numbers marked measured come from the runs named in their notes.",
        "",
        f"name = {json.dumps('This host (' + (platform.node() or 'unnamed') + ')')}",
        f"soc = {json.dumps(f'{cpu_name()}, {os.cpu_count()} logical CPUs')}",
        'memory = "unknown type (measured bandwidth below)"',
        "ram_gb = "
        + _entry(m.ram_gb, src, "physical memory from sysconf (SC_PHYS_PAGES x page size)"),
        'battery_wh = "mains"',
    ]
    if isinstance(m.power, str):
        reason = m.power
        idle = _entry(
            10.0, "estimate", f"no power reading here ({reason}); 10 W: a server or desktop "
            "platform's idle share, generic"
        )  # fmt: skip
        active = _entry(
            8.0 * m.threads, "estimate", f"no power reading here ({reason}); 8 W per busy core "
            f"x {m.threads} threads, a generic figure for x86 server cores"
        )  # fmt: skip
    else:
        idle_w, busy_w = m.power
        idle = _entry(idle_w, src, "RAPL energy counter over 3 s idle")
        active = _entry(
            max(busy_w - idle_w, 0.1), src, f"RAPL over 3 s of fp32 GEMM on {m.threads} threads "
            f"({busy_w:.1f} W) minus idle ({idle_w:.1f} W)"
        )  # fmt: skip
    lines += [
        f"idle_w = {idle}",
        "",
        "[delegates.cpu]",
        f'unit = "{m.threads} threads of {cpu_name()}"',
        'dispatch_unit = "kernel"',
        f"threads = {_entry(m.threads, src, 'the threads every measurement here ran with')}",
        "memory_bandwidth_gbs = "
        + _entry(
            m.memory_bandwidth_gbs,
            src,
            "weight bytes / time of one row through a chain of "
            f"{STREAM_LINEARS} XNNPACK int4 (8da4w) linears of 8192 x 8192 (each 32 MiB codes "
            "+ 4 MiB bf16 scales), median of 9",
        ),
        "peak_memory_bandwidth_gbs = "
        + _entry(
            max(m.best_bandwidth_gbs, m.memory_bandwidth_gbs),
            src,
            "the best of the same 9 runs (this host's bus peak is unknown)",
        ),
        "verify_bandwidth_gbs = "
        + _entry(
            m.verify_bandwidth_gbs,
            src,
            f"the same linear on {VERIFY_PROBE_ROWS} rows (a verify of "
            f"{VERIFY_PROBE_ROWS - 1} drafts), median of 9",
        ),
        "dispatch_us = "
        + _entry(
            max(m.dispatch_us, RESOLUTION_US),
            src,
            f"ExecuTorch, per XNNPACK operator: programs of 1 and 201 "
            f"chained 64x64 linears on one row, (t201 - t1) / 200; a program call costs "
            f"{m.program_call_us:.1f} us",
        ),  # fmt: skip
        "node_us = "
        + _entry(
            m.node_us,
            src,
            f"ExecuTorch, per XNNPACK node that is not a matmul: programs of 1 and 201 chained "
            f"multiplies on one row of {NODE_WIDTH}, (t201 - t1) / 200, median of 5 interleaved",
        ),
        "ns_per_element = "
        + _entry(
            m.ns_per_element,
            src,
            "ExecuTorch, XNNPACK nodes other than matmuls: a chain of 24 (multiply, add, tanh, "
            f"square in turn) on 64 rows of {NODE_WIDTH} less on 8 rows, per element written, "
            "median of 50 interleaved",
        ),
        *([_resident_mb_line(m.resident_mb, src)] if m.resident_mb is not None else []),
        *_resident_lines(m.resident, m.resident_side, src, "XNNPACK 8da4w linears"),
        "host_call_us = "
        + _entry(
            m.host_call_us,
            src,
            "edgemtp's Python host per program call: greedy decoding of the embedded model's "
            "shapes through StaticBackend over a stand-in program that streams 32 MiB of int4 "
            "weights (past the cache) per call, median step less its argmax",
        ),
        *(
            [
                "resident_host_call_us = "
                + _entry(
                    m.resident_host_call_us,
                    src,
                    "the same beside a stand-in that streams a 64 x 64 int4 linear (the "
                    "program's data and the host's own stay in the cache)",
                )
            ]
            if m.resident_host_call_us is not None
            else []
        ),
        "host_ns_per_logit = "
        + _entry(m.host_ns_per_logit, src, "numpy argmax over a 262144-logit row, best median"),
        *(
            [f"host_us_per_row = {_entry(m.host_us_per_row, src, HOST_ROW_NOTE)}"]
            if m.host_us_per_row
            else []
        ),
        "call_us = "
        + _entry(
            max(m.program_call_us - m.dispatch_us, RESOLUTION_US),
            src,
            "ExecuTorch program call less its one operator",
        ),
        *_linear_element_line(m.ns_per_linear_element, src, "XNNPACK 8da4w linears", m.quick),
        *_attention_lines(m.attention, src, "XNNPACK"),
        "ns_per_portable_element = "
        + _entry(
            m.ns_per_portable_element,
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
        + _peak_note(m.quick),
        "fp16": "torch.mm in float16, 256 x 1024 x 1024, median of 3 (ExecuTorch's CPU "
        "programs have no fp16 path)",
        "fp32": "XNNPACK fp32 linear 1024 x 1024 on 256 rows, median of 3 x 3 calls",
    }
    for dtype, value in m.peak_tops.items():
        lines.append(f"{dtype} = {_entry(value, src, notes[dtype])}")
    gemv = f"{STREAM_LINEARS} x {'32 MiB' if not m.quick else '0.5 MiB'}"
    lines += [
        "",
        "[delegates.cpu.backends.onnx]",
        "memory_bandwidth_gbs = "
        + _entry(m.onnx["memory_bandwidth_gbs"], src, f"weight bytes / time of one row through an "
                 f"ONNX Runtime MatMulNBits ({gemv} of 4-bit codes, fp32 scales), median of 9"),
        "verify_bandwidth_gbs = "
        + _entry(m.onnx["verify_bandwidth_gbs"], src, f"the same MatMulNBits on "
                 f"{VERIFY_PROBE_ROWS} rows (ONNX Runtime takes another path above one row)"),
        "dispatch_us = "
        + _entry(m.onnx["dispatch_us"], src, "ONNX Runtime, per node: sessions running a "
                 f"decoder layer's node mix ({', '.join(DECODER_NODE_MIX)}, Split with its "
                 "Concat) on one row of 64, 1 and 20 times over, time difference / node "
                 "difference, median of interleaved rounds"),
        "call_us = "
        + _entry(m.onnx["call_us"], src, "ONNX Runtime session.run of the one-mix session, less "
                 "its nodes"),
        "linear_us = "
        + _entry(m.onnx["linear_us"], src, "ONNX Runtime MatMulNBits beyond its weight bytes (at "
                 "memory_bandwidth_gbs) and its launch (dispatch_us): sessions of 64 and 1 "
                 "independent 64 x 64 linears on one row, per linear, median of interleaved "
                 "rounds"),
        *_resident_lines({r: m.onnx[k] for r, k in ((1, "resident_bandwidth_gbs"),
                         (VERIFY_PROBE_ROWS, "resident_verify_bandwidth_gbs")) if k in m.onnx},
                         m.resident_side, src, "ONNX Runtime MatMulNBits nodes"),
        *_attention_lines(m.onnx_attention, src, "ONNX Runtime"),
        *_linear_element_line(m.onnx["ns_per_linear_element"], src,
                              "ONNX Runtime MatMulNBits (int8 activations)", m.quick),
        *([f"ns_per_gemv_element = {_entry(m.onnx['ns_per_gemv_element'], src, GEMV_NOTE)}"]
          if m.onnx["ns_per_gemv_element"] else []),
        "ns_per_element = "
        + _entry(m.onnx_ns_per_element, src, "ONNX Runtime's non-matmul nodes: a chain of 24 "
                 "(Mul, Add, SimplifiedLayerNormalization, Gelu) on 64 x 1024 less on 8 x 1024, "
                 "per element written, median of 50 interleaved"),
        "",
        "[delegates.cpu.backends.onnx.peak_tops]",
        "int8 = "
        + _entry(m.onnx["int8_tops"], src, "MatMulNBits with int8 activations (accuracy level 4, "
                 "as ONNX cpu bundles export by default): " + _peak_note(m.quick)),
    ]  # fmt: skip
    if m.kernels:
        lines += _kernel_lines(m, src)
    return "\n".join(lines) + "\n"


def _kernel_lines(m: Measurements, src: str) -> list[str]:
    """The `[delegates.cpu.backends.kernels]` section: edgemtp's Q4_0 kernel's rates."""
    narrow = " x ".join(map(str, NARROW_Q4_0_QUICK if m.quick else NARROW_Q4_0))
    return [
        "",
        "[delegates.cpu.backends.kernels]",
        "memory_bandwidth_gbs = "
        + _entry(m.kernels["memory_bandwidth_gbs"], src, f"Q4_0 bytes (codes, float16 scales) / "
                 f"time of one row through a chain of {STREAM_LINEARS} edgemtp::q4_0_linear of "
                 f"{'1024' if m.quick else '8192'} x same in an ExecuTorch program, median of 25 "
                 "interleaved with the narrow probe below"),
        "verify_bandwidth_gbs = "
        + _entry(m.kernels["verify_bandwidth_gbs"], src, f"the same chain on {VERIFY_PROBE_ROWS} "
                 "rows (the kernel reads each weight once and computes every row beside it), "
                 "median of 9"),
        "ns_per_gemv_element = "
        + _entry(m.kernels["ns_per_gemv_element"], src, "edgemtp::q4_0_linear on one row of a "
                 f"narrow linear ({narrow}, an LM head's shape class, past the caches): its "
                 "time beyond its bytes at memory_bandwidth_gbs, per element it reads or "
                 "writes, median of 25 interleaved with the streaming chain"),
        *_resident_lines({r: m.kernels[k] for r, k in ((1, "resident_bandwidth_gbs"),
                         (VERIFY_PROBE_ROWS, "resident_verify_bandwidth_gbs")) if k in m.kernels},
                         m.resident_side, src, "edgemtp::q4_0_linear kernels"),
    ]  # fmt: skip
