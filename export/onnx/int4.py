"""The 4-bit forms of a linear in an ONNX graph, from exactly the checkpoint's codes and scales.

cpu: `com.microsoft::MatMulNBits`; htp: `DequantizeLinear(int4, block) -> MatMul`, the QNN EP's
block-quantized MatMul. The drafter's clustered head gathers rows of its 4-bit table and
dequantizes them in-graph, as `Int4Weight.dequantize` does. The tracer (`trace.py`) decides
which weight is 4-bit (`int4_of`); a linear without a 4-bit form stays an fp32 `Gemm` there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from onnx import TensorProto

from edgemtp.errors import EdgeMTPError
from edgemtp.export.onnx.graph import MS_DOMAIN, Graph, Packed
from edgemtp.export.weights import Int4Weight

INT8_ACCURACY_LEVEL = 4  # MatMulNBits: activations quantized to int8 (ONNX Runtime's levels)

# The 4-bit tensors of each weight by (id(Int4Weight), "nbits" or "qdq"): computed once per
# lowering and shared by its methods.
Packs = dict[tuple[str, str], dict[str, Any]]
# A delegate's linear: (graph, packs, x, weight name, 4-bit weight) -> the name of x @ W^T.
LinearForm = Callable[[Graph, Packs, str, str, Int4Weight], str]


def pack_nibbles(values: np.ndarray) -> bytes:
    """4-bit values (0..15, or -8..7 two's complement) two per byte, low nibble first (ONNX
    int4/uint4 raw layout and MatMulNBits' layout)."""
    flat = (values.astype(np.int16).reshape(-1) & 0xF).astype(np.uint8)
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.uint8)])
    return (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8).tobytes()


def _check_group(w: Int4Weight, where: str) -> None:
    g = w.group
    if g < 16 or g & (g - 1):
        raise EdgeMTPError(
            f"{where}: ONNX 4-bit ops need a power-of-two group >= 16, this checkpoint uses "
            f"{g}; re-quantize with --group 32, 64 or 128"
        )


def nbits_tensors(w: Int4Weight) -> dict[str, np.ndarray]:
    """MatMulNBits inputs for `w` [N, K]: B uint8 [N, K/group, group/2] (low nibble = even
    element), scales f32 [N, K/group], zero points (only if not all 8) uint8 [N, ceil(nb/2)]."""
    n, k = w.shape
    nb = k // w.group
    codes = w.codes.numpy().astype(np.uint8).reshape(n, nb, w.group // 2, 2)
    out = {
        "B": (codes[..., 0] | (codes[..., 1] << 4)).astype(np.uint8),
        "scales": w.scales.numpy().astype(np.float32),
    }
    if not w.symmetric:
        zeros = np.concatenate([w.zeros.numpy(), np.zeros((n, nb % 2), np.uint8)], axis=1)
        pairs = zeros.astype(np.uint8).reshape(n, -1, 2)
        out["zero_points"] = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)
    return out


def qdq_weight_tensors(w: Int4Weight) -> dict[str, np.ndarray | Packed]:
    """DequantizeLinear inputs for W^T [K, N], blocked along K: int4 (symmetric, zero point 0)
    or uint4 with uint4 zero points, scales f32 [K/group, N]."""
    n, k = w.shape
    nb = k // w.group
    out: dict[str, np.ndarray | Packed] = {"scales": np.ascontiguousarray(w.scales.numpy().T)}
    if w.symmetric:
        signed = w.signed_codes().numpy().T
        out["codes"] = Packed(TensorProto.INT4, (k, n), pack_nibbles(signed))
    else:
        out["codes"] = Packed(TensorProto.UINT4, (k, n), pack_nibbles(w.codes.numpy().T))
        out["zero_points"] = Packed(TensorProto.UINT4, (nb, n), pack_nibbles(w.zeros.numpy().T))
    return out


def _packed(packs: Packs, name: str, q: Int4Weight, form: str) -> dict[str, Any]:
    """The 4-bit tensors of weight `name` (stored as `q`) in `form`, computed once per lowering
    (not once per method). By name: `q` is unpacked afresh at each use (`int4_of`)."""
    key = (name, form)
    if key not in packs:
        packs[key] = nbits_tensors(q) if form == "nbits" else qdq_weight_tensors(q)
    return packs[key]


def _nbits_inits(g: Graph, packs: Packs, name: str, q: Int4Weight) -> dict[str, str]:
    names = {}
    for key, value in _packed(packs, name, q, "nbits").items():
        init = f"{name}.{key}"
        if init not in g.tensors:
            g.tensor(init, value)
        names[key] = init
    return names


def linear_nbits(
    g: Graph, packs: Packs, x: str, name: str, q: Int4Weight, accuracy_level: int = 0
) -> str:
    """x [M, K] @ W^T as MatMulNBits, for the weight `name` stored as `q`. `accuracy_level` 4
    quantizes x to int8 per block (ONNX Runtime's int8 kernels: faster than level 0's
    dequantize-to-fp32, and they keep that speed on a verify's few rows)."""
    y = g.fresh("linear")
    _check_group(q, name)
    n, k = q.shape
    names = _nbits_inits(g, packs, name, q)
    inputs = [x, names["B"], names["scales"]]
    if "zero_points" in names:
        inputs.append(names["zero_points"])
    g.node(
        "MatMulNBits",
        inputs,
        [y],
        domain=MS_DOMAIN,
        K=k,
        N=n,
        bits=4,
        block_size=q.group,
        accuracy_level=accuracy_level,
    )
    return y


def linear_qdq(g: Graph, packs: Packs, x: str, name: str, q: Int4Weight) -> str:
    """x [M, K] @ DequantizeLinear(int4 W^T, block) (the QNN EP's block-quantized MatMul)."""
    _check_group(q, name)
    tensors = _packed(packs, name, q, "qdq")
    inputs = []
    for key in ("codes", "scales", "zero_points"):
        if key in tensors:
            inputs.append(f"{name}.qdq.{key}")
            if inputs[-1] not in g.tensors:
                g.tensor(inputs[-1], tensors[key])
    weight = g.node("DequantizeLinear", inputs, axis=0, block_size=q.group)[0]
    g.typed(weight, TensorProto.FLOAT, (q.shape[1], q.shape[0]))
    return g.node("MatMul", [x, weight])[0]


def gather_rows(g: Graph, packs: Packs, name: str, q: Int4Weight, idx: str, rows: int) -> str:
    """weight[idx] (the drafter's clustered head), `rows` of them: rows of the 4-bit table
    dequantized in-graph, (code - zero) * scale in fp32 as `Int4Weight.dequantize`."""
    _check_group(q, name)
    n, k = q.shape
    names = _nbits_inits(g, packs, name, q)
    picked = g.node("Gather", [names["B"], idx], axis=0)[0]  # [rows, nb, group/2] uint8
    lo = g.node("BitwiseAnd", [picked, g.const(np.array(15, np.uint8))])[0]
    hi = g.node("BitShift", [picked, g.const(np.array(4, np.uint8))], direction="RIGHT")[0]
    pairs = g.node(
        "Concat",
        [g.node("Unsqueeze", [v, g.const(np.array([-1], np.int64))])[0] for v in (lo, hi)],
        axis=-1,
    )[0]
    nb = k // q.group
    codes = g.node("Reshape", [pairs, g.const(np.array([rows, nb, q.group], np.int64))])[0]
    if "zero_points" in names:
        zeros = g.const(q.zeros.numpy().astype(np.float32), hint=f"{name}.zeros_f32")
        zero = g.node(
            "Unsqueeze",
            [g.node("Gather", [zeros, idx], axis=0)[0], g.const(np.array([-1], np.int64))],
        )[0]
    else:
        zero = g.const(np.array(8, np.float32))
    centred = g.node("Sub", [g.node("Cast", [codes], to=TensorProto.FLOAT)[0], zero])[0]
    scale = g.node("Gather", [names["scales"], idx], axis=0)[0]
    scale = g.node("Unsqueeze", [scale, g.const(np.array([-1], np.int64))])[0]
    values = g.node("Mul", [centred, scale])[0]
    return g.node("Reshape", [values, g.const(np.array([rows, k], np.int64))])[0]
