"""What conformance vectors cover: the prompts each bundle is decoded from (one prefill chunk,
several, past the sliding ring, up to the context end), the draft depths, the case whose stop
token lands mid-round, and the model-free method choices around every context bucket.

Prompt ids are seeded, so that recording one bundle again writes the same file byte for byte.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from edgemtp.model.static import StaticShapes, auto_context_buckets

PROMPT_SEED = 20260101  # prompt i's ids come from random.Random(PROMPT_SEED + i)
# A bucketed shape set no ONNX or Core ML bundle has (context buckets are ExecuTorch cpu only),
# so that every engine's verify/draft method choice is checked against `StaticShapes` anyway.
BUCKETED_CONTEXT = 8192


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


@dataclass(frozen=True)
class CaseSpec:
    name: str
    purpose: str
    depth: int
    max_new_tokens: int
    stop_ids: tuple[int, ...]
    prompt: list[int] = field(repr=False)


def case_specs(
    shapes: StaticShapes,
    ring_slots: int,
    prompts: int,
    tokens: int,
    depths: tuple[int, ...],
    vocab: int,
) -> list[CaseSpec]:
    """One greedy generation per planned prompt and draft depth, prompt by prompt."""
    specs = []
    for index, plan in enumerate(plan_prompts(shapes, ring_slots, prompts, tokens)):
        ids = prompt_ids(index, plan.length, vocab)
        specs += [
            CaseSpec(f"{plan.name}-depth{depth}", plan.purpose, depth, plan.max_new_tokens, (), ids)
            for depth in depths
        ]
    return specs


def spec_of(case: Mapping[str, Any]) -> CaseSpec:
    """The spec a recorded case was generated from."""
    return CaseSpec(
        case["name"],
        case["purpose"],
        case["depth"],
        case["max_new_tokens"],
        tuple(case["stop_ids"]),
        case["prompt"],
    )


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


def stop_spec(cases: list[dict[str, Any]]) -> CaseSpec:
    """The deepest case with a committed token that stops it mid-round, to run again with that
    stop token; without one (no drafter, nothing accepted), a stop on a plain AR step."""
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
    return replace(spec_of(case), name=f"{case['name']}-stop", purpose=purpose, stop_ids=(token,))


def method_choice(shapes: StaticShapes) -> dict[str, Any]:
    """`StaticShapes`' verify, draft and prefill method for depths and positions around every
    bucket boundary and at both ends of the context."""
    edges = {1, 2, shapes.max_context - 1, shapes.max_context}
    for b in shapes.context_buckets:
        edges |= {b - 1, b, b + 1}
    ends = sorted(e for e in edges if 1 <= e <= shapes.max_context)
    return {
        "shapes": shapes_dict(shapes),
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


def shapes_dict(shapes: StaticShapes) -> dict[str, Any]:
    """A shape set as JSON holds it (the vectors, manifest_test's output)."""
    return {
        "max_context": shapes.max_context,
        "max_draft": shapes.max_draft,
        "chunk": shapes.chunk,
        "context_buckets": list(shapes.context_buckets),
    }


def method_choices(shapes: StaticShapes) -> list[dict[str, Any]]:
    """The method choice of the bundle's shapes and of a bucketed shape set with its chunk."""
    bucketed = StaticShapes(
        BUCKETED_CONTEXT,
        max(shapes.max_draft, 1),
        shapes.chunk,
        auto_context_buckets(BUCKETED_CONTEXT),
    )
    return [method_choice(shapes), method_choice(bucketed)]
