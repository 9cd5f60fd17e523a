"""The target's KV cache, which the drafter reads in place.

Only layers that own K/V have a cache; KV-shared layers (and every drafter layer) read their
store layer's. Full-attention layers keep one slot per position. Sliding layers keep a ring of
`window + max_draft + 1` slots (slot = position mod ring): a forward attends to the cache and its
own new rows before anything is written, and after a verify of k+1 rows the oldest slot it can have
overwritten belongs to a position no later query (target or drafter) can see, so rejected drafts
never destroy live entries. Rollback is a position reset: slots past the committed length are
marked empty (position -1).
"""

from __future__ import annotations

import torch
from torch import Tensor

from edgemtp.errors import EdgeMTPError
from edgemtp.model.config import AttentionKind, TextConfig


def ring_size(window: int, max_draft: int) -> int:
    # Target queries need the last window-1 entries, the drafter the last window+1 before its
    # position; a verify of max_draft+1 rows may overwrite that many of the oldest slots.
    return window + max_draft + 1


def cache_slots(cfg: TextConfig, max_context: int, max_draft: int) -> dict[str, int]:
    """Slots per attention kind: one per position for full layers, a ring for sliding ones."""
    ring = min(max_context, ring_size(cfg.sliding_window, max_draft))
    return {kind: max_context if kind == "full" else ring for kind in sorted(set(cfg.layer_types))}


def cache_bytes(cfg: TextConfig, max_context: int, max_draft: int, itemsize: int = 4) -> int:
    """Bytes of K and V over every layer that owns a cache."""
    slots = cache_slots(cfg, max_context, max_draft)
    return sum(
        2 * spec.num_kv_heads * slots[spec.attention] * spec.head_dim * itemsize
        for spec in cfg.layers
        if spec.owns_kv
    )


class KVCache:
    def __init__(
        self,
        cfg: TextConfig,
        max_context: int,
        max_draft: int = 0,
        dtype: torch.dtype = torch.float32,
    ):
        self.cfg = cfg
        self.max_context = max_context
        self.slots = cache_slots(cfg, max_context, max_draft)
        self.k: dict[int, Tensor] = {}
        self.v: dict[int, Tensor] = {}
        for spec in cfg.layers:
            if spec.owns_kv:
                shape = (spec.num_kv_heads, self.slots[spec.attention], spec.head_dim)
                self.k[spec.index] = torch.zeros(shape, dtype=dtype)
                self.v[spec.index] = torch.zeros(shape, dtype=dtype)
        self.slot_positions = {
            kind: torch.full((n,), -1, dtype=torch.long) for kind, n in self.slots.items()
        }
        self.length = 0  # positions [0, length) are in the cache

    @classmethod
    def for_model(
        cls, model: torch.nn.Module, cfg: TextConfig, max_context: int, max_draft: int = 0
    ) -> KVCache:
        """A cache in the dtype `model` keeps K/V in: float32, or what a program stores when
        the model is swapped to its forms (`kv_cache_dtype`, set by
        `export.executorch.xnnpack_forms`)."""
        dtype = getattr(model, "kv_cache_dtype", torch.float32)
        return cls(cfg, max_context, max_draft, dtype=dtype)

    # --- CacheView: what a forward reads -------------------------------------------------------
    def _used(self, kind: str) -> int:
        return min(self.length, self.slots[kind])

    def kv(self, layer: int) -> tuple[Tensor, Tensor]:
        n = self._used(self.cfg.layers[layer].attention)
        return self.k[layer][:, :n], self.v[layer][:, :n]

    def positions(self, kind: AttentionKind) -> Tensor:
        return self.slot_positions[kind][: self._used(kind)]

    # --- writing and rollback ------------------------------------------------------------------
    def write(self, new_kv: dict[int, tuple[Tensor, Tensor]], start: int) -> None:
        """Store the new rows of every owning layer, for positions start, start+1, ..."""
        if not new_kv:
            return
        n = next(iter(new_kv.values()))[0].shape[1]
        if start != self.length:
            raise ValueError(f"cache holds {self.length} positions, write starts at {start}")
        if start + n > self.max_context:
            raise EdgeMTPError(
                f"context full: {start + n} tokens exceed --max-context {self.max_context}"
            )
        for kind, size in self.slots.items():
            keep = min(n, size)  # a chunk longer than the ring only leaves its last `size` rows
            pos = torch.arange(start + n - keep, start + n)
            self.slot_positions[kind][pos % size] = pos
        for layer, (k, v) in new_kv.items():
            size = self.slots[self.cfg.layers[layer].attention]
            keep = min(n, size)
            slots = torch.arange(start + n - keep, start + n) % size
            self.k[layer][:, slots] = k[:, n - keep :].to(self.k[layer].dtype)
            self.v[layer][:, slots] = v[:, n - keep :].to(self.v[layer].dtype)
        self.length = start + n

    def truncate(self, length: int) -> None:
        """Forget positions >= length (rejected drafts)."""
        if length > self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        for pos in self.slot_positions.values():
            pos[pos >= length] = -1
        self.length = length

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))
