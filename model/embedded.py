"""The embedded default pair shipped in the package (`checkpoints/`): a small Gemma 4 target
trained here and its distilled MTP assistant (see `checkpoints/README.md`)."""

from __future__ import annotations

from pathlib import Path

CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"
TARGET = CHECKPOINTS / "embedded-target"
ASSISTANT = CHECKPOINTS / "embedded-assistant"
PROMPTS = TARGET / "demo_prompts.json"  # held-out prompts the demo and benchmarks decode
