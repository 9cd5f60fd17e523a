"""The concepts of the model body and how the reference computes each: a backend form's table.

The model body (`gemma4.py`) and the static methods (`static.py`) name each computation by
concept — `ops.norm`, `ops.heads`, `ops.attention`, ... — and never say how it is done. A
`Primitives` class is one backend form's table: concept by concept, the function it lowers to
(the reference below: plain PyTorch; the export forms: `export/forms.py`). Every function takes
the table itself first, so a concept can be built from the table's other primitives (the
reference's `heads` is its `linear`, then its `norm`, then RoPE).

A `Form` is what a backend needs of it: the table for decode, verify and draft steps, the table
for prompt chunks (a backend may run them in different kernels), how it stores the weights
(`prepare`, applied once by `apply_form`) and the KV cache's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Segments = tuple[Tensor, ...]  # K or V in pieces along the key axis (the cache, a call's rows)
KV = tuple[Segments, Segments]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, 1, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rope_cos_sin(positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """cos and sin [T, 1, head_dim], shaped once to broadcast over every layer's heads (an
    exported program would otherwise copy them into that shape in every layer)."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
    return emb.cos(), emb.sin()


def attends(q_pos: Tensor, kv_pos: Tensor, window: int | None) -> Tensor:
    """Causal (and sliding-window) mask from positions: [T, S], True where a row attends.
    An empty slot has position -1."""
    m = (kv_pos[None, :] >= 0) & (kv_pos[None, :] <= q_pos[:, None])
    if window is not None:
        m &= q_pos[:, None] - kv_pos[None, :] < window
    return m


def truncated(slot_pos: Tensor, at: Tensor) -> Tensor:
    """Slot positions at or past `at` (a call's first position: rejected drafts) as empty."""
    return torch.where(slot_pos >= at, -1, slot_pos)


def ring_positions(kept: Tensor, positions: Tensor, slots: int) -> Tensor:
    """The slot positions after a static call writes its rows: `kept` are the positions before
    (the trash slot last, or a context bucket's first slots only). The rows that are not pads
    hold consecutive positions ending at the last row (pads, at the last position + 1, come
    first), as every caller passes them; so each slot's new position is the newest position up
    to the last row's that lands in it, where that is not before the first row's: arithmetic
    over the slots, not a compare of every slot with every row (over [slots, rows] that ran in
    portable kernels, outside the delegates)."""
    first, last = positions.min(), positions[-1]
    ring = torch.arange(kept.shape[0])
    newest = last - (last - ring) % slots  # the newest position up to `last` in each slot
    written = (newest >= first) & (ring < slots)  # slot `slots` is the pad rows' trash
    return torch.where(written, newest, kept)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """The reference RMSNorm, in float32 whatever x's dtype (as transformers computes it)."""
    y = x.float()
    y = y * torch.pow(y.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        y = y * weight.float()
    return y.type_as(x)


def gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


# --- how a KV cache stores its rows ------------------------------------------------------------

SCALE_BYTES = 4  # an int8 cache row ends with its float32 scale


def quantize_kv(x: Tensor) -> tuple[Tensor, Tensor]:
    """K or V rows [heads, rows, head_dim] as an int8 cache stores them: symmetric, one float32
    scale per head and row, scale = max|x| / 127, codes round-half-even(x / scale); an all-zero
    row gets scale 0 and codes 0."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale == 0, torch.zeros_like(scale), 1 / scale)
    return torch.round(x * inverse).clamp(-127, 127).to(torch.int8), scale


def stored_rows(rows: Tensor, dtype: torch.dtype) -> Tensor:
    """K or V rows [heads, rows, head_dim] as a cache of `dtype` holds them. int8: each row's
    codes then its scale's four bytes, [heads, rows, head_dim + 4] (one row, one read, as
    GGML's Q8_0 blocks keep their scale)."""
    if dtype != torch.int8:
        return rows.to(dtype)
    codes, scale = quantize_kv(rows)
    return torch.cat([codes, scale.view(torch.int8)], dim=-1)


def read_rows(stored: Tensor, dtype: torch.dtype) -> Tensor:
    """Cache rows back as `dtype`: an int8 row is its codes times its scale."""
    if stored.dtype != torch.int8:
        return stored.to(dtype)
    dim = stored.shape[-1] - SCALE_BYTES
    scale = stored[..., dim:].contiguous().view(torch.float32)
    return (stored[..., :dim].to(torch.float32) * scale).to(dtype)


def as_stored(rows: Tensor, dtype: torch.dtype) -> Tensor:
    """Rows as a cache of `dtype` will give them back: what a call attends its own new rows as,
    so a verify row sees the keys a later step reads from the cache."""
    return rows if dtype == rows.dtype else read_rows(stored_rows(rows, dtype), rows.dtype)


class Primitives:
    """The reference form: every concept in plain PyTorch, as transformers computes it.

    Concepts (the body calls exactly these):
    - `norm(norm, x)`: RMSNorm; `add_norm(h, norm, y, scale)`: (h + norm(y)) [* scale];
    - `linear(linear, x)`: x W^T; `gated_linear(linear, gate, up)`: linear(gelu_tanh(gate) up);
    - `gate_up(mlp, x)`: the MLP's gate and up projections of x;
    - `heads(attn, x, cos, sin, q, kv)`: the projected, normed and rotated query heads and new
      key/value heads of x (None where not asked), in the layout `attention` reads;
    - `extend(past, new)`: what a row attends to, the cache's segments then the new rows;
    - `attention(q, keys, values, mask)`: [rows, heads * head_dim], scale 1.0;
    - `mask(q_pos, kv_pos, window)`: which keys each row attends to, in `attention`'s form;
    - `rope(positions, inv_freq, dtype)`: cos and sin;
    - `head_logits(lm_head, ids, h)`: the logits of tokens `ids` for one state h;
    - `scatter(buffer, slots, rows)`: rows [heads, T, d] into buffer slots [T] along dim 1, as
      the buffer stores them (`stored_rows`).
    """

    def norm(self, norm: nn.Module, x: Tensor) -> Tensor:
        return rms_norm(x, norm.weight, norm.eps)

    def add_norm(
        self, h: Tensor, norm: nn.Module, y: Tensor, scale: Tensor | None = None
    ) -> Tensor:
        out = h + self.norm(norm, y)
        return out if scale is None else out * scale

    def linear(self, linear: nn.Module, x: Tensor) -> Tensor:
        return linear(x)

    def gated_linear(self, linear: nn.Module, gate: Tensor, up: Tensor) -> Tensor:
        return self.linear(linear, gelu_tanh(gate) * up)

    def gate_up(self, mlp: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.linear(mlp.gate_proj, x), self.linear(mlp.up_proj, x)

    def heads(
        self, attn: nn.Module, x: Tensor, cos: Tensor, sin: Tensor, q: bool = True, kv: bool = True
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """q [heads, T, head_dim]; k, v [kv_heads, T, head_dim]."""
        shape = (x.shape[0], -1, attn.spec.head_dim)
        queries = keys = values = None
        if kv:
            k = self.linear(attn.k_proj, x).view(shape)
            v = k if attn.spec.k_eq_v else self.linear(attn.v_proj, x).view(shape)
            keys = apply_rope(self.norm(attn.k_norm, k), cos, sin).transpose(0, 1)
            values = self.norm(attn.v_norm, v).transpose(0, 1)
        if q:
            queries = self.linear(attn.q_proj, x).view(shape)
            queries = apply_rope(self.norm(attn.q_norm, queries), cos, sin).transpose(0, 1)
        return queries, keys, values

    def extend(self, past: Segments, new: Tensor) -> Segments:
        # an int8 cache read widened (a float16 one is promoted by the concatenation; a cast of
        # it would be an op on the cache Core ML's states do not survive), and the new rows as
        # the cache will give them back
        stored = past[0].dtype if past else new.dtype
        past = tuple(read_rows(p, new.dtype) if p.dtype == torch.int8 else p for p in past)
        return (torch.cat([*past, as_stored(new, stored)], dim=1),)

    def attention(self, q: Tensor, keys: Segments, values: Segments, mask: Tensor) -> Tensor:
        k = keys[0] if len(keys) == 1 else torch.cat(keys, dim=1)
        v = values[0] if len(values) == 1 else torch.cat(values, dim=1)
        k, v = read_rows(k, q.dtype), read_rows(v, q.dtype)  # a narrower cache, widened
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0, enable_gqa=True)
        return out.transpose(0, 1).reshape(q.shape[1], -1)

    def mask(self, q_pos: Tensor, kv_pos: Tensor, window: int | None) -> Tensor:
        return attends(q_pos, kv_pos, window)

    def rope(
        self, positions: Tensor, inv_freq: Tensor, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(positions, inv_freq)

    def head_logits(self, lm_head: nn.Module, ids: Tensor, h: Tensor) -> Tensor:
        return lm_head.weight[ids] @ h

    def scatter(self, buffer: Tensor, slots: Tensor, rows: Tensor) -> None:
        buffer.index_copy_(1, slots, stored_rows(rows, buffer.dtype))

    def truncated(self, slot_pos: Tensor, at: Tensor) -> Tensor:
        return truncated(slot_pos, at)

    def ring_positions(self, kept: Tensor, positions: Tensor, slots: int) -> Tensor:
        return ring_positions(kept, positions, slots)


REFERENCE = Primitives()


def keep_weights(model: nn.Module) -> dict[str, Any]:
    """The reference's `prepare`: the weights stay the loaded float tensors."""
    return {}


@dataclass(frozen=True)
class Form:
    """A backend form: its primitives for steps (decode, verify, draft) and for prompt chunks,
    how it stores the weights, and the dtype its KV cache keeps."""

    name: str
    step: Primitives
    chunk: Primitives
    prepare: Callable[[nn.Module], dict[str, Any]] = keep_weights
    cache_dtype: torch.dtype = torch.float32
    # Every dtype its attention reads a cache in (`stored_rows`): `cache_dtype` and others.
    cache_dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    # Attention reads a context bucket's slots off the whole cache buffer (the mask's width
    # says how many), so the cache hands out its buffers unsliced.
    reads_cache_prefix: bool = False
    # The cache is the program's state (Core ML): fp16 states cannot hold slot positions, so
    # the host keeps them, as method inputs and outputs.
    cache_as_states: bool = False


EVERY_CACHE_DTYPE = (torch.float32, torch.float16, torch.int8)
REFERENCE_FORM = Form("reference", REFERENCE, REFERENCE, cache_dtypes=EVERY_CACHE_DTYPE)


def apply_form(models: list[nn.Module], form: Form) -> dict[str, Any]:
    """Convert the models' weights (in place) to what `form` computes with; returns what was
    converted, summed over the models. The models then belong to that form."""
    total: dict[str, Any] = {}
    for model in models:
        for key, value in form.prepare(model).items():
            if isinstance(value, dict):
                merged = total.setdefault(key, {})
                for k, n in value.items():
                    merged[k] = merged.get(k, 0) + n
            elif isinstance(value, list):
                total[key] = total.get(key, []) + value
            elif isinstance(value, int | float):
                total[key] = total.get(key, 0) + value
            else:
                total[key] = total.get(key) or value
    return total
