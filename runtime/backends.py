"""What the decoding engine runs on: one interface over the reference model and every bundle.

A backend owns the target's KV cache and answers four calls, all at explicit positions:

- `prefill(ids, start)`: write the cache for `ids` at `start`.. and return the last row's
  (hidden, logits);
- `verify(ids, position)`: every row through every layer, cache written; (logits, hidden) per row;
- `draft_step(token, hidden, position)`: one drafter step reading the target's cache in place;
- `draft_chain(token, hidden, position, depth)`: `depth` greedy draft steps in one call (the
  picks and embedding lookups in the program), or None where the backend has no such call;
- `truncate(length)`: forget positions >= length (rejected drafts, or a chat rolled back).

`ReferenceBackend` runs the PyTorch model over `KVCache`; `StaticBackend` runs a bundle's static
methods through a `Runner` (ExecuTorch, ONNX Runtime, Core ML or the eager wrappers), gathering
embedding rows from the bundle's memory-mapped tables on the host. Both meter the time spent per
phase and the bytes the host moves (inputs, outputs and cache rows it copies), so the engine's
trace can show them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from edgemtp.errors import EdgeMTPError
from edgemtp.model.cache import KV_CACHE_DTYPES, KVCache, RingTracker, cache_slots
from edgemtp.model.checkpoint import Drafter, Target
from edgemtp.model.config import TextConfig
from edgemtp.model.forward import forward_rows, prefill, prefill_chunks
from edgemtp.model.static import StaticShapes
from edgemtp.model.tables import TokenTables

PREFILL_CHUNK = 512  # reference prefill rows per forward
DEFAULT_CONTEXT = 4096  # reference cache size when none is given (export's default too)


class _Phase:
    """A `with` block's seconds, added to a meter's phase (a plain class: a decode step enters
    a few of these, and a generator-based context manager costs several times as much)."""

    __slots__ = ("seconds", "name", "start")

    def __init__(self, seconds: dict[str, float], name: str):
        self.seconds, self.name = seconds, name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        elapsed = time.perf_counter() - self.start
        self.seconds[self.name] = self.seconds.get(self.name, 0.0) + elapsed


@dataclass
class Meter:
    """Seconds per phase (embed, target, drafter) and bytes moved by the host, accumulated."""

    seconds: dict[str, float] = field(default_factory=dict)
    bytes_moved: int = 0

    def phase(self, name: str) -> _Phase:
        return _Phase(self.seconds, name)

    def snapshot(self) -> tuple[dict[str, float], int]:
        return dict(self.seconds), self.bytes_moved


def tensor_bytes(*tensors: Tensor | None) -> int:
    return sum(t.nbytes for t in tensors if t is not None)


class Backend(Protocol):
    """The calls the decoding engine makes; see the module docstring."""

    name: str  # "reference", a bundle's backend ("executorch", "onnx", "coreml"), or "static"
    max_context: int
    max_draft: int  # deepest verify round the backend can run
    vocab_size: int
    has_drafter: bool
    meter: Meter

    def prefill(self, ids: list[int], start: int) -> tuple[Tensor, Tensor]: ...

    def verify(self, ids: list[int], position: int) -> tuple[Tensor, Tensor]: ...

    def draft_step(
        self, token: int, hidden: Tensor, position: int
    ) -> tuple[Tensor, Tensor | None, Tensor]: ...

    def draft_chain(
        self, token: int, hidden: Tensor, position: int, depth: int
    ) -> list[int] | None: ...

    def truncate(self, length: int) -> bool: ...

    def verify_shape(self, depth: int) -> str: ...


class ReferenceBackend:
    """The PyTorch model over `KVCache`: pruned chunked prefill, verify, draft."""

    name = "reference"

    def __init__(
        self,
        target: Target,
        drafter: Drafter | None = None,
        *,
        max_context: int | None = None,
        max_draft: int = 4,
        prefill_chunk: int = PREFILL_CHUNK,
        prune: bool = True,
        kv_cache: str | None = None,
    ):
        """The engine computes in the target's form (`Target.use_form`): the reference's
        numerics, or a backend form's. `kv_cache` (`KV_CACHE_DTYPES`): the cache's storage
        dtype, by default the form's."""
        cfg = target.cfg
        self.target, self.drafter = target, drafter
        self.max_context = min(max_context or DEFAULT_CONTEXT, cfg.max_position_embeddings)
        self.max_draft = max_draft if drafter is not None else 0
        self.has_drafter = drafter is not None
        self.vocab_size = cfg.vocab_size
        self.chunk, self.prune = prefill_chunk, prune
        self.form = target.form
        if kv_cache is not None and kv_cache not in KV_CACHE_DTYPES:
            raise EdgeMTPError(
                f"--kv-cache {kv_cache}: unknown (choose {', '.join(KV_CACHE_DTYPES)})"
            )
        dtype = KV_CACHE_DTYPES[kv_cache] if kv_cache else self.form.cache_dtype
        if dtype not in self.form.cache_dtypes:
            raise EdgeMTPError(
                f"--kv-cache {kv_cache}: the {self.form.name} form's attention does not read it"
            )
        self.cache = KVCache(cfg, self.max_context, self.max_draft, dtype)
        self.rings = RingTracker(self.cache.slots, cfg.sliding_window)
        self.meter = Meter()

    def prefill(self, ids: list[int], start: int) -> tuple[Tensor, Tensor]:
        if start != self.cache.length:
            raise ValueError(
                f"cache holds {self.cache.length} positions, prefill starts at {start}"
            )
        hidden, logits = prefill(
            self.target, self.cache, torch.tensor(ids), self.chunk, self.prune,
            self.form.chunk, self.meter,
        )  # fmt: skip
        self.meter.bytes_moved += len(ids) * self.cache.row_bytes()  # the K/V rows written
        self.rings.wrote(start + len(ids))
        return hidden, logits

    def verify(self, ids: list[int], position: int) -> tuple[Tensor, Tensor]:
        ops = self.form.step
        hidden = forward_rows(self.target, self.cache, torch.tensor(ids), "all", ops, self.meter)
        assert hidden is not None
        self.meter.bytes_moved += len(ids) * self.cache.row_bytes()
        self.rings.wrote(position + len(ids))
        with self.meter.phase("target"):
            logits = self.target.model.logits(hidden, ops)
        return logits, hidden

    def draft_step(
        self, token: int, hidden: Tensor, position: int
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        assert self.drafter is not None
        with self.meter.phase("embed"):
            embed = self.target.tables.embed(torch.tensor([token]))[0]
        with self.meter.phase("drafter"):
            return self.drafter.model(embed, hidden, position, self.cache, self.form.step)

    def draft_chain(
        self, token: int, hidden: Tensor, position: int, depth: int
    ) -> list[int] | None:
        assert self.drafter is not None
        with self.meter.phase("drafter"):
            drafted = self.drafter.model.chain(
                self.target.tables.embed, torch.tensor([token]), hidden, torch.tensor(position),
                self.cache, depth, self.form.step,
            )  # fmt: skip
        return drafted.tolist()

    def truncate(self, length: int) -> bool:
        keeps = self.rings.truncated(length)
        self.cache.truncate(length if keeps else 0)
        return keeps

    def verify_shape(self, depth: int) -> str:
        return f"rows_{depth + 1}"


class Runner(Protocol):
    """The static methods of one bundle, however they are executed."""

    shapes: StaticShapes
    methods: Mapping[str, Any]  # by name; which methods the bundle has

    def call(self, method: str, *inputs: Tensor) -> tuple[Tensor, ...]: ...


@dataclass
class _RowInputs:
    """A static method's inputs for one row count, allocated once: a fresh tensor per step
    costs more than the lookup that fills it (the host runs with cold caches right after each
    program call)."""

    embeds: Tensor  # [rows, hidden]
    ple: Tensor  # [rows, layers, ple_dim]
    positions: Tensor  # [rows] int64
    position_values: np.ndarray  # positions' memory, written without a torch op
    has_ple: bool


class StaticBackend:
    """A bundle's static methods behind the backend interface.

    The host gathers embedding and PLE rows from the (memory-mapped) tables, cuts the prompt
    into `chunk`-row calls (full chunks through `prefill_intermediate`, the rest left-padded into
    `prefill_final`, each through the smallest context bucket holding its rows), and pads a
    verify round into the smallest `verify_K` that fits. The methods
    own the cache; rollback is implicit (a write at position p first forgets slots >= p), so
    `truncate` moves nothing. `runner.bytes_copied`, where a runner has it, counts cache rows it
    copies on the host (ONNX Runtime); ExecuTorch and Core ML update the cache in the program.
    """

    def __init__(self, runner: Runner, tables: TokenTables, cfg: TextConfig, name: str = "static"):
        self.runner, self.tables = runner, tables
        self.shapes = shapes = runner.shapes
        self.name = name
        self.max_context = shapes.max_context
        self.max_draft = shapes.max_draft
        self.has_drafter = "draft_step" in runner.methods
        self._token = torch.zeros(1, dtype=torch.long)  # a draft chain's input, refilled
        self._token_values = self._token.numpy()
        self.vocab_size = cfg.vocab_size
        self.meter = Meter()
        self.calls: dict[str, int] = {}
        self._io_bytes: dict[str, int] = {}
        self._row_inputs: dict[int, _RowInputs] = {}
        slots = cache_slots(cfg, shapes.max_context, shapes.max_draft)
        self.rings = RingTracker(slots, cfg.sliding_window)

    def _call(self, method: str, *inputs: Tensor) -> tuple[Tensor, ...]:
        self.calls[method] = self.calls.get(method, 0) + 1
        before = getattr(self.runner, "bytes_copied", 0)
        with self.meter.phase("drafter" if method.startswith("draft") else "target"):
            out = self.runner.call(method, *inputs)
        copied = getattr(self.runner, "bytes_copied", 0) - before
        io = self._io_bytes.get(method)
        if io is None:  # a method's shapes are static: its inputs and outputs, counted once
            io = self._io_bytes[method] = tensor_bytes(*inputs, *out)
        self.meter.bytes_moved += io + copied
        return out

    def _padded(self, ids: list[int], position: int, rows: int) -> tuple[Tensor, Tensor, Tensor]:
        """Inputs for `ids` at `position`.. left-padded to `rows`: pad rows have zero inputs
        and the position after the last real row, which sends their K/V to the trash slot.
        The tensors are the backend's own for that row count, refilled by its next call."""
        pad, end = rows - len(ids), position + len(ids)
        inputs = self._row_inputs.get(rows) or self._allocate(rows)
        with self.meter.phase("embed"):
            self.tables.embed(ids, out=inputs.embeds[pad:] if pad else inputs.embeds)
            if inputs.has_ple:
                self.tables.per_layer_inputs(ids, out=inputs.ple[pad:] if pad else inputs.ple)
        if pad:
            inputs.embeds[:pad] = 0
            inputs.ple[:pad] = 0
        values = inputs.position_values
        if rows == 1:  # every AR step
            values[0] = position
        else:
            values[:pad] = end
            values[pad:] = np.arange(position, end)
        return inputs.embeds, inputs.ple, inputs.positions

    def _allocate(self, rows: int) -> _RowInputs:
        tables = self.tables
        has_ple = tables.per_layer is not None
        positions = torch.zeros(rows, dtype=torch.long)
        inputs = _RowInputs(
            torch.zeros(rows, tables.hidden_size),
            # without per-layer inputs the graph takes a placeholder it never reads
            torch.zeros(rows, tables.num_layers, tables.ple_dim if has_ple else 1),
            positions,
            positions.numpy(),
            has_ple,
        )
        self._row_inputs[rows] = inputs
        return inputs

    def _check_fits(self, end: int) -> None:
        if end > self.max_context:
            raise EdgeMTPError(
                f"context full: {end} tokens exceed the bundle's max context {self.max_context} "
                "(export with a larger --max-context, or start a new chat)"
            )

    def prefill(self, ids: list[int], start: int = 0) -> tuple[Tensor, Tensor]:
        """Returns (last hidden, last logits)."""
        c, n = self.shapes.chunk, len(ids)
        if n == 0:
            raise EdgeMTPError("nothing to prefill: the prompt is empty")
        self._check_fits(start + n)
        chunks = prefill_chunks(n, c)
        for first, end in chunks[:-1]:
            method = self.shapes.prefill_method(False, start + end)
            self._call(method, *self._padded(ids[first:end], start + first, c))
        first, end = chunks[-1]
        hidden, logits = self._call(
            self.shapes.prefill_method(True, start + end),
            *self._padded(ids[first:end], start + first, c),
        )
        self.rings.wrote(start + n)
        return hidden, logits

    def verify(self, ids: list[int], position: int) -> tuple[Tensor, Tensor]:
        """Logits and hidden states of `ids` at `position`.., through the smallest verify
        method that fits (rows and context bucket), left-padded like `prefill` (pad rows are
        written to the trash slot)."""
        end = position + len(ids)
        self._check_fits(end)
        method, pad = self.shapes.verify_method(len(ids) - 1, end)
        logits, hidden = self._call(method, *self._padded(ids, position, len(ids) + pad))
        self.rings.wrote(position + len(ids))
        return (logits[pad:], hidden[pad:]) if pad else (logits, hidden)

    def draft_step(
        self, token: int, hidden: Tensor, position: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        inputs = self._row_inputs.get(1) or self._allocate(1)
        with self.meter.phase("embed"):
            self.tables.embed([token], out=inputs.embeds)
        inputs.position_values[0] = position
        method = self.shapes.draft_method(position)
        return self._call(method, inputs.embeds[0], hidden, inputs.positions)  # type: ignore[return-value]

    def draft_chain(
        self, token: int, hidden: Tensor, position: int, depth: int
    ) -> list[int] | None:
        """The bundle's `draft_K` for this depth and position, or None where it has none (a
        bundle exported before draft chains, or for a backend without them)."""
        method = self.shapes.chain_method(depth, position)
        if method not in self.runner.methods:
            return None
        inputs = self._row_inputs.get(1) or self._allocate(1)
        inputs.position_values[0] = position
        self._token_values[0] = token
        (drafted,) = self._call(method, self._token, hidden, inputs.positions)
        return drafted.tolist()

    def truncate(self, length: int) -> bool:
        return self.rings.truncated(length)

    def verify_shape(self, depth: int) -> str:
        return self.shapes.verify_method(depth)[0]
