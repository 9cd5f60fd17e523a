"""Helpers the subcommands share: argument checks, thread counts, progress lines."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from edgemtp.errors import EdgeMTPError


def say(message: str) -> None:
    """A progress line: on stderr, so that stdout keeps only the result."""
    print(f"-- {message}", file=sys.stderr, flush=True)


def check_positive(name: str, value: int | None, minimum: int = 1) -> None:
    if value is not None and value < minimum:
        raise EdgeMTPError(f"{name} must be >= {minimum}, got {value}")


def draft_depths(text: str) -> tuple[int, ...]:
    try:
        values = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}': give draft depths like 0,1,2,3") from None
    if not values or values[0] < 0:
        raise argparse.ArgumentTypeError(f"'{text}': draft depths are >= 0 (0 = AR)")
    return values


def default_threads(cfg) -> int:
    """One thread when a decode step is too small to split (under ~50 MFLOP of matmuls)."""
    import torch

    from edgemtp.model.cost import layer_flops

    step = sum(layer_flops(cfg, spec, range(0, 1)) for spec in cfg.layers)
    step += 2 * cfg.hidden_size * cfg.vocab_size
    return 1 if step < 5e7 else torch.get_num_threads()


def bundle_threads(bundle: Path) -> int:
    from edgemtp.model.checkpoint import target_config

    try:
        raw = json.loads((bundle / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return 1  # the session names the problem
    return default_threads(target_config(raw, str(bundle)))
