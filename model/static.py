"""The static methods a bundle's program holds: the model body at fixed shapes over one cache.

Every exporter traces these methods (ExecuTorch, ONNX, Core ML) and the eager runner calls them:

- `prefill_intermediate` (a full prompt chunk that is not the last: the KV-shared layers are
  skipped), `prefill_final` (the prompt's last chunk, left-padded: the KV-shared layers on its
  last row only), `verify_K` (K + 1 rows through every layer: AR decode is `verify_0`) and
  `draft_step` (one drafter step reading the target's cache in place);
- all share one `StaticCache`; the methods read every slot of it (or of a context bucket's
  first slots, `*_ctxN`) and rely on the position masks, so no shape depends on data;
- a final prefill chunk shorter than the static chunk is left-padded: pad rows take the position
  right after the prompt (so no real row attends to them, and they always see themselves, never a
  fully masked row), zero embeddings, and are written to the trash slot;
- embedding and PLE table lookups stay on the host: the methods take embeddings, PLE rows and
  positions.

A method runs the body with its backend form's primitives (`model/primitives.py`): the step table
for verify and draft, the chunk table for prompt chunks. Where the form keeps the cache as the
program's state, which cannot hold positions (Core ML: `Form.cache_as_states`), the slot
positions are inputs and outputs the host keeps, and the drafter touches every state (a
function must use each state it declares).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from edgemtp.model.cache import StaticCache, bucket_for
from edgemtp.model.gemma4 import CacheView, Gemma4Drafter, Gemma4Target
from edgemtp.model.primitives import REFERENCE_FORM, Form, apply_form
from edgemtp.model.tables import TableInGraph

CONTEXT_STEP = 4  # auto context buckets: 512, 2048, 8192, ... below the max context
SMALLEST_BUCKET = 512
FIRST_BUCKETED_CONTEXT = 2048  # below, the whole cache is cheap next to the weights

# Each method's inputs and outputs, by kind: the names every backend and the manifest use.
TARGET_INPUTS = ("embeds", "token_ple", "positions")
DRAFTER_INPUTS = ("token_embed", "hidden", "position")
METHOD_IO: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "prefill_intermediate": (TARGET_INPUTS, ("cache_length",)),
    "prefill_final": (TARGET_INPUTS, ("hidden", "logits")),
    "verify": (TARGET_INPUTS, ("logits", "hidden")),
    "draft_step": (DRAFTER_INPUTS, ("next_hidden", "token_ids", "logits")),
    "draft": (("token", "hidden", "position"), ("tokens",)),
}


def auto_context_buckets(max_context: int) -> tuple[int, ...]:
    """Buckets for `--context-buckets auto`: 512 x 4^k below `max_context`, none under 2048
    (each bucket adds decode methods, and export time, for a cache that costs little)."""
    out, b = [], SMALLEST_BUCKET
    while max_context >= FIRST_BUCKETED_CONTEXT and b < max_context:
        out.append(b)
        b *= CONTEXT_STEP
    return tuple(out)


def bucketed(method: str, bucket: int | None) -> str:
    return method if bucket is None else f"{method}_ctx{bucket}"


def method_kind(name: str) -> str:
    """`verify_3_ctx512` -> `verify`, `draft_step_ctx512` -> `draft_step`."""
    base = name.split("_ctx")[0]
    return base.rstrip("0123456789").rstrip("_")


def method_io(name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(input names, output names) of a method, by its kind."""
    return METHOD_IO[method_kind(name)]


@dataclass(frozen=True)
class StaticShapes:
    """The static sizes every method of a bundle is built for.

    `context_buckets`: cache lengths below `max_context` with their own methods
    (`verify_K_ctxN`, `draft_step_ctxN`, `prefill_final_ctxN`, `prefill_intermediate_ctxN`)
    that read only the first N slots of each cache: a static program otherwise reads every
    slot at every call. While the context is shorter than N, slot = position % slots < N, so
    nothing is lost.
    """

    max_context: int
    max_draft: int
    chunk: int
    context_buckets: tuple[int, ...] = ()
    # Draft depths with a verify method (None: 0 and the deepest; a shallower round is
    # left-padded into the next one). Every depth 0..max_draft (`every_depth`): no round pays
    # for the deepest's rows, for an export method more per depth.
    verify_depths: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        depths = (0, self.max_draft) if self.verify_depths is None else self.verify_depths
        depths = tuple(sorted(set(depths)))
        if not depths or depths[0] != 0 or depths[-1] != self.max_draft:
            raise ValueError(
                f"verify depths {depths} must include 0 (AR decode) and the deepest, "
                f"{self.max_draft}"
            )
        object.__setattr__(self, "verify_depths", depths)
        buckets = tuple(sorted(set(self.context_buckets)))
        bad = [b for b in buckets if not self.max_draft < b < self.max_context]
        if bad:
            raise ValueError(
                f"context buckets {bad} must lie between the draft depth + 1 "
                f"({self.max_draft + 1}) and the max context ({self.max_context}), exclusive"
            )
        object.__setattr__(self, "context_buckets", buckets)

    def every_depth(self) -> StaticShapes:
        """These shapes with a verify method per draft depth."""
        return replace(self, verify_depths=tuple(range(self.max_draft + 1)))

    @classmethod
    def from_manifest(cls, shapes: dict) -> StaticShapes:
        """The shapes a manifest records; one written before `verify_depths` has (0, max)."""
        fields = dict(shapes)
        if "verify_depths" not in fields:
            fields["verify_depths"] = (0, fields["max_draft"])
        fields["verify_depths"] = tuple(fields["verify_depths"])
        fields["context_buckets"] = tuple(fields.get("context_buckets", ()))
        return cls(**fields)

    def bucket(self, end: int) -> int | None:
        """The smallest context bucket holding positions < `end` (None: the whole cache)."""
        return bucket_for(self.context_buckets, end)

    def verify_method(self, depth: int, end: int | None = None) -> tuple[str, int]:
        """The verify method for a round of `depth` drafts ending before position `end` (None:
        any position) and how many pad rows it needs."""
        k = min(d for d in self.verify_depths if d >= depth)
        return bucketed(f"verify_{k}", None if end is None else self.bucket(end)), k - depth

    def draft_method(self, position: int) -> str:
        """The draft-step method for a step at `position` (it reads positions < it)."""
        return bucketed("draft_step", self.bucket(position))

    def chain_method(self, depth: int, position: int) -> str:
        """The method drafting `depth` tokens greedily in one call at `position`."""
        return bucketed(f"draft_{depth}", self.bucket(position))

    def prefill_method(self, final: bool, end: int) -> str:
        """The prefill method for a chunk whose rows end before position `end`."""
        return bucketed("prefill_final" if final else "prefill_intermediate", self.bucket(end))


class TargetMethods(nn.Module):
    """Target methods over the shared cache: prefill chunks (intermediate/final) and verify."""

    def __init__(self, model: Gemma4Target, kvcache: StaticCache, form: Form):
        super().__init__()
        self.target = model  # distinct attribute names keep weight names distinct across methods
        self.kvcache = kvcache
        self.form = form
        self.has_ple = model.cfg.hidden_size_per_layer_input > 0

    def _forward(
        self,
        embeds: Tensor,
        token_ple: Tensor,
        positions: Tensor,
        slot_pos: tuple[Tensor, ...],
        rows: str,
        chunk: bool,
        bucket: int | None,
    ) -> tuple[Tensor | None, tuple[Tensor, ...]]:
        ops = self.form.chunk if chunk else self.form.step
        cache = self.kvcache
        held = dict(zip(cache.slots, slot_pos, strict=True)) if self.form.cache_as_states else None
        view = cache.view(truncate_at=positions.min(), bucket=bucket, positions=held, ops=ops)
        dtype = self.target.norm.weight.dtype  # fp16 where a form computes in fp16
        ple = token_ple.to(dtype) if self.has_ple else None
        hidden, new_kv = self.target(embeds.to(dtype), ple, positions, view, rows, ops)  # type: ignore[arg-type]
        new_pos = cache.write(view, new_kv, positions, ops, not self.form.cache_as_states)
        return hidden, tuple(new_pos.values()) if self.form.cache_as_states else ()

    def prefill_intermediate(
        self, embeds: Tensor, token_ple: Tensor, positions: Tensor, *slot_pos: Tensor,
        bucket: int | None = None,
    ) -> tuple[Tensor, ...]:  # fmt: skip
        """A full chunk that is not the prompt's last: KV-shared layers skipped. Returns the new
        cache length [1]."""
        _, new_pos = self._forward(embeds, token_ple, positions, slot_pos, "none", True, bucket)
        return positions[-1:] + 1, *new_pos

    def prefill_final(
        self, embeds: Tensor, token_ple: Tensor, positions: Tensor, *slot_pos: Tensor,
        bucket: int | None = None,
    ) -> tuple[Tensor, ...]:  # fmt: skip
        """The prompt's last chunk (left-padded): (last hidden [hidden], logits [vocab])."""
        hidden, new_pos = self._forward(
            embeds, token_ple, positions, slot_pos, "last", True, bucket
        )
        assert hidden is not None
        last = hidden[-1]
        logits = self.target.logits(last, self.form.chunk)
        return last.float(), logits.float(), *new_pos

    def verify(
        self, embeds: Tensor, token_ple: Tensor, positions: Tensor, *slot_pos: Tensor,
        bucket: int | None = None,
    ) -> tuple[Tensor, ...]:  # fmt: skip
        """k+1 rows through every layer: (logits [k+1, vocab], hidden [k+1, hidden])."""
        hidden, new_pos = self._forward(
            embeds, token_ple, positions, slot_pos, "all", False, bucket
        )
        assert hidden is not None
        return self.target.logits(hidden, self.form.step).float(), hidden.float(), *new_pos

    def cache_state(self, dummy: Tensor) -> tuple[Tensor, ...]:
        """Debug method: slot positions per kind, then K and V of every owning layer."""
        c = self.kvcache
        out = [c.pos(kind) + 0 for kind in c.slots]
        for i in c.owners:
            out += [c.k(i) + dummy, c.v(i) + dummy]
        return tuple(out)


class DrafterMethods(nn.Module):
    """Draft steps reading the target's cache buffers in place (never copying them): one step
    (`draft_step`), or, given the token table (`embedding`), a greedy chain of them."""

    def __init__(
        self,
        model: Gemma4Drafter,
        kvcache: StaticCache,
        form: Form,
        embedding: TableInGraph | None = None,
    ):
        super().__init__()
        self.drafter = model
        self.kvcache = kvcache
        self.form = form
        self.embedding = embedding

    def _view(self, bucket: int | None, slot_pos: tuple[Tensor, ...]) -> CacheView:
        cache = self.kvcache
        held = dict(zip(cache.slots, slot_pos, strict=True)) if self.form.cache_as_states else None
        return cache.view(bucket=bucket, positions=held)

    def _touch_states(self) -> None:
        """Where the cache is the program's state, a function must use each state it declares:
        no mask admits a trash slot, so zeroing it touches each state and changes nothing."""
        if self.form.cache_as_states:
            for i in self.kvcache.owners:
                self.kvcache.k(i)[:, -1:] = 0.0
                self.kvcache.v(i)[:, -1:] = 0.0

    def draft(
        self, token: Tensor, hidden: Tensor, position: Tensor, *slot_pos: Tensor,
        depth: int, bucket: int | None = None,
    ) -> tuple[Tensor]:  # fmt: skip
        """(last committed token [1], hidden [H], position [1]) -> (the `depth` greedy drafts
        [depth],): the draft steps and their picks in one call."""
        assert self.embedding is not None
        dtype = self.drafter.norm.weight.dtype
        embedding = self.embedding
        tokens = self.drafter.chain(
            lambda ids: embedding(ids).to(dtype), token, hidden.to(dtype), position,
            self._view(bucket, slot_pos), depth, self.form.step,
        )  # fmt: skip
        self._touch_states()
        return (tokens,)

    def draft_step(
        self, token_embed: Tensor, hidden: Tensor, position: Tensor, *slot_pos: Tensor,
        bucket: int | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """(target embedding of the last token [H], hidden [H], position [1]) ->
        (next hidden [H], token ids [n], their logits [n]); ids cover the whole vocabulary
        when the drafter has no clustered head."""
        dtype = self.drafter.norm.weight.dtype
        next_hidden, ids, logits = self.drafter(
            token_embed.to(dtype),
            hidden.to(dtype),
            position,
            self._view(bucket, slot_pos),
            self.form.step,
        )
        self._touch_states()
        if ids is None:
            ids = torch.arange(logits.shape[0])
        return next_hidden.float(), ids, logits.float()


class Method(nn.Module):
    """One exportable method: forward = `owner.<name>`. Every method module holds its owner
    under the same attribute, and both owners hold the cache as `kvcache`, so buffer names
    (`owner.kvcache.k3`, ...) are identical across methods; that is what shares them."""

    def __init__(self, owner: nn.Module, name: str, bucket: int | None = None, **constants: int):
        super().__init__()
        self.owner = owner
        self.name = name
        self.bucket = bucket  # a context bucket: a constant of the traced graph
        self.constants = constants  # others (a draft chain's depth)

    def forward(self, *args: Tensor) -> tuple[Tensor, ...]:
        if self.bucket is None:
            return getattr(self.owner, self.name)(*args, **self.constants)
        return getattr(self.owner, self.name)(*args, bucket=self.bucket, **self.constants)


@dataclass
class StaticBundle:
    """The target and drafter methods around one shared cache, in one backend form."""

    shapes: StaticShapes
    cache: StaticCache
    target: TargetMethods
    drafter: DrafterMethods | None
    form: Form
    stats: dict = field(default_factory=dict)  # what the form's `prepare` converted

    @classmethod
    def build(
        cls,
        target: Gemma4Target,
        drafter: Gemma4Drafter | None,
        shapes: StaticShapes,
        form: Form = REFERENCE_FORM,
        embedding: TableInGraph | None = None,
    ) -> StaticBundle:
        """Wrap the models in `form` (their weights converted in place: the models then belong
        to the bundle). `embedding`, the target's token table in a program's form, adds the
        greedy draft chains `draft_K` (K = 1..max_draft)."""
        cache = StaticCache(target.cfg, shapes.max_context, shapes.max_draft)
        if shapes.chunk > min(cache.slots.values()):
            raise ValueError(
                f"prefill chunk {shapes.chunk} exceeds the smallest cache ({cache.slots})"
            )
        bundle = cls(
            shapes,
            cache,
            TargetMethods(target, cache, REFERENCE_FORM).eval(),
            None
            if drafter is None
            else DrafterMethods(drafter, cache, REFERENCE_FORM, embedding).eval(),
            REFERENCE_FORM,
        )
        bundle.stats = bundle.use_form(form)
        return bundle

    def models(self) -> list[nn.Module]:
        out: list[nn.Module] = [self.target.target]
        if self.drafter is not None:
            out.append(self.drafter.drafter)
        return out

    def use_form(self, form: Form) -> dict:
        """Put the bundle in `form`: its weights converted (`apply_form`), the cache in the
        form's dtype and read as it reads it. Returns what was converted."""
        stats = apply_form(self.models(), form) if form is not self.form else {}
        self.form = self.target.form = form
        if self.drafter is not None:
            self.drafter.form = form
        self.cache.reads_prefix = form.reads_cache_prefix
        if self.cache.k(self.cache.owners[0]).dtype != form.cache_dtype:  # else: kept as they are
            self.cache.store_as(form.cache_dtype)
        return stats

    def example_inputs(self, rows: int) -> tuple[Tensor, ...]:
        cfg = self.target.target.cfg
        ple = max(cfg.hidden_size_per_layer_input, 1)
        return (
            torch.zeros(rows, cfg.hidden_size),
            torch.zeros(rows, cfg.num_layers, ple),
            torch.arange(rows),
            *self.slot_positions(),
        )

    def slot_positions(self) -> tuple[Tensor, ...]:
        """Empty slot positions, the extra inputs of methods whose host keeps them."""
        if not self.form.cache_as_states:
            return ()
        return tuple(torch.full_like(self.cache.pos(k), -1) for k in self.cache.slots)

    def methods(self, debug: bool = False) -> dict[str, tuple[Method, tuple[Tensor, ...]]]:
        """Method name -> (module, example inputs) for tracing; `debug` adds `cache_state`."""
        c = self.shapes.chunk
        out: dict[str, tuple[Method, tuple[Tensor, ...]]] = {}
        buckets = (None, *self.shapes.context_buckets)
        for name in ("prefill_intermediate", "prefill_final"):
            for b in buckets:
                out[bucketed(name, b)] = (Method(self.target, name, b), self.example_inputs(c))
        for k in self.shapes.verify_depths:
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
                    (torch.zeros(h), torch.zeros(h), torch.tensor([1]), *self.slot_positions()),
                )
            chains = self.drafter.embedding is not None
            for k in range(1, self.shapes.max_draft + 1) if chains else ():
                for b in buckets:
                    out[bucketed(f"draft_{k}", b)] = (
                        Method(self.drafter, "draft", b, depth=k),
                        (
                            torch.tensor([1]),
                            torch.zeros(h),
                            torch.tensor([1]),
                            *self.slot_positions(),
                        ),
                    )
        return out
