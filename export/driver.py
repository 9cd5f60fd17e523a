"""Host-side driver of the static methods: greedy AR / MTP decoding as `runtime.generate` does it.

The driver owns the token tables (host lookups), the chunking and padding of the prompt, the
draft loop and the greedy acceptance; the methods own the cache. It runs against any `Runner`:
the eager wrappers (`EagerRunner`) or a loaded ExecuTorch program (`ExecuTorchRunner`), so the
same code proves the wrappers and the lowered program against the reference engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from edgemtp.errors import EdgeMTPError
from edgemtp.export.static import StaticBundle, StaticShapes
from edgemtp.model.gemma4 import TokenTables
from edgemtp.runtime.sampling import greedy_accept


class Runner(Protocol):
    """The static methods of one bundle, however they are executed."""

    shapes: StaticShapes

    def call(self, method: str, *inputs: Tensor) -> tuple[Tensor, ...]: ...


class EagerRunner:
    """Runs the static wrappers in eager PyTorch."""

    def __init__(self, bundle: StaticBundle):
        self.shapes = bundle.shapes
        self.methods = {name: m for name, (m, _) in bundle.methods(debug=True).items()}

    def call(self, method: str, *inputs: Tensor) -> tuple[Tensor, ...]:
        with torch.no_grad():
            out = self.methods[method](*inputs)
        return out if isinstance(out, tuple) else (out,)


class ExecuTorchRunner:
    """Runs the methods of a .pte with ExecuTorch's Python runtime (XNNPACK and portable
    kernels on this host; a program delegated to Core ML or QNN needs that backend's runtime)."""

    def __init__(self, pte: Path | bytes, shapes: StaticShapes):
        from executorch.runtime import Runtime

        runtime = Runtime.get()
        self.program = runtime.load_program(pte)
        self.shapes = shapes
        # Load every method now: loading one initialises the shared cache buffers, which would
        # wipe the cache if it happened lazily in the middle of a sequence.
        try:
            self.methods: dict[str, Any] = {
                name: self.program.load_method(name) for name in sorted(self.program.method_names)
            }
        except RuntimeError as e:
            missing = [
                b for b in _delegate_backends(pte) if not runtime.backend_registry.is_available(b)
            ]
            if not missing:
                raise
            where = {"CoreMLBackend": "macOS 15+ / iOS 18+", "QnnBackend": "a Qualcomm device"}
            raise EdgeMTPError(
                f"this program is delegated to {', '.join(missing)}, which this ExecuTorch "
                f"runtime cannot run here: run it on {where.get(missing[0], 'its device')} "
                "(or export with --delegate cpu)"
            ) from e

    def call(self, method: str, *inputs: Tensor) -> tuple[Tensor, ...]:
        return tuple(self.methods[method].execute(inputs))


def _delegate_backends(pte: Path | bytes) -> list[str]:
    """Backend ids of a program's delegates."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    data = pte if isinstance(pte, bytes) else Path(pte).read_bytes()
    plans = deserialize_pte_binary(data).program.execution_plan
    return sorted({d.id for plan in plans for d in plan.delegates})


@dataclass
class StaticGeneration:
    tokens: list[int]
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    calls: dict[str, int] = field(default_factory=dict)


class StaticDriver:
    """Greedy decoding over static methods (one sequence)."""

    def __init__(self, runner: Runner, tables: TokenTables):
        self.runner = runner
        self.tables = tables
        self.shapes = runner.shapes
        self.calls: dict[str, int] = {}

    def _call(self, method: str, *inputs: Tensor) -> tuple[Tensor, ...]:
        self.calls[method] = self.calls.get(method, 0) + 1
        return self.runner.call(method, *inputs)

    def _rows(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        embeds = self.tables.embed(ids)
        ple = self.tables.per_layer_inputs(ids)
        if ple is None:  # the graph takes a placeholder it never reads
            ple = torch.zeros(ids.shape[0], self.tables.num_layers, 1)
        return embeds, ple

    def prefill(self, prompt: list[int]) -> tuple[Tensor, Tensor]:
        """Full chunks through `prefill_intermediate`, the rest (left-padded to the chunk)
        through `prefill_final`. Returns (last hidden, last logits)."""
        c, n = self.shapes.chunk, len(prompt)
        if not 0 < n <= self.shapes.max_context:
            raise EdgeMTPError(f"prompt of {n} tokens does not fit {self.shapes.max_context}")
        ids = torch.tensor(prompt)
        last_start = (n - 1) // c * c
        for start in range(0, last_start, c):
            embeds, ple = self._rows(ids[start : start + c])
            self._call("prefill_intermediate", embeds, ple, torch.arange(start, start + c))
        hidden, logits = self._call("prefill_final", *self._padded(ids[last_start:], last_start, c))
        return hidden, logits

    def _padded(self, ids: Tensor, position: int, rows: int) -> tuple[Tensor, Tensor, Tensor]:
        """Inputs for `ids` at `position`.. left-padded to `rows`: pad rows have zero inputs
        and the position after the last real row, which sends their K/V to the trash slot."""
        pad = rows - ids.shape[0]
        embeds, ple = self._rows(ids)
        end = position + ids.shape[0]
        positions = torch.cat([torch.full((pad,), end), torch.arange(position, end)])
        embeds = torch.cat([embeds.new_zeros(pad, embeds.shape[1]), embeds])
        ple = torch.cat([ple.new_zeros(pad, *ple.shape[1:]), ple])
        return embeds, ple, positions

    def verify(self, ids: list[int], position: int) -> tuple[Tensor, Tensor]:
        """Logits and hidden states of `ids` at `position`.., through the smallest verify
        method that fits, left-padded like `prefill` (pad rows are written to the trash slot)."""
        method, pad = self.shapes.verify_method(len(ids) - 1)
        logits, hidden = self._call(
            method, *self._padded(torch.tensor(ids), position, len(ids) + pad)
        )
        return logits[pad:], hidden[pad:]

    def draft(self, token: int, hidden: Tensor, position: int, depth: int) -> list[int]:
        tokens = []
        for _ in range(depth):
            embed = self.tables.embed(torch.tensor([token]))[0]
            hidden, ids, logits = self._call("draft_step", embed, hidden, torch.tensor([position]))
            token = int(ids[logits.argmax()])
            tokens.append(token)
        return tokens

    def generate(
        self, prompt: list[int], max_new_tokens: int, depth: int = 0, stop_ids: tuple[int, ...] = ()
    ) -> StaticGeneration:
        """Greedy AR (depth 0) or MTP; drafts never spend the budget, as in the reference."""
        if depth > self.shapes.max_draft:
            raise EdgeMTPError(f"depth {depth} > the bundle's max draft {self.shapes.max_draft}")
        self.calls = {}
        hidden, logits = self.prefill(prompt)
        out = [int(logits.argmax())]
        gen = StaticGeneration(out)
        position = len(prompt)
        while len(out) < max_new_tokens and out[-1] not in stop_ids:
            k = min(depth, max_new_tokens - len(out) - 1)
            if position + k + 1 > self.shapes.max_context:
                raise EdgeMTPError(f"context full at {position} (max {self.shapes.max_context})")
            drafts = self.draft(out[-1], hidden, position, k) if k else []
            logits, rows_hidden = self.verify([out[-1], *drafts], position)
            n, nxt = greedy_accept(logits, torch.tensor(drafts, dtype=torch.long))
            committed = [*drafts[:n], nxt]
            hidden = rows_hidden[n]
            position += len(committed)  # the next write starts here: that is the rollback
            stops = [i for i, t in enumerate(committed) if t in stop_ids]
            out.extend(committed[: stops[0] + 1] if stops else committed)
            gen.drafted += k
            gen.accepted += n
            gen.rounds += 1
        gen.calls = dict(self.calls)
        return gen
