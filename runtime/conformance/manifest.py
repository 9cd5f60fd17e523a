"""What an app-side decode core must read from a manifest, as the Python runtime reads it: the
fields, the methods it requires and calls, and the methods and padding of each round.
`manifest_mismatches` lists every place where a core's reading (`apps/core`'s `manifest_test`
output) differs, so the apps fail on a manifest they would misread instead of decoding wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from edgemtp.model.cache import ring_size
from edgemtp.model.static import StaticShapes, bucketed
from edgemtp.runtime.conformance.scenarios import shapes_dict


def python_methods(shapes: StaticShapes, has_drafter: bool) -> list[str]:
    """The methods every export for `shapes` holds and a decode engine requires."""
    names = []
    for bucket in (None, *shapes.context_buckets):
        names += [bucketed(m, bucket) for m in ("prefill_intermediate", "prefill_final")]
        names += [bucketed(f"verify_{k}", bucket) for k in shapes.verify_depths]
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
    shapes = StaticShapes.from_manifest(manifest["shapes"])
    model, drafter = manifest["model"], manifest["drafter"]
    ring = min(shapes.max_context, ring_size(model["sliding_window"], shapes.max_draft))
    kinds = manifest["cache"]["kinds"]
    expected = {
        "schema_version": manifest["schema_version"],
        "backend": manifest["backend"],
        "delegate": manifest["delegate"],
        "program": manifest["program"],
        **shapes_dict(shapes),
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
