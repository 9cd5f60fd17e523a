"""The Core ML form's primitives and weights (`export/forms.py` declares the table).

They change no maths, only how it is spelled, for coremltools' TorchScript frontend and an
all-fp16 program (ANE-friendly):

- every linear with a 4-bit checkpoint form is `ConstexprInt4Linear`: its weight is a custom op
  over OUR codes and scales (`edgemtp::int4_weight`), whose converter emits Core ML's
  `constexpr_blockwise_shift_scale` from the stored codes; coremltools never re-derives them;
- RMSNorm divides by the row's largest magnitude before squaring: x * rsqrt(mean(x^2) + eps) =
  y * rsqrt(mean(y^2) + eps / m^2) with y = x / m. fp16 squares overflow past 256, and Gemma's
  residual stream is known to exceed that;
- the additive mask in the scores' dtype (an fp32 mask would promote fp16 scores to fp32);
- RoPE angles and their sin/cos in fp32 (the fp16 pass skips them), then cast: in fp16 a
  position of 1000 has an ulp of 0.5;
- cache writes as a one-hot matmul + select (`index_copy_` has no Core ML lowering): a slot one
  row targets gets exactly that row (1 * x + 0 * ...); pad rows all target the trash slot,
  which then holds their sum instead of one of them: it is never read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgemtp.errors import EdgeMTPError
from edgemtp.export.memory import spill_module, zero_weight
from edgemtp.export.weights import ZERO_SYMMETRIC, int4_of
from edgemtp.model.primitives import Primitives, Segments, rope_cos_sin

_TRACING_SHAPES_ONLY = False


@contextlib.contextmanager
def tracing_shapes_only() -> Iterator[None]:
    """While a method is traced for conversion, `int4_weight` returns a stand-in of zeros that
    takes no memory, not the weight: the trace records the op, not its values, and each
    dequantized weight (4 bytes a weight, floats nobody reads) left the heap fragmented."""
    global _TRACING_SHAPES_ONLY
    previous, _TRACING_SHAPES_ONLY = _TRACING_SHAPES_ONLY, True
    try:
        yield
    finally:
        _TRACING_SHAPES_ONLY = previous


@torch.library.custom_op("edgemtp::int4_weight", mutates_args=())
def int4_weight(codes: Tensor, scales: Tensor, zeros: Tensor) -> Tensor:
    """(codes - zeros) * scales per group along the input dim, in the scales' dtype (fp16: the
    exact small integer times the fp16 scale, rounded once, as Core ML's constexpr computes).
    codes int8: -8..7 with zeros 0 (symmetric schemes), else 0..15."""
    rows, cols = codes.shape
    if _TRACING_SHAPES_ONLY:
        return zero_weight(rows, cols, scales.dtype)
    # one weight-sized buffer, in place: a 262144-row head's temporaries were GiBs
    w = codes.view(rows, scales.shape[1], -1).to(scales.dtype)
    w.sub_(zeros.to(scales.dtype)[..., None]).mul_(scales[..., None])
    return w.view(rows, cols)


@int4_weight.register_fake
def _int4_weight_fake(codes: Tensor, scales: Tensor, zeros: Tensor) -> Tensor:
    return codes.new_empty(codes.shape, dtype=scales.dtype)


class ConstexprInt4Linear(nn.Module):
    """A linear whose weight is `int4_weight` over its stored codes: every use of the weight
    (the matmul, and the clustered head's gather of LM-head rows) goes through the op, so the
    converter sees codes and scales, never float weights.

    The codes are int8 in the exact form the package stores them (signed for a symmetric
    scheme): coremltools' TorchScript frontend widens every uint8 constant to int32, and any
    other form would be a second copy of the codes while converting."""

    def __init__(self, codes: Tensor, scales: Tensor, zeros: Tensor):
        super().__init__()
        assert codes.dtype == torch.int8
        self.out_features, self.in_features = codes.shape
        self.register_buffer("int4_codes", codes, persistent=False)
        self.register_buffer("int4_scales", scales, persistent=False)
        self.register_buffer("int4_zeros", zeros, persistent=False)

    def __getattr__(self, name: str) -> Any:
        # `weight` is computed on each use, and not a property: TorchScript's tracer reads
        # every attribute `dir` lists, which would dequantize every linear once more
        if name == "weight":
            return int4_weight(self.int4_codes, self.int4_scales, self.int4_zeros)
        return super().__getattr__(name)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)


def coreml_weights(model: nn.Module, dtype: torch.dtype) -> dict[str, Any]:
    """Every linear with a 4-bit form as a `ConstexprInt4Linear` (fp16 scales, exact or
    refused), every other float weight in `dtype` (fp32 to convert: coremltools' fp16 pass
    casts; fp16 for the eager emulation of the program)."""
    count = 0
    for path, module in list(model.named_modules()):
        if isinstance(module, ConstexprInt4Linear):  # a model put in this form before
            module.int4_scales = module.int4_scales.to(dtype)
            count += 1
            continue
        w = int4_of(module) if isinstance(module, nn.Linear) else None
        if w is None:
            continue
        scales = w.scales.to(torch.float16)
        if not torch.equal(scales.float(), w.scales):
            raise EdgeMTPError(
                "a 4-bit group scale is not representable in fp16 (Core ML's scale dtype); "
                "export with --backend executorch or onnx"
            )
        # in place, on the codes just unpacked for this form (a head's copies were GiBs)
        codes, zeros = w.codes.view(torch.int8), w.zeros.to(torch.int8)
        if w.symmetric:
            codes.sub_(ZERO_SYMMETRIC)
            zeros.zero_()
        del w
        parent, _, leaf = path.rpartition(".")
        linear = ConstexprInt4Linear(codes, scales.to(dtype), zeros)
        setattr(model.get_submodule(parent) if parent else model, leaf, linear)
        spill_module(linear)  # while an export is spilling: the codes in a file
        count += 1
    for p in model.parameters():
        if p.dtype.is_floating_point and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return {"int4": count}


def coreml_norm(ops: Primitives, norm: nn.Module, x: Tensor) -> Tensor:
    """RMSNorm in the input's dtype without overflow: y = x / max|x| before squaring."""
    # The floor keeps 1/m finite in fp16; an all-zero row (padding) stays zero.
    inv = 1.0 / x.abs().amax(-1, keepdim=True).clamp_min(2.0**-14)
    y = x * inv
    e = norm.eps**0.5 * inv  # eps / m^2 = e * e, without forming the tiny m^2
    y = y * torch.rsqrt((y * y).mean(-1, keepdim=True) + e * e)
    return y * norm.weight if norm.weight is not None else y


def coreml_attention(
    ops: Primitives, q: Tensor, keys: Segments, values: Segments, mask: Tensor
) -> Tensor:
    """Grouped-query attention as batched matmuls over KV groups, the boolean mask made
    additive in the scores' dtype; q [heads, T, head_dim]."""
    k = keys[0] if len(keys) == 1 else torch.cat(keys, dim=1)
    v = values[0] if len(values) == 1 else torch.cat(values, dim=1)
    t, (kvh, _, hd) = mask.shape[0], k.shape
    group = q.shape[0] // kvh
    scores = torch.bmm(q.reshape(kvh, group * t, hd), k.transpose(1, 2))  # scale 1.0
    additive = torch.zeros_like(mask, dtype=scores.dtype).masked_fill(~mask, float("-inf"))
    scores = scores.view(kvh, group, t, -1) + additive
    probs = torch.softmax(scores, dim=-1).view(kvh, group * t, -1)
    out = torch.bmm(probs, v).view(kvh * group, t, hd)
    return out.transpose(0, 1).reshape(t, -1)


def coreml_rope(
    ops: Primitives, positions: Tensor, inv_freq: Tensor, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """Angles and sin/cos in fp32 (inv_freq stays fp32), cast to the activations' dtype."""
    cos, sin = rope_cos_sin(positions, inv_freq)
    return cos.to(dtype), sin.to(dtype)


def coreml_head_logits(ops: Primitives, lm_head: nn.Module, ids: Tensor, h: Tensor) -> Tensor:
    """Matrix @ column: coremltools cannot convert a matmul with a 1-D right side."""
    return (lm_head.weight[ids] @ h[:, None])[:, 0]


def onehot_scatter(ops: Primitives, buffer: Tensor, slots: Tensor, rows: Tensor) -> None:
    """rows [heads, T, d] into `buffer` slots [T] (a state) through a one-hot matmul + select;
    slice assignment is the one in-place form coremltools turns into a state update."""
    hit = torch.arange(buffer.shape[1])[:, None] == slots[None, :]  # [slots + 1, rows]
    onehot = hit.to(rows.dtype).expand(rows.shape[0], *hit.shape)
    kept = hit.any(1)[None, :, None]
    buffer[:] = torch.where(kept, torch.bmm(onehot, rows), buffer)
