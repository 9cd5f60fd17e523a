"""Export forms of two primitives, swapped into a model in place (same weights, same math).

XNNPACK delegates `mean.dim` only over the two innermost dims of a 4-D tensor with keepdim,
`pow` only with exponent 2, and `F.scaled_dot_product_attention` with a boolean mask and
`enable_gqa` decomposes into `_safe_softmax` (where/any/logical_not) and `expand` copies, none
of them delegated: every RMSNorm and attention would split the graph into another delegate
(148 XNNPACK partitions per tiny verify method, minutes of lowering). The forms here compute
the same functions with delegated ops only:

- RMSNorm: mean of squares as a 4-D global average pool, `rsqrt` instead of `pow(-0.5)`;
- attention: the boolean mask becomes an additive mask once per mask tensor, and grouped-query
  attention is batched matmuls over KV groups (no K/V repeat), per segment: the cache and the
  new rows are never concatenated. No row is ever fully masked in the static programs (see
  `static.py`), so the additive form equals the boolean one. XNNPACK programs build that
  additive mask from the positions with float arithmetic (`ArithmeticMaskTarget`), and run
  decode, verify and draft rows in edgemtp's own ExecuTorch kernel (`KernelAttention`:
  `edgemtp::cache_attention`, a torch op here whose eager form is those batched matmuls; its
  C++ kernel is in `runtime/kernels/`).

Numerics differ from the eager reference only by float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgemtp.model.gemma4 import (
    Attention,
    Gemma4Drafter,
    Gemma4Target,
    RMSNorm,
    apply_rope,
    in_prompt_chunk,
)
from edgemtp.quantize.q4_0 import Q4_0, dequantize_q4_0, q8_0_rows, unnibble_q4_0

_ADDITIVE: dict[int, tuple[Tensor, Tensor]] = {}


def clear_mask_memo() -> None:
    """Forget converted masks; call at the start of every method call."""
    _ADDITIVE.clear()


def additive_mask(mask: Tensor) -> Tensor:
    """0 where `mask` attends, -inf elsewhere; converted once per mask tensor. A float mask is
    additive already (`ArithmeticMaskTarget`)."""
    if mask.is_floating_point():
        return mask
    hit = _ADDITIVE.get(id(mask))
    if hit is not None and hit[0] is mask:
        return hit[1]
    out = torch.where(mask, 0.0, float("-inf"))
    _ADDITIVE[id(mask)] = (mask, out)
    return out


BLOCKED = -1e30  # a blocked key's additive mask: exp(score + BLOCKED - row max) is exactly 0


def _positive_part(x: Tensor) -> Tensor:
    """max(x, 0) as (x + |x|) / 2: exact on whole numbers, and no clamp or relu, which would
    make XNNPACK run its whole preprocessing pipeline on the partition (`export/lower.py`)."""
    return (x + x.abs()) * 0.5


def additive_target_mask(q_pos: Tensor, kv_pos: Tensor, window: int | None) -> Tensor:
    """`target_mask` as an additive float mask from arithmetic on the positions (subtractions,
    `_positive_part`s, adds and a scale: XNNPACK operators) instead of comparisons, logical
    ands and a `where` over [rows, keys], which ExecuTorch runs in its portable kernels at
    ~10 ns per element: a third of a prefill chunk of the embedded demo. 0 where a row
    attends; elsewhere each violated condition adds how far past it the key is (>= 1) times
    `BLOCKED`. Positions are exact as floats below 2^24, and the sum stays finite."""
    keys = kv_pos.float()[None, :]
    ahead = q_pos.float()[:, None] - keys  # >= 0: the key is at or before the row
    blocked = _positive_part(-ahead) + _positive_part(-keys)  # a future key, an empty slot (-1)
    if window is not None:
        blocked = blocked + _positive_part(ahead - (window - 1))  # out of the window
    return blocked * BLOCKED


class ArithmeticMaskTarget(Gemma4Target):
    """The target with additive float masks (`additive_target_mask`): what XNNPACK programs
    compute. The bool masks stay where a consumer needs them (Core ML's attention, the htp
    delegate's Q/DQ pass, which leaves -inf scores in float)."""

    def masks(self, positions: Tensor, kv_pos: dict[str, Tensor]) -> dict[str, Tensor]:
        window = self.cfg.sliding_window
        return {
            kind: additive_target_mask(positions, keys, window if kind == "sliding" else None)
            for kind, keys in kv_pos.items()
        }


class ArithmeticMaskDrafter(Gemma4Drafter):
    """The assistant with additive float masks: it reads the target's entries before its
    position, its sliding window the window + 1 newest of them, which is `target_mask` of the
    row before it with a window one longer. As bool masks they were ~18 portable operators of
    a draft step and split it into more delegates."""

    def masks(self, pos: Tensor, kv_pos: dict[str, Tensor]) -> dict[str, Tensor]:
        window = self.cfg.text.sliding_window + 1
        return {
            kind: additive_target_mask(pos - 1, keys, window if kind == "sliding" else None)
            for kind, keys in kv_pos.items()
        }


class ExportRMSNorm(RMSNorm):
    def forward(self, x: Tensor) -> Tensor:
        y = x.float()
        d = y.shape[-1]
        ms = (y * y).reshape(1, -1, 1, d).mean((2, 3), keepdim=True)
        y = y * torch.rsqrt(ms.reshape(*y.shape[:-1], 1) + self.eps)
        if self.weight is not None:
            y = y * self.weight.float()
        return y.type_as(x)


Segments = tuple[Tensor, ...]


class ExportAttention(Attention):
    def extend(self, past: Tensor, new: Tensor) -> Segments:  # type: ignore[override]
        """The cache and the new rows kept apart: concatenating them copied the whole static
        cache in every layer at every step (0.8 of a 9.4 ms decode step on PEER-90M)."""
        return (past, new)

    def forward(  # type: ignore[override]
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        k: Tensor | Segments,
        v: Tensor | Segments,
        mask: Tensor,
    ) -> Tensor:
        ks = k if isinstance(k, tuple) else (k,)
        vs = v if isinstance(v, tuple) else (v,)
        q = self.project_q(x, cos, sin, ks[0].shape[0])
        return self.o_proj(self.attend(q, ks, vs, mask, q.shape[1] // x.shape[0]))

    def project_q(self, x: Tensor, cos: Tensor, sin: Tensor, kv_heads: int) -> Tensor:
        """The queries normed and rotated, as [kv_heads, group * rows, head_dim]."""
        t, hd = x.shape[0], self.spec.head_dim
        q = self.q_proj(x).view(t, -1, hd)
        q = apply_rope(self.q_norm(q), cos, sin).transpose(0, 1)  # [heads, T, hd]
        return q.reshape(kv_heads, -1, hd)

    def attend(self, q: Tensor, ks: Segments, vs: Segments, mask: Tensor, group: int) -> Tensor:
        """[rows, heads * head_dim]: what the output projection reads."""
        return heads_to_rows(segment_attention(q, ks, vs, mask, group), mask.shape[0])


KERNEL_MAX_ROWS = 8  # more rows (prefill chunks): XNNPACK's batched matmuls are faster
KERNEL_CACHE_DTYPE = torch.float16  # K/V as programs with the kernel store them


class KernelAttention(ExportAttention):
    """Attention of decode, verify and draft calls as one call of edgemtp's ExecuTorch kernel
    (`edgemtp::cache_attention`), which reads only the cache slots some row attends to. The
    cache segment may be the whole buffer: the mask's width says how many of its slots the
    call reads (a context bucket's), so no slice copies the bucket out of it."""

    def _kernel_rows(self, x: Tensor) -> bool:
        return x.shape[0] <= KERNEL_MAX_ROWS and not in_prompt_chunk()

    def _normed_heads(
        self,
        proj: nn.Module,
        x: Tensor,
        norm: RMSNorm,
        rope: tuple[Tensor, Tensor] | None,
        kvh: int,
    ) -> Tensor:
        """proj(x)'s heads normed (and rotated) in one kernel call (`edgemtp::head_norm_rope`),
        as [kv_heads, heads / kv_heads * rows, head_dim]. A fused Q/K/V linear's part hands the
        kernel the whole product and where its columns start: no slice between the two."""
        fused = getattr(proj, "fused", None)
        full, start = (fused(x), proj.start) if fused is not None else (proj(x), 0)
        hd = self.spec.head_dim
        cos, sin = rope if rope is not None else (None, None)
        heads = proj.out_features // hd
        return torch.ops.edgemtp.head_norm_rope(
            full, start // hd, heads, kvh, hd, norm.weight, cos, sin, norm.eps
        )

    def project_kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        if not self._kernel_rows(x):
            return super().project_kv(x, cos, sin)
        kvh = self.spec.num_kv_heads
        k = self._normed_heads(self.k_proj, x, self.k_norm, (cos, sin), kvh)
        values = self.k_proj if self.v_proj is None else self.v_proj  # V = K before norm and RoPE
        return k, self._normed_heads(values, x, self.v_norm, None, kvh)

    def project_q(self, x: Tensor, cos: Tensor, sin: Tensor, kv_heads: int) -> Tensor:
        if not self._kernel_rows(x):
            return super().project_q(x, cos, sin, kv_heads)
        return self._normed_heads(self.q_proj, x, self.q_norm, (cos, sin), kv_heads)

    def attend(self, q: Tensor, ks: Segments, vs: Segments, mask: Tensor, group: int) -> Tensor:
        own = (ks[1], vs[1]) if len(ks) == 2 else (None, None)
        if mask.shape[0] > KERNEL_MAX_ROWS:
            return cache_attention_rows(q, ks[0], vs[0], *own, mask)
        return torch.ops.edgemtp.cache_attention_rows(q, ks[0], vs[0], *own, mask)


def heads_to_rows(out: Tensor, rows: int) -> Tensor:
    """Attention output [kv_heads, group * rows, head_dim] as [rows, heads * head_dim]."""
    return out.view(-1, rows, out.shape[-1]).transpose(0, 1).reshape(rows, -1)


def segment_attention(q: Tensor, ks: Segments, vs: Segments, mask: Tensor, group: int) -> Tensor:
    """Grouped-query attention over K/V kept in segments (the cache, the call's own rows):
    q [kv_heads, group * rows, head_dim] (scale 1.0) against each segment's keys [kv_heads,
    keys, head_dim], the mask [rows, all keys] (bool or additive), one softmax over all keys,
    each segment's probabilities times its values, summed. [kv_heads, group * rows, head_dim].
    `devices calibrate` times this very function."""
    kvh, t = q.shape[0], mask.shape[0]
    scores = torch.cat([torch.bmm(q, s.transpose(1, 2)) for s in ks], dim=-1)
    scores = scores.view(kvh, group, t, -1) + additive_mask(mask)
    probs = torch.softmax(scores, dim=-1).view(kvh, group * t, -1)
    if len(vs) == 1:  # (a full-range slice would trace to an alias ONNX cannot translate)
        return torch.bmm(probs, vs[0])
    parts, start = [], 0
    for s in vs:
        parts.append(torch.bmm(probs[..., start : start + s.shape[1]], s))
        start += s.shape[1]
    return sum(parts[1:], parts[0])


CACHE_ATTENTION = (
    "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_new, Tensor? v_new, Tensor mask)"
)
_LIBRARY = torch.library.Library("edgemtp", "DEF")
_LIBRARY.define("cache_attention" + CACHE_ATTENTION + " -> Tensor")
_LIBRARY.define("cache_attention.out" + CACHE_ATTENTION[:-1] + ", *, Tensor(a!) out) -> Tensor(a!)")


def cache_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k_new: Tensor | None,
    v_new: Tensor | None,
    mask: Tensor,
) -> Tensor:
    """What `edgemtp::cache_attention` computes (runtime/kernels/cache_attention.cpp): q
    [kv_heads, group * rows, head_dim] over the first `keys - new` cache slots (float32 or
    float16), then the new keys, `mask` [rows, keys] additive."""
    fresh = 0 if k_new is None else k_new.shape[1]
    cached = mask.shape[1] - fresh
    if cached < k_cache.shape[1]:  # (a slice is a copy in XNNPACK: none where it is all)
        k_cache, v_cache = k_cache[:, :cached], v_cache[:, :cached]
    stored = k_cache.dtype
    if stored != q.dtype:  # a float16 cache: widened to the activations' dtype, and the call's
        # own keys rounded as they will be stored (a verify row sees what later steps read)
        k_cache, v_cache = k_cache.to(q.dtype), v_cache.to(q.dtype)
        if k_new is not None and v_new is not None:
            k_new, v_new = k_new.to(stored).to(q.dtype), v_new.to(stored).to(q.dtype)
    ks = (k_cache,) + (() if k_new is None else (k_new,))
    vs = (v_cache,) + (() if v_new is None else (v_new,))
    return segment_attention(q, ks, vs, mask, q.shape[1] // mask.shape[0])


def _cache_attention_out(*args: Tensor | None, out: Tensor) -> Tensor:
    return out.copy_(cache_attention(*args))  # type: ignore[arg-type]


_LIBRARY.impl("cache_attention", cache_attention, "CompositeExplicitAutograd")
_LIBRARY.impl("cache_attention.out", _cache_attention_out, "CompositeExplicitAutograd")
torch.library.register_fake(
    "edgemtp::cache_attention", lambda q, *_: torch.empty_like(q), lib=_LIBRARY
)


_LIBRARY.define("cache_attention_rows" + CACHE_ATTENTION + " -> Tensor")
_LIBRARY.define(
    "cache_attention_rows.out" + CACHE_ATTENTION[:-1] + ", *, Tensor(a!) out) -> Tensor(a!)"
)


def cache_attention_rows(*args: Tensor | None) -> Tensor:
    """`cache_attention` as [rows, heads * head_dim] (`edgemtp::cache_attention_rows`: the
    kernel writes that layout, so no transpose runs before the output projection)."""
    return heads_to_rows(cache_attention(*args), args[-1].shape[0])  # type: ignore[arg-type,union-attr]


def _cache_attention_rows_out(*args: Tensor | None, out: Tensor) -> Tensor:
    return out.copy_(cache_attention_rows(*args))


_LIBRARY.impl("cache_attention_rows", cache_attention_rows, "CompositeExplicitAutograd")
_LIBRARY.impl("cache_attention_rows.out", _cache_attention_rows_out, "CompositeExplicitAutograd")
torch.library.register_fake(
    "edgemtp::cache_attention_rows",
    lambda q, k, v, k_new, v_new, mask: q.new_empty(mask.shape[0], q.numel() // mask.shape[0]),
    lib=_LIBRARY,
)


Q4_0_LINEAR = "(Tensor x, Tensor nibbles, Tensor scales)"
_LIBRARY.define("q4_0_linear" + Q4_0_LINEAR + " -> Tensor")
_LIBRARY.define("q4_0_linear.out" + Q4_0_LINEAR[:-1] + ", *, Tensor(a!) out) -> Tensor(a!)")


def q4_0_linear(x: Tensor, nibbles: Tensor, scales: Tensor) -> Tensor:
    """What `edgemtp::q4_0_linear` computes (runtime/kernels/q4_0_linear.cpp): x [..., in]
    rounded to Q8_0, times the Q4_0 weight of `nibbles` uint8 [out, in / 2] (`nibbles_q4_0`)
    and `scales` float16 [out, in / 32] -> [..., out]."""
    out, half = nibbles.shape
    w = dequantize_q4_0(Q4_0(scales=scales, codes=unnibble_q4_0(nibbles), shape=(out, half * 2)))
    return F.linear(q8_0_rows(x), w)


def _q4_0_linear_out(x: Tensor, nibbles: Tensor, scales: Tensor, *, out: Tensor) -> Tensor:
    return out.copy_(q4_0_linear(x, nibbles, scales))


_LIBRARY.impl("q4_0_linear", q4_0_linear, "CompositeExplicitAutograd")
_LIBRARY.impl("q4_0_linear.out", _q4_0_linear_out, "CompositeExplicitAutograd")
torch.library.register_fake(
    "edgemtp::q4_0_linear",
    lambda x, nibbles, scales: x.new_empty(*x.shape[:-1], nibbles.shape[0]),
    lib=_LIBRARY,
)


Q4_0_GATED_LINEAR = "(Tensor gate, Tensor up, Tensor nibbles, Tensor scales)"
_LIBRARY.define("q4_0_gated_linear" + Q4_0_GATED_LINEAR + " -> Tensor")
_LIBRARY.define(
    "q4_0_gated_linear.out" + Q4_0_GATED_LINEAR[:-1] + ", *, Tensor(a!) out) -> Tensor(a!)"
)


def q4_0_gated_linear(gate: Tensor, up: Tensor, nibbles: Tensor, scales: Tensor) -> Tensor:
    """What `edgemtp::q4_0_gated_linear` computes: `q4_0_linear` of gelu_tanh(gate) * up (a
    gated projection's input formed in the kernel, so no delegate runs between the two)."""
    return q4_0_linear(F.gelu(gate, approximate="tanh") * up, nibbles, scales)


def _q4_0_gated_linear_out(
    gate: Tensor, up: Tensor, nibbles: Tensor, scales: Tensor, *, out: Tensor
) -> Tensor:
    return out.copy_(q4_0_gated_linear(gate, up, nibbles, scales))


_LIBRARY.impl("q4_0_gated_linear", q4_0_gated_linear, "CompositeExplicitAutograd")
_LIBRARY.impl("q4_0_gated_linear.out", _q4_0_gated_linear_out, "CompositeExplicitAutograd")
torch.library.register_fake(
    "edgemtp::q4_0_gated_linear",
    lambda gate, up, nibbles, scales: gate.new_empty(*gate.shape[:-1], nibbles.shape[0]),
    lib=_LIBRARY,
)


_LIBRARY.define("rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor")
_LIBRARY.define(
    "rms_norm.out(Tensor x, Tensor? weight, float eps, *, Tensor(a!) out) -> Tensor(a!)"
)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """What `edgemtp::rms_norm` computes (runtime/kernels/rms_norm.cpp): x * rsqrt(mean(x^2)
    + eps) over the last dim, times `weight` where there is one."""
    y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def _rms_norm_out(x: Tensor, weight: Tensor | None, eps: float, *, out: Tensor) -> Tensor:
    return out.copy_(rms_norm(x, weight, eps))


_LIBRARY.impl("rms_norm", rms_norm, "CompositeExplicitAutograd")
_LIBRARY.impl("rms_norm.out", _rms_norm_out, "CompositeExplicitAutograd")
torch.library.register_fake(
    "edgemtp::rms_norm", lambda x, weight, eps: torch.empty_like(x), lib=_LIBRARY
)

ADD_RMS_NORM = "(Tensor h, Tensor y, Tensor weight, Tensor? scale, float eps)"
_LIBRARY.define("add_rms_norm" + ADD_RMS_NORM + " -> Tensor")
_LIBRARY.define("add_rms_norm.out" + ADD_RMS_NORM[:-1] + ", *, Tensor(a!) out) -> Tensor(a!)")


def add_rms_norm(h: Tensor, y: Tensor, weight: Tensor, scale: Tensor | None, eps: float) -> Tensor:
    """What `edgemtp::add_rms_norm` computes: (h + rms_norm(y, weight, eps)) * scale (a
    residual add after a norm, and Gemma's layer scalar where given)."""
    out = h + rms_norm(y, weight, eps)
    return out if scale is None else out * scale


def _add_rms_norm_out(
    h: Tensor, y: Tensor, weight: Tensor, scale: Tensor | None, eps: float, *, out: Tensor
) -> Tensor:
    return out.copy_(add_rms_norm(h, y, weight, scale, eps))


_LIBRARY.impl("add_rms_norm", add_rms_norm, "CompositeExplicitAutograd")
_LIBRARY.impl("add_rms_norm.out", _add_rms_norm_out, "CompositeExplicitAutograd")
torch.library.register_fake(
    "edgemtp::add_rms_norm", lambda h, y, weight, scale, eps: torch.empty_like(y), lib=_LIBRARY
)


HEAD_NORM_ROPE = (
    "(Tensor x, int first_head, int heads, int kv_heads, int head_dim, Tensor? weight, "
    "Tensor? cos, Tensor? sin, float eps)"
)
_LIBRARY.define("head_norm_rope" + HEAD_NORM_ROPE + " -> Tensor")
_LIBRARY.define("head_norm_rope.out" + HEAD_NORM_ROPE[:-1] + ", *, Tensor(a!) out) -> Tensor(a!)")


def head_norm_rope(
    x: Tensor,
    first_head: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    weight: Tensor | None,
    cos: Tensor | None,
    sin: Tensor | None,
    eps: float,
) -> Tensor:
    """What `edgemtp::head_norm_rope` computes: heads [first_head, first_head + heads) of
    x [rows, ...] (head_dim columns each), each `rms_norm`ed, rotated where cos/sin
    [rows, 1, head_dim] are given, as [kv_heads, heads / kv_heads * rows, head_dim]."""
    t = x.shape[0]
    y = x[:, first_head * head_dim : (first_head + heads) * head_dim].reshape(t, heads, head_dim)
    y = rms_norm(y, weight, eps)
    if cos is not None and sin is not None:
        y = apply_rope(y, cos, sin)
    return y.transpose(0, 1).reshape(kv_heads, heads // kv_heads * t, head_dim)


def _head_norm_rope_out(*args: Tensor | int | float | None, out: Tensor) -> Tensor:
    return out.copy_(head_norm_rope(*args))  # type: ignore[arg-type]


_LIBRARY.impl("head_norm_rope", head_norm_rope, "CompositeExplicitAutograd")
_LIBRARY.impl("head_norm_rope.out", _head_norm_rope_out, "CompositeExplicitAutograd")
torch.library.register_fake(
    "edgemtp::head_norm_rope",
    lambda x, first, heads, kvh, hd, *_: x.new_empty(kvh, heads // kvh * x.shape[0], hd),
    lib=_LIBRARY,
)


def make_exportable(module: nn.Module) -> nn.Module:
    """Swap every RMSNorm and Attention of `module` to its export form, in place."""
    for m in module.modules():
        if type(m) is RMSNorm:
            m.__class__ = ExportRMSNorm
        elif type(m) is Attention:
            m.__class__ = ExportAttention
    return module
