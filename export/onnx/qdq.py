"""Activation Q/DQ for the htp delegate (ONNX Runtime's QNN EP): calibration and insertion.

Every op that computes a float activation, and every float graph input, gets a uint16
asymmetric per-tensor QuantizeLinear -> DequantizeLinear pair (`insert_activation_qdq`). The
ranges come from running the float-activation graphs (the same int4 DequantizeLinear weights) on
the CPU EP over greedy decoding, AR and every draft depth (`calibrate`), pooled per activation
across the methods (`range_keys`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper
from torch import Tensor

from edgemtp.export.onnx.folder import write_methods
from edgemtp.export.onnx.graph import Graph
from edgemtp.export.onnx.method import MethodGraph
from edgemtp.model.static import StaticBundle
from edgemtp.model.tables import TokenTables
from edgemtp.runtime.backends import StaticBackend
from edgemtp.runtime.runners.onnx import OnnxRunner, range_union

QUANT_MAX = 65535  # uint16 activations

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


def range_keys(m: MethodGraph) -> dict[str, str]:
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
    DequantizeLinear weights), pooled by `range_keys` across methods."""
    from edgemtp.runtime.generate import FixedDepth, decode

    shapes = static.shapes
    observe = {m.name: _activations(m.graph)[0] for m in methods}
    for m in methods:
        m.graph.outputs += observe[m.name]
    try:
        write_methods(methods, folder, "cpu", {})
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
        for depth in shapes.verify_depths:
            backend.truncate(0)
            decode(backend, prompt, budget, policy=FixedDepth(depth))
    finally:
        for m in methods:
            m.graph.outputs = m.graph.outputs[: len(m.graph.outputs) - len(observe[m.name])]
    ranges: dict[str, tuple[float, float]] = {}
    for m in methods:
        keys = range_keys(m)
        for value, seen in runner.ranges.get(m.name, {}).items():
            key = keys.get(value, value)
            ranges[key] = range_union(ranges.get(key), seen)
    return ranges
