"""ONNX backend: the static methods as ONNX graphs for ONNX Runtime (CPU EP; QDQ for the QNN EP).

How a method becomes a graph. Each method of `StaticBundle.methods()` runs once in eager PyTorch
under a `TorchDispatchMode` that records every aten op whose inputs depend on a method input, a
weight or the cache, and emits the equivalent ONNX nodes (`_Tracer`). Ops on constants only are
folded (their eager result is the constant). This costs one eager forward per method (0.1-0.7 s
on the tiny model, where `torch.onnx.export(dynamo=True)` took 10-40 s per method here; ~6 s for
all methods of e2b x0.25), needs no extra package, gives static shapes
by construction, and lets the backend pick the ONNX form of every linear from the module it came
from: a linear with `int4_of(linear)` becomes `com.microsoft::MatMulNBits` built from exactly the
codes and scales of the checkpoint (cpu) or `DequantizeLinear(int4, block) -> MatMul` (htp),
every other linear an fp32 `Gemm`.

The cache. ONNX has no mutable state, so the cache lives on the host: one preallocated array per
cache buffer of `StaticCache` (`k{i}`/`v{i}` `[kv_heads, slots + 1, head_dim]`, `pos_{kind}`
`[slots + 1]`), wrapped once in an `OrtValue` and bound by `IOBinding` as an input of every
method that reads it: the target and the drafter read the same memory, nothing is copied between
calls. The in-graph writes of `StaticCache.write` become graph outputs: the new K/V rows
`[kv_heads, T, head_dim]`, the slot of each row (`slots.{n}`: position % ring, pad rows -> the
trash slot) and the new slot-position vector, all computed by the graph with `StaticCache`'s
own code, so rollback, the ring and the trash slot behave exactly as in the eager wrappers. The
runner writes the rows into its arrays after the call (`k[:, slots] = rows`, O(rows)).

The alternative, binding one OrtValue as both the cache input and a `ScatterElements` output,
was measured (tiny and e2b x0.25, ctx 1024: ~0.2 ms of scatter kernels per verify against
~0.05-0.08 ms of host row writes here) and rejected: it is slower and nothing orders the
in-place scatter after the graph's own reads of the old buffer, so a prefill chunk longer than
`ring - window` could overwrite sliding entries its attention still reads.

Weights are stored once: every method's `.onnx` file references one `weights.bin` (ONNX external
data: location, offset, length), deduplicated by initializer name, which is the parameter's
qualified name and therefore the same in every method.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper
from torch import Tensor, nn

from edgemtp.errors import EdgeMTPError
from edgemtp.export.forms import ONNX
from edgemtp.export.lowered import Lowered, Progress
from edgemtp.export.onnx.graph import OPSET, WEIGHTS, Graph, WeightFile, dtype_name
from edgemtp.export.onnx.int4 import INT8_ACCURACY_LEVEL, Packs
from edgemtp.export.onnx.method import MethodGraph, trace_method
from edgemtp.export.weights import int4_of
from edgemtp.model.static import StaticBundle
from edgemtp.model.tables import TokenTables
from edgemtp.runtime.backends import StaticBackend
from edgemtp.runtime.runners.onnx import INDEX, OnnxRunner, range_union

FOLDER = "onnx"  # everything this backend writes lives in out_dir/onnx
ACTIVATIONS = ("int8", "fp32")  # what the cpu delegate's 4-bit linears multiply
# A DQ(int4) -> MatMul pair (the htp bundle on the CPU EP) fuses to MatMulNBits with
# accuracy_level 4 (int8 activations) unless this says 0 (fp32, exact weights).
SESSION_CONFIG = {"session.qdq_matmulnbits_accuracy_level": "0"}
QUANT_MAX = 65535  # uint16 activations


# --- activation QDQ (htp) -------------------------------------------------------------------------


# Ops that only move values: their outputs lie on their input's quantization grid already.
_MOVES = {"Identity", "Reshape", "Transpose", "Unsqueeze", "Squeeze", "Slice", "Gather", "Expand"}


def _activations(graph: Graph) -> tuple[list[str], set[str]]:
    """Float values computed from a graph input (not from weights only) by an op that is not a
    pure data movement, in node order: the values that get a Q/DQ pair. Also returns the
    values computed from integer inputs only (positions: rope angles, masks)."""
    dynamic = set(graph.inputs)
    from_ints = {i for i in graph.inputs if graph.types[i][0] != TensorProto.FLOAT}
    out = []
    for node in graph.nodes:
        inputs = [i for i in node.input if i in dynamic]
        if not inputs:
            continue
        dynamic.update(node.output)
        if all(i in from_ints for i in inputs):
            from_ints.update(node.output)
        if node.op_type in _MOVES or node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            continue
        out += [o for o in node.output if graph.types.get(o, (0,))[0] == TensorProto.FLOAT]
    return out, from_ints


def _float_inputs(graph: Graph) -> list[str]:
    return [i for i in graph.inputs if graph.types[i][0] == TensorProto.FLOAT]


def quant_params(lo: float, hi: float) -> tuple[float, int] | None:
    """uint16 asymmetric (scale, zero point) covering [lo, hi] and 0; None if not finite."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return None
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = float(np.float32((hi - lo) / QUANT_MAX)) or 1.0 / QUANT_MAX
    zero = int(min(max(round(-lo / scale), 0), QUANT_MAX))
    return scale, zero


def insert_activation_qdq(
    graph: Graph, ranges: dict[str, tuple[float, float]], keys: dict[str, str]
) -> tuple[int, int]:
    """Put a uint16 QuantizeLinear -> DequantizeLinear pair after every activation (and float
    graph input) with a finite calibrated range; consumers read the dequantized value. `keys`
    maps a value to its range key (cache buffers share one). Returns (quantized, left float)."""
    pairs: dict[str, list[onnx.NodeProto]] = {}
    renamed: dict[str, str] = {}
    skipped = 0
    activations, from_positions = _activations(graph)
    producers = graph.producers()
    for value in _float_inputs(graph) + activations:
        key = keys.get(value, value)
        params = quant_params(*ranges[key]) if key in ranges else None
        if value in from_positions:
            # Rope angles need more than 16 bits over the context and no calibration run sees
            # every position: they stay float; cos/sin are quantized over their full [-1, 1].
            bounded = producers[value].op_type in ("Cos", "Sin")
            params = quant_params(-1.0, 1.0) if bounded else None
        if params is None:
            skipped += 1
            continue
        scale = graph.const(np.array(params[0], np.float32), hint="qscale")
        zero = graph.const(np.array(params[1], np.uint16), hint="qzero")
        elem, shape = graph.types[value]
        q = graph.typed(graph.fresh(f"{value}.q"), TensorProto.UINT16, shape)
        dq = graph.typed(graph.fresh(f"{value}.dq"), elem, shape)
        pairs[value] = [
            helper.make_node("QuantizeLinear", [value, scale, zero], [q], name=graph.fresh("Q")),
            helper.make_node("DequantizeLinear", [q, scale, zero], [dq], name=graph.fresh("DQ")),
        ]
        renamed[value] = dq
    nodes: list[onnx.NodeProto] = []
    for value in graph.inputs:
        nodes += pairs.pop(value, [])
    for node in graph.nodes:
        for i, name in enumerate(node.input):
            node.input[i] = renamed.get(name, name)
        nodes.append(node)
        for o in node.output:
            nodes += pairs.pop(o, [])
    graph.nodes = nodes
    return len(renamed), skipped


# --- the bundle -----------------------------------------------------------------------------------


def _save(
    methods: list[MethodGraph], folder: Path, delegate: str, shapes: dict[str, int]
) -> tuple[list[str], WeightFile, dict[str, Any]]:
    folder.mkdir(parents=True, exist_ok=True)
    weights = WeightFile(folder / WEIGHTS)
    files = []
    index_methods: dict[str, Any] = {}
    try:
        for m in methods:
            model = m.graph.model(weights)
            (folder / f"{m.name}.onnx").write_bytes(model.SerializeToString())
            files.append(f"{m.name}.onnx")
            index_methods[m.name] = _method_spec(m)
    finally:
        weights.close()
    files.append(WEIGHTS)
    cache: dict[str, Any] = {}
    for m in methods:
        for name in m.cache_inputs:
            elem, shape = m.graph.types[name]
            fill = -1 if name.startswith("cache.pos_") else 0
            cache[name] = {"shape": list(shape), "dtype": dtype_name(elem), "fill": fill}
    index = {
        "format": "edgemtp-onnx/1",
        "delegate": delegate,
        "shapes": shapes,
        "session_config": SESSION_CONFIG,
        "cache": dict(sorted(cache.items())),
        "methods": index_methods,
    }
    (folder / INDEX).write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    files.append(INDEX)
    return files, weights, index


def _method_spec(m: MethodGraph) -> dict[str, Any]:
    def io(names: list[str]) -> list[dict[str, Any]]:
        out = []
        for n in names:
            elem, shape = m.graph.types[n]
            out.append({"name": n, "shape": list(shape), "dtype": dtype_name(elem)})
        return out

    cache_outputs = [u["output"] for u in m.updates] + sorted(
        {u["slots"] for u in m.updates if "slots" in u}
    )
    return {
        "file": f"{m.name}.onnx",
        "inputs": io(m.inputs),
        "outputs": io(m.outputs),
        "cache_inputs": m.cache_inputs,
        "cache_outputs": io(cache_outputs),
        "updates": m.updates,
    }


def _op_counts(methods: list[MethodGraph]) -> dict[str, dict[str, int]]:
    return {
        m.name: dict(sorted(Counter(n.op_type for n in m.graph.nodes).items())) for m in methods
    }


MATMUL_NODES = {"MatMul", "MatMulNBits", "Gemm", "MatMulInteger", "DynamicQuantizeMatMul"}
VIEW_NODES = {"Reshape", "Squeeze", "Unsqueeze", "Identity", "Flatten"}  # ORT aliases these


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
    numerics on the same 4-bit weights, ~1.3-2x slower). delegate "htp": a QDQ model for
    ORT's QNN EP (int4 blockwise weights, uint16 activations calibrated on greedy runs of the
    float graph over `calibration_prompt`, default: seeded random ids): needs `tables` (the
    target's `TokenTables`) to embed the calibration tokens. metal/npu: EdgeMTPError pointing to
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
            counts[m.name] = insert_activation_qdq(m.graph, ranges, _range_keys(m))
        details["qdq"] = {name: {"quantized": q, "float": f} for name, (q, f) in counts.items()}
        progress(f"calibrate + insert Q/DQ ({time.perf_counter() - start:.1f}s)")
    start = time.perf_counter()
    files, weights, index = _save(methods, folder, delegate, shapes)
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


def _range_keys(m: MethodGraph) -> dict[str, str]:
    """Value -> calibration key. The same activation in every method shares a key (module path,
    op, position in the module call, width), so ranges pool over all calls of all methods; a
    cache buffer, its readers and the rows written into it share one key."""
    g = m.graph
    keys = {name: name for name in _float_inputs(g)}
    for value in _activations(g)[0]:
        keys[value] = f"{g.keys.get(value, value)}|{g.types[value][1][-1:]}"
    producers = g.producers()
    for u in m.updates:
        if u["kind"] == "rows":
            keys[producers[u["output"]].input[0]] = u["cache"]
    return keys


class _RepeatedDrafts(StaticBackend):
    """A bundle without a drafter whose rounds still verify k rows: each draft repeats the
    last token (calibration only sees the verify methods' values)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.has_drafter = True

    def draft_step(self, token: int, hidden: Tensor, position: int) -> tuple[Tensor, ...]:
        return hidden, torch.tensor([token]), torch.zeros(1)


def calibrate(
    methods: list[MethodGraph],
    folder: Path,
    static: StaticBundle,
    tables: TokenTables,
    prompt: list[int] | None,
) -> dict[str, tuple[float, float]]:
    """Min/max of every float activation and input over greedy decoding of `prompt` (AR and
    every draft depth) on the CPU EP, with the float-activation graphs (the same
    DequantizeLinear weights), pooled by `_range_keys` across methods."""
    from edgemtp.runtime.generate import FixedDepth, decode

    shapes = static.shapes
    observe = {m.name: _activations(m.graph)[0] for m in methods}
    for m in methods:
        m.graph.outputs += observe[m.name]
    try:
        _save(methods, folder, "cpu", {})
        runner = OnnxRunner(folder, shapes, observe=observe)
        if prompt is None:
            gen = torch.Generator().manual_seed(0)
            vocab = tables.tokens.shape[0]
            n = min(4 * shapes.chunk + 3, shapes.max_context // 2)
            prompt = torch.randint(3, vocab, (n,), generator=gen).tolist()
        budget = max(1, min(16, shapes.max_context - len(prompt) - shapes.max_draft - 1))
        cfg = static.target.target.cfg
        backend = StaticBackend(runner, tables, cfg)
        if not backend.has_drafter:  # verify_k still needs k drafts: repeat the token
            backend = _RepeatedDrafts(runner, tables, cfg)
        for depth in shapes.verify_depths():
            backend.truncate(0)
            decode(backend, prompt, budget, policy=FixedDepth(depth))
    finally:
        for m in methods:
            m.graph.outputs = m.graph.outputs[: len(m.graph.outputs) - len(observe[m.name])]
    ranges: dict[str, tuple[float, float]] = {}
    for m in methods:
        keys = _range_keys(m)
        for value, seen in runner.ranges.get(m.name, {}).items():
            key = keys.get(value, value)
            ranges[key] = range_union(ranges.get(key), seen)
    return ranges
