"""The target's host-side embedding tables: the token table and the per-layer (PLE) table.

Nothing but a row lookup ever touches them, so they stay out of the compiled graphs, in their
stored form (float, or quantized rows from `quantize/tables.py`), usually memory-mapped: only the
rows a prompt touches become resident.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor


class Rows(Protocol):
    """A lookup table that reads (and dequantizes) only the rows it is asked for."""

    shape: torch.Size | tuple[int, ...]
    dtype: torch.dtype

    def __getitem__(self, ids: Tensor | list[int]) -> Tensor: ...

    def scaled(self, ids: Tensor | list[int], scale: float, out: Tensor | None = None) -> Tensor:
        """`self[ids].float() * scale`, written into `out` (of as many values) when given."""
        ...


class TensorRows:
    """A plain (often memory-mapped) tensor as `Rows`."""

    def __init__(self, table: Tensor):
        self.table = table
        self.shape, self.dtype = table.shape, table.dtype

    def __getitem__(self, ids: Tensor | list[int]) -> Tensor:
        return self.table[ids]

    def scaled(self, ids: Tensor | list[int], scale: float, out: Tensor | None = None) -> Tensor:
        rows = self.table[ids].float() * scale
        return rows if out is None else out.copy_(rows.view_as(out))


def as_rows(table: Tensor | Rows) -> Rows:
    return TensorRows(table) if isinstance(table, Tensor) else table


def _rounded(value: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(value, dtype=dtype).float())


@dataclass
class TokenTables:
    """Host-side embedding tables; only the rows looked up are ever read (they may be mmapped)."""

    tokens: Rows  # [vocab, hidden]
    per_layer: Rows | None  # [vocab_ple, layers * ple_dim]
    num_layers: int
    ple_dim: int

    def __post_init__(self) -> None:
        self.tokens = as_rows(self.tokens)
        self.per_layer = None if self.per_layer is None else as_rows(self.per_layer)
        # Scales rounded to each table's dtype, as the reference does; computed once because a
        # decode step looks up one row and a fresh tensor costs as much as the lookup.
        self._token_scale = _rounded(self.tokens.shape[1] ** 0.5, self.tokens.dtype)
        if self.per_layer is not None:
            self._ple_scale = _rounded(self.ple_dim**0.5, self.per_layer.dtype)

    @property
    def hidden_size(self) -> int:
        return self.tokens.shape[1]

    def embed(self, ids: Tensor | list[int], out: Tensor | None = None) -> Tensor:
        """Scaled token embeddings [T, hidden] in fp32 (ids [T]: a tensor or a list), written
        into `out` when given."""
        return self.tokens.scaled(ids, self._token_scale, out)

    def per_layer_inputs(self, ids: Tensor | list[int], out: Tensor | None = None) -> Tensor | None:
        """Token-identity part of the per-layer embeddings, [T, layers, ple_dim] fp32, written
        into `out` when given."""
        if self.per_layer is None:
            return None
        if out is not None:
            return self.per_layer.scaled(ids, self._ple_scale, out)
        rows = self.per_layer.scaled(ids, self._ple_scale)
        return rows.view(len(ids), self.num_layers, self.ple_dim)
