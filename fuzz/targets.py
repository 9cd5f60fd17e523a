"""Fuzz targets: each parses fuzzer bytes as one kind of outside input, the way edgemtp reads it.

The contract every target checks: the parser returns, or raises `EdgeMTPError` (the one clear
line the CLI prints). Any other exception, a crash, a hang or an allocation past the fuzzer's
memory limit is a finding. Files are written to a private folder under /dev/shm (or the temp
dir) because the readers take paths and memory-map them, as they do with real checkpoints.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from edgemtp.errors import EdgeMTPError
from edgemtp.model.config import parse_assistant_config, parse_text_config, read_config_json
from edgemtp.model.safetensors_file import SafetensorsFile
from edgemtp.quantize.gguf_import import GGUFSource

_SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None
_ROOT = Path(tempfile.mkdtemp(prefix="edgemtp-fuzz-", dir=_SHM))


def _file(name: str, data: bytes) -> Path:
    path = _ROOT / name
    path.write_bytes(data)
    return path


def safetensors(data: bytes) -> None:
    """A safetensors file: header, every entry, and one element of every tensor touched."""
    f = SafetensorsFile(_file("model.safetensors", data))
    for name in f.keys():
        t = f.tensor(name)
        if t.numel():
            t.reshape(-1)[-1].item()


def gguf(data: bytes) -> None:
    """A GGUF file as `--model x.gguf` opens it: header, key-values, tensor infos, the config
    built from them, the shape checks, then every tensor read."""
    source = GGUFSource(_file("model.gguf", data))
    for name in source.names():
        source.tensor(name)


def config(data: bytes) -> None:
    """A config.json, read as a target's and as an assistant's."""
    folder = _ROOT / "config"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_bytes(data)
    raw = read_config_json(folder)
    for parse in (parse_text_config, parse_assistant_config):
        try:
            parse(raw)
        except EdgeMTPError:
            pass


TARGETS: dict[str, Callable[[bytes], None]] = {
    "safetensors": safetensors,
    "gguf": gguf,
    "config": config,
}


def check(target: str, data: bytes) -> None:
    """Run one input through a target; only `EdgeMTPError` may escape as an expected failure."""
    try:
        TARGETS[target](data)
    except EdgeMTPError:
        pass
