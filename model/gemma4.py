"""The Gemma 4 text decoder (target) and its MTP assistant (drafter): the one body every backend
runs, in plain PyTorch. Read top to bottom: the layer, the target, the drafter.

Conventions, chosen so the same code can be lowered with static shapes later:
- one sequence, no batch dimension: hidden states are [T, hidden];
- caches are [kv_heads, slots, head_dim] with a position per slot (-1: empty); attention masks
  are built from positions, never from where an entry sits in a tensor;
- embedding lookups (token table, per-layer table) happen on the host (`model/tables.py`),
  outside the layers: the tables may stay memory-mapped in their stored dtype;
- a forward returns the new K/V of the layers that own a cache and leaves writing them to the
  caller (`model/cache.py`), so rejected drafts are never forced into a cache;
- every computation goes through `ops`, a backend form's table of primitives
  (`model/primitives.py`): the reference computes in plain PyTorch, an export form in the ops
  its backend lowers well. The body never changes with the form.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol

import torch
from torch import Tensor, nn

from edgemtp.model.config import AssistantConfig, AttentionKind, LayerSpec, RopeSpec, TextConfig
from edgemtp.model.primitives import KV, REFERENCE, Primitives

RowSelection = Literal["all", "last", "none"]


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) [* weight] over the last dim (`ops.norm` computes it)."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None


def rope_inv_freq(head_dim: int, rope: RopeSpec) -> Tensor:
    """Inverse frequencies; "proportional" RoPE rotates only the first part of the head."""
    if rope.proportional:
        angles = int(rope.partial_rotary_factor * head_dim // 2)
        exponents = torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim
        inv = torch.cat([1.0 / rope.theta**exponents, torch.zeros(head_dim // 2 - angles)])
    else:
        inv = 1.0 / rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    return inv / rope.factor


def register_rope(module: nn.Module, cfg: TextConfig) -> None:
    """(Re)create the `<kind>_inv_freq` buffers, e.g. after building a model on the meta device."""
    for kind in sorted(set(cfg.layer_types)):
        freq = rope_inv_freq(cfg.head_dim_of(kind), cfg.rope[kind])
        module.register_buffer(f"{kind}_inv_freq", freq, persistent=False)


class Attention(nn.Module):
    """The attention weights of one layer (`ops.heads` and `ops.attention` compute with them)."""

    def __init__(self, cfg: TextConfig, spec: LayerSpec):
        super().__init__()
        hidden, heads, hd = cfg.hidden_size, cfg.num_heads, spec.head_dim
        self.spec = spec
        self.q_proj = nn.Linear(hidden, heads * hd, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        if spec.owns_kv:
            self.k_proj = nn.Linear(hidden, spec.num_kv_heads * hd, bias=False)
            self.v_proj = (
                None if spec.k_eq_v else nn.Linear(hidden, spec.num_kv_heads * hd, bias=False)
            )
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.v_norm = RMSNorm(hd, cfg.rms_norm_eps, with_scale=False)
        self.o_proj = nn.Linear(heads * hd, hidden, bias=False)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, spec: LayerSpec):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.spec = spec
        self.self_attn = Attention(cfg, spec)
        self.mlp = MLP(h, spec.intermediate_size)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.has_ple = cfg.hidden_size_per_layer_input > 0
        if self.has_ple:
            self.per_layer_input_gate = nn.Linear(h, cfg.hidden_size_per_layer_input, bias=False)
            self.per_layer_projection = nn.Linear(cfg.hidden_size_per_layer_input, h, bias=False)
            self.post_per_layer_input_norm = RMSNorm(h, eps)

    def new_kv(
        self, h: Tensor, rope: tuple[Tensor, Tensor], ops: Primitives
    ) -> tuple[Tensor, Tensor]:
        """Only this layer's new K/V for the rows of h: an intermediate prefill chunk's last
        owning layer, whose output no later layer reads."""
        x = ops.norm(self.input_layernorm, h)
        _, k, v = ops.heads(self.self_attn, x, *rope, q=False)
        assert k is not None and v is not None
        return k, v

    def forward(
        self,
        h: Tensor,
        rope: tuple[Tensor, Tensor],
        past: KV,
        mask: Tensor,
        ple: Tensor | None,
        ops: Primitives = REFERENCE,
        last_only: bool = False,
    ) -> tuple[Tensor, KV, tuple[Tensor, Tensor] | None]:
        """Returns (h, the K/V attended to, this layer's new K/V or None if it reuses a cache).
        `last_only`: K/V from every row, the rest (and h returned) for the last row only."""
        attn, (cos, sin) = self.self_attn, rope
        x = ops.norm(self.input_layernorm, h)
        new = None
        if not self.spec.owns_kv:
            q, _, _ = ops.heads(attn, x, cos, sin, kv=False)
            keys, values = past
        else:
            if last_only:
                _, k, v = ops.heads(attn, x, cos, sin, q=False)
                h, x, cos, sin, mask = h[-1:], x[-1:], cos[-1:], sin[-1:], mask[-1:]
                ple = ple[-1:] if ple is not None else None
                q, _, _ = ops.heads(attn, x, cos, sin, kv=False)
            else:
                q, k, v = ops.heads(attn, x, cos, sin)
            assert k is not None and v is not None
            new = (k, v)
            keys, values = ops.extend(past[0], k), ops.extend(past[1], v)
        assert q is not None
        out = ops.linear(attn.o_proj, ops.attention(q, keys, values, mask))
        h = ops.add_norm(h, self.post_attention_layernorm, out)
        gate, up = ops.gate_up(self.mlp, ops.norm(self.pre_feedforward_layernorm, h))
        mlp = ops.gated_linear(self.mlp.down_proj, gate, up)
        if self.has_ple:  # the layer scalar scales the layer's last residual add
            h = ops.add_norm(h, self.post_feedforward_layernorm, mlp)
            gate = ops.linear(self.per_layer_input_gate, h)
            projected = ops.gated_linear(self.per_layer_projection, gate, ple)
            h = ops.add_norm(h, self.post_per_layer_input_norm, projected, self.layer_scalar)
        else:
            h = ops.add_norm(h, self.post_feedforward_layernorm, mlp, self.layer_scalar)
        return h, (keys, values), new


class CacheView(Protocol):
    """What a forward reads from a KV cache: entries per owning layer, positions per kind."""

    def kv(self, layer: int) -> KV: ...

    def positions(self, kind: AttentionKind) -> Tensor: ...


class EmptyCache:
    """A `CacheView` holding nothing, on `device`: whole sequences from position 0 (training, and
    distillation's teacher)."""

    def __init__(self, cfg: TextConfig, device: torch.device | str = "cpu"):
        self.cfg, self.device = cfg, torch.device(device)

    def kv(self, layer: int) -> KV:
        spec = self.cfg.layers[layer]
        empty = torch.zeros(spec.num_kv_heads, 0, spec.head_dim, device=self.device)
        return (empty,), (empty,)

    def positions(self, kind: AttentionKind) -> Tensor:
        return torch.zeros(0, dtype=torch.long, device=self.device)


def window_of(cfg: TextConfig, kind: str) -> int | None:
    return cfg.sliding_window if kind == "sliding" else None


class Gemma4Target(nn.Module):
    """The target decoder without its embedding tables (`model/tables.py`) but with its LM head."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.layers = nn.ModuleList(DecoderLayer(cfg, spec) for spec in cfg.layers)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False)
        p = cfg.hidden_size_per_layer_input
        if p:
            self.per_layer_model_projection = nn.Linear(h, cfg.num_layers * p, bias=False)
            self.per_layer_projection_norm = RMSNorm(p, cfg.rms_norm_eps)
        register_rope(self, cfg)

    def per_layer_inputs(
        self, embeds: Tensor, token_ple: Tensor | None, ops: Primitives = REFERENCE
    ) -> Tensor | None:
        """Combine the context projection of the embeddings with the token-identity rows."""
        if not self.cfg.hidden_size_per_layer_input:
            return None
        proj = ops.linear(self.per_layer_model_projection, embeds) * self.cfg.hidden_size**-0.5
        proj = proj.view(embeds.shape[0], self.cfg.num_layers, -1)
        proj = ops.norm(self.per_layer_projection_norm, proj)
        return (proj + token_ple) * 2.0**-0.5

    def forward(
        self,
        embeds: Tensor,
        token_ple: Tensor | None,
        positions: Tensor,
        cache: CacheView,
        rows: RowSelection = "all",
        ops: Primitives = REFERENCE,
    ) -> tuple[Tensor | None, dict[int, tuple[Tensor, Tensor]]]:
        """Run T new tokens at `positions` on top of `cache`.

        rows="all": every layer on every row (verify, unpruned prefill); "last": the layers after
        the last one that owns a cache see only the last row, and that one computes K/V for
        every row and the rest for the last (final prefill chunk: only the last row's logits
        are wanted); "none": that layer computes only K/V and the KV-shared layers are skipped
        (intermediate prefill chunk: they write no cache, so nothing is lost).
        Returns (final-normed hidden states of the kept rows or None, new K/V per owning layer).
        """
        cfg = self.cfg
        ple = self.per_layer_inputs(embeds, token_ple, ops)
        h = embeds
        kinds = sorted(set(cfg.layer_types))
        masks = {
            k: ops.mask(positions, torch.cat([cache.positions(k), positions]), window_of(cfg, k))
            for k in kinds
        }
        ropes = {
            k: ops.rope(positions, getattr(self, f"{k}_inv_freq"), embeds.dtype) for k in kinds
        }
        shared: dict[int, KV] = {}
        new_kv: dict[int, tuple[Tensor, Tensor]] = {}
        last_owner = cfg.last_owning_layer
        for i, layer in enumerate(self.layers):
            spec = layer.spec
            rope = ropes[spec.attention]
            if rows == "none" and i == last_owner:  # no later layer reads its output
                new_kv[i] = layer.new_kv(h, rope, ops)
                return None, new_kv
            past = shared[spec.kv_source] if not spec.owns_kv else cache.kv(i)
            pruning = rows == "last" and i == last_owner
            h, attended, fresh = layer(
                h, rope, past, masks[spec.attention], ple[:, i] if ple is not None else None,
                ops, last_only=pruning,
            )  # fmt: skip
            if fresh is not None:
                new_kv[i] = fresh
            if spec.kv_role == "store":
                shared[i] = attended
            if pruning:
                ple = ple[-1:] if ple is not None else None
                masks = {k: m[-1:] for k, m in masks.items()}
                ropes = {k: (c[-1:], s[-1:]) for k, (c, s) in ropes.items()}
        return ops.norm(self.norm, h), new_kv

    def logits(self, hidden: Tensor, ops: Primitives = REFERENCE) -> Tensor:
        logits = ops.linear(self.lm_head, hidden)
        cap = self.cfg.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


class ClusteredHead(nn.Module):
    """The assistant's "masked embedder": score centroids, keep the top-k clusters, and compute
    logits only for their tokens (k * vocab/centroids instead of the whole vocabulary)."""

    def __init__(self, hidden: int, vocab: int, num_centroids: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.centroids = nn.Linear(hidden, num_centroids, bias=False)
        self.register_buffer("token_ordering", torch.arange(vocab, dtype=torch.long))
        self.tokens_per_centroid = vocab // num_centroids

    def forward(
        self, h: Tensor, lm_head: nn.Module, ops: Primitives = REFERENCE
    ) -> tuple[Tensor, Tensor]:
        """h: [hidden] -> (token ids [k * per_centroid], their logits)."""
        top = torch.topk(ops.linear(self.centroids, h), self.top_k).indices
        ids = self.token_ordering.view(-1, self.tokens_per_centroid)[top].reshape(-1)
        return ids, ops.head_logits(lm_head, ids, h)


class Gemma4Drafter(nn.Module):
    """MTP assistant: no cache of its own; every layer reads the target's store-layer caches."""

    def __init__(self, cfg: AssistantConfig, target: TextConfig):
        super().__init__()
        text = cfg.text
        self.cfg = cfg
        self.stores = target.store_layers
        self.layers = nn.ModuleList(DecoderLayer(text, spec) for spec in text.layers)
        self.norm = RMSNorm(text.hidden_size, text.rms_norm_eps)
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.pre_projection = nn.Linear(2 * cfg.backbone_hidden_size, text.hidden_size, bias=False)
        self.post_projection = nn.Linear(text.hidden_size, cfg.backbone_hidden_size, bias=False)
        self.masked_embedding = (
            ClusteredHead(text.hidden_size, text.vocab_size, cfg.num_centroids, cfg.centroid_top_k)
            if cfg.use_ordered_embeddings
            else None
        )
        register_rope(self, text)

    def masks(
        self, positions: Tensor, cache: CacheView, ops: Primitives = REFERENCE
    ) -> dict[str, Tensor]:
        """Per attention kind, which of the target's entries rows at `positions` read: those
        before their position, the sliding window's window + 1 newest of them (what
        transformers' flipped bidirectional mask selects) — the target's mask of the row
        before, with a window one longer."""
        kinds = sorted({layer.spec.attention for layer in self.layers})
        window = {"sliding": self.cfg.text.sliding_window + 1}
        return {k: ops.mask(positions - 1, cache.positions(k), window.get(k)) for k in kinds}

    def step(
        self,
        token_embed: Tensor,
        hidden: Tensor,
        positions: Tensor,
        kv: dict[str, KV],
        masks: dict[str, Tensor],
        ops: Primitives = REFERENCE,
    ) -> tuple[Tensor, Tensor]:
        """One draft step for N rows, each at its fixed position: token_embed (the target's
        scaled embedding of the row's last token) and hidden (the target's, or the previous
        step's, final hidden state) [N, hidden_t]; kv: per attention kind, the target's
        store-layer K/V; masks: `masks()`'s. Returns (next hidden [N, hidden_t], final-normed
        drafter states [N, hidden_d])."""
        x = torch.cat([token_embed, hidden], dim=-1)
        h = ops.linear(self.pre_projection, x)
        ropes = {k: ops.rope(positions, getattr(self, f"{k}_inv_freq"), h.dtype) for k in masks}
        for layer in self.layers:
            kind = layer.spec.attention
            h, _, _ = layer(h, ropes[kind], kv[kind], masks[kind], None, ops)
        h = ops.norm(self.norm, h)
        return ops.linear(self.post_projection, h), h

    def logits(self, h: Tensor, ops: Primitives = REFERENCE) -> tuple[Tensor | None, Tensor]:
        """(token ids of the logits, or None for the whole vocabulary; logits) of one state
        h [hidden_d]."""
        if self.masked_embedding is not None:
            return self.masked_embedding(h, self.lm_head, ops)
        return None, ops.linear(self.lm_head, h)

    def chain(
        self,
        embed: Callable[[Tensor], Tensor],
        token: Tensor,
        target_hidden: Tensor,
        position: Tensor,
        cache: CacheView,
        depth: int,
        ops: Primitives = REFERENCE,
    ) -> Tensor:
        """`depth` greedy draft steps in one call, all at `position`: each step's token is its
        logits' argmax (the first, as the host's), embedded by `embed` (ids [1] -> the target's
        scaled token embedding [1, hidden_t]) for the next. token [1]: the last committed
        token; target_hidden [hidden_t]. Returns the drafted ids [depth]."""
        pos = position.reshape(1)
        kv = {kind: cache.kv(store) for kind, store in self.stores.items()}
        masks = self.masks(pos, cache, ops)
        hidden, drafted = target_hidden[None], []
        for _ in range(depth):
            hidden, h = self.step(embed(token), hidden, pos, kv, masks, ops)
            ids, logits = self.logits(h[0], ops)
            best = torch.argmax(logits).reshape(1)
            token = best if ids is None else ids.index_select(0, best)
            drafted.append(token)
        return torch.cat(drafted)

    def forward(
        self,
        token_embed: Tensor,
        target_hidden: Tensor,
        position: int | Tensor,
        cache: CacheView,
        ops: Primitives = REFERENCE,
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """One draft step at one position: token_embed, target_hidden [hidden_t]; reads the
        target's cache in place. Returns (next hidden [hidden_t], token ids of the logits or
        None for the whole vocabulary, logits)."""
        pos = position.reshape(1) if isinstance(position, Tensor) else torch.tensor([position])
        kv = {kind: cache.kv(store) for kind, store in self.stores.items()}
        next_hidden, h = self.step(
            token_embed[None], target_hidden[None], pos, kv, self.masks(pos, cache, ops), ops
        )
        ids, logits = self.logits(h[0], ops)
        return next_hidden[0], ids, logits
