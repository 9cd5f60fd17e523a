"""The ONNX form's RMSNorm: one op while tracing, so it becomes one ONNX node
(`SimplifiedLayerNormalization`: one fused kernel on the CPU EP, QNN's RmsNorm on the HTP, and no
rsqrt tensor whose range, 1/sqrt(eps) on zero pad rows, would ruin its int16 scale)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from edgemtp.model.primitives import Primitives


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
