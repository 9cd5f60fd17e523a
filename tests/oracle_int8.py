"""An int8 KV cache's rows in numpy: the oracle for `quantize_kv`, `stored_rows` and every
kernel that reads or writes them."""

from __future__ import annotations

import numpy as np


def numpy_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per row of the last axis: scale = max|x| / 127, codes = rint(x / scale)
    (as x times the float32 reciprocal, the way the cache computes it)."""
    scale = np.abs(x).max(-1, keepdims=True).astype(np.float32) / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(scale == 0, np.float32(0), np.float32(1) / scale).astype(np.float32)
    return np.clip(np.rint(x * inverse), -127, 127).astype(np.int8), scale


def numpy_int8_rows(x: np.ndarray) -> np.ndarray:
    """The rows as an int8 cache stores them: each row's codes, then its float32 scale's bytes."""
    codes, scale = numpy_int8(x)
    return np.concatenate([codes, scale.view(np.int8)], axis=-1)


def numpy_read_int8_rows(stored: np.ndarray) -> np.ndarray:
    """Stored int8 rows back as float32: codes times the row's scale."""
    dim = stored.shape[-1] - 4
    scale = np.ascontiguousarray(stored[..., dim:]).view(np.float32)
    return stored[..., :dim].astype(np.float32) * scale
