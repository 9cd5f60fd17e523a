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
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from edgemtp.errors import EdgeMTPError
from edgemtp.export.forms import ONNX
from edgemtp.export.lowered import Lowered, Progress
from edgemtp.export.onnx.graph import (
    ONNX_TYPE,
    OPSET,
    WEIGHTS,
    Graph,
    WeightFile,
    dtype_name,
)
from edgemtp.export.onnx.int4 import (
    INT8_ACCURACY_LEVEL,
    LinearForm,
    Packs,
    gather_rows,
    linear_nbits,
    linear_qdq,
)
from edgemtp.export.onnx_norm import rms_norm_op
from edgemtp.export.weights import int4_of
from edgemtp.model.static import StaticBundle, method_io
from edgemtp.model.tables import TokenTables
from edgemtp.runtime.backends import StaticBackend
from edgemtp.runtime.runners.onnx import INDEX, OnnxRunner, range_union

FOLDER = "onnx"  # everything this backend writes lives in out_dir/onnx
ACTIVATIONS = ("int8", "fp32")  # what the cpu delegate's 4-bit linears multiply
# A DQ(int4) -> MatMul pair (the htp bundle on the CPU EP) fuses to MatMulNBits with
# accuracy_level 4 (int8 activations) unless this says 0 (fp32, exact weights).
SESSION_CONFIG = {"session.qdq_matmulnbits_accuracy_level": "0"}
QUANT_MAX = 65535  # uint16 activations

aten = torch.ops.aten


# --- tracing eager methods into graphs ------------------------------------------------------------


@dataclass
class _Weight:
    name: str  # initializer name (qualified parameter name without the method's "owner.")
    tensor: Tensor
    module: nn.Module


@dataclass
class _Mutation:
    buffer: str  # cache input name
    source: str  # value written (whole vector for positions, rows for K/V)
    index: str | None = None  # slot index per row (K/V only)


def _np(t: Tensor) -> np.ndarray:
    return t.detach().contiguous().numpy()


class _Tracer(TorchDispatchMode):
    """Records the aten ops of one eager method call as ONNX nodes (see the module docstring)."""

    def __init__(
        self,
        graph: Graph,
        weights: dict[int, _Weight],
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
        self.transposed: dict[str, _Weight] = {}  # value name -> the weight it transposes
        self.mutations: list[_Mutation] = []
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
    def handler(tr: _Tracer, out: Tensor, a: Any, b: Any, *rest: Any, **kw: Any) -> None:
        if (rest[0] if rest else kw.get("alpha", 1)) != 1:
            raise NotImplementedError(f"{op} with alpha")
        tr.emit(op, [tr.operand(a, out.dtype), tr.operand(b, out.dtype)], out)

    return handler


def _compare(op: str) -> Callable[..., None]:
    def handler(tr: _Tracer, out: Tensor, a: Any, b: Any) -> None:
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
    def handler(tr: _Tracer, out: Tensor, x: Tensor) -> None:
        tr.emit(op, [tr.operand(x, out.dtype)], out, **attrs)

    return handler


for _op, _onnx in (("neg", "Neg"), ("cos", "Cos"), ("sin", "Sin"), ("tanh", "Tanh")):
    _on(getattr(aten, _op).default)(_unary(_onnx))
_on(aten.clone.default)(lambda tr, out, x, **kw: tr.emit("Identity", [tr.name(x)], out))


@_on(aten.rsqrt.default)
def _rsqrt(tr: _Tracer, out: Tensor, x: Tensor) -> None:
    root = tr.g.node("Sqrt", [tr.operand(x, out.dtype)])[0]
    tr.emit("Reciprocal", [root], out)


@_on(aten.gelu.default)
def _gelu(tr: _Tracer, out: Tensor, x: Tensor, approximate: str = "none") -> None:
    tr.emit("Gelu", [tr.name(x)], out, approximate=approximate)


@_on(aten.remainder.Scalar, aten.remainder.Tensor)
def _remainder(tr: _Tracer, out: Tensor, x: Any, n: Any) -> None:
    fmod = int(out.dtype.is_floating_point)
    tr.emit("Mod", [tr.operand(x, out.dtype), tr.operand(n, out.dtype)], out, fmod=fmod)


@_on(aten.bitwise_and.Tensor, aten.logical_and.default)
def _and(tr: _Tracer, out: Tensor, a: Any, b: Any) -> None:
    tr.emit("And", [tr.operand(a, torch.bool), tr.operand(b, torch.bool)], out)


@_on(aten.bitwise_and_.Tensor)
def _and_(tr: _Tracer, out: Tensor, a: Tensor, b: Any) -> None:
    name = tr.g.node("And", [tr.operand(a, torch.bool), tr.operand(b, torch.bool)])[0]
    tr.bind(a, name)  # in place: `a` now names the new value


@_on(aten.where.self)
def _where(tr: _Tracer, out: Tensor, cond: Any, a: Any, b: Any) -> None:
    inputs = [tr.operand(cond, torch.bool), tr.operand(a, out.dtype), tr.operand(b, out.dtype)]
    tr.emit("Where", inputs, out)


@_on(aten._to_copy.default)
def _to_copy(tr: _Tracer, out: Tensor, x: Tensor, **kw: Any) -> None:
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
def _reshape(tr: _Tracer, out: Tensor, x: Tensor, *args: Any, **kw: Any) -> None:
    if x.numel() != out.numel():  # expand
        tr.emit("Expand", [tr.name(x), tr.shape_const(out.shape)], out)
    else:
        tr.emit("Reshape", [tr.name(x), tr.shape_const(out.shape)], out)


@_on(aten.squeeze_.dim, aten.unsqueeze_.default)
def _reshape_(tr: _Tracer, out: Tensor, x: Tensor, *args: Any) -> None:
    name = tr.g.node("Reshape", [tr.name(x), tr.shape_const(out.shape)])[0]
    tr.bind(x, name)


@_on(aten.transpose.int, aten.t.default, aten.permute.default)
def _transpose(tr: _Tracer, out: Tensor, x: Tensor, *dims: Any) -> None:
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
def _select(tr: _Tracer, out: Tensor, x: Tensor, dim: int, index: int) -> None:
    idx = tr.g.const(np.array(index % x.shape[dim], dtype=np.int64))
    tr.emit("Gather", [tr.name(x), idx], out, axis=dim % x.dim())


@_on(aten.slice.Tensor)
def _slice(
    tr: _Tracer,
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
def _cat(tr: _Tracer, out: Tensor, tensors: list[Tensor], dim: int = 0) -> None:
    parts = [tr.operand(t, out.dtype) for t in tensors if t.numel() or tr.traced(t)]
    tr.emit("Concat", parts, out, axis=dim % out.dim())


@_on(aten.mean.dim)
def _mean(tr: _Tracer, out: Tensor, x: Tensor, dims: list[int], keepdim: bool = False, **kw):
    axes = tr.g.const(np.array([d % x.dim() for d in dims], dtype=np.int64))
    tr.emit("ReduceMean", [tr.name(x), axes], out, keepdims=int(keepdim))


@_on(aten.amax.default)
def _amax(tr: _Tracer, out: Tensor, x: Tensor, dims: list[int] = (), keepdim: bool = False):
    axes = [tr.g.const(np.array([d % x.dim() for d in dims], dtype=np.int64))] if dims else []
    tr.emit("ReduceMax", [tr.name(x), *axes], out, keepdims=int(keepdim))


@_on(aten.min.default)
def _min(tr: _Tracer, out: Tensor, x: Tensor) -> None:
    tr.emit("ReduceMin", [tr.name(x)], out, keepdims=0)


@_on(aten.any.dim)
def _any(tr: _Tracer, out: Tensor, x: Tensor, dim: int, keepdim: bool = False) -> None:
    as_int = tr.g.node("Cast", [tr.operand(x, torch.bool)], to=TensorProto.UINT8)[0]
    tr.g.typed(as_int, TensorProto.UINT8, x.shape)
    axes = tr.g.const(np.array([dim % x.dim()], dtype=np.int64))
    hit = tr.g.node("ReduceMax", [as_int, axes], keepdims=int(keepdim))[0]
    tr.g.typed(hit, TensorProto.UINT8, out.shape)
    tr.emit("Cast", [hit], out, to=TensorProto.BOOL)


@_on(aten._softmax.default)
def _softmax(tr: _Tracer, out: Tensor, x: Tensor, dim: int, half_to_float: bool) -> None:
    tr.emit("Softmax", [tr.name(x)], out, axis=dim % x.dim())


@_on(aten.topk.default)
def _topk(tr: _Tracer, out: Any, x: Tensor, k: int, dim: int = -1, largest=True, sorted=True):
    kk = tr.g.const(np.array([k], dtype=np.int64))
    tr.emit("TopK", [tr.name(x), kk], out, axis=dim % x.dim(), largest=int(largest), sorted=1)


@_on(aten.index.Tensor)
def _index(tr: _Tracer, out: Tensor, x: Tensor, indices: list[Tensor | None]) -> None:
    if len(indices) != 1 or indices[0] is None:
        raise NotImplementedError("ONNX export: only x[idx] on the first dimension")
    idx = tr.operand(indices[0], torch.int64)
    if id(x) in tr.weights:
        tr.bind(out, _weight_rows(tr, tr.weights[id(x)], idx, out.shape[0]))
    else:
        tr.emit("Gather", [tr.name(x), idx], out, axis=0)


def _linear(tr: _Tracer, x: str, w: _Weight) -> str:
    """x [M, K] @ W^T: the delegate's 4-bit form where the checkpoint has one, else an fp32
    Gemm."""
    q = int4_of(w.module)
    if q is not None:
        return tr.int4_linear(tr.g, tr.packs, x, w.name, q)
    y = tr.g.fresh("linear")
    tr.g.node("Gemm", [x, tr.name(w.tensor)], [y], transB=1)
    return y


def _weight_rows(tr: _Tracer, w: _Weight, idx: str, rows: int) -> str:
    """weight[idx]: 4-bit rows dequantized in-graph, float ones gathered."""
    q = int4_of(w.module)
    if q is not None:
        return gather_rows(tr.g, tr.packs, w.name, q, idx, rows)
    return tr.g.node("Gather", [tr.name(w.tensor), idx], axis=0)[0]


@_on(aten.mm.default, aten.bmm.default, aten.mv.default, aten.matmul.default)
def _matmul(tr: _Tracer, out: Tensor, a: Tensor, b: Tensor) -> None:
    if tr.traced(b) and tr.names.get(id(b)) in tr.transposed and a.dim() == 2:
        tr.bind(out, _linear(tr, tr.name(a), tr.transposed[tr.names[id(b)]]))
    elif b.dim() == 1:  # matrix @ vector as a [K, 1] matmul (ORT rejects some 1-D forms)
        column = tr.g.node("Reshape", [tr.operand(b, out.dtype), tr.shape_const((-1, 1))])[0]
        product = tr.g.node("MatMul", [tr.operand(a, out.dtype), column])[0]
        tr.emit("Reshape", [product, tr.shape_const(out.shape)], out)
    else:
        tr.emit("MatMul", [tr.operand(a, out.dtype), tr.operand(b, out.dtype)], out)


@_on(aten.copy_.default)
def _copy_(tr: _Tracer, out: Tensor, dst: Tensor, src: Any, non_blocking: bool = False) -> None:
    if id(dst) not in tr.cache:
        raise NotImplementedError("ONNX export: copy_ into a tensor that is not a cache buffer")
    name = tr.name(dst)
    tr.mutations.append(_Mutation(name, tr.operand(src, dst.dtype)))
    tr.mutated.add(id(dst))


@_on(aten.index_copy_.default)
def _index_copy_(tr: _Tracer, out: Tensor, dst: Tensor, dim: int, index: Any, src: Any) -> None:
    if id(dst) not in tr.cache or dim != 1:
        raise NotImplementedError("ONNX export: index_copy_ only into a cache buffer's slots")
    name = tr.name(dst)
    tr.mutations.append(_Mutation(name, tr.operand(src, dst.dtype), tr.operand(index, torch.int64)))
    tr.mutated.add(id(dst))


@_on(rms_norm_op._opoverload)
def _rms_norm_node(tr: _Tracer, out: Tensor, x: Tensor, weight: Tensor, eps: float) -> None:
    inputs = [tr.operand(x, torch.float32), tr.operand(weight, torch.float32)]
    tr.emit("SimplifiedLayerNormalization", inputs, out, axis=-1, epsilon=eps)


# --- methods --------------------------------------------------------------------------------------


def _cache_names(static: StaticBundle) -> dict[int, str]:
    """Buffer id -> graph input name, for every buffer of the shared cache."""
    return {id(buf): f"cache.{name}" for name, buf in static.cache.named_buffers()}


def _weights_of(module: nn.Module, cache: dict[int, str]) -> dict[int, _Weight]:
    out = {}
    for mod_name, mod in module.named_modules():
        for attr, t in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]:
            if id(t) in cache or id(t) in out:
                continue
            name = f"{mod_name}.{attr}" if mod_name else attr
            out[id(t)] = _Weight(name.removeprefix("owner."), t, mod)
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
    updates: list[dict[str, str]]  # cache writes (see Runner)
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
    tracer = _Tracer(
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


def _cache_outputs(graph: Graph, mutations: list[_Mutation]) -> list[dict[str, str]]:
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
