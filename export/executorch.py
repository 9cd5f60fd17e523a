"""ExecuTorch backend of `edgemtp export`: every static method in one `model.pte`.

Delegates:
- `cpu`: XNNPACK. Linears whose checkpoint weight is 4-bit run as XNNPACK's "8da4w" kernel
  (int8 dynamic activations, int4 weights) built from *our* codes and scales (never
  re-quantized by torchao). XNNPACK's blockwise int4 format has no zero
  points and rejects negative or zero scales, so a block whose scale is negative (Q4_0 has
  many: d = max / -8) or whose zero point is not 8 (asymmetric W4A16) is written exactly as
  codes' * |s| + offset, the offset being one constant per block; the program adds
  offset * (sum of the block's activations) with a small fp32 linear pair (block sums as a
  1-output linear over the input's blocks, then the [out, G] offsets). Linears of one
  module that read the same input (Q/K/V, gate/up) run as one such linear. With edgemtp's
  kernels (`--attention kernel`), a Q4_0 linear's decode, verify and draft steps run in
  `edgemtp::q4_0_linear` instead, over the checkpoint's blocks as they are: one
  operator where XNNPACK needs five (benchmarks/README.md); a down or per-layer input
  projection takes its GELU gate too (`edgemtp::q4_0_gated_linear`), so gate and up stay two
  kernel calls there rather than one fused linear. Other linears stay fp32. The
  assistant's clustered head gathers LM-head rows by token id (no linear can do that): from
  the int4 codes when there are some, dequantized exactly in fp32.
- `metal` / `npu`: Core ML through ExecuTorch's Core ML delegate (compute units CPU_AND_GPU /
  CPU_AND_NE).
- `htp`: Qualcomm QNN, when the QNN SDK is installed.

The norms are swapped to a form whose mean is a 1-output linear (no `mean.dim`, which XNNPACK
only runs as an NHWC global pooling between two transposes); see `lower.py` for why that also
makes lowering several times faster. With edgemtp's kernels, a step's layer norms and the
residual adds after them run in `edgemtp::rms_norm` / `edgemtp::add_rms_norm` instead: between
two kernels each group of them was an XNNPACK delegate call of its own (`KernelRMSNorm`); and
the q/k/v heads are normed and rotated in `edgemtp::head_norm_rope`, straight from the fused
Q/K/V product (`KernelAttention`).
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgemtp.errors import EdgeMTPError
from edgemtp.export.bundle import Lowered, Progress
from edgemtp.export.exportable import (
    KERNEL_CACHE_DTYPE,
    KERNEL_MAX_ROWS,
    ArithmeticMaskDrafter,
    ArithmeticMaskTarget,
    ExportAttention,
    ExportRMSNorm,
    KernelAttention,
    make_exportable,
)
from edgemtp.export.lower import (
    backend_config,
    delegation_summary,
    export_method,
    lower_programs,
    static_partitioner,
    xnnpack_partitioner,
)
from edgemtp.export.static import StaticBundle, method_kind
from edgemtp.export.weights import Int4Weight, int4_of
from edgemtp.model.gemma4 import ClusteredHead, Gemma4Drafter, Gemma4Target, in_prompt_chunk
from edgemtp.quantize.q4_0 import BLOCK, Q4_0, nibbles_q4_0

PROGRAM = "model.pte"
COREML_UNITS = {"metal": "CPU_AND_GPU", "npu": "CPU_AND_NE"}
QNN_MISSING = (
    "--delegate htp needs Qualcomm AI Engine Direct (QNN) SDK: install it and set QNN_SDK_ROOT "
    "(or use --delegate cpu)"
)
CLUSTERED_HEAD = "masked_embedding"  # module path of the drafter's clustered head


# --- XNNPACK forms ---------------------------------------------------------------------------


class LinearMeanRMSNorm(ExportRMSNorm):
    """RMSNorm whose mean of squares is a linear with one output (weights 1/d): XNNPACK runs it
    as a plain fully-connected op, where `mean.dim` needs an NHWC pooling between transposes.
    The static programs are float32, so the dtype casts of the reference are identities."""

    mean_weight: Tensor
    eps_bias: Tensor

    def forward(self, x: Tensor) -> Tensor:
        ms = F.linear(x * x, self.mean_weight, self.eps_bias)  # + eps as the bias: one op less
        y = x * torch.rsqrt(ms)
        return y * self.weight if self.weight is not None else y


HEAD_NORMS = ("q_norm", "k_norm", "v_norm")


class KernelRMSNorm(LinearMeanRMSNorm):
    """The norms of decode, verify and draft steps in edgemtp's kernel (`edgemtp::rms_norm`),
    and the residual add after a norm in one call (`added`, `edgemtp::add_rms_norm`): between
    two of edgemtp's kernels each group of norms was an XNNPACK delegate call of its own. Prompt
    chunks keep the XNNPACK form, inside the delegate of their linears."""

    def _kernel_call(self, x: Tensor) -> bool:
        return x.dim() >= 2 and x.shape[0] <= KERNEL_MAX_ROWS and not in_prompt_chunk()

    def forward(self, x: Tensor) -> Tensor:
        if self._kernel_call(x):
            return torch.ops.edgemtp.rms_norm(x, self.weight, self.eps)
        return super().forward(x)

    def added(self, h: Tensor, y: Tensor, scale: Tensor | None) -> Tensor:
        """(h + self(y)) [* scale] (`model.gemma4.add_normed`)."""
        if self.weight is not None and self._kernel_call(y):
            return torch.ops.edgemtp.add_rms_norm(h, y, self.weight, scale, self.eps)
        out = h + self(y)
        return out if scale is None else out * scale


def _block_form(w: Int4Weight) -> tuple[Tensor, Tensor, Tensor | None]:
    """(signed codes int8 [out, in], positive scales f32 [out, G], offsets f32 [out, G] or
    None) with w = codes * scales + offset per block, exactly:

    s > 0: (c - z) s = (c - 8) s + (8 - z) s;  s < 0: (c - z) s = (7 - c)|s| + (z - 7)|s|;
    s = 0: codes 0, scale 1 (XNNPACK wants normal scales), offset 0."""
    out, n_in = w.shape
    c = w.codes.to(torch.int16).view(out, -1, w.group)
    z = w.zeros.to(torch.int16)[..., None]
    s = w.scales.float()
    pos, neg = (s > 0)[..., None], (s < 0)[..., None]
    codes = torch.where(pos, c - 8, torch.where(neg, 7 - c, torch.zeros_like(c)))
    offset = torch.where(pos, 8 - z, torch.where(neg, z - 7, torch.zeros_like(z)))[..., 0]
    offset = offset.float() * s.abs()
    scales = torch.where(s == 0, torch.ones_like(s), s.abs())
    codes = codes.view(out, n_in).to(torch.int8)
    return codes, scales, (offset if bool((offset != 0).any()) else None)


def _import_torchao_ops() -> None:
    """Register torch.ops.torchao (dequantize_affine) without torchao's import-time warnings
    about its optional CUDA kernels, which cannot load on a CPU build of torch."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.quantization.quant_primitives  # noqa: F401
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


class Int4Linear(nn.Module):
    """A bias-free linear computing with 4-bit codes through the quantize/dequantize op patterns
    XNNPACK and Core ML lower: w = (codes - zeros) * scales per block of `group`.

    `dynamic_int8`: quantize the activations to int8 per row first (XNNPACK's 8da4w);
    otherwise weight-only (float activations). `offset` [out, G]: per-block constants added
    as offset * (block sum of x), in fp32 from the unquantized activations."""

    def __init__(
        self,
        codes: Tensor,
        scales: Tensor,
        zeros: Tensor,
        group: int,
        offset: Tensor | None = None,
        dynamic_int8: bool = True,
    ):
        super().__init__()
        import torch.ao.quantization.fx._decomposed  # noqa: F401  (torch.ops.quantized_decomposed)

        _import_torchao_ops()

        self.out_features, self.in_features = codes.shape
        self.group, self.dynamic_int8 = group, dynamic_int8
        self.codes = nn.Parameter(codes.to(torch.int8), requires_grad=False)
        self.scales = nn.Parameter(scales.float(), requires_grad=False)
        self.zeros = nn.Parameter(zeros.to(torch.int8), requires_grad=False)
        self.offset: nn.Parameter | None = None
        if offset is not None:
            # Block sums as a 1-output linear over the input viewed as [..., G, group]: a dense
            # [G, in] 0/1 matrix did the same with in²/32 fp32 weights, read at every call (an
            # E2B down projection's 18.9 MB, more than its int4 codes).
            self.block_ones = nn.Parameter(torch.ones(1, group), requires_grad=False)
            self.offset = nn.Parameter(offset.float(), requires_grad=False)
        # The same weight as GGML Q4_0 blocks, for calls of a few rows (`with_q4_0_kernel`)
        self.nibbles: nn.Parameter | None = None
        self.half_scales: nn.Parameter | None = None

    def with_q4_0_kernel(self, nibbles: Tensor, half_scales: Tensor) -> Int4Linear:
        """Also keep the weight as Q4_0 blocks (`nibbles_q4_0`'s bytes, float16 scales): decode,
        verify and draft steps (up to KERNEL_MAX_ROWS rows: one numerics for AR and MTP, so
        speculation stays lossless) then run edgemtp's Q4_0 kernel (`edgemtp::q4_0_linear`:
        signed scales, no offset pair, llama.cpp's Q8_0 activations), prompt chunks
        (`in_prompt_chunk`) XNNPACK's 8da4w GEMM, whatever their rows."""
        self.nibbles = nn.Parameter(nibbles, requires_grad=False)
        self.half_scales = nn.Parameter(half_scales, requires_grad=False)
        return self

    @classmethod
    def xnnpack(cls, w: Int4Weight, q4_0_kernel: bool = False) -> Int4Linear:
        """8da4w from the checkpoint's codes, in XNNPACK's form (see `_block_form`); with
        `q4_0_kernel`, a weight that is Q4_0 (symmetric, blocks of 32, float16 scales) also
        runs a few rows in edgemtp's Q4_0 kernel."""
        codes, scales, offset = _block_form(w)
        linear = cls(codes, scales, torch.zeros_like(scales, dtype=torch.int8), w.group, offset)
        half = w.scales.half()
        if (
            q4_0_kernel
            and w.group == BLOCK
            and w.symmetric
            and bool((half.float() == w.scales).all())
        ):
            q = Q4_0(scales=half, codes=w.codes, shape=w.shape)
            linear.with_q4_0_kernel(nibbles_q4_0(q), half)
        return linear

    @classmethod
    def weight_only(cls, w: Int4Weight) -> Int4Linear:
        """The checkpoint's codes, scales and zero points as they are (signed), float
        activations: Core ML turns this into its blockwise int4 constant."""
        codes = w.codes.to(torch.int16) - 8
        zeros = w.zeros.to(torch.int16) - 8
        return cls(codes, w.scales, zeros, w.group, dynamic_int8=False)

    def _kernel_call(self, x: Tensor) -> bool:
        """Whether a call on `x` runs in edgemtp's Q4_0 kernel (see `with_q4_0_kernel`)."""
        few = x.numel() <= KERNEL_MAX_ROWS * self.in_features
        return self.nibbles is not None and few and not in_prompt_chunk()

    def gated(self, gate: Tensor, up: Tensor) -> Tensor:
        """self(gelu_tanh(gate) * up) (`model.gemma4.gated_projection`): one kernel call where
        the kernel runs, the gate formed as it quantizes the rows."""
        if self._kernel_call(gate):
            return torch.ops.edgemtp.q4_0_gated_linear(gate, up, self.nibbles, self.half_scales)
        return self(F.gelu(gate, approximate="tanh") * up)

    def forward(self, x: Tensor) -> Tensor:
        if self._kernel_call(x):
            return torch.ops.edgemtp.q4_0_linear(x, self.nibbles, self.half_scales)
        if x.dim() == 1:  # activations are quantized per row of a matrix
            return self.forward(x[None])[0]
        if not self.dynamic_int8:
            xq = x
            w = torch.ops.torchao.dequantize_affine(
                self.codes, [1, self.group], self.scales, self.zeros, torch.int8, -8, 7
            )
        elif torch.compiler.is_exporting():
            # The pattern XNNPACK replaces by its 8da4w kernel. quantized_decomposed ops, not
            # torchao's affine ones: these have meta kernels, where a torchao op runs its whole
            # Python implementation on fake tensors at every re-trace (a third of the lowering).
            qd = torch.ops.quantized_decomposed
            scale, zero = qd.choose_qparams_per_token_asymmetric(x, torch.int8)
            q = qd.quantize_per_token(x, scale, zero, -128, 127, torch.int8)
            xq = qd.dequantize_per_token(q, scale, zero, -128, 127, torch.int8, torch.float32)
            w = qd.dequantize_per_channel_group(
                self.codes, self.scales, self.zeros, -8, 7, torch.int8, self.group, torch.float32
            )
        else:  # eager: what the XNNPACK kernel computes, rounding included
            xq = xnnpack_int8_rows(x)
            w = self.codes.float().view(*self.scales.shape, -1) * bf16(self.scales)[..., None]
            w = w.view(self.out_features, self.in_features)
        y = F.linear(xq, w)
        if self.offset is not None:
            sums = F.linear(x.reshape(*x.shape[:-1], -1, self.group), self.block_ones)
            y = y + F.linear(sums.view(*x.shape[:-1], -1), self.offset)
        return y


def bf16(t: Tensor) -> Tensor:
    """The float32 values of `t` rounded to bfloat16 (XNNPACK's blockwise scales)."""
    return t.bfloat16().float()


def xnnpack_int8_rows(x: Tensor) -> Tensor:
    """XNNPACK's dynamic int8 quantization of each row of x (float32), dequantized: range
    [min(x, 0), max(x, 0)], scale = range / 255, zero point from XNNPACK's quantization.h
    (rounded), q = clamp(round_half_even(x * (255 / range)) + zero point). Checked bit for bit
    against the XNNPACK kernel in the tests."""
    lo = x.amin(-1, keepdim=True).clamp(max=0.0)
    hi = x.amax(-1, keepdim=True).clamp(min=0.0)
    span = hi - lo
    flat = span == 0
    scale = torch.where(flat, torch.ones_like(span), span / 255.0)
    # a true division: `255.0 / t` would compute reciprocal(t) * 255, one ulp off at times
    inv = torch.where(flat, 1.0, torch.full_like(span, 255.0) / torch.where(flat, 1.0, span))
    lo_s, hi_s = lo / scale, hi / scale
    zero = torch.where((-128.0 + lo_s) + (127.0 + hi_s) > 0, -128.0 - lo_s, 127.0 - hi_s)
    zero = zero.clamp(-128.0, 127.0).round()
    q = (torch.round(x * inv) + zero).clamp(-128.0, 127.0)
    return (q - zero) * scale


class Int4ClusteredHead(ClusteredHead):
    """The clustered head over a 4-bit LM head: the whole vocabulary through that head's 4-bit
    linear, then the kept clusters' logits picked by token id.

    Gathering the kept rows instead would read fewer weights, but ExecuTorch delegates no gather
    and converts the gathered int8 codes to fp32 with a portable kernel: 0.42 ms of a 0.79 ms
    draft step for 512 rows of 256, where XNNPACK's int4 linear over all 8192 rows takes about
    0.05 ms (benchmarks/README.md, the embedded demo). At E2B's 262144 x 256 head, by the same
    rates, the linear (67 M MACs, ~1.5 ms) still costs less than converting and summing the
    4096 kept rows (~3 ms)."""

    linear: Int4Linear

    def forward(self, h: Tensor, lm_head_weight: Tensor) -> tuple[Tensor, Tensor]:
        top = torch.topk(self.centroids(h), self.top_k).indices
        ids = self.token_ordering.view(-1, self.tokens_per_centroid)[top].reshape(-1)
        return ids, self.linear(h)[ids]


# Linears of one module that read the same input, fused into one 8da4w linear each: per
# owning attention layer Q, K and V; per MLP gate and up. Not gate and up where the Q4_0 kernel
# runs the steps: the down projection takes them apart (`Int4Linear.gated`), and cutting
# their columns out of one product would put a delegate call between the kernels.
QKV_LINEARS = ("q_proj", "k_proj", "v_proj")
SHARED_INPUT_LINEARS = (QKV_LINEARS, ("gate_proj", "up_proj"))


class FusedInt4Linear(Int4Linear):
    """Int4 linears that read the same input, as one: their rows stacked, so XNNPACK runs one
    activation quantization, one int4 GEMM and one offset pair instead of one each (with the
    norm and GELU forms, 1787 -> 1560 operators per PEER-90M decode step, which is 5 % faster:
    benchmarks/README.md). Exact: the activations are quantized per row, the same for every
    output. Each part asks for the same `x` (the one tensor the parent module passes them all)
    and gets its columns of one product, computed on the first ask."""

    def __init__(self, parts: list[Int4Linear]):
        offsets = [p.offset if p.offset is not None else torch.zeros_like(p.scales) for p in parts]
        super().__init__(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scales for p in parts]),
            torch.cat([p.zeros for p in parts]),
            parts[0].group,
            torch.cat(offsets) if any(p.offset is not None for p in parts) else None,
            parts[0].dynamic_int8,
        )
        if all(p.nibbles is not None for p in parts):
            self.with_q4_0_kernel(
                torch.cat([p.nibbles for p in parts]), torch.cat([p.half_scales for p in parts])
            )
        self._last: tuple[Tensor, Tensor] | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self._last is None or self._last[0] is not x:
            self._last = (x, super().forward(x))
        return self._last[1]


class Int4Columns(nn.Module):
    """Columns [start, end) of a `FusedInt4Linear`'s product (held unregistered: its weights
    belong to the module that owns the fused linear)."""

    def __init__(self, fused: FusedInt4Linear, start: int, end: int):
        super().__init__()
        self.__dict__["fused"] = fused
        self.start, self.end = start, end
        self.out_features, self.in_features = end - start, fused.in_features

    def forward(self, x: Tensor) -> Tensor:
        return self.fused(x)[..., self.start : self.end]


def fuse_shared_input_linears(
    model: nn.Module, groups: tuple[tuple[str, ...], ...] = SHARED_INPUT_LINEARS
) -> int:
    """Fuse (in place) the members of each of `groups` that a module has, when there are two
    or more and all are 8da4w linears (a KV-shared layer has only Q; a layer whose values are
    its keys has Q and K). Returns how many linears were folded."""
    folded = 0
    for module in list(model.modules()):
        for group in groups:
            names = [n for n in group if getattr(module, n, None) is not None]
            parts = [getattr(module, n) for n in names]
            if len(parts) < 2 or not all(
                type(p) is Int4Linear and p.dynamic_int8 and p.group == parts[0].group
                for p in parts
            ):
                continue
            fused = FusedInt4Linear(parts)
            module.register_module("_".join(n.removesuffix("_proj") for n in names), fused)
            start = 0
            for name, part in zip(names, parts, strict=True):
                setattr(module, name, Int4Columns(fused, start, start + part.out_features))
                start += part.out_features
            folded += len(parts)
    return folded


def _norm_dim(model: nn.Module, path: str, norm: nn.Module) -> int:
    """The normalized size of an RMSNorm: its weight's, or the head size for the scale-free
    value norm of an attention block."""
    if norm.weight is not None:
        return int(norm.weight.shape[0])
    parent = model.get_submodule(path.rpartition(".")[0])
    spec = getattr(parent, "spec", None)
    if path.endswith("v_norm") and spec is not None:
        return int(spec.head_dim)
    raise EdgeMTPError(f"cannot tell the size of the scale-free norm {path}")


def swap_int4(model: nn.Module, make: Callable[[Int4Weight], Int4Linear], role: str = "") -> dict:
    """Swap (in place) every linear of `model` that has a 4-bit form to `make(weight)`, and a
    clustered head over a 4-bit LM head to `Int4ClusteredHead`. Works on the reference models
    too, so the reference engine can run a program's numerics. Returns what was converted."""
    stats: dict[str, Any] = {"int4": {}, "offset_blocks": 0, "float_linears": [], "head": None}
    stats.update(scales=0, bf16_rounded=0)
    head = getattr(model, CLUSTERED_HEAD, None)
    clustered = isinstance(head, ClusteredHead)
    if clustered:
        w = int4_of(model.lm_head)
        stats["head"] = "fp32 rows gathered"
        if w is not None:
            head.__class__ = Int4ClusteredHead
            head.linear = make(w)
            stats["head"] = f"int4 {w.scheme} linear over the vocabulary, kept logits picked"
    for path, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or (clustered and path == "lm_head"):
            continue  # a clustered head reads its LM head through its own linear
        w = int4_of(module)
        if w is None:
            stats["float_linears"].append(f"{role}.{path}" if role else path)
            continue
        parent_path, _, leaf = path.rpartition(".")
        q = make(w)
        setattr(model.get_submodule(parent_path) if parent_path else model, leaf, q)
        stats["int4"][w.scheme] = stats["int4"].get(w.scheme, 0) + 1
        scales = w.scales.float()
        stats["scales"] += scales.numel()
        stats["bf16_rounded"] += int((scales.bfloat16().float() != scales).sum())
        if q.offset is not None:
            stats["offset_blocks"] += int((q.offset != 0).sum())
    return stats


def xnnpack_forms(model: nn.Module, role: str = "", attention: str = "kernel") -> dict[str, Any]:
    """Swap `model` (in place) to what the XNNPACK program computes: export forms of norms and
    attention (`attention`: "kernel", edgemtp's ExecuTorch kernel for few rows, or "matmul",
    XNNPACK's batched matmuls), the norm mean as a linear, 8da4w linears. On a loaded reference
    model this makes the reference engine compute the program's numerics in eager PyTorch."""
    make_exportable(model)
    if attention == "kernel":  # what the kernel reads: a reference engine keeps its cache so too
        model.kv_cache_dtype = KERNEL_CACHE_DTYPE
    for path, module in list(model.named_modules()):
        if type(module) is ExportAttention and attention == "kernel":
            module.__class__ = KernelAttention
        if type(module) is Gemma4Target:
            module.__class__ = ArithmeticMaskTarget
        elif type(module) is Gemma4Drafter:
            module.__class__ = ArithmeticMaskDrafter
        elif type(module) is ExportRMSNorm:
            d = _norm_dim(model, path, module)
            # q/k/v norms: a step's run inside edgemtp::head_norm_rope (KernelAttention), so
            # these modules serve prompt chunks only, in XNNPACK with their RoPE and slices
            head_norm = path.rsplit(".", 1)[-1] in HEAD_NORMS
            kernel = attention == "kernel" and not head_norm
            module.__class__ = KernelRMSNorm if kernel else LinearMeanRMSNorm
            module.register_buffer("mean_weight", torch.full((1, d), 1.0 / d), persistent=False)
            module.register_buffer("eps_bias", torch.tensor([module.eps]), persistent=False)
    stats = swap_int4(model, partial(Int4Linear.xnnpack, q4_0_kernel=attention == "kernel"), role)
    groups = (QKV_LINEARS,) if attention == "kernel" else SHARED_INPUT_LINEARS
    stats["fused_linears"] = fuse_shared_input_linears(model, groups)
    stats["q4_0_kernel_linears"] = sum(
        isinstance(m, Int4Linear) and m.nibbles is not None for m in model.modules()
    )
    # What the program stores: one fp32 offset per block of every linear that has any (a
    # dense [out, blocks] matrix, positive blocks' zeros included), read at every call.
    stats["offset_values"] = sum(
        m.offset.numel()
        for m in model.modules()
        if isinstance(m, Int4Linear) and m.offset is not None
    )
    return stats


def _bundle_models(static: StaticBundle) -> list[tuple[str, nn.Module]]:
    models: list[tuple[str, nn.Module]] = [("target", static.target.target)]
    if static.drafter is not None:
        models.append(("drafter", static.drafter.drafter))
    return models


def prepare_xnnpack(static: StaticBundle, attention: str = "kernel") -> dict[str, Any]:
    """Swap the bundle's models (in place) to the forms XNNPACK lowers: 8da4w linears, the
    int4 clustered head, linear-mean norms, the attention (`xnnpack_forms`). Returns what was
    converted."""
    if attention == "kernel":
        # The kernel reads a bucket's slots off the whole buffers, in float16: half the bytes
        # of every attended key (the prefill chunks' matmuls widen the slots they read).
        static.cache.attention_reads_prefix = True
        static.cache.use_dtype(KERNEL_CACHE_DTYPE)
    total: dict[str, Any] = {}
    for role, model in _bundle_models(static):
        stats = xnnpack_forms(model, role, attention)
        for key, value in stats.items():
            if key == "int4":
                for scheme, n in value.items():
                    total.setdefault("int4", {})[scheme] = total.get("int4", {}).get(scheme, 0) + n
            elif key == "head":
                total["head"] = total.get("head") or value
            else:
                total[key] = total.get(key, type(value)()) + value
    total.setdefault("int4", {})
    total["attention"] = attention
    return total


# --- lowering --------------------------------------------------------------------------------


def lower_executorch(
    static: StaticBundle,
    delegate: str,
    out_dir: Path,
    progress: Progress,
    attention: str = "kernel",
) -> Lowered:
    """Lower every method of `static` into `out_dir/model.pte` for `delegate` (`attention`:
    the cpu delegate's, see `xnnpack_forms`)."""
    cpu = partial(_lower_xnnpack, attention=attention)
    lower = {"cpu": cpu, "htp": _lower_qnn}.get(delegate)
    if lower is None and delegate in COREML_UNITS:
        lower = partial(_lower_coreml, delegate=delegate)
    if lower is None:
        raise EdgeMTPError(
            f"--backend executorch has no '{delegate}' delegate (choose cpu, metal, npu or htp)"
        )
    with warnings.catch_warnings():
        # torch's pytree deprecations and ExecuTorch's note on mutable buffers, once per node
        # and pass: thousands of lines that say nothing about this export
        warnings.simplefilter("ignore", FutureWarning)
        warnings.filterwarnings("ignore", message="Mutation on a buffer")
        return lower(static, out_dir=Path(out_dir), progress=progress)


def _export_all(static: StaticBundle, progress: Progress) -> dict[str, Any]:
    programs = {}
    for name, (module, inputs) in static.methods().items():
        start = time.perf_counter()
        programs[name] = export_method(module, inputs)
        nodes = len(programs[name].graph.nodes)
        progress(f"trace {name}: {nodes} nodes ({time.perf_counter() - start:.1f}s)")
    return programs


# What each method takes and returns (static.py): names for the manifest.
INPUT_NAMES = {"draft_step": ["token_embed", "hidden", "position"]}
TARGET_INPUTS = ["embeds", "token_ple", "positions"]
OUTPUT_NAMES = {
    "prefill_intermediate": ["cache_length"],
    "prefill_final": ["hidden", "logits"],
    "verify": ["logits", "hidden"],
    "draft_step": ["hidden", "token_ids", "logits"],
}


def method_io(programs: dict[str, Any]) -> dict[str, Any]:
    """Each method's inputs and outputs as the program sees them: [name, shape, dtype]. The
    cache is internal (shared buffers), so these are exactly the logical inputs and outputs."""

    def describe(name: str, node: Any) -> list[Any]:
        val = node.meta["val"]
        return [name, list(val.shape), str(val.dtype).removeprefix("torch.")]

    out: dict[str, Any] = {}
    for method, program in programs.items():
        sig = program.graph_signature
        nodes = {n.name: n for n in program.graph.nodes}
        kind = method_kind(method)
        names, inputs = OUTPUT_NAMES.get(kind, []), INPUT_NAMES.get(kind, TARGET_INPUTS)
        outputs = [str(n) for n in sig.user_outputs]
        out[method] = {
            "inputs": [
                describe(inputs[i] if i < len(inputs) else n, nodes[n])
                for i, n in enumerate(sig.user_inputs)
            ],
            "outputs": [
                describe(names[i] if i < len(names) else n, nodes[n]) for i, n in enumerate(outputs)
            ],
        }
    return out


# XNNPACK nodes that run a matmul: each costs a kernel set-up and a thread-pool dispatch (the
# profile's `dispatch_us`); the elementwise and shape nodes around them cost far less
# (`node_us`).
XNNPACK_MATMUL_NODES = ("XNNFullyConnected", "XNNBatchMatrixMultiply")
PORTABLE_CALL = "portable"


def program_operators(program: Any) -> dict[str, int]:
    """Operators each method of an ExecuTorch `Program` dispatches per call: its portable
    kernel calls, plus inside each XNNPACK delegate the nodes of its XNNPACK graph (read from
    the delegate's flatbuffer); another delegate counts one. This is what a per-operator
    dispatch cost multiplies: the edge graph has ~40 % more nodes (quantize/dequantize pairs,
    views, getitems) that never run."""
    return {name: sum(kinds.values()) for name, kinds in program_operator_kinds(program).items()}


def program_kernels(program: Any, namespace: str = "") -> list[str]:
    """The operators (`ns::name.overload`) whose kernels an ExecuTorch `Program` calls."""
    return sorted(
        {
            f"{op.name}.{op.overload}" if op.overload else op.name
            for plan in program.execution_plan
            for op in plan.operators
            if op.name.startswith(namespace)
        }
    )


def program_operator_kinds(program: Any) -> dict[str, dict[str, int]]:
    """`program_operators` by kind: method -> {XNNPACK node type ("XNNFullyConnected", ...),
    "portable" (kernel calls), or another delegate's id: count}."""
    import json
    import tempfile
    from collections import Counter

    from executorch.backends.xnnpack.serialization.xnnpack_graph_serialize import (
        XNNHeader,
        _get_schema_bytes,
    )
    from executorch.exir._serialize._flatbuffer import _flatc_decompile

    counted: dict[int, Counter[str]] = {}
    out: dict[str, dict[str, int]] = {}
    with tempfile.TemporaryDirectory() as folder:
        schema = Path(folder) / "schema.fbs"
        schema.write_bytes(_get_schema_bytes())
        for plan in program.execution_plan:
            kinds: Counter[str] = Counter()
            for chain in plan.chains:
                for instruction in chain.instructions:
                    kind = type(instruction.instr_args).__name__
                    if kind == "KernelCall":
                        kinds[PORTABLE_CALL] += 1
                    elif kind == "DelegateCall":
                        delegate = plan.delegates[instruction.instr_args.delegate_index]
                        if delegate.id != "XnnpackBackend":
                            kinds[delegate.id] += 1
                            continue
                        index = delegate.processed.index
                        if index not in counted:
                            blob = program.backend_delegate_data[index].data
                            header = XNNHeader.from_bytes(blob[: XNNHeader.EXPECTED_LENGTH])
                            start = header.flatbuffer_offset
                            graph = Path(folder) / f"graph{index}.bin"
                            graph.write_bytes(blob[start : start + header.flatbuffer_size])
                            _flatc_decompile(folder, str(schema), str(graph), ["--raw-binary"])
                            parsed = json.loads(graph.with_suffix(".json").read_text())
                            counted[index] = Counter(
                                str(node["xnode_union_type"]) for node in parsed.get("xnodes", [])
                            )
                        kinds.update(counted[index])
            out[plan.name] = dict(sorted(kinds.items()))
    return out


def _lower_xnnpack(
    static: StaticBundle, out_dir: Path, progress: Progress, attention: str = "kernel"
) -> Lowered:
    start = time.perf_counter()
    stats = prepare_xnnpack(static, attention)
    programs = _export_all(static, progress)
    io = method_io(programs)
    t = time.perf_counter()
    partitioners: list[Any] = []

    def fresh() -> list[Any]:
        partitioners.append(xnnpack_partitioner())
        return partitioners[-1:]

    edge = lower_programs(programs, fresh, progress)
    progress(f"lower {len(programs)} methods to XNNPACK ({time.perf_counter() - t:.1f}s)")
    summary = delegation_summary(edge, exempt=(CLUSTERED_HEAD,))
    full = {k: v for p in partitioners for k, v in p.full_pipeline.items()}
    t = time.perf_counter()
    manager = edge.to_executorch(backend_config())
    for name, kinds in program_operator_kinds(manager.executorch_program).items():
        summary[name]["runtime_ops"] = sum(kinds.values())
        summary[name]["runtime_op_kinds"] = kinds
    data = manager.buffer
    (out_dir / PROGRAM).write_bytes(data)
    progress(f"emit {PROGRAM}: {len(data) / 2**20:.1f} MiB ({time.perf_counter() - t:.1f}s)")
    delegates = sum(m["delegates"] for m in summary.values())
    portable = sum(m["portable_nodes"] for m in summary.values())
    progress(
        f"XNNPACK: {delegates} delegates, {sum(stats['int4'].values())} 8da4w linears, "
        f"{portable} portable ops left (cache writes, masks, lookups); "
        f"{time.perf_counter() - start:.1f}s in all"
    )
    details = {
        "delegate": "XNNPACK",
        "delegation": summary,
        "int4_linears": stats["int4"],
        "offset_blocks": stats["offset_blocks"],
        "offset_values": stats["offset_values"],
        "fused_linears": stats.get("fused_linears", 0),
        "q4_0_kernel_linears": stats.get("q4_0_kernel_linears", 0),
        "float_linears": stats["float_linears"],
        "full_xnnpack_pipeline": full,  # partition tag -> op that needed every XNNPACK pass
        # edgemtp's own kernels the program calls (runtime/kernels): a runner must load them
        "kernels": program_kernels(manager.executorch_program, "edgemtp::"),
    }
    return Lowered(
        files=[PROGRAM],
        program=PROGRAM,
        numerics=xnnpack_numerics(stats),
        details=details,
        method_io=io,
    )


def xnnpack_numerics(stats: dict[str, Any]) -> dict[str, str]:
    """What the XNNPACK program computes, as converted by `prepare_xnnpack`."""
    schemes = stats["int4"]
    out: dict[str, str] = {}
    if schemes:
        rounded = stats["bf16_rounded"]
        scales = [
            "block scales as bf16 (XNNPACK's blockwise int4 format): "
            + (
                f"{rounded} of {stats['scales']} scales were not bf16 values and are rounded "
                "(relative weight error <= 2^-9)"
                if rounded
                else f"all {stats['scales']} scales are bf16 values, so the weights are exact"
            )
        ]
        out["weights"] = (
            f"{sum(schemes.values())} linears ({', '.join(f'{n} {s}' for s, n in schemes.items())})"
            f": the checkpoint's int4 codes, group 32, as XNNPACK blockwise int4 (8da4w); "
            + "; ".join(scales)
        )
        out["activations"] = (
            "int8 dynamic, asymmetric, one scale and zero point per row (token), computed by "
            "XNNPACK at run time: scale = (max(x,0) - min(x,0)) / 255; never 16-bit"
        )
        out["accumulation"] = "int32 per 32-block, times the block scale, summed in fp32"
        if stats.get("fused_linears"):
            out["fused"] = (
                f"{stats['fused_linears']} linears that read one input (Q/K/V, gate/up) run as "
                "one int4 linear per input; the same codes, scales and rounding (exact)"
            )
        if stats.get("q4_0_kernel_linears"):
            out["q4_0_kernel"] = (
                f"{stats['q4_0_kernel_linears']} Q4_0 linears run decode, verify and draft "
                f"steps (up to {KERNEL_MAX_ROWS} rows) in edgemtp's kernel "
                "(edgemtp::q4_0_linear, llama.cpp's numerics): the checkpoint's blocks as they "
                "are (codes, signed fp16 scales; no offset pair), the activations rounded to "
                "Q8_0 (per block of 32, d = max|x| / 127), int32 block sums times scale * d, "
                "summed in fp32; the down and per-layer input projections form their input "
                "gelu_tanh(gate) * up in the kernel (edgemtp::q4_0_gated_linear, fp32, exp "
                "within 2 ulp) before rounding it; prompt chunks as 8da4w below"
            )
        if stats["offset_blocks"]:
            out["offsets"] = (
                f"{stats['offset_blocks']} blocks with a negative scale or a zero point other "
                "than 8 are stored as codes' * |scale| + offset (exact); the offset times the "
                "block's activation sum is added in fp32 from the unquantized activations"
            )
        if stats["float_linears"]:
            out["float_linears"] = (
                f"{len(stats['float_linears'])} linears without a 4-bit form stay fp32 "
                f"(e.g. {stats['float_linears'][0]})"
            )
    else:
        out["weights"] = "fp32 (as loaded)"
        out["activations"] = "fp32"
        out["accumulation"] = "fp32"
    if stats.get("attention") == "kernel":
        out["kv_cache"] = (
            "float16 K/V; decode, verify and draft attention in edgemtp's kernel (fp32 math, "
            "a call's own new keys rounded to float16 as they will be stored), prefill chunks "
            "in XNNPACK's fp32 batched matmuls over the widened slots"
        )
    if stats["head"]:
        out["drafter_head"] = f"clustered head: {stats['head']}"
    out["norms"] = "RMSNorm mean of squares as a 1-output fp32 linear (weights 1/d, bias eps)"
    if stats.get("attention") == "kernel":
        out["norms"] = (
            f"decode, verify and draft steps (up to {KERNEL_MAX_ROWS} rows): the layer norms "
            "and the residual add after each (times the layer scalar after the last) in "
            "edgemtp's kernels (edgemtp::rms_norm, edgemtp::add_rms_norm; fp32, the mean of "
            "squares summed in 16 partial sums); the q/k/v head norms with their RoPE in "
            "edgemtp::head_norm_rope, read from the fused Q/K/V product; prompt chunks' norms "
            "as a 1-output fp32 linear (weights 1/d, bias eps) in XNNPACK"
        )
    out["cache"] = "fp32 K/V, shared in place by every method"
    return out


def _lower_coreml(
    static: StaticBundle, out_dir: Path, progress: Progress, delegate: str
) -> Lowered:
    """Core ML delegate: each method's supported subgraphs become Core ML models (fp16 compute,
    iOS 18 / macOS 15 target for int4 blockwise weights) inside the .pte; the cache stays an
    ExecuTorch buffer shared by every method (Core ML states are per model, and whether two
    functions may share one can only be checked on Apple hardware)."""
    try:
        import coremltools as ct
        from executorch.backends.apple.coreml.compiler import CoreMLBackend
        from executorch.backends.apple.coreml.partition import CoreMLPartitioner
    except ImportError as e:
        raise EdgeMTPError(
            f"--delegate {delegate} needs coremltools and ExecuTorch's Core ML backend ({e}): "
            "pip install coremltools (or use --delegate cpu)"
        ) from e
    start = time.perf_counter()
    counts: dict[str, int] = {}
    for _, model in _bundle_models(static):
        for scheme, n in swap_int4(model, Int4Linear.weight_only)["int4"].items():
            counts[scheme] = counts.get(scheme, 0) + n
    programs = _export_all(static, progress)
    io = method_io(programs)
    units = COREML_UNITS[delegate]
    specs = CoreMLBackend.generate_compile_specs(
        compute_unit=ct.ComputeUnit[units],
        minimum_deployment_target=ct.target.iOS18,
        compute_precision=ct.precision.FLOAT16,
    )

    def partitioners() -> list[Any]:
        inner = CoreMLPartitioner(
            compile_specs=specs,
            take_over_mutable_buffer=False,
            # the cache writes stay ExecuTorch ops on the shared buffer (and coremltools 9
            # cannot convert these index_put patterns)
            skip_ops_for_coreml_delegation=["aten.index_put.default", "aten.index_copy.default"],
        )
        return [static_partitioner(inner)]

    t = time.perf_counter()
    edge = lower_programs(programs, partitioners, progress)
    progress(f"lower {len(programs)} methods to Core ML {units} ({time.perf_counter() - t:.1f}s)")
    summary = delegation_summary(edge, exempt=(CLUSTERED_HEAD,), backend="Core ML")
    data = edge.to_executorch(backend_config()).buffer
    (out_dir / PROGRAM).write_bytes(data)
    progress(f"emit {PROGRAM}: {len(data) / 2**20:.1f} MiB ({time.perf_counter() - start:.1f}s)")
    n4 = sum(counts.values())
    numerics = {
        "weights": (
            f"{n4} linears: the checkpoint's int4 codes and zero points as Core ML blockwise "
            "int4 constants (exact); scales stored fp16 by the FLOAT16 precision (exact for "
            "Q4_0, and for bf16 W4A16 scales inside fp16's normal range)"
            if n4
            else "fp32 as loaded, stored fp16 by Core ML"
        ),
        "activations": "fp16 (Core ML compute precision FLOAT16)",
        "accumulation": f"fp16 on {'the GPU' if delegate == 'metal' else 'the Neural Engine'}",
        "cache": "fp32 ExecuTorch buffer shared by every method, cast to fp16 inside Core ML",
        "runs_on": "macOS 15+ / iOS 18+ with ExecuTorch's Core ML backend (not on Linux)",
    }
    return Lowered(
        files=[PROGRAM],
        program=PROGRAM,
        numerics=numerics,
        details={"delegate": f"Core ML {units}", "delegation": summary, "int4_linears": counts},
        method_io=io,
    )


def qnn_sdk() -> Path:
    """The QNN SDK root, or EdgeMTPError: QNN_SDK_ROOT must point at an installed SDK, and
    ExecuTorch's compiled QNN adaptor must import."""
    root = os.environ.get("QNN_SDK_ROOT")
    if not root or not (Path(root) / "lib").is_dir():
        raise EdgeMTPError(QNN_MISSING)
    try:
        import executorch.backends.qualcomm.python.PyQnnManagerAdaptor  # noqa: F401
    except ImportError as e:
        raise EdgeMTPError(QNN_MISSING) from e
    return Path(root)


def _lower_qnn(static: StaticBundle, out_dir: Path, progress: Progress) -> Lowered:
    """QNN HTP in fp16 (the int4 weights are dequantized: QNN's 4-bit weights come from its own
    calibrating quantizer, which would not keep the checkpoint's values). The SoC comes from
    EDGEMTP_QNN_SOC (default SM8650)."""
    qnn_sdk()
    from executorch.backends.qualcomm.utils.utils import (
        generate_htp_compiler_spec,
        generate_qnn_executorch_compiler_spec,
        get_soc_to_chipset_map,
        to_edge_transform_and_lower_to_qnn,
    )

    from edgemtp.export.lower import _TanhGelu

    soc = os.environ.get("EDGEMTP_QNN_SOC", "SM8650")
    chipsets = get_soc_to_chipset_map()
    if soc not in chipsets:
        raise EdgeMTPError(f"EDGEMTP_QNN_SOC={soc} is not a known SoC ({', '.join(chipsets)})")
    specs = generate_qnn_executorch_compiler_spec(
        soc_model=chipsets[soc], backend_options=generate_htp_compiler_spec(use_fp16=True)
    )
    methods = static.methods()
    start = time.perf_counter()
    with torch.no_grad(), _TanhGelu():
        edge = to_edge_transform_and_lower_to_qnn(
            {name: module.requires_grad_(False) for name, (module, _) in methods.items()},
            {name: inputs for name, (_, inputs) in methods.items()},
            specs,
            skip_mutable_buffer=True,  # the cache stays one ExecuTorch buffer for every method
        )
    progress(f"lower {len(methods)} methods to QNN HTP {soc} ({time.perf_counter() - start:.1f}s)")
    data = edge.to_executorch(backend_config()).buffer
    (out_dir / PROGRAM).write_bytes(data)
    return Lowered(
        files=[PROGRAM],
        program=PROGRAM,
        numerics={
            "weights": "fp16 (int4 weights dequantized to fp16)",
            "activations": "fp16",
            "accumulation": "fp16 on the Hexagon HTP",
            "cache": "fp32 ExecuTorch buffer shared by every method",
        },
        details={
            "delegate": f"QNN HTP {soc}",
            "delegation": delegation_summary(edge, exempt=(CLUSTERED_HEAD,), backend="QNN"),
        },
        method_io={},
    )
