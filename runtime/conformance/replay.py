"""Replaying conformance vectors through the Python decoding engine, without a model: a
`ReplayRunner` answers each program call with the recorded outputs after checking it is the
recorded call (method, positions, token ids), the same `RecordingBackend` records the engine's
decisions again, and the first difference from the vectors raises `ConformanceMismatch`. This is
what the apps' C++ core does with the same file.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from edgemtp.errors import EdgeMTPError
from edgemtp.model.static import StaticShapes
from edgemtp.runtime.backends import StaticBackend
from edgemtp.runtime.conformance.record import (
    RecordingBackend,
    call_positions,
    pad_rows,
    run_case,
    span_positions,
)
from edgemtp.runtime.conformance.scenarios import method_choice, spec_of
from edgemtp.runtime.session import Session


class ConformanceMismatch(EdgeMTPError):
    """A replay that decided differently from the vectors."""


@dataclass
class _Expected:
    method: str
    positions: list[int]
    ids: list[int]  # the real rows' token ids
    outputs: Callable[[], tuple[Tensor, ...]]
    where: str


def _one_hot(vocab: int, rows: list[int | None]) -> Tensor:
    """Logit rows whose argmax is each given token (None: a pad row, all zero)."""
    out = torch.zeros(len(rows), vocab)
    for i, token in enumerate(rows):
        if token is not None:
            out[i, token] = 1.0
    return out


def expected_calls(case: Mapping[str, Any], vocab: int) -> list[_Expected]:
    """The program calls a case's engine makes, in order, each with its recorded outputs."""
    out = []
    prompt, first = case["prompt"], case["prefill"]["first_token"]
    for i, c in enumerate(case["prefill"]["calls"]):
        rows = prompt[c["start"] : c["start"] + c["rows"]]
        end = c["start"] + c["rows"]
        if c["method"].startswith("prefill_intermediate"):
            outputs = lambda end=end: (torch.tensor([end]),)  # noqa: E731
        else:
            outputs = lambda: (torch.zeros(1), _one_hot(vocab, [first])[0])  # noqa: E731
        out.append(_Expected(c["method"], span_positions(c), rows, outputs, f"prefill call {i}"))
    for r_index, r in enumerate(case["rounds"]):
        fed = [r["input_token"], *r["drafted"]]
        for i, d in enumerate(r["draft_calls"]):
            token = r["drafted"][i]
            outputs = lambda t=token: (torch.zeros(1), torch.tensor([t]), torch.zeros(1))  # noqa: E731
            where = f"round {r_index} draft step {i}"
            out.append(_Expected(d["method"], [d["position"]], [fed[i]], outputs, where))
        v = r["verify"]
        rows_out = [None] * v["pad"] + list(r["target_argmax"])
        outputs = lambda rows=rows_out: (_one_hot(vocab, rows), torch.zeros(len(rows), 1))  # noqa: E731
        out.append(
            _Expected(v["method"], span_positions(v), fed, outputs, f"round {r_index} verify")
        )
    return out


class ReplayRunner:
    """A `Runner` that answers one case's program calls with its recorded outputs, after
    checking that each call is the recorded one. Inputs come from `TokenIdTables`, so the
    embeddings it receives are the token ids themselves."""

    def __init__(self, vectors: Mapping[str, Any], case: Mapping[str, Any]):
        self.shapes = StaticShapes.from_manifest(vectors["manifest"]["shapes"])
        self.methods = {name: None for name in vectors["methods"]}
        self.case = case["name"]
        self.expected = deque(expected_calls(case, vectors["manifest"]["model"]["vocab_size"]))
        self.made = 0

    def _mismatch(self, message: str) -> ConformanceMismatch:
        return ConformanceMismatch(f"case '{self.case}', program call {self.made}: {message}")

    def call(self, method: str, *inputs: Tensor) -> tuple[Tensor, ...]:
        if not self.expected:
            raise self._mismatch(f"{method} called after every recorded call was made")
        want = self.expected.popleft()
        positions = call_positions(inputs)
        pad = pad_rows(positions)
        ids = [int(x) for x in inputs[0].reshape(len(positions), -1)[pad:, 0].tolist()]
        got = (method, positions, ids)
        if got != (want.method, want.positions, want.ids):
            raise self._mismatch(
                f"expected {want.where}: {want.method} at positions {want.positions} with ids "
                f"{want.ids}; got {method} at positions {positions} with ids {ids}"
            )
        self.made += 1
        return want.outputs()


class TokenIdTables:
    """Embedding tables whose row for a token is the token id itself (exact in float32 below
    2^24), so a replay runner can read which tokens the engine fed. No per-layer inputs."""

    num_layers = hidden_size = 1
    per_layer = None
    ple_dim = 0

    def embed(self, ids: Tensor | list[int], out: Tensor | None = None) -> Tensor:
        rows = torch.as_tensor(ids, dtype=torch.float32).unsqueeze(-1)
        return rows if out is None else out.copy_(rows)

    def per_layer_inputs(self, ids: Tensor | list[int], out: Tensor | None = None) -> None:
        return None


@dataclass(frozen=True)
class ReplayConfig:
    """The model facts a `StaticBackend` reads, from the vectors' manifest fields."""

    vocab_size: int
    sliding_window: int
    layer_types: tuple[str, ...]


def _first_difference(want: Any, got: Any, path: str = "") -> str | None:
    """Where `got` first differs from `want` (JSON values), as `path: expected X, got Y`."""
    if isinstance(want, dict) and isinstance(got, dict):
        for key in sorted(set(want) | set(got)):
            if key not in want or key not in got:
                return f"{path}.{key}: {'missing' if key not in got else 'unexpected'}"
            found = _first_difference(want[key], got[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(want, list) and isinstance(got, list):
        for i, (a, b) in enumerate(zip(want, got, strict=False)):
            found = _first_difference(a, b, f"{path}[{i}]")
            if found:
                return found
        if len(want) != len(got):
            return f"{path}: expected {len(want)} entries, got {len(got)}"
        return None
    if type(want) is not type(got) or want != got:
        return f"{path}: expected {json.dumps(want)}, got {json.dumps(got)}"
    return None


def replay_case(vectors: Mapping[str, Any], case: Mapping[str, Any]) -> None:
    """Run one case through the engine on its recorded outputs; raise at the first decision
    that differs from the vectors."""
    manifest = vectors["manifest"]
    runner = ReplayRunner(vectors, case)
    cfg = ReplayConfig(
        manifest["model"]["vocab_size"],
        manifest["model"]["sliding_window"],
        tuple(manifest["cache"]["kinds"]),
    )
    inner = StaticBackend(runner, TokenIdTables(), cfg, name="replay")  # type: ignore[arg-type]
    recorder = RecordingBackend(inner, manifest["cache"]["kinds"])
    session = Session(recorder)
    got = json.loads(json.dumps(run_case(session, recorder, spec_of(case))))
    if runner.expected:
        raise ConformanceMismatch(
            f"case '{case['name']}': the replay stopped before {runner.expected[0].where}"
        )
    difference = _first_difference(case, got)
    if difference:
        raise ConformanceMismatch(f"case '{case['name']}': {difference.lstrip('.')}")


def replay_vectors(vectors: Mapping[str, Any]) -> dict[str, int]:
    """Replay every case and check every method choice; raises `ConformanceMismatch` at the
    first difference. Returns counts of what was checked."""
    for case in vectors["cases"]:
        replay_case(vectors, case)
    choices = 0
    for table in vectors["method_choice"]:
        shapes = StaticShapes.from_manifest(table["shapes"])
        want = method_choice(shapes)
        difference = _first_difference(table, json.loads(json.dumps(want)))
        if difference:
            raise ConformanceMismatch(f"method_choice: {difference.lstrip('.')}")
        choices += len(table["verify"]) + len(table["draft"]) + len(table["prefill"])
    return {
        "cases": len(vectors["cases"]),
        "rounds": sum(len(c["rounds"]) for c in vectors["cases"]),
        "method_choices": choices,
    }
