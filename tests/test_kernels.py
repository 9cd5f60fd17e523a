"""edgemtp's ExecuTorch kernels (runtime/kernels), run by ExecuTorch's Python runtime:
`edgemtp::cache_attention` against attention written in numpy over only the keys each row may
see, `edgemtp::q4_0_linear` (and `q4_0_gated_linear`, its input gelu_tanh(gate) * up) against
llama.cpp's Q8_0 x Q4_0 product written in numpy over the GGML bytes `gguf` quantizes, and
`edgemtp::rms_norm` / `add_rms_norm` against Gemma's RMSNorm (and the residual add) in float64."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from oracle_int8 import numpy_int8_rows, numpy_read_int8_rows
from torch import nn

from edgemtp import native
from edgemtp.errors import EdgeMTPError
from edgemtp.export.executorch_program import (
    backend_config,
    export_method,
    lower_programs,
    xnnpack_partitioner,
)
from edgemtp.export.primitives import BLOCKED
from edgemtp.model.primitives import REFERENCE
from edgemtp.quantize.q4_0 import BLOCK, nibbles_q4_0, unpack_q4_0
from edgemtp.runtime import kernels
from edgemtp.runtime.kernels.ops import (
    add_rms_norm,
    cache_attention,
    q4_0_gated_linear,
    q4_0_linear,
    rms_norm,
)


@dataclass
class Case:
    """One call: kv heads, query heads per kv head, mask rows, head dim, cache slots, keys the
    mask covers (cache slots read + new), new keys (0: none), a sliding window or None."""

    kv_heads: int
    group: int
    rows: int
    dim: int
    slots: int
    cached: int  # cache slots the mask covers (a context bucket's, or all)
    fresh: int
    window: int | None
    seed: int
    half: bool = False  # a float16 cache
    int8: bool = False  # an int8 cache: each row's codes, then its float32 scale

    def inputs(self) -> tuple[tuple[torch.Tensor | None, ...], np.ndarray]:
        """(op inputs, allowed [rows, keys]). Empty slots, and slots past the mask's width,
        hold NaN: a kernel that read them would return NaN."""
        gen = torch.Generator().manual_seed(self.seed)
        h, d = self.kv_heads, self.dim
        q = torch.randn(h, self.group * self.rows, d, generator=gen)
        k = torch.randn(h, self.slots, d, generator=gen)
        v = torch.randn(h, self.slots, d, generator=gen)
        # a ring that wrapped: slot s holds position p with p % cached == s, some slots empty
        end = self.cached + self.cached // 2 if self.window else self.cached // 2
        slot_pos = torch.full((self.cached,), -1)
        for p in range(end):
            slot_pos[p % self.cached] = p
        row_pos = torch.arange(end, end + self.rows)
        new_pos = row_pos[-self.fresh :] if self.fresh else torch.zeros(0, dtype=torch.long)
        keys = torch.cat([slot_pos, new_pos])
        allowed = (keys[None, :] >= 0) & (keys[None, :] <= row_pos[:, None])
        if self.window is not None:
            allowed &= row_pos[:, None] - keys[None, :] < self.window
        empty = slot_pos < 0
        k[:, : self.cached][:, empty] = float("nan")
        v[:, : self.cached][:, empty] = float("nan")
        k[:, self.cached :] = float("nan")
        v[:, self.cached :] = float("nan")
        k_new = torch.randn(h, self.fresh, d, generator=gen) if self.fresh else None
        v_new = torch.randn(h, self.fresh, d, generator=gen) if self.fresh else None
        if self.half:
            k, v = k.half(), v.half()
        if self.int8:  # an empty slot's scale is NaN: a kernel that read it returns NaN
            k, v = (torch.from_numpy(numpy_int8_rows(np.nan_to_num(t.numpy()))) for t in (k, v))
            unread = torch.ones(self.slots, dtype=torch.bool)
            unread[: self.cached] = empty
            nan = torch.tensor([float("nan")]).view(torch.int8)
            k[:, unread, d:], v[:, unread, d:] = nan, nan
        mask = torch.where(allowed, 0.0, BLOCKED)
        return (q, k, v, k_new, v_new, mask), allowed.numpy()


def numpy_attention(inputs: tuple[torch.Tensor | None, ...], allowed: np.ndarray) -> np.ndarray:
    """With a float16 or int8 cache the call's own keys count as stored too (as they will be:
    float16, or numpy's int8 rounding)."""
    stored = inputs[1].dtype
    int8 = stored == torch.int8

    def cached(t: torch.Tensor) -> np.ndarray:
        return (numpy_read_int8_rows(t.numpy()) if int8 else t.numpy()).astype(np.float64)

    def own(t: torch.Tensor | None) -> np.ndarray | None:  # as the cache will store it
        if t is None:
            return None
        return cached(torch.from_numpy(numpy_int8_rows(t.numpy())) if int8 else t.to(stored))

    q, k, v, k_new, v_new, _ = inputs
    q, k, v, k_new, v_new = q.double().numpy(), cached(k), cached(v), own(k_new), own(v_new)
    rows, keys = allowed.shape
    fresh = 0 if k_new is None else k_new.shape[1]
    out = np.zeros_like(q)
    for h in range(q.shape[0]):
        all_k, all_v = k[h, : keys - fresh], v[h, : keys - fresh]
        if fresh:
            all_k, all_v = np.concatenate([all_k, k_new[h]]), np.concatenate([all_v, v_new[h]])
        for r in range(q.shape[1]):
            seen = allowed[r % rows]
            scores = all_k[seen] @ q[h, r]
            p = np.exp(scores - scores.max())
            out[h, r] = (p / p.sum()) @ all_v[seen]
    return out


CASES = {
    # PEER-90M's full layers: one decode row of 4 heads x 256 over a 512 bucket of a longer cache
    "decode_bucket": Case(1, 4, 1, 256, 600, 512, 1, None, 0),
    # a verify of 4 rows, two KV heads, a head dim that is not a multiple of the vector width
    "verify_window": Case(2, 2, 4, 24, 96, 96, 4, 40, 1),
    # the drafter: no keys of its own, 3 query heads per KV head
    "draft": Case(1, 3, 1, 16, 64, 64, 0, None, 2),
    # more keys than one chunk of the kernel (128) in a wrapped ring, 9 query rows (4, 4, 1)
    "long_ring": Case(1, 3, 3, 32, 700, 700, 3, 300, 3),
    # float16 caches: a verify over a bucket, and the drafter with a head dim off the vector width
    "verify_half": Case(1, 4, 4, 256, 300, 260, 4, None, 4, half=True),
    "draft_half": Case(2, 2, 1, 40, 200, 200, 0, 64, 5, half=True),
    # int8 caches: a decode over a bucket, a verify in a wrapped ring past a chunk, the drafter
    # with a head dim off every vector width
    "decode_int8": Case(1, 4, 1, 256, 600, 512, 1, None, 6, int8=True),
    "verify_int8": Case(2, 2, 4, 32, 300, 300, 4, 140, 7, int8=True),
    "draft_int8": Case(2, 2, 1, 44, 200, 200, 0, 64, 8, int8=True),
}


@dataclass
class LinearCase:
    """One `q4_0_linear` call: rows of x, in and out features."""

    rows: int
    n_in: int
    n_out: int
    seed: int

    def ggml(self) -> tuple[torch.Tensor, np.ndarray]:
        """(x, the weight as GGML Q4_0 bytes [out, in / 32 * 18], quantized by `gguf`). One
        block of weights is all zeros (scale 0) and one block of x too (d = 0)."""
        import gguf

        gen = torch.Generator().manual_seed(self.seed)
        w = torch.randn(self.n_out, self.n_in, generator=gen) * 0.05
        w[0, :BLOCK] = 0
        x = torch.randn(self.rows, self.n_in, generator=gen) * 3
        x[-1, -BLOCK:] = 0
        return x, gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_0)

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, raw = self.ggml()
        q = unpack_q4_0(raw, (self.n_out, self.n_in))
        return x, nibbles_q4_0(q), q.scales


def numpy_q4_0_linear(x: np.ndarray, raw: np.ndarray) -> np.ndarray:
    """llama.cpp's product in float64 over GGML's bytes: x rounded to Q8_0 per block of 32
    (d = max|x| / 127 and q = rint(x * (1 / d)) in float32), the weight (nibble - 8) * d."""
    blocks = raw.reshape(raw.shape[0], -1, 18)
    d = blocks[..., :2].copy().view("<f2")[..., 0].astype(np.float64)
    qs = blocks[..., 2:]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float64) - 8
    w = (codes * d[..., None]).reshape(raw.shape[0], -1)
    xb = x.reshape(x.shape[0], -1, BLOCK).astype(np.float32)
    dx = np.abs(xb).max(-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(dx == 0, np.float32(0), np.float32(1) / dx).astype(np.float32)
    xq = (np.rint(xb * inv).astype(np.float64) * dx).reshape(x.shape)
    return xq @ w.T


@dataclass
class GatedCase(LinearCase):
    """One `q4_0_gated_linear` call: the input is gelu_tanh(gate) * up."""

    def inputs(self) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        gate, nibbles, scales = super().inputs()
        up = torch.randn(gate.shape, generator=torch.Generator().manual_seed(self.seed + 100))
        return gate, up, nibbles, scales

    def want(self) -> np.ndarray:
        """The oracle: gelu_tanh in numpy (float64, as 0.5 g (1 + tanh(...))), times up, then
        `numpy_q4_0_linear`."""
        gate, up, _, _ = (t.numpy() for t in self.inputs())
        g = gate.astype(np.float64)
        gelu = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)))
        return numpy_q4_0_linear((gelu * up).astype(np.float32), self.ggml()[1])


GATED_CASES = {
    # the MLP's down projection of a decode row, gates far into both tails of GELU
    "gated_down": GatedCase(1, 2048, 48, 14),
    # the per-layer input's projection of a verify (64 wide), a partial quad
    "gated_ple": GatedCase(4, 64, 40, 15),
}

LINEAR_CASES = {
    # a decode row through PEER-90M's fused Q/K/V shape, fewer outputs
    "linear_decode": LinearCase(1, 512, 96, 10),
    # a verify of 4 rows and 3 more: blocks not a multiple of 4 (a last, partial quad)
    "linear_verify": LinearCase(7, 160, 33, 11),
    # 2 blocks per row (the per-layer input's 64), 12 rows, outputs off every tile
    "linear_narrow": LinearCase(12, 64, 50, 12),
    # the MLP's down projection: 64 blocks per row, 2 rows
    "linear_long": LinearCase(2, 2048, 40, 13),
    # enough weight (86 KB) for the kernel to split its outputs over the thread pool
    "linear_wide": LinearCase(3, 512, 300, 16),
}


class Op(nn.Module):
    def __init__(self, rows: bool = False):
        super().__init__()
        self.op = (
            torch.ops.edgemtp.cache_attention_rows if rows else torch.ops.edgemtp.cache_attention
        )

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.op(*inputs)


class OpDrafter(Op):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor):
        return self.op(q, k, v, None, None, mask)


class LinearOp(nn.Module):
    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return torch.ops.edgemtp.q4_0_linear(*inputs)


class GatedOp(nn.Module):
    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return torch.ops.edgemtp.q4_0_gated_linear(*inputs)


def _program(cases: dict[str, Case], linears: dict[str, LinearCase] | None = None) -> bytes:
    programs = {}
    for name, case in cases.items():
        inputs, _ = case.inputs()
        args = tuple(t for t in inputs if t is not None)
        for rows in (False, True):  # cache_attention, cache_attention_rows
            module = Op(rows) if case.fresh else OpDrafter(rows)
            programs[name + ("_rows" if rows else "")] = export_method(module, args)
    for name, linear in (linears or {}).items():
        module = GatedOp() if isinstance(linear, GatedCase) else LinearOp()
        programs[name] = export_method(module, linear.inputs())
    manager = lower_programs(programs, lambda: [xnnpack_partitioner()])
    return manager.to_executorch(backend_config()).buffer


@pytest.fixture(scope="module")
def program() -> bytes:
    return _program(CASES, {**LINEAR_CASES, **GATED_CASES})


def test_kernel_matches_numpy_and_reads_only_attended_slots(program):
    from executorch.extension.pybindings import portable_lib

    kernels.load()
    loaded = portable_lib._load_for_executorch_from_buffer(program)
    for name, case in CASES.items():
        inputs, allowed = case.inputs()
        got = loaded.run_method(name, tuple(t for t in inputs if t is not None))[0].numpy()
        assert np.isfinite(got).all(), f"{name}: read a slot the mask blocks or does not cover"
        want = numpy_attention(inputs, allowed)
        np.testing.assert_allclose(got, want, atol=2e-5, err_msg=name)
        # the same written as [rows, heads * head_dim]: head kv * group + g of row t is query
        # row g * rows + t of KV head kv
        rows = loaded.run_method(f"{name}_rows", tuple(t for t in inputs if t is not None))[0]
        by_row = want.reshape(-1, case.rows, case.dim).transpose(1, 0, 2).reshape(case.rows, -1)
        np.testing.assert_allclose(rows.numpy(), by_row, atol=2e-5, err_msg=f"{name}_rows")


def test_q4_0_kernel_matches_llama_cpp_numerics_in_numpy(program):
    from executorch.extension.pybindings import portable_lib

    kernels.load()
    loaded = portable_lib._load_for_executorch_from_buffer(program)
    for name, case in LINEAR_CASES.items():
        x, raw = case.ggml()
        want = numpy_q4_0_linear(x.numpy(), raw)
        got = loaded.run_method(name, case.inputs())[0].numpy()
        # integer block sums: only the float32 sums of the blocks' products differ
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)
        eager = q4_0_linear(*case.inputs()).numpy()  # what the reference engine runs
        np.testing.assert_allclose(eager, want, rtol=1e-5, atol=1e-5, err_msg=name)


def test_gated_q4_0_kernel_matches_numpy(program):
    """The gate formed in the kernel (its own exp, vectorized) as numpy's float64 GELU: the
    same Q8_0 codes, so the same sums, but where a float32 rounding moves a value across a
    half code step (none in these cases: the bound is the one-ulp one)."""
    from executorch.extension.pybindings import portable_lib

    kernels.load()
    loaded = portable_lib._load_for_executorch_from_buffer(program)
    for name, case in GATED_CASES.items():
        want = case.want()
        got = loaded.run_method(name, case.inputs())[0].numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)
        eager = q4_0_gated_linear(*case.inputs()).numpy()
        np.testing.assert_allclose(eager, want, rtol=1e-5, atol=1e-5, err_msg=name)


def test_eager_op_matches_numpy():
    """The torch op export traces and the reference engine runs: the same function."""
    for name, case in CASES.items():
        inputs, allowed = case.inputs()
        q, k, v, k_new, v_new, mask = inputs
        # eager reads every slot up to the mask's width: give empty ones finite values
        k, v = torch.nan_to_num(k, nan=3.0), torch.nan_to_num(v, nan=-3.0)  # (keeps the dtype)
        if case.int8:  # empty slots: their NaN scales
            k, v = (
                torch.from_numpy(numpy_int8_rows(np.nan_to_num(numpy_read_int8_rows(t.numpy()))))
                for t in (k, v)
            )
        clean = (q, k, v, k_new, v_new, mask)
        got = torch.ops.edgemtp.cache_attention(*clean).numpy()
        # float32 torch ops, whose sums run in the order this CPU's kernels pick: scores of
        # ~50 at a head dim of 256 (scale 1.0) carry a few 1e-6, outputs up to ~2e-5 off
        np.testing.assert_allclose(got, numpy_attention(clean, allowed), atol=4e-5, err_msg=name)
        assert torch.equal(torch.ops.edgemtp.cache_attention(*clean), cache_attention(*clean))


class QuantizeRowsOp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.edgemtp.quantize_kv_rows(x)


def test_quantize_kv_rows_kernel_equals_numpy():
    """An int8 cache's rows as the kernel writes them: codes and scale bytes equal numpy's
    (an all-zero row, exact halves that round to even, a head dim off the vector widths)."""
    from executorch.extension.pybindings import portable_lib

    gen = torch.Generator().manual_seed(20)
    x = torch.randn(2, 5, 44, generator=gen) * 4
    x[0, 1] = 0
    x[1, 2] = torch.arange(44) - 21.5  # scale 21.5 / 127: every code a tie or near one
    x[1, 3, :2] = torch.tensor([127.0, 0.5])  # scale 1.0: 0.5 rounds to 0 (even)
    kernels.load()
    manager = lower_programs(
        {"quantize": export_method(QuantizeRowsOp(), (x,))}, lambda: [xnnpack_partitioner()]
    )
    loaded = portable_lib._load_for_executorch_from_buffer(
        manager.to_executorch(backend_config()).buffer
    )
    got = loaded.run_method("quantize", (x,))[0].numpy()
    want = numpy_int8_rows(x.numpy())
    np.testing.assert_array_equal(got, want)
    assert want[1, 3, 1] == 0 and want[1, 3, 0] == 127
    np.testing.assert_array_equal(torch.ops.edgemtp.quantize_kv_rows(x).numpy(), want)


class SlotBookkeepingOp(nn.Module):
    def __init__(self, slots: int):
        super().__init__()
        self.slots = slots

    def forward(self, kept: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        view = torch.ops.edgemtp.truncate_positions(kept, positions.min())
        return torch.ops.edgemtp.ring_positions(view, positions, self.slots)


def python_slot_bookkeeping(kept: list[int], positions: list[int], slots: int) -> list[int]:
    """The oracle, slot by slot: a slot at or past the first row's position reads as empty;
    then each row is written to slot position % slots (pads, after the last row's position,
    to the trash slot `slots`), the newest write kept."""
    first = min(positions)
    out = [-1 if p >= first else p for p in kept]
    for p in sorted(positions):
        if p <= positions[-1] and p % slots < len(out):
            out[p % slots] = p
    return out


BOOKKEEPING_CASES = {  # (slots, kept, positions)
    # a verify of 3 rows after 2 pads, in a ring of 8 that wrapped, a rejected draft at 19
    "wrapped": (8, [8, 9, 10, 11, 12, 13, 14, 19, -1], [21, 21, 18, 19, 20]),
    # the first rows of a ring: slots past the last position (a negative remainder in C++)
    "start": (8, [-1] * 9, [0, 1, 2]),
    # a context bucket: only the bucket's first 4 slots of a ring of 8 are kept
    "bucket": (8, [0, 1, 2, -1], [3]),
}


@pytest.mark.parametrize("case", BOOKKEEPING_CASES)
def test_slot_bookkeeping_kernels_match_python(case):
    """`edgemtp::truncate_positions` then `edgemtp::ring_positions` (what kernel bundles'
    calls run over a bucket's slots) against the slot-by-slot oracle and the standard ops."""
    from executorch.extension.pybindings import portable_lib

    slots, kept, positions = BOOKKEEPING_CASES[case]
    want = python_slot_bookkeeping(kept, positions, slots)
    inputs = (torch.tensor(kept), torch.tensor(positions))
    kernels.load()
    manager = lower_programs(
        {"book": export_method(SlotBookkeepingOp(slots), inputs)}, lambda: [xnnpack_partitioner()]
    )
    loaded = portable_lib._load_for_executorch_from_buffer(
        manager.to_executorch(backend_config()).buffer
    )
    assert loaded.run_method("book", inputs)[0].tolist() == want
    standard = REFERENCE.ring_positions(
        REFERENCE.truncated(inputs[0], inputs[1].min()), inputs[1], slots
    )
    assert standard.tolist() == want


class NormOp(nn.Module):
    def __init__(self, weighted: bool, eps: float):
        super().__init__()
        self.weighted, self.eps = weighted, eps

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.edgemtp.rms_norm(x, weight if self.weighted else None, self.eps)


class AddNormOp(nn.Module):
    def __init__(self, scaled: bool, eps: float):
        super().__init__()
        self.scaled, self.eps = scaled, eps

    def forward(self, h, y, weight, scale):  # type: ignore[no-untyped-def]
        return torch.ops.edgemtp.add_rms_norm(
            h, y, weight, scale if self.scaled else None, self.eps
        )


class HeadsOp(nn.Module):
    def __init__(self, first: int, heads: int, kv_heads: int, dim: int, weighted: bool, rope: bool):
        super().__init__()
        self.args = (first, heads, kv_heads, dim)
        self.weighted, self.rope = weighted, rope

    def forward(self, x, weight, cos, sin):  # type: ignore[no-untyped-def]
        w = weight if self.weighted else None
        cs = (cos, sin) if self.rope else (None, None)
        return torch.ops.edgemtp.head_norm_rope(x, *self.args, w, *cs, 1e-6)


def numpy_heads(x, first, heads, kv_heads, dim, weight, cos, sin):  # type: ignore[no-untyped-def]
    """Heads [first, first + heads) of each row normed, rotated (rotate-half RoPE), as
    [kv_heads, heads / kv_heads * rows, dim]: head h of row t at h * rows + t."""
    rows = x.shape[0]
    y = x[:, first * dim : (first + heads) * dim].reshape(rows, heads, dim)
    y = numpy_rms_norm(y, weight, 1e-6)
    if cos is not None:
        half = dim // 2
        rotated = np.concatenate([-y[..., half:], y[..., :half]], axis=-1)
        y = y * cos.astype(np.float64) + rotated * sin.astype(np.float64)
    return y.transpose(1, 0, 2).reshape(kv_heads, heads // kv_heads * rows, dim)


# (rows, heads in the product, first head, heads, kv heads, head dim, weighted, rotated):
# queries of a fused Q/K/V product (4 heads over 2 KV heads), its keys, its values (no weight,
# no RoPE), a KV-shared layer's own queries
HEAD_CASES = {
    "queries": (3, 8, 0, 4, 2, 64, True, True),
    "keys": (3, 8, 4, 2, 2, 64, True, True),
    "values": (1, 8, 6, 2, 2, 64, False, False),
    "shared_queries": (2, 4, 0, 4, 1, 256, True, True),
}


def assert_programs_match(programs: dict, calls: dict, tolerance: float) -> None:
    """Lower `programs` into one ExecuTorch program; each method's output, and the eager op's
    (what the reference engine runs, in torch's own reduction order), must match numpy's."""
    from executorch.extension.pybindings import portable_lib

    manager = lower_programs(programs, lambda: [xnnpack_partitioner()])
    kernels.load()
    program = manager.to_executorch(backend_config()).buffer  # (the module only borrows it)
    loaded = portable_lib._load_for_executorch_from_buffer(program)
    for name, (inputs, want, eager) in calls.items():
        got = loaded.run_method(name, inputs)[0].numpy()
        assert got.shape == want.shape, name
        for out in (got, eager.numpy()):
            np.testing.assert_allclose(out, want, rtol=tolerance, atol=tolerance, err_msg=name)


def test_head_norm_rope_kernel_matches_numpy():
    gen = torch.Generator().manual_seed(11)
    programs, calls = {}, {}
    for name, (rows, width, first, heads, kvh, dim, weighted, rope) in HEAD_CASES.items():
        x = torch.randn(rows, width * dim, generator=gen) * 2
        weight = torch.rand(dim, generator=gen) + 0.5
        angles = torch.rand(rows, 1, dim // 2, generator=gen) * 6
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        inputs = (x, weight, cos, sin)
        programs[name] = export_method(HeadsOp(first, heads, kvh, dim, weighted, rope), inputs)
        want = numpy_heads(
            x.numpy(), first, heads, kvh, dim, weight.numpy() if weighted else None,
            cos.numpy() if rope else None, sin.numpy(),
        )  # fmt: skip
        eager = torch.ops.edgemtp.head_norm_rope(
            x, first, heads, kvh, dim, weight if weighted else None,
            cos if rope else None, sin if rope else None, 1e-6,
        )  # fmt: skip
        calls[name] = (inputs, want, eager)
    assert_programs_match(programs, calls, 1e-5)


def numpy_rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y if weight is None else y * weight


# (shape, weighted or scaled, eps): decode and verify rows, a head norm's [rows, heads, dim],
# a width that is no multiple of the kernel's 16 partial sums
NORM_CASES = {
    "one_row": ((1, 512), True, 1e-6),
    "verify_rows": ((4, 512), False, 1e-6),
    "heads": ((3, 4, 64), True, 1e-5),
    "odd_width": ((2, 40), False, 1e-6),
}


def test_norm_kernels_match_numpy():
    gen = torch.Generator().manual_seed(7)
    programs, calls = {}, {}
    for name, (shape, flag, eps) in NORM_CASES.items():
        h, y = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen) * 3
        weight = torch.rand(shape[-1], generator=gen) + 0.5
        scale = torch.tensor([0.7])
        norm = (y, weight)
        added = (h, y, weight, scale)
        programs[f"{name}_norm"] = export_method(NormOp(flag, eps), norm)
        programs[f"{name}_add"] = export_method(AddNormOp(flag, eps), added)
        want_norm = numpy_rms_norm(y.numpy(), weight.numpy() if flag else None, eps)
        want_add = h.numpy() + numpy_rms_norm(y.numpy(), weight.numpy(), eps)
        calls[f"{name}_norm"] = (norm, want_norm, rms_norm(y, weight if flag else None, eps))
        calls[f"{name}_add"] = (
            added,
            want_add * 0.7 if flag else want_add,
            add_rms_norm(h, y, weight, scale if flag else None, eps),
        )
    assert_programs_match(programs, calls, 2e-6)


ZEN1 = frozenset("avx avx2 fma f16c bmi1 bmi2 movbe sse4_2".split())  # AVX2, no AVX-512
ICELAKE = ZEN1 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"}


@pytest.mark.skipif(native.machine() != "x86_64", reason="x86 ISA levels")
def test_each_cpu_gets_the_widest_variant_it_runs():
    assert native.chosen_variant(ICELAKE).name == "x86-64-v4-vnni"
    assert native.chosen_variant(ICELAKE - {"avx512_vnni"}).name == "x86-64-v3"  # Skylake-X
    assert native.chosen_variant(ZEN1).name == "x86-64-v3"
    assert native.chosen_variant(ZEN1 - {"avx2"}).name == "x86-64"
    assert native.chosen_variant(frozenset()).name == "x86-64"
    assert native.chosen_variant().requires <= native.cpu_features()


def test_a_variant_can_be_named_but_not_one_this_cpu_lacks(monkeypatch):
    narrowest = native.variants()[-1]
    monkeypatch.setenv(kernels.ISA_VARIABLE, narrowest.name)
    assert kernels.chosen_variant() == narrowest
    monkeypatch.setenv(kernels.ISA_VARIABLE, "x86-64-v9")
    with pytest.raises(EdgeMTPError, match="not one of"):
        kernels.chosen_variant()
    if native.machine() == "x86_64":
        monkeypatch.setenv(kernels.ISA_VARIABLE, "x86-64-v4-vnni")
        monkeypatch.setattr(native, "cpu_features", lambda: ZEN1)
        with pytest.raises(EdgeMTPError, match="this CPU lacks avx512"):
            kernels.chosen_variant()


def test_every_variant_was_built_at_install_from_these_sources():
    for variant in native.variants():
        assert kernels.library_path(variant).is_file()
    assert kernels.load() == kernels.library_path(kernels.chosen_variant())


def test_missing_or_stale_kernels_name_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "FOLDER", tmp_path)
    with pytest.raises(EdgeMTPError, match="missing.*install edgemtp again.*--kernels xnnpack"):
        kernels.library_path()
    (tmp_path / native.KERNELS.file_name(native.chosen_variant())).write_bytes(b"")
    (tmp_path / native.DIGEST).write_text("a digest of other sources\n")
    with pytest.raises(EdgeMTPError, match="changed since they were built.*pip install -e"):
        kernels.library_path()


def test_program_needing_missing_kernels_fails_in_one_line(tmp_path):
    pte = tmp_path / "model.pte"
    pte.write_bytes(_program({"draft": CASES["draft"]}))
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from edgemtp.errors import EdgeMTPError
        from edgemtp.runtime import kernels
        from edgemtp.runtime.runners.executorch import ExecuTorchRunner
        from edgemtp.model.static import StaticShapes
        kernels.FOLDER = Path({str(tmp_path)!r})  # as if installed without them
        try:
            ExecuTorchRunner({str(pte)!r}, StaticShapes(64, 0, 8))
        except EdgeMTPError as e:
            print("ERROR", e)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    line = next(x for x in done.stdout.splitlines() if x.startswith("ERROR"))
    assert "edgemtp::cache_attention.out" in line and "--kernels xnnpack" in line


def test_installed_package_decodes_a_kernel_bundle_without_a_compiler(demo_first_run, tmp_path):
    """No compiler on PATH, no CXX, an empty home (no build cache): the installed libraries
    run the bundle's edgemtp:: kernels."""
    bundle = demo_first_run.bundle
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["backend_details"]["kernels"], "the demo bundle must call edgemtp's kernels"
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "CC")}
    env.update(PATH=str(Path(sys.executable).parent), HOME=str(tmp_path))
    assert shutil.which("g++", path=env["PATH"]) is None
    argv = ["generate", "--bundle", str(bundle), "--prompt", "The capital of France is"]
    argv += ["--max-new-tokens", "8", "--mtp", "2", "--json"]
    edgemtp = Path(sys.executable).with_name("edgemtp")  # the installed command
    done = subprocess.run([str(edgemtp), *argv], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(json.loads(done.stdout)["tokens"]) == 8
    assert not any(tmp_path.iterdir()), "nothing was compiled or cached"


@pytest.mark.parametrize("variant", native.variants(), ids=lambda v: v.name)
def test_each_installed_variant_matches_numpy(program, tmp_path, variant):
    """Every ISA variant built at install that this CPU can run (x86: attention at 16, 8 or 4
    lanes with their half widening and lane sums; the Q4_0 linear's AVX-512, AVX2 and portable
    loops): each in its own process, since a second library registering the same kernel in
    this one would abort."""
    if not variant.requires <= native.cpu_features():
        pytest.skip(f"this CPU lacks {sorted(variant.requires - native.cpu_features())}")
    library = kernels.library_path(variant)
    arch = variant.name
    (tmp_path / "model.pte").write_bytes(program)
    inputs = {n: c.inputs()[0] for n, c in CASES.items()}
    inputs.update({n: c.inputs() for n, c in {**LINEAR_CASES, **GATED_CASES}.items()})
    torch.save(inputs, tmp_path / "inputs.pt")
    script = textwrap.dedent(
        f"""
        import torch
        from pathlib import Path
        from executorch.extension.pybindings import portable_lib
        from edgemtp.runtime import kernels
        kernels.load_library(Path({str(library)!r}))
        loaded = portable_lib._load_for_executorch({str(tmp_path / "model.pte")!r})
        cases = torch.load({str(tmp_path / "inputs.pt")!r})
        out = {{n: loaded.run_method(n, tuple(t for t in x if t is not None))[0]
               for n, x in cases.items()}}
        torch.save(out, {str(tmp_path / "out.pt")!r})
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    outputs = torch.load(tmp_path / "out.pt")
    for name, case in CASES.items():
        inputs, allowed = case.inputs()
        got = outputs[name].numpy()
        assert np.isfinite(got).all(), f"{name} ({arch}): read a slot it must not"
        np.testing.assert_allclose(
            got, numpy_attention(inputs, allowed), atol=2e-5, err_msg=f"{name} ({arch})"
        )
    for name, linear in LINEAR_CASES.items():
        x, raw = linear.ggml()
        np.testing.assert_allclose(
            outputs[name].numpy(),
            numpy_q4_0_linear(x.numpy(), raw),
            rtol=1e-5,
            atol=1e-5,
            err_msg=f"{name} ({arch})",
        )
    for name, gated in GATED_CASES.items():
        np.testing.assert_allclose(
            outputs[name].numpy(), gated.want(), rtol=1e-5, atol=1e-5, err_msg=f"{name} ({arch})"
        )
