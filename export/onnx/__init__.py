"""ONNX backend: the static methods as ONNX graphs for ONNX Runtime (CPU EP; QDQ for the QNN EP).

`lower_onnx` writes a bundle's `onnx/` folder. Each method runs once in eager PyTorch under a
dispatch tracer that emits ONNX nodes for the aten ops it runs (`trace.py`); a linear with a
4-bit form becomes `MatMulNBits` (cpu) or `DequantizeLinear -> MatMul` (htp) from exactly the
checkpoint's codes and scales (`int4.py`). ONNX has no mutable state, so the cache lives on the
host and each method returns the rows it writes (`method.py`). For htp every float activation
gets a uint16 Q/DQ pair, calibrated on greedy runs of the float graphs (`qdq.py`). The folder
holds one `.onnx` per method, one `weights.bin` with every weight once (`graph.py`) and the
index `methods.json` (`folder.py`). This module adds what the manifest says of the programs:
op counts, elementwise work, numerics.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from pathlib import Path
from typing import Any, Literal

from torch import nn

from edgemtp.errors import EdgeMTPError
from edgemtp.export.forms import ONNX
from edgemtp.export.lowered import Lowered, Progress
from edgemtp.export.onnx.folder import write_methods
from edgemtp.export.onnx.graph import OPSET
from edgemtp.export.onnx.int4 import INT8_ACCURACY_LEVEL, Packs
from edgemtp.export.onnx.method import MethodGraph, trace_method
from edgemtp.export.onnx.qdq import calibrate, insert_activation_qdq, range_keys
from edgemtp.export.weights import int4_of
from edgemtp.model.static import StaticBundle
from edgemtp.model.tables import TokenTables

FOLDER = "onnx"  # everything this backend writes lives in out_dir/onnx
ACTIVATIONS = ("int8", "fp32")  # what the cpu delegate's 4-bit linears multiply
MATMUL_NODES = {"MatMul", "MatMulNBits", "Gemm", "MatMulInteger", "DynamicQuantizeMatMul"}
VIEW_NODES = {"Reshape", "Squeeze", "Unsqueeze", "Identity", "Flatten"}  # ORT aliases these


def _op_counts(methods: list[MethodGraph]) -> dict[str, dict[str, int]]:
    return {
        m.name: dict(sorted(Counter(n.op_type for n in m.graph.nodes).items())) for m in methods
    }


def _elementwise_elements(methods: list[MethodGraph]) -> dict[str, int]:
    """Per method: the elements its nodes other than matmuls and views write per call (norms,
    activations, adds, masks, softmax, copies), from each value's traced shape."""
    out = {}
    for m in methods:
        types = m.graph.all_types()
        out[m.name] = sum(
            math.prod(types[v][1])
            for n in m.graph.nodes
            if n.op_type not in MATMUL_NODES | VIEW_NODES
            for v in n.output
            if v in types
        )
    return out


def _numerics(static: StaticBundle, delegate: str, activations: str) -> dict[str, str]:
    schemes: dict[str, set[str]] = {}
    float_linears = 0
    for model in (static.target.target, static.drafter.drafter if static.drafter else None):
        if model is None:
            continue
        for module in model.modules():
            if isinstance(module, nn.Linear):
                q = int4_of(module)
                if q is None:
                    float_linears += 1
                    continue
                zp = "zero-point 8 (exact Q4_0 values)" if q.symmetric else "per-group zero points"
                what = {"q4_0": "Q4_0", "w4a16": "W4A16"}[q.scheme]
                schemes.setdefault(what, set()).add(f"group {q.group}, {zp}")
    parts = [f"{k}: {', '.join(sorted(v))}" for k, v in sorted(schemes.items())]
    float_note = f"{float_linears} linears without a 4-bit form: fp32" if float_linears else ""
    if delegate == "cpu":
        weights = "; ".join(
            [f"int4 via MatMulNBits ({p}; fp32 scales = the checkpoint's)" for p in parts]
            + ([float_note] if float_note else [])
        )
        if activations == "int8":
            into_linears = "int8 into the 4-bit linears (quantized per block as each reads them)"
            compute = (
                "int32 dot products of int8 activations and int4 weights, scaled to fp32 "
                f"(MatMulNBits accuracy_level {INT8_ACCURACY_LEVEL})"
            )
        else:
            into_linears = "fp32 into the 4-bit linears"
            compute = (
                "fp32 (MatMulNBits accuracy_level 0: weights dequantized to fp32, fp32 GEMM; "
                "session.qdq_matmulnbits_accuracy_level=0)"
            )
        return {
            "weights": weights or "fp32",
            "activations": f"{into_linears}; fp32 everywhere else",
            "accumulation": compute,
            "cache": "fp32, host arrays bound by IOBinding (zero-copy), rows written by the host",
            "notes": "RMSNorm as SimplifiedLayerNormalization, GELU as Gelu(tanh), both fp32; "
            "the drafter's clustered head dequantizes its gathered 4-bit rows in-graph (exact)",
        }
    weights = "; ".join(
        [f"int4 blockwise DequantizeLinear -> MatMul ({p}; exact codes and scales)" for p in parts]
        + ([float_note] if float_note else [])
    )
    return {
        "weights": weights or "fp32",
        "activations": "uint16 asymmetric per-tensor Q/DQ after every op computing a float "
        "activation and on every float input (min/max pooled per activation over a greedy "
        "calibration run of the float graph, all methods and draft depths); cos/sin over a fixed "
        "[-1, 1]; left float: rope angles and attention masks (from int positions) and the "
        "masked scores (-inf); RMSNorm is one SimplifiedLayerNormalization node",
        "accumulation": "on the QNN HTP: the backend's kernels for int16 activations x int4 "
        "weights (the QNN EP runs block-quantized MatMul in fp16); on the CPU EP (validation): "
        "fp32 between Q/DQ pairs, DQ->MatMul fused to MatMulNBits at accuracy_level 0",
        "cache": "fp32 on the host; quantized to uint16 at every graph input (shared scale "
        "per cache buffer)",
    }


def _check_delegate(delegate: str) -> None:
    if delegate in ("cpu", "htp"):
        return
    if delegate in ("metal", "npu"):
        raise EdgeMTPError(
            f"--backend onnx has no {delegate} delegate: ONNX Runtime's CoreML EP cannot run "
            "the 4-bit MatMulNBits weights (they would fall back to the CPU); use --backend "
            f"coreml --delegate {delegate}"
        )
    raise EdgeMTPError(f"unknown delegate '{delegate}' for --backend onnx (choose cpu or htp)")


def lower_onnx(
    static: StaticBundle,
    delegate: str,
    out_dir: Path,
    progress: Progress,
    *,
    tables: TokenTables | None = None,
    calibration_prompt: list[int] | None = None,
    activations: str = "int8",
) -> Lowered:
    """Write out_dir/onnx: one .onnx per method, one shared weights.bin, methods.json.

    delegate "cpu": MatMulNBits for the CPU EP, its activations quantized to int8 per block
    (`activations="int8"`, as ExecuTorch's 8da4w) or kept fp32 ("fp32": the reference engine's
    numerics on the same 4-bit weights, and slower). delegate "htp": a QDQ model for ORT's QNN
    EP (int4 blockwise weights, uint16 activations calibrated on greedy runs of the float graph
    over `calibration_prompt`, default: seeded random ids): needs `tables` (the target's
    `TokenTables`) to embed the calibration tokens. metal/npu: EdgeMTPError pointing to
    --backend coreml. Run the result with `OnnxRunner(out_dir / lowered.program, shapes)`.
    """
    _check_delegate(delegate)
    if activations not in ACTIVATIONS:
        raise EdgeMTPError(f"--activations {activations}: choose {' or '.join(ACTIVATIONS)}")
    if delegate == "htp" and tables is None:
        raise ValueError("delegate htp calibrates activations: pass the target's tables")
    folder = Path(out_dir) / FOLDER
    static.use_form(ONNX)
    for module in (static.target, static.drafter):
        if module is not None:
            module.eval().requires_grad_(False)
    weights_form: Literal["nbits", "nbits_int8", "qdq"] = "qdq"
    if delegate == "cpu":
        weights_form = "nbits_int8" if activations == "int8" else "nbits"
    methods = []
    packs: Packs = {}
    for name in static.methods():
        m = trace_method(static, name, weights_form, packs)
        methods.append(m)
        progress(f"trace {name}: {len(m.graph.nodes)} nodes ({m.seconds:.2f}s)")
    shapes = {
        "max_context": static.shapes.max_context,
        "max_draft": static.shapes.max_draft,
        "chunk": static.shapes.chunk,
    }
    details: dict[str, Any] = {}
    if delegate == "htp":
        assert tables is not None
        start = time.perf_counter()
        ranges = calibrate(methods, folder, static, tables, calibration_prompt)
        counts = {}
        for m in methods:
            counts[m.name] = insert_activation_qdq(m.graph, ranges, range_keys(m))
        details["qdq"] = {name: {"quantized": q, "float": f} for name, (q, f) in counts.items()}
        progress(f"calibrate + insert Q/DQ ({time.perf_counter() - start:.1f}s)")
    start = time.perf_counter()
    files, weights, index = write_methods(methods, folder, delegate, shapes)
    progress(
        f"write {len(files)} files, weights {weights.size / 2**20:.1f} MiB "
        f"({time.perf_counter() - start:.1f}s)"
    )
    details.update(
        {
            "ops": _op_counts(methods),
            "elementwise_elements": _elementwise_elements(methods),
            "weights_bytes": weights.size,
            "weights_referenced_bytes": weights.referenced,
            "cache_io": "host writes the new rows into the bound cache arrays",
            "opset": OPSET,
        }
    )
    method_io = {
        name: {
            "inputs": spec["inputs"],
            "outputs": spec["outputs"],
            "cache_inputs": spec["cache_inputs"],
            "cache_outputs": spec["cache_outputs"],
        }
        for name, spec in index["methods"].items()
    }
    return Lowered(
        files=[f"{FOLDER}/{f}" for f in files],
        program=FOLDER,
        numerics=_numerics(static, delegate, activations),
        details=details,
        method_io=method_io,
    )
