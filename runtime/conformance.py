"""Conformance vectors: every decision of greedy decoding on a bundle, in token space, for the
app-side decode engines (`apps/core`) to replay without a model.

    vectors = record_vectors("bundle/")          # runs the bundle: the engine users run
    write_vectors(vectors, Path("vectors/"))     # vectors/vectors.json, all or nothing
    replay_vectors(vectors)                      # the same engine again, on the recorded outputs

Recording runs `Session.generate` -> `runtime.generate.decode` -> `StaticBackend` over the bundle,
with a `RecordingBackend` between the engine and the bundle's backend that delegates every call
and logs it, and a method log between the backend and its runner that sees each program call
(method name and positions). So the vectors hold what the Python runtime really did: prefill
chunks, verify methods and their padding, draft steps, drafted tokens, the target's argmax rows,
accepted counts, committed tokens, truncations and stop reasons. The model's outputs in them
(first token, drafted tokens, argmax rows) are enough to drive a replay; everything else is a
decision the replaying engine must make identically.

Replaying runs the same engine over a `ReplayRunner` that answers each program call with the
recorded outputs after checking it is the recorded call (method, positions, token ids), then
compares the new record with the stored one; the first difference raises `ConformanceMismatch`.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from edgemtp.errors import EdgeMTPError
from edgemtp.files import staged_folder
from edgemtp.model.cache import ring_size
from edgemtp.model.static import StaticShapes, auto_context_buckets, bucketed
from edgemtp.runtime.backends import Meter, Runner, StaticBackend
from edgemtp.runtime.sampling import argmax_rows
from edgemtp.runtime.session import Session

FORMAT_NAME = "edgemtp-conformance"
FORMAT_VERSION = 1
VECTORS = "vectors.json"
PROMPT_SEED = 20260101  # prompt i's ids come from random.Random(PROMPT_SEED + i)
# A bucketed shape set no ONNX or Core ML bundle has (context buckets are ExecuTorch cpu only),
# so that every engine's verify/draft method choice is checked against `StaticShapes` anyway.
BUCKETED_CONTEXT = 8192

FIELDS = {
    "format": "this description; name, version and the meaning of every field",
    "bundle": "the bundle recorded: manifest_sha256 (of manifest.json's bytes), backend, "
    "delegate, edgemtp_version (the exporter's)",
    "manifest": "the manifest fields a decode engine reads, at their manifest.json paths: "
    "shapes (max_context, max_draft, chunk, context_buckets), cache.kinds.<kind>.slots and "
    ".trash_slot, model.sliding_window, model.vocab_size, model.eos_token_ids, drafter (null: "
    "no drafter)",
    "methods": "the bundle's method names, sorted",
    "sampling": "temperature 0: greedy; a token is the first index of a row's largest logit",
    "cases[]": "one greedy generation from an empty cache: name, purpose, depth (the pinned "
    "draft depth), max_new_tokens (the budget, committed tokens), stop_ids, prompt (token "
    "ids), prefill, rounds, tokens (every committed token, the prefill's first included), "
    "stop_reason (stop | length | context)",
    "cases[].prefill.calls[]": "program calls of the prefill, in order: method "
    "(prefill_intermediate | prefill_final), start (position of the first real row), rows "
    "(real rows: prompt[start:start + rows]), pad (left pad rows before them; a pad row has "
    "zero inputs and position start + rows)",
    "cases[].prefill.first_token": "MODEL OUTPUT: argmax of prefill_final's logits",
    "cases[].rounds[]": "one decode round: position (where input_token goes, = cache length), "
    "input_token (the last committed token), depth (drafts this round), draft_calls[] "
    "(method, position: one per draft step, each fed the previous token), drafted (MODEL "
    "OUTPUT: the drafter's greedy tokens), verify (method, start, rows, pad: as prefill calls; "
    "ids are [input_token, *drafted]), target_argmax (MODEL OUTPUT: argmax of each real verify "
    "row), accepted (leading drafts equal to the argmax of the row before them), committed "
    "(tokens the round adds to the output: drafted[:accepted] + target_argmax[accepted], cut "
    "after a stop token), truncates[] (length, keeps: each rollback in order, and whether "
    "every sliding ring still holds [0, length)), position_after (the cache length after the "
    "round), slots (per attention kind, the cache slot of each verify row, pad rows first: "
    "position % slots, pad rows the trash slot)",
    "method_choice[]": "StaticShapes' method choice, model-free: shapes, verify[] (depth, end "
    "= one past the last verified position, method, pad), draft[] (position, method) and "
    "prefill[] (final, end = one past the chunk's last row, method)",
}


class ConformanceMismatch(EdgeMTPError):
    """A replay that decided differently from the vectors."""


# --- prompts -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptPlan:
    name: str
    purpose: str
    length: int
    max_new_tokens: int


def plan_prompts(
    shapes: StaticShapes, ring_slots: int, count: int, tokens: int
) -> list[PromptPlan]:
    """The prompts: the first four are built from the bundle's shapes to exercise one prefill
    chunk, several chunks, decoding past the sliding ring and the context end; any more get
    seeded random lengths. Every prompt leaves room for at least one new token."""
    chunk, context = shapes.chunk, shapes.max_context
    longest = context - 1
    rounds_rows = 2 * (shapes.max_draft + 1)

    def fit(n: int) -> int:
        return max(1, min(n, longest))

    plans = [
        PromptPlan(
            "short",
            "shorter than one prefill chunk: a single left-padded prefill_final call",
            fit(max(1, chunk // 2)),
            tokens,
        ),
        PromptPlan(
            "multi_chunk",
            "spans three prefill chunks: two prefill_intermediate calls, then a left-padded "
            "prefill_final",
            fit(2 * chunk + max(1, chunk // 2)),
            tokens,
        ),
    ]
    if ring_slots < context:
        length = fit(ring_slots - tokens // 2)
        plans.append(
            PromptPlan(
                "ring_wrap",
                f"decoding passes the {ring_slots}-slot sliding ring: slots wrap to "
                "position % slots and rollbacks happen past the window",
                length,
                max(tokens, ring_slots - length + rounds_rows),
            )
        )
    else:
        plans.append(
            PromptPlan(
                "ring_wrap",
                "the sliding window covers the whole context: this bundle has no ring to wrap",
                fit(chunk + 1),
                tokens,
            )
        )
    plans.append(
        PromptPlan(
            "context_end",
            "reaches the end of the context: the room left caps the depth, stop reason context",
            fit(context - max(1, tokens // 2)),
            tokens,
        )
    )
    for i in range(len(plans), count):
        rng = random.Random(PROMPT_SEED + 1000 + i)
        length = 1 + int(rng.random() * min(3 * chunk, longest))
        plans.append(PromptPlan(f"random_{i}", "a seeded random length", length, tokens))
    return plans[:count]


def prompt_ids(index: int, length: int, vocab: int) -> list[int]:
    """Seeded token ids in [0, vocab): `random.random` is stable across Python versions."""
    rng = random.Random(PROMPT_SEED + index)
    return [int(rng.random() * vocab) for _ in range(length)]


# --- recording ---------------------------------------------------------------------------------


@dataclass
class _Call:
    method: str
    positions: list[int]


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
        self.calls.append(_Call(method, [int(p) for p in inputs[2].reshape(-1).tolist()]))
        return self.runner.call(method, *inputs)


def span(call: _Call) -> dict[str, Any]:
    """A row call's positions as (start, rows, pad): pad rows first, at the position after the
    last real row, then consecutive real rows (`StaticBackend._padded`'s convention)."""
    p = call.positions
    end = p[-1] + 1
    pad = sum(1 for x in p if x > p[-1])
    start = p[pad]
    if p != [end] * pad + list(range(start, end)):
        raise EdgeMTPError(f"{call.method} was called with positions {p}: not left-padded rows")
    return {"method": call.method, "start": start, "rows": end - start, "pad": pad}


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


@dataclass(frozen=True)
class CaseSpec:
    name: str
    purpose: str
    depth: int
    max_new_tokens: int
    stop_ids: tuple[int, ...]
    prompt: list[int] = field(repr=False)


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


def mid_round_stop(case: dict[str, Any]) -> tuple[int, int] | None:
    """(round index, token) of the first committed token that is not a round's last and has
    not been output before: as a stop token it ends generation in the middle of that round."""
    seen = {case["prefill"]["first_token"]}
    for i, r in enumerate(case["rounds"]):
        for token in r["committed"][:-1]:
            if token not in seen:
                return i, token
            seen.add(token)
        seen.update(r["committed"][-1:])
    return None


def method_choice(shapes: StaticShapes) -> dict[str, Any]:
    """`StaticShapes`' verify, draft and prefill method for depths and positions around every
    bucket boundary and at both ends of the context."""
    edges = {1, 2, shapes.max_context - 1, shapes.max_context}
    for b in shapes.context_buckets:
        edges |= {b - 1, b, b + 1}
    ends = sorted(e for e in edges if 1 <= e <= shapes.max_context)
    return {
        "shapes": _shapes_dict(shapes),
        "verify": [
            dict(zip(("method", "pad"), shapes.verify_method(depth, end), strict=True))
            | {"depth": depth, "end": end}
            for depth in range(shapes.max_draft + 1)
            for end in ends
            if end > depth
        ],
        "draft": [
            {"position": p, "method": shapes.draft_method(p)}
            for p in ends
            if p < shapes.max_context
        ],
        "prefill": [
            {"final": final, "end": end, "method": shapes.prefill_method(final, end)}
            for final in (False, True)
            for end in ends
        ],
    }


def _shapes_dict(shapes: StaticShapes) -> dict[str, Any]:
    return {
        "max_context": shapes.max_context,
        "max_draft": shapes.max_draft,
        "chunk": shapes.chunk,
        "context_buckets": list(shapes.context_buckets),
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
    for index, plan in enumerate(plan_prompts(inner.shapes, ring, prompts, tokens)):
        ids = prompt_ids(index, plan.length, inner.vocab_size)
        for depth in depths:
            spec = CaseSpec(
                f"{plan.name}-depth{depth}", plan.purpose, depth, plan.max_new_tokens, (), ids
            )
            cases.append(run_case(session, recorder, spec))
            say(f"{spec.name}: {len(cases[-1]['rounds'])} rounds")
    cases.append(_stop_case(session, recorder, cases))
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
        "method_choice": [
            method_choice(inner.shapes),
            method_choice(
                StaticShapes(
                    BUCKETED_CONTEXT,
                    max(inner.shapes.max_draft, 1),
                    inner.shapes.chunk,
                    auto_context_buckets(BUCKETED_CONTEXT),
                )
            ),
        ],
    }
    return json.loads(json.dumps(vectors))  # exactly what a reader of the file sees


def _stop_case(
    session: Session, recorder: RecordingBackend, cases: list[dict[str, Any]]
) -> dict[str, Any]:
    """The deepest case with a committed token that stops it mid-round, rerun with that stop
    token; without one (no drafter, nothing accepted), a stop on a plain AR step."""
    for case in sorted(cases, key=lambda c: -c["depth"]):
        found = mid_round_stop(case)
        if found is not None:
            i, token = found
            purpose = f"stop token {token} is committed mid-round {i}: later tokens are dropped"
            break
    else:
        case = cases[0]
        token = case["tokens"][len(case["tokens"]) // 2]
        purpose = f"stop token {token} ends an AR round (no round accepted a draft)"
    spec = CaseSpec(
        f"{case['name']}-stop",
        purpose,
        case["depth"],
        case["max_new_tokens"],
        (token,),
        case["prompt"],
    )
    return run_case(session, recorder, spec)


# --- writing -----------------------------------------------------------------------------------


def vectors_text(vectors: Mapping[str, Any]) -> str:
    """JSON with sorted keys: a value whose JSON fits in `INLINE` characters, or a list of
    plain values (token ids), on one line; anything else one member per line. So each round
    is one line: a diff of two vectors names the rounds that changed."""
    return _json_lines(vectors, 0) + "\n"


INLINE = 400


def _json_lines(value: Any, depth: int) -> str:
    flat = json.dumps(value, sort_keys=True, allow_nan=False)
    nested = isinstance(value, dict | list) and any(
        isinstance(x, dict | list) for x in (value.values() if isinstance(value, dict) else value)
    )
    if len(flat) <= INLINE or not (isinstance(value, dict) or nested):
        return flat
    inner = " " * (depth + 1)
    if isinstance(value, dict):
        members = [
            f"{inner}{json.dumps(key)}: {_json_lines(value[key], depth + 1)}"
            for key in sorted(value)
        ]
        return "{\n" + ",\n".join(members) + "\n" + " " * depth + "}"
    items = [inner + _json_lines(x, depth + 1) for x in value]
    return "[\n" + ",\n".join(items) + "\n" + " " * depth + "]"


def check_out(out: Path) -> None:
    """Refuse an output folder that holds anything but an earlier vectors.json."""
    if out.exists() and not (out.is_dir() and set(os.listdir(out)) <= {VECTORS}):
        raise EdgeMTPError(f"{out} exists and holds more than {VECTORS}; choose a new --out")


def write_vectors(vectors: Mapping[str, Any], out: Path) -> Path:
    """Write `out/vectors.json` through a temporary sibling folder renamed into place. An
    existing `out` is replaced only when it holds nothing but an earlier vectors.json."""
    out = Path(out)
    check_out(out)
    with staged_folder(out) as tmp:
        (tmp / VECTORS).write_text(vectors_text(vectors))
    return out / VECTORS


def read_vectors(path: Path) -> dict[str, Any]:
    """vectors.json (or the folder holding it), checked to be this format."""
    path = Path(path)
    path = path / VECTORS if path.is_dir() else path
    try:
        vectors = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise EdgeMTPError(f"{path}: cannot read conformance vectors ({err})") from None
    fmt = vectors.get("format") if isinstance(vectors, dict) else None
    if not isinstance(fmt, dict) or fmt.get("name") != FORMAT_NAME:
        raise EdgeMTPError(f"{path}: not {FORMAT_NAME} vectors")
    if fmt.get("version") != FORMAT_VERSION:
        raise EdgeMTPError(
            f"{path}: format version {fmt.get('version')}, this edgemtp reads "
            f"{FORMAT_VERSION}; regenerate them with edgemtp conformance"
        )
    return vectors


# --- replaying ---------------------------------------------------------------------------------


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


def _positions(call: Mapping[str, Any]) -> list[int]:
    end = call["start"] + call["rows"]
    return [end] * call["pad"] + list(range(call["start"], end))


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
        out.append(_Expected(c["method"], _positions(c), rows, outputs, f"prefill call {i}"))
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
        out.append(_Expected(v["method"], _positions(v), fed, outputs, f"round {r_index} verify"))
    return out


class ReplayRunner:
    """A `Runner` that answers one case's program calls with its recorded outputs, after
    checking that each call is the recorded one. Inputs come from `TokenIdTables`, so the
    embeddings it receives are the token ids themselves."""

    def __init__(self, vectors: Mapping[str, Any], case: Mapping[str, Any]):
        self.shapes = StaticShapes(**vectors["manifest"]["shapes"])
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
        positions = [int(p) for p in inputs[2].reshape(-1).tolist()]
        pad = sum(1 for p in positions if p > positions[-1])
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
    spec = CaseSpec(
        case["name"],
        case["purpose"],
        case["depth"],
        case["max_new_tokens"],
        tuple(case["stop_ids"]),
        case["prompt"],
    )
    got = json.loads(json.dumps(run_case(session, recorder, spec)))
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
        shapes = StaticShapes(**table["shapes"])
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


# --- what an app-side core must read from a manifest ---------------------------------------------


def python_methods(shapes: StaticShapes, has_drafter: bool) -> list[str]:
    """The methods every export for `shapes` holds and a decode engine requires."""
    names = []
    for bucket in (None, *shapes.context_buckets):
        names += [bucketed(m, bucket) for m in ("prefill_intermediate", "prefill_final")]
        names += [bucketed(f"verify_{k}", bucket) for k in shapes.verify_depths()]
        names += [bucketed("draft_step", bucket)] if has_drafter else []
    return sorted(names)


def python_round(shapes: StaticShapes, has_drafter: bool, depth: int, end: int) -> dict[str, Any]:
    """What the Python side does for a round of `depth` drafts ending at `end` (and for a
    prompt ending there: its last prefill chunk's method), in the form manifest_test prints;
    "error" when it cannot run such a round."""
    if not depth + 1 <= end <= shapes.max_context:  # StaticBackend: "context full"
        return {"depth": depth, "end": end, "error": True}
    prefill = shapes.prefill_method(True, end)
    try:
        method, pad = shapes.verify_method(depth, end)
    except ValueError:  # deeper than every verify method
        return {"depth": depth, "end": end, "prefill": prefill, "error": True}
    draft = shapes.draft_method(end - depth - 1) if depth and has_drafter else None
    return {"depth": depth, "end": end, "prefill": prefill, "verify": method, "pad": pad,
            "draft": draft}  # fmt: skip


def boundary_rounds(shapes: StaticShapes, has_drafter: bool) -> list[str]:
    """The rounds manifest_test reports by default, as "DEPTH:END": every depth the decoder can
    choose, at each end where the method choice may change (the first end, each context bucket
    and the end past it, the context end)."""
    rounds = []
    for depth in range(shapes.max_draft + 1 if has_drafter else 1):
        ends = {depth + 1, shapes.max_context}
        ends |= {e for b in shapes.context_buckets for e in (b, b + 1)}
        rounds += [f"{depth}:{e}" for e in sorted(ends) if depth + 1 <= e <= shapes.max_context]
    return rounds


def manifest_mismatches(
    core: dict[str, Any], manifest: Mapping[str, Any], queries: list[str] | None = None
) -> list[str]:
    """Every field where an app-side core's understanding of a manifest (`apps/core`'s
    `manifest_test` output) differs from `manifest` or from what the
    Python side derives from it (the rounds: `queries`, else the boundary rounds); empty when
    they agree."""
    shapes = StaticShapes(**manifest["shapes"])
    model, drafter = manifest["model"], manifest["drafter"]
    ring = min(shapes.max_context, ring_size(model["sliding_window"], shapes.max_draft))
    kinds = manifest["cache"]["kinds"]
    expected = {
        "schema_version": manifest["schema_version"],
        "backend": manifest["backend"],
        "delegate": manifest["delegate"],
        "program": manifest["program"],
        "max_context": shapes.max_context,
        "max_draft": shapes.max_draft,
        "chunk": shapes.chunk,
        "context_buckets": list(shapes.context_buckets),
        "vocab_size": model["vocab_size"],
        "sliding_window": model["sliding_window"],
        "eos_token_ids": model["eos_token_ids"],
        "cache_kinds": {
            name: {"slots": k["slots"], "trash_slot": k["trash_slot"]} for name, k in kinds.items()
        },
        "has_drafter": drafter is not None,
        "methods": sorted(manifest["methods"]),
        "required_methods": python_methods(shapes, drafter is not None),
    }
    problems = [
        f"{key}: core {core.get(key)!r}, manifest/Python {value!r}"
        for key, value in expected.items()
        if core.get(key) != value
    ]
    # The ring sizes the Python runtime's StaticBackend assumes (RingTracker).
    runtime_slots = {name: shapes.max_context if name == "full" else ring for name in kinds}
    core_slots = {name: k["slots"] for name, k in core.get("cache_kinds", {}).items()}
    if core_slots != runtime_slots:
        problems.append(f"cache slots: core {core_slots}, runtime {runtime_slots}")
    rounds = core.get("rounds", [])
    asked = [f"{r['depth']}:{r['end']}" for r in rounds]
    wanted = queries if queries is not None else boundary_rounds(shapes, drafter is not None)
    if asked != wanted:
        problems.append(f"rounds: core {asked}, Python {wanted}")
    for row in rounds:
        want = python_round(shapes, drafter is not None, row["depth"], row["end"])
        got = {**row, "error": True} if "error" in row else row
        if got != want:
            problems.append(f"round {row['depth']}:{row['end']}: core {row}, Python {want}")
    return problems
