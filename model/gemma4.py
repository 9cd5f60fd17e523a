"""The Gemma 4 text decoder (target) and its MTP assistant (drafter), in plain PyTorch.

Read top to bottom: norms and RoPE, attention, the decoder layer, the target, the drafter.

Conventions, chosen so the same code can be lowered with static shapes later:
- one sequence, no batch dimension: hidden states are [T, hidden];
- caches are [kv_heads, slots, head_dim] with a position per slot (-1: empty); attention masks
  are built from positions, never from where an entry sits in a tensor;
- embedding lookups (token table, per-layer table) happen on the host in `TokenTables`, outside
  the layers: the tables may stay memory-mapped in their stored dtype;
- a forward returns the new K/V of the layers that own a cache and leaves writing them to the
  caller (the runtime's KV cache), so rejected drafts are never forced into a cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgemtp.model.config import AssistantConfig, AttentionKind, LayerSpec, RopeSpec, TextConfig

_PROMPT_CHUNK: ContextVar[bool] = ContextVar("edgemtp_prompt_chunk", default=False)


@contextmanager
def prompt_chunk() -> Iterator[None]:
    """Marks a forward as a chunk of the prompt (a static program's prefill method, the reference
    engine's chunked prefill) rather than a decode, verify or draft step. A backend form whose
    numerics differ between the two (edgemtp's Q4_0 kernel runs steps, XNNPACK's 8da4w GEMM the
    chunks) asks `in_prompt_chunk()`: a row count cannot tell them apart, since the reference's
    last chunk is as short as the prompt leaves it where the program pads it to the chunk."""
    token = _PROMPT_CHUNK.set(True)
    try:
        yield
    finally:
        _PROMPT_CHUNK.reset(token)


def in_prompt_chunk() -> bool:
    return _PROMPT_CHUNK.get()


RowSelection = Literal["all", "last", "none"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: Tensor) -> Tensor:
        y = x.float()
        y = y * torch.pow(y.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            y = y * self.weight.float()
        return y.type_as(x)


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


def rope_cos_sin(positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """cos and sin [T, 1, head_dim], shaped once to broadcast over every layer's heads (an
    exported program would otherwise copy them into that shape in every layer)."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, 1, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def target_mask(q_pos: Tensor, kv_pos: Tensor, window: int | None) -> Tensor:
    """Causal (and sliding-window) mask from positions: [T, S], True where a query attends."""
    m = (kv_pos[None, :] >= 0) & (kv_pos[None, :] <= q_pos[:, None])
    if window is not None:
        m &= q_pos[:, None] - kv_pos[None, :] < window
    return m


def drafter_mask(q_pos: Tensor, kv_pos: Tensor, window: int | None) -> Tensor:
    """The assistant at position p reads the target's entries before p; its sliding window
    holds the window + 1 newest of them (what transformers' flipped bidirectional mask selects)."""
    m = (kv_pos[None, :] >= 0) & (kv_pos[None, :] < q_pos[:, None])
    if window is not None:
        m &= q_pos[:, None] - 1 - kv_pos[None, :] <= window
    return m


class Attention(nn.Module):
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

    def project_kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """New keys and values [kv_heads, T, head_dim] for the rows of x."""
        shape = (x.shape[0], -1, self.spec.head_dim)
        k = self.k_proj(x).view(shape)
        v = k if self.v_proj is None else self.v_proj(x).view(shape)
        k = apply_rope(self.k_norm(k), cos, sin)
        return k.transpose(0, 1), self.v_norm(v).transpose(0, 1)

    def extend(self, past: Tensor, new: Tensor) -> Tensor:
        """What the rows attend to: the cache's entries, then the new rows' ([kv_heads, S, d])."""
        return torch.cat([past, new], dim=1)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, k: Tensor, v: Tensor, mask: Tensor
    ) -> Tensor:
        """x: [T, hidden]; k, v: every key/value the rows may attend to; mask: [T, S]."""
        q = self.q_proj(x).view(x.shape[0], -1, self.spec.head_dim)
        q = apply_rope(self.q_norm(q), cos, sin).transpose(0, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0, enable_gqa=True)
        return self.o_proj(out.transpose(0, 1).reshape(x.shape[0], -1))


def gated_projection(proj: nn.Module, gate: Tensor, up: Tensor) -> Tensor:
    """proj(gelu_tanh(gate) * up): the MLP's down projection and the per-layer input's. A
    projection with a `gated` form (edgemtp's Q4_0 kernel) computes it in one call."""
    gated = getattr(proj, "gated", None)
    if gated is not None:
        return gated(gate, up)
    return proj(F.gelu(gate, approximate="tanh") * up)


def add_normed(h: Tensor, norm: nn.Module, y: Tensor, scale: Tensor | None = None) -> Tensor:
    """(h + norm(y)) [* scale]: a residual add after a norm (and the layer scalar). A norm with
    an `added` form (edgemtp's ExecuTorch kernel) computes it in one call."""
    added = getattr(norm, "added", None)
    if added is not None:
        return added(h, y, scale)
    out = h + norm(y)
    return out if scale is None else out * scale


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return gated_projection(self.down_proj, self.gate_proj(x), self.up_proj(x))


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

    def forward(
        self,
        h: Tensor,
        cos: Tensor,
        sin: Tensor,
        past: tuple[Tensor, Tensor],
        mask: Tensor,
        ple: Tensor | None,
        last_only: bool = False,
    ) -> tuple[Tensor, tuple[Tensor, Tensor], tuple[Tensor, Tensor] | None]:
        """Returns (h, the K/V attended to, this layer's new K/V or None if it reuses a cache).
        `last_only`: K/V from every row, the rest (and h returned) for the last row only."""
        x = self.input_layernorm(h)
        k, v = past
        new_kv = None
        if self.spec.owns_kv:
            new_kv = self.self_attn.project_kv(x, cos, sin)
            k, v = self.self_attn.extend(k, new_kv[0]), self.self_attn.extend(v, new_kv[1])
        if last_only:
            h, x, cos, sin, mask = h[-1:], x[-1:], cos[-1:], sin[-1:], mask[-1:]
            ple = ple[-1:] if ple is not None else None
        h = add_normed(h, self.post_attention_layernorm, self.self_attn(x, cos, sin, k, v, mask))
        mlp = self.mlp(self.pre_feedforward_layernorm(h))
        if self.has_ple:  # the layer scalar scales the layer's last residual add
            h = add_normed(h, self.post_feedforward_layernorm, mlp)
            gate = self.per_layer_input_gate(h)
            projected = gated_projection(self.per_layer_projection, gate, ple)
            h = add_normed(h, self.post_per_layer_input_norm, projected, self.layer_scalar)
        else:
            h = add_normed(h, self.post_feedforward_layernorm, mlp, self.layer_scalar)
        return h, (k, v), new_kv


class CacheView(Protocol):
    """What a forward reads from a KV cache: entries per owning layer, positions per kind."""

    def kv(self, layer: int) -> tuple[Tensor, Tensor]: ...

    def positions(self, kind: AttentionKind) -> Tensor: ...


class EmptyCache:
    """A `CacheView` holding nothing, on `device`: whole sequences from position 0 (training, and
    distillation's teacher)."""

    def __init__(self, cfg: TextConfig, device: torch.device | str = "cpu"):
        self.cfg, self.device = cfg, torch.device(device)

    def kv(self, layer: int) -> tuple[Tensor, Tensor]:
        spec = self.cfg.layers[layer]
        empty = torch.zeros(spec.num_kv_heads, 0, spec.head_dim, device=self.device)
        return empty, empty

    def positions(self, kind: AttentionKind) -> Tensor:
        return torch.zeros(0, dtype=torch.long, device=self.device)


class Rows(Protocol):
    """A lookup table: a tensor (possibly memory-mapped) or a quantized table that dequantizes
    only the rows it is asked for."""

    shape: torch.Size | tuple[int, ...]
    dtype: torch.dtype

    def __getitem__(self, ids: Tensor | list[int]) -> Tensor: ...


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
        return _scaled_rows(self.tokens, ids, self._token_scale, out)

    def per_layer_inputs(self, ids: Tensor | list[int], out: Tensor | None = None) -> Tensor | None:
        """Token-identity part of the per-layer embeddings, [T, layers, ple_dim] fp32, written
        into `out` when given."""
        if self.per_layer is None:
            return None
        if out is not None:
            return _scaled_rows(self.per_layer, ids, self._ple_scale, out)
        rows = _scaled_rows(self.per_layer, ids, self._ple_scale)
        return rows.view(len(ids), self.num_layers, self.ple_dim)


def _scaled_rows(
    table: Rows, ids: Tensor | list[int], scale: float, out: Tensor | None = None
) -> Tensor:
    """`table[ids].float() * scale`, in one step where the table can (`BlockRows.scaled`),
    into `out` (of the same number of values) when given."""
    scaled = getattr(table, "scaled", None)
    if scaled is not None:
        return scaled(ids, scale, out)
    rows = table[ids].float() * scale
    return rows if out is None else out.copy_(rows.view_as(out))


class Gemma4Target(nn.Module):
    """The target decoder without its embedding tables (see TokenTables) but with its LM head."""

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

    def rope(self, kind: str, positions: Tensor) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(positions, getattr(self, f"{kind}_inv_freq"))

    def masks(self, positions: Tensor, kv_pos: dict[str, Tensor]) -> dict[str, Tensor]:
        """Per attention kind, which keys (at `kv_pos`) the rows at `positions` attend to."""
        window = self.cfg.sliding_window
        return {
            kind: target_mask(positions, keys, window if kind == "sliding" else None)
            for kind, keys in kv_pos.items()
        }

    def per_layer_inputs(self, embeds: Tensor, token_ple: Tensor | None) -> Tensor | None:
        """Combine the context projection of the embeddings with the token-identity rows."""
        if not self.cfg.hidden_size_per_layer_input:
            return None
        proj = self.per_layer_model_projection(embeds) * self.cfg.hidden_size**-0.5
        proj = self.per_layer_projection_norm(proj.view(embeds.shape[0], self.cfg.num_layers, -1))
        return (proj + token_ple) * 2.0**-0.5

    def forward(
        self,
        embeds: Tensor,
        token_ple: Tensor | None,
        positions: Tensor,
        cache: CacheView,
        rows: RowSelection = "all",
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
        ple = self.per_layer_inputs(embeds, token_ple)
        h = embeds
        kinds = sorted(set(cfg.layer_types))
        kv_pos = {k: torch.cat([cache.positions(k), positions]) for k in kinds}
        masks = self.masks(positions, kv_pos)
        ropes = {k: self.rope(k, positions) for k in kinds}
        shared: dict[int, tuple[Tensor, Tensor]] = {}
        new_kv: dict[int, tuple[Tensor, Tensor]] = {}
        last_owner = cfg.last_owning_layer
        for i, layer in enumerate(self.layers):
            spec = layer.spec
            past = shared[spec.kv_source] if not spec.owns_kv else cache.kv(i)
            cos, sin = ropes[spec.attention]
            if rows == "none" and i == last_owner:  # no later layer reads its output
                new_kv[i] = layer.self_attn.project_kv(layer.input_layernorm(h), cos, sin)
                return None, new_kv
            pruning = rows == "last" and i == last_owner
            h, attended, fresh = layer(
                h, cos, sin, past, masks[spec.attention], ple[:, i] if ple is not None else None,
                last_only=pruning,
            )  # fmt: skip
            if fresh is not None:
                new_kv[i] = fresh
            if spec.kv_role == "store":
                shared[i] = attended
            if pruning:
                ple = ple[-1:] if ple is not None else None
                masks = {k: m[-1:] for k, m in masks.items()}
                ropes = {k: (c[-1:], s[-1:]) for k, (c, s) in ropes.items()}
        return self.norm(h), new_kv

    def logits(self, hidden: Tensor) -> Tensor:
        logits = self.lm_head(hidden)
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

    def forward(self, h: Tensor, lm_head_weight: Tensor) -> tuple[Tensor, Tensor]:
        """h: [hidden] -> (token ids [k * per_centroid], their logits)."""
        top = torch.topk(self.centroids(h), self.top_k).indices
        ids = self.token_ordering.view(-1, self.tokens_per_centroid)[top].reshape(-1)
        return ids, lm_head_weight[ids] @ h


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

    def masks(self, pos: Tensor, kv_pos: dict[str, Tensor]) -> dict[str, Tensor]:
        """The draft step's attention mask over each kind's cache (once per kind, as RoPE)."""
        window = self.cfg.text.sliding_window
        return {
            kind: drafter_mask(pos, keys, window if kind == "sliding" else None)
            for kind, keys in kv_pos.items()
        }

    def forward(
        self, token_embed: Tensor, target_hidden: Tensor, position: int, cache: CacheView
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """One draft step at a fixed position.

        token_embed: the target's scaled embedding of the last token [hidden_t]; target_hidden:
        the target's (or previous step's) final hidden state [hidden_t].
        Returns (next hidden [hidden_t], token ids of the logits or None for the whole
        vocabulary, logits).
        """
        h = self.pre_projection(torch.cat([token_embed, target_hidden])[None])
        pos = torch.tensor([position])
        kinds = sorted({layer.spec.attention for layer in self.layers})
        masks = self.masks(pos, {kind: cache.positions(kind) for kind in kinds})
        ropes = {kind: rope_cos_sin(pos, getattr(self, f"{kind}_inv_freq")) for kind in kinds}
        for layer in self.layers:
            kind = layer.spec.attention
            cos, sin = ropes[kind]
            h, _, _ = layer(h, cos, sin, cache.kv(self.stores[kind]), masks[kind], None)
        h = self.norm(h)[0]
        next_hidden = self.post_projection(h)
        if self.masked_embedding is not None:
            ids, logits = self.masked_embedding(h, self.lm_head.weight)
            return next_hidden, ids, logits
        return next_hidden, None, self.lm_head(h)


def full_vocab_logits(ids: Tensor | None, logits: Tensor, vocab: int) -> Tensor:
    """Scatter clustered logits into the vocabulary, the rest one below the smallest kept logit
    (the reference's representation)."""
    if ids is None:
        return logits
    out = torch.full((vocab,), logits.min().item() - 1.0, dtype=logits.dtype)
    return out.scatter(0, ids, logits)
