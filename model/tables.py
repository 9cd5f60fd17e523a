"""The target's host-side embedding tables: the token table and the per-layer (PLE) table.

Nothing but a row lookup ever touches them, so they stay out of the compiled graphs, in their
stored form (float, or quantized rows from `quantize/tables.py`), usually memory-mapped: only the
rows a prompt touches become resident.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn


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

    def token_rows_in_graph(self) -> TableInGraph:
        """The token table as a program looks it up: `embed`'s values."""
        return TableInGraph.of(self.tokens, self._token_scale)

    def per_layer_inputs(self, ids: Tensor | list[int], out: Tensor | None = None) -> Tensor | None:
        """Token-identity part of the per-layer embeddings, [T, layers, ple_dim] fp32, written
        into `out` when given."""
        if self.per_layer is None:
            return None
        if out is not None:
            return self.per_layer.scaled(ids, self._ple_scale, out)
        rows = self.per_layer.scaled(ids, self._ple_scale)
        return rows.view(len(ids), self.num_layers, self.ple_dim)


class TableInGraph(nn.Module):
    """A host table's rows looked up inside a program (a draft chain embeds the tokens it
    drafts), to the values the host lookup (`Rows.scaled`) gives: GGML Q4_0 / Q8_0 blocks
    (codes, float16 scales), int8 rows with a float16 scale each, or float rows.

    Built from the table as the bundle stores it (`of`): the codes stay 4 or 8 bits."""

    def __init__(self, kind: str, scale: float, codes: Tensor, scales: Tensor | None = None):
        super().__init__()
        self.kind, self.scale = kind, scale
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("nibble_steps", torch.tensor([[1.0], [1.0 / 16.0]]))

    @classmethod
    def of(cls, rows: Rows, scale: float) -> TableInGraph:
        raw = getattr(rows, "raw", None)
        if raw is not None:  # GGML blocks: float16 d, then 16 (Q4_0) or 32 (Q8_0) code bytes
            raw = torch.as_tensor(raw)
            blocks = raw.view(raw.shape[0], -1, rows.block_bytes)  # type: ignore[attr-defined]
            d = blocks[..., :2].contiguous().view(torch.float16)[..., 0]
            codes = blocks[..., 2:].contiguous()
            kind = "q4_0" if codes.shape[-1] == 16 else "q8_0"
            return cls(kind, scale, codes.view(torch.int8) if kind == "q8_0" else codes, d)
        values = getattr(rows, "values", None)
        if values is not None:
            return cls("int8", scale, values, rows.scales)  # type: ignore[attr-defined]
        table = getattr(rows, "table", None)
        if table is None:
            raise TypeError(f"no in-graph form of a {type(rows).__name__} table")
        return cls("float", scale, table)

    def forward(self, ids: Tensor) -> Tensor:
        """Scaled rows [n, cols] float32 of ids [n]: (code value * d) * scale, as the host."""
        codes = self.codes.index_select(0, ids)
        if self.kind == "float":
            return codes.float() * self.scale
        assert self.scales is not None
        d = self.scales.index_select(0, ids).float()
        if self.kind == "int8":
            return codes.float() * d[:, None] * self.scale
        if self.kind == "q4_0":  # byte j: element j in the low nibble, 16 + j in the high one
            c = codes.float()[..., None, :]  # [n, blocks, 1, 16]
            shifted = torch.floor(c * self.nibble_steps)  # [n, blocks, 2, 16]: c, c >> 4
            values = shifted - 16.0 * torch.floor(shifted / 16.0) - 8.0
            values = values.reshape(codes.shape[0], codes.shape[1], 32)
        else:
            values = codes.float()
        return (values * d[..., None] * self.scale).reshape(ids.shape[0], -1)
