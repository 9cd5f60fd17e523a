"""The target's KV cache, which the drafter reads in place: its layout, and its two forms.

Only layers that own K/V have a cache; KV-shared layers (and every drafter layer) read their
store layer's. Full-attention layers keep one slot per position. Sliding layers keep a ring of
`window + max_draft + 1` slots (slot = position mod ring): a forward attends to the cache and its
own new rows before anything is written, and after a verify of k+1 rows the oldest slot it can
have overwritten belongs to a position no later query (target or drafter) can see, so rejected
drafts never destroy live entries. Rollback is a position reset.

`KVCache` is the reference engine's (host tensors; slots past the committed length are marked
empty on rollback). `StaticCache` is the static programs': one set of buffers every exported
method shares, one trash slot more per buffer for pad rows, written in-graph; a method that
writes first forgets every slot at or after its first position, so rollback needs no call.
"""

from __future__ import annotations

from bisect import bisect_left

import torch
from torch import Tensor, nn

from edgemtp.errors import EdgeMTPError
from edgemtp.model.config import KV_CACHE_KINDS, AttentionKind, TextConfig
from edgemtp.model.primitives import KV, REFERENCE, SCALE_BYTES, Primitives, stored_rows


def ring_size(window: int, max_draft: int) -> int:
    # Target queries need the last window-1 entries, the drafter the last window+1 before its
    # position; a verify of max_draft+1 rows may overwrite that many of the oldest slots.
    return window + max_draft + 1


def cache_slots(cfg: TextConfig, max_context: int, max_draft: int) -> dict[str, int]:
    """Slots per attention kind: one per position for full layers, a ring for sliding ones."""
    ring = min(max_context, ring_size(cfg.sliding_window, max_draft))
    return {kind: max_context if kind == "full" else ring for kind in sorted(set(cfg.layer_types))}


def row_width(head_dim: int, itemsize: int) -> int:
    """Elements of one cached K or V row of a head stored in `itemsize` bytes an element:
    head_dim, and an int8 row's scale bytes (1: int8)."""
    return head_dim + (SCALE_BYTES if itemsize == 1 else 0)


def cache_bytes(cfg: TextConfig, max_context: int, max_draft: int, itemsize: int = 4) -> int:
    """Bytes of K and V over every layer that owns a cache, stored in `itemsize` bytes an
    element (1: int8 rows with their scales)."""
    slots = cache_slots(cfg, max_context, max_draft)
    total = 0
    for spec in cfg.layers:
        if spec.owns_kv:  # K and V: rows per head and slot
            rows = 2 * spec.num_kv_heads * slots[spec.attention]
            total += rows * row_width(spec.head_dim, itemsize) * itemsize
    return total


class RingTracker:
    """Knows which positions a ring cache still holds after a rollback.

    A sliding ring of `slots` keeps position p until p + slots is written. A query at `length`
    needs the window (and the drafter one more) before it, so truncating to `length` keeps the
    cache usable only while nothing at or past oldest-needed + slots has been written; otherwise
    the caller must prefill again.
    """

    def __init__(self, slots: dict[str, int], window: int):
        self.slots = slots
        self.window = window
        self.written_end = 0  # one past the highest position written since the last reset

    def wrote(self, end: int) -> None:
        self.written_end = max(self.written_end, end)

    def keeps(self, length: int) -> bool:
        oldest_needed = max(0, length - self.window - 1)
        return all(oldest_needed + n >= self.written_end for n in self.slots.values())

    def truncated(self, length: int) -> bool:
        """Record a truncation to `length`; True when the cache still holds [0, length)."""
        keeps = self.keeps(length)
        self.written_end = length if keeps else 0
        return keeps


KV_CACHE_DTYPES = dict(zip(KV_CACHE_KINDS, (torch.float32, torch.float16, torch.int8), strict=True))


class KVCache:
    """The reference engine's cache: host tensors, written by `write` after each forward.

    dtype int8: each K and V row as `stored_rows` keeps it (`quantize_kv`'s codes, then the
    row's float32 scale), read back as codes * scale by the attention."""

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
                width = row_width(spec.head_dim, dtype.itemsize)
                shape = (spec.num_kv_heads, self.slots[spec.attention], width)
                self.k[spec.index] = torch.zeros(shape, dtype=dtype)
                self.v[spec.index] = torch.zeros(shape, dtype=dtype)
        self.slot_positions = {
            kind: torch.full((n,), -1, dtype=torch.long) for kind, n in self.slots.items()
        }
        self.length = 0  # positions [0, length) are in the cache

    # --- CacheView: what a forward reads -------------------------------------------------------
    def _used(self, kind: str) -> int:
        return min(self.length, self.slots[kind])

    def kv(self, layer: int) -> KV:
        n = self._used(self.cfg.layers[layer].attention)
        return (self.k[layer][:, :n],), (self.v[layer][:, :n],)

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
            for buffer, rows in ((self.k[layer], k), (self.v[layer], v)):
                buffer[:, slots] = stored_rows(rows[:, n - keep :], buffer.dtype)
        self.length = start + n

    def truncate(self, length: int) -> None:
        """Forget positions >= length (rejected drafts)."""
        if length > self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        for pos in self.slot_positions.values():
            pos[pos >= length] = -1
        self.length = length

    def _tensors(self) -> list[Tensor]:
        return [*self.k.values(), *self.v.values()]

    def row_bytes(self) -> int:
        """Bytes one position's K/V (and their scales) takes over every layer that owns a cache."""
        return sum(t[:, 0].nbytes for t in self._tensors())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())


# --- the static programs' cache ------------------------------------------------------------------


def row_slots(positions: Tensor, slots: int) -> Tensor:
    """Where each row of a static call is written: slot = position % slots, a pad row (its
    position past the last row's) to the trash slot `slots`."""
    return torch.where(positions > positions[-1], slots, positions % slots)


class StaticView:
    """`CacheView` over the static buffers: every slot, or the first `length[kind]` slots of
    each cache (a context bucket); slot positions given (possibly truncated)."""

    def __init__(self, cache: StaticCache, positions: dict[str, Tensor], length: dict[str, int]):
        self.cache = cache
        self.pos = positions
        self.length = length

    def kv(self, layer: int) -> KV:
        n = self.length.get(self.cache.cfg.layers[layer].attention)
        k, v = self.cache.k(layer), self.cache.v(layer)
        if n is None or self.cache.reads_prefix:
            return (k,), (v,)
        return (k[:, :n],), (v[:, :n],)

    def positions(self, kind: AttentionKind) -> Tensor:
        return self.pos[kind]


class StaticCache(nn.Module):
    """The target's KV cache as buffers: `k{i}`/`v{i}` per owning layer `[kv_heads, slots + 1,
    head_dim]` (int8: `head_dim + 4`, each row's scale after its codes) and `pos_{kind}` per
    kind (int64 `[slots + 1]`, -1 = empty); the last slot of each is the trash slot pad rows
    are written to (its position stays -1)."""

    def __init__(
        self,
        cfg: TextConfig,
        max_context: int,
        max_draft: int,
        dtype: torch.dtype = torch.float32,
        reads_prefix: bool = False,
    ):
        super().__init__()
        self.cfg = cfg
        self.slots = cache_slots(cfg, max_context, max_draft)
        # Attention reads a bucket's slots off the whole buffers (the mask's width says how
        # many): the views hand out the buffers unsliced (a slice is a copy in XNNPACK).
        self.reads_prefix = reads_prefix
        for kind, n in self.slots.items():
            self.register_buffer(f"pos_{kind}", torch.full((n + 1,), -1))
        self.owners = [spec.index for spec in cfg.layers if spec.owns_kv]
        self.store_as(dtype)

    def store_as(self, dtype: torch.dtype) -> None:
        """(Re)make the K/V buffers, empty, to store rows as `dtype` (`stored_rows`)."""
        for i in self.owners:
            spec = self.cfg.layers[i]
            width = row_width(spec.head_dim, dtype.itemsize)
            shape = (spec.num_kv_heads, self.slots[spec.attention] + 1, width)
            self.register_buffer(f"k{i}", torch.zeros(shape, dtype=dtype))
            self.register_buffer(f"v{i}", torch.zeros(shape, dtype=dtype))

    def k(self, layer: int) -> Tensor:
        return getattr(self, f"k{layer}")

    def v(self, layer: int) -> Tensor:
        return getattr(self, f"v{layer}")

    def pos(self, kind: str) -> Tensor:
        return getattr(self, f"pos_{kind}")

    def bucket_lengths(self, bucket: int | None) -> dict[str, int]:
        """Slots read per kind through context bucket `bucket`: only caches at least twice its
        length are cut (slicing a sliding ring a few slots longer than the bucket cost more
        than reading those slots)."""
        if bucket is None:
            return {}
        return {k: bucket for k, n in self.slots.items() if 2 * bucket <= n}

    def view(
        self,
        truncate_at: Tensor | None = None,
        bucket: int | None = None,
        positions: dict[str, Tensor] | None = None,
        ops: Primitives = REFERENCE,
    ) -> StaticView:
        """A cache view; with `truncate_at`, slots at positions >= it read as empty; with
        `bucket`, only a bucket's first slots are read; `positions`: the slot positions, when
        the host holds them (Core ML), instead of the buffers."""
        length = self.bucket_lengths(bucket)
        out = {}
        for kind in self.slots:
            p = positions[kind] if positions is not None else self.pos(kind)[: length.get(kind)]
            out[kind] = p if truncate_at is None else ops.truncated(p, truncate_at)
        return StaticView(self, out, length)

    def write(
        self,
        view: StaticView,
        new_kv: dict[int, tuple[Tensor, Tensor]],
        positions: Tensor,
        ops: Primitives,
        store_positions: bool = True,
    ) -> dict[str, Tensor]:
        """Write the rows' K/V with `ops.scatter` (pad rows to the trash slot) and return each
        kind's new slot positions (`ring_positions`), stored in the buffers unless the host
        holds them. Through a bucketed view only the bucket's slot positions are kept up to
        date: a slot past it holds a position at or past the bucket, which every later call
        either rewrites before reaching it or reads as truncated (each call truncates at its
        first position)."""
        new_pos = {k: ops.ring_positions(view.pos[k], positions, n) for k, n in self.slots.items()}
        if store_positions:
            for kind, p in new_pos.items():
                # No index_put here: ExecuTorch's reinplaced index_put on a temporary followed
                # by the buffer write-back lets the planner reuse the temporary's memory early.
                buffer = self.pos(kind)
                (buffer if p.shape[0] == buffer.shape[0] else buffer[: p.shape[0]]).copy_(p)
        slots = {k: row_slots(positions, n) for k, n in self.slots.items()}
        for i, (k, v) in new_kv.items():
            kind = self.cfg.layers[i].attention
            ops.scatter(self.k(i), slots[kind], k)
            ops.scatter(self.v(i), slots[kind], v)
        return new_pos

    def reset(self) -> None:
        """Empty the cache (eager only; a program reset is a prefill at position 0)."""
        for kind in self.slots:
            self.pos(kind).fill_(-1)
        for i in self.owners:
            self.k(i).zero_()
            self.v(i).zero_()


# --- the context buckets a static program has ------------------------------------------------


def bucket_for(buckets: tuple[int, ...], end: int) -> int | None:
    """The smallest context bucket holding positions < `end` (None: the whole cache)."""
    i = bisect_left(buckets, end)  # a decode step asks at every call
    return buckets[i] if i < len(buckets) else None
