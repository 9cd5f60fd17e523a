"""ExecuTorch backend of `edgemtp export`: every static method in one `model.pte`.

Delegates:
- `cpu`: XNNPACK, in one of two forms (`export/forms.py`): with edgemtp's kernels
  (`--kernels edgemtp`: decode, verify and draft steps run the checkpoint's Q4_0 blocks, the
  attention and the norms in `runtime/kernels`, over a float16 cache; prompt chunks XNNPACK's
  8da4w GEMMs) or XNNPACK alone (`--kernels xnnpack`: what stock ExecuTorch runtimes run).
  Linears are built from *our* codes and scales, never re-quantized by torchao
  (`export/int4.py`). The assistant's clustered head gathers only its kept tokens' int4 rows
  (outside the delegates: none gathers int4 rows).
- `metal` / `npu`: Core ML through ExecuTorch's Core ML delegate (compute units CPU_AND_GPU /
  CPU_AND_NE), int4 weight-only.
- `htp`: Qualcomm QNN, when the QNN SDK is installed.
"""

from __future__ import annotations

import os
import time
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import torch

from edgemtp.errors import EdgeMTPError
from edgemtp.export.executorch_program import (
    backend_config,
    delegation_summary,
    export_method,
    lower_programs,
    static_partitioner,
    xnnpack_partitioner,
)
from edgemtp.export.forms import COREML_DELEGATE, QNN, form_for
from edgemtp.export.int4 import CLUSTERED_HEAD
from edgemtp.export.lowered import Lowered, Progress
from edgemtp.export.memory import release_spilled, releasing_spilled
from edgemtp.model.cache import KV_CACHE_DTYPES
from edgemtp.model.static import StaticBundle, method_io
from edgemtp.runtime.kernels.ops import KERNEL_MAX_ROWS
from edgemtp.runtime.runners.executorch import program_kernels

PROGRAM = "model.pte"
COREML_COMPUTE_UNITS = {"metal": "CPU_AND_GPU", "npu": "CPU_AND_NE"}
QNN_MISSING = (
    "--delegate htp needs Qualcomm AI Engine Direct (QNN) SDK: install it and set QNN_SDK_ROOT "
    "(or use --delegate cpu)"
)


# --- lowering --------------------------------------------------------------------------------


def lower_executorch(
    static: StaticBundle,
    delegate: str,
    out_dir: Path,
    progress: Progress,
    kernels: str = "edgemtp",
    kv_cache: str | None = None,
) -> Lowered:
    """Lower every method of `static` into `out_dir/model.pte` for `delegate` (`kernels`: the
    cpu delegate's form, see `export/forms.py`; `kv_cache`: its cache's dtype, if not the
    form's)."""
    cpu = partial(_lower_xnnpack, kernels=kernels, kv_cache=kv_cache)
    lower = {"cpu": cpu, "htp": _lower_qnn}.get(delegate)
    if lower is None and delegate in COREML_COMPUTE_UNITS:
        lower = partial(_lower_coreml, delegate=delegate)
    if lower is None:
        raise EdgeMTPError(
            f"--backend executorch has no '{delegate}' delegate (choose cpu, metal, npu or htp)"
        )
    with warnings.catch_warnings():
        # torch's pytree deprecations and ExecuTorch's note on mutable buffers, once per node
        # and pass: thousands of lines that say nothing about this export
        warnings.simplefilter("ignore", FutureWarning)
        warnings.filterwarnings("ignore", message="Mutation on a buffer")
        return lower(static, out_dir=Path(out_dir), progress=progress)


def _export_all(static: StaticBundle, progress: Progress) -> dict[str, Any]:
    programs = {}
    for name, (module, inputs) in static.methods().items():
        start = time.perf_counter()
        programs[name] = export_method(module, inputs)
        nodes = len(programs[name].graph.nodes)
        progress(f"trace {name}: {nodes} nodes ({time.perf_counter() - start:.1f}s)")
    return programs


def program_io(programs: dict[str, Any]) -> dict[str, Any]:
    """Each method's inputs and outputs as the program sees them: [name, shape, dtype]. The
    cache is internal (shared buffers), so these are exactly the logical inputs and outputs."""

    def describe(name: str, node: Any) -> list[Any]:
        val = node.meta["val"]
        return [name, list(val.shape), str(val.dtype).removeprefix("torch.")]

    out: dict[str, Any] = {}
    for method, program in programs.items():
        sig = program.graph_signature
        nodes = {n.name: n for n in program.graph.nodes}
        inputs, names = method_io(method) if method != "cache_state" else ((), ())
        outputs = [str(n) for n in sig.user_outputs]
        out[method] = {
            "inputs": [
                describe(inputs[i] if i < len(inputs) else n, nodes[n])
                for i, n in enumerate(sig.user_inputs)
            ],
            "outputs": [
                describe(names[i] if i < len(names) else n, nodes[n]) for i, n in enumerate(outputs)
            ],
        }
    return out


# XNNPACK nodes that run a matmul: each costs a kernel set-up and a thread-pool dispatch (the
# profile's `dispatch_us`); the elementwise and shape nodes around them cost far less
# (`node_us`).
XNNPACK_MATMUL_NODES = ("XNNFullyConnected", "XNNBatchMatrixMultiply")
PORTABLE_CALL = "portable"


def program_operator_kinds(program: Any) -> dict[str, dict[str, int]]:
    """Operators each method of an ExecuTorch `Program` dispatches per call, by kind: method ->
    {XNNPACK node type ("XNNFullyConnected", ...), "portable" (kernel calls), or another
    delegate's id: count}. Inside each XNNPACK delegate, the nodes of its XNNPACK graph (read
    from the delegate's flatbuffer); another delegate counts one. This is what a per-operator
    dispatch cost multiplies, not the edge graph, whose quantize/dequantize pairs, views and
    getitems never run."""
    import json
    import tempfile
    from collections import Counter

    from executorch.backends.xnnpack.serialization.xnnpack_graph_serialize import (
        XNNHeader,
        _get_schema_bytes,
    )
    from executorch.exir._serialize._flatbuffer import _flatc_decompile

    counted: dict[int, Counter[str]] = {}
    out: dict[str, dict[str, int]] = {}
    with tempfile.TemporaryDirectory() as folder:
        schema = Path(folder) / "schema.fbs"
        schema.write_bytes(_get_schema_bytes())
        for plan in program.execution_plan:
            kinds: Counter[str] = Counter()
            for chain in plan.chains:
                for instruction in chain.instructions:
                    kind = type(instruction.instr_args).__name__
                    if kind == "KernelCall":
                        kinds[PORTABLE_CALL] += 1
                    elif kind == "DelegateCall":
                        delegate = plan.delegates[instruction.instr_args.delegate_index]
                        if delegate.id != "XnnpackBackend":
                            kinds[delegate.id] += 1
                            continue
                        index = delegate.processed.index
                        if index not in counted:
                            blob = program.backend_delegate_data[index].data
                            header = XNNHeader.from_bytes(blob[: XNNHeader.EXPECTED_LENGTH])
                            start = header.flatbuffer_offset
                            graph = Path(folder) / f"graph{index}.bin"
                            graph.write_bytes(blob[start : start + header.flatbuffer_size])
                            _flatc_decompile(folder, str(schema), str(graph), ["--raw-binary"])
                            parsed = json.loads(graph.with_suffix(".json").read_text())
                            counted[index] = Counter(
                                str(node["xnode_union_type"]) for node in parsed.get("xnodes", [])
                            )
                        kinds.update(counted[index])
            out[plan.name] = dict(sorted(kinds.items()))
    return out


def write_program(manager: Any, path: Path) -> int:
    """Write an ExecuTorch program's segments straight to `path` (its `buffer` would first join
    them into one bytes object as large as the program); returns the bytes written."""
    with path.open("wb") as f:
        manager.write_to_file(f)
    return path.stat().st_size


def _lower_xnnpack(
    static: StaticBundle,
    out_dir: Path,
    progress: Progress,
    kernels: str = "edgemtp",
    kv_cache: str | None = None,
) -> Lowered:
    start = time.perf_counter()
    stats = static.use_form(form_for("executorch", "cpu", kernels, kv_cache))
    release_spilled()  # the conversion's temporaries and the forms' written pages
    stats.setdefault("int4", {})
    stats["attention"] = "kernel" if kernels == "edgemtp" else "matmul"
    stats["kv_cache"] = next(k for k, d in KV_CACHE_DTYPES.items() if d == static.form.cache_dtype)
    programs = _export_all(static, progress)
    io = program_io(programs)
    t = time.perf_counter()
    partitioners: list[Any] = []

    def fresh() -> list[Any]:
        partitioners.append(xnnpack_partitioner())
        return partitioners[-1:]

    edge = lower_programs(programs, fresh, progress)
    progress(f"lower {len(programs)} methods to XNNPACK ({time.perf_counter() - t:.1f}s)")
    summary = delegation_summary(edge, exempt=(CLUSTERED_HEAD,))
    full = {k: v for p in partitioners for k, v in p.full_pipeline.items()}
    t = time.perf_counter()
    with releasing_spilled():  # the emitter copies every constant: their pages, read once
        manager = edge.to_executorch(backend_config())
        for name, kinds in program_operator_kinds(manager.executorch_program).items():
            summary[name]["runtime_ops"] = sum(kinds.values())
            summary[name]["runtime_op_kinds"] = kinds
        size = write_program(manager, out_dir / PROGRAM)
    progress(f"emit {PROGRAM}: {size / 2**20:.1f} MiB ({time.perf_counter() - t:.1f}s)")
    delegates = sum(m["delegates"] for m in summary.values())
    portable = sum(m["portable_nodes"] for m in summary.values())
    progress(
        f"XNNPACK: {delegates} delegates, {sum(stats['int4'].values())} 8da4w linears, "
        f"{portable} portable ops left (cache writes, masks, lookups); "
        f"{time.perf_counter() - start:.1f}s in all"
    )
    details = {
        "delegate": "XNNPACK",
        "delegation": summary,
        "int4_linears": stats["int4"],
        "offset_blocks": stats["offset_blocks"],
        "offset_values": stats["offset_values"],
        "fused_linears": stats.get("fused_linears", 0),
        "q4_0_kernel_linears": stats.get("q4_0_kernel_linears", 0),
        "float_linears": stats["float_linears"],
        "full_xnnpack_pipeline": full,  # partition tag -> op that needed every XNNPACK pass
        # edgemtp's own kernels the program calls (runtime/kernels): a runner must load them
        "kernels": program_kernels(manager.executorch_program, "edgemtp::"),
    }
    return Lowered(
        files=[PROGRAM],
        program=PROGRAM,
        numerics=xnnpack_numerics(stats),
        details=details,
        method_io=io,
    )


def xnnpack_numerics(stats: dict[str, Any]) -> dict[str, str]:
    """What the XNNPACK program computes, its weights as `export.forms.xnnpack_weights` stored
    them (`stats`: what that conversion returned)."""
    schemes = stats["int4"]
    out: dict[str, str] = {}
    if schemes:
        rounded = stats["bf16_rounded"]
        scales = [
            "block scales as bf16 (XNNPACK's blockwise int4 format): "
            + (
                f"{rounded} of {stats['scales']} scales were not bf16 values and are rounded "
                "(relative weight error <= 2^-9)"
                if rounded
                else f"all {stats['scales']} scales are bf16 values, so the weights are exact"
            )
        ]
        out["weights"] = (
            f"{sum(schemes.values())} linears ({', '.join(f'{n} {s}' for s, n in schemes.items())})"
            f": the checkpoint's int4 codes, group 32, as XNNPACK blockwise int4 (8da4w); "
            + "; ".join(scales)
        )
        out["activations"] = (
            "int8 dynamic, asymmetric, one scale and zero point per row (token), computed by "
            "XNNPACK at run time: scale = (max(x,0) - min(x,0)) / 255; never 16-bit"
        )
        out["accumulation"] = "int32 per 32-block, times the block scale, summed in fp32"
        if stats.get("fused_linears"):
            out["fused"] = (
                f"{stats['fused_linears']} linears that read one input (Q/K/V, gate/up) run as "
                "one int4 linear per input; the same codes, scales and rounding (exact)"
            )
        if stats.get("q4_0_kernel_linears"):
            out["q4_0_kernel"] = (
                f"{stats['q4_0_kernel_linears']} Q4_0 linears run decode, verify and draft "
                f"steps (up to {KERNEL_MAX_ROWS} rows) in edgemtp's kernel "
                "(edgemtp::q4_0_linear, llama.cpp's numerics): the checkpoint's blocks as they "
                "are (codes, signed fp16 scales; no offset pair), the activations rounded to "
                "Q8_0 (per block of 32, d = max|x| / 127), int32 block sums times scale * d, "
                "summed in fp32; the down and per-layer input projections form their input "
                "gelu_tanh(gate) * up in the kernel (edgemtp::q4_0_gated_linear, fp32, exp "
                "within 2 ulp) before rounding it; prompt chunks as 8da4w below"
            )
        if stats["offset_blocks"]:
            out["offsets"] = (
                f"{stats['offset_blocks']} blocks with a negative scale or a zero point other "
                "than 8 are stored as codes' * |scale| + offset (exact); the offset times the "
                "block's activation sum is added in fp32 from the unquantized activations"
            )
        if stats["float_linears"]:
            out["float_linears"] = (
                f"{len(stats['float_linears'])} linears without a 4-bit form stay fp32 "
                f"(e.g. {stats['float_linears'][0]})"
            )
    else:
        out["weights"] = "fp32 (as loaded)"
        out["activations"] = "fp32"
        out["accumulation"] = "fp32"
    if stats.get("attention") == "kernel" and stats["kv_cache"] == "int8":
        out["kv_cache"] = (
            "int8 K/V: each row (token, KV head) head_dim symmetric codes then its float32 "
            "scale (max|x| / 127), written by edgemtp::quantize_kv_rows; every attention (decode, "
            "verify, draft, prefill chunks) in edgemtp's kernel, reading the codes in place "
            "(fp32 math, the scale applied per key; a call's own new keys rounded as they will "
            "be stored)"
        )
    elif stats.get("attention") == "kernel":
        out["kv_cache"] = (
            f"{stats['kv_cache']} K/V; decode, verify and draft attention in edgemtp's kernel "
            "(fp32 math, a call's own new keys rounded as they will be stored), prefill chunks "
            "in XNNPACK's fp32 batched matmuls over the widened slots"
        )
    if stats["head"]:
        out["drafter_head"] = f"clustered head: {stats['head']}"
    out["norms"] = "RMSNorm mean of squares as a 1-output fp32 linear (weights 1/d, bias eps)"
    if stats.get("attention") == "kernel":
        out["norms"] = (
            f"decode, verify and draft steps (up to {KERNEL_MAX_ROWS} rows): the layer norms "
            "and the residual add after each (times the layer scalar after the last) in "
            "edgemtp's kernels (edgemtp::rms_norm, edgemtp::add_rms_norm; fp32, the mean of "
            "squares summed in 16 partial sums); the q/k/v head norms with their RoPE in "
            "edgemtp::head_norm_rope, read from the fused Q/K/V product; prompt chunks' norms "
            "as a 1-output fp32 linear (weights 1/d, bias eps) in XNNPACK"
        )
    out["cache"] = f"{stats.get('kv_cache', 'fp32')} K/V, shared in place by every method"
    return out


def _lower_coreml(
    static: StaticBundle, out_dir: Path, progress: Progress, delegate: str
) -> Lowered:
    """Core ML delegate: each method's supported subgraphs become Core ML models (fp16 compute,
    iOS 18 / macOS 15 target for int4 blockwise weights) inside the .pte; the cache stays an
    ExecuTorch buffer shared by every method (Core ML states are per model, and whether two
    functions may share one can only be checked on Apple hardware)."""
    try:
        import coremltools as ct
        from executorch.backends.apple.coreml.compiler import CoreMLBackend
        from executorch.backends.apple.coreml.partition import CoreMLPartitioner
    except ImportError as e:
        raise EdgeMTPError(
            f"--delegate {delegate} needs coremltools and ExecuTorch's Core ML backend ({e}): "
            "pip install coremltools (or use --delegate cpu)"
        ) from e
    start = time.perf_counter()
    counts = static.use_form(COREML_DELEGATE).get("int4", {})
    programs = _export_all(static, progress)
    io = program_io(programs)
    units = COREML_COMPUTE_UNITS[delegate]
    specs = CoreMLBackend.generate_compile_specs(
        compute_unit=ct.ComputeUnit[units],
        minimum_deployment_target=ct.target.iOS18,
        compute_precision=ct.precision.FLOAT16,
    )

    def partitioners() -> list[Any]:
        inner = CoreMLPartitioner(
            compile_specs=specs,
            take_over_mutable_buffer=False,
            # the cache writes stay ExecuTorch ops on the shared buffer (and coremltools 9
            # cannot convert these index_put patterns)
            skip_ops_for_coreml_delegation=["aten.index_put.default", "aten.index_copy.default"],
        )
        return [static_partitioner(inner)]

    t = time.perf_counter()
    edge = lower_programs(programs, partitioners, progress)
    progress(f"lower {len(programs)} methods to Core ML {units} ({time.perf_counter() - t:.1f}s)")
    summary = delegation_summary(edge, exempt=(CLUSTERED_HEAD,), backend="Core ML")
    size = write_program(edge.to_executorch(backend_config()), out_dir / PROGRAM)
    progress(f"emit {PROGRAM}: {size / 2**20:.1f} MiB ({time.perf_counter() - start:.1f}s)")
    n4 = sum(counts.values())
    numerics = {
        "weights": (
            f"{n4} linears: the checkpoint's int4 codes and zero points as Core ML blockwise "
            "int4 constants (exact); scales stored fp16 by the FLOAT16 precision (exact for "
            "Q4_0, and for bf16 W4A16 scales inside fp16's normal range)"
            if n4
            else "fp32 as loaded, stored fp16 by Core ML"
        ),
        "activations": "fp16 (Core ML compute precision FLOAT16)",
        "accumulation": f"fp16 on {'the GPU' if delegate == 'metal' else 'the Neural Engine'}",
        "cache": "fp32 ExecuTorch buffer shared by every method, cast to fp16 inside Core ML",
        "runs_on": "macOS 15+ / iOS 18+ with ExecuTorch's Core ML backend (not on Linux)",
    }
    return Lowered(
        files=[PROGRAM],
        program=PROGRAM,
        numerics=numerics,
        details={"delegate": f"Core ML {units}", "delegation": summary, "int4_linears": counts},
        method_io=io,
    )


def qnn_sdk() -> Path:
    """The QNN SDK root, or EdgeMTPError: QNN_SDK_ROOT must point at an installed SDK, and
    ExecuTorch's compiled QNN adaptor must import."""
    root = os.environ.get("QNN_SDK_ROOT")
    if not root or not (Path(root) / "lib").is_dir():
        raise EdgeMTPError(QNN_MISSING)
    try:
        import executorch.backends.qualcomm.python.PyQnnManagerAdaptor  # noqa: F401
    except ImportError as e:
        raise EdgeMTPError(QNN_MISSING) from e
    return Path(root)


def _lower_qnn(static: StaticBundle, out_dir: Path, progress: Progress) -> Lowered:
    """QNN HTP in fp16 (the int4 weights are dequantized: QNN's 4-bit weights come from its own
    calibrating quantizer, which would not keep the checkpoint's values). The SoC comes from
    EDGEMTP_QNN_SOC (default SM8650)."""
    qnn_sdk()
    from executorch.backends.qualcomm.utils.utils import (
        generate_htp_compiler_spec,
        generate_qnn_executorch_compiler_spec,
        get_soc_to_chipset_map,
        to_edge_transform_and_lower_to_qnn,
    )

    from edgemtp.export.executorch_program import _TanhGelu

    soc = os.environ.get("EDGEMTP_QNN_SOC", "SM8650")
    chipsets = get_soc_to_chipset_map()
    if soc not in chipsets:
        raise EdgeMTPError(f"EDGEMTP_QNN_SOC={soc} is not a known SoC ({', '.join(chipsets)})")
    specs = generate_qnn_executorch_compiler_spec(
        soc_model=chipsets[soc], backend_options=generate_htp_compiler_spec(use_fp16=True)
    )
    static.use_form(QNN)
    methods = static.methods()
    start = time.perf_counter()
    with torch.no_grad(), _TanhGelu():
        edge = to_edge_transform_and_lower_to_qnn(
            {name: module.requires_grad_(False) for name, (module, _) in methods.items()},
            {name: inputs for name, (_, inputs) in methods.items()},
            specs,
            skip_mutable_buffer=True,  # the cache stays one ExecuTorch buffer for every method
        )
    progress(f"lower {len(methods)} methods to QNN HTP {soc} ({time.perf_counter() - start:.1f}s)")
    write_program(edge.to_executorch(backend_config()), out_dir / PROGRAM)
    return Lowered(
        files=[PROGRAM],
        program=PROGRAM,
        numerics={
            "weights": "fp16 (int4 weights dequantized to fp16)",
            "activations": "fp16",
            "accumulation": "fp16 on the Hexagon HTP",
            "cache": "fp32 ExecuTorch buffer shared by every method",
        },
        details={
            "delegate": f"QNN HTP {soc}",
            "delegation": delegation_summary(edge, exempt=(CLUSTERED_HEAD,), backend="QNN"),
        },
        method_io={},
    )
