"""The target over a `KVCache`, as the reference engine runs it: rows at the cache's length, and a
prompt in chunks (the one chunk policy every engine and the simulator follow).

Pruned prefill: intermediate chunks skip the KV-shared layers (they write no cache), the final
chunk sends only its last row through them. Prompt chunks compute with the form's chunk
primitives, the other calls with its step primitives.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import torch
from torch import Tensor

from edgemtp.model.cache import KVCache
from edgemtp.model.checkpoint import Target
from edgemtp.model.primitives import Primitives


def prefill_chunks(n: int, chunk: int) -> list[tuple[int, int]]:
    """The prompt's rows [start, end) per prefill call: chunks of `chunk` from its start, the
    last one holding what is left (1 to `chunk` rows). Only the last chunk's rows pass through
    the KV-shared layers (its last row only, pruned)."""
    return [(start, min(start + chunk, n)) for start in range(0, n, chunk)]


class Phases(Protocol):
    """Where a caller times the phases of a forward ("embed", "target")."""

    def phase(self, name: str) -> AbstractContextManager: ...


class _Untimed:
    def phase(self, name: str) -> AbstractContextManager:
        return nullcontext()


UNTIMED = _Untimed()


def forward_rows(
    target: Target,
    cache: KVCache,
    ids: Tensor,
    rows: str = "all",
    ops: Primitives | None = None,
    phases: Phases = UNTIMED,
) -> Tensor | None:
    """`ids` at the cache's length through the target (`rows`: which rows go through the
    KV-shared layers: "all", "last" or "none"), their K/V written; returns the hidden rows.
    `ops`: the target form's step primitives unless given."""
    model, tables, ops = target.model, target.tables, ops or target.form.step
    with phases.phase("embed"):
        embeds, ple = tables.embed(ids), tables.per_layer_inputs(ids)
    with phases.phase("target"):
        positions = torch.arange(cache.length, cache.length + ids.shape[0])
        hidden, new_kv = model(embeds, ple, positions, cache, rows, ops)
        cache.write(new_kv, int(positions[0]))
    return hidden


def prefill(
    target: Target,
    cache: KVCache,
    ids: Tensor,
    chunk: int,
    prune: bool = True,
    ops: Primitives | None = None,
    phases: Phases = UNTIMED,
) -> tuple[Tensor, Tensor]:
    """Run the prompt through the target in chunks after what `cache` holds; returns (last
    hidden [hidden], last logits). `ops`: the target form's chunk primitives unless given."""
    hidden, ops = None, ops or target.form.chunk
    chunks = prefill_chunks(ids.shape[0], chunk)
    for start, end in chunks:
        rows = ("last" if end == chunks[-1][1] else "none") if prune else "all"
        hidden = forward_rows(target, cache, ids[start:end], rows, ops, phases)
    assert hidden is not None
    with phases.phase("target"):
        return hidden[-1], target.model.logits(hidden[-1], ops)
