"""edgemtp's kernels as torch operators: what a program calls, and what each computes.

Each `edgemtp::<name>` is declared once by `kernel_op` with its `.out` variant (what an ExecuTorch
program calls: the C++ kernel beside this file), its eager implementation below (the numerics
the C++ kernel must reproduce, and what the reference engine runs in a kernel form) and the
shape function tracing needs. Importing this module registers them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from edgemtp.model.primitives import (
    SCALE_BYTES,
    Segments,
    apply_rope,
    as_stored,
    gelu_tanh,
    read_rows,
    ring_positions,
    stored_rows,
    truncated,
)
from edgemtp.quantize.q4_0 import Q4_0, dequantize_q4_0, q8_0_rows, unnibble_q4_0

KERNEL_MAX_ROWS = 8  # calls of more rows (prompt chunks) run XNNPACK's batched matmuls instead

_LIBRARY = torch.library.Library("edgemtp", "DEF")


def kernel_op(name: str, arguments: str, eager: Callable[..., Tensor], shape: Callable) -> None:
    """Declare `edgemtp::<name>(<arguments>) -> Tensor` and its `.out` variant, both computed
    by `eager`; `shape(*arguments)` gives the result's empty tensor for tracing."""
    _LIBRARY.define(f"{name}({arguments}) -> Tensor")
    _LIBRARY.define(f"{name}.out({arguments}, *, Tensor(a!) out) -> Tensor(a!)")

    def out_variant(*args: object, out: Tensor) -> Tensor:
        return out.copy_(eager(*args))

    _LIBRARY.impl(name, eager, "CompositeExplicitAutograd")
    _LIBRARY.impl(f"{name}.out", out_variant, "CompositeExplicitAutograd")
    torch.library.register_fake(f"edgemtp::{name}", shape, lib=_LIBRARY)


# --- attention ---------------------------------------------------------------------------------


def heads_to_rows(out: Tensor, rows: int) -> Tensor:
    """Attention output [kv_heads, group * rows, head_dim] as [rows, heads * head_dim]."""
    return out.view(-1, rows, out.shape[-1]).transpose(0, 1).reshape(rows, -1)


def segment_attention(q: Tensor, ks: Segments, vs: Segments, mask: Tensor, group: int) -> Tensor:
    """Grouped-query attention over K/V kept in segments (the cache, the call's own rows):
    q [kv_heads, group * rows, head_dim] (scale 1.0) against each segment's keys [kv_heads,
    keys, head_dim], the additive mask [rows, all keys], one softmax over all keys, each
    segment's probabilities times its values, summed: [kv_heads, group * rows, head_dim]."""
    kvh, t = q.shape[0], mask.shape[0]
    scores = torch.cat([torch.bmm(q, s.transpose(1, 2)) for s in ks], dim=-1)
    scores = scores.view(kvh, group, t, -1) + mask
    probs = torch.softmax(scores, dim=-1).view(kvh, group * t, -1)
    if len(vs) == 1:  # (a full-range slice would trace to an alias ONNX cannot translate)
        return torch.bmm(probs, vs[0])
    parts, start = [], 0
    for s in vs:
        parts.append(torch.bmm(probs[..., start : start + s.shape[1]], s))
        start += s.shape[1]
    return sum(parts[1:], parts[0])


def cache_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, k_new: Tensor | None, v_new: Tensor | None,
    mask: Tensor,
) -> Tensor:  # fmt: skip
    """`edgemtp::cache_attention` (cache_attention.cpp): q [kv_heads, group * rows, head_dim]
    over the first `keys - new` cache slots (float32, float16 or int8 rows: `stored_rows`),
    then the new keys, `mask` [rows, keys] additive."""
    fresh = 0 if k_new is None else k_new.shape[1]
    cached = mask.shape[1] - fresh
    if cached < k_cache.shape[1]:  # (a slice is a copy in XNNPACK: none where it is all)
        k_cache, v_cache = k_cache[:, :cached], v_cache[:, :cached]
    stored = k_cache.dtype
    if stored != q.dtype:  # a narrower cache: widened to the activations' dtype, and the
        # call's own keys rounded as they will be stored (a verify row sees what later steps read)
        k_cache, v_cache = read_rows(k_cache, q.dtype), read_rows(v_cache, q.dtype)
        if k_new is not None and v_new is not None:
            k_new, v_new = as_stored(k_new, stored), as_stored(v_new, stored)
    ks = (k_cache,) + (() if k_new is None else (k_new,))
    vs = (v_cache,) + (() if v_new is None else (v_new,))
    return segment_attention(q, ks, vs, mask, q.shape[1] // mask.shape[0])


def cache_attention_rows(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, k_new: Tensor | None, v_new: Tensor | None,
    mask: Tensor,
) -> Tensor:  # fmt: skip
    """`cache_attention` as [rows, heads * head_dim] (`edgemtp::cache_attention_rows`: the
    kernel writes that layout, so no transpose runs before the output projection)."""
    out = cache_attention(q, k_cache, v_cache, k_new, v_new, mask)
    return heads_to_rows(out, mask.shape[0])


ATTENTION_ARGUMENTS = (
    "Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_new, Tensor? v_new, Tensor mask"
)
kernel_op(
    "cache_attention", ATTENTION_ARGUMENTS, cache_attention, lambda q, *_: torch.empty_like(q)
)
kernel_op(
    "cache_attention_rows",
    ATTENTION_ARGUMENTS,
    cache_attention_rows,
    lambda q, k, v, k_new, v_new, mask: q.new_empty(mask.shape[0], q.numel() // mask.shape[0]),
)


def quantize_kv_rows(x: Tensor) -> Tensor:
    """`edgemtp::quantize_kv_rows` (cache_attention.cpp): K or V rows [heads, rows, head_dim]
    as an int8 cache stores them (`stored_rows`: codes, then each row's float32 scale), one
    call where the arithmetic in standard ops ran outside the delegates, op by op."""
    return stored_rows(x, torch.int8)


kernel_op(
    "quantize_kv_rows",
    "Tensor x",
    quantize_kv_rows,
    lambda x: x.new_empty(*x.shape[:-1], x.shape[-1] + SCALE_BYTES, dtype=torch.int8),
)


# --- the static programs' slot bookkeeping ---------------------------------------------------


kernel_op(
    "truncate_positions",
    "Tensor slot_pos, Tensor at",
    truncated,
    lambda p, at: p.new_empty(p.shape),
)
kernel_op(
    "ring_positions",
    "Tensor kept, Tensor positions, int slots",
    ring_positions,
    lambda kept, positions, slots: kept.new_empty(kept.shape),
)


# --- Q4_0 linears ------------------------------------------------------------------------------


def q4_0_linear(x: Tensor, nibbles: Tensor, scales: Tensor) -> Tensor:
    """`edgemtp::q4_0_linear` (q4_0_linear.cpp): x [..., in] rounded to Q8_0, times the Q4_0
    weight of `nibbles` uint8 [out, in / 2] (`nibbles_q4_0`) and `scales` float16
    [out, in / 32] -> [..., out]."""
    out, half = nibbles.shape
    w = dequantize_q4_0(Q4_0(scales=scales, codes=unnibble_q4_0(nibbles), shape=(out, half * 2)))
    return F.linear(q8_0_rows(x), w)


def q4_0_gated_linear(gate: Tensor, up: Tensor, nibbles: Tensor, scales: Tensor) -> Tensor:
    """`edgemtp::q4_0_gated_linear`: `q4_0_linear` of gelu_tanh(gate) * up (a gated
    projection's input formed in the kernel, so no delegate runs between the two)."""
    return q4_0_linear(gelu_tanh(gate) * up, nibbles, scales)


kernel_op(
    "q4_0_linear",
    "Tensor x, Tensor nibbles, Tensor scales",
    q4_0_linear,
    lambda x, nibbles, scales: x.new_empty(*x.shape[:-1], nibbles.shape[0]),
)
kernel_op(
    "q4_0_gated_linear",
    "Tensor gate, Tensor up, Tensor nibbles, Tensor scales",
    q4_0_gated_linear,
    lambda gate, up, nibbles, scales: gate.new_empty(*gate.shape[:-1], nibbles.shape[0]),
)


# --- norms -------------------------------------------------------------------------------------


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """`edgemtp::rms_norm` (rms_norm.cpp): x * rsqrt(mean(x^2) + eps) over the last dim, times
    `weight` where there is one."""
    y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def add_rms_norm(h: Tensor, y: Tensor, weight: Tensor, scale: Tensor | None, eps: float) -> Tensor:
    """`edgemtp::add_rms_norm`: (h + rms_norm(y, weight, eps)) * scale (a residual add after a
    norm, and Gemma's layer scalar where given)."""
    out = h + rms_norm(y, weight, eps)
    return out if scale is None else out * scale


def head_norm_rope(
    x: Tensor, first_head: int, heads: int, kv_heads: int, head_dim: int,
    weight: Tensor | None, cos: Tensor | None, sin: Tensor | None, eps: float,
) -> Tensor:  # fmt: skip
    """`edgemtp::head_norm_rope`: heads [first_head, first_head + heads) of x [rows, ...]
    (head_dim columns each), each `rms_norm`ed, rotated where cos/sin [rows, 1, head_dim] are
    given, as [kv_heads, heads / kv_heads * rows, head_dim]."""
    t = x.shape[0]
    y = x[:, first_head * head_dim : (first_head + heads) * head_dim].reshape(t, heads, head_dim)
    y = rms_norm(y, weight, eps)
    if cos is not None and sin is not None:
        y = apply_rope(y, cos, sin)
    return y.transpose(0, 1).reshape(kv_heads, heads // kv_heads * t, head_dim)


kernel_op(
    "rms_norm", "Tensor x, Tensor? weight, float eps", rms_norm,
    lambda x, weight, eps: torch.empty_like(x),
)  # fmt: skip
kernel_op(
    "add_rms_norm",
    "Tensor h, Tensor y, Tensor weight, Tensor? scale, float eps",
    add_rms_norm,
    lambda h, y, weight, scale, eps: torch.empty_like(y),
)
kernel_op(
    "head_norm_rope",
    "Tensor x, int first_head, int heads, int kv_heads, int head_dim, Tensor? weight, "
    "Tensor? cos, Tensor? sin, float eps",
    head_norm_rope,
    lambda x, first, heads, kvh, hd, *_: x.new_empty(kvh, heads // kvh * x.shape[0], hd),
)
