"""Open any checkpoint edgemtp reads and load its target or assistant: Hugging Face folders
(text-only or multimodal, float; `model/checkpoint.py`), edgemtp's quantized folders and
compressed-tensors W4A16 checkpoints (`quantize/checkpoint.py`), GGUF files
(`quantize/gguf_import.py`)."""

from __future__ import annotations

from pathlib import Path

import torch

from edgemtp.model.checkpoint import (
    Drafter,
    Target,
    TensorSource,
    drafter_from_source,
    target_from_source,
)
from edgemtp.model.config import TextConfig, read_config_json
from edgemtp.quantize.checkpoint import QuantizedSource, stores_quantized
from edgemtp.quantize.gguf_import import GGUFSource


def open_checkpoint(path: Path) -> TensorSource:
    """A Hugging Face folder (float, compressed-tensors or edgemtp-quantized) or a GGUF file."""
    path = Path(path)
    if path.suffix == ".gguf":
        return GGUFSource(path)
    config = read_config_json(path)
    if stores_quantized(config):
        return QuantizedSource(path, config)
    return TensorSource(path, config)


def load_target(path: Path, dtype: torch.dtype = torch.float32, float_4bit: bool = True) -> Target:
    """`float_4bit=False`: the linears stored in 4 bits hold no float weights (an export whose
    backend form computes from the 4-bit codes needs none)."""
    return target_from_source(open_checkpoint(path), dtype, float_4bit)


def load_drafter(path: Path, target: TextConfig, dtype: torch.dtype = torch.float32) -> Drafter:
    return drafter_from_source(open_checkpoint(path), target, dtype)
