"""One static method as an ONNX graph (`trace_method` -> `MethodGraph`), its cache as I/O.

ONNX has no mutable state, so the cache lives on the host: one preallocated array per cache
buffer of `StaticCache` (`k{i}`/`v{i}` `[kv_heads, slots + 1, head_dim]`, `pos_{kind}`
`[slots + 1]`), wrapped once in an `OrtValue` and bound by `IOBinding` as an input of every
method that reads it: the target and the drafter read the same memory, nothing is copied between
calls. The in-graph writes of `StaticCache.write` become graph outputs: the new K/V rows
`[kv_heads, T, head_dim]`, the slot of each row (`slots.{n}`: position % ring, pad rows -> the
trash slot) and the new slot-position vector, all computed by the graph with `StaticCache`'s
own code, so rollback, the ring and the trash slot behave exactly as in the eager wrappers. The
runner writes the rows into its arrays after the call (`k[:, slots] = rows`, O(rows)).

The alternative, binding one OrtValue as both the cache input and a `ScatterElements` output,
was measured and rejected: it is slower (benchmarks/README.md, ONNX section) and nothing orders
the in-place scatter after the graph's own reads of the old buffer, so a prefill chunk longer
than `ring - window` could overwrite sliding entries its attention still reads.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
from onnx import TensorProto
from torch import nn

from edgemtp.export.memory import zero_weight
from edgemtp.export.onnx.graph import ONNX_TYPE, Graph
from edgemtp.export.onnx.int4 import (
    INT8_ACCURACY_LEVEL,
    LinearForm,
    Packs,
    linear_nbits,
    linear_qdq,
)
from edgemtp.export.onnx.trace import Mutation, Tracer, Weight
from edgemtp.model.checkpoint import StoredLinear
from edgemtp.model.static import StaticBundle, method_io


def _cache_names(static: StaticBundle) -> dict[int, str]:
    """Buffer id -> graph input name, for every buffer of the shared cache."""
    return {id(buf): f"cache.{name}" for name, buf in static.cache.named_buffers()}


def _weights_of(module: nn.Module, cache: dict[int, str]) -> dict[int, Weight]:
    """Every parameter and buffer of `module` but the cache's, by id, named by its qualified
    name without the method's "owner." (the same name in every method). A linear whose float
    weight is not held (`StoredLinear`) gets a zero stand-in: the graph takes its 4-bit form
    (`int4_of`), and the values the trace computes with it are never read."""
    out = {}
    for mod_name, mod in module.named_modules():
        named = [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]
        if isinstance(mod, StoredLinear):
            if mod.stand_in is None:
                mod.stand_in = zero_weight(mod.out_features, mod.in_features)
            named.append(("weight", mod.stand_in))
        for attr, t in named:
            if id(t) in cache or id(t) in out:
                continue
            name = f"{mod_name}.{attr}" if mod_name else attr
            out[id(t)] = Weight(name.removeprefix("owner."), t, mod)
    return out


@contextmanager
def _scopes(module: nn.Module, graph: Graph) -> Iterator[None]:
    """Keep `graph.scope` = the path of the innermost module running (for `Graph.keys`)."""
    stack: list[str] = []
    calls: Counter[str] = Counter()

    def enter(path: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            calls[path] += 1  # a module called twice in one method gets two scopes
            stack.append(f"{path}#{calls[path]}")
            graph.scope = stack[-1]

        return hook

    def leave(*_: Any) -> None:
        stack.pop()
        graph.scope = stack[-1] if stack else ""

    handles = []
    for path, sub in module.named_modules():
        name = path.removeprefix("owner.").removeprefix("owner")
        handles.append(sub.register_forward_pre_hook(enter(name)))
        handles.append(sub.register_forward_hook(leave))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        graph.scope = ""


@dataclass
class MethodGraph:
    name: str
    graph: Graph
    inputs: list[str]  # logical inputs, in call order
    outputs: list[str]  # logical outputs, in return order
    cache_inputs: list[str]
    updates: list[dict[str, str]]  # cache writes, as the runner applies them
    seconds: float = 0.0


def trace_method(
    static: StaticBundle,
    name: str,
    weights: Literal["nbits", "nbits_int8", "qdq"],
    packs: Packs | None = None,
) -> MethodGraph:
    """Run one method eagerly under the tracer; the cache is restored afterwards. `packs`
    shares the 4-bit weight forms between the methods of one lowering. `weights`: MatMulNBits
    with fp32 activations ("nbits") or int8 ones ("nbits_int8"), or Q/DQ pairs ("qdq")."""
    module, example = static.methods()[name]
    inputs, outputs = method_io(name)
    cache = _cache_names(static)
    saved = {n: b.clone() for n, b in static.cache.named_buffers()}
    graph = Graph(name)
    int4_linear: LinearForm = {
        "nbits": linear_nbits,
        "nbits_int8": partial(linear_nbits, accuracy_level=INT8_ACCURACY_LEVEL),
        "qdq": linear_qdq,
    }[weights]
    tracer = Tracer(
        graph, _weights_of(module, cache), cache, int4_linear, {} if packs is None else packs
    )
    start = time.perf_counter()
    args = [t.clone() for t in example]
    try:
        with torch.no_grad(), _scopes(module, graph), tracer:
            for input_name, t in zip(inputs, args, strict=True):
                tracer.input(input_name, t)
            result = module(*args)
    finally:
        for n, b in static.cache.named_buffers():
            b.copy_(saved[n])
    results = result if isinstance(result, tuple) else (result,)
    for out_name, t in zip(outputs, results, strict=True):
        source = tracer.operand(t)  # a constant output (e.g. ids of a dense head) is fine too
        graph.node("Identity", [source], [out_name])
        graph.typed(out_name, ONNX_TYPE[t.dtype], t.shape)
        graph.outputs.append(out_name)
    updates = _cache_outputs(graph, tracer.mutations)
    graph.prune(keep=set(inputs))  # logical inputs stay, even unread (token_ple)
    cache_inputs = [i for i in graph.inputs if i.startswith("cache.")]
    return MethodGraph(
        name,
        graph,
        list(inputs),
        list(outputs),
        cache_inputs,
        updates,
        time.perf_counter() - start,
    )


def _cache_outputs(graph: Graph, mutations: list[Mutation]) -> list[dict[str, str]]:
    """Graph outputs for the cache writes, and how the runner applies each: "copy" a whole
    (small) slot-position vector, or write "rows" at "slots"."""
    updates: list[dict[str, str]] = []
    slots: dict[str, str] = {}
    for m in mutations:
        buf = m.buffer.removeprefix("cache.")
        elem, shape = graph.types[m.buffer]
        if m.index is None:
            out = f"new.{buf}"
            graph.node("Identity", [m.source], [out])
            graph.typed(out, elem, shape)
            graph.outputs.append(out)
            updates.append({"kind": "copy", "cache": m.buffer, "output": out})
            continue
        rows_shape = graph.types[m.source][1]
        if m.index not in slots:  # one slot vector per attention kind
            slots[m.index] = f"slots.{len(slots)}"
            graph.node("Identity", [m.index], [slots[m.index]])
            graph.typed(slots[m.index], TensorProto.INT64, (rows_shape[1],))
            graph.outputs.append(slots[m.index])
        out = f"rows.{buf}"
        graph.node("Identity", [m.source], [out])
        graph.typed(out, elem, rows_shape)
        graph.outputs.append(out)
        updates.append({"kind": "rows", "cache": m.buffer, "output": out, "slots": slots[m.index]})
    return updates
