"""How ExecuTorch programs hold the checkpoint's 4-bit linears, and what each form computes.

`Int4Linear` keeps *our* codes and scales (never re-quantized by torchao) in the op patterns
XNNPACK and Core ML lower: w = (codes - zeros) * scales per block. Its forward is XNNPACK's
"8da4w" (int8 dynamic activations, int4 weights) or, weight-only, float activations (ExecuTorch's
Core ML delegate). XNNPACK's blockwise int4 has no zero points and rejects negative or zero
scales, so a block whose scale is negative (Q4_0 has many: d = max / -8) or whose zero point is
not 8 (asymmetric W4A16) is written exactly as codes' * |s| + offset, one constant per block; the
program adds offset * (the block's activation sum) with a small fp32 linear pair. A Q4_0 weight
may also keep its blocks as they are (`q4_0_blocks`) for edgemtp's Q4_0 kernel, which the kernel
form runs decode, verify and draft steps in (`export/forms.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgemtp.export.memory import spill_module
from edgemtp.export.weights import Int4Weight, int4_of
from edgemtp.quantize.q4_0 import BLOCK, Q4_0, nibbles_q4_0

CLUSTERED_HEAD = "masked_embedding"  # module path of the drafter's clustered head
_FORM_ROWS = 4096  # rows of a weight `_block_form` converts at a time


def _block_form(w: Int4Weight) -> tuple[Tensor, Tensor, Tensor | None]:
    """(signed codes int8 [out, in], positive scales f32 [out, G], offsets f32 [out, G] or
    None) with w = codes * scales + offset per block, exactly:

    s > 0: (c - z) s = (c - 8) s + (8 - z) s;  s < 0: (c - z) s = (7 - c)|s| + (z - 7)|s|;
    s = 0: codes 0, scale 1 (XNNPACK wants normal scales), offset 0.

    Converted `_FORM_ROWS` rows at a time: a whole 262144-row head's int16 temporaries would
    take gigabytes at once."""
    out, n_in = w.shape
    codes = torch.empty(out, n_in, dtype=torch.int8)
    scales = torch.empty(w.scales.shape, dtype=torch.float32)
    offset = torch.empty_like(scales)
    for r in range(0, out, _FORM_ROWS):
        rows = slice(r, r + _FORM_ROWS)
        c = w.codes[rows].to(torch.int16).view(-1, n_in // w.group, w.group)
        z = w.zeros[rows].to(torch.int16)[..., None]
        s = w.scales[rows].float()
        pos, neg = (s > 0)[..., None], (s < 0)[..., None]
        signed = torch.where(pos, c - 8, torch.where(neg, 7 - c, torch.zeros_like(c)))
        codes[rows] = signed.view(-1, n_in)
        shift = torch.where(pos, 8 - z, torch.where(neg, z - 7, torch.zeros_like(z)))[..., 0]
        offset[rows] = shift.float() * s.abs()
        scales[rows] = torch.where(s == 0, torch.ones_like(s), s.abs())
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


class Int4Linear(nn.Module):
    """A bias-free linear over 4-bit codes: w = (codes - zeros) * scales per block of `group`,
    plus `offset` [out, G] per block times the block's activation sum (in fp32, from the
    unquantized activations). `dynamic_int8`: the activations quantized to int8 per row first
    (XNNPACK's 8da4w); otherwise weight-only. `widths`: where the linears of one input were
    fused into this one, each part's output columns."""

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
        self.widths: tuple[int, ...] = (self.out_features,)
        self.codes = nn.Parameter(codes.to(torch.int8), requires_grad=False)
        self.scales = nn.Parameter(scales.float(), requires_grad=False)
        self.zeros = nn.Parameter(zeros.to(torch.int8), requires_grad=False)
        self.offset: nn.Parameter | None = None
        if offset is not None:
            # Block sums as a 1-output linear over the input viewed as [..., G, group]: a dense
            # [G, in] 0/1 matrix did the same with in²/32 fp32 weights, read at every call.
            self.block_ones = nn.Parameter(torch.ones(1, group), requires_grad=False)
            self.offset = nn.Parameter(offset.float(), requires_grad=False)
        # The same weight as GGML Q4_0 blocks (`nibbles_q4_0`'s bytes, float16 scales), for the
        # Q4_0 kernel; None where the weight is not Q4_0 or the form does not run the kernel.
        self.nibbles: nn.Parameter | None = None
        self.half_scales: nn.Parameter | None = None

    def keep_q4_0_blocks(self, nibbles: Tensor, half_scales: Tensor) -> Int4Linear:
        self.nibbles = nn.Parameter(nibbles, requires_grad=False)
        self.half_scales = nn.Parameter(half_scales, requires_grad=False)
        return self

    @classmethod
    def xnnpack(cls, w: Int4Weight, q4_0_blocks: bool = False) -> Int4Linear:
        """8da4w from the checkpoint's codes, in XNNPACK's form (see `_block_form`); with
        `q4_0_blocks`, a weight that is Q4_0 (symmetric, blocks of 32, float16 scales) also
        keeps its blocks for the Q4_0 kernel."""
        codes, scales, offset = _block_form(w)
        linear = cls(codes, scales, torch.zeros_like(scales, dtype=torch.int8), w.group, offset)
        half = w.scales.half()
        if (
            q4_0_blocks
            and w.group == BLOCK
            and w.symmetric
            and bool((half.float() == w.scales).all())
        ):
            q = Q4_0(scales=half, codes=w.codes, shape=w.shape)
            linear.keep_q4_0_blocks(nibbles_q4_0(q), half)
        return linear

    @classmethod
    def weight_only(cls, w: Int4Weight) -> Int4Linear:
        """The checkpoint's codes, scales and zero points as they are (signed), float
        activations: Core ML turns this into its blockwise int4 constant."""
        codes = w.codes.to(torch.int16) - 8
        zeros = w.zeros.to(torch.int16) - 8
        return cls(codes, w.scales, zeros, w.group, dynamic_int8=False)

    @classmethod
    def fused(cls, parts: list[Int4Linear]) -> Int4Linear:
        """The linears of one input as one: rows stacked, so XNNPACK runs one activation
        quantization, one int4 GEMM and one offset pair instead of one each. Exact: the
        activations are quantized per row, the same for every output."""
        offsets = [p.offset if p.offset is not None else torch.zeros_like(p.scales) for p in parts]
        fused = cls(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scales for p in parts]),
            torch.cat([p.zeros for p in parts]),
            parts[0].group,
            torch.cat(offsets) if any(p.offset is not None for p in parts) else None,
            parts[0].dynamic_int8,
        )
        fused.widths = tuple(p.out_features for p in parts)
        if all(p.nibbles is not None for p in parts):
            fused.keep_q4_0_blocks(
                torch.cat([p.nibbles for p in parts]), torch.cat([p.half_scales for p in parts])
            )
        return fused

    def rows(self, ids: Tensor) -> Tensor:
        """The float weight of output rows `ids` [n, in], dequantized from their gathered
        codes: a clustered head needs only its kept tokens' rows."""
        codes = self.codes.index_select(0, ids).float().view(len(ids), -1, self.group)
        w = (codes - self.zeros[ids].float()[..., None]) * self.scales[ids][..., None]
        if self.offset is not None:
            w = w + self.offset[ids][..., None]
        return w.view(len(ids), self.in_features)

    def forward(self, x: Tensor) -> Tensor:
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
            # Python implementation on fake tensors at every re-trace of the lowering.
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


def to_int4_linears(model: nn.Module, make: Callable[[Int4Weight], Int4Linear]) -> dict[str, Any]:
    """Replace (in place) every linear of `model` that has a 4-bit form by `make(weight)`.
    Returns what was converted; a clustered head's LM head is counted apart (`head`)."""
    stats: dict[str, Any] = {"int4": {}, "offset_blocks": 0, "float_linears": [], "head": None}
    stats.update(scales=0, bf16_rounded=0)
    clustered = getattr(model, CLUSTERED_HEAD, None) is not None
    if clustered:
        stats["head"] = "fp32 rows gathered"
    # By path, not a list of the modules: each replaced linear, and the 4-bit weight it
    # carries, is freed as soon as its form is built (all held at once doubled the peak).
    paths = [path for path, module in model.named_modules() if isinstance(module, nn.Linear)]
    for path in paths:
        w = int4_of(model.get_submodule(path))
        if w is None:
            stats["float_linears"].append(path)
            continue
        parent_path, _, leaf = path.rpartition(".")
        q = make(w)
        setattr(model.get_submodule(parent_path) if parent_path else model, leaf, q)
        if clustered and path == "lm_head":
            stats["head"] = f"int4 {w.scheme} rows, the kept ones gathered"
        else:
            stats["int4"][w.scheme] = stats["int4"].get(w.scheme, 0) + 1
            scales = w.scales.float()
            stats["scales"] += scales.numel()
            stats["bf16_rounded"] += int((scales.bfloat16().float() != scales).sum())
            if q.offset is not None:
                stats["offset_blocks"] += int((q.offset != 0).sum())
        spill_module(q)  # counted first: the counts would read the spilled pages back
    return stats


QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


def fuse_linears(model: nn.Module, groups: dict[str, tuple[str, ...]]) -> int:
    """Fuse (in place) the members of each group (fused name -> member names) a module has into
    one `Int4Linear` registered under the fused name, the members set to None, when there are
    two or more and all are 8da4w linears of one group size (a KV-shared layer has only Q; a
    layer whose values are its keys has Q and K). Returns how many linears were folded."""
    folded = 0
    for module in list(model.modules()):
        for fused_name, group in groups.items():
            names = [n for n in group if getattr(module, n, None) is not None]
            parts = [getattr(module, n) for n in names]
            if len(parts) < 2 or not all(
                type(p) is Int4Linear and p.dynamic_int8 and p.group == parts[0].group
                for p in parts
            ):
                continue
            fused = Int4Linear.fused(parts)
            spill_module(fused)
            module.register_module(fused_name, fused)
            for name in names:
                setattr(module, name, None)
            folded += len(parts)
    return folded
