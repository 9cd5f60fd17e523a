"""What a backend's lowering hands back to the bundle writer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Progress = Callable[[str], None]  # one line of progress, as a long export goes


@dataclass
class Lowered:
    """What a backend wrote into the bundle's temporary folder and what the manifest says of it."""

    files: list[str]  # every file written, relative to the folder (a .mlpackage: each file in it)
    program: str  # the file or folder the runtime opens (e.g. "model.pte")
    numerics: dict[str, str]  # weights / activations / accumulation / notes, as really computed
    details: dict[str, Any] = field(default_factory=dict)  # delegation summary, op counts, ...
    method_io: dict[str, Any] = field(default_factory=dict)  # backend-level I/O beyond the logical
