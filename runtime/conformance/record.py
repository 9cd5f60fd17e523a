"""Recording what the Python runtime decides on a bundle. A `RecordingBackend` sits between the
decoding engine and the bundle's `StaticBackend`, delegates every call unchanged and logs it
round by round, and a `MethodLog` around the runner sees each program call (method and
positions). `record_vectors` runs every scenario through them into the vectors document, so the
vectors hold what users' runs really do; replaying reuses the same recorder.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from edgemtp.errors import EdgeMTPError
from edgemtp.runtime.backends import Meter, Runner, StaticBackend
from edgemtp.runtime.conformance.scenarios import CaseSpec, case_specs, method_choices, stop_spec
from edgemtp.runtime.conformance.vectors import FIELDS, FORMAT_NAME, FORMAT_VERSION
from edgemtp.runtime.sampling import argmax_rows
from edgemtp.runtime.session import Session


@dataclass
class _Call:
    method: str
    positions: list[int]


def call_positions(inputs: tuple[Tensor, ...]) -> list[int]:
    """The row positions of a program call (its third input)."""
    return [int(p) for p in inputs[2].reshape(-1).tolist()]


def pad_rows(positions: list[int]) -> int:
    """How many left pad rows a row call has: pad rows sit at the position after the last real
    row (`StaticBackend._padded`'s convention)."""
    return sum(1 for p in positions if p > positions[-1])


def span_positions(span: Mapping[str, Any]) -> list[int]:
    """The positions of a call recorded as (start, rows, pad): pad rows first, then real rows."""
    end = span["start"] + span["rows"]
    return [end] * span["pad"] + list(range(span["start"], end))


class MethodLog:
    """A runner wrapper that logs each program call (method name and positions)."""

    def __init__(self, runner: Runner):
        self.runner = runner
        self.shapes = runner.shapes
        self.methods = runner.methods
        self.calls: list[_Call] = []

    @property
    def bytes_copied(self) -> int:
        return getattr(self.runner, "bytes_copied", 0)

    def call(self, method: str, *inputs: Tensor) -> tuple[Tensor, ...]:
        self.calls.append(_Call(method, call_positions(inputs)))
        return self.runner.call(method, *inputs)


def span(call: _Call) -> dict[str, Any]:
    """A row call's positions as (start, rows, pad): pad rows first, at the position after the
    last real row, then consecutive real rows."""
    p = call.positions
    pad = pad_rows(p)
    recorded = {"method": call.method, "start": p[pad], "rows": p[-1] + 1 - p[pad], "pad": pad}
    if span_positions(recorded) != p:
        raise EdgeMTPError(f"{call.method} was called with positions {p}: not left-padded rows")
    return recorded


def ring_layout(manifest: Mapping[str, Any]) -> dict[str, dict[str, int]]:
    """Attention kind -> slots and trash slot, from a manifest's cache layout."""
    return {
        kind: {"slots": int(k["slots"]), "trash_slot": int(k["trash_slot"])}
        for kind, k in sorted(manifest["cache"]["kinds"].items())
    }


class RecordingBackend:
    """A Backend that delegates every call to a `StaticBackend` and logs it, round by round;
    it puts a `MethodLog` around the backend's runner to see the program calls themselves.

    Rounds are delimited by the engine's own `on_tokens` callback (`on_tokens` below): the
    draft steps, verify and truncations before it belong to the round whose committed tokens
    it reports."""

    def __init__(self, inner: StaticBackend, layout: dict[str, dict[str, int]]):
        self.inner = inner
        self.log = MethodLog(inner.runner)
        inner.runner = self.log
        self.layout = layout
        self.name = inner.name
        self.max_context = inner.max_context
        self.max_draft = inner.max_draft
        self.vocab_size = inner.vocab_size
        self.has_drafter = inner.has_drafter
        self.meter: Meter = inner.meter
        self.start_case()

    def start_case(self) -> None:
        self.prefill_calls: list[dict[str, Any]] = []
        self.first_token: int | None = None
        self.rounds: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.log.calls.clear()

    def _calls_since(self, mark: int) -> list[_Call]:
        return self.log.calls[mark:]

    def _round(self) -> dict[str, Any]:
        if self.open is None:
            self.open = {"draft_calls": [], "drafted": [], "truncates": []}
        elif "verify" in self.open:
            raise EdgeMTPError("the engine drafted or verified again before reporting its round")
        return self.open

    def on_tokens(self, tokens: list[int]) -> None:
        if self.open is not None:  # the prefill's first token comes with no round open
            self.open["committed"] = list(tokens)
            self.rounds.append(self.open)
            self.open = None

    def prefill(self, ids: list[int], start: int) -> tuple[Tensor, Tensor]:
        mark = len(self.log.calls)
        hidden, logits = self.inner.prefill(ids, start)
        self.prefill_calls += [span(c) for c in self._calls_since(mark)]
        self.first_token = argmax_rows(logits)[0]
        return hidden, logits

    def draft_step(
        self, token: int, hidden: Tensor, position: int
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        record = self._round()
        mark = len(self.log.calls)
        out_hidden, ids, logits = self.inner.draft_step(token, hidden, position)
        (call,) = self._calls_since(mark)
        best = argmax_rows(logits)[0]
        record["draft_calls"].append({"method": call.method, "position": call.positions[0]})
        record["drafted"].append(int(ids[best]) if ids is not None else best)
        return out_hidden, ids, logits

    def draft_chain(
        self, token: int, hidden: Tensor, position: int, depth: int
    ) -> list[int] | None:
        return None  # the vectors record each draft step's call

    def verify(self, ids: list[int], position: int) -> tuple[Tensor, Tensor]:
        record = self._round()
        mark = len(self.log.calls)
        logits, hidden = self.inner.verify(ids, position)
        (call,) = self._calls_since(mark)
        record.update(
            position=position,
            input_token=ids[0],
            verify=span(call),
            target_argmax=argmax_rows(logits),
            slots={
                kind: [
                    k["trash_slot"] if p > call.positions[-1] else p % k["slots"]
                    for p in call.positions
                ]
                for kind, k in self.layout.items()
            },
        )
        return logits, hidden

    def truncate(self, length: int) -> bool:
        keeps = self.inner.truncate(length)
        if self.open is not None:
            self.open["truncates"].append({"length": length, "keeps": keeps})
        return keeps

    def verify_shape(self, depth: int) -> str:
        return self.inner.verify_shape(depth)


def run_case(session: Session, recorder: RecordingBackend, spec: CaseSpec) -> dict[str, Any]:
    """One greedy generation from an empty cache through `session` (whose backend is
    `recorder`), as its record."""
    session.reset()
    recorder.start_case()
    result = session.generate(
        spec.prompt,
        spec.max_new_tokens,
        mtp=spec.depth,
        stop_ids=spec.stop_ids,
        on_tokens=recorder.on_tokens,
        interruptible=False,
    )
    decode_steps = [s for s in result.steps if s.kind == "decode"]
    if len(decode_steps) != len(recorder.rounds) or recorder.open is not None:
        raise EdgeMTPError(
            f"case {spec.name}: {len(decode_steps)} decode steps but "
            f"{len(recorder.rounds)} rounds recorded"
        )
    rounds = []
    for step, r in zip(decode_steps, recorder.rounds, strict=True):
        rounds.append(
            {
                **r,
                "depth": len(r["drafted"]),
                "accepted": step.accepted,
                "position_after": r["truncates"][-1]["length"],
            }
        )
    return {
        "name": spec.name,
        "purpose": spec.purpose,
        "depth": spec.depth,
        "max_new_tokens": spec.max_new_tokens,
        "stop_ids": list(spec.stop_ids),
        "prompt": list(spec.prompt),
        "prefill": {"calls": recorder.prefill_calls, "first_token": recorder.first_token},
        "rounds": rounds,
        "tokens": list(result.tokens),
        "stop_reason": result.stop_reason,
    }


def manifest_subset(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """What a decode engine reads from a manifest, at the same paths."""
    model = manifest["model"]
    return {
        "shapes": dict(manifest["shapes"]),
        "cache": {"kinds": ring_layout(manifest)},
        "model": {
            "sliding_window": model["sliding_window"],
            "vocab_size": model["vocab_size"],
            "eos_token_ids": list(model["eos_token_ids"]),
        },
        "drafter": manifest["drafter"],
    }


def record_vectors(
    bundle: Path | str,
    *,
    prompts: int = 4,
    tokens: int = 48,
    depths: tuple[int, ...] | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Greedy generations over `bundle` for every (prompt, depth), plus one whose stop token
    comes mid-round, as the vectors document (see `FIELDS`)."""
    from edgemtp.runtime.bundle import MANIFEST, read_manifest

    say = progress or (lambda _: None)
    bundle = Path(bundle)
    session = Session.from_bundle(bundle, threads=1, progress=say)
    manifest = read_manifest(bundle)
    inner = session.backend
    if not isinstance(inner, StaticBackend):
        raise EdgeMTPError(f"{bundle}: conformance vectors need a bundle's static methods")
    deepest = inner.max_draft if inner.has_drafter else 0
    depths = tuple(range(deepest + 1)) if depths is None else depths
    too_deep = [d for d in depths if d > deepest]
    if too_deep:
        raise EdgeMTPError(
            f"--depths {','.join(map(str, too_deep))}: this bundle verifies at most {deepest} "
            "drafts" + ("" if inner.has_drafter else " (it has no drafter)")
        )
    layout = ring_layout(manifest)
    recorder = RecordingBackend(inner, layout)
    session = Session(recorder, session.tokenizer, session.stop_ids, session.info)
    ring = min(k["slots"] for k in layout.values())
    cases = []
    for spec in case_specs(inner.shapes, ring, prompts, tokens, depths, inner.vocab_size):
        cases.append(run_case(session, recorder, spec))
        say(f"{spec.name}: {len(cases[-1]['rounds'])} rounds")
    cases.append(run_case(session, recorder, stop_spec(cases)))
    say(f"{cases[-1]['name']}: stop token {cases[-1]['stop_ids'][0]}")
    text = (bundle / MANIFEST).read_bytes()
    vectors = {
        "format": {"name": FORMAT_NAME, "version": FORMAT_VERSION, "fields": FIELDS},
        "bundle": {
            "manifest_sha256": hashlib.sha256(text).hexdigest(),
            "backend": manifest["backend"],
            "delegate": manifest["delegate"],
            "edgemtp_version": manifest["edgemtp_version"],
        },
        "manifest": manifest_subset(manifest),
        "methods": sorted(manifest["methods"]),
        "sampling": {"temperature": 0},
        "cases": cases,
        "method_choice": method_choices(inner.shapes),
    }
    return json.loads(json.dumps(vectors))  # exactly what a reader of the file sees
