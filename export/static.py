"""Static-shape wrappers around the target and drafter: the graphs an export bundle contains.

The wrappers reuse `Gemma4Target` / `Gemma4Drafter` as they are and add only what a static,
multi-method program needs:

- the KV cache lives in registered buffers of one `StaticCache` module, shared by every method
  (same module, same buffer names): K/V per owning layer `[kv_heads, slots + 1, head_dim]` and a
  slot-position vector per attention kind (int64 `[slots + 1]`, -1 = empty). The extra last slot
  is a trash slot: padding rows are written there, its position stays -1;
- every graph reads the whole static cache (or, in a context bucket's decode methods, its first
  slots) and relies on the position masks, so no shape depends on data; new K/V are written
  in-graph with `index_copy_` at slot = position % slots;
- rollback is implicit: a method that writes first marks every slot whose position is >= its
  first real position as empty (the caller always writes at the committed length, as
  `KVCache.write` requires), so rejected drafts vanish on the next write and there is no separate
  rollback call. The drafter never needs it: its mask only admits positions < its own;
- a final prefill chunk shorter than the static chunk is left-padded: pad rows take the position
  right after the prompt (so no real row attends to them, and they always see themselves, never a
  fully masked row), zero embeddings, and are written to the trash slot. A row is a pad iff its
  position is greater than the last row's.

Embedding and PLE table lookups stay on the host; the graphs take embeddings, PLE rows and
positions.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from edgemtp.export.exportable import clear_mask_memo, make_exportable
from edgemtp.model.config import AttentionKind, TextConfig
from edgemtp.model.gemma4 import Gemma4Drafter, Gemma4Target, prompt_chunk
from edgemtp.runtime.kv_cache import cache_slots

CONTEXT_STEP = 4  # auto context buckets: 512, 2048, 8192, ... below the max context
SMALLEST_BUCKET = 512
FIRST_BUCKETED_CONTEXT = 2048  # below, the whole cache is cheap next to the weights


def auto_context_buckets(max_context: int) -> tuple[int, ...]:
    """Buckets for `--context-buckets auto`: 512 x 4^k below `max_context`, none under 2048
    (each bucket adds decode methods, and export time, for a cache that costs little)."""
    out, b = [], SMALLEST_BUCKET
    while max_context >= FIRST_BUCKETED_CONTEXT and b < max_context:
        out.append(b)
        b *= CONTEXT_STEP
    return tuple(out)


@dataclass(frozen=True)
class StaticShapes:
    """The static sizes every graph of a bundle is built for.

    `context_buckets`: cache lengths below `max_context` with their own methods
    (`verify_K_ctxN`, `draft_step_ctxN`, `prefill_final_ctxN`, `prefill_intermediate_ctxN`)
    that read only the first N slots of each cache. A static program otherwise reads every
    slot at every call: on PEER-90M (max context 4096) a decode step at position 100 takes
    6.8 ms through the whole cache and 3.8 ms through 512 slots, and a prompt's first chunk
    attends to all 4097 slots however short the prompt. While the context is shorter than N,
    slot = position % slots < N, so nothing is lost.
    """

    max_context: int
    max_draft: int
    chunk: int
    context_buckets: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        buckets = tuple(sorted(set(self.context_buckets)))
        bad = [b for b in buckets if not self.max_draft < b < self.max_context]
        if bad:
            raise ValueError(
                f"context buckets {bad} must lie between the draft depth + 1 "
                f"({self.max_draft + 1}) and the max context ({self.max_context}), exclusive"
            )
        object.__setattr__(self, "context_buckets", buckets)

    def verify_depths(self) -> tuple[int, ...]:
        """Draft depths with a verify method: 0 (plain AR decode) and the deepest. A shallower
        round is left-padded to the deepest method: its linears cost about the same (weight
        reads dominate), and every method costs export time (a minute or more per method
        for ExecuTorch on tiny models)."""
        return (0, self.max_draft) if self.max_draft else (0,)

    def bucket(self, end: int) -> int | None:
        """The smallest context bucket holding positions < `end` (None: the whole cache)."""
        i = bisect_left(self.context_buckets, end)  # a decode step asks at every call
        return self.context_buckets[i] if i < len(self.context_buckets) else None

    def verify_method(self, depth: int, end: int | None = None) -> tuple[str, int]:
        """The verify method for a round of `depth` drafts ending before position `end` (None:
        any position) and how many pad rows it needs."""
        k = min(d for d in self.verify_depths() if d >= depth)
        return bucketed(f"verify_{k}", None if end is None else self.bucket(end)), k - depth

    def draft_method(self, position: int) -> str:
        """The draft-step method for a step at `position` (it reads positions < it)."""
        return bucketed("draft_step", self.bucket(position))

    def prefill_method(self, final: bool, end: int) -> str:
        """The prefill method for a chunk whose rows end before position `end`."""
        return bucketed("prefill_final" if final else "prefill_intermediate", self.bucket(end))


def bucketed(method: str, bucket: int | None) -> str:
    return method if bucket is None else f"{method}_ctx{bucket}"


def method_kind(name: str) -> str:
    """`verify_3_ctx512` -> `verify`, `draft_step_ctx512` -> `draft_step`."""
    base = name.split("_ctx")[0]
    return base.rstrip("0123456789").rstrip("_")


class _View:
    """`CacheView` over the static buffers: every slot, or the first `length[kind]` slots of
    each cache (a context bucket); positions possibly truncated."""

    def __init__(self, cache: StaticCache, positions: dict[str, Tensor], length: dict[str, int]):
        self.cache = cache
        self.pos = positions
        self.length = length

    def kv(self, layer: int) -> tuple[Tensor, Tensor]:
        n = self.length.get(self.cache.cfg.layers[layer].attention)
        k, v = self.cache.k(layer), self.cache.v(layer)
        if n is None or self.cache.attention_reads_prefix:
            return k, v
        return k[:, :n], v[:, :n]

    def positions(self, kind: AttentionKind) -> Tensor:
        n = self.length.get(kind)
        return self.pos[kind] if n is None else self.pos[kind][:n]


class StaticCache(nn.Module):
    """The target's KV cache as buffers: `k{i}`/`v{i}` per owning layer, `pos_{kind}` per kind."""

    def __init__(
        self, cfg: TextConfig, max_context: int, max_draft: int, dtype: torch.dtype = torch.float32
    ):
        super().__init__()
        self.cfg = cfg
        self.slots = cache_slots(cfg, max_context, max_draft)
        # Set when attention reads a bucket's slots off the whole buffer by the mask's width
        # (`exportable.KernelAttention`): the view then hands out the buffers unsliced.
        self.attention_reads_prefix = False
        for kind, n in self.slots.items():
            self.register_buffer(f"pos_{kind}", torch.full((n + 1,), -1))
        self.owners = [spec.index for spec in cfg.layers if spec.owns_kv]
        for i in self.owners:
            spec = cfg.layers[i]
            shape = (spec.num_kv_heads, self.slots[spec.attention] + 1, spec.head_dim)
            self.register_buffer(f"k{i}", torch.zeros(shape, dtype=dtype))
            self.register_buffer(f"v{i}", torch.zeros(shape, dtype=dtype))

    def use_dtype(self, dtype: torch.dtype) -> None:
        """Store K/V in `dtype` (new rows are converted as they are written)."""
        for i in self.owners:
            for name in (f"k{i}", f"v{i}"):
                self.register_buffer(name, getattr(self, name).to(dtype))

    def k(self, layer: int) -> Tensor:
        return getattr(self, f"k{layer}")

    def v(self, layer: int) -> Tensor:
        return getattr(self, f"v{layer}")

    def pos(self, kind: str) -> Tensor:
        return getattr(self, f"pos_{kind}")

    def view(self, truncate_at: Tensor | None = None, bucket: int | None = None) -> _View:
        """A cache view; with `truncate_at`, slots at positions >= it read as empty; with
        `bucket`, only the first `bucket` slots are read of each cache at least twice that
        long. A slice is a copy in XNNPACK: slicing PEER-90M's 516-slot sliding rings to 512
        made its 512-bucket decode step 4.2 ms instead of 3.8 ms."""
        length = {
            k: bucket for k, n in self.slots.items() if bucket is not None and 2 * bucket <= n
        }
        out = {}
        for kind in self.slots:
            p = self.pos(kind)[: length.get(kind)]
            out[kind] = p if truncate_at is None else torch.where(p >= truncate_at, -1, p)
        return _View(self, out, length)

    def write(
        self, view: _View, new_kv: dict[int, tuple[Tensor, Tensor]], positions: Tensor
    ) -> None:
        """Store the rows' K/V (pad rows to the trash slot) and the truncated + new positions.
        The rows that are not pads hold consecutive positions ending at the last row (pads, at
        the last position + 1, come first), as every caller passes them; so each ring slot's
        new position is the newest position up to the last row's that lands in it, where that
        is not before the first row's: arithmetic over [slots], not a compare of every slot
        with every row (over [slots, rows] in portable kernels: 81 k of the 232 k elements a
        demo prefill chunk wrote outside the delegates).
        Through a bucketed view only the bucket's slot positions are kept up to date: a slot
        past it holds a position at or past the bucket, which every later call either rewrites
        before reaching it or reads as truncated (each call truncates at its first position)."""
        pad = positions > positions[-1]
        slot = {k: torch.where(pad, n, positions % n) for k, n in self.slots.items()}
        first, last = positions.min(), positions[-1]
        for kind, n in self.slots.items():
            kept = view.pos[kind]  # all slots + the trash slot, or the bucket's slots
            ring = torch.arange(kept.shape[0])
            newest = last - (last - ring) % n  # the newest position up to `last` in each slot
            written = (newest >= first) & (ring < n)  # slot n is the pad rows' trash
            # No index_put here: ExecuTorch's reinplaced index_put on a temporary followed by the
            # buffer write-back lets the planner reuse the temporary's memory too early.
            pos = self.pos(kind)
            (pos if kept.shape[0] == n + 1 else pos[: kept.shape[0]]).copy_(
                torch.where(written, newest, kept)
            )
        for i, (k, v) in new_kv.items():
            idx = slot[self.cfg.layers[i].attention]
            self.k(i).index_copy_(1, idx, k.to(self.k(i).dtype))
            self.v(i).index_copy_(1, idx, v.to(self.v(i).dtype))

    def reset(self) -> None:
        """Empty the cache (eager only; a program reset is a prefill at position 0)."""
        for kind in self.slots:
            self.pos(kind).fill_(-1)
        for i in self.owners:
            self.k(i).zero_()
            self.v(i).zero_()


class StaticTarget(nn.Module):
    """Target methods over the shared cache: prefill chunks (intermediate/final) and verify."""

    def __init__(self, model: Gemma4Target, kvcache: StaticCache):
        super().__init__()
        self.target = model  # distinct attribute names keep weight names distinct across methods
        self.kvcache = kvcache
        self.has_ple = model.cfg.hidden_size_per_layer_input > 0

    def _forward(
        self, embeds: Tensor, token_ple: Tensor, positions: Tensor, rows: str, bucket: int | None
    ) -> Tensor | None:
        clear_mask_memo()
        view = self.kvcache.view(truncate_at=positions.min(), bucket=bucket)
        ple = token_ple if self.has_ple else None
        hidden, new_kv = self.target(embeds, ple, positions, view, rows)  # type: ignore[arg-type]
        self.kvcache.write(view, new_kv, positions)
        return hidden

    def prefill_intermediate(
        self, embeds: Tensor, token_ple: Tensor, positions: Tensor, bucket: int | None = None
    ) -> Tensor:
        """A full chunk that is not the prompt's last: KV-shared layers skipped. Returns the new
        cache length [1]. With `bucket`, attention reads only that many cache slots."""
        with prompt_chunk():
            self._forward(embeds, token_ple, positions, "none", bucket)
        return positions[-1:] + 1

    def prefill_final(
        self, embeds: Tensor, token_ple: Tensor, positions: Tensor, bucket: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """The prompt's last chunk (left-padded): (last hidden [hidden], logits [vocab])."""
        with prompt_chunk():
            hidden = self._forward(embeds, token_ple, positions, "last", bucket)
            assert hidden is not None
            last = hidden[-1]
            return last, self.target.logits(last)

    def verify(
        self, embeds: Tensor, token_ple: Tensor, positions: Tensor, bucket: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """k+1 rows through every layer: (logits [k+1, vocab], hidden [k+1, hidden]); with
        `bucket`, attention reads only that many cache slots."""
        hidden = self._forward(embeds, token_ple, positions, "all", bucket)
        assert hidden is not None
        return self.target.logits(hidden), hidden

    def cache_state(self, dummy: Tensor) -> tuple[Tensor, ...]:
        """Debug method: slot positions per kind, then K and V of every owning layer."""
        c = self.kvcache
        out = [c.pos(kind) + 0 for kind in c.slots]
        for i in c.owners:
            out += [c.k(i) + dummy, c.v(i) + dummy]
        return tuple(out)


class StaticDrafter(nn.Module):
    """One draft step reading the target's cache buffers in place (never copying them)."""

    def __init__(self, model: Gemma4Drafter, kvcache: StaticCache):
        super().__init__()
        self.drafter = model
        self.kvcache = kvcache

    def draft_step(
        self, token_embed: Tensor, hidden: Tensor, position: Tensor, bucket: int | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(target embedding of the last token [H], hidden [H], position [1]) ->
        (next hidden [H], token ids [n], their logits [n]); ids cover the whole vocabulary
        when the drafter has no clustered head."""
        clear_mask_memo()
        pos = position[0].item()  # a Python int in eager, an unbacked SymInt under export
        out_hidden, ids, logits = self.drafter(
            token_embed,
            hidden,
            pos,
            self.kvcache.view(bucket=bucket),  # type: ignore[arg-type]
        )
        if ids is None:
            ids = torch.arange(logits.shape[0])
        return out_hidden, ids, logits


class Method(nn.Module):
    """One exportable method: forward = `owner.<name>`. Every method module holds its owner
    under the same attribute, and both owners hold the cache as `kvcache`, so buffer names
    (`owner.kvcache.k3`, ...) are identical across methods; that is what shares them."""

    def __init__(self, owner: nn.Module, name: str, bucket: int | None = None):
        super().__init__()
        self.owner = owner
        self.name = name
        self.bucket = bucket  # a context bucket: a constant of the traced graph

    def forward(self, *args: Tensor) -> Tensor | tuple[Tensor, ...]:
        if self.bucket is None:
            return getattr(self.owner, self.name)(*args)
        return getattr(self.owner, self.name)(*args, bucket=self.bucket)


@dataclass
class StaticBundle:
    """The target and drafter wrappers around one shared cache, plus example inputs."""

    shapes: StaticShapes
    cache: StaticCache
    target: StaticTarget
    drafter: StaticDrafter | None

    @classmethod
    def build(
        cls,
        target: Gemma4Target,
        drafter: Gemma4Drafter | None,
        shapes: StaticShapes,
        exportable: bool = True,
    ) -> StaticBundle:
        """Wrap the models; `exportable` swaps their norms and attention to the XNNPACK-friendly
        forms of `exportable.py` in place (the models then belong to the bundle)."""
        if exportable:
            make_exportable(target)
            if drafter is not None:
                make_exportable(drafter)
        cfg = target.cfg
        cache = StaticCache(cfg, shapes.max_context, shapes.max_draft)
        if shapes.chunk > min(cache.slots.values()):
            raise ValueError(
                f"prefill chunk {shapes.chunk} exceeds the smallest cache ({cache.slots})"
            )
        return cls(
            shapes,
            cache,
            StaticTarget(target, cache).eval(),
            StaticDrafter(drafter, cache).eval() if drafter is not None else None,
        )

    def example_inputs(self, rows: int) -> tuple[Tensor, Tensor, Tensor]:
        cfg = self.target.target.cfg
        ple = max(cfg.hidden_size_per_layer_input, 1)
        return (
            torch.zeros(rows, cfg.hidden_size),
            torch.zeros(rows, cfg.num_layers, ple),
            torch.arange(rows),
        )

    def methods(self, debug: bool = False) -> dict[str, tuple[Method, tuple[Tensor, ...]]]:
        """Method name -> (module, example inputs) for `torch.export`; `debug` adds
        `cache_state`."""
        c = self.shapes.chunk
        out: dict[str, tuple[Method, tuple[Tensor, ...]]] = {}
        buckets = (None, *self.shapes.context_buckets)
        for name in ("prefill_intermediate", "prefill_final"):
            for b in buckets:
                out[bucketed(name, b)] = (Method(self.target, name, b), self.example_inputs(c))
        for k in self.shapes.verify_depths():
            for b in buckets:
                out[bucketed(f"verify_{k}", b)] = (
                    Method(self.target, "verify", b),
                    self.example_inputs(k + 1),
                )
        if debug:
            out["cache_state"] = (Method(self.target, "cache_state"), (torch.zeros(1),))
        if self.drafter is not None:
            h = self.target.target.cfg.hidden_size
            for b in buckets:
                out[bucketed("draft_step", b)] = (
                    Method(self.drafter, "draft_step", b),
                    (torch.zeros(h), torch.zeros(h), torch.tensor([1])),
                )
        return out
