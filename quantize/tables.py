"""Quantized host-side lookup tables (token and per-layer embeddings).

Each keeps its stored bytes (often memory-mapped) and dequantizes only the rows looked up, so
resident memory grows with the rows a prompt touches, not with the table.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from edgemtp import native
from edgemtp.quantize.q4_0 import BLOCK, BLOCK_BYTES, dequantize_q4_0_rows

TABLE_ROWS = Path(__file__).resolve().with_name(native.TABLE_ROWS.file_name(None))


@cache
def table_rows() -> ctypes.CDLL | None:
    """The table-row library (`table_rows.cpp`, built at install) loaded, or None where it is
    missing (installed without a compiler): the lookups then run in numpy, to the same values."""
    try:
        library = ctypes.CDLL(str(TABLE_ROWS))
    except OSError:
        return None
    for name in ("edgemtp_q4_0_rows", "edgemtp_q8_0_rows"):
        function = getattr(library, name)
        function.argtypes = [
            ctypes.c_void_p,  # table
            ctypes.c_int64,  # its rows
            ctypes.c_void_p,  # ids (int64)
            ctypes.c_int64,  # how many
            ctypes.c_int64,  # columns
            ctypes.c_float,  # scale
            ctypes.c_void_p,  # out (float32 [n, columns])
        ]
        function.restype = ctypes.c_int64
    return library


class BlockRows:
    """A table of GGML blocks, one row of `cols // 32` blocks per table row (Q4_0, Q8_0).

    A lookup is one call of `table_rows.cpp` (beside this file) where it could be built, which
    dequantizes and scales the rows straight into the result; numpy's same arithmetic
    otherwise (`dequantize`)."""

    dtype = torch.float32
    block_bytes: int
    symbol: str  # the C lookup's name

    def __init__(self, raw: Tensor | np.ndarray, cols: int):
        self.raw = raw  # uint8 [rows, cols // 32 * block_bytes], usually memory-mapped
        self.shape = (raw.shape[0], cols)
        if cols % BLOCK or raw.shape[1] != cols // BLOCK * self.block_bytes:
            raise ValueError(
                f"{type(self).__name__} of {raw.shape[1]} bytes per row cannot hold {cols} columns"
            )
        contiguous = raw.is_contiguous() if isinstance(raw, Tensor) else raw.flags.c_contiguous
        address = raw.data_ptr() if isinstance(raw, Tensor) else raw.ctypes.data
        self._address = address if contiguous and raw.dtype in (np.uint8, torch.uint8) else None

    def dequantize(self, rows: np.ndarray) -> np.ndarray:
        """float32 [T, cols] of the byte rows [T, row bytes]."""
        raise NotImplementedError

    def __getitem__(self, ids: Tensor | list[int]) -> Tensor:
        return self.scaled(ids, 1.0)

    def scaled(self, ids: Tensor | list[int], scale: float, out: Tensor | None = None) -> Tensor:
        """Rows `ids` [T] times `scale` (rounded to float32 after the dequantized value, as
        `self[ids] * scale` rounds), float32 [T, cols], written into `out` (contiguous float32
        of T * cols) when given. A list of ids costs no tensor."""
        is_list = isinstance(ids, list)
        library = (
            table_rows() if self._address is not None and (is_list or ids.dim() == 1) else None
        )
        n, (height, cols) = len(ids), self.shape
        if out is not None and (
            out.dtype != torch.float32 or not out.is_contiguous() or out.numel() != n * cols
        ):
            raise ValueError(f"out must be contiguous float32 of {n} x {cols} values")
        if library is None:
            at = np.asarray(ids, dtype=np.int64) if is_list else ids.numpy()
            rows = np.asarray(self.raw[at] if isinstance(self.raw, np.ndarray) else self.raw[ids])
            found = torch.from_numpy(self.dequantize(rows))
            found = found * scale if scale != 1.0 else found
            return found if out is None else out.copy_(found.view_as(out))
        if is_list:
            ids = (ctypes.c_int64 * n)(*ids)
            at = ctypes.addressof(ids)
        else:
            ids = ids.to(torch.int64).contiguous()
            at = ids.data_ptr()
        if out is None:
            out = torch.empty(n, cols)
        done = getattr(library, self.symbol)(
            self._address, height, at, n, cols, scale, out.data_ptr()
        )
        if done != n:
            raise IndexError(f"id {int(ids[done])} is outside the table's {height} rows")
        return out


class Q4_0Rows(BlockRows):
    """GGML Q4_0 blocks: fp16 scale, 16 bytes of two 4-bit codes."""

    block_bytes = BLOCK_BYTES
    symbol = "edgemtp_q4_0_rows"

    def dequantize(self, rows: np.ndarray) -> np.ndarray:
        return dequantize_q4_0_rows(rows, self.shape[1])


class Int8Rows:
    """Symmetric int8 with one scale per row: row = q * scale."""

    dtype = torch.float32

    def __init__(self, values: Tensor, scales: Tensor):
        self.values, self.scales = values, scales  # int8 [rows, cols], [rows]
        self.shape = tuple(values.shape)
        # numpy views of the same memory: a decode step looks up a row or two, and each torch
        # op costs more than that row's arithmetic
        self._values, self._scales = values.numpy(), scales.numpy()

    def __getitem__(self, ids: Tensor | list[int]) -> Tensor:
        return self.values[ids].float() * self.scales[ids].float()[:, None]

    def scaled(self, ids: Tensor | list[int], scale: float, out: Tensor | None = None) -> Tensor:
        """`self[ids] * scale`, rounded as it rounds (q * row scale in float32, then * scale)."""
        at = np.asarray(ids, dtype=np.int64) if isinstance(ids, list) else ids.numpy()
        rows = self._values[at].astype(np.float32)
        rows *= self._scales[at].astype(np.float32)[:, None]
        if scale != 1.0:
            rows *= np.float32(scale)
        if out is None:
            return torch.from_numpy(rows)
        if not out.is_contiguous():
            return out.copy_(torch.from_numpy(rows).view_as(out))
        out.numpy().reshape(rows.shape)[...] = rows
        return out


def quantize_int8_rows(w: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row symmetric int8: scale = max|row| / 127, q = round(row / scale)."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127.0).to(torch.float16)  # stored fp16; quantize with it
    safe = torch.where(scales > 0, scales.float(), torch.ones_like(scales, dtype=torch.float32))
    values = torch.clamp(torch.round(w / safe[:, None]), -127, 127).to(torch.int8)
    return values, scales
