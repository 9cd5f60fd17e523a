"""W4A16: 4-bit group-wise integer weights, 16-bit activations.

The definitions are those of compressed-tensors / llm-compressor for
`num_bits=4, type=int, strategy=group` (round to nearest, min-max per group), so that weights we
quantize and weights we import from a "pack-quantized" checkpoint dequantize to exactly what
compressed-tensors computes:

    symmetric:   scale = max(|min|, |max|) / 7.5            q = clamp(round(x / scale), -8, 7)
    asymmetric:  scale = (max - min) / 15                   q = clamp(round(x / scale + zp), -8, 7)
                 zp = round(clamp(-8 - min / scale, -8, 7))
    dequantized: (q - zp) * scale

with min <= 0 <= max (zero is always representable), round half to even, and a scale of zero
replaced by the scale dtype's eps. Arithmetic runs in the weight's dtype, as compressed-tensors
does. We store symmetric codes signed (-8..7, zero point 0) and asymmetric codes and zero points
unsigned (0..15, i.e. compressed-tensors' signed values + 8); `(codes - zero_points) * scales`
dequantizes both.

The "pack-quantized" layout stores, per layer:
    weight_packed      int32 [out, ceil(in / 8)]  q + 8 along the input, element 8k + j in bits
                                                  4j..4j+3 of word k (low nibble first)
    weight_scale       [out, in / group_size]     in the checkpoint's dtype
    weight_zero_point  int32 [ceil(out / 8), in / group_size]  asymmetric only: zp + 8 packed
                                                  the same way but along the *output* dim
    weight_shape       int [2]                    (out, in)
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from edgemtp.errors import EdgeMTPError, malformed_input

FORMAT = "pack-quantized"
QMIN, QMAX = -8, 7  # compressed-tensors' signed int4 range; packed nibbles hold q + 8
_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_PRESETS = {"W4A16": True, "W4A16_ASYM": False}  # preset name -> symmetric (group 128)


@dataclass(frozen=True, eq=False)
class W4A16:
    """One weight matrix in 4-bit groups along its input dimension."""

    codes: torch.Tensor  # int8 [out, in]: -8..7 if symmetric, else 0..15
    scales: torch.Tensor  # [out, in // group_size], float16/bfloat16/float32
    zero_points: torch.Tensor | None  # int8 [out, in // group_size], 0..15; None if symmetric
    group_size: int
    symmetric: bool

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)


@dataclass(frozen=True)
class W4A16Scheme:
    """The weight part of one `config_groups` entry that we support."""

    group_size: int
    symmetric: bool = True
    targets: tuple[str, ...] = ("Linear",)


@dataclass(frozen=True)
class PackQuantizedConfig:
    """A checkpoint's `quantization_config`, reduced to what decides each module's scheme."""

    groups: tuple[tuple[str, W4A16Scheme], ...]
    ignore: tuple[str, ...] = ()

    def scheme_for(
        self, module_name: str, class_names: Sequence[str] = ("Linear",)
    ) -> W4A16Scheme | None:
        """The scheme compressed-tensors applies to this module, or None if it stays dense.

        `class_names` are the module's class and base-class names (class targets such as
        "Linear" match them). Precedence is compressed-tensors': `ignore` first, then exact
        names, then "re:" patterns (re.match, anchored at the start), then class names.
        """
        if any(_target_matches(module_name, t, class_names) for t in self.ignore):
            return None
        by_target: dict[str, W4A16Scheme] = {}
        for _, scheme in self.groups:
            for target in scheme.targets:
                by_target[target] = scheme  # a later group wins a repeated target
        ordered = sorted(by_target, key=lambda t: ("re:" in t, t))
        hits = [t for t in ordered if _name_matches(module_name, t)]
        hits += [t for t in ordered if t in class_names and t not in hits]
        return by_target[hits[0]] if hits else None


# --- quantize / dequantize -----------------------------------------------------------------


def quantize_w4a16(
    w: torch.Tensor,
    group_size: int = 128,
    symmetric: bool = True,
    scale_dtype: torch.dtype = torch.bfloat16,
    name: str = "tensor",
) -> W4A16:
    """Round-to-nearest W4A16 of a 2-D weight [out, in], grouped along `in`."""
    _check_weight(w, group_size, name)
    if scale_dtype not in _SCALE_DTYPES:
        raise EdgeMTPError(
            f"W4A16 scale dtype {scale_dtype} is not supported for {name}; "
            "use torch.bfloat16, torch.float16 or torch.float32"
        )
    dtype = _compute_dtype(w.dtype, scale_dtype)
    out_features, in_features = w.shape
    x = w.detach().to(dtype).reshape(out_features, in_features // group_size, group_size)

    lo = x.amin(dim=-1).clamp(max=0)
    hi = x.amax(dim=-1).clamp(min=0)
    if symmetric:
        scales = torch.maximum(lo.abs(), hi) / torch.tensor(7.5, dtype=dtype)
        zero = torch.zeros_like(scales)
    else:
        scales = (hi - lo) / torch.tensor(15.0, dtype=dtype)
        zero = (QMIN - lo / scales).clamp(QMIN, QMAX)
        zero = zero.nan_to_num(nan=0.0)  # an all-zero group: 0 / 0, any zero point is exact
    finfo = torch.finfo(scale_dtype)
    scales = scales.clamp(finfo.min, finfo.max).to(scale_dtype).to(dtype)
    scales = torch.where(scales == 0, torch.tensor(finfo.eps, dtype=dtype), scales)
    zero = zero.round()

    q = x / scales.unsqueeze(-1)
    q += zero.unsqueeze(-1)
    codes = q.clamp(QMIN, QMAX).round().to(torch.int8).reshape(out_features, in_features)
    if symmetric:
        return W4A16(codes, scales.to(scale_dtype), None, group_size, True)
    zero_points = (zero.to(torch.int8) - QMIN).to(torch.int8)
    return W4A16(
        (codes - QMIN).to(torch.int8), scales.to(scale_dtype), zero_points, group_size, False
    )


def dequantize_w4a16(q: W4A16) -> torch.Tensor:
    """The float32 weights `(codes - zero_points) * scales`.

    Exact in float32; `.to(q.scales.dtype)` gives compressed-tensors' decompressed weights.
    """
    out_features, in_features = q.shape
    x = q.codes.to(torch.float32).reshape(out_features, -1, q.group_size)
    if q.zero_points is not None:
        x = x - q.zero_points.to(torch.float32).unsqueeze(-1)
    return (x * q.scales.to(torch.float32).unsqueeze(-1)).reshape(out_features, in_features)


# --- pack-quantized layout ------------------------------------------------------------------


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Pack signed int4 codes (-8..7, int8 [rows, cols]) into int32 [rows, ceil(cols / 8)].

    Each nibble holds q + 8; element 8k + j sits in bits 4j..4j+3 of word k, and a partial last
    word is padded with zero nibbles, as compressed-tensors' `pack_to_int32(q, 4)` writes it.
    """
    if codes.dtype != torch.int8 or codes.ndim != 2:
        raise EdgeMTPError(
            f"pack_int4 takes 2-D int8 codes, got {codes.dtype} of shape {tuple(codes.shape)}; "
            "quantize the weight first"
        )
    if codes.numel() and (codes.min() < QMIN or codes.max() > QMAX):
        raise EdgeMTPError("pack_int4 takes signed int4 codes in -8..7; subtract 8 from 0..15")
    rows, cols = codes.shape
    nibbles = codes.to(torch.int32) - QMIN
    nibbles = torch.nn.functional.pad(nibbles, (0, -cols % 8)).reshape(rows, -1, 8)
    packed = torch.zeros(nibbles.shape[:2], dtype=torch.int32, device=codes.device)
    for j in range(8):
        packed |= nibbles[..., j] << (4 * j)
    return packed


def unpack_int4(packed: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Inverse of `pack_int4`: int32 [rows, ceil(cols / 8)] -> signed int8 codes [rows, cols]."""
    rows, cols = (int(n) for n in shape)
    if packed.dtype != torch.int32 or tuple(packed.shape) != (rows, math.ceil(cols / 8)):
        raise EdgeMTPError(
            f"packed int4 tensor is {packed.dtype} {tuple(packed.shape)}, expected int32 "
            f"{(rows, math.ceil(cols / 8))} for shape {(rows, cols)}; check weight_shape"
        )
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    return (nibbles.reshape(rows, -1)[:, :cols] + QMIN).to(torch.int8)


def to_pack_quantized(q: W4A16) -> dict[str, torch.Tensor]:
    """The pack-quantized tensors of one layer (local names, as compressed-tensors saves them)."""
    out = {
        "weight_packed": pack_int4(_signed_codes(q)),
        "weight_scale": q.scales,
        "weight_shape": torch.tensor(q.shape),
    }
    if q.zero_points is not None:
        out["weight_zero_point"] = pack_int4((q.zero_points + QMIN).to(torch.int8).T).T.contiguous()
    return out


def read_pack_quantized(
    tensors: Mapping[str, torch.Tensor],
    scheme: W4A16Scheme | Mapping[str, Any],
    name: str = "layer",
) -> W4A16:
    """One layer's pack-quantized tensors (local names `weight_packed`, `weight_scale`,
    `weight_zero_point`, `weight_shape`) under its scheme -> W4A16, values unchanged."""
    if not isinstance(scheme, W4A16Scheme):
        scheme = parse_scheme(scheme, name)
    missing = [k for k in ("weight_packed", "weight_scale") if k not in tensors]
    if missing:
        raise EdgeMTPError(
            f"{name} lacks {', '.join(missing)}; a pack-quantized layer needs weight_packed "
            "and weight_scale (check the tensor name prefix)"
        )
    packed, scales = tensors["weight_packed"], tensors["weight_scale"]
    g = scheme.group_size
    if scales.ndim != 2 or not scales.is_floating_point():
        raise EdgeMTPError(
            f"{name}.weight_scale is {scales.dtype} {tuple(scales.shape)}; expected a float "
            "[out, in / group_size] tensor (is this checkpoint really group-quantized?)"
        )
    if "weight_shape" in tensors:
        out_features, in_features = (int(n) for n in tensors["weight_shape"].reshape(-1))
    else:  # exact for the group strategy
        out_features, in_features = scales.shape[0], scales.shape[1] * g
    if in_features % g or tuple(scales.shape) != (out_features, in_features // g):
        raise EdgeMTPError(
            f"{name}.weight_scale has shape {tuple(scales.shape)} but weight_shape "
            f"{(out_features, in_features)} with group_size {g} needs "
            f"{(out_features, in_features // g)}; check the scheme's group_size"
        )
    codes = unpack_int4(packed, (out_features, in_features))

    zp = tensors.get("weight_zero_point")
    if scheme.symmetric:
        if zp is not None and bool(zp.any()):
            raise EdgeMTPError(
                f"{name} has a nonzero weight_zero_point but its scheme is symmetric; "
                "set symmetric: false in the scheme or drop the zero points"
            )
        return W4A16(codes, scales, None, g, True)
    if zp is None:
        raise EdgeMTPError(
            f"{name} lacks weight_zero_point but its scheme is asymmetric; "
            "set symmetric: true in the scheme or add the zero points"
        )
    zero_points = unpack_int4(zp.T.contiguous(), (in_features // g, out_features)).T
    return W4A16(
        (codes - QMIN).to(torch.int8),
        scales,
        (zero_points - QMIN).to(torch.int8).contiguous(),
        g,
        False,
    )


# --- quantization_config --------------------------------------------------------------------


def parse_quantization_config(config: Mapping[str, Any]) -> PackQuantizedConfig:
    """Read a checkpoint's `quantization_config` (or the config.json that holds it).

    Only compressed-tensors "pack-quantized" W4A16 is supported: 4-bit int weights, group
    strategy, no activation, KV-cache or output quantization, no sparsity or transforms.
    """
    with malformed_input(
        "config.json", "compressed-tensors quantization_config", "fix it or download it again"
    ):
        return _parse_quantization_config(config)


def _parse_quantization_config(config: Mapping[str, Any]) -> PackQuantizedConfig:
    qc = config.get("quantization_config", config)
    method = qc.get("quant_method", "compressed-tensors")
    if method != "compressed-tensors":
        raise EdgeMTPError(
            f"quantization method {method!r} is not supported; use a compressed-tensors "
            f"{FORMAT} W4A16 checkpoint or the unquantized weights"
        )
    for key in ("kv_cache_scheme", "transform_config", "sparsity_config"):
        value = qc.get(key)
        if value and not (key == "sparsity_config" and value.get("format") == "dense"):
            raise EdgeMTPError(
                f"quantization_config has a {key}, which edgemtp does not support; "
                "use a checkpoint with weight-only W4A16 quantization"
            )
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise EdgeMTPError(
            "quantization_config has no config_groups; is this a compressed-tensors checkpoint?"
        )
    parsed = []
    for group_name, group in groups.items():
        if isinstance(group, list):  # a preset name mapped to its targets
            if group_name.upper() not in _PRESETS:
                raise EdgeMTPError(
                    f"quantization preset {group_name!r} is not supported; "
                    f"edgemtp supports {', '.join(_PRESETS)}"
                )
            scheme = W4A16Scheme(128, _PRESETS[group_name.upper()], tuple(group))
        else:
            fmt = group.get("format") or qc.get("format")
            if fmt != FORMAT:
                raise EdgeMTPError(
                    f"quantization group {group_name!r} is stored as {fmt!r}; edgemtp reads "
                    f"only {FORMAT!r} W4A16 checkpoints"
                )
            scheme = parse_scheme(group, group_name)
        parsed.append((group_name, scheme))
    return PackQuantizedConfig(tuple(parsed), tuple(qc.get("ignore") or ()))


def parse_scheme(group: Mapping[str, Any], name: str = "group") -> W4A16Scheme:
    """One `config_groups` entry -> W4A16Scheme, or EdgeMTPError naming what is unsupported."""
    fix = "edgemtp imports only W4A16 (num_bits 4, type int, strategy group) checkpoints"
    for key in ("input_activations", "output_activations"):
        if group.get(key):
            raise EdgeMTPError(f"quantization group {name!r} quantizes {key}; {fix}")
    w = group.get("weights")
    if not w:
        raise EdgeMTPError(f"quantization group {name!r} has no weights scheme; {fix}")
    strategy = w.get("strategy")
    group_size = w.get("group_size")
    if strategy is None and isinstance(group_size, int) and group_size > 0:
        strategy = "group"  # compressed-tensors infers it
    problems = {
        "num_bits": (w.get("num_bits", 8), 4),
        "type": (str(w.get("type", "int")).lower(), "int"),
        "strategy": (strategy, "group"),
        "dynamic": (w.get("dynamic", False), False),
        "block_structure": (w.get("block_structure"), None),
    }
    for key, (value, wanted) in problems.items():
        if value != wanted:
            raise EdgeMTPError(f"quantization group {name!r} has weights {key}={value!r}; {fix}")
    if not isinstance(group_size, int) or group_size <= 0:
        raise EdgeMTPError(
            f"quantization group {name!r} has group_size={group_size!r}; "
            "a group scheme needs a positive group_size"
        )
    if w.get("actorder") in ("group", "dynamic"):
        raise EdgeMTPError(
            f"quantization group {name!r} uses actorder={w['actorder']!r} (a g_idx "
            "permutation); use a checkpoint quantized with actorder 'weight' or none"
        )
    targets = tuple(group.get("targets") or ())
    return W4A16Scheme(group_size, bool(w.get("symmetric", True)), targets)


# --- helpers --------------------------------------------------------------------------------


def _check_weight(w: torch.Tensor, group_size: int, name: str) -> None:
    if w.ndim != 2:
        raise EdgeMTPError(
            f"{name} has shape {tuple(w.shape)}; W4A16 quantizes 2-D [out, in] weights"
        )
    if not isinstance(group_size, int) or group_size <= 0 or w.shape[1] % group_size:
        raise EdgeMTPError(
            f"{name} has {w.shape[1]} input features, not a multiple of group size "
            f"{group_size}; pick a group size that divides it (32, 64, 128) or leave it dense"
        )
    if not bool(torch.isfinite(w).all()):
        bad = int((~torch.isfinite(w)).sum())
        raise EdgeMTPError(
            f"{name} has {bad} NaN/inf values; W4A16 needs finite weights (fix the checkpoint)"
        )


def _compute_dtype(w_dtype: torch.dtype, scale_dtype: torch.dtype) -> torch.dtype:
    """Compute in the weight's dtype (as compressed-tensors does) unless its scales could not
    hold the scale dtype's values exactly (float16 vs bfloat16): then float32."""
    if w_dtype in (torch.float32, torch.float64) or w_dtype == scale_dtype:
        return w_dtype
    if w_dtype in (torch.float16, torch.bfloat16) and scale_dtype == torch.float32:
        return w_dtype
    return torch.float32


def _signed_codes(q: W4A16) -> torch.Tensor:
    return q.codes if q.symmetric else (q.codes + QMIN).to(torch.int8)


def _name_matches(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def _target_matches(name: str, target: str, class_names: Sequence[str]) -> bool:
    return _name_matches(name, target) or target in class_names
