"""GGML Q4_0, bit for bit: 32 weights per block share one fp16 scale, weight = (code - 8) * scale.

The quantizer mirrors ggml's `quantize_row_q4_0_ref` as gguf-py's `quants.py` writes it in numpy,
float32 operation for float32 operation:

    m  = the block's element of largest magnitude, sign kept (the first one on ties)
    d  = m / -8                       scale, stored as fp16(d)
    id = 1 / d  (0 where d == 0)
    q  = clip(trunc(x * id + 8.5), 0, 15)

Codes are computed from the float32 `d`, not from its fp16 rounding, exactly as the reference does.
Tensors are 2-D [rows, cols] (a 1-D tensor is one row); blocks run along the last axis.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from edgemtp.errors import EdgeMTPError

BLOCK = 32  # weights per block
BLOCK_BYTES = 18  # fp16 scale + 16 bytes of nibbles
_FP16_LIMIT = 524160.0  # |m| from here on makes fp16(m / -8) overflow to inf


@dataclass(frozen=True, eq=False)
class Q4_0:
    """A Q4_0 tensor: `codes` 0..15 and one fp16 scale per block of 32 along the last axis."""

    scales: torch.Tensor  # float16 [rows, cols // 32]
    codes: torch.Tensor  # uint8 [rows, cols], values 0..15
    shape: tuple[int, ...]  # the original shape, (cols,) or (rows, cols)

    def __post_init__(self) -> None:
        rows, cols = _rows_cols(self.shape, "Q4_0")
        if self.codes.dtype != torch.uint8 or tuple(self.codes.shape) != (rows, cols):
            raise EdgeMTPError(
                f"Q4_0 codes must be uint8 of shape {(rows, cols)}, got {self.codes.dtype} "
                f"{tuple(self.codes.shape)}; build Q4_0 with quantize_q4_0 or unpack_q4_0"
            )
        if self.scales.dtype != torch.float16 or tuple(self.scales.shape) != (rows, cols // BLOCK):
            raise EdgeMTPError(
                f"Q4_0 scales must be float16 of shape {(rows, cols // BLOCK)}, got "
                f"{self.scales.dtype} {tuple(self.scales.shape)}; build Q4_0 with quantize_q4_0"
            )
        if self.codes.numel() and int(self.codes.max()) > 15:
            raise EdgeMTPError("Q4_0 codes must lie in 0..15; build Q4_0 with quantize_q4_0")


def quantize_q4_0(w: torch.Tensor | np.ndarray, name: str = "tensor") -> Q4_0:
    """Quantize a 1-D or 2-D float tensor to Q4_0 exactly as ggml's reference quantizer does."""
    x = _float32(w)
    rows, cols = _rows_cols(x.shape, name)
    if not np.isfinite(x).all():
        bad = int(x.size - np.isfinite(x).sum())
        raise EdgeMTPError(f"{name}: {bad} NaN or inf values cannot be quantized to Q4_0; fix them")

    blocks = x.reshape(-1, BLOCK)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        imax = np.abs(blocks).argmax(axis=1)[:, None]
        d = np.take_along_axis(blocks, imax, axis=1) / np.float32(-8)
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
        t = blocks * inv
        t += np.float32(8.5)
        np.trunc(t, out=t)
        # |d| below ~2.9e-39 makes 1/d inf: the reference's float->uint8 cast turns the resulting
        # inf/NaN into 0 on x86 (the fp16 scale is 0 there, so those codes never matter).
        t[np.isinf(inv[:, 0])] = 0
        np.clip(t, 0, 15, out=t)
        scales = d.astype(np.float16)

    if np.isinf(scales).any():
        amax = float(np.abs(x).max())
        raise EdgeMTPError(
            f"{name}: a weight of magnitude {amax:g} overflows the Q4_0 fp16 scale (|w| must stay "
            f"below {_FP16_LIMIT:g}); rescale the tensor or keep it unquantized"
        )
    return Q4_0(
        scales=torch.from_numpy(scales.reshape(rows, cols // BLOCK)),
        codes=torch.from_numpy(t.astype(np.uint8).reshape(rows, cols)),
        shape=tuple(x.shape),
    )


def dequantize_q4_0(q: Q4_0) -> torch.Tensor:
    """Float32 weights `(code - 8) * scale`, in the original shape (every product is exact)."""
    rows, cols = q.codes.shape
    w = (q.codes.to(torch.float32) - 8).view(rows, cols // BLOCK, BLOCK)
    return (w * q.scales.to(torch.float32)[..., None]).reshape(q.shape)


def pack_q4_0(q: Q4_0) -> np.ndarray:
    """GGML's bytes: per block, fp16 d (little-endian) then 16 bytes holding x[j] | x[j + 16] << 4.

    The result has shape `shape[:-1] + (cols // 32 * 18,)`, like `gguf.quants.quantize`.
    """
    rows, cols = q.codes.shape
    n = cols // BLOCK
    nibbles = nibbles_q4_0(q).cpu().numpy().reshape(rows, n, BLOCK // 2)
    d = q.scales.cpu().contiguous().numpy().astype("<f2").view(np.uint8).reshape(rows, n, 2)
    return np.concatenate([d, nibbles], axis=-1).reshape(*q.shape[:-1], n * BLOCK_BYTES)


def unpack_q4_0(raw: bytes | np.ndarray, shape: tuple[int, ...], name: str = "tensor") -> Q4_0:
    """Read GGML Q4_0 bytes back; `shape` is the float shape in numpy order, not ggml's."""
    shape = tuple(int(s) for s in shape)
    rows, cols = _rows_cols(shape, name)
    if isinstance(raw, bytes | bytearray | memoryview):
        buf = np.frombuffer(raw, dtype=np.uint8)
    else:
        buf = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    n = cols // BLOCK
    if buf.size != rows * n * BLOCK_BYTES:
        raise EdgeMTPError(
            f"{name}: {buf.size} bytes do not hold a Q4_0 tensor of shape {shape} "
            f"({rows * n * BLOCK_BYTES} bytes); pass the tensor's own shape in numpy order"
        )
    scales, codes = split_q4_0_blocks(buf.reshape(rows, n, BLOCK_BYTES))
    codes = codes.reshape(rows, cols)
    return Q4_0(scales=torch.from_numpy(scales), codes=torch.from_numpy(codes), shape=shape)


def split_q4_0_blocks(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGML Q4_0 blocks `[..., n, 18]` -> (fp16 scales `[..., n]`, codes uint8 `[..., n, 32]`)."""
    scales = blocks[..., :2].copy().view("<f2").astype(np.float16)[..., 0]
    qs = blocks[..., 2:]
    return scales, np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def dequantize_q4_0_rows(rows: np.ndarray, cols: int) -> np.ndarray:
    """Float32 rows `[T, cols]` of the Q4_0 byte rows `[T, cols // 32 * 18]`, in numpy: the
    values of `dequantize_q4_0`, without torch's per-operation cost on the one row a decode
    step needs."""
    scales, codes = split_q4_0_blocks(rows.reshape(rows.shape[0], cols // BLOCK, BLOCK_BYTES))
    w = (codes.astype(np.float32) - np.float32(8)) * scales.astype(np.float32)[..., None]
    return w.reshape(rows.shape[0], cols)


def q8_0_rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as llama.cpp's Q8_0 rounds activations before a Q4_0 dot product (and edgemtp's
    kernel, runtime/kernels/q4_0_linear.cpp): per block of 32 along the last axis,
    d = max|x| / 127 and q = round-half-even(x * (1 / d)); returns q * d in float32."""
    blocks = x.float().reshape(*x.shape[:-1], -1, BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    return (torch.round(blocks * inv) * d).reshape(x.shape)


def nibbles_q4_0(q: Q4_0) -> torch.Tensor:
    """The codes two per byte as GGML's blocks hold them: uint8 [rows, cols // 2], block g at
    bytes 16g..16g+15, byte j = code 32g + j | code 32g + 16 + j << 4 (`pack_q4_0` without
    the scales)."""
    rows, cols = q.codes.shape
    codes = q.codes.reshape(rows, cols // BLOCK, BLOCK)
    return (codes[..., : BLOCK // 2] | (codes[..., BLOCK // 2 :] << 4)).reshape(rows, cols // 2)


def unnibble_q4_0(nibbles: torch.Tensor) -> torch.Tensor:
    """Codes uint8 [rows, cols] back from `nibbles_q4_0`'s bytes."""
    rows, half = nibbles.shape
    blocks = nibbles.reshape(rows, -1, BLOCK // 2)
    return torch.cat([blocks & 15, blocks >> 4], dim=-1).reshape(rows, half * 2)


def _float32(w: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(w, torch.Tensor):
        return w.detach().to("cpu", torch.float32).contiguous().numpy()
    return np.array(w, dtype=np.float32, copy=None, order="C")  # keeps 0-D as 0-D


def _rows_cols(shape: tuple[int, ...], name: str) -> tuple[int, int]:
    if len(shape) not in (1, 2):
        raise EdgeMTPError(
            f"{name}: Q4_0 takes a 1-D or 2-D tensor, got shape {tuple(shape)}; "
            "reshape it to [rows, cols] first"
        )
    cols = shape[-1]
    if cols == 0 or cols % BLOCK:
        raise EdgeMTPError(
            f"{name}: Q4_0 needs the last dimension to be a positive multiple of {BLOCK}, got "
            f"shape {tuple(shape)}; pad the columns or keep this tensor unquantized"
        )
    return (shape[0] if len(shape) == 2 else 1), cols
