"""ONNX Runtime's probes: the kernels an ONNX bundle's CPU methods run (MatMulNBits with int8
activations, the per-node and per-call costs, non-matmul nodes, attention as the ONNX exporter
writes it), in CPU sessions set up as the runtime sets its own; they fill the profile's
`[delegates.cpu.backends.onnx]`."""

from __future__ import annotations

from typing import Any

import torch

from edgemtp.devices.calibrate.host import resident_size
from edgemtp.devices.calibrate.measure import (
    GEMM_CALLS,
    RESIDENT_LINEARS,
    RESOLUTION_US,
    STREAM_LINEARS,
    VERIFY_PROBE_ROWS,
    Call,
    attention_rates,
    gemm_rates,
    interleaved_medians,
    median_seconds,
    ns_per_element,
    stream_rate,
)


def _ort_session(graph: Any, threads: int) -> Any:
    """`graph` in an ONNX Runtime CPU session set up as `OnnxRunner` (runtime/runners/onnx.py)
    sets its own."""
    import onnx
    import onnxruntime as ort

    model = onnx.helper.make_model(
        graph,
        opset_imports=[
            onnx.helper.make_opsetid("", 17),
            onnx.helper.make_opsetid("com.microsoft", 1),
        ],
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def run_calls(session: Any, feed: dict[str, Any], times: int) -> Call:
    """A call that runs `session` on `feed` `times` times in a row."""
    return lambda: [session.run(None, feed) for _ in range(times)]


def _nbits_linear(
    k: int, n: int, rows: int, threads: int, count: int = 1, seed: int = 1
) -> tuple[Any, dict[str, Any], float]:
    """(session, feed, weight bytes of one) of `count` independent MatMulNBits [rows, k] x
    [k, n] (inputs x0.., outputs y0.., weights of their own), 4-bit, blocks of 32, fp32 scales,
    int8 activations (accuracy level 4): the node an ONNX cpu bundle's 4-bit linears become
    with export's default `--activations int8`. The feed gives every linear one input, drawn
    from `seed`."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    from edgemtp.export.onnx import INT8_ACCURACY_LEVEL

    rng = np.random.default_rng(0)
    nodes, inputs, outputs, weights = [], [], [], []
    for i in range(count):
        codes = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
        scales = (rng.random((n, k // 32), dtype=np.float32) * 0.01).astype(np.float32)
        weights += [onnx.numpy_helper.from_array(codes, f"B{i}"),
                    onnx.numpy_helper.from_array(scales, f"scales{i}")]  # fmt: skip
        nodes.append(helper.make_node(
            "MatMulNBits", [f"x{i}", f"B{i}", f"scales{i}"], [f"y{i}"], domain="com.microsoft",
            K=k, N=n, bits=4, block_size=32, accuracy_level=INT8_ACCURACY_LEVEL,
        ))  # fmt: skip
        inputs.append(helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [rows, k]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [rows, n]))
    graph = helper.make_graph(nodes, "nbits", inputs, outputs, weights)
    x = np.random.default_rng(seed).standard_normal((rows, k), dtype=np.float32)
    feed = {f"x{i}": x for i in range(count)}
    return _ort_session(graph, threads), feed, codes.nbytes + scales.nbytes


def onnx_attention(threads: int, quick: bool = False) -> tuple[float, float, float]:
    """`attention_rates` of ONNX Runtime: `SegmentAttention` as the ONNX exporter writes it
    (MatMul against each segment's transposed keys, Concat, the additive mask, Softmax, Slice
    and MatMul per segment, summed)."""
    import numpy as np
    from onnx import TensorProto, helper

    from edgemtp.runtime.runners.onnx import flush_denormals

    names = ("q", "k_cache", "k_rows", "v_cache", "v_rows", "mask")

    def graph(heads: int, rows: int, keys: int, dim: int) -> Any:
        def tensor(name: str, shape: list[int]) -> Any:
            return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)

        def ints(name: str, values: list[int]) -> Any:
            return helper.make_tensor(name, TensorProto.INT64, [len(values)], values)

        node = helper.make_node
        nodes = [
            node("Transpose", ["k_cache"], ["kt_cache"], perm=[0, 2, 1]),
            node("Transpose", ["k_rows"], ["kt_rows"], perm=[0, 2, 1]),
            node("MatMul", ["q", "kt_cache"], ["s_cache"]),
            node("MatMul", ["q", "kt_rows"], ["s_rows"]),
            node("Concat", ["s_cache", "s_rows"], ["s"], axis=-1),
            node("Reshape", ["s", "by_head"], ["s4"]),
            node("Add", ["s4", "mask"], ["masked"]),
            node("Softmax", ["masked"], ["p4"], axis=-1),
            node("Reshape", ["p4", "flat"], ["p"]),
            node("Slice", ["p", "zero", "keys", "last"], ["p_cache"]),
            node("Slice", ["p", "keys", "end", "last"], ["p_rows"]),
            node("MatMul", ["p_cache", "v_cache"], ["o_cache"]),
            node("MatMul", ["p_rows", "v_rows"], ["o_rows"]),
            node("Add", ["o_cache", "o_rows"], ["out"]),
        ]
        consts = [ints("by_head", [1, heads, rows, keys + rows]),
                  ints("flat", [1, heads * rows, keys + rows]), ints("zero", [0]),
                  ints("keys", [keys]), ints("end", [keys + rows]), ints("last", [2])]  # fmt: skip
        shapes = ([1, heads * rows, dim], [1, keys, dim], [1, rows, dim], [1, keys, dim],
                  [1, rows, dim], [rows, keys + rows])  # fmt: skip
        inputs = [tensor(n, shape) for n, shape in zip(names, shapes, strict=True)]
        out = [tensor("out", [1, heads * rows, dim])]
        return helper.make_graph(nodes, "attention", inputs, out, consts)

    def make(inputs: tuple[torch.Tensor, ...]) -> Call:
        heads_rows, dim = inputs[0].shape[1:]
        rows, keys = inputs[5].shape[0], inputs[1].shape[1]
        session = _ort_session(graph(heads_rows // rows, rows, keys, dim), threads)
        feed = {n: np.ascontiguousarray(x.numpy()) for n, x in zip(names, inputs, strict=True)}

        def call() -> object:
            with flush_denormals():  # as OnnxRunner runs the bundles
                return session.run(None, feed)

        return call

    return attention_rates(make, quick)


def onnx_ns_per_element(threads: int, quick: bool = False) -> float:
    """ns per element ONNX Runtime's non-matmul nodes write: a chain of 24 nodes (Mul, Add,
    SimplifiedLayerNormalization, Gelu in turn, what a decoder layer runs between its linears)
    on 64 rows of 1024 less the same chain on 8 rows, interleaved; dispatch cancels."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    width, many, few, length = (256, 16, 2, 8) if quick else (1024, 64, 8, 24)
    kinds = ("Mul", "Add", "SimplifiedLayerNormalization", "Gelu")

    def session(rows: int) -> Any:
        scale = numpy_helper.from_array(np.full(width, 0.5, dtype=np.float32), "w")
        nodes = []
        for i in range(length):
            kind, x, y = kinds[i % len(kinds)], f"h{i}", f"h{i + 1}"
            if kind in ("Mul", "Add"):
                nodes.append(helper.make_node(kind, [x, "w"], [y]))
            elif kind == "Gelu":
                nodes.append(helper.make_node(kind, [x], [y], domain="com.microsoft"))
            else:
                nodes.append(helper.make_node(kind, [x, "w"], [y], axis=-1, epsilon=1e-6))
        graph = helper.make_graph(
            nodes, "elementwise",
            [helper.make_tensor_value_info("h0", TensorProto.FLOAT, [rows, width])],
            [helper.make_tensor_value_info(f"h{length}", TensorProto.FLOAT, [rows, width])],
            [scale],
        )  # fmt: skip
        return _ort_session(graph, threads)

    def make(rows: int) -> Call:
        s, x = session(rows), np.ones((rows, width), dtype=np.float32)
        return lambda: s.run(None, {"h0": x})

    return ns_per_element(make, many, few, length * width, 5 if quick else 50)


# What a decoder layer runs between its linears, in ONNX: views, a transposed copy, a split and
# its concat (rotary halves), scaling, residual adds, norms, the activation, masking, negation.
DECODER_NODE_MIX = (
    "Reshape", "Transpose", "Reshape", "Split", "Mul", "Add",
    "SimplifiedLayerNormalization", "Gelu", "Where", "Neg",
)  # fmt: skip


def _onnx_node_chain(repeats: int, width: int, threads: int) -> tuple[Any, int]:
    """(session, nodes) of `DECODER_NODE_MIX` repeated `repeats` times on one row of `width`
    (Split's halves are concatenated back in swapped order, as rotary embedding does)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    consts = {
        "scale": np.full(width, 0.5, dtype=np.float32),
        "by_head": np.array([1, 4, width // 4]),
        "flat": np.array([1, width]),
        "halves": np.array([width // 2, width // 2]),
        "even": (np.arange(width) % 2 == 0).reshape(1, width),
    }
    nodes, x = [], "h0"
    for i, kind in enumerate(DECODER_NODE_MIX * repeats):
        y = f"h{i + 1}"
        if kind == "Reshape":
            shape = "flat" if nodes and nodes[-1].op_type == "Transpose" else "by_head"
            nodes.append(helper.make_node(kind, [x, shape], [y]))
        elif kind == "Transpose":
            nodes.append(helper.make_node(kind, [x], [y], perm=[0, 2, 1]))
        elif kind == "Split":
            nodes.append(helper.make_node(kind, [x, "halves"], [y + "a", y + "b"], axis=-1))
            nodes.append(helper.make_node("Concat", [y + "b", y + "a"], [y], axis=-1))
        elif kind in ("Mul", "Add"):
            nodes.append(helper.make_node(kind, [x, "scale"], [y]))
        elif kind == "SimplifiedLayerNormalization":
            nodes.append(helper.make_node(kind, [x, "scale"], [y], axis=-1, epsilon=1e-6))
        elif kind == "Gelu":
            nodes.append(helper.make_node(kind, [x], [y], domain="com.microsoft"))
        elif kind == "Where":
            nodes.append(helper.make_node(kind, ["even", x, "scale"], [y]))
        else:
            nodes.append(helper.make_node(kind, [x], [y]))
        x = y
    graph = helper.make_graph(
        nodes, "decoder_nodes",
        [helper.make_tensor_value_info("h0", TensorProto.FLOAT, [1, width])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, width])],
        [numpy_helper.from_array(v, k) for k, v in consts.items()],
    )  # fmt: skip
    return _ort_session(graph, threads), len(nodes)


# (k, n, count): one row through this many independent MatMulNBits of an E2B x0.25 layer's
# shape (295 MB in all: past the caches, as the streaming probe)
NARROW_GEMV = (384, 2048, 600)


def _stream_gbs(k: int, n: int, rows: int, threads: int) -> float:
    """GB/s of `rows` rows through `STREAM_LINEARS` MatMulNBits of k x n (past the caches, as
    `xnnpack.memory_bandwidth`'s probe), median of 9."""
    session, feed, weight_bytes = _nbits_linear(k, n, rows, threads, STREAM_LINEARS)
    seconds = median_seconds(lambda: session.run(None, feed), 9)
    return STREAM_LINEARS * weight_bytes / seconds / 1e9


def _node_costs(threads: int, calls: int, rounds: int) -> tuple[float, float]:
    """(seconds per node, µs per session.run beyond its nodes): sessions of `DECODER_NODE_MIX`
    on one row of 64, once and 20 times over, `calls` runs a timing, interleaved."""
    import numpy as np

    chains = [_onnx_node_chain(repeats, 64, threads) for repeats in (1, 20)]
    feed = {"h0": np.ones((1, 64), dtype=np.float32)}
    per_call = interleaved_medians([run_calls(s, feed, calls) for s, _ in chains], rounds)
    (_, few), (_, many) = chains
    per_node = (per_call[1] - per_call[0]) / calls / (many - few)
    return per_node, max((per_call[0] / calls - few * per_node) * 1e6, RESOLUTION_US)


def _linear_us(
    threads: int, linears: int, calls: int, rounds: int, per_node: float, bandwidth_gbs: float
) -> float:
    """µs a MatMulNBits takes beyond its weight bytes at `bandwidth_gbs` and its launch
    (`per_node` seconds): sessions of `linears` and of one independent 64 x 64 linears on one
    row, `calls` runs a timing, interleaved: their bytes are a few KiB, the rest is the
    kernel's own setup."""
    import numpy as np

    sessions = [_nbits_linear(64, 64, 1, threads, count) for count in (1, linears)]
    inputs = [{f"x{i}": np.ones((1, 64), np.float32) for i in range(c)} for c in (1, linears)]
    per_call = interleaved_medians(
        [run_calls(s, f, calls) for (s, _, _), f in zip(sessions, inputs, strict=True)], rounds
    )
    per_linear = (per_call[1] - per_call[0]) / calls / (linears - 1)
    streaming = sessions[0][2] / (bandwidth_gbs * 1e9)
    return max((per_linear - streaming - per_node) * 1e6, RESOLUTION_US)


def onnx_kernels(
    threads: int, quick: bool = False, limit_mb: float | None = None
) -> dict[str, float]:
    """ONNX Runtime's MatMulNBits: its bandwidth past the caches on one row and on a verify's
    (and, given the cache's `limit_mb`, with weights that stay in it), its int8 throughput
    (`gemm_rates`), the cost per node and per call (`_node_costs`), a MatMulNBits' fixed cost
    beyond its bytes and its launch (`_linear_us`), and what a narrow one on one row takes
    beyond its bytes at the probe's rate, its launch and that fixed cost, per element it reads
    or writes (`NARROW_GEMV`: narrow linears stream slower than the 8192 x 8192 probe)."""
    k = n = 1024 if quick else 8192
    bandwidth = {rows: _stream_gbs(k, n, rows, threads) for rows in (1, VERIFY_PROBE_ROWS)}

    def gemm(rows: int, side: int) -> Call:
        session, feed, _ = _nbits_linear(side, side, rows, threads, seed=2)
        return run_calls(session, feed, GEMM_CALLS)

    tops, ns_per_linear_element = gemm_rates(gemm, quick)
    calls, rounds = (20, 5) if quick else (200, 9)
    per_node, call_us = _node_costs(threads, calls, rounds)
    linears = 8 if quick else 64
    linear_us = _linear_us(threads, linears, calls // 4, rounds, per_node, bandwidth[1])
    k, n, count = (64, 256, 8) if quick else NARROW_GEMV
    session, feed, weight_bytes = _nbits_linear(k, n, 1, threads, count)
    seconds = median_seconds(lambda: session.run(None, feed), 9) / count
    beyond = seconds - weight_bytes / (bandwidth[1] * 1e9) - per_node - linear_us * 1e-6
    gemv_ns = max(beyond, 0.0) / (k + n) * 1e9
    resident = {}
    if limit_mb is not None:
        side, count = resident_size(limit_mb, quick), RESIDENT_LINEARS
        fixed_s = (call_us + count * (per_node * 1e6 + linear_us)) * 1e-6
        for rows in (1, VERIFY_PROBE_ROWS):
            session, feed, weight_bytes = _nbits_linear(side, side, rows, threads, count)
            seconds = median_seconds(run_calls(session, feed, 20), 9) / 20
            resident[rows] = stream_rate(count * weight_bytes, seconds, fixed_s)
    return {
        "memory_bandwidth_gbs": bandwidth[1],
        "verify_bandwidth_gbs": bandwidth[VERIFY_PROBE_ROWS],
        "int8_tops": tops,
        "ns_per_linear_element": ns_per_linear_element,
        "dispatch_us": max(per_node * 1e6, RESOLUTION_US),
        "call_us": call_us,
        "linear_us": linear_us,
        "ns_per_gemv_element": gemv_ns,
        **(
            {
                "resident_bandwidth_gbs": resident[1],
                "resident_verify_bandwidth_gbs": resident[VERIFY_PROBE_ROWS],
            }
            if resident
            else {}
        ),
    }
