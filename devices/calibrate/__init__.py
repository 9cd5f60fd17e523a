"""`edgemtp devices calibrate`: measure this machine and write its device profile.

Each term the simulator prices is measured on its own, as the runtime would run it (its kernels,
its threads, medians of several runs), so that a prediction rests on this host's numbers and
not on factors fitted to benchmarks:
- `xnnpack`: ExecuTorch's XNNPACK kernels: weights streamed past and from the cache, GEMM
  throughput, the cost per operator, per node and per call, attention, the portable kernels;
- `onnxruntime`: the same for ONNX Runtime (the profile's `[delegates.cpu.backends.onnx]`);
- `kernels`: edgemtp's own Q4_0 kernel, as a bundle's steps run it (`[...backends.kernels]`);
- `host`: the cache's size, edgemtp's own time per call, logit and row, power;
- `measure`: how a call is timed, and the fits from timings to the simulator's terms;
- `profile`: the measurements as TOML, each with where it came from.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from edgemtp.devices.calibrate.host import host_costs, measured_power, resident_mb, resident_size
from edgemtp.devices.calibrate.kernels import kernel_rates
from edgemtp.devices.calibrate.measure import RESIDENT_LINEARS, VERIFY_PROBE_ROWS
from edgemtp.devices.calibrate.onnxruntime import onnx_attention, onnx_kernels, onnx_ns_per_element
from edgemtp.devices.calibrate.profile import Measurements, profile_toml
from edgemtp.devices.calibrate.xnnpack import (
    executorch_attention,
    executorch_dispatch_us,
    executorch_node_us,
    executorch_ns_per_element,
    int8_gemm,
    matmul_tops,
    memory_bandwidth,
    portable_ns_per_element,
    resident_bandwidth,
)
from edgemtp.runtime.probes import physical_memory

Say = Callable[[str], None]


def calibrate(threads: int, say: Say, quick: bool = False) -> str:
    """Measure this machine; its profile as TOML text (`quick`: small sizes, for tests)."""
    when = time.strftime("%Y-%m-%d")
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
    per_op, per_call = executorch_dispatch_us(50 if quick else 2000)
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
    say("edgemtp's Q4_0 kernel (one row and a verify's, streamed and from the cache)")
    kernels = kernel_rates(side, per_call + RESIDENT_LINEARS * per_op, quick)
    say("ONNX Runtime's kernels (MatMulNBits, per-node dispatch)")
    ort = onnx_kernels(threads, quick, limit_mb)
    say("attention (masked softmax between batched matmuls), XNNPACK and ONNX Runtime")
    attention = executorch_attention(quick)
    say("ExecuTorch's portable kernels (the cache's slot bookkeeping)")
    portable_ns = portable_ns_per_element(quick)
    ort_attention = onnx_attention(threads, quick)
    ort_elements = onnx_ns_per_element(threads, quick)
    say("edgemtp's host side (decoding beside a stand-in program)")
    host = host_costs(quick)
    say("power")
    power = measured_power(0.2 if quick else 3.0)
    return profile_toml(
        Measurements(
            threads=threads,
            quick=quick,
            when=when,
            ram_gb=physical_memory() / 1e9,
            memory_bandwidth_gbs=bw,
            best_bandwidth_gbs=best,
            verify_bandwidth_gbs=verify_bw,
            peak_tops=tops,
            ns_per_linear_element=linear_ns,
            dispatch_us=per_op,
            program_call_us=per_call,
            node_us=node_us,
            ns_per_element=node_ns,
            resident_mb=limit_mb,
            resident_side=side,
            resident=resident,
            onnx=ort,
            kernels=kernels,
            attention=attention,
            ns_per_portable_element=portable_ns,
            onnx_attention=ort_attention,
            onnx_ns_per_element=ort_elements,
            host_call_us=host.call_us,
            resident_host_call_us=host.resident_call_us if limit_mb is not None else None,
            host_ns_per_logit=host.ns_per_logit,
            host_us_per_row=host.row_us,
            power=power,
        )
    )
