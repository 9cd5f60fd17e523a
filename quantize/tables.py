"""Quantized host-side lookup tables (token and per-layer embeddings).

Each keeps its stored bytes (often memory-mapped) and dequantizes only the rows looked up, so
resident memory grows with the rows a prompt touches, not with the table.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from edgemtp.quantize.q4_0 import BLOCK, BLOCK_BYTES, dequantize_q4_0_rows


class Q4_0Rows:
    """GGML Q4_0 blocks, one row of `cols // 32` blocks per table row."""

    dtype = torch.float32

    def __init__(self, raw: Tensor | np.ndarray, cols: int):
        self.raw = raw  # uint8 [rows, cols // 32 * 18]
        self.shape = (raw.shape[0], cols)
        if raw.shape[1] != cols // BLOCK * BLOCK_BYTES:
            raise ValueError(f"Q4_0 rows of {raw.shape[1]} bytes cannot hold {cols} columns")

    def __getitem__(self, ids: Tensor) -> Tensor:
        rows = np.asarray(
            self.raw[ids.numpy()] if isinstance(self.raw, np.ndarray) else self.raw[ids]
        )
        return torch.from_numpy(dequantize_q4_0_rows(rows, self.shape[1]))


class Int8Rows:
    """Symmetric int8 with one scale per row: row = q * scale."""

    dtype = torch.float32

    def __init__(self, values: Tensor, scales: Tensor):
        self.values, self.scales = values, scales  # int8 [rows, cols], [rows]
        self.shape = tuple(values.shape)

    def __getitem__(self, ids: Tensor) -> Tensor:
        return self.values[ids].float() * self.scales[ids].float()[:, None]


def quantize_int8_rows(w: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row symmetric int8: scale = max|row| / 127, q = round(row / scale)."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127.0).to(torch.float16)  # stored fp16; quantize with it
    safe = torch.where(scales > 0, scales.float(), torch.ones_like(scales, dtype=torch.float32))
    values = torch.clamp(torch.round(w / safe[:, None]), -127, 127).to(torch.int8)
    return values, scales
