"""Every backend form, declared: which primitive each concept of the model body lowers to.

One table a form (or two, where a backend runs prompt chunks in other kernels than decode, verify
and draft steps), each listing what differs from the reference (`model/primitives.py`), and the
`prepare` that stores the weights as the form computes with them. `form_for` picks the form of a
backend and delegate; `StaticBundle.use_form` applies it.

- reference: float32 RMSNorm, float linears, SDPA over the concatenated cache, boolean masks;
- export (ONNX's base, ExecuTorch's Core ML and QNN delegates): 4-D pooled-mean norms, linears
  as loaded, attention over segments in batched matmuls, additive masks (`where`);
- onnx: export, norms as one `SimplifiedLayerNormalization` (the tracer lowers the linears:
  MatMulNBits or Q/DQ);
- xnnpack: 1-output-linear-mean norms, 8da4w linears with Q/K/V and gate/up fused, attention
  over segments, additive masks by arithmetic;
- xnnpack with edgemtp's kernels: steps in `edgemtp::rms_norm` / `add_rms_norm`,
  `q4_0_linear` (Q/K/V fused), `head_norm_rope` and `cache_attention_rows` over a float16
  cache (or fp32, or int8 rows written by `quantize_kv_rows`, which prompt chunks' attention
  reads in the kernel too), the slot bookkeeping in `truncate_positions` / `ring_positions`;
  prompt chunks as xnnpack's, gate and up apart (their bookkeeping in the kernels too);
- coreml: overflow-safe fp16 norms, blockwise int4 constants, attention over the concatenated
  cache with the additive mask in fp16, one-hot cache writes, the cache as states.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from edgemtp.errors import EdgeMTPError
from edgemtp.export.coreml_forms import (
    coreml_attention,
    coreml_head_logits,
    coreml_norm,
    coreml_rope,
    coreml_weights,
    onehot_scatter,
)
from edgemtp.export.int4 import GATE_UP, QKV, Int4Linear, fuse_linears, to_int4_linears
from edgemtp.export.primitives import (
    add_mean_weights,
    arithmetic_mask,
    attend_segments,
    fused_gate_up,
    grouped_heads,
    keep_segments,
    linear_mean_norm,
    onnx_norm,
    pool_mean_norm,
    where_mask,
)
from edgemtp.model.cache import KV_CACHE_DTYPES
from edgemtp.model.primitives import EVERY_CACHE_DTYPE, Form, Primitives, Segments, gelu_tanh
from edgemtp.runtime.kernels.ops import KERNEL_MAX_ROWS, cache_attention_rows

# --- edgemtp's kernels, where a step's rows are few ------------------------------------------


def kernel_norm(ops: Primitives, norm: nn.Module, x: Tensor) -> Tensor:
    if x.dim() >= 2 and x.shape[0] <= KERNEL_MAX_ROWS:
        return torch.ops.edgemtp.rms_norm(x, norm.weight, norm.eps)
    return linear_mean_norm(ops, norm, x)


def kernel_add_norm(
    ops: Primitives, h: Tensor, norm: nn.Module, y: Tensor, scale: Tensor | None = None
) -> Tensor:
    """(h + norm(y)) [* scale] in one call: between two kernels each group of norms and adds
    was an XNNPACK delegate call of its own."""
    if norm.weight is not None and y.dim() >= 2 and y.shape[0] <= KERNEL_MAX_ROWS:
        return torch.ops.edgemtp.add_rms_norm(h, y, norm.weight, scale, norm.eps)
    out = h + ops.norm(norm, y)
    return out if scale is None else out * scale


def _runs_q4_0_kernel(linear: nn.Module, x: Tensor) -> bool:
    few = x.numel() <= KERNEL_MAX_ROWS * getattr(linear, "in_features", 0)
    return isinstance(linear, Int4Linear) and linear.nibbles is not None and few


def kernel_linear(ops: Primitives, linear: nn.Module, x: Tensor) -> Tensor:
    """The checkpoint's Q4_0 blocks as they are (signed scales, no offset pair), the
    activations rounded to Q8_0, as llama.cpp computes them: one operator where XNNPACK's
    blockwise int4 needs several. Other weights as the chunks compute them."""
    if _runs_q4_0_kernel(linear, x):
        return torch.ops.edgemtp.q4_0_linear(x, linear.nibbles, linear.half_scales)
    return linear(x)


def kernel_gated_linear(ops: Primitives, linear: nn.Module, gate: Tensor, up: Tensor) -> Tensor:
    """The down and per-layer input projections form gelu_tanh(gate) * up in the kernel."""
    if _runs_q4_0_kernel(linear, gate):
        return torch.ops.edgemtp.q4_0_gated_linear(gate, up, linear.nibbles, linear.half_scales)
    return ops.linear(linear, gelu_tanh(gate) * up)


def kernel_heads(
    ops: Primitives, attn: nn.Module, x: Tensor, cos: Tensor, sin: Tensor,
    q: bool = True, kv: bool = True,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:  # fmt: skip
    """Each head normed and rotated in one kernel call (`edgemtp::head_norm_rope`), read straight
    from the (fused) Q/K/V product where it starts: no slice between the two."""
    if x.shape[0] > KERNEL_MAX_ROWS:
        return grouped_heads(ops, attn, x, cos, sin, q, kv)
    spec = attn.spec
    hd, kvh = spec.head_dim, spec.num_kv_heads
    fused = getattr(attn, "qkv", None)
    if fused is not None:
        product = ops.linear(fused, x)
        starts = [0, fused.widths[0], fused.widths[0] + fused.widths[1]]
        sources = {
            "q": (product, starts[0], fused.widths[0]),
            "k": (product, starts[1], fused.widths[1]),
            "v": (product, starts[1] if spec.k_eq_v else starts[2], fused.widths[1]),
        }
    else:
        sources = {}
        if kv:
            k = ops.linear(attn.k_proj, x)
            v = k if spec.k_eq_v else ops.linear(attn.v_proj, x)
            sources["k"] = (k, 0, k.shape[-1])
            sources["v"] = (v, 0, v.shape[-1])
        if q:
            queries = ops.linear(attn.q_proj, x)
            sources["q"] = (queries, 0, queries.shape[-1])

    def normed(which: str, norm: nn.Module, rotate: bool) -> Tensor:
        full, start, width = sources[which]
        return torch.ops.edgemtp.head_norm_rope(
            full, start // hd, width // hd, kvh, hd, norm.weight,
            cos if rotate else None, sin if rotate else None, norm.eps,
        )  # fmt: skip

    keys = normed("k", attn.k_norm, True) if kv else None
    values = normed("v", attn.v_norm, False) if kv else None
    queries = normed("q", attn.q_norm, True) if q else None
    return queries, keys, values


def kernel_attention(
    ops: Primitives, q: Tensor, keys: Segments, values: Segments, mask: Tensor
) -> Tensor:
    """Attention in `edgemtp::cache_attention_rows`: it reads only the cache slots some row
    attends to (the mask's width: a context bucket's) and writes the output projection's
    layout; calls of many rows in its eager form, XNNPACK's batched matmuls."""
    own = (keys[1], values[1]) if len(keys) == 2 else (None, None)
    # many rows: XNNPACK's batched matmuls over the widened cache, but an int8 cache's rows
    # are read by the kernel alone (widened in standard ops they would run op by op)
    if mask.shape[0] > KERNEL_MAX_ROWS and keys[0].dtype != torch.int8:
        return cache_attention_rows(q, keys[0], values[0], *own, mask)
    return torch.ops.edgemtp.cache_attention_rows(q, keys[0], values[0], *own, mask)


def kernel_scatter(ops: Primitives, buffer: Tensor, slots: Tensor, rows: Tensor) -> None:
    """An int8 cache's rows quantized in `edgemtp::quantize_kv_rows`, then written."""
    if buffer.dtype == torch.int8:
        rows = torch.ops.edgemtp.quantize_kv_rows(rows)
    buffer.index_copy_(1, slots, rows.to(buffer.dtype))


def kernel_truncated(ops: Primitives, slot_pos: Tensor, at: Tensor) -> Tensor:
    return torch.ops.edgemtp.truncate_positions(slot_pos, at)


def kernel_ring_positions(ops: Primitives, kept: Tensor, positions: Tensor, slots: int) -> Tensor:
    return torch.ops.edgemtp.ring_positions(kept, positions, slots)


def int4_head_logits(ops: Primitives, lm_head: nn.Module, ids: Tensor, h: Tensor) -> Tensor:
    """An int4 LM head: only the kept tokens' rows, gathered as 4-bit codes and dequantized
    (`Int4Linear.rows`) outside the delegates; a float one: the kept rows gathered."""
    if isinstance(lm_head, Int4Linear):
        return lm_head.rows(ids) @ h
    return lm_head.weight[ids] @ h


def kernel_head_logits(ops: Primitives, lm_head: nn.Module, ids: Tensor, h: Tensor) -> Tensor:
    """The kept tokens' Q4_0 blocks gathered, then the Q4_0 kernel over them alone: each
    output row is computed as the whole head's would be."""
    if isinstance(lm_head, Int4Linear) and lm_head.nibbles is not None:
        nibbles, scales = lm_head.nibbles.index_select(0, ids), lm_head.half_scales[ids]
        return torch.ops.edgemtp.q4_0_linear(h[None], nibbles, scales)[0]
    return int4_head_logits(ops, lm_head, ids, h)


# --- the tables ----------------------------------------------------------------------------------


class Export(Primitives):
    """Static programs in standard ops: ONNX's base, ExecuTorch's Core ML and QNN delegates."""

    norm = pool_mean_norm
    heads = grouped_heads
    extend = keep_segments
    attention = attend_segments
    mask = where_mask


class ExportInt4Head(Export):
    """ExecuTorch's Core ML delegate: int4 weight-only linears, the clustered head through its
    int4 linear."""

    head_logits = int4_head_logits


class Onnx(Export):
    norm = onnx_norm


class Xnnpack(Primitives):
    """XNNPACK: every op delegated (the linear-mean norm, arithmetic masks, fused 8da4w
    linears)."""

    norm = linear_mean_norm
    gate_up = fused_gate_up
    heads = grouped_heads
    extend = keep_segments
    attention = attend_segments
    mask = arithmetic_mask
    head_logits = int4_head_logits


class XnnpackKernelChunk(Primitives):
    """Prompt chunks of a bundle with edgemtp's kernels: XNNPACK's GEMMs, the attention over
    the float16 cache (widened), gate and up apart (the steps' kernel takes them apart)."""

    norm = linear_mean_norm
    heads = grouped_heads
    extend = keep_segments
    attention = kernel_attention
    mask = arithmetic_mask
    head_logits = int4_head_logits
    scatter = kernel_scatter
    truncated = kernel_truncated
    ring_positions = kernel_ring_positions


class XnnpackKernelStep(Primitives):
    """Decode, verify and draft steps of a bundle with edgemtp's kernels."""

    norm = kernel_norm
    add_norm = kernel_add_norm
    linear = kernel_linear
    gated_linear = kernel_gated_linear
    heads = kernel_heads
    extend = keep_segments
    attention = kernel_attention
    mask = arithmetic_mask
    head_logits = kernel_head_logits
    scatter = kernel_scatter
    truncated = kernel_truncated
    ring_positions = kernel_ring_positions


class CoreML(Primitives):
    norm = coreml_norm
    attention = coreml_attention
    rope = coreml_rope
    head_logits = coreml_head_logits
    scatter = onehot_scatter


# --- how each form stores the weights ------------------------------------------------------------


def xnnpack_weights(model: nn.Module, kernels: bool) -> dict[str, Any]:
    """8da4w linears from the checkpoint's codes (with `kernels`, Q4_0 weights also keep their
    blocks for the kernel), fused where they read one input, the norms' mean constants."""
    add_mean_weights(model)
    stats = to_int4_linears(model, partial(Int4Linear.xnnpack, q4_0_blocks=kernels))
    # Not gate and up where the kernel runs the steps: the down projection takes them apart,
    # and cutting their columns out of one product would put a delegate call between kernels.
    groups = {"qkv": QKV} if kernels else {"qkv": QKV, "gate_up": GATE_UP}
    stats["fused_linears"] = fuse_linears(model, groups)
    linears = [m for m in model.modules() if isinstance(m, Int4Linear)]
    stats["q4_0_kernel_linears"] = sum(m.nibbles is not None for m in linears)
    # What the program stores: one fp32 offset per block of every linear that has any (a
    # dense [out, blocks] matrix, positive blocks' zeros included), read at every call.
    stats["offset_values"] = sum(m.offset.numel() for m in linears if m.offset is not None)
    return stats


def int4_weight_only(model: nn.Module) -> dict[str, Any]:
    return to_int4_linears(model, Int4Linear.weight_only)


REFERENCE = Primitives()
EXPORT = Form("export", Export(), Export())
QNN = EXPORT
COREML_DELEGATE = Form("executorch-coreml", ExportInt4Head(), ExportInt4Head(), int4_weight_only)
ONNX = Form("onnx", Onnx(), Onnx())
XNNPACK = Form("xnnpack", Xnnpack(), Xnnpack(), partial(xnnpack_weights, kernels=False))
XNNPACK_KERNELS = Form(
    "xnnpack+edgemtp-kernels",
    step=XnnpackKernelStep(),
    chunk=XnnpackKernelChunk(),
    prepare=partial(xnnpack_weights, kernels=True),
    cache_dtype=torch.float16,  # half the cache's bytes; the kernel widens what it reads
    cache_dtypes=EVERY_CACHE_DTYPE,
    reads_cache_prefix=True,
)
COREML = Form(
    "coreml", CoreML(), CoreML(), partial(coreml_weights, dtype=torch.float32),
    cache_as_states=True,
)  # fmt: skip
# The Core ML program's numerics in eager torch: weights, activations and cache in fp16.
COREML_FP16 = Form(
    "coreml-fp16", CoreML(), CoreML(), partial(coreml_weights, dtype=torch.float16),
    cache_dtype=torch.float16, cache_dtypes=(torch.float16,), cache_as_states=True,
)  # fmt: skip


def form_for(
    backend: str, delegate: str, kernels: str = "edgemtp", kv_cache: str | None = None
) -> Form:
    """The form a backend and delegate's program computes in; `kernels` (ExecuTorch cpu):
    "edgemtp", edgemtp's kernels for the steps, or "xnnpack", XNNPACK alone; `kv_cache`
    (`KV_CACHE_DTYPES`): the cache's dtype, where the form's attention reads it (refused
    otherwise), else the form's own."""
    if backend == "onnx":
        form = ONNX
    elif backend == "coreml":
        form = COREML
    elif delegate == "cpu":
        form = XNNPACK_KERNELS if kernels == "edgemtp" else XNNPACK
    else:
        form = COREML_DELEGATE if delegate in ("metal", "npu") else QNN
    if kv_cache is None:
        return form
    dtype = KV_CACHE_DTYPES[kv_cache]
    if dtype not in form.cache_dtypes:
        kinds = [k for k, d in KV_CACHE_DTYPES.items() if d in form.cache_dtypes]
        raise EdgeMTPError(
            f"--kv-cache {kv_cache}: a {backend}/{delegate} bundle's attention reads its cache "
            f"as {' or '.join(kinds)} only (its own ops take float K/V); only ExecuTorch cpu "
            "with edgemtp's kernels (--kernels edgemtp) reads int8 K/V: drop --kv-cache or "
            "export that"
        )
    return replace(form, cache_dtype=dtype, name=f"{form.name}, {kv_cache} KV cache")
