"""The 4-bit weights every backend lowers: one representation for Q4_0 and W4A16.

A loaded model always computes with the dequantized floats of its checkpoint (that is the
reference). `attach_int4` finds, for every `nn.Linear`, the stored 4-bit form of its weight and
hangs it on the module as `linear.int4`; a backend lowering the static graphs then emits its own
4-bit op (XNNPACK 8da4w, ONNX MatMulNBits, Core ML blockwise int4) from exactly these codes and
scales, so the compiled program's weights equal the reference's, value for value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from edgemtp.model.checkpoint import TensorSource
from edgemtp.quantize.q4_0 import BLOCK, Q4_0
from edgemtp.quantize.w4a16 import W4A16

ZERO_SYMMETRIC = 8  # unsigned code of the value 0 in symmetric schemes (Q4_0, symmetric W4A16)


@dataclass(frozen=True, eq=False)
class Int4Weight:
    """w[o, i] = (codes[o, i] - zeros[o, i // group]) * scales[o, i // group], in float32."""

    codes: Tensor  # uint8 [out, in], 0..15
    scales: Tensor  # float32 [out, in // group]; Q4_0's are often negative
    zeros: Tensor  # uint8 [out, in // group], 0..15 (8 for every group of a symmetric scheme)
    group: int
    scheme: str  # "q4_0" or "w4a16"

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    @property
    def symmetric(self) -> bool:
        return bool((self.zeros == ZERO_SYMMETRIC).all())

    def signed_codes(self) -> Tensor:
        """int8 codes - zeros in -15..15 (-8..7 when symmetric) [out, in]."""
        zeros = self.zeros.repeat_interleave(self.group, dim=1)
        return self.codes.to(torch.int8) - zeros.to(torch.int8)

    def dequantize(self) -> Tensor:
        return (
            self.signed_codes().float().view(*self.scales.shape, self.group)
            * self.scales[..., None]
        ).reshape(self.shape)


def int4_weight(q: Q4_0 | W4A16) -> Int4Weight:
    """Q4_0 blocks or W4A16 groups as an `Int4Weight` (same dequantized values)."""
    if isinstance(q, Q4_0):
        scales = q.scales.to(torch.float32)
        zeros = torch.full(scales.shape, ZERO_SYMMETRIC, dtype=torch.uint8)
        return Int4Weight(q.codes.reshape(scales.shape[0], -1), scales, zeros, BLOCK, "q4_0")
    scales = q.scales.to(torch.float32)
    if q.symmetric:
        codes = (q.codes + ZERO_SYMMETRIC).to(torch.uint8)
        zeros = torch.full(scales.shape, ZERO_SYMMETRIC, dtype=torch.uint8)
    else:
        assert q.zero_points is not None
        codes, zeros = q.codes.to(torch.uint8), q.zero_points.to(torch.uint8)
    return Int4Weight(codes, scales, zeros, q.group_size, "w4a16")


@dataclass(frozen=True)
class StoredInt4:
    """Where a linear's 4-bit weight is stored: unpacked into an `Int4Weight` at each
    `int4_of`, so a model's 4-bit weights are never all unpacked at once (1.16 bytes a weight,
    where the memory-mapped checkpoint holds 0.56)."""

    source: TensorSource
    name: str
    scheme: str  # "q4_0" or "w4a16"

    def unpack(self) -> Int4Weight:
        stored = self.source.quantized(self.name)  # type: ignore[attr-defined]
        weight = int4_weight(stored)
        self.source.release_pages()  # read once per form: the mapped pages need not stay
        return weight


def attach_int4(model: nn.Module, source: TensorSource, names: dict[str, str]) -> int:
    """Set `linear.int4` on every linear of `model` whose checkpoint weight is stored in 4 bits
    (`names`: state-dict key -> checkpoint name, as `load_target` returns it): a `StoredInt4`,
    nothing read yet. Returns how many."""
    count = 0
    for path, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        name = names[f"{path}.weight"]
        scheme = source.scheme_4bit(name)
        module.int4 = StoredInt4(source, name, scheme) if scheme else None  # type: ignore[assignment]
        count += scheme is not None
    return count


def int4_of(linear: nn.Module) -> Int4Weight | None:
    """The 4-bit form `attach_int4` found for a linear, if any, unpacked from the checkpoint."""
    stored = getattr(linear, "int4", None)
    return stored.unpack() if stored is not None else None


def int4_counts(*models: nn.Module) -> dict[str, int]:
    """How many linears of the models lower to each 4-bit scheme. A W4A16 checkpoint's tied LM
    head is usually Q4_0 (it is the token table), so a bundle may hold both."""
    counts: dict[str, int] = {}
    for model in models:
        for module in model.modules():
            if (stored := getattr(module, "int4", None)) is not None:
                counts[stored.scheme] = counts.get(stored.scheme, 0) + 1
    return dict(sorted(counts.items()))
