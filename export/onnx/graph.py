"""The ONNX graph under construction (`Graph`) and the `weights.bin` its methods share.

A graph holds nodes, named values with their types and initializers; `Graph.model` makes the
ModelProto. Weights are stored once: every method's `.onnx` file references one `weights.bin`
(ONNX external data: location, offset, length), deduplicated by initializer name, which is the
parameter's qualified name and therefore the same in every method (`WeightFile`).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

OPSET = 21  # blockwise int4 DequantizeLinear, uint16 Q/DQ, Gelu(approximate)
MS_DOMAIN = "com.microsoft"
WEIGHTS = "weights.bin"
ALIGN = 64  # byte alignment of every tensor in weights.bin
INLINE_BYTES = 1024  # smaller initializers (shapes, scalars, Q/DQ params) stay in the .onnx

ONNX_TYPE = {
    torch.float32: TensorProto.FLOAT,
    torch.float16: TensorProto.FLOAT16,
    torch.int64: TensorProto.INT64,
    torch.int32: TensorProto.INT32,
    torch.bool: TensorProto.BOOL,
    torch.uint8: TensorProto.UINT8,
    torch.int8: TensorProto.INT8,
}
_NP_OF_ONNX = {
    TensorProto.FLOAT: np.float32,
    TensorProto.FLOAT16: np.float16,
    TensorProto.INT64: np.int64,
    TensorProto.INT32: np.int32,
    TensorProto.BOOL: np.bool_,
    TensorProto.UINT8: np.uint8,
    TensorProto.INT8: np.int8,
    TensorProto.UINT16: np.uint16,
}
_ONNX_OF_NP = {np.dtype(v): k for k, v in _NP_OF_ONNX.items()}


@dataclass
class Packed:
    """An initializer whose bytes are not a numpy array's (4-bit ONNX types)."""

    elem_type: int
    dims: tuple[int, ...]
    raw: bytes


def _raw(value: np.ndarray | Packed) -> tuple[int, tuple[int, ...], bytes]:
    if isinstance(value, Packed):
        return value.elem_type, value.dims, value.raw
    arr = np.asarray(value)  # (not ascontiguousarray: it turns 0-d arrays into 1-d)
    return _ONNX_OF_NP[arr.dtype], tuple(arr.shape), arr.tobytes(order="C")


def dtype_name(elem: int) -> str:
    """The numpy name of an ONNX element type ("float32", "int64", ...)."""
    return np.dtype(_NP_OF_ONNX[elem]).name


class Graph:
    """One ONNX graph under construction: nodes, named values with their types, initializers."""

    def __init__(self, name: str):
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.tensors: dict[str, np.ndarray | Packed] = {}
        self.types: dict[str, tuple[int, tuple[int, ...]]] = {}  # value -> (elem type, shape)
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        # Where each value was computed, as "module path|op|n-th such op in that module call":
        # the same activation in every method gets the same key (calibration pools them).
        self.scope = ""
        self.keys: dict[str, str] = {}
        self._in_scope: Counter[tuple[str, str]] = Counter()
        self._count = 0

    def fresh(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def node(
        self,
        op: str,
        inputs: list[str],
        outputs: list[str] | int = 1,
        domain: str = "",
        **attrs: Any,
    ) -> list[str]:
        names = (
            [self.fresh(op.lower()) for _ in range(outputs)]
            if isinstance(outputs, int)
            else outputs
        )
        self._in_scope[self.scope, op] += 1
        for i, name in enumerate(names):
            self.keys[name] = f"{self.scope}|{op}|{self._in_scope[self.scope, op]}|{i}"
        self.nodes.append(
            helper.make_node(op, inputs, names, name=self.fresh(op), domain=domain, **attrs)
        )
        return names

    def const(self, value: np.ndarray | Packed, hint: str = "const") -> str:
        """A constant initializer named by its content (the same constant is stored once)."""
        elem, dims, raw = _raw(value)
        digest = hashlib.sha1(f"{elem}{dims}".encode() + raw).hexdigest()[:16]
        name = f"{hint}.{digest}"
        self.tensors.setdefault(name, value)
        self.types[name] = (elem, dims)
        return name

    def tensor(self, name: str, value: np.ndarray | Packed) -> str:
        elem, dims, _ = _raw(value)
        self.tensors[name] = value
        self.types[name] = (elem, dims)
        return name

    def typed(self, name: str, elem: int, shape: Iterable[int]) -> str:
        self.types[name] = (elem, tuple(int(s) for s in shape))
        return name

    def prune(self, keep: set[str]) -> None:
        """Drop nodes, initializers and inputs (except `keep`) no output depends on."""
        needed = set(self.outputs)
        kept = []
        for node in reversed(self.nodes):
            if any(o in needed for o in node.output):
                kept.append(node)
                needed.update(i for i in node.input if i)
        self.nodes = kept[::-1]
        self.tensors = {k: v for k, v in self.tensors.items() if k in needed}
        self.inputs = [i for i in self.inputs if i in needed or i in keep]

    def producers(self) -> dict[str, onnx.NodeProto]:
        return {o: n for n in self.nodes for o in n.output}

    def all_types(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """Every value's type: the traced ones, and what ONNX shape inference finds for values
        the tracer composes without one (the standard ops of an in-graph dequantization)."""
        info = helper.make_tensor_value_info
        known = dict(self.types)
        # small constants (axes, shapes) by value, as inference needs them; weights by type
        small = {n: v for n, v in self.tensors.items() if _nbytes(v) <= INLINE_BYTES}
        given = [n for n in dict.fromkeys([*self.inputs, *self.tensors]) if n not in small]
        inits = []
        for name, value in small.items():
            elem, dims = known[name]
            inits.append(TensorProto(name=name, data_type=elem, dims=dims, raw_data=_raw(value)[2]))
        inner = [o for n in self.nodes for o in n.output if o in known and o not in self.outputs]
        graph = helper.make_graph(
            self.nodes,
            self.name,
            [info(n, *known[n]) for n in given],
            [info(n, *known[n]) for n in self.outputs],
            inits,
            value_info=[info(n, *known[n]) for n in inner],
        )
        opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)]
        inferred = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=opsets))
        for v in inferred.graph.value_info:
            t = v.type.tensor_type
            dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
            if v.name not in known and t.HasField("shape") and min(dims, default=0) >= 0:
                known[v.name] = (t.elem_type, tuple(dims))
        return known

    def model(self, weights: WeightFile | None) -> onnx.ModelProto:
        """The ModelProto; initializers over INLINE_BYTES go to `weights` (external data)."""
        inits = []
        for name in sorted(self.tensors):
            value = self.tensors[name]
            elem, dims = self.types[name]
            t = TensorProto(name=name, data_type=elem, dims=list(dims))
            if weights is not None and _nbytes(value) > INLINE_BYTES:
                offset, length = weights.add(name, value)
                t.data_location = TensorProto.EXTERNAL
                for k, v in (("location", WEIGHTS), ("offset", offset), ("length", length)):
                    t.external_data.add(key=k, value=str(v))
            else:
                t.raw_data = _raw(value)[2]
            inits.append(t)
        info = helper.make_tensor_value_info
        io = {*self.inputs, *self.outputs, *self.tensors}
        inner = [o for n in self.nodes for o in n.output if o not in io and o in self.types]
        graph = helper.make_graph(
            self.nodes,
            self.name,
            [info(n, *self.types[n]) for n in self.inputs],
            [info(n, *self.types[n]) for n in self.outputs],
            inits,
            value_info=[info(n, *self.types[n]) for n in inner],
        )
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)],
            producer_name="edgemtp",
        )
        model.ir_version = 10
        return model


def _nbytes(value: np.ndarray | Packed) -> int:
    return len(value.raw) if isinstance(value, Packed) else np.asarray(value).nbytes


def _identity(value: np.ndarray | Packed) -> tuple[Any, ...]:
    """Same memory, same view: the same tensor (weights are views of the same parameters in
    every method, packed forms are shared objects), so no bytes need comparing."""
    if isinstance(value, Packed):
        return (id(value),)
    arr = np.asarray(value)
    return (arr.__array_interface__["data"][0], arr.shape, arr.dtype.str, arr.strides)


class WeightFile:
    """`weights.bin`, written as tensors arrive: every large initializer of every method once,
    `ALIGN`-aligned, deduplicated by name (a name seen again must hold the same bytes)."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "wb")  # noqa: SIM115 (closed by close())
        # name -> (offset, length, identity, sha256)
        self.entries: dict[str, tuple[int, int, tuple[Any, ...], str]] = {}
        self.size = 0
        self.referenced = 0  # bytes referenced by all models together (what copies would cost)

    def add(self, name: str, value: np.ndarray | Packed) -> tuple[int, int]:
        self.referenced += _nbytes(value)
        ident = _identity(value)
        if name in self.entries:
            offset, length, known, digest = self.entries[name]
            if ident != known and hashlib.sha256(_raw(value)[2]).hexdigest() != digest:
                raise RuntimeError(f"initializer {name} differs between methods")
            return offset, length
        raw = _raw(value)[2]
        pad = -self.size % ALIGN
        self.file.write(b"\0" * pad)
        offset = self.size + pad
        self.file.write(raw)
        self.size = offset + len(raw)
        self.entries[name] = (offset, len(raw), ident, hashlib.sha256(raw).hexdigest())
        return offset, len(raw)

    def close(self) -> None:
        self.file.close()
