"""`torch.export` the static methods and lower them to one ExecuTorch program (XNNPACK, fp32).

Every method is exported from a module that holds the one shared `StaticCache` under the same
name, so the cache buffers have the same fully qualified names in every method. ExecuTorch then
gives them one allocation (`MemoryPlanningPass(share_mutable_buffers=True)`); a method that only
reads them (the drafter) gets the same allocation because the buffers are mutable in another
method. `InitializedMutableBufferPass` stores their initial values (positions -1, K/V zero) in
the program; `run_reinplace_pass` turns the cache writes (`index_put`) into in-place writes.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.export import ExportedProgram

from edgemtp.export.static import StaticBundle

CACHE_BUFFER_PATTERN = "kvcache_"  # placeholder names of the cache buffers contain this
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU from delegated ops. XNNPACK's GELU ignores `approximate="tanh"` and computes the
    erf form (1e-3 off in Gemma's MLPs), so the tanh form is spelled out."""
    if approximate == "tanh":
        inner = _SQRT_2_OVER_PI * (x + 0.044715 * (x * x * x))
        return 0.5 * x * (1.0 + torch.tanh(inner))
    return 0.5 * x * (1.0 + torch.erf(x * (1.0 / math.sqrt(2.0))))


def decompose_gelu(program: ExportedProgram) -> ExportedProgram:
    return program.run_decompositions({torch.ops.aten.gelu.default: _gelu})


def export_methods(
    bundle: StaticBundle, only: tuple[str, ...] | None = None, debug: bool = False
) -> dict[str, ExportedProgram]:
    """`torch.export` every method (static shapes) under `no_grad`."""
    programs = {}
    with torch.no_grad():
        for name, (module, inputs) in bundle.methods(debug).items():
            if only is not None and name not in only:
                continue
            module.requires_grad_(False)
            programs[name] = decompose_gelu(torch.export.export(module, inputs, strict=False))
    return programs


def layer_of(node: torch.fx.Node, prefix: str = "owner.target.layers.") -> int | None:
    """The target layer a node was traced from (from its module stack), if any."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in stack.values():
        if path.startswith(prefix):
            return int(path[len(prefix) :].split(".")[0])
    return None


def ops_per_layer(program: ExportedProgram, ops: tuple[str, ...] = ("linear", "matmul")) -> Counter:
    """Count nodes whose target name contains one of `ops`, per target layer."""
    counts: Counter = Counter()
    for node in program.graph.nodes:
        if node.op == "call_function" and any(op in str(node.target) for op in ops):
            layer = layer_of(node)
            if layer is not None:
                counts[layer] += 1
    return counts


def keep_cache_outside(partitioner: Any) -> Any:
    """Wrap a partitioner so the cache buffers stay method inputs of the delegates.

    A buffer no op of a method mutates, whose users are all delegated, is frozen into the
    delegate as constant data (`tag_constant_data`): the drafter, which only reads the cache,
    would read a frozen (uninitialised) copy. Untagging the cache placeholders keeps them in the
    shared memory-planned arena.
    """
    from executorch.exir.backend.partitioner import Partitioner, PartitionResult

    class KeepCacheOutside(Partitioner):
        def __init__(self) -> None:
            super().__init__()
            self.inner = partitioner

        def ops_to_not_decompose(self, ep: ExportedProgram) -> Any:
            return self.inner.ops_to_not_decompose(ep)

        def partition(self, ep: ExportedProgram) -> PartitionResult:
            result = self.inner.partition(ep)
            for node in result.tagged_exported_program.graph.nodes:
                if node.op == "placeholder" and CACHE_BUFFER_PATTERN in node.name:
                    node.meta.pop("delegation_tag", None)
            return result

    return KeepCacheOutside()


def lower_to_executorch(programs: dict[str, ExportedProgram], xnnpack: bool = True) -> bytes:
    """One multi-method .pte (fp32) whose methods share the cache buffers."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import (
        EdgeCompileConfig,
        ExecutorchBackendConfig,
        to_edge_transform_and_lower,
    )
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass

    partitioner = (
        {name: [keep_cache_outside(XnnpackPartitioner())] for name in programs} if xnnpack else None
    )
    edge = to_edge_transform_and_lower(
        programs,
        partitioner=partitioner,
        compile_config=EdgeCompileConfig(_check_ir_validity=False),
    )
    et = edge.to_executorch(
        ExecutorchBackendConfig(
            passes=[InitializedMutableBufferPass([CACHE_BUFFER_PATTERN])],
            memory_planning_pass=MemoryPlanningPass(
                alloc_graph_input=False, share_mutable_buffers=True
            ),
            emit_mutable_buffer_names=True,
            run_reinplace_pass=True,
        )
    )
    return et.buffer


def export_bundle(bundle: StaticBundle, path: Path, xnnpack: bool = True) -> Path:
    """Export and lower every method of `bundle` into one .pte at `path`."""
    for module in (bundle.target, bundle.drafter):
        if isinstance(module, nn.Module):
            module.eval().requires_grad_(False)
    data = lower_to_executorch(export_methods(bundle), xnnpack=xnnpack)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path
