"""Traces one eager method call into ONNX nodes: `Tracer`, a `TorchDispatchMode`, and its aten ops.

Each method of `StaticBundle.methods()` runs once in eager PyTorch under the tracer, which
records every aten op whose inputs depend on a method input, a weight or the cache, and emits the
equivalent ONNX nodes (`_HANDLERS`: one emitter per aten op). Ops on constants only are folded
(their eager result is the constant). This costs one eager forward per method, far less than
`torch.onnx.export(dynamo=True)` (benchmarks/README.md, ONNX section), needs no extra package,
gives static shapes by construction, and lets the backend pick the ONNX form of every linear from
the module it came from: a linear with `int4_of(linear)` becomes the delegate's 4-bit form
(`int4.py`), every other linear an fp32 `Gemm`. Cache writes are recorded as `Mutation`s, which
`method.py` turns into graph outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from onnx import TensorProto
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from edgemtp.export.onnx.graph import ONNX_TYPE, Graph
from edgemtp.export.onnx.int4 import LinearForm, Packs, gather_rows
from edgemtp.export.primitives import rms_norm_op
from edgemtp.export.weights import int4_of

aten = torch.ops.aten


@dataclass
class Weight:
    """A parameter or buffer of the traced module: an initializer of the graph."""

    name: str  # initializer name (qualified parameter name without the method's "owner.")
    tensor: Tensor
    module: nn.Module


@dataclass
class Mutation:
    """A write into a cache buffer, which the graph returns instead (`method.py`)."""

    buffer: str  # cache input name
    source: str  # value written (whole vector for positions, rows for K/V)
    index: str | None = None  # slot index per row (K/V only)


def _np(t: Tensor) -> np.ndarray:
    return t.detach().contiguous().numpy()


class Tracer(TorchDispatchMode):
    """Records the aten ops of one eager method call as ONNX nodes (see the module docstring)."""

    def __init__(
        self,
        graph: Graph,
        weights: dict[int, Weight],
        cache: dict[int, str],
        int4_linear: LinearForm,
        packs: Packs,
    ):
        super().__init__()
        self.g = graph
        self.weights = weights
        self.cache = cache
        self.int4_linear = int4_linear  # emits x @ W^T for a 4-bit W (the delegate's form)
        self.packs = packs  # shared by the methods of one lowering
        self.names: dict[int, str] = {}
        self.keep: list[Any] = []  # every tensor named here stays alive: ids never collide
        self.transposed: dict[str, Weight] = {}  # value name -> the weight it transposes
        self.mutations: list[Mutation] = []
        self.mutated: set[int] = set()

    # values
    def traced(self, t: Any) -> bool:
        return isinstance(t, Tensor) and (
            id(t) in self.names or id(t) in self.weights or id(t) in self.cache
        )

    def name(self, t: Tensor) -> str:
        if id(t) in self.mutated:
            raise NotImplementedError("a method reads a cache buffer after writing it")
        if id(t) in self.names:
            return self.names[id(t)]
        if id(t) in self.cache:
            name = self.cache[id(t)]
            if name not in self.g.inputs:
                self.g.inputs.append(name)
                self.g.typed(name, ONNX_TYPE[t.dtype], t.shape)
            return name
        w = self.weights[id(t)]
        if w.name not in self.g.tensors:
            self.g.tensor(w.name, _np(w.tensor))
        return w.name

    def bind(self, t: Tensor, name: str) -> str:
        self.names[id(t)] = name
        self.keep.append(t)
        self.g.typed(name, ONNX_TYPE[t.dtype], t.shape)
        return name

    def input(self, name: str, t: Tensor) -> None:
        self.g.inputs.append(self.bind(t, name))

    def operand(self, x: Any, dtype: torch.dtype | None = None) -> str:
        """A traced tensor (cast to `dtype` if needed) or a constant of `dtype`."""
        if self.traced(x):
            name = self.name(x)
            if dtype is not None and x.dtype != dtype:
                name = self.g.node("Cast", [name], to=ONNX_TYPE[dtype])[0]
                self.g.typed(name, ONNX_TYPE[dtype], x.shape)
            return name
        value = torch.as_tensor(x)
        if dtype is not None:
            value = value.to(dtype)
        return self.g.const(_np(value))

    def emit(self, op: str, inputs: list[str], out: Any, domain: str = "", **attrs: Any) -> None:
        outs = list(out) if isinstance(out, tuple | list) else [out]
        names = self.g.node(op, inputs, len(outs), domain=domain, **attrs)
        for t, n in zip(outs, names, strict=True):
            self.bind(t, n)

    def shape_const(self, shape: Iterable[int]) -> str:
        return self.g.const(np.array(list(shape), dtype=np.int64))

    # dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is aten._local_scalar_dense.default and self.traced(args[0]):
            raise NotImplementedError("ONNX export: a value read with .item() steers the graph")
        flat, _ = tree_flatten((args, kwargs))
        if not any(self.traced(t) for t in flat):
            return out  # constant: folded, its eager value is the constant
        handler = _HANDLERS.get(func)
        if handler is None:
            raise NotImplementedError(f"ONNX export: no translation for {func}")
        handler(self, out, *args, **kwargs)
        return out


# aten op -> emitter; `out` is the eager result (its dtype and shape are the node's).
_HANDLERS: dict[Any, Callable[..., None]] = {}


def _on(*ops: Any) -> Callable[[Callable[..., None]], Callable[..., None]]:
    def register(fn: Callable[..., None]) -> Callable[..., None]:
        for op in ops:
            _HANDLERS[op] = fn
        return fn

    return register


def _arith(op: str) -> Callable[..., None]:
    def handler(tr: Tracer, out: Tensor, a: Any, b: Any, *rest: Any, **kw: Any) -> None:
        if (rest[0] if rest else kw.get("alpha", 1)) != 1:
            raise NotImplementedError(f"{op} with alpha")
        tr.emit(op, [tr.operand(a, out.dtype), tr.operand(b, out.dtype)], out)

    return handler


def _compare(op: str) -> Callable[..., None]:
    def handler(tr: Tracer, out: Tensor, a: Any, b: Any) -> None:
        dtype = torch.result_type(a, b)
        tr.emit(op, [tr.operand(a, dtype), tr.operand(b, dtype)], out)

    return handler


for _op, _onnx in (("add", "Add"), ("sub", "Sub"), ("mul", "Mul"), ("div", "Div")):
    _on(getattr(aten, _op).Tensor, getattr(aten, _op).Scalar)(_arith(_onnx))
for _op, _onnx in (
    ("eq", "Equal"),
    ("ge", "GreaterOrEqual"),
    ("gt", "Greater"),
    ("le", "LessOrEqual"),
    ("lt", "Less"),
):
    _on(getattr(aten, _op).Tensor, getattr(aten, _op).Scalar)(_compare(_onnx))


def _unary(op: str, **attrs: Any) -> Callable[..., None]:
    def handler(tr: Tracer, out: Tensor, x: Tensor) -> None:
        tr.emit(op, [tr.operand(x, out.dtype)], out, **attrs)

    return handler


for _op, _onnx in (("neg", "Neg"), ("cos", "Cos"), ("sin", "Sin"), ("tanh", "Tanh")):
    _on(getattr(aten, _op).default)(_unary(_onnx))
_on(aten.clone.default)(lambda tr, out, x, **kw: tr.emit("Identity", [tr.name(x)], out))


@_on(aten.rsqrt.default)
def _rsqrt(tr: Tracer, out: Tensor, x: Tensor) -> None:
    root = tr.g.node("Sqrt", [tr.operand(x, out.dtype)])[0]
    tr.emit("Reciprocal", [root], out)


@_on(aten.gelu.default)
def _gelu(tr: Tracer, out: Tensor, x: Tensor, approximate: str = "none") -> None:
    tr.emit("Gelu", [tr.name(x)], out, approximate=approximate)


@_on(aten.remainder.Scalar, aten.remainder.Tensor)
def _remainder(tr: Tracer, out: Tensor, x: Any, n: Any) -> None:
    fmod = int(out.dtype.is_floating_point)
    tr.emit("Mod", [tr.operand(x, out.dtype), tr.operand(n, out.dtype)], out, fmod=fmod)


@_on(aten.bitwise_and.Tensor, aten.logical_and.default)
def _and(tr: Tracer, out: Tensor, a: Any, b: Any) -> None:
    tr.emit("And", [tr.operand(a, torch.bool), tr.operand(b, torch.bool)], out)


@_on(aten.bitwise_and_.Tensor)
def _and_(tr: Tracer, out: Tensor, a: Tensor, b: Any) -> None:
    name = tr.g.node("And", [tr.operand(a, torch.bool), tr.operand(b, torch.bool)])[0]
    tr.bind(a, name)  # in place: `a` now names the new value


@_on(aten.where.self)
def _where(tr: Tracer, out: Tensor, cond: Any, a: Any, b: Any) -> None:
    inputs = [tr.operand(cond, torch.bool), tr.operand(a, out.dtype), tr.operand(b, out.dtype)]
    tr.emit("Where", inputs, out)


@_on(aten._to_copy.default)
def _to_copy(tr: Tracer, out: Tensor, x: Tensor, **kw: Any) -> None:
    tr.emit("Cast", [tr.name(x)], out, to=ONNX_TYPE[out.dtype])


@_on(
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.default,
    aten.expand.default,
)
def _reshape(tr: Tracer, out: Tensor, x: Tensor, *args: Any, **kw: Any) -> None:
    if x.numel() != out.numel():  # expand
        tr.emit("Expand", [tr.name(x), tr.shape_const(out.shape)], out)
    else:
        tr.emit("Reshape", [tr.name(x), tr.shape_const(out.shape)], out)


@_on(aten.squeeze_.dim, aten.unsqueeze_.default)
def _reshape_(tr: Tracer, out: Tensor, x: Tensor, *args: Any) -> None:
    name = tr.g.node("Reshape", [tr.name(x), tr.shape_const(out.shape)])[0]
    tr.bind(x, name)


@_on(aten.transpose.int, aten.t.default, aten.permute.default)
def _transpose(tr: Tracer, out: Tensor, x: Tensor, *dims: Any) -> None:
    rank = x.dim()
    perm = list(range(rank))
    if len(dims) == 1:  # permute
        perm = [d % rank for d in dims[0]]
    elif len(dims) == 2:
        a, b = dims[0] % rank, dims[1] % rank
        perm[a], perm[b] = perm[b], perm[a]
    else:
        perm = perm[::-1]
    tr.emit("Transpose", [tr.name(x)], out, perm=perm)
    if id(x) in tr.weights and rank == 2:
        tr.transposed[tr.names[id(out)]] = tr.weights[id(x)]


@_on(aten.select.int)
def _select(tr: Tracer, out: Tensor, x: Tensor, dim: int, index: int) -> None:
    idx = tr.g.const(np.array(index % x.shape[dim], dtype=np.int64))
    tr.emit("Gather", [tr.name(x), idx], out, axis=dim % x.dim())


@_on(aten.slice.Tensor)
def _slice(
    tr: Tracer,
    out: Tensor,
    x: Tensor,
    dim: int = 0,
    start: int | None = None,
    end: int | None = None,
    step: int = 1,
) -> None:
    n = x.shape[dim]
    lo, hi, _ = slice(start, end, step).indices(n)
    consts = [np.array([v], dtype=np.int64) for v in (lo, hi, dim % x.dim(), step)]
    tr.emit("Slice", [tr.name(x), *(tr.g.const(c) for c in consts)], out)


@_on(aten.cat.default)
def _cat(tr: Tracer, out: Tensor, tensors: list[Tensor], dim: int = 0) -> None:
    parts = [tr.operand(t, out.dtype) for t in tensors if t.numel() or tr.traced(t)]
    tr.emit("Concat", parts, out, axis=dim % out.dim())


@_on(aten.mean.dim)
def _mean(tr: Tracer, out: Tensor, x: Tensor, dims: list[int], keepdim: bool = False, **kw):
    axes = tr.g.const(np.array([d % x.dim() for d in dims], dtype=np.int64))
    tr.emit("ReduceMean", [tr.name(x), axes], out, keepdims=int(keepdim))


@_on(aten.amax.default)
def _amax(tr: Tracer, out: Tensor, x: Tensor, dims: list[int] = (), keepdim: bool = False):
    axes = [tr.g.const(np.array([d % x.dim() for d in dims], dtype=np.int64))] if dims else []
    tr.emit("ReduceMax", [tr.name(x), *axes], out, keepdims=int(keepdim))


@_on(aten.min.default)
def _min(tr: Tracer, out: Tensor, x: Tensor) -> None:
    tr.emit("ReduceMin", [tr.name(x)], out, keepdims=0)


@_on(aten.any.dim)
def _any(tr: Tracer, out: Tensor, x: Tensor, dim: int, keepdim: bool = False) -> None:
    as_int = tr.g.node("Cast", [tr.operand(x, torch.bool)], to=TensorProto.UINT8)[0]
    tr.g.typed(as_int, TensorProto.UINT8, x.shape)
    axes = tr.g.const(np.array([dim % x.dim()], dtype=np.int64))
    hit = tr.g.node("ReduceMax", [as_int, axes], keepdims=int(keepdim))[0]
    tr.g.typed(hit, TensorProto.UINT8, out.shape)
    tr.emit("Cast", [hit], out, to=TensorProto.BOOL)


@_on(aten._softmax.default)
def _softmax(tr: Tracer, out: Tensor, x: Tensor, dim: int, half_to_float: bool) -> None:
    tr.emit("Softmax", [tr.name(x)], out, axis=dim % x.dim())


@_on(aten.topk.default)
def _topk(tr: Tracer, out: Any, x: Tensor, k: int, dim: int = -1, largest=True, sorted=True):
    kk = tr.g.const(np.array([k], dtype=np.int64))
    tr.emit("TopK", [tr.name(x), kk], out, axis=dim % x.dim(), largest=int(largest), sorted=1)


@_on(aten.index.Tensor)
def _index(tr: Tracer, out: Tensor, x: Tensor, indices: list[Tensor | None]) -> None:
    if len(indices) != 1 or indices[0] is None:
        raise NotImplementedError("ONNX export: only x[idx] on the first dimension")
    idx = tr.operand(indices[0], torch.int64)
    if id(x) in tr.weights:
        tr.bind(out, _weight_rows(tr, tr.weights[id(x)], idx, out.shape[0]))
    else:
        tr.emit("Gather", [tr.name(x), idx], out, axis=0)


def _linear(tr: Tracer, x: str, w: Weight) -> str:
    """x [M, K] @ W^T: the delegate's 4-bit form where the checkpoint has one, else an fp32
    Gemm."""
    q = int4_of(w.module)
    if q is not None:
        return tr.int4_linear(tr.g, tr.packs, x, w.name, q)
    y = tr.g.fresh("linear")
    tr.g.node("Gemm", [x, tr.name(w.tensor)], [y], transB=1)
    return y


def _weight_rows(tr: Tracer, w: Weight, idx: str, rows: int) -> str:
    """weight[idx]: 4-bit rows dequantized in-graph, float ones gathered."""
    q = int4_of(w.module)
    if q is not None:
        return gather_rows(tr.g, tr.packs, w.name, q, idx, rows)
    return tr.g.node("Gather", [tr.name(w.tensor), idx], axis=0)[0]


@_on(aten.mm.default, aten.bmm.default, aten.mv.default, aten.matmul.default)
def _matmul(tr: Tracer, out: Tensor, a: Tensor, b: Tensor) -> None:
    if tr.traced(b) and tr.names.get(id(b)) in tr.transposed and a.dim() == 2:
        tr.bind(out, _linear(tr, tr.name(a), tr.transposed[tr.names[id(b)]]))
    elif b.dim() == 1:  # matrix @ vector as a [K, 1] matmul (ORT rejects some 1-D forms)
        column = tr.g.node("Reshape", [tr.operand(b, out.dtype), tr.shape_const((-1, 1))])[0]
        product = tr.g.node("MatMul", [tr.operand(a, out.dtype), column])[0]
        tr.emit("Reshape", [product, tr.shape_const(out.shape)], out)
    else:
        tr.emit("MatMul", [tr.operand(a, out.dtype), tr.operand(b, out.dtype)], out)


@_on(aten.copy_.default)
def _copy_(tr: Tracer, out: Tensor, dst: Tensor, src: Any, non_blocking: bool = False) -> None:
    if id(dst) not in tr.cache:
        raise NotImplementedError("ONNX export: copy_ into a tensor that is not a cache buffer")
    name = tr.name(dst)
    tr.mutations.append(Mutation(name, tr.operand(src, dst.dtype)))
    tr.mutated.add(id(dst))


@_on(aten.index_copy_.default)
def _index_copy_(tr: Tracer, out: Tensor, dst: Tensor, dim: int, index: Any, src: Any) -> None:
    if id(dst) not in tr.cache or dim != 1:
        raise NotImplementedError("ONNX export: index_copy_ only into a cache buffer's slots")
    name = tr.name(dst)
    tr.mutations.append(Mutation(name, tr.operand(src, dst.dtype), tr.operand(index, torch.int64)))
    tr.mutated.add(id(dst))


@_on(rms_norm_op._opoverload)
def _rms_norm_node(tr: Tracer, out: Tensor, x: Tensor, weight: Tensor, eps: float) -> None:
    inputs = [tr.operand(x, torch.float32), tr.operand(weight, torch.float32)]
    tr.emit("SimplifiedLayerNormalization", inputs, out, axis=-1, epsilon=eps)
