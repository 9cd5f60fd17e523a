"""The conformance vectors file, `vectors.json`: the format's description (`FIELDS`, carried
inside every file so an app-side reader needs nothing else), writing it with one round a line so
a diff of two files names the rounds that changed, and reading it back checked to be this format
and version.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from edgemtp.errors import EdgeMTPError
from edgemtp.files import staged_folder

FORMAT_NAME = "edgemtp-conformance"
FORMAT_VERSION = 1
VECTORS = "vectors.json"

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
