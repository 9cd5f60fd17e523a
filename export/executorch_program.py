"""`torch.export` the static methods and lower them to one multi-method ExecuTorch program.

Every method is exported from a module that holds the one shared `StaticCache` under the same
name, so the cache buffers have the same fully qualified names in every method and ExecuTorch
gives them one allocation (`MemoryPlanningPass(share_mutable_buffers=True)`), the drafter's
included (the buffers are mutable in another method). `InitializedMutableBufferPass` stores
their initial values (positions -1, K/V zero); `run_reinplace_pass` makes the cache writes
(`index_put`) in place.

ExecuTorch re-traces the whole graph through fake tensors in nearly every pass, so lowering
time is nodes times passes. This module cuts both: a partition holding none of the patterns
XNNPACK's other preprocessing passes rewrite gets its linear pass only (`dqlinear_partitioner`;
the program is byte-identical), the partitioner selects the single-decomposition path, GELU is
decomposed while tracing (`_TanhGelu`), dtype asserts are dropped, and provenance chains (which
every pass deep-copies) are collapsed to their origin between stages.
"""

from __future__ import annotations

import copy
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import ExportedProgram
from torch.overrides import TorchFunctionMode

from edgemtp.errors import EdgeMTPError
from edgemtp.export.memory import release_spilled, spill_data

CACHE_BUFFER_PATTERN = "kvcache_"  # placeholder names of the cache buffers contain this
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU from delegated ops. XNNPACK's GELU ignores `approximate="tanh"` and computes the
    erf form (1e-3 off in Gemma's MLPs), so the tanh form is spelled out, as
    0.5 (1 + tanh z) = sigmoid(2z): six operators where the textbook form takes nine."""
    if approximate == "tanh":
        z2 = x * (2 * _SQRT_2_OVER_PI + (2 * _SQRT_2_OVER_PI * 0.044715) * (x * x))
        return x * torch.sigmoid(z2)
    return 0.5 * x * (1.0 + torch.erf(x * (1.0 / math.sqrt(2.0))))


class _TanhGelu(TorchFunctionMode):
    """Traces `F.gelu` as `_gelu`, so no second decomposition pass is needed."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func is F.gelu:
            return _gelu(*args, **kwargs)
        return func(*args, **kwargs)


def collapse_provenance(gm: torch.fx.GraphModule) -> None:
    """Keep only the origin of every node's `from_node` chain (what ExecuTorch's debug handles
    read): each pass deep-copies the whole chain, so chains make later passes slower."""
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            chain = node.meta.get("from_node")
            if not chain:
                continue
            origin = chain[-1]
            while origin.from_node:
                origin = origin.from_node[-1]
            node.meta["from_node"] = [origin]


def drop_asserts(program: ExportedProgram) -> ExportedProgram:
    """Remove `_assert_tensor_metadata` nodes (dtype checks of `.float()`/`type_as`; edge
    lowering removes them later anyway, after re-tracing them a few times)."""
    graph = program.graph_module.graph
    for node in list(graph.nodes):
        if (
            node.op == "call_function"
            and node.target is torch.ops.aten._assert_tensor_metadata.default
        ):
            graph.erase_node(node)
    program.graph_module.recompile()
    return program


def export_method(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> ExportedProgram:
    """`torch.export` one method (static shapes) under `no_grad`, GELU decomposed."""
    with torch.no_grad(), _TanhGelu():
        module.requires_grad_(False)
        program = torch.export.export(module, inputs, strict=False)
    drop_asserts(program)
    collapse_provenance(program.graph_module)
    return program


# Edge ops (by name) that one of XNNPACK's preprocessing passes other than ConvertToLinearPass
# rewrites: NHWC tagging (pooling, mean.dim, convolutions, pads, PReLU), batch-norm fusion,
# upsampling, clone/dim-order removal, activation fusion (getitem removal is for max pooling).
_NEEDS_XNNPACK_PASSES = (
    "convolution",
    "mean.dim",
    "avg_pool",
    "max_pool",
    "batch_norm",
    "upsample",
    "constant_pad",
    "prelu",
    "clone",
    "dim_order",
    "_to_copy",
    "hardtanh",
    "relu",
    "clamp",
)
_MAX_XNNPACK_CAT_INPUTS = 4
LINEAR_PASSES_ONLY = (
    "dqlinear_partitioner"  # XnnpackBackend.preprocess: run ConvertToLinearPass only
)


def _xnnpack_passes_needed(nodes: list[torch.fx.Node]) -> str | None:
    """Why a partition needs XNNPACK's full preprocessing pipeline, or None."""
    for n in nodes:
        if n.op != "call_function":
            continue
        name = str(getattr(n.target, "__name__", n.target))
        if any(op in name for op in _NEEDS_XNNPACK_PASSES):
            return name
        if name.startswith("aten.cat") and len(n.args[0]) > _MAX_XNNPACK_CAT_INPUTS:  # type: ignore[arg-type]
            return f"{name} of {len(n.args[0])} tensors"  # type: ignore[arg-type]
    return None


def remove_identity_clones(gm: torch.fx.GraphModule) -> int:
    """Drop clones that keep the memory format and neither read a graph input nor feed the
    output (what XNNPACK's clone-removal pass does inside each delegate, done once here so the
    delegates need no generic preprocessing). Returns how many were removed."""
    removed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or "clone" not in str(node.target):
            continue
        source = node.args[0]
        if node.kwargs.get("memory_format") not in (None, torch.contiguous_format):
            continue
        order = node.kwargs.get("dim_order")
        if order is not None and list(order) != list(range(len(order))):
            continue
        if not isinstance(source, torch.fx.Node) or source.op == "placeholder":
            continue
        if any(user.op == "output" for user in node.users):
            continue
        node.replace_all_uses_with(source)
        gm.graph.erase_node(node)
        removed += 1
    if removed:
        gm.recompile()
    return removed


def _remove_identity_clones_pass(gm: torch.fx.GraphModule) -> Any:
    from torch.fx.passes.infra.pass_base import PassResult

    return PassResult(gm, remove_identity_clones(gm) > 0)


def _supported(check: Callable[[torch.fx.Node], bool], node: torch.fx.Node) -> bool:
    try:
        return bool(check(node))
    except Exception:  # a partitioner's check failing on a node means it cannot take it
        return False


def static_partitioner(inner: Any, linear_passes_only: bool = False) -> Any:
    """`inner` (a partitioner) adapted to the static programs: keeps the cache buffers outside
    the delegates, selects the single-decomposition path, collapses provenance and, for
    XNNPACK (`linear_passes_only`), asks for linear-only preprocessing of the partitions that
    allow it (see the module docstring).

    A buffer no op of a method mutates, whose users are all delegated, is frozen into the
    delegate as constant data (`tag_constant_data`): the drafter, which only reads the cache,
    would read a frozen (uninitialised) copy. Untagging the cache placeholders keeps them in the
    shared memory-planned arena.
    """
    from executorch.exir.backend.compile_spec_schema import CompileSpec
    from executorch.exir.backend.partitioner import (
        DelegationSpec,
        Partitioner,
        PartitionResult,
    )

    class StaticPartitioner(Partitioner):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner
            self.full_pipeline: dict[str, str] = {}  # tag -> why it needs all XNNPACK passes

        def ops_to_not_decompose(self, ep: ExportedProgram) -> Any:
            ops, check = self.inner.ops_to_not_decompose(ep)
            if check is None:
                return ops, None
            keep = []
            for op in ops:
                users = [n for n in ep.graph.nodes if n.op == "call_function" and n.target == op]
                if all(_supported(check, n) for n in users):
                    keep.append(op)
            return keep, None

        def partition(self, ep: ExportedProgram) -> PartitionResult:
            collapse_provenance(ep.graph_module)
            result = self.inner.partition(ep)
            graph = result.tagged_exported_program.graph
            for node in graph.nodes:
                if node.op == "placeholder" and CACHE_BUFFER_PATTERN in node.name:
                    node.meta.pop("delegation_tag", None)
            if not linear_passes_only:
                return result
            members: dict[str, list[torch.fx.Node]] = {}
            for node in graph.nodes:
                tag = node.meta.get("delegation_tag")
                if tag is not None:
                    members.setdefault(tag, []).append(node)
            tags = {}
            for tag, spec in result.partition_tags.items():
                why = _xnnpack_passes_needed(members.get(tag, []))
                if why is None:
                    specs = [*spec.compile_specs, CompileSpec(LINEAR_PASSES_ONLY, b"")]
                    spec = DelegationSpec(spec.backend_id, specs)
                else:
                    self.full_pipeline[tag] = why
                tags[tag] = spec
            return PartitionResult(result.tagged_exported_program, tags)

    return StaticPartitioner()


class BitsetDependencies:
    """What ExecuTorch's group partitioner asks of its dependency viewer (every node's
    transitive users), held as one bit set per node. The viewer it ships keeps a Python set of
    nodes per node, upstream and downstream: quadratic in the graph's size, several GiB for a
    full-size prompt-chunk graph of ~10k nodes (n^2 / 8 bytes here: ~12 MiB)."""

    replaced: type | None = None  # ExecuTorch's class, once `xnnpack_partitioner` put this in

    def __init__(self, graph_module: torch.fx.GraphModule):
        self.nodes = list(graph_module.graph.nodes)
        self.index = {node: i for i, node in enumerate(self.nodes)}
        self.below: list[int] = [0] * len(self.nodes)
        for i in range(len(self.nodes) - 1, -1, -1):
            bits = 0
            for user in self.nodes[i].users:
                j = self.index[user]
                bits |= self.below[j] | (1 << j)
            self.below[i] = bits

    def downstreams_of(self, node: torch.fx.Node) -> set[torch.fx.Node]:
        bits = self.below[self.index[node]]
        raw = np.frombuffer(bits.to_bytes((len(self.nodes) + 7) // 8, "little"), np.uint8)
        return {self.nodes[i] for i in np.flatnonzero(np.unpackbits(raw, bitorder="little"))}

    def upstreams_of(self, node: torch.fx.Node) -> set[torch.fx.Node]:
        bit = 1 << self.index[node]
        return {n for n, below in zip(self.nodes, self.below, strict=True) if below & bit}


def copy_sharing_constants(cls: type, program: ExportedProgram, specs: list[Any]) -> Any:
    """An isolated copy of a partition's program for XNNPACK's preprocessing, its graph copied
    and its constant tensors shared: ExecuTorch deep-copies every partition of a method at once
    before preprocessing any, so a whole-model method held a second copy of all its weights
    (GiBs at full size). XNNPACK reads the constants and writes its packed copies elsewhere."""
    shared = [*program.state_dict.values(), *program.constants.values()]
    return copy.deepcopy(program, {id(t): t for t in shared if isinstance(t, torch.Tensor)})


def preprocess_releasing(cls: type, program: ExportedProgram, specs: list[Any]) -> Any:
    """XNNPACK's preprocessing of one partition, then its packed weights spilled and the
    spilled weights it read released: the partitions of a whole-model method together read
    and pack all of its weights."""
    result = preprocess_releasing.original(program, specs)  # type: ignore[attr-defined]
    named = result.data_store_output
    if named is not None:  # the packed weights wait for the emit in files, if spilling
        named.buffers = [spill_data(b) for b in named.buffers]
    release_spilled()
    return result


def xnnpack_partitioner() -> Any:
    """XNNPACK's partitioner for the static programs (`static_partitioner`), its group
    partitioner's dependency viewer replaced by `BitsetDependencies` (same answers), its
    partitions copied for preprocessing with their constants shared (`copy_sharing_constants`)
    and spilled weights released after each (`preprocess_releasing`)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend
    from executorch.exir.backend.canonical_partitioners import group_partitioner

    XnnpackBackend.copy_exported_program_for_preprocess = classmethod(copy_sharing_constants)
    if not hasattr(preprocess_releasing, "original"):
        preprocess_releasing.original = XnnpackBackend.preprocess  # type: ignore[attr-defined]
        XnnpackBackend.preprocess = classmethod(preprocess_releasing)

    viewer = group_partitioner._DependencyViewer  # type: ignore[attr-defined]
    if viewer is not BitsetDependencies:
        BitsetDependencies.replaced = viewer
        group_partitioner._DependencyViewer = BitsetDependencies  # type: ignore[attr-defined]
    return static_partitioner(XnnpackPartitioner(), linear_passes_only=True)


def backend_config() -> Any:
    """The `to_executorch` configuration every multi-method program here uses."""
    from executorch.exir import ExecutorchBackendConfig
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass

    return ExecutorchBackendConfig(
        passes=[InitializedMutableBufferPass([CACHE_BUFFER_PATTERN])],
        memory_planning_pass=MemoryPlanningPass(
            alloc_graph_input=False, share_mutable_buffers=True
        ),
        emit_mutable_buffer_names=True,
        run_reinplace_pass=True,
    )


def lower_programs(
    programs: dict[str, ExportedProgram],
    partitioners: Callable[[], list[Any]] | None,
    progress: Callable[[str], None] = lambda _: None,
) -> Any:
    """`to_edge_transform_and_lower` method by method (one fresh partitioner list each, a
    progress line each), gathered into one EdgeProgramManager (delegates inside) so that
    `to_executorch` plans the shared cache across all methods."""
    from executorch.exir import EdgeCompileConfig, EdgeProgramManager, to_edge_transform_and_lower

    config = EdgeCompileConfig(_check_ir_validity=False)
    lowered = {}
    tensors: dict[str, torch.Tensor] = {}  # name -> the one copy every method shares
    for program in programs.values():
        for table in (program.state_dict, program.constants):
            tensors.update((k, v) for k, v in table.items() if isinstance(v, torch.Tensor))
    data: dict[str, Any] = {}
    for i, (name, program) in enumerate(programs.items()):
        start = time.perf_counter()
        edge = to_edge_transform_and_lower(
            {name: program},
            transform_passes=[_remove_identity_clones_pass],
            partitioner={name: partitioners()} if partitioners else None,
            compile_config=config,
        )
        gm = edge.exported_program(name).graph_module
        collapse_provenance(gm)
        writes_after_reads(gm)
        for module in gm.modules():
            specs = getattr(module, "_compile_specs", None)
            if specs:  # the marker did its job in preprocessing; the program need not carry it
                module._compile_specs = [s for s in specs if s.key != LINEAR_PASSES_ONLY]
        lowered[name] = edge.exported_program(name)
        share_delegated_weights(gm, tensors, data)
        release_spilled()  # a lowering's temporaries and read weights: resident otherwise
        progress(
            f"lower {name} ({i + 1}/{len(programs)}): {len(gm.graph.nodes)} nodes "
            f"({time.perf_counter() - start:.1f}s)"
        )
    return EdgeProgramManager(lowered, compile_config=config)


def writes_after_reads(gm: torch.fx.GraphModule) -> int:
    """Move every cache write (`index_put` on a buffer placeholder) after the last other reader
    of that buffer. Lowering re-sorts the graph, and a write that does not depend on a read of
    the old cache (an attention kernel outside the delegates) can land before it; then
    `run_reinplace_pass` must leave it functional, and every call copies the whole cache twice
    (the `index_put` into a temporary, the write-back).
    A write only feeds the buffer's write-back at the graph's end, so moving it later keeps
    the graph valid. Returns how many writes moved."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    moved = 0
    for node in list(gm.graph.nodes):
        target = getattr(node.target, "_op", node.target)
        if target is not torch.ops.aten.index_put.default or node.args[0].op != "placeholder":
            continue
        readers = [user for user in node.args[0].users if user is not node]
        last = max(readers, key=order.__getitem__, default=None)
        if last is not None and order[last] > order[node]:
            last.append(node)
            moved += 1
    if moved:
        gm.graph.lint()
        gm.recompile()
    return moved


def share_delegated_weights(
    gm: torch.fx.GraphModule, tensors: dict[str, torch.Tensor], data: dict[str, Any]
) -> None:
    """Keep one copy of each weight across the lowered methods, for memory. A delegate keeps
    its partition's own copy of the weights it consumed (`original_module`, re-traced later on
    fake tensors) besides the packed form in its named data; every method that uses a weight
    would hold another copy of both. Here a copied tensor equal to the one already known under
    the same name (the model's own, or an earlier method's) is replaced by it, and packed data
    under a content-hash key another method already holds is shared. Full-size E2B has ~2.3 GB
    of int4 codes held as int8, used by four target methods."""
    for module in gm.modules():
        original = getattr(module, "_original_exported_program", None)
        if original is None:
            continue
        for table in (original.state_dict, original.constants):
            for key, value in table.items():
                if not isinstance(value, torch.Tensor):
                    continue
                known = tensors.setdefault(key, value)
                if known is value or not _same_tensor(known, value):
                    continue
                parameter = isinstance(value, nn.Parameter)
                table[key] = nn.Parameter(known, requires_grad=False) if parameter else known
        named = getattr(module, "_named_data_store_output", None)
        if named is not None:
            for key, entry in named.pte_data.items():
                index = entry.buffer_index
                named.buffers[index] = data.setdefault(key, named.buffers[index])


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and a.stride() == b.stride()
        and bool(torch.equal(a, b))
    )


# Edge ops of a linear layer (fp32 or quantized): outside a delegate they would run on portable
# kernels. Matrix products may only stay outside inside an exempt module (a gather's product).
_LINEAR_OPS = ("linear", "addmm", "quantize_affine", "choose_qparams", "quantize_per_")
_MATMUL_OPS = (".mm.", ".mv.", "matmul")


def delegation_summary(
    edge: Any, exempt: tuple[str, ...] = (), backend: str = "XNNPACK"
) -> dict[str, Any]:
    """Per method: delegated partitions and nodes (and the elements their nodes other than
    matmuls write, and the FLOPs of their float linears), and the ops left to portable kernels
    (and the elements they write per call, by op); the simulator prices them all.

    Raises EdgeMTPError naming the op when a linear (fp32 or quantized) stayed outside the
    delegates, or a matrix product outside a module path containing one of `exempt`."""
    from executorch.devtools.backend_debug import get_delegation_info

    summary: dict[str, Any] = {}
    for name in edge.methods:
        gm = edge.exported_program(name).graph_module
        info = get_delegation_info(gm)
        portable: Counter = Counter()
        elements: Counter = Counter()
        delegated = float_flops = 0
        for node in gm.graph.nodes:
            if node.op == "call_function" and "executorch_call_delegate" in str(node.target):
                lowered = getattr(gm, node.args[0].target)
                delegated += _delegated_elements(lowered)
                float_flops += _float_linear_flops(lowered)
                continue
            if node.op != "call_function":
                continue
            op = str(getattr(node.target, "__name__", node.target))
            if op == "getitem":
                continue
            portable[op] += 1
            elements[op] += _output_elements(node)
            stack = " ".join(p for p, _ in (node.meta.get("nn_module_stack") or {}).values())
            # (edgemtp's own kernels run outside the delegates by design: runtime/kernels)
            linear = any(w in op for w in _LINEAR_OPS) and not op.startswith("edgemtp.")
            matmul = any(w in f".{op}." for w in _MATMUL_OPS)
            if linear or (matmul and not any(e in stack for e in exempt)):
                raise EdgeMTPError(
                    f"method {name}: {op} ({node.name}, from {stack or 'the graph'}) was not "
                    f"delegated to {backend}; it would run on slow portable kernels"
                )
        summary[name] = {
            "delegates": info.num_delegated_subgraphs,
            "delegated_nodes": info.num_delegated_nodes,
            "portable_nodes": info.num_non_delegated_nodes,
            "portable_ops": dict(sorted(portable.items())),
            "portable_elements": sum(elements.values()),
            "portable_elements_by_op": dict(sorted(elements.items())),
            "delegated_elements": delegated,
            "float_linear_flops": float_flops,
        }
    return summary


def _delegated_elements(lowered: Any) -> int:
    """Elements a delegate's nodes other than matmuls and linears (with their activation
    quantization) write per call: norms, activations, adds, masks, softmax, reshapes, copies."""
    skip = (*_LINEAR_OPS, *_MATMUL_OPS, "bmm", "dequantize", "getitem")
    return sum(
        _output_elements(node)
        for node in lowered.original_module.graph.nodes
        if node.op == "call_function"
        and not any(s in f".{getattr(node.target, '__name__', node.target)}." for s in skip)
    )


def _float_linear_flops(lowered: Any) -> int:
    """FLOPs per call of a delegate's linears whose weight is a float constant, not a
    dequantized int4 one: the Q4_0 offset pairs, the norms' means, linears kept in fp32."""
    total = 0
    for node in lowered.original_module.graph.nodes:
        if node.op != "call_function" or "linear" not in str(node.target):
            continue
        weight = node.args[1]
        if "dequantize" in str(getattr(weight, "target", "")):
            continue
        total += 2 * _output_elements(node) * int(node.args[0].meta["val"].shape[-1])
    return total


def _output_elements(node: Any) -> int:
    """Elements a graph node writes (what a portable kernel loops over), from its traced value;
    an index_put (a cache write, done in place in the program) writes its values only."""
    if "index_put" in str(node.target) and len(node.args) > 2:
        node = node.args[2]
    values = node.meta.get("val")
    values = values if isinstance(values, list | tuple) else [values]
    return sum(int(v.numel()) for v in values if isinstance(v, torch.Tensor))
