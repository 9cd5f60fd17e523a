"""Core ML backend: the static methods as one multifunction ML program (`model.mlpackage`).

The package (ML program, minimum deployment target iOS 18 / macOS 15, spec version 9):

- one function per method (`prefill_intermediate`, `prefill_final`, `verify_0..k`,
  `draft_step`), sharing one copy of the weights (constants de-duplicated across functions);
- the K/V caches are Core ML states (fp16: Core ML has no other state dtype). Every function,
  the drafter included, declares the same states, so on device one `MLState` serves them all;
- the slot positions are NOT states (fp16 holds integers exactly only up to 2048): they are
  int32 inputs `pos_<kind>`, the functions that write the cache return `new_pos_<kind>`, and
  the runner feeds them back. Truncation (implicit rollback), left padding and the trash slot
  are `StaticCache.write`'s;
- every linear with a 4-bit checkpoint form is a `constexpr_blockwise_shift_scale` of OUR codes
  and scales: int4 codes, no offset, for symmetric schemes (Q4_0, symmetric W4A16); uint4 codes
  with uint4 offsets otherwise; one fp16 scale per group along the input dim. coremltools never
  re-derives them: the weight is a custom torch op (`edgemtp::int4_weight`) whose converter
  emits the constexpr from the stored codes. Every other weight is fp16.

How it is built. The methods are traced with `torch.jit.trace` in their "Core ML forms"
(`coreml_forms`, `CoreMLTarget`, `CoreMLDrafter`) and converted by coremltools' TorchScript
frontend with its fp16 pass. (`torch.export` works too but took ~50 s per method here against
~1 s for a trace; torch 2.13 marks `jit.trace` deprecated, coremltools 9 still relies on it.)
The forms change no maths, only how it is spelled, and each is checked against the reference:

- the drafter step keeps the position a tensor (a trace would freeze `position[0].item()`) and
  zeroes each K/V buffer's trash slot: a converted function may not declare a state it never
  uses, and the drafter must declare all of them;
- cache writes are a one-hot matmul + select (`index_copy_` has no Core ML lowering): a slot
  one row targets gets exactly that row (1 * x + 0 * ...); pad rows all target the trash slot,
  which then holds their sum instead of one of them: it is never read;
- RMSNorm divides by the row's largest magnitude before squaring: x * rsqrt(mean(x^2) + eps) =
  y * rsqrt(mean(y^2) + eps / m^2) with y = x / m. fp16 squares overflow past 256, and Gemma's
  residual stream is known to exceed that; every op stays fp16 (ANE-friendly);
- RoPE angles (position * inv_freq) and their sin/cos stay fp32 (the fp16 pass skips them),
  then are cast to fp16: in fp16 a position of 1000 has an ulp of 0.5.

Everything else computes in fp16: activations, K/V states, weights (int4 dequantized to fp16:
scale * (code - offset) with fp16 scales, so only the product is rounded, once).

What Linux can and cannot check. `validate_mlpackage` reads the package (functions, I/O,
states, op types and dtypes, weight blobs); `package_weights` reads the weights back from
weight.bin; `TorchCoreMLRunner` runs the same forms eagerly in torch (fp16, or fp32 to prove
them exact) with those weights, behind the I/O protocol `CoreMLRunner` uses. Core ML itself
(`predict`) needs macOS 15+; whether one `MLState` really serves all functions of a package,
and the compute units' internal accumulation precision, can only be checked on Apple hardware.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import platform
import shutil
import time
import types
import uuid
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from edgemtp.errors import EdgeMTPError
from edgemtp.export.bundle import Lowered, Progress
from edgemtp.export.static import StaticBundle, StaticCache, StaticShapes
from edgemtp.export.weights import int4_of
from edgemtp.model.gemma4 import (
    Attention,
    Gemma4Drafter,
    Gemma4Target,
    RMSNorm,
    apply_rope,
    drafter_mask,
    rope_cos_sin,
)

PACKAGE = "model.mlpackage"
COMPUTE_UNITS = {"metal": "CPU_AND_GPU", "npu": "CPU_AND_NE", "cpu": "CPU_ONLY"}
SPEC_VERSION_IOS18 = 9
INT4_OP = "constexpr_blockwise_shift_scale"
_UUID_NAMESPACE = uuid.UUID("5d1c6a4e-3f0b-4c1e-9a57-6e6d74704d4c")  # fixed: deterministic ids


# --- Core ML forms of the model ---------------------------------------------------------------


@torch.library.custom_op("edgemtp::int4_weight", mutates_args=())
def int4_weight(codes: Tensor, scales: Tensor, zeros: Tensor) -> Tensor:
    """(codes - zeros) * scales per group along the input dim, in the scales' dtype (fp16: the
    exact small integer times the fp16 scale, rounded once, as Core ML's constexpr computes)."""
    group = codes.shape[1] // scales.shape[1]
    q = codes.to(torch.int16) - zeros.to(torch.int16).repeat_interleave(group, 1)
    return q.to(scales.dtype) * scales.repeat_interleave(group, 1)


@int4_weight.register_fake
def _int4_weight_fake(codes: Tensor, scales: Tensor, zeros: Tensor) -> Tensor:
    return codes.new_empty(codes.shape, dtype=scales.dtype)


class Int4Linear(nn.Linear):
    """A linear whose `weight` is the int4 op over its stored codes: every use of the weight
    (the matmul, and the drafter's clustered head, which gathers rows of `lm_head.weight`) goes
    through the op, so the converter sees codes and scales, never float weights."""

    @property  # type: ignore[override]
    def weight(self) -> Tensor:
        return int4_weight(self.int4_codes, self.int4_scales, self.int4_zeros)


class CoreMLRMSNorm(RMSNorm):
    """RMSNorm in the input's dtype without overflow: y = x / max|x| before squaring."""

    def forward(self, x: Tensor) -> Tensor:
        # The floor keeps 1/m finite in fp16; an all-zero row (padding) stays zero.
        inv = 1.0 / x.abs().amax(-1, keepdim=True).clamp_min(2.0**-14)
        y = x * inv
        e = self.eps**0.5 * inv  # eps / m^2 = e * e, without forming the tiny m^2
        y = y * torch.rsqrt((y * y).mean(-1, keepdim=True) + e * e)
        return y * self.weight if self.weight is not None else y


class CoreMLAttention(Attention):
    """`ExportAttention`'s grouped-query attention with the additive mask in the scores' dtype
    (an fp32 mask would promote fp16 scores to fp32)."""

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, k: Tensor, v: Tensor, mask: Tensor
    ) -> Tensor:
        t, hd, kvh = x.shape[0], self.spec.head_dim, k.shape[0]
        q = self.q_proj(x).view(t, -1, hd)
        q = apply_rope(self.q_norm(q), cos, sin).transpose(0, 1)  # [heads, T, hd]
        group = q.shape[0] // kvh
        scores = torch.bmm(q.reshape(kvh, group * t, hd), k.transpose(1, 2))  # scale 1.0
        additive = torch.zeros_like(mask, dtype=scores.dtype).masked_fill(~mask, float("-inf"))
        scores = scores.view(kvh, group, t, -1) + additive
        probs = torch.softmax(scores, dim=-1).view(kvh, group * t, -1)
        out = torch.bmm(probs, v).view(kvh * group, t, hd)
        return self.o_proj(out.transpose(0, 1).reshape(t, -1))


def _rope_in_dtype(self: Gemma4Target, kind: str, positions: Tensor) -> tuple[Tensor, Tensor]:
    """Angles and sin/cos in fp32 (inv_freq stays fp32), cast to the weights' dtype."""
    cos, sin = rope_cos_sin(positions, getattr(self, f"{kind}_inv_freq"))
    dtype = self.norm.weight.dtype
    return cos.to(dtype), sin.to(dtype)


@contextlib.contextmanager
def coreml_forms(static: StaticBundle, dtype: torch.dtype = torch.float32) -> Iterator[int]:
    """Put the bundle's models in their Core ML forms for the duration: `Int4Linear` wherever a
    linear has an `int4` form (fp16 scales), `CoreMLRMSNorm`, `CoreMLAttention`, RoPE cast to
    the weights' dtype. With `dtype=torch.float16` the float weights and the K/V buffers are
    cast too (the eager fp16 emulation of the program; conversion traces in fp32 and lets
    coremltools' fp16 pass cast). Everything is restored afterwards (fp32 weights are kept
    aside, not recomputed). Yields the number of int4 linears."""
    target = static.target.target
    models: list[nn.Module] = [target]
    if static.drafter is not None:
        models.append(static.drafter.drafter)
    classes: list[tuple[nn.Module, type]] = []
    saved: list[tuple[nn.Parameter, Tensor]] = []
    int4: list[nn.Module] = []
    cache = static.cache
    kv_buffers = {n: b for n, b in cache.named_buffers() if n[0] in "kv"}
    try:
        for model in models:
            for module in model.modules():
                w = int4_of(module)
                if isinstance(module, nn.Linear) and w is not None:
                    scales = w.scales.to(torch.float16)
                    if not torch.equal(scales.float(), w.scales):
                        raise EdgeMTPError(
                            "a 4-bit group scale is not representable in fp16 (Core ML's scale "
                            "dtype); export with --backend executorch or onnx"
                        )
                    module.register_buffer("int4_codes", w.codes, persistent=False)
                    module.register_buffer("int4_scales", scales.to(dtype), persistent=False)
                    module.register_buffer("int4_zeros", w.zeros, persistent=False)
                    classes.append((module, type(module)))
                    module.__class__ = Int4Linear
                    int4.append(module)
                elif isinstance(module, RMSNorm):
                    classes.append((module, type(module)))
                    module.__class__ = CoreMLRMSNorm
                elif isinstance(module, Attention):
                    classes.append((module, type(module)))
                    module.__class__ = CoreMLAttention
            for p in model.parameters():
                if p.dtype.is_floating_point and p.dtype != dtype:
                    saved.append((p, p.data))
                    p.data = p.data.to(dtype)
        for name, b in kv_buffers.items():
            setattr(cache, name, b.to(dtype, copy=True))  # traces and runs write them
        target.rope = types.MethodType(_rope_in_dtype, target)  # type: ignore[method-assign]
        yield len(int4)
    finally:
        target.__dict__.pop("rope", None)
        for name, b in kv_buffers.items():
            setattr(cache, name, b)
        for p, data in saved:
            p.data = data
        for module, cls in classes:
            module.__class__ = cls
        for module in int4:
            for name in ("int4_codes", "int4_scales", "int4_zeros"):
                del module._buffers[name]


# --- the methods with host-owned slot positions -----------------------------------------------


class _PositionsView:
    """`CacheView` over the cache buffers with slot positions given as tensors."""

    def __init__(self, cache: StaticCache, positions: dict[str, Tensor]):
        self.cache = cache
        self.pos = positions

    def kv(self, layer: int) -> tuple[Tensor, Tensor]:
        return self.cache.k(layer), self.cache.v(layer)

    def positions(self, kind: str) -> Tensor:
        return self.pos[kind]


def write_cache(
    cache: StaticCache,
    view: _PositionsView,
    new_kv: dict[int, tuple[Tensor, Tensor]],
    positions: Tensor,
) -> dict[str, Tensor]:
    """`StaticCache.write` with the slot positions returned instead of stored and the rows
    placed by a one-hot matmul + select (see the module docstring)."""
    pad = positions > positions[-1]
    write_pos = torch.where(pad, -1, positions)
    hits, new_pos = {}, {}
    for kind, n in cache.slots.items():
        slot = torch.where(pad, n, positions % n)
        hit = torch.arange(n + 1)[:, None] == slot[None, :]  # [slots + 1, rows]
        other = torch.full_like(hit, -2, dtype=positions.dtype)
        written = torch.where(hit, write_pos[None, :], other).amax(1)
        new_pos[kind] = torch.where(hit.any(1), written, view.pos[kind])
        hits[kind] = hit
    for i, (k, v) in new_kv.items():
        hit = hits[cache.cfg.layers[i].attention]
        onehot = hit.to(k.dtype).expand(k.shape[0], *hit.shape)
        kept = hit.any(1)[None, :, None]
        # Slice assignment: the one in-place form coremltools turns into a state update.
        cache.k(i)[:] = torch.where(kept, torch.bmm(onehot, k), cache.k(i))
        cache.v(i)[:] = torch.where(kept, torch.bmm(onehot, v), cache.v(i))
    return new_pos


class CoreMLTarget(nn.Module):
    """`StaticTarget`'s methods with the slot positions as inputs and outputs; fp32 tensors at
    the torch boundary, the weights' dtype inside (the converted program's float outputs are
    fp16)."""

    def __init__(self, model: Gemma4Target, kvcache: StaticCache):
        super().__init__()
        self.target = model
        self.kvcache = kvcache
        self.kinds = tuple(kvcache.slots)
        self.has_ple = model.cfg.hidden_size_per_layer_input > 0

    def _forward(
        self,
        embeds: Tensor,
        token_ple: Tensor,
        positions: Tensor,
        slot_pos: tuple[Tensor, ...],
        rows: str,
    ) -> tuple[Tensor | None, tuple[Tensor, ...]]:
        first = positions.min()
        view = _PositionsView(
            self.kvcache,
            {k: torch.where(p >= first, -1, p) for k, p in zip(self.kinds, slot_pos, strict=True)},
        )
        dtype = self.target.norm.weight.dtype
        ple = token_ple.to(dtype) if self.has_ple else None
        hidden, new_kv = self.target(embeds.to(dtype), ple, positions, view, rows)  # type: ignore[arg-type]
        new_pos = write_cache(self.kvcache, view, new_kv, positions)
        return hidden, tuple(new_pos[k] for k in self.kinds)

    def prefill_intermediate(
        self, embeds: Tensor, token_ple: Tensor, positions: Tensor, *slot_pos: Tensor
    ) -> tuple[Tensor, ...]:
        _, pos = self._forward(embeds, token_ple, positions, slot_pos, "none")
        return positions[-1:] + 1, *pos

    def prefill_final(
        self, embeds: Tensor, token_ple: Tensor, positions: Tensor, *slot_pos: Tensor
    ) -> tuple[Tensor, ...]:
        hidden, pos = self._forward(embeds, token_ple, positions, slot_pos, "last")
        assert hidden is not None
        last = hidden[-1]
        return last.float(), self.target.logits(last).float(), *pos

    def verify(
        self, embeds: Tensor, token_ple: Tensor, positions: Tensor, *slot_pos: Tensor
    ) -> tuple[Tensor, ...]:
        hidden, pos = self._forward(embeds, token_ple, positions, slot_pos, "all")
        assert hidden is not None
        return self.target.logits(hidden).float(), hidden.float(), *pos


class CoreMLDrafter(nn.Module):
    """`StaticDrafter.draft_step` with the slot positions as inputs; it also zeroes every K/V
    buffer's trash slot (see below).

    The body is `Gemma4Drafter.forward` (and `ClusteredHead.forward`) with the position kept a
    tensor: a trace freezes `position[0].item()` into a constant."""

    def __init__(self, model: Gemma4Drafter, kvcache: StaticCache):
        super().__init__()
        self.drafter = model
        self.kvcache = kvcache
        self.kinds = tuple(kvcache.slots)

    def draft_step(
        self, token_embed: Tensor, hidden: Tensor, position: Tensor, *slot_pos: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        d, cache = self.drafter, self.kvcache
        text = d.cfg.text
        slot = dict(zip(self.kinds, slot_pos, strict=True))
        dtype = d.norm.weight.dtype
        h = d.pre_projection(torch.cat([token_embed, hidden]).to(dtype)[None])
        pos = position.reshape(1)
        for layer in d.layers:
            kind = layer.spec.attention
            store = d.stores[kind]
            window = text.sliding_window if kind == "sliding" else None
            mask = drafter_mask(pos, slot[kind], window)
            cos, sin = rope_cos_sin(pos, getattr(d, f"{kind}_inv_freq"))
            kv = (cache.k(store), cache.v(store))
            h, _, _ = layer(h, cos.to(dtype), sin.to(dtype), kv, mask, None)
        # Zero every K/V buffer's trash slot (no mask admits it): a converted function may not
        # declare a state it never uses, and the drafter must declare all of them.
        for i in cache.owners:
            cache.k(i)[:, -1:] = 0.0
            cache.v(i)[:, -1:] = 0.0
        h = d.norm(h)[0]
        next_hidden = d.post_projection(h).float()
        head = d.masked_embedding
        if head is None:
            return next_hidden, torch.arange(text.vocab_size), d.lm_head(h).float()
        top = torch.topk(head.centroids(h), head.top_k).indices
        ids = head.token_ordering.view(-1, head.tokens_per_centroid)[top].reshape(-1)
        # matrix @ column (coremltools cannot convert a matmul with a 1-D right side)
        return next_hidden, ids, (d.lm_head.weight[ids] @ h[:, None])[:, 0].float()


class CoreMLMethod(nn.Module):
    """forward = `owner.<name>`; both owners hold the cache as `kvcache`, so the state names
    (`owner.kvcache.k3`, ...) are identical in every function."""

    def __init__(self, owner: nn.Module, name: str):
        super().__init__()
        self.owner = owner
        self.name = name

    def forward(self, *args: Tensor) -> tuple[Tensor, ...]:
        return getattr(self.owner, self.name)(*args)


def method_io(static: StaticBundle) -> dict[str, dict[str, list[str]]]:
    """Per function: input names and output names, as the package declares them. The logical
    inputs/outputs come first (as `StaticBundle.methods` and `driver.Runner` define them), then
    the slot positions."""
    kinds = tuple(static.cache.slots)
    pos = [f"pos_{k}" for k in kinds]
    new = [f"new_pos_{k}" for k in kinds]
    target_in = ["embeds", "token_ple", "positions", *pos]
    io = {
        "prefill_intermediate": {"inputs": target_in, "outputs": ["length", *new]},
        "prefill_final": {"inputs": target_in, "outputs": ["hidden", "logits", *new]},
    }
    for k in static.shapes.verify_depths():
        io[f"verify_{k}"] = {"inputs": target_in, "outputs": ["logits", "hidden", *new]}
    if static.drafter is not None:
        io["draft_step"] = {
            "inputs": ["token_embed", "hidden", "position", *pos],
            "outputs": ["next_hidden", "ids", "logits"],
        }
    return io


def coreml_methods(static: StaticBundle) -> dict[str, tuple[CoreMLMethod, tuple[Tensor, ...]]]:
    """Function name -> (module, example inputs): `static.methods()` (without `cache_state`)
    with the slot positions appended to every function's inputs."""
    cache = static.cache
    target = CoreMLTarget(static.target.target, cache).eval()
    drafter = (
        CoreMLDrafter(static.drafter.drafter, cache).eval() if static.drafter is not None else None
    )
    slot_pos = tuple(torch.full_like(cache.pos(k), -1) for k in cache.slots)
    out = {}
    for name, (_, inputs) in static.methods().items():
        owner = drafter if name == "draft_step" else target
        assert owner is not None
        attr = "verify" if name.startswith("verify_") else name
        out[name] = (CoreMLMethod(owner, attr).eval(), (*inputs, *slot_pos))
    return out


# --- conversion -------------------------------------------------------------------------------


_CONVERTERS_REGISTERED = False


def _register_converters() -> None:
    """Teach coremltools 9's TorchScript frontend what our traces contain (once per process):
    the int4 weight op; `__iand__` (the mask code's `m &= ...`), as a logical and; and `int` /
    `bool` of a constant size-1 array, which its own converters pass to `int()` and NumPy >= 2.3
    rejects (the replacements only add that case; they stay registered for the process)."""
    global _CONVERTERS_REGISTERED
    if _CONVERTERS_REGISTERED:
        return
    with _quiet():  # its import warns about untested torch/sklearn versions on stderr
        import coremltools  # noqa: F401
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.frontend.torch import ops
    from coremltools.converters.mil.frontend.torch.torch_op_registry import _TORCH_OPS_REGISTRY
    from coremltools.converters.mil.mil import types as mil_types

    def edgemtp_int4_weight(context: Any, node: Any) -> None:
        codes, scales, zeros = ops._get_inputs(context, node, expected=3)
        c, s, z = codes.val, scales.val, zeros.val
        if c is None or s is None or z is None:
            raise EdgeMTPError(f"int4 weight {node.name}: codes and scales must be constants")
        if (z == 8).all():  # symmetric: signed codes, no offset
            data, offset = (c.astype(np.int8) - 8).astype(mil_types.np_int4_dtype), None
        else:
            data, offset = c.astype(mil_types.np_uint4_dtype), z.astype(mil_types.np_uint4_dtype)
        out = mb.constexpr_blockwise_shift_scale(
            data=data, scale=s.astype(np.float32), offset=offset, name=_int4_name(codes.name)
        )
        context.add(out, torch_name=node.name)

    def edgemtp_iand(context: Any, node: Any) -> None:
        ops.logical_and(context, node)

    def cast_scalar(context: Any, node: Any, dtype: type, dtype_name: str) -> None:
        x = ops._get_inputs(context, node, expected=1)[0]
        if x.can_be_folded_to_const() and not isinstance(x.val, dtype):
            value = dtype(np.asarray(x.val).reshape(()).item())
            context.add(mb.const(val=value, name=node.name), node.name)
        else:
            ops._cast(context, node, dtype, dtype_name)

    def edgemtp_int(context: Any, node: Any) -> None:
        cast_scalar(context, node, int, "int32")

    def edgemtp_bool(context: Any, node: Any) -> None:
        cast_scalar(context, node, bool, "bool")

    _TORCH_OPS_REGISTRY.register_func(edgemtp_int4_weight, ["edgemtp::int4_weight"], False)
    _TORCH_OPS_REGISTRY.register_func(edgemtp_iand, ["iand"], False)
    _TORCH_OPS_REGISTRY.register_func(edgemtp_int, ["int"], True)
    _TORCH_OPS_REGISTRY.register_func(edgemtp_bool, ["bool"], True)
    _CONVERTERS_REGISTERED = True


def _int4_name(codes_var: str) -> str:
    """`<module path>_int4` from the codes' constant name: names the constexpr after its linear
    (`owner.target.layers.0.self_attn.q_proj.int4_codes` -> `target_layers_0_..._q_proj_int4`)."""
    name = codes_var.replace(".", "_").removesuffix("_int4_codes")
    return name.removeprefix("owner_") + "_int4"


_ROPE_CHAIN = ("cast", "expand_dims", "reshape", "mul", "concat")


def _feeds_rope(op: Any, hops: int = 4) -> bool:
    """Whether `op` is a RoPE sin/cos or computes its angle (positions -> float -> * inv_freq
    -> concat -> sin/cos)."""
    if op.op_type in ("sin", "cos"):
        return True
    if hops == 0 or op.op_type not in _ROPE_CHAIN:
        return False
    return any(_feeds_rope(child, hops - 1) for v in op.outputs for child in v.child_ops)


def _fp16_op(op: Any) -> bool:
    """coremltools' fp16 pass op selector: every op computes in fp16 except RoPE's. (Tracing
    in fp16 instead does not work: the TorchScript frontend promotes an fp16 tensor times a
    Python float to fp32, and a promoted weight turns `linear` into `matmul`.)"""
    return not _feeds_rope(op)


def state_names(static: StaticBundle) -> list[str]:
    """The K/V buffers every function declares as states (their names in the traced module)."""
    return [f"owner.kvcache.{kv}{i}" for i in static.cache.owners for kv in "kv"]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Mute coremltools' progress bars and warnings (stderr, logging); errors still raise."""
    log = logging.getLogger("coremltools")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(level)


@contextlib.contextmanager
def _converting() -> Iterator[Any]:
    """Quiet, single-validation conversion. coremltools re-validates the whole program after
    each of its ~110 passes (a third of a conversion's time, ~0.1 s each on a 10-layer model);
    here validation is off while it converts, and the caller validates the result once with
    the yielded function."""
    with _quiet():
        from coremltools.converters.mil.mil import Program

        validate = Program.validate
        Program.validate = lambda self, *args, **kwargs: None  # type: ignore[method-assign]
        try:
            yield validate
        finally:
            Program.validate = validate  # type: ignore[method-assign]


def convert_function(
    name: str, module: nn.Module, inputs: tuple[Tensor, ...], static: StaticBundle
) -> Any:
    """Trace one method (inside `coreml_forms`) and convert it to a single-function ML program
    (not compiled: `skip_model_load`, Linux has no Core ML runtime)."""
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb

    # coremltools names unnamed ops from a process-wide counter that only the end of its own
    # conversions resets (loading a package advances it too): start from zero, so that names,
    # hence bytes, do not depend on what ran before.
    mb.name_count.clear()
    names = method_io(static)[name]
    cache = static.cache
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # jit.trace's deprecation and tracer warnings
        traced = torch.jit.trace(module, inputs, check_trace=False)
    ct_inputs = [
        ct.TensorType(
            name=n, shape=x.shape, dtype=np.float32 if x.dtype.is_floating_point else np.int32
        )
        for n, x in zip(names["inputs"], inputs, strict=True)
    ]
    states = [
        ct.StateType(
            wrapped_type=ct.TensorType(
                shape=tuple(cache.get_buffer(n.removeprefix("owner.kvcache.")).shape),
                dtype=np.float16,
            ),
            name=n,
        )
        for n in state_names(static)
    ]
    with _converting() as validate:
        model = ct.convert(
            traced,
            inputs=ct_inputs,
            outputs=[ct.TensorType(name=n) for n in names["outputs"]],
            states=states,
            minimum_deployment_target=ct.target.iOS18,
            convert_to="mlprogram",
            compute_precision=ct.transform.FP16ComputePrecision(op_selector=_fp16_op),
            skip_model_load=True,
        )
    validate(model._mil_program)
    return model


def canonicalize(package: Path) -> None:
    """Make a package's bytes a function of its content: the Manifest's random item ids become
    name-derived ones (uuid5), and the model spec is re-serialized with protobuf's
    deterministic map ordering (map fields otherwise serialize in hash order, which changes
    from process to process)."""
    path = package / "Manifest.json"
    manifest = json.loads(path.read_text())
    ids = {
        old: str(uuid.uuid5(_UUID_NAMESPACE, item["path"])).upper()
        for old, item in manifest["itemInfoEntries"].items()
    }
    manifest["itemInfoEntries"] = {ids[k]: v for k, v in manifest["itemInfoEntries"].items()}
    manifest["rootModelIdentifier"] = ids[manifest["rootModelIdentifier"]]
    path.write_text(json.dumps(manifest, indent=4, sort_keys=True) + "\n")
    from coremltools.proto import Model_pb2

    spec_path = package / "Data" / "com.apple.CoreML" / "model.mlmodel"
    spec = Model_pb2.Model()
    spec.ParseFromString(spec_path.read_bytes())
    spec_path.write_bytes(spec.SerializeToString(deterministic=True))


def save_multifunction(models: dict[str, Any], package: Path) -> None:
    """One multifunction package from single-function models (in this order; the first
    `verify_0`, else the first, is the default), weights de-duplicated across functions.

    What `ct.utils.save_multifunction` does, without its detour: it saves every function,
    loads them back, and runs the whole default pass pipeline's validation over the merged
    program (~100 full validations, minutes for a 10-layer model); the functions here are
    converted and optimised already, so the merged program goes straight to the backend."""
    import coremltools as ct
    from coremltools.converters.mil.converter import mil_convert
    from coremltools.converters.mil.mil import Program
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY
    from coremltools.proto import Model_pb2

    program = Program()
    functions = []
    for name, model in models.items():
        program.add_function(name, model._mil_program.functions["main"])
        d = model.get_spec().description
        functions.append(
            Model_pb2.FunctionDescription(name=name, input=d.input, output=d.output, state=d.state)
        )
    PASS_REGISTRY["common::const_deduplication"]._deduplicate_const_across_functions(program)
    default = "verify_0" if "verify_0" in models else next(iter(models))
    program.default_function_name = default
    program.export_as_multifunction = True
    with _converting() as validate:
        merged = mil_convert(
            program,
            convert_from="milinternal",
            convert_to="mlprogram",
            compute_units=ct.ComputeUnit.CPU_ONLY,
            specification_version=SPEC_VERSION_IOS18,
            model_description=Model_pb2.ModelDescription(
                functions=functions, defaultFunctionName=default
            ),
            skip_model_load=True,
            pass_pipeline=ct.PassPipeline.EMPTY,
        )
    validate(program)
    if package.exists():
        shutil.rmtree(package)
    merged.save(str(package))


def delegate_compute_units(delegate: str) -> str:
    """The `ct.ComputeUnit` name a delegate maps to (set by the runtime when it loads)."""
    if delegate == "htp":
        raise EdgeMTPError(
            "Core ML has no Qualcomm delegate; use --backend executorch or onnx with --delegate htp"
        )
    if delegate not in COMPUTE_UNITS:
        raise EdgeMTPError(
            f"unknown delegate '{delegate}' for Core ML (choose {', '.join(COMPUTE_UNITS)})"
        )
    return COMPUTE_UNITS[delegate]


def lower_coreml(
    static: StaticBundle,
    delegate: str,
    out_dir: Path,
    progress: Progress,
    only: tuple[str, ...] | None = None,
) -> Lowered:
    """Convert every method of `static` (or those in `only`: tests) into one multifunction
    `model.mlpackage` in `out_dir`; see the module docstring for what it computes."""
    compute_units = delegate_compute_units(delegate)
    _register_converters()

    out_dir = Path(out_dir)
    package = out_dir / PACKAGE
    signatures = method_io(static)
    models: dict[str, Any] = {}
    with coreml_forms(static) as n_int4:
        for name, (module, inputs) in coreml_methods(static).items():
            if only is not None and name not in only:
                continue
            t0 = time.perf_counter()
            models[name] = convert_function(name, module, inputs, static)
            progress(f"convert {name} ({time.perf_counter() - t0:.1f} s)")
    t0 = time.perf_counter()
    save_multifunction(models, package)
    canonicalize(package)
    progress(f"save {PACKAGE} ({time.perf_counter() - t0:.1f} s)")
    report = validate_mlpackage(package)
    files = sorted(str(p.relative_to(out_dir)) for p in package.rglob("*") if p.is_file())
    return Lowered(
        files=files,
        program=PACKAGE,
        numerics=numerics(static, n_int4),
        details={
            "compute_units": compute_units,  # ct.ComputeUnit, set by the runtime at load
            "int4_linears": n_int4,
            "package": report,
            "unverified_here": (
                "Core ML predict needs macOS 15+: one MLState serving every function (the "
                "drafter reading the target's cache), compute-unit placement and internal "
                "accumulation precision are unchecked on this host"
            ),
        },
        method_io={name: signatures[name] for name in models},
    )


# --- reading a package back (Linux can read everything; it cannot run it) ----------------------


def _weights_dir(package: Path) -> Path:
    return Path(package) / "Data" / "com.apple.CoreML" / "weights"


def _name(op: Any) -> str:
    return op.outputs[0].name if op.outputs else ""


def _strip(name: str) -> str:
    """A weight's name without the suffixes coremltools' fp16 pass appends."""
    return name.removesuffix("_cast_fp16").removesuffix("_to_fp16")


def _functions(spec: Any) -> dict[str, Any]:
    """Function name -> its operations (proto), in declaration order."""
    out = {}
    for fd in spec.description.functions:
        fn = spec.mlProgram.functions[fd.name]
        out[fd.name] = fn.block_specializations[fn.opset].operations
    return out


def _read_blob(reader: Any, value: Any) -> np.ndarray:
    """One tensor stored in weight.bin, in its stored dtype (int4/uint4 as int8/uint8)."""
    t = value.type.tensorType
    shape = [d.constant.size for d in t.dimensions]
    offset = value.blobFileValue.offset
    read = {
        10: lambda: reader.read_fp16_data(offset).view(np.float16),
        11: lambda: reader.read_float_data(offset),
        25: lambda: reader.read_int4_data(offset).astype(np.int8),
        35: lambda: reader.read_uint4_data(offset).astype(np.uint8),
    }[t.dataType]
    return np.asarray(read()).reshape(shape)


def package_weights(package: Path) -> dict[str, dict[str, np.ndarray | None]]:
    """The linear weights stored in the package's weight.bin, by module path with underscores
    (`target_layers_0_self_attn_q_proj`): int4 ones as {"data": codes (int8 for int4, uint8 for
    uint4), "scale": fp16, "offset": uint8 or None}, fp16 ones as {"value": fp16}. Read from
    the serialized program and blob file, whatever function holds them (each blob is shared)."""
    import coremltools as ct
    from coremltools.libmilstoragepython import _BlobStorageReader

    spec = ct.utils.load_spec(str(package))
    reader = _BlobStorageReader(str(_weights_dir(package) / "weight.bin"))
    out: dict[str, dict[str, np.ndarray | None]] = {}
    for ops in _functions(spec).values():
        for op in ops:
            name = _strip(_name(op))
            if op.type == INT4_OP:
                args = {k: v.arguments[0].value for k, v in op.inputs.items()}
                out[name.removesuffix("_int4")] = {
                    "data": _read_blob(reader, args["data"]),
                    "scale": _read_blob(reader, args["scale"]),
                    "offset": _read_blob(reader, args["offset"]) if "offset" in args else None,
                }
            elif op.type == "const" and name.startswith("owner_") and name.endswith("_weight"):
                value = op.attributes["val"]
                if value.HasField("blobFileValue"):
                    key = name.removeprefix("owner_").removesuffix("_weight")
                    out[key] = {"value": _read_blob(reader, value)}
    return out


def dequantize(entry: dict[str, np.ndarray | None]) -> np.ndarray:
    """scale * (data - offset) per block along the last axis, in float32 (exact: a 4-bit
    integer times an fp16 scale). Core ML materialises this product rounded to fp16."""
    data, scale, offset = entry["data"], entry["scale"], entry["offset"]
    assert data is not None and scale is not None
    q = data.astype(np.float32)
    if offset is not None:
        q = q - np.repeat(offset.astype(np.float32), data.shape[1] // offset.shape[1], axis=1)
    return q * np.repeat(scale.astype(np.float32), data.shape[1] // scale.shape[1], axis=1)


_DTYPES = {1: "bool", 10: "fp16", 11: "fp32", 21: "int8", 22: "int16", 23: "int32", 25: "int4"}
_DTYPES |= {31: "uint8", 32: "uint16", 35: "uint4"}


def validate_mlpackage(package: Path) -> dict[str, Any]:
    """Everything a Linux host can check about a package, as a JSON-ready dict: spec version,
    opset, functions with their inputs/outputs/states (name -> shape, dtype), op counts and
    output dtypes per op type, the stored weight blobs (dtype -> count; total bytes) and
    whether all functions declare the same states. Raises EdgeMTPError if it is not an iOS 18+
    ML program."""
    import coremltools as ct
    from coremltools.proto import FeatureTypes_pb2

    spec = ct.utils.load_spec(str(package))
    if spec.specificationVersion < SPEC_VERSION_IOS18 or not spec.HasField("mlProgram"):
        raise EdgeMTPError(f"{package} is not an iOS 18 ML program; re-export it")
    array = FeatureTypes_pb2.ArrayFeatureType.ArrayDataType

    def desc(features: Any) -> dict[str, Any]:
        out = {}
        for f in features:
            t = (
                f.type.stateType.arrayType
                if f.type.HasField("stateType")
                else f.type.multiArrayType
            )
            out[f.name] = {"shape": list(t.shape), "dtype": array.Name(t.dataType).lower()}
        return out

    functions: dict[str, Any] = {}
    blobs: dict[int, str] = {}
    descriptions = {fd.name: fd for fd in spec.description.functions}
    for name, ops in _functions(spec).items():
        dtypes: dict[str, set[str]] = {}
        for op in ops:
            values = [op.attributes["val"]] if op.type == "const" else []
            values += [a.value for arg in op.inputs.values() for a in arg.arguments]
            for v in values:
                if v.HasField("blobFileValue"):
                    dtype = v.type.tensorType.dataType
                    blobs[v.blobFileValue.offset] = _DTYPES.get(dtype, str(dtype))
            if op.type != "const" and op.outputs and op.outputs[0].type.HasField("tensorType"):
                dtype = op.outputs[0].type.tensorType.dataType
                dtypes.setdefault(op.type, set()).add(_DTYPES.get(dtype, str(dtype)))
        fd = descriptions[name]
        functions[name] = {
            "inputs": desc(fd.input),
            "outputs": desc(fd.output),
            "states": desc(fd.state),
            "ops": dict(sorted(Counter(op.type for op in ops).items())),
            "dtypes": {k: sorted(v) for k, v in sorted(dtypes.items())},
        }
    states = {json.dumps(f["states"], sort_keys=True) for f in functions.values()}
    weight_bin = _weights_dir(package) / "weight.bin"
    return {
        "specification_version": spec.specificationVersion,
        "opset": sorted({fn.opset for fn in spec.mlProgram.functions.values()}),
        "default_function": spec.description.defaultFunctionName,
        "functions": functions,
        "shared_states": len(states) == 1,
        "weight_blobs": dict(sorted(Counter(blobs.values()).items())),
        "weight_bytes": weight_bin.stat().st_size,
    }


def numerics(static: StaticBundle, n_int4: int) -> dict[str, str]:
    """What the converted program computes (see the module docstring)."""
    models = [static.target.target] + ([static.drafter.drafter] if static.drafter else [])
    forms = sorted(
        {f"{w.scheme} group {w.group}" for m in models for x in m.modules() if (w := int4_of(x))}
    )
    weights = "fp16 (rounded from the checkpoint's floats)"
    if n_int4:
        weights = (
            f"{n_int4} linears int4 per block ({', '.join(forms)}) with the checkpoint's codes and "
            "scales as stored (constexpr_blockwise_shift_scale; symmetric: int4, else uint4 with "
            "uint4 offsets; scales fp16, exact: Q4_0's are fp16 by definition and a scale fp16 "
            "cannot hold is refused), dequantized to fp16 (scale * (code - offset), rounded "
            "once); other weights fp16"
        )
    return {
        "weights": weights,
        "activations": "fp16 (fp32 inputs cast to fp16 at entry; float outputs are fp16)",
        "accumulation": "fp16 ops; accumulation inside matmuls/reductions is the compute unit's",
        "cache": "K/V fp16 Core ML states; slot positions int32, host-owned",
        "rope": "angles and sin/cos fp32, then cast to fp16",
        "norm": "RMSNorm in fp16 on x / max|x| (overflow-safe), same function",
    }


# --- runners ----------------------------------------------------------------------------------


class _HostPositions:
    """The package's calling protocol: logical inputs first, then the slot positions, which
    the runner owns (int32, -1 = empty) and replaces with each function's `new_pos_*`."""

    shapes: StaticShapes
    io: dict[str, dict[str, list[str]]]
    slot_pos: dict[str, np.ndarray]

    def _run(self, method: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def call(self, method: str, *inputs: Tensor) -> tuple[Tensor, ...]:
        names = self.io[method]
        feeds = {n: x.numpy() for n, x in zip(names["inputs"], inputs, strict=False)}
        for n, x in feeds.items():
            feeds[n] = x.astype(np.float32 if x.dtype.kind == "f" else np.int32)
        feeds.update({f"pos_{k}": p for k, p in self.slot_pos.items()})
        out = self._run(method, feeds)
        for kind in self.slot_pos:
            if f"new_pos_{kind}" in out:
                self.slot_pos[kind] = np.asarray(out[f"new_pos_{kind}"], dtype=np.int32)
        logical = [n for n in names["outputs"] if not n.startswith("new_pos_")]
        return tuple(_torch(out[n]) for n in logical)


def _torch(x: np.ndarray) -> Tensor:
    x = np.asarray(x)
    return torch.from_numpy(x.astype(np.float32 if x.dtype.kind == "f" else np.int64))


def function_io(package: Path) -> dict[str, dict[str, list[str]]]:
    """Input and output names per function, in declaration order, from the package itself."""
    import coremltools as ct

    spec = ct.utils.load_spec(str(package))
    return {
        f.name: {"inputs": [i.name for i in f.input], "outputs": [o.name for o in f.output]}
        for f in spec.description.functions
    }


class CoreMLRunner(_HostPositions):
    """Runs a package's functions with Core ML (macOS 15+), all on one `MLState`."""

    def __init__(self, package: Path, shapes: StaticShapes, compute_units: str = "CPU_AND_GPU"):
        require_macos15()
        import coremltools as ct

        package = Path(package)
        self.shapes = shapes
        self.io = function_io(package)
        report = validate_mlpackage(package)["functions"]
        first = next(iter(self.io))
        inputs = report[first]["inputs"]
        self.slot_pos = {
            n.removeprefix("pos_"): np.full(inputs[n]["shape"], -1, np.int32)
            for n in inputs
            if n.startswith("pos_")
        }
        units = ct.ComputeUnit[compute_units]
        self.methods = {
            name: ct.models.MLModel(str(package), function_name=name, compute_units=units)
            for name in self.io
        }
        # One state for every function: the drafter reads the cache the target writes.
        self.state = self.methods[first].make_state()
        # Masked slots must hold finite values (0 * NaN would poison the attention sums).
        for name, state in report[first]["states"].items():
            self.state.write_state(name, np.zeros(state["shape"], np.float16))

    def _run(self, method: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.methods[method].predict(feeds, state=self.state)


def require_macos15() -> None:
    """Core ML `predict` with states and multifunction packages needs macOS 15+."""
    from edgemtp.devices.capabilities import macos_missing

    missing = macos_missing(platform.system(), platform.mac_ver()[0])
    if missing:
        raise EdgeMTPError(f"{missing}: run it on a Mac, or export --backend executorch/onnx")


class TorchCoreMLRunner(_HostPositions):
    """The Core ML forms run eagerly in torch behind the package's calling protocol: the
    numerical check a host without Core ML can do.

    In fp16 (default) it computes what the program computes, up to the compute unit's
    internal accumulation order and precision. In fp32 the same graph must equal the eager
    reference (it proves the forms: int4 op, cache writes, host-owned positions, drafter step).
    With `package`, the linears take the weights read back from it: int4 codes, offsets and
    scales in any dtype (the values are exact), fp16 weights in fp16 only (in fp32 they would
    no longer be the reference's). Use as a context manager: it holds the bundle's models in
    their Core ML forms until closed."""

    def __init__(
        self, static: StaticBundle, package: Path | None = None, dtype: torch.dtype = torch.float16
    ):
        self.shapes = static.shapes
        self.io = method_io(static)
        self.dtype = dtype
        self.slot_pos = {k: np.full(n + 1, -1, np.int32) for k, n in static.cache.slots.items()}
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(coreml_forms(static, dtype))
        self.methods = {n: m for n, (m, _) in coreml_methods(static).items()}
        self.loaded = 0
        if package is not None:
            self.loaded = self._load(static, package_weights(package))

    def reset(self) -> None:
        """Empty the cache (host-owned positions; the K/V values are then never read)."""
        self.slot_pos = {k: np.full_like(p, -1) for k, p in self.slot_pos.items()}

    def _load(self, static: StaticBundle, stored: dict[str, dict[str, Any]]) -> int:
        """Replace the linears' weights by the package's; returns how many were replaced."""
        models = {"target": static.target.target}
        if static.drafter is not None:
            models["drafter"] = static.drafter.drafter
        count = 0
        for prefix, model in models.items():
            for path, module in model.named_modules():
                entry = stored.get(f"{prefix}_{path}".replace(".", "_"))
                if entry is None:
                    continue
                if isinstance(module, Int4Linear) and "data" in entry:
                    data = torch.from_numpy(entry["data"].astype(np.int16))
                    offset = entry["offset"]
                    if offset is None:  # signed codes: the unsigned code is data + 8
                        module.int4_codes = (data + 8).to(torch.uint8)
                        module.int4_zeros = torch.full_like(module.int4_zeros, 8)
                    else:
                        module.int4_codes = data.to(torch.uint8)
                        module.int4_zeros = torch.from_numpy(offset.astype(np.uint8))
                    scales = torch.from_numpy(entry["scale"].astype(np.float16))
                    module.int4_scales = scales.to(self.dtype)
                    count += 1
                elif isinstance(module, nn.Linear) and "value" in entry:
                    if self.dtype == torch.float16:
                        module.weight.data = torch.from_numpy(entry["value"].astype(np.float16))
                        count += 1
        return count

    def _run(self, method: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = self.io[method]
        args = [torch.from_numpy(feeds[n]) for n in names["inputs"]]
        args = [a if a.dtype.is_floating_point else a.long() for a in args]
        with torch.no_grad():
            out = self.methods[method](*args)
        return {n: o.numpy() for n, o in zip(names["outputs"], out, strict=True)}

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> TorchCoreMLRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
