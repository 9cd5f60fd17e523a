"""The primitives the export forms choose from, beside the reference's (`model/primitives.py`).

They compute the same functions as the reference, spelled in ops the static programs lower
well (`export/forms.py` says which form uses which):

- attention over K/V kept in segments (the cache, the call's own rows), never concatenated:
  concatenating copied the whole static cache in every layer at every step; grouped-query
  attention as batched matmuls over KV groups (no K/V repeat); the mask additive, built once
  per forward (a boolean mask and `enable_gqa` decompose into ops no delegate takes). No row
  of a static program is ever fully masked (see `model/static.py`), so additive equals boolean;
- additive masks from arithmetic on the positions (XNNPACK operators) instead of compares, ands
  and a `where`, which run in portable kernels;
- RMSNorm without `mean.dim` or `pow` (XNNPACK delegates `mean.dim` only as an NHWC pooling,
  `pow` only squared): a 4-D global pooling, or a 1-output linear;
- RMSNorm as one op (the ONNX form), which the ONNX tracer writes as one
  `SimplifiedLayerNormalization` node: one fused kernel on the CPU EP, QNN's RmsNorm on the HTP,
  and no rsqrt tensor whose range, 1/sqrt(eps) on zero pad rows, would ruin its int16 scale;
- projections read from one product where a form fused the linears of one input (`attn.qkv`,
  `mlp.gate_up`: `export/int4.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgemtp.model.gemma4 import RMSNorm
from edgemtp.model.primitives import Primitives, Segments, apply_rope, attends
from edgemtp.runtime.kernels.ops import heads_to_rows, segment_attention

BLOCKED = -1e30  # a blocked key's additive mask: exp(score + BLOCKED - row max) is exactly 0


def _positive_part(x: Tensor) -> Tensor:
    """max(x, 0) as (x + |x|) / 2: exact on whole numbers, and no clamp or relu, which would
    make XNNPACK run its whole preprocessing pipeline on the partition
    (`export/executorch_program.py`)."""
    return (x + x.abs()) * 0.5


def where_mask(ops: Primitives, q_pos: Tensor, kv_pos: Tensor, window: int | None) -> Tensor:
    """0 where a row attends, -inf elsewhere."""
    return torch.where(attends(q_pos, kv_pos, window), 0.0, float("-inf"))


def arithmetic_mask(ops: Primitives, q_pos: Tensor, kv_pos: Tensor, window: int | None) -> Tensor:
    """The mask as additive floats from subtractions, `_positive_part`s, adds and a scale:
    0 where a row attends; elsewhere each violated condition adds how far past it the key is
    (>= 1) times `BLOCKED`. Positions are exact as floats below 2^24, and the sum stays
    finite."""
    keys = kv_pos.float()[None, :]
    ahead = q_pos.float()[:, None] - keys  # >= 0: the key is at or before the row
    blocked = _positive_part(-ahead) + _positive_part(-keys)  # a future key, an empty slot (-1)
    if window is not None:
        blocked = blocked + _positive_part(ahead - (window - 1))  # out of the window
    return blocked * BLOCKED


def pool_mean_norm(ops: Primitives, norm: nn.Module, x: Tensor) -> Tensor:
    """RMSNorm with the mean of squares as a 4-D global average pool and `rsqrt`."""
    y = x.float()
    d = y.shape[-1]
    ms = (y * y).reshape(1, -1, 1, d).mean((2, 3), keepdim=True)
    y = y * torch.rsqrt(ms.reshape(*y.shape[:-1], 1) + norm.eps)
    if norm.weight is not None:
        y = y * norm.weight.float()
    return y.type_as(x)


def linear_mean_norm(ops: Primitives, norm: nn.Module, x: Tensor) -> Tensor:
    """RMSNorm with the mean of squares as a linear with one output (weights 1/d, bias eps:
    `norm.mean_weight`, `norm.eps_bias`, added by the form): XNNPACK runs it as a plain
    fully-connected op. The static programs are float32, so the reference's casts are
    identities."""
    y = x * torch.rsqrt(F.linear(x * x, norm.mean_weight, norm.eps_bias))
    return y * norm.weight if norm.weight is not None else y


def add_mean_weights(model: nn.Module) -> None:
    """Give every RMSNorm of `model` the constants `linear_mean_norm` reads."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            d = module.dim
            module.register_buffer("mean_weight", torch.full((1, d), 1.0 / d), persistent=False)
            module.register_buffer("eps_bias", torch.tensor([module.eps]), persistent=False)


@torch.library.custom_op("edgemtp_onnx::rms_norm", mutates_args=())
def rms_norm_op(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    y = x.float()
    y = y * torch.rsqrt((y * y).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).type_as(x)


@rms_norm_op.register_fake
def _rms_norm_fake(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.empty_like(x)


def onnx_norm(ops: Primitives, norm: nn.Module, x: Tensor) -> Tensor:
    weight = norm.weight if norm.weight is not None else torch.ones(x.shape[-1])
    return rms_norm_op(x, weight, norm.eps)


def keep_segments(ops: Primitives, past: Segments, new: Tensor) -> Segments:
    return (*past, new)


def attend_segments(
    ops: Primitives, q: Tensor, keys: Segments, values: Segments, mask: Tensor
) -> Tensor:
    """`segment_attention` as [rows, heads * head_dim], what the output projection reads."""
    rows = mask.shape[0]
    return heads_to_rows(segment_attention(q, keys, values, mask, q.shape[1] // rows), rows)


def projections(
    ops: Primitives, attn: nn.Module, x: Tensor, q: bool, kv: bool
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The query, key and value projections of x [T, width each] (not yet normed): columns of
    one product where the form fused them (`attn.qkv`), else one linear each."""
    fused = getattr(attn, "qkv", None)
    if fused is None:
        k = ops.linear(attn.k_proj, x) if kv else None
        v = ops.linear(attn.v_proj, x) if kv and not attn.spec.k_eq_v else k
        return (ops.linear(attn.q_proj, x) if q else None), k, v
    product = ops.linear(fused, x)
    parts, start = [], 0
    for width in fused.widths:
        parts.append(product[..., start : start + width])
        start += width
    return parts[0], parts[1], parts[1] if attn.spec.k_eq_v else parts[2]


def grouped_heads(
    ops: Primitives, attn: nn.Module, x: Tensor, cos: Tensor, sin: Tensor,
    q: bool = True, kv: bool = True,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:  # fmt: skip
    """The reference's heads, queries as [kv_heads, group * T, head_dim] (what
    `segment_attention` reads)."""
    spec = attn.spec
    shape = (x.shape[0], -1, spec.head_dim)
    pq, pk, pv = projections(ops, attn, x, q, kv)
    queries = keys = values = None
    if kv:
        assert pk is not None and pv is not None
        keys = apply_rope(ops.norm(attn.k_norm, pk.view(shape)), cos, sin).transpose(0, 1)
        values = ops.norm(attn.v_norm, pv.view(shape)).transpose(0, 1)
    if q:
        assert pq is not None
        queries = apply_rope(ops.norm(attn.q_norm, pq.view(shape)), cos, sin).transpose(0, 1)
        queries = queries.reshape(spec.num_kv_heads, -1, spec.head_dim)
    return queries, keys, values


def fused_gate_up(ops: Primitives, mlp: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    """Gate and up as the two halves of one product where the form fused them
    (`mlp.gate_up`), else one linear each."""
    fused = getattr(mlp, "gate_up", None)
    if fused is None:
        return ops.linear(mlp.gate_proj, x), ops.linear(mlp.up_proj, x)
    product = ops.linear(fused, x)
    width = fused.widths[0]
    return product[..., :width], product[..., width:]
